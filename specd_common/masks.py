"""Allowed-token masks on the wire (structured output): the gateway's grammar says which tokens may come
next at each scored position, the verify restricts the target's logits to them. numpy only (the gateway
has no torch).

A mask is a bitmap over the vocabulary (6 KiB for 49,152 tokens), or the list of allowed ids when that is
smaller: at a JSON key, a bracket or a digit a grammar allows a few tokens, inside a string nearly all.
"""

from __future__ import annotations

import numpy as np

from specd.v1 import common_pb2
from specd_common.distributions import bitmap_bits, bitmap_bytes
from specd_common.errors import InvalidArgument, require

LISTED_ID_BYTES = 3  # a token id below 2^21 as a packed varint: a list beats the bitmap below bitmap_bytes / 3 ids


def encode_mask(bitmap: bytes, vocab_size: int) -> common_pb2.TokenMask:
    """A little-endian bitmap of allowed tokens (llguidance's u32 words are laid out so; it may run past
    the vocabulary to a whole word) as a TokenMask: the ids when few are allowed, else the bitmap."""
    size = bitmap_bytes(vocab_size)
    allowed = np.flatnonzero(bitmap_bits(bitmap[:size])[:vocab_size])  # [A]
    if allowed.size * LISTED_ID_BYTES < size:
        return common_pb2.TokenMask(allowed_token_ids=allowed.tolist())
    return common_pb2.TokenMask(allowed_bitmap=bytes(bitmap[:size]))


def allowed_tokens(mask: common_pb2.TokenMask, vocab_size: int, what: str = "allowed_tokens") -> np.ndarray:
    """A TokenMask as bool [vocab_size], checked: one form set, the right size, ids in range, one token at least."""
    require(not (mask.allowed_bitmap and mask.allowed_token_ids), f"{what}: set allowed_bitmap or allowed_token_ids, not both")
    if mask.allowed_bitmap:
        require(len(mask.allowed_bitmap) == bitmap_bytes(vocab_size),
                f"{what}: allowed_bitmap must be {bitmap_bytes(vocab_size)} bytes for a vocabulary of {vocab_size}, "
                f"got {len(mask.allowed_bitmap)}")
        allowed = bitmap_bits(mask.allowed_bitmap)[:vocab_size].astype(bool)
    else:
        ids = np.asarray(mask.allowed_token_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise InvalidArgument(f"{what}: allowed_token_ids must be in [0, {vocab_size})")
        allowed = np.zeros(vocab_size, dtype=bool)
        allowed[ids] = True
    require(bool(allowed.any()), f"{what}: a mask must allow at least one token")
    return allowed  # [V]


def bitmap_allows(bitmap: bytes, token: int) -> bool:
    """Whether a little-endian bitmap sets token's bit."""
    byte = token >> 3
    return byte < len(bitmap) and bool(bitmap[byte] >> (token & 7) & 1)


def restrict(q: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """A draft's q [V] conditioned on the allowed tokens [V] bool and renormalized: the distribution of a
    draft drawn from q that the grammar allows. The rejection rule judges such a draft by it, which keeps
    the output exact when the gateway drops drafts the grammar forbids (docs/design/structured-output.md)."""
    kept = np.where(allowed, q, 0.0)
    total = kept.sum()
    return kept / total if total > 0 else kept
