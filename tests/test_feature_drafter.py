"""The feature-head drafter: target features over the wire, the head's cache, and exactness end to end."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from draft_training import feature_data
from draft_service.feature_head import HeadCache, load_head
from gateway.features import FeatureLog
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from specd_engine.features import decode_features, encode_features
from specd_engine.models import load_causal_lm
from tests.conftest import start_cluster
from tests.test_services import FIXED, PROMPTS, assert_greedy_exact_with_drafts, generate, wait_for_no_sessions


@pytest.fixture(scope="module")
def feature_cluster(tiny):
    running = start_cluster(tiny.target, "feature", tiny.feature_head)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def target(tiny):
    return load_causal_lm(str(tiny.target), device="cpu", dtype="float32")


# --- units --------------------------------------------------------------------------------------------
def test_feature_log_keeps_committed_rows_and_slices():
    log = FeatureLog()
    rows = torch.arange(12, dtype=torch.float32).reshape(4, 3)  # 4 positions, hidden 3
    log.put(encode_features(rows[:2], 0))
    log.put(encode_features(rows[1:4], 1))  # overlaps: replaces from position 1
    assert log.rows == 4
    log.truncate(3)
    assert torch.equal(decode_features(log.slice(1, 3), 3), rows[1:3])
    with pytest.raises(ValueError, match="start at 5"):
        log.put(encode_features(rows[:1], 5))
    assert not log.slice(3, 3).data


def test_features_of_a_wrong_width_are_refused():
    message = encode_features(torch.zeros(2, 4), 0)
    with pytest.raises(Exception, match="hidden_size is 4"):
        decode_features(message, 8)


def test_head_cache_reads_in_pieces_what_a_full_pass_reads(tiny, target):
    head = load_head(tiny.feature_head, target.model)
    tokens = list(range(5, 25))
    features = feature_data.target_features(target.model, [tokens])[0].float()  # [20, H]
    with torch.inference_mode():
        full = head(torch.tensor([tokens[1:]]), features[None, :-1], torch.arange(1, 20))  # [1, 19, H]
        cache = HeadCache()
        first = head(torch.tensor([tokens[1:8]]), features[None, :7], torch.arange(1, 8), cache)
        second = head(torch.tensor([tokens[8:]]), features[None, 7:-1], torch.arange(8, 20), cache)
    assert torch.allclose(torch.cat((first, second), dim=1), full, atol=1e-5)
    assert cache.length == 19


def test_unrolled_passes_are_what_drafting_steps_compute(tiny, target):
    """The training-time test's pass j at position t (FeatureHead.unrolled) equals drafting step j from a
    cache holding the real context up to t - j + 1: same inputs, same keys attended. A mask that let pass
    j see pass 1's key at t itself (its real feature) would differ."""
    head = load_head(tiny.feature_head, target.model)
    tokens = list(range(5, 25))
    features = feature_data.target_features(target.model, [tokens])[0].float()  # [20, H]
    ids, positions = torch.tensor([tokens[1:]]), torch.arange(1, 20)  # row r: x_{r+1}, f_r, position r + 1
    with torch.inference_mode():
        passes = head.unrolled(ids, features[None, :-1], positions, 3)  # 3 × [1, 19, H]
        assert torch.allclose(passes[0], head(ids, features[None, :-1], positions), atol=1e-5)
        for first in (2, 9):  # drafting starts at row `first` with the real context before it
            cache = HeadCache()
            estimate = head(ids[:, : first + 1], features[None, : first + 1], positions[: first + 1], cache)[:, -1:]
            for step in (1, 2):
                row = first + step
                estimate = head(ids[:, row : row + 1], estimate, positions[row : row + 1], cache)  # [1, 1, H]
                assert torch.allclose(estimate[0, 0], passes[step][0, row], atol=1e-4), (first, step)
                assert not torch.allclose(passes[step][0, row], passes[0][0, row], atol=1e-3)


# --- the services -------------------------------------------------------------------------------------
def test_verify_returns_the_targets_features_at_the_positions_it_read(feature_cluster, target):
    stub = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{feature_cluster.verify.port}"))
    prompt, drafts = [5, 6, 7, 8, 9, 10], [11, 12]
    prefill = stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="f1", prompt_token_ids=prompt, return_features=True), timeout=30)
    reply = stub.Verify(
        verify_pb2.VerifyRequest(session_id="f1", commit=common_pb2.Commit(prefix_length=len(prompt)), draft_token_ids=drafts, return_features=True),
        timeout=30,
    )
    stub.Release(common_pb2.ReleaseRequest(session_id="f1"), timeout=10)
    expected = feature_data.target_features(target.model, [prompt + drafts])[0].float()  # [8, H]
    hidden = target.model.config.hidden_size
    assert prefill.features.start_position == 0 and reply.features.start_position == len(prompt) - 1
    got = torch.cat((decode_features(prefill.features, hidden), decode_features(reply.features, hidden)))  # [8, H]
    assert torch.allclose(got, expected, atol=2e-2)  # float16 on the wire


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_with_a_feature_head_equals_target_only_and_transformers(feature_cluster, tiny, prompt):
    assert_greedy_exact_with_drafts(feature_cluster, tiny.target, prompt, 30)


