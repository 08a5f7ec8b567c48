"""Lookup rounds: the gateway drafts prompt-lookup copies itself (gateway/engine.py, `--lookup-tokens`).

A copy is an ordinary draft to the verify and the acceptance rule (q is one-hot when sampling), so the
output stays exactly the target's; what is new is the bookkeeping: the draft was not asked, learns the
round's tokens from its next commit (features included), and the copies keep their own acceptance
estimate and length, priced without a draft cost.
"""

from __future__ import annotations

import numpy as np
import pytest

from gateway.adaptive import StepCosts
from gateway.rejection import rejection_sample
from specd.v1 import common_pb2, generate_pb2
from specd_common.distributions import decode_distribution, one_hot
from tests.conftest import start_cluster
from tests.test_rejection import SIGNIFICANCE, chi_square_p_value
from tests.test_services import FIXED, generate, hf_greedy, wait_for_no_sessions
from tests.test_statistical import chi_square_power

REPEATING = "one two three four one two three four one two three four one two three"  # the copy source


@pytest.fixture(scope="module")
def lookup_cluster(tiny):
    """The feature drafter (needs features kept in sync across lookup rounds) and copies up to 8 long.
    No speculation cache: its hits answer a Propose in about a round trip, and with drafts that cheap
    the tiny models' requests would choose the draft's rounds over the copies."""
    running = start_cluster(tiny.target, "feature", tiny.feature_head, lookup_tokens=8, speculated_outcomes=0)
    yield running
    running.stop()


def test_greedy_with_lookup_rounds_equals_target_only_and_transformers(lookup_cluster, tiny):
    stub = lookup_cluster.stub()
    speculative = generate(stub, text=REPEATING, max_new_tokens=40)
    target_only = generate(stub, text=REPEATING, max_new_tokens=40, disable_speculation=True)
    assert list(speculative.token_ids) == list(target_only.token_ids)
    assert list(speculative.token_ids) == hf_greedy(tiny.target, list(speculative.prompt_token_ids), 40)
    stats = speculative.stats
    assert stats.lookup_rounds > 0, "the repeated prompt offers copies from the first round"
    assert wait_for_no_sessions(lookup_cluster) == {"verify": 0, "draft": 0}


def test_the_draft_catches_up_on_lookup_rounds_it_did_not_see(lookup_cluster, monkeypatch):
    """Lookup and draft rounds alternate (copies offered every other round). At every Propose the
    draft's sequence is exactly the committed one (the commit appended what the lookup rounds emitted,
    accepted copies included), and the feature drafter, which fails a Propose whose features have a
    gap, drafts in every draft round."""
    import gateway.proposers
    from draft_service.feature_drafter import FeatureDrafter

    seen: list[list[int]] = []
    real_propose, real_lookup, calls = FeatureDrafter.propose, gateway.proposers.prompt_lookup, []

    def recording(self, session, k, rng, branches=1):
        seen.append(list(session.sequence.tokens))
        return real_propose(self, session, k, rng, branches)

    def every_other_round(*args, **kwargs):
        calls.append(1)
        return real_lookup(*args, **kwargs) if len(calls) % 2 else []

    monkeypatch.setattr(FeatureDrafter, "propose", recording)
    monkeypatch.setattr(gateway.proposers, "prompt_lookup", every_other_round)
    reply = generate(lookup_cluster.stub(), text=REPEATING, max_new_tokens=40, draft_length_policy=FIXED)
    stats = reply.stats
    assert stats.lookup_rounds >= 3 and stats.target_passes - stats.lookup_rounds >= 3
    assert stats.accepted_tokens > stats.target_passes  # the target loops: copies are accepted
    committed = list(reply.prompt_token_ids) + list(reply.token_ids)
    assert len(seen) == stats.target_passes - stats.lookup_rounds
    assert all(sequence == committed[: len(sequence)] for sequence in seen)
    # every draft round drafted k = 3 (but near the end): a Propose that failed for a gap in the
    # features would have put the draft in back-off, leaving the rounds after it without drafts
    draft_rounds = stats.target_passes - stats.lookup_rounds
    assert stats.draft_tokens >= stats.lookup_rounds + 3 * (draft_rounds - 2)


def test_the_fixed_policy_caps_copies_at_k(lookup_cluster):
    reply = generate(lookup_cluster.stub(), text=REPEATING, max_new_tokens=30, draft_length_policy=FIXED, num_draft_tokens=2)
    assert reply.stats.lookup_rounds > 0
    assert len(reply.stats.draft_tokens_per_position) <= 2


def test_lookup_rounds_need_no_draft_service(tiny):
    """A deployment with only a verify service still speculates on repeated text, exactly."""
    running = start_cluster(tiny.target, "", lookup_tokens=8)
    try:
        stub = running.stub()
        speculative = generate(stub, text=REPEATING, max_new_tokens=30)
        target_only = generate(stub, text=REPEATING, max_new_tokens=30, disable_speculation=True)
        assert list(speculative.token_ids) == list(target_only.token_ids)
        assert speculative.stats.lookup_rounds > 0 and target_only.stats.lookup_rounds == 0
        assert speculative.stats.draft_tokens > 0
    finally:
        running.stop()


