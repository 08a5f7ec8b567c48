"""`specd up` supervision: the restart policy on fake processes, and kill -9 / SIGSTOP of real children."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from specd.v1 import generate_pb2, generate_pb2_grpc
from specd_app.supervise import FIRST_BACKOFF_S, HEALTHY_AFTER_S, MAX_BACKOFF_S, Child, Supervisor
from tests.specd_stack import gateway_health, specd_up


class FakeProcess:
    def __init__(self, returncode=None):
        self.returncode = returncode

    def poll(self):
        return self.returncode


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_an_exited_child_is_restarted_after_a_doubling_backoff_reset_by_a_healthy_run():
    clock, started = FakeClock(), []

    def spawn(command):
        started.append(command)
        return FakeProcess()

    child = Child("draft", ["serve", "draft"], FakeProcess(), started_at=0.0)
    supervisor = Supervisor({"draft": child}, spawn=spawn, clock=clock)
    supervisor.step()
    assert not started  # running: nothing to do
    delays = []
    for _ in range(7):  # crash right after every start
        child.process.returncode = 1
        supervisor.step()
        due = child.restart_at
        delays.append(due - clock.now)
        clock.now = due - 0.01
        supervisor.step()
        assert child.restart_at == due  # not before its time
        clock.now = due
        supervisor.step()
        assert child.restart_at is None and child.process.poll() is None
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0] and delays[0] == FIRST_BACKOFF_S and max(delays) == MAX_BACKOFF_S
    assert len(started) == 7 and child.restarts == 7
    clock.now += HEALTHY_AFTER_S  # a long healthy run forgets the back-off
    child.process.returncode = -9
    supervisor.step()
    assert child.restart_at - clock.now == FIRST_BACKOFF_S


def child_pid(parent: int, service: str) -> int:
    """The pid of `specd serve <service>` whose parent is `parent` (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"serve" in cmdline and service.encode() in cmdline:
            return int(entry.name)
    raise AssertionError(f"no `specd serve {service}` child of {parent}")


def generate(address: str, **fields) -> generate_pb2.GenerateResponse:
    with grpc.insecure_channel(address) as channel:
        request = generate_pb2.GenerateRequest(text="hello world", max_new_tokens=24, num_draft_tokens=3, **fields)
        return generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=60)


