"""`specd bench`: the same prompts through target-only, specd, and in-process transformers baselines.

Modes (keys of the JSON report):
  target_only   the services with speculation off (one target pass per token)
  specd         speculation on, adaptive draft length, the drafter `specd up` would choose here (with
                no CUDA and shipped Medusa heads: a gateway with no draft service, the heads draft)
  specd_<drafter>  the draft service's stack (specd_feature for the default target) under the same
                policy, when specd runs on the heads; specd_k<N> uses that draft service too
  specd_k<N>    speculation on with a fixed k = N (each N in --fixed-k), to compare with adaptive
  specd_tree<B> adaptive, trees of up to B candidates a position from specd's own drafter (each B
                in --branches; specd itself uses the gateway's default, 4; B = 1: chains only): the
                heads' best chain with their next candidates beside it where the heads draft, else
                the draft service's
  specd_overlap / specd_medusa   second gateways: overlapped drafting; no draft service (--medusa)
  specd_heads_<NAME>  the default request on a verify serving other Medusa heads (--heads NAME=DIR),
                behind a gateway with no draft service: heads of different runs through the services
  hf_target     transformers `generate`, the target alone, in this process
  hf_assisted   transformers `generate` with the same kind of draft: the same draft model, or its
                prompt-lookup assistant for the n-gram drafter
Greedy, or with --temperature every mode samples at the same temperature and top-p. Reports tokens/s, speedup (services modes over target_only, hf modes over hf_target),
acceptance overall and per draft position, tokens per target pass against (1 − α^(k+1)) / (1 − α),
time to first token, p50/p95 inter-token latency, bytes on the wire per round and the share of a
round spent outside the two models; overall and per task kind (the prompt file's `category`).
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections import defaultdict
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import grpc

from gateway.rejection import expected_tokens_per_pass
from specd.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from specd_common.params import Warp

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One prompt through one mode."""

    category: str
    tokens: int
    seconds: float
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # per token, from the gaps between streamed chunks
    stats: Optional[generate_pb2.SpeculationStats] = None


def load_prompts(path: str, limit: int) -> list[dict]:
    """The first `limit` rows of a JSONL prompt file (id, category, prompt)."""
    rows = []
    with open(path) as lines:
        for line in lines:
            if len(rows) >= limit:
                break
            rows.append(json.loads(line))
    return rows


def stream_one(stub, row: dict, max_new_tokens: int, **fields) -> Sample:
    """One streamed request; timestamps give time to first token and inter-token latency."""
    request = generate_pb2.GenerateRequest(text=row["prompt"], max_new_tokens=max_new_tokens, **fields)
    sample = Sample(category=row.get("category", "all"), tokens=0, seconds=0.0)
    started = last = time.perf_counter()
    for message in stub.GenerateStream(request, timeout=900):
        now = time.perf_counter()
        if message.token_ids:
            if sample.tokens == 0:
                sample.ttft_s = now - started
            else:
                sample.itl_s += [(now - last) / len(message.token_ids)] * len(message.token_ids)
            sample.tokens += len(message.token_ids)
            last = now
        if message.finish_reason:
            sample.stats = message.stats
    sample.seconds = time.perf_counter() - started
    return sample


def run_service_mode(address: str, rows: list[dict], max_new_tokens: int, concurrency: int, progress, **fields) -> tuple[list[Sample], float]:
    """All rows through the gateway with `concurrency` streams at a time; returns samples and wall seconds."""
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        stream_one(stub, rows[0], 8, **fields)  # warm-up, not counted: first-call allocations, caches
        started = time.perf_counter()
        with futures.ThreadPoolExecutor(concurrency) as pool:
            calls = [pool.submit(stream_one, stub, row, max_new_tokens, **fields) for row in rows]
            samples = []
            for call in futures.as_completed(calls):
                samples.append(call.result())
                progress()
        return samples, time.perf_counter() - started


@dataclass(frozen=True)
class Sampling:
    """How every mode of a bench run picks tokens: greedy or sampled as `warp` says. A seed makes each
    prompt's sample reproducible, but it also fixes the gateway's draft length (a seeded request gets
    DRAFT_LENGTH_POLICY_FIXED by default), so by default there is none, as for most users."""

    warp: Warp = Warp()
    seed: Optional[int] = None

    def request_fields(self) -> dict:
        """GenerateRequest fields: none when greedy (the gateway's default)."""
        if self.warp.greedy:
            return {}
        seed = {} if self.seed is None else {"seed": self.seed}
        return {"sampling": self.warp.to_proto(common_pb2.SamplingParams), **seed}

    def generate_kwargs(self) -> dict:
        """transformers `generate` arguments for the same choice."""
        if self.warp.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.warp.temperature, "top_p": self.warp.top_p, "top_k": self.warp.top_k}


