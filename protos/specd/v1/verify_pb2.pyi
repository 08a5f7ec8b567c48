from specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyPrefillRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "return_features", "lease_seconds", "feature_layers", "prompt_length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    return_features: bool
    lease_seconds: float
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_features: _Optional[bool] = ..., lease_seconds: _Optional[float] = ..., feature_layers: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ...) -> None: ...

class VerifyPrefillResponse(_message.Message):
    __slots__ = ("sequence_length", "features", "next_scored")
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    NEXT_SCORED_FIELD_NUMBER: _ClassVar[int]
    sequence_length: int
    features: _common_pb2.TargetFeatures
    next_scored: bool
    def __init__(self, sequence_length: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.TargetFeatures, _Mapping]] = ..., next_scored: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "commit", "draft_token_ids", "return_features", "draft_parents", "return_head_drafts", "head_candidates", "head_rows", "allowed_tokens", "top_logprobs", "coupled_draw", "head_depth", "plain_steps", "stop_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    RETURN_HEAD_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    HEAD_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    HEAD_ROWS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COUPLED_DRAW_FIELD_NUMBER: _ClassVar[int]
    HEAD_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit: _common_pb2.Commit
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    return_features: bool
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    return_head_drafts: bool
    head_candidates: int
    head_rows: int
    allowed_tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenMask]
    top_logprobs: int
    coupled_draw: CoupledDraw
    head_depth: int
    plain_steps: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., commit: _Optional[_Union[_common_pb2.Commit, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., return_features: _Optional[bool] = ..., draft_parents: _Optional[_Iterable[int]] = ..., return_head_drafts: _Optional[bool] = ..., head_candidates: _Optional[int] = ..., head_rows: _Optional[int] = ..., allowed_tokens: _Optional[_Iterable[_Union[_common_pb2.TokenMask, _Mapping]]] = ..., top_logprobs: _Optional[int] = ..., coupled_draw: _Optional[_Union[CoupledDraw, _Mapping]] = ..., head_depth: _Optional[int] = ..., plain_steps: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CoupledDraw(_message.Message):
    __slots__ = ("seed", "return_target_probs")
    SEED_FIELD_NUMBER: _ClassVar[int]
    RETURN_TARGET_PROBS_FIELD_NUMBER: _ClassVar[int]
    seed: int
    return_target_probs: bool
    def __init__(self, seed: _Optional[int] = ..., return_target_probs: _Optional[bool] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("argmax_token_ids", "target_probs", "sequence_length", "model_seconds", "features", "head_drafts", "logprobs", "sampled_token_ids")
    ARGMAX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_PROBS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MODEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    HEAD_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    argmax_token_ids: _containers.RepeatedScalarFieldContainer[int]
    target_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Distribution]
    sequence_length: int
    model_seconds: float
    features: _common_pb2.TargetFeatures
    head_drafts: _common_pb2.HeadDrafts
    logprobs: _containers.RepeatedCompositeFieldContainer[RowLogprobs]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, argmax_token_ids: _Optional[_Iterable[int]] = ..., target_probs: _Optional[_Iterable[_Union[_common_pb2.Distribution, _Mapping]]] = ..., sequence_length: _Optional[int] = ..., model_seconds: _Optional[float] = ..., features: _Optional[_Union[_common_pb2.TargetFeatures, _Mapping]] = ..., head_drafts: _Optional[_Union[_common_pb2.HeadDrafts, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[RowLogprobs, _Mapping]]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyBatchRequest(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, parts: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class VerifyBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyBatchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyBatchResult, _Mapping]]] = ...) -> None: ...

class VerifyBatchResult(_message.Message):
    __slots__ = ("response", "code", "message")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    response: VerifyResponse
    code: int
    message: str
    def __init__(self, response: _Optional[_Union[VerifyResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class RowLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
