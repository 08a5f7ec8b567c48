"""The three services in-process over real gRPC sockets, with tiny random models (no download)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, generate_pb2, verify_pb2, verify_pb2_grpc
from specd_common.errors import FailedPrecondition
from tests.conftest import start_cluster

REPO = Path(__file__).resolve().parents[1]
FIXED = generate_pb2.DRAFT_LENGTH_POLICY_FIXED
ADAPTIVE = generate_pb2.DRAFT_LENGTH_POLICY_ADAPTIVE
PROMPTS = ["hello world", "the quick brown fox", "def add(a, b):", "Natalia sold clips to 48 of her friends"]


def generate(stub, **fields) -> generate_pb2.GenerateResponse:
    return stub.Generate(generate_pb2.GenerateRequest(**fields), timeout=60)


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def assert_greedy_exact_with_drafts(cluster, target_dir: Path, prompt: str, max_new_tokens: int) -> None:
    """Greedy speculation through `cluster` equals its target-only decoding and transformers' generate;
    the draft drafted every round (a feature drafter starved of the target's features fails, and the
    gateway then drafts nothing); no session is left behind."""
    stub = cluster.stub()
    speculative = generate(stub, text=prompt, max_new_tokens=max_new_tokens, draft_length_policy=FIXED)
    target_only = generate(stub, text=prompt, max_new_tokens=max_new_tokens, disable_speculation=True)
    assert list(speculative.token_ids) == list(target_only.token_ids)
    assert list(speculative.token_ids) == hf_greedy(target_dir, list(speculative.prompt_token_ids), max_new_tokens)
    assert speculative.stats.draft_tokens >= speculative.stats.target_passes - 1
    assert wait_for_no_sessions(cluster) == {"verify": 0, "draft": 0}


def wait_for_no_sessions(cluster, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(cluster.open_sessions().values()):
            break
        time.sleep(0.05)
    return cluster.open_sessions()


# --- exactness --------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculation_equals_target_only_and_transformers(cluster, tiny, prompt):
    stub = cluster.stub()
    speculative = generate(stub, text=prompt, max_new_tokens=40, draft_length_policy=FIXED)
    target_only = generate(stub, text=prompt, max_new_tokens=40, disable_speculation=True)
    assert list(speculative.token_ids) == list(target_only.token_ids)
    assert speculative.text == target_only.text
    expected = hf_greedy(tiny.target, list(speculative.prompt_token_ids), 40)
    assert list(speculative.token_ids) == expected
    assert speculative.stats.draft_tokens > 0 and target_only.stats.draft_tokens == 0
    assert target_only.stats.target_passes == len(target_only.token_ids)
    assert speculative.stats.target_passes < len(speculative.token_ids)  # speculation saved passes


def test_logit_bias_bans_and_forces_tokens_exactly_with_speculation_or_without(cluster):
    """OpenAI's logit_bias on the target's logits: -100 bans a token, +100 forces it; greedy speculation
    keeps target-only's biased answer token for token, and a forced token wins sampled rounds too."""
    stub = cluster.stub()
    plain = generate(stub, text=PROMPTS[3], max_new_tokens=24, disable_speculation=True)
    banned = {token: -100.0 for token in set(plain.token_ids[:3])}
    answers = [generate(stub, text=PROMPTS[3], max_new_tokens=24, sampling=common_pb2.SamplingParams(logit_bias=banned), **mode)
               for mode in ({"draft_length_policy": FIXED}, {"disable_speculation": True})]
    assert list(answers[0].token_ids) == list(answers[1].token_ids) != list(plain.token_ids)
    assert not set(answers[0].token_ids) & set(banned) and answers[0].stats.draft_tokens > 0
    forced = common_pb2.SamplingParams(logit_bias={11: 100.0})
    for sampling in (forced, common_pb2.SamplingParams(temperature=1.0, logit_bias={11: 100.0})):
        for mode in ({"draft_length_policy": FIXED}, {"disable_speculation": True}):
            reply = generate(stub, text=PROMPTS[3], max_new_tokens=12, sampling=sampling, seed=3, **mode)
            assert list(reply.token_ids) == [11] * 12, (sampling, mode)
    vocab = cluster.gateway.servicer.backends.target_info.vocab_size
    for bias in ({vocab: 1.0}, {3: 101.0}, {-1: 1.0}):
        with pytest.raises(grpc.RpcError) as refused:
            generate(stub, text=PROMPTS[0], max_new_tokens=2, sampling=common_pb2.SamplingParams(logit_bias=bias))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in refused.value.details()


