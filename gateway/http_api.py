"""The gateway's OpenAI-compatible HTTP API: Starlette on uvicorn, in the gateway process. No torch.

Every generation request becomes a GenerateRequest sent to this same gateway's GenerateService over
a private Unix socket (gateway/app.py binds it), so HTTP and gRPC requests share one path: the same
validation, admission control, bearer-token check, deadlines, traces and metrics. The HTTP layer
only translates (gateway/openai_api.py) and maps gRPC status codes to HTTP ones.

  POST /v1/chat/completions, POST /v1/completions   (stream: true → server-sent events, then [DONE])
  GET  /v1/models, GET /health

A client that disconnects cancels its gRPC call, which stops the generation and frees both model
services' sessions, streamed or not. Every answer that is not a 2xx is OpenAI's error JSON: bad bodies
are 400s that name the field (gateway/openai_api.py reads them), and anything unexpected is a 500
"server_error" (logged here with its traceback), never plain text, also after a stream has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import grpc
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway import openai_api
from gateway.openai_api import ApiError, Kind, ReplyIds
from specd.v1 import generate_pb2, generate_pb2_grpc
from specd_common.security import AUTHORIZATION, ServerTLS

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 10.0
HEALTH_TIMEOUT_S = 2.0
# a prompt at its limit written with JSON escapes (up to 12 bytes a character: an escaped surrogate pair) fits
MAX_BODY_BYTES = 16 * openai_api.MAX_PROMPT_CHARS
# a body arrives within this long of its headers, else 408: a client sending a byte a second holds no
# connection, task or buffer longer (the largest allowed body takes ~4 s at 1 MB/s)
BODY_TIMEOUT_S = 10.0
# bodies being read at once; past this, a request is refused (503) before its body is read, so slow
# senders cannot take every task the gateway would serve with
MAX_READING_BODIES = 64


@dataclass
class HttpSettings:
    """What the HTTP API needs to know about the gateway it fronts."""

    bridge_address: str  # the gateway's private gRPC address (unix:PATH)
    service_name: str  # GenerateService's full name, for its health status
    model: str  # the id /v1/models lists and requests must name
    vocab_size: int = openai_api.INT32_MAX + 1  # the target's: token-id prompts are checked against it
    tracer: Any = None  # the gateway's OpenTelemetry tracer, None when not tracing
    metrics: Any = None  # specd_common.metrics.GatewayMetrics, None when not counted
    token_bytes: Callable[[int], bytes] = lambda token: b""  # a token's bytes, for logprobs (Grammars.token_bytes)


class HttpApi:
    """The Starlette application and its one gRPC channel to the gateway (opened in the server's loop)."""

    def __init__(self, settings: HttpSettings):
        self.settings = settings
        self._channel: Optional[grpc.aio.Channel] = None
        self._reading = 0  # bodies being read now (MAX_READING_BODIES); only the server's loop touches it
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={HTTPException: _http_exception, Exception: _server_error},
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self._channel = grpc.aio.insecure_channel(self.settings.bridge_address)
        try:
            yield
        finally:
            await self._channel.close()

    @property
    def reading_bodies(self) -> int:
        """Request bodies being read now (at most MAX_READING_BODIES)."""
        return self._reading

    @property
    def _generate(self) -> generate_pb2_grpc.GenerateServiceStub:
        return generate_pb2_grpc.GenerateServiceStub(self._channel)

    # --- routes --------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def models(self, request: Request) -> Response:
        return self._count(request, JSONResponse(openai_api.models_list(self.settings.model)), time.perf_counter())

    async def health(self, request: Request) -> Response:
        """200 while the gateway's GenerateService reports SERVING (it stops before shutting down), else 503."""
        started = time.perf_counter()
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=self.settings.service_name), timeout=HEALTH_TIMEOUT_S)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            serving = False
        body = {"status": "ok" if serving else "not_serving"}
        return self._count(request, JSONResponse(body, status_code=200 if serving else 503), started)

    # --- generation ----------------------------------------------------------------------------
    async def _complete(self, request: Request, kind: Kind) -> Response:
        started = time.perf_counter()
        span = self._start_span(request)
        try:
            parsed = openai_api.parse_request(kind, await self._read_body(request), self.settings.vocab_size)
            if parsed.model != self.settings.model:
                raise ApiError(404, f"model {openai_api.shown(parsed.model)} is not served here; GET /v1/models lists "
                               f"{json.dumps(self.settings.model)}", "invalid_request_error", "model_not_found", "model")
            if parsed.user and span is not None:
                span.set_attribute("specd.openai.user", parsed.user)
            metadata = _call_metadata(request, span)
            ids = ReplyIds.new(kind, self.settings.model)
            if parsed.stream:
                return await self._stream(request, kind, ids, parsed.request, metadata, parsed.include_usage, span, started)
            answer = await _unless_disconnected(request, self._generate.Generate(parsed.request, metadata=metadata))
            response: Response = JSONResponse(openai_api.reply(kind, ids, answer, self.settings.token_bytes))
        except ApiError as error:
            response = _error_response(error)
        except grpc.aio.AioRpcError as error:
            response = _error_response(_api_error(error))
        except Exception:  # noqa: BLE001 - the last resort: a 500 in OpenAI's shape, the traceback in the log
            log.exception("%s %s failed", request.method, request.url.path)
            response = _error_response(SERVER_ERROR)
        _end_span(span, response.status_code)
        return self._count(request, response, started)

    async def _stream(self, request: Request, kind: Kind, ids: ReplyIds, message: generate_pb2.GenerateRequest,
                      metadata: tuple, include_usage: bool, span: Any, started: float) -> Response:
        """Server-sent events. The first message is awaited before answering, so a refused request
        (bad input, admission, auth) still gets its HTTP status rather than a 200 with an error event."""
        call = self._generate.GenerateStream(message, metadata=metadata)
        answered = False
        try:
            first = await _unless_disconnected(request, call.read())
            if first is grpc.aio.EOF:
                raise ApiError(500, "the gateway ended the stream without an answer", "server_error", "internal_error")
            answered = True
        except grpc.aio.AioRpcError as error:
            raise _api_error(error) from None
        finally:
            if not answered:
                call.cancel()
        events = self._events(kind, ids, call, first, include_usage, span)
        return self._count(request, StreamingResponse(events, media_type="text/event-stream"), started)

    async def _events(self, kind: Kind, ids: ReplyIds, call: Any, first: generate_pb2.GenerateStreamResponse,
                      include_usage: bool, span: Any) -> AsyncIterator[str]:
        """SSE lines for every gRPC message; an error after the first becomes an error event. When the
        client goes away, Starlette cancels this generator and the finally clause cancels the call."""
        status = 200
        try:
            message, is_first = first, True
            while message is not grpc.aio.EOF:
                finish = openai_api.finish_reason(message.finish_reason)
                stats = message.stats if message.finish_reason else None
                yield _event(openai_api.chunk(kind, ids, message.text, finish, is_first, stats,
                                              openai_api.logprobs(kind, message.logprobs, self.settings.token_bytes)))
                if message.finish_reason and include_usage:
                    yield _event(openai_api.usage_chunk(kind, ids, message.usage.prompt_tokens, message.usage.completion_tokens))
                message, is_first = await call.read(), False
            yield "data: [DONE]\n\n"
        except grpc.aio.AioRpcError as error:
            problem = _api_error(error)
            status = problem.status
            yield _event(problem.body())
        except asyncio.CancelledError:
            status = 499
            raise
        except Exception:  # noqa: BLE001 - the headers are sent: the last event says what happened
            log.exception("a %s stream failed", kind)
            status = SERVER_ERROR.status
            yield _event(SERVER_ERROR.body())
        finally:
            call.cancel()
            _end_span(span, status)

    async def _read_body(self, request: Request) -> Any:
        """_json_body within BODY_TIMEOUT_S (408 after), at most MAX_READING_BODIES at once (503 past
        them); a client that leaves mid-body is a 499 (its doing, not a server error: no traceback)."""
        if self._reading >= MAX_READING_BODIES:
            raise ApiError(503, f"the gateway is reading {self._reading} request bodies already; retry shortly",
                           "server_error", "overloaded")
        self._reading += 1
        try:
            return await asyncio.wait_for(_json_body(request), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s of its headers; send it "
                           "at once", code="request_timeout") from None
        except ClientDisconnect:
            raise ApiError(499, "the client closed the connection while sending its body", "cancelled",
                           "client_closed_request") from None
        finally:
            self._reading -= 1

    # --- observability -------------------------------------------------------------------------
    def _start_span(self, request: Request) -> Any:
        """A SERVER span for the HTTP request, continuing the client's W3C trace when it sent one;
        the gRPC call below becomes its child (its traceparent rides in the call's metadata)."""
        if self.settings.tracer is None:
            return None
        return self.settings.tracer.start_span(
            f"{request.method} {request.url.path}",
            context=propagate.extract(dict(request.headers)),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.url.path},
        )

    def _count(self, request: Request, response: Response, started: float) -> Response:
        if self.settings.metrics is not None:
            self.settings.metrics.count_http(request.url.path, response.status_code, time.perf_counter() - started)
        return response


