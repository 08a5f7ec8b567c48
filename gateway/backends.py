"""The model services as the gateway sees them: replica pools, what they reported, the tokenizer.

A request pins one draft and one verify replica (its KV caches live there). Replicas are picked
round-robin; a verify replica that fails mid-request is swapped for another by replaying the
sequence on it (gateway.engine), a failed draft only costs speed.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Generic, Optional, Sequence, TypeVar

import grpc

from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.adaptive import StepCosts
from gateway.tokenizer import GatewayTokenizer
from specd.v1 import common_pb2, draft_pb2_grpc, verify_pb2_grpc
from specd_common.errors import FailedPrecondition, Unavailable

log = logging.getLogger(__name__)

Stub = TypeVar("Stub")


@dataclass
class Pool(Generic[Stub]):
    """Replicas of one service, addressed by index."""

    addresses: list[str]
    stubs: list[Stub]
    health: list = field(default_factory=list)  # grpc.health.v1 stubs, one per replica (empty: not probed)
    failed: set = field(default_factory=set)  # replicas that failed a call and have not answered a health check since
    _turn: itertools.count = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __len__(self) -> int:
        return len(self.stubs)

    def pick(self, exclude: Sequence[int] = ()) -> Optional[int]:
        """The next replica in round-robin order that is not excluded; None when none is left."""
        with self._lock:
            start = next(self._turn)
        for offset in range(len(self.stubs)):
            index = (start + offset) % len(self.stubs)
            if index not in exclude:
                return index
        return None

    def usable(self, index: int, probe_timeout_s: float) -> bool:
        """May replica `index` be called? Yes unless it failed a call before (mark_failed) and does not
        now answer its health check as SERVING within probe_timeout_s: a frozen or overloaded process
        is then skipped at the cost of a short probe, not of another full call timeout."""
        if index not in self.failed or index >= len(self.health):
            return True
        try:
            serving = self.health[index].Check(health_pb2.HealthCheckRequest(), timeout=probe_timeout_s).status
        except grpc.RpcError:
            return False
        if serving != health_pb2.HealthCheckResponse.SERVING:
            return False
        self.failed.discard(index)
        return True

    def mark_failed(self, index: int) -> None:
        self.failed.add(index)


@dataclass
class Backends:
    """Verify replicas (at least one), draft replicas (maybe none), the target's info and tokenizer."""

    verify: Pool[verify_pb2_grpc.VerifyServiceStub]
    draft: Pool[draft_pb2_grpc.DraftServiceStub]
    target_info: common_pb2.GetModelInfoResponse
    draft_info: Optional[common_pb2.GetModelInfoResponse]
    tokenizer: GatewayTokenizer
    costs: StepCosts = field(default_factory=StepCosts)  # measured step times, for adaptive draft length

    @classmethod
    def connect(
        cls,
        verify_channels: dict[str, grpc.Channel],
        draft_channels: dict[str, grpc.Channel],
        timeout_s: float,
    ) -> "Backends":
        """Ask every replica who it is (waiting up to timeout_s); refuse mismatched vocabularies."""
        verify = Pool(
            list(verify_channels),
            [verify_pb2_grpc.VerifyServiceStub(c) for c in verify_channels.values()],
            [health_pb2_grpc.HealthStub(c) for c in verify_channels.values()],
        )
        draft = Pool(
            list(draft_channels),
            [draft_pb2_grpc.DraftServiceStub(c) for c in draft_channels.values()],
            [health_pb2_grpc.HealthStub(c) for c in draft_channels.values()],
        )
        if not len(verify):
            raise FailedPrecondition("the gateway needs at least one verify service address")
        target_infos = _model_infos(verify, timeout_s)
        if not target_infos:
            raise Unavailable(f"no verify replica answered within {timeout_s} s: {', '.join(verify.addresses)}")
        target_info = target_infos[0]
        for other in target_infos[1:]:
            check_same_vocabulary(target_info, other, "verify replica")
        draft_infos = _model_infos(draft, timeout_s) if len(draft) else []
        for info in draft_infos:
            check_same_vocabulary(target_info, info, "draft")
            check_features_available(target_info, info)
        if len(draft) and not draft_infos:
            log.warning("no draft replica answered; serving target-only until one does")
        return cls(verify, draft, target_info, draft_infos[0] if draft_infos else None, GatewayTokenizer(target_info))


def _model_infos(pool: Pool, timeout_s: float) -> list[common_pb2.GetModelInfoResponse]:
    """GetModelInfo from every replica at once; the ones that do not answer are logged and left out."""
    calls = [
        stub.GetModelInfo.future(common_pb2.GetModelInfoRequest(), timeout=timeout_s, wait_for_ready=True)
        for stub in pool.stubs
    ]
    infos = []
    for address, call in zip(pool.addresses, calls):
        try:
            infos.append(call.result())
        except grpc.RpcError as error:
            log.warning("replica %s did not answer GetModelInfo: %s", address, error.code())
    return infos


def check_features_available(target: common_pb2.GetModelInfoResponse, draft: common_pb2.GetModelInfoResponse) -> None:
    """A feature drafter needs a verify service that can return the target's features."""
    if draft.wants_target_features and not target.hidden_size:
        raise FailedPrecondition(
            f"draft {draft.model_name!r} reads the target's features but verify {target.model_name!r} does not "
            "report a hidden size (an older verify service?); upgrade the verify service or use another drafter"
        )


def check_same_vocabulary(
    target: common_pb2.GetModelInfoResponse, other: common_pb2.GetModelInfoResponse, role: str = "draft"
) -> None:
    """A model drafter must speak the target's token ids; a model-free drafter (no vocabulary) always does."""
    if other.vocab_digest and other.vocab_digest != target.vocab_digest:
        raise FailedPrecondition(
            f"{role} {other.model_name!r} and target {target.model_name!r} have different vocabularies "
            f"(digests {other.vocab_digest[:12]} vs {target.vocab_digest[:12]}); pick a {role} that shares "
            "the target's tokenizer"
        )
