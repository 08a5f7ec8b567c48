"""Replica pools found by DNS (gateway/discovery.py, gateway/pool.py): parsing, resolving, choosing, and
one end-to-end run with real processes on loopback addresses behind a DNS server run by the test.

The end-to-end test is the scale-out design of deploy/README.md: two verify and two draft replicas
under two names; sessions spread over both pairs; a third verify record is used within the
re-resolution period; a replica turning NOT_SERVING (SIGTERM: it drains) gets no new sessions while its
open one goes on; a removed record gets no new sessions; a draft with another vocabulary is never used;
greedy output equals target-only throughout.
"""

from __future__ import annotations

import contextlib
import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from gateway.discovery import Target, channel_address, parse_target, resolve
from gateway.pool import least_loaded
from specd.v1 import common_pb2, generate_pb2, generate_pb2_grpc, verify_pb2, verify_pb2_grpc
from tests.dns_server import DnsServer
from tests.specd_stack import free_ports, scrape_metrics, serve, wait_serving

RESOLVE_PERIOD_S = 1.0
PROMPTS = ["hello world", "the quick brown fox", "def add(a, b):"]


# --- units -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("10.0.0.5:50053", Target("10.0.0.5:50053")),
    ("specd-verify:50053", Target("specd-verify:50053")),
    ("dns:///specd-verify:50053", Target("dns:///specd-verify:50053", "specd-verify", 50053)),
    ("dns://10.96.0.10:5353/verify.specd.test:7", Target("dns://10.96.0.10:5353/verify.specd.test:7", "verify.specd.test", 7, "10.96.0.10", 5353)),
    ("dns://kube-dns/a.b:7", Target("dns://kube-dns/a.b:7", "a.b", 7, "kube-dns", 53)),
])
def test_addresses_parse_into_fixed_or_discovered_targets(text, expected):
    assert parse_target(text) == expected
    assert parse_target(text).discovered == text.startswith("dns:")


@pytest.mark.parametrize("text, message", [
    ("dns:///specd-verify", "names no port"),
    ("dns:specd-verify:50053", "dns:///NAME:PORT"),
    ("dns:///:50053", "not HOST:PORT"),
    ("dns:///name:port", "not HOST:PORT"),
])
def test_malformed_dns_addresses_say_how_to_write_them(text, message):
    with pytest.raises(ValueError, match=message):
        parse_target(text)


def test_channel_addresses_dial_one_ip():
    assert channel_address("10.1.2.3", 50053) == "ipv4:10.1.2.3:50053"
    assert channel_address("fd00::7", 50053) == "ipv6:[fd00::7]:50053"


def test_resolution_asks_the_named_dns_server_and_tells_empty_from_failed():
    with DnsServer() as server:
        server.set("verify.specd.test", ["127.0.0.3", "127.0.0.2"])
        server.set("empty.specd.test", [])
        found = resolve(parse_target(f"dns://127.0.0.1:{server.port}/verify.specd.test:50053"), timeout_s=2)
        assert found == ["ipv4:127.0.0.2:50053", "ipv4:127.0.0.3:50053"]
        assert resolve(parse_target(f"dns://127.0.0.1:{server.port}/empty.specd.test:1"), timeout_s=2) == []
        assert resolve(parse_target(f"dns://127.0.0.1:{server.port}/gone.specd.test:1"), timeout_s=2) == []
        port = server.port
    # nobody answers any more: a failed lookup (None), which the pool treats as "keep what you had"
    assert resolve(parse_target(f"dns://127.0.0.1:{port}/verify.specd.test:1"), timeout_s=0.5) is None
    assert resolve(parse_target("dns:///localhost:9"), timeout_s=2)  # the system resolver (/etc/hosts)
    assert resolve(parse_target("127.0.0.1:9"), timeout_s=2) == ["127.0.0.1:9"]


def test_least_loaded_choice_takes_turns_among_equals():
    a, b, c = (SimpleNamespace(name=n, sessions=s) for n, s in (("a", 2), ("b", 1), ("c", 1)))
    assert [least_loaded([a, b, c], turn).name for turn in range(4)] == ["b", "c", "b", "c"]
    fresh = SimpleNamespace(name="fresh", sessions=0)
    assert least_loaded([a, b, c, fresh], 5).name == "fresh"  # a replica added by scaling fills up first


