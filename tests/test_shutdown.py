"""Graceful gateway shutdown (issue 47): SIGTERM or Ctrl-C while streams run.

In process, over real sockets: the gateway is stopped by the same path SIGTERM takes
(specd_common.server.shutdown) while a slowed-down verify keeps its answers mid-stream. Answers that
fit the grace finish; the rest end with their partial answer and UNAVAILABLE; new requests are
refused at once; every session is released before the pool's channels close. Then `specd up` as a
real process tree, interrupted as a terminal's Ctrl-C does.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from gateway.app import http_server
from gateway.service import SHUTTING_DOWN
from specd.v1 import generate_pb2, generate_pb2_grpc
from specd_common.server import shutdown
from tests.conftest import start_cluster
from tests.test_http_api import SlowVerify  # every Verify sleeps first: rounds take a known minimum time
from tests.specd_stack import REPO, free_ports, gateway_health, repo_env, serving, specd_up

GRACE_S = 3.0
ROUND_DELAY_S = 0.1  # each Verify waits this long: a 400-token answer needs far more than the grace
SHORT = dict(text="hello world", max_new_tokens=8, disable_speculation=True)  # ~8 rounds: ends within the grace
LONG = dict(text="hello world", max_new_tokens=400)  # cannot end within the grace: cut off


class Reader(threading.Thread):
    """Reads one GenerateStream to its end: the tokens received, and the error that ended it (if any)."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream = stream
        self.first = threading.Event()
        self.tokens: list[int] = []
        self.finish = generate_pb2.FINISH_REASON_UNSPECIFIED
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        try:
            for message in self.stream:
                self.tokens += message.token_ids
                self.finish = message.finish_reason or self.finish
                self.first.set()
        except grpc.RpcError as error:
            self.error = error
        finally:
            self.first.set()


def generated_ids(error: grpc.RpcError) -> list[int]:
    """The token ids an interrupted generation reports in its trailing metadata."""
    text = dict(error.trailing_metadata() or ())["specd-generated-token-ids"]
    return [int(token) for token in text.split(",") if token]


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


@pytest.fixture
def slow_cluster(tiny):
    cluster = start_cluster(tiny.target, "model", tiny.draft_same, model_interceptors=(SlowVerify(ROUND_DELAY_S),), http_port=0)
    yield cluster
    for server in (cluster.draft, cluster.verify):
        server.stop(0)


def test_sigterm_during_streams_finishes_what_fits_and_cuts_off_the_rest_with_their_partial_answers(slow_cluster, caplog):
    caplog.set_level(logging.INFO)
    stub = slow_cluster.stub()
    readers = [Reader(stub.GenerateStream(generate_pb2.GenerateRequest(**fields), timeout=60))
               for fields in (SHORT, SHORT, LONG, LONG)]
    for reader in readers:
        reader.start()
    unary = stub.Generate.future(generate_pb2.GenerateRequest(**LONG), timeout=60)
    for reader in readers:
        assert reader.first.wait(30)
    assert all(reader.error is None and not reader.finish for reader in readers), "a stream ended before the shutdown"

    started = time.monotonic()
    stopping = threading.Thread(target=shutdown, args=(slow_cluster.gateway, GRACE_S))
    stopping.start()
    wait_for(lambda: gateway_health(slow_cluster.address) == "NOT_SERVING", timeout_s=2)
    with pytest.raises(grpc.RpcError) as refused:  # new work is refused at once, saying where to go
        stub.Generate(generate_pb2.GenerateRequest(**SHORT), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and refused.value.details() == SHUTTING_DOWN
    stopping.join(GRACE_S + 10)
    elapsed = time.monotonic() - started
    for reader in readers:
        reader.join(10)

    short, long = readers[:2], readers[2:]
    for reader in short:  # finished within the grace, complete
        assert reader.error is None, reader.error.details()
        assert reader.finish == generate_pb2.FINISH_REASON_LENGTH and len(reader.tokens) == SHORT["max_new_tokens"]
    for reader in long:  # cut off at the grace: what was streamed, then UNAVAILABLE saying so
        assert reader.error is not None and reader.error.code() == grpc.StatusCode.UNAVAILABLE, reader.error
        assert "shut down" in reader.error.details()
        assert 0 < len(reader.tokens) < LONG["max_new_tokens"] and generated_ids(reader.error) == reader.tokens
    with pytest.raises(grpc.RpcError) as cut:
        unary.result()
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    made = generated_ids(cut.value)
    assert 0 < len(made) < LONG["max_new_tokens"] and f"{len(made)} tokens were generated" in cut.value.details()
    assert GRACE_S <= elapsed < GRACE_S + 3, f"shutdown took {elapsed:.1f} s with a {GRACE_S} s grace"
    assert slow_cluster.open_sessions() == {"verify": 0, "draft": 0}  # released on both, before the channels closed
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info or "release failed" in r.getMessage()]
    assert not problems, problems


def test_an_idle_gateway_stops_at_once(tiny):
    cluster = start_cluster(tiny.target, "", None)
    try:
        started = time.monotonic()
        shutdown(cluster.gateway, GRACE_S)
        assert time.monotonic() - started < 2.0
    finally:
        cluster.verify.stop(0)


