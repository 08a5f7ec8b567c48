"""OpenAI-compatible requests and replies, translated to and from specd.v1 (pure functions, no I/O).

The HTTP server (gateway/http_api.py) parses a JSON body with `parse_request`, sends the resulting
GenerateRequest to the gateway's own GenerateService (so an HTTP request gets the same validation,
admission, deadlines, traces and metrics as a gRPC one), and shapes the answer with the `*_reply` /
`*_chunk` builders here. Parameters specd cannot honour are refused with a 400 that names them, never
ignored; a parameter set to its no-effect value (`n: 1`, `logprobs: false`, `presence_penalty: 0`...)
is accepted, because clients and SDKs send those by default.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.service import MAX_NEW_TOKENS
from specd.v1 import common_pb2, generate_pb2

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# Chat without max_tokens gets the gateway's default (GenerateRequest.max_new_tokens = 0): 256 tokens.
SEED_MASK = 2**64 - 1  # OpenAI seeds are signed 64-bit; specd's are unsigned: same bits

# Parameters accepted only at the value that changes nothing (SDKs and harnesses send these).
NO_EFFECT_VALUES: dict[str, tuple] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, None),
    "top_logprobs": (0, None),
    "frequency_penalty": (0, None),
    "presence_penalty": (0, None),
    "logit_bias": ({}, None),
    "tools": ([], None),
    "tool_choice": ("none", None),
    "parallel_tool_calls": (False, None),
    "response_format": ({"type": "text"}, None),
    "suffix": ("", None),
    "store": (False, None),
    "service_tier": ("auto", "default", None),
}

FINISH_REASONS = {
    generate_pb2.FINISH_REASON_EOS: "stop",
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
}

# gRPC status → (HTTP status, OpenAI error type, error code)
_HTTP_ERRORS: dict[grpc.StatusCode, tuple[int, str, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_request"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "failed_precondition"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "out_of_range"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", "client_closed_request"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "deadline_exceeded"),
}


class ApiError(Exception):
    """An error for the HTTP client: its status, OpenAI error type and code, and what to fix."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error", code: str = "",
                 param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.code, self.param = status, message, error_type, code, param

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, details: str) -> "ApiError":
        status, error_type, error_code = _HTTP_ERRORS.get(code, (500, "internal_error", "internal_error"))
        return cls(status, details or code.name, error_type, error_code)

    def body(self) -> dict:
        """OpenAI's error JSON."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code or None}}


# --------------------------------------------------------------------------- request models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system"; tool and function messages need tool calling
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class _Generation(_Strict):
    """What chat and completion requests share."""

    model: str
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)  # an extension, as in vLLM and SGLang; 0 = off
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # an end-user id: recorded on the trace, changes nothing

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def base_request(self, max_new_tokens: Optional[int]) -> generate_pb2.GenerateRequest:
        """The GenerateRequest fields every kind shares; OpenAI's defaults are temperature 1, top_p 1."""
        temperature = 1.0 if self.temperature is None else self.temperature
        request = generate_pb2.GenerateRequest(
            max_new_tokens=max_new_tokens or 0,
            sampling=common_pb2.SamplingParams(temperature=temperature, top_p=self.top_p or 0.0, top_k=self.top_k or 0),
            stop=self.stop_strings(),
        )
        if self.seed is not None:
            request.seed = self.seed & SEED_MASK
        return request


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_NEW_TOKENS)

    def to_grpc(self) -> generate_pb2.GenerateRequest:
        request = self.base_request(self.max_completion_tokens or self.max_tokens)
        role = {"developer": "system"}
        request.messages.messages.extend(
            generate_pb2.ChatMessage(role=role.get(m.role, m.role), content=m.text()) for m in self.messages
        )
        return request


