"""Which implementation runs the hot ops of a step: attention, and the small ops around it.

  "xla"     plain jnp everywhere: the reference, and the CPU default
  "pallas"  the Pallas kernels of `pallas_kernels/`: attention, and the small ops between the matmuls
            fused (residual add + RMSNorm; q/k norm + RoPE + KV-cache write); the GPU default. The
            matmuls stay XLA's: two Pallas matmuls measured no faster (BENCHMARKS.md).

The model functions also take ABLATION, Pallas attention with XLA's small ops, which the benchmark uses
to measure what the fused kernels bring; Engine and the CLI offer only CHOICES.
They also take EXACT, which `Engine(exact=True)` gives the target's decode and verify steps (prefill and
the drafter keep the engine's choice): every op's result for a token is bit-identical whether the token is
computed alone (decode, T = 1) or among T tokens (verify), at any batch size. The matmuls, lm_head
included, take pallas_kernels.skinny_matmul (fixed row tiles and K order), attention takes
pallas_kernels.invariant_attention (key runs set by the query's own position), and the residual add +
RMSNorm and q/k norm + RoPE + cache write take the fused Pallas kernels, which compute each token in
programs of their own. What stays in XLA is elementwise (SiLU product, RoPE tables) or exact (the
embedding gather, argmax). Few rows only: a skinny matmul unrolls one dot per 16 rows.
Off the GPU the Pallas kernels run in Pallas' interpreter (slow; for tests).
"""

from __future__ import annotations

import jax

CHOICES = ("xla", "pallas")
ABLATION = "pallas_attention"
EXACT = "exact"


def check(kernels: str, *head_dims: int) -> str:
    """kernels, validated against the head_dims of the models it will run."""
    if kernels not in CHOICES:
        raise ValueError(f"kernels must be one of {CHOICES}, got {kernels!r}")
    if kernels != "xla" and not all(pallas_attention_supports(h) for h in head_dims):
        raise ValueError(f"kernels={kernels!r} needs power-of-two head_dims >= 16, got {head_dims}")
    return kernels


def default(*head_dims: int) -> str:
    """Pallas on GPU when the attention kernels support every head_dim given, XLA elsewhere."""
    on_gpu = jax.default_backend() == "gpu"
    return "pallas" if on_gpu and all(pallas_attention_supports(h) for h in head_dims) else "xla"


def pallas_attention_supports(head_dim: int) -> bool:
    """The attention kernels' Triton block shapes need a power-of-two head_dim of at least 16 (Qwen3: 128)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def attention_in_pallas(kernels: str) -> bool:
    return _known(kernels) in ("pallas", ABLATION, EXACT)


def fused_in_pallas(kernels: str) -> bool:
    return _known(kernels) in ("pallas", EXACT)


def experts_in_pallas(kernels: str) -> bool:
    """Whether a Qwen3-MoE layer's routed experts may take pallas_kernels.moe_experts (models/moe.py)."""
    return _known(kernels) == "pallas"


def exact(kernels: str) -> bool:
    return _known(kernels) == EXACT


def _known(kernels: str) -> str:
    if kernels not in CHOICES + (ABLATION, EXACT):
        raise ValueError(f"kernels must be one of {CHOICES + (ABLATION, EXACT)}, got {kernels!r}")
    return kernels


def interpret() -> bool:
    """Pallas kernels run compiled on the GPU and interpreted elsewhere."""
    return jax.default_backend() != "gpu"


def hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.0, as the H100 and H200):
    the Mosaic GPU prefill kernel's wgmma exists there only."""
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", None) == "9.0"
