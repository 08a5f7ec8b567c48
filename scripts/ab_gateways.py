"""Two gateways side by side on one verify: target-only and each gateway's speculation, per prompt.

A policy change shows in the gateway alone, and this VM's speed swings ±20% from hour to hour, so
the fair comparison runs both policies against the same verify, prompt by prompt, in a rotating
order (each mode goes first as often as the others), and says each repeat's ratio apart.

    # the code before the change: a worktree of main, its gateway on the running verify
    git worktree add /tmp/before main
    (cd /tmp/before && PYTHONPATH=.:protos python -m specd_app.cli serve gateway --port 51061 \\
        --http-port 0 --metrics-port 0 --verify-address 127.0.0.1:50053 --draft-address "")
    python scripts/ab_gateways.py --new 127.0.0.1:50051 --old 127.0.0.1:51061 --repeats 2 \\
        --prompts docs/benchmarks/unseen_prompts.jsonl docs/benchmarks/heldout_prompts.jsonl \\
        --output ab.json

Target-only runs through --new (disable_speculation). The report: tokens/s over target-only per
mode, per kind and per repeat, tokens a pass kept and predicted, the share of rounds rested, and
each mode's median time to first token.

Two whole stacks (an engine change: the verify differs too) compare with --old-target-only: target-only
runs through each, each gateway's speculation is priced against its own, and `target_only_vs_old`
says how the two target-only runs compare.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections import defaultdict

import grpc

from specd.v1 import common_pb2, generate_pb2_grpc
from specd_app.bench import load_prompts, machine_facts, stream_one

MODES = ("target_only", "new", "old")
OLD_TARGET_ONLY = "old_target_only"  # --old-target-only: target-only through --old too
BASELINE = {"new": "target_only", "old": OLD_TARGET_ONLY}  # each gateway's own target-only, where both run one


def run(args: argparse.Namespace) -> list[dict]:
    stubs = {mode: generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(address))
             for mode, address in (("new", args.new), ("old", args.old))}
    rows = [row for path in args.prompts for row in load_prompts(path, args.limit)]
    modes = MODES + ((OLD_TARGET_ONLY,) if args.old_target_only else ())
    records = []
    for repeat in range(args.repeats):
        for index, row in enumerate(rows):
            first = (index + repeat) % len(modes)
            for mode in modes[first:] + modes[:first]:
                fields = {"disable_speculation": mode in ("target_only", OLD_TARGET_ONLY)}
                if args.temperature:
                    fields.update(sampling=common_pb2.SamplingParams(temperature=args.temperature), seed=args.seed)
                sample = stream_one(stubs["old" if mode.startswith("old") else "new"], row, args.max_new_tokens, **fields)
                stats = sample.stats
                records.append(dict(repeat=repeat, id=row.get("id", ""), kind=row.get("category", "all"), mode=mode,
                                    tokens=sample.tokens, seconds=round(sample.seconds, 4), passes=stats.target_passes,
                                    accepted=stats.accepted_tokens, predicted=round(stats.predicted_tokens, 3),
                                    rested=stats.rested_rounds, ttft_ms=round((sample.ttft_s or 0.0) * 1e3, 1)))
    return records


def summary(records: list[dict]) -> dict:
    """Per mode: tokens/s over its target-only overall, by kind and by repeat; tokens a pass kept and
    predicted; rounds rested."""
    totals: dict = defaultdict(lambda: [0, 0.0])
    for record in records:
        for group in ("all", f"kind:{record['kind']}", f"repeat:{record['repeat']}"):
            totals[record["mode"], group][0] += record["tokens"]
            totals[record["mode"], group][1] += record["seconds"]
    rate = {key: tokens / seconds for key, (tokens, seconds) in totals.items() if seconds}
    report = {}
    modes = {r["mode"] for r in records}
    for mode in sorted(modes - {"target_only", OLD_TARGET_ONLY}):
        mine = [r for r in records if r["mode"] == mode]
        passes = sum(r["passes"] for r in mine) or 1
        baseline = BASELINE[mode] if BASELINE[mode] in modes else "target_only"
        report[mode] = dict(
            speedup={group: round(rate[mode, group] / rate[baseline, group], 3)
                     for (m, group) in sorted(rate) if m == mode and (baseline, group) in rate},
            tokens_per_pass=round((sum(r["accepted"] for r in mine) + passes) / passes, 3),
            predicted_tokens_per_pass=round(sum(r["predicted"] for r in mine) / passes, 3),
            rested_round_share=round(sum(r["rested"] for r in mine) / passes, 3),
        )
    report["target_only_tokens_per_s"] = round(rate["target_only", "all"], 2)
    report["ttft_p50_ms"] = {mode: round(statistics.median(r["ttft_ms"] for r in records if r["mode"] == mode), 1)
                             for mode in sorted(modes)}
    if OLD_TARGET_ONLY in modes:
        report["target_only_vs_old"] = {group: round(rate["target_only", group] / rate[OLD_TARGET_ONLY, group], 3)
                                        for (m, group) in sorted(rate) if m == OLD_TARGET_ONLY}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new", required=True, help="the gateway of the code under test (target-only runs here too)")
    parser.add_argument("--old", required=True, help="the gateway it is compared with, on the same verify")
    parser.add_argument("--old-target-only", action="store_true",
                        help="target-only through --old too (another stack), each gateway over its own")
    parser.add_argument("--prompts", nargs="+", required=True)
    parser.add_argument("--limit", type=int, default=16, help="first N prompts of each file")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    records = run(args)
    command = "python scripts/ab_gateways.py " + shlex.join(sys.argv[1:])
    result = dict(command=command, started=started, machine=machine_facts(), settings=vars(args), summary=summary(records),
                  records=records)
    print(json.dumps(result["summary"], indent=1))
    if args.output:
        with open(args.output, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
