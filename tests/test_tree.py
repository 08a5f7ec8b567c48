"""Draft trees on the target side: shape rules, the tree mask, and the cache kept after a tree pass,
each against a from-scratch chain recompute on a tiny random model."""

from __future__ import annotations

import pytest

from specd_common.errors import InvalidArgument
from specd_common.tree import ROOT, ancestry, chain_parents, depths, path_of, validate_tree

torch = pytest.importorskip("torch")

# A tree of 6 nodes over two branches from the root:  root ─ 0 ─ 1 ─ 2
#                                                           │   └ 3
#                                                           └ 4 ─ 5
TOKENS = [11, 12, 13, 14, 21, 22]
PARENTS = [ROOT, 0, 1, 0, ROOT, 4]


def test_tree_shapes():
    assert chain_parents(3) == [ROOT, 0, 1] and chain_parents(0) == []
    assert depths(PARENTS) == [1, 2, 3, 2, 1, 2]
    visible = ancestry(PARENTS)
    assert [j for j in range(6) if visible[2][j]] == [0, 1, 2]
    assert [j for j in range(6) if visible[5][j]] == [4, 5]
    assert path_of(TOKENS, PARENTS, [11, 14, 99]) == [0, 3]
    assert path_of(TOKENS, PARENTS, [21, 22, 5]) == [4, 5]
    assert path_of(TOKENS, PARENTS, [7]) == []
    validate_tree(TOKENS, PARENTS)
    with pytest.raises(InvalidArgument, match="earlier node"):
        validate_tree([1, 2], [1, ROOT])
    with pytest.raises(InvalidArgument, match="siblings must differ"):
        validate_tree([1, 1], [ROOT, ROOT])
    with pytest.raises(InvalidArgument, match="one per token"):
        validate_tree([1, 2], [ROOT])


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from specd_common.lm import CausalLM
    from specd_common.models import load_causal_lm
    from tests.tiny_models import build_model

    return CausalLM(load_causal_lm(str(build_model(tmp_path_factory.mktemp("tree") / "m", seed=0))))


def chain_logits(lm, tokens: list[int]) -> torch.Tensor:
    """Logits after the last of `tokens`, from a fresh session: the recompute a tree must equal."""
    return lm.forward(lm.new_session(tokens))[-1]


@pytest.mark.parametrize("pending", [1, 3])  # one committed-but-unread token, or three (a correction + appended)
def test_a_tree_pass_scores_every_node_as_its_own_chain_would(lm, pending):
    prompt = [3, 4, 5, 6, 7]
    session = lm.new_session(prompt[: len(prompt) - pending + 1])
    session.tokens += prompt[len(prompt) - pending + 1 :]  # tokens committed but not read yet
    logits = lm.forward_tree(session, TOKENS, PARENTS)  # [1 + 6, V]
    assert logits.shape[0] == len(TOKENS) + 1
    assert torch.allclose(logits[0], chain_logits(lm, prompt), atol=1e-5)
    for node in range(len(TOKENS)):
        path = [i for i in range(len(TOKENS)) if ancestry(PARENTS)[node][i]]
        assert torch.allclose(logits[1 + node], chain_logits(lm, prompt + [TOKENS[i] for i in path]), atol=1e-5), node


@pytest.mark.parametrize("walk", [[11, 14, 30], [21, 22, 30], [30], [11, 12, 13, 30]])
def test_the_kept_path_leaves_the_cache_a_chain_would_have(lm, walk):
    prompt = [3, 4, 5, 6, 7]
    session = lm.new_session(prompt)
    lm.forward_tree(session, TOKENS, PARENTS)
    path = path_of(TOKENS, PARENTS, walk)
    with pytest.raises(RuntimeError, match="settle_tree"):
        session.apply_commit(len(prompt), [])
    lm.settle_tree(session, path)
    kept = [TOKENS[i] for i in path]
    assert session.tokens == prompt + kept and session.cached == len(session.tokens)
    assert session.cache.get_seq_length() == len(prompt) + len(kept)
    session.apply_commit(len(session.tokens), [walk[len(kept)]])  # the target's correction after the path
    expected = lm.forward(lm.new_session(prompt + kept + [walk[len(kept)]]), [40, 41])
    assert torch.allclose(lm.forward(session, [40, 41]), expected, atol=1e-5)


def test_a_chain_is_a_tree_with_one_branch(lm):
    prompt, drafts = [3, 4, 5, 6, 7], [8, 9, 10]
    as_tree = lm.forward_tree(lm.new_session(prompt), drafts, chain_parents(len(drafts)))
    assert torch.allclose(as_tree, lm.forward(lm.new_session(prompt), drafts), atol=1e-5)


def test_an_unsettled_tree_is_dropped_by_the_next_pass(lm):
    prompt = [3, 4, 5, 6, 7]
    session = lm.new_session(prompt)
    lm.forward_tree(session, TOKENS, PARENTS)
    got = lm.forward(session, [8])[-1]  # nothing kept: the nodes' rows leave the cache first
    assert session.cache.get_seq_length() == len(prompt) + 1
    assert torch.allclose(got, lm.forward(lm.new_session(prompt), [8])[-1], atol=1e-5)
