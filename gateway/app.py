"""Build and start the gateway (used by `specd serve gateway`, `specd up` and the tests). No torch."""

from __future__ import annotations

from typing import Optional

from gateway.engine import Backends
from gateway.service import SERVICE_NAME, GenerateServicer, add_to_server
from specd_common.config import ServerConfig
from specd_common.metrics import GatewayMetrics
from specd_common.server import RunningServer, channel, start_server
from specd_common.telemetry import Observability


def start_gateway_server(
    verify_address: str,
    draft_address: Optional[str],
    config: ServerConfig,
    num_draft_tokens: int = 3,
    connect_timeout_s: float = 300.0,
) -> RunningServer:
    """Connect to the model services (waiting up to connect_timeout_s for them), then serve."""
    draft_channel = channel(draft_address) if draft_address else None
    backends = Backends.connect(channel(verify_address), draft_channel, connect_timeout_s)
    servicer = GenerateServicer(backends, default_draft_tokens=num_draft_tokens)
    obs = Observability.start("gateway", config.host, config.metrics_port, metrics=GatewayMetrics())
    running = start_server(
        lambda s: add_to_server(servicer, s), [SERVICE_NAME], config.host, config.port, config.max_workers,
        interceptors=obs.server_interceptors(),
    )
    running.servicer, running.observability = servicer, obs
    return running
