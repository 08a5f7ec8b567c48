"""Probability distributions on the wire, and sampling from them. numpy only (the gateway has no torch).

The draft samples from exactly the distribution it reports (decode(encode(q))), and the gateway
samples the target's tokens from decode(encode(p)) in both speculative and target-only mode, so
quantizing to float16 never makes the two modes differ.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from specd.v1 import common_pb2
from specd_common.errors import InvalidArgument

_NUMPY_DTYPES = {
    common_pb2.PROB_ENCODING_FLOAT16: np.dtype("<f2"),
    common_pb2.PROB_ENCODING_FLOAT32: np.dtype("<f4"),
}


def encode_distribution(probs: np.ndarray, half: np.ndarray | None = None) -> common_pb2.Distribution:
    """probs: [V] float. Sparse float32 when the support is small (top-k / top-p); else the float16
    row: `half`, probs already in float16 (warping.encode_rows converts a pass's rows with torch, bitwise
    the same as numpy's conversion, which took 3.2 ms for one 49,152-token row on the EPYC VM), or
    converted here. Only its nonzero entries are sent (encode_half_support) when that is smaller than
    the dense row: a warped row at T = 0.8 is ~90% float16 zeros, so a 98 KB row becomes ~15 KB on
    the wire, which a split stack pays per position per round between machines. The decoded values
    are the dense row's, bit for bit."""
    vocab_size = probs.shape[0]
    if np.count_nonzero(probs) * 8 < vocab_size * 2:  # ids (4 B) + float32 (4 B) beat dense float16 (2 B a token)
        support = np.flatnonzero(probs)  # [S]
        return common_pb2.Distribution(
            token_ids=support.tolist(),
            probs=probs[support].astype("<f4").tobytes(),
            encoding=common_pb2.PROB_ENCODING_FLOAT32,
            vocab_size=vocab_size,
        )
    half = probs.astype("<f2") if half is None else half.astype("<f2", copy=False)
    kept = np.flatnonzero(half.view("<u2"))  # [S'] the entries float16 does not round to zero (integer test: numpy's float16 one is ~10x slower)
    if bitmap_bytes(vocab_size) + 2 * kept.size < 2 * vocab_size:
        return encode_half_support(kept, half[kept], vocab_size)
    return common_pb2.Distribution(probs=half.tobytes(), encoding=common_pb2.PROB_ENCODING_FLOAT16, vocab_size=vocab_size)


SPARSE_HALF_ENTRY_BYTES = 5  # a token id as a packed varint (3 bytes below 2^21) and its float16 value


def bitmap_bytes(vocab_size: int) -> int:
    return (vocab_size + 7) // 8


def bitmap_bits(raw: bytes) -> np.ndarray:
    """A little-endian bitmap (token i: bit i % 8, least significant first, of byte i / 8) as 0/1 per token
    [8 * len(raw)]: the layout of Distribution.support_bitmap and TokenMask.allowed_bitmap."""
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")


def encode_half_support(tokens: np.ndarray, values: np.ndarray, vocab_size: int) -> common_pb2.Distribution:
    """float16 `values` [S] of ascending token ids `tokens` [S] (zero elsewhere), with the support as ids
    or as a bitmap (Distribution.support_bitmap), whichever is smaller: ids below ~1/24 of the vocabulary."""
    message = common_pb2.Distribution(probs=values.astype("<f2").tobytes(), encoding=common_pb2.PROB_ENCODING_FLOAT16,
                                      vocab_size=vocab_size)
    if SPARSE_HALF_ENTRY_BYTES * tokens.size <= bitmap_bytes(vocab_size) + 2 * tokens.size:
        message.token_ids.extend(tokens.tolist())
    else:
        mask = np.zeros(vocab_size, dtype=bool)  # [V]
        mask[tokens] = True
        message.support_bitmap = np.packbits(mask, bitorder="little").tobytes()
    return message


def decode_distribution(message: common_pb2.Distribution, vocab_size: int | None = None) -> np.ndarray:
    """Inverse of encode_distribution: a dense, normalized float64 vector [V].

    vocab_size, when given, overrides the message's for sparse distributions (a model-free drafter
    does not know the vocabulary size; its one-hot proposals are padded to the target's).
    """
    values = entry_values(message)
    sparse = bool(message.token_ids or message.support_bitmap)
    size = vocab_size if (vocab_size and sparse) else message.vocab_size
    dense = np.zeros(size, dtype=np.float64)
    if sparse:
        dense[support_ids(message, values, size)] = values
    else:
        if values.shape[0] != size:
            raise InvalidArgument(f"dense distribution has {values.shape[0]} entries, expected {size}")
        dense[:] = values
    return normalize(dense)


def entry_values(message: common_pb2.Distribution) -> np.ndarray:
    """The message's probs as float64 [n] (the support's values, or the dense row), unnormalized."""
    if message.encoding not in _NUMPY_DTYPES:
        raise InvalidArgument(f"distribution encoding {message.encoding} is not supported")
    if message.encoding == common_pb2.PROB_ENCODING_FLOAT16:
        return float16_values(message.probs)
    return np.frombuffer(message.probs, dtype=_NUMPY_DTYPES[message.encoding]).astype(np.float64)


def support_ids(message: common_pb2.Distribution, values: np.ndarray, size: int) -> np.ndarray:
    """The token ids [S] a sparse message's values belong to (token_ids, or the set bits of
    support_bitmap in id order), checked against the values and the vocabulary size."""
    if message.token_ids and message.support_bitmap:
        raise InvalidArgument("a distribution sets token_ids or support_bitmap, not both")
    if message.support_bitmap:
        ids = np.flatnonzero(bitmap_bits(message.support_bitmap))
    else:
        ids = np.asarray(message.token_ids, dtype=np.int64)
    if ids.shape != values.shape or not ids.size or ids.min() < 0 or ids.max() >= size:
        raise InvalidArgument("sparse distribution has mismatched ids and probabilities")
    return ids


FLOAT16_NOT_FINITE_OR_NEGATIVE = 0x7C00  # the float16 bit patterns from here up: infinities, NaNs, the sign bit set


def float16_values(raw: bytes) -> np.ndarray:
    """Little-endian float16 bytes → float64 [n], exactly what numpy's astype gives, ~9x faster on
    probability rows: numpy converts float16 subnormals in software, and a warped 49,152-token row at
    T = 0.7 is a third subnormals and two thirds zeros (0.21 ms a row on the 2-core AMD EPYC VM against
    0.023, paid for every position of a sampled round). Finite non-negative values are moved into
    float32's bit layout and scaled by 2^112, exact for normals and subnormals alike (each is a
    float32 value times a power of two); anything else goes through numpy."""
    bits = np.frombuffer(raw, dtype="<u2")  # [n]
    if bits.size and bits.max() >= FLOAT16_NOT_FINITE_OR_NEGATIVE:
        return bits.view("<f2").astype(np.float64)
    widened = (bits.astype(np.uint32) << 13).view(np.float32)  # [n]: the value / 2^112
    return (widened * np.float32(2.0**112)).astype(np.float64)


def normalize(weights: np.ndarray) -> np.ndarray:
    """Scale non-negative weights [V] to sum to one."""
    total = weights.sum()
    if not total > 0:
        raise InvalidArgument("distribution has no probability mass")
    return weights / total


def encode_over(ids: np.ndarray, probs: np.ndarray, vocab_size: int) -> common_pb2.Distribution:
    """A distribution that is zero outside `ids` [n] (a head's reduced vocabulary), from its values there
    `probs` [n]: float16 over the entries that stay nonzero in float16 (encode_half_support), never the
    dense [vocab_size] row. A draft draws from exactly this (sample_sparse), so the float16 rounding
    changes which q it reports, never whether the rejection rule is exact."""
    half = probs.astype("<f2")  # [n]
    support = np.flatnonzero(half.view("<u2"))  # probabilities are never -0.0, so nonzero bits are nonzero values
    order = support[np.argsort(ids[support], kind="stable")]  # ascending token ids, as both sparse forms need
    return encode_half_support(ids[order], half[order], vocab_size)


def sample_sparse(message: common_pb2.Distribution, rng: np.random.Generator) -> int:
    """One draw from a sparse distribution (encode_over) as decode_distribution reads it, without
    building the dense row: the same values in the same order, the same normalization, one uniform."""
    values = entry_values(message)  # [S]
    return int(support_ids(message, values, message.vocab_size)[sample_from(normalize(values), rng)])


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from a normalized distribution [V] by inverse CDF (one uniform per draw)."""
    return sample_at(probs, rng.random())


def sample_at(probs: np.ndarray, uniform: float) -> int:
    """The index a distribution [V] gives the uniform draw `uniform` in [0, 1) by inverse CDF."""
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    return min(index, probs.shape[0] - 1)


def position_uniforms(seed: int, first_position: int, count: int) -> list[float]:
    """The uniform draws of positions first_position .. first_position + count - 1 of a request seeded
    with `seed` (uniforms_at)."""
    return uniforms_at(seed, range(first_position, first_position + count))


def uniforms_at(seed: int, positions: Iterable[int]) -> list[float]:
    """The coupled rule's uniform draw at each of `positions` of a request seeded with `seed`: each a
    function of (seed, position) alone, so how rounds cut the answer, whether a position was drafted,
    and which service draws (the gateway, or the verify for VerifyRequest.coupled_draw) cannot change them."""
    return [float(np.random.default_rng([seed, position]).random()) for position in positions]


def one_hot(token_id: int) -> common_pb2.Distribution:
    """A deterministic proposal (q(token) = 1), as a model-free drafter makes; vocab_size left to the receiver."""
    return common_pb2.Distribution(
        token_ids=[token_id], probs=np.ones(1, "<f4").tobytes(), encoding=common_pb2.PROB_ENCODING_FLOAT32
    )
