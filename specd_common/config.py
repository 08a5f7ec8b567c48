"""Service configuration: command-line flags with environment-variable defaults (12-factor).

Every flag --some-name can also be set as SPECD_SOME_NAME; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

DEFAULT_PORTS = {"gateway": 50051, "draft": 50052, "verify": 50053}


def env_default(name: str, default: Any) -> Any:
    """The value of SPECD_<NAME> converted to default's type, else default."""
    raw = os.environ.get("SPECD_" + name.upper().replace("-", "_"))
    if raw is None or default is None and raw == "":
        return default
    return type(default)(raw) if default is not None else raw


def add_flag(parser: argparse.ArgumentParser, name: str, default: Any, help: str, **kwargs: Any) -> None:
    """Add --name with its SPECD_NAME environment default shown in --help."""
    env = "SPECD_" + name.upper().replace("-", "_")
    value = env_default(name, default)
    kind = kwargs.pop("type", type(default) if default is not None else str)
    parser.add_argument(f"--{name}", default=value, type=kind, help=f"{help} (env {env}; default {default})", **kwargs)


@dataclass(frozen=True)
class ServerConfig:
    """Where and how a service listens, and how it bounds its sessions."""

    host: str = "127.0.0.1"
    port: int = 0
    max_sessions: int = 64
    session_idle_timeout_s: float = 300.0
    grace_s: float = 10.0
    max_workers: int = 32

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        return cls(
            host=args.host,
            port=args.port,
            max_sessions=args.max_sessions,
            session_idle_timeout_s=args.session_idle_timeout,
            grace_s=args.grace,
        )


def add_server_flags(parser: argparse.ArgumentParser, service: str) -> None:
    add_flag(parser, "host", "127.0.0.1", "address to bind; 0.0.0.0 in containers")
    add_flag(parser, "port", DEFAULT_PORTS[service], "port to bind (0 picks a free one)")
    add_flag(parser, "max-sessions", 64, "concurrent sessions before RESOURCE_EXHAUSTED")
    add_flag(parser, "session-idle-timeout", 300.0, "seconds after which an untouched session is freed")
    add_flag(parser, "grace", 10.0, "seconds in-flight requests get to finish on SIGTERM")


def add_model_flags(parser: argparse.ArgumentParser, default_model: str) -> None:
    add_flag(parser, "model", default_model, "hub id, local folder, GGUF file, or embedded:<name>")
    add_flag(parser, "device", "auto", "auto, cpu, cuda, cuda:N")
    add_flag(parser, "dtype", "auto", "auto (bf16 on CUDA, fp32 on CPU), float32, float16, bfloat16")
    add_flag(parser, "threads", 0, "torch CPU threads for this service (0 = torch's default)")
    add_flag(parser, "max-batch-size", 8, "sessions scored in one batched forward pass (1 = one session at a time)")
    add_flag(parser, "batch-wait-ms", 20.0, "longest a batch waits for expected sessions (also capped at 1/4 of a pass)")
