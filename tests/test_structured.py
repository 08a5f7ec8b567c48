"""Structured output through the three services (tiny random models, real gRPC): the answer matches its
constraint, greedy speculation equals constrained target-only decoding, forced tokens are drafted free."""

from __future__ import annotations

import json

import grpc
import pytest

from specd.v1 import common_pb2, generate_pb2
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
        print(kind, repr(speculative.text), speculative.finish_reason, speculative.stats.forced_rounds, speculative.stats.forced_tokens, speculative.stats.target_passes, len(speculative.token_ids))
    assert wait_for_no_sessions(cluster) == {"verify": 0, "draft": 0}
