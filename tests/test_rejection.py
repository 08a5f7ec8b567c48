"""The accept/reject/correct rule: exact cases, and chi-square proof that sampling is lossless.

Significance: each chi-square test rejects at p < 0.001 with fixed seeds, so a correct sampler
fails a given test with probability 1e-3 if the seeds were redrawn; with fixed seeds it is deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from gateway.rejection import expected_tokens_per_pass, greedy_verify, recovered_token, rejection_sample
from specd_common.params import Warp
from specd_engine.warping import warp_probs

SIGNIFICANCE = 1e-3


def test_greedy_accepts_matching_prefix_and_corrects_first_miss():
    outcome = greedy_verify([5, 6, 7], [5, 6, 9, 4])
    assert (outcome.accepted, outcome.next_token, outcome.bonus) == (2, 9, False)
    assert outcome.emitted([5, 6, 7]) == [5, 6, 9]


def test_greedy_all_accepted_takes_bonus():
    outcome = greedy_verify([5, 6], [5, 6, 8])
    assert (outcome.accepted, outcome.next_token, outcome.bonus) == (2, 8, True)


def test_greedy_without_drafts_is_plain_decoding():
    assert greedy_verify([], [3]).emitted([]) == [3]


def test_identical_distributions_always_accept():
    p = np.array([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    rng = np.random.default_rng(0)
    for _ in range(200):
        outcome = rejection_sample([1, 2], p[:2], p, rng)
        assert outcome.accepted == 2 and outcome.bonus and outcome.next_token == 0


def test_draft_token_impossible_under_target_is_always_rejected():
    q = np.array([[0.0, 1.0, 0.0]])
    p = np.array([[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]])
    rng = np.random.default_rng(1)
    for _ in range(100):
        outcome = rejection_sample([1], q, p, rng)
        assert outcome.accepted == 0 and outcome.next_token in (0, 2)


def test_recovered_token_comes_from_the_residual():
    p, q = np.array([0.5, 0.5, 0.0]), np.array([0.9, 0.1, 0.0])
    draws = {recovered_token(p, q, np.random.default_rng(s)) for s in range(50)}
    assert draws == {1}  # max(0, p - q) is zero everywhere but token 1


def test_expected_tokens_per_pass():
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1.75)


def chi_square_p_value(samples: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness of fit of integer samples to probs, pooling bins with small expected counts."""
    n = samples.size
    probs = probs / probs.sum()
    observed = np.bincount(samples, minlength=probs.size).astype(float)
    expected = probs * n
    big = expected >= min_expected
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert observed[probs == 0].sum() == 0, "sampled a token the target gives zero probability"
    return stats.chisquare(obs[keep], exp[keep]).pvalue


