"""The start-up runtime choice (specd_engine/autotune.py) on fake timings, and on a real tiny model."""

from __future__ import annotations

import json

import pytest

from specd_app import bench
from specd_engine import autotune
from specd_engine.autotune import (
    PLAIN, PREPACKED, TALL, RuntimeChoice, ServingTrials, available_cores, choose_runtime, compress, fewest_threads, interpolate,
    one_thread_count, thread_candidates, timed_sizes, MEASURED_POSITIONS,
)

MS = 1e-3


def ms(values: dict) -> dict:
    """positions → milliseconds, as seconds (what the measurements hold)."""
    return {n: v * MS for n, v in values.items()}


def costs(plain: dict, prepacked: dict) -> dict:
    return {PLAIN: ms(plain), PREPACKED: ms(prepacked)}


# Shapes measured on real machines (ms per forward over n new positions, 2 threads): on the AMD EPYC
# prepacking wins from 2 positions up; on the Intel Xeon it loses everywhere.
AMD = costs({1: 57, 2: 102, 3: 118, 4: 100, 5: 85, 8: 102}, {1: 74, 2: 75, 3: 73, 4: 83, 5: 77, 8: 91})
INTEL = costs({1: 31, 2: 34, 4: 50, 8: 62}, {1: 57, 2: 68, 4: 73, 8: 80})


def test_each_size_gets_the_layout_measured_faster():
    choice = choose_runtime({2: AMD})
    assert choice.layouts == {1: PLAIN, 2: PREPACKED}
    assert [choice.layout_for(n) for n in (1, 2, 3, 4, 5, 8, 64)] == [PLAIN] + [PREPACKED] * 6
    assert choice.needs == {PLAIN, PREPACKED}


def test_pass_costs_are_the_served_thread_count_and_layout_at_each_size():
    """What the verify reports to the gateway (RuntimeProfile.pass_costs): at each measured size, the
    cost of the threads and layout chosen for it, in ms."""
    choice = choose_runtime({2: AMD})
    assert choice.pass_costs_ms() == {1: 57.0, 2: 75.0, 3: 73.0, 4: 83.0, 5: 77.0, 8: 91.0}  # plain at 1, prepacked from 2
    assert RuntimeChoice("cpu", 0).pass_costs_ms() == {}


def test_a_layout_that_never_wins_is_dropped():
    choice = choose_runtime({2: INTEL})
    assert choice.layouts == {1: PLAIN} and choice.needs == {PLAIN}
    assert choice.layout_for(5) == PLAIN


def test_more_threads_must_be_clearly_faster():
    memory_bound = {1: INTEL, 2: {layout: {n: s * 0.93 for n, s in sizes.items()} for layout, sizes in INTEL.items()}}
    assert choose_runtime(memory_bound).threads == 1  # 7% faster is not worth a core
    compute_bound = {1: INTEL, 2: {layout: {n: s * 0.6 for n, s in sizes.items()} for layout, sizes in INTEL.items()}}
    assert choose_runtime(compute_bound).threads == 2


def test_threads_are_chosen_per_forward_size():
    """Measured on the 2-core AMD EPYC VM (tall layout, 2026-11-23): a second thread does nothing for
    a decoding step but makes a 4-position verify pass 1.4x faster."""
    epyc = {
        1: {PLAIN: ms({1: 69, 2: 107, 4: 111, 8: 131}), TALL: ms({1: 68, 2: 96, 4: 112, 8: 161})},
        2: {PLAIN: ms({1: 69, 2: 120, 4: 124, 8: 128}), TALL: ms({1: 66, 2: 83, 4: 79, 8: 102})},
    }
    choice = choose_runtime(epyc)
    assert choice.threads == 1 and choice.threads_by_size == {1: 1, 2: 2}
    assert [choice.threads_for(n) for n in (1, 2, 4, 5, 64)] == [1, 2, 2, 2, 2]
    assert [choice.layout_for(n) for n in (2, 4, 8)] == [TALL, TALL, TALL]
    assert choose_runtime({2: AMD}).threads_by_size == {}  # one count for every size: nothing varies
    assert choose_runtime({2: AMD}).threads_for(4) == 2


