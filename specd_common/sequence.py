"""A session's token sequence and how much of it a cache holds: the KV-sync bookkeeping, torch-free.

Invariant: `cached` positions of `tokens` have keys/values in the drafter's or target's cache, and
at least one token is pending (cached < len(tokens)), so every forward pass feeds at least the last
token and yields the next position's logits. One exception: a verify whose prefill scored the
prompt's last token holds every token and those logits (specd_engine/lm.py, KVSession.scored).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from specd_common.errors import InvalidArgument, require


@dataclass
class TokenSequence:
    """Tokens of one session (prompt, accepted output, and the last round's speculation)."""

    tokens: list[int]
    max_length: int
    cached: int = 0
    on_crop: Callable[[int], None] = field(default=lambda n: None, repr=False)  # drop n cached positions

    def apply_commit(self, prefix_length: int, append: Sequence[int]) -> None:
        """Keep tokens[:prefix_length], append `append`, and roll the cache back to match. Idempotent.

        Cached positions past prefix_length whose tokens `append` repeats stay cached (the same
        tokens after the same prefix have the same keys and values): the kept path of a draft tree
        (CausalLM.settle_tree) is committed this way."""
        require(
            0 < prefix_length <= len(self.tokens),
            f"commit.prefix_length {prefix_length} must be in [1, {len(self.tokens)}] (the session's length)",
        )
        new_length = prefix_length + len(append)
        if new_length > self.max_length:
            raise InvalidArgument(f"sequence would reach {new_length} tokens; the model's limit is {self.max_length}")
        old, self.tokens = self.tokens, self.tokens[:prefix_length] + list(append)
        agree = prefix_length + common_prefix(old[prefix_length:], append)
        keep = min(self.cached, agree, len(self.tokens) - 1)
        if keep < self.cached:
            self.on_crop(self.cached - keep)
            self.cached = keep

    def pending(self) -> list[int]:
        """Tokens not yet in the cache: what the next forward pass must feed."""
        return self.tokens[self.cached :]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of a and b."""
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def validate_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    """INVALID_ARGUMENT unless every id is in [0, vocab_size)."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(f"{what} contains token id {token_id}, outside the vocabulary [0, {vocab_size})")
