"""Prometheus metrics: each service's /metrics endpoint, scraped over HTTP, moves with a request.

The three services run in-process on port 0 (gRPC and metrics) with tiny random models; each has
its own CollectorRegistry, so their numbers stay apart in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from draft_service.app import start_draft_server
from draft_service.drafters import ModelDrafter
from gateway.app import start_gateway_server
from gateway.options import GatewayOptions
from specd.v1 import common_pb2, draft_pb2_grpc, generate_pb2, generate_pb2_grpc
from specd_app.cli import build_parser
from specd_common.config import ServerConfig
from specd_engine.models import load_causal_lm
from tests.specd_stack import free_ports, scrape_metrics
from tests.tiny_models import build_model, build_tokenizer
from verify_service.app import start_verify_server

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics-models")
    tokenizer = build_tokenizer()
    target = build_model(root / "target", seed=1, tokenizer=tokenizer)
    draft = build_model(root / "draft", seed=2, layers=1, tokenizer=tokenizer)
    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=0, max_workers=8)
    started = []
    try:
        verify = start_verify_server(load_causal_lm(str(target), device="cpu"), config)
        started.append(verify)
        drafter = start_draft_server(ModelDrafter(load_causal_lm(str(draft), device="cpu")), config)
        started.append(drafter)
        gateway = start_gateway_server(
            f"127.0.0.1:{verify.port}", f"127.0.0.1:{drafter.port}", config,
            GatewayOptions(connect_timeout_s=30, lookup_tokens=0),  # every round a Propose (test_each_service_counts_a_request)
        )
        started.append(gateway)
        channel = grpc.insecure_channel(f"127.0.0.1:{gateway.port}")
        try:
            yield {"gateway": gateway, "draft": drafter, "verify": verify, "stub": generate_pb2_grpc.GenerateServiceStub(channel)}
        finally:
            channel.close()
    finally:
        for running in reversed(started):
            running.stop(grace_s=1.0)


def scrape(running) -> dict:
    """{(sample name, frozenset(labels)): value} from the service's /metrics over HTTP."""
    port = running.observability.metrics_port
    assert port, "the metrics endpoint did not start"
    return scrape_metrics("127.0.0.1", port)


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: dict, name: str, **labels) -> float:
    """Sum over every label set that includes `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def request(max_new_tokens: int = 16) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        text=PROMPT, raw=True, max_new_tokens=max_new_tokens, sampling=common_pb2.SamplingParams(temperature=0.0), seed=7
    )


def test_each_service_counts_a_request(services):
    before = {name: scrape(services[name]) for name in ("gateway", "draft", "verify")}
    response = services["stub"].Generate(request(), timeout=60)
    after = {name: scrape(services[name]) for name in ("gateway", "draft", "verify")}
    stats = response.stats
    assert stats.target_passes > 0 and stats.draft_tokens > 0

    def delta(where: str, name: str, **labels) -> float:
        return value(after[where], name, **labels) - value(before[where], name, **labels)

    def delta_total(where: str, name: str, **labels) -> float:
        return total(after[where], name, **labels) - total(before[where], name, **labels)

    # gateway: requests, speculation counters named like vLLM's, per-position acceptance, latencies
    assert delta("gateway", "specd_requests_total", service="gateway", method="Generate", code="OK") == 1
    assert delta("gateway", "specd_request_duration_seconds_count", service="gateway", method="Generate") == 1
    assert delta("gateway", "specd_spec_decode_num_draft_tokens_total") == stats.draft_tokens
    assert delta("gateway", "specd_spec_decode_num_accepted_tokens_total") == stats.accepted_tokens
    assert delta("gateway", "specd_target_passes_total") == stats.target_passes
    assert delta_total("gateway", "specd_spec_decode_num_accepted_tokens_per_pos_total") == stats.accepted_tokens
    assert delta_total("gateway", "specd_spec_decode_num_draft_tokens_per_pos_total") == stats.draft_tokens
    assert delta("gateway", "specd_spec_decode_num_draft_tokens_per_pos_total", position="0") == delta(
        "gateway", "specd_spec_decode_num_drafts_total"
    )
    assert delta("gateway", "specd_tokens_per_target_pass_count") == stats.target_passes
    assert delta("gateway", "specd_tokens_per_target_pass_sum") == len(response.token_ids)
    assert delta("gateway", "specd_time_to_first_token_seconds_count") == 1
    assert 0 < delta("gateway", "specd_inter_token_latency_seconds_count") < len(response.token_ids)
    assert delta("gateway", "specd_generation_tokens_total") == len(response.token_ids)
    assert delta("gateway", "specd_prompt_tokens_total") == len(response.prompt_token_ids)
    assert delta_total("gateway", "specd_request_finish_total") == 1
    # a round's phases once a round; a round is one Verify, of one pass or a plain call's several (--plain-steps)
    rounds = delta("verify", "specd_requests_total", service="verify", method="Verify", code="OK")
    assert delta("gateway", "specd_round_phase_seconds_count", phase="verify_wait") == rounds <= stats.target_passes
    assert value(after["gateway"], "specd_active_sessions", service="gateway") == 0
    assert value(after["gateway"], "specd_queue_depth", service="gateway") == 0

    # draft and verify: one RPC per round each, a prefill and a release, forward passes, sessions freed
    drafts = delta("gateway", "specd_spec_decode_num_drafts_total")
    assert delta("draft", "specd_requests_total", service="draft", method="Propose", code="OK") == drafts
    for service in ("draft", "verify"):
        assert delta(service, "specd_requests_total", service=service, method="Prefill", code="OK") == 1
        assert delta(service, "specd_requests_total", service=service, method="Release", code="OK") == 1
        assert delta(service, "specd_model_forward_seconds_count", service=service) > 0
        assert value(after[service], "specd_active_sessions", service=service) == 0
        assert value(after[service], "specd_kv_cache_tokens", service=service) == 0
        assert value(after[service], "specd_queue_depth", service=service) == 0
    # health checks are not counted as requests
    assert total(after["verify"], "specd_requests_total", method="Check") == 0


def test_gauges_show_a_generation_in_progress(services):
    stream = services["stub"].GenerateStream(request(max_new_tokens=24), timeout=60)
    try:
        first = next(stream)
        assert first.token_ids
        gateway, verify = scrape(services["gateway"]), scrape(services["verify"])
        assert value(gateway, "specd_active_sessions", service="gateway") == 1
        assert value(gateway, "specd_queue_depth", service="gateway") == 1
        assert value(verify, "specd_active_sessions", service="verify") == 1
        assert value(verify, "specd_kv_cache_tokens", service="verify") >= len(first.prompt_token_ids)
    finally:
        for _ in stream:  # drain, so the generation finishes and releases its sessions
            pass
    assert value(scrape(services["gateway"]), "specd_active_sessions", service="gateway") == 0
    assert value(scrape(services["verify"]), "specd_active_sessions", service="verify") == 0


def test_the_gateway_reports_its_speculation_cap(services):
    """The cap in force (the default: set by the verify's measured batch costs and the rounds measured
    here; the smallest batch until 20 rounds are) is a gauge."""
    services["stub"].Generate(request(), timeout=60)
    cap = services["gateway"].servicer.backends.speculation_cap()
    assert cap in (0, 1, 2, 4, 8)  # no cap, or a batch size the verify measured (1: none pays)
    assert value(scrape(services["gateway"]), "specd_speculation_cap") == cap


def test_a_rejected_request_is_counted_with_its_status(services):
    before = scrape(services["gateway"])
    with pytest.raises(grpc.RpcError) as error:
        services["stub"].Generate(request(max_new_tokens=10**6), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(services["gateway"])
    labels = dict(service="gateway", method="Generate", code="INVALID_ARGUMENT")
    assert value(after, "specd_requests_total", **labels) - value(before, "specd_requests_total", **labels) == 1


def test_metrics_port_flag_defaults_per_service(monkeypatch):
    parser = build_parser()
    ports = {s: parser.parse_args(["serve", s]).metrics_port for s in ("gateway", "draft", "verify")}
    assert ports == {"gateway": 9464, "draft": 9465, "verify": 9466}
    assert parser.parse_args(["serve", "verify", "--metrics-port", "-1"]).metrics_port == -1
    monkeypatch.setenv("SPECD_METRICS_PORT", "0")
    assert build_parser().parse_args(["serve", "draft"]).metrics_port == 0


def test_a_cancelled_stream_leaves_no_active_generation(services):
    stream = services["stub"].GenerateStream(request(max_new_tokens=200), timeout=60)
    assert next(stream).token_ids
    stream.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the server notices the cancellation at its next message
        gateway = scrape(services["gateway"])
        if value(gateway, "specd_queue_depth", service="gateway") == 0:
            break
        time.sleep(0.05)
    assert value(gateway, "specd_active_sessions", service="gateway") == 0
    assert value(gateway, "specd_queue_depth", service="gateway") == 0
    assert value(gateway, "specd_requests_total", service="gateway", method="GenerateStream", code="CANCELLED") >= 1
    assert value(gateway, "specd_request_finish_total", finish_reason="cancelled") >= 1


def test_specd_serve_exposes_metrics_on_the_flagged_port(tmp_path):
    """The CLI path: `specd serve draft --metrics-port N` in its own process, scraped over HTTP."""
    grpc_port, metrics_port = free_ports(2)
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, SPECD_LOG_LEVEL="WARNING")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), str(repo / "protos"), env.get("PYTHONPATH")]))
    command = [
        sys.executable, "-m", "specd_app.cli", "serve", "draft", "--drafter", "ngram", "--host", "127.0.0.1",
        "--port", str(grpc_port), "--metrics-port", str(metrics_port),
    ]
    log_path = tmp_path / "draft.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            info = draft_pb2_grpc.DraftServiceStub(channel).GetModelInfo(
                common_pb2.GetModelInfoRequest(), timeout=60, wait_for_ready=True
            )
        assert info.drafter == "ngram"
        samples = scrape_metrics("127.0.0.1", metrics_port)
        assert value(samples, "specd_requests_total", service="draft", method="GetModelInfo", code="OK") == 1
        assert value(samples, "specd_active_sessions", service="draft") == 0
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    assert process.returncode == 0, log_path.read_text()[-2000:]

