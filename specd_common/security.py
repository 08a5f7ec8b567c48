"""Transport security and authentication: TLS / mutual TLS from PEM files, and a bearer token.

Everything here is optional and off by default, so a laptop run (`specd up` on 127.0.0.1) stays
plaintext. In production the model services take --tls-cert/--tls-key/--tls-client-ca (mTLS: only
a client holding a certificate from that CA, i.e. the gateway, may call them), the gateway dials
them with --tls-ca/--tls-client-cert/--tls-client-key, and every service may require a bearer
token (--auth-token / --auth-token-file): the gateway on its public API, draft and verify on theirs,
which the gateway calls with its own token (with_bearer_token on its channels).

Server certificates are re-read when their files change (Kubernetes updates mounted Secrets in
place and cert-manager rotates them), so rotation needs no restart; each new connection sees the
current files. Client certificates are read once, when the channel is built.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import grpc

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"  # gRPC metadata keys are lower case
# Methods served without a token: health (Kubernetes probes, load balancers) and reflection (grpcurl).
# Everything else is checked, so a service added later is protected without anyone remembering to.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")


class SecurityConfigError(ValueError):
    """A TLS or token setting that cannot work (a key without a certificate, an empty token file, ...)."""


def read_pem(path: str, what: str) -> bytes:
    """The file's bytes, or a SecurityConfigError naming the flag's role instead of a bare OSError."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise SecurityConfigError(f"cannot read {what} {path!r}: {error.strerror}") from error
    if not data.strip():
        raise SecurityConfigError(f"{what} {path!r} is empty")
    return data