def test_one_thread_count_serves_every_size_where_exactness_needs_it():
    """int4's rule: a position scores the same bits in a pass of any size only on one thread count.
    Summed over the sizes rounds use, the EPYC timings above favour 2 threads (394 against 495 ms)."""
    epyc = {
        1: {PLAIN: ms({1: 69, 2: 107, 4: 111, 8: 131}), TALL: ms({1: 68, 2: 96, 4: 112, 8: 161})},
        2: {PLAIN: ms({1: 69, 2: 120, 4: 124, 8: 128}), TALL: ms({1: 66, 2: 83, 4: 79, 8: 102})},
    }
    choice = one_thread_count(choose_runtime(epyc), epyc)
    assert choice.threads_by_size == {} and {choice.threads_for(n) for n in (1, 2, 4, 5, 64)} == {2}
    assert choice.layouts == {1: TALL} and choice.costs_ms == choose_runtime(epyc).costs_ms
    close = {1: {PLAIN: ms({1: 50, 2: 60, 4: 80, 8: 100})}, 2: {PLAIN: ms({1: 52, 2: 58, 4: 74, 8: 96})}}
    assert one_thread_count(choose_runtime(close), close).threads == 1  # within the tolerance on both: fewer threads


def test_one_thread_count_weighs_prompt_chunks_beside_rounds():
    """Rounds as one start on the 2-core EPYC timed them (int4, flat pass, 2026-12-07: within 2% summed
    over 1–5 positions, 8 positions level), and a 32-position chunk 1.8x cheaper on two threads, as
    quiet runs measure it (55.1 against 30.6 ms). Rounds alone chose one thread."""
    rounds = {1: {1: 5.9, 2: 6.0, 4: 6.9, 8: 11.1}, 2: {1: 5.1, 2: 5.6, 4: 7.7, 8: 11.1}}
    without_chunk = {t: {PLAIN: ms(timings)} for t, timings in rounds.items()}
    with_chunk = {t: {PLAIN: ms({**timings, 32: chunk})} for (t, timings), chunk in zip(rounds.items(), (55.1, 30.6))}
    assert one_thread_count(choose_runtime(without_chunk), without_chunk).threads == 1
    assert one_thread_count(choose_runtime(with_chunk), with_chunk).threads == 2
    assert timed_sizes("int4")[-1] == 32 and timed_sizes("float") == MEASURED_POSITIONS


def test_an_int4_model_runs_every_pass_on_the_thread_count_it_chose(tiny):
    """Timings where one thread wins a 1-position pass and two win longer ones: a float model runs each
    size on its winner and trials the other while serving; an int4 model (exactness) runs all on one."""
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    def timings(name, runs, repeats):  # (threads, layout, positions) → seconds
        if name == "prompt product":  # (threads, kernel): int4 alone here (quantized.choose_prompt_kernel)
            return {}
        return {(t, layout, n): (0.010 if t == 1 else 0.012) if n == 1 else (0.040 if t == 1 else 0.020)
                for t, layout, n in runs()}

    assert available_cores() >= 2, "CI's machine has 2 cores; this compares thread counts"
    float_lm = CausalLM(load_causal_lm(str(tiny.target)), layouts={PLAIN})
    varied = float_lm.tune(max_threads=2, measure=timings)
    assert varied.threads_by_size == {1: 1, 2: 2} and float_lm.tuning.trials is not None
    int4_lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    fixed = int4_lm.tune(max_threads=2, measure=timings)
    assert fixed.threads_by_size == {} and fixed.threads == 2 and int4_lm.tuning.trials is None


def test_a_model_without_float32_products_keeps_its_plain_weights_whatever_timings_say(tiny):
    """Layouts switch float32 products only (layouts.SwitchableLinear). A bfloat16 model's products stay
    transformers' linears, so timing layouts there is noise; a copied layout (rows) that won by noise
    once dropped the weights every pass reads (a TypeError in the next pass). Here it has one layout."""
    import torch

    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    def timings(name, runs, repeats):  # every layout but plain timed fastest, were any other timed
        return {key: (0.02 if PLAIN in key else 0.01) for key in runs()}

    lm = CausalLM(load_causal_lm(str(tiny.target), dtype="bfloat16"), layouts={PLAIN, PREPACKED, "rows"})
    assert lm.tuning.layouts == {PLAIN}
    choice = lm.tune(max_threads=2, measure=timings)
    lm.use_only(choice.needs)
    assert choice.needs == {PLAIN} and lm.forward(lm.new_session([5, 6, 7]), [8]).dtype == torch.float32


