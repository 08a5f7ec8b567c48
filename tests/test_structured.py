"""Structured output through the three services (tiny random models, real gRPC): the answer matches its
constraint, greedy speculation equals constrained target-only decoding, forced tokens are drafted free."""

from __future__ import annotations

import json
import re
import grpc
import jsonschema
import openai
import pytest

from gateway.grammar import MAX_CONSTRAINT_BYTES
from specd.v1 import common_pb2, generate_pb2, verify_pb2, verify_pb2_grpc
from tests.test_services import FIXED, PROMPTS, generate, wait_for_no_sessions

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                 "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "tags", "home"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": generate_pb2.OutputConstraint(json_schema=json.dumps(SCHEMA)),
    "json_object": generate_pb2.OutputConstraint(json_object=True),
    "regex": generate_pb2.OutputConstraint(regex=r"(yes|no), because [a-z ]{1,20}\."),
    "choice": generate_pb2.OutputConstraint(choice=generate_pb2.Choices(choices=["red fox", "brown bear", "blue whale"])),
    "lark_grammar": generate_pb2.OutputConstraint(lark_grammar='start: "sum(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'),
}


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_greedy_constrained_speculation_equals_constrained_target_only(cluster, kind):
    stub = cluster.stub()
    for prompt in PROMPTS[:2]:
        request = dict(text=prompt, max_new_tokens=120, constraint=CONSTRAINTS[kind])
        speculative = generate(stub, **request, draft_length_policy=FIXED)
        target_only = generate(stub, **request, disable_speculation=True)
        assert list(speculative.token_ids) == list(target_only.token_ids), kind
    assert wait_for_no_sessions(cluster) == {"verify": 0, "draft": 0}


def test_seeded_sampled_constrained_speculation_is_target_only_with_the_seed(cluster):
    """Seeded sampling under the adaptive policy judges every draft by the coupled rule, so with a grammar
    too the answer is constrained target-only decoding's with that seed, token for token."""
    stub = cluster.stub()
    sampling = common_pb2.SamplingParams(temperature=1.0)
    for seed in range(3):
        request = dict(text=PROMPTS[seed], max_new_tokens=200, constraint=CONSTRAINTS["json_schema"], sampling=sampling,
                       seed=seed)
        speculative = generate(stub, **request, draft_length_policy=generate_pb2.DRAFT_LENGTH_POLICY_ADAPTIVE)
        target_only = generate(stub, **request, disable_speculation=True)
        assert list(speculative.token_ids) == list(target_only.token_ids)
        assert speculative.stats.forced_rounds > 0
        jsonschema.validate(json.loads(speculative.text), SCHEMA)


def test_unseeded_sampled_constrained_answers_match_the_grammar(cluster):
    """Sampled rounds judged by the rejection rule (fixed policy: the drafter's q, restricted to the grammar)."""
    stub = cluster.stub()
    for prompt in PROMPTS:
        reply = generate(stub, text=prompt, max_new_tokens=200, constraint=CONSTRAINTS["json_schema"], draft_length_policy=FIXED,
                         sampling=common_pb2.SamplingParams(temperature=0.8, top_k=40))
        jsonschema.validate(json.loads(reply.text), SCHEMA)
        assert reply.finish_reason == generate_pb2.FINISH_REASON_EOS and reply.stats.draft_tokens > reply.stats.forced_tokens


