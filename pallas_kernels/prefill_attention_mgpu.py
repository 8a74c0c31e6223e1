"""Causal GQA flash attention for prefill, lowered through Mosaic GPU (TMA + wgmma) for Hopper.

Same contract as prefill_attention (q [B, T, N, H]; caches [B, K, S, H] already holding the T new
tokens at start .. start + T - 1; start [B] int32; rows with start + T > S are don't-care), with
one precondition more: V's slots at and past start + T must hold finite values. The TMA moves
whole key blocks, so the last block of a tile may carry slots past start + T; the causal mask gives
them weight 0, but 0 * NaN is NaN in P V (K there is harmless: its logits are replaced). The
engine's caches are zeroed at creation and only ever written with K/V, so they always qualify;
slots past S are filled with zeros by the TMA itself. Hopper only (wgmma): the model checks.

Structure (FlashAttention-3's producer/consumer split):
- One CTA per (query head n, pair of query tiles, batch row b), of three warpgroups. The two
  compute warpgroups own one tile of BLOCK_Q tokens each (the pair's first and second); the
  third only issues TMA loads of head n // G's key and value blocks into a ring of num_stages
  shared-memory slots, and waits for both compute warpgroups to free a slot before refilling it.
  Query heads vary fastest in the grid, so the G heads of one KV head run side by side and share
  its blocks in L2; pairs run longest first.
- A compute step: S = Q K^T (wgmma into registers), masked online softmax in base 2, O += P V
  (wgmma, P from registers). With ping_pong, a barrier shared by the two compute warpgroups makes
  one run its softmax while the other's matmuls hold the tensor cores.
- The tiling plan (pair_plan, tile_plan) and the causal mask (causal_visible) are plain functions
  of scalars and iotas: the kernel calls them on traced values, the CPU tests on concrete ones.

Testing. The kernel cannot run in jax 0.12's Mosaic GPU interpreter (its pipelined wgmma under
pl.run_state has no CPU rule). So:
- on the CPU, tests/test_prefill_mgpu.py walks the kernel's tiles with pair_plan and
  causal_visible and checks that each query reads exactly the keys the reference lets it see, and
  that no tile reads a block it does not need;
  and it lowers the kernel to Mosaic GPU for CUDA, which runs all of its tracing and shape checks;
- on the GPU, tests/test_gpu.py (`pytest -m gpu`) and eagle3_jax_bench/attention.py's
  `mosaic_check` compare the kernel with
  attention_reference (token tails, start > 0 and differing within a batch, a prompt overflowing
  the cache, GQA 1 to 8, head_dim 64 and 128), and its `prefill` section times it against the
  Triton kernel, cuDNN and JAX's own Mosaic GPU kernel.
Why this lowering for prefill: see the package docstring (pallas_kernels/__init__.py).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common

_LOG2E = math.log2(math.e)
_COMPUTE_WARPGROUPS = 2  # tiles per CTA; the third warpgroup loads K/V
BLOCK_Q = 64  # tokens per compute warpgroup: the rows of one warpgroup's wgmma


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
    block_kv: int = 128  # keys per step
    num_stages: int = 2  # K/V slots in the ring
    ping_pong: bool = True  # alternate the compute warpgroups' softmax and matmuls

    def __post_init__(self):
        if self.block_kv % 64 or self.block_kv < 64:
            raise ValueError(f"{self.block_kv=} must be a multiple of 64")
        if self.num_stages < 2:
            raise ValueError(f"{self.num_stages=} must be >= 2")


def unsupported(q, k_cache, v_cache, config: MosaicPrefillConfig = MosaicPrefillConfig()) -> str | None:
    """Why this kernel cannot take these operands, or None when it can.

    The TMA's tiled boxes need 16-bit data and token and slot counts that are multiples of 8;
    head_dim 64 or 128 keeps the ring in shared memory; caches shorter than one key block are
    left to the Triton kernel (never measured here).
    """
    _, T, _, H = q.shape
    S = k_cache.shape[2]
    dtypes = {jnp.dtype(x.dtype) for x in (q, k_cache, v_cache)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs q and caches all bf16 or all f16, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
    if H not in (64, 128):
        return f"needs head_dim 64 or 128, got {H}"
    if T % 8:
        return f"needs a token count that is a multiple of 8, got T={T}"
    if S % 8:
        return f"needs a cache capacity that is a multiple of 8, got S={S}"
    if S < config.block_kv:
        return f"needs a cache of at least {config.block_kv} slots (one key block), got S={S}"
    return None


def pair_plan(start, pair, warpgroup, *, num_tokens: int, capacity: int, block_kv: int):
    """The work of one CTA: (first_token, full, steps) of compute warpgroup `warpgroup`'s tile
    (see tile_plan), and pair_steps, the key blocks the loader fills for the pair: its second
    tile's steps, which are the most either tile takes."""
    plan = functools.partial(tile_plan, start, num_tokens=num_tokens, capacity=capacity, block_kv=block_kv)
    first_token = (_COMPUTE_WARPGROUPS * pair + warpgroup) * BLOCK_Q
    full, steps = plan(first_token)
    _, pair_steps = plan((_COMPUTE_WARPGROUPS * pair + _COMPUTE_WARPGROUPS - 1) * BLOCK_Q)
    return first_token, full, steps, pair_steps