def test_http_requests_during_the_drain_get_503_and_the_stream_in_flight_ends_cleanly(slow_cluster):
    port = http_server(slow_cluster.gateway).port
    stub = slow_cluster.stub()
    # greedy, as LONG: OpenAI's default temperature (1) sampled the random model's EOS within a few rounds now and then
    body = json.dumps({"model": slow_cluster.gateway.servicer.backends.target_info.model_name, "prompt": "hello world",
                       "max_tokens": 400, "temperature": 0, "stream": True}).encode()

    def post(data: bytes):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=data,
                                         headers={"content-type": "application/json"})
        return urllib.request.urlopen(request, timeout=30)

    streaming = post(body)
    first = streaming.readline()
    assert first.startswith(b"data: ")
    holder = Reader(stub.GenerateStream(generate_pb2.GenerateRequest(**LONG), timeout=60))  # keeps the drain busy
    holder.start()
    assert holder.first.wait(30)
    stopping = threading.Thread(target=shutdown, args=(slow_cluster.gateway, GRACE_S))
    stopping.start()
    wait_for(lambda: gateway_health(slow_cluster.address) == "NOT_SERVING", timeout_s=2)
    with pytest.raises(urllib.error.HTTPError) as refused:
        post(body.replace(b'"stream": true', b'"stream": false'))
    assert refused.value.code == 503
    error = json.loads(refused.value.read())["error"]
    assert error["message"] == SHUTTING_DOWN and error["type"]
    events = [line for line in (first + streaming.read()).decode().splitlines() if line.startswith("data: ")]
    stopping.join(GRACE_S + 10)
    last = json.loads(events[-1].removeprefix("data: "))
    assert "error" in last and "shut down" in last["error"]["message"]  # the stream's end says why
    assert slow_cluster.open_sessions() == {"verify": 0, "draft": 0}


# --- `specd up`, interrupted like a terminal's Ctrl-C (SIGINT to its process group) ----------------


def test_ctrl_c_of_specd_up_stops_the_gateway_first_and_exits_within_the_grace(tiny, tmp_path):
    log_path = tmp_path / "up.log"
    with specd_up(tiny.target, log_path) as stack:
        stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(stack.address("gateway")))
        readers = [Reader(stub.GenerateStream(generate_pb2.GenerateRequest(text="hello world", max_new_tokens=300), timeout=120))
                   for _ in range(4)]
        for reader in readers:
            reader.start()
        for reader in readers:
            assert reader.first.wait(60)
        started = time.monotonic()
        os.killpg(stack.pid, signal.SIGINT)  # what a terminal sends the foreground group on Ctrl-C
        process_exited = wait_pid(stack.pid, 30)
        elapsed = time.monotonic() - started
        for reader in readers:
            reader.join(10)
    log = log_path.read_text()
    assert process_exited, log
    assert elapsed < 10 + 6, f"specd up took {elapsed:.1f} s to stop:\n{log}"
    assert not any(serving(stack.address(name)) for name in ("gateway", "draft", "verify")), "a child outlived specd up"
    for reader in readers:
        assert reader.error is None or reader.error.code() == grpc.StatusCode.UNAVAILABLE, reader.error
        assert reader.error is not None or reader.finish
    assert "Traceback" not in log and "internal error" not in log and "release failed" not in log, log
    order = [log.index(f"stopping {names}") for names in ("gateway", "verify, draft")]
    assert order == sorted(order), log


def test_ctrl_c_during_the_demo_cancels_it_cleanly(tiny, tmp_path):
    """The demo's call is cancelled (or, if it was quicker, answered), never a traceback, and `specd up`
    does not go on to say it serves."""
    gateway, draft, verify = free_ports(3)
    command = [sys.executable, "-m", "specd_app.cli", "up", "--target", str(tiny.target), "--drafter", "ngram",
               "--threads", "1", "--gateway-port", str(gateway), "--draft-port", str(draft), "--verify-port", str(verify),
               "--http-port", "0", "--demo", "Write a long story about a dragon"]
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, env=repo_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: "demo prompt" in log_path.read_text() or process.poll() is not None, timeout_s=120)
            time.sleep(0.2)  # into the demo's generation
            os.killpg(process.pid, signal.SIGINT)
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    log = log_path.read_text()
    asked = log.index("stopping: the gateway first")
    assert "demo cancelled" in log[asked:] or " tokens in " in log, log
    assert "Traceback" not in log and "serving until Ctrl-C" not in log[asked:], log


def wait_pid(pid: int, timeout_s: float) -> bool:
    """True once `pid` (a child of the specd_up fixture's Popen) is gone or a zombie."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(") ", 1)[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


SIGNAL_ON_ANOTHER_THREAD = """
import signal, threading, time
from specd_common.server import wait_for_stop_signal
def deliver():
    time.sleep(0.3)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # caught here, not on the main thread
    time.sleep(30)
threading.Thread(target=deliver, daemon=True).start()
wait_for_stop_signal()
print("stopped")
"""


def test_a_service_stops_when_another_thread_catches_sigterm():
    """The kernel may hand SIGTERM to any thread (on CUDA, the driver's own): the main thread must
    still wake and stop. An untimed wait there never woke (a draft on a GPU was killed after 60 s)."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SIGNAL_ON_ANOTHER_THREAD], env=repo_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=20)
    assert done.stdout.strip() == "stopped", done.stderr
    assert time.monotonic() - started < 10
