"""EAGLE-3 heads served through the three services: a checkpoint in a published layout (written the
way a user's folder holds it, by draft_service/eagle3_head.write_eagle3_checkpoint) loads in the draft
service, the draft names the target layers it reads, the verify returns exactly those layers' hidden
states side by side, and greedy output equals target-only and transformers'."""

from __future__ import annotations

import grpc
import pytest
import torch

from draft_service.eagle3_head import Eagle3Config, write_eagle3_checkpoint
from specd.v1 import common_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from specd_common.features import decode_features
from tests.conftest import start_cluster
from tests.test_services import PROMPTS, assert_greedy_exact_with_drafts
from tests.tiny_models import build_model, build_tokenizer

LAYERS = 8  # the EAGLE-3 default reads hidden_states (2, L // 2, L - 3) = (2, 4, 5)
DEFAULT_LAYERS = (2, 4, 5)


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("eagle3") / "target", seed=11, layers=LAYERS, tokenizer=build_tokenizer())


def head_config(target, layout: str) -> Eagle3Config:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target)
    return Eagle3Config(hidden_size=config.hidden_size, num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                        head_dim=config.hidden_size // config.num_attention_heads, intermediate_size=config.intermediate_size,
                        rms_norm_eps=config.rms_norm_eps, rope_theta=10000.0, rope_scaling=None, vocab_size=config.vocab_size,
                        draft_vocab_size=config.vocab_size // 2, target_hidden_size=config.hidden_size,
                        feature_layers=DEFAULT_LAYERS, layout=layout)


@pytest.fixture(scope="module", params=["eagle", "speculators"])
def eagle3_cluster(request, deep_target, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"eagle3-{request.param}")
    write_eagle3_checkpoint(folder, head_config(deep_target, request.param), seed=5)
    running = start_cluster(deep_target, "eagle3", folder)
    yield running
    running.stop()


def test_the_draft_names_the_layers_its_head_reads(eagle3_cluster):
    stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{eagle3_cluster.draft.port}"))
    info = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)
    assert info.drafter == "eagle3" and info.wants_target_features
    assert tuple(info.target_feature_layers) == DEFAULT_LAYERS


def test_the_verify_returns_the_layers_a_session_asks_for(eagle3_cluster, deep_target):
    """Rows are hidden_states[2], [4], [5] side by side (float16 on the wire), at the positions each call
    read; a session that names no layers on the same verify still gets the final hidden state."""
    from transformers import AutoModelForCausalLM

    stub = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{eagle3_cluster.verify.port}"))
    prompt, drafts = [5, 6, 7, 8, 9, 10], [11, 12]
    prefill = stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="l1", prompt_token_ids=prompt, return_features=True,
                                                           feature_layers=list(DEFAULT_LAYERS)), timeout=30)
    reply = stub.Verify(verify_pb2.VerifyRequest(session_id="l1", commit=common_pb2.Commit(prefix_length=len(prompt)),
                                                 draft_token_ids=drafts, return_features=True), timeout=30)
    plain = stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="l2", prompt_token_ids=prompt, return_features=True), timeout=30)
    for session in ("l1", "l2"):
        stub.Release(common_pb2.ReleaseRequest(session_id=session), timeout=10)
    model = AutoModelForCausalLM.from_pretrained(deep_target).eval()
    with torch.inference_mode():
        states = model(torch.tensor([prompt + drafts]), output_hidden_states=True).hidden_states  # L + 1 of [1, 8, H]
    hidden = model.config.hidden_size
    expected = torch.cat([states[layer][0] for layer in DEFAULT_LAYERS], dim=-1)  # [8, 3H]
    got = torch.cat((decode_features(prefill.features, 3 * hidden), decode_features(reply.features, 3 * hidden)))
    assert reply.features.start_position == len(prompt) - 1 and got.shape == expected.shape
    assert torch.allclose(got, expected, atol=2e-2)
    assert torch.allclose(decode_features(plain.features, hidden), states[-1][0, : len(prompt) - 1], atol=2e-2)


def test_layers_the_target_does_not_have_are_invalid_argument(eagle3_cluster):
    stub = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{eagle3_cluster.verify.port}"))
    for layers, features in (([2, LAYERS + 1], True), ([0], True), ([2], False)):
        with pytest.raises(grpc.RpcError) as error:
            stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="bad", prompt_token_ids=[5, 6], return_features=features,
                                                         feature_layers=layers), timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "feature_layers" in error.value.details()


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_with_an_eagle3_head_equals_target_only_and_transformers(eagle3_cluster, deep_target, prompt):
    assert_greedy_exact_with_drafts(eagle3_cluster, deep_target, prompt, 24)
