"""Sampled output follows the target distribution: chi-square tests at significance 1e-3, fixed seeds.

Two levels: the rejection rule on a real model's next-token distributions (the embedded default
target), and the whole system (gateway + services over gRPC, tiny models) on the first sampled token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gateway.rejection import rejection_sample
from specd.v1 import common_pb2, generate_pb2
from specd_common.distributions import decode_distribution, encode_distribution, sample_from
from specd_common.params import Warp
from specd_common.warping import warp_probs
from tests.conftest import start_cluster
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


@pytest.mark.parametrize(
    "warp,overlap,drafter",
    [
        (Warp(temperature=1.0), False, "model"),
        (Warp(temperature=0.8, top_k=8), False, "model"),
        (Warp(temperature=1.0, top_p=0.8), True, "model"),
        (Warp(temperature=1.0), False, "feature"),  # q is zero outside the head's vocabulary
    ],
    ids=["t1", "topk8", "topp0.8-overlap", "t1-feature-head"],
)
def test_system_samples_follow_the_target(tiny, warp, overlap, drafter):
    """Through gateway, draft and verify: the first sampled token's frequencies match the target's p."""
    from specd_common.models import load_causal_lm

    draft_model = tiny.feature_head if drafter == "feature" else tiny.draft_noisy
    running = start_cluster(tiny.target, drafter, draft_model, num_draft_tokens=2, overlap=overlap)
    try:
        stub = running.stub()
        sampling = common_pb2.SamplingParams(temperature=warp.temperature, top_k=warp.top_k, top_p=warp.top_p)
        request = dict(
            text="hello world", max_new_tokens=3, sampling=sampling,
            draft_length_policy=generate_pb2.DRAFT_LENGTH_POLICY_FIXED,  # always draft: exercise the rule
        )
        prompt = list(stub.Generate(generate_pb2.GenerateRequest(**request, seed=0), timeout=30).prompt_token_ids)
        firsts, accepted = [], 0
        for seed in range(1000):
            reply = stub.Generate(generate_pb2.GenerateRequest(**request, seed=seed), timeout=30)
            firsts.append(reply.token_ids[0])
            accepted += reply.stats.accepted_tokens
        target = load_causal_lm(str(tiny.target))
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt])).logits[0, -1:]
        p = decode_distribution(encode_distribution(warp_probs(logits, warp)[0].numpy()))
        assert accepted > 0, "no draft was ever accepted: the test would not exercise rejection sampling"
        assert chi_square_p_value(np.array(firsts), p) > SIGNIFICANCE
    finally:
        running.stop()
