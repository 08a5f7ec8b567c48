"""A request's sessions on the model services: which replica holds each, how far it agrees with the
committed sequence, and the one place that opens and releases them.

KV sync: a service's cache agrees with the gateway's committed sequence up to `agreed` tokens. The
next request to it carries a Commit (keep that prefix, append the rest), so a round costs one RPC per
service and a retried RPC cannot corrupt a cache.

No session outlives its request (SessionKeeper): each is opened with a lease that this gateway
renews while the request runs, so a model service frees it within seconds of the gateway dying;
and a Release that fails (a busy or restarting service) is retried in the background until the
service answers, instead of leaving the cache to the lease or the idle expiry.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import grpc

from gateway.options import SESSION_LEASE_S
from gateway.pool import Pool, Replica
from specd.v1 import common_pb2

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0  # a Release is tiny: a replica that cannot answer in 5 s is busy or gone (retried in the background)
RENEWALS_PER_LEASE = 4  # a lease is renewed this often within its length: three renewals may be late or lost
FIRST_RETRY_S = 0.5  # a failed Release is retried after this, doubling each time ...
MAX_RETRY_S = 8.0  # ... up to this
GIVE_UP_AFTER_S = 60.0  # past this and two leases the service has freed the session itself (lease or idle expiry)


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


@dataclass(eq=False)
class _Retry:
    replica: Replica
    session_id: str
    due: float
    since: float  # when the first Release failed
    wait_s: float = FIRST_RETRY_S


class SessionKeeper:
    """This gateway's open sessions on every replica: renews their leases (one KeepAlive per replica every
    lease / RENEWALS_PER_LEASE) and retries failed Releases with back-off until the service answers
    (released, or not held there) or, at the latest, until the lease has run out twice over (and
    GIVE_UP_AFTER_S), when the service has freed the session by itself. One daemon thread, started with the first session."""

    def __init__(self, lease_s: float = SESSION_LEASE_S, clock: Callable[[], float] = time.monotonic):
        self.lease_s = lease_s
        self._clock = clock
        self._open: dict[Replica, set[str]] = {}
        self._retries: list[_Retry] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def opened(self, replica: Replica, session_id: str) -> None:
        with self._lock:
            self._open.setdefault(replica, set()).add(session_id)
            if self._thread is None and self.lease_s > 0:
                self._thread = threading.Thread(target=self._run, name="session-keeper", daemon=True)
                self._thread.start()

    def closed(self, replica: Replica, session_id: str, released: bool) -> None:
        """The request is done with the session; `released` False: its Release failed, retry it."""
        with self._lock:
            held = self._open.get(replica, set())
            held.discard(session_id)
            if not held:
                self._open.pop(replica, None)
            if not released:
                now = self._clock()
                self._retries.append(_Retry(replica, session_id, due=now + FIRST_RETRY_S, since=now))

    @property
    def pending_releases(self) -> int:
        with self._lock:
            return len(self._retries)

    def tick(self) -> None:
        """One round of renewals and of the Release retries that are due (the thread's loop body)."""
        with self._lock:
            renewals = [(replica, sorted(ids)) for replica, ids in self._open.items()]
            now = self._clock()
            due = [retry for retry in self._retries if retry.due <= now]
        timeout_s = max(0.1, self.lease_s / RENEWALS_PER_LEASE)
        calls = [(replica, _start(replica.stub.KeepAlive, common_pb2.KeepAliveRequest(session_ids=ids), timeout_s))
                 for replica, ids in renewals if ids]
        releases = [(retry, _release(retry.replica, retry.session_id)) for retry in due]
        for replica, call in calls:
            reply, failure = _outcome(call)
            if failure is not None:
                log.info("lease renewal on %s failed: %s", replica.address, failure)
            elif lost := self._still_open(replica, reply.unknown_session_ids):
                log.warning("%s no longer holds %d session(s) of running requests (expired?)", replica.address, len(lost))
        for retry, call in releases:
            self._settle(retry, _released(call))

    def _still_open(self, replica: Replica, session_ids: Sequence[str]) -> list[str]:
        """Of the sessions a renewal found unknown, those whose request still runs: one that ended while
        its renewal waited behind a busy service was released, not lost."""
        with self._lock:
            held = self._open.get(replica, set())
            return [session_id for session_id in session_ids if session_id in held]

    def _settle(self, retry: _Retry, done: bool) -> None:
        with self._lock:
            if done or self._clock() - retry.since > max(2 * self.lease_s, GIVE_UP_AFTER_S):
                self._retries.remove(retry)
            else:
                retry.wait_s = min(retry.wait_s * 2, MAX_RETRY_S)
                retry.due = self._clock() + retry.wait_s

    def _run(self) -> None:
        period = self.lease_s / RENEWALS_PER_LEASE
        while not self._stop.wait(period):
            try:
                self.tick()
            except Exception:  # a bug here must not end the renewals of every session
                log.exception("session keeper")

    def stop(self) -> None:
        """Stop renewing; a last try at the pending releases (the process is about to go)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=RELEASE_TIMEOUT_S)
        with self._lock:
            for retry in self._retries:
                retry.due = 0.0
            self._open.clear()
        if self._retries:
            self.tick()


class SessionSet:
    """Every session one request opened, on any replica of any service, so that all are released on
    every exit path (finish, cancel, deadline, fault); the keeper renews them meanwhile."""

    def __init__(self, request_id: str, sampling: common_pb2.SamplingParams, keeper: Optional[SessionKeeper] = None):
        self.request_id = request_id
        self.sampling = sampling
        self.keeper = keeper or SessionKeeper(lease_s=0)  # lease 0: no lease asked, nothing renewed
        self._opened: list[tuple[Pool, Replica, str]] = []

    def open(self, link: Link, pool: Pool, replica: Replica, request_type: type, sequence: list[int],
             timeout_s: float, **extra: Any) -> Any:
        """Prefill a new session holding `sequence` on `replica` (reserved by pool.pick) and pin it to
        `link`; returns the reply. The reservation ends in release_all. `extra` may set the session's
        own `sampling` (a draft that drafts greedily for a sampled request)."""
        session_id = f"{self.request_id}-{len(self._opened) + 1}"
        self._opened.append((pool, replica, session_id))
        self.keeper.opened(replica, session_id)
        reply = replica.stub.Prefill(
            request_type(session_id=session_id, prompt_token_ids=sequence, sampling=extra.pop("sampling", self.sampling),
                         lease_seconds=self.keeper.lease_s, **extra), timeout=timeout_s
        )
        link.session_id, link.replica, link.sync = session_id, replica, ServiceSync(agreed=len(sequence))
        link.features_sent = len(sequence) - 1
        return reply

    def release_all(self) -> None:
        """Free every session opened; a Release that fails is the keeper's to retry, never raised."""
        calls = [(pool, replica, session_id, _release(replica, session_id)) for pool, replica, session_id in self._opened]
        for pool, replica, session_id, call in calls:
            released = _released(call)
            if not released:
                log.info("release of %s on %s failed; retrying in the background", session_id, replica.address)
            self.keeper.closed(replica, session_id, released)
            pool.release(replica)
        self._opened.clear()


def _start(method: Any, request: Any, timeout_s: float) -> Any:
    """A call in flight, or None when it could not start (its channel closed at shutdown)."""
    try:
        return method.future(request, timeout=timeout_s)
    except ValueError:
        return None


def _outcome(call: Any) -> tuple[Any, Optional[grpc.StatusCode]]:
    """(the reply, None), or (None, why it failed): its status code, UNAVAILABLE for a call that never started."""
    if call is None:
        return None, grpc.StatusCode.UNAVAILABLE
    try:
        return call.result(), None
    except grpc.RpcError as error:
        return None, error.code()


def _release(replica: Replica, session_id: str) -> Any:
    return _start(replica.stub.Release, common_pb2.ReleaseRequest(session_id=session_id), RELEASE_TIMEOUT_S)


def _released(call: Any) -> bool:
    """Whether the service no longer holds the session: released, or NOT_FOUND (expired, never opened)."""
    return _outcome(call)[1] in (None, grpc.StatusCode.NOT_FOUND)
