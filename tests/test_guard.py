"""The never-slower guard (gateway/guard.py): trials of speculating rounds judged against plain rounds as served."""

import pytest

from gateway.guard import PlainRounds, SpeculationGuard
from gateway.policy import SpeculationPolicy

POLICY = SpeculationPolicy(guard_trial_rounds=4, guard_rest_rounds=3, guard_max_rest_rounds=10, guard_own_plain_rounds=2)
PLAIN_S = 0.050  # a plain round: 20 tokens/s


def guard_with_plain_rounds() -> SpeculationGuard:
    shared = PlainRounds(POLICY)
    shared.observe(PLAIN_S)
    return SpeculationGuard(shared, policy=POLICY)


def trial(guard: SpeculationGuard, tokens: int, seconds: float, rounds: int = POLICY.guard_trial_rounds) -> None:
    """Rounds that drafted, each emitting `tokens` in `seconds`."""
    for _ in range(rounds):
        assert guard.allows()
        guard.observe(tokens, seconds, plain=False, alone=True)


def rest(guard: SpeculationGuard) -> int:
    """Plain rounds until the guard lets the request speculate again; returns how many."""
    rounds = 0
    while not guard.allows():
        guard.observe(1, PLAIN_S, plain=True, alone=True)
        rounds += 1
        assert rounds <= POLICY.guard_max_rest_rounds
    return rounds


def test_a_trial_that_pays_goes_on_speculating():
    guard = guard_with_plain_rounds()
    trial(guard, tokens=2, seconds=0.080)  # 25 tokens/s against 20
    assert guard.allows() and guard.rested == 0


def test_a_losing_trial_rests_then_probes_and_each_loss_in_a_row_doubles_the_rest():
    guard = guard_with_plain_rounds()
    trial(guard, tokens=1, seconds=0.060)  # speculation that keeps nothing: 16.7 tokens/s against 20
    assert not guard.allows()
    assert rest(guard) == 3
    trial(guard, tokens=1, seconds=0.060)  # the probe loses again
    assert rest(guard) == 6
    trial(guard, tokens=1, seconds=0.060)
    assert rest(guard) == 10  # at most guard_max_rest_rounds
    trial(guard, tokens=3, seconds=0.090)  # the text changed kind: 33 tokens/s
    assert guard.allows()
    trial(guard, tokens=1, seconds=0.060)
    assert rest(guard) == 3  # a paying trial reset the rest
    assert guard.rested == 3 + 6 + 10 + 3


def test_the_verdict_weighs_tokens_over_seconds_of_the_whole_trial():
    guard = guard_with_plain_rounds()
    for tokens, seconds in ((4, 0.100), (1, 0.060), (1, 0.060), (1, 0.060)):  # 7 tokens in 0.28 s: 25 tokens/s
        guard.observe(tokens, seconds, plain=False, alone=True)
    assert guard.allows()


def test_rounds_beside_other_requests_or_forced_by_a_grammar_are_no_evidence():
    guard = guard_with_plain_rounds()
    trial(guard, tokens=1, seconds=0.060, rounds=POLICY.guard_trial_rounds - 1)
    guard.observe(1, 0.200, plain=False, alone=False)  # a batch: the speculation cap's to judge; the trial starts over
    trial(guard, tokens=1, seconds=0.060, rounds=POLICY.guard_trial_rounds - 1)
    guard.observe(8, 0.070, plain=False, alone=True, forced=True)
    assert guard.allows()
    trial(guard, tokens=1, seconds=0.060)
    assert not guard.allows()


def test_plain_is_priced_by_the_requests_own_plain_rounds_then_its_kinds_then_the_planner():
    shared = PlainRounds(POLICY)
    guard = SpeculationGuard(shared, lambda: 0.040, POLICY)
    assert guard.plain_s() == 0.040  # nothing served plain yet: the planner's price of a plain Verify
    other = SpeculationGuard(shared, policy=POLICY)
    other.observe(1, 0.050, plain=True, alone=True)  # another request's plain round
    assert guard.plain_s() == pytest.approx(0.050)
    guard.observe(1, 0.070, plain=True, alone=True)  # this request's context is longer: its rounds cost more
    assert guard.plain_s() == pytest.approx(0.050 + 0.5 * 0.020)  # one own round: still its kind's (shared learned it too)
    guard.observe(1, 0.070, plain=True, alone=True)
    assert guard.plain_s() == pytest.approx(0.070)
    guard.observe(1, 0.500, plain=True, alone=False)  # beside other requests: not a plain round of its own
    assert guard.plain_s() == pytest.approx(0.070)


def test_no_verdict_without_any_price_of_plain():
    guard = SpeculationGuard(PlainRounds(POLICY), policy=POLICY)
    trial(guard, tokens=1, seconds=10.0)
    assert guard.allows()


def test_a_request_under_the_fixed_policy_is_never_rested_but_teaches_plain():
    shared = PlainRounds(POLICY)
    shared.observe(PLAIN_S)
    guard = SpeculationGuard(shared, policy=POLICY, judges=False)
    trial(guard, tokens=1, seconds=1.0, rounds=3 * POLICY.guard_trial_rounds)
    assert guard.allows() and guard.rested == 0
    guard.observe(1, 0.030, plain=True, alone=True)
    assert shared.seconds() == pytest.approx(0.040)


def test_a_resting_request_plans_plain_rounds_and_asks_for_no_proposals():
    """The engine reads the guard when it plans: while a request rests, its rounds are plain (no
    proposals asked, none taken) whatever the heads offer; under the fixed policy it never rests."""
    from gateway.adaptive import StepCosts
    from gateway.proposers import HeadProposals
    from tests.test_medusa import asks_heads, head_policy_generation, head_round

    costs = StepCosts()
    for positions in range(1, 6):
        costs.observe_verify(positions, 0.050)  # drafts cost nothing: the heads always pay on paper
    generation = head_policy_generation(costs)
    generation.heads.proposals = HeadProposals([[7], [8], [9]])
    assert asks_heads(generation) and head_round(generation) == ([7, 8, 9], [])
    generation.guard.shared.observe(PLAIN_S)
    for _ in range(generation.guard.policy.guard_trial_rounds):  # speculation that kept nothing, slowly
        generation.guard.observe(1, 2 * PLAIN_S, plain=False, alone=True, expected=1.0)
    generation.heads.proposals = HeadProposals([[7], [8], [9]])
    assert not generation.context().allowed
    assert not asks_heads(generation) and head_round(generation) == ([], [])
    for unjudged in (head_policy_generation(costs, adaptive=False), head_policy_generation(costs, speculate=False)):
        for _ in range(3 * unjudged.guard.policy.guard_trial_rounds):
            unjudged.guard.observe(1, 2 * PLAIN_S, plain=False, alone=True, expected=1.0)
        assert unjudged.guard.allows() and unjudged.guard.rested == 0  # target-only answers report no rested rounds
