"""The OpenAI-compatible HTTP API, driven by the official `openai` package over real HTTP.

A tiny target and a partly agreeing model draft run in this process behind real sockets; every
HTTP answer is compared with the gRPC answer for the same request (same engine, same tokens). The
README's curl examples run against the real default model in tests/test_e2e.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Iterator

import grpc
import openai
import pytest

from specd.v1 import common_pb2, generate_pb2
from gateway.app import http_server
from tests.conftest import Cluster, TinyModels, client_for, http_port, start_cluster
from tests.specd_stack import gateway_health

TOKEN = "s3cret-http-token"


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    (listed,) = client.models.list().data
    return listed.id


def grpc_answer(cluster: Cluster, **fields) -> generate_pb2.GenerateResponse:
    return cluster.stub().Generate(generate_pb2.GenerateRequest(**fields), timeout=60)


def chat_request(content: str, max_new_tokens: int) -> dict:
    return {"messages": generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content=content)]),
            "max_new_tokens": max_new_tokens}


MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def test_models_lists_the_target(served: Cluster, model: str):
    assert model == served.gateway.servicer.backends.target_info.model_name


def test_greedy_chat_equals_the_grpc_answer_and_counts_usage(served: Cluster, client: openai.OpenAI, model: str):
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0)
    expected = grpc_answer(served, **chat_request(MESSAGES[0]["content"], 24))
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == ("length" if len(expected.token_ids) == 24 else "stop")
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == len(expected.prompt_token_ids) + len(expected.token_ids)
    stats = reply.model_extra["specd"]  # the extension field: speculation ran and is reported
    assert stats["target_passes"] >= 1 and stats["draft_tokens"] > 0
    assert 0.0 <= stats["acceptance_rate"] <= 1.0


def test_streamed_chat_deltas_concatenate_to_the_same_text(served: Cluster, client: openai.OpenAI, model: str):
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    expected = grpc_answer(served, **chat_request(MESSAGES[0]["content"], 24))
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected.text
    assert [c.choices[0].finish_reason for c in content][-1] in ("length", "stop")
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    usage = chunks[-1]  # include_usage: one more chunk with no choices and the usage
    assert usage.choices == [] and usage.usage.completion_tokens == len(expected.token_ids)
    assert usage.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert len({c.id for c in chunks}) == 1


def test_completions_are_raw_text_and_accept_token_ids(served: Cluster, client: openai.OpenAI, model: str):
    prompt = "Once upon a time"
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0)
    expected = grpc_answer(served, text=prompt, raw=True, max_new_tokens=20)
    assert reply.choices[0].text == expected.text
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    by_ids = client.completions.create(model=model, prompt=list(expected.prompt_token_ids), max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == expected.text


def test_default_max_tokens_of_completions_is_openais_16(client: openai.OpenAI, model: str):
    reply = client.completions.create(model=model, prompt="The sea", temperature=0, stop=None)
    assert reply.usage.completion_tokens <= 16
    assert reply.choices[0].finish_reason == "length" or reply.usage.completion_tokens < 16


def test_seeded_sampling_equals_grpc_with_the_same_seed(served: Cluster, client: openai.OpenAI, model: str):
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    expected = grpc_answer(served, **chat_request(MESSAGES[0]["content"], 20), seed=1234,
                           sampling=common_pb2.SamplingParams(temperature=0.9, top_p=0.95))
    assert reply.choices[0].message.content == expected.text
    other = grpc_answer(served, **chat_request(MESSAGES[0]["content"], 20), seed=4321,
                        sampling=common_pb2.SamplingParams(temperature=0.9, top_p=0.95))
    assert other.token_ids != expected.token_ids, "the seed must matter (a different seed, different tokens)"


def test_stop_strings_end_the_text_before_them(served: Cluster, client: openai.OpenAI, model: str):
    full = grpc_answer(served, **chat_request(MESSAGES[0]["content"], 24)).text
    stop = full[5:7]
    assert stop and stop in full
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop])
    assert reply.choices[0].message.content == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"top_logprobs": 2}, "invalid 'top_logprobs': needs logprobs: true"),
        ({"n": 2}, "'n' is not supported by specd (only 1 is accepted)"),
        ({"frequency_penalty": 0.5}, "'frequency_penalty' is not supported"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "'tools' is not supported"),
        ({"temperature": 3}, "invalid 'temperature'"),
        ({"max_tokens": 0}, "invalid 'max_tokens'"),
        ({"messages": []}, "invalid 'messages'"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "invalid 'messages[0].role'"),
    ],
)
def test_bad_input_is_a_400_that_names_the_parameter(client: openai.OpenAI, model: str, extra: dict, fragment: str):
    request = {"model": model, "messages": MESSAGES, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**request)
    assert refused.value.status_code == 400
    assert fragment in refused.value.body["message"], refused.value.body


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize(
    "path, fields, param, fragment",
    [
        # the two former 500s: a lone surrogate (JSON allows it, UTF-8 and protobuf cannot) and an id beyond int32
        (CHAT, {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content", "lone UTF-16 surrogate"),
        (COMPLETIONS, {"prompt": [1099511627776]}, "prompt[0]", "vocabulary in [0, "),
        (COMPLETIONS, {"prompt": [1, 5000]}, "prompt[1]", "vocabulary in [0, "),  # int32, beyond the tiny vocabulary
        (COMPLETIONS, {"prompt": [1, -1]}, "prompt[1]", "got -1"),
        # strict types: no bool as an int, no string as a bool, no fractional ints, no NaN / Infinity
        (CHAT, {"max_tokens": True}, "max_tokens", "must be an integer in [1, 8192], got true"),
        (CHAT, {"max_tokens": 4.0}, "max_tokens", "must be an integer"),
        (CHAT, {"max_tokens": "4"}, "max_tokens", "must be an integer"),
        (CHAT, {"max_completion_tokens": 8193}, "max_completion_tokens", "in [1, 8192], got 8193"),
        (COMPLETIONS, {"max_tokens": False}, "max_tokens", "got false"),
        (CHAT, {"stream": "yes"}, "stream", 'must be true or false, got "yes"'),
        (CHAT, {"stream": 1}, "stream", "must be true or false"),
        (CHAT, {"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage", "true or false"),
        (CHAT, {"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation", "not supported"),
        (CHAT, {"stream_options": True}, "stream_options", "must be an object"),
        (CHAT, {"temperature": "NaN"}, "temperature", "finite number"),
        (CHAT, {"temperature": True}, "temperature", "finite number in [0, 2], got true"),
        (CHAT, {"top_p": 0}, "top_p", "in (0, 1]"),
        (CHAT, {"top_p": "0.9"}, "top_p", "finite number"),
        (CHAT, {"top_k": -1}, "top_k", "in [0, 2147483647]"),
        (CHAT, {"top_k": 2.5}, "top_k", "must be an integer"),
        (CHAT, {"seed": True}, "seed", "must be an integer"),
        (CHAT, {"seed": 2**64}, "seed", "got 18446744073709551616"),
        (CHAT, {"stop": 7}, "stop", "must be an array"),
        (CHAT, {"stop": ["ok", None]}, "stop[1]", "must be a string of 1..256 characters"),
        (CHAT, {"stop": [f"s{i}" for i in range(17)]}, "stop", "array of 0..16 items"),
        (CHAT, {"stop": "x" * 257}, "stop", "a string of 257 characters"),
        (CHAT, {"user": 42}, "user", "must be a string"),
        (CHAT, {"model": 3}, "model", "must be a string"),
        (CHAT, {"n": True}, "n", "only 1 is accepted"),
        (CHAT, {"logprobs": 0}, "logprobs", "must be true or false"),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "in [0, 20]"),
        (CHAT, {"messages": "hi"}, "messages", "must be an array"),
        (CHAT, {"messages": ["hi"]}, "messages[0]", "must be an object"),
        (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string"),
        (CHAT, {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name", "not supported"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0].image_url", "not supported"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0].type", '"text"'),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}]},
         "messages[0].content[0].text", "surrogate"),
        (CHAT, {"messages": [{"role": "user", "content": "x" * 600_000}, {"role": "user", "content": "y" * 500_000}]},
         "messages", "1100000 characters in all; at most 1000000"),
        (COMPLETIONS, {"prompt": ""}, "prompt", "1..1000000 characters"),
        (COMPLETIONS, {"prompt": []}, "prompt", "array of 1.."),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        (COMPLETIONS, {"prompt": [[1, 2]]}, "prompt[0]", "token id"),
        (COMPLETIONS, {"prompt": None}, "prompt", "is required"),
        (COMPLETIONS, {"max_completion_tokens": 4}, "max_completion_tokens", "not supported"),
    ],
)
def test_every_malformed_field_is_a_400_naming_it(served: Cluster, model: str, path: str, fields: dict, param: str,
                                                   fragment: str):
    """Sent as raw JSON bytes (no SDK between): the answer is OpenAI's error JSON naming the field, what it
    must be and what it got. NaN, Infinity and lone surrogates are written as Python's json writes them."""
    base = {"model": model, "max_tokens": 2, **({"messages": MESSAGES} if path == CHAT else {"prompt": "The sea"})}
    status, answer = raw_http(http_port(served), "POST", path, json.dumps({**base, **fields}).encode())
    error = json.loads(answer)["error"]
    assert status == 400, answer
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert f"'{param}'" in error["message"] and fragment in error["message"], error["message"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_say_so(served: Cluster, model: str, literal: str):
    """Python's JSON reader takes NaN and Infinity literals (and 1e999 overflows to Infinity): a range
    message ("should be ≤ 2") would mislead, so the error says the number is not finite."""
    body = '{"model": %s, "messages": %s, "temperature": %s}' % (json.dumps(model), json.dumps(MESSAGES), literal)
    status, answer = raw_http(http_port(served), "POST", CHAT, body.encode())
    error = json.loads(answer)["error"]
    assert status == 400 and error["param"] == "temperature", answer
    assert "not a finite number" in error["message"], error["message"]


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"[" * 100_000, "not valid JSON"),  # deeper than Python's recursion limit
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),  # more digits than Python converts
        (b'{"model": "\xff"}', "not valid JSON"),  # not UTF-8
        (b"[1, 2]", "must be a JSON object"),
    ],
)
def test_bodies_that_are_not_a_json_object_are_400s(served: Cluster, body: bytes, fragment: str):
    status, answer = raw_http(http_port(served), "POST", CHAT, body)
    assert status == 400 and fragment in json.loads(answer)["error"]["message"], answer


