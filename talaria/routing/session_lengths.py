"""How long agent sessions last: the calls a session makes and the time a turn takes, learned from
the sessions the router has seen end. What the admission line predicts an admitted session's
remaining work from (talaria/routing/admission_line.py), since a client never says how many turns
it has left.

- Lengths: the call counts of the last KEEP sessions that went quiet (talaria/routing/session_load.py).
  A session that has made `done` calls is expected to make `E[L - done | L >= done]` more over those
  (0 when every session seen ended there). Before any session has ended, the same over the paper's
  agent sessions (§2.1: 445 SWE-Bench sessions, depth median 11 calls, p95 49), as a lognormal
  through those two figures, as the trace generator draws them (talaria/trace/generate.py): agent
  sessions are deep, and a first burst promised from "one more call each" comes back to a full node
  (in a 200-session burst, first promises of 8-17 s for a line that took 60 s to drain). Past the
  longest seen, Lindy's rule: a session is expected to last as long again as it has (`done` more
  calls), the estimate that assumes least about the distribution.
- Second calls: the share of sessions that made one (`second_call`). A one-call client (a script, a
  health check, an SDK without a session id) looks like an agent's first call; what tells them
  apart is whether the model's sessions have been coming back.
- Turns: a session's call-to-call time (its call's run and its tool gap), smoothed with the
  cost model's EWMA gain.

Only ints and floats; the caller's clock.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from statistics import NormalDist

KEEP = 512  # sessions whose lengths are kept: recent enough to follow a changing workload
ALPHA = 0.2  # weight of the newest turn (the instances' cost EWMA's gain, session_load.GROWTH_ALPHA)
PAPER_DEPTH = (11, 49)  # §2.1: calls per agent session, median and p95: the prior before any session ends
_N = NormalDist()
_MU = math.log(PAPER_DEPTH[0])  # the lognormal's log-space parameters
_SIGMA = math.log(PAPER_DEPTH[1] / PAPER_DEPTH[0]) / _N.inv_cdf(0.95)


def prior_remaining_calls(done: int) -> float:
    """E[L - done | L >= done] for L lognormal through PAPER_DEPTH: with mu, sigma its log-space
    parameters, E[L; L >= k] = exp(mu + sigma^2 / 2) Phi((mu + sigma^2 - ln k) / sigma) and
    P(L >= k) = Phi((mu - ln k) / sigma)."""
    k = math.log(max(1, done))
    tail = _N.cdf((_MU - k) / _SIGMA)
    if tail < 1e-12:  # far past the distribution: as long again (Lindy)
        return float(done)
    return math.exp(_MU + _SIGMA * _SIGMA / 2) * _N.cdf((_MU + _SIGMA * _SIGMA - k) / _SIGMA) / tail - done


def prior_second_call() -> float:
    """P(L >= 2) for L lognormal through PAPER_DEPTH (continuous, as `prior_remaining_calls`)."""
    return _N.cdf((_MU - math.log(2)) / _SIGMA)


class SessionLengths:
    def __init__(self, keep: int = KEEP) -> None:
        self._ended: deque[int] = deque(maxlen=keep)
        self._counts: Counter[int] = Counter()  # the same lengths, counted: remaining_calls reads this
        self.turn_s: float | None = None  # EWMA of a session's call-to-call time; None before a second call

    def ended(self, calls: int) -> None:
        """A session went quiet after `calls` calls."""
        if len(self._ended) == self._ended.maxlen:
            old = self._ended[0]
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]
        self._ended.append(calls)
        self._counts[calls] += 1

    def turn(self, seconds: float) -> None:
        """A session's next call arrived `seconds` after its previous one."""
        self.turn_s = seconds if self.turn_s is None else (1 - ALPHA) * self.turn_s + ALPHA * seconds

    def remaining_calls(self, done: int) -> float:
        """Calls a session that has made `done` is expected to make after them."""
        if not self._counts:
            return prior_remaining_calls(done)
        n = more = 0
        for length, count in self._counts.items():  # at most as many distinct lengths as sessions kept
            if length >= done:
                n += count
                more += (length - done) * count
        return more / n if n else float(done)

    def second_call(self) -> float:
        """The chance that a session makes a second call: the share of those seen that did (the
        prior's before any ended)."""
        if not self._counts:
            return prior_second_call()
        return 1.0 - self._counts.get(1, 0) / len(self._ended)

    def telemetry(self) -> dict:
        ended = sorted(self._ended)
        return {"sessions_seen": len(ended), "mean_calls": sum(ended) / len(ended) if ended else None,
                "p95_calls": ended[int(0.95 * (len(ended) - 1))] if ended else None,
                "turn_s": None if self.turn_s is None else round(self.turn_s, 3)}

    def __len__(self) -> int:
        return len(self._ended)
