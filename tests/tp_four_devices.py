"""Tensor parallelism on 4 virtual CPU devices, against the unsharded model and engine (themselves checked
against transformers) and, at tp 2, against transformers directly; and one mesh over two processes of one
device each (tests/tp_two_processes.py), started beside the others. Run by tests/test_tensor_parallel.py in
a child pytest with XLA_FLAGS=--xla_force_host_platform_device_count=4 (the suite's own processes have one
device); not collected by the suite itself.

Every compilation counts (the suite's time): the prompts share one prefill bucket, the targets are 3 layers
deep, each unsharded output is computed once (`world`'s caches) and serves every check against it."""

import dataclasses
import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

import eagle3_jax
from eagle3_jax.checkpoints import sharded
from eagle3_jax.models import qwen3, weights
from eagle3_jax.models.collectives import Shards
from eagle3_jax.parallel import layout
from eagle3_jax.parallel.mesh import tp_mesh

import drafter_oracle as oracle
import spec_worlds as worlds
from hf_models import build_model, build_moe_model, save_model, save_moe_model

ROOT = Path(__file__).parent.parent
# One prefill bucket (16 tokens) for all three prompts: one prefill compilation per engine.
PROMPTS = [[3, 17, 5, 40, 22, 9, 1], [30, 2], [7, 7, 7, 21, 44, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
MAX_LEN = 32  # the longest prompt reaches the cache edge at 16 new tokens
NEW = 20
LAYERS = 3  # the drafters' default capture layers (2, 1, 0) exist
SAMPLING = dict(temperature=[0.9, 0.0, 1.3], top_k=[12, 0, 0], top_p=[0.8, 1.0, 0.95], seed=[5, 6, 7])
SPEC_SAMPLING = dict(num_draft_tokens=3, max_len=MAX_LEN, proposal="argmax")


def test_four_devices():
    assert jax.device_count() == 4


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The dense target (GQA 4 with 2 KV heads: replicated at tp 4) and its speculators-format drafter; the
    permutation target and its pi2 drafter (every round accepts one draft); two MoE targets (fused experts;
    per-expert shards with dense layers between) and a drafter with an embedding of its own. Each target
    loads unsharded and, on first use, straight to the shards at tp 1, 2 or 4. The two processes on one mesh
    start here, on the dense target and its drafter, and are collected by the last test."""
    root = tmp_path_factory.mktemp("tp")
    out = {"folders": {}}
    for kind in ("random2", "permutation"):
        out["model:" + kind], out[kind] = worlds.save_target(kind, root / kind, layers=LAYERS)
        out["folders"][kind] = root / kind
    out["drafter"] = worlds.save_drafter("random2", root / "drafter", out["random2"])[2]
    out["two_processes"] = start_two_processes(root, root / "random2", root / "drafter")
    out["pi2"] = worlds.save_drafter("pi2", root / "pi2", out["permutation"])[2]
    for name in MOE:
        model = build_moe_model(name, seed=5, num_layers=LAYERS, vocab=worlds.V, hidden=worlds.D)
        out["folders"][name] = save_moe_model(model, root / name, name)
        out[name] = eagle3_jax.load_target(out["folders"][name], dtype="float32", progress=False)
    embed = torch.randn(worlds.V, worlds.D, generator=torch.Generator().manual_seed(3))
    out["own_embed"] = oracle.write_specforge(root / "own_embed", worlds.RANDOM_SPEC,
                                              oracle.random_drafter_state(worlds.RANDOM_SPEC, 4), embed=embed)
    yield out
    for proc, _ in out["two_processes"]:  # a failed test leaves them running
        proc.kill()


def start_two_processes(root: Path, target, drafter) -> list[tuple[subprocess.Popen, Path]]:
    """tests/tp_two_processes.py as processes 0 and 1 of one CPU device each (the 4-device flag dropped), each
    with its output file under root (a pipe nobody reads until the last test could fill and stall it)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=4", "")
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    args = [str(target), str(drafter), str(MAX_LEN), str(NEW), json.dumps(PROMPTS), json.dumps(SAMPLING)]
    started = []
    for i in range(2):
        log = root / f"process{i}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, "tests/tp_two_processes.py", str(i), str(port), *args],
                                    stdout=f, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        started.append((proc, log))
    return started


def cached(world, key, compute):
    """world[key], computed on first use: each unsharded oracle runs once for every check against it."""
    if key not in world:
        world[key] = compute()
    return world[key]


def unsharded_greedy(world, kind: str):
    return cached(world, ("greedy", kind), lambda: eagle3_jax.Engine(world[kind], max_len=MAX_LEN).generate(
        PROMPTS, NEW))


def unsharded_sampled(world):
    """The dense target speculating for seeded sampled rows (a greedy row beside them)."""
    return cached(world, "sampled", lambda: eagle3_jax.Engine(world["random2"], world["drafter"],
                                                              **SPEC_SAMPLING).generate(PROMPTS, NEW, **SAMPLING))


def sharded_target(world, kind: str, tp: int):
    """The world's `kind` target loaded straight to the shards of a tp mesh, once per (kind, tp)."""
    loaded = world.setdefault("sharded", {})
    if (kind, tp) not in loaded:
        loaded[kind, tp] = eagle3_jax.load_target(world["folders"][kind], dtype="float32", progress=False,
                                                  mesh=tp_mesh(tp))
    return loaded[kind, tp]


@functools.cache
def _sharded_forward(cfg, mesh):
    tp = mesh.devices.size
    local_cfg = layout.local_config(cfg, tp)
    specs = weights.partition_specs(weights.target_weights(local_cfg), layout.TARGET_RULES)

    def local(params, tokens):
        cache = qwen3.new_row_cache(local_cfg, tokens.shape[0], tokens.shape[1], params["embed"].dtype)
        hidden, _, _ = qwen3.forward_rows(params, local_cfg, tokens, cache, tp=Shards(tp))
        return qwen3.logits(params, hidden)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=P(None, None, "tp"),
                                 check_vma=False))


