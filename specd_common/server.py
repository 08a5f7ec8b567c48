"""gRPC server plumbing shared by the three services: health, reflection, limits, graceful shutdown."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd_common.errors import Unavailable
from specd_common.security import ClientTLS, ServerTLS, open_channel
from specd_common.telemetry import Observability, instrument_channel

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a round of dense float16 distributions is ~100 KB a position
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# a restarted service is dialled again within this long of listening: gRPC's own back-off grows to 120 s,
# and after a 16 s verify restart the gateway found it 7.2 s after it served (a SYN a second is free)
RECONNECT_BACKOFF_MS = 500
CLIENT_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, *((f"grpc.{bound}_reconnect_backoff_ms", RECONNECT_BACKOFF_MS)
                                             for bound in ("initial", "min", "max"))]
CUT_OFF_S = 5.0  # after the grace, how long calls told to end get to send their partial answers (a round or a prefill)
LAST_STATUS_S = 1.0  # a call that has returned still sends its status: server.stop's grace once every call has returned


class WatchSafeHealthServicer(health.HealthServicer):
    """grpc_health's servicer without a deadlock it has: set() holds its lock while each Watch
    stream's send waits for gRPC's event thread, and a watcher that closes at that moment makes the
    event thread wait for the same lock in the close callback, so neither moves. Seen: a verify
    watched by two gateways never finished its SIGTERM drain (NOT_SERVING made the first gateway
    drop its watch while the second was being told). Here the close callback runs on a thread of its
    own, so the event thread never waits for the lock (tests/test_units.py)."""

    def _on_close_callback(self, send_response_callback, service):
        forget = super()._on_close_callback(send_response_callback, service)
        return lambda: threading.Thread(target=forget, name="health-watch-closed", daemon=True).start()


class CallGate:
    """A servicer's calls in flight, and the door new ones come through, for a graceful shutdown.

    The server's stop closes the door (new calls are refused with UNAVAILABLE and `refusal`, so a
    client retries on another replica at once), waits for the calls inside to finish within the
    grace, then cuts the rest off: a call checks `cut` between its steps and ends with what it has.
    Only when every call has left does the server stop and its companions close the channels the
    calls use (closing them under a running call ended it in INTERNAL, "Channel closed", its
    sessions left behind). A servicer exposes its gate as `.gate`; the gateway's does."""

    def __init__(self, refusal: str):
        self.refusal = refusal
        self._calls = 0
        self._closed = False
        self._cut = threading.Event()
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def enter(self):
        """Count a call for its whole life; Unavailable once the door is closed."""
        with self._changed:
            if self._closed:
                raise Unavailable(self.refusal)
            self._calls += 1
        try:
            yield
        finally:
            with self._changed:
                self._calls -= 1
                self._changed.notify_all()

    @property
    def in_flight(self) -> int:
        return self._calls

    @property
    def cut(self) -> bool:
        """The grace is over: end now, with the partial answer."""
        return self._cut.is_set()

    def close(self) -> None:
        with self._changed:
            self._closed = True

    def cut_off(self) -> None:
        self._cut.set()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to timeout_s until no call is in flight; True if none is."""
        with self._changed:
            return self._changed.wait_for(lambda: self._calls == 0, max(0.0, timeout_s))


@dataclass
class RunningServer:
    """A started gRPC server, its bound port and its health servicer."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: Sequence[str]
    servicer: Any = None  # the service's own servicer, for tests and metrics
    observability: Any = None  # specd_common.telemetry.Observability: tracer, metrics, /metrics endpoint
    health_server: Optional[grpc.Server] = None  # plaintext health-only port (probes), when configured
    health_port: int = -1
    companions: list = field(default_factory=list)  # begin_stop() / stop(grace): the gateway's HTTP API, its verify watch
    cleanups: list = field(default_factory=list)  # callables run after stopping (e.g. remove a socket's folder)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            self.health.set(name, status)

    @property
    def gate(self) -> Optional[CallGate]:
        """The servicer's CallGate (the gateway's), None for a servicer that keeps sessions instead."""
        return getattr(self.servicer, "gate", None)

    def begin_stop(self) -> None:
        """Report NOT_SERVING and refuse new calls (where the servicer has a gate); nothing stops yet."""
        for companion in self.companions:
            companion.begin_stop()
        if self.gate is not None:
            self.gate.close()
        self.set_serving(False)

    def drain(self, grace_s: float, poll_s: float = 0.1) -> float:
        """Report NOT_SERVING, then wait up to grace_s until the service holds no session (a model
        service: gateways watching its health stop sending it new sessions at once, and the sessions
        in flight finish here instead of failing over) or, with a gate (the gateway: one call per
        request), until its calls in flight have finished. Returns the grace left for stop()."""
        self.begin_stop()
        deadline = time.monotonic() + grace_s
        if self.gate is not None:
            self.gate.wait_idle(grace_s)
            log.info("drained: %d call(s) still in flight", self.gate.in_flight)
        sessions = getattr(self.servicer, "sessions", None)
        while sessions is not None and len(sessions) and time.monotonic() < deadline:
            time.sleep(poll_s)
        if sessions is not None:
            log.info("drained: %d session(s) still open", len(sessions))
        return max(0.0, deadline - time.monotonic())

    def stop(self, grace_s: float = 5.0) -> None:
        """Report NOT_SERVING, let in-flight RPCs finish for up to grace_s, then stop; the companions
        (the gateway's pools and their channels, its HTTP API) stop only after the calls have ended.
        With a gate, the calls still running when the grace ends are cut off and get CUT_OFF_S to
        send their partial answers."""
        self.begin_stop()
        calls_grace_s = grace_s
        if self.gate is not None:
            self._end_calls(grace_s)
            calls_grace_s = LAST_STATUS_S  # the calls have returned; their statuses are on the way (health watches are cut)
        self.server.stop(calls_grace_s).wait()
        for companion in self.companions:
            companion.stop(grace_s)
        for cleanup in self.cleanups:
            cleanup()
        if self.health_server is not None:
            self.health_server.stop(0).wait()
        if self.observability is not None:
            self.observability.close()

    def _end_calls(self, grace_s: float) -> None:
        """Wait for the gate's calls to finish within the grace; cut off the ones still running."""
        gate = self.gate
        if gate.wait_idle(grace_s):
            return
        log.info("grace over: ending %d call(s) with their partial answers", gate.in_flight)
        gate.cut_off()
        if not gate.wait_idle(CUT_OFF_S):
            log.warning("%d call(s) still running %.0f s after the cut-off; stopping anyway", gate.in_flight, CUT_OFF_S)


