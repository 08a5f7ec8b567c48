"""Build and start the gateway (used by `specd serve gateway`, `specd up` and the tests). No torch."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from typing import Optional, Sequence

from gateway.admission import Admission, estimate_from_profile
from gateway.backends import Backends
from gateway.links import SessionKeeper
from gateway.http_api import HttpApi, HttpServer, HttpSettings
from gateway.options import GatewayOptions
from gateway.pool import PoolMetrics
from gateway.service import SERVICE_NAME, GenerateServicer, add_to_server
from specd.v1 import common_pb2
from specd_common.config import ServerConfig
from specd_common.metrics import GatewayMetrics
from specd_common.security import ClientTLS, token_interceptors, with_bearer_token
from specd_common.server import RunningServer, channel, start_observed_server

log = logging.getLogger(__name__)
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def start_gateway_server(
    verify_addresses: str | Sequence[str],
    draft_addresses: Optional[str | Sequence[str]],
    config: ServerConfig,
    options: GatewayOptions = GatewayOptions(),
    backend_tls: Optional[ClientTLS] = None,
    http_port: Optional[int] = None,
) -> RunningServer:
    """Connect to the model services (waiting up to options.connect_timeout_s for them), then serve.

    Addresses may be lists (or comma-separated) of HOST:PORT and dns:///NAME:PORT (every record a
    replica, re-resolved every options.resolve_period_s; gateway/discovery.py): each request pins the
    least-loaded replica of each service (gateway/pool.py). The gateway reports NOT_SERVING while no
    verify replica serves.
    backend_tls is how the gateway dials them (TLS / mutual TLS); config.tls is its own public port;
    options.auth_token, when set, is required as `authorization: Bearer <token>` on every GenerateService RPC,
    and sent on every call to draft and verify (one token for the stack; docs/security.md).
    http_port: also serve the OpenAI-compatible HTTP API (gateway/http_api.py) on config.host and this
    port (0 = a free one, None = no HTTP), with the same TLS files as the gRPC port.
    """
    metrics = GatewayMetrics()
    pool_metrics = PoolMetrics(metrics.report_replicas, metrics.report_sessions, metrics.count_discovery)
    backends = Backends.connect(
        split_addresses(verify_addresses), split_addresses(draft_addresses),
        lambda address, name: with_bearer_token(channel(address, tls_for(backend_tls, name)), options.auth_token),
        options.connect_timeout_s, options.resolve_period_s, pool_metrics,
    )
    backends.report_cap = metrics.speculation_cap.set
    backends.keeper = SessionKeeper(options.session_lease_s)
    if options.max_speculative_requests >= 0:
        metrics.speculation_cap.set(options.max_speculative_requests)
    admission = Admission(max_active=config.max_sessions, max_waiting=options.max_waiting,
                          estimate=estimate_from_profile(backends.target_info.runtime_profile), max_queue_s=options.max_queue_s)
    servicer = GenerateServicer(backends, options, admission)
    # threads: every admitted or waiting request holds one, plus a few for health checks and refusals
    workers = config.max_sessions + options.max_waiting + 8
    interceptors = token_interceptors(options.auth_token)
    warn_plaintext_token(config, options.auth_token)
    bridge_dir = tempfile.mkdtemp(prefix="specd-gateway-") if http_port is not None else None  # mode 0700
    bridge = [f"unix:{bridge_dir}/generate.sock"] if bridge_dir else []
    try:
        running = start_observed_server(
            "gateway", lambda s: add_to_server(servicer, s), SERVICE_NAME, servicer, None, config,
            interceptors=interceptors, metrics=metrics, max_workers=workers, private_addresses=bridge,
        )
    except BaseException:
        backends.stop()
        raise
    running.companions.append(backends)  # its pools stop with the server
    backends.follow_verify_health(running.set_serving)
    if bridge_dir is not None:
        running.cleanups.append(lambda: shutil.rmtree(bridge_dir, ignore_errors=True))
        try:
            running.companions.append(start_http_api(running, bridge[0], backends, config, http_port))
        except BaseException:
            running.stop(0)
            raise
    return running


def http_server(running: RunningServer) -> Optional[HttpServer]:
    """The gateway's HTTP API server (its bound port is `.port`), None when HTTP is off."""
    return next((companion for companion in running.companions if isinstance(companion, HttpServer)), None)


def start_http_api(running: RunningServer, bridge_address: str, backends: Backends, config: ServerConfig,
                   port: int) -> HttpServer:
    """The HTTP API in front of the gateway's GenerateService (reached over the private bridge socket)."""
    obs, target = running.observability, backends.target_info
    settings = HttpSettings(token_bytes=backends.grammars.token_bytes,
        bridge_address=bridge_address, service_name=SERVICE_NAME, model=target.model_name, vocab_size=target.vocab_size,
        tracer=obs.tracer if obs is not None and obs.tracing else None, metrics=obs.metrics if obs is not None else None,
    )
    return HttpServer(HttpApi(settings), config.host, port, config.tls, config.grace_s).start()


def warn_plaintext_token(config: ServerConfig, auth_token: str) -> None:
    """A bearer token over plaintext off loopback can be sniffed: allowed (TLS may end at a proxy), but said."""
    if auth_token and not config.tls.enabled and config.host not in LOOPBACK_HOSTS:
        log.warning("--auth-token without --tls-cert on %s: tokens cross the network in clear text "
                    "unless a proxy in front terminates TLS", config.host)


def tls_for(tls: Optional[ClientTLS], name: str) -> Optional[ClientTLS]:
    """How to dial a replica found under DNS name `name`: its certificate is checked against the name
    (not the pod IP the channel dials), unless an explicit server name was configured."""
    if tls is None or not tls.enabled or not name or tls.server_name:
        return tls
    return dataclasses.replace(tls, server_name=name)


def split_addresses(addresses: Optional[str | Sequence[str]]) -> list[str]:
    """'a:1,b:2' or ['a:1', 'b:2'] → ['a:1', 'b:2']; None or '' → []."""
    if not addresses:
        return []
    if isinstance(addresses, str):
        addresses = addresses.split(",")
    return [address.strip() for address in addresses if address.strip()]
