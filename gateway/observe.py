"""What the gateway reports about one Generation: GenAI attributes, a span per round, speculation metrics.

The engine calls three hooks: `prefill(fn)`, `round(fn)` (one per target pass) and `finish()`. The
tracer and metrics come from the gateway RPC being served (specd_common.telemetry.current()); outside
a served RPC (unit tests of the engine) every hook just calls through.

Span attributes follow the OpenTelemetry GenAI conventions where they fit (gen_ai.*), and the
speculative-decoding ones live under `specd.`:

  specd.round.index, specd.round.lookup (the drafts were the gateway's prompt-lookup copy),
  specd.round.heads (the drafts were the verify's Medusa heads' proposals),
  specd.draft.length, specd.accepted.length, specd.emitted.length,
  specd.round.bonus, specd.round.corrected, specd.acceptance_rate_so_far,
  specd.time.draft_wait_ms, specd.time.verify_wait_ms, specd.time.accept_ms
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Protocol, TypeVar

from opentelemetry import trace

from gateway.adaptive import tokens_by_pass
from specd_common import telemetry
from specd_common.metrics import GatewayMetrics


class ObservedGeneration(Protocol):
    """What the observer reads of a gateway.engine.Generation (a protocol, so this module does not
    import the engine that calls it)."""

    spec: Any  # GenerationSpec: prompt_ids, max_new_tokens, warp, ...
    stats: Any  # SpeculationStats
    generated: list
    backends: Any
    request_id: str
    speculate: bool


class RoundResult(Protocol):
    """What the observer reads of one round's result (gateway.engine.Chunk)."""

    finish_reason: Optional[str]


Chunk = TypeVar("Chunk", bound=RoundResult)

OPERATION = "text_completion"