def test_propose_without_the_features_it_needs_fails_precondition(feature_cluster):
    stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{feature_cluster.draft.port}"))
    assert stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10).wants_target_features
    stub.Prefill(draft_pb2.DraftPrefillRequest(session_id="nf", prompt_token_ids=[5, 6, 7, 8]), timeout=30)
    try:
        with pytest.raises(grpc.RpcError) as error:
            stub.Propose(draft_pb2.ProposeRequest(session_id="nf", commit=common_pb2.Commit(prefix_length=4), num_draft_tokens=2), timeout=30)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "target features" in error.value.details()
    finally:
        stub.Release(common_pb2.ReleaseRequest(session_id="nf"), timeout=10)


def test_draft_greedy_tokens_match_a_full_recompute(tiny, target):
    """The serving path (cache, true features re-read after acceptance) drafts what a head reading
    the whole sequence from scratch would."""
    from draft_service.feature_drafter import FeatureDrafter
    from specd_engine.models import describe_model
    from specd_common.params import Warp

    head = load_head(tiny.feature_head, target.model)
    drafter = FeatureDrafter(head, describe_model(target), 512)
    tokens = list(range(5, 30))
    features = feature_data.target_features(target.model, [tokens])[0].float()
    session = drafter.open(tokens[:10], Warp())
    drafter.add_features(session, encode_features(features[:9], 0))
    drafter.propose(session, 3, np.random.default_rng(0))
    session.sequence.apply_commit(10, tokens[10:14])  # as if the target had produced 4 other tokens
    drafter.add_features(session, encode_features(features[9:13], 9))
    drafted = drafter.propose(session, 3, np.random.default_rng(0)).token_ids
    with torch.inference_mode():  # reference: no cache, the head's own estimates appended one by one
        sequence, previous, expected = tokens[:14], list(features[:13]), []
        for _ in range(3):
            estimate = head(torch.tensor([sequence[1:]]), torch.stack(previous)[None], torch.arange(1, len(sequence)))[0, -1]
            expected.append(int(head.vocab_ids[int(torch.argmax(head.logits(estimate)))]))
            sequence, previous = sequence + [expected[-1]], previous + [estimate]
    assert drafted == expected


def test_auto_drafter_is_the_shipped_head_only_for_the_default_target(monkeypatch, tmp_path):
    """With a draft service of its own (a GPU): the shipped feature head for the default target, else
    n-gram. Where draft and verify would share one CPU: the verify's Medusa heads, when shipped."""
    from specd_app import stack_choice
    from specd_common import config

    heads, head = tmp_path / "medusa", tmp_path / "feature"
    heads.mkdir(), head.mkdir()
    monkeypatch.setattr(config, "DEFAULT_FEATURE_HEAD", head)
    monkeypatch.setattr(config, "DEFAULT_MEDUSA_HEADS", heads)
    for one_cpu in (False, True):  # no Medusa heads shipped yet: the same answer either way
        assert stack_choice.resolve_drafter("auto", "", config.DEFAULT_TARGET, one_cpu) == ("ngram", "")  # no head shipped there
    (head / "feature_head.json").write_text("{}")
    assert stack_choice.resolve_drafter("auto", "", config.DEFAULT_TARGET, one_cpu=False) == ("feature", str(head))
    assert stack_choice.resolve_drafter("auto", "", config.DEFAULT_TARGET, one_cpu=True) == ("feature", str(head))
    (heads / "medusa_heads.json").write_text("{}")
    assert stack_choice.resolve_drafter("auto", "", config.DEFAULT_TARGET, one_cpu=True) == (config.HEADS_ONLY, "")
    assert stack_choice.resolve_drafter("auto", "", config.DEFAULT_TARGET, one_cpu=False) == ("feature", str(head))
    assert stack_choice.resolve_drafter("auto", "", "my/other-model", one_cpu=True) == ("ngram", "")
    assert stack_choice.resolve_drafter("model", "m", config.DEFAULT_TARGET, one_cpu=True) == ("model", "m")
    assert config.draft_service_default(config.DEFAULT_TARGET) == ("feature", str(head))


