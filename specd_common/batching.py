"""Batch scheduling: concurrent sessions' forward passes gathered into one batched pass.

The model services are sync gRPC servers with a thread pool, so the rounds of concurrent sessions
arrive on different threads at nearly the same time. Running them one after another leaves the
device doing small matrix products; one padded pass over all of them costs little more than one.
Callers keep calling `forward(session, extra)` and block; a single worker thread takes what is
queued and runs `CausalLM.forward_batch`.

How long to wait (the scheduler): a batch opens when the worker is free and a request is queued,
and closes at the first of
  * `max_batch_size` sessions queued;
  * every session expected queued: those in either of the last two batches, plus any new arrival
    (nobody else is coming, so waiting would only add latency; a session busy elsewhere, e.g. in the
    draft service while its verify is pending, drops out of the expected set after two batches);
  * the window: `max_wait_ms`, but at most a quarter of a recent pass (waiting longer than that
    for a straggler costs more than the separate pass it saves).
The window starts when the worker is free, not when the oldest request arrived: otherwise sessions
that fell out of step (one group queued while the other ran) would alternate forever, each group
alone; waiting a few ms for the group on its way back through the gateway merges them.
With one active session nothing waits; `max_batch_size` 1 bypasses the batcher entirely.

A service may also `finish` a batch: turn every caller's logits into its reply in one call on the
worker's side (the verify's Medusa heads propose for all the batch's rows in one product per head,
instead of one product per session). Callers then get what `finish` returns instead of logits; a
reply that is an exception is raised to its caller alone.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from specd_common.config import BatchPolicy  # with the flags that set it: the CLI must not import torch
from specd_common.lm import CausalLM, KVSession
from specd_common.telemetry import model_forward

PASS_TIME_SMOOTHING = 0.2  # weight of the newest pass in the moving average of pass times


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
    tag: Any = None  # the caller's, handed to `finish` with its logits
    future: Future = field(default_factory=Future)


# finish(tags, logits) → one reply per caller: tags [b] as the callers passed them, logits [b] of [len(extra) + 1, V];
# a reply that is an Exception is raised to that caller alone (the others get theirs)
Finish = Callable[[list[Any], list[torch.Tensor]], list[Any]]


class ForwardBatcher:
    """`CausalLM.forward` with the same signature, batched across the threads that call it concurrently
    (with `finish`, callers get its replies instead of logits: the module docstring)."""

    def __init__(self, lm: CausalLM, policy: BatchPolicy, clock: Callable[[], float] = time.monotonic,
                 finish: Optional[Finish] = None):
        self.lm = lm
        self.policy = policy
        self.finish = finish
        self.stats = BatchStats()
        self._clock = clock
        self._queue: collections.deque[_Request] = collections.deque()
        self._recent: collections.deque[frozenset[int]] = collections.deque(maxlen=2)  # session ids of the last batches
        self._pass_seconds: float | None = None  # moving average; None before the first pass
        self._condition = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="specd-forward-batcher", daemon=True)
        self._worker.start()

    def forward(self, session: KVSession, extra: Sequence[int] = (), tag: Any = None) -> Any:
        """Queue one session's pass and wait for its logits [len(extra) + 1, V] (with `finish`, its reply
        for `tag`)."""
        self.lm.check_room(session, extra)  # fail the caller alone, before it can spoil a batch
        request = _Request(session, list(extra), tag)
        with self._condition:
            if self._closed:
                raise RuntimeError("the forward batcher is closed")
            self._queue.append(request)
            self._condition.notify()
        # The pass runs on the worker thread, outside this RPC's trace context: the span (and the
        # forward-time histogram) are recorded here, from the caller's side, queueing included.
        with model_forward(len(extra) + 1):  # positions scored for this caller
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
            deadline = self._clock() + self.window_s()
            while self._queued_sessions() < self._batch_target() and not self._closed:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    break
                self._condition.wait(remaining)
            return self._take(self.policy.max_batch_size)

    def window_s(self) -> float:
        """How long an open batch may wait for expected sessions."""
        window = self.policy.max_wait_ms / 1000
        if self._pass_seconds is not None:
            window = min(window, self.policy.wait_fraction * self._pass_seconds)
        return window

    def _queued_sessions(self) -> int:
        return len({id(request.session) for request in self._queue})

    def _batch_target(self) -> int:
        """How many sessions are worth waiting for: those of the last two batches and those queued, at most a full batch."""
        expected = {id(request.session) for request in self._queue}.union(*self._recent)
        return min(self.policy.max_batch_size, len(expected))

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
        started = self._clock()
        try:
            results = self.lm.forward_batch([(request.session, request.extra) for request in batch])
            if self.finish is not None:
                results = self.finish([request.tag for request in batch], results)
        except Exception as error:  # the callers' threads re-raise it (grpc_errors maps it to a status)
            for request in batch:
                request.future.set_exception(error)
            return
        elapsed = self._clock() - started
        self._pass_seconds = elapsed if self._pass_seconds is None else (
            PASS_TIME_SMOOTHING * elapsed + (1 - PASS_TIME_SMOOTHING) * self._pass_seconds
        )
        self._recent.append(frozenset(id(request.session) for request in batch))
        self.stats.batches += 1
        self.stats.requests += len(batch)
        self.stats.sizes[len(batch)] += 1
        for request, result in zip(batch, results):
            if isinstance(result, Exception):  # finish failed this caller alone
                request.future.set_exception(result)
            else:
                request.future.set_result(result)

    def _fail_queued(self) -> None:
        while self._queue:
            self._queue.popleft().future.set_exception(RuntimeError("the forward batcher is closed"))


def make_batcher(lm: CausalLM, policy: BatchPolicy, finish: Optional[Finish] = None) -> ForwardBatcher | None:
    """A batcher for `lm` when the policy batches; None means call `lm.forward` directly (today's path)."""
    return ForwardBatcher(lm, policy, finish=finish) if policy.enabled else None
