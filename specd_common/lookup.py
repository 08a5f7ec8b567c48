"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the current suffix.

The one implementation: the gateway proposes copies itself (lookup rounds, gateway/engine.py), the
draft service's n-gram drafter proposes them as its drafts, and offline evaluations simulate both.
Their `--lookup-min-ngram` flags all mean `min_ngram` here."""

from __future__ import annotations

from typing import Sequence

LONGEST_NGRAM = 3  # the suffix length tried first, unless the shortest allowed is longer
SHORTEST_NGRAM = 1  # the n-gram drafter's default (`specd serve draft --lookup-min-ngram`): any recurring token


def prompt_lookup(tokens: Sequence[int], k: int, max_ngram: int = LONGEST_NGRAM, min_ngram: int = SHORTEST_NGRAM) -> list[int]:
    """Up to k tokens continuing the longest suffix n-gram seen earlier, trying n from max_ngram (or
    min_ngram, when that is larger) down to min_ngram ≥ 1.

    The most recent earlier match of the longest n wins (recent context predicts best). Returns []
    when no n-gram recurs. With overlap, the copy runs on into itself: a match that ends near the end
    of the sequence (a loop of period p) continues with the tokens it has just copied, so a repeating
    run yields k tokens, not the p − 1 that are left before the end.
    """
    if min_ngram < 1:
        raise ValueError(f"the shortest n-gram a copy needs must be ≥ 1, got {min_ngram}")
    length = len(tokens)
    for n in range(min(max(max_ngram, min_ngram), length - 1), min_ngram - 1, -1):
        suffix, last = list(tokens[length - n :]), tokens[length - 1]
        for end in range(length - 2, n - 2, -1):  # where an earlier occurrence ends, latest first
            # the cheap test first: this runs every round in the gateway, over the whole sequence
            if tokens[end] == last and list(tokens[end - n + 1 : end + 1]) == suffix:
                return copy_forward(tokens, end + 1, k)
    return []


def copy_forward(tokens: Sequence[int], source: int, k: int) -> list[int]:
    """k tokens copied from position `source` (< len(tokens)) on, reading the copy itself where the
    source runs past the end (LZ77's overlapping copy): [a, b, c] from 1, k = 4 → [b, c, b, c]."""
    period = len(tokens) - source
    return [tokens[source + i % period] for i in range(k)]
