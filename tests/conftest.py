"""Shared fixtures: tiny random models (built once per run) and an in-process three-service cluster."""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import grpc
import pytest

from tests.tiny_models import build_feature_head, build_model, build_noisy_copy, build_tokenizer

logging.getLogger("transformers").setLevel(logging.ERROR)


@dataclass
class TinyModels:
    target: Path
    draft_same: Path  # identical weights: greedy drafts are always accepted
    draft_noisy: Path  # noisy output head: partial agreement
    draft_other: Path  # unrelated random weights
    other_vocab: Path  # a different tokenizer: must be refused
    feature_head: Path  # an untrained feature head for target, scoring every other id (reduced vocabulary)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer()
    target = build_model(root / "target", seed=0, tokenizer=tokenizer)
    from transformers import PreTrainedTokenizerFast

    other_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    other_tokenizer.add_tokens(["<extra_a>", "<extra_b>"])
    return TinyModels(
        target=target,
        draft_same=build_model(root / "draft_same", seed=0, tokenizer=tokenizer),
        draft_noisy=build_noisy_copy(target, root / "draft_noisy", noise=0.6),
        draft_other=build_model(root / "draft_other", seed=1, layers=1, tokenizer=tokenizer),
        other_vocab=build_model(root / "other_vocab", seed=2, layers=1, tokenizer=other_tokenizer),
        feature_head=build_feature_head(target, root / "feature_head", vocab_stride=2),
    )


class CallCounter(grpc.ServerInterceptor):
    """Counts RPCs by method name: proves a round costs one Propose and one Verify."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):
        with self._lock:
            self.counts[handler_call_details.method.rsplit("/", 1)[-1]] += 1
        return continuation(handler_call_details)


@dataclass
class Cluster:
    """Verify, draft and gateway servers on 127.0.0.1 with ports picked by the OS."""

    verify: object
    draft: Optional[object]
    gateway: object
    calls: CallCounter = field(default_factory=CallCounter)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def stub(self):
        from specd.v1 import generate_pb2_grpc

        return generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(self.address))

    def open_sessions(self) -> dict[str, int]:
        counts = {"verify": len(self.verify.servicer.sessions)}
        if self.draft is not None:
            counts["draft"] = len(self.draft.servicer.sessions)
        return counts

    def stop(self) -> None:
        for server in (self.gateway, self.draft, self.verify):
            if server is not None:
                server.stop(0)


def start_cluster(
    target: Path,
    drafter: str = "model",
    draft_model: Optional[Path] = None,
    max_sessions: int = 16,
    idle_timeout_s: float = 300.0,
    num_draft_tokens: int = 3,
    max_waiting: int = 64,
    max_speculative_requests: int = 0,
    speculated_outcomes: int = 4,
    model_tls=None,
    gateway_tls=None,
    backend_tls=None,
    auth_token: str = "",
    http_port: Optional[int] = None,
    model_interceptors: tuple = (),
    draft_timeout_s: float = 5.0,
    lookup_tokens: int = 0,
    medusa_heads: Optional[Path] = None,
    weights: str = "float",
    forward: str = "auto",
    plain_steps: int = 4,
) -> Cluster:
    """Start the three services in this process (real gRPC over loopback sockets).

    Security (tests/test_security.py): model_tls / gateway_tls are specd_common.security.ServerTLS for
    draft+verify / the gateway's public port, backend_tls the gateway's ClientTLS toward draft+verify,
    auth_token the public API's bearer token. The defaults are plaintext and open, as before.
    http_port: also serve the OpenAI-compatible HTTP API (0 = a free port; tests/test_http_api.py);
    model_interceptors: more gRPC interceptors on draft and verify (e.g. one that slows them down);
    lookup_tokens: the gateway's own prompt-lookup copies (tests/test_lookup_rounds.py; off by default here);
    medusa_heads: a heads folder the verify serves (tests/test_medusa.py); drafter "" starts no draft service;
    weights / forward: the verify's --weights (tests/test_quantized.py) and --forward (tests/test_flat_pass.py);
    plain_steps: the gateway's --plain-steps (tests/test_plain_steps.py).
    """
    import dataclasses

    from draft_service.app import make_drafter, start_draft_server
    from gateway.app import start_gateway_server
    from gateway.options import GatewayOptions
    from specd_common.config import ServerConfig
    from specd_engine.models import load_causal_lm
    from verify_service.app import start_verify_server

    calls = CallCounter()
    config = ServerConfig(port=0, max_sessions=max_sessions, session_idle_timeout_s=idle_timeout_s)
    model_config, gateway_config = config, config
    if model_tls is not None:
        model_config = dataclasses.replace(config, tls_cert=model_tls.cert, tls_key=model_tls.key, tls_client_ca=model_tls.client_ca)
    if gateway_tls is not None:
        gateway_config = dataclasses.replace(config, tls_cert=gateway_tls.cert, tls_key=gateway_tls.key, tls_client_ca=gateway_tls.client_ca)
    verify = start_verify_server(load_causal_lm(str(target)), model_config, interceptors=[calls, *model_interceptors],
                                 medusa_heads=str(medusa_heads or ""), weights=weights, forward=forward)
    draft = None
    if drafter:
        head_target = str(target) if drafter == "eagle3" else ""  # an EAGLE-3 head names no target; a feature head does
        draft = start_draft_server(make_drafter(drafter, str(draft_model or ""), target=head_target), model_config,
                                   interceptors=[calls, *model_interceptors])
    gateway = start_gateway_server(
        f"127.0.0.1:{verify.port}",
        f"127.0.0.1:{draft.port}" if draft else None,
        gateway_config,
        GatewayOptions(
            num_draft_tokens=num_draft_tokens,
            connect_timeout_s=30,
            draft_timeout_s=draft_timeout_s,
            max_waiting=max_waiting,
            max_speculative_requests=max_speculative_requests,
            speculated_outcomes=speculated_outcomes,
            auth_token=auth_token,
            lookup_tokens=lookup_tokens,
            plain_steps=plain_steps,
        ),
        backend_tls=backend_tls,
        http_port=http_port,
    )
    return Cluster(verify, draft, gateway, calls)


def http_port(cluster: Cluster) -> int:
    from gateway.app import http_server

    return http_server(cluster.gateway).port


def client_for(cluster: Cluster, api_key: str = "unused") -> "openai.OpenAI":
    """The official OpenAI client on a cluster's HTTP port."""
    import openai

    # max_retries=0: a refusal must reach the test as the status the server sent, not be retried away
    return openai.OpenAI(base_url=f"http://127.0.0.1:{http_port(cluster)}/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def served(tiny: TinyModels) -> Iterator[Cluster]:
    """Target + a partly-agreeing model draft, with the gateway's OpenAI-compatible HTTP API on a free port."""
    cluster = start_cluster(tiny.target, "model", tiny.draft_noisy, http_port=0)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(served: Cluster) -> "openai.OpenAI":
    return client_for(served)


@pytest.fixture(scope="module")
def cluster(tiny: TinyModels) -> Iterator[Cluster]:
    """Target + a partly-agreeing model draft."""
    running = start_cluster(tiny.target, "model", tiny.draft_noisy)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def default_target():
    """The real embedded default target (SmolLM2-135M-Instruct), loaded once in this process."""
    from specd_engine.models import DEFAULT_TARGET, load_causal_lm

    return load_causal_lm(DEFAULT_TARGET, device="cpu", dtype="float32")
