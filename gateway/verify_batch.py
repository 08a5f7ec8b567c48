"""One call a pass: this gateway's Verifies to one verify replica, sent together when they are due together.

Why: a verify scores every session's round in one pass, but each stream sent its own unary Verify,
and on a 2-core CPU the calls cost what the model needs: 8 sessions driven straight at the verify
made 430 tokens/s in-process and 342 through a Verify each (2-vCPU Xeon). So a stream's Verify
waits here, briefly, for the other streams that can come in time (they verified on the replica
lately, and their call has answered or should by then), and the first to arrive (the collector)
sends whatever has gathered as one VerifyBatch. A stream alone, or a
replica that does not know VerifyBatch, calls Verify itself, as before: one stream's round pays
nothing. The wait is the verify's own batching rule seen from this side (BatchPolicy: at most
max_wait_ms and wait_fraction of a recent call), since the verify would wait that long for them
anyway. A part fails alone, with the status its own Verify would have had (PartError), so the
engine's failover reads it as it reads any call's error. docs/design/batching.md.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

import grpc

from gateway.policy import POLICY
from specd.v1 import verify_pb2
from specd_common import telemetry
from specd_common.config import BatchPolicy
from specd_common.tree import MAX_VERIFY_PARTS


class PartError(grpc.RpcError):
    """A VerifyBatch part's failure (or the whole call's), raised to that part's caller as its Verify would fail."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass
class _Part:
    request: verify_pb2.VerifyRequest
    deadline: float  # time.monotonic() by which its caller needs the reply
    reply: Future = field(default_factory=Future)
    taken: bool = False  # a collector has it in its batch
    parts: int = 1  # ... of that many parts


