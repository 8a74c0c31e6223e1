"""The benchmark at tiny shapes on the CPU: every section runs and the JSON has its fields (times are
not asserted: speed is measured on the GPU, see BENCHMARKS.md)."""

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from eagle3_jax.decoding import engine as engine_lib
from eagle3_jax_bench import (
    bench,
    checks,
    dense,
    lookup,
    moe,
    moe_layer,
    outputs,
    profile,
    round_ab,
    sampling,
    structured,
)
from eagle3_jax_bench.core import Run

from cuda_lowering import lower_for_cuda


def test_bench_smoke(tmp_path):
    assert bench.main(["--tiny", "--out", str(tmp_path), "--kernels", "xla"]) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["skipped"] == []
    assert all(row["identical"] for rows in results["agreement"].values() for row in rows)  # float32
    assert {"copy_tbps", "matmul_tflops"} <= set(results["ceilings"])
    for section in ("decode", "verify", "draft_step", "chain", "rebuild", "round"):
        assert results[section], section
        for row in results[section]:
            assert row["time_ms"] > 0 and row["floor_ms"] > 0 and row["ratio"] > 0 and row["compile_s"] > 0
    assert {(r["batch"], r["kv_len"]) for r in results["decode"]} == {(2, 32)}
    assert {r["tokens"] for r in results["verify"]} == {3}
    for r in results["round"]:
        assert set(r["parts_ms"]) == {"verify", "chain", "rebuild"} and "overhead" in r
        assert r["time_ms_one_round_per_call"] > 0
        assert list(r["projected_tokens_per_s"]) == [str(t) for t in range(1, r["gamma"] + 2)]
    engine = results["engine"]
    assert engine["transfers_per_call"] == 1.0 and engine["compilations_in_the_timed_request"] == 0
    assert engine["rounds_per_call"] == 4 and all(r["rounds_per_call"] == 4 for r in results["decode"])
    assert results["peer"]["tokens_per_s"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--rounds-per-call", "0"], "--rounds-per-call must be >= 1, got 0"),
    (["--routing", "local"], "--routing is for --model qwen3-30b-a3b"),
    (["--experts-only"], "--experts-only is for --model qwen3-30b-a3b"),
    (["--steps-only"], "--steps-only is for --model qwen3-30b-a3b"),
    (["--model", "qwen3-30b-a3b", "--experts-only", "--steps-only"], "two runs: give one"),
    (["--model", "qwen3-30b-a3b", "--kernels", "xla", "pallas"], "measures one --kernels choice"),
])
def test_bench_refuses_bad_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--tiny"] + argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_compare_reports_the_first_difference_and_its_margin(tmp_path):
    """The agreement report's logic (the smoke test runs the check itself): where two outputs first differ,
    and the target's top-2 logit margin there."""
    import jax.numpy as jnp
    import numpy as np

    from eagle3_jax.models import qwen3 as target_lib

    s = dense.setup(Run(600, tmp_path, "bench.json"), dense.tiny_plan(), ("xla",), jnp.float32)
    target = s.target
    assert checks.compare(target, [[1, 2]], [[5, 6, 7]], [[5, 6, 8]]) == [
        {"identical": False, "tokens": 3, "first_difference": 2, "margin": checks.margin(target, [1, 2, 5, 6])}]
    assert checks.compare(target, [[1]], [[4, 4]], [[4, 4]]) == [{"identical": True, "tokens": 2}]
    tokens = [3, 1, 4, 1, 5]
    cache = target_lib.new_row_cache(s.plan.target, 1, 5, jnp.float32)
    hidden, _, _ = target_lib.forward_rows(s.tparams, s.plan.target, jnp.asarray([tokens]), cache)
    logits = np.sort(np.asarray(target_lib.logits(s.tparams, hidden[0, -1])))
    assert abs(checks.margin(target, tokens) - (logits[-1] - logits[-2])) < 1e-6


