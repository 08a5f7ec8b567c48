"""The speculative loop: one request, round by round, with both services' KV caches kept in sync.

A round, in order:
  1. Propose: the draft applies the last round's commit and drafts k tokens (skipped when k = 0).
  2. Verify: the target applies the same commit and scores the k drafts plus one position.
  3. Accept / reject / correct (gateway.rejection) with the request's seeded RNG.
  4. Emit the accepted drafts and the recovered/bonus token; stop on EOS, length or a stop string.
The commit (how much of each service's sequence survives, and what to append) rides on the next
request to each service, so a round costs exactly one RPC per service.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import grpc
import numpy as np

from gateway.observe import GenerationObserver
from gateway.rejection import RoundOutcome, greedy_verify, rejection_sample
from gateway.text import TextStream
from gateway.tokenizer import GatewayTokenizer
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from specd_common.distributions import decode_distribution
from specd_common.errors import FailedPrecondition
from specd_common.params import Warp

log = logging.getLogger(__name__)

DEFAULT_RPC_TIMEOUT_S = 120.0
RELEASE_TIMEOUT_S = 5.0


class FinishReason:
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"


@dataclass(frozen=True)
class GenerationSpec:
    """A validated request, in domain terms."""

    prompt_ids: list[int]
    max_new_tokens: int
    warp: Warp
    seed: int
    stop: tuple[str, ...] = ()
    speculate: bool = True
    num_draft_tokens: int = 3


@dataclass
class SpeculationStats:
    target_passes: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class Chunk:
    """What one round adds to the answer; the last chunk carries finish_reason."""

    token_ids: list[int]
    text: str
    finish_reason: Optional[str] = None


@dataclass
class Backends:
    """The model services as the gateway sees them: stubs, what they reported, the shared tokenizer."""

    verify: verify_pb2_grpc.VerifyServiceStub
    draft: Optional[draft_pb2_grpc.DraftServiceStub]
    target_info: common_pb2.GetModelInfoResponse
    draft_info: Optional[common_pb2.GetModelInfoResponse]
    tokenizer: GatewayTokenizer

    @classmethod
    def connect(cls, verify_channel: grpc.Channel, draft_channel: Optional[grpc.Channel], timeout_s: float) -> "Backends":
        """Ask both services who they are; refuse a draft whose vocabulary differs from the target's."""
        verify = verify_pb2_grpc.VerifyServiceStub(verify_channel)
        target_info = verify.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout_s, wait_for_ready=True)
        draft, draft_info = None, None
        if draft_channel is not None:
            draft = draft_pb2_grpc.DraftServiceStub(draft_channel)
            draft_info = draft.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout_s, wait_for_ready=True)
            check_same_vocabulary(target_info, draft_info)
        return cls(verify, draft, target_info, draft_info, GatewayTokenizer(target_info))


def check_same_vocabulary(target: common_pb2.GetModelInfoResponse, draft: common_pb2.GetModelInfoResponse) -> None:
    """A model drafter must speak the target's token ids; a model-free drafter (no vocabulary) always does."""
    if draft.vocab_digest and draft.vocab_digest != target.vocab_digest:
        raise FailedPrecondition(
            f"draft {draft.model_name!r} and target {target.model_name!r} have different vocabularies "
            f"(digests {draft.vocab_digest[:12]} vs {target.vocab_digest[:12]}); pick a draft that shares "
            "the target's tokenizer"
        )


@dataclass
class ServiceSync:
    """How far a service's token sequence agrees with the gateway's committed one."""

    agreed: int  # the service's first `agreed` tokens equal the committed sequence's

    def commit(self, sequence: Sequence[int]) -> common_pb2.Commit:
        """Keep what agrees, append what the service has not seen (corrections, bonus, skipped rounds)."""
        return common_pb2.Commit(prefix_length=self.agreed, append_token_ids=sequence[self.agreed :])