async def _json_body(request: Request) -> Any:
    """The body as JSON, read up to MAX_BODY_BYTES (413 beyond). Invalid UTF-8, numbers of more digits than
    Python converts and nesting deeper than its recursion limit are bad JSON too (400, not a crash)."""
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes; send a shorter prompt",
                           code="request_too_large")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"the request body is not valid JSON: {str(error)[:200]}") from None


async def _unless_disconnected(request: Request, awaitable: Any) -> Any:
    """Await a gRPC call, cancelling it if the HTTP client disconnects first (its sessions are then freed)."""
    call = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not call.done():
        call.cancel()
        if isinstance(awaitable, grpc.aio.Call):
            awaitable.cancel()
        raise ApiError(499, "the client closed the connection", "cancelled", "client_closed_request")
    return call.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is already read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _call_metadata(request: Request, span: Any) -> tuple:
    """The client's bearer token (checked by the gateway's gRPC interceptor, as for gRPC clients) and
    the trace context of this request's span."""
    metadata = []
    if "authorization" in request.headers:
        metadata.append((AUTHORIZATION, request.headers["authorization"]))
    if span is not None:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata.extend(carrier.items())
    return tuple(metadata)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _api_error(error: grpc.aio.AioRpcError) -> ApiError:
    return ApiError.from_grpc(error.code(), error.details() or "", error.trailing_metadata())