def test_identical_draft_is_always_accepted(tiny):
    running = start_cluster(tiny.target, "model", tiny.draft_same, num_draft_tokens=4)
    try:
        reply = generate(running.stub(), text="hello world", max_new_tokens=25, draft_length_policy=FIXED)
        assert reply.stats.accepted_tokens == reply.stats.draft_tokens
        assert reply.stats.target_passes == 5  # 5 tokens a pass: 4 drafts + the bonus
    finally:
        running.stop()


class LinearCosts:
    """Step costs fixed by the test (a round with k drafts costs 1 + 0.1 k), so k depends on acceptance
    alone; the live measurement of costs is tested in test_units."""

    def observe_verify(self, positions: int, seconds: float, heads: bool = False, tree: bool = False) -> None:
        pass

    def observe_draft(self, k: int, seconds: float) -> None:
        pass

    def round_cost_s(self, k: int, branches: int = 1, drafting: bool = True, heads: Optional[bool] = None,
                     widened: Optional[int] = None, tree: bool = False) -> float:
        return 1.0 + 0.1 * (k + min(k, k if widened is None else widened) * (branches - 1))


def test_adaptive_draft_length_follows_acceptance(tiny):
    """A drafter that is mostly right (n-gram on looping text) keeps drafting; an unrelated model draft
    is mostly not asked at all. The policy never changes greedy output."""
    cases = (("ngram", None, lambda fixed, adaptive: adaptive > 1.0),
             ("model", tiny.draft_other, lambda fixed, adaptive: adaptive < 0.5 * fixed))
    for drafter, draft_model, check in cases:
        # one pass a plain Verify: with a tiny model the round trip is nearly all of a round, so plain
        # calls of 4 passes out-run any drafts as served and the guard rests them (not what this tests)
        running = start_cluster(tiny.target, drafter, draft_model, num_draft_tokens=4, plain_steps=1)
        running.gateway.servicer.backends.costs = LinearCosts()
        try:
            stub = running.stub()
            request = dict(text="the quick brown fox", max_new_tokens=80)
            fixed = generate(stub, **request, draft_length_policy=FIXED)
            adaptive = generate(stub, **request, draft_length_policy=ADAPTIVE)
            assert list(adaptive.token_ids) == list(fixed.token_ids)
            per_pass = [r.stats.draft_tokens / r.stats.target_passes for r in (fixed, adaptive)]
            assert check(*per_pass), (drafter, per_pass)
        finally:
            running.stop()


def test_speculation_pauses_under_load(tiny):
    """Past max_speculative_requests running requests, rounds are target-only; the output is unchanged."""
    running = start_cluster(tiny.target, "model", tiny.draft_same, max_speculative_requests=1)
    try:
        stub = running.stub()
        alone = generate(stub, text="hello world", max_new_tokens=20, draft_length_policy=FIXED)
        holder = stub.GenerateStream(
            generate_pb2.GenerateRequest(text="hello", max_new_tokens=480, disable_speculation=True), timeout=60
        )
        next(holder)  # one request is running: a second one makes two, above the limit
        busy = generate(stub, text="hello world", max_new_tokens=20, draft_length_policy=FIXED)
        holder.cancel()
        assert alone.stats.draft_tokens > 0 and busy.stats.draft_tokens == 0
        assert list(busy.token_ids) == list(alone.token_ids)
    finally:
        running.stop()


def test_a_paused_request_stops_collecting_target_features(tiny, monkeypatch):
    """A feature drafter needs the target's features of every committed position. A request alone asks
    the verify for them and drafts; one that meets a paused round (load) asks for none (not even with
    its prompt) and leaves the draft service out; its output is unchanged."""
    from verify_service.service import VerifyServicer

    asked: list[bool] = []
    real = VerifyServicer.Verify

    def recording(self, request, context):
        asked.append(request.return_features)
        return real(self, request, context)

    monkeypatch.setattr(VerifyServicer, "Verify", recording)  # before the server binds its handlers
    running = start_cluster(tiny.target, "feature", tiny.feature_head, max_speculative_requests=1)
    try:
        stub = running.stub()
        alone = generate(stub, text="hello world", max_new_tokens=20, draft_length_policy=FIXED)
        assert alone.stats.draft_tokens > 0 and all(asked)
        holder = stub.GenerateStream(
            generate_pb2.GenerateRequest(text="hello", max_new_tokens=480, disable_speculation=True), timeout=60
        )
        next(holder)  # one request is running: a second one makes two, above the limit
        asked.clear()
        proposes = running.calls.counts["Propose"]
        busy = generate(stub, text="hello world", max_new_tokens=20, draft_length_policy=FIXED)
        holder.cancel()
        assert asked and not any(asked)
        assert running.calls.counts["Propose"] == proposes and busy.stats.draft_tokens == 0
        assert list(busy.token_ids) == list(alone.token_ids)
    finally:
        running.stop()


