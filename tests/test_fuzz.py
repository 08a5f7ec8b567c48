"""Hostile input against the public API: every request gets a clear error or a valid answer, nothing crashes.

A fixed budget (derandomized hypothesis, bounded examples) so CI runs the same cases every time.
"""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specd.v1 import common_pb2, generate_pb2
from tests.test_services import wait_for_no_sessions

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=300)
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}

prompts = st.one_of(
    st.builds(lambda t: {"text": t}, st.one_of(TEXT, st.just(""), st.just("x" * 1_000_001))),
    st.builds(lambda ids: {"token_ids": generate_pb2.TokenIds(ids=ids)}, st.lists(INT32, max_size=40)),
    st.builds(
        lambda pairs: {"messages": generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role=r, content=c) for r, c in pairs])},
        st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", "", "root"]), TEXT), max_size=3),
    ),
)


@st.composite
def requests(draw):
    fields = draw(prompts)
    fields.update(
        raw=draw(st.booleans()),
        max_new_tokens=draw(st.one_of(st.integers(-5, 12), INT32)),
        sampling=common_pb2.SamplingParams(temperature=draw(FLOATS), top_k=draw(INT32), top_p=draw(FLOATS)),
        stop=draw(st.lists(TEXT, max_size=18)),
        disable_speculation=draw(st.booleans()),
        num_draft_tokens=draw(st.one_of(st.integers(-2, 20), INT32)),
    )
    if draw(st.booleans()):
        fields["seed"] = draw(st.integers(0, 2**64 - 1))
    return generate_pb2.GenerateRequest(**fields)


@pytest.fixture(scope="module")
def fuzz_stub(cluster):
    return cluster.stub()


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(request=requests())
def test_fuzzed_requests_get_an_answer_or_a_clear_error(fuzz_stub, request):
    assert answer_code(fuzz_stub, request) in ALLOWED, request


def answer_code(stub, request: generate_pb2.GenerateRequest) -> grpc.StatusCode:
    """OK with a finished answer, or the error's code (an error must say what is wrong)."""
    try:
        reply = stub.Generate(request, timeout=30)
    except grpc.RpcError as error:
        assert error.details(), "an error without a message"
        return error.code()
    assert reply.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
    return grpc.StatusCode.OK


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.sampled_from(["object", "array", "string", "integer", "number",
                                                                              "boolean", "null", "#/x", "^[a-z]+$", ""])),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.sampled_from(["type", "properties", "items", "required", "enum", "const",
                                                             "anyOf", "$ref", "minimum", "maxLength", "pattern",
                                                             "additionalProperties", "format", "x"]), inner, max_size=5)),
    max_leaves=12,
)
REGEX_TEXT = st.text(alphabet="ab(|)*+?[]{}^$.\\d,-09", max_size=24)
LARK_TEXT = st.one_of(st.text(alphabet='start:|"a()*+?/ \n%import', max_size=40),
                      st.builds(lambda body: "start: " + body, st.text(alphabet='"ab |()*+?/[]', max_size=30)))

constraints = st.one_of(
    st.builds(lambda value: generate_pb2.OutputConstraint(json_schema=json.dumps(value)), JSON_VALUES),
    st.builds(lambda text: generate_pb2.OutputConstraint(json_schema=text), TEXT),
    st.builds(lambda text: generate_pb2.OutputConstraint(regex=text), REGEX_TEXT),
    st.builds(lambda text: generate_pb2.OutputConstraint(lark_grammar=text), LARK_TEXT),
    st.builds(lambda items: generate_pb2.OutputConstraint(choice=generate_pb2.Choices(choices=items)), st.lists(TEXT, max_size=4)),
)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(constraint=constraints, greedy=st.booleans())
def test_fuzzed_constraints_get_an_answer_or_invalid_argument(fuzz_stub, constraint, greedy):
    """Schemas, regexes, Lark grammars and choice lists, well-formed or not: a constrained answer or
    INVALID_ARGUMENT with a message, never an internal error."""
    request = generate_pb2.GenerateRequest(text="hi", max_new_tokens=6, constraint=constraint,
                                           sampling=common_pb2.SamplingParams(temperature=0.0 if greedy else 1.0))
    assert answer_code(fuzz_stub, request) in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, constraint


def test_invalid_utf8_in_a_stop_string_is_invalid_argument(cluster):
    channel = grpc.insecure_channel(cluster.address)
    raw_call = channel.unary_unary("/specd.v1.GenerateService/Generate", request_serializer=None, response_deserializer=None)
    good = generate_pb2.GenerateRequest(text="hi", max_new_tokens=2).SerializeToString()
    bad_stop = bytes([0x42, 2, 0xFF, 0xFE])  # field 8 (stop), length 2, not UTF-8
    with pytest.raises(grpc.RpcError) as caught:
        raw_call(good + bad_stop, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in caught.value.details()


def test_services_are_still_up_and_clean_after_fuzzing(cluster):
    for server in (cluster.gateway, cluster.draft, cluster.verify):
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    assert wait_for_no_sessions(cluster) == {"verify": 0, "draft": 0}
