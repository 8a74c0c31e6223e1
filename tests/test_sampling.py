"""The sampling filters against transformers' warpers, and the rejection sampler's room stop, on the CPU."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from eagle3_jax.decoding import candidate_filter, sampling


def transformers_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution transformers' generate samples from: its warpers in generate's order, then softmax."""
    scores = torch.from_numpy(logits)[None]
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


FILTERED = jax.jit(sampling.filtered_probs, static_argnames=("filter",))


def ours(logits: np.ndarray, temperature, top_k, top_p, filter="radix") -> np.ndarray:
    """The filter over the rows. "radix": one call of the radix build. "candidates": the rows the candidate
    build takes (every sampled row's top_k in [1, K]: sampling.filter_for) in one call of it, the others in a
    call of the radix build."""
    rows = len(logits)
    t, k, p = (np.broadcast_to(np.asarray(x), (rows,)) for x in (temperature, top_k, top_p))
    out = np.zeros(logits.shape, np.float32)
    by_candidates = (k >= 1) & (k <= candidate_filter.K) if filter == "candidates" else np.zeros(rows, bool)
    for group, build in ((by_candidates, "candidates"), (~by_candidates, "radix")):
        if group.any():
            settings = sampling.SamplingParams(jnp.asarray(t[group], jnp.float32), jnp.asarray(k[group], jnp.int32),
                                               jnp.asarray(p[group], jnp.float32), None)
            assert build == "radix" or sampling.filter_for(settings) == build
            out[group] = FILTERED(jnp.asarray(logits[group], jnp.float32), settings.temperature, settings.top_k,
                                  settings.top_p, filter=build)
    return out


def check_rows(logits, settings, atol=1e-6, filter="radix"):
    got = ours(logits, *zip(*settings), filter=filter)
    for row, (t, k, p), g in zip(logits, settings, got):
        want = transformers_probs(row, t, k, p)
        np.testing.assert_array_equal(g > 0, want > 0, err_msg=f"kept tokens differ at {(t, k, p)}")
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=atol, err_msg=f"{(t, k, p)}")


@pytest.mark.parametrize("filter", sampling.FILTERS)
def test_filters_equal_transformers_on_random_logits(filter):
    rng = np.random.default_rng(0)
    V = 50
    settings = [(float(t), int(k), float(p)) for t, k, p in zip(
        rng.uniform(0.2, 2.0, 96), rng.choice([0, 1, 2, 5, 20, 49, 50, 80], 96),
        rng.choice([1.0, 0.95, 0.9, 0.5, 0.2, 0.01], 96))]
    logits = (rng.standard_normal((96, V)) * rng.uniform(0.5, 4, (96, 1))).astype(np.float32)
    check_rows(logits, settings, filter=filter)


@pytest.mark.parametrize("filter", sampling.FILTERS)
def test_filters_equal_transformers_at_qwen3_vocabulary_size(filter):
    """151,936 logits a row: the radix search settles thresholds across the whole float range."""
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((5, 151936)) * 3).astype(np.float32)
    logits[1, 7] = 40.0  # one token holds nearly all the mass: top-p keeps just it
    settings = [(0.6, 20, 0.95), (1.0, 0, 0.9), (1.3, 0, 0.5), (0.7, 1000, 1.0), (2.0, 0, 0.999)]
    check_rows(logits, settings, atol=1e-9, filter=filter)


@pytest.mark.parametrize("filter", sampling.FILTERS)
def test_no_filter_settings_keep_everything(filter):
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((4, 30)).astype(np.float32)
    got = ours(logits, [1.0, 1.0, 1.0, 0.5], [0, 30, 2**31 - 1, 0], [1.0, 1.0, 1.0, 1.0], filter=filter)
    np.testing.assert_allclose(got[:3], jax.nn.softmax(logits[:3]), rtol=1e-6)
    np.testing.assert_allclose(got[3], jax.nn.softmax(logits[3] / 0.5), rtol=1e-6)


def stable_sort(original):
    def sort(x, *args, **kwargs):
        return original(x, *args, stable=True, **kwargs)
    return sort