def test_the_speculation_cache_is_exact_hits_and_keeps_seeded_output(tiny):
    """A feature head's draft service prepares the next round while the target verifies: greedy output
    stays the target's, some Proposes are answered from the cache, and a seeded sampled request gives
    the same answer every time however the worker's timing falls."""
    running = start_cluster(tiny.target, "feature", tiny.feature_head)
    try:
        stub = running.stub()
        hits = lookups = 0
        for prompt in PROMPTS[:3]:
            cached = generate(stub, text=prompt, max_new_tokens=40, draft_length_policy=FIXED)
            target_only = generate(stub, text=prompt, max_new_tokens=40, disable_speculation=True)
            assert list(cached.token_ids) == list(target_only.token_ids)
            hits, lookups = hits + cached.stats.draft_cache_hits, lookups + cached.stats.draft_cache_lookups
            assert cached.stats.draft_cache_hit_wait_seconds <= cached.stats.draft_cache_lookup_wait_seconds <= cached.stats.draft_wait_seconds
        assert 0 < hits <= lookups
        assert running.draft.servicer.cache_hits == hits
        sampling = common_pb2.SamplingParams(temperature=0.9)
        seeded = {tuple(generate(stub, text="hello", max_new_tokens=24, sampling=sampling, seed=3,
                                 draft_length_policy=FIXED).token_ids) for _ in range(3)}
        assert len(seeded) == 1
    finally:
        running.stop()


def test_ngram_drafter_is_exact_too(tiny):
    running = start_cluster(tiny.target, "ngram")
    try:
        stub = running.stub()
        prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox"
        speculative = generate(stub, text=prompt, raw=True, max_new_tokens=30)
        target_only = generate(stub, text=prompt, raw=True, max_new_tokens=30, disable_speculation=True)
        assert list(speculative.token_ids) == list(target_only.token_ids)
        assert speculative.stats.draft_tokens > 0
    finally:
        running.stop()


def test_same_seed_same_sample_and_seeds_matter(cluster):
    stub = cluster.stub()
    sampling = common_pb2.SamplingParams(temperature=1.0, top_p=0.95)
    first = generate(stub, text="hello world", max_new_tokens=20, sampling=sampling, seed=11)
    again = generate(stub, text="hello world", max_new_tokens=20, sampling=sampling, seed=11)
    others = {tuple(generate(stub, text="hello world", max_new_tokens=20, sampling=sampling, seed=s).token_ids) for s in range(3)}
    assert list(first.token_ids) == list(again.token_ids)
    assert len(others) > 1


def test_stream_matches_unary_and_reports_at_the_end(cluster):
    stub = cluster.stub()
    request = generate_pb2.GenerateRequest(text="the quick brown fox", max_new_tokens=24)
    messages = list(stub.GenerateStream(request, timeout=60))
    unary = stub.Generate(request, timeout=60)
    assert [t for m in messages for t in m.token_ids] == list(unary.token_ids)
    assert "".join(m.text for m in messages) == unary.text
    assert list(messages[0].prompt_token_ids) == list(unary.prompt_token_ids)
    assert messages[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == 24 and messages[-1].stats.target_passes > 0
    assert all(m.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])


def test_stop_string_cuts_the_text(cluster):
    stub = cluster.stub()
    full = generate(stub, text="hello world", max_new_tokens=40)
    stop = full.text[10:13]
    assert len(stop) == 3
    cut = generate(stub, text="hello world", max_new_tokens=40, stop=[stop])
    assert cut.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert cut.text == full.text[: full.text.index(stop)]


def test_prompt_forms_agree(cluster):
    stub = cluster.stub()
    as_text = generate(stub, text="hello world", max_new_tokens=5)
    as_messages = generate(
        stub,
        messages=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content="hello world")]),
        max_new_tokens=5,
    )
    as_ids = generate(stub, token_ids=generate_pb2.TokenIds(ids=as_text.prompt_token_ids), max_new_tokens=5)
    assert as_text.prompt_token_ids == as_messages.prompt_token_ids == as_ids.prompt_token_ids
    assert as_text.token_ids == as_messages.token_ids == as_ids.token_ids
    raw = generate(stub, text="hello world", raw=True, max_new_tokens=5)
    assert len(raw.prompt_token_ids) < len(as_text.prompt_token_ids)


def test_gateway_chat_template_matches_transformers(cluster, tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.target)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert cluster.gateway.servicer.backends.tokenizer.encode_chat(messages) == list(expected)


