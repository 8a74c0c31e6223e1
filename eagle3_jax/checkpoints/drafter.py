"""Loading an EAGLE-3 drafter for a given target, in the formats seen in the wild.

* SpecForge / SGLang flat format (`LlamaForCausalLMEagle3`; AngelSlim `Eagle3LlamaForCausalLM`):
  top-level Llama config, keys `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, in
  `model.safetensors` or (AngelSlim) `pytorch_model.bin`.
* vllm-project "speculators" format (`speculators_model_type: eagle3`): nested
  `transformer_layer_config` (llama, or qwen3 with q/k norms), keys `layers.0.*`, flags
  `norm_before_residual`, `fc_norm`, `norm_before_fc`, `norm_output`, `target_hidden_size`.

Capture layers: a nested `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang's reading) counts
"output of layer k", so we capture entering layer k + 1; a top-level `eagle_aux_hidden_state_layer_ids`
(speculators, read as-is by vLLM) already counts "entering layer k". Without either, the target's
default (2, N//2, N-3).
"""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoints import hf_layout, orbax_io, safetensors_io, sharded
from eagle3_jax.checkpoints.common import check_dtype, read_json, refuse_unused
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.errors import CheckpointError
from eagle3_jax.models import weights as weights_lib
from eagle3_jax.models.config import DrafterConfig, Qwen3Config, RopeConfig, parse_rope, refuse_unsupported_layer
from eagle3_jax.models.config_fields import Fields

