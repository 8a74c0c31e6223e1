"""The demo pair: the shipped files load in transformers and in eagle3_jax and agree, the demo's speculative output
is its spec-off output, the pair is what its record says; and the pieces that built it: the corpus stages, the
pre-training loss (against transformers' own), exact resume, the Hugging Face export, the drafter's data."""

import json
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, Qwen3ForCausalLM

import eagle3_jax
from eagle3_jax.checkpoints.target_export import export_hf
from eagle3_jax.checkpoints.tokenizer import load_tokenizer
from eagle3_jax.demo import PAIR, corpus
from eagle3_jax.demo.__main__ import main as demo_main
from eagle3_jax.models import qwen3
from eagle3_jax.training import loop, pretrain
from eagle3_jax_bench import pair as pair_bench
from tools import build_demo_pair as build

TINY = build.BuildConfig.tiny()


@pytest.fixture(scope="module")
def pair():
    target = eagle3_jax.load_target(PAIR / "target", dtype="float32", progress=False)
    return target, eagle3_jax.load_drafter(PAIR / "drafter", target, dtype="float32")


@pytest.fixture(scope="module")
def demo_prompts():
    return [p for p in json.loads((PAIR / "prompts.json").read_text()) if p["demo"]]


def test_shipped_target_matches_transformers(pair, demo_prompts):
    """transformers' Qwen3ForCausalLM (float32) and load_target give the same logits and greedy tokens, and the
    tokenizer round-trips the held-out text."""
    target, _ = pair
    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    text = demo_prompts[1]["text"].rstrip("\n")
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    hf = Qwen3ForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
        hf_greedy = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    cache = qwen3.new_row_cache(target.config, 1, len(ids), jnp.float32)
    hidden, _, _ = qwen3.forward_rows(target.params, target.config, jnp.asarray([ids]), cache)
    ours = np.asarray(qwen3.logits(target.params, hidden))[0]
    np.testing.assert_allclose(ours, theirs, atol=1e-4 * np.abs(theirs).max())
    assert eagle3_jax.Engine(target, max_len=128).generate([ids], 16)[0].token_ids == hf_greedy