# --- one RPC per service per round ------------------------------------------------------------------
def test_each_round_costs_one_propose_and_one_verify(tiny):
    running = start_cluster(tiny.target, "model", tiny.draft_noisy)
    try:
        running.calls.counts.clear()
        # FIXED: every round drafts (under ADAPTIVE a round may choose k = 0 and skip the draft call)
        reply = generate(running.stub(), text="hello world", max_new_tokens=30, draft_length_policy=FIXED)
        counts = running.calls.counts
        passes = reply.stats.target_passes
        assert counts["Verify"] == passes
        # every round drafts except a last round with a single token left (k = 0 saves the draft call)
        assert counts["Propose"] in (passes, passes - 1)
        assert counts["Prefill"] == 2 and counts["Release"] == 2
    finally:
        running.stop()


# --- bad input ---------------------------------------------------------------------------------------
BAD_REQUESTS = {
    "no prompt": dict(max_new_tokens=5),
    "empty text": dict(text=""),
    "negative max_new_tokens": dict(text="hi", max_new_tokens=-1),
    "huge max_new_tokens": dict(text="hi", max_new_tokens=10**6),
    "negative temperature": dict(text="hi", sampling=common_pb2.SamplingParams(temperature=-1)),
    "top_p above one": dict(text="hi", sampling=common_pb2.SamplingParams(temperature=1, top_p=2)),
    "negative top_k": dict(text="hi", sampling=common_pb2.SamplingParams(top_k=-5)),
    "too many drafts": dict(text="hi", num_draft_tokens=99),
    "unknown draft length policy": dict(text="hi", draft_length_policy=7),
    "token id out of vocabulary": dict(token_ids=generate_pb2.TokenIds(ids=[1, 10**6])),
    "negative token id": dict(token_ids=generate_pb2.TokenIds(ids=[-3])),
    "empty token ids": dict(token_ids=generate_pb2.TokenIds(ids=[])),
    "unknown role": dict(messages=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="robot", content="x")])),
    "no messages": dict(messages=generate_pb2.ChatMessages()),
    "too many stop strings": dict(text="hi", stop=["x"] * 17),
    "empty stop string": dict(text="hi", stop=[""]),
    "prompt longer than the context": dict(token_ids=generate_pb2.TokenIds(ids=[5] * 600)),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_requests_get_invalid_argument_and_leak_nothing(cluster, name):
    with pytest.raises(grpc.RpcError) as caught:
        generate(cluster.stub(), **BAD_REQUESTS[name])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert len(caught.value.details()) > 10
    assert wait_for_no_sessions(cluster) == {"verify": 0, "draft": 0}


def test_model_services_validate_their_own_input(cluster):
    verify = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{cluster.verify.port}"))
    draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{cluster.draft.port}"))

    def code_of(call, request):
        with pytest.raises(grpc.RpcError) as caught:
            call(request, timeout=10)
        return caught.value.code()

    commit = common_pb2.Commit(prefix_length=1)
    assert code_of(verify.Verify, verify_pb2.VerifyRequest(session_id="nope", commit=commit)) == grpc.StatusCode.NOT_FOUND
    assert code_of(draft.Propose, draft_pb2.ProposeRequest(session_id="nope", commit=commit, num_draft_tokens=2)) == grpc.StatusCode.NOT_FOUND
    assert code_of(verify.Verify, verify_pb2.VerifyRequest(session_id="", commit=commit)) == grpc.StatusCode.INVALID_ARGUMENT
    verify.Prefill(verify_pb2.VerifyPrefillRequest(session_id="s1", prompt_token_ids=[1, 2, 3]), timeout=10)
    try:
        duplicate = verify_pb2.VerifyPrefillRequest(session_id="s1", prompt_token_ids=[1])
        assert code_of(verify.Prefill, duplicate) == grpc.StatusCode.ALREADY_EXISTS
        too_far = verify_pb2.VerifyRequest(session_id="s1", commit=common_pb2.Commit(prefix_length=9))
        assert code_of(verify.Verify, too_far) == grpc.StatusCode.INVALID_ARGUMENT
        bad_draft = verify_pb2.VerifyRequest(session_id="s1", commit=commit, draft_token_ids=[10**6])
        assert code_of(verify.Verify, bad_draft) == grpc.StatusCode.INVALID_ARGUMENT
        zero_k = draft_pb2.ProposeRequest(session_id="s1", commit=commit, num_draft_tokens=0)
        assert code_of(draft.Propose, zero_k) == grpc.StatusCode.INVALID_ARGUMENT
        # a retried Verify with the same commit gives the same answer (idempotent KV sync)
        again = verify_pb2.VerifyRequest(session_id="s1", commit=common_pb2.Commit(prefix_length=3), draft_token_ids=[4, 5])
        first, second = verify.Verify(again, timeout=10), verify.Verify(again, timeout=10)
        assert first.argmax_token_ids == second.argmax_token_ids and first.sequence_length == second.sequence_length
    finally:
        verify.Release(common_pb2.ReleaseRequest(session_id="s1"), timeout=10)


