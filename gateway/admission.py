"""Admission control: a bounded number of requests run, a bounded number wait; the rest are refused.

Refusing fast with RESOURCE_EXHAUSTED keeps memory flat and latency honest under overload, and lets
a load balancer or the client retry elsewhere, instead of queueing without bound.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

from specd_common.errors import ResourceExhausted


class Admission:
    """At most max_active requests run at once and at most max_waiting wait for a slot."""

    def __init__(self, max_active: int, max_waiting: int, max_wait_s: float = 30.0):
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self._slots = threading.BoundedSemaphore(max_active)
        self._lock = threading.Lock()
        self.active = 0
        self.waiting = 0

    @contextlib.contextmanager
    def slot(self, deadline_s: Optional[float] = None) -> Iterator[None]:
        """Hold a slot for one request; RESOURCE_EXHAUSTED if the queue is full or the wait runs out."""
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
        try:
            yield
        finally:
            with self._lock:
                self.active -= 1
            self._slots.release()
