"""The `eagle3-jax` command and the conversion script, run as a user would run them."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import eagle3_jax
from eagle3_jax.cli import main

import spec_worlds as worlds


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    _, target = worlds.save_target("permutation", root / "target")
    worlds.save_drafter("pi2", root / "drafter", target)
    vocab = {f"w{i}": i for i in range(worlds.V)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w47", unk_token="w0").save_pretrained(root / "target")
    return root


def test_generate_with_prompt_ids(folders, capsys):
    code = main(["generate", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--prompt-ids", "3,17,5", "--max-new-tokens", "9", "--num-draft-tokens", "2",
                 "--dtype", "float32", "--max-len", "64", "--rounds-per-call", "3"])
    out = capsys.readouterr().out
    target = eagle3_jax.load_target(folders / "target", dtype="float32")
    (expected,) = eagle3_jax.Engine(target, max_len=64).generate([[3, 17, 5]], 9, stop_token_ids=[47])
    assert code == 0
    assert out.splitlines()[0] == " ".join(f"w{t}" for t in expected.token_ids)
    assert "tokens/s" in out and "tau (mean tokens per round) = 2.000" in out and "accepted 1:" in out


def test_generate_with_text_prompt(folders, capsys):
    assert main(["generate", "--target", str(folders / "target"), "--prompt", "w3 w17 w5",
                 "--max-new-tokens", "4", "--dtype", "float32", "--max-len", "64"]) == 0
    first = capsys.readouterr().out.splitlines()[0].split()
    pi = worlds.PI
    assert first == [f"w{pi[5]}", f"w{pi[pi[5]]}", f"w{pi[pi[pi[5]]]}", f"w{pi[pi[pi[pi[5]]]]}"]


def test_errors_are_reported_not_raised(folders, tmp_path, capsys):
    assert main(["generate", "--target", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2
    assert "config.json: file not found" in capsys.readouterr().err
    assert main(["generate", "--target", str(folders / "target"), "--prompt-ids", "1,999", "--dtype", "float32"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    assert main(["generate", "--target", str(folders / "target"), "--prompt-ids", "1", "--dtype", "float32",
                 "--rounds-per-call", "0"]) == 2
    assert "rounds_per_call must be an int in [1, max_len=" in capsys.readouterr().err
    # head_dim 24: the Pallas kernels cannot take it, and --kernels pallas says so.
    assert main(["generate", "--target", str(folders / "target"), "--prompt-ids", "1", "--dtype", "float32",
                 "--kernels", "pallas"]) == 2
    assert "power-of-two head_dims" in capsys.readouterr().err


def test_second_run_compiles_nothing(folders, tmp_path):
    """The command keeps JAX's persistent compilation cache: the first run fills it, the second finds every
    program there and writes nothing new."""
    cache = tmp_path / "xla"
    env = {**os.environ, "EAGLE3_JAX_COMPILE_CACHE": str(cache)}
    command = [sys.executable, "-m", "eagle3_jax.cli", "generate", "--target", str(folders / "target"),
               "--prompt-ids", "3,17,5", "--max-new-tokens", "4", "--dtype", "float32", "--max-len", "64"]
    first = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    entries = sorted(p.name for p in cache.iterdir())
    assert entries
    second = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    assert sorted(p.name for p in cache.iterdir()) == entries
    assert first.splitlines()[0] == second.splitlines()[0]


def test_convert_script_and_command(folders, tmp_path):
    repo = Path(__file__).resolve().parents[1]
    script = [sys.executable, str(repo / "convert" / "convert_checkpoint.py")]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    subprocess.run(script + [str(folders / "target"), str(tmp_path / "t"), "--dtype", "float32"], check=True, env=env)
    assert main(["convert", str(folders / "drafter"), str(tmp_path / "d"), "--drafter-of", str(folders / "target"),
                 "--dtype", "float32"]) == 0
    target = eagle3_jax.load_target(tmp_path / "t", dtype="float32")
    drafter = eagle3_jax.load_drafter(tmp_path / "d", target, dtype="float32")
    assert (tmp_path / "t" / "tokenizer.json").exists()
    (result,) = eagle3_jax.Engine(target, drafter, num_draft_tokens=2, max_len=64).generate([[3, 17, 5]], 6)
    assert result.accept_lengths == [1] * len(result.accept_lengths) and len(result.token_ids) == 6
    assert np.array_equal(np.asarray(target.params["embed"]), np.eye(worlds.V, dtype=np.float32) * np.float32(0.7))


def test_bench_subcommand(tmp_path):
    import json

    assert main(["bench", "--variants-only", "--kernels", "xla", "--out", str(tmp_path)]) == 0
    variants = json.loads((tmp_path / "bench.json").read_text())["variants"]
    assert {"step", "step_one_round_per_call", "forward_no_head", "matmuls_only"} <= set(variants[0])
    assert main(["bench", "--agreement-only", "--kernels", "xla", "--out", str(tmp_path / "a")]) == 0
    agreement = json.loads((tmp_path / "a" / "bench.json").read_text())["agreement"]
    assert [row["tokens"] for row in agreement["xla: gamma_3 vs spec_off"]] == [96, 96]


def test_demo_runs(capsys):
    from eagle3_jax import demo

    demo.main()
    out = capsys.readouterr().out
    assert out.count("output identical to spec off") == 3 and out.count("tau 2.00") == 3