class VerifyCoalescer:
    """The Verifies of this gateway's streams on one replica, sent as one VerifyBatch when several are
    due. `open_sessions()` says how many sessions this gateway has open there."""

    def __init__(self, stub, open_sessions: Callable[[], int], policy: BatchPolicy = BatchPolicy()):
        self.stub, self.open_sessions, self.policy = stub, open_sessions, policy
        self.supported = True  # False once the replica answered UNIMPLEMENTED (an older verify)
        self._last_verify: dict[str, float] = {}  # session id → time.monotonic() of its last Verify here
        self._in_flight: dict[str, float] = {}  # session id → time.monotonic() its call went out
        self._queue: list[_Part] = []
        self._collecting = False
        self._call_s: Optional[float] = None  # moving average of a call's seconds (Verify or VerifyBatch)
        self._condition = threading.Condition()

    def verify(self, request: verify_pb2.VerifyRequest, timeout: float) -> verify_pb2.VerifyResponse:
        """The reply to `request` within `timeout` seconds, alone or in a VerifyBatch; raises grpc.RpcError."""
        started = time.monotonic()
        with self._condition:
            self._last_verify[request.session_id] = started
            alone = not self.supported or self._expected() <= 1
            if alone:
                self._in_flight[request.session_id] = started
        if alone:
            part = _Part(request, started + timeout)
            self._send([part])
            return part.reply.result()
        with telemetry.span("specd.verify.coalesced") as span:
            reply = self._coalesced(_Part(request, started + timeout))
            if span.is_recording():
                span.set_attribute("specd.verify.parts", reply[1])
        telemetry.add_rpc_seconds("Verify", time.monotonic() - started)  # the round's verify wait, whoever sent it
        return reply[0]

    def _coalesced(self, part: _Part) -> tuple[verify_pb2.VerifyResponse, int]:
        """`part`'s reply and the parts of the call that carried it."""
        with self._condition:
            self._queue.append(part)
            self._condition.notify_all()
            while self._collecting and not part.taken:
                self._condition.wait()
            batch = None
            if not part.taken:  # no collector took it: this caller collects
                self._collecting = True
                batch = self._gather(part)
                self._collecting = False
                self._condition.notify_all()  # parts left behind: one of their callers collects next
        if batch is not None:
            self._send(batch)
        try:
            return part.reply.result(timeout=max(part.deadline - time.monotonic(), 0.0)), part.parts
        except TimeoutError:
            raise PartError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline of this Verify passed before its VerifyBatch answered") from None

    def _gather(self, own: _Part) -> list[_Part]:
        """Under the lock: wait for the streams expected, within the window; take `own` and up to a
        batch's worth of the others."""
        window = self.policy.max_wait_ms / 1000
        if self._call_s is not None:
            window = min(window, self.policy.wait_fraction * self._call_s)
        until = time.monotonic() + window
        while len(self._queue) < min(self._expected(until), MAX_VERIFY_PARTS):
            remaining = until - time.monotonic()
            if remaining <= 0:
                break
            self._condition.wait(remaining)
        others = [part for part in self._queue if part is not own]
        batch, self._queue = [own] + others[: MAX_VERIFY_PARTS - 1], others[MAX_VERIFY_PARTS - 1 :]
        now = time.monotonic()
        for part in batch:
            part.taken, part.parts = True, len(batch)
            self._in_flight[part.request.session_id] = now
        return batch

    def _expected(self, until: Optional[float] = None) -> int:
        """Under the lock: the streams worth waiting for until `until` (now when None): those that
        verified here within two calls' time (or twice the longest wait) whose call has answered, or
        whose call in flight should answer by then (sent a call's time before it), at most the
        sessions this gateway has open there. A stream that prefills, waits for a draft or rides a
        call that went out just now (two groups a pass apart) cannot come within the window: waiting
        for it held every round of both groups a quarter of a call (8 streams: 3.5 s became 6.2 s)."""
        now = time.monotonic()
        horizon = 2 * max(self._call_s or 0.0, self.policy.max_wait_ms / 1000)
        for session_id in [key for key, at in self._last_verify.items() if now - at > horizon]:
            del self._last_verify[session_id]
        due = (until or now) - (self._call_s or 0.0)  # a call sent before this answers by `until`
        coming = [key for key in self._last_verify if self._in_flight.get(key, -1.0) <= due]
        return min(self.open_sessions(), len(coming))

    def _landed(self, session_ids: list[str]) -> None:
        """These sessions' call has answered (or failed): they may be waited for again."""
        with self._condition:
            for session_id in session_ids:
                self._in_flight.pop(session_id, None)

    def _observe(self, seconds: float) -> None:
        """A call's seconds, into the moving average that bounds the wait."""
        self._call_s = seconds if self._call_s is None else self._call_s + POLICY.cost_smoothing * (seconds - self._call_s)

    def _send(self, batch: list[_Part]) -> None:
        """One Verify or VerifyBatch for the batch; every part's future gets its reply or its error,
        after its session is off the in-flight set (its caller's next Verify may follow at once)."""
        try:
            outcomes = self._call(batch)
        except Exception as error:  # never leave a caller waiting (a closed channel raises ValueError)
            outcomes = [error] * len(batch)
        self._landed([part.request.session_id for part in batch])
        for part, outcome in zip(batch, outcomes):
            if isinstance(outcome, BaseException):
                part.reply.set_exception(outcome)
            else:
                part.reply.set_result(outcome)

    def _call(self, batch: list[_Part]) -> list:
        """Each part's VerifyResponse or the grpc.RpcError its caller gets."""
        if len(batch) == 1:
            return [self._unary(batch[0])]
        started = time.monotonic()
        try:
            results = self.stub.VerifyBatch(verify_pb2.VerifyBatchRequest(parts=[p.request for p in batch]),
                                            timeout=self._timeout(batch)).results
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                return [self._unary(part) for part in batch]
            return [PartError(error.code(), error.details() or str(error)) for _ in batch]
        self._observe(time.monotonic() - started)
        return [PartError(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.message) if result.code else result.response
                for result in results]

    def _unary(self, part: _Part):
        """The part's own Verify: its reply or its error."""
        started = time.monotonic()
        try:
            reply = self.stub.Verify(part.request, timeout=self._timeout([part]))
        except grpc.RpcError as error:
            return error
        self._observe(time.monotonic() - started)
        return reply

    @staticmethod
    def _timeout(batch: list[_Part]) -> float:
        """The call's timeout: the latest deadline of its parts, so one caller's short deadline never
        fails the others' rounds (a part past its own deadline fails alone: _coalesced)."""
        return max(max(part.deadline for part in batch) - time.monotonic(), 0.001)


_made = threading.Lock()


def coalescer_of(replica) -> VerifyCoalescer:
    """The replica's VerifyCoalescer (gateway/pool.Replica.calls), made on first use; it expects the
    streams this gateway has open there."""
    with _made:
        if replica.calls is None:
            replica.calls = VerifyCoalescer(replica.stub, lambda: replica.sessions)
        return replica.calls
