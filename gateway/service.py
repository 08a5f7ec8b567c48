"""The public GenerateService: validate the request, run a Generation, shape the answer. Thin on purpose."""

from __future__ import annotations

import secrets
from typing import Optional

import grpc
from google.protobuf.message import DecodeError

from gateway.admission import Admission
from gateway.backends import Backends
from gateway.engine import Chunk, FinishReason, Generation, GenerationSpec
from gateway.options import GatewayOptions
from specd.v1 import generate_pb2, generate_pb2_grpc
from specd_common.errors import grpc_errors, grpc_stream_errors, require
from specd_common.params import Warp, check_top_logprobs
from specd_common.sequence import validate_token_ids
from specd_common.server import CallGate
from specd_common.tree import MAX_BRANCHES, MAX_DRAFT_TOKENS, MAX_TREE_NODES

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
DEFAULT_MAX_NEW_TOKENS = 256
MAX_NEW_TOKENS = 8192
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_PROMPT_CHARS = 1_000_000
CHAT_ROLES = ("system", "user", "assistant")
SHUTTING_DOWN = "the gateway is shutting down; retry on another replica"
_POLICIES = {generate_pb2.DRAFT_LENGTH_POLICY_FIXED, generate_pb2.DRAFT_LENGTH_POLICY_ADAPTIVE}
_FINISH = {
    FinishReason.EOS: generate_pb2.FINISH_REASON_EOS,
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
}


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, backends: Backends, options: GatewayOptions = GatewayOptions(), admission: Optional[Admission] = None):
        self.backends = backends
        self.options = options
        self.admission = admission or Admission(max_active=64, max_waiting=options.max_waiting)
        self.gate = CallGate(SHUTTING_DOWN)  # the server's graceful shutdown (specd_common/server.py)

    @grpc_errors
    def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext):
        with self.gate.enter():
            return self._generate(request, context)

    @grpc_stream_errors
    def GenerateStream(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext):
        with self.gate.enter():
            yield from self._generate_stream(request, context)

    def _generate(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext) -> generate_pb2.GenerateResponse:
        generation = self._start(request, context)
        token_ids, logprobs, finish = [], [], None
        with self._slot(generation, context) as ticket:
            for chunk in generation.run():
                ticket.emitted(len(chunk.token_ids))
                token_ids.extend(chunk.token_ids)
                logprobs.extend(chunk.logprobs)
                finish = chunk.finish_reason
        return generate_pb2.GenerateResponse(
            text=generation.text,
            token_ids=token_ids,
            prompt_token_ids=generation.spec.prompt_ids,
            finish_reason=_FINISH.get(finish, generate_pb2.FINISH_REASON_UNSPECIFIED),
            usage=_usage(generation),
            stats=_stats(generation),
            logprobs=logprobs,
        )

    def _generate_stream(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext):
        generation = self._start(request, context)
        first = True
        with self._slot(generation, context) as ticket:
            for chunk in generation.run():
                ticket.emitted(len(chunk.token_ids))
                yield _stream_message(generation, chunk, first)
                first = False

    def _slot(self, generation: Generation, context: grpc.ServicerContext):
        """The request's admission slot (RESOURCE_EXHAUSTED at once when it cannot be served in time)."""
        spec = generation.spec
        return self.admission.slot(_deadline(context), len(spec.prompt_ids), spec.max_new_tokens)

    def _start(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext) -> Generation:
        spec = self.to_spec(request)
        return Generation(
            self.backends,
            spec,
            time_remaining=lambda: _deadline(context),
            is_active=context.is_active,
            cut_off=lambda: self.gate.cut,
            speculation_allowed=self._speculation_allowed,
            running=lambda: self.admission.active,
            options=self.options,
        )

    def _speculation_allowed(self) -> bool:
        """Under load the target is busy anyway and drafts cost throughput: plain decoding, as servers
        do. The limit is the flag's, or (auto, < 0) the one the verify's measured batch costs set
        (Backends.speculation_cap)."""
        limit = self.options.max_speculative_requests
        if limit < 0:
            limit = self.backends.speculation_cap()
        return not limit or self.admission.active <= limit

    def to_spec(self, request: generate_pb2.GenerateRequest) -> GenerationSpec:
        """Validate a GenerateRequest (INVALID_ARGUMENT that says what to fix) and turn it into a spec."""
        require(
            not isinstance(request, MalformedRequest),
            f"the request is not a valid specd.v1.GenerateRequest ({getattr(request, 'reason', '')}); "
            "string fields must be valid UTF-8",
        )
        max_new = request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        require(1 <= max_new <= MAX_NEW_TOKENS, f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {max_new}")
        k = request.num_draft_tokens or self.options.num_draft_tokens
        require(1 <= k <= MAX_DRAFT_TOKENS, f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {k}")
        adaptive = self._adaptive(request)
        # the gateway's default shapes greedy adaptive rounds only: a fixed-policy round drafts every round
        # alike, so a tree there would cost every round its extra positions, paying or not; and sampled
        # trees did not gain side by side on the 2-core EPYC: 1.207x transformers against chains' 1.28x
        # with fixed shapes (docs/benchmarks/bench_sampled_s36.json), 1.245x against 1.25x chosen by
        # the heads' confidence (bench_sampled_s37.json: every row's distribution comes back)
        warp = Warp.from_proto(request.sampling)
        validate_token_ids(warp.biased_tokens, self.backends.target_info.vocab_size, "sampling.logit_bias")
        grammar = self.backends.grammars.compile(request.constraint)
        check_top_logprobs(request.top_logprobs)
        require(request.logprobs or not request.top_logprobs, "top_logprobs needs logprobs: true")
        default_branches = min(self.options.draft_branches, max(1, MAX_TREE_NODES // k)) if adaptive and warp.greedy else 1
        branches = request.draft_branches or default_branches
        require(1 <= branches <= MAX_BRANCHES and k * branches <= MAX_TREE_NODES,
                f"draft_branches must be in [1, {MAX_BRANCHES}] with num_draft_tokens × draft_branches ≤ {MAX_TREE_NODES}, "
                f"got {request.draft_branches} with {k} drafts")
        require(len(request.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings")
        for stop in request.stop:
            require(1 <= len(stop) <= MAX_STOP_LENGTH, f"each stop string must be 1..{MAX_STOP_LENGTH} characters")
        prompt_ids = self.prompt_ids(request)
        limit = self.backends.target_info.max_sequence_length
        require(
            len(prompt_ids) < limit,
            f"the prompt is {len(prompt_ids)} tokens; the model's context is {limit} tokens, shorten it",
        )
        return GenerationSpec(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new,
            warp=warp,
            seed=request.seed if request.HasField("seed") else secrets.randbits(63),
            stop=tuple(request.stop),
            speculate=not request.disable_speculation,
            num_draft_tokens=k,
            adaptive=adaptive,
            branches=1 if grammar or request.logprobs else branches,  # chains: masks and logprobs follow one path
            # seeded sampling whose k follows the timings: the coupled rule keeps its output the seed's
            # (under the fixed policy k is fixed, and the draft's q with the rejection rule keeps it)
            reproducible=request.HasField("seed") and not warp.greedy and adaptive,
            grammar=grammar,
            top_logprobs=request.top_logprobs if request.logprobs else None,
        )

    def _adaptive(self, request: generate_pb2.GenerateRequest) -> bool:
        """The server's default policy unless the request names one. Seeded sampling may be adaptive
        too: its drafts are judged by the coupled rule (GenerationSpec.reproducible), whose output does
        not depend on k, so "same seed, same output" holds whatever the timings choose."""
        policy = request.draft_length_policy
        if policy == generate_pb2.DRAFT_LENGTH_POLICY_UNSPECIFIED:
            return self.options.draft_length_policy == "adaptive"
        require(policy in _POLICIES, f"draft_length_policy {policy} is not one of {sorted(_POLICIES)}")
        return policy == generate_pb2.DRAFT_LENGTH_POLICY_ADAPTIVE

    def prompt_ids(self, request: generate_pb2.GenerateRequest) -> list[int]:
        tokenizer = self.backends.tokenizer
        kind = request.WhichOneof("prompt")
        if kind == "text":
            require(0 < len(request.text) <= MAX_PROMPT_CHARS, f"text must be 1..{MAX_PROMPT_CHARS} characters")
            ids = tokenizer.encode_prompt(request.text, raw=request.raw)
        elif kind == "messages":
            messages = request.messages.messages
            require(len(messages) > 0, "messages must hold at least one message")
            for message in messages:
                require(message.role in CHAT_ROLES, f"message role must be one of {CHAT_ROLES}, got {message.role!r}")
            chars = sum(len(m.content) for m in messages)
            require(chars <= MAX_PROMPT_CHARS, f"messages are {chars} characters in all; at most {MAX_PROMPT_CHARS}")
            ids = tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in messages])
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
            validate_token_ids(ids, self.backends.target_info.vocab_size, "token_ids")
        else:
            require(False, "set a prompt: text, messages or token_ids")
        require(len(ids) > 0, "the prompt tokenizes to nothing; send a non-empty prompt")
        return ids


def _deadline(context: grpc.ServicerContext) -> Optional[float]:
    """Seconds left for the client, or None without a deadline (grpc then reports a huge number)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e6 else remaining


def _usage(generation: Generation) -> generate_pb2.Usage:
    return generate_pb2.Usage(prompt_tokens=len(generation.spec.prompt_ids), completion_tokens=len(generation.generated))


def _stats(generation: Generation) -> generate_pb2.SpeculationStats:
    stats = generation.stats
    return generate_pb2.SpeculationStats(
        target_passes=stats.target_passes,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        draft_tokens_per_position=stats.draft_tokens_per_position,
        accepted_tokens_per_position=stats.accepted_tokens_per_position,
        wire_bytes=stats.wire_bytes,
        round_seconds=stats.round_seconds,
        model_seconds=stats.model_seconds,
        rejected_rounds=stats.rejected_rounds,
        draft_cache_lookups=stats.draft_cache_lookups,
        draft_cache_hits=stats.draft_cache_hits,
        draft_wait_seconds=stats.draft_wait_seconds,
        draft_cache_hit_wait_seconds=stats.draft_cache_hit_wait_seconds,
        draft_cache_lookup_wait_seconds=stats.draft_cache_lookup_wait_seconds,
        draft_model_seconds=stats.draft_model_seconds,
        lookup_rounds=stats.lookup_rounds,
        head_rounds=stats.head_rounds,
        tree_rounds=stats.tree_rounds,
        predicted_tokens=stats.predicted_tokens,
        predicted_tokens_squared_error=stats.predicted_tokens_squared_error,
        forced_rounds=stats.forced_rounds,
        forced_tokens=stats.forced_tokens,
        rested_rounds=stats.rested_rounds,
    )


def _stream_message(generation: Generation, chunk: Chunk, first: bool) -> generate_pb2.GenerateStreamResponse:
    message = generate_pb2.GenerateStreamResponse(text=chunk.text, token_ids=chunk.token_ids, logprobs=chunk.logprobs)
    if first:
        message.prompt_token_ids.extend(generation.spec.prompt_ids)
    if chunk.finish_reason:
        message.finish_reason = _FINISH[chunk.finish_reason]
        message.usage.CopyFrom(_usage(generation))
        message.stats.CopyFrom(_stats(generation))
    return message


class MalformedRequest:
    """Stands in for a request whose bytes did not parse (e.g. invalid UTF-8 in a string field)."""

    def __init__(self, reason: str):
        self.reason = reason


def parse_request(data: bytes):
    """GenerateRequest.FromString that turns a parse failure into a MalformedRequest instead of INTERNAL."""
    try:
        return generate_pb2.GenerateRequest.FromString(data)
    except DecodeError as error:
        return MalformedRequest(str(error))


def add_to_server(servicer: GenerateServicer, server: grpc.Server) -> None:
    """Register like the generated helper, but with a parser that reports bad bytes as INVALID_ARGUMENT."""
    serialize = lambda message: message.SerializeToString()  # noqa: E731
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=parse_request, response_serializer=serialize
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=parse_request, response_serializer=serialize
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