def until_drafts_are_accepted(address: str, timeout_s: float = 90.0) -> generate_pb2.GenerateResponse:
    """Send requests until one has accepted drafts (the restarted draft is back in use)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = generate(address, draft_length_policy=generate_pb2.DRAFT_LENGTH_POLICY_FIXED)
        if reply.stats.accepted_tokens > 0:
            return reply
        assert time.monotonic() < deadline, "speculation did not resume after the draft came back"
        time.sleep(0.5)


@pytest.mark.e2e
def test_specd_up_restarts_a_killed_draft_and_verify_and_skips_a_frozen_draft(tiny, tmp_path):
    drafter = ("--drafter", "model", "--draft-model", str(tiny.draft_same))  # same weights: every draft accepted
    log = tmp_path / "up.log"
    with specd_up(tiny.target, log, drafter=drafter) as stack:
        deadline = time.monotonic() + 60
        while "specd is up" not in log.read_text():  # supervision starts once `specd up` has seen the gateway serve
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        address = stack.address("gateway")
        expected = generate(address, disable_speculation=True).token_ids
        assert until_drafts_are_accepted(address).token_ids == expected

        os.kill(child_pid(stack.pid, "draft"), signal.SIGKILL)
        reply = generate(address)  # the draft is gone: exact target-only answer, no error
        assert reply.token_ids == expected
        assert until_drafts_are_accepted(address).token_ids == expected  # restarted, and used again

        os.kill(child_pid(stack.pid, "verify"), signal.SIGKILL)
        health = []  # the gateway's health while the verify is away and back
        deadline = time.monotonic() + 90
        while True:  # requests fail UNAVAILABLE at once while the verify restarts, then succeed
            health.append(gateway_health(address))
            started = time.monotonic()
            try:
                assert generate(address).token_ids == expected
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                assert time.monotonic() - started < 2.0, "a request waited for a verify that is down"
                assert time.monotonic() < deadline, "the verify did not come back"
                time.sleep(0.2)
        assert "NOT_SERVING" in health, health  # readiness takes the gateway out while its target is down
        deadline = time.monotonic() + 10
        while gateway_health(address) != "SERVING":
            assert time.monotonic() < deadline, "the gateway did not report SERVING once its verify was back"
            time.sleep(0.2)

        frozen = child_pid(stack.pid, "draft")
        os.kill(frozen, signal.SIGSTOP)
        try:
            started = time.monotonic()
            first = generate(address)  # one draft timeout, then target-only
            after_first = time.monotonic()
            second = generate(address)  # the draft failed before: a 0.2 s health probe, not another timeout
            second_s = time.monotonic() - after_first
        finally:
            os.kill(frozen, signal.SIGCONT)
        assert first.token_ids == expected and second.token_ids == expected
        assert second_s < 3.0, f"a frozen draft stalled the next request {second_s:.1f} s (first took {after_first - started:.1f} s)"
        assert until_drafts_are_accepted(address).token_ids == expected


# The mark: a verify killed under `specd up` serves again within this many seconds of the kill, once
# its start-up timings are cached (specd_engine/runtime_cache.py); re-measuring them took 36 s of 44-47.
WARM_RESTART_S = 15.0


@pytest.mark.e2e
def test_a_verify_killed_under_specd_up_serves_again_within_15_s_on_a_warm_cache(tmp_path):
    """The default target: its start-up timings are first cached by a verify started exactly as `specd up`
    starts it (no budget, so a busy machine cannot leave the cache cold), then `specd up`'s verify is
    killed with kill -9 and must answer SERVING again within WARM_RESTART_S, having read the cache."""
    import subprocess

    from gateway.options import GatewayOptions
    from specd_app.stack import service_commands
    from specd_common.config import DEFAULT_TARGET
    from tests.specd_stack import REPO, free_ports, repo_env, serving

    port = free_ports(1)[0]
    warm = service_commands("127.0.0.1", {"gateway": 0, "draft": 0, "verify": port}, DEFAULT_TARGET, "ngram", "", 1,
                            GatewayOptions().num_draft_tokens)["verify"]  # what specd_up below runs, on another port
    with open(tmp_path / "warm.log", "w") as log:
        process = subprocess.Popen([*warm, "--startup-budget", "0", "--metrics-port", "-1"], cwd=REPO, env=repo_env(),
                                   stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 400  # a cold cache on a busy 2-core machine: ~90 s of timings
            while not serving(f"127.0.0.1:{port}"):
                assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "warm.log").read_text()
                time.sleep(0.5)
        finally:
            process.terminate()
            process.wait(timeout=30)
    assert "start-up timings cached in" in (tmp_path / "warm.log").read_text() or "from the cache" in (tmp_path / "warm.log").read_text()

    log = tmp_path / "up.log"
    with specd_up(DEFAULT_TARGET, log, timeout_s=180) as stack:
        deadline = time.monotonic() + 60
        while "specd is up" not in log.read_text():  # supervision starts once `specd up` has seen the gateway serve
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert log.read_text().count("start-up timings: from the cache") == 1  # the verify (the n-gram draft times nothing)
        os.kill(child_pid(stack.pid, "verify"), signal.SIGKILL)
        killed = time.monotonic()
        while not serving(stack.address("verify")):
            assert time.monotonic() - killed < 60, log.read_text()[-3000:]
            time.sleep(0.1)
        restart_s = time.monotonic() - killed
        print(f"verify kill -9 → SERVING: {restart_s:.1f} s")
        assert log.read_text().count("start-up timings: from the cache") == 2, log.read_text()[-3000:]
        assert restart_s < WARM_RESTART_S, f"the verify served again {restart_s:.1f} s after kill -9 (cache warm)"
        deadline = time.monotonic() + 30  # and the gateway uses it again
        while True:
            try:
                assert generate(stack.address("gateway")).token_ids
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, error
                time.sleep(0.2)
