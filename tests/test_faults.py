"""Faults, multi-process on loopback: kill -9 a draft or a verify replica mid-stream.

Each service runs as its own `specd serve` process with a tiny model and one torch thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import grpc
import pytest

from specd.v1 import generate_pb2, generate_pb2_grpc
from tests.specd_stack import free_ports, serve, wait_serving

PROMPT = "hello world"
MAX_NEW = 400


def kill9(process: subprocess.Popen) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def stream(address: str, **fields):
    stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(address))
    return stub.GenerateStream(generate_pb2.GenerateRequest(text=PROMPT, max_new_tokens=MAX_NEW, **fields), timeout=120)


def target_only(address: str) -> list[int]:
    return [t for m in stream(address, disable_speculation=True) for t in m.token_ids]


@pytest.fixture(scope="module")
def models(tiny):
    return tiny


@pytest.mark.parametrize("drafter", ["model", "feature"])  # the feature head's draft prepares rounds in its speculation cache
def test_killing_the_draft_mid_stream_falls_back_to_exact_target_only(models, tmp_path, drafter):
    verify_port, draft_port, gateway_port = free_ports(3)
    head = str(models.draft_same if drafter == "model" else models.feature_head)
    with serve("verify", verify_port, tmp_path, "--model", str(models.target), "--threads", "1"), serve(
        "draft", draft_port, tmp_path, "--drafter", drafter, "--model", head, "--threads", "1"
    ) as draft:
        wait_serving(verify_port, draft_port)
        # no lookup rounds: every round after the kill must be target-only for the count below
        with serve("gateway", gateway_port, tmp_path, "--verify-address", f"127.0.0.1:{verify_port}",
                   "--draft-address", f"127.0.0.1:{draft_port}", "--num-draft-tokens", "3", "--lookup-tokens", "0"):
            wait_serving(gateway_port)
            address = f"127.0.0.1:{gateway_port}"
            messages = stream(address)
            received = list(next(messages).token_ids)
            kill9(draft)
            rest = list(messages)
            received += [t for m in rest for t in m.token_ids]
            stats = rest[-1].stats
            assert rest[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
            assert received == target_only(address)  # exact, despite losing the draft
            assert stats.draft_tokens > 0, "speculation never ran before the kill"
            if drafter == "model":  # with an identical draft every speculative round emits 4 tokens; target-only rounds 1
                assert stats.target_passes > MAX_NEW // 4 + 10, "no round ran without the draft: the kill came too late"


@pytest.mark.parametrize("drafter", ["model", "feature"])  # a feature drafter also needs the new replica's features
def test_killing_a_verify_replica_mid_stream_replays_on_the_other(models, tmp_path, drafter):
    port_a, port_b, draft_port, gateway_port = free_ports(4)
    draft_model = models.feature_head if drafter == "feature" else models.draft_noisy
    with serve("verify", port_a, tmp_path, "--model", str(models.target), "--threads", "1"), serve(
        "verify", port_b, tmp_path, "--model", str(models.target), "--threads", "1"
    ) as verify_b, serve("draft", draft_port, tmp_path, "--drafter", drafter, "--model", str(draft_model), "--threads", "1"):
        wait_serving(port_a, port_b, draft_port)
        with serve("gateway", gateway_port, tmp_path, "--verify-address", f"127.0.0.1:{port_a},127.0.0.1:{port_b}",
                   "--draft-address", f"127.0.0.1:{draft_port}"):
            wait_serving(gateway_port)
            address = f"127.0.0.1:{gateway_port}"
            expected = target_only(address)  # the first request pins replica A (round-robin) ...
            messages = stream(address)  # ... and the second one B
            received = list(next(messages).token_ids)
            kill9(verify_b)
            rest = list(messages)
            received += [t for m in rest for t in m.token_ids]
            assert rest[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
            assert received == expected  # nothing duplicated, nothing missing
            assert rest[-1].stats.draft_tokens > 0
        gateway_log = (tmp_path / f"gateway-127.0.0.1-{gateway_port}.log").read_text()
        assert "replaying on another" in gateway_log, "the stream ended before the kill: failover not exercised"
        assert "target-only rounds" not in gateway_log, "the draft failed after the failover (e.g. missing features)"


def test_losing_the_only_verify_gives_unavailable_with_the_partial_output(models, tmp_path):
    verify_port, gateway_port = free_ports(2)
    with serve("verify", verify_port, tmp_path, "--model", str(models.target), "--threads", "1") as verify:
        wait_serving(verify_port)
        with serve("gateway", gateway_port, tmp_path, "--verify-address", f"127.0.0.1:{verify_port}", "--draft-address", ""):
            wait_serving(gateway_port)
            messages = stream(f"127.0.0.1:{gateway_port}")
            received = list(next(messages).token_ids)
            kill9(verify)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                for message in messages:
                    received += message.token_ids
            assert time.monotonic() - started < 30, "the client waited too long for the failure"
            error = caught.value
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            metadata = dict(error.trailing_metadata())
            generated = [int(t) for t in metadata["specd-generated-token-ids"].split(",") if t]
            assert generated[: len(received)] == received and len(generated) >= len(received) > 0


# --- a draft that errs or stalls (in process: an interceptor on the draft service) ------------------


class TroubledPropose(grpc.ServerInterceptor):
    """After the draft's first `after` Propose calls, the next `times` fail with `code` or first sleep
    `delay_s`; the others behave."""

    def __init__(self, times: int, code: grpc.StatusCode | None = None, delay_s: float = 0.0, after: int = 0):
        self.left, self.code, self.delay_s, self.after = times, code, delay_s, after
        self.troubled = 0

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.endswith("DraftService/Propose"):
            return handler

        def propose(request, context):
            if self.after > 0:
                self.after -= 1
            elif self.left > 0:
                self.left -= 1
                self.troubled += 1
                if self.code is not None:
                    context.abort(self.code, "injected draft failure")
                time.sleep(self.delay_s)
            return handler.unary_unary(request, context)

        return handler._replace(unary_unary=propose)


def test_a_frozen_draft_with_its_cache_mid_stream_costs_speed_only(tiny, monkeypatch):
    """The feature head's draft answers from its speculation cache, then freezes (every Propose stalls past
    --draft-timeout): the answer is still exactly target-only's."""
    import dataclasses

    import gateway.engine
    from gateway.policy import POLICY
    from tests.conftest import start_cluster

    frozen = TroubledPropose(1000, delay_s=1.0, after=4)
    monkeypatch.setattr(gateway.engine, "POLICY", dataclasses.replace(POLICY, draft_backoff_s=0.05))
    cluster = start_cluster(tiny.target, "feature", tiny.feature_head, model_interceptors=(frozen,), draft_timeout_s=0.3)
    try:
        request = dict(text="hello world", max_new_tokens=60, draft_length_policy=generate_pb2.DRAFT_LENGTH_POLICY_FIXED)
        expected = cluster.stub().Generate(generate_pb2.GenerateRequest(**request, disable_speculation=True), timeout=60)
        reply = cluster.stub().Generate(generate_pb2.GenerateRequest(**request), timeout=60)
    finally:
        cluster.stop()
    assert frozen.troubled > 0 and reply.stats.draft_cache_lookups > 0
    assert list(reply.token_ids) == list(expected.token_ids)


