"""Draft trees (decoding/tree.py, models/eagle3.draft_tree, spec_round's tree round): the tree chosen from the
candidates, the drafter's expansion against chains run along each candidate's path, the sampled rule against a
plain-Python walk of it; through the engine, greedy output equal to spec-off output (through a pool with refills
and chunks riding in tree rounds, stops inside accepted paths, the max_len edge, preemption, the prefix cache) with
the accept lengths a structural world predicts, seeded sampled rows, the trace's layout, the usage counts, and the
refusals. The sampled distribution's chi-square gate is in test_sampling_engine.py, the kernel's tree mask in
test_ragged_paged_attention.py, the demo pair's tau in test_demo_pair.py."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
from eagle3_jax.decoding import sampling, tree
from eagle3_jax.decoding.live import LivePool
from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models.kv_cache import Layout
from eagle3_jax_bench.profile import count_compilations

import spec_worlds as worlds

PROMPTS = [[3, 17, 5, 40, 22, 9, 1], [30, 2], [7, 7, 7, 21, 44, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
           [9, 8], [1, 2, 3, 4, 5]]
MAX_LEN = 64
# (N, D, K): the shapes the engine tests share. Both hold every level-1 candidate of the ladder drafter and its
# right level-2 one (pi^2, then pi^3: the second child, then the third).
SHAPES = [(12, 3, 3), (10, 2, 3)]
# Every engine here runs requests of two prompts or more through a pool of two slots, one page table and chunk
# shape: one compilation of its calls per shape and build. 12 pages of KV: two long rows do not fit.
POOL = dict(max_len=MAX_LEN, max_batch=2, page_size=8, prefill_chunk=6, kv_tokens=96)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The permutation target with the ladder drafter (a tree path two deep through later siblings, the chain
    never right), and the random pair; four layers each."""
    root = tmp_path_factory.mktemp("trees")
    _, permutation = worlds.save_target("permutation", root / "permutation", layers=4)
    _, noise = worlds.save_target("random", root / "random", layers=4)
    return {"ladder": (permutation, worlds.save_drafter("ladder", root / "ladder", permutation)[2]),
            "random": (noise, worlds.save_drafter("random", root / "random_d", noise)[2])}


def walk(prompt, max_new, stops=(), max_len=MAX_LEN):
    """The permutation world's greedy continuation (x_{n+1} = pi(x_n)), cut at a stop, max_new or max_len."""
    out = []
    while len(out) < max_new and len(prompt) + len(out) < max_len and not (out and out[-1] in stops):
        out.append(int(worlds.PI[(prompt + out)[-1]]))
    return out


def tree_engine(world_pair, shape, **kwargs):
    target, drafter = world_pair
    n, d, k = shape
    return eagle3_jax.Engine(target, drafter, num_draft_tokens=n, draft_depth=d, draft_top_k=k, **{**POOL, **kwargs})


@pytest.fixture(scope="module")
def ladder(world):
    """A tree engine of each shape over the ladder pair."""
    return {shape: tree_engine(world["ladder"], shape) for shape in SHAPES}


# ----------------------------------------------------------------------------- the tree's arithmetic


def test_the_tree_is_the_best_candidates_in_level_order():
    """K 2, D 2: level 1 c0, c1; level 2 c2, c3 (children of c0), c4, c5 (of c1). The best four are c0, c2, c1,
    c4: nodes 1 .. 4 = c0, c1, c2, c4 (level order), parents root, root, node 1, node 2. A child tied with its
    parent (log p 0) never displaces it."""
    scores = jnp.array([[-0.1, -0.5, -0.3, -0.9, -0.6, -2.0]])
    tokens = jnp.array([[10, 11, 12, 13, 14, 15]])
    parents = jnp.array([[-1, -1, 0, 0, 1, 1]])
    t = tree.build(scores, tokens, parents, 4, 2)
    assert t.tokens.tolist() == [[10, 11, 12, 14]] and t.parents.tolist() == [[0, 0, 0, 1, 2]]
    assert t.depth.tolist() == [[0, 1, 1, 2, 2]]
    assert np.flatnonzero(np.asarray(t.ancestors[0, 3])).tolist() == [0, 1, 3]
    tied = tree.build(jnp.array([[-0.1, -0.5, -0.1, -0.9, -0.6, -2.0]]), tokens, parents, 1, 2)
    assert tied.tokens.tolist() == [[10]]
    path, accepted = tree.path_of(t, jnp.array([[True, False, True, False, True]]), 2)
    assert path.tolist() == [[0, 2, 4]] and accepted.tolist() == [2]
    path, accepted = tree.path_of(t, jnp.array([[True, True, False, False, True]]), 2)  # node 4's parent rejected
    assert path[0, :2].tolist() == [0, 1] and accepted.tolist() == [1]