class GenerationObserver:
    """Spans and metrics for one Generation; cheap no-ops when there is nothing to report to."""

    def __init__(self, generation: ObservedGeneration):
        self.generation = generation
        scope = telemetry.current()
        self.active = scope is not None
        self.metrics: Optional[GatewayMetrics] = (
            scope.obs.metrics if scope is not None and isinstance(scope.obs.metrics, GatewayMetrics) else None
        )
        self.started = scope.started if scope is not None else time.perf_counter()
        self.span = trace.get_current_span() if scope is not None and scope.obs.tracing else trace.INVALID_SPAN
        self.rounds = 0
        self.finish_reason: Optional[str] = None
        self.failed = False
        self._last_emit: Optional[float] = None
        self._finished = False
        if self.metrics is not None:
            self.metrics.active_generations.inc()
        if self.span.is_recording():
            self.span.set_attributes(request_attributes(generation))

    def prefill(self, prefill: Callable[[], None]) -> None:
        """Run the prefill of both services under a `specd.prefill` span."""
        if not self.active:
            return prefill()
        with telemetry.span("specd.prefill", {"gen_ai.usage.input_tokens": len(self.generation.spec.prompt_ids)}):
            try:
                return prefill()
            except BaseException:
                self.failed = True
                raise

    def round(self, run_round: Callable[[], Chunk]) -> Chunk:
        """Run one round (one target pass; a plain call decodes several) under a `specd.round` span; count it."""
        if not self.active:
            return run_round()
        stats, generated = self.generation.stats, self.generation.generated
        drafted_before, accepted_before, emitted_before = stats.draft_tokens, stats.accepted_tokens, len(generated)
        passes_before = stats.target_passes
        predicted_before = stats.predicted_tokens
        lookups_before, heads_before, trees_before = stats.lookup_rounds, stats.head_rounds, stats.tree_rounds
        forced_before, forced_tokens_before, rested_before = stats.forced_rounds, stats.forced_tokens, stats.rested_rounds
        cache_lookups_before, cache_hits_before = stats.draft_cache_lookups, stats.draft_cache_hits
        started = time.perf_counter()
        with telemetry.span("specd.round", {"specd.round.index": self.rounds}) as span, telemetry.timing_rpcs() as rpcs:
            try:
                chunk = run_round()
            except BaseException:
                self.failed = True
                raise
            now = time.perf_counter()
            draft_length = stats.draft_tokens - drafted_before
            accepted = stats.accepted_tokens - accepted_before
            emitted = len(generated) - emitted_before
            draft_wait = rpcs.seconds.get("Propose", 0.0)
            verify_wait = rpcs.seconds.get("Verify", 0.0)
            accept = max(0.0, now - started - draft_wait - verify_wait)
            cache = None  # the draft's speculation cache: "hit", "miss", or None when this round asked nothing of it
            if stats.draft_cache_lookups > cache_lookups_before:
                cache = "hit" if stats.draft_cache_hits > cache_hits_before else "miss"
            if span.is_recording():
                span.set_attributes(
                    {
                        "specd.draft.length": draft_length,
                        "specd.round.passes": stats.target_passes - passes_before,  # > 1: a plain call's several (plain_steps)
                        "specd.round.lookup": stats.lookup_rounds > lookups_before,
                        "specd.round.heads": stats.head_rounds > heads_before,
                        "specd.round.tree": stats.tree_rounds > trees_before,
                        "specd.round.forced": stats.forced_rounds > forced_before,
                        "specd.round.rested": stats.rested_rounds > rested_before,
                        "specd.accepted.length": accepted,
                        "specd.round.expected_tokens": stats.predicted_tokens - predicted_before,
                        "specd.emitted.length": emitted,
                        "specd.round.bonus": accepted == draft_length,
                        "specd.round.corrected": accepted < draft_length,
                        "specd.acceptance_rate_so_far": stats.accepted_tokens / max(1, stats.draft_tokens),
                        "specd.time.draft_wait_ms": draft_wait * 1e3,
                        "specd.time.verify_wait_ms": verify_wait * 1e3,
                        "specd.time.accept_ms": accept * 1e3,
                    }
                )
                if cache:
                    span.set_attribute("specd.draft.cache", cache)
                if chunk.finish_reason:
                    span.set_attribute("specd.finish_reason", chunk.finish_reason)
        self.rounds += 1
        self.finish_reason = chunk.finish_reason or self.finish_reason
        if self.metrics is not None:
            self._count(draft_length, accepted, emitted, draft_wait, verify_wait, accept, now, stats.target_passes - passes_before)
            if cache:
                self.metrics.draft_cache_wait.labels(cache).observe(draft_wait)
            if stats.rested_rounds > rested_before:
                self.metrics.rested_rounds.inc()
            if stats.forced_rounds > forced_before:
                self.metrics.forced_rounds.inc()
                self.metrics.forced_tokens.inc(stats.forced_tokens - forced_tokens_before)
        return chunk

    def _count(self, draft_length, accepted, emitted, draft_wait, verify_wait, accept, now, passes) -> None:
        metrics = self.metrics
        metrics.count_round(draft_length, accepted, tokens_by_pass(emitted, passes))
        metrics.draft_wait_seconds.observe(draft_wait)
        metrics.verify_wait_seconds.observe(verify_wait)
        metrics.accept_seconds.observe(accept)
        if emitted:
            if self._last_emit is None:
                metrics.time_to_first_token.observe(now - self.started)
            else:
                per_token = (now - self._last_emit) / emitted
                for _ in range(emitted):
                    metrics.inter_token_latency.observe(per_token)
            self._last_emit = now

    def finish(self) -> None:
        """Record usage and the finish reason; called once on every exit path of Generation.run."""
        if not self.active or self._finished:
            return
        self._finished = True
        generation = self.generation
        reason = self.finish_reason or ("error" if self.failed else "cancelled")
        if self.span.is_recording():
            stats = generation.stats
            self.span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": len(generation.spec.prompt_ids),
                    "gen_ai.usage.output_tokens": len(generation.generated),
                    "gen_ai.response.finish_reasons": [reason],
                    "specd.target_passes": stats.target_passes,
                    "specd.draft_tokens": stats.draft_tokens,
                    "specd.accepted_tokens": stats.accepted_tokens,
                    "specd.acceptance_rate": stats.accepted_tokens / max(1, stats.draft_tokens),
                    "specd.tokens_per_target_pass": len(generation.generated) / max(1, stats.target_passes),
                }
            )
        if self.metrics is not None:
            self.metrics.active_generations.dec()
            self.metrics.prompt_tokens.inc(len(generation.spec.prompt_ids))
            self.metrics.generation_tokens.inc(len(generation.generated))
            self.metrics.finished.labels(reason).inc()


def request_attributes(generation: ObservedGeneration) -> dict:
    """GenAI request attributes (and specd's request settings) for the gateway's server span."""
    spec, backends = generation.spec, generation.backends
    attributes = {
        "gen_ai.operation.name": OPERATION,
        "gen_ai.request.model": backends.target_info.model_name,
        "gen_ai.request.max_tokens": spec.max_new_tokens,
        "gen_ai.request.temperature": spec.warp.temperature,
        "gen_ai.request.top_p": spec.warp.top_p,
        "gen_ai.request.seed": spec.seed,
        "specd.request_id": generation.request_id,
        "specd.speculate": generation.speculate,
        "specd.num_draft_tokens": spec.num_draft_tokens,
    }
    if spec.warp.top_k:
        attributes["gen_ai.request.top_k"] = spec.warp.top_k
    if spec.stop:
        attributes["gen_ai.request.stop_sequences"] = list(spec.stop)
    if generation.speculate and backends.draft_info is not None:
        attributes["specd.draft.model"] = backends.draft_info.model_name
        attributes["specd.drafter"] = backends.draft_info.drafter
    return attributes
