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
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm
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


def test_the_drafters_chain_is_each_nodes_first_child():
    from specd_common.tree import main_chain

    assert main_chain(PARENTS) == [0, 1, 2]
    assert main_chain([ROOT, ROOT, 0, 0, 2]) == [0, 2, 4]
    assert main_chain([]) == []


def test_a_tree_keeps_the_alternatives_of_its_first_positions_only():
    """chain_with_leaves builds the drafters' tree shape; widened_nodes + reindexed cut it to the
    alternatives beside the first w drafts (what a round verifies when only those pay), and a greedy
    path through the cut tree is the one through the whole tree where it stays inside."""
    from specd_common.tree import chain_with_leaves, greedy_path, reindexed, widened_nodes

    tokens, parents = chain_with_leaves([[10, 20, 30], [11, 21, 31], [12, 22, 32]])
    assert tokens == [10, 20, 30, 11, 21, 31, 12, 22, 32] and parents == [ROOT, ROOT, ROOT, 0, 0, 0, 3, 3, 3]
    assert chain_with_leaves([[10], [11]]) == ([10, 11], chain_parents(2))
    kept = widened_nodes(parents, 1)
    assert kept == [0, 1, 2, 3, 6] and reindexed(parents, kept) == [ROOT, ROOT, ROOT, 0, 3]
    assert widened_nodes(parents, 0) == [0, 3, 6] and reindexed(parents, [0, 3, 6]) == chain_parents(3)
    assert widened_nodes(parents, 3) == list(range(9))
    validate_tree([tokens[i] for i in kept], reindexed(parents, kept))
    argmax = [20, 0, 7, 0, 0, 0, 0, 0, 0, 0]  # the target takes node 1 (an alternative, a leaf), then 7
    assert greedy_path(tokens, parents, argmax) == [1]
    argmax = [10, 11, 0, 0, 22, 0, 0, 0, 0, 0]  # node 0, node 3, then node 7 (22 under node 3)
    assert greedy_path(tokens, parents, argmax) == [0, 3, 7]
    cut_tokens, cut_parents = [tokens[i] for i in kept], reindexed(parents, kept)
    assert greedy_path(cut_tokens, cut_parents, [argmax[0]] + [argmax[1 + i] for i in kept]) == [0, 3]


def test_greedy_tree_verify_emits_what_target_only_decoding_would():
    from gateway.rejection import greedy_tree_verify

    # rows: after the root, then after nodes 0..5 (the target's argmax at each)
    argmax = [11, 14, 13, 50, 60, 22, 70]
    out = greedy_tree_verify(TOKENS, PARENTS, argmax)  # root → 11 (node 0) → 14 (node 3, a leaf) → 60
    assert (out.path, out.accepted, out.next_token, out.bonus) == ((0, 3), 2, 60, True)
    assert out.emitted(TOKENS) == [11, 14, 60]
    out = greedy_tree_verify(TOKENS, PARENTS, [21, 0, 0, 0, 0, 9, 70])  # the second branch, corrected after node 4
    assert (out.path, out.next_token, out.bonus) == ((4,), 9, False) and out.emitted(TOKENS) == [21, 9]
    out = greedy_tree_verify(TOKENS, PARENTS, [5, 0, 0, 0, 0, 0, 0])  # nothing matches: the correction alone
    assert (out.path, out.accepted, out.next_token) == ((), 0, 5) and out.emitted(TOKENS) == [5]


def test_a_tree_rounds_features_keep_the_committed_rows_and_the_kept_path():
    from gateway.features import tree_path_rows
    from specd_engine.features import decode_features, encode_features

    rows = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)  # 2 committed-but-unread rows, then 6 nodes
    kept = tree_path_rows(encode_features(rows, 10), nodes=6, path=(0, 3))
    assert kept.start_position == 10
    assert torch.equal(decode_features(kept, 3), rows[[0, 1, 2, 5]])


