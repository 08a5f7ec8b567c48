from specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftPrefillRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "target_features", "lease_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FEATURES_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    target_features: _common_pb2.TargetFeatures
    lease_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., target_features: _Optional[_Union[_common_pb2.TargetFeatures, _Mapping]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class DraftPrefillResponse(_message.Message):
    __slots__ = ("sequence_length",)
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    sequence_length: int
    def __init__(self, sequence_length: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "commit", "num_draft_tokens", "seed", "target_features", "branches", "speculate_outcomes", "next_seed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TARGET_FEATURES_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit: _common_pb2.Commit
    num_draft_tokens: int
    seed: int
    target_features: _common_pb2.TargetFeatures
    branches: int
    speculate_outcomes: int
    next_seed: int
    def __init__(self, session_id: _Optional[str] = ..., commit: _Optional[_Union[_common_pb2.Commit, _Mapping]] = ..., num_draft_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., target_features: _Optional[_Union[_common_pb2.TargetFeatures, _Mapping]] = ..., branches: _Optional[int] = ..., speculate_outcomes: _Optional[int] = ..., next_seed: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("token_ids", "draft_probs", "sequence_length", "model_seconds", "parents", "cache_hit")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MODEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Distribution]
    sequence_length: int
    model_seconds: float
    parents: _containers.RepeatedScalarFieldContainer[int]
    cache_hit: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.Distribution, _Mapping]]] = ..., sequence_length: _Optional[int] = ..., model_seconds: _Optional[float] = ..., parents: _Optional[_Iterable[int]] = ..., cache_hit: _Optional[bool] = ...) -> None: ...
