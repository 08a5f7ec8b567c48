"""Every threshold of the gateway's speculation policy, in one place, each with its principle.

The policy itself measures what depends on the machine (verify and draft costs, acceptance per
request, batch yields); what is left here are the priors it starts from and how fast it forgets.
Why each value is what it is, and the measurement behind it: docs/design/policy.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculationPolicy:
    """The speculation policy's constants (gateway/adaptive.py, gateway/proposers.py, gateway/planner.py)."""

    # --- a request's own estimates (AcceptanceEstimate, HeadCalibration) ---
    acceptance_prior: float = 0.5  # a drafter nobody has measured yet is as likely right as wrong
    prior_weight: float = 2.0  # the prior counts as two rounds: a few rounds of evidence outweigh it
    decay: float = 0.9  # each round forgets 10%: a request's text changes kind within ~10 rounds
    max_acceptance: float = 0.999  # no estimate is ever certain: a sure draft would make k unbounded
    rescue_prior: float = 0.3  # a tree's alternatives hold the target's token where the best misses ~30% of the time
    shared_decay: float = 0.99  # the server-wide estimate a new request starts from follows the last ~100 rounds of its kind
    probe_every_rounds: int = 8  # a drafter declined this many rounds in a row drafts once, to re-measure itself
    heads_past_best_chain: int = 1  # proposals of one head more than the best chain drafts: the estimate learns deeper positions only from drafts

    # --- never slower as served (gateway/guard.py) ---
    guard_trial_rounds: int = 8  # a verdict on 8 rounds of 1-4 tokens each: fewer say too little, more lose longer
    guard_rest_rounds: int = 8  # a losing trial rests as long as a trial took, so a probe costs at most what it found
    guard_max_rest_rounds: int = 64  # rests double while trials keep losing, but text that changes kind is found again
    guard_own_plain_rounds: int = 3  # a request's own plain rounds price plain once it ran this many (its context's length)

    # --- shared measured costs (StepCosts) ---
    cost_smoothing: float = 0.1  # moving averages of step times follow a change within ~10 passes
    stale_after_verifies: int = 100  # a Verify size unmeasured this long is priced from fresh sizes, not its old average
    min_draft_s: float = 1e-4  # a round with a draft step faster than this measured no draft at all

    # --- the draft service as a proposer (faults only cost speed) ---
    draft_backoff_s: float = 1.0  # first pause after a draft fails; doubles on each failure in a row
    draft_max_backoff_s: float = 30.0  # ... up to this: a draft that comes back is used again within half a minute
    draft_probe_s: float = 0.2  # a health check of a draft that failed before must not stall a stream longer

    # --- the speculation cap (many requests share a verify pass) ---
    speculation_margin: float = 1.1  # speculating in a batch must promise 10% over its modelled cost (the model's error)
    measured_margin: float = 1.05  # measured rates must differ by 5% to switch (their noise at ~50 rounds is ±7%)
    yield_smoothing: float = 0.02  # batch yields average over ~50 rounds so the cap does not flicker with one round
    min_shape_rounds: int = 50  # fewer rounds of a kind than this say too little to decide on
    cap_hold_rounds: int = 500  # a changed cap stands this long so the estimates that moved it settle first
    stale_rounds: int = 10_000  # a kind of round unseen this long is forgotten, so an old verdict is retried

    @property
    def cap_hysteresis(self) -> float:
        """The bar a size already allowed keeps: half the model's margin (otherwise an estimate at the
        threshold flips the cap every round)."""
        return 1 + (self.speculation_margin - 1) / 2


POLICY = SpeculationPolicy()
