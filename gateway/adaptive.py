"""Adaptive draft length: each round, the k that maximizes expected tokens per second.

Expected tokens from one round with per-token acceptance α and k drafts are (1 − α^(k+1)) / (1 − α)
(Leviathan et al. 2023); a round costs a Verify over k + 1 positions plus a Propose of k tokens.
Both costs are measured live by the gateway (they depend on the hardware, the batch and the network,
so no constant is baked in), and α is estimated per request from its own rounds. k = 0 (a plain
target step) is always a candidate, so a request whose drafts keep failing stops paying for them.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from gateway.rejection import expected_tokens_per_pass


def best_draft_length(acceptance: float, max_k: int, round_cost_s: Callable[[int], float]) -> int:
    """argmax over k in [0, max_k] of expected tokens / round cost (ties: the smaller k)."""
    best_k, best_rate = 0, -1.0
    for k in range(max_k + 1):
        rate = expected_tokens_per_pass(acceptance, k) / max(round_cost_s(k), 1e-9)
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


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

    def round_cost_s(self, k: int) -> float:
        """Seconds a round with k drafts is expected to take (1.0 while nothing is measured)."""
        verify = self.verify_s(k + 1)
        return (1.0 if verify is None else verify) + self.draft_s(k)


class AcceptanceEstimate:
    """Per-token acceptance α of one request: accepted / examined drafts, exponentially forgotten,
    shrunk toward a prior.

    A draft is examined when every draft before it was accepted; drafts after the first rejection
    say nothing about α, so counting them (accepted / drafted) would underestimate it. Rounds
    without drafts forget too, so a request that stopped drafting drifts back to the prior and
    tries again: the draft may have become useful (code, repeated text) where it was not before.
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9):
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self._accepted = 0.0
        self._examined = 0.0

    @property
    def value(self) -> float:
        estimate = (self._accepted + self.prior * self.prior_weight) / (self._examined + self.prior_weight)
        return min(estimate, 0.999)

    def update(self, drafted: int, accepted: int) -> None:
        examined = accepted + (1 if accepted < drafted else 0)
        self._accepted = self.decay * self._accepted + accepted
        self._examined = self.decay * self._examined + examined
