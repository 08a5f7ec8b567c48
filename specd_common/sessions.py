"""A bounded, thread-safe store of per-session state (KV caches) with leases and idle expiry.

Both model services keep one entry per generation request. The store bounds how many sessions
exist (RESOURCE_EXHAUSTED past that), serializes work on one session, and frees sessions that
nobody touched for `idle_timeout_s`, so a vanished client cannot leak memory. A session opened
with a lease (the gateway's) is freed sooner: when neither used nor renewed (KeepAlive) for its
lease, i.e. seconds after its gateway died or gave it up, not minutes. After sessions are freed
the reaper hands the freed heap back to the operating system (`return_freed_memory`), so the
process's memory falls back after a wave of requests instead of staying at its peak.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, Sequence, TypeVar

from specd_common.errors import AlreadyExists, Cancelled, InvalidArgument, NotFound, ResourceExhausted

log = logging.getLogger(__name__)

State = TypeVar("State")
MAX_SESSION_ID_LENGTH = 128
MAX_KEEPALIVE_IDS = 4096  # KeepAliveRequest.session_ids: one gateway's sessions on one replica fit many times over


@dataclass
class _Entry(Generic[State]):
    state: State
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    tokens: int = 0  # positions this session holds (counted against the token budget)
    lease_s: float = 0.0  # freed after this long without use or renewal; 0: the store's idle timeout


class SessionStore(Generic[State]):
    """session id → state, at most `max_sessions`, expiring after `idle_timeout_s` without use, and
    holding at most `max_tokens` positions in all (0 = no token budget): memory is bounded by what
    the sessions hold, not only by how many there are. `on_drop` is told of each state released or
    expired (outside the store's lock), so the service can forget it where it schedules work."""

    def __init__(self, max_sessions: int, idle_timeout_s: float, clock: Callable[[], float] = time.monotonic, max_tokens: int = 0,
                 on_drop: Callable[[State], None] = lambda state: None):
        self.max_sessions = max_sessions
        self.on_drop = on_drop
        self.max_tokens = max_tokens
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._entries: dict[str, _Entry[State]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._freed = threading.Event()  # a session was dropped since the heap was last trimmed

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def create(self, session_id: str, state: State) -> None:
        """Add a session; ALREADY_EXISTS for a live id, RESOURCE_EXHAUSTED when the store is full."""
        with self.opening(session_id) as keep:
            keep(state)

    @property
    def tokens(self) -> int:
        """Positions held by all sessions (what the token budget counts)."""
        with self._lock:
            return sum(entry.tokens for entry in self._entries.values())

    def _check_budget(self, more: int) -> None:
        """RESOURCE_EXHAUSTED if `more` positions would pass the budget (caller holds self._lock)."""
        if not self.max_tokens or more <= 0:
            return
        held = sum(entry.tokens for entry in self._entries.values())
        if held + more > self.max_tokens:
            raise ResourceExhausted(
                f"the KV budget is full: sessions hold {held} of {self.max_tokens} tokens and this needs {more} more; "
                "retry later, send a shorter prompt, or raise --kv-token-budget"
            )

    def account(self, session_id: str, tokens: int) -> None:
        """Record that a session now holds `tokens` positions: RESOURCE_EXHAUSTED, before any work,
        when growing to that many would pass the budget (call it inside `use`, before the forward)."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                raise NotFound(f"session {session_id!r} not found (never opened, released, or expired after idling)")
            self._check_budget(tokens - entry.tokens)
            entry.tokens = tokens

    @contextlib.contextmanager
    def opening(self, session_id: str, tokens: int = 0, lease_s: float = 0.0) -> Iterator[Callable[[State], None]]:
        """Claim the id and a slot before the costly part of opening a session (a prefill forward):
        ALREADY_EXISTS / RESOURCE_EXHAUSTED come at once, not after the work. The block calls the
        yielded function with the new state; if it raises instead, the claim is dropped. Until then
        the entry is held, so a request for the same id waits and the reaper skips it. `tokens`: the
        positions it will hold, checked against the token budget now. `lease_s` > 0: the session is
        freed after that long without use or renewal (`renew`), however long the idle timeout."""
        validate_session_id(session_id)
        if lease_s < 0 or lease_s != lease_s:
            raise InvalidArgument(f"lease_seconds must be ≥ 0 (0 = no lease), got {lease_s}")
        entry: _Entry = _Entry(None, last_used=self._clock(), tokens=tokens, lease_s=min(lease_s, self.idle_timeout_s))
        with self._lock:
            if session_id in self._entries:
                raise AlreadyExists(f"session {session_id!r} already exists; use a new id or release it first")
            if len(self._entries) >= self.max_sessions:
                raise ResourceExhausted(
                    f"{len(self._entries)} sessions are open (the limit); retry later or release finished sessions"
                )
            self._check_budget(tokens)
            entry.lock.acquire()
            self._entries[session_id] = entry
        filled = False

        def keep(state: State) -> None:
            nonlocal filled
            entry.state, filled = state, True

        try:
            yield keep
        finally:
            if not filled:
                with self._lock:
                    if self._entries.get(session_id) is entry:
                        del self._entries[session_id]
            entry.last_used = self._clock()
            entry.lock.release()

    @contextlib.contextmanager
    def use(self, session_id: str) -> Iterator[State]:
        """Hold a session exclusively for one round of work; NOT_FOUND for an unknown or expired id."""
        validate_session_id(session_id)
        with self._lock:
            entry = self._entries.get(session_id)
        if entry is None:
            raise NotFound(f"session {session_id!r} not found (never opened, released, or expired after idling)")
        with entry.lock:
            if entry.state is None:  # its opening failed while this request waited
                raise NotFound(f"session {session_id!r} not found (its Prefill failed)")
            entry.last_used = self._clock()
            yield entry.state
            entry.last_used = self._clock()

    def release(self, session_id: str) -> bool:
        """Drop a session; False when it did not exist. Idempotent."""
        validate_session_id(session_id)
        with self._lock:
            entry = self._entries.pop(session_id, None)
        if entry is None:
            return False
        self._dropped([entry])
        return True

    def _dropped(self, entries: Sequence[_Entry[State]]) -> None:
        self._freed.set()
        for entry in entries:
            if entry.state is not None:
                self.on_drop(entry.state)

    def renew(self, session_ids: Sequence[str]) -> list[str]:
        """Mark sessions as still wanted (their lease starts again); returns the ids not held here."""
        if len(session_ids) > MAX_KEEPALIVE_IDS:
            raise InvalidArgument(f"at most {MAX_KEEPALIVE_IDS} session ids a KeepAlive, got {len(session_ids)}; split the call")
        now, unknown = self._clock(), []
        with self._lock:
            for session_id in session_ids:
                entry = self._entries.get(session_id)
                if entry is None:
                    unknown.append(session_id)
                else:
                    entry.last_used = max(entry.last_used, now)
        return unknown

    def snapshot(self) -> list[State]:
        """The open sessions' states, for metrics (read them, do not mutate them)."""
        with self._lock:
            return [entry.state for entry in self._entries.values() if entry.state is not None]  # not half-open ones

    def expire_idle(self) -> list[str]:
        """Drop sessions not in use whose lease (or, without one, the idle timeout) ran out; return their ids."""
        now = self._clock()
        with self._lock:
            stale = [
                sid
                for sid, entry in self._entries.items()
                if now - entry.last_used > (entry.lease_s or self.idle_timeout_s) and not entry.lock.locked()
            ]
            dropped = [self._entries.pop(sid) for sid in stale]
        if stale:
            self._dropped(dropped)
            log.info("expired %d sessions (lease or idle timeout ran out)", len(stale))
        return stale

    def start_reaper(self, interval_s: float | None = None) -> threading.Thread:
        """Run expire_idle, then return_freed_memory, periodically in a daemon thread until close().
        Every second at most: a lease of a few seconds must end within about a second of running out."""
        interval = interval_s if interval_s is not None else max(0.05, min(REAPER_PERIOD_S, self.idle_timeout_s / 4))

        def loop() -> None:
            while not self._stop.wait(interval):
                self.expire_idle()
                if self._freed.is_set():
                    self._freed.clear()
                    return_freed_memory()

        thread = threading.Thread(target=loop, name="session-reaper", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stop the reaper and drop every session."""
        self._stop.set()
        with self._lock:
            self._entries.clear()


REAPER_PERIOD_S = 1.0  # how late a lease may end, at most, after it ran out
_LIBC = ctypes.util.find_library("c")


def return_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim), so memory freed by released KV
    caches shows up as a smaller RSS instead of staying reserved for this process. Freed caches of a
    few MB go back by themselves (glibc maps big blocks), but torch's many smaller tensors (a session's
    first chunks, activations) land in the arena, whose top stays mapped. False where there is no glibc."""
    if not _LIBC:
        return False
    try:
        return bool(ctypes.CDLL(_LIBC).malloc_trim(0))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return False


def validate_session_id(session_id: str) -> None:
    if not session_id or len(session_id) > MAX_SESSION_ID_LENGTH:
        raise InvalidArgument(f"session_id must be 1..{MAX_SESSION_ID_LENGTH} characters")


def drop_if_abandoned(store: SessionStore, session_id: str, context) -> None:
    """After a slow Prefill: if the caller gave up meanwhile (deadline, cancel), its Release may already
    have come and gone, so free the session now instead of leaving it to the idle reaper."""
    if not context.is_active():
        store.release(session_id)
        raise Cancelled(f"session {session_id!r} was opened after the caller gave up; it has been released")
