"""Batch scheduling: concurrent sessions' work gathered into one pass (continuous batching).

The model services are sync gRPC servers with a thread pool, so the rounds of concurrent sessions
arrive on different threads at nearly the same time. Running them one after another leaves the
device doing small matrix products; one pass over all of them streams the weights once. Callers
block in `forward(session, extra)` (a chain), `forward(..., parents=...)` (a draft tree) or
`prefill(session)` (a prompt); a single worker thread takes what is queued and runs
`CausalLM.run_feeds`: with the lean forward one ragged pass, attention in place in each cache.

Prompts are prefilled in chunks that share passes with the running rounds (chunked prefill): each
pass carries every queued round and as many prompt positions as the prompts' share of the pass's
time allows. Only streams that were already streaming when the oldest waiting prompt arrived are
protected: with D of them and Q prompts waiting for their first token, prefill gets Q / (D + Q) of
a pass (each request an equal share; at least MIN_PREFILL_SHARE), in seconds priced by the passes'
own measured cost (`PassCost`: the rounds' pass alone, plus what a prompt position adds beside
them), and a whole PREFILL_CHUNK when none is protected. A lone long prompt beside four decoding
streams then slows them by half as priced (1.4-1.6x their p95 measured) instead of stopping them.
Streams that started after a waiting prompt arrived (a burst's first answers, short prompts served
ahead of it) went ahead of it already and hold it back no further: a burst is prefilled at full
speed and its streams then decode together, sharing every pass's weights, instead of the first ones
decoding alone while the last prompts wait in small chunks, each pass paying the weights again (8
long prompts at once, in-process: 1.29-1.39x one-at-a-time's throughput with every stream
protected, 1.90x this way; docs/design/batching.md).

Among waiting prompts (`prefill_shares`) half of a pass's prompt positions go to the one waiting
longest, the rest shortest-remaining first: a four-word prompt that arrives behind ten long ones
gets its first token after its own few positions, not after theirs, and no long prompt is starved
by a stream of short ones (measured: shortest-first alone left long prompts without
a token for 60 s under overload; arrival order alone made short prompts wait 35 s; docs/design/
overload.md). A prompt whose caller gives up (deadline, cancel) leaves the queue between chunks
instead of being prefilled for nobody.

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
With one active session nothing waits, nor while a round queued again (Again, below) waits: its
session's next pass runs at once and those between rounds join the one after (waiting for them held
every such pass a quarter of one). `max_batch_size` 1 bypasses the batcher entirely.

A service may also `finish` a batch: turn every caller's logits into its reply in one call on the
worker's side (the verify's Medusa heads propose for all the batch's rows in one product per head,
instead of one product per session). Callers then get what `finish` returns instead of logits; a
reply that is an exception is raised to its caller alone. A reply that is `Again(token)` asks for
another pass: the token joins the caller's session and its round is queued again, ahead of new
arrivals, without going back to the caller (plain decoding steps in one call: the verify's
VerifyRequest.plain_steps). The caller's future answers with its last pass's reply.
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
from specd_common.errors import Cancelled
from specd_engine.lm import PREFILL_CHUNK, CausalLM
from specd_engine.sessions import Feed, KVSession
from specd_common.telemetry import model_forward

PASS_TIME_SMOOTHING = 0.2  # weight of the newest pass in the moving average of pass times
MIN_PREFILL_CHUNK = 4  # a waiting prompt advances at least this many positions a pass, however busy the rest
# waiting prompts get at least this share of a pass's time beside protected rounds, which then slow by
# 1 / (1 - share) = 1.5x as priced, the rest of 2x their p95 inter-token latency left for the passes' spread;
# no prompt is starved by the streams running before it
MIN_PREFILL_SHARE = 1 / 3


@dataclass
class BatchStats:
    """What the batcher did: how many passes, and how many requests each carried."""

    batches: int = 0
    requests: int = 0
    sizes: collections.Counter = field(default_factory=collections.Counter)  # batch size → passes

    @property
    def mean_batch_size(self) -> float:
        return self.requests / self.batches if self.batches else 0.0


@dataclass(eq=False)  # identity: a queue removes the very item
class _Request:
    session: KVSession
    extra: list[int]  # a chain's drafts, or a tree's nodes
    tag: Any = None  # the caller's, handed to `finish` with its logits
    parents: Optional[list[int]] = None  # a tree's (specd_common/tree.py); None for a chain
    future: Future = field(default_factory=Future)
    again: bool = False  # queued again by its finish (Again): its caller is still waiting, not on its way back


@dataclass(frozen=True)
class Again:
    """A `finish` reply that asks for another pass for its caller: `token` joins the session (the
    module docstring)."""

    token: int


@dataclass(eq=False)
class _Prefill:
    session: KVSession
    wanted: Callable[[], bool] = lambda: True  # False once the caller went away: the prefill stops
    arrived: float = 0.0  # the batcher's clock when it was queued
    future: Future = field(default_factory=Future)


class _Line:
    """seconds ≈ a + b × x, fitted by least squares over the observations, older ones forgotten at
    PASS_TIME_SMOOTHING an observation; while they were all one size, their mean."""

    def __init__(self) -> None:
        self._sums = [0.0] * 5  # weight, Σx, Σy, Σxx, Σxy (forgetting)

    def observe(self, x: float, seconds: float) -> None:
        keep = 1 - PASS_TIME_SMOOTHING
        terms = (1.0, x, seconds, x * x, x * seconds)
        self._sums = [keep * total + term for total, term in zip(self._sums, terms)]

    def fit(self) -> Optional[tuple[float, float]]:
        """(a, b), or None until observations of different sizes were seen (or the slope is not positive)."""
        w, x, y, xx, xy = self._sums
        spread = w * xx - x * x
        if w <= 0 or spread <= 1e-6 * max(w * xx, 1e-12):
            return None
        slope = (w * xy - x * y) / spread
        if slope <= 0:
            return None
        return max((y - slope * x) / w, 0.0), slope

    def at(self, x: float) -> Optional[float]:
        """The fitted seconds at x; the mean while no line fits; None before any observation."""
        w, _, y, _, _ = self._sums
        if w <= 0:
            return None
        fitted = self.fit()
        return y / w if fitted is None else fitted[0] + fitted[1] * x


class PassCost:
    """What a pass costs, learnt from the passes run (older ones forgotten at PASS_TIME_SMOOTHING a pass),
    in two parts priced apart because they scale differently:
      * `rounds_s(positions)`: a pass of the running rounds alone, a line over the passes that fed no
        prompt positions (the weights streamed once, plus their positions; speculation varies them);
      * `position_s`: what each prompt position adds beside the rounds, measured at the chunk sizes it
        is served in: the attention over the prompt's earlier positions is in it (late chunks of a long
        prompt cost more than early ones), and on a CPU a few rows beside the rounds cost more each than
        a big chunk alone (4 rounds 59 ms, with 8 prompt positions 96 ms: 4.6 ms a position; 2.8 in
        128-position chunks). A single line over every pass fitted neither: it priced 8 positions at a
        third of the rounds' pass and they cost two thirds."""

    def __init__(self) -> None:
        self._rounds = _Line()
        self.position_s: Optional[float] = None

    def rounds_s(self, positions: int) -> Optional[float]:
        """Seconds of a pass feeding the rounds' `positions` alone; None before any such pass."""
        return self._rounds.at(positions)

    def observe(self, seconds: float, decoding: int, prompt: int, priced: bool = True) -> None:
        """A pass fed `decoding` round positions and `prompt` prompt positions in `seconds`. Only passes whose
        prompt positions were priced beside rounds teach `position_s` (a whole chunk's are cheaper each)."""
        if not prompt:
            self._rounds.observe(decoding, seconds)
            return
        rounds = self.rounds_s(decoding)
        if not (priced and decoding and rounds is not None):
            return
        each = max(seconds - rounds, 0.0) / prompt
        self.position_s = each if self.position_s is None else (
            PASS_TIME_SMOOTHING * each + (1 - PASS_TIME_SMOOTHING) * self.position_s)


