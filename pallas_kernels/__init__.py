"""Pallas GPU kernels for EAGLE-3 decode, verify and prefill: paged attention, the exact path's kernels, and
the fused small ops (each module's docstring says why it exists and what it measured).

  ragged_paged_attention(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, *, scale, max_q_len=None, uniform=False,
                         interpret=False, **RaggedPagedConfig fields)
                                                                decode, verify and prefill chunks of a
                                                                ragged token batch over paged KV (Mosaic
                                                                GPU; interpret=True: jax's GPU interpreter)
  paged_attention_reference(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, *, scale)
                                                                its oracle, one sequence at a time
  attention_reference(q, k_cache, v_cache, start, *, scale)     dense attention in plain jnp (the oracles' core)
  invariant_attention(q, k_cache, v_cache, start, *, scale, interpret=False, **InvariantConfig fields)
                                                                decode/verify over contiguous rows (the exact
                                                                path gathers each row's pages), T- and
                                                                B-invariant (Triton)
  rope_page_write(qkv, cos, sin, k_pages, v_pages, page_table, seq, positions, *, num_heads, q_norm, k_norm,
                  eps, interpret=False)                         q/k norm + RoPE + the page write (Triton)
  add_rms_norm(x, delta, weight, *, eps, interpret=False)      residual add + RMSNorm (Triton)
  add_rms_norm_mgpu(x, delta, weight, *, eps, interpret=False) the same in Mosaic GPU (Hopper's)
  skinny_matmul(x, w, *, out_dtype=None, interpret=False, **SkinnyConfig fields)
                                                                x @ w.T for few rows, row results
                                                                independent of the row count
  route_top_k(logits, *, k, normalize, out_dtype, interpret=False)
                                                                a Qwen3-MoE router's softmax, top-k and
                                                                renormalisation for few rows (Triton)
  moe_experts(x, combine, slots, count, w_gate_up, w_down, *, interpret=False, **ExpertsConfig fields)
                                                                a Qwen3-MoE layer's routed experts for few
                                                                rows, each expert's weights read once

Lowering, chosen per kernel by measurement on the H200 (BENCHMARKS.md, design decisions):
- Attention over the engine's paged KV: Mosaic GPU (TMA loads of pages, wgmma) on Hopper, one kernel for
  every query shape (eagle3_jax.models.paged_attention.uses_paged_kernel); elsewhere the model's XLA path.
- The exact path's kernels (skinny_matmul, invariant_attention), the fused add + RMSNorm, the fused q/k norm
  + RoPE + page write, the MoE router's top-k and the routed experts: Pallas's Triton backend (pl.pallas_call with
  pltriton.CompilerParams). A Mosaic GPU call is an FFI custom call in XLA, not a plain kernel: the Mosaic GPU
  add_rms_norm_mgpu matches Triton's kernel time on the H200, but a Qwen3-8B step with it takes 2.3% / 2.4%
  longer at batch 1 / 8 (BENCHMARKS.md (s)), so Hopper keeps Triton by default (eagle3_jax.models.layers
  MOSAIC_NORM_ON_HOPPER, norm_lowering).
  The Triton backend works on the JAX versions the project takes, 0.11.2 (the H200's image) through 0.12 (the
  CPU suite): deprecated (a "jax-pallas-triton" DeprecationWarning at lowering) but present; passing Triton
  CompilerParams selects it although jax_pallas_use_mosaic_gpu now defaults to True. Our Triton-lowered calls
  run inside XLA's command buffers (CUDA graphs) as plain kernel thunks.
  pallas_call(interpret=True) runs these kernels unchanged on the CPU through the generic interpreter, and
  the Mosaic GPU ones run in jax 0.12's Mosaic GPU interpreter (tests/README.md says what each covers).
- Tunings depend on the dtype: the defaults fill Hopper's shared memory with 2-byte tiles, and 4-byte
  (float32) operands take half the keys per step (InvariantConfig.for_dtype).
"""

from pallas_kernels.add_rms_norm import add_rms_norm
from pallas_kernels.add_rms_norm_mgpu import add_rms_norm_mgpu
from pallas_kernels.add_rms_norm_mgpu import unsupported as add_rms_norm_mgpu_unsupported
from pallas_kernels.invariant_attention import InvariantConfig, invariant_attention
from pallas_kernels.moe_router import route_top_k
from pallas_kernels.moe_router import unsupported as route_top_k_unsupported
from pallas_kernels.ragged_paged_attention import RaggedPagedConfig, ragged_paged_attention
from pallas_kernels.ragged_paged_attention import unsupported as ragged_paged_unsupported
from pallas_kernels.reference import attention_reference, paged_attention_reference
from pallas_kernels.rope_page_write import rope_page_write
from pallas_kernels.routed_experts import ExpertsConfig, moe_experts
from pallas_kernels.routed_experts import unsupported as moe_experts_unsupported
from pallas_kernels.skinny_matmul import SkinnyConfig, skinny_matmul, skinny_matmul_reference

__all__ = [
    "ExpertsConfig",
    "InvariantConfig",
    "RaggedPagedConfig",
    "SkinnyConfig",
    "add_rms_norm",
    "add_rms_norm_mgpu",
    "add_rms_norm_mgpu_unsupported",
    "attention_reference",
    "invariant_attention",
    "moe_experts",
    "moe_experts_unsupported",
    "paged_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_unsupported",
    "rope_page_write",
    "route_top_k",
    "route_top_k_unsupported",
    "skinny_matmul",
    "skinny_matmul_reference",
]
