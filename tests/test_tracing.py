"""Tracing end to end: `specd up` (three processes) exporting over OTLP/gRPC to a real receiver in the test.

The receiver implements opentelemetry.proto.collector.trace.v1.TraceService/Export with the
opentelemetry-proto stubs, so the services' exporters speak real OTLP to it. The services run with
tiny random models and are configured only by OTEL_* environment variables, as a user would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from specd.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from specd_common import telemetry
from tests.specd_stack import free_ports
from tests.tiny_models import build_model, build_tokenizer

REPO = Path(__file__).resolve().parents[1]
SERVER, CLIENT, INTERNAL = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT, trace_pb2.Span.SPAN_KIND_INTERNAL
STATUS_ERROR = trace_pb2.Status.STATUS_CODE_ERROR
ROUND_ATTRIBUTES = (
    "specd.round.index", "specd.round.lookup", "specd.round.heads", "specd.round.tree", "specd.draft.length", "specd.accepted.length", "specd.round.bonus", "specd.round.corrected",
    "specd.acceptance_rate_so_far", "specd.time.draft_wait_ms", "specd.time.verify_wait_ms", "specd.time.accept_ms",
    "specd.round.expected_tokens", "specd.round.passes",
)
STARTUP_TIMEOUT_S = 180.0
EXPORT_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------- the OTLP receiver


@dataclass
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    attributes: dict
    status: int
    start_ns: int
    end_ns: int


def _any_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def _attributes(key_values) -> dict:
    return {kv.key: _any_value(kv.value) for kv in key_values}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.kind,
                            _attributes(s.attributes), s.status.code, s.start_time_unix_nano, s.end_time_unix_nano,
                        )
                    )
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)


@pytest.fixture
def receiver():
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.endpoint = f"http://127.0.0.1:{port}"
    try:
        yield servicer
    finally:
        server.stop(0).wait()


# --------------------------------------------------------------------------- `specd up` with tiny models


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tracing-models")
    tokenizer = build_tokenizer()
    return (
        build_model(root / "target", seed=1, tokenizer=tokenizer),
        build_model(root / "draft", seed=2, layers=1, tokenizer=tokenizer),
    )



def specd_env(otlp_endpoint: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "protos"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_endpoint,
        OTEL_BSP_SCHEDULE_DELAY="100",
        SPECD_METRICS_PORT="-1",  # one value for all three children: metrics are test_metrics.py's business
        SPECD_LOG_LEVEL="WARNING",
    )
    return env


@pytest.fixture
def specd_up(receiver, tiny_models, tmp_path):
    target, draft = tiny_models
    gateway_port, draft_port, verify_port, http_port = free_ports(4)
    command = [
        sys.executable, "-m", "specd_app.cli", "up", "--target", str(target), "--drafter", "model",
        "--draft-model", str(draft), "--host", "127.0.0.1", "--gateway-port", str(gateway_port),
        "--draft-port", str(draft_port), "--verify-port", str(verify_port), "--threads", "1", "--http-port", str(http_port),
    ]
    log_path = tmp_path / "specd-up.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, env=specd_env(receiver.endpoint), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    address = f"127.0.0.1:{gateway_port}"
    try:
        wait_serving(address, process, log_path)
        yield address, http_port
    finally:
        stop(process)


def wait_serving(address: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"specd up exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    pytest.fail(f"specd up not serving after {STARTUP_TIMEOUT_S:.0f} s:\n{log_path.read_text()[-4000:]}")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM `specd up` (it stops its children); kill the whole process group if that takes too long."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


# --------------------------------------------------------------------------- the checks


@dataclass
class Trace:
    spans: list[ReceivedSpan]
    by_id: dict = field(init=False)

    def __post_init__(self):
        self.by_id = {s.span_id: s for s in self.spans}

    def named(self, name: str, service: str | None = None, kind: int | None = None) -> list[ReceivedSpan]:
        return [
            s for s in self.spans
            if s.name == name and (service is None or s.service == service) and (kind is None or s.kind == kind)
        ]

    def children(self, parent: ReceivedSpan, name: str | None = None) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.parent_id == parent.span_id and (name is None or s.name == name)]

    def parent(self, span: ReceivedSpan) -> ReceivedSpan:
        return self.by_id[span.parent_id]


def waterfall(trace: Trace, width: int = 40) -> str:
    """The trace as an indented text waterfall (printed, so a failing test shows what arrived)."""
    if not trace.spans:
        return "(no spans)"
    start = min(s.start_ns for s in trace.spans)
    scale = max(1, max(s.end_ns for s in trace.spans) - start) / width
    lines = []

    def walk(span: ReceivedSpan, depth: int) -> None:
        left = int((span.start_ns - start) / scale)
        bar = " " * left + "#" * max(1, int((span.end_ns - span.start_ns) / scale))
        label = f"{'  ' * depth}{span.name} [{span.service.removeprefix('specd-')}]"
        lines.append(f"{label:<58} {(span.end_ns - span.start_ns) / 1e6:8.2f} ms |{bar:<{width}}|")
        for child in sorted(trace.children(span), key=lambda s: s.start_ns):
            walk(child, depth + 1)

    for root in sorted((s for s in trace.spans if s.parent_id not in trace.by_id), key=lambda s: s.start_ns):
        walk(root, 0)
    return "\n".join(lines)


def trace_of(receiver: Receiver, trace_id: str) -> Trace:
    return Trace([s for s in receiver.snapshot() if s.trace_id == trace_id])


def wait_for_trace(receiver: Receiver, find_root, complete) -> Trace:
    """Poll the receiver until the request's trace has arrived completely (exports are batched per process)."""
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    while True:
        root = find_root(receiver.snapshot())
        if root is not None:
            trace = trace_of(receiver, root.trace_id)
            if complete(trace) or time.monotonic() > deadline:
                return trace
        elif time.monotonic() > deadline:
            pytest.fail(f"no gateway span arrived in {EXPORT_TIMEOUT_S:.0f} s; got {len(receiver.snapshot())} spans")
        time.sleep(0.2)