def tile_plan(start, first_token, *, num_tokens: int, capacity: int, block_kv: int):
    """Key blocks of the tile of tokens first_token .. first_token + BLOCK_Q - 1.

    Returns (full, steps): blocks [0, full) hold keys every row of the tile sees (no mask);
    blocks [full, steps) hold the rest of what some row sees (causal mask). Works on traced
    scalars (the kernel) and Python ints (the tests).
    """
    length = jnp.minimum(start + num_tokens, capacity)  # keys in use; rows past the cache are don't-care
    full = lax.div(jnp.minimum(start + first_token + 1, length), block_kv)
    last = jnp.minimum(start + first_token + BLOCK_Q, length)  # one past the tile's last key
    steps = lax.div(last + block_kv - 1, block_kv)
    return full, steps


def causal_visible(row_iota, key_iota, *, start, first_token, step, block_kv: int):
    """Which keys of block `step` tile rows see: key <= start + token (iotas of the tile's shape)."""
    return key_iota + step * block_kv <= row_iota + (start + first_token)


def _kernel(start_ref, q_ref, k_ref, v_ref, o_ref, scratch, *, scale, config, num_pairs):
    # start_ref [B] int32; q_ref, o_ref [B, T, N, H]; k_ref, v_ref [B, K, S, H], all in GMEM.
    (q_smem, k_smem, v_smem), (k_ready, v_ready, q_ready), (k_free, v_free), schedule = scratch
    bq, bkv, stages = BLOCK_Q, config.block_kv, config.num_stages
    T, N, H = q_ref.shape[1:]
    K, S = k_ref.shape[1], k_ref.shape[2]
    dtype = q_ref.dtype
    head, b = lax.axis_index("heads"), lax.axis_index("batch")
    pair = num_pairs - 1 - lax.axis_index("pairs")  # longest first
    warpgroup = lax.axis_index("wg")
    start = start_ref[b]
    # (The loader warpgroup uses pair_steps only.)
    first, full, steps, pair_steps = pair_plan(start, pair, warpgroup, num_tokens=T, capacity=S, block_kv=bkv)

    def take_turn():  # with ping_pong: both compute warpgroups meet here
        if config.ping_pong:
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

    @pl.when(warpgroup < _COMPUTE_WARPGROUPS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_tile = q_smem.at[warpgroup]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(first, bq), head], q_tile, q_ready.at[warpgroup])
        plgpu.barrier_wait(q_ready.at[warpgroup])
        carry = (
            plgpu.layout_cast(jnp.full((bq, H), 0, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.full((bq,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(k_ready.at[0])

        pl.when(warpgroup == 1)(take_turn)  # offsets the two warpgroups by one turn

        def step(i, carry, *, masked):
            acc, m, l = carry
            slot = lax.rem(i, stages)

            def qk(ref):
                plgpu.wgmma(ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                take_turn()
                return ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * (scale * _LOG2E)  # logits in base 2: exp2 below
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA)
                keys = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
                visible = causal_visible(rows, keys, start=start, first_token=first, step=i, block_kv=bkv)
                s = jnp.where(visible, s, -jnp.inf)
            # Every row sees key 0 in the first block it reads, so m is finite from then on.
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p = p.astype(dtype)
            if config.ping_pong:
                plgpu.barrier_arrive(schedule)  # softmax done: the other may take the tensor cores
            plgpu.barrier_wait(v_ready.at[slot])
            if config.ping_pong:
                plgpu.barrier_wait(schedule)

            def pv(ref):
                plgpu.wgmma(ref, p, v_smem.at[slot])

                @pl.when(i + 1 < steps)  # wait for the next keys while this matmul runs
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(i + 1, stages)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
        acc, _, l = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)

        def skip(i, _):  # steps the loader fills for the other tile only
            slot = lax.rem(i, stages)
            # Waiting for the fill first keeps this warpgroup from freeing a slot's next use
            # before the other one has read its current one.
            for ready, free in ((k_ready, k_free), (v_ready, v_free)):
                plgpu.barrier_wait(ready.at[slot])
                plgpu.barrier_arrive(free.at[slot])
            take_turn()
            take_turn()

        lax.fori_loop(steps, pair_steps, skip, None)
        pl.when(warpgroup == 0)(take_turn)
        q_tile[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        # Rows past T fall outside o_ref: the TMA store drops them.
        plgpu.copy_smem_to_gmem(q_tile, o_ref.at[b, pl.ds(first, bq), head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(warpgroup == _COMPUTE_WARPGROUPS)
    def _load():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, N // K)

        @pl.loop(0, pair_steps)
        def _(i):
            slot = lax.rem(i, stages)
            window = (b, kv_head, pl.ds(i * bkv, bkv))
            for ref, smem, ready, free in ((k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free)):

                @pl.when(i >= stages)  # the first round fills an empty ring
                def _():
                    plgpu.barrier_wait(free.at[slot])

                plgpu.copy_gmem_to_smem(ref.at[window], smem.at[slot], ready.at[slot])


@functools.partial(jax.jit, static_argnames=("scale", "config"))
def _prefill(q, k_cache, v_cache, start, *, scale, config):
    B, T, N, H = q.shape
    bq, bkv, stages = BLOCK_Q, config.block_kv, config.num_stages
    num_pairs = -(-T // (_COMPUTE_WARPGROUPS * bq))
    smem = functools.partial(plgpu.SMEM, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))

    def entry(start_ref, q_ref, k_ref, v_ref, o_ref):
        pl.run_scoped(
            lambda *scratch: _kernel(
                start_ref, q_ref, k_ref, v_ref, o_ref, scratch, scale=scale, config=config, num_pairs=num_pairs
            ),
            (
                smem((_COMPUTE_WARPGROUPS, bq, H), q.dtype),  # a tile's queries, then its output
                smem((stages, bkv, H), k_cache.dtype),
                smem((stages, bkv, H), v_cache.dtype),
            ),
            (
                plgpu.Barrier(num_barriers=stages),  # K slot filled
                plgpu.Barrier(num_barriers=stages),  # V slot filled
                plgpu.Barrier(num_barriers=_COMPUTE_WARPGROUPS),  # query tile loaded
            ),
            (  # slot read by both compute warpgroups
                plgpu.Barrier(num_arrivals=_COMPUTE_WARPGROUPS, num_barriers=stages),
                plgpu.Barrier(num_arrivals=_COMPUTE_WARPGROUPS, num_barriers=stages),
            ),
            plgpu.Barrier(num_arrivals=_COMPUTE_WARPGROUPS),  # ping-pong turns
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(N, num_pairs, B),
        grid_names=("heads", "pairs", "batch"),
        num_threads=_COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(start, q, k_cache, v_cache)


def prefill_attention_mgpu(q, k_cache, v_cache, start, *, scale, **static_tuning):
    """Causal GQA attention of T new tokens over a KV cache, in one Mosaic GPU kernel (GPU only).

    Contract: prefill_attention's, plus finite cache slots past start + T (module docstring).
    static_tuning: fields of MosaicPrefillConfig.
    """
    _common.check_shapes(q, k_cache, v_cache, start)
    config = MosaicPrefillConfig(**static_tuning)
    if reason := unsupported(q, k_cache, v_cache, config):
        raise ValueError(f"Mosaic GPU prefill attention {reason}")
    return _prefill(q, k_cache, v_cache, start.astype(jnp.int32), scale=float(scale), config=config)
