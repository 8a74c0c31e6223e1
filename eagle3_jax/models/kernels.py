"""Which implementation runs the hot ops of a step: attention, and the small ops around it.

  "xla"     plain jnp everywhere: the reference, and the CPU default
  "pallas"  the Pallas kernels of `pallas_kernels/`: paged attention (the Mosaic GPU kernel on Hopper, for
            the operands it takes; XLA's path elsewhere), the residual add + RMSNorm fused, and a Qwen3-MoE
            layer's routed experts; the GPU default. The matmuls stay XLA's: two Pallas matmuls measured no
            faster (BENCHMARKS.md).

The model functions also take ABLATION, Pallas attention with XLA's small ops, which the benchmark uses
to measure what the fused kernels bring; Engine and the CLI offer only CHOICES.
They also take EXACT, which `Engine(exact=True)` gives the target's decode and verify steps (prefill and
the drafter keep the engine's choice): every op's result for a token is bit-identical whether the token is
computed alone (decode, T = 1) or among T tokens (verify), at any batch size. The matmuls, lm_head
included, take pallas_kernels.skinny_matmul (fixed row tiles and K order), attention takes
pallas_kernels.invariant_attention over each row's pages gathered (key runs set by the query's own position),
and the residual add + RMSNorm takes the fused Pallas kernel, which computes each token in programs of its
own, and so does the fused q/k norm + RoPE + page write. What stays in XLA is elementwise
(SiLU product, RoPE tables) or exact (the embedding gather, argmax). Few rows only: a skinny matmul unrolls one
dot per 16 rows.
Off the GPU the Pallas kernels run in Pallas' interpreter (slow; for tests).
"""

from __future__ import annotations

import jax

CHOICES = ("xla", "pallas")
ABLATION = "pallas_attention"
EXACT = "exact"


def check(kernels: str) -> str:
    """kernels, validated (attention takes the XLA path for the operands its kernel does not take)."""
    if kernels not in CHOICES:
        raise ValueError(f"kernels must be one of {CHOICES}, got {kernels!r}")
    return kernels


def default() -> str:
    """Pallas on a GPU, XLA elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def invariant_attention_supports(head_dim: int) -> bool:
    """The exact path's attention kernel's Triton block shapes need a power-of-two head_dim of at least 16
    (Qwen3: 128)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def attention_in_pallas(kernels: str) -> bool:
    return _known(kernels) in ("pallas", ABLATION, EXACT)


def fused_in_pallas(kernels: str) -> bool:
    return _known(kernels) in ("pallas", EXACT)


def experts_in_pallas(kernels: str) -> bool:
    """Whether a Qwen3-MoE layer's routed experts may take pallas_kernels.moe_experts, and its router's top-k
    pallas_kernels.route_top_k (models/moe.py)."""
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
    the ragged paged attention kernel's wgmma exists there only."""
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", None) == "9.0"
