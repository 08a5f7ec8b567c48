"""Tracing for the three services: OTEL_* configuration, gRPC server/client plumbing, hooks for deep code.

Configuration is only the standard OpenTelemetry environment variables. Tracing is on when an OTLP
endpoint is set (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT) and neither
OTEL_SDK_DISABLED=true nor OTEL_TRACES_EXPORTER=none says otherwise; spans then go over OTLP/gRPC
through a BatchSpanProcessor (OTEL_BSP_*), sampled by OTEL_TRACES_SAMPLER(_ARG), named by
OTEL_SERVICE_NAME (default specd-gateway / specd-draft / specd-verify) and OTEL_RESOURCE_ATTRIBUTES.
With no endpoint nothing is installed: no provider, no exporter thread, and every hook below returns
after one context-variable lookup.

Each service owns an `Observability` (its tracer provider and its Prometheus metrics) instead of the
process-global provider, so three services in one process (the in-process tests) stay apart. The
server interceptor makes the service current for the duration of each RPC (a context variable), which
is how hooks in the engine, the model and the KV cache find the right tracer and metrics without
plumbing. On the client side `instrument_channel` (used by specd_common.server.channel) opens a
CLIENT span per unary call made while serving and injects W3C `traceparent` into its gRPC metadata
(OTEL_PROPAGATORS); the server interceptor extracts it, so one request is one trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from specd_common.metrics import ServiceMetrics, serve_metrics

log = logging.getLogger(__name__)

SERVICE_NAMES = {"gateway": "specd-gateway", "draft": "specd-draft", "verify": "specd-verify"}
UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")  # probes and tooling: no spans, no metrics
_NOOP_TRACER = trace.NoOpTracer()


# --------------------------------------------------------------------------- configuration


def tracing_configured(environ: Mapping[str, str] = os.environ) -> bool:
    """True when the OTEL_* variables ask for OTLP trace export."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if "otlp" not in exporters:
        if exporters - {"none", ""}:
            log.warning("OTEL_TRACES_EXPORTER=%s: specd exports traces over OTLP only", ",".join(sorted(exporters)))
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def tracer_provider_from_env(default_service_name: str):
    """A TracerProvider exporting over OTLP/gRPC, or None when tracing is not configured (the no-op case)."""
    if not tracing_configured():
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != "grpc":
        log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: specd exports over OTLP/gRPC only; using grpc", protocol)
    resource = Resource.create()  # reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
    if resource.attributes.get(SERVICE_NAME, "").startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # sampler from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint, headers, TLS from OTEL_*
    log.info("tracing: exporting spans of %s over OTLP/gRPC", resource.attributes.get(SERVICE_NAME))
    return provider


# --------------------------------------------------------------------------- one service's observability


class Observability:
    """One service's tracer (or the no-op tracer), its metrics, and its metrics HTTP endpoint."""

    def __init__(self, service: str, tracer_provider=None, metrics: Optional[ServiceMetrics] = None):
        self.service = service
        self.tracer_provider = tracer_provider
        self.tracing = tracer_provider is not None
        self.tracer = tracer_provider.get_tracer("specd") if self.tracing else _NOOP_TRACER
        self.metrics = metrics if metrics is not None else ServiceMetrics(service)
        self.metrics_port: Optional[int] = None  # bound port of the /metrics endpoint, None when not served
        self._http = None

    @classmethod
    def start(cls, service: str, host: str = "127.0.0.1", metrics_port: int = -1, metrics=None) -> "Observability":
        """Tracing from OTEL_*; metrics served on metrics_port (> 0 that port, 0 a free one, < 0 not served)."""
        obs = cls(service, tracer_provider_from_env(SERVICE_NAMES.get(service, f"specd-{service}")), metrics)
        if metrics_port >= 0:
            try:
                obs._http, obs.metrics_port = serve_metrics(obs.metrics.registry, host, metrics_port)
                log.info("metrics of %s on http://%s:%d/metrics", service, host, obs.metrics_port)
            except OSError as error:  # metrics are auxiliary: keep serving inference, say so loudly
                log.error("metrics endpoint %s:%d for %s not started: %s", host, metrics_port, service, error)
        return obs

    def server_interceptors(self) -> list:
        return [ServerInterceptor(self)]

    def close(self) -> None:
        """Stop the metrics endpoint and flush and stop the span exporter."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()  # flushes what the batch processor still holds
            self.tracer_provider = None


@dataclass
class RpcScope:
    """What is current while a server handles one RPC."""

    obs: Observability
    method: str
    started: float  # time.perf_counter() when the RPC arrived


_SCOPE: contextvars.ContextVar[Optional[RpcScope]] = contextvars.ContextVar("specd_rpc_scope", default=None)


def current() -> Optional[RpcScope]:
    """The RPC being served on this thread (None outside a server handler)."""
    return _SCOPE.get()


# --------------------------------------------------------------------------- hooks for deep code


_NOOP_CM = contextlib.nullcontext(trace.INVALID_SPAN)


def span(name: str, attributes: Optional[Mapping[str, Any]] = None):
    """A child span of the current one in the current service's tracer; a shared no-op when not tracing."""
    scope = _SCOPE.get()
    if scope is None or not scope.obs.tracing:
        return _NOOP_CM
    return scope.obs.tracer.start_as_current_span(name, attributes=attributes)


