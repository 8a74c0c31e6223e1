"""Every config field the library reads is type-checked: a sweep over the fields each parser actually reads
(recorded while it parses a valid config, so a field added to a parser is swept too), each set to values
of the wrong type, must raise CheckpointError naming the file and the key. Pure Python: no tensors."""

import copy
import dataclasses
import json

import pytest
import transformers

from eagle3_jax import CheckpointError
from eagle3_jax.checkpoints import generation
from eagle3_jax.checkpoints.drafter import drafter_config
from eagle3_jax.models.config import Qwen3Config

import drafter_oracle as oracle
from test_drafter_golden import BASE, HT, LAYERS, VT

WHERE = "/ckpt/config.json"


class Recorder(dict):
    """A config dict that records the path of every key read from it (nested objects included)."""

    def __init__(self, data, log, path=()):
        super().__init__(data)
        self.log, self.path = log, path

    def _seen(self, key):
        self.log.add(self.path + (key,))

    def _wrap(self, key, value):
        return Recorder(value, self.log, self.path + (key,)) if isinstance(value, dict) else value

    def __contains__(self, key):
        self._seen(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self._seen(key)
        return self._wrap(key, super().__getitem__(key))

    def get(self, key, default=None):
        self._seen(key)
        return self._wrap(key, super().get(key, default))


def fields_read(parse, raw) -> set[tuple[str, ...]]:
    log = set()
    parse(Recorder(raw, log))
    return log


def lookup(raw, path):
    for key in path:
        raw = raw.get(key) if isinstance(raw, dict) else None
    return raw


def wrong_values(value):
    """Values of another type than `value` (any type at all when the field is absent or null)."""
    if isinstance(value, bool):
        return [1, "true"]
    if isinstance(value, int):
        return [4.5, 4.0, True, "4"]
    if isinstance(value, float):
        return ["abc", True, float("nan")]
    if isinstance(value, str):
        return [3, ["x"]]
    if isinstance(value, list):
        return ["x", [1.5]]
    if isinstance(value, dict):
        return ["x", [1]]
    return [[{}]]  # wrong for every type a field can have


def with_value(raw, path, value):
    out = copy.deepcopy(raw)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def target_configs():
    """config.json as transformers writes them: dense, YaRN, MoE, and the transformers 4 rope_scaling spelling."""
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    dense = transformers.Qwen3Config(**small).to_dict()
    yarn = transformers.Qwen3Config(**small, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64,
        "attention_factor": 1.1, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}).to_dict()
    moe = transformers.Qwen3MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      mlp_only_layers=[0], decoder_sparse_step=1).to_dict()
    legacy = {**{k: v for k, v in dense.items() if k != "rope_parameters"}, "rope_theta": 1e6,
              "rope_scaling": {"type": "yarn", "factor": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5}}
    return {"dense": dense, "yarn": yarn, "moe": moe, "legacy_yarn": legacy}


TARGET_CONFIG = Qwen3Config.from_dict(dict(model_type="qwen3", vocab_size=VT, hidden_size=HT, intermediate_size=64,
                                           num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=12))
_QWEN3_LAYER = dataclasses.replace(BASE, qk_norm=True, norm_before_fc=True, norm_output=True)
DRAFTER_CONFIGS = {
    "specforge": (oracle.specforge_config_dict(dataclasses.replace(BASE, fc_norm=True, norm_before_residual=True))
                  | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}, "midlayer."),
    "speculators": (oracle.speculators_config_dict(_QWEN3_LAYER, target_layer_ids=[2, 4, 6]), "layers.0."),
}


def parse_drafter(raw, prefix):
    shapes = {prefix + "self_attn.q_proj.weight": (BASE.num_heads * BASE.head_dim, 2 * BASE.hidden_size)}
    return drafter_config(raw, WHERE, shapes, TARGET_CONFIG)


def sweep(parse, raw):
    """(path, value) for every field `parse` reads and every wrong value for it."""
    assert parse(raw) is not None  # the base config is valid
    paths = sorted(fields_read(parse, raw))
    assert len(paths) > 10
    return [(path, bad) for path in paths for bad in wrong_values(lookup(raw, path))]


def assert_refused(parse, raw, path, bad):
    with pytest.raises(CheckpointError) as err:
        parse(with_value(raw, path, bad))
    message = str(err.value)
    assert message.startswith(WHERE) and ".".join(path) in message, message


@pytest.mark.parametrize("name", sorted(target_configs()))
def test_every_target_config_field_is_type_checked(name):
    raw = target_configs()[name]

    def parse(r):
        return Qwen3Config.from_dict(r, where=WHERE)

    for path, bad in sweep(parse, raw):
        assert_refused(parse, raw, path, bad)


@pytest.mark.parametrize("name", sorted(DRAFTER_CONFIGS))
def test_every_drafter_config_field_is_type_checked(name):
    raw, prefix = DRAFTER_CONFIGS[name]

    def parse(r):
        return parse_drafter(r, prefix)

    for path, bad in sweep(parse, raw):
        assert_refused(parse, raw, path, bad)


def test_the_listed_bad_values():
    """The cases as a user meets them: a string theta, a fractional or boolean layer count."""
    raw = {k: v for k, v in target_configs()["dense"].items() if k != "rope_parameters"}  # top-level rope_theta
    for key, bad, message in [("rope_theta", "abc", "rope_theta must be a finite number, got 'abc'"),
                              ("num_hidden_layers", 4.5, "num_hidden_layers must be an integer >= 1, got 4.5"),
                              ("num_hidden_layers", True, "num_hidden_layers must be an integer >= 1, got True"),
                              ("num_attention_heads", 0, "num_attention_heads must be an integer >= 1, got 0"),
                              ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false")]:
        with pytest.raises(CheckpointError, match=f"^{WHERE}: {message}"):
            Qwen3Config.from_dict({**raw, key: bad}, where=WHERE)


QWEN3_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


@pytest.mark.parametrize("raw", [QWEN3_GENERATION, {"do_sample": True}, {"do_sample": True, "top_k": 0},
                                 {"do_sample": False, "temperature": 0.7}, {}, {"temperature": None}])
def test_generation_sampling_is_what_transformers_reads(tmp_path, raw):
    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    config = transformers.GenerationConfig.from_pretrained(tmp_path)
    expected = generation.GREEDY
    if config.do_sample:
        expected = {k: generation.HF_DEFAULTS[k] if getattr(config, k) is None else getattr(config, k)
                    for k in generation.GREEDY}
    assert generation.generation_sampling(tmp_path) == expected
    assert generation.generation_sampling(tmp_path / "absent") is None


def test_malformed_generation_config_names_the_file(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text('{"do_sample": tru')
    with pytest.raises(CheckpointError, match=f"^{path}: not valid JSON"):
        generation.generation_sampling(tmp_path)


def test_every_generation_config_field_is_type_checked(tmp_path, monkeypatch):
    path = tmp_path / "generation_config.json"
    log = set()
    read_json = generation.read_json
    monkeypatch.setattr(generation, "read_json", lambda p: Recorder(read_json(p), log))
    path.write_text(json.dumps(QWEN3_GENERATION))
    generation.generation_sampling(tmp_path)
    assert {("do_sample",), ("temperature",), ("top_k",), ("top_p",)} <= log
    for (key,) in sorted(log):
        for bad in wrong_values(QWEN3_GENERATION.get(key)):
            path.write_text(json.dumps({**QWEN3_GENERATION, key: bad}))
            with pytest.raises(CheckpointError, match=f"^{path}: {key} must be"):
                generation.generation_sampling(tmp_path)