def _error_response(error: ApiError) -> JSONResponse:
    headers = {"www-authenticate": 'Bearer realm="specd"'} if error.status == 401 else {}
    if error.status in (429, 503):  # when to come back: the gateway's estimate, else soon
        headers["retry-after"] = error.retry_after or "1"
    return JSONResponse(error.body(), status_code=error.status, headers=headers or None)


SERVER_ERROR = ApiError(500, "the gateway failed to answer this request (a bug: its log has the traceback); "
                               "retrying may not help", "server_error", "internal_error")


async def _server_error(_request: Request, _error: Exception) -> Response:
    """Whatever escaped a route (Starlette logs the traceback): OpenAI's error JSON, never plain text."""
    return _error_response(SERVER_ERROR)


async def _http_exception(_request: Request, error: HTTPException) -> Response:
    """Unknown paths (404) and wrong methods (405) in OpenAI's error shape too."""
    return _error_response(ApiError(error.status_code, str(error.detail), "invalid_request_error", "not_found" if error.status_code == 404 else "method_not_allowed"))


def _end_span(span: Any, status: int) -> None:
    if span is None:
        return
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
    span.end()


# --------------------------------------------------------------------------- the server


class HttpServer:
    """uvicorn serving an HttpApi on a socket bound at construction (a busy port fails here, at once)."""

    def __init__(self, api: HttpApi, host: str, port: int, tls: ServerTLS = ServerTLS(), grace_s: float = 5.0):
        self.socket = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = self.socket.getsockname()[1]
        self.api, self.tls = api, tls
        config = uvicorn.Config(api.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=grace_s,
                                access_log=False, **_tls_options(tls))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.socket]},
                                        name="specd-http", daemon=True)

    def start(self) -> "HttpServer":
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP API did not start on port {self.port}; see the log above")
            time.sleep(0.01)
        scheme = "https" if self.tls.enabled else "http"
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", scheme, *self.socket.getsockname()[:2])
        return self

    def begin_stop(self) -> None:
        """The gateway is stopping: keep accepting, so a new request gets its 503 in OpenAI's error JSON
        (the gateway's GenerateService refuses it: UNAVAILABLE) and /health says not_serving, rather than
        a refused connection; in-flight requests go on until the gateway's calls end (RunningServer.stop)."""

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting connections; in-flight requests get the graceful-shutdown time."""
        self._server.should_exit = True
        self._thread.join(grace_s + 1.0)
        self.socket.close()


def _tls_options(tls: ServerTLS) -> dict:
    """uvicorn's TLS settings from the gateway's own (--tls-cert/--tls-key[/--tls-client-ca])."""
    if not tls.enabled:
        return {}
    options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if tls.client_ca:
        options.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options
