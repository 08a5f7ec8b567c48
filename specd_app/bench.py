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
  <mode>_cache / <mode>_nocache   the draft service's modes with its speculation cache switched (--cache-ab)
  specd_medusa  a second gateway with no draft service (--medusa)
  specd_heads_<NAME>  the default request on a verify serving other Medusa heads (--heads NAME=DIR),
                behind a gateway with no draft service: heads of different runs through the services
  hf_target     transformers `generate`, the target alone, in this process
  hf_assisted   transformers `generate` with the same kind of draft: the same draft model, or its
                prompt-lookup assistant for the n-gram drafter
  llamacpp_target / llamacpp_lookup   llama.cpp on the target's own GGUF, alone and with its prompt
                lookup (k = --num-draft-tokens), where llama-cpp-python is installed (`make setup-llama-cpp`)
Greedy, or with --temperature every mode samples at the same temperature and top-p. Reports tokens/s, speedup (services modes over target_only, hf and llamacpp modes over their engine alone),
acceptance overall and per draft position, tokens per target pass against (1 − α^(k+1)) / (1 − α),
time to first token, p50/p95 inter-token latency, bytes on the wire per round and the share of a
round spent outside the two models; overall and per task kind (the prompt file's `category`).

Many users at once (issue 43), through the service modes:
  --concurrency N --sequential-too   each mode one request at a time and N at once (`scaling`):
                throughput, TTFT and ITL of both, their ratio, and how close N at once comes to all
                prefills + batched decoding (`prefill_bound`); long prompts in
                docs/benchmarks/long_prompts.jsonl (specd_app/long_prompts.py builds it)
  --arrival     K streams decode; a ~2,000-token prompt arrives; the streams' ITL before it and
                during its prefill (`run_arrival`, `arrival_report`)
Issue 43's measurements (local stack of `specd up`'s defaults; add --output FILE to save a report):
  specd bench --prompts docs/benchmarks/heldout_prompts.jsonl docs/benchmarks/fresh_prompts.jsonl --limit 8 \
      --max-new-tokens 64 --concurrency 8 --sequential-too --repeats 2 --no-hf      (then --concurrency 16)
  specd bench --prompts docs/benchmarks/long_prompts.jsonl --limit 8 --max-new-tokens 64 \
      --concurrency 8 --sequential-too --repeats 2 --no-hf                         (then --max-new-tokens 256)
  specd bench --prompts docs/benchmarks/heldout_prompts.jsonl --limit 4 --max-new-tokens 256 --arrival --repeats 2
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
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
    prompt_id: str = ""
    started: float = 0.0  # time.perf_counter() when the request was sent
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens) of each streamed chunk
    prompt_tokens: int = 0  # the gateway's count (chat template included), from the last message's usage


def load_prompts(path: str, limit: int) -> list[dict]:
    """The first `limit` rows of a JSONL prompt file (id, category, prompt); a row without an id gets
    FILE-N (per-prompt results, such as each prompt's prefill, are keyed by it)."""
    rows = []
    with open(path) as lines:
        for index, line in enumerate(lines):
            if len(rows) >= limit:
                break
            rows.append({"id": f"{Path(path).stem}-{index}", **json.loads(line)})
    return rows


def longest_prompt(path: str) -> dict:
    """The row of a prompt file with the longest prompt (in characters): `--arrival`'s long prompt."""
    return max(load_prompts(path, limit=sys.maxsize), key=lambda row: len(row["prompt"]))


def schema_constraint(path: str) -> dict:
    """GenerateRequest fields that constrain every answer to the JSON Schema in a file (`--json-schema`)."""
    with open(path) as schema:
        return {"constraint": generate_pb2.OutputConstraint(json_schema=json.dumps(json.load(schema)))}