@pytest.mark.parametrize("constraint, fragment", [
    (generate_pb2.OutputConstraint(json_schema="{not json"), "constraint.json_schema is not valid JSON"),
    (generate_pb2.OutputConstraint(json_schema='{"type": "object", "properties": 5}'), "constraint.json_schema cannot be used"),
    (generate_pb2.OutputConstraint(json_schema='{"$ref": "#/nowhere"}'), "constraint.json_schema cannot be used"),
    (generate_pb2.OutputConstraint(json_schema="[1, 2]"), "must be a JSON object"),
    (generate_pb2.OutputConstraint(json_schema="false"), "must be a JSON object"),  # a boolean schema (was a 500)
    (generate_pb2.OutputConstraint(json_schema="x" * (MAX_CONSTRAINT_BYTES + 1)), f"1..{MAX_CONSTRAINT_BYTES} bytes"),
    (generate_pb2.OutputConstraint(regex="(unclosed"), "constraint.regex cannot be used"),
    (generate_pb2.OutputConstraint(lark_grammar="start: undefined_rule"), "constraint.lark_grammar cannot be used"),
    (generate_pb2.OutputConstraint(choice=generate_pb2.Choices()), "constraint.choice must hold"),
    (generate_pb2.OutputConstraint(choice=generate_pb2.Choices(choices=["ok", ""])), "each of constraint.choice"),
], ids=["not-json", "bad-schema", "bad-ref", "not-an-object", "boolean", "too-large", "bad-regex", "bad-lark", "no-choices", "empty-choice"])
def test_a_bad_constraint_is_invalid_argument_naming_it(cluster, constraint, fragment):
    with pytest.raises(grpc.RpcError) as refused:
        generate(cluster.stub(), text=PROMPTS[0], max_new_tokens=4, constraint=constraint)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in refused.value.details()


def test_a_grammar_cut_by_max_new_tokens_ends_with_length_and_a_valid_prefix(cluster):
    reply = generate(cluster.stub(), text=PROMPTS[0], max_new_tokens=9, constraint=CONSTRAINTS["json_schema"])
    assert reply.finish_reason == generate_pb2.FINISH_REASON_LENGTH and len(reply.token_ids) == 9
    assert reply.text.startswith('{"name"')


# --- the OpenAI-compatible HTTP API ---------------------------------------------------------------------
# (fixtures `served` and `client`: tests/conftest.py)
HTTP_PROMPTS = [f"Describe pet number {i} as JSON." for i in range(20)]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}


def test_openai_client_json_schema_answers_validate_and_speculation_changes_nothing(served, client):
    """The official client's response_format: on 20 prompts every greedy answer validates against its
    schema (nested objects, arrays, enums) and equals constrained target-only decoding's
    (`speculation: false`); sampled answers validate too; forced tokens were drafted free."""
    model = served.gateway.servicer.backends.target_info.model_name
    forced = 0
    for prompt in HTTP_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        greedy = client.chat.completions.create(model=model, messages=messages, max_tokens=200, temperature=0,
                                                response_format=RESPONSE_FORMAT)
        target_only = client.chat.completions.create(model=model, messages=messages, max_tokens=200, temperature=0,
                                                     response_format=RESPONSE_FORMAT, extra_body={"speculation": False})
        assert greedy.choices[0].message.content == target_only.choices[0].message.content
        jsonschema.validate(json.loads(greedy.choices[0].message.content), SCHEMA)
        assert greedy.choices[0].finish_reason == "stop"
        forced += greedy.model_extra["specd"]["forced_rounds"]
        sampled = client.chat.completions.create(model=model, messages=messages, max_tokens=200, temperature=0.8,
                                                 response_format=RESPONSE_FORMAT)
        jsonschema.validate(json.loads(sampled.choices[0].message.content), SCHEMA)
    assert forced >= len(HTTP_PROMPTS)


def test_json_object_mode_streams_a_json_prefix_that_ends_in_an_object(served, client):
    """{"type": "json_object"}, streamed: the deltas concatenate to the whole answer's text, which is a JSON
    object when it finished (a tiny random model may run out of tokens first: then a prefix of one)."""
    model = served.gateway.servicer.backends.target_info.model_name
    for prompt in HTTP_PROMPTS[:4]:
        messages = [{"role": "user", "content": prompt}]
        whole = client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0,
                                               response_format={"type": "json_object"})
        streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0,
                                                  response_format={"type": "json_object"}, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        assert text == whole.choices[0].message.content and text.startswith("{")
        if whole.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("response_format, param", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}, "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "extra": 1}}, "response_format.json_schema.extra"),
    ({"type": "json_object", "regex": "a"}, "response_format.regex"),
    ({"type": "choice", "choice": []}, "response_format.choice"),
    ({"type": "regex", "regex": ""}, "response_format.regex"),
    ("json", "response_format"),
], ids=["type", "no-schema-object", "no-name", "bad-name", "schema-not-object", "strict", "unknown-key", "mixed", "no-choices",
        "empty-regex", "not-an-object"])
