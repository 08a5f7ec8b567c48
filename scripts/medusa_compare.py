"""Medusa heads side by side on the same held-out answers (docs/draft-training.md).

Runs `specd train-draft`'s own evaluation of Medusa heads (draft_training/medusa_training.py,
medusa_evaluation: each head's top-1 agreement with the target's greedy token, and greedy head
rounds simulated as the gateway runs them, k = 1..K, overall and per kind) for every heads folder
given, on the held-out answers of one work dir, so that heads trained in different runs are compared
on identical answers with identical features.

    .venv/bin/python scripts/medusa_compare.py --work-dir WORK \\
        --heads shipped=verify_service/heads/smollm2-135m-instruct --heads chained=WORK/medusa --output compare.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from specd_common.config import DEFAULT_TARGET


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", required=True, help="a train-draft work dir with held-out answers (data/gen-eval shards)")
    parser.add_argument("--heads", action="append", required=True, help="NAME=DIR, repeatable")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--output", default="")
    parser.add_argument("--leak-free", action="store_true", help="also report the chains on the held-out answers whose "
                        "prompt shares no passage with a corpus prompt (heads trained on leaking records score high elsewhere)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from draft_training.feature_training import corpus_prompts
    from draft_training.medusa_training import medusa_evaluation
    from draft_training.train_prompts import passage_check
    from specd_app.bench import emit_report, machine_facts
    from specd_engine.models import load_causal_lm, vocab_digest
    from verify_service.medusa import load_heads

    target = load_causal_lm(args.target, device="cpu", dtype="float32")
    report = {"command": " ".join(["python", "scripts/medusa_compare.py", *argv]), "machine": machine_facts(), "heads": {}}
    holds_passage = passage_check(corpus_prompts(target.name)) if args.leak_free else None  # the corpus counted once for every head
    for spec in args.heads:
        name, _, folder = spec.partition("=")
        heads = load_heads(Path(folder), target.model, vocab_digest(target.tokenizer))
        report["heads"][name] = {"folder": folder, "config": vars(heads.config),
                                 **medusa_evaluation(heads, target, Path(args.work_dir), 0, holds_passage)}
    emit_report(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
