from specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftLengthPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_LENGTH_POLICY_UNSPECIFIED: _ClassVar[DraftLengthPolicy]
    DRAFT_LENGTH_POLICY_FIXED: _ClassVar[DraftLengthPolicy]
    DRAFT_LENGTH_POLICY_ADAPTIVE: _ClassVar[DraftLengthPolicy]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
DRAFT_LENGTH_POLICY_UNSPECIFIED: DraftLengthPolicy
DRAFT_LENGTH_POLICY_FIXED: DraftLengthPolicy
DRAFT_LENGTH_POLICY_ADAPTIVE: DraftLengthPolicy
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "messages", "token_ids", "raw", "max_new_tokens", "sampling", "seed", "stop", "disable_speculation", "num_draft_tokens", "draft_length_policy", "draft_branches", "constraint", "logprobs", "top_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DISABLE_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_POLICY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: ChatMessages
    token_ids: TokenIds
    raw: bool
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    disable_speculation: bool
    num_draft_tokens: int
    draft_length_policy: DraftLengthPolicy
    draft_branches: int
    constraint: OutputConstraint
    logprobs: bool
    top_logprobs: int
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., raw: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., disable_speculation: _Optional[bool] = ..., num_draft_tokens: _Optional[int] = ..., draft_length_policy: _Optional[_Union[DraftLengthPolicy, str]] = ..., draft_branches: _Optional[int] = ..., constraint: _Optional[_Union[OutputConstraint, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class OutputConstraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark_grammar", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark_grammar: str
    choice: Choices
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark_grammar: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("target_passes", "draft_tokens", "accepted_tokens", "draft_tokens_per_position", "accepted_tokens_per_position", "wire_bytes", "round_seconds", "model_seconds", "rejected_rounds", "draft_cache_lookups", "draft_cache_hits", "draft_model_seconds", "lookup_rounds", "head_rounds", "tree_rounds", "draft_wait_seconds", "draft_cache_hit_wait_seconds", "draft_cache_lookup_wait_seconds", "predicted_tokens", "forced_rounds", "forced_tokens", "rested_rounds", "predicted_tokens_squared_error")
    TARGET_PASSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CACHE_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TREE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CACHE_HIT_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CACHE_LOOKUP_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORCED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESTED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_SQUARED_ERROR_FIELD_NUMBER: _ClassVar[int]
    target_passes: int
    draft_tokens: int
    accepted_tokens: int
    draft_tokens_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_tokens_per_position: _containers.RepeatedScalarFieldContainer[int]
    wire_bytes: int
    round_seconds: float
    model_seconds: float
    rejected_rounds: int
    draft_cache_lookups: int
    draft_cache_hits: int
    draft_model_seconds: float
    lookup_rounds: int
    head_rounds: int
    tree_rounds: int
    draft_wait_seconds: float
    draft_cache_hit_wait_seconds: float
    draft_cache_lookup_wait_seconds: float
    predicted_tokens: float
    forced_rounds: int
    forced_tokens: int
    rested_rounds: int
    predicted_tokens_squared_error: float
    def __init__(self, target_passes: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., draft_tokens_per_position: _Optional[_Iterable[int]] = ..., accepted_tokens_per_position: _Optional[_Iterable[int]] = ..., wire_bytes: _Optional[int] = ..., round_seconds: _Optional[float] = ..., model_seconds: _Optional[float] = ..., rejected_rounds: _Optional[int] = ..., draft_cache_lookups: _Optional[int] = ..., draft_cache_hits: _Optional[int] = ..., draft_model_seconds: _Optional[float] = ..., lookup_rounds: _Optional[int] = ..., head_rounds: _Optional[int] = ..., tree_rounds: _Optional[int] = ..., draft_wait_seconds: _Optional[float] = ..., draft_cache_hit_wait_seconds: _Optional[float] = ..., draft_cache_lookup_wait_seconds: _Optional[float] = ..., predicted_tokens: _Optional[float] = ..., forced_rounds: _Optional[int] = ..., forced_tokens: _Optional[int] = ..., rested_rounds: _Optional[int] = ..., predicted_tokens_squared_error: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "prompt_token_ids", "finish_reason", "usage", "stats", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    stats: SpeculationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("text", "token_ids", "prompt_token_ids", "finish_reason", "usage", "stats", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    stats: SpeculationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...