def start_server(
    add_servicers: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    host: str,
    port: int,
    max_workers: int = 32,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    tls: ServerTLS = ServerTLS(),
    health_port: int = -1,
    private_addresses: Sequence[str] = (),
) -> RunningServer:
    """Start a server with the given servicers plus grpc.health.v1 and reflection; port 0 picks a free one.

    With tls enabled the port speaks only TLS (mutual when tls.client_ca is set); health_port >= 0
    adds a plaintext port serving nothing but grpc.health.v1, because Kubernetes' gRPC probes
    cannot do TLS and the health status reveals nothing a probe should not see.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS, interceptors=list(interceptors)
    )
    add_servicers(server)
    health_servicer = WatchSafeHealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = bind(server, host, port, tls)
    for address in private_addresses:  # e.g. unix:PATH for an in-process client (plaintext, not on the network)
        bind_address(server, address)
    server.start()
    running = RunningServer(server, bound, health_servicer, service_names)
    if health_port >= 0:
        running.health_server, running.health_port = start_health_server(health_servicer, host, health_port)
    running.set_serving(True)
    security = "plaintext" if not tls.enabled else "mutual TLS" if tls.mutual else "TLS"
    log.info("serving %s on %s:%d (%s)", ", ".join(service_names), host, bound, security)
    return running


def bind(server: grpc.Server, host: str, port: int, tls: ServerTLS = ServerTLS()) -> int:
    """Add the listening port, TLS or plaintext; the bound port number (port 0 picks one)."""
    return bind_address(server, f"{host}:{port}", tls)


def bind_address(server: grpc.Server, address: str, tls: ServerTLS = ServerTLS()) -> int:
    """Add a listening address (host:port or unix:PATH), TLS or plaintext; OSError if it cannot be bound."""
    bound = server.add_secure_port(address, tls.credentials()) if tls.enabled else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {address}")
    return bound


def start_health_server(health_servicer: health.HealthServicer, host: str, port: int) -> tuple[grpc.Server, int]:
    """A plaintext server with only the shared health servicer: same statuses, no API, no reflection."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = bind(server, host, port)
    server.start()
    log.info("health checks (plaintext, grpc.health.v1 only) on %s:%d", host, bound)
    return server, bound


def start_observed_server(
    service: str,
    add_servicers: Callable[[grpc.Server], None],
    service_name: str,
    servicer: Any,
    sessions: Any,
    config: Any,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    metrics: Any = None,
    max_workers: int | None = None,
    private_addresses: Sequence[str] = (),
) -> RunningServer:
    """start_server with tracing and metrics for `service` (draft, verify, gateway); observability is the
    outermost interceptor so every RPC, refused or not, is traced and counted."""
    observability = Observability.start(service, config.host, config.metrics_port, metrics=metrics)
    if sessions is not None:
        observability.metrics.watch_sessions(sessions)
    running = start_server(
        add_servicers,
        [service_name],
        config.host,
        config.port,
        max_workers or config.max_workers,
        interceptors=[*observability.server_interceptors(), *interceptors],
        tls=config.tls,
        health_port=config.health_port,
        private_addresses=private_addresses,
    )
    running.servicer, running.observability = servicer, observability
    return running


SIGNAL_POLL_S = 0.5  # how often the main thread wakes to run a signal's handler (see wait_for_stop_signal)


def wait_for_stop_signal(poll_s: float = SIGNAL_POLL_S) -> None:
    """Block until SIGTERM or SIGINT. Python runs a signal's handler on the main thread, and only
    once that thread wakes; the kernel may deliver the signal to any thread (CUDA's own threads
    included), and then an untimed wait never wakes: a draft on CUDA ignored SIGTERM for 60 s until
    it was killed. Waking every poll_s runs the handler whichever thread caught the signal."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(poll_s):
        pass


def wait_for_termination(running: RunningServer, grace_s: float, on_stop: Callable[[], None] = lambda: None) -> None:
    """Block until SIGTERM/SIGINT, then shut down gracefully (shutdown)."""
    wait_for_stop_signal()
    shutdown(running, grace_s)
    on_stop()


def shutdown(running: RunningServer, grace_s: float) -> None:
    """What SIGTERM does to a service: NOT_SERVING and new calls refused at once, then in-flight
    work gets up to grace_s in all (drain), then the server stops (stop)."""
    log.info("shutting down: draining in-flight requests for up to %.0f s", grace_s)
    running.stop(running.drain(grace_s))


def channel(address: str, tls: Optional[ClientTLS] = None) -> grpc.Channel:
    """A channel to an internal service with specd's message limits and trace propagation;
    plaintext unless tls is enabled (then TLS, and mutual TLS when it carries a client certificate)."""
    return instrument_channel(open_channel(address, tls, CLIENT_CHANNEL_OPTIONS), address)