def sharded_logits(target, tokens: np.ndarray) -> np.ndarray:
    """The sharded prefill's logits, its devices' vocabulary slices side by side (the whole vocabulary)."""
    return np.asarray(_sharded_forward(target.config, target.mesh)(target.params, tokens))


@functools.partial(jax.jit, static_argnames="cfg")
def _unsharded_forward(params, tokens, cfg):
    cache = qwen3.new_row_cache(cfg, tokens.shape[0], tokens.shape[1], params["embed"].dtype)
    hidden, _, _ = qwen3.forward_rows(params, cfg, tokens, cache)
    return qwen3.logits(params, hidden)


def unsharded_logits(target, tokens: np.ndarray) -> np.ndarray:
    """The one-device forward's logits, jitted (op by op, its first run compiles every op: seconds more)."""
    return np.asarray(_unsharded_forward(target.params, tokens, target.config))


TOKENS = np.array([PROMPTS[0] + [0] * 9, PROMPTS[2]], np.int32)
MOE = ("moe_top3_norm_fused", "moe_top1_step2_sharded")
KINDS = ("random2",) + MOE


@pytest.mark.parametrize("kind, tp", [(kind, tp) for kind in KINDS[:2] for tp in (1, 2, 4)] + [(MOE[1], 4)])
def test_logits_equal_the_unsharded_forward(world, kind, tp):
    """The dense target and the fused-expert MoE at tp 1, 2 and 4; the MoE of per-expert shards with dense
    layers between at tp 4 (its engine below, with a drafter, at tp 4 too)."""
    expected = cached(world, ("logits", kind), lambda: unsharded_logits(world[kind], TOKENS))
    np.testing.assert_allclose(sharded_logits(sharded_target(world, kind, tp), TOKENS), expected, rtol=0, atol=1e-5)


