"""Model services check what they can before doing work, and refuse clearly (issue 15, items 2–5)."""

from __future__ import annotations

import json
import threading

import grpc
import pytest
import torch

from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from specd_common.errors import AlreadyExists, ResourceExhausted
from specd_engine.features import encode_features
from specd_common.params import Warp
from specd_common.sessions import SessionStore
from specd_engine.warping import warp_probs
from tests.conftest import start_cluster
from tests.test_services import generate


# --- the store claims a slot before the work ------------------------------------------------------
def test_opening_claims_the_id_and_slot_before_the_work_and_frees_them_if_it_fails():
    store: SessionStore[str] = SessionStore(max_sessions=2, idle_timeout_s=60)
    store.create("a", "state-a")
    ran = []
    with pytest.raises(AlreadyExists):
        with store.opening("a"):
            ran.append("duplicate")
    with pytest.raises(RuntimeError):
        with store.opening("b"):
            raise RuntimeError("the prefill failed")
    assert len(store) == 1  # the failed opening left no slot behind
    with store.opening("b") as keep:
        with pytest.raises(ResourceExhausted):  # "b" holds the last slot while it opens
            with store.opening("c"):
                ran.append("over the limit")
        keep("state-b")
    assert not ran
    with store.use("b") as state:
        assert state == "state-b"


def test_a_request_for_a_session_that_is_opening_waits_for_it():
    store: SessionStore[str] = SessionStore(max_sessions=4, idle_timeout_s=60)
    seen = []
    with store.opening("s") as keep:
        reader = threading.Thread(target=lambda: seen.append(store.use("s").__enter__()))
        reader.start()
        reader.join(0.2)
        assert reader.is_alive()  # blocked on the half-open session
        keep("ready")
    reader.join(5)
    assert seen == ["ready"]
    assert store.snapshot() == ["ready"]


# --- the services --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def feature_cluster(tiny):
    running = start_cluster(tiny.target, "feature", tiny.feature_head, max_sessions=2)
    yield running
    running.stop()


def test_verify_refuses_a_duplicate_or_an_extra_session_without_running_the_target(feature_cluster, monkeypatch):
    stub = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{feature_cluster.verify.port}"))
    lm = feature_cluster.verify.servicer.scorer.lm
    stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="one", prompt_token_ids=[5, 6, 7]), timeout=30)
    stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="two", prompt_token_ids=[5, 6, 7]), timeout=30)
    forwards = []
    monkeypatch.setattr(lm, "run_feeds", lambda *args: forwards.append(args))
    try:
        for session_id, code in (("one", grpc.StatusCode.ALREADY_EXISTS), ("three", grpc.StatusCode.RESOURCE_EXHAUSTED)):
            with pytest.raises(grpc.RpcError) as error:
                stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id=session_id, prompt_token_ids=list(range(5, 60))), timeout=30)
            assert error.value.code() == code
        assert forwards == []  # refused before any forward pass
    finally:
        for session_id in ("one", "two"):
            stub.Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=10)


def test_draft_refuses_a_prompt_longer_than_its_model_takes(feature_cluster):
    stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{feature_cluster.draft.port}"))
    limit = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10).max_sequence_length
    assert limit > 0
    with pytest.raises(grpc.RpcError) as error:
        stub.Prefill(draft_pb2.DraftPrefillRequest(session_id="long", prompt_token_ids=[5] * limit), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and str(limit - 1) in error.value.details()
    assert len(feature_cluster.draft.servicer.sessions) == 0


def test_draft_refuses_more_feature_rows_than_the_sequence_has(feature_cluster):
    stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{feature_cluster.draft.port}"))
    hidden = feature_cluster.draft.servicer.drafter.head.config.hidden_size
    prompt = [5, 6, 7, 8]
    stub.Prefill(draft_pb2.DraftPrefillRequest(session_id="f", prompt_token_ids=prompt,
                                               target_features=encode_features(torch.zeros(3, hidden), 0)), timeout=30)
    try:
        with pytest.raises(grpc.RpcError) as error:  # 3,400 rows for a 4-token session
            stub.Propose(draft_pb2.ProposeRequest(session_id="f", commit=common_pb2.Commit(prefix_length=4), num_draft_tokens=2,
                                                  target_features=encode_features(torch.zeros(3400, hidden), 0)), timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "4 tokens" in error.value.details()
    finally:
        stub.Release(common_pb2.ReleaseRequest(session_id="f"), timeout=10)


# --- tiny temperatures: computed stably, their limit is greedy --------------------------------------
def test_a_tiny_temperature_warps_to_the_argmax_without_nan():
    logits = torch.tensor([[3.0, 9.5, -2.0, 9.25], [40.0, -1e4, 39.0, 0.0]])
    for temperature in (1e-38, 1e-20, 1e-6):
        probs = warp_probs(logits, Warp(temperature=temperature, top_p=0.9))
        assert not torch.isnan(probs).any()
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(dim=-1), 4).float())