@contextlib.contextmanager
def model_forward(num_tokens: int) -> Iterator[None]:
    """Wrap one model forward pass: span `specd.model_forward` and the forward-time histogram."""
    scope = _SCOPE.get()
    if scope is None:
        yield
        return
    started = time.perf_counter()
    with span("specd.model_forward", {"specd.forward.tokens": num_tokens}):
        yield
    histogram = scope.obs.metrics.model_forward_seconds
    if histogram is not None:
        histogram.observe(time.perf_counter() - started)


@contextlib.contextmanager
def kv_rollback(sequence: Any) -> Iterator[None]:
    """Wrap TokenSequence.apply_commit: span `specd.kv_rollback` with how many cached positions were dropped."""
    scope = _SCOPE.get()
    if scope is None:
        yield
        return
    cached, length = sequence.cached, len(sequence.tokens)
    with span("specd.kv_rollback") as current_span:
        yield
        dropped = max(0, cached - sequence.cached)  # a kept tree path adds cached positions
        if dropped and scope.obs.metrics.kv_rollback_tokens is not None:
            scope.obs.metrics.kv_rollback_tokens.inc(dropped)
        if current_span.is_recording():
            current_span.set_attributes(
                {"specd.kv.dropped_tokens": dropped, "specd.kv.cached_tokens": sequence.cached,
                 "specd.sequence.length_before": length, "specd.sequence.length": len(sequence.tokens)}
            )


@dataclass
class RpcTimer:
    """Seconds spent in outgoing RPCs, by method name, while it is active (one speculative round)."""

    seconds: dict = field(default_factory=dict)

    def add(self, method: str, seconds: float) -> None:
        self.seconds[method] = self.seconds.get(method, 0.0) + seconds


_TIMER: contextvars.ContextVar[Optional[RpcTimer]] = contextvars.ContextVar("specd_rpc_timer", default=None)


@contextlib.contextmanager
def timing_rpcs() -> Iterator[RpcTimer]:
    """Collect the time of every outgoing RPC made on this thread inside the block."""
    timer = RpcTimer()
    token = _TIMER.set(timer)
    try:
        yield timer
    finally:
        _TIMER.reset(token)


def add_rpc_seconds(method: str, seconds: float) -> None:
    """Count `seconds` as this thread's time in `method` (a call made for it by another thread: a
    VerifyBatch part's, gateway/verify_batch.py)."""
    timer = _TIMER.get()
    if timer is not None:
        timer.add(method, seconds)


# --------------------------------------------------------------------------- server side


