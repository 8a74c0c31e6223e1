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
from eagle3_jax.decoding import round_costs

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


def test_generate_with_auto_gamma(folders, capsys, tmp_path, monkeypatch):
    """--num-draft-tokens auto: the same tokens, and how many rounds ran each gamma. Its round costs are
    measured on this first use, into a folder of the test's."""
    monkeypatch.setattr(round_costs, "default_folder", lambda: tmp_path)
    code = main(["generate", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--prompt-ids", "3,17,5", "--max-new-tokens", "9", "--num-draft-tokens", "auto",
                 "--max-draft-tokens", "1", "--dtype", "float32", "--max-len", "64", "--rounds-per-call", "3"])
    out = capsys.readouterr().out
    target = eagle3_jax.load_target(folders / "target", dtype="float32")
    (expected,) = eagle3_jax.Engine(target, max_len=64).generate([[3, 17, 5]], 9, stop_token_ids=[47])
    assert code == 0 and out.splitlines()[0] == " ".join(f"w{t}" for t in expected.token_ids)
    assert "gamma per round: 0: " in out and len(list(tmp_path.glob("*.json"))) == 1
    with pytest.raises(SystemExit):
        main(["generate", "--target", str(folders / "target"), "--num-draft-tokens", "many"])
    assert "--num-draft-tokens must be an int or 'auto', got 'many'" in capsys.readouterr().err
    for flags, message in [(["--num-draft-tokens", "auto"], "pass --drafter"),
                           (["--max-draft-tokens", "2"], "--max-draft-tokens is for --num-draft-tokens auto"),
                           (["--num-draft-tokens", "auto", "--drafter", "d", "--max-draft-tokens", "0"],
                            r"--max-draft-tokens must be unset or an int in \[1, 16\]")]:
        with pytest.raises(SystemExit, match=message):  # before the target loads
            main(["generate", "--target", str(folders / "missing"), "--prompt-ids", "1", *flags])


def test_generate_with_a_draft_tree(folders, capsys):
    """--draft-depth and --draft-top-k: a tree's output is the target's, its histogram as deep as the tree; the tree
    rules in the flags' names, before the target loads."""
    code = main(["generate", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--prompt-ids", "3,17,5", "--max-new-tokens", "9", "--num-draft-tokens", "6", "--draft-depth", "2",
                 "--draft-top-k", "3", "--dtype", "float32", "--max-len", "64"])
    out = capsys.readouterr().out
    target = eagle3_jax.load_target(folders / "target", dtype="float32")
    (expected,) = eagle3_jax.Engine(target, max_len=64).generate([[3, 17, 5]], 9, stop_token_ids=[47])
    assert code == 0 and out.splitlines()[0] == " ".join(f"w{t}" for t in expected.token_ids)
    assert "accepted 2:" in out and "accepted 3:" not in out
    for flags, message in [(["--draft-top-k", "2"], "give --draft-depth"),
                           (["--draft-top-k", "2", "--draft-depth", "2", "--num-draft-tokens", "9"],
                            "--num-draft-tokens=9 is more than the 6 candidates of --draft-depth=2"),
                           (["--draft-depth", "2"], "--draft-top-k=1 drafts a chain"),
                           (["--draft-top-k", "0"], "--draft-top-k must be a positive int, got 0")]:
        with pytest.raises(SystemExit, match=message):  # before the target loads
            main(["generate", "--target", str(folders / "missing"), "--drafter", "d", "--prompt-ids", "1", *flags])
    with pytest.raises(SystemExit, match="from the top-k tokens of an EAGLE-3 drafter"):
        main(["serve", "--target", str(folders / "missing"), "--prompt-lookup", "--draft-top-k", "2",
              "--draft-depth", "2"])


