"""Draft trees, torch-free: the shape rules and the walk that finds the kept path.

A tree of n drafted nodes is two lists: tokens[i] and parents[i], where parents[i] is the index
of an earlier node (parents precede children) or ROOT (the node follows the last committed token
directly). A chain of k drafts is the tree with parents [ROOT, 0, 1, ..., k-2]. Siblings carry
different tokens, so a sequence of tokens names at most one path from the root.

The target scores every node in one pass with a mask that lets a node see the committed context,
its ancestors and itself (CausalLM.forward_tree); its position is the root's plus its depth.
"""

from __future__ import annotations

from typing import Optional, Sequence

from specd_common.errors import InvalidArgument

ROOT = -1
# A round's limits, one value each, read by the gateway's checks and both model services' (a Verify or
# Propose that the gateway may send is never refused by a service for its size):
MAX_DRAFT_TOKENS = 16  # drafts in a round's chain (num_draft_tokens, lookup copies, a tree's depth)
MAX_BRANCHES = 4  # candidates per drafted position of a tree (draft_branches, ProposeRequest.branches)
MAX_TREE_NODES = 32  # drafted nodes one Verify scores or one Propose returns at most (k × branches)
MAX_SPECULATED_OUTCOMES = 16  # ProposeRequest.speculate_outcomes: 16 × k head steps already outlast a CPU verify pass
MAX_PLAIN_STEPS = 16  # VerifyRequest.plain_steps: passes one plain Verify decodes at most (a round's tokens, as a chain's)
MAX_VERIFY_PARTS = 64  # VerifyBatchRequest.parts: twice a verify's default batch of 32 sessions, so a caller never splits a pass


def chain_parents(k: int) -> list[int]:
    """The parents of a chain of k drafts: [ROOT, 0, 1, ..., k-2]."""
    return [ROOT] + list(range(k - 1)) if k else []


def validate_tree(tokens: Sequence[int], parents: Sequence[int]) -> None:
    """INVALID_ARGUMENT unless parents has one entry per token, each parent precedes its child, and
    siblings differ (a path is then named by its tokens)."""
    if len(parents) != len(tokens):
        raise InvalidArgument(f"draft_parents has {len(parents)} entries for {len(tokens)} draft tokens; give one per token")
    seen: set[tuple[int, int]] = set()
    for index, (token, parent) in enumerate(zip(tokens, parents)):
        if not ROOT <= parent < index:
            raise InvalidArgument(f"draft_parents[{index}] = {parent}; a parent must be -1 (the root) or an earlier node (< {index})")
        if (parent, token) in seen:
            raise InvalidArgument(f"draft node {index} repeats token {token} under parent {parent}; siblings must differ")
        seen.add((parent, token))


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node: 1 for a child of the root, its parent's + 1 otherwise."""
    result: list[int] = []
    for parent in parents:
        result.append(1 if parent == ROOT else result[parent] + 1)
    return result


def ancestry(parents: Sequence[int]) -> list[list[bool]]:
    """visible[i][j]: node j is node i or one of its ancestors (the tree part of the attention mask) [n][n]."""
    visible: list[list[bool]] = []
    for index, parent in enumerate(parents):
        row = list(visible[parent]) if parent != ROOT else [False] * len(parents)
        row[index] = True
        visible.append(row)
    return visible


def main_chain(parents: Sequence[int]) -> list[int]:
    """The drafter's own chain: from the root, each node's first child in node order, as indices."""
    chain, at = [], ROOT
    while (child := next((i for i, p in enumerate(parents) if p == at), None)) is not None:
        chain.append(child)
        at = child
    return chain


def chain_with_leaves(steps: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """The tree of a chain with alternatives beside each of its tokens: steps[i] is [chain token i,
    its alternatives...] (distinct), all children of chain token i - 1 (ROOT for i = 0), alternatives
    as leaves. Nodes in order: chain token, its alternatives, next chain token, ... → (tokens, parents).
    With one candidate a step this is the chain."""
    tokens: list[int] = []
    parents: list[int] = []
    parent = ROOT
    for candidates in steps:
        parents += [parent] * len(candidates)
        parent = len(tokens)
        tokens += list(candidates)
    return tokens, parents


def from_paths(paths: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """The tree whose node i is the last token of paths[i] (the tokens from the root to it; each path's
    parent path comes earlier, siblings' last tokens differ) → (tokens, parents)."""
    index = {tuple(path): i for i, path in enumerate(paths)}
    return [path[-1] for path in paths], [index[tuple(path[:-1])] if len(path) > 1 else ROOT for path in paths]


def widened_nodes(parents: Sequence[int], widened: int) -> list[int]:
    """The nodes to keep, in order, so that only the first `widened` positions keep their
    alternatives: the main chain and every node at depth ≤ widened (closed under ancestors: a
    node's parent is on the chain or shallower)."""
    chain, depth = set(main_chain(parents)), depths(parents)
    return [node for node in range(len(parents)) if node in chain or depth[node] <= widened]


def reindexed(parents: Sequence[int], kept: Sequence[int]) -> list[int]:
    """The parents of the subtree of nodes `kept` (ascending, closed under ancestors), in its own indices."""
    index = {node: position for position, node in enumerate(kept)}
    return [ROOT if parents[node] == ROOT else index[parents[node]] for node in kept]


def greedy_path(tokens: Sequence[int], parents: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The nodes a greedy target keeps, from the root: while the current node has a child carrying the
    target's choice after it (argmax [1 + n]: row 0 after the last committed token, row 1 + i after node
    i), step to that child."""
    path, at = [], ROOT
    while (child := child_with(tokens, parents, at, int(argmax[0 if at == ROOT else at + 1]))) is not None:
        path.append(child)
        at = child
    return path


def child_with(tokens: Sequence[int], parents: Sequence[int], parent: int, token: int) -> Optional[int]:
    """The child of `parent` (a node index or ROOT) that carries `token`, if any (siblings differ)."""
    return next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == parent and t == token), None)


def path_of(tokens: Sequence[int], parents: Sequence[int], walk: Sequence[int]) -> list[int]:
    """Node indices of the longest path from the root whose tokens are a prefix of `walk`."""
    path, at = [], ROOT
    for token in walk:
        child = child_with(tokens, parents, at, token)
        if child is None:
            break
        path.append(child)
        at = child
    return path