def test_the_choice_records_what_chose_it():
    choice = choose_runtime({1: INTEL, 2: AMD})
    record = json.loads(choice.summary())
    assert record["source"] == "measured" and record["threads"] in (1, 2)
    assert record["costs_ms"]["2"][PREPACKED]["4"] == 83.0


def test_pass_pricing_is_each_cost_over_one_session_timed_alike():
    """autotune.pass_pricing over a runtime read back from JSON (string keys), as `specd bench` prints it."""
    runtime = {"session_costs_ms": {"1": 5.0, "4": 6.0, "8": 9.0}, "batch_costs_ms": {"8": {"1": 12.5}, "32": {"1": 36.0, "4": 90.0}}}
    pricing = autotune.pass_pricing(runtime)
    assert pricing == {"session_ms": 5.0, "sessions_8_x": 2.5, "sessions_32_x": 7.2, "positions_4_x": 1.2}
    assert bench.pricing_line(pricing).endswith("(5.0 ms): 8 sessions 2.5x, 32 sessions 7.2x, 4 positions 1.2x")
    assert autotune.pass_pricing({"batch_costs_ms": runtime["batch_costs_ms"]}) == {}  # no baseline timed: nothing priced
    assert autotune.pass_pricing({"session_costs_ms": {1: 4.0}}) == {"session_ms": 4.0}


def test_fewest_threads_within_the_tolerance():
    assert fewest_threads({1: 1.0, 2: 0.95, 4: 0.5}) == 4
    assert fewest_threads({1: 1.0, 2: 0.95}) == 1
    assert fewest_threads({1: 1.0, 2: 1.2}) == 1


def test_interpolation_and_helpers():
    assert interpolate({1: 10.0, 4: 40.0}, 2) == pytest.approx(20.0)
    assert interpolate({1: 10.0, 4: 40.0}, 9) == 40.0 and interpolate({2: 5.0}, 1) == 5.0
    assert compress({1: PLAIN, 2: PREPACKED, 3: PREPACKED, 8: PLAIN}) == {1: PLAIN, 2: PREPACKED, 8: PLAIN}
    assert thread_candidates(1) == [1] and thread_candidates(2) == [1, 2] and thread_candidates(16) == [1, 2, 4, 8, 16]
    assert RuntimeChoice("cuda", 0).layout_for(4) == PLAIN


def test_serving_trials_settle_what_start_up_left_close():
    """ServingTrials from the start-up costs of the 2-core EPYC VM where 1 thread came within the
    tolerance at 4 positions: every size with two thread counts alternates between the start-up
    choice and the other count's best kept layout; once both have their passes, the lower serving
    median wins and the runtime runs that size with it, other sizes unchanged."""
    start_up = {
        1: {PLAIN: ms({1: 50, 2: 74, 4: 64, 8: 98}), TALL: ms({1: 59, 2: 66, 4: 62, 8: 98})},
        2: {PLAIN: ms({1: 57, 2: 89, 4: 112, 8: 120}), TALL: ms({1: 63, 2: 58, 4: 58, 8: 97})},
    }
    choice = choose_runtime(start_up)
    assert choice.threads_for(4) == 1 and choice.layout_for(4) == TALL  # 58 ms on 2 threads is within 10% of 62
    trials = ServingTrials.from_costs(choice, start_up, passes=3)
    assert trials.candidates[4] == [(1, TALL), (2, TALL)] and set(trials.candidates) == {1, 2, 3, 4, 5, 8}
    serving_ms = {(1, TALL): 74.0, (2, TALL): 57.0}  # what the passes take once the stack serves
    settled = None
    for _ in range(6):
        candidate = trials.next(4)
        assert candidate in serving_ms
        settled = trials.record(4, candidate, serving_ms[candidate] * MS)
        assert (settled is None) == (_ < 5)  # settles only when both have three passes
    winner, medians = settled
    assert winner == (2, TALL) and medians[(1, TALL)] == pytest.approx(74 * MS)
    assert trials.next(4) is None and trials.next(2) is not None  # settled there, still open elsewhere
    before = {n: (choice.threads_for(n), choice.layout_for(n)) for n in (1, 2, 3, 5, 8)}
    choice.settle(4, *winner, why="test")
    assert (choice.threads_for(4), choice.layout_for(4)) == winner and choice.settled_in_serving == {4: "test"}
    assert {n: (choice.threads_for(n), choice.layout_for(n)) for n in (1, 2, 3, 5, 8)} == before
    assert json.loads(choice.summary())["settled_in_serving"] == {"4": "test"}