class HFRunner:
    """transformers `generate` in this process, one prompt at a time (greedy, or sampled as `sampling`
    says): the target alone, or assisted (k > 0) by the draft model (draft_spec) or,
    without one, by transformers' prompt lookup."""

    def __init__(self, target_spec: str, draft_spec: str, warm_prompt: str, sampling: Sampling = Sampling()):
        import torch

        from gateway.tokenizer import GatewayTokenizer
        from specd_common.models import describe_model, load_causal_lm

        self.torch = torch
        self.sampling = sampling
        self.loaded = load_causal_lm(target_spec)
        self.tokenizer = GatewayTokenizer(describe_model(self.loaded))
        self.assistant = load_causal_lm(draft_spec).model if draft_spec else None
        for k in (None, 3):  # warm-up, not counted
            self.run({"prompt": warm_prompt}, 8, k)

    def run(self, row: dict, max_new_tokens: int, k: Optional[int]) -> Sample:
        extra: dict = {}
        if k and self.assistant is not None:
            self.assistant.generation_config.num_assistant_tokens = k
            self.assistant.generation_config.num_assistant_tokens_schedule = "constant"
            extra = {"assistant_model": self.assistant}
        elif k:
            extra = {"prompt_lookup_num_tokens": k}
        ids = self.torch.tensor([self.tokenizer.encode_prompt(row["prompt"], raw=False)])
        if self.sampling.seed is not None:
            self.torch.manual_seed(self.sampling.seed)
        started = time.perf_counter()
        with self.torch.inference_mode():
            out = self.loaded.model.generate(ids, max_new_tokens=max_new_tokens, **self.sampling.generate_kwargs(), **extra)
        return Sample(category=row.get("category", "all"), tokens=out.shape[1] - ids.shape[1], seconds=time.perf_counter() - started)


def run_interleaved(modes: dict[str, Callable[[dict], Sample]], rows: list[dict], progress) -> dict[str, tuple[list[Sample], float]]:
    """Every row through every mode before the next row, the order rotated from row to row, so a slow
    spell of a shared machine (seen here: ±15% within minutes) hits all modes alike and the modes are
    compared side by side. Wall seconds of a mode = the sum of its samples (one stream at a time)."""
    names = list(modes)
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for index, row in enumerate(rows):
        for name in names[index % len(names):] + names[: index % len(names)]:
            progress.stage(name)
            samples[name].append(modes[name](row))
            progress()
    return {name: (done, sum(sample.seconds for sample in done)) for name, done in samples.items()}


