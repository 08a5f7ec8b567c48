"""A request's sessions on the model services: which replica holds each, how far it agrees with the
committed sequence, and the one place that opens and releases them.

KV sync: a service's cache agrees with the gateway's committed sequence up to `agreed` tokens. The
next request to it carries a Commit (keep that prefix, append the rest), so a round costs one RPC per
service and a retried RPC cannot corrupt a cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import grpc

from gateway.pool import Pool, Replica
from specd.v1 import common_pb2

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0  # a Release is tiny: a replica that cannot answer in 5 s is gone (its sessions expire there)


@dataclass
class ServiceSync:
    """How far a service's token sequence agrees with the gateway's committed one."""

    agreed: int  # the service's first `agreed` tokens equal the committed sequence's

    def commit(self, sequence: Sequence[int]) -> common_pb2.Commit:
        """Keep what agrees, append what the service has not seen (corrections, bonus, skipped rounds)."""
        return common_pb2.Commit(prefix_length=self.agreed, append_token_ids=sequence[self.agreed :])


@dataclass
class Link:
    """This request's session on one replica of a service."""

    session_id: str = ""
    replica: Optional[Replica] = None  # the pinned replica; None while closed
    features_sent: int = 0  # feature drafters: rows of target features the session has been sent
    sync: ServiceSync = field(default_factory=lambda: ServiceSync(agreed=0))
    failed: list[Replica] = field(default_factory=list)  # replicas that failed during this request

    @property
    def open(self) -> bool:
        return self.replica is not None


class SessionSet:
    """Every session one request opened, on any replica of any service, so that all are released on
    every exit path (finish, cancel, deadline, fault)."""

    def __init__(self, request_id: str, sampling: common_pb2.SamplingParams):
        self.request_id = request_id
        self.sampling = sampling
        self._opened: list[tuple[Pool, Replica, str]] = []

    def open(self, link: Link, pool: Pool, replica: Replica, request_type: type, sequence: list[int],
             timeout_s: float, **extra: Any) -> Any:
        """Prefill a new session holding `sequence` on `replica` (reserved by pool.pick) and pin it to
        `link`; returns the reply. The reservation ends in release_all."""
        session_id = f"{self.request_id}-{len(self._opened) + 1}"
        self._opened.append((pool, replica, session_id))
        reply = replica.stub.Prefill(
            request_type(session_id=session_id, prompt_token_ids=sequence, sampling=self.sampling, **extra), timeout=timeout_s
        )
        link.session_id, link.replica, link.sync = session_id, replica, ServiceSync(agreed=len(sequence))
        link.features_sent = len(sequence) - 1
        return reply

    def release_all(self) -> None:
        """Free every session opened; failures are logged, never raised."""
        calls = [
            replica.stub.Release.future(common_pb2.ReleaseRequest(session_id=session_id), timeout=RELEASE_TIMEOUT_S)
            for _, replica, session_id in self._opened
        ]
        for (pool, replica, _), call in zip(self._opened, calls):
            try:
                call.result()
            except grpc.RpcError as error:
                log.info("release failed (the replica may be gone): %s", error.code())
            pool.release(replica)
        self._opened.clear()
