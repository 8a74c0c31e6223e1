"""Loading a Qwen3 or Qwen3-MoE target: a Hugging Face safetensors folder or our orbax conversion of one.

A Qwen3-MoE checkpoint stores its experts either per expert (the hub's layout,
`mlp.experts.{e}.{gate,up,down}_proj.weight`, which transformers 5 still writes on save) or fused
(transformers 5's in-memory layout, `mlp.experts.gate_up_proj [E, 2I, D]` and `mlp.experts.down_proj
[E, D, I]`); both load, layer by layer, into the fused layout.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoints import safetensors_io
from eagle3_jax.errors import CheckpointError
from eagle3_jax.models import qwen3
from eagle3_jax.models.config import Qwen3Config, read_json

ORBAX_MARKER = "eagle3_jax.json"  # present in folders written by `convert`
_FORMAT_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "generation_config.json")
DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class Target:
    """A loaded target: its config, its parameters on the device, and the folder it came from."""

    config: Qwen3Config
    params: dict
    folder: Path


def hf_layer_keys(cfg: Qwen3Config, i: int) -> dict[str, tuple[str, ...]]:
    """Our per-layer name -> the transformers tensors it is made of (concatenated along the output).
    A sparse layer's experts are named by their fused names, which per-expert checkpoints are stacked into."""
    p = f"model.layers.{i}."
    keys = {
        "attn_norm": (p + "input_layernorm.weight",),
        "wqkv": tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"),
        "q_norm": (p + "self_attn.q_norm.weight",),
        "k_norm": (p + "self_attn.k_norm.weight",),
        "wo": (p + "self_attn.o_proj.weight",),
        "mlp_norm": (p + "post_attention_layernorm.weight",),
        "w_gate_up": (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        "w_down": (p + "mlp.down_proj.weight",),
    }
    if cfg.is_sparse(i):
        keys.update(router=(p + "mlp.gate.weight",), w_gate_up=(p + "mlp.experts.gate_up_proj",),
                    w_down=(p + "mlp.experts.down_proj",))
    return keys


def _hf_expected_shapes(cfg: Qwen3Config, files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape; a sparse layer's experts in the layout the
    file uses for that layer (fused when its `mlp.experts.gate_up_proj` is present, else per expert)."""
    D, H, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    N, K = cfg.num_heads, cfg.num_kv_heads
    attention = {
        "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
        "self_attn.q_proj.weight": (N * H, D), "self_attn.k_proj.weight": (K * H, D),
        "self_attn.v_proj.weight": (K * H, D), "self_attn.o_proj.weight": (D, N * H),
        "self_attn.q_norm.weight": (H,), "self_attn.k_norm.weight": (H,),
    }
    dense = {"mlp.gate_proj.weight": (I, D), "mlp.up_proj.weight": (I, D), "mlp.down_proj.weight": (D, I)}
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        mlp = _sparse_shapes(cfg, p + "mlp.experts.gate_up_proj" in files) if cfg.is_sparse(i) else dense
        shapes.update({p + k: s for k, s in {**attention, **mlp}.items()})
    return shapes


def _sparse_shapes(cfg: Qwen3Config, fused: bool) -> dict[str, tuple[int, ...]]:
    D, E, Ie = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.moe_intermediate_size
    shapes = {"mlp.gate.weight": (E, D)}
    if fused:
        return {**shapes, "mlp.experts.gate_up_proj": (E, 2 * Ie, D), "mlp.experts.down_proj": (E, D, Ie)}
    for e in range(E):
        shapes.update({f"mlp.experts.{e}.gate_proj.weight": (Ie, D), f"mlp.experts.{e}.up_proj.weight": (Ie, D),
                       f"mlp.experts.{e}.down_proj.weight": (D, Ie)})
    return shapes


_EXPERT_KEY = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")


class _ExpertStacks:
    """Per-expert tensors written into one host stack per layer and weight ([E, 2I, D] gate then up,
    [E, D, I] down), each moved to the device as soon as it is full: host memory holds the stacks being
    filled, never a second copy of the model."""

    def __init__(self, cfg: Qwen3Config, dtype, put):
        self.num_experts, self.half = cfg.moe.num_experts, cfg.moe.moe_intermediate_size
        self.dtype, self.put = dtype, put
        self.stacks: dict[str, list] = {}  # fused name -> [host array, tensors still missing]

    def take(self, name: str, array: np.ndarray) -> bool:
        """Stacks `array` when it is a per-expert tensor (True), else leaves it to the caller (False)."""
        match = _EXPERT_KEY.fullmatch(name)
        if not match:
            return False
        prefix, e, which = match.group(1), int(match.group(2)), match.group(3)
        fused = prefix + ("down_proj" if which == "down" else "gate_up_proj")
        if fused not in self.stacks:
            rows = array.shape[0] * (1 if which == "down" else 2)
            self.stacks[fused] = [np.empty((self.num_experts, rows, array.shape[1]), self.dtype),
                                  self.num_experts * (1 if which == "down" else 2)]
        entry = self.stacks[fused]
        rows = slice(self.half, None) if which == "up" else slice(0, array.shape[0])
        entry[0][e, rows] = array
        entry[1] -= 1
        if entry[1] == 0:
            self.put(fused, self.stacks.pop(fused)[0])
        return True


def check_dtype(dtype: str) -> jnp.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return jnp.dtype(dtype)


def load_target(path: str | Path, dtype: str = "bfloat16", progress: bool = True) -> Target:
    """Loads a Qwen3 target from a Hugging Face folder or an orbax folder written by `convert`."""
    folder = Path(path)
    jdtype = check_dtype(dtype)
    cfg = Qwen3Config.from_file(folder / "config.json")
    if (folder / ORBAX_MARKER).exists():
        return Target(cfg, _load_orbax(folder, cfg, jdtype), folder)
    files = safetensors_io.weight_map(folder)
    expected = _hf_expected_shapes(cfg, files)
    safetensors_io.check_tensors(folder, files, expected)
    # A tied checkpoint may still hold the lm_head that transformers ties to the embedding and never reads.
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    safetensors_io.refuse_unused(folder, files, {*expected, *tied})
    loaded: dict[str, jax.Array] = {}

    def put(name: str, array: np.ndarray) -> None:
        # Cast on the host only when the file's dtype differs (bf16 stays bf16, no float32 detour).
        loaded[name] = jax.device_put(array if array.dtype == jdtype else array.astype(jdtype))

    experts = _ExpertStacks(cfg, jdtype, put) if cfg.moe is not None else None

    def take(name: str, array: np.ndarray) -> None:
        if experts is None or not experts.take(name, array):
            put(name, array)

    safetensors_io.read_tensors(files, list(expected), take, progress)
    return Target(cfg, _assemble(cfg, loaded), folder)


def _assemble(cfg: Qwen3Config, loaded: dict[str, jax.Array]) -> dict:
    """Builds our pytree from transformers' tensors, fusing qkv and gate/up on the device."""
    layers = []
    for i in range(cfg.num_layers):
        layer = {}
        for ours, theirs in hf_layer_keys(cfg, i).items():
            parts = [loaded.pop(name) for name in theirs]
            layer[ours] = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
        layers.append(layer)
    params = {
        "embed": loaded.pop("model.embed_tokens.weight"),
        "final_norm": loaded.pop("model.norm.weight"),
        "layers": tuple(layers),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = loaded.pop("lm_head.weight")
    return params


def save_params(folder: Path, params) -> None:
    """Writes a parameter pytree to folder/params with orbax."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save((folder / "params").absolute(), params)


def restore_params(folder: Path, abstract):
    """Reads folder/params into the structure, shapes and dtypes of `abstract` (ShapeDtypeStructs); a stored
    tensor that `abstract` has no place for, or one it lacks, is refused naming it."""
    import orbax.checkpoint as ocp

    where = folder / "params"
    try:
        with ocp.StandardCheckpointer() as ckpt:
            metadata = ckpt.metadata(where.absolute()).item_metadata
            if metadata is None:
                raise ValueError("its metadata is unreadable")
            stored = leaf_names(metadata)
            wanted = leaf_names(abstract)
            missing = sorted(set(wanted) - set(stored))
            if missing:
                raise CheckpointError(f"{where}: missing tensor {missing[0]!r}")
            safetensors_io.refuse_unused(where, stored, set(wanted))
            return ckpt.restore(where.absolute(), abstract)
    except CheckpointError:
        raise
    except Exception as e:  # orbax raises many types; all mean the same thing to the user
        raise CheckpointError(f"{where}: cannot restore the orbax checkpoint ({e})") from None


def leaf_names(tree) -> list[str]:
    """A pytree's leaves as dotted names: {"layers": ({"wo": x},)} -> ["layers.0.wo"]."""
    def name(path) -> str:
        return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)

    return [name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _load_orbax(folder: Path, cfg: Qwen3Config, dtype) -> dict:
    marker = read_json(folder / ORBAX_MARKER)
    if marker.get("format_version") != _FORMAT_VERSION:
        raise CheckpointError(f"{folder / ORBAX_MARKER}: unknown format_version {marker.get('format_version')!r}")
    stored = jnp.dtype(marker.get("dtype", "bfloat16"))
    params = restore_params(folder, qwen3.abstract_params(cfg, stored))
    return params if stored == dtype else jax.tree.map(lambda x: x.astype(dtype), params)


def convert(src: str | Path, dst: str | Path, dtype: str = "bfloat16") -> Path:
    """Hugging Face folder -> orbax folder (params, config.json, tokenizer files) that loads faster."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst}: destination already exists")
    tgt = load_target(src, dtype=dtype)
    dst.mkdir(parents=True)
    save_params(dst, tgt.params)
    shutil.copy(src / "config.json", dst / "config.json")
    for name in _TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    (dst / ORBAX_MARKER).write_text(json.dumps({"format_version": _FORMAT_VERSION, "dtype": dtype, "kind": "target"}))
    return dst
