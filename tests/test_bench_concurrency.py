"""`specd bench` for many users at once (issue 43): the long-prompt set, `--sequential-too` and `--arrival`.

The measurements themselves run on the developer's machine with the default models (commands in
specd_app/bench.py's docstring); here they run end to end on tiny random models through in-process
services, a few prompts and tokens each, and the reports are checked for their structure and for
numbers that agree with each other (every ratio is the quotient of the numbers it relates).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from tests.conftest import start_cluster

SHORT = [
    ("math", "Natalia sold clips to 48 of her friends in April"),
    ("code", "def add(a, b):\n    return a + b"),
    ("chat", "hello world, how are you today?"),
]
# ~340 tokens of the tiny tokenizer: the tiny models' context is 512
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)


@pytest.fixture(scope="module")
def bench_cluster(tiny):
    running = start_cluster(tiny.target, "model", tiny.draft_noisy)
    yield running
    running.stop()


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def short_prompts(tmp_path: Path) -> Path:
    return write_rows(tmp_path / "short.jsonl", [{"id": f"short-{i}", "category": c, "prompt": p} for i, (c, p) in enumerate(SHORT)])


def bench(cluster, tiny, tmp_path: Path, *flags: str) -> dict:
    from specd_app import cli

    output = tmp_path / "report.json"
    argv = ["bench", "--gateway", cluster.address, "--target", str(tiny.target), "--drafter", "model", "--no-hf",
            "--output", str(output), *flags]
    assert cli.main(argv) == 0
    assert not list(tmp_path.glob("*.png"))  # these reports are tables, not the speedup plot
    return json.loads(output.read_text())


def assert_saved_with_command_machine_and_date(report: dict) -> None:
    assert report["command"].startswith("specd bench") and report["machine"]["date"] and report["machine"]["logical_cpus"] > 0


def test_sequential_too_reports_one_at_a_time_and_n_at_once_side_by_side(bench_cluster, tiny, tmp_path, capsys):
    report = bench(bench_cluster, tiny, tmp_path, "--prompts", str(short_prompts(tmp_path)), "--max-new-tokens", "6",
                   "--concurrency", "2", "--sequential-too", "--repeats", "2")
    assert_saved_with_command_machine_and_date(report)
    assert report["settings"]["sequential_too"] and report["settings"]["repeats"] == 2
    scaling = report["scaling"]
    assert scaling["concurrency"] == 2 and set(scaling["modes"]) == {"target_only", "specd"}
    for mode, row in scaling["modes"].items():
        one, many = report["sequential"][mode]["overall"], report["modes"][mode]["overall"]
        assert one["prompts"] == many["prompts"] == 2 * len(SHORT)  # every prompt, in each of the two repeats
        assert row["sequential"]["tokens_per_s"] == one["tokens_per_s"] > 0
        assert row["concurrent"]["tokens_per_s"] == many["tokens_per_s"] > 0
        assert row["concurrent_over_sequential"] == round(many["tokens_per_s"] / one["tokens_per_s"], 3)
        assert row["concurrent_over_sequential_by_repeat"] == [
            round(m / o, 3) for m, o in zip(many["tokens_per_s_by_repeat"], one["tokens_per_s_by_repeat"])]
        assert row["vs_target_only"] == {"sequential": one["speedup"], "concurrent": many["speedup"]}
        for side in (one, many):  # the client's CPU over the timed runs alone: never more cores than the machine has
            assert 0 <= side["cores_by_process"]["client"] == side["cores"] <= os.cpu_count()
        for side in (row["sequential"], row["concurrent"]):
            assert 0 < side["ttft_ms_p50"] <= side["ttft_ms_p95"] and 0 < side["itl_ms_p50"] <= side["itl_ms_p95"]
        prefill = row["prefill"]
        assert set(prefill["ms_by_prompt"]) == set(prefill["prompt_tokens_by_prompt"]) == {f"short-{i}" for i in range(len(SHORT))}
        assert all(ms > 0 for ms in prefill["ms_by_prompt"].values()) and all(n > 0 for n in prefill["prompt_tokens_by_prompt"].values())
        assert prefill["mean_ms"] == pytest.approx(statistics.mean(prefill["ms_by_prompt"].values()), abs=0.1)
        waves = -(-len(SHORT) // 2)
        assert prefill["bound_s"] == pytest.approx(prefill["total_s"] + waves * prefill["decode_alone_s_median"], abs=0.002)
        bound_tokens_per_s = many["tokens"] / 2 / (prefill["total_s"] + waves * prefill["decode_alone_s_median"])
        assert prefill["bound_tokens_per_s"] == pytest.approx(bound_tokens_per_s, rel=0.05)
        assert prefill["reached"] == pytest.approx(many["tokens_per_s"] / prefill["bound_tokens_per_s"], rel=0.01)
    assert scaling["modes"]["target_only"]["vs_target_only"] == {"sequential": 1.0, "concurrent": 1.0}
    printed = capsys.readouterr().out
    assert "| 2 at once tok/s |" in printed and f"| target_only | {report['sequential']['target_only']['overall']['tokens_per_s']} |" in printed


def test_arrival_reports_the_running_streams_latency_before_and_during_a_long_prefill(bench_cluster, tiny, tmp_path, capsys):
    long_file = write_rows(tmp_path / "long.jsonl", [{"id": "long-short", "category": "rag", "prompt": LONG[:200]},
                                                      {"id": "long-0", "category": "rag", "prompt": LONG}])
    # the streams outlast the long prompt's prefill even at its smallest chunks beside them (325 tokens,
    # 4 positions a pass: ~82 passes), speculating several tokens a pass
    # (after 16 tokens: target-only's plain rounds bring up to 4 a Verify, so there are gaps before it arrives)
    report = bench(bench_cluster, tiny, tmp_path, "--prompts", str(short_prompts(tmp_path)), "--max-new-tokens", "300",
                   "--arrival", "--arrival-streams", "2", "--arrival-after", "16", "--arrival-prompts", str(long_file), "--repeats", "2")
    assert_saved_with_command_machine_and_date(report)
    assert report["settings"]["arrival_prompt"] == f"{long_file}#long-0"  # the longest prompt of the file
    assert set(report["arrival"]) == {"target_only", "specd"}
    for row in report["arrival"].values():
        assert row["runs"] == 2 and row["streams"] == row["streams_running_through_prefill"] == 2
        before, during = row["before"], row["during"]
        assert before["gaps"] > 0 and during["gaps"] > 0
        for side in (before, during):
            assert 0 < side["itl_ms_p50"] <= side["itl_ms_p95"] and side["longest_gap_ms"] > 0
        assert row["p95_during_over_before"] == round(during["itl_ms_p95"] / before["itl_ms_p95"], 3)
        assert row["within_target"] == (row["p95_during_over_before"] <= row["target_ratio"] == 2.0)
        assert len(row["p95_during_over_before_by_run"]) == 2 and all(r > 0 for r in row["p95_during_over_before_by_run"])
        assert row["long_prompt_tokens"] > 300 and row["long_ttft_ms_alone"] > 0 and row["long_ttft_ms_under_load"] > 0
    assert "| target_only | 2/2 |" in capsys.readouterr().out


def test_arrival_windows_count_a_stall_through_the_whole_prefill():
    """Hand-made timestamps: gaps before the arrival count once every stream has its first token; a
    gap that overlaps [arrival, the long prompt's first token] counts as during, even one that began
    before the arrival and ended after the first token (a stream stalled by a prefill run in one go)."""
    from specd_app.bench import ArrivalRun, Sample, arrival_report, gap_summary

    steady = Sample("chat", tokens=6, seconds=9.0, ttft_s=1.0, started=0.0,
                    chunks=[(1.0, 1), (1.1, 1), (1.2, 1), (1.3, 1), (3.5, 1), (3.6, 1)])  # stalled 1.3 → 3.5
    late = Sample("chat", tokens=7, seconds=9.0, ttft_s=1.15, started=0.0,
                  chunks=[(1.15, 1), (1.25, 3), (1.35, 1), (3.4, 1), (3.45, 1)])
    long = Sample("rag", tokens=1, seconds=3.0, ttft_s=2.0, started=1.4)  # arrives at 1.4, first token at 3.4
    run = ArrivalRun([steady, late], long, long_alone=Sample("rag", tokens=1, seconds=1.0, ttft_s=1.5), arrived=1.4)
    before, during = run.gaps()
    assert sorted(before) == sorted([(1.2, 1.3, 1), (1.15, 1.25, 3), (1.25, 1.35, 1)])  # (1.0, 1.1), (1.1, 1.2): before 1.15
    assert sorted(during) == sorted([(1.3, 3.5, 1), (1.35, 3.4, 1)])
    assert run.running_through_prefill() == 2
    summary = gap_summary(before)
    assert summary["gaps"] == 3 and summary["itl_ms_p50"] == 33.3 and summary["itl_ms_p95"] == 100.0  # a 3-token gap: 33 ms thrice
    report = arrival_report([run])
    assert report["during"]["longest_gap_ms"] == 2200.0 and report["p95_during_over_before"] == round(2200.0 / 100.0, 3)
    assert not report["within_target"] and report["long_ttft_ms_alone"] == 1500.0 and report["long_ttft_ms_under_load"] == 2000.0


def test_prefill_bound_is_every_prefill_plus_one_decode_per_wave():
    from specd_app.bench import Sample, prefill_bound

    alone = [Sample("rag", tokens=10, seconds=3.0, ttft_s=2.0, prompt_id="a", prompt_tokens=800),
             Sample("rag", tokens=10, seconds=4.0, ttft_s=3.0, prompt_id="b", prompt_tokens=1000),
             Sample("rag", tokens=10, seconds=2.0, ttft_s=1.0, prompt_id="c", prompt_tokens=400)]
    concurrent = {"prompts": 6, "tokens": 60, "tokens_per_s": 4.0}  # the three prompts twice, 2 at a time
    bound = prefill_bound(alone, concurrent, concurrency=2)
    assert bound["ms_by_prompt"] == {"a": 2000.0, "b": 3000.0, "c": 1000.0} and bound["total_s"] == 6.0
    assert bound["decode_alone_s_median"] == 1.0 and bound["bound_s"] == 6.0 + 2 * 1.0  # ⌈3 / 2⌉ waves
    assert bound["bound_tokens_per_s"] == 30 / 8.0 and bound["reached"] == round(4.0 / 3.75, 3)
    assert bound["prompt_tokens_by_prompt"] == {"a": 800, "b": 1000, "c": 400}


def test_the_concurrency_flags_refuse_what_they_cannot_measure(tmp_path):
    from specd_app import cli

    prompts = str(short_prompts(tmp_path))
    base = ["bench", "--gateway", "127.0.0.1:1", "--prompts", prompts, "--no-hf", "--drafter", "model"]
    with pytest.raises(SystemExit, match="--sequential-too"):
        cli.main([*base, "--sequential-too"])  # one stream at a time is all there is
    with pytest.raises(SystemExit, match="--arrival-after"):
        cli.main([*base, "--arrival", "--max-new-tokens", "16", "--arrival-after", "16"])


def test_the_long_prompt_file_is_what_its_builder_writes_and_every_prompt_is_long():
    """docs/benchmarks/long_prompts.jsonl by the default target's tokenizer (raw prompt text, before
    the chat template): every prompt at least MIN_TOKENS, the first eight (`--limit 8`) 750-1,100,
    the last two near 2,000 (`--arrival`'s longest prompt among them); and rebuilt, the same file."""
    from specd_app.bench import load_prompts, longest_prompt
    from specd_app.long_prompts import LONG_PROMPTS, MIN_TOKENS, build_long_prompts, default_token_counter

    count = default_token_counter()
    rows = load_prompts(str(LONG_PROMPTS), limit=100)
    assert rows == build_long_prompts(count)
    sizes = [count(row["prompt"]) for row in rows]
    assert len(rows) >= 10 and min(sizes) >= MIN_TOKENS
    assert all(750 <= size <= 1100 for size in sizes[:8]) and all(1900 <= size <= 2050 for size in sizes[8:])
    assert len({row["id"] for row in rows}) == len(rows) and {row["category"] for row in rows} == {"summarization", "rag"}
    assert count(longest_prompt(str(LONG_PROMPTS))["prompt"]) >= 1900
