"""Sampled output follows the target distribution: chi-square tests at significance 1e-3, fixed seeds.

Two levels: the rejection rule on a real model's next-token distributions (the embedded default
target), and the whole system (gateway + services over gRPC, tiny models with peaked next-token
distributions). The whole-system test computes, from the very p and q the gateway used, its power
against each known-wrong rule (correction drawn from p, accept every draft, reject every draft, q
taken from another warp) and requires >= 0.99 at the significance level; controls swap each wrong
rule into the running gateway and show the test then fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import pytest
import torch
from scipy import stats

import gateway.engine
from gateway.rejection import RoundOutcome, recovered_token, rejection_sample
from specd.v1 import common_pb2, generate_pb2
from specd_common.distributions import decode_distribution, encode_distribution, sample_from
from specd_common.params import Warp
from specd_engine.warping import warp_probs
from tests.conftest import start_cluster
from tests.tiny_models import build_eagle3_head, build_feature_head, build_model, build_noisy_copy, build_tokenizer
from tests.test_rejection import SIGNIFICANCE, chi_square_p_value

WARPS = [Warp(temperature=1.0), Warp(temperature=0.6), Warp(temperature=1.0, top_k=20), Warp(temperature=0.9, top_p=0.9)]
WARP_IDS = ["t1", "t0.6", "t1-topk20", "t0.9-topp0.9"]


def next_token_logits(loaded, text: str) -> torch.Tensor:
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        return loaded.model(ids).logits[0, -1].float()  # [V]


@pytest.mark.e2e
@pytest.mark.parametrize("warp", WARPS, ids=WARP_IDS)
def test_rejection_rule_on_real_model_distributions(default_target, warp):
    """p: the target's next-token distribution; q: the same model with a shorter context (a real, wrong draft)."""
    p_logits = next_token_logits(default_target, "The capital of France is Paris. The capital of Italy is")
    q_logits = next_token_logits(default_target, "The capital of Italy is")
    # What crosses the wire (float16 / sparse), decoded: exactly what the gateway uses.
    p = decode_distribution(encode_distribution(warp_probs(p_logits[None], warp)[0].numpy()))
    q = decode_distribution(encode_distribution(warp_probs(q_logits[None], warp)[0].numpy()))
    assert 0.05 < np.minimum(p, q).sum() < 0.95, "the draft should be neither useless nor perfect"
    rng = np.random.default_rng(2024)
    firsts = np.empty(8000, dtype=np.int64)
    for i in range(firsts.size):
        draft = sample_from(q, rng)
        firsts[i] = rejection_sample([draft], q[None], np.stack([p, p]), rng).emitted([draft])[0]
    assert chi_square_p_value(firsts, p) > SIGNIFICANCE



# --------------------------------------------------------------------------- the whole system

SAMPLES = {"model": 1000, "feature": 2000, "eagle3": 2000}  # requests per case: the untrained heads overlap p less
REQUIRED_POWER = 0.99
HEAD_SCALE, DRAFT_NOISE = 15.0, 0.4  # peaked target; a draft overlapping it by 35-50 % at the first position


@dataclass
class PeakedModels:
    target: object
    draft: object
    feature_head: object
    eagle3_head: object  # an EAGLE-3 checkpoint (speculators layout) reading the target's layers 1, 2, 2


@pytest.fixture(scope="module")
def peaked(tmp_path_factory) -> PeakedModels:
    """Tiny models whose first-position distributions are peaked (top token 0.2-0.3), unlike the
    near-flat random ones, so 1,000-2,000 samples tell a right sampler from a wrong one."""
    root = tmp_path_factory.mktemp("peaked")
    target = build_model(root / "target", seed=3, tokenizer=build_tokenizer(), head_scale=HEAD_SCALE)
    return PeakedModels(target, build_noisy_copy(target, root / "draft", noise=DRAFT_NOISE),
                        build_feature_head(target, root / "head", vocab_stride=2), build_eagle3_head(target, root / "eagle3"))


# Known-wrong rules, each with the distribution of the first token it emits (draft x ~ q at the
# first position, target p there): what the power is computed against.


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p - q, 0.0)
    return r / r.sum() if r.sum() > 0 else p


def flatter(q: np.ndarray) -> np.ndarray:
    """q under another warp: the square root, renormalised (like a temperature twice as high)."""
    root = np.sqrt(q)
    return root / root.sum()


def correction_from_p(drafts, q, p, rng) -> RoundOutcome:
    for i, token in enumerate(drafts):
        if not (q[i][token] > 0 and rng.random() * q[i][token] < p[i][token]):
            return RoundOutcome(i, int(rng.choice(p.shape[1], p=p[i] / p[i].sum())), bonus=False)
    return RoundOutcome(len(drafts), int(rng.choice(p.shape[1], p=p[-1] / p[-1].sum())), bonus=True)


