"""The services' flags and their settings dataclasses share one set of defaults: a gateway, server or
batch policy built in code runs as `specd serve ...` with no flags does."""

from __future__ import annotations

import os

import pytest

from gateway.options import GatewayOptions
from specd_app.cli import build_parser, gateway_options
from specd_common.config import BatchPolicy, ServerConfig


@pytest.fixture(autouse=True)
def no_specd_environment(monkeypatch):
    """SPECD_* variables are flag defaults too (specd_common/config.py): none here."""
    for name in [n for n in os.environ if n.startswith("SPECD_")]:
        monkeypatch.delenv(name)


def test_the_gateway_flags_default_to_gateway_options():
    assert gateway_options(build_parser().parse_args(["serve", "gateway"])) == GatewayOptions()


@pytest.mark.parametrize("service", ["verify", "draft", "gateway"])
def test_the_server_flags_default_to_server_config_but_for_the_ports(service):
    args = build_parser().parse_args(["serve", service])
    fields = ("host", "max_sessions", "session_idle_timeout_s", "grace_s", "tls_cert", "tls_key", "tls_client_ca", "health_port")
    built, default = ServerConfig.from_args(args), ServerConfig()
    assert {f: getattr(built, f) for f in fields} == {f: getattr(default, f) for f in fields}


@pytest.mark.parametrize("service", ["verify", "draft"])
def test_the_batch_flags_default_to_batch_policy(service):
    assert BatchPolicy.from_args(build_parser().parse_args(["serve", service])) == BatchPolicy()

