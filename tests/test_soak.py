"""Soak: ten minutes of load above the admission limit against three `specd serve` processes.

Marked slow (run with `make test-slow`, or `pytest -m slow tests/test_soak.py`). SPECD_SOAK_SECONDS
shortens or lengthens it. Asserts: no process dies, every refusal is RESOURCE_EXHAUSTED, no session
is left open afterwards, and resident memory grows less than MEMORY_GROWTH_BOUND_MB after warm-up.
The numbers it logs go into the README.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from collections import Counter
from concurrent import futures

import grpc
import pytest

from specd.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from specd_app.bench import machine_facts
from tests.specd_stack import free_ports, serve, wait_serving

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)

SOAK_SECONDS = float(os.environ.get("SPECD_SOAK_SECONDS", "600"))  # SPECD_SOAK_REPORT: where the JSON goes
CONCURRENCY = 12  # clients
ADMITTED, WAITING = 4, 2  # the gateway runs 4 and queues 2: half the clients are refused at any time
MEMORY_GROWTH_BOUND_MB = 64.0
WARM_UP_S = min(60.0, SOAK_SECONDS / 5)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def scrape_gauge(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def client_loop(address: str, stop: threading.Event, outcomes: Counter, lock: threading.Lock, seed: int) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(address))
    prompts = ["hello world", "the quick brown fox", "def add(a, b):", "Natalia sold clips"]
    i = seed
    while not stop.is_set():
        i += 1
        request = generate_pb2.GenerateRequest(
            text=prompts[i % len(prompts)], max_new_tokens=16 + i % 48,
            sampling=common_pb2.SamplingParams(temperature=0.0 if i % 2 else 0.8, top_p=0.95), seed=i,
        )
        try:
            if i % 3:
                stub.Generate(request, timeout=30)
            else:  # streams, some abandoned half-way
                for n, _ in enumerate(stub.GenerateStream(request, timeout=30)):
                    if i % 9 == 0 and n == 2:
                        break
            code = "OK"
        except grpc.RpcError as error:
            code = error.code().name
            if code == "RESOURCE_EXHAUSTED":
                time.sleep(0.05)
        with lock:
            outcomes[code] += 1


@pytest.mark.timeout(SOAK_SECONDS + 300)  # the soak itself plus start-up and drain: past the suite's 600 s default
def test_soak_above_the_admission_limit(tiny, tmp_path):
    verify_port, draft_port, gateway_port, vm, dm, gm = free_ports(6)
    with serve("verify", verify_port, tmp_path, "--model", str(tiny.target), "--threads", "1", "--metrics-port", str(vm)) as verify, serve(
        "draft", draft_port, tmp_path, "--drafter", "model", "--model", str(tiny.draft_noisy), "--threads", "1", "--metrics-port", str(dm)
    ) as draft:
        wait_serving(verify_port, draft_port)
        with serve("gateway", gateway_port, tmp_path, "--verify-address", f"127.0.0.1:{verify_port}",
                   "--draft-address", f"127.0.0.1:{draft_port}", "--max-sessions", str(ADMITTED),
                   "--max-waiting", str(WAITING), "--metrics-port", str(gm)) as gateway:
            wait_serving(gateway_port)
            processes = {"verify": verify, "draft": draft, "gateway": gateway}
            stop, lock, outcomes = threading.Event(), threading.Lock(), Counter()
            samples = []
            with futures.ThreadPoolExecutor(CONCURRENCY) as pool:
                clients = [pool.submit(client_loop, f"127.0.0.1:{gateway_port}", stop, outcomes, lock, s * 1000) for s in range(CONCURRENCY)]
                started = time.monotonic()
                try:
                    while time.monotonic() - started < SOAK_SECONDS:
                        time.sleep(min(10.0, SOAK_SECONDS / 10))
                        for name, process in processes.items():
                            assert process.poll() is None, f"{name} died during the soak"
                        samples.append((time.monotonic() - started, {n: rss_mb(p.pid) for n, p in processes.items()}))
                finally:
                    stop.set()  # whatever happened, the clients stop (else the pool's exit waits for ever)
                for client in clients:
                    client.result(timeout=60)
            time.sleep(1.0)
            sessions = {"verify": scrape_gauge(vm, "specd_active_sessions"), "draft": scrape_gauge(dm, "specd_active_sessions")}
    warm = next(rss for t, rss in samples if t >= WARM_UP_S)
    final = samples[-1][1]
    growth = {name: round(final[name] - warm[name], 1) for name in final}
    summary = {
        "seconds": SOAK_SECONDS, "clients": CONCURRENCY, "admitted": ADMITTED, "waiting": WAITING,
        "outcomes": dict(outcomes), "rss_mb_after_warm_up": {n: round(v, 1) for n, v in warm.items()},
        "rss_mb_final": {n: round(v, 1) for n, v in final.items()}, "growth_mb": growth, "open_sessions_after": sessions,
        "command": "SPECD_SOAK_REPORT=docs/benchmarks/soak.json .venv/bin/python -m pytest -m slow tests/test_soak.py",
        "machine": machine_facts(), "load_average": os.getloadavg(),
    }
    report = os.environ.get("SPECD_SOAK_REPORT") or str(tmp_path / "soak.json")
    with open(report, "w") as out:
        json.dump(summary, out, indent=2)
    log.warning("soak summary (also in %s): %s", report, json.dumps(summary))
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes["OK"] > 0 and outcomes["RESOURCE_EXHAUSTED"] > 0, "the load never crossed the admission limit"
    assert sessions == {"verify": 0, "draft": 0}
    assert all(g < MEMORY_GROWTH_BOUND_MB for g in growth.values()), growth
