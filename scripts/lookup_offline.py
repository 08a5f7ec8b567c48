"""Lookup rounds offline: how many tokens a target pass moves when prompt-lookup copies of up to C tokens
are tried before the feature head's k drafts, on the held-out answers of a `specd train-draft` work dir.

Greedy rounds are simulated as in draft_training/draft_eval.py (the answer is the target's greedy
continuation, so a round keeps the longest matching prefix plus one target token): a round is a
lookup round when specd_common.lookup.prompt_lookup finds a copy (min n-gram 2, as the gateway's
default), else a head round of k drafts through the feature drafter's serving path. No timing: the
counts decide how many positions each pass verifies; the stack's costs are measured by `specd bench`.

    .venv/bin/python scripts/lookup_offline.py --work-dir WORK --head draft_service/heads/smollm2-135m-instruct \\
        --pairs 3:8 3:3 0:8 3:0 --output docs/benchmarks/lookup_offline.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def simulate(drafter, records: list[dict], head_k: int, copy_tokens: int, min_ngram: int = 2) -> dict:
    """Per source (copy / head): rounds, tokens per pass and drafts per pass, over all answers."""
    from specd_common.features import encode_features
    from specd_common.lookup import prompt_lookup
    from specd_common.params import Warp

    rounds = []  # (source, drafted, accepted)
    for record in records:
        tokens, start = record["tokens"].tolist(), record["start"]
        answer = tokens[start:]
        session, position, sent = drafter.open(tokens[:start], Warp()), 0, 0
        while position < len(answer):
            drafter.add_features(session, encode_features(record["features"][sent : start + position - 1], sent))
            sent = start + position - 1
            left = len(answer) - position - 1  # the last token always comes from the target
            sequence = session.sequence
            copy = prompt_lookup(sequence.tokens, min(copy_tokens, left), min_ngram=min_ngram) if copy_tokens and left > 0 else []
            if copy:
                sequence.tokens.extend(copy)  # held as the draft's pending tokens, rolled back by the commit
                proposal, source = copy, "copy"
            elif min(head_k, left) > 0:
                proposal, source = drafter.propose(session, min(head_k, left), None).token_ids, "head"
            else:
                proposal, source = [], "none"
            accepted = 0
            while accepted < len(proposal) and proposal[accepted] == answer[position + accepted]:
                accepted += 1
            rounds.append((source, len(proposal), accepted))
            sequence.apply_commit(start + position + accepted, [answer[position + accepted]])
            position += accepted + 1
    summary = {"passes": len(rounds), "tokens_per_pass": round(sum(a + 1 for *_, a in rounds) / len(rounds), 3),
               "drafts_per_pass": round(sum(d for _, d, _ in rounds) / len(rounds), 3)}
    for source in ("copy", "head", "none"):
        mine = [r for r in rounds if r[0] == source]
        if mine:
            summary[source] = {"rounds": len(mine), "tokens_per_pass": round(sum(a + 1 for *_, a in mine) / len(mine), 3),
                               "drafts_per_pass": round(sum(d for _, d, _ in mine) / len(mine), 3)}
    return summary


def main() -> None:
    from draft_service.feature_drafter import FeatureDrafter
    from draft_service.feature_head import load_head
    from held_out import held_out_parser, load_held_out, report_header
    from specd_common.models import describe_model, max_sequence_length

    parser = held_out_parser(__doc__)
    parser.add_argument("--head", required=True, help="feature head folder")
    parser.add_argument("--pairs", nargs="+", default=["3:8", "3:3", "0:8", "3:0"], help="HEAD_K:COPY_TOKENS (0 = none)")
    args = parser.parse_args()
    target, records = load_held_out(args)
    head = load_head(Path(args.head), target.model, torch.bfloat16)  # as served
    drafter = FeatureDrafter(head, describe_model(target), max_sequence_length(target), lookup_min_ngram=0)
    results = {}
    with torch.inference_mode():
        for pair in args.pairs:
            head_k, copy_tokens = map(int, pair.split(":"))
            results[f"head{head_k}_copy{copy_tokens}"] = simulate(drafter, records, head_k, copy_tokens)
            print(pair, json.dumps(results[f"head{head_k}_copy{copy_tokens}"]), flush=True)
    report = {**report_header(), "threads": args.threads, "held_out_answers": len(records),
              "answer_tokens": sum(len(r["tokens"]) - r["start"] for r in records), "results": results}
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