def test_logits_at_tp2_equal_transformers(world):
    with torch.no_grad():
        expected = world["model:random2"](torch.as_tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(sharded_logits(sharded_target(world, "random2", 2), TOKENS), expected, rtol=0,
                               atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_loaded_shards_equal_the_placed_unsharded_target(world, kind):
    """Reading each device's slices from the files gives the shards that placing the loaded target gives."""
    loaded = sharded_target(world, kind, 4)
    placed = sharded.shard_target(world[kind], loaded.mesh)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(placed.params)):
        assert a.sharding == b.sharding and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_files_load_to_their_shards_bit_for_bit(world, tmp_path):
    folder = tmp_path / "bf16"
    world["model:random2"].to(torch.bfloat16).save_pretrained(folder)
    world["model:random2"].to(torch.float32)
    loaded = eagle3_jax.load_target(folder, dtype="bfloat16", progress=False, mesh=tp_mesh(4))
    placed = sharded.shard_target(eagle3_jax.load_target(folder, dtype="bfloat16", progress=False), loaded.mesh)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(placed.params)):
        assert a.dtype == b.dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def tokens_of(results):
    return [(r.token_ids, r.finish_reason) for r in results]


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_output_is_the_unsharded_engine(world, tp):
    """The dense target, spec off, up to the cache edge (tp 1: the tp-1 bench's dry run in the suite checks
    that a one-device mesh decodes the unsharded engine's tokens; the MoE target: with its drafter below)."""
    target = sharded_target(world, "random2", tp)
    expected = unsharded_greedy(world, "random2")
    engine = eagle3_jax.Engine(target, max_len=MAX_LEN, mesh=target.mesh)
    assert tokens_of(engine.generate(PROMPTS, NEW)) == tokens_of(expected)
    kinds = [kind for kind, _ in engine.device_events]  # one transfer per prefill and per call of rounds
    assert kinds.count("transfer") == kinds.count("prefill") + kinds.count("call") > 1
    assert expected[2].finish_reason == "length" and len(expected[2].token_ids) == MAX_LEN - len(PROMPTS[2])


@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5])
def test_speculation_is_lossless_up_to_the_cache_edge(world, gamma):
    """tp 4 (the target's KV heads replicated, the drafter replicated), the permutation world: every round
    accepts pi2's first draft, as on one device, and the longest prompt runs into max_len. Spec-off output is
    known: each token is pi of the one before."""
    expected = []
    for prompt in PROMPTS:
        out = [int(worlds.PI[prompt[-1]])]
        while len(out) < min(NEW, MAX_LEN - len(prompt)):
            out.append(int(worlds.PI[out[-1]]))
        expected.append((out, "length"))
    target = sharded_target(world, "permutation", 4)
    engine = eagle3_jax.Engine(target, world["pi2"], num_draft_tokens=gamma, max_len=MAX_LEN)  # the target's mesh
    got = engine.generate(PROMPTS, NEW)
    assert tokens_of(got) == expected
    for r in got:  # the last round may be cut by max_new_tokens or max_len
        assert r.accept_lengths[:-1] == [1] * (len(r.accept_lengths) - 1) and r.accept_lengths[-1] <= 1


def test_prompt_lookup_on_a_mesh_is_the_spec_off_output(world):
    """PromptLookup at tp 4 (its history replicated, as the drafter would be): the permutation world's known
    output, on prompts that hold the cycle's next tokens (lookups accepted) and prompts that do not."""
    prompts = [[int(t) for t in worlds.ORDER[:12]] + [int(t) for t in worlds.ORDER[:3]], PROMPTS[0]]
    expected = [[int(worlds.PI[p[-1]])] for p in prompts]
    for out, prompt in zip(expected, prompts):
        while len(out) < min(NEW, MAX_LEN - len(prompt)):
            out.append(int(worlds.PI[out[-1]]))
    target = sharded_target(world, "permutation", 4)
    got = eagle3_jax.Engine(target, eagle3_jax.PromptLookup(), num_draft_tokens=3, max_len=MAX_LEN).generate(
        prompts, NEW)
    assert [r.token_ids for r in got] == expected and max(got[0].accept_lengths) == 3