def tie_cases():
    """Logits whose top-p cut falls inside a group of equal logits (and top-k cuts through ties)."""
    base = np.log(np.array([0.4, 0.2, 0.2, 0.2], np.float32))
    cases = [(base, (1.0, 0, 0.7)), (base, (1.0, 0, 0.5)), (base, (1.0, 2, 0.9)), (base[::-1].copy(), (1.0, 0, 0.7))]
    rng = np.random.default_rng(3)
    for _ in range(60):  # small integer logits: ties everywhere
        row = rng.integers(-3, 3, 24).astype(np.float32)
        cases.append((row, (float(rng.choice([1.0, 0.8])), int(rng.choice([0, 3, 7])), float(rng.uniform(0.05, 0.98)))))
    return cases


@pytest.mark.parametrize("filter", sampling.FILTERS)
def test_top_p_ties_at_the_boundary(monkeypatch, filter):
    """Where the cut splits tokens of equal logit, transformers keeps as many of them as the mass needs, in
    the order torch.sort leaves them (not stable on the CPU). Ours keeps the same number, the ones with the
    highest ids: exactly transformers' answer under a stable sort, and the same kept mass as its own."""
    cases = tie_cases()
    split = 0
    for row, (t, k, p) in cases:
        (got,) = ours(row[None], t, k, p, filter=filter)
        as_is = transformers_probs(row, t, k, p)
        np.testing.assert_allclose(np.sort(got), np.sort(as_is), rtol=1e-5, atol=1e-7)
        with monkeypatch.context() as m:
            m.setattr(torch, "sort", stable_sort(torch.sort))
            stable = transformers_probs(row, t, k, p)
        np.testing.assert_array_equal(got > 0, stable > 0)
        np.testing.assert_allclose(got, stable, rtol=1e-5, atol=1e-7)
        kept = got > 0
        split += bool(np.isin(row[kept], row[~kept]).any())  # a kept and a dropped token of equal logit
    assert split >= 10  # the cases do cut through tied groups


def as_filtered(p):
    """Distributions p [R, V] (every entry > 0) as a `sampling.Filtered` that keeps every token."""
    logits = jnp.log(p)
    top = jnp.max(logits, axis=-1)
    return sampling.Filtered(logits, jnp.full(top.shape, -jnp.inf), jnp.zeros(top.shape, jnp.int32), top,
                             jnp.sum(jnp.exp(logits - top[:, None]), axis=-1))


def test_verify_stops_for_room_with_a_draw_from_p_not_the_residual():
    """When the cache has room for fewer drafts than were proposed, the round stops after them without a
    rejection: the next token comes from p there. 100,000 rounds of fixed p and q in one call."""
    V, G, N = 6, 3, 100_000
    rng = np.random.default_rng(4)
    p = rng.dirichlet(np.ones(V), size=G + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(V), size=G).astype(np.float32)
    drafts = jnp.asarray(rng.integers(0, V, (N, G)), jnp.int32)
    keys = sampling.row_keys(jnp.zeros((N, 2), jnp.uint32), jnp.arange(N))

    @jax.jit
    def run(room):
        pb, qb = (jnp.broadcast_to(x, (N,) + x.shape) for x in (p, q))
        return sampling.verify(keys, as_filtered(pb.reshape(N * (G + 1), V)), drafts, qb, room)

    for room in (0, 1):
        accepted, tokens = run(jnp.full((N,), room, jnp.int32))
        accepted, tokens = np.asarray(accepted), np.asarray(tokens)
        assert accepted.max() == room
        # Rows that took every draft the room allowed: the next token is from p at that position.
        full = accepted == room
        counts = np.bincount(tokens[full, room], minlength=V)
        expected = p[room].astype(np.float64) / p[room].sum(dtype=np.float64) * full.sum()
        assert stats.chisquare(counts, expected).pvalue > 1e-4


