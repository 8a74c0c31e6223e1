"""Pallas GPU kernels for EAGLE-3 decode, verify and prefill: attention, and two fusions of the
small ops around it (each module's docstring says why it exists and what it measured).

  attention_reference(q, k_cache, v_cache, start, *, scale)     plain jnp
  decode_attention(..., *, scale, interpret=False, **DecodeConfig fields)
  prefill_attention(..., *, scale, interpret=False, **PrefillConfig fields)
  add_rms_norm(x, delta, weight, *, eps, interpret=False)      residual add + RMSNorm
  rope_cache_write(qkv, cos, sin, k_cache, v_cache, start, *, num_heads, q_norm, k_norm, eps,
                   interpret=False)                             q/k norm + RoPE + KV-cache write

Attention:
q [B, T, N, H]; caches [B, K, S, H] already holding the T new tokens at
start .. start + T - 1; start [B] int32. Both kernels read only keys below
start + T (masked loads), clamp rows with start + T > S, and run one
(prefill, or decode with one split) or two (decode with splits) kernel
launches per call, with no XLA ops around them.

Lowering: Pallas's Triton backend (pl.pallas_call with
pltriton.CompilerParams), not Mosaic GPU. Why:
- It works on both JAX versions the project meets: 0.10.2 (CPU, tests) and
  0.11.2 (H200). In 0.11 it is deprecated (a "jax-pallas-triton"
  DeprecationWarning at lowering) but present; passing Triton CompilerParams
  selects it although jax_pallas_use_mosaic_gpu now defaults to True.
- pallas_call(interpret=True) runs these kernels unchanged on the CPU through
  the generic interpreter, so every mask, split and row mapping is tested
  there (tests/test_pallas_attention.py); lowering to Triton IR can also be
  checked on a CPU with .lower(lowering_platforms=("cuda",)).
- Masked loads with a dynamic trip count (scf.for, software-pipelined by
  Triton's num_stages) give exactly "read keys < start + T, never garbage".
  In Mosaic GPU the TMA moves fixed boxes (a tail block would pull garbage,
  possibly NaN, into shared memory and need extra masking) and wgmma wants
  64-row tiles where decode has T * G = 4..32 query rows; that kernel could
  not be written and validated within this task's three device runs.
- It measured well enough (H200, bf16, Qwen3-8B heads, see BENCHMARKS.md):
  decode/verify kernels read K/V at 4.3-4.6 TB/s (above a 4 GiB copy
  kernel's 4.26) at B >= 8 and 16k+ keys and 3.3-3.6 TB/s at B = 1, 32k;
  faster than plain XLA at all 36 decode/verify shapes; prefill 214 / 363
  TFLOP/s at 2k / 8k (cuDNN 271 / 509).
What the second session measured against this choice (BENCHMARKS.md):
- Prefill: JAX's own Mosaic GPU flash attention (attention_mgpu, float16)
  reaches 239 / 529 TFLOP/s at 2k / 8k against our Triton kernel's 200 / 369.
  For prefill the Mosaic GPU lowering is the better one; ours is not written
  yet (JAX's kernel takes float16 only, keys as [B, S, K, H] and no start > 0).
- Decode: bandwidth-bound; our Triton kernel reads at or above the copy rate
  from batch 8 and 16k keys, so a rewrite would not pay there.
What the third session measured (BENCHMARKS.md):
- Our Triton-lowered calls run inside XLA's command buffers (CUDA graphs): in
  jax 0.11.2 XLA builds them from the thunk sequence, where each call is a
  plain kernel thunk. (The second session believed the opposite; withdrawn.)
- add_rms_norm written for Mosaic GPU was slower than the Triton kernel (then
  with 4 warps): 1.90 against 1.67 us of kernel time, and 0.655 against
  0.502 ms for a jit of 72 calls; a Mosaic GPU call is an FFI custom call in
  XLA, not a plain kernel. So the small fused kernels stay on Triton.
What it found on the CPU (jax 0.10.2's Mosaic GPU interpreter; the probes are
in commit 8d072de):
- Mosaic GPU kernels can be checked there only through plgpu.kernel's named
  grid axes (program_id is always 0 in an interpreted pallas_call grid) and
  whole-array BlockSpecs.
- A tensor-core attention step does not run there at all: pl.run_state is
  unsupported, plgpu.transpose_ref fails ('TransposeTransform' object has no
  attribute 'indices') and so does writing a tiled, swizzled SMEM ref (a
  shape assertion). So a Mosaic GPU prefill kernel (the lowering JAX's own
  kernel shows to be faster for prefill) would need its tiling and masking
  tested another way; it is not written.
When Triton is removed from Pallas, the kernels' structure (rows = tokens x
group heads, balanced split-K, LSE merge) carries over to Mosaic GPU.
"""

from pallas_kernels.add_rms_norm import add_rms_norm
from pallas_kernels.attention import (
    DecodeConfig,
    PrefillConfig,
    attention_reference,
    decode_attention,
    prefill_attention,
)
from pallas_kernels.rope_cache_write import rope_cache_write

__all__ = [
    "DecodeConfig",
    "PrefillConfig",
    "add_rms_norm",
    "attention_reference",
    "decode_attention",
    "prefill_attention",
    "rope_cache_write",
]