def stream_one(stub, row: dict, max_new_tokens: int, on_tokens: Optional[Callable[[Sample], None]] = None, **fields) -> Sample:
    """One streamed request; timestamps give time to first token and inter-token latency. on_tokens
    is called with the sample after each chunk of tokens (`--arrival` waits on it)."""
    request = generate_pb2.GenerateRequest(text=row["prompt"], max_new_tokens=max_new_tokens, **fields)
    sample = Sample(category=row.get("category", "all"), tokens=0, seconds=0.0, prompt_id=row.get("id", ""))
    started = last = sample.started = time.perf_counter()
    for message in stub.GenerateStream(request, timeout=900):
        now = time.perf_counter()
        if message.token_ids:
            if sample.tokens == 0:
                sample.ttft_s = now - started
            else:
                sample.itl_s += [(now - last) / len(message.token_ids)] * len(message.token_ids)
            sample.tokens += len(message.token_ids)
            sample.chunks.append((now, len(message.token_ids)))
            last = now
            if on_tokens is not None:
                on_tokens(sample)
        if message.finish_reason:
            sample.stats = message.stats
            sample.prompt_tokens = message.usage.prompt_tokens
    sample.seconds = time.perf_counter() - started
    return sample


def run_service_mode(address: str, rows: list[dict], max_new_tokens: int, concurrency: int, progress,
                     children: Optional[dict] = None, cpu: Optional[dict[str, float]] = None,
                     **fields) -> tuple[list[Sample], float]:
    """All rows through the gateway with `concurrency` streams at a time; returns samples and wall seconds.
    With `cpu`, adds to it the CPU seconds each of `children` (name → Popen) and this process used over
    the same timed window as the wall seconds (cpu_snapshot; the warm-up is in neither)."""
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        stream_one(stub, rows[0], 8, **fields)  # warm-up, not counted: first-call allocations, caches
        before = cpu_snapshot(children or {}) if cpu is not None else {}
        started = time.perf_counter()
        with futures.ThreadPoolExecutor(concurrency) as pool:
            calls = [pool.submit(stream_one, stub, row, max_new_tokens, **fields) for row in rows]
            samples = []
            for call in futures.as_completed(calls):
                samples.append(call.result())
                progress()
        wall = time.perf_counter() - started
        if cpu is not None:
            add_cpu(cpu, before, cpu_snapshot(children or {}))
        return samples, wall


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

    def __init__(self, target_spec: str, draft_spec: str, warm_prompt: str, sampling: Sampling = Sampling(),
                 device: str = "auto", dtype: str = "auto"):
        """device / dtype: as the services' flags (the verify's device, so both run on the same GPU)."""
        import torch

        from gateway.tokenizer import GatewayTokenizer
        from specd_engine.models import describe_model, load_causal_lm, synchronize

        self.torch, self.synchronize = torch, synchronize
        self.sampling = sampling
        self.loaded = load_causal_lm(target_spec, device, dtype)
        self.tokenizer = GatewayTokenizer(describe_model(self.loaded))
        self.assistant = load_causal_lm(draft_spec, device, dtype).model if draft_spec else None
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
        ids = self.input_ids(row["prompt"])
        if self.sampling.seed is not None:
            self.torch.manual_seed(self.sampling.seed)
        started = time.perf_counter()
        with self.torch.inference_mode():
            out = self.loaded.model.generate(ids, max_new_tokens=max_new_tokens, **self.sampling.generate_kwargs(), **extra)
        self.synchronize(self.loaded.device)  # out's shape is known before its values: the time ends when the device's work does
        return Sample(category=row.get("category", "all"), tokens=out.shape[1] - ids.shape[1], seconds=time.perf_counter() - started)


    def input_ids(self, prompt: str):
        """The prompt's ids [1, n] on the model's device (generate does not move them there)."""
        return self.torch.tensor([self.tokenizer.encode_prompt(prompt, raw=False)], device=self.loaded.device)