@pytest.mark.parametrize("shape", [(3,), (2, 4)])
def test_row_keys_depend_only_on_seed_and_position(shape):
    seeds = jnp.asarray([[0, 1], [0, 2], [5, 1]], jnp.uint32)
    keys = sampling.row_keys(seeds, jnp.asarray([7, 7, 9]))
    again = sampling.row_keys(seeds[::-1], jnp.asarray([9, 7, 7]))[::-1]
    draw = jax.vmap(lambda k: jax.random.uniform(k, shape))
    np.testing.assert_array_equal(draw(keys), draw(again))
    assert len({tuple(np.asarray(x).ravel()) for x in draw(keys)}) == 3


@pytest.mark.parametrize("filter", sampling.FILTERS)
def test_ties_past_the_candidates(monkeypatch, filter):
    """200 tokens tied at the top-k cut, spread over the row, more than the 64 candidates hold: top-k keeps
    them all, and top-p cuts inside them (within the candidates and past them) or keeps them all. The kept
    tokens and their probabilities are transformers' under a stable sort."""
    rng = np.random.default_rng(5)
    V = 1000
    row = rng.uniform(-6.0, 0.0, V).astype(np.float32)
    spots = rng.permutation(V)
    row[spots[:10]] = rng.uniform(2.0, 4.0, 10)
    row[spots[10:210]] = 1.0
    settings = [(t, 20, p) for t in (1.0, 0.7) for p in (0.6, 0.8, 0.9, 0.97, 0.9999, 1.0)]
    got = ours(np.repeat(row[None], len(settings), axis=0), *zip(*settings), filter=filter)
    tied_kept = []
    for g, (t, k, p) in zip(got, settings):
        with monkeypatch.context() as m:
            m.setattr(torch, "sort", stable_sort(torch.sort))
            want = transformers_probs(row, t, k, p)
        np.testing.assert_array_equal(g > 0, want > 0, err_msg=f"{(t, k, p)}")
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-9, err_msg=f"{(t, k, p)}")
        tied_kept.append(int(np.sum(g[spots[10:210]] > 0)))
    assert min(tied_kept) < 54 < max(tied_kept)  # 54 tied tokens are candidates: cuts fall either side
    assert any(54 < n < 200 for n in tied_kept) and 200 in tied_kept


def test_rows_without_top_k_beside_rows_with_it():
    """Settings mixing top_k 0, top_k 20, top_k past the candidates and a greedy row take the radix build:
    each sampled row's result is transformers', and a top_k 20 row's is what the candidate build gives it.
    A greedy row's settings never decide the build."""
    rng = np.random.default_rng(6)
    V = 3000
    logits = (rng.standard_normal((5, V)) * 3).astype(np.float32)
    settings = [(0.6, 20, 0.95), (1.0, 0, 0.9), (0.8, candidate_filter.K + 1, 0.99), (0.6, 20, 0.5), (0.0, 0, 1.0)]
    t, k, p = (np.array(x) for x in zip(*settings))
    params = sampling.SamplingParams(t, k, p, None)
    assert sampling.filter_for(params) == "radix"
    assert sampling.filter_for(sampling.SamplingParams(t[[0, 3, 4]], k[[0, 3, 4]], p[[0, 3, 4]], None)) == "candidates"
    assert sampling.filter_for(sampling.SamplingParams(t[[0, 2]], k[[0, 2]], p[[0, 2]], None)) == "radix"
    mixed = ours(logits, t, k, p, filter="radix")
    for row, (ti, ki, pi), g in zip(logits[:4], settings[:4], mixed[:4]):
        want = transformers_probs(row, ti, ki, pi)
        np.testing.assert_array_equal(g > 0, want > 0, err_msg=f"{(ti, ki, pi)}")
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-9)
    alone = ours(logits[[0, 3]], t[[0, 3]], k[[0, 3]], p[[0, 3]], filter="candidates")
    np.testing.assert_allclose(alone, mixed[[0, 3]], rtol=1e-6, atol=1e-12)