def test_generate_with_prompt_lookup(folders, capsys):
    """--prompt-lookup on a prompt that holds a stretch of the target's cycle and then its start again: the output
    retraces the stretch, so lookups are accepted (tau > 1), and it is spec-off's; its flags are checked."""
    prompt = [int(t) for t in worlds.ORDER[:12]] + [int(t) for t in worlds.ORDER[:3]]
    code = main(["generate", "--target", str(folders / "target"), "--prompt-lookup", "--prompt-lookup-max", "2",
                 "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "8", "--num-draft-tokens", "3",
                 "--dtype", "float32", "--max-len", "64"])
    out = capsys.readouterr().out
    target = eagle3_jax.load_target(folders / "target", dtype="float32")
    (expected,) = eagle3_jax.Engine(target, max_len=64).generate([prompt], 8, stop_token_ids=[47])
    assert code == 0 and out.splitlines()[0] == " ".join(f"w{t}" for t in expected.token_ids)
    tau = float(out.split("tau (mean tokens per round) = ")[1].split()[0])
    assert tau > 1
    with pytest.raises(SystemExit):  # argparse: exclusive with --drafter
        main(["generate", "--target", "t", "--prompt-ids", "1", "--prompt-lookup", "--drafter", "d"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="are for --prompt-lookup"):
        main(["generate", "--target", str(folders / "missing"), "--prompt-ids", "1", "--prompt-lookup-min", "2"])
    code = main(["generate", "--target", str(folders / "missing"), "--prompt-ids", "1", "--prompt-lookup",
                 "--prompt-lookup-max", "0"])  # refused before the target (missing) would load
    assert code == 2 and "max_ngram must be an int >= 1, got 0" in capsys.readouterr().err


def test_generate_with_text_prompt(folders, capsys):
    assert main(["generate", "--target", str(folders / "target"), "--prompt", "w3 w17 w5",
                 "--max-new-tokens", "4", "--dtype", "float32", "--max-len", "64"]) == 0
    first = capsys.readouterr().out.splitlines()[0].split()
    pi = worlds.PI
    assert first == [f"w{pi[5]}", f"w{pi[pi[5]]}", f"w{pi[pi[pi[5]]]}", f"w{pi[pi[pi[pi[5]]]]}"]



def test_text_skips_special_tokens_and_the_dtype_fits_the_device(folders, capsys):
    """The eos stop token (w47) ends the output but is not printed, nor is the unknown token w0, unless
    --show-special-tokens; without --dtype the CPU runs float32, and says so."""
    command = ["generate", "--target", str(folders / "target"), "--prompt-ids", "3,17,5", "--max-new-tokens", "48",
               "--max-len", "64"]
    target = eagle3_jax.load_target(folders / "target", dtype="float32")
    (expected,) = eagle3_jax.Engine(target, max_len=64).generate([[3, 17, 5]], 48, stop_token_ids=[47])
    assert expected.finish_reason == "stop" and expected.token_ids[-1] == 47
    plain = [t for t in expected.token_ids if t not in (0, 47)]
    for flags, shown in (([], plain), (["--show-special-tokens"], expected.token_ids)):
        assert main(command + flags) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == " ".join(f"w{t}" for t in shown) and "dtype: float32 (the default on cpu)" in out


def test_errors_are_reported_not_raised(folders, tmp_path, capsys):
    assert main(["generate", "--target", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2
    assert "config.json: file not found" in capsys.readouterr().err
    assert main(["generate", "--target", str(folders / "target"), "--prompt-ids", "1,999", "--dtype", "float32"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    assert main(["generate", "--target", str(folders / "target"), "--prompt-ids", "1", "--dtype", "float32",
                 "--rounds-per-call", "0"]) == 2
    assert "rounds_per_call must be an int in [1, max_len=" in capsys.readouterr().err
    # --exact reaches the Engine, whose exact attention kernel cannot take head_dim 24 (where --kernels pallas runs:
    # attention then takes the XLA path).
    assert main(["generate", "--target", str(folders / "target"), "--prompt-ids", "1", "--dtype", "float32",
                 "--exact"]) == 2
    assert "exact=True needs a power-of-two head_dim >= 16" in capsys.readouterr().err


def test_stop_ids_errors_name_the_flag_and_a_budget_past_max_len_is_refused(folders, capsys):
    """--stop-ids' errors name --stop-ids (not --prompt-ids); --max-new-tokens past --max-len is refused as the server
    refuses max_tokens, with both numbers, not cut to fit."""
    command = ["generate", "--target", str(folders / "target"), "--prompt-ids", "3,17,5", "--dtype", "float32",
               "--max-len", "64"]
    with pytest.raises(SystemExit):
        main(command + ["--stop-ids", "47,x"])
    assert "--stop-ids must be integers separated by commas or spaces, got '47,x'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--stop-ids has 48, outside the vocabulary \\[0, 48\\)"):
        main(command + ["--stop-ids", "47,48"])
    with pytest.raises(SystemExit, match="the prompt has 3 tokens and --max-new-tokens is 62: together 65, past "
                                         "--max-len 64"):
        main(command + ["--max-new-tokens", "62"])
    assert main(command + ["--max-new-tokens", "61", "--stop-ids", "47"]) == 0


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

    """`bench` is found through the entry point the benchmarks package registers."""
    assert main(["bench", "--variants-only", "--kernels", "xla", "--out", str(tmp_path)]) == 0
    variants = json.loads((tmp_path / "bench.json").read_text())["variants"]
    assert {"step", "step_one_round_per_call", "forward_no_head", "matmuls_only"} <= set(variants[0])



def _copy_target(folders, tmp_path, **generation_config):
    import json
    import shutil

    folder = tmp_path / "target"
    shutil.copytree(folders / "target", folder)
    if generation_config:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def test_generate_samples_with_generation_config_defaults_or_flags(folders, tmp_path, capsys):
    """The folder's generation_config.json (Qwen3's settings here) as transformers reads it, each flag given
    laid over it (a lone --top-p keeps the file's temperature and top-k). The settings used are printed."""
    folder = _copy_target(folders, tmp_path, do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    common = ["generate", "--target", str(folder), "--prompt-ids", "3,17,5", "--max-new-tokens", "8",
              "--dtype", "float32", "--max-len", "64", "--stop-ids", "47"]
    target = eagle3_jax.load_target(folder, dtype="float32")
    engine = eagle3_jax.Engine(target, max_len=64)
    for flags, settings, line in [
        (["--seed", "4"], {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 4},
         "sampling: temperature=0.6, top_k=20, top_p=0.95, seed=4 (from generation_config.json)"),
        (["--temperature", "1.5", "--top-p", "0.9", "--seed", "2"],
         {"temperature": 1.5, "top_k": 20, "top_p": 0.9, "seed": 2},
         "sampling: temperature=1.5, top_k=20, top_p=0.9, seed=2 (from flags over generation_config.json)"),
        (["--top-p", "0.5", "--seed", "2"], {"temperature": 0.6, "top_k": 20, "top_p": 0.5, "seed": 2},
         "sampling: temperature=0.6, top_k=20, top_p=0.5, seed=2 (from flags over generation_config.json)"),
    ]:
        assert main(common + flags) == 0
        out = capsys.readouterr().out.splitlines()
        (expected,) = engine.generate([[3, 17, 5]], 8, stop_token_ids=[47], **settings)
        assert out[0] == " ".join(f"w{t}" for t in expected.token_ids) and line in out


def test_chat_renders_the_template_with_enable_thinking(folders, tmp_path, capsys):
    import argparse

    from eagle3_jax.checkpoints.tokenizer import load_tokenizer
    from eagle3_jax.cli import _prompt_ids

    folder = _copy_target(folders, tmp_path, do_sample=False)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer.chat_template = ("{% for m in messages %}w1 {{ m['content'] }} {% endfor %}"
                               "{% if enable_thinking is defined and not enable_thinking %}w3{% else %}w2{% endif %}")
    tokenizer.save_pretrained(folder)
    tokenizer = load_tokenizer(folder)
    for thinking, last in ((None, 2), (True, 2), (False, 3)):
        args = argparse.Namespace(prompt="w5 w6", prompt_ids=None, chat=True, thinking=thinking, target=str(folder))
        assert _prompt_ids(args, tokenizer) == [1, 5, 6, last]
    assert main(["generate", "--target", str(folder), "--prompt", "w5 w6", "--chat", "--no-thinking",
                 "--max-new-tokens", "3", "--dtype", "float32", "--max-len", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    pi = worlds.PI
    assert out[0].split() == [f"w{pi[3]}", f"w{pi[pi[3]]}", f"w{pi[pi[pi[3]]]}"]
    assert "sampling: greedy (from generation_config.json)" in out


def test_malformed_generation_config_is_named_before_any_work(folders, tmp_path, capsys):
    folder = _copy_target(folders, tmp_path)
    (folder / "generation_config.json").write_text('{"do_sample": tru')
    assert main(["generate", "--target", str(folder), "--prompt-ids", "3,17", "--max-new-tokens", "2",
                 "--dtype", "float32", "--max-len", "64"]) == 2
    err = capsys.readouterr().err
    assert "generation_config.json" in err and "Traceback" not in err