def test_count_compilations_counts_backend_compiles():
    """Every compilation in the block, or with fun_name those of one function (planted's count of the call of
    rounds' compilations beside the timing's own helpers)."""
    import jax
    import jax.numpy as jnp

    def triple(x):
        return x * 3 + 1

    f, g = jax.jit(triple), jax.jit(lambda x: x - 1)
    five, six, seven = jnp.ones(5), jnp.ones(6), jnp.ones(7)
    with profile.count_compilations() as first:
        f(five)
        f(five)  # cached
    with profile.count_compilations() as second:
        f(five)
        f(six)  # a new shape compiles
    with profile.count_compilations("triple") as named:
        f(seven)
        g(seven)  # another function: not counted
        g(six)
    assert first.count == 1 and second.count == 1 and named.count == 1


def test_kernel_groups_sort_a_profile_by_kind():
    """The step profile's summary: kernel names as XLA and our Pallas calls name them."""
    times = {"gemm_fusion_dot_147": [36, 1700.0], "ragged_paged_attention": [36, 160.0], "add_rms_norm__1": [72, 160.0],
             "loop_reduce_fusion_106": [72, 80.0], "input_reduce_fusion_2": [36, 1650.0],  # a batch-1 matvec
             "entry_mosaic_gpu_kernel": [48, 270.0], "moe_router": [48, 150.0], "moe_down": [48, 600.0],
             "rope_page_write": [48, 100.0]}
    assert profile.kernel_groups(times) == {"matmuls": 3350.0, "attention": 430.0, "fused norm": 160.0,
                                            "other (small XLA fusions)": 80.0, "routed experts": 600.0,
                                            "MoE router": 150.0, "RoPE + KV write": 100.0}
    assert profile.gpu_kernel_times(lambda: None) == {}  # no GPU here: no trace, no numbers
    assert profile.gpu_events(lambda: None) == []


def test_a_traces_busy_and_idle_time_and_the_ops_behind_its_kernels():
    """busy_and_idle on kernels with gaps and an overlap (another stream's, counted once); kernel_sources finds the
    jax ops a fusion runs in the optimised HLO's text, by the trace's name (dots as underscores)."""
    events = [("a", 0.0, 2.0), ("b", 3.0, 2.0), ("c", 4.0, 3.0), ("d", 10.0, 1.0)]  # c overlaps b by 1 us
    assert profile.busy_and_idle(events) == (7.0, 4.0) and profile.busy_and_idle([]) == (0.0, 0.0)

    def f(x):
        with jax.named_scope("layer_0"):
            y = jnp.sin(x) @ x
        with jax.named_scope("layer_1"):
            return jnp.exp(y).sum(0)

    text = jax.jit(f).lower(jnp.ones((64, 64))).compile().as_text()
    fusion = re.search(r"%([\w.]*fusion[\w.]*) = ", text).group(1)
    sources = profile.kernel_sources(text, [fusion.replace(".", "_"), "no_such_kernel"])
    assert "layer_1/reduce_sum" in sources[fusion.replace(".", "_")] and sources["no_such_kernel"] == []