def test_a_top_k_cut_at_minus_infinity_in_the_candidate_build(monkeypatch):
    """Rows with fewer finite logits than top_k (the k-th candidate is -inf, and tokens of -inf run past the
    candidates): the candidate build's distribution is transformers' exactly, with and without top-p, its
    cut -inf when every finite token is kept; so is a row whose tokens tied at a finite cut have weights that
    underflow to 0 (the tied mass then fits top-p for all of them or none)."""
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((6, 300)) * 2).astype(np.float32)
    for r in range(4):
        logits[r, rng.permutation(300)[:290]] = -np.inf  # 10 finite logits
    logits[3, :3] = 5.0  # a tie at the top among the finite logits
    logits[5, :] = -300.0  # 281 tokens at the top-20 cut whose weight exp(-300 - top) is 0
    logits[5, rng.permutation(300)[:19]] = rng.uniform(-3, 0, 19)
    settings = [(1.0, 20, 1.0), (0.7, 20, 0.9), (1.0, 64, 0.3), (1.0, 11, 0.999), (0.7, 20, 0.9), (1.0, 20, 0.6)]
    with monkeypatch.context() as m:
        m.setattr(torch, "sort", stable_sort(torch.sort))
        check_rows(logits, settings, filter="candidates")
    t, k, p = (jnp.asarray(x) for x in zip(*settings))
    cut, _, _, total = jax.jit(candidate_filter.filter_rows)(sampling.tempered(jnp.asarray(logits), t), k, p)
    assert cut[0] == -np.inf and np.all(np.isfinite(np.asarray(total)))


def primitives(jaxpr) -> set[str]:
    """The primitives a jaxpr's text names, its sub-jaxprs (loops, branches, calls) included."""
    return set(re.findall(r"\b([a-z_]+)\[", str(jaxpr)))


def test_each_build_is_one_program_without_a_branch():
    """The candidate build holds no conditional and no loop; the radix build its fixed-count loop (a scan), no
    conditional; an unknown filter is refused naming the choices."""
    x, t = jnp.zeros((3, 500)), jnp.ones((3,))
    k, p = jnp.full((3,), 20), jnp.full((3,), 0.9)
    def jaxpr(filter):
        return jax.make_jaxpr(lambda *a: sampling.filter_rows(*a, filter=filter))(x, t, k, p)
    candidates, radix = primitives(jaxpr("candidates")), primitives(jaxpr("radix"))
    assert "cond" in primitives(jax.make_jaxpr(lambda a: jax.lax.cond(a[0, 0] > 0, lambda: a, lambda: -a))(x))
    assert "top_k" in candidates and not {"cond", "while"} & candidates
    assert "scan" in radix and "cond" not in radix
    with pytest.raises(ValueError, match=r"filter must be one of \('radix', 'candidates'\), got 'sort'"):
        jaxpr("sort")


@pytest.mark.parametrize("blocks", [candidate_filter.BLOCKS, (32,), (16, 16), (4, 2, 8)])
def test_candidates_at_any_blocks_are_a_stable_sort(blocks):
    """The K candidates at one, two or three levels of blocks: a row's K largest logits in the order of a
    stable descending sort with higher ids first among equal logits (numpy's lexsort), on rows of many ties
    and -inf, and on a row whose largest logits crowd few blocks."""
    rng = np.random.default_rng(8)
    x = rng.integers(-40, 40, (4, 5000)).astype(np.float32)
    x[1, rng.permutation(5000)[:4990]] = -np.inf
    x[2, 100:300] = 50.0  # 200 equal maxima in a few neighbouring blocks
    x[3] = rng.standard_normal(5000)
    k = candidate_filter.K
    padded = candidate_filter.padded(jnp.asarray(x), blocks)
    values, ids = jax.jit(candidate_filter.candidates, static_argnums=(1, 2))(padded, k, blocks)
    padded, ids = np.asarray(padded), np.asarray(ids)
    assert padded.shape[-1] % math.prod(blocks) == 0 and padded.shape[-1] - 5000 < math.prod(blocks)
    for row, got in zip(padded, ids):  # the padding is -inf of ids past the row: ordered as any other -inf
        np.testing.assert_array_equal(got, np.lexsort((-np.arange(len(row)), -row))[:k])
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(padded, ids, axis=-1))