class Generation:
    """One request's life: prefill both services, run rounds, release both, whatever happens."""

    def __init__(
        self,
        backends: Backends,
        spec: GenerationSpec,
        time_remaining: Callable[[], Optional[float]] = lambda: None,
        is_active: Callable[[], bool] = lambda: True,
    ):
        self.backends = backends
        self.spec = spec
        self.session_id = uuid.uuid4().hex
        self.rng = np.random.default_rng(spec.seed)
        self.sequence: list[int] = list(spec.prompt_ids)  # prompt + generated
        self.generated: list[int] = []
        self.stats = SpeculationStats()
        self.speculate = spec.speculate and backends.draft is not None
        self.max_length = backends.target_info.max_sequence_length
        self._time_remaining = time_remaining
        self._is_active = is_active
        self._text = TextStream(backends.tokenizer.decode, spec.stop)
        self._verify_sync = ServiceSync(agreed=len(self.sequence))
        self._draft_sync = ServiceSync(agreed=len(self.sequence))
        self._opened: list = []  # stubs holding this session

    @property
    def text(self) -> str:
        return self._text.text

    def run(self) -> Iterator[Chunk]:
        """Yield one Chunk per round until a stop condition; sessions are released on every exit path."""
        observer = GenerationObserver(self)  # spans and metrics (gateway/observe.py)
        try:
            observer.prefill(self._prefill)
            while self._is_active():
                chunk = observer.round(self._round)
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            observer.finish()
            self._release()

    def _timeout(self) -> float:
        remaining = self._time_remaining()  # None, or a huge number, when the client set no deadline
        return DEFAULT_RPC_TIMEOUT_S if remaining is None else max(min(remaining, DEFAULT_RPC_TIMEOUT_S), 0.001)

    def _prefill(self) -> None:
        """Open the session on both services at once."""
        sampling = self.spec.warp.to_proto(common_pb2.SamplingParams)
        opens = [(self.backends.verify, verify_pb2.VerifyPrefillRequest)]
        if self.speculate:
            opens.append((self.backends.draft, draft_pb2.DraftPrefillRequest))
        self._opened = [stub for stub, _ in opens]
        calls = [
            stub.Prefill.future(
                request_type(session_id=self.session_id, prompt_token_ids=self.sequence, sampling=sampling),
                timeout=self._timeout(),
            )
            for stub, request_type in opens
        ]
        for call in calls:
            call.result()

    def _draft_length(self) -> int:
        """k for this round: no more drafts than tokens left to generate (the last slot is the bonus)."""
        if not self.speculate:
            return 0
        left = min(self.spec.max_new_tokens - len(self.generated), self.max_length - len(self.sequence))
        return max(0, min(self.spec.num_draft_tokens, left - 1))

    def _round(self) -> Chunk:
        # 1. Propose
        k = self._draft_length()
        drafts: list[int] = []
        draft_probs: list[common_pb2.Distribution] = []
        if k > 0:
            proposal = self.backends.draft.Propose(
                draft_pb2.ProposeRequest(
                    session_id=self.session_id,
                    commit=self._draft_sync.commit(self.sequence),
                    num_draft_tokens=k,
                    seed=int(self.rng.integers(2**63)),
                ),
                timeout=self._timeout(),
            )
            drafts, draft_probs = list(proposal.token_ids), list(proposal.draft_probs)
            self._draft_sync.agreed = len(self.sequence)
        # 2. Verify
        scores = self.backends.verify.Verify(
            verify_pb2.VerifyRequest(
                session_id=self.session_id, commit=self._verify_sync.commit(self.sequence), draft_token_ids=drafts
            ),
            timeout=self._timeout(),
        )
        self._verify_sync.agreed = len(self.sequence)
        # 3. Accept / reject / correct
        outcome = self._judge(drafts, draft_probs, scores)
        # 4. Commit and emit
        self._verify_sync.agreed += outcome.accepted
        if drafts:
            self._draft_sync.agreed += outcome.accepted
        self.stats.target_passes += 1
        self.stats.draft_tokens += len(drafts)
        self.stats.accepted_tokens += outcome.accepted
        return self._emit(outcome.emitted(drafts))

    def _judge(self, drafts: list[int], draft_probs: list, scores: verify_pb2.VerifyResponse) -> RoundOutcome:
        if self.spec.warp.greedy:
            return greedy_verify(drafts, list(scores.argmax_token_ids))
        vocab_size = self.backends.target_info.vocab_size
        p = np.stack([decode_distribution(d) for d in scores.target_probs])  # [k + 1, V]
        q = np.stack([decode_distribution(d, vocab_size) for d in draft_probs]) if drafts else np.zeros((0, p.shape[1]))
        return rejection_sample(drafts, q, p, self.rng)

    def _emit(self, tokens: list[int]) -> Chunk:
        """Append tokens one by one until a stop condition; return what the client gets this round."""
        eos = set(self.backends.target_info.eos_token_ids)
        taken: list[int] = []
        finish = None
        for token in tokens:
            taken.append(token)
            if token in eos:
                finish = FinishReason.EOS
            elif len(self.generated) + len(taken) >= self.spec.max_new_tokens:
                finish = FinishReason.LENGTH
            elif len(self.sequence) + len(taken) >= self.max_length:
                finish = FinishReason.LENGTH
            if finish:
                break
        self.sequence.extend(taken)
        self.generated.extend(taken)
        delta = self._text.push(taken)
        if delta.stopped:
            return Chunk(taken, delta.text, FinishReason.STOP)
        text = delta.text + (self._text.flush() if finish else "")
        return Chunk(taken, text, finish)

    def _release(self) -> None:
        """Free the session on every service it was opened on; failures are logged, never raised."""
        request = common_pb2.ReleaseRequest(session_id=self.session_id)
        calls = [stub.Release.future(request, timeout=RELEASE_TIMEOUT_S) for stub in self._opened]
        for call in calls:
            try:
                call.result()
            except grpc.RpcError as error:
                log.warning("release of session %s failed: %s", self.session_id, error)
        self._opened.clear()