@pytest.mark.parametrize("shape, message", [
    ((6, 7, 2), "draft_depth=7 is more than num_draft_tokens=6: each level of a tree holds a node"),
    ((11, 2, 2), r"num_draft_tokens=11 is more than the 6 candidates of draft_depth=2 steps of draft_top_k=2 beams"),
])
def test_impossible_shapes(shape, message):
    with pytest.raises(ValueError, match=message):
        tree.TreeShape(*shape)
    assert tree.TreeShape(6, 2, 2).candidates == 6 and tree.TreeShape(6, 2, 2).reach == 7
    assert tree.TreeShape(8, 5, 4).reach == 16  # the drafter's beams reach past the target's nodes


def test_the_drafter_expands_as_chains_along_each_candidate_path(world):
    """draft_tree's candidates, D 3 and K 3 over two rows with other committed lengths: each candidate's score is the
    summed log-probability of its path, as a chain of the drafter fed along that path on its own gets it (no tree
    mask, nothing shared); each parent's children are its top K; each level's beams, the K best candidates of
    that level; the committed pairs' entries are left as they were."""
    target, drafter = world["random"]
    cfg, params = drafter.config, drafter.params
    embed = target.params["embed"]
    depth, K, B, page = 3, 3, 2, 8
    rng = np.random.default_rng(0)
    lengths = jnp.array([5, 9], jnp.int32)
    table = jnp.arange(B * 3, dtype=jnp.int32).reshape(B, 3)
    pages = drafter_lib.new_pages(cfg, B * 3, page, jnp.float32)
    h = jnp.asarray(rng.standard_normal((B, 9, cfg.hidden_size)), jnp.float32)
    toks = jnp.asarray(rng.integers(0, worlds.V, (B, 9)), jnp.int32)
    committed = Layout.uniform(table, jnp.zeros(B, jnp.int32), 9)  # row 0's entries past 5 are stale
    _, pages = drafter_lib.forward(params, cfg, embed, h, toks, pages, committed, "xla")
    hidden = jnp.asarray(rng.standard_normal((B, cfg.hidden_size)), jnp.float32)
    scores, tokens, parents, after = drafter_lib.draft_tree(params, cfg, embed, hidden, pages, table, lengths, depth,
                                                            K, "xla")
    for k_old, k_new, n in ((pages.k[0], after.k[0], lengths),):
        for b in range(B):
            old = np.asarray(k_old[:, table[b]]).reshape(cfg.num_kv_heads, -1, cfg.head_dim)[:, : int(n[b])]
            new = np.asarray(k_new[:, table[b]]).reshape(cfg.num_kv_heads, -1, cfg.head_dim)[:, : int(n[b])]
            np.testing.assert_array_equal(new, old)
    d2t = np.asarray(params["d2t"])
    to_draft = {int(i + d2t[i]): i for i in range(len(d2t))}

    @jax.jit
    def chain_step(h, token, buf, row_table, start):  # one chain step of one row: (carried h, token) at `start`
        out, buf = drafter_lib.forward(params, cfg, embed, h[None, None], token[None, None], buf,
                                       Layout.uniform(row_table[None], start[None], 1), "xla")
        return out[0, 0], buf

    def logp(h):
        return np.asarray(jax.nn.log_softmax(drafter_lib.draft_logits(params, cfg, h)))

    scores, tokens, parents = (np.asarray(x) for x in (scores, tokens, parents))
    C = K + (depth - 1) * K * K
    for b in range(B):
        for c in range(C):
            path = [c]
            while parents[b, path[0]] >= 0:
                path.insert(0, int(parents[b, path[0]]))
            h_now, buf, expected = hidden[b], pages, 0.0
            for level, cand in enumerate(path):  # the chain along the path, one token at a time
                expected += logp(h_now)[to_draft[int(tokens[b, cand])]]
                h_now, buf = chain_step(drafter_lib.carried(params, cfg, h_now), tokens[b, cand], buf, table[b],
                                        lengths[b] + level)
            np.testing.assert_allclose(scores[b, c], expected, rtol=1e-5, atol=1e-5)
            children = [j for j in range(C) if parents[b, j] == c]
            if children:  # a beam: its children are the top K after its path, best first
                assert [to_draft[int(tokens[b, j])] for j in children] == np.argsort(-logp(h_now))[:K].tolist()
        for level in range(depth - 1):  # the beams of each level are its K best candidates
            lo = 0 if level == 0 else K + (level - 1) * K * K
            hi = K if level == 0 else lo + K * K
            beams = sorted({int(p) for p in parents[b] if lo <= p < hi})
            assert beams == sorted((np.argsort(-scores[b, lo:hi], kind="stable")[:K] + lo).tolist())