def test_moe_greedy_speculation_is_the_unsharded_greedy_output(world):
    """The MoE target with dense layers between (per-expert shards) at tp 4, speculating with a drafter whose
    own embedding is split over the vocabulary like the target's: the unsharded engine's spec-off greedy
    tokens, up to the cache edge."""
    kind = MOE[1]
    target = sharded_target(world, kind, 4)
    drafter = eagle3_jax.load_drafter(world["own_embed"], target, dtype="float32")
    assert drafter.params["embed"].sharding.spec == P("tp", None)
    got = eagle3_jax.Engine(target, drafter, num_draft_tokens=2, max_len=MAX_LEN, mesh=target.mesh).generate(
        PROMPTS, NEW)
    assert tokens_of(got) == tokens_of(unsharded_greedy(world, kind))


def test_seeded_sampling_gives_the_unsharded_tokens(world):
    """Filters (top-k, top-p) and draws across vocabulary shards, at prefill, verify and after a rejection:
    the unsharded engine's tokens, seed for seed, speculating with argmax proposals (sampled proposals' q:
    test_filters_and_draws_across_shards_are_the_unsharded_ones); a greedy row beside the sampled ones."""
    target = sharded_target(world, "random2", 4)
    got = eagle3_jax.Engine(target, world["drafter"], mesh=target.mesh, **SPEC_SAMPLING).generate(PROMPTS, NEW,
                                                                                                 **SAMPLING)
    assert tokens_of(got) == tokens_of(unsharded_sampled(world))
    assert got[1].token_ids == unsharded_greedy(world, "random2")[1].token_ids


def test_a_mesh_samples_through_the_radix_search_whatever_the_settings(world):
    """Settings the candidate filter takes on one device (every sampled row's top_k in [1, 64]) build the
    radix search on a mesh; a num_draft_tokens="auto" engine on a mesh is refused before anything is placed."""
    settings = dict(temperature=0.7, top_k=20)
    one = eagle3_jax.Engine(world["random2"], max_len=MAX_LEN)
    assert one.build_for(one.request(PROMPTS, 4, **settings)).filter == "candidates"
    target = sharded_target(world, "random2", 4)
    engine = eagle3_jax.Engine(target, max_len=MAX_LEN)
    assert engine.build_for(engine.request(PROMPTS, 4, **settings)).filter == "radix"
    with pytest.raises(ValueError, match="num_draft_tokens='auto' runs on one device"):
        eagle3_jax.Engine(target, world["drafter"], num_draft_tokens="auto", max_len=MAX_LEN)


def test_a_tp_that_does_not_split_the_target_is_refused_with_the_numbers(world):
    """random2: 8 heads, 2 KV heads, intermediate 104, vocabulary 48; tp 3 divides only the vocabulary."""
    mesh = tp_mesh(3)
    message = ("tp=3 does not divide the target's num_attention_heads=8, intermediate_size=104, "
               "num_key_value_heads=2")
    with pytest.raises(ValueError, match=message):
        eagle3_jax.load_target(world["folders"]["random2"], dtype="float32", progress=False, mesh=mesh)
    with pytest.raises(ValueError, match=message):
        eagle3_jax.Engine(world["random2"], max_len=MAX_LEN, mesh=mesh)
    with pytest.raises(ValueError, match="tp=8 needs 8 devices, and 4 are present"):
        tp_mesh(8)
    with pytest.raises(ValueError, match="the target is loaded on another mesh"):
        eagle3_jax.Engine(sharded_target(world, "random2", 4), max_len=MAX_LEN, mesh=tp_mesh(2))


