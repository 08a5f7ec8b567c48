"""Adaptive draft length: each round, the k that maximizes expected tokens per second.

Expected tokens from one round with per-token acceptance α and k drafts are (1 − α^(k+1)) / (1 − α)
(Leviathan et al. 2023); a round costs a Verify over k + 1 positions plus a Propose of k tokens.
Both costs are measured live by the gateway (they depend on the hardware, the batch and the network,
so no constant is baked in), and α is estimated per request from its own rounds. k = 0 (a plain
target step) is always a candidate, so a request whose drafts keep failing stops paying for them.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence, Union


def expected_tokens(chain: Sequence[float], k: int) -> float:
    """Expected tokens from a round of k drafts when draft i is accepted with probability chain[i-1]
    given that drafts 1..i-1 were (positions past the chain's end repeat its last value):
    1 + Σ_j Π_{i≤j} chain[i-1]. With one value α this is (1 − α^(k+1)) / (1 − α)."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= chain[min(i, len(chain) - 1)] if chain else 0.0
        total += reach
    return total


def best_draft_length(acceptance: Union[float, Sequence[float]], max_k: int, round_cost_s: Callable[[int], float]) -> int:
    """argmax over k in [0, max_k] of expected tokens / round cost (ties: the smaller k).

    acceptance: one per-token rate α, or the conditional rate per draft position (the measured
    ones fall with the position — 0.57, 0.34, 0.27 for the shipped head — so one α over-promises
    long drafts)."""
    return best_rate(acceptance, max_k, round_cost_s)[0]


def best_rate(acceptance: Union[float, Sequence[float]], max_k: int, round_cost_s: Callable[[int], float]) -> tuple[int, float]:
    """best_draft_length's k and the expected tokens per second it gives (to compare drafters)."""
    chain = [acceptance] if isinstance(acceptance, (int, float)) else list(acceptance)
    best_k, best = 0, -1.0
    for k in range(max_k + 1):
        rate = expected_tokens(chain, k) / max(round_cost_s(k), 1e-9)
        if rate > best * (1 + 1e-9):
            best_k, best = k, rate
    return best_k, best


class StepCosts:
    """Moving averages of measured Verify seconds by positions and Propose seconds by k; shared by requests.

    An unmeasured Verify size costs as much as the largest measured smaller one (optimistic, so it
    gets tried and measured); an unmeasured Propose scales linearly from the nearest measured one.
    """

    def __init__(self, smoothing: float = 0.1):
        self.smoothing = smoothing
        self._verify: dict[int, float] = {}
        self._draft: dict[int, float] = {}
        self._lock = threading.Lock()

    def observe_verify(self, positions: int, seconds: float) -> None:
        self._observe(self._verify, positions, seconds)

    def observe_draft(self, k: int, seconds: float) -> None:
        self._observe(self._draft, k, seconds)

    def _observe(self, table: dict[int, float], key: int, seconds: float) -> None:
        with self._lock:
            old = table.get(key)
            table[key] = seconds if old is None else old + self.smoothing * (seconds - old)

    def verify_s(self, positions: int) -> Optional[float]:
        with self._lock:
            if not self._verify:
                return None
            smaller = [n for n in self._verify if n <= positions]
            return self._verify[max(smaller) if smaller else min(self._verify)]

    def draft_s(self, k: int) -> float:
        if k == 0:
            return 0.0
        with self._lock:
            if not self._draft:
                return 0.0
            nearest = min(self._draft, key=lambda j: abs(j - k))
            return self._draft[nearest] * k / nearest

    def round_cost_s(self, k: int, branches: int = 1, drafting: bool = True) -> float:
        """Seconds a round with k drafts is expected to take (1.0 while nothing is measured); a tree of
        `branches` candidates per position verifies k × branches + 1 positions. drafting=False: the
        drafts cost nothing to make (the gateway's prompt-lookup copies)."""
        verify = self.verify_s(k * branches + 1)
        return (1.0 if verify is None else verify) + (self.draft_s(k) if drafting else 0.0)


class AcceptanceEstimate:
    """Acceptance of one request's drafts, per draft position: accepted / examined, exponentially
    forgotten, shrunk toward a prior.

    Draft i is examined when drafts 1..i-1 were accepted; drafts after the first rejection say
    nothing, so counting them (accepted / drafted) would underestimate. Position i's prior is the
    estimate of position i-1 (position 1's is `prior`), so a position never reached yet borrows
    from the one before it. Rounds without drafts forget too, so a request that stopped drafting
    drifts back to the prior and tries again: the draft may have become useful (code, repeated
    text) where it was not before.
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9):
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self._accepted: list[float] = []  # per position (0 = the first draft)
        self._examined: list[float] = []

    def chain(self, length: int) -> list[float]:
        """Conditional acceptance of draft positions 1..length."""
        rates, previous = [], self.prior
        for i in range(length):
            accepted = self._accepted[i] if i < len(self._accepted) else 0.0
            examined = self._examined[i] if i < len(self._examined) else 0.0
            previous = min((accepted + previous * self.prior_weight) / (examined + self.prior_weight), 0.999)
            rates.append(previous)
        return rates

    @property
    def value(self) -> float:
        """Per-token acceptance over all positions (accepted / examined, with the prior)."""
        estimate = (sum(self._accepted) + self.prior * self.prior_weight) / (sum(self._examined) + self.prior_weight)
        return min(estimate, 0.999)

    def update(self, drafted: int, accepted: int) -> None:
        examined = min(drafted, accepted + 1)
        while len(self._examined) < examined:
            self._examined.append(0.0)
            self._accepted.append(0.0)
        for i in range(len(self._examined)):
            self._examined[i] = self.decay * self._examined[i] + (1 if i < examined else 0)
            self._accepted[i] = self.decay * self._accepted[i] + (1 if i < accepted else 0)
