"""Ragged paged attention: the Mosaic GPU kernel in jax's GPU interpreter, the XLA path, and the page
write, against the dense reference (pallas_kernels.reference.paged_attention_reference), which
assembles each sequence's cache page by page and runs attention_reference on it.

Batches mix decode (1 query), verify (gamma + 1 = 4) and prefill-chunk queries over KV lengths
that end on, before and after page edges, with pages in shuffled order. Pages no sequence uses hold
NaN and page-table entries past a sequence's pages are out of range: a path that reads either turns
its output NaN. Slots past kv_len inside a page in use hold large finite values (the kernel's
precondition: it reads them, masked), which a leaked key or value would dominate.
What the interpreter does not check (swizzled layouts, wgmma, timing) the H200 bench does
(eagle3_jax_bench/paged_attention.py compares each timed shape with the XLA path).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from eagle3_jax.models import kv_cache
from eagle3_jax.models.layers import apply_rope, rms_norm
from eagle3_jax.models.paged_attention import (
    attention_block,
    paged_attention_xla,
    token_positions,
    write_pages,
)
from pallas_kernels.ragged_paged_attention import RaggedPagedConfig, ragged_paged_attention, unsupported
from pallas_kernels.reference import paged_attention_reference

from cuda_lowering import lower_for_cuda

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def ragged_batch(seed, q_lens, kv_lens, *, K, G, H, page_size, dtype, spare_pages=3, extra_tokens=2):
    """(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens) with shuffled pages (see the docstring)."""
    rng = np.random.default_rng(seed)
    pages_per_seq = max(-(-n // page_size) for n in kv_lens) + 1
    used = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(used) + spare_pages
    order = rng.permutation(num_pages)
    table = np.full((len(kv_lens), pages_per_seq), num_pages + 5, np.int32)  # past the pool: never read
    k = rng.standard_normal((K, num_pages, page_size, H)).astype(np.float32)
    v = rng.standard_normal((K, num_pages, page_size, H)).astype(np.float32)
    referenced = np.zeros(num_pages, bool)
    taken = 0
    for s, (n, u) in enumerate(zip(kv_lens, used)):
        table[s, :u] = order[taken:taken + u]
        taken += u
        referenced[table[s, :u]] = True
        last, fill = table[s, u - 1], n - (u - 1) * page_size
        k[:, last, fill:], v[:, last, fill:] = 30.0, 1e3  # past kv_len in a page in use: finite, loud
    k[:, ~referenced], v[:, ~referenced] = np.nan, np.nan
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]) + extra_tokens, K * G, H)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table),
            jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu))


def check(out, ref, cu_q_lens, dtype):
    n = int(cu_q_lens[-1])
    out, ref = np.asarray(out[:n].astype(jnp.float32)), np.asarray(ref[:n].astype(jnp.float32))
    assert np.isfinite(out).all(), "unwritten output, or a page or slot past kv_len leaked"
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < TOLERANCE[dtype], err


# (q_lens, kv_lens, page_size, G): decode, verify and chunk queries in one batch; kv_len on a page
# edge, one before and one after it, one key only; a sequence with no queries (skipped).
MIXES = [
    ([1, 4, 36, 1], [16, 17, 47, 1], 16, 4),
    ([4, 0, 1, 4, 9], [8, 5, 31, 4, 64], 8, 2),
    ([1, 4, 1], [129, 255, 128], 128, 4),
]


@pytest.mark.parametrize("mix,dtype", [(MIXES[0], jnp.float32), (MIXES[0], jnp.bfloat16), (MIXES[1], jnp.float32),
                                       (MIXES[2], jnp.bfloat16)], ids=["page16-f32", "page16-bf16", "page8-f32",
                                                                       "page128-bf16"])
def test_xla_path_matches_the_dense_reference(mix, dtype):
    q_lens, kv_lens, page_size, G = mix
    args = ragged_batch(0, q_lens, kv_lens, K=2, G=G, H=64, page_size=page_size, dtype=dtype)
    out = paged_attention_xla(*args, scale=0.125, max_q_len=max(q_lens))
    assert out.shape == args[0].shape and out.dtype == dtype
    check(out, paged_attention_reference(*args, scale=0.125), args[5], dtype)
    assert not np.asarray(out[int(args[5][-1]):]).any()  # tokens of no sequence: zeros


# (mix, dtype, tuning): pages smaller than a key block (several TMAs per block), equal to one, and
# larger (a block is a slice of a page); one split and several, merged in XLA. The chunk of MIXES[0]
# takes two compute warpgroups per CTA (bf16 and three splits: the race test below).
KERNEL_CASES = [
    (MIXES[0], jnp.float32, dict(block_kv=64, num_splits=1)),
    (MIXES[1], jnp.float32, dict(block_kv=64, num_splits=2)),
    (MIXES[2], jnp.bfloat16, dict(block_kv=64, num_splits=1)),
    (MIXES[2], jnp.float32, dict(block_kv=128, num_splits=2)),
]


@pytest.mark.parametrize("mix,dtype,tuning", KERNEL_CASES, ids=["f32-1split", "page8-f32-2splits", "page128-bf16",
                                                               "page128-f32-block128"])
def test_kernel_in_the_gpu_interpreter_matches_the_xla_path_and_the_reference(mix, dtype, tuning):
    q_lens, kv_lens, page_size, G = mix
    args = ragged_batch(1, q_lens, kv_lens, K=2, G=G, H=64, page_size=page_size, dtype=dtype)
    out = ragged_paged_attention(*args, scale=0.125, max_q_len=max(q_lens), interpret=True, **tuning)
    assert out.shape == args[0].shape and out.dtype == dtype
    check(out, paged_attention_reference(*args, scale=0.125), args[5], dtype)
    check(out, paged_attention_xla(*args, scale=0.125, max_q_len=max(q_lens)), args[5], dtype)


def tree_masks(seed, q_lens, kv_lens, starts, tokens, words=2):
    """(tree_start [S], tree_bits [tokens, words]): for each sequence's queries (at its last q_len key slots), a
    random subset of the tree region's slots before its own (from starts[s]; a draft tree's ancestors) and its
    own; tokens of no sequence, and queries before their tree's start, get random bits (never read)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, (tokens, words), dtype=np.uint64)
    at = 0
    for q_len, kv_len, start in zip(q_lens, kv_lens, starts):
        for i in range(q_len):
            own = kv_len - q_len + i - start
            if own < 0:  # a query before its tree: every key it sees is before the start, its bits never read
                continue
            seen = (rng.random(own) < 0.5).tolist() + [True]
            row = np.zeros(words, np.uint64)
            for j in np.flatnonzero(seen):
                row[j // 32] |= np.uint64(1) << np.uint64(j % 32)
            bits[at + i] = row
        at += q_len
    return jnp.asarray(starts, jnp.int32), jnp.asarray(bits.astype(np.uint32).view(np.int32))


# (q_lens, kv_lens, tree starts, page_size, G): a target's verify of a 17-node tree (two tiles at G 4) whose region
# crosses a 64-key block, a drafter's step of 3 beams over a 40-slot region (bits in the second word), a decode whose
# tree starts past its keys (a plain query), a sequence with no queries.
TREE_MIX = ([17, 3, 1, 0], [70, 60, 9, 5], [53, 20, 9, 5], 8, 4)


@pytest.mark.parametrize("tuning", [dict(block_kv=64, num_splits=1), dict(block_kv=64, num_splits=2)],
                         ids=["1split", "2splits"])
def test_a_tree_mask_in_the_kernel_the_xla_path_and_the_reference(tuning):
    """A tree mask (tree_start, tree_bits): the kernel in the GPU interpreter and the XLA path against the dense
    reference, which reads each bit on its own; and the mask changes the output (the reference without it differs)."""
    q_lens, kv_lens, starts, page_size, G = TREE_MIX
    args = ragged_batch(7, q_lens, kv_lens, K=2, G=G, H=64, page_size=page_size, dtype=jnp.float32)
    tree = tree_masks(8, q_lens, kv_lens, starts, args[0].shape[0])
    ref = paged_attention_reference(*args, scale=0.125, tree_start=tree[0], tree_bits=tree[1])
    assert np.abs(np.asarray(ref - paged_attention_reference(*args, scale=0.125))[:20]).max() > 0.1
    xla = paged_attention_xla(*args, scale=0.125, max_q_len=17, tree_start=tree[0], tree_bits=tree[1])
    check(xla, ref, args[5], jnp.float32)
    out = ragged_paged_attention(*args, scale=0.125, max_q_len=17, interpret=True, tree_start=tree[0],
                                 tree_bits=tree[1], **tuning)
    check(out, ref, args[5], jnp.float32)
    with pytest.raises(ValueError, match="tree_start and tree_bits come together"):
        ragged_paged_attention(*args, scale=0.125, max_q_len=17, interpret=True, tree_bits=tree[1])


def test_no_data_races_between_the_loader_and_two_compute_warpgroups():
    """The interpreter's happens-before race detector over a chunk of three tiles (two CTAs of two
    compute warpgroups, the last with no queries for its second) sharing a 2-slot ring, in three
    splits, beside a decode sequence whose CTA's second warpgroup only frees slots; bf16."""
    args = ragged_batch(6, [36, 1], [100, 9], K=1, G=4, H=64, page_size=16, dtype=jnp.bfloat16)
    params = plgpu.InterpretGPUParams(detect_races=True)
    out = ragged_paged_attention(*args, scale=0.125, max_q_len=36, interpret=params, block_kv=64, num_splits=3)
    check(out, paged_attention_reference(*args, scale=0.125), args[5], jnp.bfloat16)


def test_kernel_default_splits_for_a_batch_of_one_decode():
    """Batch 1 decode: the default split count (one wave) over 5 pages of 8, one head group of 8."""
    args = ragged_batch(2, [1], [37], K=1, G=8, H=64, page_size=8, dtype=jnp.bfloat16)
    assert RaggedPagedConfig(block_kv=64).splits_for(1, args[3].shape[1] * 8) == 1  # 48 slots: one block
    config = RaggedPagedConfig(block_kv=64, wave=4)
    assert config.splits_for(1, 512) == 4 and config.splits_for(3, 512) == 1 and config.splits_for(1, 130) == 3
    out = ragged_paged_attention(*args, scale=0.125, max_q_len=1, interpret=True, block_kv=64)
    check(out, paged_attention_reference(*args, scale=0.125), args[5], jnp.bfloat16)


@pytest.mark.parametrize("q_len,G", [(1, 8), (4, 4), (12, 8)], ids=["decode", "verify", "two-tiles"])
def test_a_uniform_batch_merges_its_splits_statically(q_len, G):
    """Three sequences of q_len queries each, in order (a decode or verify batch; 12 queries of a group of 8: two
    tiles a sequence), over two splits: uniform=True (the merge by slices) is the ragged merge bit for bit, and
    the reference; a batch whose tokens are not its sequences' refuses uniform=True."""
    args = ragged_batch(q_len, [q_len] * 3, [40, 17, 64], K=2, G=G, H=64, page_size=8, dtype=jnp.float32,
                        extra_tokens=0)
    assert RaggedPagedConfig(block_kv=64, num_splits=2).splits_for(3, args[3].shape[1] * 8) == 2  # a merge runs
    ragged = ragged_paged_attention(*args, scale=0.125, max_q_len=q_len, interpret=True, block_kv=64, num_splits=2)
    uniform = ragged_paged_attention(*args, scale=0.125, max_q_len=q_len, uniform=True, interpret=True, block_kv=64,
                                     num_splits=2)
    np.testing.assert_array_equal(np.asarray(uniform), np.asarray(ragged))
    check(uniform, paged_attention_reference(*args, scale=0.125), args[5], jnp.float32)
    padded = ragged_batch(q_len, [q_len] * 3, [40, 17, 64], K=2, G=G, H=64, page_size=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match=f"uniform: {3 * q_len + 2} tokens are not 3 sequences of {q_len}"):
        ragged_paged_attention(*padded, scale=0.125, max_q_len=q_len, uniform=True, interpret=True)


def test_the_static_merge_equals_the_lookups_and_reads_only_real_rows():
    """merge_splits on random partials, a uniform batch (3 sequences of 5 queries, a group of 4, two tiles of 4 tokens
    each) with NaN in every row no token owns: the static merge is the looked-up one bit for bit and reads no NaN;
    and only Layout.uniform marks its attention group uniform (a chunk after it stays ragged)."""
    from pallas_kernels.ragged_paged_attention import ROWS, merge_splits

    S, q_len, G, K, H, tq, tiles, splits = 3, 5, 4, 2, 8, 4, 2, 3
    rng = np.random.default_rng(0)
    part = np.full((splits, S * tiles, K, ROWS, H), np.nan, np.float32)
    lse = np.full((splits, S * tiles, K, ROWS), np.nan, np.float32)
    for s in range(S):
        for j in range(q_len):
            work, rows = s * tiles + j // tq, slice((j % tq) * G, (j % tq + 1) * G)
            part[:, work, :, rows] = rng.standard_normal((splits, K, G, H))
            lse[:, work, :, rows] = rng.standard_normal((splits, K, G))
    cu = jnp.arange(S + 1, dtype=jnp.int32) * q_len
    args = (jnp.asarray(part), jnp.asarray(lse), cu, S * q_len)
    static = merge_splits(*args, tiles=tiles, group=G, tq=tq, uniform=True)
    assert np.isfinite(np.asarray(static)).all()
    np.testing.assert_array_equal(np.asarray(static), np.asarray(merge_splits(*args, tiles=tiles, group=G, tq=tq)))
    table, start = jnp.zeros((S, 4), jnp.int32), jnp.full((S,), 7, jnp.int32)
    uniform = kv_cache.Layout.uniform(table, start, q_len)
    mixed = uniform.then(kv_cache.Layout.ragged(table, start, cu, S * q_len))
    assert [g.uniform for g in mixed.groups] == [True, False]


def test_token_positions_and_write_pages_match_a_dense_cache():
    """New K/V written into shuffled pages equal the same entries set in a dense cache per sequence, read back
    through the page table; tokens of no sequence, positions past the table and page ids outside the pool write
    nothing."""
    K, H, page_size = 2, 16, 8
    q_lens, kv_lens = [3, 1, 0], [10, 17, 4]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens = jnp.asarray(kv_lens, jnp.int32)
    seq, pos = token_positions(cu, lens, 6)
    assert seq.tolist() == [0, 0, 0, 1, 3, 3] and pos.tolist() == [7, 8, 9, 16, -1, -1]
    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.permutation(9).reshape(3, 3), jnp.int32)
    pages = jnp.asarray(rng.standard_normal((K, 9, page_size, H)), jnp.float32)
    new_k, new_v = (jnp.asarray(rng.standard_normal((6, K, H)), jnp.float32) for _ in range(2))
    k_pages, v_pages = write_pages(pages, pages, table, seq, pos, new_k, new_v)

    def dense(p):  # [S, K, L, H]: each sequence's keys in position order
        return np.asarray(p[:, table].reshape(K, 3, 3 * page_size, H).transpose(1, 0, 2, 3))

    for new, paged in ((new_k, k_pages), (new_v, v_pages)):
        expected = np.array(dense(pages))
        for token, (s_, p_) in enumerate(zip(seq.tolist(), pos.tolist())):
            if s_ < 3 and p_ >= 0:
                expected[s_, :, p_] = np.asarray(new[token])
        np.testing.assert_array_equal(dense(paged), expected)
    past = write_pages(pages, pages, table, jnp.array([0]), jnp.array([3 * page_size]), new_k[:1], new_v[:1])
    np.testing.assert_array_equal(np.asarray(past[0]), np.asarray(pages))
    unallocated = table.at[0, 0].set(-1)  # a page id outside the pool: nothing written, not the pool's last page
    none = write_pages(pages, pages, unallocated, jnp.array([0]), jnp.array([2]), new_k[:1], new_v[:1])
    np.testing.assert_array_equal(np.asarray(none[0]), np.asarray(pages))