def test_tp_floor_bench_dry_run(tmp_path):
    """The multi-device bench at tiny shapes: the step on a mesh of 4, its floor and the all-reduce probes."""
    import json

    from eagle3_jax_bench import tensor_parallel

    assert tensor_parallel.main(["--out", str(tmp_path), "--model", "tiny", "--tp", "4", "--batches", "2",
                                 "--kv-len", "16", "--reps", "1", "--inner", "1", "--dtype", "float32",
                                 "--copy-mb", "1", "--allreduce-mb", "1"]) == 0
    (row,) = json.loads((tmp_path / "tensor_parallel.json").read_text())["tp_step"]
    assert row["tp"] == 4 and row["allreduces"] == 1 + 2 * 6 and row["step_ms"] > 0 and row["floor_ms"] > 0


def test_filters_and_draws_across_shards_are_the_unsharded_ones():
    """filter_rows over 4 vocabulary slices: the same cut, tie id, top and mass as over whole rows, with many
    ties (logits on a coarse grid, some at the top-p boundary), and the same draws for the same keys; verify
    over those rows (2 rows of 3 drafts) the same accepted drafts and tokens, for argmax drafts and for
    drafts sampled from a q over 32 of the ids (the engine's sampled proposals)."""
    from eagle3_jax.decoding import sampling
    from eagle3_jax.models.collectives import Vocab

    rows, V = 8, 1024
    logits = np.round(np.random.default_rng(0).normal(0, 2, (rows, V)), 0).astype(np.float32)
    logits[1] = 0.0  # one row all tied
    temperature = np.array([1, 0.7, 1, 1.3, 1, 0.5, 1, 2], np.float32)
    top_k = np.array([0, 5, 50, 0, 1, 3, 1024, 200], np.int32)
    top_p = np.array([1, 0.9, 0.5, 0.3, 1, 0.95, 0.8, 0.99], np.float32)
    keys = jax.random.split(jax.random.key(3), rows)
    rng = np.random.default_rng(1)
    # Batch row 0 (filter rows 0-3) drafts any ids (mostly rejected); batch row 1 (rows 4-7) the largest
    # logits of rows 4-6, which keep 1 (top-k), 3 and many tokens (mostly accepted). q covers all 6.
    best = np.argmax(logits[4:7], axis=-1)
    others = np.setdiff1d(rng.permutation(V), best)[:29]
    q_ids = np.concatenate([best, others]).astype(np.int32)
    q = rng.dirichlet(np.ones(32), (2, 3)).astype(np.float32)  # [B, G, 32]
    drafts = jax.numpy.asarray(np.stack([others[:3], best]), jax.numpy.int32)
    room = np.array([3, 2], np.int32)
    q, q_ids = jax.numpy.asarray(q), jax.numpy.asarray(q_ids)

    def filtered(vocab):
        def run(x, t, k, p, keys):
            f = sampling.filter_rows(x, t, k, p, vocab, filter="radix")  # the only filter of a split vocabulary
            one_hot = sampling.verify(keys[:2], f, drafts, None, room)
            from_q = sampling.verify(keys[:2], f, drafts, q, room, q_ids)
            return (f.cut, f.tie_id, f.top, f.total, f.probs(), sampling.categorical(keys, f.probs(), vocab),
                    *one_hot, *from_q)
        return run

    whole = jax.jit(filtered(Vocab()))(logits, temperature, top_k, top_p, keys)
    mesh = tp_mesh(4)
    split = jax.jit(jax.shard_map(filtered(Vocab(Shards(4))), mesh=mesh, in_specs=(P(None, "tp"), P(), P(), P(), P()),
                                  out_specs=(P(), P(), P(), P(), P(None, "tp")) + (P(),) * 5, check_vma=False))
    got = split(logits, temperature, top_k, top_p, keys)
    for name, a, b in zip(("one-hot accepted", "one-hot tokens", "q accepted", "q tokens"), whole[6:], got[6:]):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
    accepted = np.concatenate([np.asarray(whole[6]), np.asarray(whole[8])])
    assert accepted.max() > 0 and (accepted < room.tolist() * 2).any(), accepted  # accepts and rejections
    for name, a, b in zip(("cut", "tie_id", "top"), whole[:3], got[:3]):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
    np.testing.assert_allclose(np.asarray(got[3]), np.asarray(whole[3]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[4]), np.asarray(whole[4]), rtol=1e-6, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(got[5]), np.asarray(whole[5]))
    assert len(set(np.asarray(whole[1]).tolist())) > 2  # tie ids at work, not all "none at the cut"


