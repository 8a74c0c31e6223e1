"""Outside oracle for the JAX EAGLE-3 drafter (test support only).

Two jobs:

1. Write random drafter checkpoints in the file layouts seen in the wild
   (SpecForge / SGLang flat ``model.safetensors``, AngelSlim ``pytorch_model.bin``,
   vllm-project "speculators" nested config + ``layers.0.*`` keys).
2. Compute reference outputs in float32 on CPU with the *reference projects' own
   PyTorch modules*, imported as packages at test time (nothing is re-implemented
   here; this file only wires their modules together and feeds them inputs):

   ``"specforge"``         ``specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3``
                           with ``attention_backend="sdpa"`` (plain torch SDPA, no flash_attn).
   ``"specforge_peagle"``  ``specforge.modeling.draft.peagle.PEagleDraftModel`` with ONE layer:
                           its first layer is an EAGLE-3 layer that honours
                           ``norm_before_residual``; attention is ``flex_attention`` run eagerly.
   ``"speculators"``       ``speculators.models.eagle3.Eagle3DraftModel`` (vllm-project/speculators
                           0.9.0): its fc / fc_norm / input_norm / first layer (Llama or Qwen3
                           decoder layer with 2H q/k/v) / norm / lm_head, HF "eager" attention.

   Flags each oracle covers (anything else is refused with ValueError, never ignored):

   =====================  =========  ================  ===========
   DraftSpec flag          specforge  specforge_peagle  speculators
   =====================  =========  ================  ===========
   (plain EAGLE-3)         yes        yes               yes
   target_hidden_size!=H   yes        yes               no (its fc is 3*H wide)
   fc_norm                 yes (Ht)   no                yes (needs Ht == H)
   norm_before_residual    no         yes               yes
   qk_norm (Qwen3 layer)   no         no                yes
   norm_before_fc          no         no                yes
   norm_output             no         no                yes (speculators meaning)
   arbitrary positions     yes (*)    yes               yes
   =====================  =========  ================  ===========

   (*) SpecForge's sdpa attention slices its RoPE table to ``q_len`` (SpecForge only ever
   uses positions ``0..T-1``), so :func:`reference_forward` lengthens the table for the
   call (``_rope_table_covers``); the cos/sin values are still SpecForge's own.

   ``norm_output`` has OPPOSITE meanings in the two projects. speculators (default False):
   True = the hidden carried to the next draft step is ``norm(h)`` instead of ``h``; logits
   are ``lm_head(norm(h))`` either way. SpecForge (default True): False = logits are
   ``lm_head(h)`` with no final norm; the carried hidden is always pre-norm ``h``.
   ``DraftSpec.norm_output`` uses the speculators meaning; SpecForge's ``norm_output=False``
   is not modelled (the flat writers never write ``norm_output``).

Everything runs under ``torch.compiler.set_stance("force_eager")``: SpecForge decorates
``apply_rotary_pos_emb``, ``LlamaRotaryEmbedding.forward`` and ``LlamaRMSNorm.forward``
with ``torch.compile``; eager runs the same Python code without an inductor build.

Requirements: torch (CPU), transformers 5.x, safetensors, ``pip install --no-deps
specforge==0.2.0`` and ``pip install --no-deps speculators==0.9.0`` (both required; its package
``__init__`` imports ``openai``, ``datasets`` and ``hs_connectors`` for training-data code
only; :func:`import_speculators` puts empty stand-ins in ``sys.modules`` for those three
while importing when they are absent, and removes them afterwards).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import os
import sys
import types
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "DraftSpec",
    "ChainResult",
    "ORACLES",
    "random_drafter_state",
    "random_target_embed",
    "random_features",
    "specforge_config_dict",
    "speculators_config_dict",
    "write_specforge",
    "write_angelslim",
    "write_speculators",
    "to_speculators_keys",
    "oracle_supports",
    "reference_forward",
    "reference_chain",
    "unsupported_reason",
]

ORACLES = ("specforge", "specforge_peagle", "speculators")


# --------------------------------------------------------------------------------------
# Spec and random state
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftSpec:
    """Shape and flags of a tiny EAGLE-3 drafter (one decoder layer)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    norm_before_residual: bool = False
    # Extra flags (speculators / SpecForge "eagle3.1"); all off = the standard drafter.
    fc_norm: bool = False  # RMSNorm on each of the 3 feature chunks before fc (fc_norm.{0,1,2})
    norm_before_fc: bool = False  # one RMSNorm over the whole 3H concat (input_norm.weight)
    qk_norm: bool = False  # Qwen3-style layer: q_norm / k_norm per head before RoPE
    norm_output: bool = False  # speculators meaning: carry norm(h) to the next step

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError("draft_vocab_size must be <= target_vocab_size")
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc are mutually exclusive (speculators)")
        if 3 * self.target_hidden_size == self.hidden_size:
            raise ValueError("3*target_hidden_size == hidden_size makes hidden_in ambiguous")


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


