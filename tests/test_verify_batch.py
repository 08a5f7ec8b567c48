"""VerifyBatch: several sessions' Verifies in one call (verify_service/service.py) and the gateway's
coalescing of its streams' Verifies into it (gateway/verify_batch.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from gateway.verify_batch import PartError, VerifyCoalescer
from specd.v1 import common_pb2, generate_pb2, verify_pb2, verify_pb2_grpc
from specd_common.config import BatchPolicy
from specd_common.tree import MAX_VERIFY_PARTS

PATIENT = BatchPolicy(max_wait_ms=5000, wait_fraction=200)  # a collector waits for every stream it expects (up to 200 calls' time)


class FakeStub:
    """Verify answers with the session id's length as argmax; VerifyBatch answers each part so, or as told."""

    def __init__(self, batch_error=None, fail_part: str = "", batch_seconds: float = 0.0):
        self.batch_error, self.fail_part, self.batch_seconds = batch_error, fail_part, batch_seconds
        self.unary_seconds = 0.02  # a call's time bounds a collector's wait (a tenth of a second under PATIENT)
        self.unary, self.batches = [], []
        self._lock = threading.Lock()

    @staticmethod
    def reply(request) -> verify_pb2.VerifyResponse:
        return verify_pb2.VerifyResponse(argmax_token_ids=[len(request.session_id)], sequence_length=7)

    def Verify(self, request, timeout):
        with self._lock:
            self.unary.append(request.session_id)
        time.sleep(self.unary_seconds)
        return self.reply(request)

    def VerifyBatch(self, request, timeout):
        with self._lock:
            self.batches.append([part.session_id for part in request.parts])
        time.sleep(self.batch_seconds)
        if self.batch_error is not None:
            raise PartError(self.batch_error, f"fake {self.batch_error.name}")
        return verify_pb2.VerifyBatchResponse(results=[
            verify_pb2.VerifyBatchResult(code=grpc.StatusCode.NOT_FOUND.value[0], message="no such session")
            if part.session_id == self.fail_part else verify_pb2.VerifyBatchResult(response=self.reply(part))
            for part in request.parts])


def warmed(stub: FakeStub, ids: list[str], open_sessions: int = 0) -> VerifyCoalescer:
    """A coalescer that has seen each of `ids` verify once (it waits only for streams that verified
    lately), with the stub's record of those calls cleared."""
    coalescer = VerifyCoalescer(stub, lambda: open_sessions or len(ids), PATIENT)
    for session_id in ids:
        coalescer.verify(verify_pb2.VerifyRequest(session_id=session_id), 10.0)
    stub.unary.clear()
    return coalescer


def drive(coalescer: VerifyCoalescer, ids: list[str], timeouts: dict = {}) -> dict:
    """Each id's Verify from its own thread at once: its reply, or the error it raised."""

    def one(session_id: str):
        try:
            return coalescer.verify(verify_pb2.VerifyRequest(session_id=session_id), timeouts.get(session_id, 10.0))
        except grpc.RpcError as error:
            return error

    with ThreadPoolExecutor(len(ids)) as pool:
        return dict(zip(ids, pool.map(one, ids)))


def test_streams_due_together_share_one_call_and_each_gets_its_own_reply():
    stub = FakeStub()
    got = drive(warmed(stub, ["a", "bb", "ccc"]), ["a", "bb", "ccc"])
    assert stub.unary == [] and len(stub.batches) == 1 and sorted(stub.batches[0]) == ["a", "bb", "ccc"]
    assert {key: list(reply.argmax_token_ids) for key, reply in got.items()} == {"a": [1], "bb": [2], "ccc": [3]}


def test_a_stream_alone_calls_verify_itself():
    stub = FakeStub()
    got = drive(warmed(stub, ["a"]), ["a"])
    assert stub.unary == ["a"] and stub.batches == [] and list(got["a"].argmax_token_ids) == [1]


def test_only_streams_seen_verifying_are_waited_for():
    """A coalescer waits for the streams that verified lately, not for every open session (one that
    prefills or waits for a draft would hold the others' rounds for the whole window)."""
    stub = FakeStub()
    coalescer = warmed(stub, ["a"], open_sessions=5)
    started = time.monotonic()
    got = drive(coalescer, ["a"])
    assert stub.unary == ["a"] and stub.batches == [] and time.monotonic() - started < 1.0
    assert list(got["a"].argmax_token_ids) == [1]


def test_a_stream_whose_call_is_on_its_way_is_not_waited_for():
    """Two groups a pass apart: a stream riding a call that went out just now (less than a call's time
    ago) cannot join, so the other goes at once instead of waiting the window (5 s here)."""
    stub = FakeStub()
    stub.unary_seconds = 0.3  # a call's time, as the coalescer measures it
    coalescer = warmed(stub, ["a"], open_sessions=2)  # "a" alone so far: its next call goes at once
    stub.unary_seconds = 0.6
    riding = threading.Thread(target=coalescer.verify, args=(verify_pb2.VerifyRequest(session_id="a"), 10.0))
    riding.start()
    time.sleep(0.05)
    started = time.monotonic()
    assert list(coalescer.verify(verify_pb2.VerifyRequest(session_id="bb"), 10.0).argmax_token_ids) == [2]
    riding.join(5)
    assert time.monotonic() - started < 0.9 and stub.batches == [] and sorted(stub.unary) == ["a", "bb"]


