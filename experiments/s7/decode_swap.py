"""Seventh session: the batch-1 decode loop with its matmuls swapped (keys, not query rows, fill the
wgmma's 64-row side), timing and validation only.

Per key block: S^T = K Q^T (wgmma M = 64 keys, N = RN = T * R query rows), a column softmax (the
row statistics of S reduce across warps), P stored to shared memory, O^T += V^T P^T (M = head_dim,
N = RN). At T = 1 the tensor work per block is 8x smaller than with Q on the 64-row side.

Output: per (batch row, KV head, split, compute warpgroup) the partial O^T / l and lse (broadcast
along head_dim) as [2, H, RN] f32, merged by the caller (the probe, in XLA). No clusters.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from decode_mgpu import causal_visible, query_window, rows_per_token, split_plan, warpgroup_plan, _compute_registers
from pallas_kernels import _common

_LOG2E = math.log2(math.e)
_COL = plgpu.Layout.WGMMA.reduce(0)  # per-column vectors of a wgmma result


def _kernel(start_ref, q_ref, k_ref, v_ref, part_ref, scratch, *, scale, bkv, stages, W, splits):
    q_smem, p_smem, ((k_smem, v_smem), stage), (k_ready, v_ready, q_ready), (k_free, v_free), ring_done = scratch
    T, N, H = q_ref.shape[1:]
    K, S = k_ref.shape[1], k_ref.shape[2]
    R = rows_per_token(N, K)
    RN = T * R
    dtype = q_ref.dtype
    head, b, split = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("split")
    start = start_ref[b]
    lo, hi = split_plan(start, split, num_tokens=T, capacity=S, block_kv=bkv, splits=splits)
    first, _ = query_window(head, num_heads=N, kv_heads=K)

    def slot_of(w, c):
        return w + W * lax.rem(c, stages)

    def compute(w):
        plgpu.set_max_registers(_compute_registers(W), action="increase")
        plgpu.barrier_wait(q_ready)

        def step(c, carry, *, masked):
            acc, m, l = carry
            i, slot = lo + w + W * c, slot_of(w, c)
            plgpu.barrier_wait(k_ready.at[slot])

            def qk(ref):
                plgpu.wgmma(ref, k_smem.at[slot], q_smem.transpose((1, 0)))
                return ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bkv, RN), jnp.float32))  # [keys, rows]
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * (scale * _LOG2E)
            if masked:
                keys = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                visible = causal_visible(rows, keys, start=start, step=i, num_tokens=T, rows_per_token=R,
                                         block_kv=bkv)
                s = jnp.where(visible, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=0))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
            l = l * alpha + p.sum(axis=0)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
            p_smem[w].transpose((1, 0))[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_ready.at[slot])
            acc = pl.run_state(
                lambda ref: plgpu.wgmma(ref, v_smem.at[slot].transpose((1, 0)), p_smem[w].transpose((1, 0)))
            )(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        carry = (
            plgpu.layout_cast(jnp.full((H, RN), 0, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((RN,), _common.M_INIT, jnp.float32), _COL),
            plgpu.layout_cast(jnp.full((RN,), 0, jnp.float32), _COL),
        )
        count, unmasked = warpgroup_plan(start, lo, hi, w, compute_warpgroups=W, block_kv=bkv)
        carry = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), carry)
        acc, m, l = lax.fori_loop(unmasked, count, functools.partial(step, masked=True), carry)
        seen = l > 0
        inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)
        plgpu.barrier_arrive(ring_done)  # the staging buffers share bytes with the ring
        plgpu.barrier_wait(ring_done)
        for kind, value in enumerate((acc * lax.broadcast_in_dim(inv, acc.shape, [1]),
                                      lax.broadcast_in_dim(lse, acc.shape, [1]))):
            stage[w][...] = value
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage[w], part_ref.at[b, head, split, w, kind])
            plgpu.wait_smem_to_gmem(0)

    def load():
        plgpu.set_max_registers(40, action="decrease")
        for t in range(T):  # queries first, ahead of the ring's blocks
            plgpu.copy_gmem_to_smem(q_ref.at[b, t, pl.ds(first, R)], q_smem.at[pl.ds(t * R, R)], q_ready)

        @pl.loop(0, hi - lo)
        def _(n):
            c, slot = lax.div(n, W), slot_of(lax.rem(n, W), lax.div(n, W))
            window = (b, head, pl.ds((lo + n) * bkv, bkv))
            for ref, smem, ready, free in ((k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free)):

                @pl.when(c >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                plgpu.copy_gmem_to_smem(ref.at[window], smem.at[slot], ready.at[slot])

    warpgroup = lax.axis_index("wg")
    for w in range(W):
        pl.when(warpgroup == w)(functools.partial(compute, w))
    pl.when(warpgroup == W)(load)


@functools.partial(jax.jit, static_argnames=("scale", "splits", "W", "bkv", "stages"))
def decode_swap_partials(q, k_cache, v_cache, start, *, scale, splits, W=2, bkv=64, stages=2):
    B, T, N, H = q.shape
    K = k_cache.shape[1]
    RN = T * rows_per_token(N, K)
    slots = W * stages
    tiled = functools.partial(plgpu.SMEM, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))

    def entry(start_ref, q_ref, k_ref, v_ref, part_ref):
        pl.run_scoped(
            lambda *scratch: _kernel(start_ref, q_ref, k_ref, v_ref, part_ref, scratch, scale=scale, bkv=bkv,
                                     stages=stages, W=W, splits=splits),
            tiled((RN, H), q.dtype),
            [tiled((RN, bkv), q.dtype) for _ in range(W)],
            plgpu.RefUnion(
                (tiled((slots, bkv, H), k_cache.dtype), tiled((slots, bkv, H), v_cache.dtype)),
                [plgpu.SMEM((H, RN), jnp.float32) for _ in range(W)],
            ),
            (plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_arrivals=T)),
            (plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots)),
            plgpu.Barrier(num_arrivals=W),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((B, K, splits, W, 2, H, RN), jnp.float32),
        grid=(K, B, splits),
        grid_names=("heads", "batch", "split"),
        num_threads=W + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(start, q, k_cache, v_cache)


def merge_partials(part, *, num_heads, dtype):
    """XLA merge of decode_swap_partials' output into [B, T, N, H] (validation only)."""
    B, K, P1, P2, _, H, RN = part.shape
    G, R = num_heads // K, rows_per_token(num_heads, K)
    T = RN // R
    o = part[:, :, :, :, 0].reshape(B, K, P1 * P2, H, RN)
    lse = part[:, :, :, :, 1, 0, :].reshape(B, K, P1 * P2, RN)
    w = jnp.exp2(lse - lse.max(axis=2, keepdims=True))
    merged = jnp.einsum("bkpr,bkphr->bkhr", w, o) / w.sum(axis=2)[:, :, None, :]  # [B, K, H, RN]
    out = jnp.zeros((B, T, num_heads, H), jnp.float32)
    for h in range(K):
        first = (h * G) // R * R
        off = h * G - first
        for t in range(T):
            out = out.at[:, t, h * G:(h + 1) * G, :].set(merged[:, h, :, t * R + off:t * R + off + G].transpose(0, 2, 1))
    return out.astype(dtype)