def test_full_services_answer_resource_exhausted(tiny):
    running = start_cluster(tiny.target, "model", tiny.draft_noisy, max_sessions=1, max_waiting=0)
    try:
        stub = running.stub()
        holder = stub.GenerateStream(generate_pb2.GenerateRequest(text="hello", max_new_tokens=400), timeout=60)
        next(holder)  # the only session is now taken
        with pytest.raises(grpc.RpcError) as caught:
            generate(stub, text="hello", max_new_tokens=5)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        holder.cancel()
        assert wait_for_no_sessions(running) == {"verify": 0, "draft": 0}
        assert len(generate(stub, text="hello", max_new_tokens=5).token_ids) == 5  # capacity is back
    finally:
        running.stop()


def test_deadlines_propagate_and_free_sessions(cluster):
    stub = cluster.stub()
    outcomes = set()
    for timeout_s in (0.01, 0.03, 0.1, 0.3):
        try:
            stub.Generate(generate_pb2.GenerateRequest(text="hello", max_new_tokens=480), timeout=timeout_s)
            outcomes.add("finished")
        except grpc.RpcError as error:
            # or refused at once: the previous request may still hold the gateway until its next round
            # notices its caller left, and then this one's tokens cannot come in time (gateway/admission.py)
            assert error.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED), error.details()
            outcomes.add("expired" if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "refused")
    assert "expired" in outcomes
    assert wait_for_no_sessions(cluster) == {"verify": 0, "draft": 0}


def test_client_disconnect_mid_stream_frees_both_sessions(cluster):
    stream = cluster.stub().GenerateStream(generate_pb2.GenerateRequest(text="hello", max_new_tokens=400), timeout=60)
    next(stream)
    assert cluster.open_sessions() == {"verify": 1, "draft": 1}
    stream.cancel()
    assert wait_for_no_sessions(cluster) == {"verify": 0, "draft": 0}


def test_a_released_session_leaves_the_verify_batcher(cluster):
    """After an answer, its verify session is released and the batcher forgets it (SessionStore.on_drop →
    Scorer.close → ForwardBatcher.forget): the next prompt is not cut into a chunk beside a stream that
    ended, and no batch waits for it."""
    generate(cluster.stub(), text="the quick brown fox", max_new_tokens=8, disable_speculation=True)
    assert wait_for_no_sessions(cluster) == {"verify": 0, "draft": 0}
    batcher = cluster.verify.servicer.scorer.batcher
    assert batcher is not None and batcher.stats.batches > 0
    assert batcher._streaming == {} and batcher._batch_target() == 0


def test_idle_sessions_expire_on_both_services(tiny):
    running = start_cluster(tiny.target, "model", tiny.draft_noisy, idle_timeout_s=0.3)
    try:
        verify = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{running.verify.port}"))
        verify.Prefill(verify_pb2.VerifyPrefillRequest(session_id="abandoned", prompt_token_ids=[1, 2]), timeout=10)
        assert running.open_sessions()["verify"] == 1
        assert wait_for_no_sessions(running, timeout_s=5) == {"verify": 0, "draft": 0}
    finally:
        running.stop()


def test_draft_with_another_vocabulary_is_refused(tiny):
    with pytest.raises(FailedPrecondition, match="different vocabularies"):
        start_cluster(tiny.target, "model", tiny.other_vocab).stop()


# --- build hygiene -------------------------------------------------------------------------------------
def test_committed_stubs_are_fresh(tmp_path):
    protos = sorted((REPO / "protos/specd/v1").glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO / "protos"), f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, protos)],
        check=True,
    )
    generated = sorted(p for p in (tmp_path / "specd/v1").iterdir() if p.suffix in (".py", ".pyi"))
    assert generated, "protoc produced nothing"
    for fresh in generated:
        committed = REPO / "protos/specd/v1" / fresh.name
        assert committed.exists() and committed.read_text() == fresh.read_text(), f"{fresh.name} is stale: run `make protos`"


def test_gateway_does_not_import_torch():
    code = (
        "import sys, gateway.app, gateway.service, gateway.engine, gateway.tokenizer;"
        "assert 'torch' not in sys.modules, 'torch imported'; assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
