from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProbEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROB_ENCODING_UNSPECIFIED: _ClassVar[ProbEncoding]
    PROB_ENCODING_FLOAT16: _ClassVar[ProbEncoding]
    PROB_ENCODING_FLOAT32: _ClassVar[ProbEncoding]
PROB_ENCODING_UNSPECIFIED: ProbEncoding
PROB_ENCODING_FLOAT16: ProbEncoding
PROB_ENCODING_FLOAT32: ProbEncoding

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class TokenMask(_message.Message):
    __slots__ = ("allowed_bitmap", "allowed_token_ids")
    ALLOWED_BITMAP_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    allowed_bitmap: bytes
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, allowed_bitmap: _Optional[bytes] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Distribution(_message.Message):
    __slots__ = ("token_ids", "probs", "encoding", "vocab_size", "support_bitmap")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_BITMAP_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: bytes
    encoding: ProbEncoding
    vocab_size: int
    support_bitmap: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[bytes] = ..., encoding: _Optional[_Union[ProbEncoding, str]] = ..., vocab_size: _Optional[int] = ..., support_bitmap: _Optional[bytes] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("prefix_length", "append_token_ids")
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prefix_length: _Optional[int] = ..., append_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TargetFeatures(_message.Message):
    __slots__ = ("start_position", "hidden_size", "data")
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start_position: int
    hidden_size: int
    data: bytes
    def __init__(self, start_position: _Optional[int] = ..., hidden_size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class HeadDrafts(_message.Message):
    __slots__ = ("start_position", "heads", "token_ids", "candidates", "confidences")
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    start_position: int
    heads: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    candidates: int
    confidences: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, start_position: _Optional[int] = ..., heads: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., candidates: _Optional[int] = ..., confidences: _Optional[_Iterable[float]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "vocab_size", "max_sequence_length", "eos_token_ids", "tokenizer_json", "chat_template", "bos_token", "eos_token", "vocab_digest", "drafter", "wants_target_features", "hidden_size", "runtime_config", "medusa_heads", "runtime_profile", "target_feature_layers", "speculation_cache")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    WANTS_TARGET_FEATURES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_CONFIG_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_HEADS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_PROFILE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_CACHE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    max_sequence_length: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_json: str
    chat_template: str
    bos_token: str
    eos_token: str
    vocab_digest: str
    drafter: str
    wants_target_features: bool
    hidden_size: int
    runtime_config: str
    medusa_heads: int
    runtime_profile: RuntimeProfile
    target_feature_layers: _containers.RepeatedScalarFieldContainer[int]
    speculation_cache: bool
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., vocab_digest: _Optional[str] = ..., drafter: _Optional[str] = ..., wants_target_features: _Optional[bool] = ..., hidden_size: _Optional[int] = ..., runtime_config: _Optional[str] = ..., medusa_heads: _Optional[int] = ..., runtime_profile: _Optional[_Union[RuntimeProfile, _Mapping]] = ..., target_feature_layers: _Optional[_Iterable[int]] = ..., speculation_cache: _Optional[bool] = ...) -> None: ...

class RuntimeProfile(_message.Message):
    __slots__ = ("batch_costs", "ragged", "prefill_ms_per_token", "pass_costs")
    BATCH_COSTS_FIELD_NUMBER: _ClassVar[int]
    RAGGED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PASS_COSTS_FIELD_NUMBER: _ClassVar[int]
    batch_costs: _containers.RepeatedCompositeFieldContainer[BatchCost]
    ragged: bool
    prefill_ms_per_token: float
    pass_costs: _containers.RepeatedCompositeFieldContainer[BatchCost]
    def __init__(self, batch_costs: _Optional[_Iterable[_Union[BatchCost, _Mapping]]] = ..., ragged: _Optional[bool] = ..., prefill_ms_per_token: _Optional[float] = ..., pass_costs: _Optional[_Iterable[_Union[BatchCost, _Mapping]]] = ...) -> None: ...

class BatchCost(_message.Message):
    __slots__ = ("rows", "positions", "milliseconds")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MILLISECONDS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    positions: int
    milliseconds: float
    def __init__(self, rows: _Optional[int] = ..., positions: _Optional[int] = ..., milliseconds: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("renewed", "unknown_session_ids")
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    renewed: int
    unknown_session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, renewed: _Optional[int] = ..., unknown_session_ids: _Optional[_Iterable[str]] = ...) -> None: ...