class LlamaCppRunner:
    """llama.cpp (the llama-cpp-python package, an optional install: `make setup-llama-cpp`) on the
    target's own GGUF in this process, one prompt at a time: the CPU user's other choice. It runs the
    GGUF's quantized weights with its own kernels, so its tokens are the quantized model's, not
    bit-identical to the services' float32 ones; tokens/s compare what each gives a user of the same
    file. k > 0: llama.cpp's prompt-lookup drafting (LlamaPromptLookupDecoding) with k tokens."""

    def __init__(self, gguf: str, tokenizer, eos_ids: Iterable[int], warm_prompt: str, threads: int,
                 sampling: Sampling = Sampling()):
        """tokenizer: a GatewayTokenizer, so every mode reads the same prompt ids (chat template included)."""
        self.sampling, self.tokenizer, self.eos_ids = sampling, tokenizer, set(eos_ids)
        self.gguf, self.threads = gguf, threads or None  # None: llama.cpp's default, every core
        self._models: dict = {}
        for k in (None, 3):  # warm-up, not counted
            self.run({"prompt": warm_prompt}, 8, k)

    def model(self, k: Optional[int]):
        """The model for k draft tokens, loaded at first use (a Llama's draft is fixed when it loads)."""
        if (k or 0) not in self._models:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self._models[k or 0] = llama_cpp.Llama(
                model_path=self.gguf, n_ctx=4096, n_threads=self.threads, n_threads_batch=self.threads,
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None, verbose=False)
        return self._models[k or 0]

    def run(self, row: dict, max_new_tokens: int, k: Optional[int]) -> Sample:
        llm = self.model(k)
        ids = self.tokenizer.encode_prompt(row["prompt"], raw=False)
        if self.sampling.seed is not None:
            llm.set_seed(self.sampling.seed)
        started = time.perf_counter()
        sample = Sample(category=row.get("category", "all"), tokens=0, seconds=0.0, started=started)
        # reset: no prefix reuse from the last prompt, so every mode prefills every prompt whole
        for token in llm.generate(ids, reset=True, **self.sampler()):
            now = time.perf_counter()
            if sample.tokens:
                sample.itl_s.append(now - sample.chunks[-1][0])
            else:
                sample.ttft_s = now - started
            sample.tokens += 1
            sample.chunks.append((now, 1))
            if token in self.eos_ids or sample.tokens >= max_new_tokens:
                break
        sample.seconds = time.perf_counter() - started
        return sample

    def sampler(self) -> dict:
        """llama.cpp's sampler set to the same choice as the other modes: greedy (top-k 1), or temperature
        and top-p alone (its defaults would add top-k 40, min-p 0.05 and a repeat penalty)."""
        plain = {"min_p": 0.0, "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
        if self.sampling.warp.greedy:
            return {**plain, "top_k": 1, "temp": 0.0}
        return {**plain, "top_k": 0, "temp": self.sampling.warp.temperature, "top_p": self.sampling.warp.top_p}

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
            # what the planner expected its rounds to keep against what they kept (drafts + the
            # recovered/bonus token; the tokens a pass above also lose what EOS and the length cut)
            predicted_tokens_per_pass=round(sum(s.predicted_tokens for s in stats) / passes, 3),
            realized_tokens_per_pass=round((accepted + passes) / passes, 3),
            prediction_standard_error=prediction_standard_error(stats),
            iid_tokens_per_pass=round(expected_tokens_per_pass(alpha, round(drafted / passes)), 3),
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
            forced_round_share=round(sum(s.forced_rounds for s in stats) / passes, 4),  # structured output (--json-schema)
            forced_token_share=round(sum(s.forced_tokens for s in stats) / tokens, 4) if tokens else 0.0,
            rested_round_share=round(sum(s.rested_rounds for s in stats) / passes, 4),  # speculation that lost, resting (gateway/guard.py)
        )
    summary.update(speculation_cache(stats))
    if any(s.ttft_s for s in samples):
        summary["ttft_ms_p50"] = round(1000 * statistics.median(s.ttft_s for s in samples), 1)
        summary["ttft_ms_p95"] = round(1000 * percentile([s.ttft_s for s in samples], 0.95), 1)
    gaps = [g for s in samples for g in s.itl_s]
    if gaps:
        summary["itl_ms_p50"] = round(1000 * percentile(gaps, 0.5), 1)
        summary["itl_ms_p95"] = round(1000 * percentile(gaps, 0.95), 1)
    return summary