def test_a_body_over_the_limit_is_a_413(served: Cluster):
    from gateway.http_api import MAX_BODY_BYTES

    status, answer = raw_http(http_port(served), "POST", CHAT, b" " * (MAX_BODY_BYTES + 1))
    assert status == 413 and str(MAX_BODY_BYTES) in json.loads(answer)["error"]["message"], answer


def test_a_bug_is_a_500_in_openai_shape_plain_and_streamed(served: Cluster, model: str, monkeypatch: pytest.MonkeyPatch):
    """The last resort: an exception nobody expected (here injected into the reply builders) reaches the
    client as OpenAI's error JSON with type server_error; after a stream has started, as its last event."""
    from gateway import openai_api

    def broken(*_args, **_kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(openai_api, "reply", broken)
    body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}).encode()
    status, answer = raw_http(http_port(served), "POST", CHAT, body)
    error = json.loads(answer)["error"]
    assert status == 500 and error["type"] == "server_error" and "injected" not in error["message"], answer

    real_chunk = openai_api.chunk
    monkeypatch.setattr(openai_api, "chunk", lambda *args, **kwargs: broken() if not args[4] else real_chunk(*args, **kwargs))
    streamed = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True}).encode()
    status, answer = raw_http(http_port(served), "POST", CHAT, streamed)
    events = [line.removeprefix(b"data: ") for line in answer.split(b"\n") if line.startswith(b"data: ")]
    assert status == 200 and json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant", answer
    assert json.loads(events[-1])["error"]["type"] == "server_error", answer
    assert b"Traceback" not in answer


