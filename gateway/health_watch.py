"""The gateway's health follows its verify replicas: NOT_SERVING while none of them answers SERVING.

Without a target the gateway can answer nothing, so a load balancer or Kubernetes readiness probe
should send clients elsewhere (or make them wait) instead of letting every request fail UNAVAILABLE.
Drafts are not watched: without one, requests are still served exactly (target-only rounds).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 1.0


class VerifyWatch:
    """A daemon thread asking each verify replica's grpc.health.v1 every period_s and reporting
    whether any serves through set_serving (called only on a change, and never once stopping)."""

    def __init__(self, health_stubs: Sequence, addresses: Sequence[str], set_serving: Callable[[bool], None],
                 period_s: float = WATCH_PERIOD_S):
        self._stubs, self._addresses = list(health_stubs), list(addresses)
        self._set_serving = set_serving
        self._period_s = period_s
        self.serving = True  # the gateway starts SERVING once a verify replica has answered
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specd-verify-watch", daemon=True)

    def start(self) -> "VerifyWatch":
        self._thread.start()
        return self

    def any_serving(self) -> bool:
        return any(self._serves(stub) for stub in self._stubs)

    def _serves(self, stub) -> bool:
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=self._period_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _run(self) -> None:
        while not self._stopping.wait(self._period_s):
            serving = self.any_serving()
            with self._lock:
                if self._stopping.is_set() or serving == self.serving:
                    continue
                self.serving = serving
                self._set_serving(serving)
            if serving:
                log.info("a verify replica serves again: the gateway reports SERVING")
            else:
                log.warning("no verify replica serves (%s): the gateway reports NOT_SERVING", ", ".join(self._addresses))

    def begin_stop(self) -> None:
        """No more health changes: the server's own shutdown decides from here."""
        with self._lock:
            self._stopping.set()

    def stop(self, grace_s: float = 0.0) -> None:
        self.begin_stop()
        self._thread.join(self._period_s * 2 + 1)