def speculative_first_tokens(p_logits, q_logits, warp: Warp, k: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Run n rounds of draft-then-verify on fixed toy logits; return the first emitted token of each,
    and the target's warped distribution for that position."""
    p = warp_probs(torch.as_tensor(p_logits), warp).double().numpy()  # [k + 1, V]
    q = warp_probs(torch.as_tensor(q_logits), warp).double().numpy()  # [k, V]
    rng = np.random.default_rng(seed)
    firsts = np.empty(n, dtype=np.int64)
    for i in range(n):
        drafts = [int(rng.choice(q.shape[1], p=q[j] / q[j].sum())) for j in range(k)]
        outcome = rejection_sample(drafts, q, p, rng)
        firsts[i] = outcome.emitted(drafts)[0]
    return firsts, p[0]


@pytest.mark.parametrize(
    "warp",
    [Warp(temperature=1.0), Warp(temperature=0.7), Warp(temperature=1.3, top_k=5), Warp(temperature=1.0, top_p=0.8),
     Warp(temperature=1.0, logit_bias=((3, 2.0), (5, -100.0)))],
    ids=["t1", "t0.7", "t1.3-topk5", "t1-topp0.8", "t1-logit-bias"],
)
def test_sampling_follows_target_distribution_on_toy_logits(warp: Warp):
    generator = torch.Generator().manual_seed(0)
    vocab = 12
    p_logits = torch.randn(3, vocab, generator=generator) * 1.5
    q_logits = p_logits[:2] + torch.randn(2, vocab, generator=generator)  # a draft that is close but wrong
    firsts, p0 = speculative_first_tokens(p_logits, q_logits, warp, k=2, n=20_000, seed=1)
    assert chi_square_p_value(firsts, p0) > SIGNIFICANCE


def test_tokens_after_an_accepted_draft_follow_the_target():
    """Second position: when x1 is accepted, t1 ~ norm(min(p1, q1)) and t2 ~ p2 (toy rows do not depend on t1)."""
    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]])  # [k + 1, V]
    q = np.array([[0.2, 0.2, 0.6], [0.6, 0.2, 0.2]])  # [k, V]
    rng = np.random.default_rng(3)
    firsts, seconds = [], []
    for _ in range(30_000):
        drafts = [int(rng.choice(3, p=q[0])), int(rng.choice(3, p=q[1]))]
        outcome = rejection_sample(drafts, q, p, rng)
        if outcome.accepted >= 1:
            emitted = outcome.emitted(drafts)
            firsts.append(emitted[0])
            seconds.append(emitted[1])
    assert len(seconds) > 1000
    assert chi_square_p_value(np.array(seconds), p[1]) > SIGNIFICANCE
    assert chi_square_p_value(np.array(firsts), np.minimum(p[0], q[0])) > SIGNIFICANCE


def test_a_sampler_that_ignores_the_residual_is_caught():
    """The test has teeth: correcting from p instead of max(0, p - q) biases the output and is detected."""
    p = np.array([[0.5, 0.3, 0.2], [0.3, 0.3, 0.4]])
    q = np.array([[0.1, 0.1, 0.8]])
    rng = np.random.default_rng(5)
    firsts = []
    for _ in range(20_000):
        draft = int(rng.choice(3, p=q[0]))
        if rng.random() < min(1.0, p[0][draft] / q[0][draft]):
            firsts.append(draft)
        else:
            firsts.append(int(rng.choice(3, p=p[0])))  # the bug
    assert chi_square_p_value(np.array(firsts), p[0]) < SIGNIFICANCE


@pytest.mark.parametrize("warp", [Warp(temperature=0.7), Warp(temperature=0.3), Warp(temperature=1.0, top_k=50)])
def test_a_pass_encoded_at_once_is_what_each_row_encodes_to(warp: Warp):
    """encode_rows (torch's float16 conversion for the whole pass) puts the same bytes on the wire as
    encode_distribution row by row (numpy's): rows full of float16 subnormals and zeros (low
    temperature: only the nonzeros are sent) and sparse top-k rows alike, so the speed-up cannot move a sampled token."""
    from specd_common.distributions import encode_distribution
    from specd_engine.warping import encode_rows

    generator = torch.Generator().manual_seed(3)
    probs = warp_probs(torch.randn(4, 49152, generator=generator) * 4, warp)  # [4, V]
    encoded = encode_rows(probs)
    assert [m.SerializeToString() for m in encoded] == [encode_distribution(row).SerializeToString() for row in probs.numpy()]
    from specd.v1 import common_pb2

    sparse_float32 = encoded[0].encoding == common_pb2.PROB_ENCODING_FLOAT32  # top-k: float32 at ids; else float16 nonzeros
    assert sparse_float32 == (warp.top_k > 0) and (sparse_float32 or encoded[0].token_ids or encoded[0].support_bitmap)


