"""A generation request, checked on the host before any device work and laid out as the device takes it.

Every field holds one row per prompt: its tokens (right-padded to a prompt bucket), its length, its
max_new_tokens, its stop ids, its sampling settings, its penalties and logit_bias, and the logprobs it asks for.
Rows never share a setting, so rows of different requests can sit side by side in one batch. Bad input raises
ValueError naming the argument, and the prompt index where there is one.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets

import jax
import numpy as np

from eagle3_jax.decoding import logprobs as logprobs_lib
from eagle3_jax.decoding import penalties as penalties_lib
from eagle3_jax.decoding.penalties import Penalties
from eagle3_jax.decoding.sampling import SamplingParams

_MIN_PREFILL_BUCKET = 16
_STOP_SLOTS = 8  # stop ids are padded to a multiple of this, so their number rarely recompiles
_SEQUENCES = (list, tuple, np.ndarray)
# Below this, logits / temperature can overflow float32 (to inf at about 1e-37 times a logit of 10):
# such a temperature is refused rather than sampled wrongly; 0 is greedy.
MIN_TEMPERATURE = 1e-5


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Request:
    """B rows, as host arrays from `Request.build`: the live pool's per-prompt rows (live_plan.request_rows)."""

    tokens: np.ndarray  # [B, T] int32: the prompts, right-padded with 0 to their bucket (`bucket_length`)
    lengths: np.ndarray  # [B] int32: the prompts' lengths
    max_new: np.ndarray  # [B] int32: the most tokens each row may emit (max_new_tokens, at most max_len)
    stop_ids: np.ndarray  # [B, P] int32: each row's stop token ids, padded with -1
    sampling: SamplingParams | None  # each row's settings; None when every row is greedy
    # each row's compiled constraint (decoding/automaton.Automaton) or None (free); None when no row is constrained
    constraints: tuple | None = dataclasses.field(default=None, metadata=dict(static=True))
    penalties: Penalties | None = None  # each row's penalties and logit_bias; None when no row has any
    # [B] int32: the alternatives each row's tokens report with their logprobs (0 .. logprobs.TOP; -1: no logprobs);
    # None when no row asks for logprobs
    logprobs: np.ndarray | None = None
    prompt_logprobs: np.ndarray | None = None  # [B] int32: the same for the prompt's own tokens; None: no row asks

    @property
    def samples(self) -> bool:
        """Whether some row samples: such a request runs the sampling build of the steps."""
        return self.sampling is not None

    @property
    def penalized(self) -> bool:
        """Whether some row has a penalty or a logit_bias: such a request runs a build with penalties."""
        return self.penalties is not None and bool(np.any(self.penalties.active()))

    @property
    def wants_logprobs(self) -> bool:
        """Whether some row asks for logprobs (of its tokens or its prompt's): a build with logprobs then."""
        return any(x is not None and bool(np.any(x >= 0)) for x in (self.logprobs, self.prompt_logprobs))

    def budget(self, max_len: int) -> np.ndarray:
        """[B] the most tokens each row can emit: its max_new_tokens, or the room left below max_len."""
        return np.minimum(self.max_new, max_len - self.lengths)

    def is_stop(self, row: int, token: int) -> bool:
        """Whether `token` is one of the row's stop ids (not the padding)."""
        return token >= 0 and bool(np.any(self.stop_ids[row] == token))

    @property
    def num_rows(self) -> int:
        return self.lengths.shape[0]

    def padded_length(self, rows, max_len: int) -> int:
        """The prompt bucket of these rows together: their longest prompt's."""
        return bucket_length(max((int(self.lengths[r]) for r in rows), default=1), max_len)

    def take(self, rows, num_rows: int, max_len: int) -> Request:
        """These rows, in this order, then 1-token greedy rows up to num_rows, with the prompts cut to their own
        bucket: the host rows a live pool splits a request into and stacks (live_plan)."""
        index = np.zeros((num_rows,), np.int64)
        index[: len(rows)] = rows
        real = np.arange(num_rows) < len(rows)

        def pick(x, pad):
            return np.where(real.reshape((-1,) + (1,) * (x.ndim - 1)), x[index], np.asarray(pad, x.dtype))

        sampling = penalties = None
        if self.sampling is not None:
            s = self.sampling
            sampling = SamplingParams(temperature=pick(s.temperature, 0), top_k=pick(s.top_k, 0),
                                      top_p=pick(s.top_p, 1), seed=pick(s.seed, 0))
        if self.penalties is not None:
            p = self.penalties
            penalties = Penalties(pick(p.frequency, 0), pick(p.presence, 0), pick(p.repetition, 1),
                                  pick(p.bias_ids, -1), pick(p.bias, 0))
        constraints = None
        if self.constraints is not None:
            constraints = tuple(self.constraints[r] for r in rows) + (None,) * (num_rows - len(rows))
        return Request(tokens=pick(self.tokens[:, : self.padded_length(rows, max_len)], 0),
                       lengths=pick(self.lengths, 1), max_new=pick(self.max_new, 1),
                       stop_ids=pick(self.stop_ids, -1), sampling=sampling, constraints=constraints,
                       penalties=penalties, logprobs=None if self.logprobs is None else pick(self.logprobs, -1),
                       prompt_logprobs=None if self.prompt_logprobs is None else pick(self.prompt_logprobs, -1))

    def constraint(self, row: int):
        """The row's compiled constraint, or None."""
        return None if self.constraints is None else self.constraints[row]

    @classmethod
    def build(cls, prompts, max_new_tokens, stop_token_ids=(), *, max_len: int, vocab_size: int,
              temperature=0.0, top_k=0, top_p=1.0, seed=None, constraints=None, frequency_penalty=0.0,
              presence_penalty=0.0, repetition_penalty=1.0, logit_bias=None, logprobs=None,
              prompt_logprobs=None) -> Request:
        """The request `Engine.generate` describes (see there), checked: ValueError on any bad value.
        constraints: None, or one compiled constraint (or None) per prompt; a constrained row also stops at its
        constraint's end ids."""
        rows = _prompt_rows(prompts, max_len, vocab_size)
        B = len(rows)
        budgets = _max_new(max_new_tokens, B)
        stops = _stop_lists(stop_token_ids, B, vocab_size)
        if constraints is not None:
            stops = [s + [e for e in c.eos if e not in s] if c is not None else s for s, c in zip(stops, constraints)]
            constraints = tuple(constraints) if any(c is not None for c in constraints) else None
        tokens = np.zeros((B, bucket_length(max(len(p) for p in rows), max_len)), np.int32)
        for i, p in enumerate(rows):
            tokens[i, : len(p)] = p
        widest = max(len(s) for s in stops)
        stop_ids = np.full((B, max(_STOP_SLOTS, -(-widest // _STOP_SLOTS) * _STOP_SLOTS)), -1, np.int32)
        for i, s in enumerate(stops):
            stop_ids[i, : len(s)] = s
        # No row can emit more than max_len tokens: the clamp keeps the int32 in range.
        max_new = np.array([min(m, max_len) for m in budgets], np.int32)
        return cls(tokens, np.array([len(p) for p in rows], np.int32), max_new, stop_ids,
                   _sampling_settings(B, temperature, top_k, top_p, seed), constraints,
                   _penalty_settings(B, vocab_size, frequency_penalty, presence_penalty, repetition_penalty,
                                     logit_bias),
                   _logprob_counts("logprobs", logprobs, B), _logprob_counts("prompt_logprobs", prompt_logprobs, B))


def bucket_length(length: int, max_len: int) -> int:
    """The padded length of a row of `length` tokens: a power of two from 16 up, capped at max_len, so that
    padding stays under half a row and few shapes compile."""
    return min(max(_MIN_PREFILL_BUCKET, 1 << (length - 1).bit_length()), max_len)


def check_room(prompt_tokens: int, max_new_tokens: int, max_len: int, name: str = "max_new_tokens",
               limit: str | None = None) -> None:
    """A prompt and its budget must fit max_len together: ValueError naming both numbers otherwise. Engine.generate
    cuts a row at max_len instead (a budget is a most); the server and the CLI, which take one prompt and a budget a
    user typed, refuse it, so that nobody gets fewer tokens than asked for without being told. name, limit: how the
    caller spells the budget and the capacity."""
    if prompt_tokens + max_new_tokens > max_len:
        raise ValueError(f"the prompt has {prompt_tokens} tokens and {name} is {max_new_tokens}: together "
                         f"{prompt_tokens + max_new_tokens}, past {limit or f'max_len={max_len}'}")


def is_int(x) -> bool:
    """An int, or a numpy integer; not a bool (True is not a token id, a budget or a count)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)) and math.isfinite(x)


def _token_ids(where: str, ids) -> list[int]:
    """A sequence of token ids as a list of Python ints; ValueError naming `where` for anything else."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"{where} must be a 1-D array of integer token ids, got {ids.ndim}-D {ids.dtype}")
        return ids.tolist()
    if not isinstance(ids, (list, tuple)):  # a ValueError, as for every bad request
        raise ValueError(f"{where} must be a list of token ids, got {type(ids).__name__}")  # noqa: TRY004
    for j, t in enumerate(ids):
        if type(t) is not int and not is_int(t):  # the type check first: it is the common case
            raise ValueError(f"{where} has {t!r} at position {j}: token ids are ints")
    return [int(t) for t in ids]


def _prompt_rows(prompts, max_len: int, vocab_size: int) -> list[list[int]]:
    """The prompts as lists of ints, each checked (non-empty, fits max_len, ids in the vocabulary)."""
    if isinstance(prompts, np.ndarray) and prompts.ndim != 2:
        raise ValueError(f"prompts must be a list of token-id lists (or a 2-D array), got a {prompts.ndim}-D array")
    if not isinstance(prompts, _SEQUENCES) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    rows = []
    for i, p in enumerate(prompts):
        row = _token_ids(f"prompt {i}", p)
        if not row:
            raise ValueError(f"prompt {i} is empty")
        if len(row) >= max_len:  # the prompt and at least one new token must fit
            raise ValueError(f"prompt {i} has {len(row)} tokens: it must be shorter than max_len={max_len}")
        if min(row) < 0 or max(row) >= vocab_size:
            bad = next(t for t in row if not 0 <= t < vocab_size)
            raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
        rows.append(row)
    return rows


def _max_new(max_new_tokens, B: int) -> list[int]:
    """max_new_tokens for every row, or one per prompt; each a positive int."""
    budgets = []
    for m, where in _per_row("max_new_tokens", max_new_tokens, B):
        if not is_int(m) or m < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {m!r}{where}")
        budgets.append(int(m))
    return budgets


def _stop_lists(stop_token_ids, B: int, vocab_size: int) -> list[list[int]]:
    """The rows' stop ids: one list for every row, or a list of lists, one per prompt."""
    if not isinstance(stop_token_ids, _SEQUENCES):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r} "
                         "(or give one list per prompt)")
    if len(stop_token_ids) == 0 or not all(isinstance(s, _SEQUENCES) for s in stop_token_ids):
        return [_stop_ids(stop_token_ids, vocab_size, "")] * B
    if len(stop_token_ids) != B:
        raise ValueError(f"stop_token_ids has {len(stop_token_ids)} lists for {B} prompts")
    return [_stop_ids(s, vocab_size, f" (prompt {i})") for i, s in enumerate(stop_token_ids)]


def _stop_ids(stop_token_ids, vocab_size: int, where: str) -> list[int]:
    bad = [t for t in list(stop_token_ids) if not is_int(t) or not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"stop token id {bad[0]!r} is not an int in the vocabulary [0, {vocab_size}){where}")
    return [int(t) for t in stop_token_ids]


def _per_row(name: str, value, B: int) -> list[tuple[object, str]]:
    """A scalar for every row, or a list of one value per row: (value, where) per row, where names the
    prompt when the values were given per prompt."""
    if isinstance(value, _SEQUENCES):
        if len(value) != B:
            raise ValueError(f"{name} has {len(value)} values for {B} prompts")
        return [(v, f" (prompt {i})") for i, v in enumerate(value)]
    return [(value, "")] * B


def _sampling_settings(B: int, temperature, top_k, top_p, seed) -> SamplingParams | None:
    """The rows' sampling settings as host arrays, checked; None when every row is greedy."""
    temps, ks, ps, seeds = (_per_row(n, v, B) for n, v in
                            (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)))
    for t, where in temps:
        if not _is_real(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                             f"got {t!r}{where}")
    for k, where in ks:
        if not is_int(k) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: no top-k filter), got {k!r}{where}")
    for p, where in ps:
        if not _is_real(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: no top-p filter), got {p!r}{where}")
    for s, where in seeds:
        if s is not None and (not is_int(s) or not 0 <= s < 2**64):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {s!r}{where}")
    if all(t == 0 for t, _ in temps):
        return None
    seeds = [secrets.randbits(64) if s is None else int(s) for s, _ in seeds]
    key_data = np.array([[s >> 32, s & 0xFFFFFFFF] for s in seeds], np.uint32)
    # top_k beyond int32 keeps every token, as any value >= the vocabulary size does.
    return SamplingParams(temperature=np.array([t for t, _ in temps], np.float32),
                          top_k=np.array([min(int(k), 2**31 - 1) for k, _ in ks], np.int32),
                          top_p=np.array([p for p, _ in ps], np.float32), seed=key_data)