def is_complete(trace: Trace, stats) -> bool:
    """Whether every span the request's stats say it made has arrived: round spans whose passes add up
    to the target's, a Verify client and server span each, both Releases."""
    names = Counter(s.name for s in trace.spans)
    services = {s.service for s in trace.spans}
    rounds = trace.named("specd.round")
    return (
        services == {"specd-gateway", "specd-draft", "specd-verify"}
        and sum(r.attributes.get("specd.round.passes", 0) for r in rounds) >= stats.target_passes
        and names["specd.v1.VerifyService/Verify"] >= 2 * len(rounds)
        and names["specd.v1.VerifyService/Release"] == 2
        and names["specd.v1.DraftService/Release"] == 2
    )


def check_request_trace(trace: Trace, root: ReceivedSpan, stats, response_tokens: int, finish: str) -> None:
    # one trace across the three services, every parent link resolves inside it
    assert {s.service for s in trace.spans} == {"specd-gateway", "specd-draft", "specd-verify"}
    for s in trace.spans:
        if s is not root:
            assert s.parent_id in trace.by_id, f"{s.service} span {s.name} has a dangling parent"

    # the gateway's server span: GenAI attributes
    attributes = root.attributes
    assert root.service == "specd-gateway" and root.kind == SERVER
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.model"]
    assert attributes["gen_ai.request.max_tokens"] == 16
    assert "gen_ai.request.temperature" in attributes and "gen_ai.request.top_p" in attributes
    assert attributes["gen_ai.usage.output_tokens"] == response_tokens
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["gen_ai.response.finish_reasons"] == [finish]
    assert attributes["rpc.system"] == "grpc" and attributes["rpc.grpc.status_code"] == 0

    # one round span per round, children of the server span, with the specd.* attributes; its passes
    # (a plain round's Verify may decode several) add up to the target's
    rounds = sorted(trace.named("specd.round"), key=lambda s: s.attributes["specd.round.index"])
    assert sum(r.attributes["specd.round.passes"] for r in rounds) == stats.target_passes
    assert [r.attributes["specd.round.index"] for r in rounds] == list(range(len(rounds)))
    for r in rounds:
        assert r.service == "specd-gateway" and r.parent_id == root.span_id
        assert set(ROUND_ATTRIBUTES) <= set(r.attributes), set(ROUND_ATTRIBUTES) - set(r.attributes)
        a = r.attributes
        assert 0 <= a["specd.accepted.length"] <= a["specd.draft.length"]
        assert a["specd.round.bonus"] == (a["specd.accepted.length"] == a["specd.draft.length"])
        assert a["specd.round.corrected"] == (not a["specd.round.bonus"])
        assert a["specd.time.verify_wait_ms"] > 0 and a["specd.time.accept_ms"] >= 0
        assert (a["specd.time.draft_wait_ms"] > 0) == (a["specd.draft.length"] > 0 and not a["specd.round.lookup"])  # copies ask no draft
    assert sum(r.attributes["specd.draft.length"] for r in rounds) == stats.draft_tokens
    assert sum(r.attributes["specd.accepted.length"] for r in rounds) == stats.accepted_tokens
    assert sum(r.attributes["specd.round.expected_tokens"] for r in rounds) == pytest.approx(stats.predicted_tokens)
    assert sum((r.attributes["specd.accepted.length"] + r.attributes["specd.round.passes"] - r.attributes["specd.round.expected_tokens"]) ** 2
               for r in rounds) == pytest.approx(stats.predicted_tokens_squared_error)  # the prediction's noise, round by round
    # (a plain call's passes each kept the one token expected: no error)
    assert rounds[-1].attributes["specd.acceptance_rate_so_far"] == pytest.approx(
        stats.accepted_tokens / max(1, stats.draft_tokens)
    )

    # client spans per RPC, each the parent of the model service's server span
    for service, method in (("specd-verify", "specd.v1.VerifyService/Verify"), ("specd-draft", "specd.v1.DraftService/Propose")):
        clients = trace.named(method, "specd-gateway", CLIENT)
        servers = trace.named(method, service, SERVER)
        assert len(servers) == len(clients)
        assert all(trace.parent(c).name == "specd.round" for c in clients)
        assert sorted(trace.parent(s).span_id for s in servers) == sorted(c.span_id for c in clients)
        for server in servers:
            assert len(trace.children(server, "specd.kv_rollback")) == 1
            assert trace.children(server, "specd.model_forward"), f"{method} has no model forward span"
    assert len(trace.named("specd.v1.VerifyService/Verify", "specd-verify", SERVER)) == len(rounds)
    prefill = trace.named("specd.prefill")
    assert len(prefill) == 1 and prefill[0].parent_id == root.span_id
    for service, method in (("specd-verify", "specd.v1.VerifyService/Prefill"), ("specd-draft", "specd.v1.DraftService/Prefill")):
        (client,) = trace.named(method, "specd-gateway", CLIENT)
        (server,) = trace.named(method, service, SERVER)
        assert client.parent_id == prefill[0].span_id and server.parent_id == client.span_id
        assert trace.children(server, "specd.model_forward")
    for method in ("specd.v1.VerifyService/Release", "specd.v1.DraftService/Release"):
        (client,) = trace.named(method, "specd-gateway", CLIENT)
        assert client.parent_id == root.span_id