class PrefillBudget:
    """How many prompt positions the next pass may carry beside the running rounds' `decoding`
    positions: the prompts' share of the pass's time (the module docstring), priced by the measured
    PassCost."""

    def __init__(self) -> None:
        self.cost = PassCost()

    def positions(self, decoding: int, rounds: int, waiting: int, granule: int = 1) -> int:
        """decoding: positions the pass's rounds feed; rounds: how many of them are protected (the module
        docstring); waiting: prompts being prefilled; granule: the positions a pass's prompt rows cost in
        (CausalLM.prefill_granule): the budget is whole granules, at least one."""
        if not rounds:
            return PREFILL_CHUNK
        rounds_s, position_s = self.cost.rounds_s(decoding), self.cost.position_s
        if rounds_s is None or not position_s:
            budget = MIN_PREFILL_CHUNK  # unmeasured: a small chunk, whose pass measures the cost
        else:
            share = max(waiting / (rounds + waiting), MIN_PREFILL_SHARE)  # of the pass's time, for the prompts
            budget = int(min(max(share / (1 - share) * rounds_s / position_s, MIN_PREFILL_CHUNK), PREFILL_CHUNK))
        return max(budget // granule, 1) * granule

    def observe(self, seconds: float, decoding: int, prompt: int, priced: bool) -> None:
        """A pass that fed `decoding` round positions and `prompt` prompt positions (priced: beside protected
        streams) took `seconds`."""
        self.cost.observe(seconds, decoding, prompt, priced)


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
        self._prefills: collections.deque[_Prefill] = collections.deque()  # prompts being prefilled, in arrival order
        self.prefill_budget = PrefillBudget()
        self._recent: collections.deque[frozenset[int]] = collections.deque(maxlen=2)  # session ids of the last batches
        # when each stream with a round in the last pass began (KVSession.prefilled_at, by id: no session is
        # kept alive by it): streams that may be between rounds
        self._streaming: dict[int, float] = {}
        self._pass_seconds: float | None = None  # moving average; None before the first pass
        self._condition = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="specd-forward-batcher", daemon=True)
        self._worker.start()

    def forward(self, session: KVSession, extra: Sequence[int] = (), tag: Any = None,
                parents: Optional[Sequence[int]] = None) -> Any:
        """Queue one session's round and wait for its logits [len(extra) + 1, V] (with `finish`, its reply
        for `tag`): a chain of drafts `extra`, or with `parents` a tree of nodes `extra` (CausalLM.tree_feed)."""
        self.lm.check_room(session, extra if parents is None else ())  # fail the caller alone, before it can spoil a batch
        request = _Request(session, list(extra), tag, None if parents is None else list(parents))
        # The pass runs on the worker thread, outside this RPC's trace context: the span (and the
        # forward-time histogram) are recorded here, from the caller's side, queueing included.
        with model_forward(len(extra) + 1):  # positions scored for this caller
            return self._wait(self._queue, request)

    def prefill(self, session: KVSession, wanted: Callable[[], bool] = lambda: True) -> None:
        """Prefill a session made with CausalLM.new_session(prefill=False), in chunks that share the passes
        of the other sessions' rounds; returns when its prompt is cached (CausalLM.prefill_end). Cancelled
        (before its next chunk) once `wanted()` is False."""
        if self.lm.unprefilled(session):
            with model_forward(self.lm.unprefilled(session)):  # the caller's span, as `forward` records it
                self._wait(self._prefills, _Prefill(session, wanted, self._clock()))

    def forget(self, session: KVSession) -> None:
        """A session that ended (released or expired): it is no stream a prompt's chunks make room for,
        nor one a batch waits for. Without this the next request's prompt was cut into a small chunk
        beside the last request's finished stream, a whole extra pass before its first token."""
        with self._condition:
            self._streaming.pop(id(session), None)
            self._recent = collections.deque((ids - {id(session)} for ids in self._recent), maxlen=self._recent.maxlen)

    def _wait(self, queue: collections.deque, item: Any) -> Any:
        with self._condition:
            if self._closed:
                raise RuntimeError("the forward batcher is closed")
            queue.append(item)
            self._condition.notify()
        return item.future.result()

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
            while not self._queue and not self._prefills and not self._closed:
                self._condition.wait()
            if self._closed:
                self._fail_queued()
                return None
            # a round queued again runs at once: the sessions out between rounds join the pass after
            # (waiting for them held every further pass a quarter of one)
            deadline = self._clock() + (0.0 if any(request.again for request in self._queue) else self.window_s())
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
        """One pass: every taken round and the prompts' chunks; each caller gets its logits (or reply) or
        its error, and each prompt whose prefill completes returns."""
        started = self._clock()
        feeds, requests = [], []
        for request in batch:
            try:
                feeds.append(self.lm.chain_feed(request.session, request.extra) if request.parents is None
                             else self.lm.tree_feed(request.session, request.extra, request.parents))
                requests.append(request)
            except Exception as error:  # this round alone is refused (the context limit, a malformed tree)
                request.future.set_exception(error)
        decoding = sum(len(feed.tokens) for feed in feeds)  # the rounds' positions
        prefilling, priced = self._prefill_feeds(decoding, self._streams_since([feed.session for feed in feeds]))
        if not feeds and not prefilling:  # every prompt queued was given up: nothing to run
            return
        try:
            results = self.lm.run_feeds(feeds + [feed for feed, _ in prefilling])[: len(requests)]
            if self.finish is not None and requests:
                results = self.finish([request.tag for request in requests], results)
        except Exception as error:  # the callers' threads re-raise it (grpc_errors maps it to a status)
            for request in requests:
                request.future.set_exception(error)
            for _, prefill in prefilling:
                self._finish_prefill(prefill, error)
            return
        elapsed = self._clock() - started
        # a stream of the last pass is waited for by one pass of prompt positions alone, not more: one
        # whose round did not come back by then (it finished, or drafts elsewhere) protects nothing
        self._streaming = {id(request.session): request.session.prefilled_at for request in requests}
        self.prefill_budget.observe(elapsed, decoding, sum(len(feed.tokens) for feed, _ in prefilling), priced)
        if requests:
            self._pass_seconds = elapsed if self._pass_seconds is None else (
                PASS_TIME_SMOOTHING * elapsed + (1 - PASS_TIME_SMOOTHING) * self._pass_seconds
            )
            self._recent.append(frozenset(id(request.session) for request in requests))
            self.stats.batches += 1
            self.stats.requests += len(requests)
            self.stats.sizes[len(requests)] += 1
        again = []
        for request, result in zip(requests, results):
            if isinstance(result, Exception):  # finish failed this caller alone
                request.future.set_exception(result)
            elif isinstance(result, Again):
                again.append((request, result.token))
            else:
                request.future.set_result(result)
        self._queue_again(again)
        for _, prefill in prefilling:
            if not self.lm.unprefilled(prefill.session):
                prefill.session.prefilled_at = self._clock()
                self._finish_prefill(prefill)

    def _queue_again(self, again: list[tuple[_Request, int]]) -> None:
        """Rounds whose finish asked for another pass (Again): each session takes its token and its
        round waits at the head of the queue, where the next batch takes it first."""
        for request, token in again:
            request.session.apply_commit(len(request.session.tokens), [token])
            request.again = True
        if again:
            with self._condition:
                self._queue.extendleft(reversed([request for request, _ in again]))
                self._condition.notify()

    def _streams_since(self, sessions: list[KVSession]) -> list[float]:
        """When each stream a pass's prompt chunks must respect began: those with a round in it, and those
        of the last pass whose next round has not come back yet (a pass of prompt positions alone while
        they are in the gateway would otherwise be a whole chunk they then wait for: 1.26 s gaps seen)."""
        return list({**self._streaming, **{id(session): session.prefilled_at for session in sessions}}.values())

    def _finish_prefill(self, prefill: _Prefill, error: Optional[Exception] = None) -> None:
        with self._condition:
            self._prefills.remove(prefill)
        if error is None:
            prefill.future.set_result(None)
        else:
            prefill.future.set_exception(error)

    def _prefill_feeds(self, decoding: int, streaming_since: Sequence[float]) -> tuple[list[tuple[Feed, _Prefill]], bool]:
        """The prompts' chunks for this pass beside streams that began at `streaming_since` (their rounds
        feed `decoding` positions), within PrefillBudget's positions shared by prefill_shares, and whether
        that budget was priced (some stream is protected); prompts nobody waits for any more are dropped."""
        with self._condition:
            waiting = list(self._prefills)
        for prefill in [prefill for prefill in waiting if not prefill.wanted()]:
            self._finish_prefill(prefill, Cancelled("the caller went away before its prompt was prefilled"))
            waiting.remove(prefill)
        if not waiting:
            return [], False
        oldest = min(prefill.arrived for prefill in waiting)
        protected = sum(1 for since in streaming_since if since < oldest)  # streaming before it arrived
        budget = self.prefill_budget.positions(decoding, protected, len(waiting), self.lm.prefill_granule)
        shares = prefill_shares([self.lm.unprefilled(prefill.session) for prefill in waiting],
                                [prefill.arrived for prefill in waiting], budget)
        return [(self.lm.prefill_feed(prefill.session, positions), prefill)
                for prefill, positions in zip(waiting, shares) if positions], protected > 0

    def _fail_queued(self) -> None:
        for queue in (self._queue, self._prefills):
            while queue:
                queue.popleft().future.set_exception(RuntimeError("the forward batcher is closed"))


def prefill_shares(remaining: Sequence[int], arrived: Sequence[float], budget: int) -> list[int]:
    """Prompt positions for each waiting prompt this pass, `budget` in all: half of it for the prompt
    waiting longest (no prompt waits forever behind newer ones), the rest shortest-remaining first
    (a short prompt's first token is not held up by the long ones ahead of it). One prompt alone gets
    the whole budget."""
    shares = [0] * len(remaining)
    if not remaining or budget <= 0:
        return shares
    oldest = min(range(len(remaining)), key=lambda i: arrived[i])
    shares[oldest] = min(remaining[oldest], budget if len(remaining) == 1 else -(-budget // 2))
    left = budget - shares[oldest]
    for i in sorted(range(len(remaining)), key=lambda i: remaining[i]):
        extra = min(remaining[i] - shares[i], left)
        shares[i] += extra
        left -= extra
    return shares


def make_batcher(lm: CausalLM, policy: BatchPolicy, finish: Optional[Finish] = None) -> ForwardBatcher | None:
    """A batcher for `lm` when the policy batches; None means call `lm.forward` directly (today's path)."""
    return ForwardBatcher(lm, policy, finish=finish) if policy.enabled else None
