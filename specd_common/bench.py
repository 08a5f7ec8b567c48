"""`specd bench`: the same prompts through target-only, specd, and in-process transformers baselines.

Modes: target_only (the services with speculation off), specd (speculation on), hf_target
(transformers generate, target alone) and hf_assisted (transformers generate with the same kind of
draft: prompt lookup for the n-gram drafter). Greedy, one stream at a time. Reports tokens/s,
speedup over target-only, acceptance, tokens per target pass against (1 - α^(k+1)) / (1 - α),
time to first token and inter-token latency, overall and per task kind.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

import grpc

from gateway.rejection import expected_tokens_per_pass
from specd.v1 import generate_pb2, generate_pb2_grpc


@dataclass
class Sample:
    """One prompt through one mode."""

    category: str
    tokens: int
    seconds: float
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed chunks, per token
    target_passes: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


def load_prompts(path: str, limit: int) -> list[dict]:
    """The first `limit` rows of a JSONL prompt file (id, category, prompt)."""
    rows = []
    with open(path) as lines:
        for line in lines:
            if len(rows) >= limit:
                break
            rows.append(json.loads(line))
    return rows


def run_service_mode(address: str, rows: list[dict], max_new_tokens: int, speculate: bool, k: int) -> list[Sample]:
    """Stream each prompt through the gateway; time the first token and the gaps between chunks."""
    samples = []
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for row in rows:
            request = generate_pb2.GenerateRequest(
                text=row["prompt"], max_new_tokens=max_new_tokens, disable_speculation=not speculate, num_draft_tokens=k
            )
            started = last = time.perf_counter()
            sample = Sample(category=row.get("category", "all"), tokens=0, seconds=0.0)
            for message in stub.GenerateStream(request, timeout=600):
                now = time.perf_counter()
                if sample.tokens == 0:
                    sample.ttft_s = now - started
                elif message.token_ids:
                    sample.itl_s += [(now - last) / len(message.token_ids)] * len(message.token_ids)
                sample.tokens += len(message.token_ids)
                last = now
                if message.finish_reason:
                    sample.target_passes = message.stats.target_passes
                    sample.draft_tokens = message.stats.draft_tokens
                    sample.accepted_tokens = message.stats.accepted_tokens
            sample.seconds = time.perf_counter() - started
            samples.append(sample)
    return samples


def run_hf_mode(target_spec: str, rows: list[dict], max_new_tokens: int, prompt_lookup: Optional[int]) -> list[Sample]:
    """transformers generate in this process, greedy; prompt_lookup=k uses its prompt-lookup assistant."""
    import torch

    from gateway.tokenizer import GatewayTokenizer
    from specd_common.models import describe_model, load_causal_lm

    loaded = load_causal_lm(target_spec)
    tokenizer = GatewayTokenizer(describe_model(loaded))
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    samples = []
    for row in rows:
        ids = torch.tensor([tokenizer.encode_prompt(row["prompt"], raw=False)])
        started = time.perf_counter()
        with torch.inference_mode():
            out = loaded.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **extra)
        seconds = time.perf_counter() - started
        samples.append(Sample(category=row.get("category", "all"), tokens=out.shape[1] - ids.shape[1], seconds=seconds))
    return samples


def summarize(samples: Iterable[Sample], k: int) -> dict:
    samples = list(samples)
    tokens = sum(s.tokens for s in samples)
    seconds = sum(s.seconds for s in samples)
    drafts = sum(s.draft_tokens for s in samples)
    accepted = sum(s.accepted_tokens for s in samples)
    passes = sum(s.target_passes for s in samples)
    gaps = sorted(g for s in samples for g in s.itl_s)
    summary = {"prompts": len(samples), "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)}
    if passes:
        alpha = accepted / drafts if drafts else 0.0
        summary.update(
            acceptance_rate=round(alpha, 4),
            tokens_per_target_pass=round(tokens / passes, 3),
            predicted_tokens_per_pass=round(expected_tokens_per_pass(alpha, k), 3) if drafts else 1.0,
            mean_accepted_per_round=round(accepted / passes, 3),
        )
    if any(s.ttft_s for s in samples):
        summary["ttft_ms_p50"] = round(1000 * statistics.median(s.ttft_s for s in samples), 1)
    if gaps:
        summary["itl_ms_p50"] = round(1000 * gaps[len(gaps) // 2], 1)
        summary["itl_ms_p95"] = round(1000 * gaps[min(len(gaps) - 1, int(0.95 * len(gaps)))], 1)
    return summary


def report(results: dict[str, list[Sample]], k: int) -> dict:
    """JSON report: per mode, overall and per task kind, with speedup over target_only."""
    out: dict = {"k": k, "modes": {}}
    for mode, samples in results.items():
        by_kind = defaultdict(list)
        for sample in samples:
            by_kind[sample.category].append(sample)
        out["modes"][mode] = {"overall": summarize(samples, k), "by_category": {c: summarize(s, k) for c, s in by_kind.items()}}
    base = out["modes"].get("target_only", {}).get("overall", {}).get("tokens_per_s")
    hf_base = out["modes"].get("hf_target", {}).get("overall", {}).get("tokens_per_s")
    for mode, entry in out["modes"].items():
        reference = hf_base if mode.startswith("hf_") else base
        if reference:
            entry["overall"]["speedup"] = round(entry["overall"]["tokens_per_s"] / reference, 3)
    return out


def markdown_table(result: dict) -> str:
    lines = [
        "| mode | tokens/s | speedup | acceptance | tokens/pass (predicted) | TTFT p50 ms | ITL p50 / p95 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, entry in result["modes"].items():
        o = entry["overall"]
        per_pass = f"{o['tokens_per_target_pass']} ({o['predicted_tokens_per_pass']})" if "tokens_per_target_pass" in o else "-"
        itl = f"{o['itl_ms_p50']} / {o['itl_ms_p95']}" if "itl_ms_p50" in o else "-"
        lines.append(
            f"| {mode} | {o['tokens_per_s']} | {o.get('speedup', '-')} | {o.get('acceptance_rate', '-')} | {per_pass} "
            f"| {o.get('ttft_ms_p50', '-')} | {itl} |"
        )
    return "\n".join(lines)
