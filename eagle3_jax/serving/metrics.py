"""The server's Prometheus metrics, written in the text exposition format (no client library needed).

Counters and histograms are updated on the server's event loop thread; the gauges and the speculation totals
are read from the live pool when scraped.
"""

from __future__ import annotations

import bisect

# Seconds: time to first token spans a prefill behind a queue; inter-token latency a call of rounds.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0,
               2.5)
PREFIX = "eagle3_jax_"


class Histogram:
    """Cumulative bucket counts, sum and count of observed values."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = PREFIX + name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket (+Inf only)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip(self.buckets, self.counts):
            total += n
            out.append(f'{self.name}_bucket{{le="{bound}"}} {total}')
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum}",
                f"{self.name}_count {self.count}"]
        return out


def _metric(kind: str, name: str, help_text: str, value) -> list[str]:
    return [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}", f"{PREFIX}{name} {value}"]


class Metrics:
    """What /metrics reports for one server."""

    def __init__(self, pool, compilations=None):
        self.pool = pool
        self.compilations = compilations  # warm_start.Compilations since the server started, or None
        self.ttft = Histogram("time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
                              TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds",
                             "Seconds between a request's consecutive chunks of tokens (a call of rounds delivers "
                             "several tokens at once).", ITL_BUCKETS)
        self.generation_tokens = self.prompt_tokens = 0
        self.finished: dict[str, int] = {}

    def request_finished(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self) -> str:
        lines = (_metric("gauge", "requests_running", "Requests holding a slot of the pool.", self.pool.running)
                 + _metric("gauge", "requests_waiting", "Requests waiting for a slot.", self.pool.waiting)
                 + _metric("counter", "spec_draft_tokens_total",
                           "Draft positions of the rounds that emitted tokens (gamma each; a draft tree's nodes).",
                           self.pool.draft_tokens)
                 + _metric("counter", "spec_accepted_tokens_total", "Draft tokens accepted by the target.",
                           self.pool.accepted_tokens)
                 + _metric("counter", "generation_tokens_total", "Tokens generated.", self.generation_tokens)
                 + _metric("counter", "prompt_tokens_total", "Prompt tokens admitted.", self.prompt_tokens))
        if self.compilations is not None:
            lines += _metric("counter", "backend_compilations_total",
                             "XLA compilations since the server started (a program loaded from the persistent "
                             "compilation cache is none).", self.compilations.count)
        name = PREFIX + "requests_finished_total"
        lines += [f"# HELP {name} Requests finished, by finish reason.", f"# TYPE {name} counter"]
        lines += [f'{name}{{finish_reason="{k}"}} {v}' for k, v in sorted(self.finished.items())]
        lines += self.ttft.lines() + self.itl.lines()
        return "\n".join(lines) + "\n"
