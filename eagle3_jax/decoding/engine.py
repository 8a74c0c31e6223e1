"""The host side: a checked request (request.py), prefill, then one jitted call of rounds after another.

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
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from eagle3_jax.checkpoints.target import Target
from eagle3_jax.decoding import spec_round
from eagle3_jax.decoding.request import Request, is_int
from eagle3_jax.decoding.request import bucket_length as bucket_length  # training/batching.py's prompt buckets
from eagle3_jax.decoding.round_output import RoundOutput
from eagle3_jax.models import kernels as kernels_lib

ROUNDS_PER_CALL = 4  # the default: 4 save most of a call's overhead (k = 8: 0.6% more; BENCHMARKS.md)
PROPOSALS = ("argmax", "sample")
# Both are lossless; which accepts more depends on the drafter. "argmax" is what vLLM, SGLang and
# tpu-inference do, and needs no filter over the draft vocabulary per draft step.
DEFAULT_PROPOSAL = "argmax"
# Engine(exact=...)'s default. The exact kernels cost speed (BENCHMARKS.md): they become the default
# where they cost at most 3% of a decode step at batch 1 and 8 on the H200.
DEFAULT_EXACT = False
DEFAULT_MAX_LEN = 2048  # Engine(max_len=None)'s capacity, where the target's limit allows it


@dataclasses.dataclass(frozen=True)
class RoundTrace:
    """One speculative round of one sequence, for inspection (`generate(..., trace=True)`)."""

    drafted: list[int]  # the drafter's gamma proposals, as target ids
    # After each of [x_n, d_1 .. d_gamma]: a greedy row's argmax; a sampled row's accepted drafts, then the
    # token sampled after them, then the target's argmax.
    target: list[int]
    # How many drafts the round committed: those accepted before the first rejection, fewer when the round
    # was cut short (by a stop token, max_new_tokens or max_len) before emitting them all.
    accepted: int


@dataclasses.dataclass(frozen=True)
class Result:
    token_ids: list[int]  # generated tokens only
    finish_reason: str  # "stop" (ended at a stop token, included) or "length"
    # Per speculative round: the drafts it committed (0..gamma; RoundTrace.accepted); empty when spec is off.
    # tau = mean(a + 1).
    accept_lengths: list[int]
    rounds: list[RoundTrace] | None = None  # per-round detail, with trace=True


# Shared by every Engine; jax.jit caches one executable per (StepSpec, argument shapes and dtypes).
jit_prefill = jax.jit(spec_round.prefill, static_argnames=("spec",))
jit_rounds = jax.jit(spec_round.spec_rounds, static_argnames=("spec", "num_rounds"), donate_argnames=("state",))


class Engine:
    """Decoding of a Qwen3 target, greedy or sampled per row, speculative when an EAGLE-3 drafter is given.
    Lossless: a greedy row's output is token for token what plain greedy decoding of the target gives,
    and a sampled row's output is distributed exactly as sampling the target alone."""

    def __init__(self, target: Target, drafter=None, num_draft_tokens: int = 3, max_len: int | None = None,
                 kernels: str | None = None, rounds_per_call: int = ROUNDS_PER_CALL,
                 proposal: str = DEFAULT_PROPOSAL, exact: bool = DEFAULT_EXACT):
        """max_len: the KV capacity of a row, prompt and output (None: min(2048, the target's
        max_position_embeddings)).
        rounds_per_call: rounds run by one device call (a lax.scan) and returned in one transfer. More
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
        max_len = _check_sizes(cfg, drafter is not None, num_draft_tokens, max_len, rounds_per_call)
        head_dims = (cfg.head_dim,) + ((drafter.config.head_dim,) if drafter is not None else ())
        kernels = kernels_lib.check(kernels or kernels_lib.default(*head_dims), *head_dims)
        if proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
        _check_exact(cfg, exact)
        self.target, self.drafter, self.max_len = target, drafter, max_len
        self._rounds_per_call = int(rounds_per_call)
        self.num_draft_tokens = int(num_draft_tokens) if drafter is not None else 0
        self._spec = spec_round.StepSpec(
            target=cfg,
            drafter=drafter.config if drafter is not None else None,
            gamma=self.num_draft_tokens,
            max_len=self.max_len,
            kernels=kernels,
            exact=exact,
        )
        # Without a drafter there is nothing to propose: one sampling build for either choice.
        self._sampling_spec = dataclasses.replace(self._spec, sampling=True,
                                                  proposal=proposal if drafter is not None else DEFAULT_PROPOSAL)
        # Prefill draws no drafts: one compilation of it serves both proposals.
        self._sampling_prefill_spec = dataclasses.replace(self._sampling_spec, proposal=PROPOSALS[0])
        self.device_events: list[tuple[str, tuple[int, ...]]] = []

    def _build(self, request: Request) -> spec_round.StepSpec:
        """The build a request runs: the sampling one when some row samples."""
        return self._sampling_spec if request.samples else self._spec

    def _call_prefill(self, request: Request):
        self.device_events.append(("prefill", ()))
        spec = self._sampling_prefill_spec if request.samples else self._spec
        return jit_prefill(self.target.params, self._draft_params, jax.device_put(request), spec=spec)

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
        Every token id, max_new_tokens, stop id, top_k and seed is an int (a numpy integer too; not a bool,
        not a float); a prompt is a list or tuple of them or a 1-D integer array, and prompts may be a 2-D
        integer array. Anything else raises ValueError naming the argument and the prompt index.
        trace=True also keeps each round's drafts and target choices (`Result.rounds`): they travel in
        the round's one transfer either way, so tracing adds no device work and no transfer."""
        request = self.request(prompts, max_new_tokens, stop_token_ids, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed)
        B = len(request.lengths)
        tokens, accepts, traces = ([[] for _ in range(B)] for _ in range(3))
        reasons = ["length"] * B
        for out, live in self._rounds(request):
            accepted, done = out.accepted.tolist(), out.done.tolist()
            for i, new in enumerate(out.tokens):
                tokens[i].extend(new)
                if live[i]:
                    accepts[i].append(accepted[i])
                    if trace:
                        traces[i].append(RoundTrace(out.drafts[i].tolist(), out.choices[i].tolist(), accepted[i]))
                if done[i] and new and request.is_stop(i, new[-1]):
                    reasons[i] = "stop"
        return [Result(t, r, a, tr if trace else None) for t, r, a, tr in zip(tokens, reasons, accepts, traces)]

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_token_ids: Sequence[int] = (),
               *, temperature=0.0, top_k=0, top_p=1.0, seed=None) -> Iterator[list[list[int]]]:
        """Yields, once per round, the new tokens of each prompt; the settings are `generate`'s. Safe to
        abandon at any point. A bad request raises here, before the first chunk is asked for."""
        request = self.request(prompts, max_new_tokens, stop_token_ids, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed)
        return (out.tokens for out, _ in self._rounds(request))

    def request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_token_ids: Sequence[int] = (),
                *, temperature=0.0, top_k=0, top_p=1.0, seed=None) -> Request:
        """The request `generate` runs for these arguments, checked against this engine's max_len and the
        target's vocabulary; raises ValueError before any device work."""
        self.device_events = []  # a request refused here did nothing on the device
        return Request.build(prompts, max_new_tokens, stop_token_ids, max_len=self.max_len,
                             vocab_size=self.target.config.vocab_size, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed)

    def _rounds(self, request: Request):
        """Yields (round output, which rows were live in a speculative round) for prefill and each round."""
        self.device_events = []
        spec = self._build(request)
        state, packed = self._call_prefill(request)
        out = RoundOutput.unpack(self._fetch(packed), self.num_draft_tokens)
        yield out, [False] * len(out.tokens)
        left = request.budget(self.max_len) - np.array([len(t) for t in out.tokens])
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
                out = RoundOutput.unpack(round_packed, self.num_draft_tokens)
                left -= np.array([len(t) for t in out.tokens])
                yield out, speculative_rows
                if out.done.all():
                    break
            if out.done.all():
                pending = None
            else:
                pending = following if following is not None else self._call_rounds(state, spec)