def test_the_coupled_rule_emits_p_keeps_a_draft_with_p_of_it_and_matches_target_only():
    """gateway.rejection.coupled_verify on toy rows, seeds 0..N: the first emitted token follows p_1, a
    fixed draft is kept with probability p_1(x) (what min(1, p/q) gives a one-hot q), the token after a
    kept draft follows p_2, and every answer is the one target-only decoding draws with the same
    position uniforms (no drafts: each position's own draw). Control: keeping the draft with
    probability q-free 0.5 and drawing the correction from p, not from p without x, is caught."""
    from gateway.rejection import coupled_verify
    from specd_common.distributions import position_uniforms

    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]])  # [k + 1, V]
    drafts = [1, 1]
    firsts, seconds, kept, wrong = [], [], 0, []
    for seed in range(20_000):
        uniforms = position_uniforms(seed, 100, 3)
        outcome = coupled_verify(drafts, p, uniforms)
        emitted = outcome.emitted(drafts)
        alone = [coupled_verify([], p[i : i + 1], uniforms[i : i + 1]).next_token for i in range(len(emitted))]
        assert emitted == alone  # target-only decoding with the same seed, token for token
        firsts.append(emitted[0])
        kept += outcome.accepted >= 1
        if outcome.accepted >= 1:
            seconds.append(emitted[1])
        rng = np.random.default_rng(seed)
        wrong.append(1 if rng.random() < 0.5 else int(rng.choice(3, p=p[0])))
    assert chi_square_p_value(np.array(firsts), p[0]) > SIGNIFICANCE
    assert chi_square_p_value(np.array(seconds), p[1]) > SIGNIFICANCE
    assert kept / 20_000 == pytest.approx(p[0][1], abs=0.015)
    assert chi_square_p_value(np.array(wrong), p[0]) < SIGNIFICANCE
    assert position_uniforms(7, 10, 3)[1:] == position_uniforms(7, 11, 2)  # a position's draw is its own


def test_the_coupled_tree_rule_walks_the_target_draws():
    """coupled_tree_verify: the child carrying the target's draw is kept, and the first token follows p
    at the root whatever the tree holds (two fixed children of the root, one grandchild)."""
    from gateway.rejection import coupled_tree_verify
    from specd_common.distributions import position_uniforms

    tokens, parents = [0, 1, 2], [-1, -1, 0]
    p = np.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.3, 0.3, 0.4], [0.3, 0.3, 0.4]])  # [1 + n, V]
    firsts, paths = [], {}
    for seed in range(20_000):
        outcome = coupled_tree_verify(tokens, parents, p, position_uniforms(seed, 0, 3))
        emitted = outcome.emitted(tokens)
        firsts.append(emitted[0])
        paths[outcome.path] = paths.get(outcome.path, 0) + 1
        if outcome.path == (0,):
            assert emitted[1] != 2 and not outcome.bonus  # the grandchild was not the draw
        if outcome.path == (0, 2):
            assert outcome.bonus  # a leaf: its row gives the bonus
    assert chi_square_p_value(np.array(firsts), p[0]) > SIGNIFICANCE
    assert paths[(0, 2)] / 20_000 == pytest.approx(0.5 * 0.6, abs=0.015)
    assert paths[()] / 20_000 == pytest.approx(0.2, abs=0.015)