def test_a_malformed_response_format_is_a_400_naming_the_field(client, served, response_format, param):
    model = served.gateway.servicer.backends.target_info.model_name
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format=response_format)
    assert refused.value.body["param"] == param, refused.value.body


def test_a_schema_the_compiler_refuses_is_a_400_from_the_gateway(client, served):
    model = served.gateway.servicer.backends.target_info.model_name
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "object", "properties": 5}}})
    assert "properties must be an object" in refused.value.body["message"]


def test_specd_extension_formats_regex_grammar_and_choice(client, served):
    model = served.gateway.servicer.backends.target_info.model_name
    for response_format, check in (
        ({"type": "regex", "regex": "[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
        ({"type": "grammar", "grammar": 'start: "ok(" /[a-z]{1,4}/ ")"'}, lambda text: re.fullmatch(r"ok\([a-z]{1,4}\)", text)),
        ({"type": "choice", "choice": ["alpha", "beta gamma"]}, lambda text: text in ("alpha", "beta gamma")),
    ):
        reply = client.completions.create(model=model, prompt="Answer:", max_tokens=30, temperature=0,
                                          extra_body={"response_format": response_format})
        assert check(reply.choices[0].text), (response_format, reply.choices[0].text)


# --- logprobs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [common_pb2.SamplingParams(), common_pb2.SamplingParams(temperature=0.9)],
                         ids=["greedy", "sampled"])
def test_logprobs_equal_target_only_and_speculation_does_not_change_them(cluster, sampling):
    """Each token's logprob and its position's top 5, with speculation and without (seeded sampling: the
    same tokens), under a constraint too (where it lists only allowed tokens: one, with logprob 0, where the
    grammar forces a token); the token's logprob is its entry in the top list when listed."""
    stub = cluster.stub()
    for constraint in (None, CONSTRAINTS["json_schema"]):
        request = dict(text=PROMPTS[1], max_new_tokens=40, sampling=sampling, seed=5, logprobs=True, top_logprobs=5)
        if constraint is not None:
            request["constraint"] = constraint
        speculative = generate(stub, **request)
        target_only = generate(stub, **request, disable_speculation=True)
        assert list(speculative.token_ids) == list(target_only.token_ids)
        assert [e.token_id for e in speculative.logprobs] == list(speculative.token_ids)
        assert speculative.stats.draft_tokens > 0
        for mine, theirs in zip(speculative.logprobs, target_only.logprobs):
            assert mine.logprob == pytest.approx(theirs.logprob, abs=2e-3)
            assert [t.token_id for t in mine.top][:2] == [t.token_id for t in theirs.top][:2]
            assert (len(mine.top) == 5 if constraint is None else 1 <= len(mine.top) <= 5) and mine.logprob <= 0
            listed = {t.token_id: t.logprob for t in mine.top}
            if mine.token_id in listed:
                assert listed[mine.token_id] == pytest.approx(mine.logprob)
        if sampling.temperature == 0:
            assert all(e.top[0].token_id == e.token_id for e in speculative.logprobs)


def test_top_logprobs_without_logprobs_or_past_20_is_invalid(cluster):
    for fields in ({"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(grpc.RpcError) as refused:
            generate(cluster.stub(), text=PROMPTS[0], max_new_tokens=2, **fields)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in refused.value.details()


def test_http_logprobs_in_openai_shapes_equal_the_grpc_ones(served, client):
    """Chat's logprobs.content (token, logprob, bytes, top_logprobs), streamed too, and the legacy
    completions' tokens / token_logprobs / top_logprobs / text_offset, with the gRPC answer's numbers."""
    model = served.gateway.servicer.backends.target_info.model_name
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                          top_logprobs=3)
    expected = served.stub().Generate(generate_pb2.GenerateRequest(
        messages=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content=messages[0]["content"])]),
        max_new_tokens=12, logprobs=True, top_logprobs=3), timeout=60)
    content = chat.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    assert b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace") == chat.choices[0].message.content
    assert all(len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token for entry in content)
    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                              top_logprobs=3, stream=True)
    pieces = [entry for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for entry in chunk.choices[0].logprobs.content]
    assert [entry.token for entry in pieces] == [entry.token for entry in content]
    legacy = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2)
    scored = legacy.choices[0].logprobs
    assert "".join(scored.tokens) == legacy.choices[0].text and len(scored.token_logprobs) == 8
    assert all(len(top) <= 2 for top in scored.top_logprobs) and scored.text_offset[0] == 0
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