def test_attention_block_writes_the_rotated_keys_at_their_positions():
    """The model's paged block (q/k norm, RoPE, page write, attention): q and the written K/V equal layers'
    rms_norm and apply_rope of the same rows, placed at each token's position through the page table (crossing a
    page edge); a row whose write is off leaves the pages as they were; the output is the XLA path's."""
    N, K, H, page_size, T = 4, 2, 16, 8, 5
    rng = np.random.default_rng(4)
    qkv = jnp.asarray(rng.standard_normal((2, T, (N + 2 * K) * H)), jnp.float32)
    cos, sin = (jnp.asarray(rng.standard_normal((2, T, H)), jnp.float32) for _ in range(2))
    q_norm, k_norm = (jnp.asarray(rng.standard_normal(H), jnp.float32) for _ in range(2))
    table = jnp.asarray([[2, 0], [1, 3]], jnp.int32)
    pages = jnp.asarray(rng.standard_normal((K, 4, page_size, H)), jnp.float32)
    start = jnp.array([6, 0], jnp.int32)  # row 0 crosses the edge of page 2 into page 0
    layout = kv_cache.Layout.uniform(table, start, T, jnp.array([True, False]))
    out, k_pages, v_pages = attention_block(qkv, cos, sin, pages, pages, layout, num_heads=N, q_norm=q_norm,
                                            k_norm=k_norm, eps=1e-6, kernels="xla")
    q, k, v = jnp.split(qkv.reshape(2, T, N + 2 * K, H), [N, N + K], axis=2)
    q_ref = apply_rope(rms_norm(q, q_norm, 1e-6), cos, sin)
    k_ref = apply_rope(rms_norm(k, k_norm, 1e-6), cos, sin)
    for paged, ref in ((k_pages, k_ref), (v_pages, v)):
        row0 = np.asarray(paged[:, table[0]].reshape(K, 2 * page_size, H))[:, 6 : 6 + T]
        np.testing.assert_allclose(row0, np.asarray(ref[0]).transpose(1, 0, 2), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(paged[:, table[1]]), np.asarray(pages[:, table[1]]))
    (group,) = layout.groups
    want = paged_attention_xla(q_ref.reshape(2 * T, N, H), k_pages, v_pages, group.read_table, group.kv_lens,
                               group.cu_q_lens, scale=H**-0.5, max_q_len=T)
    np.testing.assert_allclose(np.asarray(out).reshape(2 * T, N, H), np.asarray(want), rtol=1e-6, atol=1e-6)