def test_no_effect_values_are_accepted(client: openai.OpenAI, model: str):
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0, n=1,
                                           logprobs=False, presence_penalty=0, frequency_penalty=0.0)
    assert reply.usage.completion_tokens >= 1


def test_a_prompt_longer_than_the_context_is_a_400_from_the_engine(client: openai.OpenAI, model: str):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="sea " * 2000, max_tokens=4)
    assert "context" in refused.value.body["message"]


def test_logit_bias_bans_and_forces_tokens_as_over_grpc(served: Cluster, client: openai.OpenAI, model: str):
    plain = grpc_answer(served, **chat_request("Tell me about the sea.", 8))
    banned = sorted(set(plain.token_ids[:2]))
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                           logit_bias={str(token): -100 for token in banned})
    expected = grpc_answer(served, **chat_request("Tell me about the sea.", 8),
                           sampling=common_pb2.SamplingParams(logit_bias={token: -100.0 for token in banned}))
    assert reply.choices[0].message.content == expected.text and not set(expected.token_ids) & set(banned)
    forced = client.completions.create(model=model, prompt="the", max_tokens=5, logit_bias={"11": 100}, seed=1)
    assert forced.choices[0].text == served.gateway.servicer.backends.tokenizer.decode([11] * 5)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="the", max_tokens=2, logit_bias={"11": 150})
    assert refused.value.body["param"] == "logit_bias.11"


