"""Prometheus metrics of one service, in its own CollectorRegistry, served over HTTP at /metrics.

Every service: RPC count and latency by method and status, RPCs in flight (queue depth), and for the
model services sessions, KV-cache tokens, forward-pass time and KV rollback. The gateway adds the
request-level and speculation numbers, named like vLLM's (`spec_decode_num_draft_tokens_total`, ...)
so dashboards carry over. A registry per service (not prometheus_client's global one) keeps three
services in one process (the tests) apart. Torch-free: the gateway imports it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

DEFAULT_METRICS_PORTS = {"gateway": 9464, "draft": 9465, "verify": 9466}
PREFIX = "specd"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKENS_PER_PASS_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 17, 33)
HTTP_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health")


class ServiceMetrics:
    """Metrics every service exports; `service` is a label so one Prometheus job can scrape all three."""

    def __init__(self, service: str, registry: Optional[CollectorRegistry] = None, model_service: bool = True):
        self.service = service
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "RPCs handled, by method and gRPC status code.", ["service", "method", "code"], registry=r
        )
        self.request_seconds = Histogram(
            f"{PREFIX}_request_duration_seconds", "RPC latency, from arrival to the last response message.",
            ["service", "method"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_depth = Gauge(
            f"{PREFIX}_queue_depth", "RPCs accepted and not finished (being served or waiting for the model).",
            ["service"], registry=r,
        ).labels(service)
        self._active_sessions = Gauge(
            f"{PREFIX}_active_sessions", "Open sessions (model services) or generations in progress (gateway).",
            ["service"], registry=r,
        )
        self._kv_cache_tokens = Gauge(
            f"{PREFIX}_kv_cache_tokens", "Token positions held in KV caches, summed over open sessions.",
            ["service"], registry=r,
        )
        self.model_forward_seconds = self.kv_rollback_tokens = None  # model services only
        if model_service:
            self.model_forward_seconds = Histogram(
                f"{PREFIX}_model_forward_seconds", "Time of one model forward pass (prefill, draft step or verify).",
                ["service"], buckets=STEP_BUCKETS, registry=r,
            ).labels(service)
            self.kv_rollback_tokens = Counter(
                f"{PREFIX}_kv_rollback_tokens", "Cached positions dropped by commits (rejected speculation).",
                ["service"], registry=r,
            ).labels(service)

        self._rpc_children: dict = {}  # (method, code) → (counter, histogram) children: labels() is not free

    def count_rpc(self, method: str, code: str, seconds: float) -> None:
        children = self._rpc_children.get((method, code))
        if children is None:
            children = self.requests.labels(self.service, method, code), self.request_seconds.labels(self.service, method)
            self._rpc_children[(method, code)] = children
        children[0].inc()
        children[1].observe(seconds)

    def watch_sessions(self, store: Any) -> None:
        """Report a SessionStore's size and cached tokens, read at scrape time."""
        self._active_sessions.labels(self.service).set_function(lambda: len(store))
        self._kv_cache_tokens.labels(self.service).set_function(lambda: _cached_tokens(store))


def _cached_tokens(store: Any) -> int:
    """Sum of `state.sequence.cached` over the store's sessions (0 for a model-free drafter)."""
    return sum(getattr(getattr(state, "sequence", None), "cached", 0) for state in store.snapshot())


