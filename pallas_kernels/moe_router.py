"""A Qwen3-MoE router's softmax, top-k and renormalisation for few rows, in one kernel: logits [M, E] (float32)
-> (weights [M, k], expert ids [M, k] int32), as models/moe.py's `route` computes them after its router matmul.

Why: XLA runs these steps as six small fusions a layer (the softmax recomputed inside the top-k's
comparisons among them), about 11 us of a Qwen3-30B-A3B layer's 72 us at batch 1 on the H200, for 512 bytes of
logits (BENCHMARKS.md, table (k)'s trace). One program holds every row's logits: M x E floats, a few KiB.

Semantics (the reference is `route`'s, lax.top_k's order):
  * p = softmax(logits) per row: exp(l - max l) / sum;
  * the top k of p in descending order, ties to the lower expert index: k passes, each taking the row's
    maximum and, among entries equal to it, the lowest index, then masking that entry out;
  * weights renormalised to sum 1 over the k when `normalize`, then cast to out_dtype.
Rows, experts and the k choices are padded to powers of 2 (Triton's tensor shapes) by masked loads and stores
(padding experts at -inf: zero probability, never chosen while k <= E). Lowering: Pallas' Triton backend, as the
routed experts' kernel it feeds (routed_experts.py); interpret=True runs it on the CPU for the tests.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _common

MAX_ROWS = 64  # the routed experts' kernel takes at most this many rows


def _kernel(logits_ref, weights_ref, ids_ref, *, rows, experts, normalize):
    M, E = logits_ref.shape
    k = ids_ref.shape[1]
    width = _common.next_power_of_2(k)  # the kept choices' columns, past k masked on store
    row_ids, expert_ids = jnp.arange(rows), jnp.arange(experts)
    in_rows = row_ids < M
    mask = in_rows[:, None] & (expert_ids < E)[None, :]
    logits = pltriton.load(logits_ref.at[pl.ds(jnp.int32(0), rows), pl.ds(jnp.int32(0), experts)], mask=mask,
                           other=jnp.array(-jnp.inf, jnp.float32))
    e = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    p = e / jnp.sum(e, axis=1, keepdims=True)
    choice = jnp.arange(width)[None, :]
    weights = jnp.zeros((rows, width), jnp.float32)
    ids = jnp.zeros((rows, width), jnp.int32)
    for i in range(k):  # k passes: the largest left, ties to the lowest index, then masked out
        best = jnp.max(p, axis=1)
        # (a row of NaN logits matches nothing: clamped to a real expert, so no caller reads past the weights)
        index = jnp.minimum(jnp.min(jnp.where(p == best[:, None], expert_ids[None, :], experts), axis=1), E - 1)
        weights = jnp.where(choice == i, best[:, None], weights)
        ids = jnp.where(choice == i, index[:, None], ids)
        p = jnp.where(expert_ids[None, :] == index[:, None], -1.0, p)
    if normalize:
        weights = weights / jnp.sum(weights, axis=1, keepdims=True)
    window, stored = (pl.ds(jnp.int32(0), rows), pl.ds(jnp.int32(0), width)), in_rows[:, None] & (choice < k)
    pltriton.store(weights_ref.at[window], weights.astype(weights_ref.dtype), mask=stored)
    pltriton.store(ids_ref.at[window], ids, mask=stored)


def unsupported(rows: int, experts: int, k: int) -> str | None:
    """Why the kernel cannot take these shapes (None when it can)."""
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (the router kernel takes 1 to {MAX_ROWS})"
    if not 1 <= k <= experts:
        return f"top {k} of {experts} experts"
    return None


@functools.partial(jax.jit, static_argnames=("k", "normalize", "out_dtype", "interpret"))
def route_top_k(logits, *, k: int, normalize: bool, out_dtype, interpret: bool = False):
    """logits [M, E] float32 -> (weights [M, k] out_dtype, ids [M, k] int32): softmax, top k, renormalised
    when `normalize` (module docstring). Shapes the kernel cannot take raise ValueError naming them."""
    M, E = logits.shape
    reason = unsupported(M, E, k)
    if reason:
        raise ValueError(f"route_top_k cannot take {reason}")
    return pl.pallas_call(
        functools.partial(_kernel, rows=_common.next_power_of_2(M), experts=_common.next_power_of_2(E),
                          normalize=normalize),
        out_shape=(jax.ShapeDtypeStruct((M, k), out_dtype), jax.ShapeDtypeStruct((M, k), jnp.int32)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), interpret=interpret, name="moe_router",
    )(logits.astype(jnp.float32))
