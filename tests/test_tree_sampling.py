"""The multi-candidate sampling rule of tree rounds (gateway.rejection.multi_candidate_sample): exact,
then chi-square at significance 1e-3 with fixed seeds, with its power against wrong rules stated.

Candidates for one position are drawn from q without replacement. The exact output distribution
of a rule is computed here by enumerating every draw order (small supports only): the right rule's
equals p to rounding; each wrong rule's differs, and from that difference the noncentral
chi-square gives the test's power against it (required ≥ 0.99 at the sample sizes used).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import pytest

from gateway.rejection import multi_candidate_sample, tree_rejection_sample
from specd_common.distributions import sample_from
from tests.test_rejection import SIGNIFICANCE, chi_square_p_value
from tests.test_statistical import chi_square_power, residual

SAMPLES = 6000
REQUIRED_POWER = 0.99


def without(q: np.ndarray, token: int) -> np.ndarray:
    """The distribution of the next draw from q without replacement once `token` was drawn."""
    rest = q.copy()
    rest[token] = 0.0
    return rest / rest.sum() if rest.sum() > 0 else rest


def exact_output(p: np.ndarray, q: np.ndarray, candidates: int, update_target: bool = True, update_proposal: bool = True) -> np.ndarray:
    """P(emitted token) under the multi-candidate rule, by enumerating every draw order from q without
    replacement. update_target / update_proposal off give two wrong rules: keep testing against p
    after a rejection, or keep dividing by q instead of q without the earlier candidates."""

    def emitted(target: np.ndarray, proposal: np.ndarray, drawing: np.ndarray, left: int) -> np.ndarray:
        if left == 0 or drawing.sum() <= 0:
            return target
        out = np.zeros_like(p)
        for token in np.flatnonzero(drawing):
            ratio = target[token] / proposal[token] if proposal[token] > 0 else 0.0
            accept = min(1.0, ratio)
            out[token] += drawing[token] * accept
            next_target = residual(target, proposal) if update_target else target
            next_proposal = without(proposal, token) if update_proposal else proposal
            out += drawing[token] * (1 - accept) * emitted(next_target, next_proposal, without(drawing, token), left - 1)
        return out

    return emitted(p, q, q, candidates)


def sample_rule(p: np.ndarray, q: np.ndarray, candidates: int, samples: int, seed: int,
                rule: Callable = multi_candidate_sample) -> np.ndarray:
    """Tokens emitted by `rule` when `candidates` drafts are drawn from q without replacement."""
    rng = np.random.default_rng(seed)
    out = np.empty(samples, dtype=np.int64)
    for i in range(samples):
        drawn, rest = [], q.copy()
        for _ in range(min(candidates, int((q > 0).sum()))):
            drawn.append(sample_from(rest / rest.sum(), rng))
            rest[drawn[-1]] = 0.0
        out[i] = rule(drawn, q, p, rng)[1]
    return out


def forgets_earlier_candidates(candidates, q, p, rng) -> tuple[Optional[int], int]:
    """A wrong rule: after a rejection it divides by q again instead of q without the earlier draws."""
    target = p
    for index, token in enumerate(candidates):
        if rng.random() * q[token] < target[token]:
            return index, int(token)
        target = residual(target, q)
    return None, sample_from(target, rng)


TOY_P = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.0])
# A peaked q (overlap with p 0.40): forgetting to shrink q after a draw changes the output enough to see
TOY_Q = np.array([0.02, 0.03, 0.60, 0.05, 0.20, 0.03, 0.02, 0.05])


def test_the_rule_emits_p_exactly_and_the_wrong_rules_do_not():
    for candidates in (1, 2, 3):
        assert np.allclose(exact_output(TOY_P, TOY_Q, candidates), TOY_P, atol=1e-12), candidates
    for wrong in (dict(update_target=False), dict(update_proposal=False)):
        assert not np.allclose(exact_output(TOY_P, TOY_Q, 3, **wrong), TOY_P, atol=1e-3), wrong


@pytest.mark.parametrize("candidates", [2, 3])
def test_multi_candidate_samples_follow_the_target(candidates):
    powers = {name: chi_square_power(exact_output(TOY_P, TOY_Q, candidates, **wrong), TOY_P, SAMPLES)
              for name, wrong in (("no residual", dict(update_target=False)), ("q not shrunk", dict(update_proposal=False)))}
    print(f"power at {SAMPLES} samples, {candidates} candidates: {powers}")
    assert min(powers.values()) >= REQUIRED_POWER, powers
    assert chi_square_p_value(sample_rule(TOY_P, TOY_Q, candidates, SAMPLES, seed=candidates), TOY_P) > SIGNIFICANCE


def test_a_rule_that_forgets_earlier_candidates_fails_the_test():
    power = chi_square_power(exact_output(TOY_P, TOY_Q, 3, update_proposal=False), TOY_P, SAMPLES)
    assert power >= REQUIRED_POWER
    wrong = sample_rule(TOY_P, TOY_Q, 3, SAMPLES, seed=11, rule=forgets_earlier_candidates)
    assert chi_square_p_value(wrong, TOY_P) < SIGNIFICANCE


def exact_output_fixed(p: np.ndarray, tokens: list[int], update_target: bool = True) -> np.ndarray:
    """P(emitted token) when the candidates are fixed tokens (the Medusa heads' best), each judged
    against its own one-hot q: accepted with r_i(x_i), else r_{i+1} = norm(max(0, r_i − onehot(x_i))).
    update_target off is the wrong rule that keeps testing each candidate against p."""
    out, reach, target = np.zeros_like(p), 1.0, p
    for token in tokens:
        out[token] += reach * target[token]
        reach *= 1 - target[token]
        if update_target:
            target = residual(target, np.eye(len(p))[token])
    return out + reach * target


def test_fixed_candidates_each_with_their_own_one_hot_emit_p():
    """Deterministic candidates (a sampled Medusa head tree: each head's best tokens, not draws): exact
    by enumeration, the wrong rule is not, the chi-square test has power ≥ 0.99 against it at 6,000
    samples, and samples of the served rule (tree_rejection_sample with one one-hot per node) pass."""
    tokens = [2, 4, 0]  # q's favourites: p gives them 0.15, 0.10, 0.30
    one_hots = [np.eye(len(TOY_P))[t] for t in tokens]
    assert np.allclose(exact_output_fixed(TOY_P, tokens), TOY_P, atol=1e-12)
    wrong = exact_output_fixed(TOY_P, tokens, update_target=False)
    assert not np.allclose(wrong, TOY_P, atol=1e-3)
    assert chi_square_power(wrong, TOY_P, SAMPLES) >= REQUIRED_POWER
    rng = np.random.default_rng(17)
    emitted = [tree_rejection_sample(tokens, [-1, -1, -1], one_hots, np.stack([TOY_P] * 4), rng).emitted(tokens)[0]
               for _ in range(SAMPLES)]
    assert chi_square_p_value(np.array(emitted), TOY_P) > SIGNIFICANCE
    # one shared q for fixed candidates (as for draws without replacement) never accepts the second
    assert multi_candidate_sample(tokens[:2], one_hots[0], np.eye(len(TOY_P))[4], np.random.default_rng(0)) == (None, 4)
    assert multi_candidate_sample(tokens[:2], one_hots[:2], np.eye(len(TOY_P))[4], np.random.default_rng(0)) == (1, 4)


def test_a_sampled_tree_round_follows_the_target_at_both_depths():
    """A two-level tree (2 candidates at each depth, the second level under the first candidate): the
    first emitted token follows p_root and, after the first candidate, the second follows p there."""
    q_root, q_next = TOY_Q, np.roll(TOY_Q, 2)
    p_root, p_next, p_leaf = TOY_P, np.roll(TOY_P, 3), np.roll(TOY_P, 5)
    rng = np.random.default_rng(5)
    firsts, seconds = [], []
    for _ in range(SAMPLES):
        a, b = (int(t) for t in rng.choice(8, size=2, replace=False, p=q_root))  # without replacement
        c, d = (int(t) for t in rng.choice(8, size=2, replace=False, p=q_next))
        tokens, parents = [a, b, c, d], [-1, -1, 0, 0]
        p_rows = np.stack([p_root, p_next, p_leaf, p_leaf, p_leaf])  # [1 + 4, V]
        outcome = tree_rejection_sample(tokens, parents, [q_root, None, q_next, None], p_rows, rng)
        emitted = outcome.emitted(tokens)
        firsts.append(emitted[0])
        if outcome.path[:1] == (0,):
            seconds.append(emitted[1])
    assert chi_square_p_value(np.array(firsts), p_root) > SIGNIFICANCE
    assert chi_square_p_value(np.array(seconds), p_next) > SIGNIFICANCE


@pytest.mark.e2e
def test_multi_candidate_rule_on_real_model_distributions(default_target):
    """p: the default target's top-20 next-token distribution; q: the same model with a shorter context."""
    from specd_common.distributions import decode_distribution, encode_distribution
    from specd_common.params import Warp
    from specd_engine.warping import warp_probs
    from tests.test_statistical import next_token_logits

    warp = Warp(temperature=1.0, top_k=20)
    p_full = decode_distribution(encode_distribution(warp_probs(next_token_logits(
        default_target, "The capital of France is Paris. The capital of Italy is")[None], warp)[0].numpy()))
    q_full = decode_distribution(encode_distribution(warp_probs(next_token_logits(
        default_target, "The capital of Italy is")[None], warp)[0].numpy()))
    support = np.flatnonzero((p_full > 0) | (q_full > 0))  # the two top-20s: small enough to enumerate
    p, q = p_full[support], q_full[support]
    assert 0.05 < np.minimum(p, q).sum() < 0.95, "the draft should be neither useless nor perfect"
    samples = 20_000  # these p and q are closer than the toy ones: 6,000 samples had power 0.75
    powers = [chi_square_power(exact_output(p, q, 3, **wrong), p, samples) for wrong in (dict(update_proposal=False), dict(update_target=False))]
    print(f"power against 'q not shrunk' / 'no residual' at {samples} samples: {powers}")
    assert min(powers) >= REQUIRED_POWER
    assert np.allclose(exact_output(p, q, 3), p, atol=1e-9)
    assert chi_square_p_value(sample_rule(p, q, 3, samples, seed=3), p) > SIGNIFICANCE