def test_sampling_section_and_its_sort_reference(tmp_path):
    """`--sampling-only`'s measurement at tiny shapes (its fields, each sampled round in the build its settings
    take), every variant of the candidate filter finds the radix search's cuts, and the sort-based filter
    it is timed against keeps what the engine's filter keeps (tie-free logits: the tie rule is the engine's
    alone)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from eagle3_jax.decoding import sampling as sampling_lib

    run = Run(600, tmp_path, "bench.json")
    setup = dense.setup(run, dense.tiny_plan(), ("xla",), jnp.float32)
    sampling.sampling(run, setup, 1, 0, "xla")  # the spec-off step
    sampling.sampling(run, setup, 2, 1, "xla")  # a round, and its parts, at batch 2 (rows and batch apart)
    spec_off, entry = run.results["sampling"]
    for proposal in ("argmax", "sample"):
        for label in ("qwen3_defaults", "top_p_only"):
            assert entry[f"{proposal}_{label}_ms"] > 0 and f"{proposal}_{label}_extra" in entry
            assert (f"{proposal}_{label}_ms" in spec_off) == (proposal == "argmax")
            assert entry["compile_s"][f"{proposal}_{label}"] > 0
    builds = [sampling_lib.filter_for(sampling_lib.SamplingParams(*(np.array([x]) for x in settings), None))
              for _, settings in sampling.SETTINGS]
    assert builds == ["candidates", "radix"]
    assert spec_off["greedy_ms"] > 0 and "filter_ms" not in spec_off and "draft_step_ms" not in spec_off
    parts = [*sampling._filters(), *sampling._draft_steps(), "verify_argmax_ms", "verify_sample_ms", "final_draw_ms"]
    assert entry["greedy_ms"] > 0 and all(entry[k] > 0 for k in parts)
    assert {"filter_blocks32_ms", "filter_blocks16x16_ms", "draft_step_blocks16x16_ms", "filter_radix_ms"} <= set(parts)
    assert len(sampling.summary_lines(run.results)) == 4
    # Every block size of the candidate filter, 32 candidates at top_k 20, and the radix search find the same cuts.
    x = jax.random.normal(jax.random.key(4), (8, 700), jnp.float32) * 3
    t, k, p = jnp.full((8,), 0.6), jnp.full((8,), 20, jnp.int32), jnp.full((8,), 0.95)
    filters = sampling._filters()
    radix = jax.jit(filters["filter_radix_ms"])(x, t, k, p)
    for name in ("filter_ms", "filter_blocks32_ms", "filter_blocks16x16_ms", "filter_k32_ms"):
        cut, tie_id, _, total = jax.jit(filters[name])(x, t, k, p)
        np.testing.assert_array_equal(cut, radix[0])
        np.testing.assert_array_equal(tie_id, radix[1])
        np.testing.assert_allclose(total, radix[2], rtol=1e-6)
    logits = jax.random.normal(jax.random.key(3), (6, 500), jnp.float32) * 3
    t, k, p = jnp.array([0.6, 1.0, 1.3, 0.6, 1.0, 2.0]), jnp.array([20, 0, 5, 1, 500, 50]), jnp.full((6,), 0.9)
    np.testing.assert_allclose(sampling.sorted_filter(logits, t, k, p),
                               sampling_lib.filtered_probs(logits, t, k, p, filter="radix"), atol=1e-6)


def test_moe_bench_smoke(tmp_path, monkeypatch):
    """`bench --model qwen3-30b-a3b` at tiny shapes, one gamma and one token count: every section runs and
    the floors count the routed experts only."""
    import dataclasses

    tiny = moe.tiny_plan()
    plan = dataclasses.replace(tiny, base=dataclasses.replace(tiny.base, gammas=(1,)), ffn_tokens=(2,))
    monkeypatch.setattr(moe, "tiny_plan", lambda: plan)
    args = ["--tiny", "--model", "qwen3-30b-a3b", "--out", str(tmp_path), "--kernels", "xla", "--rounds-per-call", "1"]
    assert bench.main(args) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["skipped"] == [] and results["routing_used"]["steps"] == "random routers"
    for section in ("decode", "verify", "round"):
        (row,) = results[section]
        assert row["time_ms"] > 0 and row["floor_ms"] > 0
    cfg = plan.base.target
    all_experts = cfg.num_layers * cfg.moe.num_experts * moe.expert_bytes(cfg, 4)
    assert results["decode"][0]["bytes_read"] < all_experts  # 4 of 16 experts per layer, not all
    experts = results["experts"]
    paths = ("gathered", "grouped", "kernel", "grouped_in_out")
    assert {(r["routing"], r["path"]) for r in experts} == {(k, p) for k in moe.ROUTINGS for p in paths}
    projection = results["projection"]["batch_1"]
    assert projection["best_gamma"] == 1 and projection["gammas"]["1"]["speedup"] > 0


def test_moe_bench_steps_only(tmp_path, monkeypatch):
    """`bench --model qwen3-30b-a3b --steps-only` at tiny shapes: the decode and verify rows on the routed
    floors, the expert path of each step's token count, no drafter rows and no experts section; the decode
    step's trace row from a stand-in for the GPU's trace (two kernels a layer, 1 us apart)."""
    import dataclasses

    tiny = moe.tiny_plan()
    plan = dataclasses.replace(tiny, base=dataclasses.replace(tiny.base, gammas=(1,)))
    monkeypatch.setattr(moe, "tiny_plan", lambda: plan)
    layers = plan.base.target.num_layers
    events = [e for i in range(layers) for e in (("moe_gate_up", 10.0 * i, 4.0), ("fusion_7", 10.0 * i + 5, 3.0))]
    monkeypatch.setattr(profile, "gpu_events", lambda run: run() is not None and events)
    args = ["--tiny", "--model", "qwen3-30b-a3b", "--steps-only", "--out", str(tmp_path), "--kernels", "xla",
            "--rounds-per-call", "1"]
    assert bench.main(args) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["skipped"] == [] and not {"round", "chain", "experts", "layer_ops"} & set(results)
    (decode,), (verify,) = results["decode"], results["verify"]
    assert decode["batch"] == 1 and verify["tokens"] == 2 and verify["time_ms"] > 0 and verify["floor_ms"] > 0
    cfg = plan.base.target
    assert decode["bytes_read"] < cfg.num_layers * cfg.moe.num_experts * moe.expert_bytes(cfg, 4)
    assert results["expert_path_by_tokens"] == {"1": "gathered", "2": "gathered"}
    (trace,) = results["trace"]
    assert trace["rounds"] == 1 and trace["kernels"] == 2 * layers
    assert trace["per_layer_us"] == pytest.approx({"kernels": 7.0, "idle": 3.0 - 2.0 / layers, "routed experts": 4.0,
                                                   "other (small XLA fusions)": 3.0})
    assert trace["top_per_layer"]["moe_gate_up"][:2] == [1.0, 4.0]


def test_moe_bench_experts_only(tmp_path, monkeypatch):
    """`bench --model qwen3-30b-a3b --experts-only` at tiny shapes: one decoder layer's ops, every expert
    path (the kernel at one token, the others at two) and the chunk section's paths at 40 tokens, each against
    its floor; the op rows' bytes add up to the layer's."""
    import dataclasses

    plan = dataclasses.replace(moe.tiny_plan(), ffn_tokens=(1,), others_tokens=(2,))
    monkeypatch.setattr(moe, "tiny_plan", lambda: plan)
    args = ["--tiny", "--model", "qwen3-30b-a3b", "--experts-only", "--out", str(tmp_path), "--kernels", "xla"]
    assert bench.main(args) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["skipped"] == [] and "decode" not in results
    ops = {r["op"]: r for r in results["layer_ops"]}
    assert set(ops) == {"norm", "attention", "router_topk", "router_topk_sort", "router_topk_kernel", "experts",
                        "moe_mlp", "layer", "final_norm_lm_head"}
    assert all(r["time_ms"] > 0 and r["floor_ms"] > 0 for r in ops.values())
    parts = 2 * ops["norm"]["bytes_read"] + ops["attention"]["bytes_read"] + ops["moe_mlp"]["bytes_read"]
    assert ops["layer"]["bytes_read"] == parts and ops["experts"]["expert_path"] == "gathered"
    assert all(ops[name]["kernels_us_per_application"] == {} for name in moe_layer.PROFILED)  # a GPU trace only
    cfg = plan.base.target
    assert ops["experts"]["bytes_read"] == moe.expert_bytes(cfg, 4) * cfg.moe.num_experts_per_tok
    paths = {(r["path"], r["tokens"]) for r in results["experts"] if r["routing"] == "random"}
    assert paths == {("kernel", 1), ("gathered", 2), ("grouped", 2), ("grouped_in_out", 2)}
    assert all(r["ratio"] > 0 for r in results["experts"])
    chunk_rows = {(r["path"], r["tokens"], r["tile"]): r for r in results["chunks"]}
    tiles = {("tiled", 40, moe.moe.tile_rows(40 * cfg.moe.num_experts_per_tok, cfg.moe.num_experts))}
    assert set(chunk_rows) == {("grouped", 40, None)} | tiles | {(f"tiled_{t}", 40, t) for t in moe.CHUNK_TILES}
    assert all(r["ratio"] > 0 and r["x_compute_floor"] > 0 for r in chunk_rows.values())
    # The kernel's tunings are timed on the GPU only: each lowers to Triton here at the benchmark's shapes
    # (hidden 2048, moe_intermediate 768, 128 experts) for 1 row (8 slots) and 64 rows (128 slots).
    import jax
    import jax.numpy as jnp

    from pallas_kernels import routed_experts

    E, D, Ie, bf16, spec = 128, 2048, 768, jnp.bfloat16, jax.ShapeDtypeStruct
    for name, tuning in moe.KERNEL_TUNINGS.items():
        for M, S in ((1, 8), (64, 128)):
            args = (spec((M, D), bf16), spec((S, M), bf16), spec((S,), jnp.int32), spec((1,), jnp.int32),
                    spec((E, 2 * Ie, D), bf16), spec((E, D, Ie), bf16))
            lowered = lower_for_cuda(routed_experts._experts, *args, config=pallas_kernels.ExpertsConfig(**tuning),
                                     interpret=False)
            assert lowered.count("moe_down") >= 1, (name, M)


def test_synthetic_routing_and_the_tau_model():
    for kind in moe.ROUTINGS:
        ids = moe.synthetic_routing(kind, layers=3, rows=2, tokens=5, experts=16, top_k=4)
        assert ids.shape == (3, 10, 4) and ids.min() >= 0 and ids.max() < 16
        assert all(len(set(row)) == 4 for row in ids.reshape(-1, 4))  # k distinct experts per token
    local = moe.synthetic_routing("local", layers=8, rows=1, tokens=32, experts=128, top_k=8)
    uniform = moe.synthetic_routing("random", layers=8, rows=1, tokens=32, experts=128, top_k=8)
    assert moe.distinct_per_layer(local).mean() < moe.distinct_per_layer(uniform).mean()
    assert abs(moe.tau_model(3) - 2.5) < 1e-9 and 1 < moe.tau_model(1) < moe.tau_model(2) < 2.5


LIBRARY_READING_ARGV = '''
import sys

from absl import flags

MODE = flags.DEFINE_string("bench_test_mode", "heuristics", "a library's own flag")


def mode():
    """As tokamax 0.0.17's config reads its flags: the first read parses sys.argv when absl has not."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv)
    return MODE.value