def prediction_standard_error(stats: list) -> float:
    """The standard error of realized minus predicted tokens a pass over these answers' rounds: the
    spread of (kept − expected) a round over √rounds. A kind's ~100 rounds keep 1 to 4 tokens each, so
    its realized tokens a pass carry 3-7% of noise at 2 prompts × 64 tokens (docs/design/policy.md); a
    prediction is off only by what exceeds ~2 of these."""
    rounds = sum(s.target_passes for s in stats)
    if rounds < 2:
        return 0.0
    mean = (sum(s.accepted_tokens for s in stats) + rounds - sum(s.predicted_tokens for s in stats)) / rounds
    variance = max(sum(s.predicted_tokens_squared_error for s in stats) / rounds - mean * mean, 0.0)
    return round((variance / (rounds - 1)) ** 0.5, 4)


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank q-quantile (the value at index ⌊q·n⌋ of the sorted values, the last at most)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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
        reference = out["modes"].get(speedup_reference(mode))
        if reference:
            entry["overall"]["speedup"] = round(entry["overall"]["tokens_per_s"] / reference["overall"]["tokens_per_s"], 3)
            for kind, summary in entry["by_category"].items():
                base = reference["by_category"].get(kind, {}).get("tokens_per_s")
                if base:
                    summary["speedup"] = round(summary["tokens_per_s"] / base, 3)
    for baseline in ("hf_target", "llamacpp_target"):  # what a user runs instead: in-process, on the same cores
        if (base := out["modes"].get(baseline)) is not None:
            for entry in out["modes"].values():
                entry["overall"][f"vs_{baseline}"] = round(entry["overall"]["tokens_per_s"] / base["overall"]["tokens_per_s"], 3)
    return out


def speedup_reference(mode: str) -> str:
    """The mode a mode's speedup is over: its own engine without drafts (the services' target_only,
    transformers' hf_target, llama.cpp's llamacpp_target)."""
    for prefix in ("hf_", "llamacpp_"):
        if mode.startswith(prefix):
            return f"{prefix}target"
    return "target_only"


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


