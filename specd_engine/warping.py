"""Temperature / top-k / top-p warping of logits, the same function on the draft and the target side.

The rejection rule is lossless only if p and q are warped identically, so both services call this.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specd.v1 import common_pb2
from specd_common import tree
from specd_common.distributions import encode_distribution, uniforms_at
from specd_common.params import Warp

NUCLEUS_CANDIDATES = 256  # a row's best tokens its top-p nucleus is first looked for among (outside_nucleus)


def biased(logits: torch.Tensor, warp: Warp) -> torch.Tensor:
    """logits [n, V] with the request's logit_bias added (the same tensor when it has none): what greedy
    takes the argmax of and sampling warps, on every side, so speculation keeps the biased answer."""
    bias = [(token, value) for token, value in warp.logit_bias if token < logits.shape[-1]]  # a drafter's rows may be shorter
    if not bias:
        return logits
    tokens = torch.tensor([token for token, _ in bias], device=logits.device)  # [b]
    values = torch.tensor([value for _, value in bias], dtype=logits.dtype, device=logits.device)  # [b]
    return logits.index_add(-1, tokens, values.expand(*logits.shape[:-1], -1))


def constrained(logits: torch.Tensor, warp: Warp, allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [n, V] after logit_bias, with the tokens a grammar forbids (allowed [n, V] bool False) at -inf:
    the target's scores a greedy step takes the argmax of, and sampling warps, restricted to the grammar
    before anything is normalized (so the answer is the target's distribution renormalized over it)."""
    logits = biased(logits, warp)
    return logits if allowed is None else logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def warp_probs(logits: torch.Tensor, warp: Warp, allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [n, V] → probabilities [n, V] float32 after logit_bias and a grammar's mask (allowed [n, V],
    structured output), temperature, then top-k, then top-p."""
    logits = constrained(logits.float(), warp, allowed)
    # Shifted so the best score is 0 first (softmax, top-k and top-p are shift-invariant): then a tiny
    # temperature sends every other score to -inf instead of overflowing the best to inf (inf - inf =
    # NaN), and the result tends to greedy, its limit, down to any temperature > 0.
    scores = (logits - logits.max(dim=-1, keepdim=True).values) / warp.temperature  # [n, V]
    if 0 < warp.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, warp.top_k, dim=-1).values[..., -1:]  # [n, 1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if warp.top_p < 1.0:
        scores = scores.masked_fill(outside_nucleus(scores, warp.top_p), float("-inf"))
    return scores.softmax(dim=-1)


def outside_nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """bool [n, V]: the tokens outside each row's nucleus, the fewest best tokens whose mass reaches
    top_p (the best token always kept) under softmax(scores [n, V]). Looked for among the rows' best
    NUCLEUS_CANDIDATES first, then four times as many, up to the whole vocabulary: a sort of 49,152
    scores took ~3 ms a row on a 2-core CPU, ten times the rest of a sampled row's warp."""
    probs = scores.softmax(dim=-1)  # [n, V]
    vocab, count = probs.shape[-1], min(NUCLEUS_CANDIDATES, probs.shape[-1])
    while True:
        best, order = torch.topk(probs, count, dim=-1)  # [n, count], best first
        drop_best = best.cumsum(dim=-1) - best >= top_p  # the mass of strictly better tokens reached top_p
        if count == vocab or bool(drop_best[:, -1].all()):  # every row's nucleus lies within its best `count`
            return torch.ones_like(probs, dtype=torch.bool).scatter(-1, order, drop_best)
        count = min(4 * count, vocab)


def draw_rows(probs: torch.Tensor, uniforms: Sequence[float]) -> torch.Tensor:
    """The coupled rule's draws (VerifyRequest.coupled_draw): each row of probs [n, V] (warp_probs)
    at its uniform by inverse CDF, accumulated in float64 → ids [n]. The verify draws here in
    speculative and target-only rounds alike, from the float32 p, so the two modes draw the same
    token at the same position and seed."""
    cdf = torch.cumsum(probs.double(), dim=-1)  # [n, V]
    targets = torch.tensor(uniforms, dtype=torch.float64, device=probs.device)[:, None] * cdf[:, -1:]  # [n, 1]
    ids = torch.searchsorted(cdf, targets, right=True)[:, 0]  # [n]
    return ids.clamp_(max=probs.shape[-1] - 1)


UNDRAWN = -1  # draw_walk's token at a row nobody reads


def draw_walk(probs: torch.Tensor, seed: int, positions: Sequence[int], drafts: Sequence[int],
              parents: Sequence[int] = ()) -> torch.Tensor:
    """The coupled rule's draws at the rows the gateway reads: row 0's token (draw_rows at the uniform of
    its position), then the row after the draft that carries it (a chain's next draft, a tree's child
    with that token), until no draft carries the draw. The gateway keeps drafts while they equal the
    draws, so no other row is read; they hold UNDRAWN. A row's draw is its own (its p, its uniform), so
    the tokens drawn are those of drawing every row. Why: a draw costs ~0.2 ms a row on a 2-core CPU
    (the uniform's generator and a float64 CDF over the vocabulary), and a sampled round's drafts mostly
    miss early. probs [n, V] (warp_probs), positions [n] (Draw.positions) → ids [n]."""
    ids = torch.full((probs.shape[0],), UNDRAWN, dtype=torch.long)
    row, at = 0, tree.ROOT
    while True:
        token = int(draw_rows(probs[row : row + 1], uniforms_at(seed, positions[row : row + 1]))[0])
        ids[row] = token
        if parents:
            child = tree.child_with(drafts, parents, at, token)
        else:
            child = row if row < len(drafts) and drafts[row] == token else None
        if child is None:
            return ids
        row, at = child + 1, child


def encode_rows(probs: torch.Tensor) -> list[common_pb2.Distribution]:
    """probs [n, V] (warp_probs) → one wire Distribution a row (encode_distribution), converted to
    float16 by torch for the whole pass at once: bitwise numpy's conversion, which spent 3.2 ms a
    49,152-token row on the 2-core EPYC VM (~5% of a sampled verify pass, per position)."""
    probs = probs.cpu()
    half = probs.to(torch.float16).numpy()  # [n, V]
    return [encode_distribution(row, row_half) for row, row_half in zip(probs.numpy(), half)]