def test_serving_trials_keep_the_start_up_choice_on_a_tie_of_thread_counts():
    """Equal medians: the fewer threads win (a core left for the rest of the stack); one candidate: no trial."""
    trials = ServingTrials({1: [(2, PLAIN), (1, PLAIN)], 8: [(1, PLAIN)]}, passes=1)
    assert trials.next(8) is None and trials.next(3) is None
    trials.record(1, (2, PLAIN), 0.05)
    assert trials.record(1, (1, PLAIN), 0.05)[0] == (1, PLAIN)


def test_a_tiny_model_tunes_itself_and_still_computes_the_same_logits(tmp_path):
    torch = pytest.importorskip("torch")
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm
    from tests.tiny_models import build_model

    loaded = load_causal_lm(str(build_model(tmp_path / "m", seed=0)))
    reference = CausalLM(load_causal_lm(str(build_model(tmp_path / "m", seed=0))))
    prompt, drafts = [5, 6, 7, 8], [9, 10, 11]
    expected = reference.forward(reference.new_session(prompt), drafts)
    threads = available_cores()
    lm = CausalLM(loaded, layouts={PLAIN, PREPACKED})
    choice = lm.tune(repeats=1)
    try:
        assert choice.source == "measured" and choice.threads in thread_candidates(threads)
        assert lm.run(torch.get_num_threads) == choice.threads  # set where the model runs: its own thread
        assert set(choice.costs_ms) == set(thread_candidates(threads))
        assert lm.tuning.layouts == choice.needs
        got = lm.forward(lm.new_session(prompt), drafts)
        assert torch.allclose(got, expected, atol=1e-4)
        # serving trials: passes of one size alternate candidates until that size settles; logits unchanged
        lm.tuning.trials = ServingTrials({2: [(choice.threads_for(2), choice.layout_for(2)), (1, PLAIN)]}, passes=2)
        for token in range(4):
            logits = lm.forward(lm.new_session(prompt), [20 + token])  # a pass over 2 positions: the prompt's last token + one draft
        assert 2 in choice.settled_in_serving and lm.tuning.trials.next(2) is None
        assert torch.allclose(logits, reference.forward(reference.new_session(prompt), [23]), atol=1e-4)
    finally:
        lm.run(torch.set_num_threads, threads)


def test_batch_sizes_timed_at_start_up():
    from specd_engine.autotune import batch_sizes

    assert batch_sizes(8) == [2, 4, 8] and batch_sizes(6) == [2, 4, 6] and batch_sizes(2) == [2] and batch_sizes(1) == []


def test_thread_caps_of_the_stack_and_the_candidates_within_them():
    from specd_app.stack import stack_thread_caps
    from specd_engine.autotune import threads_to_try

    assert stack_thread_caps(1) == {"verify": 1, "draft": 1} and stack_thread_caps(16)["verify"] == 16
    assert threads_to_try(3) == [3] and threads_to_try(0, max_threads=1) == [1]


@pytest.mark.parametrize(
    "quota, period, cores",
    [("max", "100000", None), ("-1", "100000", None), ("200000", "100000", 2), ("250000", "100000", 2),
     ("50000", "100000", 1), ("", "100000", None)],
)
def test_a_cfs_quota_allows_whole_cpus(quota, period, cores):
    from specd_engine.autotune import quota_cores

    assert quota_cores(quota, period) == cores


def test_available_cores_stay_within_the_cgroup_cpu_quota(tmp_path, monkeypatch):
    """A container limited to fewer CPUs than its affinity shows (Kubernetes limits.cpu) gets that
    many threads at most; cgroup v2 (cpu.max) and v1 (cpu/cpu.cfs_quota_us) both read."""
    import os


    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    affinity = len(os.sched_getaffinity(0))
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir()
    (v2 / "cpu.max").write_text("100000 100000\n")
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert autotune.cgroup_cpu_quota(str(v2)) == 1 and autotune.cgroup_cpu_quota(str(v1)) is None
    assert autotune.cgroup_cpu_quota(str(tmp_path / "none")) is None  # no cgroup filesystem: no quota
    monkeypatch.setattr(autotune, "CGROUP_ROOT", str(v2))
    assert autotune.available_cores() == 1
    monkeypatch.setattr(autotune, "CGROUP_ROOT", str(v1))
    assert autotune.available_cores() == affinity
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert autotune.available_cores() == 3  # set by the user: taken as is


