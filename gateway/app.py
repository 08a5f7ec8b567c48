"""Build and start the gateway (used by `specd serve gateway`, `specd up` and the tests). No torch."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from gateway.admission import Admission
from gateway.backends import Backends
from gateway.options import GatewayOptions
from gateway.service import SERVICE_NAME, GenerateServicer, add_to_server
from specd_common.config import ServerConfig
from specd_common.metrics import GatewayMetrics
from specd_common.security import BearerTokenInterceptor, ClientTLS
from specd_common.server import RunningServer, channel, start_observed_server

log = logging.getLogger(__name__)
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def start_gateway_server(
    verify_addresses: str | Sequence[str],
    draft_addresses: Optional[str | Sequence[str]],
    config: ServerConfig,
    options: GatewayOptions = GatewayOptions(),
    backend_tls: Optional[ClientTLS] = None,
) -> RunningServer:
    """Connect to the model services (waiting up to options.connect_timeout_s for them), then serve.

    Addresses may be lists (or comma-separated): each request pins one replica of each service.
    backend_tls is how the gateway dials them (TLS / mutual TLS); config.tls is its own public port;
    options.auth_token, when set, is required as `authorization: Bearer <token>` on every GenerateService RPC.
    """
    verify = {address: channel(address, backend_tls) for address in split_addresses(verify_addresses)}
    draft = {address: channel(address, backend_tls) for address in split_addresses(draft_addresses)}
    backends = Backends.connect(verify, draft, options.connect_timeout_s)
    admission = Admission(max_active=config.max_sessions, max_waiting=options.max_waiting)
    servicer = GenerateServicer(backends, options, admission)
    # threads: every admitted or waiting request holds one, plus a few for health checks and refusals
    workers = config.max_sessions + options.max_waiting + 8
    interceptors = [BearerTokenInterceptor(options.auth_token)] if options.auth_token else []
    warn_plaintext_token(config, options.auth_token)
    return start_observed_server(
        "gateway", lambda s: add_to_server(servicer, s), SERVICE_NAME, servicer, None, config,
        interceptors=interceptors, metrics=GatewayMetrics(), max_workers=workers,
    )


def warn_plaintext_token(config: ServerConfig, auth_token: str) -> None:
    """A bearer token over plaintext off loopback can be sniffed: allowed (TLS may end at a proxy), but said."""
    if auth_token and not config.tls.enabled and config.host not in LOOPBACK_HOSTS:
        log.warning("--auth-token without --tls-cert on %s: tokens cross the network in clear text "
                    "unless a proxy in front terminates TLS", config.host)


def split_addresses(addresses: Optional[str | Sequence[str]]) -> list[str]:
    """'a:1,b:2' or ['a:1', 'b:2'] → ['a:1', 'b:2']; None or '' → []."""
    if not addresses:
        return []
    if isinstance(addresses, str):
        addresses = addresses.split(",")
    return [address.strip() for address in addresses if address.strip()]
