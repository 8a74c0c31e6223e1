"""eagle3_jax_bench/training.py at tiny shapes on the CPU: it runs the real training step and reports every figure."""

import json

from eagle3_jax_bench import training


def test_train_bench_smoke(tmp_path, capsys):
    assert training.main(["--tiny", "--seq", "32", "--ttt-steps", "2", "--max-batch", "1", "--reps", "1",
                             "--out", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"] and result["largest_batch"] == 1
    assert result["flops_by_part"]["total"] == sum(v for k, v in result["flops_by_part"].items() if k != "total")


def test_step_flops_count_matmuls_as_two_flops_per_weight_and_token():
    """At one token there is no attention context to speak of: the count is 2 x weights read per token,
    the drafter's three times over (forward and backward) per TTT step."""
    cfg = training.TINY
    spec = training.make_spec(cfg, 128, 1, "xla")
    flops = training.step_flops(spec, 1, 1)
    D, inter, V, L = 64, 128, 512, 6
    layer = (4 + 2 * 2) * 16 * D + D * 4 * 16 + 3 * inter * D
    attention = 4 * 4 * 16  # one (query, key) pair per layer
    assert flops["target_forward"] == 2 * (L * layer + V * D) + L * attention
    draft_layer = (4 + 2 * 2) * 16 * 2 * D + D * 4 * 16 + 3 * inter * D
    assert flops["drafter_forward_backward"] == 3 * (2 * (draft_layer + 128 * D) + 2 * 3 * D * D + attention)