def _split_method(full_method: str) -> tuple[str, str]:
    """'/specd.v1.DraftService/Propose' → ('specd.v1.DraftService', 'Propose')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


class ServerInterceptor(grpc.ServerInterceptor):
    """Per RPC: extract W3C context from metadata, open a SERVER span, make the service current, count it."""

    def __init__(self, obs: Observability):
        self.obs = obs

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        full_method = handler_call_details.method
        if handler is None or full_method.startswith(UNTRACED_PREFIXES):
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, full_method, metadata))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._streaming(handler.unary_stream, full_method, metadata))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._unary(handler.stream_unary, full_method, metadata))
        return handler._replace(stream_stream=self._streaming(handler.stream_stream, full_method, metadata))

    def _serving(self, full_method: str, metadata, context: grpc.ServicerContext) -> "_Serving":
        return _Serving(self.obs, full_method, metadata, context)

    def _unary(self, behavior: Callable, full_method: str, metadata) -> Callable:
        def handle(request_or_iterator, context):
            with self._serving(full_method, metadata, context):
                return behavior(request_or_iterator, context)

        return handle

    def _streaming(self, behavior: Callable, full_method: str, metadata) -> Callable:
        def handle(request_or_iterator, context):
            with self._serving(full_method, metadata, context):
                yield from behavior(request_or_iterator, context)

        return handle


class _Serving:
    """One RPC being served: the service made current, a SERVER span when tracing, counted on exit.

    A plain class rather than @contextmanager: this runs on every RPC, tracing or not.
    """

    __slots__ = ("obs", "method", "context", "started", "token", "span", "span_token")

    def __init__(self, obs: Observability, full_method: str, metadata, context: grpc.ServicerContext):
        self.obs, self.context = obs, context
        service, self.method = _split_method(full_method)
        self.span = self.span_token = None
        if obs.tracing:
            self.span = obs.tracer.start_span(
                full_method.lstrip("/"),
                context=propagate.extract({key: value for key, value in metadata}),
                kind=SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": self.method},
            )

    def __enter__(self) -> "_Serving":
        self.started = time.perf_counter()
        self.obs.metrics.queue_depth.inc()
        self.token = _SCOPE.set(RpcScope(self.obs, self.method, self.started))
        if self.span is not None:
            self.span_token = otel_context.attach(trace.set_span_in_context(self.span))
        return self

    def __exit__(self, exc_type, error, traceback) -> bool:
        code = _server_code(self.context, error)
        if self.span is not None:
            span = self.span
            if error is not None and not isinstance(error, GeneratorExit):
                span.record_exception(error)
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code is not grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, f"{code.name}: {_details(self.context)}"))
            span.end()
            otel_context.detach(self.span_token)
        _reset(_SCOPE, self.token)
        metrics = self.obs.metrics
        metrics.queue_depth.dec()
        metrics.count_rpc(self.method, code.name, time.perf_counter() - self.started)
        return False


def _reset(var: contextvars.ContextVar, token: contextvars.Token) -> None:
    """Reset a context variable; a streaming handler abandoned by its client may be finalized elsewhere."""
    try:
        var.reset(token)
    except ValueError:
        pass


def _server_code(context: grpc.ServicerContext, error: Optional[BaseException] = None) -> grpc.StatusCode:
    """The status the handler set (context.abort / set_code); CANCELLED for a client gone; else UNKNOWN on error."""
    try:
        code = context.code()
    except Exception:  # not every context implementation supports code()
        code = None
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(error, GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN


def _details(context: grpc.ServicerContext) -> str:
    try:
        details = context.details()
    except Exception:
        return ""
    return details.decode("utf-8", "replace") if isinstance(details, bytes) else str(details or "")


# --------------------------------------------------------------------------- client side


class _ClientCall:
    """Bookkeeping for one outgoing unary call: its CLIENT span (when tracing) and its time (when timed)."""

    __slots__ = ("method", "timer", "span", "started")

    def __init__(self, full_method: str, peer: dict, scope: Optional[RpcScope], timer: Optional[RpcTimer]):
        service, self.method = _split_method(full_method)
        self.timer, self.span = timer, None
        if scope is not None and scope.obs.tracing:
            self.span = scope.obs.tracer.start_span(
                full_method.lstrip("/"),
                kind=SpanKind.CLIENT,
                attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": self.method, **peer},
            )
        self.started = time.perf_counter()

    def metadata(self, metadata) -> Any:
        """The call's metadata plus W3C `traceparent` (and `tracestate`, baggage) of the CLIENT span."""
        if self.span is None:
            return metadata
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self.span))
        return [*(metadata or ()), *carrier.items()]

    def done(self, code: Any = None, details: str = "") -> None:
        if self.timer is not None:
            self.timer.add(self.method, time.perf_counter() - self.started)
        if self.span is not None:
            if isinstance(code, grpc.StatusCode):
                self.span.set_attribute("rpc.grpc.status_code", code.value[0])
                if code is not grpc.StatusCode.OK:
                    self.span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))
            self.span.end()