def test_speculation_false_is_target_only_with_the_same_greedy_answer(client: openai.OpenAI, model: str):
    """The extension field `speculation` (default true): false decodes target-only, as gRPC's
    disable_speculation, so a client can compare the two over HTTP."""
    answers = [client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0,
                                              extra_body={"speculation": flag}) for flag in (True, False)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    stats = [answer.model_extra["specd"] for answer in answers]
    assert stats[0]["draft_tokens"] > 0 and stats[1]["draft_tokens"] == 0, stats
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body={"speculation": "no"})
    assert refused.value.body["param"] == "speculation"


def test_unknown_model_is_404(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    assert refused.value.body["code"] == "model_not_found"


def test_malformed_json_and_unknown_paths_get_openai_error_bodies(served: Cluster):
    status, body = raw_http(http_port(served), "POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    status, body = raw_http(http_port(served), "GET", "/v1/nothing-here")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    status, body = raw_http(http_port(served), "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_http_requests_are_counted_in_the_gateway_metrics(served: Cluster, client: openai.OpenAI, model: str):
    metrics = served.gateway.observability.metrics
    before = metrics.http_requests.labels("/v1/chat/completions", "200")._value.get()
    grpc_before = metrics.requests.labels("gateway", "Generate", "OK")._value.get()
    client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0)
    assert metrics.http_requests.labels("/v1/chat/completions", "200")._value.get() == before + 1
    # the same request went through the gateway's gRPC path (admission, traces, metrics)
    assert metrics.requests.labels("gateway", "Generate", "OK")._value.get() == grpc_before + 1


# --------------------------------------------------------------------------- auth, overload, outage


def test_bearer_token_is_required_when_configured(tiny: TinyModels):
    cluster = start_cluster(tiny.target, "", auth_token=TOKEN, http_port=0)
    try:
        model = cluster.gateway.servicer.backends.target_info.model_name
        with pytest.raises(openai.AuthenticationError) as refused:
            client_for(cluster, "wrong-token").chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert refused.value.status_code == 401 and "invalid bearer token" in refused.value.body["message"]
        body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 2}).encode()
        status, answer = raw_http(http_port(cluster), "POST", "/v1/chat/completions", body)  # no Authorization header
        assert status == 401 and json.loads(answer)["error"]["type"] == "authentication_error"
        reply = client_for(cluster, TOKEN).chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert reply.usage.completion_tokens >= 1
    finally:
        cluster.stop()