def test_a_part_that_fails_fails_its_caller_alone_with_its_own_status():
    stub = FakeStub(fail_part="bb")
    got = drive(warmed(stub, ["a", "bb", "ccc"]), ["a", "bb", "ccc"])
    assert isinstance(got["bb"], PartError) and got["bb"].code() == grpc.StatusCode.NOT_FOUND
    assert "no such session" in got["bb"].details()
    assert list(got["a"].argmax_token_ids) == [1] and list(got["ccc"].argmax_token_ids) == [3]


def test_a_failed_call_fails_every_part_with_its_status_for_the_failover():
    stub = FakeStub(batch_error=grpc.StatusCode.UNAVAILABLE)
    got = drive(warmed(stub, ["a", "bb"]), ["a", "bb"])
    assert all(isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE for error in got.values())


def test_a_verify_without_verify_batch_gets_unary_calls_from_then_on():
    stub = FakeStub(batch_error=grpc.StatusCode.UNIMPLEMENTED)
    coalescer = warmed(stub, ["a", "bb"])
    got = drive(coalescer, ["a", "bb"])
    assert not coalescer.supported and sorted(stub.unary) == ["a", "bb"] and len(stub.batches) == 1
    assert [list(got[key].argmax_token_ids) for key in ("a", "bb")] == [[1], [2]]
    drive(coalescer, ["a", "bb"])
    assert len(stub.batches) == 1 and len(stub.unary) == 4


def test_a_short_deadline_fails_its_own_part_and_not_the_call():
    """The call waits for its latest deadline; a part whose own deadline passes first fails alone."""
    stub = FakeStub(batch_seconds=0.5)
    coalescer = warmed(stub, ["hurried", "slow"])
    results = {}

    def patient():
        results["slow"] = coalescer.verify(verify_pb2.VerifyRequest(session_id="slow"), 10.0)

    first = threading.Thread(target=patient)
    first.start()  # the collector, waiting for the second stream it expects
    time.sleep(0.1)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as raised:
        coalescer.verify(verify_pb2.VerifyRequest(session_id="hurried"), 0.1)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 0.45
    first.join(5)
    assert list(results["slow"].argmax_token_ids) == [4] and sorted(stub.batches[0]) == ["hurried", "slow"]


def test_the_verify_scores_a_batch_as_each_part_alone_and_refuses_what_it_cannot(tiny):
    """Through a real verify: two sessions' parts in one VerifyBatch get what their own Verifies would
    (the same sessions' states, stepped alike), an unknown session's part fails NOT_FOUND alone, and a
    batch with a session twice or too many parts is refused whole."""
    from specd_common.config import ServerConfig
    from specd_engine.models import load_causal_lm
    from verify_service.app import start_verify_server

    server = start_verify_server(load_causal_lm(str(tiny.target)), ServerConfig(port=0, max_sessions=8))
    try:
        stub = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        prompts = {"a1": [5, 9, 14, 3], "b1": [7, 2, 30, 11, 6], "a2": [5, 9, 14, 3], "b2": [7, 2, 30, 11, 6]}
        for session_id, prompt in prompts.items():
            stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id=session_id, prompt_token_ids=prompt), timeout=30)

        def part(session_id: str, drafts: list[int]) -> verify_pb2.VerifyRequest:
            prompt = prompts.get(session_id, [1])
            return verify_pb2.VerifyRequest(session_id=session_id, draft_token_ids=drafts,
                                            commit=common_pb2.Commit(prefix_length=len(prompt), append_token_ids=[4]))

        batched = stub.VerifyBatch(verify_pb2.VerifyBatchRequest(parts=[part("a1", [8, 8]), part("nobody", []), part("b1", [3])]),
                                   timeout=30).results
        alone = [stub.Verify(part("a2", [8, 8]), timeout=30), stub.Verify(part("b2", [3]), timeout=30)]
        assert batched[1].code == grpc.StatusCode.NOT_FOUND.value[0] and "nobody" in batched[1].message
        assert [result.code for result in (batched[0], batched[2])] == [0, 0]
        for result, reply in zip((batched[0], batched[2]), alone):
            assert list(result.response.argmax_token_ids) == list(reply.argmax_token_ids)
            assert result.response.sequence_length == reply.sequence_length
        for parts, message in (([part("a1", []), part("a1", [])], "different session"),
                               ([part(f"s{i}", []) for i in range(MAX_VERIFY_PARTS + 1)], f"1 to {MAX_VERIFY_PARTS}")):
            with pytest.raises(grpc.RpcError) as refused:
                stub.VerifyBatch(verify_pb2.VerifyBatchRequest(parts=parts), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in refused.value.details()
    finally:
        server.stop()


def test_concurrent_streams_share_verify_batches_and_answer_as_each_alone(tiny):
    """Eight greedy requests at once through the three services (no draft service: the verify's
    Medusa heads draft) give each one's tokens alone, and their Verifies went in VerifyBatch calls."""
    from tests.conftest import start_cluster
    from tests.tiny_models import build_medusa_heads

    heads = build_medusa_heads(tiny.target, tiny.target.parent / "verify-batch-heads")
    prompts = [f"the quick brown fox {i}" for i in range(8)]

    def generate(stub, text: str) -> list[int]:
        request = generate_pb2.GenerateRequest(text=text, raw=True, max_new_tokens=16,
                                               sampling=common_pb2.SamplingParams(temperature=0.0))
        return list(stub.Generate(request, timeout=60).token_ids)

    cluster = start_cluster(tiny.target, "", medusa_heads=heads)
    try:
        stub = cluster.stub()
        alone = [generate(stub, text) for text in prompts]
        assert cluster.calls.counts["VerifyBatch"] == 0
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda text: generate(stub, text), prompts))
        assert together == alone
        assert cluster.calls.counts["VerifyBatch"] > 0
    finally:
        cluster.stop()