# --- the verify's side of the contract -------------------------------------------------------------------
def test_verify_restricts_the_target_to_each_rows_mask_and_refuses_bad_masks(cluster):
    """VerifyRequest.allowed_tokens: the argmax of each row is the target's best allowed token (ids or a
    bitmap), and a malformed mask is INVALID_ARGUMENT naming what to fix."""
    vocab = cluster.gateway.servicer.backends.target_info.vocab_size
    with grpc.insecure_channel(f"127.0.0.1:{cluster.verify.port}") as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="masks", prompt_token_ids=[5, 6, 7]), timeout=10)
        try:
            keep = common_pb2.Commit(prefix_length=3)  # the prompt, dropping the last pass's draft
            free = stub.Verify(verify_pb2.VerifyRequest(session_id="masks", commit=keep, draft_token_ids=[9]),
                               timeout=10).argmax_token_ids
            only = (free[0] + 1) % vocab
            bitmap = bytearray((vocab + 7) // 8)
            bitmap[free[1] // 8] |= 1 << free[1] % 8
            other = next(t for t in range(vocab) if t != free[1])
            bitmap[other // 8] |= 1 << other % 8
            masks = [common_pb2.TokenMask(allowed_token_ids=[only]), common_pb2.TokenMask(allowed_bitmap=bytes(bitmap))]
            scored = stub.Verify(verify_pb2.VerifyRequest(session_id="masks", commit=keep,
                                                          draft_token_ids=[9], allowed_tokens=masks), timeout=10)
            assert list(scored.argmax_token_ids) == [only, free[1]]
            for bad, fragment in (
                ([masks[0]], "one mask per scored position (2)"),
                ([masks[0], common_pb2.TokenMask(allowed_bitmap=b"\x01")], "allowed_bitmap must be"),
                ([masks[0], common_pb2.TokenMask(allowed_token_ids=[vocab])], "allowed_token_ids must be in"),
                ([masks[0], common_pb2.TokenMask()], "must allow at least one token"),
                ([masks[0], common_pb2.TokenMask(allowed_token_ids=[1], allowed_bitmap=bytes(bitmap))], "not both"),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Verify(verify_pb2.VerifyRequest(session_id="masks", commit=keep,
                                                         draft_token_ids=[9], allowed_tokens=bad), timeout=10)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in refused.value.details()
        finally:
            stub.Release(common_pb2.ReleaseRequest(session_id="masks"), timeout=10)


def test_likeliest_is_a_stable_argsorts_first_n_ties_included():
    """The sampled logprobs' top-N (gateway.engine.likeliest) orders as a full stable argsort does, ties by
    id: float16 rows hold many equal values."""
    import numpy as np

    from gateway.engine import likeliest

    rng = np.random.default_rng(1)
    for _ in range(100):
        p = rng.integers(0, 5, int(rng.integers(1, 300))).astype(float)
        for n in (0, 1, 3, 20, p.size + 2):
            assert likeliest(p, n).tolist() == np.argsort(-p, kind="stable")[:n].tolist()
