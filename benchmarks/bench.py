"""`eagle3-jax bench`: where a Qwen3-8B + EAGLE-3 decode stands against the GPU's limits.

One process, random bf16 weights at real shapes built on the device (no downloads). It measures the
ceilings (device-to-device copy bandwidth, bf16 matmul rate), then every step the engine runs, each
against its floor (bytes it must read: weights + live KV, over the copy bandwidth measured here):
the spec-off decode step, the verify step, one draft step, the drafter rebuild, the draft chain and
whole speculative rounds, plus compile times, transfers per call and the peer a user would run
instead (transformers `generate`, eager). On the CPU it runs the same code at tiny shapes (a smoke
test). Prints a table, writes bench.json and bench.png under --out.

Timing: warm-up, then the median over `reps` of `inner` back-to-back calls each,
synchronised with block_until_ready; random data, never zeros; functions are compiled ahead of the
timed region (`lower().compile()`), so nothing can recompile inside it. Spec-off steps and whole rounds
are timed as the engine runs them, `--rounds-per-call` rounds to a call, and reported per round.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import measure
from eagle3_jax.checkpoints.drafter import Drafter
from eagle3_jax.checkpoints.target import Target
from eagle3_jax.decoding import engine as engine_lib
from eagle3_jax.decoding import sampling as sampling_lib
from eagle3_jax.decoding import spec_round
from eagle3_jax.decoding.engine import ROUNDS_PER_CALL, Engine
from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models import kernels as kernels_lib
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.config import Qwen3Config
from eagle3_jax.models.eagle3 import DrafterConfig


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to measure."""

    target: Qwen3Config
    drafter: DrafterConfig
    batches: tuple[int, ...]  # spec-off decode
    kv_lengths: tuple[int, ...]  # spec-off decode
    spec_batches: tuple[int, ...]  # verify, draft, rebuild, rounds
    spec_kv_length: int
    gammas: tuple[int, ...]
    reps: int
    inner: int
    copy_bytes: int
    matmul_n: int


def qwen3_8b_plan() -> Plan:
    target, drafter = measure.model_pair(vocab=151936, hidden=4096, intermediate=12288, layers=36, heads=32,
                                         kv_heads=8, head_dim=128, theta=1e6, draft_vocab=32000)
    return Plan(target, drafter, batches=(1, 8, 32), kv_lengths=(1024, 8192), spec_batches=(1, 8), spec_kv_length=1024,
                gammas=(1, 3, 5, 7), reps=15, inner=10, copy_bytes=4 << 30, matmul_n=8192)


def tiny_plan() -> Plan:
    target, drafter = measure.model_pair(vocab=256, hidden=64, intermediate=128, layers=6, heads=4, kv_heads=2,
                                         head_dim=16, theta=1e4, draft_vocab=64, max_positions=1024)
    return Plan(target, drafter, batches=(2,), kv_lengths=(32,), spec_batches=(1,), spec_kv_length=32,
                gammas=(2,), reps=2, inner=2, copy_bytes=1 << 20, matmul_n=128)


def decode_state(plan: Plan, batch: int, length: int, capacity: int, dtype,
                 with_drafter: bool) -> spec_round.DecodeState:
    t, d = plan.target, plan.drafter
    key = jax.random.key(batch * 7 + length)
    return spec_round.DecodeState(
        target_cache=measure.random_cache(t.num_layers, batch, t.num_kv_heads, capacity, t.head_dim, length, dtype, 11),
        draft_cache=(measure.random_cache(1, batch, d.num_kv_heads, capacity, d.head_dim, length, dtype, 99)
                     if with_drafter else None),
        last_token=jax.random.randint(key, (batch,), 0, t.vocab_size, jnp.int32),
        draft_hidden=measure.normal(key, (batch, d.hidden_size), dtype) if with_drafter else None,
        num_generated=jnp.zeros((batch,), jnp.int32),
        max_new=jnp.full((batch,), 1 << 30, jnp.int32),
        stop_ids=jnp.full((batch, 8), -1, jnp.int32),
        done=jnp.zeros((batch,), bool),
    )


# ----------------------------------------------------------------------------- the run


