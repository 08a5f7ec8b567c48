"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the current suffix."""

from __future__ import annotations

from typing import Sequence


def prompt_lookup(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens continuing the longest suffix n-gram (max_ngram down to min_ngram) seen earlier.

    The most recent earlier match wins (recent context predicts best). Returns [] when no n-gram recurs.
    """
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(tokens[length - n :])
        for start in range(length - n - 1, -1, -1):  # latest earlier occurrence first
            if list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + k])
    return []
