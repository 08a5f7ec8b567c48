"""Medusa-head trees offline: how many tokens a greedy target pass moves when the verify's heads
propose a tree of their top candidates instead of a chain, on the held-out answers of a
`specd train-draft` work dir (issue 14: is a heads tree worth its extra verified positions here?).

A round verifies the heads' proposals of the row before the last committed token (the row whose
next token is that token), as draft_training/medusa_training.simulate_chain does for chains; a tree
node is (parent node, head d, rank r): head d's r-th candidate at that row, placed under its parent.
Candidates come from MedusaHeads.propose as served: chained heads read the earlier heads' best, so
every node's parent is a node of the best chain (or the root); "chain3+leaves2" is the shape the
gateway drafts with draft_branches 2 (tree.chain_with_leaves).
The round keeps the deepest path whose tokens are the target's greedy continuation, plus one
target token. No timing: the node count is what a pass verifies beyond the pending token; the
stack's cost per position count is what `specd bench` and the verify's start-up measure.

    .venv/bin/python scripts/heads_trees_offline.py --work-dir WORK --heads verify_service/heads/smollm2-135m-instruct \\
        --output docs/benchmarks/heads_trees_offline.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# name → nodes (parent index or -1 for the root's children, head d (0-based), rank r), parents first
TREES = {
    "chain3": [(-1, 0, 0), (0, 1, 0), (1, 2, 0)],
    "chain3+a2": [(-1, 0, 0), (0, 1, 0), (1, 2, 0), (-1, 0, 1)],
    "chain3+a2+a3": [(-1, 0, 0), (0, 1, 0), (1, 2, 0), (-1, 0, 1), (-1, 0, 2)],
    "chain3+a2+b2": [(-1, 0, 0), (0, 1, 0), (1, 2, 0), (-1, 0, 1), (0, 1, 1)],
    "chain3+a2+b2+a3": [(-1, 0, 0), (0, 1, 0), (1, 2, 0), (-1, 0, 1), (0, 1, 1), (-1, 0, 2)],
    "chain2+leaves2": [(-1, 0, 0), (-1, 0, 1), (0, 1, 0), (0, 1, 1)],
    "chain3+leaves2": [(-1, 0, 0), (-1, 0, 1), (0, 1, 0), (0, 1, 1), (2, 2, 0), (2, 2, 1)],
    "chain3+leaves3": [(-1, 0, 0), (-1, 0, 1), (-1, 0, 2), (0, 1, 0), (0, 1, 1), (0, 1, 2), (3, 2, 0), (3, 2, 1), (3, 2, 2)],
}


def accepted_depth(tree: list, candidates: list, row: int, continuation: list[int]) -> int:
    """Tokens of the deepest tree path equal to `continuation` (the target's greedy tokens after the
    last committed one). candidates[d][row][r]: head d's r-th candidate at that row."""
    node, depth = -1, 0
    while depth < len(continuation):
        child = next((i for i, (parent, d, r) in enumerate(tree) if parent == node
                      and candidates[d][row][r] == continuation[depth]), None)
        if child is None:
            return depth
        node, depth = child, depth + 1
    return depth


def passes_for(tree: list, candidates: list, tokens: list[int], start: int) -> int:
    """Target passes to produce tokens[start:] greedily: the prompt's pass, then one per round."""
    length, passes = start + 1, 1
    while length < len(tokens):
        room = len(tokens) - length - 1  # the last token always comes from the target
        length += 1 + accepted_depth(tree, candidates, length - 2, tokens[length : length + room])
        passes += 1
    return passes


def main() -> None:
    from held_out import held_out_parser, load_held_out, report_header
    from specd_common.models import vocab_digest
    from verify_service.medusa import load_heads

    parser = held_out_parser(__doc__)
    parser.add_argument("--heads", required=True, help="Medusa heads folder")
    args = parser.parse_args()
    target, records = load_held_out(args)
    heads = load_heads(Path(args.heads), target.model, vocab_digest(target.tokenizer))
    ranks = 1 + max(r for tree in TREES.values() for *_, r in tree)
    passes = dict.fromkeys(TREES, 0)
    with torch.inference_mode():
        for record in records:
            tokens = record["tokens"].long().tolist()
            next_tokens = torch.tensor(tokens[1:] + tokens[-1:])  # [T]: each row's own next token
            proposed = heads.propose(record["features"].float(), next_tokens, record.get("layer_features"), ranks)  # [T, K, ranks]
            candidates = proposed.view(len(tokens), -1, ranks).transpose(0, 1).tolist()  # [K][T][ranks]
            for name, tree in TREES.items():
                passes[name] += passes_for(tree, candidates, tokens, record["start"])
    produced = sum(len(r["tokens"]) - r["start"] for r in records)
    results = {name: {"nodes": len(tree), "passes": passes[name], "tokens_per_pass": round(produced / passes[name], 4)}
               for name, tree in TREES.items()}
    for name, result in results.items():
        print(name, json.dumps(result), flush=True)
    report = {**report_header(), "heads": args.heads, "held_out_answers": len(records), "answer_tokens": produced,
              "trees": {name: [list(node) for node in tree] for name, tree in TREES.items()}, "results": results}
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