FLAT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclasses.dataclass(frozen=True)
class Drafter:
    config: DrafterConfig
    params: dict
    folder: Path


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a format keeps things: its layer config, key prefix, flags, and the tensors it may ship that
    inference has no use for."""

    layer: Fields
    prefix: str
    flags: dict[str, bool]
    capture: tuple[int, ...] | None
    ignored: frozenset[str]


# SpecForge keeps t2d (the inverse of d2t) as a buffer; speculators may ship the target's final norm and
# lm_head, used only in training.
_FLAT_IGNORED = frozenset({"t2d"})
_SPECULATORS_IGNORED = frozenset({"t2d", "verifier_norm.weight", "verifier_lm_head.weight"})


def _layout(fields: Fields) -> _Layout:
    where = fields.where
    kind = fields.str("speculators_model_type", None)
    if kind is not None:
        if kind != "eagle3":
            raise CheckpointError(f"{where}: speculators_model_type {kind!r} is not eagle3")
        if fields.obj("transformer_layer_config") is None:
            raise CheckpointError(f"{where}: speculators config without 'transformer_layer_config'")
        names = ("norm_before_residual", "fc_norm", "norm_before_fc", "norm_output")
        flags = {k: fields.bool(k, False) for k in names}
        ids = fields.ints("eagle_aux_hidden_state_layer_ids", ())
        return _Layout(fields.nested("transformer_layer_config"), "layers.0.", flags, ids or None, _SPECULATORS_IGNORED)
    architectures = fields.strs("architectures", ())
    if not set(architectures) & set(FLAT_ARCHITECTURES):
        raise CheckpointError(
            f"{where}: not an EAGLE-3 drafter (architectures={list(architectures)}; expected one of "
            f"{list(FLAT_ARCHITECTURES)} or a speculators eagle3 config)"
        )
    if not fields.bool("norm_output", True):
        raise CheckpointError(f"{where}: norm_output=false (logits without the final norm) is not supported")
    flags = {"norm_before_residual": fields.bool("norm_before_residual", False),
             "fc_norm": fields.bool("fc_norm", False), "norm_before_fc": False, "norm_output": False}
    nested = fields.nested("eagle_config").ints("eagle_aux_hidden_state_layer_ids", ())
    top = fields.ints("eagle_aux_hidden_state_layer_ids", ())
    capture = tuple(i + 1 for i in nested) if nested else top or None
    return _Layout(fields, "midlayer.", flags, capture, _FLAT_IGNORED)


def _check_layer_config(layer: Fields) -> None:
    where = layer.where
    layers = layer.int("num_hidden_layers", 1)
    if layers != 1:
        raise CheckpointError(f"{where}: num_hidden_layers={layers}: only one-layer drafters are supported")
    refuse_unsupported_layer(layer, ("attention_bias", "mlp_bias"))
    model_type = layer.str("model_type", "llama")
    if model_type not in ("llama", "qwen3"):
        raise CheckpointError(f"{where}: drafter layer type {model_type!r} is not supported (llama or qwen3)")


def _read_weights(folder: Path) -> dict[str, np.ndarray]:
    """All drafter tensors on the host (a drafter is one layer: small next to its target)."""
    if (folder / safetensors_io.SINGLE_FILE).exists() or (folder / safetensors_io.INDEX_FILE).exists():
        files = safetensors_io.weight_map(folder)
        out: dict[str, np.ndarray] = {}
        safetensors_io.read_tensors(files, list(files), out.__setitem__, progress=False)
        return out
    bin_file = folder / "pytorch_model.bin"
    if bin_file.exists():
        try:
            import torch
        except ImportError:
            raise CheckpointError(
                f"{bin_file}: reading .bin files needs torch; convert it first with `eagle3-jax convert`") from None
        try:
            state = torch.load(bin_file, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many types for a bad pickle
            raise CheckpointError(f"{bin_file}: not a readable PyTorch state dict ({e})") from None
        return {k: _torch_to_numpy(v) for k, v in state.items()}
    raise CheckpointError(f"{folder}: no model.safetensors, {safetensors_io.INDEX_FILE} or pytorch_model.bin")


def _torch_to_numpy(tensor) -> np.ndarray:
    import torch

    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
        return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
    return tensor.numpy()


def drafter_config(raw: dict[str, Any], where: Path, shapes: dict[str, tuple[int, ...]],
                   target: Qwen3Config) -> tuple[DrafterConfig, _Layout]:
    """The drafter's config and its format's layout, read from config.json (`raw`) and checked against the
    tensors' shapes (`shapes`: name -> shape) and against the target's config."""
    fields = Fields.of(raw, where)
    layout = _layout(fields)
    layer = layout.layer
    _check_layer_config(layer)
    q_name = layout.prefix + "self_attn.q_proj.weight"
    if q_name not in shapes:
        raise CheckpointError(f"{where}: missing tensor {q_name!r}")
    heads = layer.int("num_attention_heads", minimum=1)
    hidden = layer.int("hidden_size", minimum=1)
    intermediate = layer.int("intermediate_size", minimum=1)
    q_rows = shapes[q_name][0]
    if q_rows % heads:
        raise CheckpointError(f"{where}: {q_name} has {q_rows} rows, not a multiple of num_attention_heads={heads}")
    head_dim = q_rows // heads  # from the weights: published configs sometimes disagree with them
    configured_head_dim = layer.int("head_dim", None)
    if configured_head_dim not in (None, head_dim):
        warnings.warn(f"{where}: config head_dim={configured_head_dim} disagrees with the weights ({head_dim}); "
                      f"using {head_dim}")
    target_hidden = fields.int("target_hidden_size", 0, minimum=0) or hidden
    vocab = layer.int("vocab_size", 0, minimum=0) or fields.int("vocab_size", 0, minimum=0)
    capture = layout.capture or target.default_capture_layers
    _check_fit(where, target, target_hidden=target_hidden, vocab=vocab, capture=capture)
    cfg = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=heads,
        num_kv_heads=layer.int("num_key_value_heads", 0, minimum=0) or heads,
        head_dim=head_dim,
        rms_norm_eps=layer.float("rms_norm_eps", 1e-6),
        rope=parse_rope(layer, head_dim, layer.int("max_position_embeddings", 4096, minimum=1)),
        draft_vocab_size=(fields.int("draft_vocab_size", 0, minimum=0) or layer.int("draft_vocab_size", 0, minimum=0)
                          or vocab),
        target_vocab_size=vocab,
        target_hidden_size=target_hidden,
        capture_layers=capture,
        qk_norm=layer.str("model_type", "llama") == "qwen3",
        **layout.flags,
    )
    return cfg, layout


def _check_fit(where: Path, tcfg: Qwen3Config, *, target_hidden: int, vocab: int, capture: tuple[int, ...]) -> None:
    """A drafter trained for another target is refused, naming the mismatch."""
    if target_hidden != tcfg.hidden_size:
        raise CheckpointError(
            f"{where}: drafter expects target hidden size {target_hidden}, the target has {tcfg.hidden_size}")
    if vocab != tcfg.vocab_size:
        raise CheckpointError(f"{where}: drafter vocab_size {vocab} does not match the target's {tcfg.vocab_size}")
    bad = [c for c in capture if not 0 <= c < tcfg.num_layers]
    if bad:
        raise CheckpointError(
            f"{where}: capture layer {bad[0]} is out of range for a {tcfg.num_layers}-layer target (layers {capture})"
        )


def _float_weights(cfg: DrafterConfig, layout: _Layout, with_embed: bool) -> hf_layout.Plan:
    """The drafter's float parameters and their tensors in this format (d2t, an integer, is read apart)."""
    described = weights_lib.drafter_weights(cfg, layout.prefix, with_embed=with_embed)
    return hf_layout.plan([w for w in described if w.dtype is None], ())


def _check_weights(cfg: DrafterConfig, layout: _Layout, weights: dict[str, np.ndarray], where: Path) -> None:
    expected = hf_layout.expected_shapes(_float_weights(cfg, layout, with_embed=False))
    for name, shape in expected.items():
        if name not in weights:
            raise CheckpointError(f"{where}: missing tensor {name!r}")
        if weights[name].shape != shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {weights[name].shape}, expected {shape}")
    refuse_unused(where, weights, {*expected, "d2t", "embed_tokens.weight", *layout.ignored})
    embed_shape = (cfg.target_vocab_size, cfg.hidden_size)
    if "embed_tokens.weight" in weights and weights["embed_tokens.weight"].shape != embed_shape:
        raise CheckpointError(f"{where}: tensor 'embed_tokens.weight' has shape "
                              f"{weights['embed_tokens.weight'].shape}, expected {embed_shape}")
    if "embed_tokens.weight" not in weights and cfg.hidden_size != cfg.target_hidden_size:
        raise CheckpointError(f"{where}: drafter hidden size {cfg.hidden_size} differs from the target's "
                              f"{cfg.target_hidden_size} and it ships no embed_tokens.weight")


