"""Hardware decides: a model service measures its own forward passes at start-up and picks its runtime.

What is chosen (each overridable by a flag, each logged in one line, each reported by GetModelInfo):
  * threads, per forward size: the fewest torch threads within `THREAD_TOLERANCE` of the fastest
    measured count at that size. On a memory-bound CPU a second thread often buys nothing for a
    decoding step (a 2-core AMD EPYC VM: one step of the default target 63–72 ms on 1 thread, 78–83
    ms on 2) while a verify pass over 4 positions, which has arithmetic to share, gets 1.4x faster
    (110 → 79 ms, tall layout); a thread left idle serves the other processes of the stack (gateway,
    draft, gRPC) instead of fighting them.
  * linear layout per position count: PyTorch's default CPU linear (which repacks the weight on
    every call), the weight prepacked once in oneDNN's layout, or MKL's packed one-row GEMM
    (specd_engine.layouts.SwitchableLinear; on the 2-core AMD EPYC VM: 54 vs 61 ms for a decoding step),
    or "tall": a linear whose weight has more rows than columns (the LM head, the MLP's gate and up)
    computed as W·xᵀ, one stream over the weight for all rows, which on that EPYC scores 4 rows of
    the 49,152-row LM head ~2.5x faster than PyTorch's x·Wᵀ; narrower layers stay plain; "cols":
    the same W·xᵀ for every layer; or "rows": x·Wᵀ from a transposed copy of W, a GEMV over
    contiguous columns, which on that EPYC made a decoding step 45 ms instead of 53.
    Which is faster depends on the CPU and on how many positions a pass scores: on one 2-core AMD
    EPYC prepacking made a 4-position verify pass 1.4x cheaper, on a 2-core Intel Xeon it was a
    40–80% slowdown (shared/notes/cpu-costs-intel.md). Only the layouts that win at some position
    count are kept, and every forward uses the one measured faster for its position count.

The measuring is impure (`measure_forward_costs`); the choosing is a pure function of the timings
(`choose_runtime`), so a test can prove it on fake timings.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Optional, Sequence

from specd_common.config import STARTUP_BUDGET_S
from specd_common.cost_curve import interpolate

PLAIN, PREPACKED, MKL, TALL, COLS, ROWS = "plain", "prepacked", "mkl", "tall", "cols", "rows"
LAYOUTS = (PLAIN, PREPACKED, MKL, TALL, COLS, ROWS)
DENSE_LAYOUTS = frozenset({PLAIN, MKL, TALL, COLS})  # those that read the ordinary weight
# How a model service runs its passes: auto = specd_engine/lean_forward.py where it serves the model and
# agrees with transformers on a start-up probe (11–17% cheaper passes on a 2-core Intel Xeon VM), flat where
# flat_pass.why_not_by_default allows, else ragged; ragged = the lean model, each session's cache its own;
# flat = the lean model in one flat pass over a KV store allocated at start-up (specd_engine/flat_pass.py);
# transformers = its own forward.
FORWARDS = ("auto", "ragged", "flat", "transformers")
# What a flat pass's KV store keeps keys and values as (flat_pass.store_dtype decides auto).
KV_DTYPES = ("auto", "float32", "bfloat16")
MEASURED_POSITIONS = (1, 2, 4, 8)  # forward sizes timed at start-up; others are interpolated
# A prompt chunk's size, timed too where one thread count serves every pass (int4: one_thread_count):
# prompts and batches run on the count rounds chose, and there a second core pays nearly in full.
CHUNK_POSITIONS = 32
# Position counts rounds use: target-only and the one-token probe (1), speculative rounds (k + 1 = 2..5).
ROUND_POSITIONS = (1, 2, 3, 4, 5)
# A verify times batched rounds at start-up with every row scoring 1 position (plain decoding), 4 (k = 3
# drafts, the default cap) and 8 (a long prompt-lookup copy): what the gateway's speculation cap weighs.
BATCH_POSITIONS = (1, 4, 8)
BATCH_CONTEXT = 256  # tokens each timed session holds, like a chat prompt and its answer (a pass packs every row's cache)
# Fewer threads win unless more are at least 10% faster: a spare core serves the gateway, the draft and
# gRPC, and on a shared VM two medians of five passes differ by ~5-10% from noise alone.
THREAD_TOLERANCE = 0.10


# Costs[threads][layout][positions] = median seconds of one forward over that many new positions
Costs = dict[int, dict[str, dict[int, float]]]


@dataclass
class RuntimeChoice:
    """What a model service runs with, and the measurements that chose it."""

    device: str
    threads: int  # for one position (a decoding step); 0 = left as torch's default (not a CPU, or not chosen)
    layouts: dict[int, str] = field(default_factory=dict)  # positions → layout (beyond the last key: the last one)
    threads_by_size: dict[int, int] = field(default_factory=dict)  # positions → threads, when it varies by size
    costs_ms: dict = field(default_factory=dict)  # the measured table, ms, for the record
    source: str = "measured"  # measured | flags | default
    kv_token_budget: int = 0  # positions all sessions may hold (0 = none); see kv_token_budget()
    batch_costs_ms: dict = field(default_factory=dict)  # rows → positions per row → ms of one batched round (verify)
    session_costs_ms: dict = field(default_factory=dict)  # positions → ms of one session's round timed as the batches (pass_pricing)
    heads_product: dict = field(default_factory=dict)  # rows → the Medusa heads' product precision and its timings (verify)
    settled_in_serving: dict = field(default_factory=dict)  # size → what ServingTrials chose there and the medians that chose it
    weights: str = "float"  # the linear products' weights: float as loaded, or int4 (specd_engine/quantized.py)

    def layout_for(self, positions: int) -> str:
        """The layout for a forward over `positions` rows (the nearest measured size at or below)."""
        return by_size(self.layouts, positions, PLAIN)

    def threads_for(self, positions: int) -> int:
        """Torch threads for a forward over `positions` rows (0 = leave them as they are)."""
        return by_size(self.threads_by_size, positions, self.threads)

    def settle(self, size: int, threads: int, layout: str, why: str = "") -> None:
        """Run forwards of exactly `size` positions with (threads, layout) from now on (ServingTrials),
        other sizes as they were; `why` is recorded in settled_in_serving."""
        self.settled_in_serving = {**self.settled_in_serving, size: why or f"{threads} threads ({layout})"}  # a new dict: GetModelInfo may be reading
        all_sizes = sorted(set(sizes()) | {size})
        threads_at = {n: self.threads_for(n) for n in all_sizes}
        layouts = {n: self.layout_for(n) for n in all_sizes}
        threads_at[size], layouts[size] = threads, layout
        self.threads = threads_at[all_sizes[0]]
        self.layouts = compress(layouts)
        per_size = compress(threads_at)
        self.threads_by_size = per_size if len(set(per_size.values())) > 1 else {}

    @property
    def needs(self) -> set[str]:
        """The layouts some forward uses: the weights that must be kept."""
        return set(self.layouts.values()) or {PLAIN}

    def pass_costs_ms(self) -> dict[int, float]:
        """positions → ms of one session's pass at each measured size, at the threads and layout that
        serve it ({} when nothing was measured)."""
        by_size = {n: self.costs_ms.get(self.threads_for(n), {}).get(self.layout_for(n), {}).get(n) for n in sizes()}
        return {n: ms for n, ms in by_size.items() if ms is not None}

    def summary(self) -> str:
        """One log line: the choice and what it was chosen from."""
        return json.dumps(asdict(self), separators=(",", ":"))


def pass_pricing(runtime: dict) -> dict[str, float]:
    """What a verify's pass costs beside one session's, from the start-up timings in its runtime (a
    RuntimeChoice's asdict, or its summary() read back: keys ints or strings): 8 and 32 sessions at one
    position each, and one session at 4 positions (k = 3 drafts), each over one session at one position
    timed the same way (BATCH_CONTEXT positions cached, the replies included). Issue 57's bars (8 sessions
    ≤ 2.5x, 32 ≤ 7x, 4 positions ≤ 1.4x) are these numbers. {} where they were not timed."""
    def by_int(table: dict) -> dict:
        return {int(key): value for key, value in table.items()}

    alone, batches = by_int(runtime.get("session_costs_ms") or {}), by_int(runtime.get("batch_costs_ms") or {})
    if not alone.get(1):
        return {}
    priced = {f"sessions_{rows}_x": by_int(batches.get(rows, {})).get(1) for rows in (8, 32)}
    priced["positions_4_x"] = alone.get(4)
    return {"session_ms": alone[1], **{name: round(ms / alone[1], 2) for name, ms in priced.items() if ms}}


def priced_rows(max_batch_size: int) -> list[int]:
    """Rows a verify times its rounds for at start-up: one session (pass_pricing's baseline), then batch_sizes."""
    return [1, *batch_sizes(max_batch_size)]


def batch_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to time at start-up: powers of two from 2, and the largest batch itself."""
    sizes = [2 ** i for i in range(1, max_batch_size.bit_length()) if 2 ** i < max_batch_size]
    return sizes + [max_batch_size] if max_batch_size > 1 else []


def by_size(table: dict, positions: int, default):
    """table[the largest key ≤ positions] (the smallest key below them; `default` for an empty table)."""
    if not table:
        return default
    fitting = [n for n in table if n <= positions]
    return table[max(fitting) if fitting else min(table)]


def best_layouts(by_layout: dict[str, dict[int, float]], positions: Iterable[int]) -> dict[int, str]:
    """For each position count, the layout with the lower (interpolated) cost; ties go to plain."""
    return {
        n: min(sorted(by_layout), key=lambda layout: (interpolate(by_layout[layout], n), layout != PLAIN))
        for n in positions
    }


def choose_runtime(costs: Costs, device: str = "cpu") -> RuntimeChoice:
    """Per forward size, the thread count and layout with the lowest cost.

    At each size fewer threads win unless more are `THREAD_TOLERANCE` faster there (they are then free
    for the rest of the stack). A layout that wins at no position count is dropped, so its weights
    need not be kept."""
    measured_sizes = sizes()
    best = {t: best_layouts(by_layout, measured_sizes) for t, by_layout in costs.items()}  # threads → {n: layout}
    threads_at = {
        n: fewest_threads({t: interpolate(costs[t][best[t][n]], n) for t in costs}) for n in measured_sizes
    }
    layouts = compress({n: best[threads_at[n]][n] for n in measured_sizes})
    per_size = compress(threads_at)
    table = {t: {layout: {n: round(s * 1000, 2) for n, s in timings.items()} for layout, timings in by_layout.items()} for t, by_layout in costs.items()}
    return RuntimeChoice(device=device, threads=threads_at[measured_sizes[0]], layouts=layouts,
                         threads_by_size=per_size if len(set(per_size.values())) > 1 else {}, costs_ms=table)


def one_count_serves(weights: str) -> bool:
    """Whether one thread count serves every pass of a model with these weights (one_thread_count): int4's
    exactness needs it."""
    return weights == "int4"


def timed_sizes(weights: str) -> tuple[int, ...]:
    """The forward sizes a model's start-up times: a prompt chunk's too where one thread count serves
    every pass (one_thread_count weighs it)."""
    return MEASURED_POSITIONS + ((CHUNK_POSITIONS,) if one_count_serves(weights) else ())


def one_thread_count(choice: RuntimeChoice, costs: Costs) -> RuntimeChoice:
    """`choice` with a single thread count for every forward size, each size on its cheapest layout at
    that count. For a model whose exactness needs a position's logits to be the same bits in a pass of
    any size (int4: specd_engine/quantized.py): CPU SDPA for one query over 64 or more keys splits the
    keys by thread count (flash-decoding style), so a row scored on 1 thread and the same row scored on
    2 differ by rounding, and a verify judging drafts on another thread count than its one-position
    passes changed greedy output (6 of 244 speculative requests of the e2e prompts through `specd up`,
    2-core AMD EPYC, 2026-11-27; 0 of 90 of the first prompt since).

    That count serves rounds (ROUND_POSITIONS, summed) and prompt chunks and batches (the largest size
    timed) alike, so it is weighed on both: the fewest threads within the tolerance of the best score,
    a count's score being its cost over the cheapest on each. Weighing rounds alone chose 1 thread on
    the 2-core EPYC when 1–5-position passes came out within 10% (median costs 4.9–7.5 ms either way in
    a quiet start), and served prompts 1.6–1.8x slower than 2 threads (300 tokens: 315 against 172–195
    ms; 2026-12-07)."""
    def cheapest(by_layout: dict, n: int) -> float:
        return min(interpolate(timings, n) for timings in by_layout.values())

    rounds = {t: sum(cheapest(by_layout, n) for n in ROUND_POSITIONS) for t, by_layout in costs.items()}
    largest = max(n for by_layout in costs.values() for timings in by_layout.values() for n in timings)
    chunk = {t: cheapest(by_layout, largest) for t, by_layout in costs.items()}
    score = {t: rounds[t] / min(rounds.values()) + chunk[t] / min(chunk.values()) for t in costs}
    threads = fewest_threads(score)
    layouts = compress(best_layouts(costs[threads], sizes()))
    return replace(choice, threads=threads, threads_by_size={}, layouts=layouts)


# Passes timed per candidate while serving before a size's thread count is settled (ServingTrials).
TRIAL_PASSES = 8
Candidate = tuple[int, str]  # (threads, layout) of a forward


class ServingTrials:
    """Start-up timings are taken on an idle machine in a few seconds; serving passes settle what
    they left close. On the 2-core AMD EPYC VM the start-up medians of a 4-position pass on 1 and 2
    threads came out within 4% of each other in one start (64 vs 62 ms: 1 thread chosen) and 25%
    apart in another (64 vs 51: 2 chosen), and the first start served its speculative rounds in
    74 ms against the second's 57. So for each size of a single session's forward (sizes() up to
    MEASURED_POSITIONS[-1], where more than one thread count was measured), the first passes of
    that size alternate between the start-up choice and the best kept layout of each other thread
    count, TRIAL_PASSES timed each, and the lower median while serving wins; every later pass of
    that size runs with it. Alternating passes see the same load and context lengths, so the
    comparison is side by side. Pure bookkeeping: CausalLM times its passes and applies the result."""

    def __init__(self, candidates: dict[int, list[Candidate]], passes: int = TRIAL_PASSES):
        self.candidates = {n: list(c) for n, c in candidates.items() if len(c) > 1}  # size → candidates, the start-up choice first
        self.passes = passes
        self.samples: dict[tuple[int, Candidate], list[float]] = {}

    @classmethod
    def from_costs(cls, choice: RuntimeChoice, costs: "Costs", passes: int = TRIAL_PASSES) -> "ServingTrials":
        """Candidates from the start-up measurements: at each size, the chosen (threads, layout), then
        for every other measured thread count its cheapest layout among those the choice keeps."""
        kept = choice.needs
        candidates = {}
        for n in sizes():
            chosen = (choice.threads_for(n), choice.layout_for(n))
            others = [(t, min(sorted(kept & set(by_layout)), key=lambda layout: interpolate(by_layout[layout], n)))
                      for t, by_layout in sorted(costs.items()) if t != chosen[0] and kept & set(by_layout)]
            candidates[n] = [chosen, *others]
        return cls(candidates, passes)

    def next(self, size: int) -> Optional[Candidate]:
        """The candidate the next pass of `size` positions should be timed with, None when there is
        nothing to try at that size (settled, or a single candidate)."""
        open_ = self.candidates.get(size)
        if not open_:
            return None
        return min(open_, key=lambda candidate: len(self.samples.get((size, candidate), [])))

    def record(self, size: int, candidate: Candidate, seconds: float) -> Optional[tuple[Candidate, dict[Candidate, float]]]:
        """Add one timed pass; once every candidate of `size` has `passes` of them, settle the size:
        returns (the winner, candidate → median seconds) and stops trying there; else None."""
        self.samples.setdefault((size, candidate), []).append(seconds)
        open_ = self.candidates.get(size, [])
        if not open_ or any(len(self.samples.get((size, c), [])) < self.passes for c in open_):
            return None
        medians = {c: statistics.median(self.samples[(size, c)]) for c in open_}
        del self.candidates[size]
        return min(open_, key=lambda c: (medians[c], c[0])), medians


def sizes() -> list[int]:
    """The forward sizes a runtime is chosen for (positions; others use the nearest below)."""
    return sorted(set(ROUND_POSITIONS) | set(MEASURED_POSITIONS))


def compress(layouts: dict[int, str]) -> dict[int, str]:
    """Keep only the sizes where the layout changes ({1: plain, 2: prepacked, 4: prepacked} → {1: plain, 2: prepacked})."""
    kept, previous = {}, None
    for n in sorted(layouts):
        if layouts[n] != previous:
            kept[n] = previous = layouts[n]
    return kept


def thread_candidates(cores: int) -> list[int]:
    """1, then every power of two below the core count, then all cores."""
    counts = {1, cores}
    n = 2
    while n < cores:
        counts.add(n)
        n *= 2
    return sorted(counts)


def threads_to_try(threads: int, max_threads: int = 0) -> list[int]:
    """[threads] when fixed (> 0), else the candidates up to `max_threads` (0 = all cores)."""
    if threads > 0:
        return [threads]
    cores = available_cores()
    return thread_candidates(min(cores, max_threads) if max_threads > 0 else cores)


def available_cores() -> int:
    """OMP_NUM_THREADS when set, else the CPUs this process may run on: its CPU affinity, and no more
    than its cgroup's CPU quota allows (a container limited to 2 CPUs on a 64-core node sees 64 in its
    affinity; 64 threads there would be throttled to 2 CPUs' time). Not torch.get_num_threads():
    that is the calling thread's current setting, which an earlier measurement may have changed."""
    import os

    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return cores if quota is None else max(1, min(cores, quota))


def quota_cores(quota_us: str, period_us: str) -> Optional[int]:
    """Whole CPUs a CFS quota allows (at least 1), from cgroup v2's cpu.max fields or v1's
    cpu.cfs_quota_us / cpu.cfs_period_us; None when unlimited ("max" or -1) or unreadable. Rounded
    down: 2.5 CPUs of quota keep a third thread waiting for time half the time."""
    try:
        quota, period = int(quota_us), int(period_us)
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, quota // period)


CGROUP_ROOT = "/sys/fs/cgroup"


def cgroup_cpu_quota(root: Optional[str] = None) -> Optional[int]:
    """This process's CPU quota in whole CPUs (quota_cores), from cgroup v2 (cpu.max) or v1
    (cpu/cpu.cfs_quota_us); None when there is none or no cgroup filesystem. Reads the mount's root:
    inside a container that is the container's own cgroup (Kubernetes, Docker with cgroup namespaces)."""
    from pathlib import Path

    root = root or CGROUP_ROOT
    try:
        v2 = Path(root, "cpu.max")
        if v2.exists():
            return quota_cores(*v2.read_text().split()[:2])
        v1 = Path(root, "cpu")
        if (v1 / "cpu.cfs_quota_us").exists():
            return quota_cores((v1 / "cpu.cfs_quota_us").read_text().strip(), (v1 / "cpu.cfs_period_us").read_text().strip())
    except (OSError, TypeError):
        return None
    return None


@dataclass
class Budget:
    """Seconds the start-up measurements of one service may take in all (0 = no limit), from `started`;
    `cut` names the measurements it stopped before all their rounds."""

    seconds: float = STARTUP_BUDGET_S
    started: float = field(default_factory=time.monotonic)
    cut: list = field(default_factory=list)

    def spent(self) -> bool:
        return self.seconds > 0 and time.monotonic() - self.started >= self.seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def measure_interleaved(runs: dict, repeats: int = 5, budget: Optional[Budget] = None, name: str = "") -> dict:
    """Median seconds of each `runs[key]()`, with torch set to `key[0]` threads.

    The rounds are interleaved (each round times every run once, after one untimed warm-up round),
    so a burst of load from a neighbour on a shared machine spreads over all candidates instead of
    condemning one; and a `budget` spent ends them at a round's end (every candidate then has the same
    number of samples, at least one), with `name` added to budget.cut. torch.set_num_threads is
    process-wide; the caller sets its choice afterwards."""
    import torch

    samples: dict = {key: [] for key in runs}
    for round_index in range(repeats + 1):
        for key, run in runs.items():
            torch.set_num_threads(key[0])
            started = time.perf_counter()
            run()
            if torch.cuda.is_initialized():  # CUDA runs asynchronously: a timing ends when the device is done
                torch.cuda.synchronize(torch.cuda.current_device())  # a service sets its own (models.load_causal_lm)
            if round_index:  # round 0 warms every shape up
                samples[key].append(time.perf_counter() - started)
        if round_index and round_index < repeats and budget is not None and budget.spent():
            budget.cut.append(f"{name or 'a measurement'} after {round_index} of {repeats} rounds")
            break
    return {key: statistics.median(times) for key, times in samples.items()}


# measure(name, make_runs, repeats) → measure_interleaved's medians of make_runs(), or {} when a start-up
# budget was spent before (the caller keeps its defaults): how start-up code asks for timings, so a service
# can answer from its cache (specd_engine/runtime_cache.py) without building the runs.
Measure = Callable[[str, Callable[[], dict], int], dict]


def measure_now(name: str, make_runs: Callable[[], dict], repeats: int) -> dict:
    """The plain Measure: time the runs here and now, no budget, no cache."""
    return measure_interleaved(make_runs(), repeats)


def fewest_threads(cost_by_threads: dict[int, float], tolerance: float = THREAD_TOLERANCE) -> int:
    """The smallest thread count whose cost is within `tolerance` of the cheapest."""
    fastest = min(cost_by_threads.values())
    return min(t for t, cost in cost_by_threads.items() if cost <= fastest * (1 + tolerance))


def measure_forward_costs(
    timed_forward: Callable[[int, str], Callable[[], None]],
    threads: Sequence[int],
    layouts: Sequence[str] = LAYOUTS,
    positions: Sequence[int] = MEASURED_POSITIONS,
    repeats: int = 5,
    measure: Measure = measure_now,
) -> Costs:
    """Median seconds of `timed_forward(positions, layout)()` for every thread count, layout and size."""
    def runs() -> dict:
        return {(t, layout, n): timed_forward(n, layout) for t in threads for layout in layouts for n in positions}

    costs: Costs = {}
    for (count, layout, n), seconds in measure("forward costs", runs, repeats).items():
        costs.setdefault(count, {}).setdefault(layout, {})[n] = seconds
    return costs


KV_MEMORY_SHARE = 0.5  # of the memory free after loading the model, what the KV caches may use


def kv_bytes_per_token(config, element_size: int) -> int:
    """Bytes one cached position costs: keys and values of every layer's KV heads."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * element_size


def available_memory_bytes(device: str) -> int:
    """Memory free now on the device the caches live on (0 if unknown): CUDA's free memory, or the
    host's MemAvailable."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def kv_token_budget(bytes_per_token: int, available_bytes: int, share: float = KV_MEMORY_SHARE) -> int:
    """How many positions the sessions of a service may hold in all: `share` of the free memory over
    the per-position cost (0 = no budget, when the free memory is unknown)."""
    if available_bytes <= 0 or bytes_per_token <= 0:
        return 0
    return max(1, int(available_bytes * share) // bytes_per_token)
