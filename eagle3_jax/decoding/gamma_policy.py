"""The choice of gamma (draft tokens per round, 0 included) for each call of rounds, from the acceptance
observed so far in the request and what a call of each gamma costs (round_costs.py). Pure functions over
small numpy arrays.

The model: draft position i is accepted with probability alpha_i given that positions 1 .. i-1 were (the
conditional acceptance rate), the same for every row of the request. A round of gamma g then emits
E(g) = 1 + sum_{i <= g} prod_{j <= i} alpha_j tokens per live row on average, and the policy takes the gamma
of the most expected tokens per second, E(g) / cost(g), at the pool's batch size and KV length.

Estimates are decayed counts, so that they follow a drafter that is good on part of the text and poor on
the rest: every round of evidence multiplies the counts by DECAY before adding its own (a memory of about
1 / (1 - DECAY) rounds of every row; a flush's evidence counts as the rounds it covers, and rounds that hold
their pairs back show nothing and fade nothing). Position 1's estimate starts from PRIOR_MEAN; position i > 1's
starts from position i - 1's estimate, so a position no round has reached yet is taken to accept as the
one before it does: the policy tries one more draft where the last one it ran is accepted often enough
to pay for it, and no position needs a round of its own to be explored. The prior weighs PRIOR_WEIGHT
rounds; it is light, so that a drafter that is never right reads as alpha about 0 within a few calls: at
batch 1 the steady estimate of such a drafter is PRIOR_WEIGHT * PRIOR_MEAN / (PRIOR_WEIGHT + 1 / (1 - DECAY))
= 0.012, well under the 4-5% by which a round of gamma 1 costs more than a plain one on an 8B target at
batch 1 (a wrong 0.05 would keep gamma 1 running for nothing).

Rounds of gamma 0 still observe position 1: every FLUSH_CALLS-th gamma-0 call brings the drafter up to date
over the pairs the calls before it held back (spec_round.spec_rounds), and reports how many of their tokens
equal its would-be first draft (round_output's shadow columns). Without that observation gamma 0 would be
absorbing: nothing could show the drafter improving. Holding the pairs back makes the drafter read its
weights once per FLUSH_CALLS calls rather than once per call (docs/how-it-works.md has the arithmetic); a
call that drafts first needs the drafter up to date, so leaving gamma 0 with pairs held takes one flushing
gamma-0 call first.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PRIOR_MEAN = 0.5  # a drafter of unknown quality: speculation is tried first, and dropped if it does not pay
PRIOR_WEIGHT = 0.25  # rounds' worth of evidence the prior holds
DECAY = 0.9  # per round: a memory of about 10 rounds of every row
FLUSH_CALLS = 4  # gamma-0 calls per catch-up of the drafter: StepSpec.held = FLUSH_CALLS x rounds per call


@dataclasses.dataclass(frozen=True)
class Call:
    """What one call of rounds runs: its gamma and, at gamma 0 with a drafter, whether it flushes the held
    pairs into the drafter (StepSpec.flush)."""

    gamma: int
    flush: bool = True


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Decayed counts per draft position 1 .. G: `reached[i-1]` rows' rounds drafted position i and knew its
    fate, `accepted[i-1]` of them accepted it."""

    accepted: np.ndarray  # [G] float64
    reached: np.ndarray  # [G] float64

    @classmethod
    def fresh(cls, max_gamma: int) -> Acceptance:
        return cls(np.zeros(max_gamma), np.zeros(max_gamma))


def round_counts(gamma: int, max_gamma: int, accepted, emitted, done, shadow) -> tuple[np.ndarray, np.ndarray]:
    """One round's evidence over its rows (arrays [B]; rows that emitted nothing tell nothing): (accepted
    [G], reached [G]). A row of a gamma g round that committed a drafts accepted positions 1 .. a, and
    rejected position a + 1 when a < g and the round ran to its end (it emitted a + 1 tokens and the row
    goes on); a round cut by a stop token, max_new_tokens or max_len is censored after its committed
    drafts, since the cut, not the drafter, ended it. A gamma 0 round reports position 1 through `shadow`
    [B, 2]: (would-be first drafts that matched, pairs), summed over rows."""
    accepted, emitted, done, shadow = (np.asarray(x) for x in (accepted, emitted, done, shadow))
    positions = np.arange(1, max_gamma + 1)[None, :]
    live = emitted[:, None] > 0
    if gamma == 0:
        hits, tries = np.zeros(max_gamma), np.zeros(max_gamma)
        hits[0], tries[0] = shadow.sum(axis=0)
        return hits, tries
    a = accepted[:, None]
    rejected_at = np.where((a < gamma) & (emitted[:, None] == a + 1) & ~done[:, None], a + 1, 0)
    hits = live & (positions <= a)
    tries = hits | (live & (positions == rejected_at))
    return hits.sum(0).astype(float), tries.sum(0).astype(float)