def _draft_to_target(cfg: DrafterConfig, weights: dict[str, np.ndarray], where: Path) -> np.ndarray:
    """d2t offsets as int32, checked to land inside the target vocabulary."""
    d2t = weights.get("d2t")
    if d2t is None:
        if cfg.draft_vocab_size != cfg.target_vocab_size:
            raise CheckpointError(f"{where}: draft vocab {cfg.draft_vocab_size} < target vocab "
                                  f"{cfg.target_vocab_size} but no 'd2t' tensor")
        return np.zeros((cfg.draft_vocab_size,), np.int32)
    if d2t.shape != (cfg.draft_vocab_size,) or not np.issubdtype(d2t.dtype, np.integer):
        raise CheckpointError(
            f"{where}: tensor 'd2t' must be integer [{cfg.draft_vocab_size}], got {d2t.dtype} {d2t.shape}")
    ids = np.arange(cfg.draft_vocab_size) + d2t
    if ids.min() < 0 or ids.max() >= cfg.target_vocab_size:
        raise CheckpointError(
            f"{where}: tensor 'd2t' maps draft ids outside the target vocabulary [0, {cfg.target_vocab_size})")
    return d2t.astype(np.int32)


def _params(cfg: DrafterConfig, layout: _Layout, weights: dict[str, np.ndarray], dtype, where: Path) -> dict:
    _check_weights(cfg, layout, weights, where)
    d2t = _draft_to_target(cfg, weights, where)
    float_weights = _float_weights(cfg, layout, with_embed="embed_tokens.weight" in weights)
    names = hf_layout.expected_shapes(float_weights)
    cast = {n: weights[n] if weights[n].dtype == dtype else weights[n].astype(dtype) for n in names}
    params = hf_layout.assemble(float_weights, cast, concatenate=np.concatenate)
    return jax.device_put({**params, "d2t": d2t})


def load_drafter(path: str | Path, target: Target, dtype: str = "bfloat16") -> Drafter:
    """Loads an EAGLE-3 drafter for `target` (Hugging Face formats above, or a `convert_drafter` folder),
    on the target's tensor-parallel mesh when it has one (replicated: checkpoints/sharded.py)."""
    drafter = _load(Path(path), target, dtype)
    return drafter if target.mesh is None else sharded.shard_drafter(drafter, target.config, target.mesh)


def _load(folder: Path, target: Target, dtype: str) -> Drafter:
    jdtype = check_dtype(dtype)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: drafter folder not found")
    if (folder / orbax_io.ORBAX_MARKER).exists():
        return _load_orbax(folder, target, jdtype)
    where = folder / "config.json"
    raw = read_json(where)
    weights = _read_weights(folder)
    cfg, layout = drafter_config(raw, where, {name: w.shape for name, w in weights.items()}, target.config)
    return Drafter(cfg, _params(cfg, layout, weights, jdtype, folder), folder)


def _config_from_json(marker: Fields) -> DrafterConfig:
    """The DrafterConfig a converted folder's marker stores (written by `convert_drafter`)."""
    raw = dict(marker.obj("config") or {})
    try:
        raw["rope"] = RopeConfig(**raw["rope"])
        raw["capture_layers"] = tuple(raw["capture_layers"])
        return DrafterConfig(**raw)
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{marker.where}: malformed 'config' ({e})") from None


def convert_drafter(src: str | Path, dst: str | Path, target: Target, dtype: str = "bfloat16") -> Path:
    """Drafter folder (any supported format, .bin included) -> orbax folder that loads without torch."""
    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst}: destination already exists")
    drafter = load_drafter(src, target, dtype=dtype)
    dst.mkdir(parents=True)
    orbax_io.save_params(dst, drafter.params)
    shutil.copy(Path(src) / "config.json", dst / "config.json")
    orbax_io.write_marker(dst, "drafter", dtype, has_embed="embed" in drafter.params,
                          config=dataclasses.asdict(drafter.config))
    return dst


def _load_orbax(folder: Path, target: Target, dtype) -> Drafter:
    marker = orbax_io.read_marker(folder, "drafter")
    cfg = _config_from_json(marker)
    _check_fit(folder, target.config, target_hidden=cfg.target_hidden_size, vocab=cfg.target_vocab_size,
               capture=cfg.capture_layers)
    stored = jnp.dtype(marker.str("dtype"))
    described = weights_lib.drafter_weights(cfg, with_embed=marker.bool("has_embed"))
    params = orbax_io.restore_params(folder, weights_lib.abstract_params(described, stored))
    if stored != dtype:
        params = {k: v if k == "d2t" else jax.tree.map(lambda x: x.astype(dtype), v) for k, v in params.items()}
    return Drafter(cfg, params, folder)