def test_the_verify_draws_what_the_gateway_would_by_the_same_rule():
    """warping.draw_rows (the verify's draws for VerifyRequest.coupled_draw) on rows whose CDF is exact
    in float32 and float64: every seed's round ends as the gateway's own coupled rule ends it on the same
    rows and uniforms, a chain and a tree alike, judged as greedy judges argmaxes; the first draw follows
    p. Control: drawing every row with row 0's uniform breaks what two rows draw together."""
    from gateway.rejection import coupled_tree_verify, coupled_verify, greedy_tree_verify
    from specd_common.distributions import uniforms_at
    from specd_common.tree import depths
    from specd_engine.warping import draw_rows

    p = np.array([[0.5, 0.25, 0.25], [0.125, 0.625, 0.25], [0.25, 0.25, 0.5], [0.75, 0.125, 0.125]])  # [4, V]: dyadic
    drafts, nodes, parents = [1, 1, 2], [0, 1, 2], [-1, -1, 0]
    firsts, pairs, wrong_pairs = [], [], []
    for seed in range(5_000):
        uniforms = uniforms_at(seed, range(40, 44))
        drawn = draw_rows(torch.tensor(p, dtype=torch.float32), uniforms).tolist()
        assert coupled_verify(drafts, p, uniforms) == greedy_verify(drafts, drawn)
        tree_uniforms = uniforms_at(seed, [40] + [40 + depth for depth in depths(parents)])  # the verify's positions
        tree_drawn = draw_rows(torch.tensor(p, dtype=torch.float32), tree_uniforms).tolist()
        assert coupled_tree_verify(nodes, parents, p, uniforms) == greedy_tree_verify(nodes, parents, tree_drawn)
        firsts.append(drawn[0])
        pairs.append(3 * drawn[0] + drawn[1])
        wrong_pairs.append(3 * drawn[0] + draw_rows(torch.tensor(p[1:2], dtype=torch.float32), uniforms[:1]).item())
    assert chi_square_p_value(np.array(firsts), p[0]) > SIGNIFICANCE
    independent = np.outer(p[0], p[1]).ravel()  # positions draw independently
    assert chi_square_p_value(np.array(pairs), independent) > SIGNIFICANCE
    assert chi_square_p_value(np.array(wrong_pairs), independent) < SIGNIFICANCE


def test_the_verify_draws_only_the_rows_the_gateway_reads_and_those_as_drawing_every_row():
    """warping.draw_walk: for a chain and a tree, every row it draws holds draw_rows' token for that row
    (its p, its uniform), the others UNDRAWN, and the gateway's judging (greedy_verify,
    greedy_tree_verify) ends the round as on every row's draws. Control: rows past the first miss stay
    undrawn, so on these dyadic rows some seeds leave rows undrawn and some draw the whole chain."""
    from specd_common.distributions import uniforms_at
    from specd_common.tree import depths
    from gateway.rejection import greedy_tree_verify
    from specd_engine.warping import UNDRAWN, draw_rows, draw_walk

    p = torch.tensor([[0.5, 0.25, 0.25], [0.125, 0.625, 0.25], [0.25, 0.25, 0.5], [0.75, 0.125, 0.125]])  # [4, V]
    drafts, nodes, parents = [0, 1, 2], [0, 1, 2], [-1, -1, 0]
    chain_positions = list(range(40, 44))
    tree_positions = [40] + [40 + depth for depth in depths(parents)]
    undrawn_rounds = whole_chains = 0
    for seed in range(2_000):
        for tokens, tree_parents, positions in ((drafts, [], chain_positions), (nodes, parents, tree_positions)):
            every = draw_rows(p, uniforms_at(seed, positions)).tolist()
            walked = draw_walk(p, seed, positions, tokens, tree_parents).tolist()
            assert all(w in (UNDRAWN, e) for w, e in zip(walked, every)) and walked[0] == every[0]
            if tree_parents:
                assert greedy_tree_verify(tokens, tree_parents, walked) == greedy_tree_verify(tokens, tree_parents, every)
            else:
                assert greedy_verify(tokens, walked) == greedy_verify(tokens, every)
                undrawn_rounds += UNDRAWN in walked
                whole_chains += UNDRAWN not in walked
    assert undrawn_rounds > 1_000 and whole_chains > 50


def test_logit_bias_is_added_before_warping_and_survives_the_wire():
    """biased(): the bias lands on its token ids in every row (ids past a drafter's shorter rows are
    skipped); -100 leaves a token no probability, +100 all of it; SamplingParams round-trips it."""
    from specd.v1 import common_pb2
    from specd_engine.warping import biased

    logits = torch.zeros(2, 6)
    warp = Warp(logit_bias=((1, 2.5), (4, -1.0), (9, 7.0)))
    assert torch.equal(biased(logits, warp), torch.tensor([[0, 2.5, 0, 0, -1.0, 0]] * 2))
    assert biased(logits, Warp()) is logits
    probs = warp_probs(torch.randn(3, 6), Warp(temperature=1.0, logit_bias=((2, 100.0), (0, -100.0))))
    assert bool((probs[:, 2] > 0.999).all()) and bool((probs[:, 0] < 1e-30).all())
    assert Warp.from_proto(warp.to_proto(common_pb2.SamplingParams)) == warp


