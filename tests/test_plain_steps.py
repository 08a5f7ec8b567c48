"""Plain decoding of several passes in one Verify (VerifyRequest.plain_steps; --plain-steps).

A plain call's tokens must be exactly those of one Verify a pass with the commits between them, greedy
and with the coupled rule's draws, alone and beside other sessions in one VerifyBatch; a stop token ends
it; the session it leaves takes the next commit as after a kept chain; and the gateway's answers are the
same whether it asks for one pass a call or several.
"""

from __future__ import annotations

import grpc
import pytest

from specd.v1 import common_pb2, generate_pb2, verify_pb2, verify_pb2_grpc
from specd_common.tree import MAX_PLAIN_STEPS
from tests.conftest import start_cluster

PROMPTS = [[5, 17, 42, 9, 3], [11, 12, 13], [40, 2, 7, 7, 19, 23, 8]]
SAMPLED = common_pb2.SamplingParams(temperature=0.8, top_p=0.95)


@pytest.fixture(scope="module")
def stack(tiny):
    """The tiny target's verify and a gateway with no draft service, asking for 4 passes a plain call."""
    running = start_cluster(tiny.target, "", plain_steps=4)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def verify(stack):
    return verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.verify.port}"))


def _open(verify, session_id: str, prompt: list[int], sampling=None) -> None:
    verify.Prefill(verify_pb2.VerifyPrefillRequest(session_id=session_id, prompt_token_ids=prompt, sampling=sampling), timeout=30)


def _chosen(reply: verify_pb2.VerifyResponse, sampled: bool) -> list[int]:
    return list(reply.sampled_token_ids if sampled else reply.argmax_token_ids)


def _one_pass_a_call(verify, session_id: str, prompt: list[int], passes: int, sampling=None, seed: int = 0) -> list[int]:
    """`passes` tokens, one plain Verify each, every token committed before the next pass."""
    _open(verify, session_id, prompt, sampling)
    sequence, tokens = list(prompt), []
    try:
        for _ in range(passes):
            commit = common_pb2.Commit(prefix_length=len(sequence) - bool(tokens), append_token_ids=tokens[-1:])
            request = verify_pb2.VerifyRequest(session_id=session_id, commit=commit)
            if sampling is not None:
                request.coupled_draw.seed = seed
            token = _chosen(verify.Verify(request, timeout=30), sampling is not None)[0]
            tokens.append(token)
            sequence.append(token)
    finally:
        verify.Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=10)
    return tokens


def _stepped(prompt: list[int], steps: int, session_id: str, sampling=None, seed: int = 0, stop=()) -> verify_pb2.VerifyRequest:
    request = verify_pb2.VerifyRequest(session_id=session_id, commit=common_pb2.Commit(prefix_length=len(prompt)),
                                       plain_steps=steps, stop_token_ids=list(stop))
    if sampling is not None:
        request.coupled_draw.seed = seed
    return request


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "coupled"])
def test_a_plain_call_decodes_what_one_call_a_pass_does(verify, sampling):
    for index, prompt in enumerate(PROMPTS):
        expected = _one_pass_a_call(verify, f"one-{index}", prompt, 9, sampling, seed=7)
        _open(verify, f"steps-{index}", prompt, sampling)
        try:
            first = verify.Verify(_stepped(prompt, 5, f"steps-{index}", sampling, seed=7), timeout=30)
            assert _chosen(first, sampling is not None) == expected[:5]
            assert first.sequence_length == len(prompt)
            # the session holds all but the last token, as after a chain whose drafts were all kept
            commit = common_pb2.Commit(prefix_length=len(prompt) + 4, append_token_ids=expected[4:5])
            rest = verify_pb2.VerifyRequest(session_id=f"steps-{index}", commit=commit, plain_steps=4)
            if sampling is not None:
                rest.coupled_draw.seed = 7
            assert _chosen(verify.Verify(rest, timeout=30), sampling is not None) == expected[5:9]
        finally:
            verify.Release(common_pb2.ReleaseRequest(session_id=f"steps-{index}"), timeout=10)


def test_plain_calls_beside_each_other_in_one_batch_stop_where_each_must(verify):
    """Three sessions' plain calls in one VerifyBatch (one pass for all, the batcher queueing each
    session's next pass): each gets its own tokens; the one given its third token as a stop id ends there."""
    expected = [_one_pass_a_call(verify, f"alone-{i}", prompt, 6) for i, prompt in enumerate(PROMPTS)]
    stop = expected[1][2]
    for i, prompt in enumerate(PROMPTS):
        _open(verify, f"batch-{i}", prompt)
    try:
        parts = [_stepped(prompt, 6, f"batch-{i}", stop=[stop] if i == 1 else []) for i, prompt in enumerate(PROMPTS)]
        results = verify.VerifyBatch(verify_pb2.VerifyBatchRequest(parts=parts), timeout=30).results
        assert [result.code for result in results] == [0, 0, 0]
        got = [list(result.response.argmax_token_ids) for result in results]
        assert got[0] == expected[0] and got[2] == expected[2]
        assert got[1] == expected[1][: expected[1].index(stop) + 1]
    finally:
        for i in range(len(PROMPTS)):
            verify.Release(common_pb2.ReleaseRequest(session_id=f"batch-{i}"), timeout=10)


def test_plain_steps_are_checked(verify):
    _open(verify, "checked", PROMPTS[0])
    try:
        for request in (_stepped(PROMPTS[0], MAX_PLAIN_STEPS + 1, "checked"),
                        verify_pb2.VerifyRequest(session_id="checked", commit=common_pb2.Commit(prefix_length=5),
                                                 plain_steps=3, draft_token_ids=[4]),
                        verify_pb2.VerifyRequest(session_id="checked", commit=common_pb2.Commit(prefix_length=5),
                                                 plain_steps=3, top_logprobs=2),
                        _stepped(PROMPTS[0], 3, "checked", stop=[10**6])):
            with pytest.raises(grpc.RpcError) as caught:
                verify.Verify(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "plain_steps" in caught.value.details() or "stop_token_ids" in caught.value.details()
    finally:
        verify.Release(common_pb2.ReleaseRequest(session_id="checked"), timeout=10)


@pytest.mark.parametrize("sampling", [common_pb2.SamplingParams(), common_pb2.SamplingParams(temperature=0.8, top_k=20)],
                         ids=["greedy", "sampled"])
def test_the_gateway_answers_the_same_with_one_pass_a_call_or_several(tiny, stack, sampling):
    one = start_cluster(tiny.target, "", plain_steps=1)
    try:
        for prompt in ("hello world", "def add(a, b):"):
            request = generate_pb2.GenerateRequest(text=prompt, max_new_tokens=23, sampling=sampling, seed=11,
                                                   disable_speculation=True)
            before = {name: cluster.calls.counts["Verify"] + cluster.calls.counts["VerifyBatch"] for name, cluster in
                      (("several", stack), ("single", one))}
            several, single = stack.stub().Generate(request, timeout=60), one.stub().Generate(request, timeout=60)
            assert list(several.token_ids) == list(single.token_ids) and several.text == single.text
            assert several.finish_reason == single.finish_reason
            assert several.stats.target_passes == single.stats.target_passes == len(single.token_ids)
            calls = {name: cluster.calls.counts["Verify"] + cluster.calls.counts["VerifyBatch"] - before[name]
                     for name, cluster in (("several", stack), ("single", one))}
            # a call a pass (the first token may come with the prefill), or one for up to 4 passes
            assert calls["single"] in (len(single.token_ids), len(single.token_ids) - 1)
            assert calls["several"] == -(-calls["single"] // 4)
    finally:
        one.stop()
