"""Never slower, as served: a request speculates only while its rounds emit tokens faster than plain ones.

The planner prices each round from estimates: acceptance per position, the heads' calibrated
confidence, step costs by size. Each estimate can be right on average and the request still lose:
a pass that asks for the heads' proposals costs ~15% more on a 2-core CPU whether the next round
drafts or not, a size never served is priced from start-up costs, not as served, and on text unlike
the drafts' training the drafts that are taken keep little. So the guard judges the policy by what it did, not by what
it expected: over a trial of policy.guard_trial_rounds rounds run alone, the tokens emitted per
second of round (everything a round costs: planning, the Verify, judging, emitting) against what a
plain round costs as served (this request's own plain rounds, else this server's of its kind,
else the planner's price of one). The trial's tokens are the planner's expected tokens of its
rounds times what the request's rounds have kept of what was expected so far: a round keeps 1 to
4 tokens, so 8 rounds' realized tokens are ±20% noise, and most answers that paid 1.1-1.5x rested
once when judged by them; expectations vary little round to round, and the request's whole history
corrects their bias. A trial that loses rests the request for a number of plain
rounds, then it tries again (a probe: the text may have changed kind); each loss in a row doubles
the rest, up to policy.guard_max_rest_rounds, and a trial that pays resets it. Rounds run beside
other requests are the speculation cap's to judge (gateway/adaptive.speculation_cap), and a
grammar's forced rounds are free drafts, so neither enters a trial. A request under the fixed
policy is never judged: its client chose its drafts, and a seeded sampled one repeats itself only
if its rounds do not depend on timings. docs/design/policy.md.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from gateway.policy import POLICY, SpeculationPolicy


class PlainRounds:
    """Seconds of a plain round (no drafts, no proposals asked, run alone), as a moving average: one
    shared by this server's requests of a kind (greedy or sampled), one of each request's own."""

    def __init__(self, policy: SpeculationPolicy = POLICY):
        self.smoothing = policy.cost_smoothing
        self.rounds = 0
        self._seconds = 0.0
        self._lock = threading.Lock()  # a shared one is taught by every request's thread

    def observe(self, seconds: float) -> None:
        with self._lock:
            self.rounds += 1
            self._seconds += max(self.smoothing, 1 / self.rounds) * (seconds - self._seconds)

    def seconds(self) -> Optional[float]:
        """The average (None before any round)."""
        with self._lock:
            return self._seconds if self.rounds else None


class SpeculationGuard:
    """One request's verdict on its own speculation, trial by trial (module docstring). Generation asks
    `allows` when it plans a round and tells `observe` what the round did."""

    def __init__(self, shared: PlainRounds, plain_price_s: Callable[[], Optional[float]] = lambda: None,
                 policy: SpeculationPolicy = POLICY, judges: bool = True):
        self.shared = shared
        self.own = PlainRounds(policy)
        self.policy = policy
        self.judges = judges  # False (target-only, or drafts the client fixed): it only measures plain rounds
        self.plain_price_s = plain_price_s  # the planner's price of a plain Verify: the reference while no plain round ran
        self.rested = 0  # rounds this request rested (SpeculationStats)
        self._start_trial()
        self._kept, self._expected = 0.0, 0.0  # over every trial round of the request: realized and expected tokens
        self._rest_left = 0
        self._next_rest = policy.guard_rest_rounds

    def allows(self) -> bool:
        """Whether this round may speculate (draft or ask for proposals)."""
        return self._rest_left == 0

    def plain_s(self) -> Optional[float]:
        """What a plain round of this request costs as served: its own once it ran a few, else its kind's."""
        if self.own.rounds >= self.policy.guard_own_plain_rounds:
            return self.own.seconds()
        shared = self.shared.seconds()
        return shared if shared is not None else self.plain_price_s()

    def observe(self, tokens: int, seconds: float, plain: bool, alone: bool, forced: bool = False,
                expected: Optional[float] = None) -> None:
        """One round: `tokens` emitted in `seconds`, `expected` by the planner (None: as many as it
        emitted); plain: it drafted nothing and asked for no proposals; alone: no other request shared
        its passes; forced: its drafts were a grammar's forced tokens."""
        if plain and alone:
            self.own.observe(seconds)
            self.shared.observe(seconds)
        if not self.judges:
            return
        if self._rest_left:
            self._rest_left -= 1
            self.rested += 1
            return
        if not alone or forced:
            self._start_trial()  # a trial's rounds are alike
            return
        expected = float(tokens) if expected is None else expected
        self._kept += tokens
        self._expected += expected
        self._trial_tokens += expected
        self._trial_seconds += seconds
        self._trial_rounds += 1
        if self._trial_rounds < self.policy.guard_trial_rounds:
            return
        plain_s = self.plain_s()
        if plain_s is not None:
            kept = self._trial_tokens * self._kept / max(self._expected, 1e-9)
            self._judge(kept / max(self._trial_seconds, 1e-9), 1.0 / max(plain_s, 1e-9))
        self._start_trial()

    def _start_trial(self) -> None:
        """A trial from nothing: tokens (the planner's expected), seconds and rounds."""
        self._trial_tokens, self._trial_seconds, self._trial_rounds = 0.0, 0.0, 0

    def _judge(self, speculating_rate: float, plain_rate: float) -> None:
        """A finished trial: rest when it emitted fewer tokens a second than plain rounds would have."""
        if speculating_rate >= plain_rate:
            self._next_rest = self.policy.guard_rest_rounds
            return
        self._rest_left = self._next_rest
        self._next_rest = min(2 * self._next_rest, self.policy.guard_max_rest_rounds)