def cpu_seconds(pid: int) -> Optional[float]:
    """CPU seconds (user + system, all threads) process `pid` has used so far, from /proc/<pid>/stat;
    None where there is no /proc (not Linux) or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14 and 15)


def cpu_snapshot(children: dict) -> dict[str, float]:
    """CPU seconds so far of each child service (name → Popen) and of this process ("client": the
    bench's streams, their gRPC and its parsing): taken around a run, they say which process kept how
    many cores busy (cores_by_process)."""
    snapshot = {name: seconds for name, process in children.items() if (seconds := cpu_seconds(process.pid)) is not None}
    snapshot["client"] = sum(os.times()[:2])
    return snapshot


def add_cpu(total: dict[str, float], before: dict[str, float], after: dict[str, float]) -> None:
    """Add each process's CPU seconds between two cpu_snapshot()s into `total`."""
    for name in after.keys() & before.keys():
        total[name] = total.get(name, 0.0) + after[name] - before[name]


def add_cores(report: dict, cpu_by_mode: dict[str, dict[str, float]], results: dict[str, tuple[list[Sample], float]]) -> None:
    """Each service mode's cores kept busy by process over its runs (CPU seconds over the wall seconds
    of its `results`, as `report` takes them), busiest first, and their sum: on a CPU the stack shares
    the cores it measures, so whether a mode is bound by one process (the verify's model thread) or
    leaves cores idle is read here."""
    for mode, cpu in cpu_by_mode.items():
        entry, wall = report["modes"].get(mode), results.get(mode, ([], 0.0))[1]
        if entry is None or wall <= 0:
            continue
        cores = {name: round(seconds / wall, 2) for name, seconds in sorted(cpu.items(), key=lambda item: -item[1])}
        entry["overall"]["cores_by_process"] = cores
        entry["overall"]["cores"] = round(sum(cores.values()), 2)


def cores_cell(summary: dict) -> str:
    """The verify's cores and all the stack's (with the bench's client), or '-' where not measured."""
    if "cores" not in summary:
        return "-"
    return f"{summary['cores_by_process'].get('verify', 0.0)} / {summary['cores']}"


def speculation_cache(stats: list) -> dict:
    """The draft's speculation cache over these requests: its hit rate, and the gateway's mean wait for a
    Propose on a hit and on a miss (a hit's is one round trip; a miss's, a draft's k steps besides)."""
    lookups, hits = sum(s.draft_cache_lookups for s in stats), sum(s.draft_cache_hits for s in stats)
    if not lookups:
        return {}
    hit_wait = sum(s.draft_cache_hit_wait_seconds for s in stats)
    miss_wait = sum(s.draft_cache_lookup_wait_seconds for s in stats) - hit_wait
    out = {"draft_cache_hit_rate": round(hits / lookups, 4), "draft_cache_lookups": lookups}
    if hits:
        out["draft_wait_ms_per_hit"] = round(1000 * hit_wait / hits, 2)
    if lookups > hits:
        out["draft_wait_ms_per_miss"] = round(1000 * miss_wait / (lookups - hits), 2)
    return out


SCALING_KEYS = ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p95", "itl_ms_p50", "itl_ms_p95")


def scaling(sequential: dict, concurrent: dict, sequential_samples: dict[str, list[Sample]], concurrency: int) -> dict:
    """`--sequential-too`: each mode one request at a time and `concurrency` at a time (two `report`s
    of the same prompts), side by side: throughput, TTFT and ITL of both, their ratio (within each
    repeat too), the speedup over target-only at each, and the prefill bound of `prefill_bound`."""
    out = {}
    for mode, entry in concurrent["modes"].items():
        if mode not in sequential["modes"] or mode not in sequential_samples:
            continue
        one, many = sequential["modes"][mode]["overall"], entry["overall"]
        row = {
            "sequential": {key: one[key] for key in SCALING_KEYS if key in one},
            "concurrent": {key: many[key] for key in SCALING_KEYS if key in many},
            "concurrent_over_sequential": round(many["tokens_per_s"] / one["tokens_per_s"], 3),
            "vs_target_only": {"sequential": one.get("speedup"), "concurrent": many.get("speedup")},
            "prefill": prefill_bound(sequential_samples[mode], many, concurrency),
        }
        if "tokens_per_s_by_repeat" in one and "tokens_per_s_by_repeat" in many:
            row["concurrent_over_sequential_by_repeat"] = [
                round(m / o, 3) for m, o in zip(many["tokens_per_s_by_repeat"], one["tokens_per_s_by_repeat"])]
        out[mode] = row
    return {"concurrency": concurrency, "modes": out}


def prefill_bound(alone: list[Sample], concurrent: dict, concurrency: int) -> dict:
    """Issue 43: a long prompt's prefill is compute-bound and cannot be batched away. Each prompt's
    prefill is its TTFT when it ran alone; the best a batching server can do with `concurrency` streams
    is every prefill one after another plus the decoding of each wave of `concurrency` requests at the
    cost of one request's (the weights stream once a pass for all rows):
        bound_s = Σ prefill + ⌈prompts / concurrency⌉ × median decoding time alone.
    `reached` = concurrent tokens/s over the bound's tokens/s (1.0: the concurrent run is that good)."""
    by_prompt = defaultdict(list)
    for sample in alone:
        by_prompt[sample.prompt_id].append(sample)
    prefill_s = {pid: statistics.median(s.ttft_s for s in samples) for pid, samples in by_prompt.items()}
    decode_s = statistics.median(s.seconds - s.ttft_s for s in alone)
    waves = -(-len(by_prompt) // concurrency)
    bound_s = sum(prefill_s.values()) + waves * decode_s
    runs = concurrent["prompts"] / len(by_prompt)  # repeats of the prompt set in the concurrent report
    bound_tokens_per_s = concurrent["tokens"] / runs / bound_s
    prompt_tokens = {pid: samples[0].prompt_tokens for pid, samples in by_prompt.items()}
    return {
        "ms_by_prompt": {pid: round(1000 * seconds, 1) for pid, seconds in prefill_s.items()},
        "prompt_tokens_by_prompt": prompt_tokens,
        "mean_ms": round(1000 * statistics.mean(prefill_s.values()), 1),
        "total_s": round(sum(prefill_s.values()), 3),
        "decode_alone_s_median": round(decode_s, 3),
        "bound_s": round(bound_s, 3),
        "bound_tokens_per_s": round(bound_tokens_per_s, 2),
        "reached": round(concurrent["tokens_per_s"] / bound_tokens_per_s, 3),
    }


ARRIVAL_ITL_RATIO_TARGET = 2.0  # issue 43: running streams' p95 ITL during a long prefill at most 2x before it
ARRIVAL_LONG_NEW_TOKENS = 8  # the long prompt is there for its prefill; a few tokens show its first one


@dataclass
class ArrivalRun:
    """`--arrival`: streams that were decoding when a long prompt arrived, and that prompt."""

    streams: list[Sample]
    long: Sample
    long_alone: Sample  # the same long prompt alone just before: its prefill without load
    arrived: float  # time.perf_counter() when the long prompt was sent

    @property
    def first_token(self) -> float:
        return self.long.started + self.long.ttft_s

    def gaps(self) -> tuple[list[tuple[float, float, int]], list[tuple[float, float, int]]]:
        """The running streams' gaps between chunks, (start, end, tokens), before the long prompt
        arrived (once every stream had its first token: their own prefills are not "before") and
        during its prefill: every gap that overlaps [arrival, its first token], so a stream stalled
        through the whole prefill counts with that one long gap."""
        steady = max(s.started + s.ttft_s for s in self.streams)
        before, during = [], []
        for sample in self.streams:
            for (start, _), (end, tokens) in zip(sample.chunks, sample.chunks[1:]):
                if start >= steady and end <= self.arrived:
                    before.append((start, end, tokens))
                elif start < self.first_token and end > self.arrived:
                    during.append((start, end, tokens))
        return before, during

    def running_through_prefill(self) -> int:
        """Streams that were still emitting after the long prompt's first token."""
        return sum(1 for s in self.streams if s.chunks and s.chunks[-1][0] >= self.first_token)


def run_arrival(stub, short_rows: list[dict], long_row: dict, streams: int, max_new_tokens: int, after_tokens: int,
                progress, **fields) -> ArrivalRun:
    """Issue 43's arrival: `streams` requests (short prompts, `max_new_tokens` each) decode; once each
    has `after_tokens` tokens, `long_row` is sent. Before that, a short warm-up and the long prompt
    alone (its unloaded TTFT)."""
    stream_one(stub, short_rows[0], 8, **fields)  # warm-up, not counted
    long_alone = stream_one(stub, long_row, ARRIVAL_LONG_NEW_TOKENS, **fields)
    emitted = [0] * streams
    changed = threading.Condition()

    def counter(index: int) -> Callable[[Sample], None]:
        def on_tokens(sample: Sample) -> None:
            with changed:
                emitted[index] = sample.tokens
                changed.notify_all()
        return on_tokens

    with futures.ThreadPoolExecutor(streams + 1) as pool:
        running = [pool.submit(stream_one, stub, short_rows[i % len(short_rows)], max_new_tokens, on_tokens=counter(i), **fields)
                   for i in range(streams)]
        for call in running:  # a stream that ends (or fails) early wakes the wait below too
            call.add_done_callback(lambda _: notify(changed))
        with changed:
            changed.wait_for(lambda: min(emitted) >= after_tokens or any(call.done() for call in running), timeout=900)
        arrived = time.perf_counter()
        long = pool.submit(stream_one, stub, long_row, ARRIVAL_LONG_NEW_TOKENS, **fields)
        samples = [call.result() for call in running]
        for _ in samples:
            progress()
        run = ArrivalRun(samples, long.result(), long_alone, arrived)
    progress()
    if run.running_through_prefill() < streams:
        log.warning("only %d of %d streams still ran at the long prompt's first token: raise --max-new-tokens",
                    run.running_through_prefill(), streams)
    return run


def notify(condition: threading.Condition) -> None:
    with condition:
        condition.notify_all()


def gap_summary(gaps: list[tuple[float, float, int]]) -> dict:
    """Per-token inter-token latency of chunk gaps (a gap of n tokens counts n times, as in stream_one)
    and the longest wait between two chunks a client saw."""
    if not gaps:
        return {"gaps": 0}
    per_token = [(end - start) / tokens for start, end, tokens in gaps for _ in range(tokens)]
    return {"gaps": len(gaps), "itl_ms_p50": round(1000 * percentile(per_token, 0.5), 1),
            "itl_ms_p95": round(1000 * percentile(per_token, 0.95), 1),
            "longest_gap_ms": round(1000 * max(end - start for start, end, _ in gaps), 1)}


def arrival_report(runs: list[ArrivalRun]) -> dict:
    """One mode's arrival runs: the running streams' ITL before the long prompt arrived and during its
    prefill (gaps pooled over the runs), the p95 ratio (issue 43: at most ARRIVAL_ITL_RATIO_TARGET)
    pooled and for each run, and the long prompt's TTFT alone and under load."""
    split = [run.gaps() for run in runs]
    before = gap_summary([gap for b, _ in split for gap in b])
    during = gap_summary([gap for _, d in split for gap in d])
    out = {"runs": len(runs), "streams": len(runs[0].streams), "before": before, "during": during,
           "long_prompt_tokens": runs[0].long.prompt_tokens,
           "long_ttft_ms_alone": round(1000 * statistics.median(run.long_alone.ttft_s for run in runs), 1),
           "long_ttft_ms_under_load": round(1000 * statistics.median(run.long.ttft_s for run in runs), 1),
           "streams_running_through_prefill": min(run.running_through_prefill() for run in runs),
           "target_ratio": ARRIVAL_ITL_RATIO_TARGET}
    if before.get("itl_ms_p95") and "itl_ms_p95" in during:
        out["p95_during_over_before"] = round(during["itl_ms_p95"] / before["itl_ms_p95"], 3)
        out["within_target"] = out["p95_during_over_before"] <= ARRIVAL_ITL_RATIO_TARGET
        by_run = [(gap_summary(b), gap_summary(d)) for b, d in split]
        out["p95_during_over_before_by_run"] = [round(d["itl_ms_p95"] / b["itl_ms_p95"], 3) for b, d in by_run
                                                if b.get("itl_ms_p95") and "itl_ms_p95" in d]
    return out


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
        facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        facts["cuda"] = torch.version.cuda
        facts["gpu_driver"] = gpu_driver()
    import transformers

    facts["transformers"] = transformers.__version__
    return facts


def gpu_driver() -> str:
    """The NVIDIA driver's version ('' where nvidia-smi cannot tell)."""
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def emit_report(report: dict, output: str = "") -> None:
    """A measuring script's result: JSON on stdout and, when `output` names a file, in it."""
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


def pricing_line(pricing: dict) -> str:
    """The verify's start-up pass pricing (autotune.pass_pricing) in one line."""
    named = {"sessions_8_x": "8 sessions", "sessions_32_x": "32 sessions", "positions_4_x": "4 positions"}
    parts = [f"{label} {pricing[key]}x" for key, label in named.items() if key in pricing]
    return f"verify pass pricing over one session at one position ({pricing['session_ms']} ms): " + ", ".join(parts)


def speedup_cell(overall: dict) -> str:
    """The speedup, with its range over repeats when there were several ("0.989 (0.95–1.02)")."""
    spread = overall.get("speedup_by_repeat")
    cell = str(overall.get("speedup", "-"))
    return f"{cell} ({min(spread)}–{max(spread)})" if spread else cell


def markdown_table(result: dict) -> str:
    lines = [
        "| mode | tokens/s | speedup | vs hf_target | vs llamacpp_target | acceptance | tokens/pass realized ± SE (planner's prediction) | TTFT p50 ms | ITL p50 / p95 ms | bytes/round | outside models | cores: verify / all |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, entry in result["modes"].items():
        o = entry["overall"]
        per_pass = realized_cell(o)
        itl = f"{o['itl_ms_p50']} / {o['itl_ms_p95']}" if "itl_ms_p50" in o else "-"
        outside = f"{100 * o['outside_models_share']:.1f}%" if o.get("outside_models_share") is not None else "-"
        lines.append(
            f"| {mode} | {o['tokens_per_s']} | {speedup_cell(o)} | {o.get('vs_hf_target', '-')} | {o.get('vs_llamacpp_target', '-')} | {o.get('acceptance_rate', '-')} | {per_pass} "
            f"| {o.get('ttft_ms_p50', '-')} | {itl} | {o.get('wire_bytes_per_round', '-')} | {outside} | {cores_cell(o)} |"
        )
    return "\n".join(lines)


def realized_cell(summary: dict) -> str:
    """Tokens a pass the rounds kept, ± the standard error of their difference from what the planner
    expected (prediction_standard_error), and in brackets what the planner expected them to keep."""
    if "realized_tokens_per_pass" not in summary:
        return "-"
    noise = f" ± {summary['prediction_standard_error']}" if summary.get("prediction_standard_error") else ""
    return f"{summary['realized_tokens_per_pass']}{noise} ({summary['predicted_tokens_per_pass']})"


def kinds_table(result: dict) -> str:
    """Each speculating mode by task kind: speedup over target-only, and tokens a pass realized
    (predicted), so a kind where speculation loses, or where the planner misjudges it, shows."""
    modes = [m for m in result["modes"] if m.startswith("specd")]
    kinds = sorted({k for m in modes for k in result["modes"][m]["by_category"]})
    lines = ["| kind | " + " | ".join(f"{m} speedup | {m} tokens/pass ± SE (predicted)" for m in modes) + " |",
             "|---|" + "---|---|" * len(modes)]
    for kind in kinds:
        cells = []
        for mode in modes:
            summary = result["modes"][mode]["by_category"].get(kind, {})
            cells += [str(summary.get("speedup", "-")), realized_cell(summary)]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pair(one: dict, many: dict, key: str) -> str:
    return f"{one.get(key, '-')} → {many.get(key, '-')}"


def scaling_table(result: dict) -> str:
    """`--sequential-too`: each mode one at a time → N at once, and the prefill bound."""
    scale = result["scaling"]
    n = scale["concurrency"]
    lines = [
        f"| mode | 1 at a time tok/s | {n} at once tok/s | ratio | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms "
        "| vs target-only (1 / N) | prefill mean ms | prefills + batched decode tok/s (reached) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, row in scale["modes"].items():
        one, many, bound = row["sequential"], row["concurrent"], row["prefill"]
        ratio = str(row["concurrent_over_sequential"])
        spread = row.get("concurrent_over_sequential_by_repeat")
        if spread:
            ratio += f" ({min(spread)}–{max(spread)})"
        versus = f"{row['vs_target_only']['sequential'] or '-'} / {row['vs_target_only']['concurrent'] or '-'}"
        lines.append(
            f"| {mode} | {one['tokens_per_s']} | {many['tokens_per_s']} | {ratio} | {pair(one, many, 'ttft_ms_p50')} "
            f"| {pair(one, many, 'ttft_ms_p95')} | {pair(one, many, 'itl_ms_p50')} | {pair(one, many, 'itl_ms_p95')} "
            f"| {versus} | {bound['mean_ms']} | {bound['bound_tokens_per_s']} ({bound['reached']}) |"
        )
    for mode, row in scale["modes"].items():  # each prompt's prefill: its TTFT alone (prompt tokens as the gateway counts)
        bound = row["prefill"]
        each = ", ".join(f"{pid} {ms} ms ({bound['prompt_tokens_by_prompt'][pid]} tokens)" for pid, ms in bound["ms_by_prompt"].items())
        lines.append(f"\n{mode} prefill (TTFT alone): {each}; all {bound['total_s']} s")
    return "\n".join(lines)


def arrival_table(result: dict) -> str:
    """`--arrival`: the running streams' ITL before a long prompt arrived and during its prefill."""
    lines = [
        "| mode | streams | ITL p50 / p95 ms before | ITL p50 / p95 ms during prefill | p95 ratio (by run) "
        f"| ≤ {ARRIVAL_ITL_RATIO_TARGET}x | longest gap ms before / during | long TTFT ms alone / under load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, row in result["arrival"].items():
        before, during = row["before"], row["during"]
        by_run = row.get("p95_during_over_before_by_run", [])
        ratio = f"{row.get('p95_during_over_before', '-')}" + (f" ({', '.join(map(str, by_run))})" if len(by_run) > 1 else "")
        lines.append(
            f"| {mode} | {row['streams_running_through_prefill']}/{row['streams']} "
            f"| {before.get('itl_ms_p50', '-')} / {before.get('itl_ms_p95', '-')} "
            f"| {during.get('itl_ms_p50', '-')} / {during.get('itl_ms_p95', '-')} | {ratio} "
            f"| {'yes' if row.get('within_target') else 'no'} | {before.get('longest_gap_ms', '-')} / {during.get('longest_gap_ms', '-')} "
            f"| {row['long_ttft_ms_alone']} / {row['long_ttft_ms_under_load']} |"
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

    def add(self, count: int) -> None:
        """More requests to run than first counted (modes that turned out to be available)."""
        self._bar.total += count
        self._bar.refresh()

    def stage(self, name: str) -> None:
        self._bar.set_description(f"bench {name}")

    def __call__(self) -> None:
        with self._lock:
            self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