def _penalty_settings(B: int, vocab_size: int, frequency, presence, repetition, logit_bias) -> Penalties | None:
    """The rows' penalties and logit_bias as host arrays, checked; None when no row has any."""
    settings = Penalties.neutral(B)
    limit = penalties_lib.PENALTY_LIMIT
    for name, values, column in (("frequency_penalty", frequency, settings.frequency),
                                 ("presence_penalty", presence, settings.presence)):
        for i, (v, where) in enumerate(_per_row(name, values, B)):
            if not _is_real(v) or not -limit <= v <= limit:
                raise ValueError(f"{name} must be a number in [-{limit:g}, {limit:g}], got {v!r}{where}")
            column[i] = v
    for i, (v, where) in enumerate(_per_row("repetition_penalty", repetition, B)):
        if not _is_real(v) or v <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: none), got {v!r}{where}")
        settings.repetition[i] = v
    biases = [(logit_bias, "")] * B if logit_bias is None or isinstance(logit_bias, dict) else \
        _per_row("logit_bias", logit_bias, B)
    for i, (bias, where) in enumerate(biases):
        if bias is None:
            continue
        if not isinstance(bias, dict) or len(bias) > penalties_lib.BIAS_WIDTH:
            raise ValueError(f"logit_bias must be None or a dict of at most {penalties_lib.BIAS_WIDTH} token id -> "
                             f"bias entries, got {bias!r}{where}")
        for j, (token, b) in enumerate(bias.items()):
            if not is_int(token) or not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias has token id {token!r}, not an int in the vocabulary [0, "
                                 f"{vocab_size}){where}")
            if not _is_real(b) or not -penalties_lib.BIAS_LIMIT <= b <= penalties_lib.BIAS_LIMIT:
                raise ValueError(f"logit_bias's bias for token {token} must be a number in [-100, 100], got "
                                 f"{b!r}{where}")
            settings.bias_ids[i, j], settings.bias[i, j] = token, b
    return settings if np.any(settings.active()) else None


def _logprob_counts(name: str, values, B: int) -> np.ndarray | None:
    """[B] int32: each row's logprobs alternatives (None: -1, none), checked; None when no row asks."""
    counts = []
    for v, where in _per_row(name, values, B):
        if v is not None and (not is_int(v) or not 0 <= v <= logprobs_lib.TOP):
            raise ValueError(f"{name} must be None or an int in [0, {logprobs_lib.TOP}] (the most likely tokens "
                             f"reported beside each token's own), got {v!r}{where}")
        counts.append(-1 if v is None else int(v))
    return np.array(counts, np.int32) if max(counts) >= 0 else None
