"""Tensor parallelism: the layout of every weight on the devices, the refusals, and (in a child pytest, since
the suite's own processes have one CPU device) the sharded model and engine on 4 virtual devices and one mesh
over two processes (tests/tp_four_devices.py, which starts tests/tp_two_processes.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eagle3_jax
from eagle3_jax.models import weights
from eagle3_jax.models.config import MoeConfig, Qwen3Config, RopeConfig
from eagle3_jax.parallel import layout
from eagle3_jax.parallel.mesh import mesh_size, tp_mesh

from hf_models import build_model, save_model

ROOT = Path(__file__).parent.parent
# Qwen3-32B's attention and MLP shapes (64 query heads, 8 KV heads), two layers, a small vocabulary.
QWEN3_32B = Qwen3Config(vocab_size=1024, hidden_size=5120, intermediate_size=25600, num_layers=2, num_heads=64,
                        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope=RopeConfig(1e6, 128),
                        tie_word_embeddings=False, max_position_embeddings=4096)
# Qwen3-235B-A22B's: 4 KV heads, experts of intermediate 1536.
QWEN3_235B = Qwen3Config(vocab_size=1024, hidden_size=4096, intermediate_size=12288, num_layers=2, num_heads=64,
                         num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope=RopeConfig(1e6, 128),
                         tie_word_embeddings=False, max_position_embeddings=4096,
                         moe=MoeConfig(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                                       norm_topk_prob=True))


def placement(cfg, tp, path):
    return next(p for p in layout.target_placements(cfg, tp) if p.weight.path == path)


def test_each_device_holds_its_heads_rows_of_the_fused_weights():
    """wqkv rows [q_d; k_d; v_d] and w_gate_up rows [gate_d; up_d], o and down the matching columns."""
    H, I = 128, 25600
    qkv = placement(QWEN3_32B, 2, ("layers", 0, "wqkv"))
    q, k, v = 0, 64 * H, 72 * H  # where q, k and v start in the fused rows
    assert qkv.dim == 0 and qkv.ranges[1] == ((32 * H, 64 * H), (k + 4 * H, k + 8 * H), (v + 4 * H, v + 8 * H))
    assert qkv.ranges[0][0] == (q, 32 * H) and qkv.global_shape == (2 * (32 + 8) * H, 5120)
    gate_up = placement(QWEN3_32B, 4, ("layers", 1, "w_gate_up"))
    assert gate_up.ranges[3] == ((3 * I // 4, I), (I + 3 * I // 4, 2 * I))
    assert placement(QWEN3_32B, 4, ("layers", 1, "w_down")).ranges[3] == ((3 * I // 4, I),)
    assert placement(QWEN3_32B, 4, ("layers", 1, "wo")).dim == 1
    assert placement(QWEN3_32B, 4, ("lm_head",)).ranges[2] == ((512, 768),)
    assert placement(QWEN3_32B, 4, ("layers", 1, "attn_norm")).dim is None


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    """tp 16 over 8 KV heads: devices 2h and 2h + 1 hold KV head h, the one their 4 query heads read."""
    H = 128
    qkv = placement(QWEN3_32B, 16, ("layers", 0, "wqkv"))
    k, v = 64 * H, 72 * H
    for d in range(16):
        assert qkv.ranges[d] == ((4 * d * H, 4 * (d + 1) * H), (k + d // 2 * H, k + (d // 2 + 1) * H),
                                 (v + d // 2 * H, v + (d // 2 + 1) * H))
    local = layout.local_config(QWEN3_32B, 16)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (4, 1, 1600, 64)


def test_moe_experts_split_their_intermediate_not_the_experts():
    local = layout.local_config(QWEN3_235B, 8)
    assert local.moe.moe_intermediate_size == 192 and local.moe.num_experts == 128 and local.num_kv_heads == 1
    gate_up = placement(QWEN3_235B, 8, ("layers", 0, "w_gate_up"))
    assert gate_up.dim == 1 and gate_up.ranges[1] == ((192, 384), (1536 + 192, 1536 + 384))
    assert placement(QWEN3_235B, 8, ("layers", 0, "w_down")).dim == 2
    assert placement(QWEN3_235B, 8, ("layers", 0, "router")).dim is None


def test_placements_agree_with_the_rules_tables_partition_specs():
    for cfg in (QWEN3_32B, QWEN3_235B):
        specs = weights.partition_specs(weights.target_weights(cfg), layout.TARGET_RULES)
        for p in layout.target_placements(cfg, 4):
            node = specs
            for key in p.weight.path:
                node = node[key]
            assert node == p.spec
    drafter = weights.partition_specs(weights.target_weights(QWEN3_32B), layout.DRAFTER_RULES)
    assert drafter["embed"] == P("tp", None) and drafter["layers"][0]["wqkv"] == P(None, None)


def test_a_tp_that_does_not_split_the_target_is_refused_naming_the_sizes():
    with pytest.raises(ValueError, match=r"tp=3 does not divide the target's num_attention_heads=64, "
                                         r"vocab_size=1024, intermediate_size=25600, num_key_value_heads=8"):
        layout.check(QWEN3_32B, 3)
    with pytest.raises(ValueError, match=r"tp=6 does not divide .*num_key_value_heads=4 \(tp must divide it, or "
                                         r"be a multiple of it"):
        layout.check(QWEN3_235B, 6)
    with pytest.raises(ValueError, match="moe_intermediate_size=1536"):
        layout.check(QWEN3_235B, 1024)
    layout.check(QWEN3_235B, 8)  # all layers sparse: the dense intermediate is never split
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="tp must be a positive int"):
            layout.check(QWEN3_32B, bad)


def test_a_mesh_larger_than_the_devices_is_refused():
    n = jax.device_count()
    with pytest.raises(ValueError, match=f"tp={n + 1} needs {n + 1} devices, and {n} are present"):
        tp_mesh(n + 1)
    assert mesh_size(tp_mesh(1)) == 1
    with pytest.raises(ValueError, match="one axis 'tp'"):
        mesh_size(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)))


def test_an_orbax_folder_or_exact_kernels_on_a_mesh_are_refused(tmp_path):
    folder = save_model(build_model("mha_tied", num_layers=2, vocab=48), tmp_path / "hf", "mha_tied")
    converted = eagle3_jax.convert(folder, tmp_path / "orbax", dtype="float32")
    with pytest.raises(eagle3_jax.CheckpointError, match="an orbax conversion loads on one device; a mesh needs "
                                                         "the Hugging Face folder"):
        eagle3_jax.load_target(converted, dtype="float32", mesh=tp_mesh(1))
    target = eagle3_jax.load_target(folder, dtype="float32", progress=False, mesh=tp_mesh(1))
    with pytest.raises(ValueError, match="exact=True runs on one device"):
        eagle3_jax.Engine(target, max_len=32, exact=True)


def test_the_candidate_filter_is_refused_on_a_split_vocabulary():
    """Its lax.top_k is per device: a vocabulary split over a mesh takes the radix search."""
    from eagle3_jax.decoding import sampling
    from eagle3_jax.models.collectives import Shards, Vocab

    x, row = np.zeros((1, 8), np.float32), np.ones((1,), np.float32)
    with pytest.raises(ValueError, match="filter 'candidates' is per device: a vocabulary split over a mesh"):
        sampling.filter_rows(x, row, np.ones((1,), np.int32), row, Vocab(Shards(4)), filter="candidates")


def test_cli_tp_beyond_the_devices_is_refused_before_loading(tmp_path, capsys):
    from eagle3_jax import cli

    n = jax.device_count()
    assert cli.main(["generate", "--target", str(tmp_path / "absent"), "--prompt-ids", "1,2",
                     "--tp", str(n + 1), "--no-compile-cache"]) == 2
    assert f"error: tp={n + 1} needs {n + 1} devices, and {n} are present" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--num-draft-tokens auto runs on one device \(.*\): with --tp give it an"):
        cli.main(["generate", "--target", str(tmp_path / "absent"), "--drafter", str(tmp_path / "absent"),
                  "--prompt-ids", "1,2", "--num-draft-tokens", "auto", "--tp", "2", "--no-compile-cache"])


def test_four_virtual_devices(tmp_path):
    """tests/tp_four_devices.py in a child pytest with 4 CPU devices: every one of its tests passes."""
    flags = os.environ.get("XLA_FLAGS", "")  # the suite's compile flags (tests/conftest.py), plus 4 devices
    env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "tests/tp_four_devices.py", "--basetemp", str(tmp_path)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].startswith("29 passed"), proc.stdout[-2000:]


def test_tp1_bench_dry_run(tmp_path):
    """The tp-1 overhead bench at tiny shapes: both paths compile, run and report a ratio, and a one-device
    mesh's greedy steps leave the unsharded engine's tokens and lengths."""
    from eagle3_jax_bench import tensor_parallel

    assert tensor_parallel.main(["--out", str(tmp_path), "--model", "tiny", "--batches", "1", "--gammas", "0",
                                 "--kv-len", "16", "--reps", "1", "--inner", "1", "--dtype", "float32"]) == 0
    (row,) = json.loads((tmp_path / "tensor_parallel.json").read_text())["rounds"]
    assert row["batch"] == 1 and row["gamma"] == 0 and row["unsharded_ms"] > 0 and row["ratio"] > 0
    assert row["same_tokens"] is True