def constrained_first_tokens(p: np.ndarray, q: np.ndarray, allowed: np.ndarray, n: int, seed: int,
                             judge_by_restricted_q: bool = True) -> np.ndarray:
    """The gateway's rule for a constrained round on toy rows, n times: drafts drawn from the drafter's q
    [k, V], cut before the first one the grammar forbids (allowed [k + 1, V]), the kept ones judged by q
    restricted to the grammar (specd_common.masks.restrict) against the verify's p [k + 1, V]; the first
    emitted token of each round."""
    from specd_common.masks import restrict

    rng = np.random.default_rng(seed)
    firsts = np.empty(n, dtype=np.int64)
    for i in range(n):
        drafts = [int(rng.choice(q.shape[1], p=row)) for row in q]
        kept = next((j for j, token in enumerate(drafts) if not allowed[j, token]), len(drafts))
        q_kept = np.array([restrict(q[j], allowed[j]) if judge_by_restricted_q else q[j] for j in range(kept)] or
                          np.zeros((0, q.shape[1])))
        outcome = rejection_sample(drafts[:kept], q_kept, p[: kept + 1], rng)
        firsts[i] = outcome.emitted(drafts[:kept])[0]
    return firsts


def follows(samples: np.ndarray, probs: np.ndarray) -> bool:
    """The samples fit probs: nothing outside its support, and the chi-square test does not reject."""
    return not np.isin(samples, np.flatnonzero(probs == 0)).any() and chi_square_p_value(samples, probs) > SIGNIFICANCE


@pytest.mark.parametrize("warp", [Warp(temperature=1.0), Warp(temperature=0.8, top_k=6), Warp(temperature=1.0, top_p=0.9)],
                         ids=["t1", "t0.8-topk6", "t1-topp0.9"])
def test_constrained_sampling_follows_the_target_restricted_to_the_grammar(warp: Warp):
    """Structured output, sampled: the first token of a round follows the target's distribution restricted
    to the grammar and renormalized (the verify masks logits before warping, specd_engine.warping), and
    the test has the power to reject three wrong rules on the same rows: masking only the drafts (the
    target unmasked), masking after normalization (p zeroed outside the grammar, not renormalized), and
    dropping forbidden drafts but judging the kept ones by the drafter's unrestricted q."""
    generator = torch.Generator().manual_seed(4)
    vocab, k = 12, 2
    p_logits = torch.randn(k + 1, vocab, generator=generator) * 1.5
    q_logits = p_logits[:k] + torch.randn(k, vocab, generator=generator)
    allowed = torch.zeros(k + 1, vocab, dtype=torch.bool)
    allowed[:, [0, 2, 3, 5, 7, 8, 11]] = True  # the grammar's tokens (a toy grammar: the same at every position)
    allowed[1, 3] = False
    p = warp_probs(p_logits, warp, allowed).double().numpy()  # [k + 1, V] what the verify returns
    q = warp_probs(q_logits, warp).double().numpy()  # [k, V] the drafter knows no grammar
    q /= q.sum(axis=1, keepdims=True)
    n = 20_000
    assert follows(constrained_first_tokens(p, q, allowed.numpy(), n, seed=1), p[0])
    unmasked = warp_probs(p_logits, warp).double().numpy()
    assert not follows(constrained_first_tokens(unmasked, q, allowed.numpy(), n, seed=1), p[0])  # masking only the drafts
    after = unmasked * allowed.numpy()  # masked after normalization
    assert not follows(constrained_first_tokens(after, q, allowed.numpy(), n, seed=1), p[0])
    assert not follows(constrained_first_tokens(p, q, allowed.numpy(), n, seed=1, judge_by_restricted_q=False), p[0])
