"""What telemetry costs per speculative round: uninstrumented vs tracing off (the default) vs tracing on.

Runs verify, draft and gateway in-process on port 0 with tiny random models (tests/tiny_models.py,
no download), sends the same greedy request to three stacks set up differently, interleaved request by request
so machine noise hits all three alike, and prints the time per round:

  uninstrumented  no interceptors, plain channels: the hooks see no RPC scope and return at once
  tracing off     what `specd serve` runs with no OTEL_* endpoint: interceptors + Prometheus metrics,
                  no tracer provider (no-op tracer)
  tracing on      OTEL_EXPORTER_OTLP_ENDPOINT set: spans exported over OTLP/gRPC (BatchSpanProcessor)
                  to an in-process receiver that discards them

  PYTHONPATH=.:protos python scripts/tracing_overhead.py [--requests 100] [--tokens 32]

Tiny models make a round ~5 ms, so this is a worst case: with real models a round costs 10-100x more
while the telemetry cost per round stays the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "protos"), str(REPO / "tests")]

import grpc  # noqa: E402
import torch  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from draft_service.app import start_draft_server  # noqa: E402
from draft_service.drafters import ModelDrafter  # noqa: E402
from gateway.app import start_gateway_server  # noqa: E402
from gateway.options import GatewayOptions  # noqa: E402
from specd.v1 import common_pb2, generate_pb2, generate_pb2_grpc  # noqa: E402
from specd_common import server as server_module  # noqa: E402
from specd_common import telemetry  # noqa: E402
from specd_common.config import ServerConfig  # noqa: E402
from specd_engine.models import load_causal_lm  # noqa: E402
from tiny_models import build_model, build_tokenizer  # noqa: E402
from verify_service.app import start_verify_server  # noqa: E402

MODES = ("uninstrumented", "tracing off", "tracing on")


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def otlp_sink():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop(0)


@contextmanager
def stacks(target: Path, draft: Path, endpoint: str):
    """Three gateway+draft+verify stacks, one per mode, all running at once; yields {mode: stub}.

    Each stack loads its own models: a service owns its model and changes it in place at start-up
    (CausalLM drops the weight layouts its timings did not pick), so stacks sharing one model would
    depend on which layouts the first one's timings happened to pick."""
    saved_env = {n: os.environ.pop(n) for n in [n for n in os.environ if n.startswith("OTEL_")]}
    saved = telemetry.Observability.server_interceptors, server_module.instrument_channel
    config = ServerConfig(host="127.0.0.1", port=0, max_workers=8)
    started, channels, stubs = [], [], {}
    try:
        for mode in MODES:
            if mode == "uninstrumented":  # set-up time only: servers and channels are built without telemetry
                telemetry.Observability.server_interceptors = lambda self: []
                server_module.instrument_channel = lambda channel, address: channel
            if mode == "tracing on":
                os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
            verify = start_verify_server(load_causal_lm(str(target), device="cpu"), config)
            drafter = start_draft_server(ModelDrafter(load_causal_lm(str(draft), device="cpu")), config)
            started += [verify, drafter]
            started.append(
                start_gateway_server(f"127.0.0.1:{verify.port}", f"127.0.0.1:{drafter.port}", config, GatewayOptions(connect_timeout_s=30))
            )
            telemetry.Observability.server_interceptors, server_module.instrument_channel = saved
            os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
            channels.append(grpc.insecure_channel(f"127.0.0.1:{started[-1].port}"))
            stubs[mode] = generate_pb2_grpc.GenerateServiceStub(channels[-1])
        yield stubs
    finally:
        telemetry.Observability.server_interceptors, server_module.instrument_channel = saved
        os.environ.update(saved_env)
        for channel in channels:
            channel.close()
        for running in reversed(started):
            running.stop(grace_s=1.0)


def one_request(stub, tokens: int) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (this process, all threads: client and the three services) and target passes."""
    request = generate_pb2.GenerateRequest(
        text="the quick brown fox", raw=True, max_new_tokens=tokens, seed=1,
        sampling=common_pb2.SamplingParams(temperature=0.0),
    )
    started, cpu_started = time.perf_counter(), time.process_time()
    passes = stub.Generate(request, timeout=60).stats.target_passes
    return time.perf_counter() - started, time.process_time() - cpu_started, passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100, help="requests per mode")
    parser.add_argument("--tokens", type=int, default=32, help="max new tokens per request")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root, otlp_sink() as endpoint:
        tokenizer = build_tokenizer()
        target = build_model(Path(root) / "target", seed=1, tokenizer=tokenizer)
        draft = build_model(Path(root) / "draft", seed=2, layers=1, tokenizer=tokenizer)
        per_round = {mode: [] for mode in MODES}  # wall ms per round, one entry per request
        cpu_per_round = {mode: [] for mode in MODES}  # CPU ms per round, one entry per request
        passes_total = {mode: 0 for mode in MODES}
        with stacks(target, draft, endpoint) as stubs:
            for mode in MODES:
                for _ in range(3):  # warm-up
                    one_request(stubs[mode], args.tokens)
            for i in range(args.requests):
                order = MODES[i % 3 :] + MODES[: i % 3]  # rotate, so no mode always runs first
                for mode in order:
                    seconds, cpu_seconds, passes = one_request(stubs[mode], args.tokens)
                    per_round[mode].append(seconds / passes * 1e3)
                    cpu_per_round[mode].append(cpu_seconds / passes * 1e3)
                    passes_total[mode] += passes
    base = statistics.median(per_round["uninstrumented"])
    cpu_base = statistics.median(cpu_per_round["uninstrumented"])
    print(f"{args.requests} requests x {args.tokens} tokens per mode, interleaved; torch threads 1; medians per round")
    print(f"{'mode':<16} {'rounds':>7} {'wall ms':>8} {'vs uninstrumented':>26} {'CPU ms':>8} {'vs uninstrumented':>26}")
    for mode in MODES:
        wall, cpu = statistics.median(per_round[mode]), statistics.median(cpu_per_round[mode])
        print(
            f"{mode:<16} {passes_total[mode]:>7} {wall:>8.3f} {(wall - base) * 1e3:>+14.0f} us ({(wall / base - 1) * 100:+5.1f}%)"
            f" {cpu:>8.3f} {(cpu - cpu_base) * 1e3:>+14.0f} us ({(cpu / cpu_base - 1) * 100:+5.1f}%)"
        )


if __name__ == "__main__":
    main()