def _check_sizes(cfg, has_drafter: bool, num_draft_tokens, max_len, rounds_per_call) -> int:
    """Engine's int arguments, each an int (a numpy integer too, never a bool) in its range; returns
    max_len, None resolved to the default that fits the target."""
    limit = cfg.max_position_embeddings
    max_len = min(DEFAULT_MAX_LEN, limit) if max_len is None else max_len
    if not is_int(max_len) or not 2 <= max_len <= limit:
        raise ValueError(f"max_len must be None or an int in [2, max_position_embeddings={limit}], got {max_len!r}")
    least = 1 if has_drafter else 0
    if not is_int(num_draft_tokens) or num_draft_tokens < least:
        raise ValueError(f"num_draft_tokens must be an int >= {least}{' with a drafter' if has_drafter else ''}, "
                         f"got {num_draft_tokens!r}")
    # More rounds than max_len can never emit a token: every round emits one per live row.
    if not is_int(rounds_per_call) or not 1 <= rounds_per_call <= max_len:
        raise ValueError(f"rounds_per_call must be an int in [1, max_len={max_len}], got {rounds_per_call!r}")
    return int(max_len)


def _check_exact(cfg, exact) -> None:
    if not isinstance(exact, bool):
        raise ValueError(f"exact must be a bool, got {exact!r}")
    if not exact:
        return
    if not kernels_lib.pallas_attention_supports(cfg.head_dim):
        raise ValueError(f"exact=True needs a power-of-two head_dim >= 16 (its attention kernel), got {cfg.head_dim}")
    if cfg.moe is not None:
        raise ValueError("exact=True is for dense targets: the expert layers have no row-invariant kernels")
    _check_exact_shapes(cfg)


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
