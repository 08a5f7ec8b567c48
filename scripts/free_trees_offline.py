"""Free drafters in one tree, offline: how many tokens a greedy target pass moves, and at what modeled
speed, when a lookup copy and the Medusa heads' confident candidates share a round's tree
(gateway/engine.py, Generation._joined_round) instead of a copy preempting the heads, on the held-out
answers of a `specd train-draft` work dir. Also measured, not shipped: a third free drafter, an n-gram
table of the committed corpus of the target's own answers (`--corpus-ngrams`).

Each answer is one request, simulated round by round with the gateway's own rule and estimates: a
copy (specd_common.lookup.prompt_lookup, up to 8 tokens, min n-gram 2) valued by the request's
AcceptanceEstimate of copies (adaptive.chain_nodes), the heads' candidates (4 a head, as served) by
their path products times the request's HeadCalibration (adaptive.head_nodes), and the round's nodes
chosen by adaptive.valued_tree for a verify costing base + position · n (+ tree for a tree pass) ms.
Policies: "preempt" (before: a copy alone when one exists, cut by its value; else the heads' tree),
"joined" (now: both in one tree where a heads' node pays), "heads" (no copies), each also as
":chains" (a request beside others: one candidate a head, the pools' chains compete), and with
--corpus-ngrams "corpus" (the corpus table's chain alone) and "joined+corpus" (it as a third pool).

The corpus table: for n = 4 down to 1, the most frequent token after each n tokens of the corpus
answers (counts over answer positions only), valued count / (total + 2) (add-2 smoothing: a raw
count / total made n-grams seen once 100% sure, and they hit 28%). Corpus records whose prompts
share a rare 6-gram with a held-out prompt (in < 20 corpus prompts; train_prompts.leaking_prompts) are left out: the synthetic
summarization and translation prompts reuse passages across templates, and keeping them inflated
the table's own tokens a pass (`--keep-leaks` keeps them).

    PYTHONPATH=scripts:. .venv/bin/python scripts/free_trees_offline.py --work-dir WORK \\
        --heads verify_service/heads/smollm2-135m-instruct --corpus-ngrams --output docs/benchmarks/free_trees_offline.json
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import torch

COPY_TOKENS, MIN_NGRAM, CANDIDATES = 8, 2, 4  # the CLI's --lookup-tokens and --lookup-min-ngram, draft_branches
NGRAM_ORDERS, SMOOTHING, NGRAM_DEPTH = (4, 3, 2, 1), 2.0, 4


class CorpusNgrams:
    """The most frequent next token after each n tokens of the corpus's answers, n in NGRAM_ORDERS:
    per order, sorted packed keys (16 bits a token) with their best next token, its count and the
    key's total count."""

    def __init__(self, sequences: list[tuple[list[int], int]]):
        self.tables = {n: self._table(sequences, n) for n in NGRAM_ORDERS}

    @staticmethod
    def _pack(windows: np.ndarray) -> np.ndarray:  # [M, n] token ids → [M] keys
        keys = np.zeros(len(windows), dtype=np.uint64)
        for column in windows.T:
            keys = (keys << np.uint64(16)) | column.astype(np.uint64)
        return keys

    def _table(self, sequences: list[tuple[list[int], int]], n: int) -> tuple:
        keys, nexts = [], []
        for tokens, start in sequences:
            ids = np.asarray(tokens, dtype=np.int64)
            at = np.arange(max(start, n), len(ids))  # answer positions with n tokens before them
            if len(at):
                keys.append(self._pack(np.stack([ids[at - n + j] for j in range(n)], axis=1)))
                nexts.append(ids[at])
        keys, nexts = np.concatenate(keys), np.concatenate(nexts)
        order = np.lexsort((nexts, keys))
        keys, nexts = keys[order], nexts[order]
        pair_starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (nexts[1:] != nexts[:-1])])
        pair_counts = np.diff(np.r_[pair_starts, len(keys)])
        pair_keys, pair_nexts = keys[pair_starts], nexts[pair_starts]
        key_starts = np.flatnonzero(np.r_[True, pair_keys[1:] != pair_keys[:-1]])
        group = np.repeat(np.arange(len(key_starts)), np.diff(np.r_[key_starts, len(pair_keys)]))
        best = np.lexsort((-pair_counts, group))[key_starts]  # each key's most frequent next token
        return pair_keys[key_starts], pair_nexts[best], pair_counts[best], np.add.reduceat(pair_counts, key_starts)

    def next_token(self, context: list[int]) -> tuple[int, float] | None:
        """(token, its smoothed share) after the longest n-gram of the context's end that the corpus holds."""
        for n in NGRAM_ORDERS:
            if len(context) < n:
                continue
            keys, best, count, total = self.tables[n]
            key = self._pack(np.asarray([context[-n:]]))[0]
            i = int(np.searchsorted(keys, key))
            if i < len(keys) and keys[i] == key:
                return int(best[i]), float(count[i] / (total[i] + SMOOTHING))
        return None

    def chain(self, context: list[int], depth: int) -> tuple[list[int], list[float]]:
        tokens, shares, context = [], [], list(context)
        while len(tokens) < depth and (step := self.next_token(context)) is not None:
            tokens.append(step[0])
            shares.append(step[1])
            context.append(step[0])
        return tokens, shares