def test_one_trace_per_request_across_specd_up(receiver, specd_up):
    address, http_port = specd_up
    stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(address))

    # 1. unary, greedy: the gateway's server span is the root of the trace
    response = stub.Generate(
        generate_pb2.GenerateRequest(text="the quick brown fox", raw=True, max_new_tokens=16, seed=5), timeout=120
    )
    stats = response.stats
    assert stats.target_passes > 0 and stats.draft_tokens > 0

    def generate_root(spans):
        return next(
            (s for s in spans if s.name == "specd.v1.GenerateService/Generate" and s.kind == SERVER and s.status != STATUS_ERROR),
            None,
        )

    trace = wait_for_trace(receiver, generate_root, lambda t: is_complete(t, stats))
    root = generate_root(trace.spans)
    print(waterfall(trace))
    assert root.parent_id == ""
    finish = generate_pb2.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower()
    check_request_trace(trace, root, stats, len(response.token_ids), finish)

    # 2. streaming, sampled, joining the caller's trace through a W3C traceparent in the metadata
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    last = None
    for message in stub.GenerateStream(
        generate_pb2.GenerateRequest(
            text="hello world", raw=True, max_new_tokens=16, seed=3, sampling=common_pb2.SamplingParams(temperature=0.9)
        ),
        metadata=[("traceparent", f"00-{caller_trace}-{caller_span}-01")],
        timeout=120,
    ):
        last = message
    stream_stats = last.stats
    tokens = last.usage.completion_tokens
    trace = wait_for_trace(
        receiver,
        lambda spans: next((s for s in spans if s.trace_id == caller_trace and s.kind == SERVER and s.service == "specd-gateway"), None),
        lambda t: is_complete(t, stream_stats),
    )
    (root,) = trace.named("specd.v1.GenerateService/GenerateStream", "specd-gateway", SERVER)
    assert root.parent_id == caller_span
    trace.by_id[caller_span] = root  # the caller's span is outside the system; treat the link as resolved
    finish = generate_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    check_request_trace(trace, root, stream_stats, tokens, finish)

    # 3. a rejected request: an error span with the gRPC status, and no rounds
    with pytest.raises(grpc.RpcError):
        stub.Generate(generate_pb2.GenerateRequest(text="x", raw=True, max_new_tokens=10**6), timeout=30)
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    while time.monotonic() < deadline:
        errors = [s for s in receiver.snapshot() if s.name == "specd.v1.GenerateService/Generate" and s.status == STATUS_ERROR]
        if errors:
            break
        time.sleep(0.2)
    assert len(errors) == 1
    assert errors[0].attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not trace_of(receiver, errors[0].trace_id).named("specd.round")

    # 4. the OpenAI-compatible HTTP API: its SERVER span continues the caller's trace (traceparent
    #    header) and is the parent of the gateway's gRPC span, under which the whole request is traced
    http_trace, http_caller = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(
        model=client.models.list().data[0].id, prompt="the quick brown fox", max_tokens=16, temperature=0,
        extra_headers={"traceparent": f"00-{http_trace}-{http_caller}-01"},
    )
    http_stats = generate_pb2.SpeculationStats(**{k: v for k, v in reply.model_extra["specd"].items() if k != "acceptance_rate"})
    trace = wait_for_trace(
        receiver,
        lambda spans: next((s for s in spans if s.trace_id == http_trace and s.name == "specd.v1.GenerateService/Generate"), None),
        lambda t: is_complete(t, http_stats) and t.named("POST /v1/completions"),
    )
    print(waterfall(trace))
    (http_span,) = trace.named("POST /v1/completions", "specd-gateway", SERVER)
    assert http_span.parent_id == http_caller
    assert http_span.attributes["http.response.status_code"] == 200
    (root,) = trace.named("specd.v1.GenerateService/Generate", "specd-gateway", SERVER)
    assert root.parent_id == http_span.span_id
    trace.by_id[http_caller] = http_span  # the caller's span is outside the system
    check_request_trace(trace, root, http_stats, reply.usage.completion_tokens, reply.choices[0].finish_reason)


# --------------------------------------------------------------------------- configuration (in-process)


def test_no_endpoint_installs_nothing(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    assert not telemetry.tracing_configured()
    obs = telemetry.Observability.start("verify")
    try:
        assert obs.tracer_provider is None and not obs.tracing
        assert isinstance(obs.tracer, type(telemetry.trace.NoOpTracer()))
        assert obs.metrics_port is None  # metrics_port < 0: no endpoint either
    finally:
        obs.close()


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({}, False),
    ],
)
def test_tracing_is_configured_only_by_otel_variables(environ, expected):
    assert telemetry.tracing_configured(environ) is expected


def test_service_name_defaults_and_otel_service_name_wins(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # never contacted: nothing is exported
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider = telemetry.tracer_provider_from_env("specd-draft")
    try:
        assert provider.resource.attributes["service.name"] == "specd-draft"
        assert "0.25" in provider.sampler.get_description()
    finally:
        provider.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-draft")
    provider = telemetry.tracer_provider_from_env("specd-draft")
    try:
        assert provider.resource.attributes["service.name"] == "my-draft"
    finally:
        provider.shutdown()