def observe(stats: Acceptance, gamma: int, accepted, emitted, done, shadow) -> Acceptance:
    """`stats` after one more round (`round_counts`'s arguments), the older evidence decayed once per round the
    new evidence spans: a round that drafted, 1; a gamma-0 round, the most held rounds a row caught up on
    (0 for a round that holds its pair: no evidence, so nothing older fades)."""
    hits, tries = round_counts(gamma, len(stats.accepted), accepted, emitted, done, shadow)
    decay = DECAY ** (1 if gamma else int(np.max(np.asarray(shadow)[:, 1], initial=0)))
    return Acceptance(decay * stats.accepted + hits, decay * stats.reached + tries)


def rates(stats: Acceptance) -> np.ndarray:
    """The conditional acceptance rate of each draft position [G], each estimate's prior the one before."""
    out, prior = np.empty(len(stats.accepted)), PRIOR_MEAN
    for i, (hits, tries) in enumerate(zip(stats.accepted, stats.reached)):
        out[i] = prior = (PRIOR_WEIGHT * prior + hits) / (PRIOR_WEIGHT + tries)
    return out


def expected_tokens(alpha: np.ndarray) -> np.ndarray:
    """Tokens a round of each gamma 0 .. G emits per row on average [G + 1]: 1 + sum_{i <= g} prod_{j <= i}."""
    return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(alpha))])


def choose(alpha: np.ndarray, seconds) -> int:
    """The gamma of the most expected tokens per second, `seconds[g]` what a call of gamma g costs (a tie
    goes to the smaller gamma)."""
    seconds = np.asarray(seconds, float)
    if seconds.shape != (len(alpha) + 1,) or not np.all(seconds > 0):
        raise ValueError(f"seconds must be {len(alpha) + 1} positive costs, one per gamma, got {seconds!r}")
    return int(np.argmax(expected_tokens(alpha) / seconds))


class Fixed:
    """The policy of an engine built for one gamma: every call runs it."""

    def __init__(self, gamma: int):
        self.gamma = gamma

    def choose(self, length: float, rows: int, mixed: bool) -> Call:
        return Call(self.gamma)

    def dispatched(self, call: Call) -> None:
        """A fixed gamma keeps no count of its calls."""

    def observe(self, gamma: int, out) -> None:
        """A fixed gamma learns nothing from what it sees."""

    def may_choose_ahead(self) -> bool:
        return True


class Auto:
    """The policy of one request under num_draft_tokens="auto": the acceptance its rounds showed so far
    (`observe`), and `seconds(length, rows, mixed)`, a call's cost per gamma 0 .. G at the rows it computes (its
    bucket) and with or without prompt tokens in its rounds. holds: whether gamma-0 calls hold their pairs back
    from the proposer (one that reads target features); a proposer that does not is up to date after every call,
    and its gamma-0 rounds report their evidence themselves. A call that carries prompt tokens never holds: its
    chunks read the drafter's weights anyway, so it flushes."""

    def __init__(self, max_gamma: int, seconds, holds: bool = True):
        self.stats, self._seconds, self._holds = Acceptance.fresh(max_gamma), seconds, holds
        self.holding = 0  # gamma-0 calls dispatched since the drafter was last brought up to date
        self.rounds_seen = 0

    def choose(self, length: float, rows: int, mixed: bool) -> Call:
        """The next call at this mean KV length, of `rows` rows, carrying prompt tokens or not (nothing changes
        until it is `dispatched`)."""
        gamma = choose(rates(self.stats), self._seconds(length, rows, mixed))
        if not self._holds:
            return Call(gamma)
        if gamma == 0:
            return Call(0, flush=mixed or self.holding + 1 == FLUSH_CALLS)
        return Call(0) if self.holding else Call(gamma)  # the drafter must catch up before it drafts

    def dispatched(self, call: Call) -> None:
        self.holding = 0 if call.flush else self.holding + 1

    def observe(self, gamma: int, out) -> None:
        """One round's output (round_output.RoundOutput)."""
        self.stats = observe(self.stats, gamma, out.accepted, out.emitted, out.done, out.shadow)
        self.rounds_seen += 1

    def may_choose_ahead(self) -> bool:
        """Not before the first call's rounds are read: the second call would be the prior's choice again (with
        a drafter that is never right, a call more of speculation for nothing)."""
        return self.rounds_seen > 0