class GatewayMetrics(ServiceMetrics):
    """The gateway's request-level and speculative-decoding metrics on top of the common ones."""

    def __init__(self, registry: Optional[CollectorRegistry] = None):
        super().__init__("gateway", registry, model_service=False)
        r = self.registry
        self.active_generations = self._active_sessions.labels("gateway")
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "From the request's arrival to its first generated token.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between successive chunks divided by the chunk's tokens, observed once per token after the first.",
            buckets=STEP_BUCKETS, registry=r,
        )
        self.tokens_per_target_pass = Histogram(
            f"{PREFIX}_tokens_per_target_pass", "Tokens emitted per target forward pass (speculative round).",
            buckets=TOKENS_PER_PASS_BUCKETS, registry=r,
        )
        round_seconds = Histogram(
            f"{PREFIX}_round_phase_seconds", "A round's time split: draft_wait, verify_wait, accept.",
            ["phase"], buckets=STEP_BUCKETS, registry=r,
        )
        self.draft_wait_seconds = round_seconds.labels("draft_wait")
        self.verify_wait_seconds = round_seconds.labels("verify_wait")
        self.accept_seconds = round_seconds.labels("accept")
        self.target_passes = Counter(f"{PREFIX}_target_passes", "Target forward passes (rounds).", registry=r)
        self.draft_cache_wait = Histogram(
            f"{PREFIX}_draft_cache_propose_seconds",
            "Time the gateway waited for a Propose after asking the draft to prepare it (result: hit, miss); "
            "the count per result is the speculation cache's hit rate.",
            ["result"], buckets=STEP_BUCKETS, registry=r,
        )
        self.speculation_cap = Gauge(
            f"{PREFIX}_speculation_cap",
            "Running requests above which rounds are plain decoding (0 = no cap): the flag's, or the one measured costs set.",
            registry=r,
        )
        self.num_drafts = Counter(
            f"{PREFIX}_spec_decode_num_drafts", "Rounds that had drafts (vLLM: spec_decode_num_drafts).", registry=r
        )
        self.num_draft_tokens = Counter(
            f"{PREFIX}_spec_decode_num_draft_tokens", "Draft tokens proposed (vLLM: spec_decode_num_draft_tokens).",
            registry=r,
        )
        self.num_accepted_tokens = Counter(
            f"{PREFIX}_spec_decode_num_accepted_tokens",
            "Draft tokens accepted by the target (vLLM: spec_decode_num_accepted_tokens).", registry=r,
        )
        self.accepted_per_pos = Counter(
            f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position, 0-based (vLLM: spec_decode_num_accepted_tokens_per_pos).",
            ["position"], registry=r,
        )
        self.drafted_per_pos = Counter(
            f"{PREFIX}_spec_decode_num_draft_tokens_per_pos",
            "Proposed draft tokens by draft position, 0-based: the denominator of acceptance per position.",
            ["position"], registry=r,
        )
        self.rested_rounds = Counter(
            f"{PREFIX}_speculation_rested_rounds",
            "Rounds run plain because the request's own speculation had lost to plain rounds as served (the never-slower guard).",
            registry=r,
        )
        self.forced_rounds = Counter(
            f"{PREFIX}_structured_forced_rounds",
            "Structured output: rounds whose drafts were the tokens the grammar forces (jump-forward, no drafter asked).",
            registry=r,
        )
        self.forced_tokens = Counter(
            f"{PREFIX}_structured_forced_tokens", "Structured output: forced tokens drafted (in num_draft_tokens too).",
            registry=r,
        )
        self._per_pos: list = []
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.", registry=r)
        self.http_requests = Counter(
            f"{PREFIX}_http_requests", "Requests to the OpenAI-compatible HTTP API, by route and HTTP status.",
            ["route", "status"], registry=r,
        )
        self.http_request_seconds = Histogram(
            f"{PREFIX}_http_request_duration_seconds",
            "HTTP API latency until the response starts (a stream's first chunk), by route.",
            ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.finished = Counter(
            f"{PREFIX}_request_finish", "Finished generations by finish reason (eos, length, stop, cancelled, error).",
            ["finish_reason"], registry=r,
        )
        self.pool_replicas = Gauge(
            f"{PREFIX}_gateway_replicas", "Model-service replicas this gateway knows, by role and state "
            "(serving, not_serving, unanswered, refused, draining).", ["role", "state"], registry=r,
        )
        self.pool_sessions = Gauge(
            f"{PREFIX}_gateway_replica_sessions", "Sessions this gateway has open on each replica.",
            ["role", "replica"], registry=r,
        )
        self.pool_changes = Counter(
            f"{PREFIX}_gateway_discovery_changes", "Replicas added to or removed from a pool by discovery.",
            ["role", "change"], registry=r,
        )

    def report_replicas(self, role: str, counts: dict) -> None:
        """A pool's replicas by state (gateway.pool)."""
        for state, count in counts.items():
            self.pool_replicas.labels(role, state).set(count)

    def report_sessions(self, role: str, replica: str, count: Optional[int]) -> None:
        """Sessions open on one replica; None: the replica is gone, drop its series."""
        if count is not None:
            self.pool_sessions.labels(role, replica).set(count)
            return
        try:
            self.pool_sessions.remove(role, replica)
        except KeyError:
            pass  # never reported

    def count_discovery(self, role: str, change: str) -> None:
        self.pool_changes.labels(role, change).inc()

    def count_http(self, path: str, status: int, seconds: float) -> None:
        """One request to the OpenAI-compatible HTTP API (its generation is also counted as a gRPC RPC)."""
        route = path if path in HTTP_ROUTES else "other"  # bounded label values: no path from a client verbatim
        self.http_requests.labels(route, str(status)).inc()
        self.http_request_seconds.labels(route).observe(seconds)

    def count_round(self, draft_length: int, accepted: int, emitted_by_pass: Sequence[int]) -> None:
        """One round: its target passes, each with the tokens it emitted (a plain call decodes several,
        gateway/adaptive.py tokens_by_pass)."""
        self.target_passes.inc(len(emitted_by_pass))
        for emitted in emitted_by_pass:
            self.tokens_per_target_pass.observe(emitted)
        if draft_length:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(draft_length)
            self.num_accepted_tokens.inc(accepted)
            for position in range(draft_length):
                drafted, accepted_child = self._position(position)
                drafted.inc()
                if position < accepted:
                    accepted_child.inc()

    def _position(self, position: int) -> tuple:
        """The per-position counter children, created on first use (labels() is not free)."""
        if position >= len(self._per_pos):
            for p in range(len(self._per_pos), position + 1):
                self._per_pos.append((self.drafted_per_pos.labels(str(p)), self.accepted_per_pos.labels(str(p))))
        return self._per_pos[position]


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, int]:
    """Serve the registry at http://host:port/metrics in a daemon thread; port 0 picks a free one."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
