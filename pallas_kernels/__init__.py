"""Pallas GPU kernels for EAGLE-3 decode, verify and prefill: attention, and two fusions of the
small ops around it (each module's docstring says why it exists and what it measured).

  attention_reference(q, k_cache, v_cache, start, *, scale)     plain jnp
  decode_attention(..., *, scale, interpret=False, **DecodeConfig fields)
  prefill_attention(..., *, scale, interpret=False, **PrefillConfig fields)           Triton
  prefill_attention_mgpu(..., *, scale, **MosaicPrefillConfig fields)                Mosaic GPU
  invariant_attention(..., *, scale, interpret=False, **InvariantConfig fields)       decode/verify, T- and
                                                                                    B-invariant (Triton)
  add_rms_norm(x, delta, weight, *, eps, interpret=False)      residual add + RMSNorm (Triton)
  add_rms_norm_mgpu(x, delta, weight, *, eps, interpret=False) the same in Mosaic GPU (Hopper's)
  skinny_matmul(x, w, *, out_dtype=None, interpret=False, **SkinnyConfig fields)
                                                                x @ w.T for few rows, row results
                                                                independent of the row count
  moe_experts(x, combine, slots, count, w_gate_up, w_down, *, interpret=False, **ExpertsConfig fields)
                                                                a Qwen3-MoE layer's routed experts for few
                                                                rows, each expert's weights read once
  rope_cache_write(qkv, cos, sin, k_cache, v_cache, start, *, num_heads, q_norm, k_norm, eps,
                   interpret=False)                             q/k norm + RoPE + KV-cache write
  ragged_paged_attention(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, *, scale, max_q_len=None,
                         interpret=False, **RaggedPagedConfig fields)
                                                                decode, verify and prefill chunks of a
                                                                ragged token batch over paged KV (Mosaic
                                                                GPU; interpret=True: jax's GPU interpreter)
  paged_attention_reference(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, *, scale)
                                                                its oracle, one sequence at a time

Attention:
q [B, T, N, H]; caches [B, K, S, H] already holding the T new tokens at
start .. start + T - 1; start [B] int32. The kernels read keys below start + T
(the Triton ones with masked loads; the Mosaic GPU one in whole TMA blocks, so
it asks for finite slots past start + T), clamp rows with start + T > S, and
run one or two kernel launches per call, with no XLA ops around them.

Lowering, chosen per kernel by measurement on the H200 (BENCHMARKS.md, design decisions):
- Prefill: Mosaic GPU (TMA + wgmma, FlashAttention-3's warp-specialised
  pipeline), prefill_attention_mgpu. Kernel time at 8k tokens: 571 TFLOP/s,
  cuDNN's rate (570) and 1.46x the Triton kernel's (391); at 2k: 399 against
  cuDNN's 392 and Triton's 276. The model takes it wherever it runs: on a
  Hopper GPU (wgmma), on bf16/f16 operands with head_dim 64 or 128 and sizes
  that are multiples of 8 (eagle3_jax.models.attention.uses_mosaic_prefill).
  Elsewhere (other GPUs, float32, and the CPU tests) the Triton prefill kernel runs.
- Decode/verify and the small fused kernels: Pallas's Triton backend
  (pl.pallas_call with pltriton.CompilerParams). Why:
  - Decode is bandwidth-bound and the Triton kernel reads K/V at or above the
    copy rate from batch 8 and 16k keys; faster than plain XLA at all 36
    decode/verify shapes of the benchmark.
  - A Mosaic GPU call is an FFI custom call in XLA, not a plain kernel: an
    earlier add_rms_norm in Mosaic GPU was slower (1.90 against 1.67 us of
    kernel time; 0.655 against 0.502 ms for a jit of 72 calls). Its port,
    add_rms_norm_mgpu, matches Triton's kernel time on the H200 but costs
    3.50 against 2.46 us a call in a chain of 72 (eagle3_jax_bench/norm.py),
    so Hopper keeps Triton by default (eagle3_jax.models.layers
    MOSAIC_NORM_ON_HOPPER, norm_lowering).
  - Masked loads with a dynamic trip count (scf.for, software-pipelined by
    Triton's num_stages) give exactly "read keys < start + T, never garbage",
    where the TMA moves fixed boxes; and wgmma wants 64-row tiles where decode
    has T * G = 4..32 query rows.
  - A Mosaic GPU decode kernel whose split-K CTAs merge inside a thread-block
    cluster (no second launch) is correct and level with the Triton kernel from
    batch 8 but slower at batch 1 (24.9 against 21.9 us at 16k keys: the
    in-cluster merge costs 4-5 us). The best Mosaic loop with no merge at all
    (128 CTAs) already takes 19.1 / 19.9 / 20.6 us at T = 1 / 4 / 8, and every
    merge measured costs more than the rest of an 80%-of-copy budget
    (distributed shared memory ~8 bytes/cycle into an SM; a merge kernel of
    its own ~1.4 us; a global semaphore ~1.2 us).
  - pallas_call(interpret=True) runs these kernels unchanged on the CPU through
    the generic interpreter, so every mask, split and row mapping is tested
    there (tests/test_pallas_attention.py).
  The Triton backend works on the JAX versions the project takes, 0.11.2 (the
  H200's image) through 0.12 (the CPU suite): deprecated (a "jax-pallas-triton"
  DeprecationWarning at lowering) but present; passing Triton CompilerParams
  selects it although jax_pallas_use_mosaic_gpu now defaults to True. Our
  Triton-lowered calls run inside XLA's command buffers (CUDA graphs): in jax
  0.11.2 XLA builds them from the thunk sequence, where each call is a plain
  kernel thunk.
- Tunings depend on the dtype: the defaults fill Hopper's shared memory with
  2-byte tiles, and 4-byte (float32) operands take half the keys per step
  (DecodeConfig.for_dtype, PrefillConfig.for_dtype).
Testing the Mosaic GPU kernel: jax 0.12's Mosaic GPU interpreter cannot run its
tensor-core attention step (pipelined wgmma under pl.run_state has no CPU rule).
So its tiling plan and mask are plain functions that the CPU tests walk against
the reference's visibility, the tests lower the whole kernel for CUDA, and
tests/test_gpu.py (`pytest -m gpu`) compares it with the
reference on the GPU (prefill_attention_mgpu's docstring).
When Triton is removed from Pallas, the decode kernel's structure (rows =
tokens x group heads, balanced split-K, LSE merge) carries over to Mosaic GPU.
"""