class _TracedUnaryUnary(grpc.UnaryUnaryMultiCallable):
    """A unary multicallable that, inside a served RPC, opens a CLIENT span, injects context and times the call.

    Outside a served RPC it is one context-variable lookup on top of the real multicallable. (A grpc
    client interceptor does the same job but costs ~50 us a call in grpc's interceptor machinery.)
    """

    def __init__(self, inner: grpc.UnaryUnaryMultiCallable, full_method: str, peer: dict):
        self._inner, self._method, self._peer = inner, full_method, peer

    def _start(self) -> Optional[_ClientCall]:
        scope, timer = _SCOPE.get(), _TIMER.get()
        if timer is None and (scope is None or not scope.obs.tracing):
            return None
        return _ClientCall(self._method, self._peer, scope, timer)

    def __call__(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None, compression=None):
        call = self._start()
        if call is None:
            return self._inner(request, timeout, metadata, credentials, wait_for_ready, compression)
        try:
            response = self._inner(request, timeout, call.metadata(metadata), credentials, wait_for_ready, compression)
        except grpc.RpcError as error:
            call.done(_rpc_code(error), _rpc_details(error))
            raise
        except BaseException:
            call.done(grpc.StatusCode.UNKNOWN)
            raise
        call.done(grpc.StatusCode.OK)
        return response

    def with_call(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None, compression=None):
        call = self._start()
        if call is None:
            return self._inner.with_call(request, timeout, metadata, credentials, wait_for_ready, compression)
        try:
            response, rpc = self._inner.with_call(
                request, timeout, call.metadata(metadata), credentials, wait_for_ready, compression
            )
        except grpc.RpcError as error:
            call.done(_rpc_code(error), _rpc_details(error))
            raise
        call.done(rpc.code())
        return response, rpc

    def future(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None, compression=None):
        call = self._start()
        if call is None:
            return self._inner.future(request, timeout, metadata, credentials, wait_for_ready, compression)
        future = self._inner.future(request, timeout, call.metadata(metadata), credentials, wait_for_ready, compression)
        future.add_done_callback(lambda f: call.done(f.code(), f.details()))
        return future


def _rpc_code(error: grpc.RpcError) -> Any:
    return error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN


def _rpc_details(error: grpc.RpcError) -> str:
    return error.details() if hasattr(error, "details") else str(error)


class TracedChannel(grpc.Channel):
    """A channel whose unary calls propagate trace context and are timed (see _TracedUnaryUnary)."""

    def __init__(self, channel: grpc.Channel, address: str):
        self._channel = channel
        host, _, port = address.removeprefix("ipv4:").removeprefix("ipv6:").rpartition(":")
        self._peer = {"server.address": host.strip("[]") or address}
        if port.isdigit():
            self._peer["server.port"] = int(port)

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        inner = self._channel.unary_unary(
            method, request_serializer, response_deserializer, _registered_method=_registered_method
        )
        return _TracedUnaryUnary(inner, method, self._peer)

    def unary_stream(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return self._channel.unary_stream(method, request_serializer, response_deserializer, _registered_method=_registered_method)

    def stream_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return self._channel.stream_unary(method, request_serializer, response_deserializer, _registered_method=_registered_method)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return self._channel.stream_stream(method, request_serializer, response_deserializer, _registered_method=_registered_method)

    def subscribe(self, callback, try_to_connect=False):
        self._channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):
        self._channel.unsubscribe(callback)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self._channel.close()
        return False


def instrument_channel(channel: grpc.Channel, address: str) -> grpc.Channel:
    """The channel with trace propagation and RPC timing (pass-through outside a served RPC)."""
    return TracedChannel(channel, address)