MODE_AT_IMPORT = mode()  # tokamax reads its flags when called; a library may read them on import too
'''


def test_a_library_that_parses_argv_with_absl_does_not_read_the_bench_flags(tmp_path, monkeypatch):
    """tokamax parses sys.argv with absl the first time it reads a flag: imported plainly, a library that
    does so refuses the bench's own --model; imported through core.import_absl_library, its flags keep
    their defaults."""
    import importlib
    import sys

    from absl import flags

    from eagle3_jax_bench.core import import_absl_library

    (tmp_path / "argv_reading_library.py").write_text(LIBRARY_READING_ARGV)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["eagle3-jax", "bench", "--model", "qwen3-30b-a3b"])
    was_parsed = flags.FLAGS.is_parsed()
    flags.FLAGS.unparse_flags()
    try:
        with pytest.raises(flags.UnrecognizedFlagError, match="model"):
            importlib.import_module("argv_reading_library")
        flags.FLAGS.unparse_flags()
        delattr(flags.FLAGS, "bench_test_mode")  # defined again by the next import
        library = import_absl_library("argv_reading_library")
        assert library.MODE_AT_IMPORT == library.mode() == "heuristics" and flags.FLAGS.is_parsed()
        with pytest.raises(ImportError, match="no_such_library"):
            import_absl_library("no_such_library")
    finally:
        flags.FLAGS.unparse_flags()
        delattr(flags.FLAGS, "bench_test_mode")
        sys.modules.pop("argv_reading_library", None)
        if was_parsed:
            flags.FLAGS.mark_as_parsed()


# (total, non-embedding) parameters in billions, as the Qwen3 model cards give them.
PUBLISHED_PARAMETERS = {"qwen3-1.7b": (1.7, 1.4), "qwen3-8b": (8.2, 6.95), "qwen3-32b": (32.8, 31.2),
                        "qwen3-30b-a3b": (30.5, 29.9), "qwen3-235b-a22b": (235, 234)}


def test_presets_have_the_published_parameter_counts():
    """Each real-shape preset's target, counted from its abstract params, has the parameters its model card
    states (to the card's rounding); an unknown preset is refused with the choices named."""
    import math

    import jax

    from eagle3_jax.models import qwen3
    from eagle3_jax_bench import presets

    for name, (total, non_embedding) in PUBLISHED_PARAMETERS.items():
        target, drafter = presets.pair(name)
        params = qwen3.abstract_params(target, "bfloat16")
        count = sum(math.prod(x.shape) for x in jax.tree.leaves(params)) / 1e9
        vocab = sum(math.prod(params[k].shape) for k in ("embed", "lm_head") if k in params) / 1e9
        assert abs(count / total - 1) < 0.03 and abs((count - vocab) / non_embedding - 1) < 0.01, name
        assert drafter.hidden_size == target.hidden_size and drafter.target_vocab_size == target.vocab_size
    assert presets.pair("qwen3-30b-a3b")[0].moe.num_experts == 128
    with pytest.raises(ValueError, match="unknown model preset 'qwen3-9b'; presets: qwen3-1.7b, qwen3-8b"):
        presets.pair("qwen3-9b")


def test_pool_bench_dry_run(tmp_path):
    """The continuous-batching bench at tiny shapes: a pool and fixed chunks over the same prompts emit the same
    tokens, Engine.compile leaves the timed runs nothing to compile, each pool row has its floor, the sweep runs
    each chunk, and the shared-prefix workload hits the cache with caching on only, emitting the same tokens."""
    from eagle3_jax_bench import pool

    assert pool.main(["--out", str(tmp_path), "--model", "tiny", "--prompts", "8", "--pools", "2", "--gammas", "0",
                      "--lengths", "4", "20", "--budgets", "2", "6", "--runs", "pool", "fixed_chunks", "steady",
                      "--sweep", "8", "--sweep-prompts", "4", "--shared-prefix", "100", "--prefix-prompts", "4",
                      "--prefix-lengths", "3", "8"]) == 0
    results = json.loads((tmp_path / "pool_bench.json").read_text())
    runs = {r["run"]: r for r in results["pool"] if r["run"] in ("pool", "fixed_chunks")}
    assert set(runs) == {"pool", "fixed_chunks"} and runs["pool"]["tokens"] == runs["fixed_chunks"]["tokens"] > 8
    assert all(r["compilations"] == 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 for r in results["pool"])
    (floor,) = results["floor"]
    assert floor["floor_s"] == max(floor["compute_s"], floor["bytes_s"]) > 0
    assert runs["pool"]["x_floor"] == pytest.approx(runs["pool"]["seconds"] / floor["floor_s"])
    assert results["steady"][0]["tokens_per_s"] > 0
    assert [r["prefill_chunk"] for r in results["pool"] if r["run"] == "sweep"] == [engine_lib.PREFILL_CHUNK, 8]
    on, off = results["shared_prefix"]
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)
    assert on["cached_tokens"] == 2 * 64 and off["cached_tokens"] == 0  # a page of 64 for each after the first chunk
    shared = [r for r in results["pool"] if r["run"] == "shared_prefix"]
    assert shared[0]["tokens"] == shared[1]["tokens"]


def test_pool_bench_on_the_planted_world_accepts_drafts(tmp_path):
    from eagle3_jax_bench import pool

    assert pool.main(["--out", str(tmp_path), "--model", "tiny", "--prompts", "4", "--pools", "2", "--gammas", "3",
                      "--lengths", "4", "20", "--budgets", "8", "12", "--planted-tau", "3"]) == 0
    results = json.loads((tmp_path / "pool_bench.json").read_text())
    assert results["world"]["tau_at_gamma_3"] == 3 and results["steady"][0]["tau"] > 2
    assert results["pool"][0]["planted_match"] == 1.0  # every prompt's tokens are the target's continuation


def test_auto_gamma_bench_and_calibration_dry_run(tmp_path, monkeypatch, capsys):
    """eagle3_jax_bench/auto_gamma.py at the tiny preset: every engine runs and the comparisons are filled in;
    the cost table `bench --calibrate` prints is the one the auto engine stored (speed is the GPU's to
    measure)."""
    from eagle3_jax.decoding import round_costs
    from eagle3_jax_bench import auto_gamma

    monkeypatch.setattr(round_costs, "default_folder", lambda: tmp_path / "costs")
    monkeypatch.setattr(round_costs, "STALE_RATIO", 1e6)  # a shared CPU's timings wander: no re-measuring here
    assert auto_gamma.main(["--out", str(tmp_path), "--model", "tiny", "--batches", "2", "--max-gamma", "1",
                            "--prompt-len", "4", "--max-new-tokens", "6", "--reps", "1"]) == 0
    (row,) = json.loads((tmp_path / "auto_gamma.json").read_text())["rows"]
    assert set(row["runs"]) == {"0", "1", "auto"} and row["auto_vs_spec_off"] > 0 and row["best_fixed_gamma"] in (0, 1)
    assert all(r["tokens"] == 12 for r in row["runs"].values()) and sum(row["runs"]["auto"]["gammas_of_row_0"].values())
    assert all(row["catch_up"][k] > 0 for k in ("hold_ms", "flush_ms", "spec_off_ms"))
    (stored,) = (tmp_path / "costs").glob("*.json")
    table = auto_gamma.calibrate(*auto_gamma.models("tiny"), (2,), 1, 4 + 6 + 1 + 2)  # the bench's max_len
    assert table["seconds"][2] == [pytest.approx(s) for s in json.loads(stored.read_text())["seconds"]["2"]]
    assert "batch    2 kv      1:" in capsys.readouterr().out
    called = []
    monkeypatch.setattr(auto_gamma, "calibrate_preset", called.append)
    assert bench.main(["--tiny", "--calibrate"]) == 0 and called == ["tiny"]


def test_lookup_bench_dry_run(tmp_path, capsys):
    """The prompt-lookup bench (eagle3_jax_bench/lookup.py) on the tiny preset: the copy task is copied whole
    (tau gamma + 1), the output is the cycle's, and the table and JSON hold both proposers' rows."""
    assert lookup.main(["--out", str(tmp_path / "lookup.json"), "--dry-run"]) == 0
    out = json.loads((tmp_path / "lookup.json").read_text())
    rows = {r["proposer"]: r for r in out["rows"]}
    assert set(rows) == {"off", "prompt_lookup"} and all(r["tokens_follow_f"] for r in rows.values())
    assert rows["prompt_lookup"]["tau"] == 4.0 and rows["off"]["tau"] == 1.0
    assert rows["prompt_lookup"]["round_vs_step"] > 0 and rows["prompt_lookup"]["speedup"] > 0
    no_search = rows["prompt_lookup"]
    assert no_search["verify_ms"] > 0 and no_search["search_ms"] == no_search["round_ms"] - no_search["verify_ms"]
    assert "prompt_lookup" in capsys.readouterr().out
    with pytest.raises(ValueError, match="its new_tokens at most stretch - 8"):
        lookup.run(dataclasses.replace(lookup.dry_plan(), new_tokens=40))


def test_round_ab_dry_run(tmp_path, capsys):
    """The A/B of two checkouts' rounds (eagle3_jax_bench/round_ab.py) on the tiny preset, with this checkout as the
    one tree: its child process times both engines at both batches; without trees it refuses."""
    root = Path(__file__).resolve().parents[1]
    assert round_ab.main(["--trees", str(root), "--out", str(tmp_path / "ab.json"), "--dry-run"]) == 0
    out = json.loads((tmp_path / "ab.json").read_text())
    assert [(r["batch"], r["gamma"]) for r in out["rows"]] == [(1, 3), (1, 0), (2, 3), (2, 0)]
    assert all(len(r["ms"]) == 1 and r["ms"][0] > 0 and r["last_over_first"] == 1.0 for r in out["rows"])
    assert "last / first" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        round_ab.main(["--out", str(tmp_path / "ab.json")])


def test_trees_bench_dry_run(tmp_path):
    """eagle3_jax_bench/trees.py at the tiny preset: the spec-off step, the depth-2 chain's round and a (4, 2, 2)
    tree's, each with its projections at the dry run's taus (tau x batch / round; tau x step / round)."""
    from eagle3_jax_bench import trees

    assert trees.main(["--tiny", "--out", str(tmp_path), "--kernels", "xla"]) == 0
    rows = json.loads((tmp_path / "trees.json").read_text())["rows"]
    assert [r["config"] for r in rows] == [["chain", 2], ["tree", 4, 2, 2]]
    chain, tree = rows
    assert chain["round_over_chain_of_its_depth"] == 1 and tree["round_ms"] > 0
    for r in rows:
        greedy, sampled = trees.TINY_TAUS[tuple(r["config"])]
        assert r["greedy_tokens_per_s"] == pytest.approx(2 * greedy / (r["round_ms"] / 1e3))
        assert r["sampled_speedup"] == pytest.approx(sampled * r["step_ms"] / r["round_ms"])
    assert tree["greedy_over_first_chain"] == pytest.approx(tree["greedy_tokens_per_s"] / chain["greedy_tokens_per_s"])


def test_outputs_section(tmp_path, capsys):
    """`--outputs-only` at tiny shapes: each build's call of rounds (default, logprobs, penalties, both) timed from
    the same state, spec off and at gamma 3, with its cost over the default build's (times are not asserted)."""
    assert bench.main(["--tiny", "--out", str(tmp_path), "--kernels", "xla", "--outputs-only"]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["outputs"]
    assert [(r["batch"], r["gamma"]) for r in rows] == [(2, 0), (2, 3)]
    for r in rows:
        assert all(r[f"{name}_ms"] > 0 and r["compile_s"][name] > 0 for name in outputs.BUILDS)
        assert {"logprobs_extra", "penalties_extra", "both_extra"} <= set(r)
    assert "outputs b2 g3: round" in capsys.readouterr().out


def test_structured_bench_dry_run(tmp_path, capsys):
    """The structured-outputs bench (eagle3_jax_bench/structured.py): the constrained and free calls of rounds on the
    tiny preset, and every kind's compile on a small synthetic vocabulary."""
    assert structured.main(["call", "--out", str(tmp_path / "call.json"), "--dry-run"]) == 0
    call = json.loads((tmp_path / "call.json").read_text())
    assert [r["batch"] for r in call["rows"]] == [2] and all(r["ratio"] > 0 for r in call["rows"])
    assert call["states"] == 401  # [a-z ]{1,400}: one state per length, and the start
    assert structured.main(["compile", "--out", str(tmp_path / "compile.json"), "--dry-run", "--vocab", "synthetic",
                            "--reps", "1"]) == 0
    rows = json.loads((tmp_path / "compile.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["compile_ms"] > 0 and r["classes"] < 4096 for r in rows)
    assert "constrained" in capsys.readouterr().out