def test_a_commit_keeps_cached_tokens_it_repeats():
    from specd_common.sequence import TokenSequence

    dropped = []
    sequence = TokenSequence(tokens=[1, 2, 3, 4, 5], max_length=64, cached=5, on_crop=dropped.append)
    sequence.apply_commit(3, [4, 9])  # 4 repeats what was cached at position 3; 9 replaces 5
    assert sequence.tokens == [1, 2, 3, 4, 9] and sequence.cached == 4 and dropped == [1]
    sequence.apply_commit(5, [])  # idempotent
    assert sequence.cached == 4 and dropped == [1]


def test_a_feature_drafter_proposes_its_chain_plus_runners_up(tmp_path):
    """branches = 3: every drafted position carries the head's top 3, the first of which continues the
    chain; the chain is the one branches = 1 drafts."""
    import numpy as np

    from draft_service.feature_drafter import FeatureDrafter
    from draft_training import feature_data
    from draft_training.feature_training import build_head
    from specd_engine.features import encode_features
    from specd_engine.models import describe_model, load_causal_lm
    from specd_common.params import Warp
    from specd_common.tree import main_chain
    from tests.tiny_models import build_model

    target = load_causal_lm(str(build_model(tmp_path / "m", seed=0)))
    head = build_head(target, torch.arange(target.model.config.vocab_size), "").eval()
    prompt = list(range(5, 25))
    features = feature_data.target_features(target.model, [prompt])[0].float()

    def propose(branches: int):
        drafter = FeatureDrafter(head, describe_model(target), 512)
        session = drafter.open(prompt, Warp())
        drafter.add_features(session, encode_features(features[:-1], 0))
        return drafter.propose(session, 3, np.random.default_rng(0), branches), session

    chain, _ = propose(1)
    tree_proposal, session = propose(3)
    assert chain.parents == [] and len(chain.token_ids) == 3
    assert len(tree_proposal.token_ids) == 9
    validate_tree(tree_proposal.token_ids, tree_proposal.parents)
    assert [tree_proposal.token_ids[i] for i in main_chain(tree_proposal.parents)] == chain.token_ids
    assert depths(tree_proposal.parents) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert session.sequence.tokens == prompt + chain.token_ids  # the session holds only its chain


def test_sampled_alternatives_are_more_draws_without_replacement(tmp_path):
    """When sampling, a position's other candidates are distinct draws from the q recorded for the
    first (their own draft_probs entries are empty: the gateway reuses the first sibling's q)."""
    import numpy as np

    from draft_service.feature_drafter import FeatureDrafter
    from draft_training import feature_data
    from draft_training.feature_training import build_head
    from specd_common.distributions import decode_distribution
    from specd_engine.features import encode_features
    from specd_engine.models import describe_model, load_causal_lm
    from specd_common.params import Warp
    from tests.tiny_models import build_model

    target = load_causal_lm(str(build_model(tmp_path / "m", seed=0)))
    head = build_head(target, torch.arange(target.model.config.vocab_size), "").eval()
    prompt = list(range(5, 25))
    drafter = FeatureDrafter(head, describe_model(target), 512)
    session = drafter.open(prompt, Warp(temperature=1.0, top_k=5))
    drafter.add_features(session, encode_features(feature_data.target_features(target.model, [prompt])[0].float()[:-1], 0))
    proposal = drafter.propose(session, 2, np.random.default_rng(0), branches=3)
    validate_tree(proposal.token_ids, proposal.parents)  # siblings differ
    assert proposal.parents == [ROOT, ROOT, ROOT, 0, 0, 0]
    assert [bool(d.probs) for d in proposal.draft_probs] == [True, False, False, True, False, False]
    for first in (0, 3):
        q = decode_distribution(proposal.draft_probs[first], target.model.config.vocab_size)
        assert all(q[token] > 0 for token in proposal.token_ids[first : first + 3])  # all drawn from that q