def accept_all(drafts, q, p, rng) -> RoundOutcome:
    return RoundOutcome(len(drafts), int(rng.choice(p.shape[1], p=p[-1] / p[-1].sum())), bonus=True)


def reject_all(drafts, q, p, rng) -> RoundOutcome:
    if not drafts:  # a round without drafts (the last token of a request) has only the bonus token
        return accept_all(drafts, q, p, rng)
    return RoundOutcome(0, recovered_token(p[0], q[0], rng), bonus=False)


def q_of_another_warp(drafts, q, p, rng) -> RoundOutcome:
    return rejection_sample(drafts, np.array([flatter(row) for row in q]).reshape(q.shape), p, rng)


def accept_probabilities(p: np.ndarray, q_used: np.ndarray, q_drawn: np.ndarray) -> np.ndarray:
    """P(draft x drawn from q_drawn and accepted by the rule min(1, p/q_used)), per x."""
    ratio = np.divide(p, q_used, out=np.zeros_like(p), where=q_used > 0)
    return q_drawn * np.minimum(1.0, ratio)


WRONG_RULES: dict[str, tuple[Callable, Callable[[np.ndarray, np.ndarray], np.ndarray]]] = {
    "correction from p": (correction_from_p, lambda p, q: np.minimum(p, q) + (1 - np.minimum(p, q).sum()) * p),
    "accept every draft": (accept_all, lambda p, q: q),
    "reject every draft": (reject_all, lambda p, q: residual(p, q)),
    "q of another warp": (
        q_of_another_warp,
        lambda p, q: (a := accept_probabilities(p, flatter(q), q)) + (1 - a.sum()) * residual(p, flatter(q)),
    ),
}


def pooled(probs: np.ndarray, expected: np.ndarray, min_expected: float = 5.0) -> np.ndarray:
    """probs binned as chi_square_p_value bins the samples (pooling bins of small expected count)."""
    big = expected >= min_expected
    return np.append(probs[big], probs[~big].sum())


def chi_square_power(wrong: np.ndarray, p: np.ndarray, n: int, alpha: float = SIGNIFICANCE) -> float:
    """P(the test rejects at alpha) when samples follow `wrong` instead of p: noncentral chi-square
    with the test's degrees of freedom and noncentrality n * sum((wrong - p)^2 / p) over its bins."""
    p_bins, wrong_bins = pooled(p, p * n), pooled(wrong / wrong.sum(), p * n)
    keep = p_bins > 0
    df = int(keep.sum()) - 1
    noncentrality = n * float((((wrong_bins - p_bins) ** 2)[keep] / p_bins[keep]).sum())
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, noncentrality))


@dataclass
class SystemRun:
    """What a case's requests produced, and the first round's p and q as the gateway saw them."""

    firsts: np.ndarray
    seconds: dict = field(default_factory=dict)  # first token → the second tokens that followed it
    accepted: int = 0
    rejected_rounds: int = 0
    cache_hits: int = 0  # rounds whose drafts the draft's speculation cache had prepared
    p: Optional[np.ndarray] = None  # [V] first position, target
    q: Optional[np.ndarray] = None  # [V] first position, draft
    prompt: list = field(default_factory=list)


def run_system(models: PeakedModels, warp: Warp, drafter: str, rule: Callable, monkeypatch, cached: bool = False) -> SystemRun:
    """SAMPLES seeded requests (2 tokens, 2 drafts a round) through gateway, draft and verify over gRPC,
    with `rule` as the gateway's sampling rule (the real one, or a wrong one for a control). cached:
    3 tokens, 1 draft a round, so that after a rejected first draft the second token's round drafts
    from the draft's speculation cache (draft_service/speculation.py)."""
    recorded: list = []

    def recording(drafts, q, p, rng):
        if not recorded and len(drafts):
            recorded.append((q[0].copy(), p[0].copy()))
        return rule(drafts, q, p, rng)

    monkeypatch.setattr(gateway.engine, "rejection_sample", recording)
    draft_model = {"feature": models.feature_head, "eagle3": models.eagle3_head}.get(drafter, models.draft)
    running = start_cluster(models.target, drafter, draft_model, num_draft_tokens=1 if cached else 2,
                            speculated_outcomes=16 if cached else 4)
    try:
        stub = running.stub()
        sampling = common_pb2.SamplingParams(temperature=warp.temperature, top_k=warp.top_k, top_p=warp.top_p)
        request = dict(text="hello world", max_new_tokens=3 if cached else 2, sampling=sampling,
                       draft_length_policy=generate_pb2.DRAFT_LENGTH_POLICY_FIXED)  # always draft: exercise the rule
        run = SystemRun(firsts=np.empty(SAMPLES[drafter], dtype=np.int64))
        for seed in range(SAMPLES[drafter]):
            reply = stub.Generate(generate_pb2.GenerateRequest(**request, seed=seed), timeout=30)
            run.firsts[seed] = reply.token_ids[0]
            if len(reply.token_ids) > 1:
                run.seconds.setdefault(reply.token_ids[0], []).append(reply.token_ids[1])
            run.accepted += reply.stats.accepted_tokens
            run.rejected_rounds += reply.stats.rejected_rounds
            run.cache_hits += reply.stats.draft_cache_hits
            run.prompt = list(reply.prompt_token_ids)
        (run.q, run.p), = recorded[:1]
        return run
    finally:
        running.stop()