# --- start-up timings cached per machine (specd_engine/runtime_cache.py) and bounded by a budget ---


def counted_runs(calls: list, keys=((1, "a"), (2, "a")), seconds: float = 0.0):
    """make_runs for StartupTimings.measure: counts how often the runs are built, each run sleeping `seconds`."""
    import time

    def make_runs() -> dict:
        calls.append(1)
        return {key: (lambda: time.sleep(seconds)) for key in keys}

    return make_runs


def test_a_second_start_with_the_same_key_reads_the_timings_and_measures_nothing(tmp_path, caplog):
    from specd_engine.runtime_cache import StartupTimings

    key, calls = {"cpu": "test cpu", "cores": 2, "torch": "1.0"}, []
    first = StartupTimings("verify", key, tmp_path)
    measured = first.measure("forward costs", counted_runs(calls), repeats=2)
    assert first.source == "measured" and first.finish() == first.path and first.path.parent == tmp_path
    with caplog.at_level("INFO"):
        second = StartupTimings("verify", key, tmp_path)
    assert second.measure("forward costs", counted_runs(calls), repeats=2) == measured  # tuple keys, float seconds
    assert calls == [1] and second.source == "cached" and str(second.path) in caplog.text
    assert second.finish() is None  # nothing new to write
    remeasured = StartupTimings("verify", key, tmp_path, remeasure=True)
    remeasured.measure("forward costs", counted_runs(calls), repeats=1)
    assert calls == [1, 1] and remeasured.source == "measured"


@pytest.mark.parametrize("change", [{"torch": "2.0"}, {"cores": 4}, {"cpu": "other cpu"}, {"model": "other", "config": "x"}])
def test_a_changed_machine_software_or_model_is_a_miss(tmp_path, change):
    from specd_engine.runtime_cache import StartupTimings

    key, calls = {"cpu": "test cpu", "cores": 2, "torch": "1.0", "model": "m", "config": "c"}, []
    warm = StartupTimings("verify", key, tmp_path)
    warm.measure("forward costs", counted_runs(calls), repeats=1)
    warm.finish()
    changed = StartupTimings("verify", {**key, **change}, tmp_path)
    changed.measure("forward costs", counted_runs(calls), repeats=1)
    assert calls == [1, 1] and changed.path != warm.path


def test_the_key_follows_the_torch_version_the_cores_the_engine_and_the_model(tmp_path, monkeypatch):
    import torch

    from specd_engine import runtime_cache
    from specd_engine.models import load_causal_lm
    from tests.tiny_models import build_model

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = runtime_cache.machine_key("cpu")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert runtime_cache.machine_key("cpu")["cores"] == 2 != one["cores"]
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert runtime_cache.machine_key("cpu")["torch"] == "0.0.1"
    monkeypatch.setattr(runtime_cache, "ENGINE_REVISION", runtime_cache.ENGINE_REVISION + 1)
    assert runtime_cache.machine_key("cpu")["engine"] == runtime_cache.ENGINE_REVISION  # a pass that costs otherwise is timed again
    small, other = load_causal_lm(str(build_model(tmp_path / "a", seed=0))), load_causal_lm(str(build_model(tmp_path / "b", seed=0, layers=1)))
    assert runtime_cache.model_key("m", small.model) == runtime_cache.model_key("m", small.model)
    assert runtime_cache.model_key("m", small.model)["config"] != runtime_cache.model_key("m", other.model)["config"]
    assert runtime_cache.cpu_model()  # /proc/cpuinfo's model name, or what platform says