def clean_corpus(records: list[dict], keep_leaks: bool = False) -> tuple[list[tuple[list[int], int]], int]:
    """The corpus's (tokens, answer start) without records whose prompt shares a rare passage with a
    held-out prompt (train_prompts.leaking_prompts; all of them with keep_leaks), and how many were left out."""
    from draft_training.corpus import Corpus, corpus_dir
    from draft_training.train_prompts import leaking_prompts
    from specd_common.config import DEFAULT_TARGET

    corpus = Corpus.open(corpus_dir(DEFAULT_TARGET))
    leaks = leaking_prompts([record.tokens[: record.start] for record in corpus.records],
                            [record["tokens"][: record["start"]].tolist() for record in records])
    kept = [(record.tokens, record.start) for record, leak in zip(corpus.records, leaks) if keep_leaks or not leak]
    return kept, len(corpus.records) - len(kept)


def simulate(record: dict, candidates: list, confidences: list, policy: str, cost, ngrams=None) -> tuple[int, int, float]:
    """One request's rounds under `policy`: (target passes, nodes verified, modeled ms)."""
    from gateway.adaptive import AcceptanceEstimate, HeadCalibration, chain_nodes, head_nodes, valued_tree
    from specd_common.lookup import prompt_lookup
    from specd_common.sequence import common_prefix

    policy, _, shape = policy.partition(":")  # "<policy>:chains": a request beside others, whose passes take chains
    width = 1 if shape == "chains" else CANDIDATES
    tokens, start = record["tokens"].tolist(), record["start"]
    copies, calibration = AcceptanceEstimate(), HeadCalibration()
    length, passes, nodes_in_all, ms = start + 1, 1, 0, cost(0, False)
    while length < len(tokens):
        room = len(tokens) - length - 1  # the last token always comes from the target
        row = length - 2  # the heads' proposals of the row before the last committed token
        copy = prompt_lookup(tokens[:length], min(COPY_TOKENS, room), min_ngram=MIN_NGRAM) if "joined" in policy or policy == "preempt" else []
        heads = head_nodes([c[:width] for c in candidates[row][:room]], [p[:width] for p in confidences[row][:room]], calibration.scale)
        copy_pool = chain_nodes(copy, copies.chain(len(copy)))
        pools = [copy_pool, heads] if policy != "corpus" else []
        if policy in ("corpus", "joined+corpus"):
            pools.append(chain_nodes(*ngrams.chain(tokens[:length], min(NGRAM_DEPTH, room))))
        # (the engine falls back to the copy's own rule where no heads' node pays: the same nodes here,
        # where a verify that asks for the heads' proposals costs what one that does not costs)
        nodes, _ = valued_tree([copy_pool] if copy and policy == "preempt" else pools, cost, trees=shape != "chains")
        truth = tuple(tokens[length : length + room])
        accepted = max((len(node.path) for node in nodes if truth[: len(node.path)] == node.path), default=0)
        copied = sum(node.path == tuple(copy[: len(node.path)]) for node in nodes)
        copies.update(copied, common_prefix(copy[:copied], truth[:accepted]))
        own = {node.path: node.value for node in heads}
        if any(node.path in own for node in nodes) and calibration.scale:
            calibration.observe(sum(own.get(node.path, 0.0) for node in nodes) / calibration.scale,
                                sum(node.path in own and truth[: len(node.path)] == node.path for node in nodes))
        tree = len({node.path[:-1] for node in nodes}) < len(nodes)
        length, passes, nodes_in_all, ms = length + 1 + accepted, passes + 1, nodes_in_all + len(nodes), ms + cost(len(nodes), tree)
    return passes, nodes_in_all, ms


