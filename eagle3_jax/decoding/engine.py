"""The host side: validate requests, prefill, then one jitted call of `rounds_per_call` rounds after another.

Each call's outputs come back in one small device-to-host transfer. While some row surely needs another
call, it is dispatched before that transfer is waited on, so the device does not idle on the host; near
the end it is dispatched only if the tokens say so. Stop checks run on the device; rounds run after every
row is done change nothing and are dropped. `Engine.device_events` records what the latest request did.

The jitted steps are module-level: their static configuration (`StepSpec`) is a hashable argument, so
every Engine of the same configuration, and every request of the same shapes, reuses one compilation.

Sampling settings (temperature, top-k, top-p, seed) travel as device arrays, one value per row, so new
values never recompile. An Engine has two builds of its steps: the greedy one, which a request whose rows
are all greedy runs (no sampling work at all), and the sampling one, which runs any request with
a sampled row and handles greedy rows beside them. Each compiles once, when first needed.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from eagle3_jax.checkpoints.target import Target
from eagle3_jax.decoding import spec_round
from eagle3_jax.decoding.sampling import SamplingParams
from eagle3_jax.models import kernels as kernels_lib

_MIN_PREFILL_BUCKET = 16
_STOP_SLOTS = 8  # stop ids are padded to a multiple of this, so their number rarely recompiles
ROUNDS_PER_CALL = 4  # the default: 4 save most of a call's overhead (k = 8: 0.6% more; BENCHMARKS.md)
PROPOSALS = ("argmax", "sample")
# Both are lossless; which accepts more depends on the drafter. "argmax" is what vLLM, SGLang and
# tpu-inference do, and needs no filter over the draft vocabulary per draft step.
DEFAULT_PROPOSAL = "argmax"
# Engine(exact=...)'s default. The exact kernels cost speed (BENCHMARKS.md): they become the default
# where they cost at most 3% of a decode step at batch 1 and 8 on the H200.
DEFAULT_EXACT = False
# Below this, logits / temperature can overflow float32 (to inf at about 1e-37 times a logit of 10):
# such a temperature is refused rather than sampled wrongly; 0 is greedy.
MIN_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class RoundTrace:
    """One speculative round of one sequence, for inspection (`generate(..., trace=True)`)."""

    drafted: list[int]  # the drafter's gamma proposals, as target ids
    # After each of [x_n, d_1 .. d_gamma]: a greedy row's argmax; a sampled row's accepted drafts, then the
    # token sampled after them, then the target's argmax.
    target: list[int]
    accepted: int  # how many drafts were accepted before the first rejection


@dataclasses.dataclass(frozen=True)
class Result:
    token_ids: list[int]  # generated tokens only
    finish_reason: str  # "stop" (ended at a stop token, included) or "length"
    accept_lengths: list[int]  # per speculative round: drafted tokens accepted (0..gamma); empty when spec is off
    rounds: list[RoundTrace] | None = None  # per-round detail, with trace=True


# Shared by every Engine; jax.jit caches one executable per (StepSpec, argument shapes and dtypes).
jit_prefill = jax.jit(spec_round.prefill, static_argnames=("spec",))
jit_rounds = jax.jit(spec_round.spec_rounds, static_argnames=("spec", "num_rounds"), donate_argnames=("state",))


@dataclasses.dataclass(frozen=True)
class _RoundOutput:
    """The host's view of one round (or of prefill), unpacked from spec_round's single array."""

    tokens: list[list[int]]  # emitted tokens per row
    choices: np.ndarray  # [B, gamma + 1] the target's choices (RoundTrace.target)
    drafts: np.ndarray  # [B, gamma]
    accepted: np.ndarray  # [B]
    done: np.ndarray  # [B] bool

    @classmethod
    def unpack(cls, packed: np.ndarray) -> _RoundOutput:
        gamma = (packed.shape[1] - 4) // 2
        choices, drafts = packed[:, : gamma + 1], packed[:, gamma + 1 : 2 * gamma + 1]
        num_emit, accepted, done = packed[:, -3], packed[:, -2], packed[:, -1].astype(bool)
        # Whole-array tolist, then list slices: per-row numpy work costs seconds at thousands of rows.
        tokens = [row[:n] for row, n in zip(choices.tolist(), num_emit.tolist())]
        return cls(tokens, choices, drafts, accepted, done)


class Engine:
    """Decoding of a Qwen3 target, greedy or sampled per row, speculative when an EAGLE-3 drafter is given.
    Lossless: a greedy row's output is token for token what plain greedy decoding of the target gives,
    and a sampled row's output is distributed exactly as sampling the target alone."""

    def __init__(self, target: Target, drafter=None, num_draft_tokens: int = 3, max_len: int = 2048,
                 kernels: str | None = None, rounds_per_call: int = ROUNDS_PER_CALL,
                 proposal: str = DEFAULT_PROPOSAL, exact: bool = DEFAULT_EXACT):
        """rounds_per_call: rounds run by one device call (a lax.scan) and returned in one transfer. More
        save the per-call overhead (about 0.2-0.3 ms on the H200) more often; fewer deliver tokens sooner
        (a call's rounds arrive together) and run fewer rounds in vain after a stop token.
        proposal: how the drafter proposes for a sampled row: "argmax" (q one-hot, accepted with
        probability p(x)) or "sample" (x drawn from the drafter's filtered q, accepted with probability
        min(1, p(x) / q(x))). Both are lossless; which accepts more is the drafter's to show. Greedy rows
        ignore it.
        exact: the target's decode and verify steps run kernels whose result for a token does not depend
        on how many tokens or rows share the step (eagle3_jax/models/kernels.py, EXACT), so greedy
        speculative output is bit for bit spec-off output in 16-bit too, not only in float32. Prefill and
        the drafter run `kernels`. Off the GPU the exact kernels run in Pallas' interpreter (slow)."""
        cfg = target.config
        if max_len < 2 or max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_len must be in [2, max_position_embeddings={cfg.max_position_embeddings}], got {max_len}")
        head_dims = (cfg.head_dim,) + ((drafter.config.head_dim,) if drafter is not None else ())
        kernels = kernels_lib.check(kernels or kernels_lib.default(*head_dims), *head_dims)
        # More rounds than max_len can never emit a token: every round emits one per live row.
        if not _is_int(rounds_per_call) or not 1 <= rounds_per_call <= max_len:
            raise ValueError(f"rounds_per_call must be an int in [1, max_len={max_len}], got {rounds_per_call!r}")
        if drafter is not None and num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1 with a drafter, got {num_draft_tokens}")
        if proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
        if not isinstance(exact, bool):
            raise ValueError(f"exact must be a bool, got {exact!r}")
        if exact and not kernels_lib.pallas_attention_supports(cfg.head_dim):
            raise ValueError(f"exact=True needs a power-of-two head_dim >= 16 (its attention kernel), "
                             f"got {cfg.head_dim}")
        if exact and cfg.moe is not None:
            raise ValueError("exact=True is for dense targets: the expert layers have no row-invariant kernels")
        if exact:
            _check_exact_shapes(cfg)
        self.target, self.drafter, self.max_len = target, drafter, max_len
        self._rounds_per_call = int(rounds_per_call)
        self.num_draft_tokens = num_draft_tokens if drafter is not None else 0
        self._spec = spec_round.StepSpec(
            target=cfg,
            drafter=drafter.config if drafter is not None else None,
            gamma=self.num_draft_tokens,
            max_len=max_len,
            kernels=kernels,
            exact=exact,
        )
        # Without a drafter there is nothing to propose: one sampling build for either choice.
        self._sampling_spec = dataclasses.replace(self._spec, sampling=True,
                                                  proposal=proposal if drafter is not None else DEFAULT_PROPOSAL)
        # Prefill draws no drafts: one compilation of it serves both proposals.
        self._sampling_prefill_spec = dataclasses.replace(self._sampling_spec, proposal=PROPOSALS[0])
        self.device_events: list[tuple[str, tuple[int, ...]]] = []

    def _build(self, inputs) -> spec_round.StepSpec:
        """The build a request runs: the sampling one when its inputs carry sampling settings."""
        return self._sampling_spec if len(inputs) > 4 else self._spec

    def _call_prefill(self, *inputs):
        self.device_events.append(("prefill", ()))
        spec = self._sampling_prefill_spec if self._build(inputs).sampling else self._spec
        return jit_prefill(self.target.params, self._draft_params, *inputs, spec=spec)

    def _call_rounds(self, state, spec: spec_round.StepSpec):
        """Dispatches one call of rounds (asynchronously: JAX returns before the device finishes)."""
        self.device_events.append(("call", (self._rounds_per_call,)))
        return jit_rounds(self.target.params, self._draft_params, state, spec=spec, num_rounds=self._rounds_per_call)

    def _fetch(self, packed: jax.Array) -> np.ndarray:
        """The engine's only device-to-host transfer: one int32 array per call (prefill, or a call of rounds)."""
        self.device_events.append(("transfer", tuple(packed.shape)))
        return jax.device_get(packed)

    @property
    def spec(self) -> spec_round.StepSpec:
        """The static configuration the jitted steps (`jit_prefill`, `jit_rounds`) are compiled for when
        every row is greedy (requests with a sampled row run it with `sampling=True`)."""
        return self._spec

    @property
    def rounds_per_call(self) -> int:
        """Rounds per device call, fixed at construction: the jitted scan is built for it."""
        return self._rounds_per_call

    @property
    def _draft_params(self):
        return self.drafter.params if self.drafter is not None else None

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_token_ids: Sequence[int] = (),
                 *, temperature=0.0, top_k=0, top_p=1.0, seed=None, trace: bool = False) -> list[Result]:
        """Continuation of each prompt (token ids); see `Result`.

        temperature, top_k, top_p, seed: each a scalar for every prompt or a list with one per prompt.
        temperature 0 is greedy (the argmax; the other settings are then ignored); else the row samples
        from the target's distribution filtered as transformers' generate does (temperature, then top-k,
        then top-p; top_k 0 and top_p 1 mean no filter). seed None draws fresh entropy; an int in
        [0, 2**64) fixes the row's draws: with the same engine (drafter, gamma, proposal), its prompt,
        settings and seed give the same tokens whatever the other rows. Bad values raise ValueError before
        any device work.
        trace=True also keeps each round's drafts and target choices (`Result.rounds`): they travel in
        the round's one transfer either way, so tracing adds no device work and no transfer."""
        tokens = [[] for _ in prompts]
        accepts = [[] for _ in prompts]
        traces = [[] for _ in prompts]
        reasons = ["length"] * len(prompts)
        stops = set(stop_token_ids)
        settings = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        for out, live in self._rounds(*self._prepare(prompts, max_new_tokens, stop_token_ids, **settings)):
            accepted, done = out.accepted.tolist(), out.done.tolist()
            for i, new in enumerate(out.tokens):
                tokens[i].extend(new)
                if live[i]:
                    accepts[i].append(accepted[i])
                    if trace:
                        traces[i].append(RoundTrace(out.drafts[i].tolist(), out.choices[i].tolist(), accepted[i]))
                if done[i] and new and new[-1] in stops:
                    reasons[i] = "stop"
        return [Result(t, r, a, tr if trace else None) for t, r, a, tr in zip(tokens, reasons, accepts, traces)]

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_token_ids: Sequence[int] = (),
               *, temperature=0.0, top_k=0, top_p=1.0, seed=None) -> Iterator[list[list[int]]]:
        """Yields, once per round, the new tokens of each prompt; the settings are `generate`'s. Safe to
        abandon at any point. A bad request raises here, before the first chunk is asked for."""
        settings = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        rounds = self._rounds(*self._prepare(prompts, max_new_tokens, stop_token_ids, **settings))
        return (out.tokens for out, _ in rounds)

    def _rounds(self, inputs, budget: np.ndarray):
        """Yields (round output, which rows were live in a speculative round) for prefill and each round.
        budget: the most tokens each row can emit (max_new_tokens, or the room left below max_len)."""
        self.device_events = []
        spec = self._build(inputs)
        state, packed = self._call_prefill(*inputs)
        out = _RoundOutput.unpack(self._fetch(packed))
        yield out, [False] * len(out.tokens)
        left = budget - np.array([len(t) for t in out.tokens])
        pending = self._call_rounds(state, spec) if not out.done.all() else None
        most_per_call = self.rounds_per_call * (self.num_draft_tokens + 1)
        while pending is not None:
            state, packed = pending
            # Dispatch the next call before waiting for this one's tokens when some row is sure to need it
            # (more tokens left than this call can emit); near the end, wait and dispatch only if needed: a
            # pause of one dispatch instead of a call of rounds run in vain. A stop token can still waste one.
            following = None
            if np.any((left > most_per_call) & ~out.done):
                following = self._call_rounds(state, spec)
            for round_packed in self._fetch(packed):
                speculative_rows = (~out.done & (self.drafter is not None)).tolist()
                out = _RoundOutput.unpack(round_packed)
                left -= np.array([len(t) for t in out.tokens])
                yield out, speculative_rows
                if out.done.all():
                    break
            if out.done.all():
                pending = None
            else:
                pending = following if following is not None else self._call_rounds(state, spec)

    def _prepare(self, prompts, max_new_tokens, stop_token_ids, temperature=0.0, top_k=0, top_p=1.0, seed=None):
        """Checks the request on the host and builds the device inputs; raises ValueError before any device work.
        Returns the inputs (with the rows' SamplingParams last when some row samples) and the most tokens
        each row can emit."""
        self.device_events = []  # a request refused here did nothing on the device
        vocab = self.target.config.vocab_size
        if isinstance(prompts, (str, bytes)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        for i, p in enumerate(prompts):
            if not isinstance(p, (list, tuple, np.ndarray)):  # a ValueError, as for every bad request
                raise ValueError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")  # noqa: TRY004
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(p) > self.max_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens, more than max_len={self.max_len}")
            if min(p) < 0 or max(p) >= vocab:
                bad = next(t for t in p if not 0 <= t < vocab)
                raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab})")
        bad_stops = [t for t in stop_token_ids if not _is_int(t) or not 0 <= int(t) < vocab]
        if bad_stops:
            raise ValueError(f"stop token id {bad_stops[0]!r} is not an int in the vocabulary [0, {vocab})")
        B = len(prompts)
        tokens = np.zeros((B, bucket_length(max(len(p) for p in prompts), self.max_len)), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        slots = max(_STOP_SLOTS, -(-len(stop_token_ids) // _STOP_SLOTS) * _STOP_SLOTS)
        stops = np.full((B, slots), -1, np.int32)
        stops[:, : len(stop_token_ids)] = list(stop_token_ids)
        lengths = np.array([len(p) for p in prompts], np.int32)
        # No row can emit more than max_len tokens: the clamp keeps the int32 in range.
        max_new = min(int(max_new_tokens), self.max_len)
        host = (tokens, lengths, np.full((B,), max_new, np.int32), stops)
        settings = _sampling_settings(B, temperature, top_k, top_p, seed)
        inputs = jax.device_put(host if settings is None else host + (settings,))
        return inputs, np.minimum(max_new, self.max_len - lengths)


def _check_exact_shapes(cfg) -> None:
    """exact=True's matmul (pallas_kernels/skinny_matmul.py) needs every target weight's output size to be a
    multiple of 16 and its input size at least 16."""
    D, H, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    outputs = {"q/k/v": (cfg.num_heads + 2 * cfg.num_kv_heads) * H, "o": D, "gate/up": 2 * I, "down": D,
               "lm_head": cfg.vocab_size}
    bad = [f"{name} {n}" for name, n in outputs.items() if n % 16] + [
        f"input {k}" for k in (D, cfg.num_heads * H, I) if k < 16]
    if bad:
        raise ValueError(f"exact=True needs target weights with outputs a multiple of 16 and inputs >= 16: {bad}")


def bucket_length(length: int, max_len: int) -> int:
    """The padded length of a row of `length` tokens: a power of two from 16 up, capped at max_len, so that
    padding stays under half a row and few shapes compile."""
    return min(max(_MIN_PREFILL_BUCKET, 1 << (length - 1).bit_length()), max_len)


def _per_row(name: str, value, B: int) -> list:
    """A scalar for every row, or a list of one value per row."""
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != B:
            raise ValueError(f"{name} has {len(value)} values for {B} prompts")
        return list(value)
    return [value] * B


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _sampling_settings(B: int, temperature, top_k, top_p, seed) -> SamplingParams | None:
    """The rows' sampling settings as host arrays, checked; None when every row is greedy."""
    temps, ks, ps, seeds = (_per_row(n, v, B) for n, v in
                            (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)))
    for t in temps:
        if not _is_real(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {t!r}")
    for k in ks:
        if not _is_int(k) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: no top-k filter), got {k!r}")
    for p in ps:
        if not _is_real(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: no top-p filter), got {p!r}")
    for s in seeds:
        if s is not None and (not _is_int(s) or not 0 <= s < 2**64):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {s!r}")
    if all(t == 0 for t in temps):
        return None
    seeds = [secrets.randbits(64) if s is None else int(s) for s in seeds]
    key_data = np.array([[s >> 32, s & 0xFFFFFFFF] for s in seeds], np.uint32)
    # top_k beyond int32 keeps every token, as any value >= the vocabulary size does.
    top_k = np.array([min(int(k), 2**31 - 1) for k in ks], np.int32)
    return SamplingParams(temperature=np.array(temps, np.float32), top_k=top_k, top_p=np.array(ps, np.float32),
                          seed=key_data)