class Bench:
    def __init__(self, plan: Plan, kernels: tuple[str, ...], budget_s: float, dtype, out: Path | None,
                 target: Target | None = None, drafter: Drafter | None = None,
                 rounds_per_call: int = ROUNDS_PER_CALL):
        """Random weights at the plan's shapes, unless a loaded target and drafter are given. Decode steps
        and rounds are timed as the engine runs them, rounds_per_call to a device call."""
        self.plan, self.kernels, self.dtype, self.out = plan, kernels, dtype, out
        self.rounds_per_call = rounds_per_call
        self.deadline = time.perf_counter() + budget_s
        self.results: dict = {"skipped": []}
        t0 = time.perf_counter()
        self.tparams = (target.params if target
                        else measure.random_tree(target_lib.abstract_params(plan.target, dtype), seed=1))
        self.dparams = (drafter.params if drafter
                        else measure.random_tree(drafter_lib.abstract_params(plan.drafter, dtype), seed=2))
        jax.block_until_ready((self.tparams, self.dparams))
        self.results["init_s"] = time.perf_counter() - t0
        self.target = target or Target(plan.target, self.tparams, folder=None)
        self.drafter = drafter or Drafter(plan.drafter, self.dparams, folder=None)
        self.bw = None  # TB/s, once the ceilings are measured
        self.with_peer = True

    def log(self, line: str) -> None:
        if self.out is not None:  # the command-line run reports as it goes; time_parts stays quiet
            print(line, flush=True)

    def time(self, compiled, state, args):
        """Median seconds per call of a compiled step; returns (seconds, the state it leaves)."""
        return measure.time_chain(compiled, state, args, self.plan.reps, self.plan.inner)

    def time_left(self, label: str) -> bool:
        if time.perf_counter() < self.deadline:
            return True
        self.results["skipped"].append(label)
        self.log(f"skipped (time budget): {label}")
        return False

    def target_read(self, batch: int, tokens: int) -> int:
        """Target weight bytes a step of `tokens` tokens per row reads: every weight but the embedding
        (bench_moe counts only the routed experts)."""
        return measure.target_weight_bytes(self.tparams)

    def floor_s(self, nbytes_read: int) -> float:
        return nbytes_read / (self.bw * 1e12) if self.bw else float("nan")

    def row(self, section: str, entry: dict, seconds: float, read: int, compile_s: float) -> dict:
        entry.update(time_ms=seconds * 1e3, floor_ms=self.floor_s(read) * 1e3, ratio=seconds / self.floor_s(read),
                     bytes_read=read, compile_s=compile_s)
        self.results.setdefault(section, []).append(entry)
        self.save()
        rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}
        self.log(f"{section:12s} {json.dumps(rounded)}")
        return entry

    def save(self) -> None:
        """Written after every measurement, so a run cut short still leaves its numbers."""
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "bench.json").write_text(json.dumps(self.results, indent=1, default=str))

    def ceilings(self) -> None:
        self.results["ceilings"] = copy = measure.measure_copy_bandwidth(self.plan.copy_bytes)
        copy["matmul_tflops"] = measure.measure_matmul(self.plan.matmul_n)
        self.bw = copy["copy_tbps"]
        self.log(f"ceilings {json.dumps(copy)}")

    def _kv(self, cfg_layers, kv_heads, head_dim, batch, length):
        return measure.kv_bytes(cfg_layers, batch, length, kv_heads, head_dim, jnp.dtype(self.dtype).itemsize)

    def decode(self, batch: int, length: int, kernels: str) -> None:
        """The spec-off step the engine runs: a round with no drafter (one target token, argmax, commit),
        per round of the engine's calls of several rounds."""
        seconds, compile_s, _, read, _ = self._spec_off_step(batch, length, kernels)
        entry = {"batch": batch, "kv_len": length, "kernels": kernels, "tokens_per_s": batch / seconds,
                 "rounds_per_call": self.rounds_per_call}
        self.row("decode", entry, seconds, read, compile_s)

    def _spec_off_step(self, batch: int, length: int, kernels: str, profile: bool = False,
                       rounds_per_call: int | None = None):
        """Compiles and times the engine's spec-off step: (seconds per round, compile seconds, executable,
        bytes read per round, and with profile=True the GPU time of each kernel per round, else None)."""
        t = self.plan.target
        rounds = self.rounds_per_call if rounds_per_call is None else rounds_per_call
        call, compiled, compile_s, seconds, state = self._engine_call(batch, length, length + 64, kernels, rounds)
        read = self.target_read(batch, 1) + self._kv(t.num_layers, t.num_kv_heads, t.head_dim, batch, length)
        kernel_times = None
        if profile:
            holder = [state]

            def run():
                holder[0], out = call(holder[0])
                return out

            kernel_times = {name: [n / rounds, us / rounds]
                            for name, (n, us) in measure.gpu_kernel_times(run).items()}
        return seconds, compile_s, compiled, read, kernel_times

    def verify(self, batch: int, tokens: int, kernels: str) -> None:
        t, L = self.plan.target, self.plan.spec_kv_length
        cache = measure.random_cache(t.num_layers, batch, t.num_kv_heads, L + 64, t.head_dim, L, self.dtype, 5)
        toks = jax.random.randint(jax.random.key(3), (batch, tokens), 0, t.vocab_size, jnp.int32)
        step = measure.jit_step(measure.target_step, 3, cfg=t, capture=self.plan.drafter.capture_layers,
                                kernels=kernels)
        compiled, compile_s = measure.compile_timed(step, self.tparams, toks, cache)
        seconds, _ = self.time(compiled, cache, (self.tparams, toks))
        read = self.target_read(batch, tokens) + self._kv(t.num_layers, t.num_kv_heads, t.head_dim, batch, L + tokens)
        entry = {"batch": batch, "kv_len": L, "tokens": tokens, "kernels": kernels}
        self.row("verify", entry, seconds, read, compile_s)

    def _drafter_inputs(self, batch):
        d, L = self.plan.drafter, self.plan.spec_kv_length
        cache = measure.random_cache(1, batch, d.num_kv_heads, L + 64, d.head_dim, L, self.dtype, 7)
        return cache, self.tparams["embed"]

    def _drafter_read(self, batch, tokens, with_fc: bool, with_head: bool) -> int:
        d, p = self.plan.drafter, self.dparams
        layer = measure.nbytes({k: v for k, v in p.items() if k not in ("fc", "lm_head", "d2t")})
        read = layer + (measure.nbytes(p["fc"]) if with_fc else 0) + (measure.nbytes(p["lm_head"]) if with_head else 0)
        return read + self._kv(1, d.num_kv_heads, d.head_dim, batch, self.plan.spec_kv_length + tokens)

    def draft_step(self, batch: int, kernels: str) -> None:
        d = self.plan.drafter
        cache, embed = self._drafter_inputs(batch)
        h = measure.normal(jax.random.key(4), (batch, d.hidden_size), self.dtype)
        token = jnp.zeros((batch,), jnp.int32) + 17
        step = measure.jit_step(measure.draft_step, 5, cfg=d, kernels=kernels)
        compiled, compile_s = measure.compile_timed(step, self.dparams, embed, h, token, cache)
        seconds, _ = self.time(compiled, cache, (self.dparams, embed, h, token))
        self.row("draft_step", {"batch": batch, "kernels": kernels}, seconds, self._drafter_read(batch, 1, False, True),
                 compile_s)

    def rebuild(self, batch: int, tokens: int, kernels: str) -> None:
        d = self.plan.drafter
        cache, embed = self._drafter_inputs(batch)
        feats = measure.normal(jax.random.key(5), (batch, tokens, d.feature_width), self.dtype)
        toks = jax.random.randint(jax.random.key(6), (batch, tokens), 0, d.target_vocab_size, jnp.int32)
        step = measure.jit_step(measure.rebuild_step, 5, cfg=d, kernels=kernels)
        compiled, compile_s = measure.compile_timed(step, self.dparams, embed, feats, toks, cache)
        seconds, _ = self.time(compiled, cache, (self.dparams, embed, feats, toks))
        self.row("rebuild", {"batch": batch, "tokens": tokens, "kernels": kernels}, seconds,
                 self._drafter_read(batch, tokens, True, False), compile_s)

    def chain(self, batch: int, gamma: int, kernels: str) -> None:
        d = self.plan.drafter
        cache, embed = self._drafter_inputs(batch)
        h = measure.normal(jax.random.key(4), (batch, d.hidden_size), self.dtype)
        step = measure.jit_step(measure.chain_step, 4, cfg=d, gamma=gamma, kernels=kernels)
        compiled, compile_s = measure.compile_timed(step, self.dparams, embed, h, cache)
        seconds, _ = self.time(compiled, cache, (self.dparams, embed, h))
        read = self._drafter_read(batch, gamma, False, True) * (gamma - 1) + measure.nbytes(self.dparams["lm_head"])
        self.row("chain", {"batch": batch, "gamma": gamma, "kernels": kernels}, seconds, read, compile_s)

    def round(self, batch: int, gamma: int, kernels: str) -> None:
        """A whole speculative round, per round as the engine runs them (rounds_per_call to a call). Its
        overhead is against its parts timed one call each, so it is taken from the round timed one call
        each too. The timed rounds grow the cache by about a token each, up to capacity (L + 512), so the
        KV read is up to 512 tokens longer than the floor counts (at batch 8, up to 3% more bytes)."""
        seconds, compile_s = self._time_round(batch, gamma, kernels, self.rounds_per_call)
        single = seconds if self.rounds_per_call == 1 else self._time_round(batch, gamma, kernels, 1)[0]
        L = self.plan.spec_kv_length
        measured = self._parts(batch, gamma, kernels)
        parts = {r["section"]: r["time_ms"] for r in measured}
        t = self.plan.target
        read = (self.target_read(batch, gamma + 1)
                + self._kv(t.num_layers, t.num_kv_heads, t.head_dim, batch, L + gamma + 1)
                + sum(r["bytes_read"] for r in measured if r["section"] != "verify"))
        entry = {"batch": batch, "gamma": gamma, "kernels": kernels, "parts_ms": parts,
                 "rounds_per_call": self.rounds_per_call, "time_ms_one_round_per_call": single * 1e3}
        if len(parts) == 3:
            entry["overhead"] = single * 1e3 / sum(parts.values()) - 1
        self.row("round", entry, seconds, read, compile_s)
        spec_off = [r for r in self.results.get("decode", [])
                    if r["batch"] == batch and r["kv_len"] == L and r["kernels"] == kernels]
        entry["projected_tokens_per_s"] = {tau: batch * tau / seconds for tau in range(1, gamma + 2)}
        if spec_off:
            entry["spec_off_tokens_per_s"] = spec_off[0]["tokens_per_s"]

    def _time_round(self, batch: int, gamma: int, kernels: str, rounds_per_call: int) -> tuple[float, float]:
        """(seconds per round, compile seconds) of the engine's call of rounds_per_call speculative rounds."""
        L = self.plan.spec_kv_length
        capacity = min(L + 512, self.plan.target.max_position_embeddings)
        _, _, compile_s, seconds, _ = self._engine_call(batch, L, capacity, kernels, rounds_per_call, gamma)
        return seconds, compile_s

    def _engine_call(self, batch: int, length: int, capacity: int, kernels: str, rounds_per_call: int,
                     gamma: int = 0):
        """Compiles and times the engine's call of rounds_per_call rounds (spec-off when gamma is 0) from a
        random state at `length`: (the call on a state, executable, compile seconds, seconds per round,
        the state it leaves)."""
        dparams = self.dparams if gamma else None
        # The engine's own jitted call, built from its StepSpec directly: the ablation kernels
        # (kernels_lib.ABLATION) are the model's to run, not Engine's to offer.
        spec = spec_round.StepSpec(target=self.plan.target, drafter=self.plan.drafter if gamma else None,
                                   gamma=gamma, max_len=capacity, kernels=kernels)
        state = decode_state(self.plan, batch, length, capacity, self.dtype, with_drafter=gamma > 0)
        compiled, compile_s = measure.compile_timed(engine_lib.jit_rounds, self.tparams, dparams, state,
                                                    spec=spec, num_rounds=rounds_per_call)

        def call(s):
            return compiled(self.tparams, dparams, s)

        seconds, state = self.time(call, state, ())
        return call, compiled, compile_s, seconds / rounds_per_call, state

    def _parts(self, batch, gamma, kernels):
        wanted = {("verify", gamma + 1), ("chain", gamma), ("rebuild", gamma + 1)}
        out = []
        for section, key in (("verify", "tokens"), ("chain", "gamma"), ("rebuild", "tokens")):
            for r in self.results.get(section, []):
                if r["batch"] == batch and r["kernels"] == kernels and (section, r[key]) in wanted:
                    out.append(dict(r, section=section))
        return out

    def variants(self, batch: int, length: int, kernels: str) -> None:
        """Where a decode step's time goes: the full step, the step without lm_head and argmax, and the
        matmuls alone; with the number of kernels XLA emits for each."""
        t = self.plan.target
        out = {}
        cache = measure.random_cache(t.num_layers, batch, t.num_kv_heads, length + 64, t.head_dim, length,
                                     self.dtype, 5)
        tokens = jnp.zeros((batch, 1), jnp.int32) + 3
        for name, step, args in (
            ("forward_no_head", measure.jit_step(measure.forward_only, 3, cfg=t, kernels=kernels),
             (self.tparams, tokens)),
            ("matmuls_only", measure.jit_step(measure.matmuls_only, 3, cfg=t),
             (self.tparams, measure.normal(jax.random.key(8), (batch, t.hidden_size), self.dtype))),
        ):
            state = cache if name != "matmuls_only" else jnp.zeros((), jnp.int32)
            compiled, compile_s = measure.compile_timed(step, *args, state)
            seconds, state = self.time(compiled, state, args)
            if name != "matmuls_only":
                cache = state
            out[name] = {"time_ms": seconds * 1e3, "kernel_count": measure.kernel_count(compiled)}
        seconds, _, _, read, kernel_times = self._spec_off_step(batch, length, kernels, profile=True)
        # One round per call: what the engine's scan of rounds saves, and the kernel count (a scan's kernels
        # are in its loop body, not in the entry computation that kernel_count reads).
        single, _, compiled, _, _ = self._spec_off_step(batch, length, kernels, rounds_per_call=1)
        out["step_one_round_per_call"] = {"time_ms": single * 1e3, "kernel_count": measure.kernel_count(compiled)}
        out["step"] = {"time_ms": seconds * 1e3, "kernel_count": measure.kernel_count(compiled),
                       "rounds_per_call": self.rounds_per_call}
        if kernel_times:  # the kernels' times summed, against the step's wall time. Kernels in XLA's command
            # buffers can overlap, so the difference is not the time between kernels (BENCHMARKS.md).
            busy_us = sum(us for _, us in kernel_times.values())
            out["step"].update(kernel_busy_ms=busy_us / 1e3, wall_minus_kernel_sum_ms=seconds * 1e3 - busy_us / 1e3,
                               launches=sum(n for n, _ in kernel_times.values()),
                               groups_us=measure.kernel_groups(kernel_times),
                               kernels=dict(sorted(kernel_times.items(), key=lambda kv: -kv[1][1])))
        entry = {"batch": batch, "kv_len": length, "kernels": kernels, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                 "floor_ms": self.floor_s(read) * 1e3, **out}
        self.results.setdefault("variants", []).append(entry)
        self.log(f"variants {json.dumps(entry)}")
        self.save()

    def agreement(self, gamma: int, new_tokens: int) -> None:
        """Greedy output at real shapes in the run's dtype: speculative against spec-off for each attention
        implementation, and Pallas against XLA when both are measured. Where two outputs differ, the
        target's top-2 logit margin (XLA path) at the first differing token says how near a tie it was."""
        rng = np.random.default_rng(0)
        # 200 tokens: a prefill of 256, several tiles of the prefill kernel; 25: a short row beside it.
        prompts = [rng.integers(0, self.plan.target.vocab_size, n).tolist() for n in (200, 25)]
        impls = [impl for impl in ("xla", "pallas") if impl in self.kernels]
        modes = {"spec_off": None, f"gamma_{gamma}": self.drafter}
        outs = {(impl, mode): [r.token_ids for r in Engine(self.target, drafter, num_draft_tokens=gamma, max_len=512,
                                                          kernels=impl).generate(prompts, new_tokens)]
                for impl in impls for mode, drafter in modes.items()}
        report = {f"{impl}: gamma_{gamma} vs spec_off":
                  self._compare(prompts, outs[impl, "spec_off"], outs[impl, f"gamma_{gamma}"])
                  for impl in impls}
        if len(impls) == 2:
            report.update({f"{mode}: pallas vs xla": self._compare(prompts, outs["xla", mode], outs["pallas", mode])
                           for mode in modes})
        self.results["agreement"] = report
        self.log(f"agreement {json.dumps(report)}")
        self.save()

    def _compare(self, prompts, first: list[list[int]], second: list[list[int]]) -> list[dict]:
        rows = []
        for prompt, a, b in zip(prompts, first, second):
            diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            row = {"identical": a == b, "tokens": len(a)}
            if diff is not None:
                row.update(first_difference=diff, margin=self._margin(prompt + a[:diff]))
            rows.append(row)
        return rows

    def _margin(self, tokens: list[int]) -> float:
        cfg = self.plan.target
        cache = target_lib.new_cache(cfg, 1, len(tokens), self.dtype)
        hidden, _, _ = jax.jit(target_lib.forward, static_argnums=(1, 4, 5))(
            self.tparams, cfg, jnp.asarray([tokens], jnp.int32), cache, (), "xla")
        top = jax.lax.top_k(target_lib.logits(self.tparams, hidden[0, -1]), 2)[0]
        return float(top[0] - top[1])

    def engine_generate(self, gamma: int, kernels: str, new_tokens: int) -> None:
        """The engine end to end: transfers per call of rounds counted, no implicit transfer allowed."""
        engine = Engine(self.target, self.drafter, num_draft_tokens=gamma, max_len=256, kernels=kernels,
                        rounds_per_call=self.rounds_per_call)
        prompt = [list(range(5, 5 + 16))]
        engine.generate(prompt, 4)  # compile
        with jax.transfer_guard("disallow"), measure.count_compilations() as compilations:
            start = time.perf_counter()
            (result,) = engine.generate(prompt, new_tokens)
            seconds = time.perf_counter() - start
        fetches = [shape for kind, shape in engine.device_events if kind == "transfer"]
        rounds = len(result.accept_lengths)
        self.results["engine"] = {
            "gamma": gamma, "kernels": kernels, "tokens": len(result.token_ids), "rounds": rounds,
            "tokens_per_s": len(result.token_ids) / seconds, "tau": len(result.token_ids[1:]) / max(rounds, 1),
            "rounds_per_call": engine.rounds_per_call, "device_to_host_transfers": len(fetches),
            # prefill, then each call of rounds_per_call rounds
            "transfers_per_call": len(fetches) / (1 + -(-rounds // engine.rounds_per_call)),
            "transfer_shape": list(fetches[0]), "host_syncs_inside_a_round": 0,
            "compilations_in_the_timed_request": compilations.count,
        }
        self.log(f"engine {json.dumps(self.results['engine'])}")
        self.save()

    def peer(self, prompt_len: int, new_tokens: int) -> None:
        """transformers' generate on the same config and device, eager, random weights."""
        import torch
        from transformers import Qwen3Config as HFConfig
        from transformers import Qwen3ForCausalLM

        t = self.plan.target
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
        self.results["peer"] = {"name": "transformers generate (eager)", "tokens_per_s": new_tokens / seconds,
                                "ms_per_token": seconds / new_tokens * 1e3, "torch": torch.__version__}
        self.log(f"peer {json.dumps(self.results['peer'])}")
        self.save()
        del model
        if device == "cuda":
            torch.cuda.empty_cache()

    def sampling(self, batch: int, gamma: int, kernels: str) -> None:
        """A sampled round against a greedy round, as the engine runs them (the aim: at most 3% more), for
        each proposal mode at Qwen3's generation_config settings (temperature 0.6, top-k 20, top-p 0.95) and
        with top-p alone (temperature 1, top-p 0.95). Then the filter alone over the verify's logits
        [batch (gamma + 1), V] at Qwen3's settings, against one sort per row."""
        L = self.plan.spec_kv_length
        capacity = min(L + 512, self.plan.target.max_position_embeddings)
        greedy, compile_s = self._sampling_round(batch, gamma, kernels, capacity, None, None)
        entry = {"batch": batch, "gamma": gamma, "kernels": kernels, "rounds_per_call": self.rounds_per_call,
                 "greedy_ms": greedy * 1e3, "compile_s": {"greedy": compile_s}}
        for proposal in engine_lib.PROPOSALS:
            for label, settings in (("qwen3_defaults", (0.6, 20, 0.95)), ("top_p_only", (1.0, 0, 0.95))):
                seconds, compile_s = self._sampling_round(batch, gamma, kernels, capacity, proposal, settings)
                entry[f"{proposal}_{label}_ms"] = seconds * 1e3
                entry[f"{proposal}_{label}_extra"] = seconds / greedy - 1
                entry["compile_s"].setdefault(proposal, compile_s)  # new settings reuse the executable
        rows, V = batch * (gamma + 1), self.plan.target.vocab_size
        logits = jax.random.normal(jax.random.key(9), (rows, V), jnp.float32) * 3
        settings = (jnp.full((rows,), 0.6), jnp.full((rows,), 20, jnp.int32), jnp.full((rows,), 0.95))
        parts = (("filter_ms", sampling_lib.filtered_probs), ("filter_sort_ms", sorted_filter))
        for name, fn in parts:
            compiled = jax.jit(fn).lower(logits, *settings).compile()
            entry[name] = self._time_pure(compiled, logits, *settings) * 1e3
        self.results.setdefault("sampling", []).append(entry)
        self.log(f"sampling {json.dumps(entry)}")
        self.save()

    def _sampling_round(self, batch, gamma, kernels, capacity, proposal, settings) -> tuple[float, float]:
        """(seconds per round, compile seconds) of a call of rounds from a random state at the plan's KV
        length: greedy when proposal is None, else every row sampling with settings (t, top_k, top_p)."""
        spec = spec_round.StepSpec(target=self.plan.target, drafter=self.plan.drafter, gamma=gamma,
                                   max_len=capacity, kernels=kernels, sampling=proposal is not None,
                                   proposal=proposal or "argmax")
        state = decode_state(self.plan, batch, self.plan.spec_kv_length, capacity, self.dtype, with_drafter=True)
        if proposal is not None:
            t, k, p = settings
            state = dataclasses.replace(state, sampling=sampling_lib.SamplingParams(
                temperature=jnp.full((batch,), t, jnp.float32), top_k=jnp.full((batch,), k, jnp.int32),
                top_p=jnp.full((batch,), p, jnp.float32), seed=jnp.zeros((batch, 2), jnp.uint32)))
        compiled, compile_s = measure.compile_timed(engine_lib.jit_rounds, self.tparams, self.dparams, state,
                                                    spec=spec, num_rounds=self.rounds_per_call)
        seconds, _ = self.time(compiled, state, (self.tparams, self.dparams))
        return seconds / self.rounds_per_call, compile_s

    def _time_pure(self, compiled, *args) -> float:
        """Median seconds per call of a stateless compiled function."""
        jax.block_until_ready(compiled(*args))
        samples = []
        for _ in range(self.plan.reps):
            start = time.perf_counter()
            for _ in range(self.plan.inner):
                out = compiled(*args)
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - start) / self.plan.inner)
        return float(np.median(samples))

    def run(self) -> dict:
        plan, primary = self.plan, self.kernels[0]
        self.ceilings()
        first_batch, first_len = plan.batches[0], plan.kv_lengths[0]
        for kernels in self.kernels:
            if self.time_left(f"decode b{first_batch} l{first_len} {kernels}"):
                self.decode(first_batch, first_len, kernels)
        if self.time_left("agreement"):
            self.agreement(gamma=3, new_tokens=24)
        mid = plan.gammas[len(plan.gammas) // 2]
        b = plan.spec_batches[0]
        self._spec_set(b, mid, primary)
        if self.time_left("engine"):
            self.engine_generate(mid, primary, 48)
        if self.with_peer and self.time_left("peer"):
            self.peer(prompt_len=128, new_tokens=32)
        for batch in plan.batches:  # the spec-off step is the baseline: every kernel choice, every shape
            for length in plan.kv_lengths:
                for kernels in self.kernels:
                    first = (batch, length) == (first_batch, first_len)
                    if not first and self.time_left(f"decode b{batch} l{length} {kernels}"):
                        self.decode(batch, length, kernels)
        for batch in plan.spec_batches:
            for gamma in plan.gammas:
                if (batch, gamma) != (b, mid):
                    self._spec_set(batch, gamma, primary)
        return self.results

    def _spec_set(self, batch: int, gamma: int, kernels: str) -> None:
        measured = self.results.get("draft_step", [])
        if batch == self.plan.spec_batches[0] and not any(r["batch"] == batch for r in measured):
            if self.time_left(f"draft_step b{batch}"):
                self.draft_step(batch, kernels)
        for label, fn in (("verify", lambda: self.verify(batch, gamma + 1, kernels)),
                          ("chain", lambda: self.chain(batch, gamma, kernels)),
                          ("rebuild", lambda: self.rebuild(batch, gamma + 1, kernels)),
                          ("round", lambda: self.round(batch, gamma, kernels))):
            if self.time_left(f"{label} b{batch} g{gamma}"):
                fn()


def time_parts(target: Target, drafter: Drafter, gamma: int, kv_length: int = 256, batch: int = 1,
               kernels: str | None = None, reps: int = 5, inner: int = 5, with_floor: bool = False) -> dict:
    """Times a speculative round and its parts for loaded models on the current device (for notebooks):
    the spec-off step, one draft step, the draft chain, the verify step, the rebuild and the round, in ms.
    with_floor also measures the copy bandwidth so each row carries its memory-bandwidth floor."""
    plan = dataclasses.replace(tiny_plan(), target=target.config, drafter=drafter.config, batches=(batch,),
                               kv_lengths=(kv_length,), spec_batches=(batch,), spec_kv_length=kv_length,
                               gammas=(gamma,), reps=reps, inner=inner, copy_bytes=256 << 20)
    dtype = target.params["embed"].dtype
    kernels = kernels or kernels_lib.default(target.config.head_dim, drafter.config.head_dim)
    bench = Bench(plan, (kernels,), budget_s=1e9, dtype=dtype, out=None, target=target, drafter=drafter)
    if with_floor:
        bench.ceilings()
    impl = bench.kernels[0]
    bench.decode(batch, kv_length, impl)
    bench.draft_step(batch, impl)
    bench.verify(batch, gamma + 1, impl)
    bench.chain(batch, gamma, impl)
    bench.rebuild(batch, gamma + 1, impl)
    bench.round(batch, gamma, impl)
    return {s: bench.results[s][0] for s in ("decode", "draft_step", "verify", "chain", "rebuild", "round")}


def sorted_filter(logits, temperature, top_k, top_p):
    """The textbook top-k / top-p, one descending sort per row, for timing against the engine's filter
    (sampling.filtered_probs, which needs no sort). Ties at the boundary are not treated as the engine does."""
    x = logits / temperature[:, None]
    ordered = -jnp.sort(-x, axis=-1)  # descending
    rows = jnp.arange(x.shape[0])
    kth = jnp.where(top_k > 0, ordered[rows, jnp.maximum(top_k - 1, 0)], -jnp.inf)
    ordered = jnp.where(ordered >= kth[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens ranked above each one
    cut = jnp.min(jnp.where(before < top_p[:, None], ordered, jnp.inf), axis=-1)
    kept = jnp.where(x >= jnp.maximum(kth, cut)[:, None], x, -jnp.inf)
    return jax.nn.softmax(kept, axis=-1)


def versions() -> dict:
    out = {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
           "device": str(jax.devices()[0].device_kind)}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


def summary(results: dict) -> str:
    """The headline table: each step against its floor and against the spec-off step."""
    lines = [f"device {results['versions']['device']}, jax {results['versions']['jax']}"]
    if "ceilings" in results:
        c = results["ceilings"]
        lines[0] += f", copy {c['copy_tbps']:.2f} TB/s, matmul {c['matmul_tflops']:.0f} TFLOP/s"
    lines.append(f"{'step':34s} {'ms':>9s} {'floor ms':>9s} {'x floor':>8s} {'compile s':>9s}")
    for section in ("decode", "verify", "draft_step", "chain", "rebuild", "round"):
        for r in results.get(section, []):
            keys = [f"{k}={r[k]}" for k in ("batch", "kv_len", "tokens", "gamma", "kernels") if k in r]
            label = f"{section} {' '.join(keys)}"
            lines.append(f"{label:34s} {r['time_ms']:9.3f} {r['floor_ms']:9.3f} {r['ratio']:8.2f} "
                         f"{r['compile_s']:9.1f}")
            if section == "round" and "overhead" in r:
                proj = ", ".join(f"tau {k}: {v:.0f}" for k, v in r["projected_tokens_per_s"].items())
                lines.append(f"{'':34s} overhead beyond parts (each one call) {r['overhead'] * 100:+.1f}%; "
                             f"projected tok/s {proj}; spec-off {r.get('spec_off_tokens_per_s', float('nan')):.0f}")
    if "engine" in results:
        e = results["engine"]
        lines.append(f"engine: {e['transfers_per_call']:.2f} device-to-host transfers per call of "
                     f"{e['rounds_per_call']} rounds, "
                     f"{e['compilations_in_the_timed_request']} compilation(s) in the timed request, "
                     f"{e['tokens_per_s']:.1f} tok/s at tau {e['tau']:.2f}")
    for name, rows in results.get("agreement", {}).items():
        lines.append(f"agreement {name}: " + "; ".join(
            "identical" if r["identical"] else f"differs from token {r['first_difference']} (margin {r['margin']:.2e})"
            for r in rows))
    if "peer" in results:
        lines.append(f"peer: {results['peer']['name']}: {results['peer']['tokens_per_s']:.1f} tok/s")
    for e in results.get("sampling", []):
        rounds = ", ".join(f"{p} {e[f'{p}_{label}_ms']:.3f} ms ({e[f'{p}_{label}_extra'] * 100:+.1f}%)"
                           for p in engine_lib.PROPOSALS for label in ("qwen3_defaults", "top_p_only")
                           if f"{p}_{label}_ms" in e)
        lines.append(f"sampling b{e['batch']} g{e['gamma']}: greedy round {e['greedy_ms']:.3f} ms; sampled "
                     f"(qwen3_defaults, then top_p_only) {rounds}")
        lines.append(f"{'':2s}over [{e['batch'] * (e['gamma'] + 1)}, V]: " + ", ".join(
            f"{k[:-3]} {e[k]:.3f} ms" for k in ("filter_ms", "filter_sort_ms") if k in e))
    if results["skipped"]:
        lines.append(f"skipped for time: {', '.join(results['skipped'])}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{s} " + " ".join(str(r.get(k, "")) for k in ("batch", "kv_len", "tokens", "gamma")), r["ratio"])
            for s in ("decode", "verify", "draft_step", "chain", "rebuild", "round") for r in results.get(s, [])]
    fig, ax = plt.subplots(figsize=(9, max(3, 0.3 * len(rows))))
    ax.barh([r[0] for r in rows], [r[1] for r in rows], color="tab:blue")
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel("time / memory-bandwidth floor")
    ax.set_title(f"eagle3-jax on {results['versions']['device']}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    # Leave GPU memory to the transformers peer measured in the same process (read when the backend starts).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    parser = argparse.ArgumentParser(prog="eagle3-jax bench", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (default on the CPU)")
    parser.add_argument("--kernels", nargs="+", choices=kernels_lib.CHOICES + (kernels_lib.ABLATION,),
                        help="kernel choices to compare (eagle3_jax/models/kernels.py; the first is used throughout)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting new measurements after this")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for bench.json and bench.png")
    parser.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    parser.add_argument("--agreement-only", action="store_true",
                        help="only the output agreement check (speculative vs spec-off, Pallas vs XLA), 96 tokens")
    parser.add_argument("--rounds-per-call", type=int, default=ROUNDS_PER_CALL,
                        help="rounds per device call, as the engine runs them (see eagle3_jax.Engine)")
    parser.add_argument("--sampling-only", action="store_true",
                        help="only a sampled round against a greedy round (batch 1 and 8, gamma 3) and the filters")
    parser.add_argument("--variants-only", action="store_true",
                        help="only the ceilings and the decode-step breakdown (batch 1, first KV length)")
    parser.add_argument("--model", choices=("qwen3-8b", "qwen3-30b-a3b"), default="qwen3-8b",
                        help="the target's shapes: dense Qwen3-8B, or Qwen3-30B-A3B (MoE; benchmarks/bench_moe.py)")
    parser.add_argument("--routing", choices=("random", "local"), default=None,
                        help="MoE: the routing the experts section leads with (both are measured; the whole "
                             "steps route through random routers)")
    args = parser.parse_args(argv)
    if args.rounds_per_call < 1:
        parser.error(f"--rounds-per-call must be >= 1, got {args.rounds_per_call}")
    moe = args.model == "qwen3-30b-a3b"
    if args.routing is not None and not moe:
        parser.error("--routing is for --model qwen3-30b-a3b")
    if moe and args.kernels is not None and len(args.kernels) > 1:
        parser.error("--model qwen3-30b-a3b measures one --kernels choice")
    tiny = args.tiny or jax.default_backend() == "cpu"
    plan = tiny_plan() if tiny else qwen3_8b_plan()
    on_gpu = jax.default_backend() == "gpu"
    kernels = tuple(args.kernels or (["pallas", "pallas_attention", "xla"] if on_gpu else ["xla"]))
    # bf16 as served on the GPU; float32 on the CPU, whose XLA lacks some bf16 dot kernels.
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    out = Path(args.out)
    if moe:
        return _main_moe(args, tiny, kernels, dtype, out)
    bench = Bench(plan, kernels, args.budget_s, dtype, out, rounds_per_call=args.rounds_per_call)
    bench.with_peer = not args.no_peer
    bench.results.update(versions=versions(), plan={"tiny": tiny, "target": dataclasses.asdict(plan.target),
                                                     "drafter": dataclasses.asdict(plan.drafter)})
    if args.agreement_only:
        bench.agreement(gamma=3, new_tokens=96)
        results = bench.results
    elif args.sampling_only:
        for batch in (1, 8):
            bench.sampling(batch, 3, kernels[0])
        results = bench.results
    elif args.variants_only:
        bench.ceilings()
        for choice in kernels:
            bench.variants(plan.batches[0], plan.kv_lengths[0], choice)
        results = bench.results
    else:
        results = bench.run()
    bench.save()
    try:
        plot(results, out / "bench.png")
    except ImportError:
        print("matplotlib not installed: no plot")
    print(summary(results))
    for v in results.get("variants", []):
        parts = ", ".join(f"{k} {v[k]['time_ms']:.3f} ms ({v[k]['kernel_count']} kernels)"
                          for k in ("step", "step_one_round_per_call", "forward_no_head", "matmuls_only"))
        print(f"variants b{v['batch']} l{v['kv_len']} {v['kernels']} [{v['xla_flags']}]: "
              f"floor {v['floor_ms']:.3f} ms; {parts}")
        step = v["step"]
        if "kernel_busy_ms" in step:
            groups = ", ".join(f"{g} {us / 1e3:.3f}" for g, us in step["groups_us"].items())
            print(f"  kernel times summed {step['kernel_busy_ms']:.3f} ms in {step['launches']:.0f} launches "
                  f"({groups} ms), wall minus that {step['wall_minus_kernel_sum_ms']:.3f} ms; "
                  "top kernels (launches, us per step):")
            for name, (count, us) in list(step["kernels"].items())[:12]:
                print(f"    {us:8.1f} us {count:5.0f}x  {name[:90]}")
    return 0


def _main_moe(args, tiny: bool, kernels: tuple[str, ...], dtype, out: Path) -> int:
    from benchmarks import bench_moe  # it builds on this module

    plan = bench_moe.tiny_moe_plan() if tiny else bench_moe.qwen3_30b_a3b_plan()
    bench = bench_moe.MoeBench(plan, kernels[:1], args.budget_s, dtype, out, rounds_per_call=args.rounds_per_call)
    bench.results.update(versions=versions(), plan={"tiny": tiny, "model": args.model,
                                                     "target": dataclasses.asdict(plan.base.target),
                                                     "drafter": dataclasses.asdict(plan.base.drafter)})
    results = bench.run(args.routing or "random")
    bench.save()
    try:
        plot(results, out / "bench.png")
    except ImportError:
        print("matplotlib not installed: no plot")
    print(bench_moe.summary(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
