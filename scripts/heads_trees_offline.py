"""Medusa-head trees offline: how many tokens a greedy target pass moves when the verify's heads
propose a tree of their top candidates instead of a chain, on the held-out answers of a
`specd train-draft` work dir (issue 14: is a heads tree worth its extra verified positions here?).

A round verifies the heads' proposals of the row before the last committed token (the row whose
next token is that token), as draft_training/medusa_training.simulate_chain does for chains; a tree
node is (parent node, head d, rank r): head d's r-th candidate at that row, placed under its parent.
Candidates come from MedusaHeads.propose as served: chained heads read the earlier heads' best, so
every node's parent is a node of the best chain (or the root); "chain3+leaves2" is the shape the
gateway drafts with draft_branches 2 (tree.chain_with_leaves).
"confident<N>/c<C>" is the gateway's rule with confidences (adaptive.confident_tree) at a fixed size: per
row the N nodes of the largest path products of the heads' probabilities among each head's best C;
"confident>=<t>" keeps the nodes worth at least t instead. "calibration" bins every candidate node
by that value against how often it was the target's path: are the products acceptance rates?
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
CONFIDENT_NODES = (3, 4, 5, 6, 8)  # per-row trees of that many nodes chosen by the heads' confidence ...
CONFIDENT_CANDIDATES = (2, 3, 4)  # ... among each head's best c candidates
CONFIDENT_THRESHOLDS = (0.02, 0.05, 0.1, 0.2)  # ... of up to 12 nodes (c = 4), those worth at least that


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


def node_values(confidences: list, row: int) -> list:
    """adaptive.node_values of that row (the gateway's rule): [(value, depth, rank)] for every
    candidate. confidences[d][row][r]: head d's probability of its r-th candidate."""
    from gateway.adaptive import node_values as values_of

    return values_of([probs[row] for probs in confidences])


def confident_tree(confidences: list, row: int, nodes: int, threshold: float = 0.0, candidates: int = 0) -> list:
    """At most `nodes` nodes of the most value (node_values) at that row, those of value ≥ threshold
    past the first, among each head's first `candidates` (0: all; EAGLE-2's dynamic tree); parents
    come first since a child's value is below its parent's."""
    pool = [node for node in node_values(confidences, row) if not candidates or node[2] < candidates]
    ranked = sorted(pool, reverse=True)[:nodes]
    chosen = sorted(ranked[:1] + [node for node in ranked[1:] if node[0] >= threshold], key=lambda node: (node[1], node[2]))
    chain = {}  # depth → index of the chain node there
    tree = []
    for _, depth, rank in chosen:
        if depth > 0 and depth - 1 not in chain:
            continue  # its parent was not chosen (equal values)
        tree.append((chain.get(depth - 1, -1), depth, rank))
        if rank == 0:
            chain[depth] = len(tree) - 1
    return tree


def passes_for(tree, candidates: list, tokens: list[int], start: int) -> tuple[int, int]:
    """(target passes to produce tokens[start:] greedily: the prompt's pass, then one per round;
    nodes verified in all); tree: a fixed tree, or row → that row's tree."""
    length, passes, nodes = start + 1, 1, 0
    while length < len(tokens):
        room = len(tokens) - length - 1  # the last token always comes from the target
        row = length - 2
        shape = tree(row) if callable(tree) else tree
        length += 1 + accepted_depth(shape, candidates, row, tokens[length : length + room])
        passes, nodes = passes + 1, nodes + len(shape)
    return passes, nodes


CALIBRATION_EDGES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001)


def calibration_counts(confidences: list, candidates: list, tokens: list[int], start: int, counts: list) -> None:
    """Adds each answer row's nodes to counts[bin] = [nodes, Σ value, nodes on the target's path],
    binned by value (CALIBRATION_EDGES): are the heads' path probabilities the acceptance rates?"""
    for row in range(start - 1, len(tokens) - 2):
        truth = tokens[row + 2 :]
        for value, depth, rank in node_values(confidences, row):
            path = [candidates[d][row][0] for d in range(depth)] + [candidates[depth][row][rank]]
            hit = len(truth) > depth and path == truth[: depth + 1]
            b = next(i for i, edge in enumerate(CALIBRATION_EDGES[1:]) if value < edge)
            counts[b][0] += 1
            counts[b][1] += value
            counts[b][2] += hit


def main() -> None:
    from held_out import held_out_parser, load_held_out, report_header
    from specd_common.models import vocab_digest
    from verify_service.medusa import load_heads

    parser = held_out_parser(__doc__)
    parser.add_argument("--heads", required=True, help="Medusa heads folder")
    args = parser.parse_args()
    target, records = load_held_out(args)
    heads = load_heads(Path(args.heads), target.model, vocab_digest(target.tokenizer))
    ranks = max(CONFIDENT_CANDIDATES)
    shapes = {**TREES, **{f"confident{n}/c{c}": (n, 0.0, c) for c in CONFIDENT_CANDIDATES for n in CONFIDENT_NODES},
              **{f"confident>={t}/c{ranks}": (heads.config.num_heads * ranks, t, ranks) for t in CONFIDENT_THRESHOLDS}}
    passes, nodes = dict.fromkeys(shapes, 0), dict.fromkeys(shapes, 0)
    counts = [[0, 0.0, 0] for _ in CALIBRATION_EDGES[1:]]
    with torch.inference_mode():
        for record in records:
            tokens = record["tokens"].long().tolist()
            next_tokens = torch.tensor(tokens[1:] + tokens[-1:])  # [T]: each row's own next token
            proposed, probs = heads.ranked(record["features"].float(), next_tokens, record.get("layer_features"), ranks)  # [T, K, ranks]
            candidates = proposed.transpose(0, 1).tolist()  # [K][T][ranks]
            confidences = probs.transpose(0, 1).tolist()
            for name, tree in shapes.items():
                if name not in TREES:
                    tree = lambda row, shape=tree: confident_tree(confidences, row, *shape)
                record_passes, record_nodes = passes_for(tree, candidates, tokens, record["start"])
                passes[name], nodes[name] = passes[name] + record_passes, nodes[name] + record_nodes
            calibration_counts(confidences, candidates, tokens, record["start"], counts)
    produced = sum(len(r["tokens"]) - r["start"] for r in records)
    rounds = {name: passes[name] - len(records) for name in shapes}  # the prompts' passes draft nothing
    results = {name: {"nodes_per_round": round(nodes[name] / rounds[name], 3), "passes": passes[name],
                      "tokens_per_pass": round(produced / passes[name], 4)} for name in shapes}
    calibration = [{"value_from": low, "value_to": min(high, 1.0), "nodes": n, "mean_value": round(total / n, 4),
                    "accepted": round(hits / n, 4)} for (low, high), (n, total, hits)
                   in zip(zip(CALIBRATION_EDGES, CALIBRATION_EDGES[1:]), counts) if n]
    for name, result in results.items():
        print(name, json.dumps(result), flush=True)
    for row in calibration:
        print("calibration", json.dumps(row), flush=True)
    report = {**report_header(), "heads": args.heads, "held_out_answers": len(records), "answer_tokens": produced,
              "trees": {name: [list(node) for node in tree] for name, tree in TREES.items()}, "results": results,
              "calibration": calibration}
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