def main() -> None:
    from held_out import held_out_parser, load_held_out, report_header
    from specd_common.models import vocab_digest
    from verify_service.medusa import load_heads

    parser = held_out_parser(__doc__)
    parser.add_argument("--heads", required=True, help="Medusa heads folder")
    parser.add_argument("--corpus-ngrams", action="store_true", help="also the corpus n-gram table: alone, and as a third pool")
    parser.add_argument("--keep-leaks", action="store_true", help="keep the corpus records that share passages with held-out prompts")
    parser.add_argument("--costs", nargs="+", default=["cpu:35:2.2:1.5", "flat:20:0.3:0.3"],
                        help="NAME:BASE:POSITION:TREE, ms of a verify of n + 1 positions: base + position · n (+ tree)")
    args = parser.parse_args()
    target, records = load_held_out(args)
    heads = load_heads(Path(args.heads), target.model, vocab_digest(target.tokenizer))
    ngrams, left_out = None, 0
    if args.corpus_ngrams:
        sequences, left_out = clean_corpus(records, args.keep_leaks)
        ngrams = CorpusNgrams(sequences)
    policies = ["heads", "preempt", "joined", "heads:chains", "preempt:chains", "joined:chains"] + (["corpus", "joined+corpus"] if ngrams else [])
    rows = []
    with torch.inference_mode():
        for record in records:
            tokens = record["tokens"].long().tolist()
            proposed, probs = heads.ranked(record["features"].float(), torch.tensor(tokens[1:] + tokens[-1:]), None, CANDIDATES)
            rows.append((record, proposed.tolist(), probs.tolist()))  # [T][K][c] each
    results = {}
    for spec in args.costs:
        name, base, position, tree = spec.split(":")
        cost = lambda n, is_tree, b=float(base), p=float(position), t=float(tree): b + p * n + (t if is_tree else 0.0)  # noqa: E731
        for policy in policies:
            by_kind = collections.defaultdict(lambda: [0, 0, 0, 0.0])  # kind → tokens, passes, nodes, ms
            for record, candidates, confidences in rows:
                passes, nodes, ms = simulate(record, candidates, confidences, policy, cost, ngrams)
                for kind in ("all", record["category"]):
                    totals = by_kind[kind]
                    totals[0] += len(record["tokens"]) - record["start"]
                    totals[1], totals[2], totals[3] = totals[1] + passes, totals[2] + nodes, totals[3] + ms
            results[f"{name}/{policy}"] = {kind: {"tokens_per_pass": round(t / p, 3), "nodes_per_pass": round(n / p, 2),
                                                  "modeled_tokens_per_s": round(1000 * t / ms, 2)} for kind, (t, p, n, ms) in sorted(by_kind.items())}
            print(name, policy, json.dumps(results[f"{name}/{policy}"]["all"]), flush=True)
    report = {**report_header(), "heads": args.heads, "held_out_answers": len(records), "costs": args.costs,
              "corpus_records_left_out": left_out, "results": results}
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
