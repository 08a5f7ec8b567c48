"""Batch scheduling: concurrent sessions' forward passes gathered into one batched pass.

The model services are sync gRPC servers with a thread pool, so the rounds of concurrent sessions
arrive on different threads at nearly the same time. Running them one after another leaves the
device doing small matrix products; one padded pass over all of them costs little more than one.
Callers keep calling `forward(session, extra)` and block; a single worker thread takes what is
queued and runs `CausalLM.forward_batch`.

How long to wait (the scheduler): a batch opens when the worker is free and a request is queued,
and closes at the first of
  * `max_batch_size` requests queued,
  * as many requests queued as sessions recently active (nobody else is coming: waiting only adds latency),
  * `max_wait_ms` after it opened.
The window starts when the worker is free, not when the oldest request arrived: otherwise sessions
that fell out of step (one group queued while the other ran) would alternate forever, each group
alone; waiting a few ms for the group that is on its way back through the gateway merges them.
With one active session nothing waits; `max_batch_size` 1 bypasses the batcher entirely.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specd_common.lm import CausalLM, KVSession

ACTIVITY_HORIZON_S = 1.0  # a session that submitted within this long is expected back for the next batch


@dataclass(frozen=True)
class BatchPolicy:
    """How a model service batches: at most `max_batch_size` sessions a pass, waiting at most `max_wait_ms`."""

    max_batch_size: int = 8
    max_wait_ms: float = 5.0

    @property
    def enabled(self) -> bool:
        return self.max_batch_size > 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BatchPolicy":
        if args.max_batch_size < 1 or args.batch_wait_ms < 0:
            raise ValueError("--max-batch-size must be >= 1 and --batch-wait-ms >= 0")
        return cls(max_batch_size=args.max_batch_size, max_wait_ms=args.batch_wait_ms)


@dataclass
class BatchStats:
    """What the batcher did: how many passes, and how many requests each carried."""

    batches: int = 0
    requests: int = 0
    sizes: collections.Counter = field(default_factory=collections.Counter)  # batch size → passes

    @property
    def mean_batch_size(self) -> float:
        return self.requests / self.batches if self.batches else 0.0


@dataclass
class _Request:
    session: KVSession
    extra: list[int]
    arrived: float
    future: Future = field(default_factory=Future)


class ForwardBatcher:
    """`CausalLM.forward` with the same signature, batched across the threads that call it concurrently."""

    def __init__(
        self,
        lm: CausalLM,
        policy: BatchPolicy,
        clock: Callable[[], float] = time.monotonic,
        activity_horizon_s: float = ACTIVITY_HORIZON_S,
    ):
        self.lm = lm
        self.policy = policy
        self.activity_horizon_s = activity_horizon_s
        self.stats = BatchStats()
        self._clock = clock
        self._queue: collections.deque[_Request] = collections.deque()
        self._last_seen: dict[int, float] = {}  # id(session) → last submission time
        self._condition = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="specd-forward-batcher", daemon=True)
        self._worker.start()

    def forward(self, session: KVSession, extra: Sequence[int] = ()) -> torch.Tensor:
        """Queue one session's pass and wait for its logits [len(extra) + 1, V]."""
        self.lm.check_room(session, extra)  # fail the caller alone, before it can spoil a batch
        request = _Request(session, list(extra), self._clock())
        with self._condition:
            if self._closed:
                raise RuntimeError("the forward batcher is closed")
            self._queue.append(request)
            self._last_seen[id(session)] = request.arrived
            self._condition.notify()
        return request.future.result()

    def close(self) -> None:
        """Stop the worker; requests still queued fail."""
        with self._condition:
            self._closed = True
            self._condition.notify()
        self._worker.join()

    def _serve(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                return
            self._run(batch)

    def _collect(self) -> list[_Request] | None:
        """Block for the next batch (see the module docstring for when it closes); None once closed."""
        with self._condition:
            while not self._queue and not self._closed:
                self._condition.wait()
            if self._closed:
                self._fail_queued()
                return None
            deadline = self._clock() + self.policy.max_wait_ms / 1000
            while len(self._queue) < self._batch_target() and not self._closed:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    break
                self._condition.wait(remaining)
            return self._take(self.policy.max_batch_size)

    def _batch_target(self) -> int:
        """How many requests are worth waiting for: the sessions seen lately, at most a full batch."""
        horizon = self._clock() - self.activity_horizon_s
        for key in [key for key, seen in self._last_seen.items() if seen < horizon]:
            del self._last_seen[key]
        return max(1, min(self.policy.max_batch_size, len(self._last_seen)))

    def _take(self, limit: int) -> list[_Request]:
        """Up to `limit` queued requests in arrival order, one per session (a repeat waits for the next batch)."""
        batch: list[_Request] = []
        sessions: set[int] = set()
        kept: collections.deque[_Request] = collections.deque()
        while self._queue and len(batch) < limit:
            request = self._queue.popleft()
            if id(request.session) in sessions:
                kept.append(request)
                continue
            sessions.add(id(request.session))
            batch.append(request)
        self._queue.extendleft(reversed(kept))
        return batch

    def _run(self, batch: list[_Request]) -> None:
        """One batched forward; each caller gets its logits or the error."""
        try:
            results = self.lm.forward_batch([(request.session, request.extra) for request in batch])
        except Exception as error:  # the callers' threads re-raise it (grpc_errors maps it to a status)
            for request in batch:
                request.future.set_exception(error)
            return
        self.stats.batches += 1
        self.stats.requests += len(batch)
        self.stats.sizes[len(batch)] += 1
        for request, logits in zip(batch, results):
            request.future.set_result(logits)

    def _fail_queued(self) -> None:
        while self._queue:
            self._queue.popleft().future.set_exception(RuntimeError("the forward batcher is closed"))


def make_batcher(lm: CausalLM, policy: BatchPolicy) -> ForwardBatcher | None:
    """A batcher for `lm` when the policy batches; None means call `lm.forward` directly (today's path)."""
    return ForwardBatcher(lm, policy) if policy.enabled else None