def test_shipped_files_are_the_record(pair):
    """bfloat16 weights, at most 30 MB in all, the held-out split as the rule says, the recorded tau goal met."""
    files = [f for f in PAIR.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 30e6
    for path in PAIR.glob("*/model.safetensors"):
        with safe_open(str(path), "np") as f:
            assert {str(f.get_slice(k).get_dtype()) for k in f.keys() if k not in ("d2t", "t2d")} == {"BF16"}
    manifest = json.loads((PAIR / "manifest.json").read_text())
    assert all(e["held_out"] == corpus.is_held_out(e["path"]) for e in manifest["files"])
    held_out = {e["path"] for e in manifest["files"] if e["held_out"]}
    assert {p["file"] for p in json.loads((PAIR / "prompts.json").read_text())} <= held_out
    record = json.loads((PAIR / "record.json").read_text())
    assert record["done"] == list(build.STAGES[:-1]) and record["tau_greedy"]["3"] >= 3.0
    target, drafter = pair
    assert record["config"]["vocab_size"] == target.config.vocab_size == drafter.config.target_vocab_size


def test_demo_output_is_spec_off_output(capsys):
    """The demo raises if speculative output differs from spec-off output; it prints decoded text."""
    summary = demo_main(["--prompts", "2", "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    assert out.count("(held out)") == 2 and "output identical to spec off" in out
    # A drafter that had learnt nothing would give tau 1; this one gives 3.2 greedy and 1.44 sampled here.
    assert summary["tau"] > 2.5 and summary["sampled_tau"] > 1.2



def committed_drafts(result, prompt_length: int, max_len: int) -> tuple[list[int], int]:
    """Per round, the drafts a cut run committed, from its trace and tokens alone: the target's verdict (the
    drafts matching its choices), at most the drafts the cache can take, at most the tokens the round
    emitted. Also how many rounds were cut inside their accepted span."""
    start, out, inside = 1, [], 0  # prefill emits token 0
    for r in result.rounds:
        verdict = next((j for j, (d, t) in enumerate(zip(r.drafted, r.target)) if d != t), len(r.drafted))
        accepted = min(verdict, max_len - prompt_length - start - 1)
        emitted = min(accepted + 1, len(result.token_ids) - start)
        assert result.token_ids[start : start + emitted] == r.target[:emitted]
        out.append(min(accepted, emitted))
        inside += emitted <= accepted
        start += emitted
    assert start == len(result.token_ids)
    return out, inside


def test_accept_lengths_count_the_drafts_a_cut_round_commits(pair, demo_prompts):
    """A round cut short by a stop token inside its accepted span, by max_new_tokens or by max_len reports
    the drafts it emitted. The demo's two prompts and engine (the test above's): nothing compiles again."""
    target, drafter = pair
    tokenizer = load_tokenizer(PAIR / "target")
    prompts = [tokenizer(p["text"].rstrip("\n"))["input_ids"] for p in demo_prompts[:2]]
    max_len = max(map(len, prompts)) + 24 + 3 + 2
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=max_len)
    full = engine.generate(prompts, 12)
    text = sum(prompts, [])
    inside = 0
    for kept in (2, 3, 6):  # inside the first rounds' spans (tau is about 3.5 here)
        stop = full[0].token_ids[kept - 1]
        edge = [text[: max_len - kept], text[1 : max_len - kept - 3]]  # room for kept and kept + 3 tokens
        for request, results in [
            (prompts, engine.generate(prompts, 12, stop_token_ids=[stop], trace=True)),
            (prompts, engine.generate(prompts, kept, trace=True)),
            (edge, engine.generate(edge, max_len, trace=True)),
        ]:
            for prompt, result in zip(request, results):
                expected, cut_inside = committed_drafts(result, len(prompt), max_len)
                assert result.accept_lengths == expected == [r.accepted for r in result.rounds]
                inside += cut_inside
            if request is prompts:  # cut runs of the uncut run's prompts: its tokens, up to the cut
                assert all(r.token_ids == f.token_ids[: len(r.token_ids)] for r, f in zip(results, full))
    assert inside  # some rounds were cut inside their accepted span: there the target accepted more


def test_pair_bench_dry_run(tmp_path):
    assert pair_bench.main(["--out", str(tmp_path), "--tiny", "--dtype", "float32", "--gammas", "3",
                            "--max-new-tokens", "6", "--batches", "8", "--auto", "--lookup", "1"]) == 0
    results = json.loads((tmp_path / "pair_bench.json").read_text())
    assert {(r["batch"], r["gamma"]) for r in results["end_to_end"]} == {(8, 0), (8, 3), (8, "auto")}
    auto = next(r for r in results["end_to_end"] if r["gamma"] == "auto")
    assert auto["best_fixed_gamma"] in (0, 3) and auto["vs_best_fixed"] > 0
    assert sum(auto["rounds_by_gamma"].values()) > 0
    assert results["projection"]["projected_speedup"] > 0
    rows = {(r["task"], r["proposer"]): r for r in results["proposers"]}
    assert set(rows) == {(t, p) for t in ("held-out code", "rewrite") for p in ("off", "eagle3", "prompt_lookup")}
    assert all(r["tokens_per_s"] > 0 and (r["tau"] is None) == (r["proposer"] == "off") for r in rows.values())


def test_a_draft_tree_beats_the_chain_of_its_depth(tmp_path):
    """The pair bench's tree section (`--trees`) on the first 8 held-out prompts, 32 new tokens, greedy: a (16, 5, 4)
    tree's output is spec-off's and the depth-5 chain's, and its tau beats the chain's (BENCHMARKS.md (i) has the
    figures on 24 prompts of 96 tokens, greedy and sampled)."""
    assert pair_bench.main(["--out", str(tmp_path), "--trees", "--dtype", "float32", "--gammas", "0", "5",
                            "--tree-shapes", "16,5,4", "--held-out", "8", "--max-new-tokens", "32",
                            "--temperatures", "0"]) == 0
    rows = json.loads((tmp_path / "pair_trees.json").read_text())["trees"]
    assert [(r["draft_depth"], r["draft_top_k"]) for r in rows] == [(0, 1), (5, 1), (5, 4)]
    assert all(r["same_tokens_as_first"] and r["tokens_per_s"] > 0 for r in rows)
    off, chain, tree = rows
    assert off["tau"] is None and tree["tau"] > chain["tau"] > 1
    assert tree["tau_over_chain_of_its_depth"] == tree["tau"] / chain["tau"]


def test_corpus_stages(tmp_path):
    """The CPU stages on a few standard library files: manifest, held-out prompts, a tokenizer that
    AutoTokenizer loads, the token streams and the prompts the GPU stages read."""
    work = tmp_path / "work"
    record = build.build(work, tmp_path / "pair", TINY, until="tokens")
    assert record["done"] == ["corpus", "tokenizer", "tokens"]
    manifest = json.loads((work / "manifest.json").read_text())
    assert sum(e["held_out"] for e in manifest["files"]) == TINY.files_per_split
    tokenizer = AutoTokenizer.from_pretrained(work / "target")
    prompt = json.loads((work / "prompts.json").read_text())[0]
    assert prompt["file"] in {e["path"] for e in manifest["files"] if e["held_out"]}
    assert tokenizer.decode(tokenizer(prompt["text"])["input_ids"]) == prompt["text"]
    stream = np.load(work / "train_tokens.npy")
    assert stream.max() < TINY.vocab_size and (stream == tokenizer.eos_token_id).sum() == TINY.files_per_split
    regen = [json.loads(line) for line in (work / "regen_prompts_greedy.jsonl").read_text().splitlines()]
    assert regen and all(0 < len(r["input_ids"]) for r in regen)
    with pytest.raises(ValueError, match="other settings"):
        build.build(work, tmp_path / "pair", build.BuildConfig(), until="tokens")


def test_first_lines_and_held_out_rule():
    text = "a = 1\nbb = 2\nccc = 3\n"
    assert corpus.first_lines(text, 13) == corpus.first_lines(text, 20)[:13] == "a = 1\nbb = 2\n"
    assert corpus.first_lines(text, 3) == "a ="  # one line at least, cut to fit
    assert corpus.lines_from(text, 2, 100) == "ccc = 3\n"
    assert corpus.is_held_out("chunk.py") and not corpus.is_held_out("os.py")


CFG = TINY.target_config()


def test_next_token_loss_is_transformers_loss(tmp_path):
    """Our loss on exported random weights equals Qwen3ForCausalLM(labels=...).loss; the export loads in both."""
    params = pretrain.init_params(CFG, seed=3)
    export_hf(tmp_path, CFG, params, "float32", eos_token_id=0)
    windows = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 17)).astype(np.int32)
    hf = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers shifts the labels itself; causal, so the last input changes no loss term
        theirs = hf(torch.tensor(windows).long(), labels=torch.tensor(windows).long()).loss.item()
    ours = float(pretrain.next_token_loss(params, CFG, jnp.asarray(windows)))
    assert ours == pytest.approx(theirs, rel=1e-5)
    loaded = eagle3_jax.load_target(tmp_path, dtype="float32", progress=False)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), loaded.params, params))