def test_cache_root_follows_specd_cache_dir_then_xdg(tmp_path, monkeypatch):
    from pathlib import Path

    from specd_engine.runtime_cache import cache_root, runtime_folder

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "specd"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "specd" and runtime_folder() == tmp_path / "specd" / "runtime"
    monkeypatch.delenv("SPECD_CACHE_DIR")
    assert cache_root() == tmp_path / "xdg" / "specd"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "specd" and runtime_folder(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("content", ["{not json", '{"format": 0, "key": {}, "timings": {}}', '{"format": 1}', "[]",
                                     '{"format": 1, "key": KEY, "timings": {"forward costs": [[["x"], 1.0]]}}'])
def test_a_corrupt_or_old_cache_file_is_measured_over_with_a_warning(tmp_path, caplog, content):
    import json

    from specd_engine.runtime_cache import StartupTimings

    key, calls = {"cpu": "test cpu"}, []
    timings = StartupTimings("verify", key, tmp_path)
    timings.path.write_text(content.replace("KEY", json.dumps(timings.key)))
    timings = StartupTimings("verify", key, tmp_path)
    assert "measuring again" in caplog.text and not timings.cached
    timings.measure("forward costs", counted_runs(calls), repeats=1)
    assert calls == [1] and timings.finish() == timings.path
    assert StartupTimings("verify", key, tmp_path).cached  # rewritten whole


def test_a_budget_cuts_the_rounds_short_and_such_timings_are_not_cached(tmp_path, caplog):
    from specd_engine.autotune import Budget
    from specd_engine.runtime_cache import StartupTimings

    calls = []
    timings = StartupTimings("verify", {"cpu": "test cpu"}, tmp_path, budget=Budget(seconds=0.05))
    measured = timings.measure("forward costs", counted_runs(calls, seconds=0.02), repeats=5)  # a round takes 0.04 s
    assert set(measured) == {(1, "a"), (2, "a")}  # one timed round after the warm-up: the best found so far
    assert timings.budget.cut == ["forward costs after 1 of 5 rounds"]
    assert timings.measure("batch costs", counted_runs(calls), repeats=3) == {} and calls == [1]  # no time left: defaults
    assert "not timed" in timings.budget.cut[-1] and timings.source.startswith("measured, cut short")
    with caplog.at_level("WARNING"):
        assert timings.finish() is None
    assert "cut short by their 0 s budget" in caplog.text and not list(tmp_path.iterdir())
    unbounded = StartupTimings("verify", {"cpu": "test cpu"}, tmp_path, budget=Budget(seconds=0))
    unbounded.measure("forward costs", counted_runs(calls, seconds=0.01), repeats=3)
    assert not unbounded.budget.cut and unbounded.finish() is not None


def test_a_verify_started_twice_on_a_warm_cache_measures_only_once(tmp_path, monkeypatch):
    """Scorer's start-up: the forward costs, the batch costs, the prefill cost (and the heads' product) are
    timed on the first start and read on the second, which chooses the same runtime from them."""
    from specd_common.config import BatchPolicy, StartupMeasurement
    from specd_engine.models import load_causal_lm
    from tests.tiny_models import build_model
    from verify_service.scorer import Scorer

    measured = []
    real = autotune.measure_interleaved
    monkeypatch.setattr(autotune, "measure_interleaved", lambda runs, *a, **k: measured.append(len(runs)) or real(runs, *a, **k))
    model = build_model(tmp_path / "m", seed=0)
    startup = StartupMeasurement(cache_dir=str(tmp_path / "cache"))
    batching = BatchPolicy(max_batch_size=2)
    first = Scorer(load_causal_lm(str(model)), batching, max_threads=2, prepack="auto", startup=startup)
    assert len(measured) == 3 and len(list((tmp_path / "cache").glob("verify-*.json"))) == 1
    second = Scorer(load_causal_lm(str(model)), batching, max_threads=2, prepack="auto", startup=startup)
    assert len(measured) == 3  # nothing timed again
    assert second.info().runtime_profile.prefill_ms_per_token == first.info().runtime_profile.prefill_ms_per_token > 0
    assert second.lm.runtime.source == "cached" and first.lm.runtime.source == "measured"
    assert (second.lm.runtime.layouts, second.lm.runtime.threads) == (first.lm.runtime.layouts, first.lm.runtime.threads)
    assert second.lm.runtime.batch_costs_ms == first.lm.runtime.batch_costs_ms != {}
    assert set(first.lm.runtime.batch_costs_ms) == {2} and set(first.lm.runtime.session_costs_ms) == set(autotune.BATCH_POSITIONS)
    pricing = autotune.pass_pricing(json.loads(first.info().runtime_config))  # as `specd bench` reads it
    assert pricing["session_ms"] == first.lm.runtime.session_costs_ms[1] > 0 and pricing["positions_4_x"] > 0
    Scorer(load_causal_lm(str(model)), BatchPolicy(max_batch_size=4), max_threads=2, startup=startup)  # another batch size: a miss
    assert len(measured) == 6