def summarize(samples: Iterable[Sample], k: int, wall_s: Optional[float] = None) -> dict:
    samples = list(samples)
    tokens = sum(s.tokens for s in samples)
    seconds = wall_s if wall_s is not None else sum(s.seconds for s in samples)
    summary = {"prompts": len(samples), "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)}
    stats = [s.stats for s in samples if s.stats is not None]
    passes = sum(s.target_passes for s in stats)
    if passes:
        drafted = sum(s.draft_tokens for s in stats)
        accepted = sum(s.accepted_tokens for s in stats)
        examined = accepted + sum(s.rejected_rounds for s in stats)
        alpha = accepted / examined if examined else 0.0  # per-token acceptance, as in the formula
        round_s = sum(s.round_seconds for s in stats)
        summary.update(
            acceptance_rate=round(accepted / drafted, 4) if drafted else 0.0,
            alpha=round(alpha, 4),
            drafts_per_pass=round(drafted / passes, 3),
            tokens_per_target_pass=round(tokens / passes, 3),
            predicted_tokens_per_pass=round(expected_tokens_per_pass(alpha, round(drafted / passes)), 3),
            mean_accepted_per_round=round(accepted / passes, 3),
            acceptance_per_position=_per_position(stats),
            wire_bytes_per_round=round(sum(s.wire_bytes for s in stats) / passes),
            round_ms=round(1000 * round_s / passes, 2),
            draft_model_ms_per_round=round(1000 * sum(s.draft_model_seconds for s in stats) / passes, 2),
            verify_model_ms_per_round=round(1000 * sum(s.model_seconds - s.draft_model_seconds for s in stats) / passes, 2),
            outside_models_share=round(1 - sum(s.model_seconds for s in stats) / round_s, 4) if round_s else None,
            lookup_round_share=round(sum(s.lookup_rounds for s in stats) / passes, 4),
            head_round_share=round(sum(s.head_rounds for s in stats) / passes, 4),
            tree_round_share=round(sum(s.tree_rounds for s in stats) / passes, 4),
        )
    lookaheads = sum(s.lookahead_rounds for s in stats)
    if lookaheads:
        summary["lookahead_hit_rate"] = round(sum(s.lookahead_hits for s in stats) / lookaheads, 4)
    if any(s.ttft_s for s in samples):
        summary["ttft_ms_p50"] = round(1000 * statistics.median(s.ttft_s for s in samples), 1)
    gaps = sorted(g for s in samples for g in s.itl_s)
    if gaps:
        summary["itl_ms_p50"] = round(1000 * gaps[len(gaps) // 2], 1)
        summary["itl_ms_p95"] = round(1000 * gaps[min(len(gaps) - 1, int(0.95 * len(gaps)))], 1)
    return summary


def _per_position(stats: list) -> list[float]:
    """Acceptance rate of the i-th draft of a round, given that it was proposed."""
    width = max((len(s.draft_tokens_per_position) for s in stats), default=0)
    drafted, accepted = [0] * width, [0] * width
    for s in stats:
        for i, (d, a) in enumerate(zip(s.draft_tokens_per_position, s.accepted_tokens_per_position)):
            drafted[i] += d
            accepted[i] += a
    return [round(a / d, 4) if d else 0.0 for d, a in zip(drafted, accepted)]


def report(results: dict[str, tuple[list[Sample], float]], k: int) -> dict:
    """JSON report: per mode, overall and per task kind, with speedups."""
    out: dict = {"k": k, "modes": {}}
    for mode, (samples, wall_s) in results.items():
        by_kind = defaultdict(list)
        for sample in samples:
            by_kind[sample.category].append(sample)
        out["modes"][mode] = {
            "overall": summarize(samples, k, wall_s),
            "by_category": {c: summarize(s, k) for c, s in sorted(by_kind.items())},
        }
    for mode, entry in out["modes"].items():
        reference = out["modes"].get("hf_target" if mode.startswith("hf_") else "target_only")
        if reference:
            entry["overall"]["speedup"] = round(entry["overall"]["tokens_per_s"] / reference["overall"]["tokens_per_s"], 3)
            for kind, summary in entry["by_category"].items():
                base = reference["by_category"].get(kind, {}).get("tokens_per_s")
                if base:
                    summary["speedup"] = round(summary["tokens_per_s"] / base, 3)
    hf = out["modes"].get("hf_target")
    for entry in out["modes"].values():  # what a user compares with: transformers generate in-process, same cores
        if hf:
            entry["overall"]["vs_hf_target"] = round(entry["overall"]["tokens_per_s"] / hf["overall"]["tokens_per_s"], 3)
    overlap = out["modes"].get("specd_overlap", {}).get("overall", {})
    sequential = out["modes"].get(f"specd_k{k}", out["modes"].get("specd", {})).get("overall", {})
    if "lookahead_hit_rate" in overlap and "round_ms" in sequential:
        out["overlap_model"] = overlap_on_separate_devices(sequential, overlap["lookahead_hit_rate"])
    return out


def add_repeat_spread(report: dict, tokens_per_s_by_repeat: dict[str, list[float]]) -> None:
    """Each service mode's speedup over target_only within each repeat (the modes run side by side in
    a repeat, in order then reversed): the run-to-run spread a single ratio hides. On a 2-core VM one
    configuration measured 1.103 and 0.982 at 4 streams in two runs (docs/benchmarks/HISTORY.md)."""
    reference = tokens_per_s_by_repeat.get("target_only")
    if not reference or len(reference) < 2:
        return
    for mode, rates in tokens_per_s_by_repeat.items():
        entry = report["modes"].get(mode)
        if entry is not None and len(rates) == len(reference):
            entry["overall"]["tokens_per_s_by_repeat"] = [round(rate, 2) for rate in rates]
            entry["overall"]["speedup_by_repeat"] = [round(rate / base, 3) for rate, base in zip(rates, reference)]


def overlap_on_separate_devices(sequential: dict, hit_rate: float) -> dict:
    """What overlap would give with draft and target on their own devices, from measured step times:
    a round whose look-ahead hit hides the draft's time behind the target's (when the draft is faster),
    and a round that missed costs what a sequential round costs."""
    round_ms, draft_ms = sequential["round_ms"], sequential["draft_model_ms_per_round"]
    hidden_ms = hit_rate * min(draft_ms, sequential["verify_model_ms_per_round"])
    return {
        "lookahead_hit_rate": hit_rate,
        "sequential_round_ms": round_ms,
        "draft_ms_per_round": draft_ms,
        "modeled_round_ms": round(round_ms - hidden_ms, 2),
        "modeled_speedup_over_sequential": round(round_ms / (round_ms - hidden_ms), 3),
    }


def machine_facts() -> dict:
    """Where a report was measured: CPU model, cores, memory, GPU, library versions, date."""
    import os
    import platform

    import torch

    facts = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu": platform.processor() or platform.machine(),
             "logical_cpus": os.cpu_count(), "torch": torch.__version__, "torch_default_threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            facts["cpu"] = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
        with open("/proc/meminfo") as meminfo:
            facts["memory_gib"] = round(int(meminfo.readline().split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
    return facts


def emit_report(report: dict, output: str = "") -> None:
    """A measuring script's result: JSON on stdout and, when `output` names a file, in it."""
    import sys
    from pathlib import Path

    text = json.dumps(report, indent=1)
    if output:
        Path(output).write_text(text + "\n")
    sys.stdout.write(text + "\n")


def stack_runtime(addresses: dict) -> dict:
    """The runtime each model service chose at start-up (GetModelInfo.runtime_config), by service name."""
    from specd.v1 import common_pb2, draft_pb2_grpc, verify_pb2_grpc

    stubs = {"verify": verify_pb2_grpc.VerifyServiceStub, "draft": draft_pb2_grpc.DraftServiceStub}
    chosen = {}
    for name, stub_class in stubs.items():
        if name in addresses:
            with grpc.insecure_channel(addresses[name]) as channel:
                info = stub_class(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30)
            chosen[name] = json.loads(info.runtime_config) if info.runtime_config else {}
    return chosen


def speedup_cell(overall: dict) -> str:
    """The speedup, with its range over repeats when there were several ("0.989 (0.95–1.02)")."""
    spread = overall.get("speedup_by_repeat")
    cell = str(overall.get("speedup", "-"))
    return f"{cell} ({min(spread)}–{max(spread)})" if spread else cell


def markdown_table(result: dict) -> str:
    lines = [
        "| mode | tokens/s | speedup | vs hf_target | acceptance | tokens/pass (predicted) | TTFT p50 ms | ITL p50 / p95 ms | bytes/round | outside models |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, entry in result["modes"].items():
        o = entry["overall"]
        per_pass = f"{o['tokens_per_target_pass']} ({o['predicted_tokens_per_pass']})" if "tokens_per_target_pass" in o else "-"
        itl = f"{o['itl_ms_p50']} / {o['itl_ms_p95']}" if "itl_ms_p50" in o else "-"
        outside = f"{100 * o['outside_models_share']:.1f}%" if o.get("outside_models_share") is not None else "-"
        lines.append(
            f"| {mode} | {o['tokens_per_s']} | {speedup_cell(o)} | {o.get('vs_hf_target', '-')} | {o.get('acceptance_rate', '-')} | {per_pass} "
            f"| {o.get('ttft_ms_p50', '-')} | {itl} | {o.get('wire_bytes_per_round', '-')} | {outside} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """PNG: speedup per task kind for each mode, and acceptance per draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    modes = [m for m in result["modes"] if m != "target_only" and m != "hf_target"]
    kinds = sorted({k for m in modes for k in result["modes"][m]["by_category"]})
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        speedups = [result["modes"][mode]["by_category"].get(k, {}).get("speedup", 0) for k in kinds]
        left.bar([x + i * width for x in range(len(kinds))], speedups, width, label=mode)
        per_position = result["modes"][mode]["overall"].get("acceptance_per_position")
        if per_position:
            right.plot(range(1, len(per_position) + 1), per_position, marker="o", label=mode)
    left.axhline(1.0, color="gray", linewidth=0.8)
    left.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(kinds))], kinds)
    left.set_ylabel("speedup over target-only")
    left.set_title("speedup per task kind")
    left.legend(fontsize=8)
    right.set_xlabel("draft position in round")
    right.set_ylabel("acceptance")
    right.set_ylim(0, 1)
    right.set_title("acceptance per draft position")
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


class Progress:
    """A progress bar over all modes' requests (tqdm when stderr is a terminal, log lines otherwise)."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="prompt", desc="bench")
        self._lock = threading.Lock()

    def stage(self, name: str) -> None:
        self._bar.set_description(f"bench {name}")

    def __call__(self) -> None:
        with self._lock:
            self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
