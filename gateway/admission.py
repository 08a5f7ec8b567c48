"""Admission control: serve what can be served in time, refuse the rest at once.

A request that cannot get its answer before its deadline costs the server work for nobody (its
prefill alone can take seconds) and delays every request behind it, so under overload a queue
that admits everyone answers no one. Here a request is admitted only when the gateway's estimate
of its service time fits (`ServiceEstimate`):

    time to first token ≈ (its prompt + the prompts pending ahead of it) × seconds a prompt token
    time to finish      ≈ time to first token + max_new_tokens × seconds a generated token

"Ahead" follows the verify's prefill order (specd_engine/batching.py), roughly: of each pending
prompt, as many tokens as this one holds (shorter ones go first, the oldest gets half of a pass).
While other requests run, a request is refused with RESOURCE_EXHAUSTED (HTTP 429) and a Retry-After
when its time to finish passes DEADLINE_HEADROOM of its deadline or, without a deadline, when its
first token is further than `max_queue_s` away. The rates are measured on this gateway's own
requests (prefill: busy time, with any prompt pending, per prompt token prefilled, which counts the
passes' sharing; decoding: seconds between a stream's tokens); until then they are what the verify
measured at start-up. At most `max_active` requests run and `max_waiting` wait for a slot; the KV
budget is the verify's, which refuses a Prefill it cannot hold at once.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from gateway.options import MAX_QUEUE_S
from specd.v1 import common_pb2
from specd_common.errors import ResourceExhausted

RATE_MEMORY = 0.8  # weight of the past in the measured rates (the newest observation gets the rest)
MAX_RETRY_AFTER_S = 120  # Retry-After never says more than this
# a request is admitted when its estimate fits this share of its deadline: requests admitted after it slow
# it down (their prompts and rows share its passes), so estimates made now run late by about that much
DEADLINE_HEADROOM = 0.8


@dataclass(eq=False)
class Ticket:
    """One admitted request, as the estimate sees it: its prompt until its first token, then its tokens."""

    prompt_tokens: int
    max_new_tokens: int
    estimate: Optional["ServiceEstimate"] = field(default=None, repr=False)
    last_token_at: Optional[float] = None  # None until its first token

    def emitted(self, tokens: int) -> None:
        """The request produced `tokens` more tokens (a round's chunk)."""
        if self.estimate is not None:
            self.estimate.on_token(self, tokens)


class ServiceEstimate:
    """What the verify serves, learned from this gateway's requests: seconds a prompt token costs
    (prompt tokens prefilled per second while any prompt was pending: with several pending, the
    passes share them, so this is the throughput a new prompt will see), and seconds between a
    stream's tokens at the load of the moment. Priors: the verify's start-up batch costs."""

    def __init__(self, prefill_s_per_token: float = 0.0, decode_s_per_token: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.prefill_s_per_token = prefill_s_per_token  # 0: unknown, nothing refused on it
        self.decode_s_per_token = decode_s_per_token
        self._clock = clock
        self._pending: set[Ticket] = set()  # admitted, no token yet
        self._busy_since: Optional[float] = None  # since the last prefill finished, with a prompt pending all along
        self._busy_sum = self._tokens_sum = 0.0  # busy seconds and prompt tokens of recent prefills, fading
        self._lock = threading.Lock()

    def pending_ahead(self, prompt_tokens: int) -> int:
        """Prompt tokens the verify prefills before a prompt of `prompt_tokens` arriving now is done: of each
        pending prompt, at most as many as this one holds (specd_engine/batching.py's prefill_shares:
        shorter prompts go first, the oldest gets half of every pass; a fair share, roughly)."""
        with self._lock:
            return sum(min(t.prompt_tokens, prompt_tokens) for t in self._pending)

    def predict(self, prompt_tokens: int, max_new_tokens: int) -> tuple[float, float]:
        """(seconds to the first token, seconds to the last) for a request arriving now."""
        first = (self.pending_ahead(prompt_tokens) + prompt_tokens) * self.seconds_per_prompt_token()
        return first, first + max_new_tokens * self.decode_s_per_token

    def seconds_per_prompt_token(self) -> float:
        """The measured rate, or more when the prompts pending now say it is higher: none of them has
        finished in the busy time since the last one did, so fewer tokens than they hold were prefilled
        in it (a lower bound that corrects a low prior within the first wave of long prompts)."""
        with self._lock:
            pending = sum(ticket.prompt_tokens for ticket in self._pending)
            busy = self._busy(self._clock())
        return max(self.prefill_s_per_token, busy / pending if pending else 0.0)

    def admit(self, ticket: Ticket) -> None:
        with self._lock:
            if not self._pending:
                self._busy_since = self._clock()
            self._pending.add(ticket)
        ticket.estimate = self

    def leave(self, ticket: Ticket) -> None:
        """The request ended (finished, refused upstream, cancelled): its prompt is no longer pending."""
        with self._lock:
            self._drop_pending(ticket, self._clock())

    def on_token(self, ticket: Ticket, tokens: int) -> None:
        """`ticket`'s request produced `tokens` more tokens (Ticket.emitted)."""
        now = self._clock()
        with self._lock:
            if ticket.last_token_at is None:  # its first: its prompt is prefilled
                # busy seconds per prompt token over the recent prefills (a ratio of sums: prompts that
                # finish together share one stretch of busy time)
                self._busy_sum = RATE_MEMORY * self._busy_sum + self._drop_pending(ticket, now)
                self._tokens_sum = RATE_MEMORY * self._tokens_sum + ticket.prompt_tokens
                if self._busy_sum > 0:
                    self.prefill_s_per_token = self._busy_sum / max(self._tokens_sum, 1)
            elif tokens > 0 and ticket.last_token_at is not None:
                self.decode_s_per_token = _blend(self.decode_s_per_token, (now - ticket.last_token_at) / tokens)
            ticket.last_token_at = now

    def _drop_pending(self, ticket: Ticket, now: float) -> float:
        """Remove a pending ticket (caller holds the lock); the busy seconds since the last prefill ended,
        which this prompt's prefill is charged with (the other pending prompts start a new stretch)."""
        if ticket not in self._pending:
            return 0.0
        self._pending.discard(ticket)
        busy = self._busy(now)
        self._busy_since = now if self._pending else None
        return busy

    def _busy(self, now: float) -> float:
        """Seconds since the last prefill finished, with a prompt pending all along (caller holds the lock)."""
        return now - self._busy_since if self._busy_since is not None else 0.0


def _blend(old: float, new: float) -> float:
    return new if old <= 0 else RATE_MEMORY * old + (1 - RATE_MEMORY) * new


class Admission:
    """At most max_active requests run and at most max_waiting wait for a slot; a request whose estimated
    time does not fit its deadline (or max_queue_s) is refused at once (the module docstring)."""

    def __init__(self, max_active: int, max_waiting: int, max_wait_s: float = 30.0,
                 estimate: Optional[ServiceEstimate] = None, max_queue_s: float = MAX_QUEUE_S):
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self.max_queue_s = max_queue_s
        self.estimate = estimate or ServiceEstimate()
        self._slots = threading.BoundedSemaphore(max_active)
        self._lock = threading.Lock()
        self.active = 0
        self.waiting = 0

    def check_in_time(self, prompt_tokens: int, max_new_tokens: int, deadline_s: Optional[float]) -> None:
        """RESOURCE_EXHAUSTED, with a Retry-After, when the load makes the request miss its time. An idle
        server admits anything: what cannot finish then is the request's own size, and it ends at its
        deadline with its partial answer (DEADLINE_EXCEEDED), not with "busy"."""
        if not self.active:
            return
        first, last = self.estimate.predict(prompt_tokens, max_new_tokens)
        if deadline_s is not None and last > deadline_s * DEADLINE_HEADROOM:
            over = last - deadline_s * DEADLINE_HEADROOM
            reason = (f"its answer would take about {last:.1f} s (first token in {first:.1f} s) but the deadline is "
                      f"{deadline_s:.1f} s")
        elif deadline_s is None and first > self.max_queue_s:
            over = first - self.max_queue_s
            reason = f"its first token would come in about {first:.0f} s, past the {self.max_queue_s:.0f} s queue limit"
        else:
            return
        retry_after = min(MAX_RETRY_AFTER_S, max(1, math.ceil(over)))
        error = ResourceExhausted(f"server busy: {reason} ({self.active} requests running); retry after {retry_after} s, "
                                  "with a longer deadline, a shorter prompt or fewer max_new_tokens")
        error.trailing_metadata = (("retry-after", str(retry_after)),)
        raise error

    @contextlib.contextmanager
    def slot(self, deadline_s: Optional[float] = None, prompt_tokens: int = 0, max_new_tokens: int = 0) -> Iterator[Ticket]:
        """Hold a slot for one request; RESOURCE_EXHAUSTED if it cannot be served in time, the queue is
        full or the wait runs out. Yields the request's Ticket: report its tokens with `emitted`."""
        self.check_in_time(prompt_tokens, max_new_tokens, deadline_s)
        with self._lock:
            if self.waiting >= self.max_waiting and self.active >= self.max_active:
                raise ResourceExhausted(
                    f"server busy: {self.active} requests running and {self.waiting} waiting; retry with backoff"
                )
            self.waiting += 1
        wait_s = self.max_wait_s if deadline_s is None else max(0.0, min(deadline_s, self.max_wait_s))
        acquired = self._slots.acquire(timeout=wait_s)
        with self._lock:
            self.waiting -= 1
            if acquired:
                self.active += 1
        if not acquired:
            raise ResourceExhausted(f"server busy: no slot freed within {wait_s:.1f} s; retry with backoff")
        ticket = Ticket(prompt_tokens, max_new_tokens)
        self.estimate.admit(ticket)
        try:
            yield ticket
        finally:
            self.estimate.leave(ticket)
            with self._lock:
                self.active -= 1
            self._slots.release()


def estimate_from_profile(profile: common_pb2.RuntimeProfile) -> ServiceEstimate:
    """Priors from what the verify measured at start-up: a prompt token costs its measured prefill cost;
    a generated token, a one-position round in the largest batch measured. Nothing measured: no priors
    (nothing is refused until this gateway's requests are measured)."""
    decode_ms = max((cost for cost in profile.batch_costs if cost.positions == 1), key=lambda cost: cost.rows, default=None)
    return ServiceEstimate(profile.prefill_ms_per_token / 1000, decode_ms.milliseconds / 1000 if decode_ms else 0.0)