def test_the_sampled_rule_is_a_walk_over_the_siblings():
    """sampled_match against a plain-Python walk of TreeSpeculativeSamplingTargetOnly (SGLang): at each node of the
    path, its children in order, accepting the first whose cumulative target probability exceeds the node's
    uniform; on random trees and distributions, with some nodes not usable (never judged)."""
    B, N, D, K, V = 64, 7, 3, 3, 12
    rng = np.random.default_rng(1)
    C = K + (D - 1) * K * K
    scores = jnp.asarray(-np.abs(rng.standard_normal((B, C))).cumsum(axis=1), jnp.float32)
    parents = np.concatenate([np.full(K, -1), np.repeat(np.arange(K), K),
                              np.repeat(K + np.arange(K * K)[:K], K)])  # level 3: children of level 2's first K
    tokens = np.stack([np.concatenate([rng.permutation(V)[:K] for _ in range(C // K)]) for _ in range(B)])
    t = tree.build(scores, jnp.asarray(tokens, jnp.int32), jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (B, C)),
                   N, D)
    logits = jnp.asarray(rng.standard_normal((B * (N + 1), V)) * 2, jnp.float32)
    p = sampling.filter_rows(logits, jnp.ones(B * (N + 1)), jnp.zeros(B * (N + 1), jnp.int32),
                             jnp.ones(B * (N + 1)), filter="radix")
    keys = sampling.row_keys(jnp.asarray(rng.integers(0, 2**31, (B, 2)), jnp.uint32), jnp.arange(B))
    ok = jnp.asarray(rng.random((B, N + 1)) < 0.85).at[:, 0].set(True)
    match = np.asarray(tree.sampled_match(t, p, keys, ok))
    u = np.asarray(sampling.uniforms(keys, N + 1))
    probs = np.asarray(p.probs()).reshape(B, N + 1, V)
    par, tok, okn = np.asarray(t.parents), np.asarray(t.tokens), np.asarray(ok)
    for b in range(B):
        expected = np.zeros(N + 1, bool)
        expected[0] = True
        for node in range(N + 1):
            cumulative = 0.0
            for child in range(1, N + 1):
                if par[b, child] != node or not okn[b, child]:
                    continue
                cumulative += probs[b, node, tok[b, child - 1]]
                if u[b, node] < cumulative:
                    expected[child] = True
                    break
        np.testing.assert_array_equal(match[b], expected)


def random_tree(seed, B=6, N=7, D=3, K=3, V=16):
    """A batch of trees of random candidates (build's), their tokens below V."""
    rng = np.random.default_rng(seed)
    C = K + (D - 1) * K * K
    scores = jnp.asarray(-np.abs(rng.standard_normal((B, C))).cumsum(axis=1), jnp.float32)
    parents = np.concatenate([np.full(K, -1), np.repeat(np.arange(K), K), np.repeat(K + np.arange(K), K)])
    tokens = jnp.asarray(rng.integers(0, V, (B, C)), jnp.int32)
    return tree.build(scores, tokens, jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (B, C)), N, D)


def path_tokens(t, b, node):
    """The tokens of the nodes from the root's child down to `node` (row b)."""
    out, parents = [], np.asarray(t.parents[b])
    while node:
        out.insert(0, int(t.tokens[b, node - 1]))
        node = int(parents[node])
    return out


def test_penalties_and_automaton_states_follow_each_branch():
    """penalties.tree_logits at node j is verify_logits at the position after j's path, its path's tokens the drafts;
    tree.automaton_states at node j is grammar.along's state after them: the chain's rules down every branch."""
    from eagle3_jax.decoding import grammar, penalties

    B, N, D, V, L = 6, 7, 3, 16, 24
    t = random_tree(3, B, N, D, V=V)
    rng = np.random.default_rng(4)
    sequence = jnp.asarray(rng.integers(0, V, (B, L)), jnp.int32)
    n = jnp.asarray(rng.integers(6, 12, B), jnp.int32)
    settings = penalties.Penalties(jnp.asarray(rng.uniform(-2, 2, B), jnp.float32),
                                   jnp.asarray(rng.uniform(-2, 2, B), jnp.float32),
                                   jnp.asarray(rng.uniform(0.5, 2, B), jnp.float32),
                                   jnp.asarray(np.where(np.arange(penalties.BIAS_WIDTH) < 2, 3, -1)[None].repeat(B, 0),
                                               jnp.int32), jnp.full((B, penalties.BIAS_WIDTH), 1.5, jnp.float32))
    pen = penalties.PenaltyState(settings, sequence, jnp.asarray(rng.integers(2, 6, B), jnp.int32))
    logits = jnp.asarray(rng.standard_normal((B, N + 1, V)), jnp.float32)
    got = np.asarray(penalties.tree_logits(logits, pen, n, t.tokens, t.ancestors))
    # A toy automaton: 4 states, token classes by id % 3, class 2 never allowed from state 3.
    nxt = np.array([[1, 2, 3], [0, 2, 1], [3, 3, 0], [1, 0, -1]], np.int32)
    tables = grammar.Tables(jnp.asarray((np.arange(V) % 3)[None], jnp.int32), jnp.asarray(nxt))
    rows = grammar.Rows(jnp.zeros((B,), jnp.int32), jnp.asarray(rng.integers(-1, 4, B), jnp.int32))
    states = np.asarray(tree.automaton_states(tables, rows, t, D))
    for b in range(B):
        for node in range(N + 1):
            drafts = jnp.asarray([path_tokens(t, b, node)], jnp.int32)
            depth = drafts.shape[1]
            one = jax.tree.map(lambda x: x[b : b + 1], pen)
            chain = penalties.verify_logits(jnp.broadcast_to(logits[b : b + 1, node : node + 1], (1, depth + 1, V)),
                                            one, n[b : b + 1], drafts)
            np.testing.assert_allclose(got[b, node], np.asarray(chain[0, depth]), rtol=1e-6)
            along = grammar.along(tables, jax.tree.map(lambda x: x[b : b + 1], rows), drafts)
            assert states[b, node] == int(along[0, depth])


# ----------------------------------------------------------------------------- through the engine


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_trees_are_lossless_through_a_pool_and_accept_as_predicted(ladder, shape):
    """Five prompts through two slots (refilled), prompts prefilled 6 tokens a call riding in the tree rounds, KV
    of 12 pages of 8 that runs out (rows preempted and recomputed): the permutation world's output, and every
    round's path two deep through level 1's second node (pi^2, not the top-1 pi^1), as the ladder predicts."""
    engine = ladder[shape]
    preempted = engine.preemptions
    got = engine.generate(PROMPTS, 40, trace=True)
    assert [r.token_ids for r in got] == [walk(p, 40) for p in PROMPTS]
    assert engine.preemptions > preempted
    depth = shape[1]
    for r in got:
        assert r.gammas == [depth] * len(r.accept_lengths)
        assert r.accept_lengths[:-1] == [2] * (len(r.accept_lengths) - 1)  # the last is cut by max_new_tokens
        assert all(trace.path[0] == 2 for trace in r.rounds[:-1])


def test_the_chain_of_the_same_depth_accepts_nothing(world):
    """The ladder's top-1 chain is never right: K = 1 with D = N is that chain exactly (the same step
    configuration, output and rounds)."""
    chain = eagle3_jax.Engine(*world["ladder"], num_draft_tokens=3, **POOL)
    same = eagle3_jax.Engine(*world["ladder"], num_draft_tokens=3, draft_depth=3, draft_top_k=1, **POOL)
    assert same.spec == chain.spec and same.tree is None and same.draft_depth == 3
    got = same.generate(PROMPTS[:2], 12, trace=True)
    assert got == chain.generate(PROMPTS[:2], 12, trace=True)
    assert [r.token_ids for r in got] == [walk(p, 12) for p in PROMPTS[:2]]
    assert {a for r in got for a in r.accept_lengths} == {0}


def test_lossless_at_the_max_len_edge(ladder):
    """Every prompt length from max_len - N - 3 to max_len - 1: a node past the room or at a slot past max_len (no
    row holds a page there) is never accepted; each row fills its sequence to max_len with the world's tokens, its
    paths as deep as the room and the slots allow."""
    rng = np.random.default_rng(5)
    n = SHAPES[0][0]
    prompts = [rng.integers(0, worlds.V, size=L).tolist() for L in range(MAX_LEN - n - 3, MAX_LEN)]
    got = ladder[SHAPES[0]].generate(prompts, 50)
    for p, r in zip(prompts, got):
        assert r.token_ids == walk(p, 50) and len(p) + len(r.token_ids) == MAX_LEN
        # The path is nodes 2, then 9 (pi^2, then its third child): depth 2 needs room 2 and slot n + 9 below
        # max_len, depth 1 room 1 and slot n + 2.
        at, expected = len(p), []
        for _ in r.accept_lengths:
            expected.append(2 if at + 9 < MAX_LEN else 1 if at + 3 <= MAX_LEN else 0)
            at += expected[-1] + 1
        assert r.accept_lengths == expected


def test_stops_inside_accepted_paths(ladder):
    """A stop id at each position of the first rounds' accepted paths (three tokens a round): the output is cut
    right after it, and the round that emitted it commits the drafts among what it emitted."""
    engine = ladder[SHAPES[0]]
    full = walk(PROMPTS[0], 20)
    cuts = list(range(1, 9))
    got = engine.generate([PROMPTS[0]] * len(cuts), 20, [[full[cut]] for cut in cuts])
    for cut, r in zip(cuts, got):
        assert r.token_ids == full[: cut + 1] and r.finish_reason == "stop"
        assert r.accept_lengths == [2] * ((cut - 1) // 3) + [min(2, (cut - 1) % 3 + 1)]


def test_the_prefix_cache_holds_only_the_committed_path(world, ladder):
    """A chat's second turn starts after the pages the first left in the cache, with the drafts, paths and accept
    lengths of an engine that caches nothing: the drafter's cached entries are its committed pairs only."""
    engine = ladder[SHAPES[1]]
    uncached = tree_engine(world["ladder"], SHAPES[1], prefix_caching=False)
    first = engine.generate([PROMPTS[2], PROMPTS[3]], 20)
    turn = PROMPTS[2] + first[0].token_ids + [5, 6]
    again, plain = engine.generate([turn, turn], 12, trace=True), uncached.generate([turn, turn], 12, trace=True)
    assert again[0].cached_tokens >= 32 and plain[0].cached_tokens == 0
    assert [r.token_ids for r in again] == [r.token_ids for r in plain] == [walk(turn, 12)] * 2
    assert again[0].rounds == plain[0].rounds


def test_random_pair_lossless_and_seeded_sampling(world):
    """The random pair: greedy output equal to spec-off's through the pool; sampled rows, the same seeds give
    the same tokens whatever the other rows and slots, and greedy rows beside them stay greedy."""
    engine = tree_engine(world["random"], SHAPES[1])
    expected = [r.token_ids for r in eagle3_jax.Engine(world["random"][0], **POOL).generate(PROMPTS, 30)]
    assert [r.token_ids for r in engine.generate(PROMPTS, 30)] == expected
    seeds = [11, 12, 13, 14, 15]
    first = [r.token_ids for r in engine.generate(PROMPTS, 16, temperature=1.0, seed=seeds)]
    order = [3, 1, 4, 0, 2]
    again = engine.generate([PROMPTS[i] for i in order], 16, temperature=1.0, seed=[seeds[i] for i in order])
    assert [r.token_ids for r in again] == [first[i] for i in order]
    mixed = engine.generate(PROMPTS, 16, temperature=[0.0, 1.0, 0.0, 1.0, 0.0], seed=seeds)
    assert [mixed[i].token_ids for i in (0, 2, 4)] == [expected[i][:16] for i in (0, 2, 4)]
    assert [mixed[i].token_ids for i in (1, 3)] == [first[i] for i in (1, 3)]


def test_the_trace_and_the_usage_counts(ladder):
    """Each traced round: N node tokens, their parents (each before its child), and the accepted path, one node a
    level from the root, whose tokens are the target's choices before its bonus token; a live pool counts N drafted
    tokens a round and the path's accepted ones."""
    engine = ladder[SHAPES[0]]
    n, d, _ = SHAPES[0]
    results = engine.generate(PROMPTS[:2], 12, trace=True)
    for trace in results[0].rounds:
        assert len(trace.drafted) == len(trace.parents) == n and len(trace.target) == d + 1
        assert all(0 <= p < i for i, p in enumerate(trace.parents, 1))
        assert len(trace.path) == trace.accepted
        for depth, node in enumerate(trace.path):
            assert trace.parents[node - 1] == (trace.path[depth - 1] if depth else 0)
            assert trace.drafted[node - 1] == trace.target[depth]
    pool = LivePool(engine, max_batch=2)  # the stop width of generate's requests: their programs
    try:
        done = threading.Semaphore(0)
        for prompt in PROMPTS[:2]:
            pool.submit(pool.check(prompt, 12), lambda e: e.finished and done.release())
        assert done.acquire(timeout=600) and done.acquire(timeout=600)
        rounds = sum(len(r.accept_lengths) for r in results)
        assert pool.draft_tokens == n * rounds
        assert pool.accepted_tokens == sum(sum(r.accept_lengths) for r in results)
    finally:
        pool.close()


@pytest.mark.parametrize("kwargs, message", [
    ({"draft_top_k": 0}, "draft_top_k must be a positive int, got 0"),
    ({"draft_top_k": 2.0}, "draft_top_k must be a positive int"),
    ({"draft_top_k": 2, "draft_depth": True}, "draft_depth must be None or a positive int, got True"),
    ({"draft_top_k": 2}, "give draft_depth, its drafting steps"),
    ({"draft_depth": 2}, "draft_top_k=1 drafts a chain, as deep as num_draft_tokens"),
    ({"draft_top_k": 2, "draft_depth": 9}, "draft_depth=9 is more than num_draft_tokens=8"),
    ({"num_draft_tokens": 11, "draft_top_k": 2, "draft_depth": 2}, "more than the 6 candidates"),
    ({"draft_top_k": 2, "draft_depth": 3, "proposal": "sample"}, "use proposal='argmax' with a tree"),
    ({"draft_top_k": 2, "draft_depth": 3, "exact": True}, "exact=True's attention kernel has no tree mask"),
    ({"draft_top_k": 2, "draft_depth": 3, "num_draft_tokens": "auto"}, "chooses a chain's gamma"),
    ({"draft_top_k": 40, "draft_depth": 1, "num_draft_tokens": 8}, "more than the drafter's 32 draft tokens"),
])
def test_bad_tree_arguments_are_refused_before_device_work(world, kwargs, message):
    target, drafter = world["random"]
    with count_compilations() as compiles, pytest.raises(ValueError, match=message):
        eagle3_jax.Engine(target, drafter, **{"num_draft_tokens": 8, **POOL, **kwargs})
    assert compiles.count == 0


def test_a_tree_needs_an_eagle3_drafter(world):
    target = world["random"][0]
    for proposer in (None, eagle3_jax.PromptLookup()):
        with pytest.raises(ValueError, match="draft_top_k=2 drafts a tree from the top-k tokens of an EAGLE-3"):
            eagle3_jax.Engine(target, proposer, num_draft_tokens=4, draft_depth=2, draft_top_k=2, max_len=MAX_LEN)


def test_the_round_writes_no_further_than_its_pages_reach(world):
    """Engine.scratch and the page table's width: the drafter's beams ((D - 1) K slots) and the target's N + 1
    nodes past the committed KV all have a column, and a call's pages cover its rounds' commits and the last
    round's reach."""
    engine = tree_engine(world["random"], (8, 5, 4))
    reach = tree.TreeShape(8, 5, 4).reach
    assert reach == 16 and engine.scratch == reach - (5 + 1)
    assert engine.table_width * engine.page_size >= MAX_LEN + reach
    assert engine.spec.gamma == engine.draft_depth == 5 and engine.num_draft_tokens == 8
