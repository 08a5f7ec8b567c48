"""The draft's speculation cache (draft_service/speculation.py): which outcomes it prepares, that a
prepared answer does not depend on when it was made, and that its drafts follow the q it carries."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from draft_service.app import make_drafter
from draft_service.speculation import SpeculationCache, SpeculationJob, likeliest_outcomes
from specd_common.distributions import decode_distribution
from specd_engine.features import encode_features
from specd_common.params import Warp
from tests.test_statistical import SIGNIFICANCE, chi_square_p_value, chi_square_power

PROMPT = list(range(3, 15))


def test_the_likeliest_outcomes_weigh_kept_prefixes_by_the_drafts_own_probabilities():
    probs = torch.tensor([[0.6, 0.3, 0.1],  # position 1: drafted 0
                          [0.1, 0.5, 0.4],  # position 2: drafted 1
                          [0.7, 0.2, 0.1]])  # after the chain: the bonus
    # (0, 1): 0.3; (0, 2): 0.1; (1, 0): 0.6·0.1 = 0.06; (1, 2): 0.6·0.4 = 0.24; (2, 0): 0.3·0.7 = 0.21; ...
    assert likeliest_outcomes(probs, [0, 1], 4) == [(0, 1), (1, 2), (2, 0), (0, 2)]
    assert likeliest_outcomes(probs, [0, 1], 0) == []
    assert likeliest_outcomes(probs[:2], [0, 1], 3) == []  # needs the distribution after the chain too


@pytest.fixture(scope="module")
def drafter(tiny):
    return make_drafter("feature", str(tiny.feature_head))


def prompt_features(drafter) -> torch.Tensor:
    """Stand-ins for the target's features of the prompt [len(PROMPT) - 1, F] (the head reads any rows)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn((len(PROMPT) - 1, drafter.head.config.feature_size), generator=generator)


def drafted_session(drafter, warp: Warp, k: int = 3):
    """A session that has just answered a Propose: the prompt committed (random target features),
    a chain of k drafts pending."""
    session = drafter.open(PROMPT, warp)
    drafter.add_features(session, encode_features(prompt_features(drafter), 0))
    proposal = drafter.propose(session, k, np.random.default_rng(1))
    return session, proposal.token_ids


def test_a_prepared_answer_is_the_one_made_whenever_it_is_made(drafter):
    """The worker prepares every outcome; a Propose that comes before the worker prepares just its
    own outcome by the same code. Both give the same tokens and the same q, and leave the session's
    caches as they found them."""
    warp = Warp(temperature=1.0)
    session, chain = drafted_session(drafter, warp)
    cache_length = session.cache.length
    job = SpeculationJob(session, len(PROMPT), tuple(chain), 3, 6, seed=11)
    job.run_all(drafter)
    assert len(job.answers) == 6 and session.cache.length == cache_length
    for outcome, answer in job.answers.items():
        late, late_chain = drafted_session(drafter, warp)
        assert late_chain == chain
        alone = SpeculationJob(late, len(PROMPT), tuple(chain), 3, 6, seed=11).resolve(drafter, outcome)
        assert alone.token_ids == answer.token_ids
        assert [decode_distribution(q).tolist() for q in alone.draft_probs] == [decode_distribution(q).tolist() for q in answer.draft_probs]
    unprepared = SpeculationJob(session, len(PROMPT), tuple(chain), 3, 6, seed=11)
    assert unprepared.resolve(drafter, (0, chain[0])) is None  # the drafted token is never a correction


def test_prepared_drafts_follow_the_q_they_carry(drafter):
    """The gateway judges a prepared draft with the q that came with it: the drafts must be drawn from
    that q. 2,000 seeds of one prepared outcome: the first draft's frequencies match its q, and the
    test has the power to tell them from the q a miss would have sent (drawn with the target's true
    features, not the head's estimates): a cache that sent that q instead would be caught."""
    warp = Warp(temperature=1.0)
    session, chain = drafted_session(drafter, warp, k=2)
    samples = 2000
    firsts, q = np.empty(samples, dtype=np.int64), None
    for seed in range(samples):
        job = SpeculationJob(session, len(PROMPT), tuple(chain), 1, 1, seed=seed)
        job._plan(drafter)
        outcome = job.plan.outcomes[0]
        answer = job.resolve(drafter, outcome)
        firsts[seed] = answer.token_ids[0]
        q = decode_distribution(answer.draft_probs[0], drafter.info().vocab_size) if q is None else q
    assert chi_square_p_value(firsts, q) > SIGNIFICANCE
    # The q a miss sends for the same outcome: its session holds the target's features of the kept positions.
    a, token = outcome
    miss = drafter.open(PROMPT, warp)
    miss.sequence.tokens = PROMPT + list(chain[:a]) + [token]
    kept = torch.randn((a + 1, drafter.head.config.feature_size), generator=torch.Generator().manual_seed(5))
    drafter.add_features(miss, encode_features(torch.cat([prompt_features(drafter), kept]), 0))
    q_miss = decode_distribution(drafter.propose(miss, 1, np.random.default_rng(0)).draft_probs[0], drafter.info().vocab_size)
    assert chi_square_power(q, q_miss, samples) >= 0.99
    assert chi_square_p_value(firsts, q_miss) < SIGNIFICANCE


def test_the_worker_runs_jobs_in_the_background_and_a_release_drops_them(drafter):
    warp = Warp()
    session, chain = drafted_session(drafter, warp)
    cache = SpeculationCache(drafter).start()
    try:
        job = SpeculationJob(session, len(PROMPT), tuple(chain), 3, 4, seed=0)
        assert cache.schedule("s", job)
        deadline = time.monotonic() + 10
        while not job.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.done and len(job.answers) == 4
        assert cache.take("s") is job and cache.take("s") is None
        cache.schedule("t", SpeculationJob(session, len(PROMPT), tuple(chain), 3, 4, seed=0))
        cache.drop("t")
        assert cache.take("t") is None
    finally:
        cache.stop()