def test_sampled_lookup_rounds_are_reproducible_by_seed(lookup_cluster):
    stub = lookup_cluster.stub()
    sampling = common_pb2.SamplingParams(temperature=1.0, top_k=20)
    fixed = dict(draft_length_policy=generate_pb2.DRAFT_LENGTH_POLICY_FIXED)  # copies every round they offer
    first = generate(stub, text=REPEATING, max_new_tokens=24, seed=7, sampling=sampling, **fixed)
    again = generate(stub, text=REPEATING, max_new_tokens=24, seed=7, sampling=sampling, **fixed)
    assert list(first.token_ids) == list(again.token_ids)
    assert first.stats.lookup_rounds > 0
    # adaptive, the coupled rule: the answer is target-only decoding's with that seed
    adaptive = generate(stub, text=REPEATING, max_new_tokens=24, seed=7, sampling=sampling)
    alone = generate(stub, text=REPEATING, max_new_tokens=24, seed=7, sampling=sampling, disable_speculation=True)
    assert list(adaptive.token_ids) == list(alone.token_ids)


def test_a_copy_judged_with_a_one_hot_q_follows_p():
    """What a sampled lookup round relies on: rejection sampling with q = one-hot(copied token) emits
    p exactly (accept with p(d), else the residual: p without d). 20,000 rounds on a toy p; power
    ≥ 0.99 against emitting the copy whenever p gives it any mass and against resampling from p
    itself after a rejection (the residual forgotten)."""
    p = np.array([0.05, 0.4, 0.25, 0.2, 0.1])
    copied, samples = 2, 20_000
    q = decode_distribution(one_hot(copied), p.size)[None]  # [1, V]
    rng = np.random.default_rng(0)
    firsts = np.array([rejection_sample([copied], q, np.stack([p, p]), rng).emitted([copied])[0] for _ in range(samples)])
    always_copy = np.eye(p.size)[copied]
    no_residual = p * (1 - p[copied]) + always_copy * p[copied]
    powers = [chi_square_power(wrong, p, samples) for wrong in (always_copy, no_residual)]
    assert min(powers) >= 0.99, powers
    assert chi_square_p_value(firsts, p) > SIGNIFICANCE


def test_a_copy_round_is_priced_without_a_draft_cost():
    costs = StepCosts()
    costs.observe_verify(1, 0.100)
    costs.observe_verify(4, 0.125)
    costs.observe_draft(3, 0.030)
    assert costs.round_cost_s(3) == pytest.approx(0.155)
    assert costs.round_cost_s(3, drafting=False) == pytest.approx(0.125)


@pytest.mark.parametrize("fields", [dict(lookup_tokens=-1), dict(lookup_tokens=17), dict(lookup_min_ngram=0)])
def test_lookup_options_out_of_range_are_refused_with_the_range(fields):
    from gateway.options import GatewayOptions

    with pytest.raises(ValueError, match=r"lookup tokens must be in \[0, 16\]"):
        GatewayOptions(**fields)


def test_declined_copies_are_tried_again_later():
    """Unit, the engine's choice of copy length without services: copies that failed get declined
    (k = 0 pays best), and each declined round lets their estimate drift back to its prior, so a request
    whose text starts repeating later offers copies again instead of never."""
    from types import SimpleNamespace

    from gateway.engine import Generation, GenerationSpec
    from gateway.options import GatewayOptions
    from specd_common.params import Warp

    costs = StepCosts()
    costs.observe_verify(1, 0.100)
    for positions in range(2, 6):
        costs.observe_verify(positions, 0.150)  # a copy must bring 1.5 tokens a round to pay
    backends = SimpleNamespace(draft=SimpleNamespace(configured=False), draft_info=None, costs=costs, keeper=None, position_price_s=lambda running: 0.0,
                               target_info=SimpleNamespace(max_sequence_length=100, eos_token_ids=[], medusa_heads=0),
                               tokenizer=SimpleNamespace(decode=lambda ids: ""))
    spec = GenerationSpec(prompt_ids=[1, 2, 3, 1, 2], max_new_tokens=10, warp=Warp(), seed=0)
    generation = Generation(backends, spec, options=GatewayOptions(lookup_tokens=4))
    drafts = lambda: generation.planner.plan(generation.context()).drafts  # noqa: E731  (no draft service, no heads)
    assert drafts() == [3, 1, 2, 3]  # the prior (0.5 a position) pays for 4
    for _ in range(10):
        generation.lookup.acceptance.update(4, 0)  # copies keep failing
    assert drafts() == []
    retried = next((calls for calls in range(1, 200) if drafts()), None)
    assert retried is not None and retried > 1