def test_a_bfloat16_head_drafts_too(tiny, target):
    """--dtype bfloat16 on the draft service: the head's scores are cast back to float32 for choosing."""
    from draft_service.app import make_drafter
    from specd_common.params import Warp

    drafter = make_drafter("feature", str(tiny.feature_head), dtype="bfloat16")
    assert next(drafter.head.parameters()).dtype == torch.bfloat16
    prompt = list(range(5, 15))
    session = drafter.open(prompt, Warp(temperature=1.0))
    drafter.add_features(session, encode_features(feature_data.target_features(target.model, [prompt])[0][:-1], 0))
    proposal = drafter.propose(session, 3, np.random.default_rng(0))
    assert len(proposal.token_ids) == 3 and len(proposal.draft_probs) == 3


# --- trees (specd_common/tree.py) through the services ---------------------------------------------------
def test_verify_scores_a_tree_and_keeps_the_committed_path(feature_cluster, target):
    """Over real gRPC: every node's argmax equals a chain verify of its path, and after a commit that
    appends one path + correction the session answers what a fresh session would."""
    stub = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{feature_cluster.verify.port}"))
    prompt, nodes, parents = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [-1, 0, -1, 2]  # two branches of two

    def open_session(name: str, tokens: list[int]) -> None:
        stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id=name, prompt_token_ids=tokens), timeout=30)

    def verify(name: str, prefix: int, append=(), drafts=(), tree=()) -> list[int]:
        request = verify_pb2.VerifyRequest(session_id=name, commit=common_pb2.Commit(prefix_length=prefix, append_token_ids=append),
                                           draft_token_ids=drafts, draft_parents=tree)
        return list(stub.Verify(request, timeout=30).argmax_token_ids)

    try:
        open_session("tree", prompt)
        scored = verify("tree", len(prompt), drafts=nodes, tree=parents)
        open_session("branch-a", prompt)
        open_session("branch-b", prompt)
        assert scored[:3] == verify("branch-a", len(prompt), drafts=[11, 12])
        assert [scored[0], scored[3], scored[4]] == verify("branch-b", len(prompt), drafts=[13, 14])
        # keep the second branch's first node, then a correction; the next pass must see exactly that
        after = verify("tree", len(prompt), append=[13, 40], drafts=[41, 42])
        open_session("fresh", prompt + [13, 40])
        assert after == verify("fresh", len(prompt) + 2, drafts=[41, 42])
        with pytest.raises(grpc.RpcError) as error:
            verify("tree", len(prompt) + 4, drafts=[1, 1], tree=[-1, -1])
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "siblings must differ" in error.value.details()
    finally:
        for name in ("tree", "branch-a", "branch-b", "fresh"):
            stub.Release(common_pb2.ReleaseRequest(session_id=name), timeout=10)


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_tree_rounds_equal_target_only(feature_cluster, tiny, prompt):
    stub = feature_cluster.stub()
    tree_rounds = generate(stub, text=prompt, max_new_tokens=30, draft_length_policy=FIXED, draft_branches=3)
    chains = generate(stub, text=prompt, max_new_tokens=30, draft_length_policy=FIXED)
    target_only = generate(stub, text=prompt, max_new_tokens=30, disable_speculation=True)
    assert list(tree_rounds.token_ids) == list(target_only.token_ids)
    assert tree_rounds.stats.draft_tokens >= tree_rounds.stats.target_passes - 1  # it drafted every round
    # trees went over the wire (3x the nodes, their parents and feature rows), not chains only
    per_pass = [reply.stats.wire_bytes / reply.stats.target_passes for reply in (tree_rounds, chains)]
    assert per_pass[0] > 1.5 * per_pass[1], per_pass
    assert wait_for_no_sessions(feature_cluster) == {"verify": 0, "draft": 0}


def test_sampled_tree_rounds_run_and_are_reproducible_by_seed(feature_cluster):
    """Sampling with trees (their distribution is tested in test_statistical / test_tree_sampling):
    the rounds run, carry trees, and the same seed gives the same tokens."""
    stub = feature_cluster.stub()
    request = dict(text=PROMPTS[0], max_new_tokens=12, draft_length_policy=FIXED,
                   sampling=common_pb2.SamplingParams(temperature=0.8, top_k=20), seed=7)
    trees, again = (generate(stub, **request, draft_branches=3) for _ in range(2))
    chains = generate(stub, **request)
    assert list(trees.token_ids) == list(again.token_ids) and trees.stats.draft_tokens > 0
    per_pass = [reply.stats.wire_bytes / reply.stats.target_passes for reply in (trees, chains)]
    assert per_pass[0] > 1.5 * per_pass[1], per_pass


def test_too_many_tree_nodes_are_refused_with_what_to_fix(feature_cluster):
    with pytest.raises(grpc.RpcError) as error:
        generate(feature_cluster.stub(), text=PROMPTS[0], max_new_tokens=4, num_draft_tokens=16, draft_branches=3)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft_branches" in error.value.details()
