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
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence, TypeVar, Union

import grpc

from gateway.grammar import MAX_CHOICE_CHARS, MAX_CHOICES, MAX_CONSTRAINT_BYTES
from gateway.service import MAX_NEW_TOKENS, MAX_PROMPT_CHARS, MAX_STOP_LENGTH, MAX_STOP_STRINGS
from specd.v1 import common_pb2, generate_pb2
from specd_common.params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_TOP_LOGPROBS

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# Chat without max_tokens gets the gateway's default (GenerateRequest.max_new_tokens = 0): 256 tokens.
SEED_MASK = 2**64 - 1  # OpenAI seeds are signed 64-bit; specd's are unsigned: same bits
INT32_MAX = 2**31 - 1  # token ids and top_k are int32 in specd.v1
ROLES = ("system", "developer", "user", "assistant")  # "developer" is OpenAI's newer name for "system"
Kind = Literal["chat", "completion"]
T = TypeVar("T")
_UNSET = object()

# Parameters accepted only at the value that changes nothing (SDKs and harnesses send these).
NO_EFFECT_VALUES: dict[str, tuple] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "frequency_penalty": (0, None),
    "presence_penalty": (0, None),
    "tools": ([], None),
    "tool_choice": ("none", None),
    "parallel_tool_calls": (False, None),
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
                 param: Optional[str] = None, retry_after: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.code, self.param = status, message, error_type, code, param
        self.retry_after = retry_after  # seconds, for the Retry-After header of a 429 / 503

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> "ApiError":
        """The HTTP error for a gRPC status; the gateway's `retry-after` trailer (admission) becomes Retry-After."""
        status, error_type, error_code = _HTTP_ERRORS.get(code, (500, "server_error", "internal_error"))
        retry_after = next((str(value) for key, value in trailing_metadata or () if key == "retry-after"), None)
        return cls(status, details or code.name, error_type, error_code, retry_after=retry_after)

    def body(self) -> dict:
        """OpenAI's error JSON."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code or None}}


# --------------------------------------------------------------------------- reading a request body
# One set of typed readers checks every field (strict JSON types: a boolean is not a number, a string is not
# a boolean, NaN and Infinity are not numbers); each error names the field's path (`messages[0].content`),
# the type or range it must have and what it got, so a client can fix the request from the message alone.


def as_int(value: Any, path: str, low: int, high: int, what: str = "an integer") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid(path, f"must be {what} in [{low}, {high}]", value)
    return value


def as_number(value: Any, path: str, low: float, high: float, above_low: bool = False) -> float:
    """A JSON number (an integer counts), finite, in [low, high] or (low, high] when above_low."""
    interval = f"{'(' if above_low else '['}{low:g}, {high:g}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(value, float) and not math.isfinite(value):
        raise invalid(path, f"must be a finite number in {interval}", value)
    if not (low < value if above_low else low <= value) or value > high:
        raise invalid(path, f"must be in {interval}", value)
    return float(value)


def as_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(path, "must be true or false", value)
    return value


def as_text(value: Any, path: str, min_chars: int = 0, max_chars: int = MAX_PROMPT_CHARS) -> str:
    """A string of min_chars..max_chars characters that UTF-8 can carry: JSON lets a string hold a lone
    UTF-16 surrogate (`"\\ud800"`), which no model or protobuf message can."""
    if not isinstance(value, str) or not min_chars <= len(value) <= max_chars:
        raise invalid(path, f"must be a string of {min_chars}..{max_chars} characters", value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise invalid(path, f"holds a lone UTF-16 surrogate at character {error.start}, which is not text; "
                            "send characters outside the BMP as a surrogate pair or as UTF-8") from None
    return value


def as_list(value: Any, path: str, min_items: int, max_items: int) -> list:
    if not isinstance(value, list) or not min_items <= len(value) <= max_items:
        raise invalid(path, f"must be an array of {min_items}..{max_items} items", value)
    return value


def as_object(value: Any, path: str, known: tuple[str, ...]) -> dict:
    """A JSON object whose keys are all known (anything else would be ignored, so it is refused)."""
    if not isinstance(value, dict):
        raise invalid(path, "must be an object", value)
    for key in value:
        if key not in known:
            raise unsupported(_join(path, key))
    return value


def read(body: dict, name: str, check: Callable[..., T], *limits: Any, where: str = "") -> Optional[T]:
    """body[name] checked by `check(value, path, *limits)`; None when absent or null (OpenAI's "not set")."""
    value = body.get(name)
    return None if value is None else check(value, _join(where, name), *limits)


def require(body: dict, name: str, check: Callable[..., T], *limits: Any, where: str = "") -> T:
    path = _join(where, name)
    if body.get(name) is None:
        raise ApiError(400, f"parameter {path!r} is required", param=path)
    return check(body[name], path, *limits)


def invalid(path: str, problem: str, value: Any = _UNSET) -> ApiError:
    got = "" if value is _UNSET else f", got {shown(value)}"
    return ApiError(400, f"invalid {path!r}: {problem}{got}", param=path)


def unsupported(path: str) -> ApiError:
    hint = f" (only {json.dumps(NO_EFFECT_VALUES[path][0])} is accepted)" if path in NO_EFFECT_VALUES else ""
    return ApiError(400, f"parameter {path!r} is not supported by specd{hint}; remove it", param=path)


def _join(where: str, name: str) -> str:
    name = json.dumps(name)[1:-1]  # a client's key, printable and UTF-8-safe for the error JSON
    return f"{where}.{name}" if where else name


def shown(value: Any) -> str:
    """A JSON value as an error message shows it: short and ASCII-escaped (safe in the error JSON)."""
    if isinstance(value, (list, dict)):
        return f"an {'array' if isinstance(value, list) else 'object'} of {len(value)} items"
    if isinstance(value, str) and len(value) > 40:
        return f"a string of {len(value)} characters"
    text = json.dumps(value)  # NaN and Infinity as JSON writes them; lone surrogates escaped
    text = text if len(text) <= 40 else f"{text[:24]}... ({len(text)} digits)"
    return f"{text} (not a finite number)" if isinstance(value, float) and not math.isfinite(value) else text


# --------------------------------------------------------------------------- the requests


@dataclass(frozen=True)
class ParsedRequest:
    """A checked OpenAI request: what the HTTP layer needs, and the GenerateRequest it becomes."""

    model: str
    stream: bool
    include_usage: bool
    user: Optional[str]  # an end-user id: recorded on the trace, changes nothing
    request: generate_pb2.GenerateRequest


def parse_request(kind: Kind, body: Any, vocab_size: int = INT32_MAX + 1) -> ParsedRequest:
    """Check a JSON body field by field; ApiError(400) that names the field and says what to fix.
    Token ids are checked against vocab_size when the caller knows it (the gateway checks them again)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {shown(body)}")
    body = as_object({key: value for key, value in body.items() if not _no_effect(key, value)}, "", _FIELDS[kind])
    model = require(body, "model", as_text, 1)
    stream = read(body, "stream", as_bool) or False
    options = read(body, "stream_options", as_object, ("include_usage",)) or {}
    include_usage = read(options, "include_usage", as_bool, where="stream_options") or False
    user = read(body, "user", as_text)
    if kind == "chat":
        messages = _messages(require(body, "messages", as_list, 1, MAX_PROMPT_CHARS))
        max_tokens = read(body, "max_tokens", as_int, 1, MAX_NEW_TOKENS)
        max_new = read(body, "max_completion_tokens", as_int, 1, MAX_NEW_TOKENS) or max_tokens
        request = generate_pb2.GenerateRequest(messages=generate_pb2.ChatMessages(messages=messages))
        request.logprobs = read(body, "logprobs", as_bool) or False
        request.top_logprobs = read(body, "top_logprobs", as_int, 0, MAX_TOP_LOGPROBS) or 0
        if request.top_logprobs and not request.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
    else:
        max_new = read(body, "max_tokens", as_int, 1, MAX_NEW_TOKENS) or COMPLETION_DEFAULT_MAX_TOKENS
        request = _prompt(require(body, "prompt", _prompt_value), vocab_size)
        top = read(body, "logprobs", as_int, 0, MAX_COMPLETION_LOGPROBS)  # the legacy API's: how many likeliest tokens
        request.logprobs, request.top_logprobs = top is not None, top or 0
    _sampling(body, request, vocab_size)
    constraint = read(body, "response_format", _response_format)
    if constraint is not None:
        request.constraint.CopyFrom(constraint)
    speculation = read(body, "speculation", as_bool)  # an extension: false = target-only, to compare the two
    request.disable_speculation = speculation is False
    request.max_new_tokens = max_new or 0  # 0: the gateway's default (chat: 256 tokens)
    return ParsedRequest(model, stream, include_usage, user, request)


_SHARED_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "user",
                  "logit_bias", "speculation", "response_format")
_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": (*_SHARED_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs"),
    "completion": (*_SHARED_FIELDS, "prompt", "logprobs"),
}


def _sampling(body: dict, request: generate_pb2.GenerateRequest, vocab_size: int = INT32_MAX + 1) -> None:
    """The sampling fields chat and completions share; OpenAI's defaults are temperature 1, top_p 1."""
    temperature = read(body, "temperature", as_number, 0, 2)
    request.sampling.temperature = 1.0 if temperature is None else temperature
    request.sampling.top_p = read(body, "top_p", as_number, 0, 1, True) or 0.0
    request.sampling.top_k = read(body, "top_k", as_int, 0, INT32_MAX) or 0  # an extension, as in vLLM; 0 = off
    seed = read(body, "seed", as_int, -(2**63), SEED_MASK)
    if seed is not None:
        request.seed = seed & SEED_MASK
    request.stop.extend(read(body, "stop", _stop_value) or [])
    request.sampling.logit_bias.update(read(body, "logit_bias", _logit_bias_value, vocab_size) or {})


def _logit_bias_value(value: Any, path: str, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias: an object from token ids (as strings) to numbers in [-100, 100]."""
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(path, f"must be an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids", value)
    bias, high = {}, highest_token_id(vocab_size)
    for key, number in value.items():
        where = _join(path, key)
        if not (key.isascii() and key.isdigit()) or int(key) > high:
            raise invalid(where, f"must be keyed by a token id in [0, {high}] written as a decimal string", key)
        bias[int(key)] = as_number(number, where, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return bias


MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "grammar", "choice")  # the last three: specd's extensions
MAX_SCHEMA_NAME_CHARS = 64  # OpenAI's limit on json_schema.name


def _response_format(value: Any, path: str) -> Optional[generate_pb2.OutputConstraint]:
    """OpenAI's response_format ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name",
    "schema", "strict", "description"}}) and specd's extensions in the same shape: {"type": "regex",
    "regex": ...}, {"type": "grammar", "grammar": <Lark>}, {"type": "choice", "choice": [...]}. None for
    "text". Whatever the schema says is enforced, `strict` true or false (the grammar always binds)."""
    fields = as_object(value, path, ("type", "json_schema", "regex", "grammar", "choice"))
    kind = require(fields, "type", as_text, 1, 32, where=path)
    if kind not in RESPONSE_FORMATS:
        raise invalid(_join(path, "type"), f"must be one of {', '.join(RESPONSE_FORMATS)}", kind)
    extra = set(fields) - {"type", kind}
    if extra:
        raise invalid(_join(path, sorted(extra)[0]), f"does not go with type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return generate_pb2.OutputConstraint(json_object=True)
    if kind == "json_schema":
        where = _join(path, "json_schema")
        spec = require(fields, "json_schema", as_object, ("name", "description", "schema", "strict"), where=path)
        name = require(spec, "name", as_text, 1, MAX_SCHEMA_NAME_CHARS, where=where)
        if not all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
            raise invalid(_join(where, "name"), "may hold only a-z, A-Z, 0-9, underscores and dashes", name)
        read(spec, "description", as_text, where=where)
        read(spec, "strict", as_bool, where=where)
        schema = require(spec, "schema", as_object_of_any, where=where)
        return generate_pb2.OutputConstraint(json_schema=json.dumps(schema))
    if kind == "choice":
        choices = require(fields, "choice", as_list, 1, MAX_CHOICES, where=path)
        texts = [as_text(choice, f"{_join(path, 'choice')}[{i}]", 1, MAX_CHOICE_CHARS) for i, choice in enumerate(choices)]
        return generate_pb2.OutputConstraint(choice=generate_pb2.Choices(choices=texts))
    text = require(fields, kind, as_text, 1, MAX_CONSTRAINT_BYTES, where=path)
    return generate_pb2.OutputConstraint(regex=text) if kind == "regex" else generate_pb2.OutputConstraint(lark_grammar=text)


def as_object_of_any(value: Any, path: str) -> dict:
    """A JSON object, whatever its keys (a JSON Schema: the grammar compiler checks it)."""
    if not isinstance(value, dict):
        raise invalid(path, "must be an object (a JSON Schema)", value)
    return value


def _stop_value(value: Any, path: str) -> list[str]:
    """A string or an array of strings."""
    if isinstance(value, str):
        return [as_text(value, path, 1, MAX_STOP_LENGTH)]
    stops = as_list(value, path, 0, MAX_STOP_STRINGS)
    return [as_text(stop, f"{path}[{i}]", 1, MAX_STOP_LENGTH) for i, stop in enumerate(stops)]


def _messages(messages: list) -> list[generate_pb2.ChatMessage]:
    """Roles system/developer/user/assistant ("developer" is OpenAI's newer "system"; tool messages would
    need tool calling), text content as a string or as text parts; MAX_PROMPT_CHARS characters in all."""
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        message = as_object(message, where, ("role", "content"))
        role = require(message, "role", as_text, where=where)
        if role not in ROLES:
            raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}", role)
        content = require(message, "content", _content, where=where)
        checked.append(generate_pb2.ChatMessage(role="system" if role == "developer" else role, content=content))
    total = sum(len(message.content) for message in checked)
    if total > MAX_PROMPT_CHARS:
        raise invalid("messages", f"the contents are {total} characters in all; at most {MAX_PROMPT_CHARS} are accepted "
                                  "(and the prompt must fit the model's context, in tokens)")
    return checked


def _content(value: Any, path: str) -> str:
    """A string, or an array of text parts ({"type": "text", "text": ...}) joined."""
    if isinstance(value, str) or not isinstance(value, list):
        return as_text(value, path)
    texts = []
    for i, part in enumerate(value):
        where = f"{path}[{i}]"
        part = as_object(part, where, ("type", "text"))
        if require(part, "type", as_text, where=where) != "text":
            raise invalid(f"{where}.type", 'must be "text" (specd takes text only)', part["type"])
        texts.append(require(part, "text", as_text, where=where))
    return "".join(texts)


def _prompt_value(value: Any, path: str) -> Union[str, list[int]]:
    """A string, an array of one string, or an array of token ids (checked against the vocabulary later)."""
    if isinstance(value, list) and value and isinstance(value[0], str):
        if len(value) != 1:
            raise invalid(path, "specd answers one prompt per request; send a string or an array of one string")
        return as_text(value[0], f"{path}[0]", 1)
    if isinstance(value, list):
        return as_list(value, path, 1, MAX_PROMPT_CHARS)
    return as_text(value, path, 1)


def _prompt(prompt: Union[str, list], vocab_size: int) -> generate_pb2.GenerateRequest:
    if isinstance(prompt, str):  # completions are raw text: no chat template
        return generate_pb2.GenerateRequest(text=prompt, raw=True)
    high, what = highest_token_id(vocab_size), "a token id of the model's vocabulary"
    ids = [as_int(token, f"prompt[{i}]", 0, high, what) for i, token in enumerate(prompt)]
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=ids))


def highest_token_id(vocab_size: int) -> int:
    """The largest token id a request may name: the model's last, and an int32 (specd.v1's type)."""
    return min(vocab_size, INT32_MAX + 1) - 1


def _no_effect(key: str, value: Any) -> bool:
    return key in NO_EFFECT_VALUES and any(_same(value, allowed) for allowed in NO_EFFECT_VALUES[key])


def _same(value: Any, allowed: Any) -> bool:
    """Equal, where booleans and None match only themselves (`logprobs: 0` is not `logprobs: false`)."""
    if isinstance(value, bool) or isinstance(allowed, bool) or value is None or allowed is None:
        return value is allowed
    return value == allowed


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


def reply(kind: Kind, ids: ReplyIds, answer: generate_pb2.GenerateResponse,
          token_bytes: Callable[[int], bytes] = lambda token: b"") -> dict:
    """The whole (non-streamed) answer."""
    finish = finish_reason(answer.finish_reason)
    scored = logprobs(kind, answer.logprobs, token_bytes)
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": answer.text}, "logprobs": scored,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": answer.text, "logprobs": scored, "finish_reason": finish}
    return {**ids.envelope(kind, False, [choice]), "usage": usage(answer.usage.prompt_tokens, answer.usage.completion_tokens),
            "specd": speculation(answer.stats)}


def chunk(kind: Kind, ids: ReplyIds, text: str, finish: Optional[str] = None, first: bool = False,
          stats: Optional[generate_pb2.SpeculationStats] = None, scored: Optional[dict] = None) -> dict:
    """One streamed chunk; the chat stream's first delta names the role, the last carries finish_reason
    (and specd's speculation stats); `scored`: its tokens' logprobs (logprobs())."""
    if kind == "chat":
        delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": scored, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": scored, "finish_reason": finish}
    message = ids.envelope(kind, True, [choice])
    if stats is not None:
        message["specd"] = speculation(stats)
    return message


def logprobs(kind: Kind, entries: Sequence[generate_pb2.TokenLogprob], token_bytes: Callable[[int], bytes]) -> Optional[dict]:
    """OpenAI's logprobs object for some tokens (None when the request asked for none): chat's
    {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}, the legacy completions' {"tokens",
    "token_logprobs", "top_logprobs", "text_offset"} (offsets counted within this piece of text)."""
    if not entries:
        return None
    texts: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in texts:
            texts[token] = token_bytes(token).decode("utf-8", errors="replace")
        return texts[token]

    if kind == "chat":
        def item(token: int, value: float) -> dict:
            return {"token": text(token), "logprob": value, "bytes": list(token_bytes(token))}

        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t.token_id, t.logprob) for t in e.top]}
                            for e in entries], "refusal": None}
    offsets = [0]
    for entry in entries[:-1]:
        offsets.append(offsets[-1] + len(text(entry.token_id)))
    return {"tokens": [text(e.token_id) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t.token_id): t.logprob for t in e.top} for e in entries], "text_offset": offsets}


def usage_chunk(kind: Kind, ids: ReplyIds, prompt_tokens: int, completion_tokens: int) -> dict:
    """The extra last chunk of `stream_options.include_usage`: no choices, the request's usage."""
    return {**ids.envelope(kind, True, []), "usage": usage(prompt_tokens, completion_tokens)}


def models_list(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "specd"}]}