def target_distribution(models: PeakedModels, ids: list, warp: Warp) -> np.ndarray:
    """The target's warped next-token distribution after ids, as it crosses the wire."""
    from specd_engine.models import load_causal_lm

    target = load_causal_lm(str(models.target))
    with torch.inference_mode():
        logits = target.model(torch.tensor([ids])).logits[0, -1:]
    return decode_distribution(encode_distribution(warp_probs(logits, warp)[0].numpy()))


CASES = [
    (Warp(temperature=1.0), "model"),
    (Warp(temperature=0.8, top_k=8), "model"),
    (Warp(temperature=1.0, top_p=0.8), "model"),
    (Warp(temperature=1.0), "feature"),  # q is zero outside the head's vocabulary
    (Warp(temperature=1.0), "eagle3"),  # an EAGLE-3 checkpoint read through the target's layers 1, 2, 2
    (Warp(temperature=1.0), "feature-cached"),  # second tokens drafted from the speculation cache
]


@pytest.mark.parametrize("warp,drafter", CASES, ids=["t1", "topk8", "topp0.8", "t1-feature-head", "t1-eagle3-head",
                                                     "t1-feature-head-cached"])
def test_system_samples_follow_the_target(peaked, warp, drafter, monkeypatch):
    """Through gateway, draft and verify: the first token's frequencies match the target's p, and the
    second token's, after the most frequent first token, match p given that token; the test has power
    >= 0.99 against every wrong rule, computed from the p and q the gateway used."""
    cached = drafter.endswith("-cached")
    drafter = drafter.removesuffix("-cached")
    run = run_system(peaked, warp, drafter, rejection_sample, monkeypatch, cached)
    p = target_distribution(peaked, run.prompt, warp)
    np.testing.assert_allclose(run.p, p, atol=2e-3)  # the gateway judged with the target's p
    powers = {name: chi_square_power(emitted(p, run.q), p, run.firsts.size) for name, (_, emitted) in WRONG_RULES.items()}
    print(f"{drafter} {warp}: overlap of p and q {np.minimum(p, run.q).sum():.2f}; power at alpha {SIGNIFICANCE}: "
          + ", ".join(f"{name} {power:.4f}" for name, power in powers.items()))
    assert min(powers.values()) >= REQUIRED_POWER, powers
    assert run.accepted > 0 and run.rejected_rounds > 0, "drafts must be both accepted and rejected"
    if cached:
        assert run.cache_hits >= 50, f"{run.cache_hits} cache hits in {run.firsts.size} requests"
    assert chi_square_p_value(run.firsts, p) > SIGNIFICANCE
    first = int(np.bincount(run.firsts).argmax())
    seconds = np.array(run.seconds[first])
    assert seconds.size >= 100
    assert chi_square_p_value(seconds, target_distribution(peaked, run.prompt + [first], warp)) > SIGNIFICANCE


@pytest.mark.parametrize("name", list(WRONG_RULES))
def test_a_wrong_rule_in_the_gateway_fails_the_test(peaked, name, monkeypatch):
    """Controls: each known-wrong rule swapped into the running gateway makes the first-token test fail."""
    rule, _ = WRONG_RULES[name]
    warp = Warp(temperature=1.0)
    run = run_system(peaked, warp, "model", rule, monkeypatch)
    assert chi_square_p_value(run.firsts, target_distribution(peaked, run.prompt, warp)) < SIGNIFICANCE