def test_a_tiny_temperature_through_the_gateway_gives_the_greedy_answer(feature_cluster):
    stub = feature_cluster.stub()
    greedy = generate(stub, text="hello world", max_new_tokens=12)
    cold = generate(stub, text="hello world", max_new_tokens=12, seed=3, sampling=common_pb2.SamplingParams(temperature=1e-38))
    assert cold.token_ids == greedy.token_ids and cold.finish_reason == greedy.finish_reason


# --- admission by memory: a KV-token budget -------------------------------------------------------
def test_the_token_budget_counts_what_sessions_hold_and_refuses_growth_past_it():
    store: SessionStore[str] = SessionStore(max_sessions=8, idle_timeout_s=60, max_tokens=100)
    store.create("a", "a")
    store.account("a", 60)
    with pytest.raises(ResourceExhausted, match="KV budget"):
        with store.opening("b", tokens=50):
            pass
    with store.opening("b", tokens=40) as keep:
        keep("b")
    assert store.tokens == 100
    with pytest.raises(ResourceExhausted):
        store.account("b", 41)
    store.account("a", 20)  # a rollback frees positions
    store.account("b", 80)
    store.release("a")
    assert store.tokens == 80


def test_the_default_budget_comes_from_free_memory_and_the_kv_bytes_per_position():
    from types import SimpleNamespace

    from specd_engine.autotune import kv_bytes_per_token, kv_token_budget

    smollm2 = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64)
    assert kv_bytes_per_token(smollm2, 4) == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_token_budget(46_080, 20 * 2**30) == 233_016  # half of 20 GiB
    assert kv_token_budget(46_080, 0) == 0  # unknown free memory: no budget rather than a wrong one


def test_verify_refuses_past_its_kv_budget_before_any_forward(tiny, monkeypatch):
    from specd_common.config import ServerConfig
    from specd_engine.models import load_causal_lm
    from verify_service.app import start_verify_server

    running = start_verify_server(load_causal_lm(str(tiny.target)), ServerConfig(port=0), kv_token_budget=100)
    stub = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{running.port}"))
    try:
        info = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)
        assert json.loads(info.runtime_config)["kv_token_budget"] == 100
        # measured at start-up, outside the budget; typed, for the gateway's speculation cap
        rows = (2, 4, 8, 16, 32)  # autotune.batch_sizes of the default --max-batch-size (32)
        assert {(cost.rows, cost.positions) for cost in info.runtime_profile.batch_costs} == {(b, n) for b in rows for n in (1, 4, 8)}
        assert all(cost.milliseconds > 0 for cost in info.runtime_profile.batch_costs)
        stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="a", prompt_token_ids=list(range(5, 75))), timeout=30)  # 70
        forwards = []
        run = running.servicer.scorer.lm.run_feeds
        monkeypatch.setattr(running.servicer.scorer.lm, "run_feeds", lambda *a, **k: forwards.append(a) or run(*a, **k))
        with pytest.raises(grpc.RpcError) as error:
            stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="b", prompt_token_ids=list(range(5, 50))), timeout=30)  # 45
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--kv-token-budget" in error.value.details()
        stub.Verify(verify_pb2.VerifyRequest(session_id="a", commit=common_pb2.Commit(prefix_length=70), draft_token_ids=[7] * 16), timeout=30)
        with pytest.raises(grpc.RpcError) as error:  # all 16 drafts kept + a bonus token + 16 drafts = 103 > 100
            stub.Verify(verify_pb2.VerifyRequest(session_id="a", commit=common_pb2.Commit(prefix_length=86, append_token_ids=[7]),
                                                 draft_token_ids=[7] * 16), timeout=30)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(forwards) == 1  # only the Verify that fitted ran the target
    finally:
        running.server.stop(0)


def test_draft_refuses_past_its_kv_budget_before_drafting(tiny, monkeypatch):
    from draft_service.app import draft_token_budget, make_drafter, start_draft_server
    from specd_common.config import ServerConfig

    drafter = make_drafter("model", str(tiny.draft_same))
    assert drafter.bytes_per_token() == 2 * 2 * 2 * 16 * 4  # tiny Llama: 2 layers × K,V × 2 KV heads × 16 dims × fp32
    assert draft_token_budget(make_drafter("ngram"), 0) == 0  # token ids only: no budget
    running = start_draft_server(drafter, ServerConfig(port=0), kv_token_budget=100)
    stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{running.port}"))
    try:
        stub.Prefill(draft_pb2.DraftPrefillRequest(session_id="a", prompt_token_ids=list(range(5, 75))), timeout=30)  # 70
        drafted = []
        propose = drafter.propose
        monkeypatch.setattr(drafter, "propose", lambda *a, **k: drafted.append(a) or propose(*a, **k))
        with pytest.raises(grpc.RpcError) as error:
            stub.Prefill(draft_pb2.DraftPrefillRequest(session_id="b", prompt_token_ids=list(range(5, 50))), timeout=30)  # 45
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--kv-token-budget" in error.value.details()
        stub.Propose(draft_pb2.ProposeRequest(session_id="a", commit=common_pb2.Commit(prefix_length=60), num_draft_tokens=16), timeout=30)
        with pytest.raises(grpc.RpcError) as error:  # 76 held, + 16 appended + 16 drafts = 108 > 100
            stub.Propose(draft_pb2.ProposeRequest(session_id="a", commit=common_pb2.Commit(prefix_length=60, append_token_ids=[7] * 16 + [8] * 16),
                                                  num_draft_tokens=16), timeout=30)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(drafted) == 1  # only the Propose that fitted drafted
    finally:
        running.server.stop(0)