def test_a_draft_pool_found_empty_at_start_speculates_once_a_draft_joins(tiny):
    """A gateway started before any draft pod is ready (its DNS name has no record yet) serves
    target-only, then speculates when a draft appears in DNS: the drafts' rules come from the first
    one to join, not from start-up."""
    from draft_service.app import make_drafter, start_draft_server
    from gateway.app import start_gateway_server
    from gateway.options import GatewayOptions
    from specd_common.config import ServerConfig
    from specd_engine.models import load_causal_lm
    from verify_service.app import start_verify_server

    config = ServerConfig(port=0)
    with DnsServer() as names, contextlib.ExitStack() as stack:
        names.set("draft.specd.test", [])
        verify = start_verify_server(load_causal_lm(str(tiny.target)), config)
        stack.callback(verify.stop, 0)
        draft = start_draft_server(make_drafter("model", str(tiny.draft_same)), config)
        stack.callback(draft.stop, 0)
        gateway = start_gateway_server(
            f"127.0.0.1:{verify.port}", f"dns://127.0.0.1:{names.port}/draft.specd.test:{draft.port}", config,
            GatewayOptions(connect_timeout_s=30, resolve_period_s=0.3, draft_length_policy="fixed", max_speculative_requests=0,
                           lookup_tokens=0),  # drafts only from the draft service
        )
        stack.callback(gateway.stop, 0)
        stub = generate_pb2_grpc.GenerateServiceStub(stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{gateway.port}")))
        request = generate_pb2.GenerateRequest(text=PROMPTS[0], max_new_tokens=24)
        before = stub.Generate(request, timeout=60)
        assert before.stats.draft_tokens == 0  # no draft yet: target-only, still served
        names.set("draft.specd.test", ["127.0.0.1"])
        wait_until(lambda: gateway.servicer.backends.draft_info is not None, 10, "the draft joining")
        after = stub.Generate(request, timeout=60)
        assert after.stats.draft_tokens > 0 and list(after.token_ids) == list(before.token_ids)


# --- end to end --------------------------------------------------------------------------------------
VERIFY_IPS = ["127.0.0.2", "127.0.0.3"]
THIRD_VERIFY = "127.0.0.6"
DRAFT_IPS = ["127.0.0.4", "127.0.0.5"]
WRONG_DRAFT = "127.0.0.7"  # serves a draft with another vocabulary


def prefills(host: str, metrics_port: int) -> float:
    """Prefill RPCs a replica has answered OK (each is a session a gateway opened on it)."""
    return sum(value for (name, labels), value in scrape_metrics(host, metrics_port).items()
               if name == "specd_requests_total" and ("method", "Prefill") in labels and ("code", "OK") in labels)


def pool_state(gateway_metrics_port: int, role: str, state: str) -> float:
    return scrape_metrics("127.0.0.1", gateway_metrics_port).get(
        ("specd_gateway_replicas", frozenset({("role", role), ("state", state)})), 0.0)


def wait_until(condition, timeout_s: float, what: str) -> float:
    """Poll condition() until true; returns the seconds it took (fails after timeout_s)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - started


def test_dns_pools_spread_sessions_follow_records_and_health(tiny, tmp_path):
    verify_port, draft_port, model_metrics, gateway_port, gateway_metrics = free_ports(5)
    model = ["--threads", "1", "--metrics-port", str(model_metrics), "--grace", "60"]
    with DnsServer() as names, contextlib.ExitStack() as stack:
        names.set("verify.specd.test", VERIFY_IPS)
        names.set("draft.specd.test", DRAFT_IPS)
        verifies = {
            ip: stack.enter_context(serve("verify", verify_port, tmp_path, "--model", str(tiny.target), *model, host=ip))
            for ip in [*VERIFY_IPS, THIRD_VERIFY]
        }
        for ip, draft in [*((ip, tiny.draft_same) for ip in DRAFT_IPS), (WRONG_DRAFT, tiny.other_vocab)]:
            stack.enter_context(serve("draft", draft_port, tmp_path, "--drafter", "model", "--model", str(draft), *model, host=ip))
        wait_serving(*(f"{ip}:{verify_port}" for ip in verifies), *(f"{ip}:{draft_port}" for ip in [*DRAFT_IPS, WRONG_DRAFT]))
        dns = f"dns://127.0.0.1:{names.port}"
        stack.enter_context(serve(
            "gateway", gateway_port, tmp_path, "--verify-address", f"{dns}/verify.specd.test:{verify_port}",
            "--draft-address", f"{dns}/draft.specd.test:{draft_port}", "--resolve-period", str(RESOLVE_PERIOD_S),
            "--metrics-port", str(gateway_metrics), "--num-draft-tokens", "3", "--draft-length-policy", "fixed",
            "--max-speculative-requests", "0",
        ))
        wait_serving(gateway_port)
        stub = generate_pb2_grpc.GenerateServiceStub(stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{gateway_port}")))

        def generate(prompt: str, speculate: bool = True) -> list[int]:
            request = generate_pb2.GenerateRequest(text=prompt, max_new_tokens=40, disable_speculation=not speculate)
            return list(stub.Generate(request, timeout=60).token_ids)

        def verify_prefills() -> dict[str, float]:
            return {ip: prefills(ip, model_metrics) for ip, process in verifies.items() if process.poll() is None}

        def run_all(count: int) -> None:
            """count requests, four at a time, each checked against target-only."""
            with futures.ThreadPoolExecutor(4) as pool:
                outputs = list(pool.map(lambda i: (i, generate(PROMPTS[i % len(PROMPTS)])), range(count)))
            for i, tokens in outputs:
                assert tokens == reference[PROMPTS[i % len(PROMPTS)]], f"request {i} differs from target-only"

        reference = {prompt: generate(prompt, speculate=False) for prompt in PROMPTS}

        # 1. sessions spread over both verify and both draft replicas
        run_all(12)
        counts = verify_prefills()
        assert all(counts[ip] > 0 for ip in VERIFY_IPS) and counts[THIRD_VERIFY] == 0, counts
        assert all(prefills(ip, model_metrics) > 0 for ip in DRAFT_IPS)

        # 2. a third verify record: in the pool within the re-resolution period, then given sessions;
        #    a new draft record whose draft has another vocabulary: refused, never used
        names.set("verify.specd.test", [*VERIFY_IPS, THIRD_VERIFY])
        names.set("draft.specd.test", [*DRAFT_IPS, WRONG_DRAFT])
        took = wait_until(lambda: pool_state(gateway_metrics, "verify", "serving") == 3, 10, "the third verify joining")
        assert took <= RESOLVE_PERIOD_S + 2.0, f"the third verify joined after {took:.1f} s"
        wait_until(lambda: pool_state(gateway_metrics, "draft", "refused") == 1, 10, "the wrong draft being refused")
        run_all(6)
        assert verify_prefills()[THIRD_VERIFY] > 0
        assert prefills(WRONG_DRAFT, model_metrics) == 0

        # 3. a replica that turns NOT_SERVING takes no new session; its open session goes on until released
        draining_ip = VERIFY_IPS[0]
        own = verify_pb2_grpc.VerifyServiceStub(stack.enter_context(grpc.insecure_channel(f"{draining_ip}:{verify_port}")))
        own.Prefill(verify_pb2.VerifyPrefillRequest(session_id="in-flight", prompt_token_ids=[5, 6, 7]), timeout=30)
        verifies[draining_ip].terminate()  # SIGTERM: NOT_SERVING, then it waits for its sessions
        wait_until(lambda: pool_state(gateway_metrics, "verify", "serving") == 2, 10, "the draining verify leaving the choice")
        before = verify_prefills()
        run_all(6)
        after = verify_prefills()
        assert after[draining_ip] == before[draining_ip], "a NOT_SERVING replica got a new session"
        assert sum(after.values()) - sum(before.values()) == 6
        scores = own.Verify(verify_pb2.VerifyRequest(
            session_id="in-flight", commit=common_pb2.Commit(prefix_length=3), draft_token_ids=[8]), timeout=30)
        assert len(scores.argmax_token_ids) == 2  # the open session still works while the replica drains
        assert verifies[draining_ip].poll() is None
        own.Release(common_pb2.ReleaseRequest(session_id="in-flight"), timeout=30)
        assert verifies[draining_ip].wait(timeout=30) == 0  # drained: it exits once its last session ended

        # 4. removing the records of the drained replica and of a serving one: no new sessions there
        names.set("verify.specd.test", [THIRD_VERIFY])
        wait_until(lambda: pool_state(gateway_metrics, "verify", "serving") == 1, RESOLVE_PERIOD_S + 5, "the removed record leaving the pool")
        before = verify_prefills()
        run_all(4)
        after = verify_prefills()
        assert after[VERIFY_IPS[1]] == before[VERIFY_IPS[1]] and after[THIRD_VERIFY] == before[THIRD_VERIFY] + 4
        changes = scrape_metrics("127.0.0.1", gateway_metrics)
        assert changes[("specd_gateway_discovery_changes_total", frozenset({("role", "verify"), ("change", "removed")}))] >= 2

