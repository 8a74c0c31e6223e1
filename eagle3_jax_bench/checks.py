"""The checks beside the timed rows: greedy output agreement at real shapes (speculative against
spec-off, Pallas against XLA), the engine end to end (transfers per call, compilations in a timed
request) and the peer a user would run instead (transformers `generate`, eager)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoints.drafter import Drafter
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.decoding.engine import Engine
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.config import Qwen3Config

from .core import Run
from .profile import count_compilations


def agreement(run: Run, target: Target, drafter: Drafter, kernels: tuple[str, ...], gamma: int,
              new_tokens: int) -> None:
    """Greedy output at real shapes in the run's dtype: speculative against spec-off for each attention
    implementation, and Pallas against XLA when both are measured. Where two outputs differ, the
    target's top-2 logit margin (XLA path) at the first differing token says how near a tie it was."""
    rng = np.random.default_rng(0)
    # 200 tokens: a prefill of 256, several tiles of the prefill kernel; 25: a short row beside it.
    prompts = [rng.integers(0, target.config.vocab_size, n).tolist() for n in (200, 25)]
    impls = [impl for impl in ("xla", "pallas") if impl in kernels]
    modes = {"spec_off": None, f"gamma_{gamma}": drafter}
    outs = {(impl, mode): [r.token_ids for r in Engine(target, d, num_draft_tokens=gamma, max_len=512,
                                                      kernels=impl).generate(prompts, new_tokens)]
            for impl in impls for mode, d in modes.items()}
    report = {f"{impl}: gamma_{gamma} vs spec_off": compare(target, prompts, outs[impl, "spec_off"],
                                                            outs[impl, f"gamma_{gamma}"])
              for impl in impls}
    if len(impls) == 2:
        report.update({f"{mode}: pallas vs xla": compare(target, prompts, outs["xla", mode], outs["pallas", mode])
                       for mode in modes})
    run.record("agreement", report)


def compare(target: Target, prompts, first: list[list[int]], second: list[list[int]]) -> list[dict]:
    """Per prompt: whether two outputs are identical, and where they first differ, the target's margin there."""
    rows = []
    for prompt, a, b in zip(prompts, first, second):
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        row = {"identical": a == b, "tokens": len(a)}
        if diff is not None:
            row.update(first_difference=diff, margin=margin(target, prompt + a[:diff]))
        rows.append(row)
    return rows


def margin(target: Target, tokens: list[int]) -> float:
    """The target's top-1 minus top-2 logit after `tokens` (XLA path): how near a tie the next token is."""
    cfg, params = target.config, target.params
    cache = target_lib.new_row_cache(cfg, 1, len(tokens), params["embed"].dtype)
    hidden, _, _ = jax.jit(target_lib.forward_rows, static_argnums=(1, 4, 5))(
        params, cfg, jnp.asarray([tokens], jnp.int32), cache, (), "xla")
    top = jax.lax.top_k(target_lib.logits(params, hidden[0, -1]), 2)[0]
    return float(top[0] - top[1])


def engine_generate(run: Run, target: Target, drafter: Drafter, gamma: int, kernels: str, new_tokens: int,
                    rounds_per_call: int) -> None:
    """The engine end to end: transfers per call of rounds counted, no implicit transfer allowed."""
    engine = Engine(target, drafter, num_draft_tokens=gamma, max_len=256, kernels=kernels,
                    rounds_per_call=rounds_per_call)
    prompt = [list(range(5, 5 + 16))]
    engine.generate(prompt, new_tokens)  # compile: the same calls, with prompt tokens and without
    with jax.transfer_guard("disallow"), count_compilations() as compilations:
        start = time.perf_counter()
        (result,) = engine.generate(prompt, new_tokens)
        seconds = time.perf_counter() - start
    fetches = [shape for kind, shape in engine.device_events if kind == "transfer"]
    calls = sum(kind == "call" for kind, _ in engine.device_events)
    rounds = len(result.accept_lengths)
    run.record("engine", {
        "gamma": gamma, "kernels": kernels, "tokens": len(result.token_ids), "rounds": rounds,
        "tokens_per_s": len(result.token_ids) / seconds, "tau": len(result.token_ids[1:]) / max(rounds, 1),
        "rounds_per_call": engine.rounds_per_call, "device_to_host_transfers": len(fetches),
        "transfers_per_call": len(fetches) / calls,  # the prompt's call, then calls of rounds_per_call rounds
        "transfer_shape": list(fetches[0]), "host_syncs_inside_a_round": 0,
        "compilations_in_the_timed_request": compilations.count,
    })


def peer(run: Run, t: Qwen3Config, prompt_len: int, new_tokens: int) -> None:
    """transformers' generate on the same config and device, eager, random weights."""
    import torch
    from transformers import Qwen3Config as HFConfig
    from transformers import Qwen3ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = HFConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                   num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads,
                   num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim, tie_word_embeddings=False,
                   max_position_embeddings=t.max_position_embeddings)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    prompt = torch.randint(0, t.vocab_size, (1, prompt_len), device=device)
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    run.record("peer", {"name": "transformers generate (eager)", "tokens_per_s": new_tokens / seconds,
                        "ms_per_token": seconds / new_tokens * 1e3, "torch": torch.__version__})
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
