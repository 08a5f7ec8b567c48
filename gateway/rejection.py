"""Accept / reject / correct: the lossless speculative sampling rule, as small pure functions.

Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318). For drafts
x_1..x_k drawn from q_1..q_k, with target distributions p_1..p_{k+1} (warped identically):
accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), left to right; at the first rejection
draw the recovered token from norm(max(0, p_i - q_i)); if all k are accepted, draw a bonus token
from p_{k+1}. Greedy decoding is the limit: accept while x_i == argmax p_i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specd_common.distributions import sample_from
from specd_common.tree import ROOT


@dataclass(frozen=True)
class RoundOutcome:
    """How one round ended."""

    accepted: int  # drafts kept, 0..k
    next_token: int  # the recovered token (accepted < k) or the bonus token (accepted == k)
    bonus: bool  # True when every draft was accepted and next_token came from p_{k+1}
    path: tuple[int, ...] = ()  # a tree round: the kept nodes' indices (len == accepted); () for a chain

    def emitted(self, draft_tokens: Sequence[int]) -> list[int]:
        """Tokens this round adds to the output: the accepted drafts, then the recovered/bonus token."""
        kept = [draft_tokens[node] for node in self.path] if self.path else list(draft_tokens[: self.accepted])
        return kept + [self.next_token]


def greedy_verify(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> RoundOutcome:
    """target_argmax: [k + 1]. Keep drafts while they equal the target's argmax; correct the first miss."""
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_argmax[accepted]:
        accepted += 1
    return RoundOutcome(accepted, int(target_argmax[accepted]), bonus=accepted == len(draft_tokens))


def greedy_tree_verify(node_tokens: Sequence[int], parents: Sequence[int], target_argmax: Sequence[int]) -> RoundOutcome:
    """A tree round (specd_common/tree.py), greedy: target_argmax [1 + n] holds the target's choice after
    the last committed token (row 0) and after each node (row 1 + i). From the root, step to the child
    whose token is the target's choice while there is one; the choice after the last kept node is the
    correction (or the bonus, at a leaf). What it emits is what target-only decoding would."""
    path, at, row = [], ROOT, 0
    while True:
        choice = int(target_argmax[row])
        child = next((i for i, (t, p) in enumerate(zip(node_tokens, parents)) if p == at and t == choice), None)
        if child is None:
            is_leaf = at != ROOT and at not in parents
            return RoundOutcome(len(path), choice, bonus=is_leaf, path=tuple(path))
        path.append(child)
        at, row = child, child + 1


def rejection_sample(
    draft_tokens: Sequence[int],
    draft_probs: np.ndarray,  # q: [k, V], each row the distribution x_i was drawn from
    target_probs: np.ndarray,  # p: [k + 1, V]
    rng: np.random.Generator,
) -> RoundOutcome:
    """The lossless rule: the emitted tokens follow the target distribution exactly, whatever q is."""
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if q[token] > 0 and rng.random() * q[token] < p[token]:  # u < p/q without dividing
            continue
        return RoundOutcome(i, recovered_token(p, q, rng), bonus=False)
    return RoundOutcome(len(draft_tokens), sample_from(target_probs[-1], rng), bonus=True)


def recovered_token(p: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> int:
    """Draw from norm(max(0, p - q)), the part of p the draft under-proposed."""
    residual = np.maximum(p - q, 0.0)  # [V]
    if residual.sum() <= 0:  # p == q: a rejection has probability zero; p is the right answer anyway
        residual = p
    return sample_from(residual / residual.sum(), rng)


def expected_tokens_per_pass(acceptance_rate: float, k: int) -> float:
    """(1 - α^(k+1)) / (1 - α): tokens per target pass predicted for i.i.d. acceptance α and k drafts."""
    if acceptance_rate >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance_rate ** (k + 1)) / (1.0 - acceptance_rate)
