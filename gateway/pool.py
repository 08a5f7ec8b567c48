"""A pool of replicas of one model service: discovered, health-watched, least-loaded, pinned per session.

The design is deploy/README.md's "Scale-out". In short:
- The configured addresses (gateway/discovery.py) are resolved at start, every resolve_period_s and at
  once after a replica fails a call. Each replica address gets one channel that dials only it; a
  static list `a:1,b:2` is the same pool with addresses that never change.
- Each replica has a tending thread: it first asks GetModelInfo (the pool's `admit` may refuse it,
  e.g. a draft with another vocabulary, which is then never used), then follows grpc.health.v1
  Health/Watch. A replica reporting NOT_SERVING (draining after SIGTERM) gets no new sessions at once,
  before DNS drops it; its sessions in flight go on.
- pick() reserves the eligible replica with the fewest sessions this gateway has open on it, ties
  taken in turn, and release() gives the reservation back. The caller keeps the replica for the whole
  session (the pin): every RPC of the session uses it, never the pool.
- A replica whose address leaves DNS drains: no new sessions, its channel closes after its last one.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.discovery import Target, parse_target, resolve
from specd.v1 import common_pb2

log = logging.getLogger(__name__)

Stub = TypeVar("Stub")

RESOLVE_PERIOD_S = 5.0
RETRY_S = 1.0  # how soon a replica that does not answer (GetModelInfo, Health/Watch) is asked again
DNS_TIMEOUT_S = 2.0


@dataclass(eq=False)
class Replica(Generic[Stub]):
    """One replica as this gateway sees it; identity is the object (an address may come back later)."""

    address: str  # the channel's target
    channel: Any
    stub: Stub
    health: Any  # grpc.health.v1 stub
    info: Optional[common_pb2.GetModelInfoResponse] = None  # None until it has answered GetModelInfo
    refused: str = ""  # why admit() refused it ('' = admitted or not asked yet)
    serving: bool = False  # last Health/Watch answer (True once it answered GetModelInfo)
    failed: bool = False  # failed a call and has not answered a health check since
    listed: bool = True  # False: gone from DNS (or the pool stopped); draining
    sessions: int = 0  # sessions this gateway has open (or is opening) on it
    watch_call: Any = None
    calls: Any = None  # a verify replica's VerifyCoalescer (gateway/verify_batch.py), made on first use

    @property
    def eligible(self) -> bool:
        """May a new session go here?"""
        return self.listed and self.info is not None and not self.refused and self.serving


def least_loaded(candidates: Sequence[Replica], turn: int) -> Replica:
    """The candidate with the fewest sessions; among equals the turn-th (mod their count), so equal
    replicas take turns and a newly added one fills up first."""
    fewest = min(r.sessions for r in candidates)
    tied = [r for r in candidates if r.sessions == fewest]
    return tied[turn % len(tied)]


@dataclass
class PoolMetrics:
    """Where the pool reports (GatewayMetrics implements these); the default reports nowhere."""

    replicas: Callable[[str, dict[str, int]], None] = lambda role, counts: None
    sessions: Callable[[str, str, Optional[int]], None] = lambda role, address, count: None  # None: forget it
    discovery_change: Callable[[str, str], None] = lambda role, change: None


class Pool(Generic[Stub]):
    """The replicas of one role ('verify' or 'draft')."""

    def __init__(
        self,
        role: str,
        addresses: Sequence[str],
        dial: Callable[[str, str], Any],
        stub_type: Callable[[Any], Stub],
        admit: Callable[[common_pb2.GetModelInfoResponse], str] = lambda info: "",
        resolve_period_s: float = RESOLVE_PERIOD_S,
        metrics: PoolMetrics = PoolMetrics(),
        on_serving_change: Callable[[bool], None] = lambda serving: None,
    ):
        """dial(address, name) opens a channel to one replica (name: the DNS name it was found under,
        for TLS name checks; '' for fixed addresses). admit(info) returns why a replica must not be
        used ('' to use it). on_serving_change(any_serving) is called when whether any replica serves
        changes."""
        self.role = role
        self.targets: list[Target] = [parse_target(address) for address in addresses]
        self._dial, self._stub_type, self._admit = dial, stub_type, admit
        self._resolve_period_s = resolve_period_s
        self._metrics = metrics
        self.on_serving_change = on_serving_change  # may be set later (the gateway's server starts after the pool)
        self._replicas: dict[str, Replica[Stub]] = {}  # listed replicas by address
        self._draining: list[Replica[Stub]] = []  # unlisted, with sessions still open
        self._found: dict[Target, list[str]] = {}  # last successful resolution of each target
        self._turn = itertools.count()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # notified when a replica is decided or changes health
        self._stopping = threading.Event()
        self._refresh_now = threading.Event()
        self._any_serving = False
        self._threads: list[threading.Thread] = []

    # --- life -------------------------------------------------------------------------------------
    @property
    def configured(self) -> bool:
        return bool(self.targets)

    @property
    def discovering(self) -> bool:
        return any(target.discovered for target in self.targets)

    def start(self) -> "Pool[Stub]":
        """Resolve once now, then keep resolving in the background (only when a DNS name is configured)."""
        self.refresh()
        if self.discovering:
            self._spawn(self._resolve_loop, f"specd-{self.role}-dns")
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            self._refresh_now.set()  # wakes the resolving thread
            replicas = list(self._replicas.values()) + self._draining
            self._changed.notify_all()
        for replica in replicas:
            self._cancel_watch(replica)
            replica.channel.close()  # ends calls in flight on the tending threads
        for thread in self._threads:
            thread.join(RETRY_S * 2 + DNS_TIMEOUT_S)

    def wait_settled(self, timeout_s: float, need: int = 1) -> bool:
        """Wait until every listed replica has answered GetModelInfo (or been refused) and at least
        `need` are admitted, or until timeout_s; True when settled."""

        def settled() -> bool:
            replicas = list(self._replicas.values())
            decided = all(r.info is not None or r.refused for r in replicas)
            return decided and sum(r.info is not None and not r.refused for r in replicas) >= need

        with self._changed:
            return self._changed.wait_for(lambda: settled() or self._stopping.is_set(), timeout_s) and settled()

    # --- choosing ---------------------------------------------------------------------------------
    def replicas(self) -> list[Replica[Stub]]:
        """The listed replicas, in the order they were found."""
        with self._lock:
            return list(self._replicas.values())

    def pick(self, exclude: Sequence[Replica] = ()) -> Optional[Replica[Stub]]:
        """Reserve a session slot on the eligible replica with the fewest sessions (ties in turn);
        None when none is eligible. The caller must release() it when the session ends or fails to open."""
        with self._lock:
            candidates = [r for r in self._replicas.values() if r.eligible and r not in exclude]
            if not candidates:
                return None
            chosen = least_loaded(candidates, next(self._turn))
            chosen.sessions += 1
            self._metrics.sessions(self.role, chosen.address, chosen.sessions)
            return chosen

    def release(self, replica: Replica[Stub]) -> None:
        """A session on replica ended (or never opened); a drained replica closes after its last one."""
        with self._lock:
            replica.sessions -= 1
            close = not replica.listed and replica.sessions <= 0
            if close and replica in self._draining:
                self._draining.remove(replica)
            self._metrics.sessions(self.role, replica.address, None if close else replica.sessions)
            self._report()
        if close:
            replica.channel.close()

    def usable(self, replica: Replica[Stub], probe_timeout_s: float) -> bool:
        """May this replica be called? Yes unless it failed a call before (mark_failed) and does not
        now answer its health check as SERVING within probe_timeout_s: a frozen or overloaded process
        is then skipped at the cost of a short probe, not of another full call timeout."""
        if not replica.failed:
            return True
        try:
            serving = replica.health.Check(health_pb2.HealthCheckRequest(), timeout=probe_timeout_s).status
        except grpc.RpcError:
            return False
        if serving != health_pb2.HealthCheckResponse.SERVING:
            return False
        replica.failed = False
        return True

    def mark_failed(self, replica: Replica[Stub]) -> None:
        """A call to replica failed: probe it before the next use, and look the names up again now."""
        replica.failed = True
        self._refresh_now.set()

    def any_serving(self) -> bool:
        with self._lock:
            return any(r.eligible for r in self._replicas.values())

    # --- discovery --------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Resolve every target; add replicas that appeared, drain those that went."""
        for target in self.targets:
            found = resolve(target, DNS_TIMEOUT_S)
            if found is not None:
                self._found[target] = found
        wanted = list(dict.fromkeys(address for target in self.targets for address in self._found.get(target, [])))
        names = {address: target.name for target in self.targets for address in self._found.get(target, [])}
        with self._lock:
            if self._stopping.is_set():
                return
            for address in wanted:
                if address not in self._replicas:
                    self._add(address, names[address])
            for address in [a for a in self._replicas if a not in wanted]:
                self._remove(address)
            self._report()

    def _resolve_loop(self) -> None:
        while not self._stopping.is_set():
            self._refresh_now.wait(self._resolve_period_s)
            self._refresh_now.clear()
            if not self._stopping.is_set():
                self.refresh()

    def _add(self, address: str, name: str) -> None:
        channel = self._dial(address, name)
        replica = Replica(address, channel, self._stub_type(channel), health_pb2_grpc.HealthStub(channel))
        self._replicas[address] = replica
        self._metrics.discovery_change(self.role, "added")
        self._metrics.sessions(self.role, address, 0)
        if self.discovering:
            log.info("%s replica %s found", self.role, address)
        self._spawn(lambda: self._tend(replica), f"specd-{self.role}-{address}")

    def _remove(self, address: str) -> None:
        replica = self._replicas.pop(address)
        replica.listed = False
        self._cancel_watch(replica)
        self._metrics.discovery_change(self.role, "removed")
        log.info("%s replica %s left DNS; draining %d session(s)", self.role, address, replica.sessions)
        if replica.sessions > 0:
            self._draining.append(replica)
        else:
            self._metrics.sessions(self.role, address, None)
            replica.channel.close()

    # --- tending one replica ----------------------------------------------------------------------
    def _tend(self, replica: Replica[Stub]) -> None:
        """Learn who the replica is (refusing a wrong one), then follow its health while it is listed."""
        while self._live(replica) and replica.info is None:
            try:
                info = replica.stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=RETRY_S * 5, wait_for_ready=True)
            except grpc.RpcError:
                self._stopping.wait(RETRY_S)
                continue
            refusal = self._admit(info)
            if refusal:
                log.error("%s replica %s is not used: %s", self.role, replica.address, refusal)
            self._decide(replica, info, refusal)
        while self._live(replica) and not replica.refused:
            try:
                # wait_for_ready: while the replica is away the watch waits for the channel to reconnect
                # (CLIENT_CHANNEL_OPTIONS) and hears SERVING as soon as it is back, instead of failing each RETRY_S
                replica.watch_call = replica.health.Watch(health_pb2.HealthCheckRequest(), wait_for_ready=True)
                if not self._live(replica):
                    replica.watch_call.cancel()
                for reply in replica.watch_call:
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    self._set_serving(replica, serving)
                    if not serving:  # draining: end the stream, or its server's shutdown would wait for it
                        replica.watch_call.cancel()
            except grpc.RpcError:
                pass  # the replica went away, or the watch was cancelled: ask again after a pause
            self._set_serving(replica, False)
            self._stopping.wait(RETRY_S)

    def _live(self, replica: Replica[Stub]) -> bool:
        return replica.listed and not self._stopping.is_set()

    def _decide(self, replica: Replica[Stub], info: common_pb2.GetModelInfoResponse, refusal: str) -> None:
        with self._changed:
            replica.info, replica.refused, replica.serving = info, refusal, not refusal
            self._report()
            self._changed.notify_all()

    def _set_serving(self, replica: Replica[Stub], serving: bool) -> None:
        with self._changed:
            if replica.serving != serving and replica.listed:
                log.info("%s replica %s %s", self.role, replica.address, "serves" if serving else "does not serve")
            replica.serving = serving
            self._report()
            self._changed.notify_all()

    def _report(self) -> None:
        """Metrics by state, and on_serving_change when whether any replica serves flipped (lock held)."""
        replicas = list(self._replicas.values())
        self._metrics.replicas(self.role, {
            "serving": sum(r.eligible for r in replicas),
            "not_serving": sum(r.info is not None and not r.refused and not r.serving for r in replicas),
            "unanswered": sum(r.info is None and not r.refused for r in replicas),
            "refused": sum(bool(r.refused) for r in replicas),
            "draining": len(self._draining),
        })
        serving = any(r.eligible for r in replicas)
        if serving != self._any_serving and not self._stopping.is_set():
            self._any_serving = serving
            self.on_serving_change(serving)

    def _cancel_watch(self, replica: Replica[Stub]) -> None:
        if replica.watch_call is not None:
            replica.watch_call.cancel()

    def _spawn(self, run: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=run, name=name, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