class CompletionRequest(_Generation):
    prompt: Union[str, list[int], list[str]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("specd answers one prompt per request; send a string or a list with one string")
            return prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    def to_grpc(self) -> generate_pb2.GenerateRequest:
        request = self.base_request(self.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS)
        if isinstance(self.prompt, str):
            request.text, request.raw = self.prompt, True  # completions are raw text: no chat template
        else:
            request.token_ids.ids.extend(self.prompt)
        return request


Kind = Literal["chat", "completion"]
_MODELS: dict[str, type[_Generation]] = {"chat": ChatCompletionRequest, "completion": CompletionRequest}


def parse_request(kind: Kind, body: Any) -> _Generation:
    """Validate a JSON body; ApiError(400) that names the parameter and says what to fix."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    body = {key: value for key, value in body.items() if not _no_effect(key, value)}
    try:
        return _MODELS[kind].model_validate(body)
    except ValidationError as error:
        raise _validation_error(error) from None


def _no_effect(key: str, value: Any) -> bool:
    return key in NO_EFFECT_VALUES and any(_same(value, allowed) for allowed in NO_EFFECT_VALUES[key])


def _same(value: Any, allowed: Any) -> bool:
    """Equal, where booleans and None match only themselves (`logprobs: 0` is not `logprobs: false`)."""
    if isinstance(value, bool) or isinstance(allowed, bool) or value is None or allowed is None:
        return value is allowed
    return value == allowed


def _validation_error(error: ValidationError) -> ApiError:
    """The first problem, phrased for a person: which parameter, what is wrong with it."""
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        name = str(first["loc"][-1])
        hint = f" (only {json.dumps(NO_EFFECT_VALUES[name][0])} is accepted)" if name in NO_EFFECT_VALUES else ""
        return ApiError(400, f"parameter {param!r} is not supported by specd{hint}; remove it", param=param)
    if first["type"] == "missing":
        return ApiError(400, f"parameter {param!r} is required", param=param)
    message = first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"invalid {param!r}: {message}", param=param)


# --------------------------------------------------------------------------- replies


@dataclass(frozen=True)
class ReplyIds:
    """What every reply and chunk of one request repeats."""

    id: str
    created: int
    model: str

    def envelope(self, kind: Kind, streamed: bool, choices: list) -> dict:
        """The fields every reply and chunk of the request shares, around its choices."""
        name = ("chat.completion.chunk" if streamed else "chat.completion") if kind == "chat" else "text_completion"
        return {"id": self.id, "object": name, "created": self.created, "model": self.model, "choices": choices}

    @classmethod
    def new(cls, kind: Kind, model: str) -> "ReplyIds":
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculation(stats: generate_pb2.SpeculationStats) -> dict:
    """specd's extension field: the speculation counters of generate.proto plus the acceptance rate."""
    fields = {field.name: _json_value(field, getattr(stats, field.name)) for field in stats.DESCRIPTOR.fields}
    fields["acceptance_rate"] = stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else 0.0
    return fields


def _json_value(field: Any, value: Any) -> Any:
    """A proto field as JSON: numbers stay numbers (json_format would write 64-bit integers as strings)."""
    return list(value) if field.is_repeated else value


def finish_reason(reason: int) -> Optional[str]:
    return FINISH_REASONS.get(reason)


def reply(kind: Kind, ids: ReplyIds, answer: generate_pb2.GenerateResponse) -> dict:
    """The whole (non-streamed) answer."""
    finish = finish_reason(answer.finish_reason)
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": answer.text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": answer.text, "logprobs": None, "finish_reason": finish}
    return {**ids.envelope(kind, False, [choice]), "usage": usage(answer.usage.prompt_tokens, answer.usage.completion_tokens),
            "specd": speculation(answer.stats)}


def chunk(kind: Kind, ids: ReplyIds, text: str, finish: Optional[str] = None, first: bool = False,
          stats: Optional[generate_pb2.SpeculationStats] = None) -> dict:
    """One streamed chunk; the chat stream's first delta names the role, the last carries finish_reason
    (and specd's speculation stats)."""
    if kind == "chat":
        delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    message = ids.envelope(kind, True, [choice])
    if stats is not None:
        message["specd"] = speculation(stats)
    return message


def usage_chunk(kind: Kind, ids: ReplyIds, prompt_tokens: int, completion_tokens: int) -> dict:
    """The extra last chunk of `stream_options.include_usage`: no choices, the request's usage."""
    return {**ids.envelope(kind, True, []), "usage": usage(prompt_tokens, completion_tokens)}


def models_list(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "specd"}]}
