"""Teacher-forced agreement of feature heads with the target on held-out answers (docs/draft-training.md).

For every answer position t of the held-out answers a `specd train-draft` work dir holds (gen-eval
shards), the head reads (x_t, the target's true feature f_{t-1}), as at a draft's first position,
and its top-n tokens are compared with the target's greedy next token x_{t+1}. Cheaper than the
simulated speculation of `specd train-draft` (one batched pass per answer), and comparable across
heads on the same answers.

    .venv/bin/python scripts/head_agreement.py --work-dir WORK \\
        --head previous=OLD_HEAD_DIR --head corpus=NEW_HEAD_DIR --output agreement.json

With --speculate K it also simulates greedy speculation at fixed k = K on the same answers through the
draft's serving path (draft_training/draft_eval.py), in bfloat16 as served, with the head alone and
with prompt lookup first (the served default, --lookup-min-ngram 2): tokens per target pass and the
acceptance at each draft position (given the positions before it were accepted), overall and per kind.

With --leak-free it also reports all of it on the held-out answers whose prompt holds no passage of a
corpus prompt (train_prompts.passage_check, as scripts/medusa_compare.py): a head trained on the
leaking corpus records scores high on the others, so heads of different runs compare fairly there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

TOP = (1, 2, 3)


def agreement(head, records: list[dict]) -> dict:
    """Share of answer positions whose next token is among the head's top-n, overall and top-1 per kind."""
    hits, total, by_kind = {n: 0 for n in TOP}, 0, {}
    with torch.inference_mode():
        for record in records:
            tokens, features, start = record["tokens"].long(), record["features"].float(), record["start"]
            estimates = head(tokens[None, 1:], features[None, :-1], torch.arange(1, len(tokens)))[0]  # [T-1, H]: f̂ at 1..T-1
            best = head.vocab_ids[torch.topk(head.logits(estimates), max(TOP), dim=-1).indices]  # [T-1, 3] token ids
            for row in range(start - 1, len(tokens) - 2):  # row i reads x_{i+1}, predicts x_{i+2}
                following, guesses = int(tokens[row + 2]), best[row].tolist()
                total += 1
                for n in TOP:
                    hits[n] += following in guesses[:n]
                kind = by_kind.setdefault(record["category"], [0, 0])
                kind[0] += following == guesses[0]
                kind[1] += 1
    return {"positions": total, **{f"top{n}": round(hits[n] / total, 3) for n in TOP},
            "top1_by_kind": {kind: round(right / seen, 3) for kind, (right, seen) in sorted(by_kind.items())}}


def simulated(head, target, records: list[dict], k: int) -> dict:
    """Simulated greedy rounds at fixed k, the head alone and with prompt lookup first (as served)."""
    from draft_service.feature_drafter import FeatureDrafter
    from draft_training.draft_eval import evaluate_drafter
    from specd_engine.models import describe_model, max_sequence_length

    head = head.to(torch.bfloat16)
    results = {}
    with torch.inference_mode():
        drafter = FeatureDrafter(head, describe_model(target), max_sequence_length(target))
        for name, lookup in (("head_only", 0), ("lookup2", 2)):
            results[name] = evaluate_drafter(drafter, records, ks=(k,), lookup_min_ngram=lookup)[f"k={k}"]
    return results


def main() -> None:
    from draft_service.feature_head import load_head
    from draft_training.feature_training import eval_records
    from specd_common.config import DEFAULT_TARGET
    from specd_engine.models import load_causal_lm

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", required=True, help="a train-draft work dir with held-out answers (data/gen-eval-*)")
    parser.add_argument("--head", action="append", required=True, help="NAME=HEAD_DIR, repeatable")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--output", default="", help="write the results as JSON here")
    parser.add_argument("--speculate", type=int, default=0, help="also simulate greedy speculation at this fixed k (0 = no)")
    parser.add_argument("--leak-free", action="store_true", help="also report on the held-out answers whose prompt "
                        "shares no passage with a corpus prompt")
    args = parser.parse_args()
    target = load_causal_lm(args.target, device="cpu", dtype="float32")
    records = eval_records(target, Path(args.work_dir), 0)
    subsets = {"all": records}
    if args.leak_free:
        from draft_training.feature_training import corpus_prompts
        from draft_training.train_prompts import passage_check

        holds_passage = passage_check(corpus_prompts(target.name))
        subsets["leak_free"] = [r for r in records if not holds_passage(r["tokens"][: r["start"]].tolist())]
    results = {}
    for name, folder in (spec.split("=", 1) for spec in args.head):
        head = load_head(Path(folder), target.model)
        results[name] = {}
        for subset, chosen in subsets.items():
            results[name][subset] = {"held_out_answers": len(chosen), **agreement(head, chosen)}
        if args.speculate:  # after the agreement: simulated() turns the head to bfloat16, as served
            for subset, chosen in subsets.items():
                results[name][subset]["speculation"] = simulated(head, target, chosen, args.speculate)
    text = json.dumps({"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                       "work_dir": args.work_dir, "held_out_answers": len(records), "heads": results}, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