class SlowVerify(grpc.ServerInterceptor):
    """Every Verify (alone or a VerifyBatch of them) takes at least delay_s longer: generations last long
    enough to be interrupted."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.endswith(("/Verify", "/VerifyBatch")):
            return handler

        def slow(request, context):
            time.sleep(self.delay_s)
            return handler.unary_unary(request, context)

        return handler._replace(unary_unary=slow)


@pytest.fixture(scope="module")
def slow(tiny: TinyModels) -> Iterator[Cluster]:
    """One request at a time, none waiting, each verify pass 50 ms slower."""
    cluster = start_cluster(tiny.target, "model", tiny.draft_noisy, max_sessions=1, max_waiting=0,
                            http_port=0, model_interceptors=(SlowVerify(0.05),))
    yield cluster
    cluster.stop()


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def cancelled_generations(cluster: Cluster) -> float:
    return cluster.gateway.observability.metrics.finished.labels("cancelled")._value.get()


def test_admission_refusal_is_429(slow: Cluster):
    client = client_for(slow)
    model = slow.gateway.servicer.backends.target_info.model_name
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=300, temperature=0, stream=True)
    try:
        next(iter(stream))  # the one slot is held
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert refused.value.status_code == 429 and "busy" in refused.value.body["message"]
    finally:
        stream.close()
    assert wait_for(lambda: slow.open_sessions() == {"verify": 0, "draft": 0})


def test_a_client_leaving_mid_stream_frees_both_sessions(slow: Cluster):
    cancelled = cancelled_generations(slow)
    model = slow.gateway.servicer.backends.target_info.model_name
    stream = client_for(slow).chat.completions.create(model=model, messages=MESSAGES, max_tokens=400, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    assert slow.open_sessions() == {"verify": 1, "draft": 1}
    stream.close()  # 400 tokens at >= 50 ms a pass would take many seconds more
    assert wait_for(lambda: slow.open_sessions() == {"verify": 0, "draft": 0}), slow.open_sessions()
    assert wait_for(lambda: cancelled_generations(slow) == cancelled + 1)


def test_a_client_leaving_a_plain_request_frees_both_sessions(slow: Cluster):
    cancelled = cancelled_generations(slow)
    model = slow.gateway.servicer.backends.target_info.model_name
    body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 400, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", http_port(slow))) as connection:
        connection.sendall(http_bytes("POST", "/v1/chat/completions", body))
        assert wait_for(lambda: slow.open_sessions() == {"verify": 1, "draft": 1})
    assert wait_for(lambda: slow.open_sessions() == {"verify": 0, "draft": 0}), slow.open_sessions()
    assert wait_for(lambda: cancelled_generations(slow) == cancelled + 1)


def test_verify_down_is_a_quick_503_and_health_follows_the_verify(tiny: TinyModels):
    """While no verify replica serves, requests get 503 at once and the gateway's health (gRPC and
    /health) says NOT_SERVING; a verify back on its address brings both back."""
    from specd_common.config import ServerConfig
    from specd_engine.models import load_causal_lm
    from verify_service.app import start_verify_server

    cluster = start_cluster(tiny.target, "", http_port=0)
    try:
        model = cluster.gateway.servicer.backends.target_info.model_name
        port = cluster.verify.port
        cluster.verify.stop(0)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as refused:
            client_for(cluster).chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert refused.value.status_code == 503 and "verify" in refused.value.body["message"]
        assert time.monotonic() - started < 2.0
        assert wait_for(lambda: raw_http(http_port(cluster), "GET", "/health")[0] == 503, timeout_s=5)
        assert gateway_health(cluster.address) == "NOT_SERVING"
        cluster.verify = start_verify_server(load_causal_lm(str(tiny.target)), ServerConfig(port=port))
        assert wait_for(lambda: raw_http(http_port(cluster), "GET", "/health")[0] == 200, timeout_s=10)
        assert gateway_health(cluster.address) == "SERVING"
        reply = client_for(cluster).chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert reply.usage.completion_tokens >= 1
    finally:
        cluster.stop()


def test_a_verify_back_after_a_long_outage_is_used_within_2_s_of_serving(tiny: TinyModels):
    """gRPC's reconnect back-off grows while a service is away (1 s, 1.6 s, 2.6 s, ... to 120 s): after a
    16 s restart the gateway refused requests for 7.2 s after the new verify served. Now the channel
    dials every RECONNECT_BACKOFF_MS and the health watch waits for it, so requests succeed at once."""
    from specd_common.config import ServerConfig
    from specd_engine.models import load_causal_lm
    from verify_service.app import start_verify_server

    cluster = start_cluster(tiny.target, "", http_port=0)
    try:
        model = cluster.gateway.servicer.backends.target_info.model_name
        port = cluster.verify.port
        loaded = load_causal_lm(str(tiny.target))
        cluster.verify.stop(0)
        assert wait_for(lambda: raw_http(http_port(cluster), "GET", "/health")[0] == 503, timeout_s=5)
        time.sleep(10)  # long enough for gRPC's default back-off to wait ~4 s between tries by now
        cluster.verify = start_verify_server(loaded, ServerConfig(port=port))
        serving = time.monotonic()
        assert wait_for(lambda: raw_http(http_port(cluster), "GET", "/health")[0] == 200, timeout_s=2), \
            "the gateway did not find the verify within 2 s of its serving"
        reply = client_for(cluster).chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert reply.usage.completion_tokens >= 1 and time.monotonic() - serving < 4
    finally:
        cluster.stop()


def test_http_port_stops_with_the_gateway(tiny: TinyModels):
    cluster = start_cluster(tiny.target, "", http_port=0)
    port = http_port(cluster)
    cluster.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# --------------------------------------------------------------------------- raw HTTP helpers


def http_bytes(method: str, path: str, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "Connection: close\r\n\r\n").encode() + body


def raw_http(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request on a fresh connection; (status, body). No client library between test and server."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(http_bytes(method, path, body))
        data = b""
        while chunk := connection.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


def half_sent(port: int, body: bytes) -> socket.socket:
    """A connection that sent its headers (announcing `body`) and half the body, then waits."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=30)
    connection.sendall(http_bytes("POST", CHAT, body)[: -(len(body) // 2)])
    return connection


def reply_of(connection: socket.socket) -> tuple[int, bytes]:
    data = b""
    while chunk := connection.recv(65536):
        data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


def test_a_client_leaving_mid_body_is_a_499_not_a_server_error(served: Cluster, model: str, caplog: pytest.LogCaptureFixture):
    """Its doing, not the server's: counted as client_closed_request (499), no 500, no ERROR in the log."""
    metrics = served.gateway.observability.metrics
    counted = lambda status: metrics.http_requests.labels(CHAT, status)._value.get()  # noqa: E731
    before_499, before_500 = counted("499"), counted("500")
    body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 2}).encode()
    with caplog.at_level("WARNING"):
        for _ in range(3):
            half_sent(http_port(served), body).close()
        assert wait_for(lambda: counted("499") == before_499 + 3)
    assert counted("500") == before_500
    assert not [record for record in caplog.records if record.levelname in ("ERROR", "CRITICAL")], caplog.text


def test_a_body_that_does_not_arrive_in_time_is_a_408(served: Cluster, model: str, monkeypatch: pytest.MonkeyPatch):
    from gateway import http_api

    monkeypatch.setattr(http_api, "BODY_TIMEOUT_S", 0.5)
    body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 2}).encode()
    started = time.monotonic()
    with half_sent(http_port(served), body) as connection:
        status, answer = reply_of(connection)
    assert status == 408 and "0.5 s" in json.loads(answer)["error"]["message"], answer
    assert time.monotonic() - started < 5


