"""Split-K GQA attention for decode and verify (T new tokens, T * max(8, G) <= 64 rows), lowered
through Mosaic GPU for Hopper, with the split-K merge done inside one thread-block cluster.

Same contract as decode_attention (q [B, T, N, H]; caches [B, K, S, H] already holding the new
tokens at start .. start + T - 1; start [B] int32; rows with start + T > S are don't-care), with
prefill_attention_mgpu's precondition: V's slots at and past start + T must be finite, because
the TMA moves whole key blocks (the engine's caches are zero-initialised, so they always are).

Why a second decode kernel: at batch 1 the Triton kernel splits each KV head's keys over 16
programs and merges their partial outputs in a second kernel launch, which costs about 2 us of a
21 us call at 16k keys. Here the splits of one (b, KV head) are the CTAs of one cluster, and
they merge through distributed shared memory in the same kernel.

Structure: a cluster of `splits` CTAs per (KV head h, batch row b); CTA j takes a balanced share
of the key blocks in use (split_plan). Each CTA has a loader warpgroup, which streams its blocks
of K and V into a ring of num_stages shared-memory slots by TMA, and a compute warpgroup:
- Queries: the rows of one wgmma tile (64) hold, per token t, the R = max(8, G) query heads
  starting at the multiple of R at or below h * G (query_window): one 8-row-aligned TMA box per
  token. Of those R rows, G (at offset off) are head h's; the rest are other heads' queries,
  computed and never stored, as are rows past T * R.
- Per key block: S = Q K^T (wgmma), causal mask (row r is token r // R), online softmax in base
  2, O += P V (wgmma).
- Merge: every CTA publishes its row maxima and sums in shared memory; after a cluster barrier
  each reads all of them, scales its own O by exp2(m_j - M) / L and publishes that; after a
  second barrier CTA j sums token t's G rows over the cluster for the tokens t = j (mod splits)
  and stores them to o; a third barrier keeps every CTA's shared memory alive until the others
  have read it. With one split there is no cluster and O / l is stored directly.

Testing: as for prefill_attention_mgpu (its docstring): the plan functions run on concrete values
in tests/test_decode_mgpu.py against the reference's visibility, the tests lower the whole kernel
for CUDA, and bench_attention.py's `mosaic_check` runs it against the reference on the GPU.
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
TILE_ROWS = 64  # the rows of one wgmma: every query row of a CTA
_ROW = plgpu.Layout.WGMMA.reduce(1)  # per-row vectors of a wgmma result


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    block_kv: int = 64  # keys per step
    num_stages: int = 2  # K/V slots in the ring per compute warpgroup
    compute_warpgroups: int = 2  # each takes every W-th key block of the CTA's share
    # CTAs per cluster. 8 by measurement: clusters of 16 (Hopper's non-portable maximum) stream
    # keys 21% slower at batch 1 (BENCHMARKS.md, sixth session).
    max_splits: int = 8
    wave_slots: int = 132  # CTAs the H200 runs at once (one per SM)
    merge: str = "lse"  # "lse": owner combines (o / l, lse) rows; "none": timing only, unmerged rows stored
    pad: int = 8  # f32 words of padding per staging row: row stride = 8 banks mod 32, conflict-free stores
    combine: str = "full"  # timing variants of the owner's combine: "full", "o_only", "local" (own buffers)
    q_first: bool = False  # the loader issues the queries' TMA boxes before the ring's blocks
    cluster: bool = True  # False: no cluster (merge "none" only)
    profile_dir: str = ""  # Mosaic GPU's on-device profiler trace (named scopes), when set

    def __post_init__(self):
        if self.block_kv % 64 or self.block_kv < 64:
            raise ValueError(f"{self.block_kv=} must be a multiple of 64")
        if self.num_stages < 1 or self.compute_warpgroups not in (1, 2, 3):
            raise ValueError(f"{self.num_stages=} must be >= 1 and {self.compute_warpgroups=} 1, 2 or 3")
        if not (_common.is_power_of_2(self.max_splits) and self.max_splits <= 16):
            raise ValueError(f"{self.max_splits=} must be a power of 2 <= 16")

    def splits_for(self, batch: int, kv_heads: int, capacity: int) -> int:
        """The most splits (a power of 2) that keep all CTAs in one wave, at most one per block."""
        splits = 1
        while (splits < self.max_splits and batch * kv_heads * splits * 2 <= self.wave_slots
               and splits * 2 <= -(-capacity // self.block_kv)):
            splits *= 2
        return splits


def rows_per_token(num_heads: int, kv_heads: int) -> int:
    """R: a token's rows in the tile, a whole number of 8-row TMA boxes holding its G heads."""
    return max(8, num_heads // kv_heads)


def query_window(kv_head, *, num_heads: int, kv_heads: int):
    """(first, off): the tile takes query heads first .. first + R - 1 of each token; kv_head's G
    heads are rows off .. off + G - 1 of them."""
    group, rows = num_heads // kv_heads, rows_per_token(num_heads, kv_heads)
    first = lax.div(kv_head * group, rows) * rows
    return first, kv_head * group - first


def split_plan(start, split, *, num_tokens: int, capacity: int, block_kv: int, splits: int):
    """Key blocks [lo, hi) of split `split`: a balanced share of the blocks in use,
    [0, ceil(min(start + T, S) / block_kv)); splits past the blocks in use get none."""
    length = jnp.minimum(start + num_tokens, capacity)
    blocks = lax.div(length + block_kv - 1, block_kv)
    return lax.div(split * blocks, splits), lax.div((split + 1) * blocks, splits)


def warpgroup_plan(start, lo, hi, warpgroup, *, compute_warpgroups: int, block_kv: int):
    """(count, unmasked): compute warpgroup w takes blocks lo + w + W * c for c in [0, count);
    those with c < unmasked hold only keys <= start, which every row sees (no mask)."""
    W = compute_warpgroups
    count = lax.div(jnp.maximum(hi - lo - warpgroup, 0) + W - 1, W)
    full = lax.div(start + 1, block_kv)  # blocks [0, full) hold only keys <= start
    unmasked = lax.div(jnp.maximum(full - lo - warpgroup, 0) + W - 1, W)
    return count, jnp.minimum(unmasked, count)


def causal_visible(row_iota, key_iota, *, start, step, num_tokens: int, rows_per_token: int, block_kv: int):
    """Which keys of block `step` the tile's rows see: key <= start + token of the row (rows past
    T * R count as token T - 1)."""
    token = jnp.minimum(lax.div(row_iota, rows_per_token), num_tokens - 1)
    return key_iota + step * block_kv <= token + start


_SMEM_BYTES = 232448  # the H200's shared memory per CTA (227 KB)


def smem_bytes(T, N, K, H, config: MosaicDecodeConfig) -> int:
    """Shared memory of one CTA (without barriers): queries, and the larger of the K/V ring and the
    merge buffers (per compute warpgroup: staging rows of o / l and lse, and per-token copies), which
    share bytes."""
    W = config.compute_warpgroups
    ring = 2 * W * config.num_stages * config.block_kv * H * 2
    merge = W * (TILE_ROWS * (H + config.pad) * 4 + 2 * T * (N // K) * H * 4)
    return TILE_ROWS * H * 2 + max(ring, merge)


def unsupported(q, k_cache, v_cache, config: MosaicDecodeConfig = MosaicDecodeConfig()) -> str | None:
    """Why this kernel cannot take these operands, or None when it can."""
    _, T, N, H = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    G = N // K
    dtypes = {jnp.dtype(x.dtype) for x in (q, k_cache, v_cache)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs q and caches all bf16 or all f16, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
    if H not in (64, 128):
        return f"needs head_dim 64 or 128, got {H}"
    if (8 % G if G < 8 else G % 8) or N % 8:
        return f"needs G = N / K dividing 8 or a multiple of 8 and N a multiple of 8, got N={N}, K={K}"
    if T * rows_per_token(N, K) > TILE_ROWS:
        return f"needs T * max(8, G) <= {TILE_ROWS} query rows, got T={T}, G={G}"
    if G * H < 128:
        return f"needs G * head_dim >= 128 (a warpgroup's store), got G={G}, H={H}"
    if S < config.block_kv:
        return f"needs a cache of at least {config.block_kv} slots (one key block), got S={S}"
    if (need := smem_bytes(T, N, K, H, config)) > _SMEM_BYTES - (16384 if config.profile_dir else 0):
        return f"needs {need} bytes of shared memory, more than the {_SMEM_BYTES} a CTA has"
    return None


def _kernel(start_ref, q_ref, k_ref, v_ref, o_ref, scratch, *, scale, config, splits):
    # start_ref [B] int32; q_ref, o_ref [B, T, N, H]; k_ref, v_ref [B, K, S, H], all in GMEM.
    (q_smem, ((k_smem, v_smem), (stage, tok_o, tok_lse))), (k_ready, v_ready, q_ready), (
        k_free, v_free), (ring_done, meet) = scratch
    bkv, stages, W = config.block_kv, config.num_stages, config.compute_warpgroups
    T, N, H = q_ref.shape[1:]
    K, S = k_ref.shape[1], k_ref.shape[2]
    G, R = N // K, rows_per_token(N, K)
    dtype = q_ref.dtype
    head, b = lax.axis_index("heads"), lax.axis_index("batch")
    split = lax.axis_index("split") if splits > 1 else 0
    assert config.cluster or config.merge in ("none", "gmem")
    if config.merge == "gmem":
        o_ref, part_ref, lse_ref = o_ref
    start = start_ref[b]
    lo, hi = split_plan(start, split, num_tokens=T, capacity=S, block_kv=bkv, splits=splits)
    first, off = query_window(head, num_heads=N, kv_heads=K)
    if splits > 1:
        peers = [functools.partial(plgpu.cluster_ref, block_id={"split": p}) for p in range(splits)]
    else:
        peers = [lambda ref: ref]
    token_layout = plgpu.Layout.WG_STRIDED((G, H), vec_size=min(4, G * H // 128))

    def slot_of(w, c):  # warpgroup w's c-th block: its own slots, so barrier parities stay per warpgroup
        return w + W * lax.rem(c, stages)

    def compute(w):
        plgpu.set_max_registers(_compute_registers(W), action="increase")

        if w == 0 and not config.q_first:  # loads every compute warpgroup's queries
            for t in range(T):
                plgpu.copy_gmem_to_smem(q_ref.at[b, t, pl.ds(first, R)], q_smem.at[pl.ds(t * R, R)], q_ready)

        with jax.named_scope("q_wait"):
            plgpu.barrier_wait(q_ready)

        def step(c, carry, *, masked):
            acc, m, l = carry
            i, slot = lo + w + W * c, slot_of(w, c)
            with jax.named_scope("k_wait"):
                plgpu.barrier_wait(k_ready.at[slot])
            with jax.named_scope("block"):

                def qk(ref):
                    plgpu.wgmma(ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    return ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((TILE_ROWS, bkv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                s = s * (scale * _LOG2E)  # logits in base 2: exp2 below
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                    keys = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                    visible = causal_visible(rows, keys, start=start, step=i, num_tokens=T, rows_per_token=R,
                                             block_kv=bkv)
                    s = jnp.where(visible, s, -jnp.inf)
                # m starts finite (M_INIT): a block with no key visible to a row leaves it unchanged.
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            with jax.named_scope("v_wait"):
                plgpu.barrier_wait(v_ready.at[slot])
            with jax.named_scope("pv"):
                acc = pl.run_state(lambda ref: plgpu.wgmma(ref, p.astype(dtype), v_smem.at[slot]))(
                    plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        carry = (
            plgpu.layout_cast(jnp.full((TILE_ROWS, H), 0, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((TILE_ROWS,), _common.M_INIT, jnp.float32), _ROW),
            plgpu.layout_cast(jnp.full((TILE_ROWS,), 0, jnp.float32), _ROW),
        )
        count, unmasked = warpgroup_plan(start, lo, hi, w, compute_warpgroups=W, block_kv=bkv)
        carry = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), carry)
        acc, m, l = lax.fori_loop(unmasked, count, functools.partial(step, masked=True), carry)

        if config.merge == "gmem":  # timing: the partial's rows (all 64) and lse straight to global memory
            with jax.named_scope("publish"):
                seen = l > 0
                inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
                part_ref.at[b, head, split, w][...] = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
                lse_ref.at[b, head, split, w][...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)
            return
        # Each partial publishes, per token, its G rows of o / l and of lse = m + log2(l) (broadcast
        # along H, so that the owner's combine is elementwise in one layout). A partial with no key
        # visible to a row has l = 0: its rows publish o = 0 and lse = -inf, weight 0.
        with jax.named_scope("ring_done"):  # the merge buffers share bytes with the ring
            plgpu.barrier_arrive(ring_done)
            plgpu.barrier_wait(ring_done)
        with jax.named_scope("publish"):
            seen = l > 0
            inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
            lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)
            for name, rows_value, bufs in (("o", acc * lax.broadcast_in_dim(inv, acc.shape, [0]), tok_o),
                                           ("lse", lax.broadcast_in_dim(lse, acc.shape, [0]), tok_lse)):
                stage[w].at[:, pl.ds(0, H)][...] = rows_value
                plgpu.commit_smem()  # the warpgroup's rows are all staged before any token's are read
                for t in range(T):
                    bufs[w][t][...] = plgpu.load(stage[w].at[pl.ds(t * R + off, G), pl.ds(0, H)], (),
                                                 layout=token_layout)
                plgpu.commit_smem()  # ... and all read before the staging buffer is reused
        if config.merge == "none":  # timing only: the partial's own rows, unmerged
            for t in range(T):
                o_ref.at[b, t, pl.ds(head * G, G)][...] = tok_o[w][t][...].astype(dtype)
            return
        with jax.named_scope("meet1"):
            _meet(meet.at[0])
        with jax.named_scope("combine"):
            for t in range(T):  # token t: combined and stored by warpgroup (t // splits) % W of split t % splits
                if (t // splits) % W != w:
                    continue

                @pl.when(split == t % splits)
                def _():
                    src = [(lambda r: r)] * splits if config.combine == "local" else peers
                    with jax.named_scope("c_load"):
                        outs = [plgpu.load(peer(bufs[t]), (), layout=token_layout) for peer in src for bufs in tok_o]
                        if config.combine != "o_only":
                            lses = [plgpu.load(peer(bufs[t]), (), layout=token_layout)
                                    for peer in src for bufs in tok_lse]
                    with jax.named_scope("c_math"):
                        if config.combine == "o_only":
                            o = functools.reduce(jnp.add, outs)
                        else:
                            top = functools.reduce(jnp.maximum, lses)  # finite: some partial holds key 0
                            weights = [jnp.exp2(x - top) for x in lses]
                            total = functools.reduce(jnp.add, weights)
                            o = functools.reduce(jnp.add, [wt * x for wt, x in zip(weights, outs)]) / total
                    o_ref.at[b, t, pl.ds(head * G, G)][...] = o.astype(dtype)

        with jax.named_scope("meet2"):
            _meet(meet.at[1])  # no CTA exits while another may still read its token buffers

    def load():
        plgpu.set_max_registers(40, action="decrease")
        if config.q_first:
            for t in range(T):
                plgpu.copy_gmem_to_smem(q_ref.at[b, t, pl.ds(first, R)], q_smem.at[pl.ds(t * R, R)], q_ready)

        @pl.loop(0, hi - lo)
        def _(n):
            c, slot = lax.div(n, W), slot_of(lax.rem(n, W), lax.div(n, W))
            window = (b, head, pl.ds((lo + n) * bkv, bkv))
            for ref, smem, ready, free in ((k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free)):

                @pl.when(c >= stages)  # the first round fills an empty ring
                def _():
                    with jax.named_scope("free_wait"):
                        plgpu.barrier_wait(free.at[slot])

                plgpu.copy_gmem_to_smem(ref.at[window], smem.at[slot], ready.at[slot])

    warpgroup = lax.axis_index("wg")
    for w in range(W):
        pl.when(warpgroup == w)(functools.partial(compute, w))
    pl.when(warpgroup == W)(load)


def _compute_registers(compute_warpgroups):
    """Registers per thread of a compute warpgroup: what the loader's 40 leave, a multiple of 8."""
    return min(232, (65536 // 128 - 40) // compute_warpgroups // 8 * 8)


def _meet(barrier):
    """All compute warpgroups of the cluster (of the CTA, with one split) meet; their
    shared-memory stores before it are visible to the reads after it."""
    plgpu.commit_smem()
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


@functools.partial(jax.jit, static_argnames=("scale", "config"))
def _decode(q, k_cache, v_cache, start, *, scale, config):
    B, T, N, H = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    G = N // K
    bkv, W = config.block_kv, config.compute_warpgroups
    slots = W * config.num_stages
    splits = config.splits_for(B, K, S)
    tiled = functools.partial(plgpu.SMEM, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    f32 = functools.partial(plgpu.SMEM, dtype=jnp.float32)
    mesh = dict(grid=(K, B), grid_names=("heads", "batch"))
    if splits > 1 and not config.cluster:
        mesh = dict(grid=(K, B, splits), grid_names=("heads", "batch", "split"))
        meet = plgpu.Barrier(num_arrivals=W, num_barriers=2)
    elif splits > 1:
        mesh |= dict(cluster=(splits,), cluster_names=("split",))
        meet = plgpu.ClusterBarrier(collective_axes=("split",), num_arrivals=W, num_barriers=2)
    else:
        meet = plgpu.Barrier(num_arrivals=W, num_barriers=2)

    def entry(start_ref, q_ref, k_ref, v_ref, *o_ref):
        o_ref = o_ref if config.merge == "gmem" else o_ref[0]
        pl.run_scoped(
            lambda *scratch: _kernel(
                start_ref, q_ref, k_ref, v_ref, o_ref, scratch, scale=scale, config=config, splits=splits
            ),
            (
                tiled((TILE_ROWS, H), q.dtype),
                plgpu.RefUnion(
                    (tiled((slots, bkv, H), k_cache.dtype), tiled((slots, bkv, H), v_cache.dtype)),
                    (
                        [f32((TILE_ROWS, H + config.pad)) for _ in range(W)],  # o / l, then lse; padded rows
                        [[f32((G, H)) for _ in range(T)] for _ in range(W)],  # per token: o / l rows
                        [[f32((G, H)) for _ in range(T)] for _ in range(W)],  # per token: lse rows
                    ),
                ),
            ),
            (
                plgpu.Barrier(num_barriers=slots),  # K slot filled
                plgpu.Barrier(num_barriers=slots),  # V slot filled
                plgpu.Barrier(num_arrivals=T),  # one query box per token
            ),
            (plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots)),  # slot read
            (plgpu.Barrier(num_arrivals=W), meet),  # compute warpgroups done with the ring; cluster meets
            collective_axes="wg",
        )

    params = dict(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane)
    if config.profile_dir:
        params |= dict(profile_space=160, profile_dir=config.profile_dir)
    out = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),) + ((
            jax.ShapeDtypeStruct((B, K, splits, W, TILE_ROWS, H), jnp.float32),
            jax.ShapeDtypeStruct((B, K, splits, W, TILE_ROWS), jnp.float32)) if config.merge == "gmem" else ()),
        num_threads=W + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(**params),
        **mesh,
    )(start, q, k_cache, v_cache)
    return out if config.merge == "gmem" else out[0]


def decode_attention_mgpu(q, k_cache, v_cache, start, *, scale, **static_tuning):
    """Causal GQA attention of T (small) new tokens over a KV cache, in one Mosaic GPU kernel
    (GPU only). static_tuning: fields of MosaicDecodeConfig."""
    _common.check_shapes(q, k_cache, v_cache, start)
    config = MosaicDecodeConfig(**static_tuning)
    if reason := unsupported(q, k_cache, v_cache, config):
        raise ValueError(f"Mosaic GPU decode attention {reason}")
    return _decode(q, k_cache, v_cache, start.astype(jnp.int32), scale=float(scale), config=config)