from pallas_kernels.add_rms_norm import add_rms_norm
from pallas_kernels.add_rms_norm_mgpu import add_rms_norm_mgpu
from pallas_kernels.add_rms_norm_mgpu import unsupported as add_rms_norm_mgpu_unsupported
from pallas_kernels.attention import (
    DecodeConfig,
    PrefillConfig,
    attention_reference,
    decode_attention,
    prefill_attention,
)
from pallas_kernels.invariant_attention import InvariantConfig, invariant_attention
from pallas_kernels.prefill_attention_mgpu import prefill_attention_mgpu
from pallas_kernels.prefill_attention_mgpu import unsupported as mosaic_prefill_unsupported
from pallas_kernels.ragged_paged_attention import RaggedPagedConfig, ragged_paged_attention
from pallas_kernels.ragged_paged_attention import unsupported as ragged_paged_unsupported
from pallas_kernels.reference import paged_attention_reference
from pallas_kernels.rope_cache_write import rope_cache_write
from pallas_kernels.routed_experts import ExpertsConfig, moe_experts
from pallas_kernels.routed_experts import unsupported as moe_experts_unsupported
from pallas_kernels.skinny_matmul import SkinnyConfig, skinny_matmul, skinny_matmul_reference

__all__ = [
    "DecodeConfig",
    "ExpertsConfig",
    "InvariantConfig",
    "PrefillConfig",
    "RaggedPagedConfig",
    "SkinnyConfig",
    "add_rms_norm",
    "add_rms_norm_mgpu",
    "add_rms_norm_mgpu_unsupported",
    "attention_reference",
    "decode_attention",
    "invariant_attention",
    "moe_experts",
    "moe_experts_unsupported",
    "mosaic_prefill_unsupported",
    "paged_attention_reference",
    "prefill_attention",
    "prefill_attention_mgpu",
    "ragged_paged_attention",
    "ragged_paged_unsupported",
    "rope_cache_write",
    "skinny_matmul",
    "skinny_matmul_reference",
]