@dataclass(frozen=True)
class ServerTLS:
    """PEM files for a listening port: cert + key turn TLS on; client_ca also requires client certificates."""

    cert: str = ""
    key: str = ""
    client_ca: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise SecurityConfigError("--tls-cert and --tls-key go together")
        if self.client_ca and not self.cert:
            raise SecurityConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca)

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials that re-read the files when they change; unreadable files fail now, not at first use."""
        reloader = _CertificateReloader(self)
        return grpc.dynamic_ssl_server_credentials(
            reloader.initial, reloader.fetch, require_client_authentication=self.mutual
        )


class _CertificateReloader:
    """Hands gRPC a new certificate configuration when the files' mtimes or sizes change.

    gRPC calls fetch() on each new TLS handshake; a stat per handshake is cheap, and a bad file in
    the middle of a rotation keeps the last good configuration instead of breaking every connection.
    """

    def __init__(self, tls: ServerTLS) -> None:
        self._tls = tls
        self._lock = threading.Lock()
        self._signature = self._stat()
        self.initial = self._load()

    def _paths(self) -> list[str]:
        return [p for p in (self._tls.cert, self._tls.key, self._tls.client_ca) if p]

    def _stat(self) -> tuple:
        signature = []
        for path in self._paths():
            try:
                info = os.stat(path)
                signature.append((info.st_mtime_ns, info.st_size, info.st_ino))
            except OSError:
                signature.append(None)
        return tuple(signature)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        pair = (read_pem(self._tls.key, "TLS key"), read_pem(self._tls.cert, "TLS certificate"))
        roots = read_pem(self._tls.client_ca, "TLS client CA") if self._tls.client_ca else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=roots)

    def fetch(self) -> Optional[grpc.ServerCertificateConfiguration]:
        """None keeps the current configuration (gRPC's contract for the fetcher)."""
        signature = self._stat()
        with self._lock:
            if signature == self._signature:
                return None
            try:
                configuration = self._load()
            except SecurityConfigError as error:
                log.warning("TLS files changed but cannot be loaded, keeping the previous ones: %s", error)
                return None
            self._signature = signature
        log.info("TLS certificate files changed: new connections use the new ones")
        return configuration


@dataclass(frozen=True)
class ClientTLS:
    """How a client dials a TLS server: trust roots, an optional client certificate (mTLS), a name override.

    `enabled` without a CA uses the system's trust roots (a public gateway with a public certificate).
    server_name overrides the name checked against the server certificate (tests dialling 127.0.0.1
    with a certificate for "localhost", or an address that is not the certificate's name).
    """

    enabled: bool = False
    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise SecurityConfigError("--tls-client-cert and --tls-client-key go together")

    @classmethod
    def from_files(cls, ca: str = "", cert: str = "", key: str = "", server_name: str = "", force: bool = False) -> "ClientTLS":
        """TLS is on when asked for or when any file is given: a CA or a client cert only make sense over TLS."""
        return cls(bool(force or ca or cert or key), ca, cert, key, server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        roots = read_pem(self.ca, "TLS CA") if self.ca else None
        key = read_pem(self.key, "TLS client key") if self.key else None
        cert = read_pem(self.cert, "TLS client certificate") if self.cert else None
        return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=cert)

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def open_channel(address: str, tls: Optional[ClientTLS] = None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A plaintext channel, or a TLS one when tls is enabled."""
    if tls is None or not tls.enabled:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the token; empty when there is none."""
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()


def with_bearer_token(channel: grpc.Channel, token: str) -> grpc.Channel:
    """The channel, sending `authorization: Bearer <token>` on every call; unchanged when token is ''.

    The gateway wraps each channel to a draft or verify replica once, where it is opened, so no
    call site can forget the token. A client interceptor rather than call credentials: gRPC sends
    call credentials only over TLS, and the token must also work on a plaintext loopback stack.
    """
    return grpc.intercept_channel(channel, _BearerClientInterceptor(token)) if token else channel


class _BearerClientInterceptor(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
):
    """Adds the bearer metadata to every call, of any shape, keeping the call's own metadata."""

    def __init__(self, token: str) -> None:
        self._metadata = bearer_metadata(token)

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in details.metadata or () if m[0] != AUTHORIZATION]
        return _CallDetails(details.method, details.timeout, [*metadata, *self._metadata], details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    """grpc.ClientCallDetails is an interface with no constructor; interceptors build their own."""

    method: str
    timeout: Optional[float]
    metadata: Optional[Sequence[tuple[str, str]]]
    credentials: Optional[grpc.CallCredentials]
    wait_for_ready: Optional[bool]
    compression: Any


def load_token(token: str = "", token_file: str = "") -> str:
    """The bearer token from a flag or a file (a mounted Secret); '' means authentication is off.

    A named but empty file is an error, never "no authentication": a broken Secret must not
    silently open the API.
    """
    if token and token_file:
        raise SecurityConfigError("give --auth-token or --auth-token-file, not both")
    if token_file:
        token = read_pem(token_file, "auth token file").decode("utf-8").strip()
    if token != token.strip() or any(c.isspace() for c in token):
        raise SecurityConfigError("the auth token must not contain whitespace")
    return token


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8")).digest()


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses RPCs without `authorization: Bearer <token>` with UNAUTHENTICATED, before any work.

    Every method is checked except those under `open_prefixes` (grpc.health.v1 for Kubernetes probes,
    reflection for grpcurl): the gateway's GenerateService and the model services' DraftService and
    VerifyService alike. The comparison is constant time over SHA-256 digests, so neither the
    token's bytes nor its length leak through timing.
    """

    def __init__(self, token: str, open_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES) -> None:
        if not token:
            raise SecurityConfigError("an empty bearer token would accept anyone")
        self._expected = _digest(token)
        self._open = tuple(open_prefixes)

    def authorized(self, metadata: Optional[Sequence[Any]]) -> Optional[str]:
        """None when the metadata carries the right token, else why not (for the client's error)."""
        values = [m.value for m in metadata or () if m.key == AUTHORIZATION]
        if not values:
            return "missing 'authorization: Bearer <token>' metadata (the token this service runs with: --auth-token or --auth-token-file)"
        scheme, _, given = str(values[0]).partition(" ")
        if scheme.lower() != "bearer" or not given:
            return "the authorization metadata must be 'Bearer <token>'"
        if not hmac.compare_digest(_digest(given.strip()), self._expected):
            return "invalid bearer token"
        return None

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        if handler_call_details.method.startswith(self._open):
            return continuation(handler_call_details)
        reason = self.authorized(handler_call_details.invocation_metadata)
        handler = continuation(handler_call_details)
        if reason is None or handler is None:
            return handler
        return _refusing_handler(handler, f"unauthenticated: {reason}")


def token_interceptors(token: str) -> list[grpc.ServerInterceptor]:
    """[the bearer check] when a token is set, else []: how each service turns --auth-token into interceptors."""
    return [BearerTokenInterceptor(token)] if token else []


def _refusing_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED before any work."""

    def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
        context.set_trailing_metadata((("www-authenticate", 'Bearer realm="specd"'),))
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def refuse_stream(request: Any, context: grpc.ServicerContext):
        refuse(request, context)
        yield  # unreachable: abort raises; makes this a generator as a streaming handler must be

    serdes = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(lambda it, ctx: refuse_stream(None, ctx), **serdes)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(lambda it, ctx: refuse(None, ctx), **serdes)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **serdes)
    return grpc.unary_unary_rpc_method_handler(refuse, **serdes)