def test_no_step_moves_a_row_of_logits(tmp_path):
    """The sampling build's chunk call and mixed call of rounds at tp 4 (a target of vocabulary 80 = 4 x 20, width
    48): no collective carries a vocabulary axis, whole or sliced; each reduction over it moves a few numbers per
    row, the rest are the [B, T, D] all-reduces."""
    from eagle3_jax.decoding import live, live_plan, spec_round
    from eagle3_jax.decoding import parallel_steps as steps

    model = build_model("gqa4_sharded", seed=1, num_layers=2, vocab=80, hidden=48)
    folder = save_model(model, tmp_path, "gqa4_sharded")
    mesh = tp_mesh(4)
    target = eagle3_jax.load_target(folder, dtype="float32", progress=False, mesh=mesh)
    # 12 chunk tokens beside 4 rows: the mixed forward's [1, 16, 48] all-reduce has no axis of 20 or 80
    engine = eagle3_jax.Engine(target, max_len=MAX_LEN, max_batch=4, prefill_chunk=12)
    spec = dataclasses.replace(engine.spec, sampling=True)
    rows = engine.steps.empty(engine.spec, 4, engine.table_width, 8, jnp.float32)
    state = spec_round.with_pages(rows, engine.page_pool.arrays)
    chunks = engine.steps.put(live.device_chunks(live_plan.empty_chunk(12, engine.prefill_sequences,
                                                                        engine.table_width, 8, 4, alone=False)))
    chunk = jax.tree.map(lambda x: x[0], chunks)  # one round's: an exact engine's call of its own takes one
    prefill = jax.make_jaxpr(functools.partial(steps.jit_prefill, spec=spec, mesh=mesh))(target.params, None, state,
                                                                                         chunk)
    rounds = jax.make_jaxpr(functools.partial(steps.jit_rounds, spec=spec, num_rounds=1, mesh=mesh))(
        target.params, None, state, chunks)
    for jaxpr in (prefill, rounds):
        moved = collectives_in(jaxpr.jaxpr)
        assert {name for name, _ in moved} >= {"all_gather", "psum", "pmax", "pmin"}
        for name, shape in moved:
            assert 80 not in shape and 20 not in shape, (name, shape)


def collectives_in(jaxpr) -> list[tuple[str, tuple[int, ...]]]:
    """(primitive, operand shape) of every collective in a jaxpr and the jaxprs inside it."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("all_gather", "psum", "pmax", "pmin", "psum_invariant", "all_to_all", "ppermute"):
            found += [(name.replace("_invariant", ""), tuple(v.aval.shape)) for v in eqn.invars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += collectives_in(inner)
    return found


def test_two_processes_decode_as_one(world):
    """One mesh over two processes of one CPU device each (jax.distributed, gloo), started with the world:
    each loads its shard of the dense target, and both emit the one-process engine's tokens, speculating for
    seeded sampled rows (a greedy row beside them), seed for seed."""
    expected = [r.token_ids for r in unsharded_sampled(world)]
    for proc, log in world["two_processes"]:
        proc.wait(timeout=300)
        out = log.read_text()
        assert proc.returncode == 0, out[-3000:]
        printed = [line for line in out.splitlines() if line.startswith("[")]  # the tokens; the rest is logging
        assert printed and json.loads(printed[-1]) == expected, out[-3000:]