def random_drafter_state(spec: DraftSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 drafter weights under SpecForge's key names (plus d2t / t2d).

    Scale: linears are N(0, 1/fan_in) (not the 0.02 of HF init: at these tiny widths 0.02
    gives near-uniform attention and near-tied logits), lm_head N(0, (2.5/sqrt(H))^2) so
    logits have std ~2.5 and clear argmax margins; norm weights 1 + 0.1*N(0,1).
    d2t / t2d: a random sorted subset ``used`` of target ids, ``d2t[i] = used[i] - i``
    (SpecForge ``process_token_dict_to_mappings``), ``t2d[j] = j in used``.
    """
    g = _gen(seed)
    H, I, Ht = spec.hidden_size, spec.intermediate_size, spec.target_hidden_size
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim

    def lin(out_f, in_f, gain=1.0):
        return torch.randn(out_f, in_f, generator=g) * (gain / math.sqrt(in_f))

    def nrm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    s: dict[str, torch.Tensor] = {}
    s["fc.weight"] = lin(H, 3 * Ht)
    if spec.fc_norm:
        for i in range(3):
            s[f"fc_norm.{i}.weight"] = nrm(Ht)
    if spec.norm_before_fc:
        s["input_norm.weight"] = nrm(3 * Ht)
    p = "midlayer."
    s[p + "hidden_norm.weight"] = nrm(H)
    s[p + "input_layernorm.weight"] = nrm(H)
    s[p + "post_attention_layernorm.weight"] = nrm(H)
    s[p + "self_attn.q_proj.weight"] = lin(nh * hd, 2 * H, gain=1.5)
    s[p + "self_attn.k_proj.weight"] = lin(nkv * hd, 2 * H, gain=1.5)
    s[p + "self_attn.v_proj.weight"] = lin(nkv * hd, 2 * H)
    s[p + "self_attn.o_proj.weight"] = lin(H, nh * hd)
    if spec.qk_norm:
        s[p + "self_attn.q_norm.weight"] = nrm(hd)
        s[p + "self_attn.k_norm.weight"] = nrm(hd)
    s[p + "mlp.gate_proj.weight"] = lin(I, H)
    s[p + "mlp.up_proj.weight"] = lin(I, H)
    s[p + "mlp.down_proj.weight"] = lin(H, I)
    s["norm.weight"] = nrm(H)
    s["lm_head.weight"] = torch.randn(spec.draft_vocab_size, H, generator=g) * (2.5 / math.sqrt(H))

    Vt, Vd = spec.target_vocab_size, spec.draft_vocab_size
    if Vd == Vt:
        used = torch.arange(Vt)
    else:
        while True:
            used = torch.sort(torch.randperm(Vt, generator=g)[:Vd]).values
            if not torch.equal(used, torch.arange(Vd)):  # keep the mapping non-trivial
                break
    s["d2t"] = (used - torch.arange(Vd)).to(torch.int64)
    t2d = torch.zeros(Vt, dtype=torch.bool)
    t2d[used] = True
    s["t2d"] = t2d
    return s


def random_target_embed(spec: DraftSpec, seed: int) -> torch.Tensor:
    """A random embedding table [Vt, H] standing in for the target's ``embed_tokens``.

    The drafter consumes embeddings of width H (``input_layernorm`` is H wide), so when
    ``target_hidden_size != hidden_size`` this must be the table the drafter ships itself.
    """
    return torch.randn(spec.target_vocab_size, spec.hidden_size, generator=_gen(seed))


def random_features(spec: DraftSpec, batch: int, length: int, seed: int) -> torch.Tensor:
    """Random target features [B, P, 3*Ht] (low, mid, high concatenated)."""
    return torch.randn(batch, length, 3 * spec.target_hidden_size, generator=_gen(seed))


# --------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------


def _save_state(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        v = v.detach().cpu()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.contiguous()
    return out


def _dtype_name(state, dtype) -> str:
    if dtype is None:
        dtype = state["fc.weight"].dtype
    return str(dtype).replace("torch.", "")


def specforge_config_dict(spec: DraftSpec, *, architecture: str = "LlamaForCausalLMEagle3",
                          dtype: str = "float32") -> dict:
    """Flat config as in SpecForge ``configs/*-eagle3.json`` (e.g. qwen3-32b-eagle3.json,
    qwen3-30B-A3B-eagle3.1.json) and the SGLang / AngelSlim exports.

    ``vocab_size`` is the TARGET vocabulary; ``draft_vocab_size`` the lm_head rows.
    ``target_hidden_size`` is written only when it differs from ``hidden_size`` (SpecForge
    reads it with ``getattr(config, "target_hidden_size", config.hidden_size)``); ``fc_norm``
    only when set (SpecForge ``LlamaForCausalLMEagle3.__init__``). ``norm_before_residual``
    is written only when set: vLLM's flat ``llama_eagle3`` reads it with a False default,
    SpecForge's own LlamaForCausalLMEagle3 ignores it.
    """
    if spec.qk_norm or spec.norm_before_fc or spec.norm_output:
        raise ValueError("the flat SpecForge/AngelSlim format has no qk_norm / norm_before_fc / "
                         "norm_output(speculators meaning); use write_speculators")
    c = {
        "architectures": [architecture],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": spec.num_kv_heads,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": spec.target_vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
    }
    if spec.target_hidden_size != spec.hidden_size:
        c["target_hidden_size"] = spec.target_hidden_size
    if spec.fc_norm:
        c["fc_norm"] = True
    if spec.norm_before_residual:
        c["norm_before_residual"] = True
    return c


def _flat_state(state, embed):
    s = dict(state)
    if embed is not None:
        s["embed_tokens.weight"] = embed
    return s


def write_specforge(path, spec: DraftSpec, state: dict[str, torch.Tensor], *,
                    embed: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> str:
    """SpecForge / SGLang layout: ``config.json`` + ``model.safetensors``.

    Keys are SpecForge's module names (``fc.weight``, ``midlayer.*``, ``norm.weight``,
    ``lm_head.weight``, buffers ``d2t`` I64 / ``t2d`` BOOL): SpecForge's ``export/to_sglang.py``
    maps them identically (``WEIGHT_MAPS = {"LlamaForCausalLMEagle3": {}}``) and drops every
    key containing "embed", so by default no ``embed_tokens.weight`` is written.
    """
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = specforge_config_dict(spec, dtype=_dtype_name(state, dtype))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(_save_state(_flat_state(state, embed), dtype), os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return str(path)


def write_angelslim(path, spec: DraftSpec, state: dict[str, torch.Tensor], *,
                    embed: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> str:
    """AngelSlim layout: same flat keys and config fields, ``architectures:
    ["Eagle3LlamaForCausalLM"]``, weights in ``pytorch_model.bin`` (``torch.save`` of the
    state dict)."""
    os.makedirs(path, exist_ok=True)
    cfg = specforge_config_dict(spec, architecture="Eagle3LlamaForCausalLM",
                                dtype=_dtype_name(state, dtype))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    torch.save(_save_state(_flat_state(state, embed), dtype), os.path.join(path, "pytorch_model.bin"))
    return str(path)


def to_speculators_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``midlayer.*`` -> ``layers.0.*`` (speculators ``Eagle3Converter._save_converted_checkpoint``);
    every other key (fc, fc_norm.i, input_norm, norm, lm_head, d2t, t2d) keeps its name, as in
    ``Eagle3DraftModel`` (``speculators/models/eagle3/core.py``)."""
    return {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
            for k, v in state.items()}


def speculators_config_dict(spec: DraftSpec, *, target_layer_ids=None, dtype: str = "float32",
                            verifier_name_or_path: str | None = None,
                            verifier_architectures=("Qwen3ForCausalLM",)) -> dict:
    """speculators ``Eagle3SpeculatorConfig`` as written by ``save_pretrained``.

    Sources (vllm-project/speculators, src/speculators/...):
      - ``speculators_model_type``, ``architectures``, ``draft_vocab_size``, ``norm_before_residual``,
        ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``, ``norm_before_fc``,
        ``fc_norm``, ``norm_output``, ``embed_requires_grad``: fields of
        ``models/eagle3/config.py::Eagle3SpeculatorConfig``;
      - ``speculators_version``, ``speculators_config`` {algorithm, proposal_methods,
        default_proposal_method, verifier{name_or_path, architectures}}: ``config.py``
        (``SpeculatorModelConfig``, ``SpeculatorsConfig``, ``VerifierConfig``) and
        ``proposals/greedy.py``; values as produced by ``convert/eagle/eagle3_converter.py``;
      - ``transformer_layer_config``: a nested HF config (``model_type`` picks the layer:
        "llama" -> LlamaDecoderLayer, "qwen3" -> Qwen3DecoderLayer with q/k norm;
        ``models/eagle3/model_definitions.py``); ``vocab_size`` there is the TARGET vocabulary
        (``Eagle3SpeculatorConfig.target_vocab_size``). Field list as in the converter's
        ``_create_transformer_config_from_eagle`` and published configs
        (nm-testing/EAGLE3-LLaMA3.1-Instruct-8B-converted, RedHatAI/*-speculator.eagle3).
    ``norm_before_residual`` is ALWAYS written explicitly: speculators defaults it to False but
    vLLM's ``transformers_utils/configs/speculators/algos.py::update_eagle3`` defaults a
    missing key to True. ``eagle_aux_hidden_state_layer_ids`` (None -> null, as in the
    RedHatAI Qwen3 drafters) are "hidden state ENTERING layer k" ids, i.e. HF
    ``output_hidden_states`` indices: vLLM passes them unchanged to
    ``set_aux_hidden_state_layers`` and captures ``hidden_states + residual`` before layer k;
    speculators' own default is ``[2, N//2, N-3]`` (``models/utils.py::resolve_target_layer_ids``).
    """
    tl = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 4096,
        "model_type": "qwen3" if spec.qk_norm else "llama",
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": spec.num_kv_heads,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": spec.target_vocab_size,
    }
    if not spec.qk_norm:
        tl["mlp_bias"] = False
        tl["pretraining_tp"] = 1
    return {
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": spec.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": None if target_layer_ids is None else [int(i) for i in target_layer_ids],
        "embed_requires_grad": False,
        "fc_norm": spec.fc_norm,
        "has_no_defaults_at_init": False,
        "norm_before_fc": spec.norm_before_fc,
        "norm_before_residual": spec.norm_before_residual,
        "norm_output": spec.norm_output,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{
                "accept_tolerance": 0.0,
                "proposal_type": "greedy",
                "speculative_tokens": 3,
                "verifier_accept_k": 1,
            }],
            "verifier": {
                "architectures": list(verifier_architectures),
                "name_or_path": verifier_name_or_path,
            },
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "target_hidden_size": None if spec.target_hidden_size == spec.hidden_size else spec.target_hidden_size,
        "torch_dtype": dtype,
        "transformer_layer_config": tl,
        "transformers_version": "4.57.1",
    }


def write_speculators(path, spec: DraftSpec, state: dict[str, torch.Tensor], *, target_layer_ids=None,
                      include_embed: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> str:
    """speculators layout: nested ``config.json`` + ``model.safetensors`` with ``layers.0.*`` keys.

    ``include_embed``: an embedding table [Vt, H] to ship as ``embed_tokens.weight`` (checkpoints
    trained with speculators carry one - ``Eagle3DraftModel`` does not list it in
    ``_keys_to_ignore_on_save``; converted ones only if the source had it). None = no embedding.
    ``d2t`` / ``t2d`` are written when the draft vocabulary is smaller than the target's
    (``DraftVocabMixin._init_vocab`` registers them only then).
    """
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = speculators_config_dict(spec, target_layer_ids=target_layer_ids, dtype=_dtype_name(state, dtype))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    s = to_speculators_keys(state)
    if spec.draft_vocab_size == spec.target_vocab_size:
        s.pop("d2t", None)
        s.pop("t2d", None)
    if include_embed is not None:
        if tuple(include_embed.shape) != (spec.target_vocab_size, spec.hidden_size):
            raise ValueError("include_embed must be [target_vocab_size, hidden_size]")
        s["embed_tokens.weight"] = include_embed
    save_file(_save_state(s, dtype), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)


# --------------------------------------------------------------------------------------
# Oracle back ends
# --------------------------------------------------------------------------------------


def _unsupported(spec: DraftSpec, oracle: str) -> list[str]:
    bad = []
    diff_ht = spec.target_hidden_size != spec.hidden_size
    if oracle == "specforge":
        for f in ("norm_before_residual", "qk_norm", "norm_before_fc", "norm_output"):
            if getattr(spec, f):
                bad.append(f)
    elif oracle == "specforge_peagle":
        for f in ("fc_norm", "qk_norm", "norm_before_fc", "norm_output"):
            if getattr(spec, f):
                bad.append(f)
    elif oracle == "speculators":
        if diff_ht:
            bad.append("target_hidden_size != hidden_size")
    else:
        raise ValueError(f"unknown oracle {oracle!r}; choose from {ORACLES}")
    return bad


def oracle_supports(spec: DraftSpec, oracle: str) -> bool:
    return not _unsupported(spec, oracle)


def unsupported_reason(spec: DraftSpec, oracle: str) -> str:
    """Why a test skips an oracle for spec: the features of spec that the oracle's drafter has no form for."""
    return f"{oracle}'s drafter has no {', '.join(_unsupported(spec, oracle))}"


def _pick(spec: DraftSpec, oracle: str) -> str:
    if oracle == "auto":
        for name in ORACLES:
            if oracle_supports(spec, name):
                return name
        raise ValueError(f"no available oracle covers {spec}")
    bad = _unsupported(spec, oracle)
    if bad:
        raise ValueError(f"oracle {oracle!r} does not support {bad}")
    return oracle


_STUBBED = ("openai", "datasets", "hs_connectors")
_speculators_cache: dict = {}


def import_speculators():
    """Import ``speculators.models.eagle3`` on CPU without its training-only dependencies."""
    if "mod" in _speculators_cache:
        return _speculators_cache["mod"]
    if importlib.util.find_spec("speculators") is None:
        raise ImportError("speculators is not installed (pip install --no-deps speculators==0.9.0)")

    class _Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    added = []
    for root in _STUBBED:
        if root in sys.modules or importlib.util.find_spec(root) is not None:
            continue
        for name in [root] + ([f"{root}.types", f"{root}.types.chat", f"{root}.types.completion"]
                              if root == "openai" else []):
            sys.modules[name] = _Stub(name)
            added.append(name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module("speculators.models.eagle3")
    finally:
        for name in added:
            sys.modules.pop(name, None)
    _speculators_cache["mod"] = mod
    return mod


def import_specforge():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flash_attn is not found" at import
        from specforge.modeling.draft import llama3_eagle, peagle
    return llama3_eagle, peagle


@contextlib.contextmanager
def _eager():
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        yield


@contextlib.contextmanager
def _rope_table_covers(rotary_emb, max_position: int):
    """SpecForge's sdpa attention asks its rotary module for ``seq_len=q_len`` and then
    indexes the table with ``position_ids``; ask for at least ``max_position + 1`` rows."""
    orig = rotary_emb.forward

    def forward(x, seq_len=None):
        return orig(x, seq_len=max(int(seq_len or 0), int(max_position) + 1))

    rotary_emb.forward = forward
    try:
        yield
    finally:
        del rotary_emb.forward


def _load(module: torch.nn.Module, state: dict[str, torch.Tensor], allowed_missing=()) -> None:
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not any(k == a or k.startswith(a) for a in allowed_missing)]
    if missing or unexpected:
        raise ValueError(f"state does not fit {type(module).__name__}: missing={missing} unexpected={unexpected}")


class _Oracle:
    """Common interface: project / embed / layer (one causal pass) / logits / carry."""

    name = ""

    def __init__(self, spec, state, embed):
        self.spec = spec
        if tuple(embed.shape) != (spec.target_vocab_size, spec.hidden_size):
            raise ValueError(f"embedding must be [Vt={spec.target_vocab_size}, H={spec.hidden_size}], "
                             f"got {tuple(embed.shape)} (the drafter's input_layernorm is H wide)")
        self.d2t = state["d2t"].to(torch.int64)

    def carry(self, h):
        return h


class _SpecForgeModelOracle(_Oracle):
    """SpecForge's draft models share their fc, embedding and head entry points."""

    def project(self, feats):
        return self.m.project_hidden_states(feats)

    def embed(self, tokens):
        return self.m.embed_input_ids(tokens)

    def logits(self, h):
        return self.m.compute_logits(h)


class _SpecForgeOracle(_SpecForgeModelOracle):
    name = "specforge"

    def __init__(self, spec, state, embed):
        super().__init__(spec, state, embed)
        le, _ = import_specforge()
        from transformers import LlamaConfig

        self.le = le
        cfg = LlamaConfig.from_dict(specforge_config_dict(spec))  # == AutoDraftModelConfig.from_file
        m = le.LlamaForCausalLMEagle3(cfg, attention_backend="sdpa").float().eval()
        _load(m, {**state, "embed_tokens.weight": embed.float()})
        self.m = m

    def layer(self, emb, h, positions):
        attn = self.m.midlayer.self_attn
        with _rope_table_covers(attn.rotary_emb, int(positions.max())):
            return self.m.backbone(input_embeds=emb, hidden_states=h, cache_hidden=None,
                                   attention_mask=None, position_ids=positions)


class _PEagleOracle(_SpecForgeModelOracle):
    name = "specforge_peagle"

    def __init__(self, spec, state, embed):
        super().__init__(spec, state, embed)
        _, pe = import_specforge()
        from transformers import LlamaConfig

        cfg = LlamaConfig.from_dict({**specforge_config_dict(spec), "architectures": ["PEagleDraftModel"],
                                     "target_hidden_size": spec.target_hidden_size})
        m = pe.PEagleDraftModel(cfg, norm_before_residual=spec.norm_before_residual).float().eval()
        _load(m, {**to_speculators_keys(state), "embed_tokens.weight": embed.float()},
              allowed_missing=("mask_hidden",))
        self.m = m

    def layer(self, emb, h, positions):
        from torch.nn.attention.flex_attention import create_block_mask

        T = emb.shape[1]
        mask = create_block_mask(lambda b, hh, q, kv: q >= kv, B=None, H=None, Q_LEN=T, KV_LEN=T,
                                 device=emb.device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
            return self.m.backbone(input_embeds=emb, hidden_states=h, attention_mask=mask,
                                   position_ids=positions)


class _SpeculatorsOracle(_Oracle):
    name = "speculators"

    def __init__(self, spec, state, embed):
        super().__init__(spec, state, embed)
        mod = import_speculators()
        cfg = mod.Eagle3SpeculatorConfig.from_dict(speculators_config_dict(spec))
        cfg.transformer_layer_config._attn_implementation = "eager"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = mod.Eagle3DraftModel(cfg).float().eval()
        s = to_speculators_keys(state)
        s["embed_tokens.weight"] = embed.float()
        if spec.draft_vocab_size == spec.target_vocab_size:
            # DraftVocabMixin registers d2t / t2d as None when the vocabularies are equal
            s.pop("d2t", None)
            s.pop("t2d", None)
        _load(m, s, allowed_missing=("verifier_lm_head.", "verifier_norm."))
        self.m = m

    def project(self, feats):
        m = self.m
        if m.input_norm is not None:
            feats = m.input_norm(feats)
        if m.fc_norm is not None:
            chunks = feats.chunk(len(m.fc_norm), dim=-1)
            feats = torch.cat([n(c) for n, c in zip(m.fc_norm, chunks)], dim=-1)
        return m.fc(feats)

    def embed(self, tokens):
        return self.m.embed_tokens(tokens)

    def layer(self, emb, h, positions, cache=None, past_len: int = 0):
        """One pass of speculators' first decoder layer. With ``cache`` (an HF DynamicCache)
        the T new rows are appended after ``past_len`` cached rows and attend to all of them."""
        x = torch.cat([emb, h], dim=-1)  # Eagle3DraftModel.forward: cat([input_embeds, hidden_states])
        B, T = x.shape[0], x.shape[1]
        S = past_len + T
        visible = torch.arange(S)[None, :] <= (past_len + torch.arange(T))[:, None]
        mask = torch.zeros(T, S, dtype=x.dtype).masked_fill(~visible, torch.finfo(x.dtype).min)
        mask = mask[None, None].expand(B, 1, T, S)
        pos_emb = self.m.rotary_emb(x, positions)
        kw = {}
        if cache is not None:
            kw = {"past_key_values": cache, "use_cache": True,
                  "cache_position": torch.arange(past_len, S)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.m.layers[0](x, attention_mask=mask, position_ids=positions,
                                    position_embeddings=pos_emb, **kw)

    def logits(self, h):
        return self.m.lm_head(self.m.norm(h))

    def carry(self, h):
        return self.m.norm(h) if self.spec.norm_output else h


_ORACLE_CLASSES = {"specforge": _SpecForgeOracle, "specforge_peagle": _PEagleOracle,
                   "speculators": _SpeculatorsOracle}


def _build(state, spec, embed, oracle):
    name = _pick(spec, oracle)
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    return _ORACLE_CLASSES[name](spec, state, embed.float())


# --------------------------------------------------------------------------------------
# Reference computations
# --------------------------------------------------------------------------------------


def reference_forward(state, spec: DraftSpec, target_embed: torch.Tensor, hidden_in: torch.Tensor,
                      tokens: torch.Tensor, positions: torch.Tensor, *, oracle: str = "auto"):
    """One causal pass of the drafter layer over T inputs.

    hidden_in: [B,T,3*Ht] target features (fc applied first, with fc_norm / input_norm when the
    spec has them) or [B,T,H] already-projected / carried hiddens. tokens: [B,T] target ids
    (looked up in ``target_embed`` [Vt,H]). positions: [B,T] RoPE positions (any values; the
    attention is causal over the T inputs regardless of the position values).
    Returns (logits_draft [B,T,Vd], hidden_out_prenorm [B,T,H]).
    """
    o = _build(state, spec, target_embed, oracle)
    with _eager():
        h = hidden_in.float()
        if h.shape[-1] == 3 * spec.target_hidden_size:
            h = o.project(h)
        elif h.shape[-1] != spec.hidden_size:
            raise ValueError(f"hidden_in width {h.shape[-1]} is neither 3*Ht nor H")
        out = o.layer(o.embed(tokens.long()), h, positions.long())
        return o.logits(out), out


class ChainResult(NamedTuple):
    draft_ids: torch.Tensor  # [B, gamma] int64 TARGET ids (draft id + d2t[draft id])
    logits: torch.Tensor  # [B, gamma, Vd] logits of each draft step
    draft_vocab_ids: torch.Tensor  # [B, gamma] argmax in the draft vocabulary
    hidden: torch.Tensor  # [B, gamma, H] pre-norm output of each step (before `carry`)
    margins: torch.Tensor  # [B, gamma] top1 - top2 logit gap (small => argmax is fragile)


def _step_outputs(lg, d2t):
    top2 = lg.topk(2, dim=-1).values
    d = lg.argmax(-1)
    return d, d + d2t[d], top2[..., 0] - top2[..., 1]


def reference_chain(state, spec: DraftSpec, target_embed: torch.Tensor, features: torch.Tensor,
                    tokens: torch.Tensor, gamma: int, *, oracle: str = "auto", mode: str = "full") -> ChainResult:
    """Greedy chain drafting of ``gamma`` tokens.

    features [B,P,3*Ht] are the target features g_0..g_{P-1}; tokens [B,P] are x_1..x_P, so row t
    pairs (g_t, x_{t+1}) at RoPE position t (teacher-forced extend). d_1 = argmax of the output
    at row P-1, mapped to a target id with d2t. Step k >= 2 feeds (carried hidden of step k-1,
    d_{k-1}) at position P+k-2 and attends to every drafter KV entry before it.

    mode="full" (any oracle): step k runs ONE causal pass over the P+k-1 inputs
    [fc(g_0..g_{P-1}); c_1..c_{k-1}] / [x_1..x_P, d_1..d_{k-1}] at positions 0..P+k-2 and reads
    the last row. Equivalent to incremental decoding with a KV cache because the drafter is a
    single causal layer: the K/V of a row are functions of that row's own (hidden, token,
    position) only, and those inputs never change once fixed, so recomputing them gives the
    cached values; the causal mask makes every row see exactly the rows before it.
    mode="ttt" (specforge only): SpecForge's training-time-test cache (``cache_hidden``): step 1
    runs the P rows with the causal mask; step k feeds the previous step's outputs back at
    positions t+k-1 and attends to the step-1 keys causally plus its own row's keys from steps
    2..k (diagonal). Row P-1 of step k is then exactly draft step k.
    mode="cache" (speculators only): real incremental decoding with a transformers
    ``DynamicCache``: extend the P rows once, then one new row per step.
    """
    o = _build(state, spec, target_embed, oracle)
    B, P, _ = features.shape
    d2t = o.d2t
    outs = ([], [], [], [], [])
    tokens = tokens.long()
    with _eager():
        base = o.project(features.float())
        if mode == "full":
            hs, toks = [base], [tokens]
            for k in range(1, gamma + 1):
                h_in, t_in = torch.cat(hs, 1), torch.cat(toks, 1)
                pos = torch.arange(P + k - 1)[None].expand(B, -1)
                last = o.layer(o.embed(t_in), h_in, pos)[:, -1]
                lg = o.logits(last)
                d, t, marg = _step_outputs(lg, d2t)
                for lst, v in zip(outs, (t, lg, d, last, marg)):
                    lst.append(v)
                hs.append(o.carry(last)[:, None])
                toks.append(t[:, None])
        elif mode == "ttt":
            if o.name != "specforge":
                raise ValueError("mode='ttt' uses SpecForge's cache_hidden path: oracle must be 'specforge'")
            m, le = o.m, o.le
            mask = le.prepare_decoder_attention_mask(torch.ones(B, P, dtype=torch.bool), (B, P), base, 0)
            pos = torch.arange(P)[None].expand(B, -1)
            cache_hidden = [[], []]
            h_in, t_in = base, tokens
            for k in range(1, gamma + 1):
                out = m.backbone(input_embeds=m.embed_input_ids(t_in), hidden_states=h_in,
                                 cache_hidden=cache_hidden, attention_mask=mask, position_ids=pos)
                last = out[:, P - 1]
                lg = m.compute_logits(last)
                d, t, marg = _step_outputs(lg, d2t)
                for lst, v in zip(outs, (t, lg, d, last, marg)):
                    lst.append(v)
                h_in = out  # SpecForge carries the pre-norm backbone output
                t_in = torch.cat([t_in[:, 1:], t[:, None]], 1)  # shift as in training; row P-1 = d_k
        elif mode == "cache":
            if o.name != "speculators":
                raise ValueError("mode='cache' uses HF DynamicCache through speculators' layer: "
                                 "oracle must be 'speculators'")
            from transformers import DynamicCache

            cache = DynamicCache()
            h_in, t_in, past = base, tokens, 0
            for k in range(1, gamma + 1):
                T = h_in.shape[1]
                pos = torch.arange(past, past + T)[None].expand(B, -1)
                last = o.layer(o.embed(t_in), h_in, pos, cache=cache, past_len=past)[:, -1]
                past += T
                lg = o.logits(last)
                d, t, marg = _step_outputs(lg, d2t)
                for lst, v in zip(outs, (t, lg, d, last, marg)):
                    lst.append(v)
                h_in, t_in = o.carry(last)[:, None], t[:, None]
        else:
            raise ValueError("mode must be 'full', 'ttt' or 'cache'")
    ids, lgs, dv, hid, marg = (torch.stack(x, 1) for x in outs)
    return ChainResult(ids, lgs, dv, hid, marg)
