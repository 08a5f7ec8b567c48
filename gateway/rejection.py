"""Accept / reject / correct: the lossless speculative sampling rule, as small pure functions.

Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318). For drafts
x_1..x_k drawn from q_1..q_k, with target distributions p_1..p_{k+1} (warped identically):
accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), left to right; at the first rejection
draw the recovered token from norm(max(0, p_i - q_i)); if all k are accepted, draw a bonus token
from p_{k+1}. Greedy decoding is the limit: accept while x_i == argmax p_i.

Drafts that were not drawn from a distribution the gateway holds (the Medusa heads' best tokens,
lookup copies, a draft that drafts greedily) are judged by the coupled rule instead: the target's
own token at each position is drawn from p_i with a uniform fixed by (seed, position), and drafts
are kept while they equal it. It emits exactly what target-only decoding with that seed emits, so
the output follows p, and a seeded request gives the same answer whatever rounds it was cut into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from specd_common.distributions import sample_at, sample_from
from specd_common.tree import ROOT, child_with, greedy_path


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
    path = greedy_path(node_tokens, parents, target_argmax)
    last = path[-1] if path else ROOT
    is_leaf = last != ROOT and last not in parents
    return RoundOutcome(len(path), int(target_argmax[0 if last == ROOT else last + 1]), bonus=is_leaf, path=tuple(path))


def coupled_verify(draft_tokens: Sequence[int], target_probs: np.ndarray, uniforms: Sequence[float]) -> RoundOutcome:
    """Sampled drafts not drawn from a q the gateway holds (target_probs p: [k + 1, V]; uniforms: one
    per position, position_uniforms): the target's token y_i = the inverse CDF of p_i at uniforms[i];
    keep drafts while x_i == y_i, then emit y_i. Draft i is kept with probability p_i(x_i), as
    min(1, p/q) gives a one-hot q, and the emitted token is always y_i, drawn from p_i."""
    for i, token in enumerate(draft_tokens):
        target = sample_at(target_probs[i], uniforms[i])
        if target != token:
            return RoundOutcome(i, target, bonus=False)
    return RoundOutcome(len(draft_tokens), sample_at(target_probs[-1], uniforms[len(draft_tokens)]), bonus=True)


def coupled_tree_verify(node_tokens: Sequence[int], parents: Sequence[int], target_probs: np.ndarray,
                        uniforms: Sequence[float]) -> RoundOutcome:
    """coupled_verify over a tree (target_probs: [1 + n, V], after the last committed token and after
    each node; uniforms: one per depth from the root's): from the root, draw the target's token at
    the current node's row and step to the child that carries it while there is one."""
    path, at = [], ROOT
    while True:
        target = sample_at(target_probs[0 if at == ROOT else at + 1], uniforms[len(path)])
        child = child_with(node_tokens, parents, at, target)
        if child is None:
            is_leaf = at != ROOT and at not in parents
            return RoundOutcome(len(path), target, bonus=is_leaf, path=tuple(path))
        path.append(child)
        at = child


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


def without(q: np.ndarray, token: int) -> np.ndarray:
    """q with `token` removed and renormalized: the distribution of the next draw without replacement."""
    rest = q.copy()
    rest[token] = 0.0
    total = rest.sum()
    return rest / total if total > 0 else rest


def residual_of(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)), the part of p the proposal under-proposed (p itself when p == q)."""
    residual = np.maximum(p - q, 0.0)  # [V]
    return residual / residual.sum() if residual.sum() > 0 else p


def multi_candidate_sample(candidates: Sequence[int], q: Union[np.ndarray, Sequence[Optional[np.ndarray]]], p: np.ndarray,
                           rng: np.random.Generator) -> tuple[Optional[int], int]:
    """Several candidates for one position; the output follows p exactly (recursive rejection
    sampling: SpecInfer's multi-step rule, Jeon et al. 2024). q: the distribution the candidates were
    drawn from WITHOUT replacement in this order, or one entry per candidate: the distribution it was
    drawn from given the earlier ones, None for "the previous entry without the previous candidate"
    (a later draw without replacement). Deterministic candidates (the Medusa heads' best tokens) are
    each their own one-hot.

    Candidate i is one ordinary speculative-sampling step, accepted with min(1, r_i(x)/q_i(x)),
    where r_1 = p; a rejection moves on with r_{i+1} = norm(max(0, r_i - q_i)). Each step emits
    exactly r_i whatever q_i is, as long as x_i was drawn from q_i given what came before (a later
    draw without replacement: q_i is q without the earlier ones; a fixed token: its one-hot), hence
    the whole emits p. Returns (index of the accepted candidate or None, token): None means every
    candidate was rejected and the token came from the last residual."""
    proposals = [q] + [None] * (len(candidates) - 1) if isinstance(q, np.ndarray) else list(q)
    target, proposal = p, None
    for index, token in enumerate(candidates):
        proposal = proposals[index] if proposals[index] is not None else without(proposal, candidates[index - 1])
        if proposal[token] > 0 and rng.random() * proposal[token] < target[token]:  # u < r/q without dividing
            return index, int(token)
        target = residual_of(target, proposal)
    return None, sample_from(target, rng)


def tree_rejection_sample(
    node_tokens: Sequence[int],
    parents: Sequence[int],
    draft_probs: Sequence[Optional[np.ndarray]],  # [n]: q each node was drawn from; None for a later sibling drawn from its first sibling's q
    target_probs: np.ndarray,  # p: [1 + n, V], after the last committed token (row 0) and after each node
    rng: np.random.Generator,
) -> RoundOutcome:
    """A tree round when sampling: from the root, the children of the current node are candidates
    drawn without replacement from one q (a draft's tree) or fixed tokens each with its one-hot q (the
    Medusa heads' tree), judged by multi_candidate_sample against the p after that node; an
    accepted child with children of its own goes on, one without is a leaf whose p gives the bonus
    token; when all are rejected the residual gives the correction. A chain is the tree of one child
    per node, where this is rejection_sample."""
    path, at = [], ROOT
    while True:
        row = 0 if at == ROOT else at + 1
        children = [node for node, parent in enumerate(parents) if parent == at]
        if not children:
            return RoundOutcome(len(path), sample_from(target_probs[row], rng), bonus=True, path=tuple(path))
        index, token = multi_candidate_sample([node_tokens[c] for c in children], [draft_probs[c] for c in children],
                                              target_probs[row], rng)
        if index is None:
            return RoundOutcome(len(path), token, bonus=False, path=tuple(path))
        path.append(children[index])
        at = children[index]


def recovered_token(p: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> int:
    """Draw from norm(max(0, p - q)), the part of p the draft under-proposed."""
    return sample_from(residual_of(p, q), rng)  # p == q: a rejection has probability zero; p is right anyway


def expected_tokens_per_pass(acceptance_rate: float, k: int) -> float:
    """(1 - α^(k+1)) / (1 - α): tokens per target pass predicted for i.i.d. acceptance α and k drafts."""
    if acceptance_rate >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance_rate ** (k + 1)) / (1.0 - acceptance_rate)