def test_past_the_bodies_being_read_a_request_is_refused_at_once(served: Cluster, model: str, monkeypatch: pytest.MonkeyPatch):
    """Slow senders hold at most MAX_READING_BODIES reads; the next request is a 503 with Retry-After, and
    once they are gone requests are served again."""
    from gateway import http_api

    monkeypatch.setattr(http_api, "MAX_READING_BODIES", 2)
    body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}).encode()
    metrics = served.gateway.observability.metrics
    before = metrics.http_requests.labels(CHAT, "499")._value.get()
    slow = [half_sent(http_port(served), body) for _ in range(2)]
    try:
        assert wait_for(lambda: http_server(served.gateway).api.reading_bodies == 2)
        started = time.monotonic()
        status, answer = raw_http(http_port(served), "POST", CHAT, body)
        assert status == 503 and "reading 2 request bodies" in json.loads(answer)["error"]["message"], answer
        assert time.monotonic() - started < 2
    finally:
        for connection in slow:
            connection.close()
    assert wait_for(lambda: metrics.http_requests.labels(CHAT, "499")._value.get() == before + 2)
    status, answer = raw_http(http_port(served), "POST", CHAT, body)
    assert status == 200, answer


def test_a_request_that_reaches_the_context_ends_there_with_length(served: Cluster, client: openai.OpenAI, model: str):
    """A prompt plus max_tokens past the model's context is served up to the context and ends with
    finish_reason length (the tiny target holds 512 positions)."""
    context = 512  # the tiny target's max_position_embeddings (tests/tiny_models.py)
    prompt = [5 + i % 50 for i in range(context - 6)]
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=4000, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens <= 6, reply
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == context, reply.usage


def test_concurrent_streams_each_get_their_own_answer(served: Cluster, client: openai.OpenAI, model: str):
    prompts = ["Tell me about the sea.", "Name a color.", "What is a cat?"]
    results: dict[int, str] = {}

    def ask(index: int) -> None:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompts[index]}],
                                                max_tokens=16, temperature=0, stream=True)
        results[index] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for index, prompt in enumerate(prompts):
        assert results[index] == grpc_answer(served, **chat_request(prompt, 16)).text