# --- the budget bounds memory: a real verify process with the default target ---------------------
KV_BUDGET_TOKENS = 8100
PROMPT_TOKENS = 2000
# A prefill's transient (activations, the allocator's retained free memory) is measured on the
# first prompt; it must show chunked prefill (specd_engine/lm.py PREFILL_CHUNK: 150-270 MiB seen on
# 2-core VMs; a whole 2,000-token pass at once takes 400-570 MiB, attention being 9 heads × 2,000²
# floats a matrix). The later prompts may add only their KV and the heap's fragmentation (30-50 MiB
# seen here, more on CI's VM); a KV accounting off by a third of the budget would still fail.
TRANSIENT_LIMIT = 384 * 2**20
FRAGMENTATION_SLACK = 128 * 2**20


def memory_kib(pid: int, field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of a process, in KiB."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


@pytest.mark.e2e
def test_a_full_kv_budget_refuses_at_once_and_bounds_the_verify_rss(tmp_path):
    """Fill a `specd serve verify` (SmolLM2-135M, fp32) budget of 8,100 positions with 2,000-token
    prompts: the fifth is refused with RESOURCE_EXHAUSTED in under a second, and the process's peak
    RSS stays within its RSS when ready (model resident after a 4-token prefill, runtime) + the
    KV its four sessions hold (4 × (2,000 + 128 spare) × 46,080 B = 374 MiB) + one prefill's
    transient, measured on the first prompt, + 128 MiB for fragmentation. Without the budget every
    prompt would be admitted (and a fifth adds 92 MB)."""
    import subprocess
    import sys
    import time

    from specd_engine.autotune import kv_bytes_per_token
    from specd_engine.kv_cache import SPARE_COLUMNS
    from tests.specd_stack import REPO, free_ports, repo_env, serving

    (port,) = free_ports(1)
    command = [sys.executable, "-m", "specd_app.cli", "serve", "verify", "--port", str(port), "--threads", "1",
               "--prepack", "off", "--metrics-port", "-1", "--kv-token-budget", str(KV_BUDGET_TOKENS)]
    with open(tmp_path / "verify.log", "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=repo_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not serving(f"127.0.0.1:{port}"):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "verify.log").read_text()[-3000:]
            time.sleep(0.5)
        stub = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        info = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30)
        # the weights are memory-mapped: resident only once a forward pass has read them all
        stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="warm-up", prompt_token_ids=[5, 6, 7, 8]), timeout=60)
        stub.Release(common_pb2.ReleaseRequest(session_id="warm-up"), timeout=30)
        time.sleep(1.5)  # the reaper's heap trim after the release (specd_common/sessions.py) is done
        ready_rss = memory_kib(process.pid, "VmRSS") * 1024
        with open(f"/proc/{process.pid}/clear_refs", "w") as refs:  # VmHWM from here on: the prefills' peak only,
            refs.write("5")  # not start-up's (its timings' passes peaked before the trim above)
        per_token = kv_bytes_per_token(_smollm2_config(), 4)
        assert per_token == 46_080
        prompt = [(7 * i) % (info.vocab_size - 10) + 5 for i in range(PROMPT_TOKENS)]
        for index in range(KV_BUDGET_TOKENS // PROMPT_TOKENS):
            stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id=f"s{index}", prompt_token_ids=prompt), timeout=300)
            if index == 0:
                transient = memory_kib(process.pid, "VmHWM") * 1024 - ready_rss - PROMPT_TOKENS * per_token
                assert transient <= TRANSIENT_LIMIT, f"one prefill's transient {transient / 2**20:.0f} MiB: not chunked?"
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="one-too-many", prompt_token_ids=prompt), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - started < 1.0
        peak = memory_kib(process.pid, "VmHWM") * 1024
        sessions = KV_BUDGET_TOKENS // PROMPT_TOKENS  # each holds its prompt + SPARE_COLUMNS (kv_cache.GrowingLayer.reserve)
        bound = ready_rss + sessions * (PROMPT_TOKENS + SPARE_COLUMNS) * per_token + transient + FRAGMENTATION_SLACK
        print(f"peak {peak / 2**20:.0f} MiB, ready {ready_rss / 2**20:.0f} MiB, transient {transient / 2**20:.0f} MiB, "
              f"bound {bound / 2**20:.0f} MiB")
        assert peak <= bound, f"peak RSS {peak / 2**20:.0f} MiB > bound {bound / 2**20:.0f} MiB (ready {ready_rss / 2**20:.0f} MiB)"
    finally:
        process.terminate()
        process.wait(timeout=60)


def _smollm2_config():
    """SmolLM2-135M's attention shapes: 30 layers, 3 KV heads of 64 dimensions."""
    from types import SimpleNamespace

    return SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, head_dim=64, num_attention_heads=9, hidden_size=576)