@pytest.mark.parametrize(
    "trouble", [TroubledPropose(1, code=grpc.StatusCode.INTERNAL), TroubledPropose(1, delay_s=1.0)], ids=["error", "slow"]
)
def test_a_draft_that_errs_or_stalls_costs_speed_only_and_is_reopened_after_the_backoff(tiny, trouble, monkeypatch):
    """A failing or too-slow (> --draft-timeout) Propose: the request goes on target-only (exact), the draft
    is re-opened after the back-off (a health probe, then a new Prefill), and its drafts are accepted again."""
    import dataclasses

    import gateway.engine
    from gateway.policy import POLICY
    from tests.conftest import start_cluster

    monkeypatch.setattr(gateway.engine, "POLICY", dataclasses.replace(POLICY, draft_backoff_s=0.05))  # re-open within this short request
    cluster = start_cluster(tiny.target, "model", tiny.draft_same, model_interceptors=(trouble,), draft_timeout_s=0.3)
    try:
        request = dict(text="hello world", max_new_tokens=60, draft_length_policy=generate_pb2.DRAFT_LENGTH_POLICY_FIXED)
        expected = cluster.stub().Generate(generate_pb2.GenerateRequest(**request, disable_speculation=True), timeout=60)
        prefills = cluster.calls.counts["Prefill"]
        started = time.monotonic()
        reply = cluster.stub().Generate(generate_pb2.GenerateRequest(**request), timeout=60)
        elapsed = time.monotonic() - started
    finally:
        cluster.stop()
    assert trouble.troubled == 1
    assert list(reply.token_ids) == list(expected.token_ids)
    assert cluster.calls.counts["Prefill"] - prefills == 3  # verify once, draft twice: opened, then re-opened after the back-off
    assert reply.stats.accepted_tokens > 0  # the identical draft is used again once back
    assert elapsed < 5.0  # a stalled draft costs one --draft-timeout (0.3 s), not its whole stall per round