def test_seeded_samples_drawn_by_the_verify_follow_the_target(peaked):
    """Seeded sampled requests through gateway, draft and verify, every token drawn by the verify
    (VerifyRequest.coupled_draw): target-only, and speculative under the adaptive policy, whose draft
    then drafts greedily and whose rounds the coupled rule judges. Seed for seed the two answers are
    the same, and the first token follows the target's p."""
    warp = Warp(temperature=1.0, top_k=8)
    running = start_cluster(peaked.target, "model", peaked.draft, num_draft_tokens=2)
    try:
        stub = running.stub()
        sampling = common_pb2.SamplingParams(temperature=warp.temperature, top_k=warp.top_k)
        request = dict(text="hello world", max_new_tokens=2, sampling=sampling)
        firsts, drafted, prompt = [], 0, []
        for seed in range(SAMPLES["model"]):
            alone = stub.Generate(generate_pb2.GenerateRequest(**request, seed=seed, disable_speculation=True), timeout=30)
            spec = stub.Generate(generate_pb2.GenerateRequest(**request, seed=seed), timeout=30)
            assert list(spec.token_ids) == list(alone.token_ids), seed
            firsts.append(alone.token_ids[0])
            drafted += spec.stats.draft_tokens
            prompt = list(alone.prompt_token_ids)
    finally:
        running.stop()
    assert drafted > 0
    assert chi_square_p_value(np.array(firsts), target_distribution(peaked, prompt, warp)) > SIGNIFICANCE


MOST_TREE_SAMPLES = 8000  # requests at most (~25 per second here): past that the test cannot reach its power


def samples_for_power(wrongs: dict, p: np.ndarray, wanted: float, most: int, step: int = 250) -> int:
    """The fewest samples (a multiple of `step`, at most `most`) at which the chi-square test catches every
    wrong output distribution in `wrongs` with power ≥ `wanted`; `most` + 1 where none does. Sized from the
    run's own p and q because the random tiny head's q differs between CPUs (floating point), and with it
    how far each wrong rule lands from p."""
    for n in range(step, most + 1, step):
        if all(chi_square_power(wrong, p, n) >= wanted for wrong in wrongs.values()):
            return n
    return most + 1


def test_system_tree_samples_follow_the_target(peaked, monkeypatch):
    """Sampled tree rounds through gateway, draft and verify (feature head, 3 candidates a position,
    drawn without replacement): the first token follows the target's p. The first request records the p
    and q the gateway used; from them the test draws as many requests as give power ≥ 0.99 against both
    wrong rules: ignoring the residual after a rejection, and not shrinking q after each candidate (the
    subtle one: this untrained head overlaps p by ~0.05, so few candidates are accepted and ~3,000 requests
    are needed). test_tree_sampling.py catches both at toy level, with a control that fails."""
    from tests.test_tree_sampling import exact_output

    recorded: list = []
    real_rule = gateway.engine.tree_rejection_sample

    def recording(tokens, parents, q_rows, p, rng):
        if not recorded:
            recorded.append((q_rows[0].copy(), p[0].copy()))
        return real_rule(tokens, parents, q_rows, p, rng)

    monkeypatch.setattr(gateway.engine, "tree_rejection_sample", recording)
    warp = Warp(temperature=1.0, top_k=8)
    running = start_cluster(peaked.target, "feature", peaked.feature_head, num_draft_tokens=2)
    try:
        stub = running.stub()
        sampling = common_pb2.SamplingParams(temperature=warp.temperature, top_k=warp.top_k)
        request = dict(text="hello world", max_new_tokens=3, sampling=sampling, draft_branches=3,
                       draft_length_policy=generate_pb2.DRAFT_LENGTH_POLICY_FIXED)

        def first_token(seed: int) -> int:
            reply = stub.Generate(generate_pb2.GenerateRequest(**request, seed=seed), timeout=30)
            return reply.token_ids[0], list(reply.prompt_token_ids)

        first, prompt = first_token(0)
        assert recorded, "no tree round ran"
        q, used = recorded[0]
        p = target_distribution(peaked, prompt, warp)
        np.testing.assert_allclose(used, p, atol=2e-3)  # the gateway judged with the target's p
        support = np.flatnonzero((p > 0) | (q > 0))
        wrongs = {name: exact_output(p[support], q[support], 3, **wrong)
                  for name, wrong in (("no residual", dict(update_target=False)),
                                      ("q not shrunk", dict(update_proposal=False)))}
        samples = samples_for_power(wrongs, p[support], REQUIRED_POWER, MOST_TREE_SAMPLES)
        print(f"tree rounds: overlap of p and q {np.minimum(p, q).sum():.2f}; {samples} requests")
        assert samples <= MOST_TREE_SAMPLES, f"no sample count up to {MOST_TREE_SAMPLES} reaches power {REQUIRED_POWER}"
        firsts = np.array([first] + [first_token(seed)[0] for seed in range(1, samples)], dtype=np.int64)
    finally:
        running.stop()
    assert chi_square_p_value(firsts, p) > SIGNIFICANCE
