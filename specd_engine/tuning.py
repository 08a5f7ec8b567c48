"""The runtime a pass runs on, and the start-up measurements that choose it.

Every pass runs inside `PassRuntime.pass_of`: one pass at a time (a lock), counted and timed
(telemetry's model_forward), on the thread count and weight layout measured for its size, or on a
serving trial's candidate while that size is still being settled (autotune.ServingTrials). `tune`
takes the measurements at start-up (autotune.py says what is measured and why; runtime_cache.py
keeps them between starts).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Iterator, Optional

import torch

from specd_engine import autotune, layouts, quantized
from specd_common.telemetry import model_forward
from specd_engine.sessions import Feed

log = logging.getLogger(__name__)


class PassRuntime:
    """Threads and weight layout per pass size (`choice`), the serving trials still settling sizes, and
    the layouts the model's float32 products keep (layouts.py). Passes are serialised here, so the one
    layout switch every SwitchableLinear reads is enough."""

    def __init__(self, device: torch.device, kept_layouts: set[str], switch: layouts.LayoutSwitch):
        self.layouts = kept_layouts
        self.switch = switch
        self.choice = autotune.RuntimeChoice(device=str(device), threads=0, layouts={1: min(kept_layouts)}, source="default")
        self.trials: Optional[autotune.ServingTrials] = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def pass_of(self, rows: int, trial: bool = True) -> Iterator[None]:
        """Run the pass inside, over `rows` positions, alone, on the measured runtime for its size, or
        (trial) on a serving trial's candidate, timed and recorded."""
        with self._lock, model_forward(rows):
            candidate = self.trials.next(rows) if trial and self.trials is not None else None
            if candidate is None:
                self._apply(self.choice.threads_for(rows), self.choice.layout_for(rows))
                yield
                return
            self._apply(*candidate)
            started = time.perf_counter()
            yield
            self._settle_trial(rows, candidate, time.perf_counter() - started)

    def _apply(self, threads: int, layout: str) -> None:
        """Use `layout`'s weights and `threads` torch threads (set only when it changes: the call
        resizes OpenMP's team; 0 leaves them)."""
        self.switch.layout = layout
        if threads and threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def _settle_trial(self, rows: int, trial: autotune.Candidate, seconds: float) -> None:
        """Record a timed trial pass; when its size settles, run that size with the winner from now on
        and say so in one log line."""
        settled = self.trials.record(rows, trial, seconds)
        if settled is None:
            return
        (threads, layout), medians = settled
        why = f"{threads} threads ({layout}); medians of {self.trials.passes} passes each: " + ", ".join(
            f"{t} threads ({lay}) {seconds * 1e3:.1f} ms" for (t, lay), seconds in medians.items())
        self.choice.settle(rows, threads, layout, why)
        log.info("serving trials: %d-position forwards run on %s", rows, why)

    def use_only(self, module: torch.nn.Module, kept: set[str]) -> None:
        """Keep only the layouts `kept` in the module's linears (the others' weights are freed)."""
        layouts.drop_unused(module, kept)
        self.layouts &= kept


def tune(lm: Any, threads: int = 0, max_threads: int = 0, repeats: int = 5,
         measure: autotune.Measure = autotune.measure_now) -> autotune.RuntimeChoice:
    """Measure a CausalLM's forward passes on this machine and adopt the fastest runtime: thread count
    (unless `threads` > 0 fixes it; at most `max_threads` > 0) and the weight layout per forward size
    (among the kept layouts); for int4, whether prompt rows take a dense product. Not on CUDA: there
    the default stands. `measure` takes the timings (a service's may answer from its cache). On the
    model's thread."""
    runtime = lm.tuning
    if lm.loaded.device.type != "cpu":
        return runtime.choice
    counts = autotune.threads_to_try(threads, max_threads)
    if len(counts) == 1 and len(runtime.layouts) == 1:
        torch.set_num_threads(counts[0])
        runtime.choice = autotune.RuntimeChoice("cpu", counts[0], {1: next(iter(runtime.layouts))}, source="flags")
        choose_prompt_kernel(lm, counts[0], measure)
        return runtime.choice
    prompt = [i % lm.vocab_size for i in range(1, autotune.CHUNK_POSITIONS + 1)]  # any ids; as long as the largest size timed
    session = lm.new_session(prompt)

    def timed_forward(positions: int, layout: str):
        fixed = autotune.RuntimeChoice("cpu", 0, {1: layout})

        def run() -> None:
            runtime.choice = fixed
            lm.run_feeds_then_rewind([Feed(session, prompt[:positions], logits=positions)])  # every position's logits, like a verify

        return run

    costs = autotune.measure_forward_costs(timed_forward, counts, sorted(runtime.layouts), autotune.timed_sizes(lm.weights),
                                           repeats=repeats, measure=measure)
    if not costs:  # no start-up time left to measure: the default runtime stands
        return runtime.choice
    choice = autotune.choose_runtime(costs)
    if autotune.one_count_serves(lm.weights):  # exactness: every pass on one thread count, never trialled on another
        choice, runtime.trials = autotune.one_thread_count(choice, costs), None
    else:
        runtime.trials = autotune.ServingTrials.from_costs(choice, costs)
    torch.set_num_threads(choice.threads)
    choose_prompt_kernel(lm, choice.threads, measure)
    lm.use_only(choice.needs)
    runtime.choice = choice
    return choice


def choose_prompt_kernel(lm: Any, threads: int, measure: autotune.Measure) -> None:
    """int4 lean passes (ragged or flat): measure whether prompt rows' products are cheaper through a
    dense weight (quantized.choose_prompt_kernel) and keep it where they are."""
    if lm.weights == "int4" and lm.lean is not None:
        lm.passes.prompt_kernel = quantized.choose_prompt_kernel(lm.lean.layers, threads, measure)
        log.info("prompt rows' products: %s", lm.passes.prompt_kernel or "int4, as every row's")