def test_pretraining_resumes_exactly(tmp_path):
    """Four updates at once equal one update, a stop (time budget 0), then three more from the checkpoint; the
    loss falls and the held-out loss is logged at each checkpoint."""
    stream = np.tile(np.arange(40, dtype=np.uint16), 100)  # learnable within a few updates
    config = pretrain.PretrainConfig(seq_len=16, batch_size=2, steps=4, warmup_steps=1, learning_rate=1e-2)
    straight = pretrain.pretrain(CFG, stream, tmp_path / "a", config, log_every=1, held_out=stream[:100])
    first = pretrain.pretrain(CFG, stream, tmp_path / "b", config, time_budget_s=0)
    assert int(first.step) == 1
    resumed = pretrain.pretrain(CFG, stream, tmp_path / "b", config)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), straight.params, resumed.params))
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 4 and losses[-1] < losses[0] and any("held_out_loss" in x for x in lines)
    with pytest.raises(ValueError, match="other settings"):
        other = pretrain.PretrainConfig(seq_len=16, batch_size=2, steps=5, warmup_steps=1)
        pretrain.pretrain(CFG, stream, tmp_path / "b", other)


class _Crash(Exception):
    pass


def test_pretraining_stops_on_a_signal_resumes_exactly_and_logs_each_step_once(tmp_path, monkeypatch):
    """Pre-training runs the drafter trainer's loop (eagle3_jax/training/loop.py): SIGINT after update 1
    (checkpointed there, `Interrupted`); a resume that checkpoints at 2, logs 3 and crashes in update 4; a resume
    from 2 after a cut-off metrics line: the uninterrupted run's parameters, metrics.jsonl holds steps 1 to 4
    once each, and other settings are refused by name. (The settings of `test_pretraining_resumes_exactly`:
    one compiled step.)"""
    stream = np.tile(np.arange(40, dtype=np.uint16), 100)
    config = pretrain.PretrainConfig(seq_len=16, batch_size=2, steps=4, warmup_steps=1, learning_rate=1e-2)
    straight = pretrain.pretrain(CFG, stream, tmp_path / "straight", config)
    real, calls = pretrain.jit_train_step, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise _Crash
        out = real(*args, **kwargs)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)
        return out

    def logged_steps():
        return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    monkeypatch.setattr(pretrain, "jit_train_step", interrupted)
    out = tmp_path / "out"
    with pytest.raises(loop.Interrupted, match="stopped by SIGINT at step 1 of 4") as e:
        pretrain.pretrain(CFG, stream, out, config, log_every=1, checkpoint_every=2)
    assert e.value.exit_code == 130 and (out / "checkpoints" / "1").is_dir()
    with pytest.raises(_Crash):
        pretrain.pretrain(CFG, stream, out, config, log_every=1, checkpoint_every=2)
    assert logged_steps() == [1, 2, 3]
    monkeypatch.setattr(pretrain, "jit_train_step", real)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # a process killed while writing its line
    resumed = pretrain.pretrain(CFG, stream, out, config, log_every=1, checkpoint_every=2)
    assert int(resumed.step) == 4 and logged_steps() == [1, 2, 3, 4]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), straight.params, resumed.params))
    with pytest.raises(ValueError, match=r"other settings \(steps differs\): steps: 4 in the run, 5 now"):
        pretrain.pretrain(CFG, stream, out, pretrain.PretrainConfig(**{**config.__dict__, "steps": 5}))


def test_drafter_data_is_one_length(tmp_path):
    """Regenerated records cut to drafter_seq_len (short ones left out) and as many plain-text windows."""
    b = build.Build(tmp_path, TINY, deadline=float("inf"))
    span = TINY.drafter_seq_len
    records = [{"input_ids": list(range(n)), "loss_mask": [0] * 3 + [1] * (n - 3)} for n in (span + 9, span, 5)]
    (tmp_path / "regen_greedy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    np.save(tmp_path / "train_tokens.npy", np.arange(500, dtype=np.uint16))
    samples = [json.loads(x) for x in b.write_drafter_data().read_text().splitlines()]
    assert [len(s["input_ids"]) for s in samples] == [span] * 4
    assert samples[0]["loss_mask"] == records[0]["loss_mask"][:span] and "loss_mask" not in samples[3]