def _lower(T, S, pages_per_seq, page_size, max_q_len, **tuning):
    """The kernel lowered for CUDA on this CPU host at Qwen3-8B heads (32 / 8, head_dim 128), bf16."""
    q = jax.ShapeDtypeStruct((T, 32, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((8, S * pages_per_seq, page_size, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((S, pages_per_seq), jnp.int32)
    kv_lens, cu = jax.ShapeDtypeStruct((S,), jnp.int32), jax.ShapeDtypeStruct((S + 1,), jnp.int32)
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, scale=128**-0.5, max_q_len=max_q_len, **tuning))
    return fn.trace(q, pages, pages, table, kv_lens, cu).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "shape,tuning",
    [
        ((1, 1, 2048, 16, 1), {}),  # decode, batch 1, 32k keys: split, merged in XLA
        ((64, 64, 256, 64, 1), {}),  # decode, batch 64: one split
        ((32, 8, 64, 128, 4), {"block_kv": 64, "num_stages": 4}),  # verify; pages larger than a block
        ((512, 1, 64, 128, 512), {}),  # a prefill chunk
    ],
    ids=["decode-b1", "decode-b64", "verify-page128", "chunk512"],
)
def test_lowers_for_cuda_at_qwen3_8b_shapes(shape, tuning):
    assert _lower(*shape, **tuning).count("stablehlo.custom_call @mosaic_gpu") == 1


def test_a_tree_mask_lowers_for_cuda_at_qwen3_8b_shapes():
    """The verify of a 33-node tree (N 32: three tiles of 16 tokens, two words of bits) at batch 8, and a drafter
    step of 8 beams: one Mosaic GPU call each."""
    for S, q_len, words in ((8, 33, 2), (8, 8, 2)):
        T = S * q_len
        q = jax.ShapeDtypeStruct((T, 32, 128), jnp.bfloat16)
        pages = jax.ShapeDtypeStruct((8, S * 64, 64, 128), jnp.bfloat16)
        table = jax.ShapeDtypeStruct((S, 64), jnp.int32)
        lens, cu = jax.ShapeDtypeStruct((S,), jnp.int32), jax.ShapeDtypeStruct((S + 1,), jnp.int32)
        start, bits = jax.ShapeDtypeStruct((S,), jnp.int32), jax.ShapeDtypeStruct((T, words), jnp.int32)
        fn = jax.jit(lambda *a: ragged_paged_attention(*a[:6], scale=128**-0.5, max_q_len=q_len, uniform=True,
                                                       tree_start=a[6], tree_bits=a[7]))
        text = lower_for_cuda(fn, q, pages, pages, table, lens, cu, start, bits)
        assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


def test_default_tunings_fit_a_hopper_block():
    """128-key blocks in 2 stages for decode and verify (one compute warpgroup); a chunk's two compute
    warpgroups at head_dim 128 take 64-key blocks in 4 stages, which fit where the defaults would not."""
    assert RaggedPagedConfig.for_kernel(128, 2, 1) == RaggedPagedConfig()
    chunk = RaggedPagedConfig.for_kernel(128, 2, 2)
    assert (chunk.block_kv, chunk.num_stages) == (64, 4)
    assert RaggedPagedConfig().smem_bytes(128, 2, 2) > 227 * 1024 >= chunk.smem_bytes(128, 2, 2)
    assert RaggedPagedConfig.for_kernel(128, 2, 2, num_stages=2).block_kv == 64  # given fields win
    q, pages = jnp.ones((512, 32, 128), jnp.bfloat16), jnp.ones((8, 4, 64, 128), jnp.bfloat16)
    assert unsupported(q, pages, pages, chunk, max_q_len=512) is None
    assert unsupported(q, pages, pages, max_q_len=512) is None  # no config: the entry's defaults
    assert "2 compute warpgroups" in unsupported(q, pages, pages, RaggedPagedConfig(), max_q_len=512)


def test_refuses_what_it_cannot_take_and_says_why():
    def operands(T=4, N=8, K=2, H=64, page_size=16, dtype=jnp.bfloat16, page_dtype=None):
        q = jnp.ones((T, N, H), dtype)
        pages = jnp.ones((K, 4, page_size, H), page_dtype or dtype)
        return q, pages, pages, jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32), jnp.array([0, 1, 2])

    for kwargs, tuning, message in [
        ({"page_size": 12}, {}, "page_size a multiple of 8, got 12"),
        ({"page_size": 48}, {}, "page_size dividing block_kv=128 or a multiple of it, got 48"),
        ({"dtype": jnp.float32}, {}, "float32"),
        ({"page_dtype": jnp.float16}, {}, "one dtype"),
        ({"H": 96}, {}, "head_dim 64, 128 or 256, got 96"),
        ({"N": 10}, {}, "group size dividing 64"),
        ({"H": 256}, {"num_stages": 4}, "bytes of shared memory"),
    ]:
        with pytest.raises(ValueError, match=message):
            ragged_paged_attention(*operands(**kwargs), scale=1.0, **tuning)
    assert unsupported(*operands(dtype=jnp.float32)[:3], interpret=True) is None
    q, k, v, table, lens, cu = operands()
    for bad, message in [
        ((q[0], k, v, table, lens, cu), "q must be"),
        ((q, k, v[:1], table, lens, cu), "must match"),
        ((q, k, v, table, lens[:1], cu), "kv_lens"),
        ((q, k, v, table[0], lens, cu), "page_table must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            ragged_paged_attention(*bad, scale=1.0)
    for max_q_len in (0, 2.0, True):
        with pytest.raises(ValueError, match="max_q_len"):
            ragged_paged_attention(q, k, v, table, lens, cu, scale=1.0, max_q_len=max_q_len)
    for tuning, message in [({"block_kv": 96}, "block_kv"), ({"num_stages": 1}, "num_stages"),
                            ({"num_splits": 0}, "num_splits"), ({"wave": 0}, "wave")]:
        with pytest.raises(ValueError, match=message):
            RaggedPagedConfig(**tuning)


# (q_lens, kv_lens, page_size, tuning): Qwen3-8B heads on the GPU. Ragged mixes with a chunk longer
# than one tile, KV lengths that end mid-page, the default split count and forced ones, every page size.
GPU_CASES = [
    ([1, 4, 70, 1], [1000, 4100, 333, 16384], 16, {}),
    ([1, 1, 1, 1], [1024, 7, 32768, 129], 64, {}),
    ([4, 4, 4], [4096, 4100, 8], 128, {"block_kv": 64, "num_stages": 4}),
    ([1], [32768], 16, {"num_splits": 1}),
    ([512], [4096], 64, {}),
]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (run: pytest -m gpu on one)")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=["mix", "decode", "verify-page128", "one-split", "chunk"])
def test_kernel_on_a_hopper_gpu_at_qwen3_8b_heads(case, dtype):
    """The compiled kernel (swizzled layouts, wgmma, ptxas: what the interpreter cannot check) against
    the dense reference; pages no sequence uses are NaN, as in the CPU tests."""
    from eagle3_jax.models.kernels import hopper

    if not hopper():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU (wgmma)")
    q_lens, kv_lens, page_size, tuning = case
    args = ragged_batch(5, q_lens, kv_lens, K=8, G=4, H=128, page_size=page_size, dtype=dtype)
    out = ragged_paged_attention(*args, scale=128**-0.5, max_q_len=max(q_lens), **tuning)
    check(out, paged_attention_reference(*args, scale=128**-0.5), args[5], jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (run: pytest -m gpu on one)")
def test_a_tree_mask_on_a_hopper_gpu_at_qwen3_8b_heads():
    """The compiled kernel with a tree mask: a 33-node verify over 1k keys (three tiles), a drafter's step of 8
    beams over a 48-slot region, a decode, with the default splits and one; against the dense reference."""
    from eagle3_jax.models.kernels import hopper

    if not hopper():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU (wgmma)")
    q_lens, kv_lens, starts = [33, 8, 1], [1057, 340, 20], [1024, 300, 20]
    args = ragged_batch(9, q_lens, kv_lens, K=8, G=4, H=128, page_size=64, dtype=jnp.bfloat16)
    tree = tree_masks(10, q_lens, kv_lens, starts, args[0].shape[0])
    ref = paged_attention_reference(*args, scale=128**-0.5, tree_start=tree[0], tree_bits=tree[1])
    for tuning in ({}, {"num_splits": 1}):
        out = ragged_paged_attention(*args, scale=128**-0.5, max_q_len=33, tree_start=tree[0], tree_bits=tree[1],
                                     **tuning)
        check(out, ref, args[5], jnp.bfloat16)


@pytest.mark.parametrize("on_hopper,kernels,dtype,expected", [
    (True, "pallas", jnp.bfloat16, "kernel"),
    (True, "pallas_attention", jnp.float16, "kernel"),
    (True, "xla", jnp.bfloat16, "xla"),
    (False, "pallas", jnp.bfloat16, "xla"),  # other GPUs, the CPU
    (True, "pallas", jnp.float32, "xla"),  # wgmma takes 16-bit operands
])
def test_the_model_entry_takes_the_kernel_only_on_hopper_for_pallas_attention(monkeypatch, on_hopper, kernels,
                                                                            dtype, expected):
    """paged_attention.attend: the Mosaic GPU kernel on a Hopper GPU with Pallas attention and operands
    it takes, the XLA path otherwise (spies: neither a Hopper GPU nor the interpreter is the point)."""
    import pallas_kernels
    from eagle3_jax.models import kernels as kernels_lib
    from eagle3_jax.models import paged_attention

    called = []
    monkeypatch.setattr(kernels_lib, "hopper", lambda: on_hopper)
    monkeypatch.setattr(pallas_kernels, "ragged_paged_attention", lambda q, *a, **k: called.append("kernel") or q)
    monkeypatch.setattr(paged_attention, "paged_attention_xla", lambda q, *a, **k: called.append("xla") or q)
    q, pages = jnp.ones((4, 8, 128), dtype), jnp.ones((2, 4, 16, 128), dtype)
    table, lens, cu = jnp.zeros((1, 4), jnp.int32), jnp.array([4]), jnp.array([0, 4])
    paged_attention.attend(q, pages, pages, table, lens, cu, max_q_len=4, kernels=kernels)
    assert called == [expected]
    with pytest.raises(ValueError, match="batch-invariant attention runs through attention_block"):
        paged_attention.attend(q, pages, pages, table, lens, cu, max_q_len=4, kernels=kernels_lib.EXACT)
