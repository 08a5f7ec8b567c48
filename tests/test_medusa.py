"""Medusa heads: the verify service proposes the next round's drafts (verify_service/medusa.py).

The heads' drafts are ordinary drafts to the acceptance rule (q is one-hot when sampling, as for
lookup copies: tests/test_lookup_rounds.py has the chi-square test of that rule), so what is new is
the alignment: the verify returns one row of proposals per position it read, and the gateway must
take the row whose next token is the round's last committed one. The system tests use untrained
heads (identity residual blocks), whose every head proposes the target's own next token at its row:
an off-by-one row is right exactly where the target's output repeats with period 2, the right row
where it repeats a token, so comparing the served rounds with a simulation on the same tokens tells
them apart.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from draft_training.medusa_training import answer_rows, medusa_rows, simulate_chain
from gateway.adaptive import StepCosts, best_rate, depth_sums
from gateway.features import HeadProposals, head_drafts_at
from specd.v1 import common_pb2
from tests.conftest import start_cluster
from tests.test_services import FIXED, generate, hf_greedy, wait_for_no_sessions
from tests.tiny_models import build_medusa_heads

HEADS = 3
# The tiny target's greedy answers to these (chat template on) hold runs of one token and of two
# alternating tokens, so the alignment test below sees both kinds of repetition.
PROMPTS = ["hello world", "one two three four one two three four one two three four one two three", "the quick brown fox"]


@pytest.fixture(scope="module")
def medusa_heads(tiny, tmp_path_factory):
    return build_medusa_heads(tiny.target, tmp_path_factory.mktemp("medusa") / "heads", heads=HEADS)


class FrozenCosts(StepCosts):
    """Step costs that serving does not move (their observations are dropped)."""

    def observe_verify(self, *args, **kwargs) -> None:
        pass

    def observe_draft(self, *args, **kwargs) -> None:
        pass


def start_heads_cluster(target, heads, **options):
    """A verify with Medusa heads and no draft service at all (start_cluster's `options` besides), whose
    gateway prices rounds by frozen, nearly flat step costs (a verify of n positions 100 + n ms, with
    or without the heads' proposals), so adaptive rounds' shapes follow the tokens, not the machine's
    load (under a busy CPU a measured spike could price the heads out for a whole request: head_rounds
    0 in 3 of 8 runs). Greedy and sampled requests price by the same frozen table (left measured, the
    sampled one never joined a copy and the heads on a 2-core AMD EPYC, 3 runs of 3)."""
    running = start_cluster(target, "", medusa_heads=heads, **options)
    costs = FrozenCosts()
    for positions in range(1, 34):
        for asked in (False, True):
            StepCosts.observe_verify(costs, positions, 0.100 + 0.001 * positions, heads=asked)
    running.gateway.servicer.backends.costs = running.gateway.servicer.backends.sampled_costs = costs
    return running


@pytest.fixture(scope="module")
def medusa_cluster(tiny, medusa_heads):
    """start_heads_cluster's stack, shared by this module's system tests."""
    running = start_heads_cluster(tiny.target, medusa_heads)
    yield running
    running.stop()


# --- units -------------------------------------------------------------------------------------
def test_untrained_heads_propose_the_targets_own_next_token(tiny, medusa_heads):
    from specd_engine.models import load_causal_lm
    from verify_service.medusa import load_heads

    target = load_causal_lm(str(tiny.target), device="cpu", dtype="float32")
    heads = load_heads(medusa_heads, target.model)
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.inference_mode():
        output = target.model(ids, output_hidden_states=True)
    features = output.hidden_states[-1][0]  # [5, H], after the final norm
    proposals = heads.propose(features)  # [5, K]
    assert proposals.shape == (5, HEADS)
    own = output.logits[0].argmax(dim=-1)  # [5]
    assert torch.equal(proposals, own[:, None].expand(5, HEADS))


def test_loading_heads_for_another_vocabulary_fails_clearly(tiny, medusa_heads, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from verify_service.medusa import load_heads

    other = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="trained for a target with vocabulary"):
        load_heads(medusa_heads, other)


def test_the_scorer_gives_token_input_heads_each_rows_own_next_token(tiny, monkeypatch):
    """Heads that read a row's next token get the target's argmax at the rows this pass scored, and the
    committed token after it at rows read late (a commit that appended two tokens). Sampling sessions
    get every row; a greedy one only the row after the drafts that equal the target's argmax."""
    from draft_training.medusa_training import MedusaRecipe, build_heads
    from specd_engine.models import load_causal_lm
    from specd_common.params import Warp
    from verify_service.medusa import MedusaHeads

    loaded = load_causal_lm(str(tiny.target), device="cpu", dtype="float32")
    heads = build_heads(loaded, torch.arange(loaded.model.config.vocab_size), "", MedusaRecipe(num_heads=2, next_token_input=True))
    scorer = heads_scorer(loaded, heads.eval())
    seen = []
    real = MedusaHeads.ranked

    def recording(self, features, next_tokens=None, layer_features=None, candidates=1, depth=0):
        seen.append(next_tokens.tolist())
        return real(self, features, next_tokens, layer_features, candidates, depth)

    monkeypatch.setattr(MedusaHeads, "ranked", recording)
    def argmax_after(drafts: list[int]) -> list[int]:
        return scorer.score(scorer.open([5, 17, 42], Warp()), drafts).argmax_token_ids

    choice = argmax_after([])[0]  # the target's token after 42
    own = argmax_after([choice, 9])  # its argmax after 42, choice, 9
    sampled = scorer.open([5, 17, 42], Warp(temperature=1.0))
    scorer.score(sampled, [choice, 9], head_drafts=True)
    assert seen[-1] == own
    sampled.sequence.apply_commit(3, [11, 12])  # 11 and 12 are read by the next pass
    second = scorer.score(sampled, [8], head_drafts=True)
    assert seen[-1][0] == 12 and len(seen[-1]) == 3  # row of 11: the committed 12; rows of 12, 8: the argmax
    assert second.head_drafts.start_position == 3 and len(second.head_drafts.token_ids) == 3 * 2
    one = scorer.score(scorer.open([5, 17, 42], Warp()), [choice, (own[1] + 1) % loaded.model.config.vocab_size], head_drafts=True)  # the first draft agrees, the second not
    assert one.head_drafts.start_position == 3 and len(one.head_drafts.token_ids) == 2  # the row of `choice` only
    assert seen[-1] == [own[1]]


def test_a_batch_proposes_once_what_its_sessions_would_alone(tiny, monkeypatch):
    """The replies to a batched pass are made together: the heads propose once for every asking
    session's rows (a greedy session's one row, a sampling session's every row) and each session gets
    exactly the proposals (and scores) it would get alone; a session that did not ask gets none."""
    from specd_common.params import Warp
    from verify_service.medusa import MedusaHeads
    from verify_service.scorer import Part

    heads, loaded = random_token_heads(tiny, chained=True)
    scorer = heads_scorer(loaded, heads)
    calls = []
    real = MedusaHeads.ranked
    monkeypatch.setattr(MedusaHeads, "ranked", lambda self, features, tokens=None, layers=None, candidates=1, depth=0:
                        calls.append(features.shape[0]) or real(self, features, tokens, layers, candidates, depth))
    greedy, sampled, plain = (scorer.open([5, 17, 42], warp) for warp in (Warp(), Warp(temperature=0.8), Warp()))
    parts = [Part(greedy, [9, 3], head_drafts=True), Part(sampled, [9], head_drafts=True), Part(plain, [4])]
    for part in parts:
        part.session.sequence.keep_features = part.head_drafts
    logits = scorer.lm.forward_batch([(part.session.sequence, part.drafts) for part in parts])
    together = scorer._replies(parts, logits)
    assert calls == [1 + 2]  # one propose: the greedy session's row and the sampling session's two
    alone = [scorer._replies([part], [rows])[0] for part, rows in zip(parts, logits)]
    for batched, single in zip(together, alone):
        assert batched.argmax_token_ids == single.argmax_token_ids and batched.target_probs == single.target_probs
        assert batched.head_drafts is single.head_drafts is None or same_proposals(batched.head_drafts, single.head_drafts)
    assert len(together[0].head_drafts.token_ids) == HEADS and len(together[1].head_drafts.token_ids) == 2 * HEADS
    assert together[2].head_drafts is None and together[2].argmax_token_ids


def test_after_a_tree_the_heads_propose_from_the_kept_paths_last_node(tiny):
    """A greedy tree pass returns the heads' proposals of one row: the last node of the path the
    target's argmax walks, at the position that node takes once kept, equal to what a chain pass over
    that path alone returns (candidates included). A sampling session gets every row, the root's then
    the nodes' in node order, and the gateway's pick (head_drafts_after_tree) of the same kept path is
    that same row (the heads read the same inputs: the target's argmax as each row's next token)."""
    from gateway.features import head_drafts_after_tree
    from specd_common.params import Warp

    heads, loaded = random_token_heads(tiny, chained=True)
    scorer = heads_scorer(loaded, heads)
    vocab, prompt = loaded.model.config.vocab_size, [5, 17, 42]
    first = scorer.score(scorer.open(prompt, Warp()), []).argmax_token_ids[0]
    second = scorer.score(scorer.open(prompt, Warp()), [first]).argmax_token_ids[1]
    wrong = [(first + 1) % vocab, (second + 1) % vocab]
    nodes, parents = [wrong[0], first, wrong[1], second], [-1, -1, 1, 1]  # the path the target keeps: nodes 1, 3
    for candidates in (1, 3):
        in_tree = scorer.score(scorer.open(prompt, Warp()), nodes, parents, head_drafts=True, head_candidates=candidates)
        in_chain = scorer.score(scorer.open(prompt, Warp()), [first, second], head_drafts=True, head_candidates=candidates)
        assert in_tree.head_drafts.start_position == in_chain.head_drafts.start_position == len(prompt) + 1
        assert len(in_tree.head_drafts.token_ids) == HEADS * candidates and in_tree.head_drafts.candidates == candidates
        assert same_proposals(in_tree.head_drafts, in_chain.head_drafts)
    missed = scorer.score(scorer.open(prompt, Warp()), wrong, [-1, 0], head_drafts=True)  # the root's row: no node kept
    assert same_proposals(missed.head_drafts, scorer.score(scorer.open(prompt, Warp()), [], head_drafts=True).head_drafts)
    sampled = scorer.score(scorer.open(prompt, Warp(temperature=1.0)), nodes, parents, head_drafts=True, head_candidates=3)
    assert sampled.head_drafts.start_position == len(prompt) - 1 and len(sampled.head_drafts.token_ids) == 5 * HEADS * 3
    assert same_row(head_drafts_after_tree(sampled.head_drafts, len(nodes), (1, 3)), head_drafts_at(in_tree.head_drafts, len(prompt) + 1))
    root = scorer.score(scorer.open(prompt, Warp()), wrong, [-1, 0], head_drafts=True, head_candidates=3)  # no node kept
    assert same_row(head_drafts_after_tree(sampled.head_drafts, len(nodes), ()), head_drafts_at(root.head_drafts, len(prompt) - 1))


def test_a_coupled_draw_returns_one_token_a_row_and_the_heads_read_the_kept_row(tiny, monkeypatch):
    """VerifyRequest.coupled_draw: a sampled session gets each read row's drawn token (no distributions
    unless asked; -1 past the first miss), drawn at the position each row scores (a chain's consecutive,
    a tree's node by its depth),
    and, as greedy, the heads' proposals of the one row the caller will read: after the drafts that
    equal the draws. A greedy session ignores it."""
    from specd.v1 import verify_pb2
    from specd_common.params import Warp
    from verify_service import scorer as scorer_module

    heads, loaded = random_token_heads(tiny, chained=True)
    scorer = heads_scorer(loaded, heads)
    positions = []
    real = scorer_module.draw_walk
    monkeypatch.setattr(scorer_module, "draw_walk", lambda probs, seed, at, *walk: positions.append(list(at)) or real(probs, seed, at, *walk))
    prompt, warm = [5, 17, 42], Warp(temperature=1.0)
    draw = verify_pb2.CoupledDraw(seed=3)
    first = scorer.score(scorer.open(prompt, warm), [], coupled=draw).sampled_token_ids[0]
    drafts = [first, 7, 8]
    chain = scorer.score(scorer.open(prompt, warm), drafts, head_drafts=True, coupled=draw)
    assert len(chain.sampled_token_ids) == 4 and not chain.target_probs and not chain.argmax_token_ids
    assert chain.sampled_token_ids[0] == first  # the same seed and position draw the same token
    kept = next((i for i, (x, y) in enumerate(zip(drafts, chain.sampled_token_ids)) if x != y), len(drafts))
    assert kept >= 1 and len(chain.head_drafts.token_ids) == HEADS  # one row, as greedy
    assert all(token == -1 for token in chain.sampled_token_ids[kept + 1 :])  # rows past the first miss: not read, not drawn
    assert chain.head_drafts.start_position == len(prompt) - 1 + kept
    with_probs = scorer.score(scorer.open(prompt, warm), drafts, coupled=verify_pb2.CoupledDraw(seed=3, return_target_probs=True))
    assert with_probs.sampled_token_ids == chain.sampled_token_ids and len(with_probs.target_probs) == 4
    positions.clear()
    scorer.score(scorer.open(prompt, warm), [4, 9, 10, 11], [-1, 0, 1, 1], coupled=draw)  # depths 1, 2, 3, 3
    assert positions == [[3, 4, 5, 6, 6]]
    greedy = scorer.score(scorer.open(prompt, Warp()), drafts, coupled=draw)
    assert greedy.argmax_token_ids and not greedy.sampled_token_ids


def test_heads_candidates_are_their_best_in_order(tiny):
    """propose with candidates c: each head's c best tokens, best first, its first the single proposal's;
    chained heads read the earlier heads' best (so the first candidates equal the chain's)."""
    heads, loaded = random_token_heads(tiny, chained=True)
    features, next_tokens = torch.randn(4, loaded.model.config.hidden_size), torch.randint(0, 50, (4,))
    best = heads.propose(features, next_tokens)  # [4, K]
    top = heads.propose(features, next_tokens, candidates=3)  # [4, K, 3]
    assert top.shape == (4, HEADS, 3) and torch.equal(top[..., 0], best)
    tokens = next_tokens[:, None]
    for index in range(HEADS):  # head index + 1's scores, given the earlier heads' best
        scores = heads.head_output(index, heads.fused(features), tokens) @ heads.head_columns  # [4, V']
        assert torch.equal(top[:, index], heads.vocab_ids[scores.topk(3).indices])
        tokens = torch.cat((tokens, best[:, index : index + 1]), dim=1)


def test_heads_asked_for_fewer_propose_what_the_first_of_all_propose(tiny):
    """ranked(depth=d): only the first d heads run (chained ones read the earlier heads' best), and they
    propose exactly what the first d of all the heads do, with the same confidences."""
    heads, loaded = random_token_heads(tiny, chained=True)
    features, next_tokens = torch.randn(4, loaded.model.config.hidden_size), torch.randint(0, 50, (4,))
    every, confident = heads.ranked(features, next_tokens, candidates=2)  # [4, K, 2] each
    for depth in range(1, HEADS + 1):
        some, sure = heads.ranked(features, next_tokens, candidates=2, depth=depth)
        assert some.shape == (4, depth, 2) and torch.equal(some, every[:, :depth]) and torch.equal(sure, confident[:, :depth])


def test_a_failing_reply_fails_its_session_alone(tiny, monkeypatch):
    """Unit, the verify's batch replies: when the heads' product fails, the sessions that asked for
    proposals get the error and the others their scores; when one session's reply fails (its warp),
    the rest of the batch still gets theirs."""
    import verify_service.scorer as scorer_module
    from specd_common.params import Warp
    from verify_service.medusa import MedusaHeads
    from verify_service.scorer import Part

    heads, loaded = random_token_heads(tiny, chained=True)
    scorer = heads_scorer(loaded, heads)
    asking, plain, sampled = (scorer.open([5, 17, 42], warp) for warp in (Warp(), Warp(), Warp(temperature=0.8)))
    parts = [Part(asking, [9], head_drafts=True), Part(plain, [4]), Part(sampled, [3])]
    asking.sequence.keep_features = True
    logits = scorer.lm.forward_batch([(part.session.sequence, part.drafts) for part in parts])

    def broken(*args, **kwargs):
        raise RuntimeError("heads broke")

    monkeypatch.setattr(MedusaHeads, "ranked", broken)
    replies = scorer._replies(parts, logits)
    assert isinstance(replies[0], RuntimeError) and replies[1].argmax_token_ids and replies[2].target_probs
    monkeypatch.undo()
    monkeypatch.setattr(scorer_module, "warp_probs", broken)
    replies = scorer._replies(parts, logits)
    assert replies[0].head_drafts.token_ids and replies[1].argmax_token_ids and isinstance(replies[2], RuntimeError)


def test_served_fusing_heads_read_the_layers_of_their_own_rows(tiny):
    """Heads that fuse lower layers, served: the verify keeps those layers' outputs with the features
    (CausalLM.capture_layers) and the proposals of every row of a sampling session's pass, alone and
    in a batched pass beside another session, equal the heads' proposals from the same rows computed
    offline by training's extraction (feature_data.target_layers). A layer's output taken from the
    wrong layer or row changes the random heads' proposals."""
    from draft_training.feature_data import target_features, target_layers
    from specd_common.params import Warp
    from verify_service.scorer import Part

    heads, loaded = random_token_heads(tiny, chained=True, fusion_layers=(1, 2))
    scorer = heads_scorer(loaded, heads)
    prompt, drafts = [5, 17, 42], [9, 3]
    own = scorer.score(scorer.open(prompt, Warp()), drafts).argmax_token_ids  # [3]: the target's argmax at rows 2..4
    sequence = prompt + drafts
    features = target_features(loaded.model, [sequence])[0][2:].float()  # [3, H]: rows 2..4
    layers = target_layers(loaded.model, [sequence], [3], [1, 2])[0].float()  # [3, 2, H]: rows 2..4
    expected = heads.propose(features, torch.tensor(own), layers).flatten().tolist()  # [3 · K]
    swapped = heads.propose(features, torch.tensor(own), layers.flip(1)).flatten().tolist()
    assert swapped != expected  # the check can tell the layers apart
    alone = scorer.score(scorer.open(prompt, Warp(temperature=0.8)), drafts, head_drafts=True).head_drafts
    assert alone.start_position == 2 and list(alone.token_ids) == expected
    parts = [Part(scorer.open([7, 7, 1, 2, 8], Warp(temperature=0.8)), [4], head_drafts=True),
             Part(scorer.open(prompt, Warp(temperature=0.8)), drafts, head_drafts=True)]
    for part in parts:
        part.session.sequence.keep_features = True
    batched = scorer._replies(parts, scorer.lm.forward_batch([(part.session.sequence, part.drafts) for part in parts]))
    assert batched[1].head_drafts.start_position == 2
    assert list(batched[1].head_drafts.token_ids) == expected


def test_head_drafts_at_picks_the_row_of_a_position():
    message = common_pb2.HeadDrafts(start_position=10, heads=2, token_ids=[1, 2, 3, 4, 5, 6])  # rows 10, 11, 12
    assert head_drafts_at(message, 11).tokens == [[3], [4]]
    assert head_drafts_at(message, 12).tokens == [[5], [6]]
    assert head_drafts_at(message, 9).tokens == [] and head_drafts_at(message, 13).tokens == []
    assert head_drafts_at(common_pb2.HeadDrafts(), 0).tokens == []
    with_candidates = common_pb2.HeadDrafts(start_position=10, heads=2, candidates=3, token_ids=list(range(12)))  # rows 10, 11
    assert head_drafts_at(with_candidates, 11).tokens == [[6, 7, 8], [9, 10, 11]]
    assert head_drafts_at(with_candidates, 12).tokens == []
    assert head_drafts_at(with_candidates, 11).confidences == []  # a verify that sends none
    confident = common_pb2.HeadDrafts(start_position=10, heads=2, candidates=2, token_ids=list(range(8)),
                                      confidences=[0.5, 0.25, 0.125, 0.0625, 0.75, 0.5, 0.25, 0.125])  # rows 10, 11
    assert head_drafts_at(confident, 11) == HeadProposals([[4, 5], [6, 7]], [[0.75, 0.5], [0.25, 0.125]])


def heads_scorer(loaded, heads):
    """A Scorer of the tiny target serving `heads`, one session a pass, its heads in one precision at every
    row count (int8: its blocks and products): start-up tuning chooses a precision a row count by timing,
    and these tests compare a row's proposals across passes of other row counts."""
    from specd_engine.batching import BatchPolicy
    from verify_service.scorer import Scorer

    scorer = Scorer(loaded, BatchPolicy(max_batch_size=1), threads=1, prepack="off", medusa=heads)
    heads.fix_precision("int8")
    return scorer


def same_row(first: HeadProposals, second: HeadProposals) -> bool:
    """same_proposals for one row each."""
    return first.tokens == second.tokens and len(first.confidences) == len(second.confidences) > 0 and \
        torch.allclose(torch.tensor(first.confidences), torch.tensor(second.confidences), rtol=1e-5, atol=1e-8)


def same_proposals(first: common_pb2.HeadDrafts, second: common_pb2.HeadDrafts) -> bool:
    """The same tokens, and confidences equal up to float rounding (a batched or tree pass sums in
    another order)."""
    return (first.start_position, first.heads, first.candidates, list(first.token_ids)) == \
        (second.start_position, second.heads, second.candidates, list(second.token_ids)) and \
        len(first.confidences) == len(second.confidences) == len(first.token_ids) and \
        all(abs(a - b) <= 1e-5 * max(abs(a), 1e-3) for a, b in zip(first.confidences, second.confidences))


def test_training_pairs_row_t_with_the_targets_row_t_plus_k():
    """medusa_rows: head k reads f_t and x_{t+1} and learns the target's scores from f_{t+k}, for answer rows t ≥ start - 1."""
    features = torch.arange(8, dtype=torch.float32)[:, None].repeat(1, 4)  # row t holds t
    record = {"tokens": torch.arange(100, 108), "features": features, "start": 3}
    rows = answer_rows([record])  # f_3..f_7
    (in1, next1, out1, layers1), (in2, next2, out2, _) = medusa_rows([record], 2)
    assert layers1 is None  # the record carries no fused layers' outputs
    out1, out2 = rows[out1], rows[out2]
    assert in1[:, 0].tolist() == [2, 3, 4, 5, 6] and out1[:, 0].tolist() == [3, 4, 5, 6, 7]
    assert next1.tolist() == [[103], [104], [105], [106], [107]]
    assert in2[:, 0].tolist() == [2, 3, 4, 5] and out2[:, 0].tolist() == [4, 5, 6, 7]
    assert next2.tolist() == [[103, 104], [104, 105], [105, 106], [106, 107]]  # x_{t+1}, x_{t+2}: what head 2 may read
    # a second record in the batch: its rows are found past the first one's in answer_rows
    other = {"tokens": torch.arange(200, 205), "features": features[:5] + 10, "start": 2}
    rows = answer_rows([record, other])  # f_3..f_7, then the other's f_2..f_4
    (in1, _, out1, _), (in2, _, out2, _) = medusa_rows([record, other], 2)
    assert in1[:, 0].tolist() == [2, 3, 4, 5, 6, 11, 12, 13] and rows[out1][:, 0].tolist() == [3, 4, 5, 6, 7, 12, 13, 14]
    assert in2[:, 0].tolist() == [2, 3, 4, 5, 11, 12] and rows[out2][:, 0].tolist() == [4, 5, 6, 7, 13, 14]


def test_training_rows_carry_the_fused_layers_outputs_of_their_own_row():
    """With layer_features (rows start - 1 .. T - 1 of the record), head k's row t reads the layers'
    outputs at t, beside f_t: an off-by-one would pair f_t with the outputs at t ± 1."""
    features = torch.arange(8, dtype=torch.float32)[:, None].repeat(1, 4)  # row t holds t
    layers = torch.arange(2, 8, dtype=torch.float32)[:, None, None].repeat(1, 2, 4)  # [T - start + 1, L, H]: row t holds t
    record = {"tokens": torch.arange(100, 108), "features": features, "start": 3, "layer_features": layers}
    for inputs, _, _, layer_rows in medusa_rows([record], 3):
        assert layer_rows.shape[1:] == (2, 4)
        assert torch.equal(layer_rows[:, 0, 0], inputs[:, 0])


def test_target_layers_are_the_decoder_outputs_of_each_answer_row(tiny):
    """feature_data.target_layers: the outputs of the asked decoder layers at rows start - 1 .. T - 1,
    the same for a sequence alone and padded in a batch beside a longer one."""
    from draft_training.feature_data import target_layers
    from specd_engine.models import load_causal_lm

    loaded = load_causal_lm(str(tiny.target), device="cpu", dtype="float32")
    short, long = [5, 9, 14, 3, 8, 2], [4, 4, 7, 1, 9, 12, 30, 31, 2]
    with torch.inference_mode():
        alone = loaded.model.model(input_ids=torch.tensor([short]), output_hidden_states=True).hidden_states
    batch = target_layers(loaded.model, [short, long], [3, 4], [1, 2])
    expected = torch.stack([alone[1][0, 2:], alone[2][0, 2:]], dim=1)  # [4, 2, H]
    assert batch[0].shape == expected.shape and batch[1].shape[0] == len(long) - 3
    assert torch.allclose(batch[0].float(), expected, atol=1e-2)
    assert not torch.allclose(alone[1][0, 2:], alone[2][0, 2:], atol=1e-2)  # the two layers differ: their order is checked


def test_fusing_heads_start_as_the_heads_they_were_made_from_and_then_read_the_layers(tiny):
    """reshaped_from(fusion_layers=...): the fusion starts at zero, so the heads propose what they did
    whatever the layers' outputs; once it has weights, the outputs change the proposals. Heads that
    fuse refuse to propose without the layers' outputs."""
    from draft_training.medusa_training import reshaped_from

    heads, loaded = random_token_heads(tiny, chained=True)
    h = loaded.model.config.hidden_size
    features, next_tokens = torch.randn(6, h), torch.randint(0, 50, (6,))
    fusing = reshaped_from(heads, loaded.model, fusion_layers=[1, 2]).eval()
    assert fusing.fusion.in_features == 2 * h
    layer_features = torch.randn(6, 2, h) * 5
    assert torch.equal(fusing.propose(features, next_tokens, layer_features), heads.propose(features, next_tokens))
    with torch.no_grad():
        fusing.fusion.weight.copy_(torch.randn(h, 2 * h, generator=torch.Generator().manual_seed(1)))
    assert not torch.equal(fusing.propose(features, next_tokens, layer_features), heads.propose(features, next_tokens))
    with pytest.raises(ValueError, match="layer_features"):
        fusing.propose(features, next_tokens)


def random_token_heads(tiny, chained: bool, seed: int = 0, fusion_layers: tuple[int, ...] = ()):
    """Token-input heads over the tiny target's whole vocabulary with random (not identity) blocks (and
    fusion, with fusion_layers), so that every input column changes their proposals; with the loaded target."""
    from draft_training.medusa_training import MedusaRecipe, build_heads
    from specd_engine.models import load_causal_lm

    loaded = load_causal_lm(str(tiny.target), device="cpu", dtype="float32")
    heads = build_heads(loaded, torch.arange(loaded.model.config.vocab_size), "",
                        MedusaRecipe(num_heads=HEADS, next_token_input=True, chained_input=chained, fusion_layers=list(fusion_layers)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return heads.eval(), loaded


def test_chained_heads_served_read_what_they_were_trained_on(tiny):
    """A chained head k reads x_{t+1}..x_{t+k}: in training the answer's own tokens (medusa_rows), when
    serving the earlier heads' proposals (propose). On an answer whose tokens are the proposals
    themselves, the training rows must give each head the same input and so the same proposal; an
    off-by-one column in either place changes the random heads' argmax."""
    heads, loaded = random_token_heads(tiny, chained=True)
    features = torch.randn(1, loaded.model.config.hidden_size)  # [1, H]: row t
    proposals = heads.propose(features, torch.tensor([7]))[0]  # [K]
    assert len(set(proposals.tolist())) > 1  # the check below can tell the heads' inputs apart
    tokens = torch.tensor([3, 7] + proposals.tolist())  # row t = 0 (start 1): x_1 = 7, then the proposals
    record = {"tokens": tokens, "features": features.expand(len(tokens), -1), "start": 1}
    with torch.inference_mode():
        for index, (inputs, read, _, _) in enumerate(medusa_rows([record], HEADS)):
            scores = heads.head_output(index, inputs[:1], read[:1]) @ heads.head_columns  # [1, V]
            assert read[0].tolist() == [7] + proposals[:index].tolist()
            assert int(scores.argmax()) == int(proposals[index])


def test_reshaped_heads_start_as_the_heads_they_were_made_from(tiny):
    """reshaped_from: a run warm-started from unchained one-block token heads, made chained and two
    blocks deep, proposes exactly what they did (the new input columns are zero, the new blocks the
    identity); then every head's input is wider by one token per earlier head and has two blocks."""
    from draft_training.medusa_training import reshaped_from

    heads, loaded = random_token_heads(tiny, chained=False)
    features, next_tokens = torch.randn(6, loaded.model.config.hidden_size), torch.randint(0, 50, (6,))
    chained = reshaped_from(heads, loaded.model, chained_input=True).eval()
    deeper = reshaped_from(chained, loaded.model, num_layers=2).eval()
    for reshaped in (chained, deeper):
        assert torch.equal(reshaped.propose(features, next_tokens), heads.propose(features, next_tokens))
    h = loaded.model.config.hidden_size
    assert [head[0].linear.in_features for head in deeper.heads] == [2 * h, 3 * h, 4 * h]
    assert [len(head) for head in deeper.heads] == [2, 2, 2] and deeper.config.num_layers == 2


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_reduced_precision_products_propose_what_float32_does(tiny, precision):
    """top_columns in bfloat16 or int8 rescores its best candidates in float32: two vocabulary columns
    whose scores differ by less than the reduced precision can tell apart still give float32's argmax
    (without the rescoring the rounded scores tie and the first column wins), and chained random heads
    propose the same tokens in either precision."""
    heads, loaded = random_token_heads(tiny, chained=True)
    h = loaded.model.config.hidden_size
    with torch.no_grad():
        heads.head_columns[:, 0] = 1.0  # for x = 1 a score of H, far above every other column's
        heads.head_columns[:, 1] = 1.0 + 1e-3  # 0.1% above column 0's: bfloat16 resolves 0.4%, int8 0.8%
    heads.reduced, heads.rescoring = {}, None  # the columns changed: reduce them again
    ones = torch.ones(3, h)
    assert (heads._reduced_scores(ones, precision).argmax(dim=-1) == 0).all()  # the rounding ties them
    assert heads.top_columns(ones, 1, precision).tolist() == heads.top_columns(ones, 1, "float32").tolist() == [[1]] * 3
    assert heads.top_columns(ones, 2, precision).tolist() == heads.top_columns(ones, 2, "float32").tolist() == [[1, 0]] * 3
    features, next_tokens = torch.randn(8, h), torch.randint(0, 50, (8,))
    in_float32 = heads.propose(features, next_tokens)
    heads.product_dtypes = {1: precision}
    assert torch.equal(heads.propose(features, next_tokens), in_float32)


def test_heads_product_precision_chosen_from_fake_timings(tiny, monkeypatch):
    """tune_product: the fastest reduced precision for the row counts where it measured REDUCED_MARGIN
    faster than float32, float32 elsewhere (and no reduced copy of the columns kept that no size
    uses); the residual blocks likewise in int8; the record names the timings."""
    from specd_engine import autotune
    from verify_service import medusa, native_heads

    heads, _ = random_token_heads(tiny, chained=True)
    ms = {(1, "float32"): 0.50, (1, "bfloat16"): 0.69, (1, "int8"): 0.48, (4, "float32"): 2.42, (4, "bfloat16"): 0.81,
          (4, "int8"): 1.0, (8, "float32"): 3.0, (8, "bfloat16"): 2.9, (8, "int8"): 5.0,
          (1, "blocks float32"): 1.6, (1, "blocks int8"): 1.2, (4, "blocks float32"): 1.9, (4, "blocks int8"): 1.8,
          (8, "blocks float32"): 2.2, (8, "blocks int8"): 1.6,
          (1, "native"): 0.95, (1, "framework"): 1.0, (4, "native"): 1.0, (4, "framework"): 3.0, (8, "native"): 1.0, (8, "framework"): 3.0}
    monkeypatch.setattr(autotune, "measure_interleaved", lambda runs, repeats: {key: ms[key[1:]] / 1e3 for key in runs})
    record = heads.tune_product(rows=(1, 4, 8))
    assert heads.product_dtypes == {1: "float32", 4: "bfloat16", 8: "float32"}  # 1 row and 8 rows: within the margin
    assert heads.block_dtypes == {1: "int8", 4: "float32", 8: "int8"}
    assert record[4].startswith("bfloat16 (2.42 ms float32, 0.81 ms bfloat16, 1.00 ms int8); "
                                "blocks float32 (1.90 ms float32, 1.80 ms int8); proposals ")
    if not native_heads.unavailable(heads):  # a whole proposal natively where it is REDUCED_MARGIN faster
        assert heads.native_rows == {1: False, 4: True, 8: True} and heads.native is not None
        assert record[4].endswith("proposals native (1.00 ms native int4, 3.00 ms framework)")
    else:
        assert heads.native is None and "proposals by the framework (native: " in record[4]
    assert set(heads.reduced) == {"bfloat16"} and heads.rescoring is not None and len(heads.packed_blocks) == sum(len(head) for head in heads.heads)
    assert medusa.REDUCED_MARGIN > 3.0 / 2.9
    ms[(1, "int8")], ms[(4, "bfloat16")] = 0.42, 2.5  # the AVX2-only EPYC: int8 at one row
    ms[(1, "blocks int8")] = ms[(8, "blocks int8")] = 2.5
    heads.tune_product(rows=(1, 4, 8))
    assert heads.product_dtypes == {1: "int8", 4: "int8", 8: "float32"} and set(heads.reduced) == {"int8"} and heads.rescoring is not None
    assert set(heads.block_dtypes.values()) == {"float32"} and heads.packed_blocks == {}
    ms[(1, "int8")] = ms[(4, "int8")] = 2.5
    heads.tune_product(rows=(1, 4, 8))
    assert set(heads.product_dtypes.values()) == {"float32"} and heads.reduced == {} and heads.rescoring is None


def test_int8_blocks_propose_as_their_float32_weights_do(tiny):
    """Residual blocks multiplied in 8 bits (block_dtypes) read the same inputs as in float32: heads whose
    blocks are near the identity propose the same tokens either way, and a block's output moves by
    no more than its weight's 8-bit rounding allows."""
    heads, loaded = random_token_heads(tiny, chained=True)
    h = loaded.model.config.hidden_size
    with torch.no_grad():
        for head in heads.heads:
            for block in head:
                block.linear.weight.mul_(0.01)  # small updates: the argmax is the features' own
    features, next_tokens = torch.randn(16, h), torch.randint(0, 50, (16,))
    in_float32 = heads.propose(features, next_tokens)
    heads.fix_precision("int8")
    heads.product_dtypes = {}  # the products in float32: the blocks alone in 8 bits
    assert torch.equal(heads.propose(features, next_tokens), in_float32)
    block, x = heads.heads[1][0], torch.randn(4, 3 * h)
    exact, packed = block(x[:, :h], x[:, h:]), block(x[:, :h], x[:, h:], heads.packed_blocks[1, 0])
    assert not torch.equal(exact, packed) and (exact - packed).abs().max() < 0.05


def test_simulated_rounds_with_perfect_proposals():
    """An oracle (row t proposes x_{t+2}..x_{t+1+k}) is accepted in full: 1 + (k + 1) tokens a pass after the first."""
    tokens = list(range(100, 130))
    oracle = [tokens[t + 2 : t + 5] for t in range(len(tokens))]
    passes, accepted = simulate_chain(oracle, tokens, start=10, k=3)
    # 20 answer tokens: the first pass emits 1, then 4 a pass (3 accepted + the target's own) while 4 fit
    assert accepted[:4] == [3, 3, 3, 3] and passes == 1 + len(accepted)
    assert sum(a + 1 for a in accepted) == len(tokens) - 10 - 1


def head_policy_generation(costs: StepCosts, draft_service: bool = False, max_new_tokens: int = 50, **spec):
    """A Generation whose policy can be asked without services (unit tests of the head-round choices):
    three heads, greedy, with or without a draft service configured (none open)."""
    from gateway.engine import Generation, GenerationSpec
    from gateway.options import GatewayOptions
    from specd_common.params import Warp

    backends = SimpleNamespace(draft=SimpleNamespace(configured=draft_service), keeper=None, position_price_s=lambda running: 0.0,
                               draft_info=SimpleNamespace(wants_target_features=False) if draft_service else None, costs=costs,
                               target_info=SimpleNamespace(max_sequence_length=100, eos_token_ids=[], medusa_heads=3),
                               tokenizer=SimpleNamespace(decode=lambda ids: ""))
    return Generation(backends, GenerationSpec(prompt_ids=[1, 2, 3], max_new_tokens=max_new_tokens, warp=Warp(), seed=0, **spec),
                      options=GatewayOptions())


def head_round(generation) -> tuple[list[int], list[int]]:
    """The heads' offer this round as (drafts, parents), ([], []) when they decline."""
    ctx = generation.context()
    offer = generation.heads.offer(ctx, generation.draft.rate(ctx), generation.draft.enabled)
    generation.heads.settle(offer)
    return (offer.plan.drafts, offer.plan.parents) if offer.plan is not None else ([], [])


def asks_heads(generation) -> bool:
    return generation.planner.decide_heads_ask(generation.context())


def test_heads_give_way_to_a_draft_that_promises_more():
    """Unit, the engine's choice without services: head proposals are taken when they pay and nothing
    better is open; declined when the draft service's estimate promises more tokens per second."""
    costs = StepCosts()
    costs.observe_verify(1, 0.100)
    for positions in range(2, 6):
        costs.observe_verify(positions, 0.120)
    costs.observe_draft(3, 0.010)
    generation = head_policy_generation(costs, draft_service=True, max_new_tokens=20)
    generation.draft._retry_at = float("inf")  # the draft is backing off
    generation.heads.proposals = HeadProposals([[7], [8], [9]])
    assert head_round(generation) == ([7, 8, 9], [])  # no draft open: the prior (0.5) pays for 3
    generation.draft.link.replica = SimpleNamespace()  # a draft session is open ...
    for _ in range(10):
        generation.draft.acceptance.update(3, 3)  # ... and its drafts are always accepted
    generation.heads.proposals = HeadProposals([[7], [8], [9]])
    assert head_round(generation) == ([], [])
    assert not generation.heads.proposals  # proposals are used once


def test_a_verify_asks_for_proposals_only_when_a_head_round_could_pay():
    """Unit: proposals cost the verify every pass that asks, so a request asks only while a head round
    could pay by the heads' acceptance and the measured costs; a round that does not ask forgets like
    a declined one, so the request asks again later. The fixed policy asks only without a draft service."""
    costs = StepCosts()
    costs.observe_verify(1, 0.100)
    for positions in range(2, 6):
        costs.observe_verify(positions, 0.120)
    generation = head_policy_generation(costs)
    assert asks_heads(generation)  # the prior (0.5) pays for a 20% dearer pass
    k, _ = best_rate(generation.heads.acceptance.chain(3), 3, lambda k: generation.context().free_cost(k, heads=True))
    assert k >= 1 and generation.heads.depth == min(3, k + generation.heads.policy.heads_past_best_chain)  # each head costs a product
    for _ in range(10):
        generation.heads.acceptance.update(3, 0)  # every proposal rejected
    assert not asks_heads(generation)
    rounds = 0
    while not asks_heads(generation):  # each round that does not ask forgets toward the prior
        assert head_round(generation) == ([], [])
        rounds += 1
        assert rounds < 100, "a request that stopped asking must ask again once its estimate forgets"
    assert rounds > 3  # ... but not at once
    assert generation.heads.depth >= 1
    generation.heads.proposals = HeadProposals([[7], [8], [9]])
    assert head_round(generation)[0][:1] == [7]  # it asked: the proposals are judged by the estimate as before

    assert asks_heads(head_policy_generation(costs, adaptive=False))  # no draft service: the heads draft
    assert not asks_heads(head_policy_generation(costs, draft_service=True, adaptive=False))  # the draft service drafts


def test_asking_the_heads_and_their_offer_are_queries_and_settling_records_them():
    """HeadProposer.ask and offer change nothing, however often they are called; record_ask and settle
    are where a round's choice is kept (issue 56: methods read as queries do not change state)."""
    costs = StepCosts()
    costs.observe_verify(1, 0.100)
    for positions in range(2, 6):
        costs.observe_verify(positions, 0.120)
    generation = head_policy_generation(costs)
    heads, ctx = generation.heads, generation.context()
    generation.heads.proposals = HeadProposals([[7], [8], [9]], [[0.9], [0.8], [0.7]])

    def state():
        return (heads.proposals, heads.asked, heads.depth, heads._declined, heads._declined_rounds,
                heads.acceptance.chain(3))

    before = state()
    asks = [heads.ask(ctx, 0.0, False) for _ in range(3)]
    offers = [heads.offer(ctx, 0.0, False) for _ in range(3)]
    assert state() == before and asks[0] == asks[1] == asks[2] and asks[0].asked
    assert offers[0].plan is not None and offers[0] == offers[1] == offers[2]
    assert heads.record_ask(asks[0]) and (heads.asked, heads.depth) == (True, asks[0].depth)
    heads.settle(offers[0])
    assert not heads.proposals and heads.offer(ctx, 0.0, False).plan is None  # taken: once


def test_heads_beside_a_better_draft_still_draft_one_token_every_few_rounds():
    """Unit: beside a draft service that promises more, the heads are not asked, but every
    probe_every_rounds declined rounds a Verify asks and the next round drafts one head token, so the
    heads' estimate and calibration learn (a sampled split stack took no head round at all before)."""
    costs = StepCosts()
    costs.observe_verify(1, 0.100)
    for positions in range(2, 6):
        costs.observe_verify(positions, 0.120)
    costs.observe_draft(3, 0.010)
    generation = head_policy_generation(costs, draft_service=True)
    generation.draft.link.replica = SimpleNamespace()  # a draft session is open ...
    for _ in range(10):
        generation.draft.acceptance.update(3, 3)  # ... and its drafts are always accepted
    every = generation.heads.policy.probe_every_rounds
    asked = []
    for _ in range(3 * (every + 1)):
        asked.append(asks_heads(generation))
        if asked[-1]:
            assert generation.heads.depth == 1  # a probe drafts one token: the first head alone is run
            generation.heads.proposals = HeadProposals([[7], [8], [9]])  # the Verify that asked returns them
            assert head_round(generation) == ([7], [])  # one token, the first head's best
        else:
            assert head_round(generation) == ([], [])
    assert asked == ([False] * every + [True]) * 3


def test_a_rescue_estimate_learns_per_position():
    """A tree's alternatives are judged per draft position: misses beside the first draft pull its
    estimate down without moving the second's, which learns from its own trial."""
    from gateway.adaptive import AcceptanceEstimate

    learning = AcceptanceEstimate(prior=0.3)
    for _ in range(30):
        learning.observe(0, False)
    learning.observe(1, True)
    assert learning.chain(2)[0] < 0.06 and learning.chain(2)[1] > 0.3


def test_heads_without_confidences_are_valued_by_their_measured_acceptance():
    """A verify that sends no confidences: each head's best candidate is valued by the heads'
    acceptance per position, a chain (nothing to branch with). At +20 ms a position the prior (0.5)
    pays for 2 drafts (1.75 tokens / 160 ms against 1.5 / 140 and 1 / 120)."""
    steep = StepCosts()
    for positions in range(1, 8):
        steep.observe_verify(positions, 0.100 + 0.020 * positions)
    generation = head_policy_generation(steep, branches=2)
    generation.heads.proposals = HeadProposals([[7, 17], [8, 18], [9, 19]])
    assert head_round(generation) == ([7, 8], [])
    for _ in range(20):
        generation.heads.acceptance.update(3, 0)  # the heads' drafts keep failing
    generation.heads.proposals = HeadProposals([[7, 17], [8, 18], [9, 19]])
    assert head_round(generation) == ([], [])


CONFIDENCES = [[0.9, 0.05], [0.5, 0.3], [0.4, 0.2]]  # each head's two candidates; path values 0.9, 0.05 | 0.45, 0.27 | 0.18, 0.09
TOKENS = [[7, 17], [8, 18], [9, 19]]  # their tokens


def per_position(cost: float, tree_extra: float = 0.0) -> Callable[[int, bool], float]:
    """A verify of n drafts (n + 1 positions) costing 1 + cost · n, and tree_extra more for a tree."""
    return lambda n, tree: 1.0 + cost * n + (tree_extra if tree else 0.0)


def test_a_confident_tree_takes_the_nodes_that_pay_by_their_path_probability():
    """Unit, by hand: values are path products (0.9 | 0.45, 0.27 | 0.18, ...: a second candidate of head 2
    hangs off head 1's best); n nodes promise 1 + the n largest values over the cost of n drafts. At
    +0.1 a position: n = 2 gives 2.35/1.2 = 1.958, n = 3 (head 2's second candidate) 2.62/1.3 = 2.015,
    n = 4 2.80/1.4 = 2.0, so the tree is head 1's best with both of head 2's beside, not the chain of
    3; at +0.2 the chain of 2 (2.35/1.4); free positions take every node; a halved scale (heads
    twice as confident as they are right) the chain of 2; a scale per depth that halves only the
    deeper heads' values keeps head 1's best alone; nothing of value: no drafts. At +0.05 a
    position the 4 best nodes (2.80/1.2 = 2.333, head 2's second candidate among them); when a tree
    costs 0.3 more than a chain of its size, the chain of 3 (2.53/1.15 = 2.2): not the 3 most
    valuable nodes, so chains are weighed apart."""
    from gateway.adaptive import confident_tree

    def counts(confidences, scales, cost):  # candidates taken per depth (head)
        nodes, rate = confident_tree(TOKENS, confidences, scales, cost)
        return [sum(len(node.path) == depth for node in nodes) for depth in range(1, 4) if any(len(node.path) == depth for node in nodes)]

    nodes, rate = confident_tree(TOKENS, CONFIDENCES, [1.0], per_position(0.1))
    assert [node.path for node in nodes] == [(7,), (7, 8), (7, 18)]  # parents first, the heads' best before their alternatives
    assert depth_sums(nodes, {node.path: node.value for node in nodes}) == pytest.approx([0.9, 0.72])
    assert rate == pytest.approx(2.62 / 1.3)
    assert counts(CONFIDENCES, [1.0], per_position(0.2)) == [1, 1]
    assert counts(CONFIDENCES, [1.0], per_position(0.0)) == [2, 2, 2]
    assert counts(CONFIDENCES, [0.5], per_position(0.1)) == [1, 1]
    assert counts(CONFIDENCES, [1.0, 0.2], per_position(0.1)) == [1]  # 1.9/1.1 against 1.99/1.2 for the chain of 2
    assert counts(CONFIDENCES, [1.0], per_position(0.05)) == [1, 2, 1]
    nodes, rate = confident_tree(TOKENS, CONFIDENCES, [1.0], per_position(0.05, tree_extra=0.3))
    assert [node.path for node in nodes] == [(7,), (7, 8), (7, 8, 9)] and rate == pytest.approx(2.53 / 1.15)
    nodes, rate = confident_tree([[7], [8]], [[0.01], [0.5]], [1.0], per_position(0.2))
    assert (nodes, rate) == ([], 1.0)


def test_head_calibration_follows_each_depth_apart():
    """Unit, by hand: heads whose depth-1 nodes are kept as often as valued but whose depth-2 nodes are
    kept a fifth as often get a scale near 1 at depth 1 and well below it at depth 2 (~0.4: the prior,
    two rounds' worth, pulls it toward depth 1's); a depth never drafted
    borrows the depth above's scale; a depth-2 value is never above its parent's once scaled."""
    from gateway.adaptive import HeadCalibration, head_nodes

    calibration = HeadCalibration()
    assert calibration.scales(3) == [1.0, 1.0, 1.0]
    for _ in range(60):
        calibration.observe([0.5, 0.5], [1 if _ % 2 else 0, 1 if _ % 10 == 1 else 0])
    first, second, third = calibration.scales(3)
    assert first == pytest.approx(1.0, abs=0.15) and 0.25 < second < 0.5 and third == second
    nodes = head_nodes([[7], [8]], [[0.2], [1.0]], [1.0, 5.0])
    assert [node.value for node in nodes] == pytest.approx([0.2, 0.2])  # 0.2 · 1.0 · 5 capped at its parent's 0.2


def test_free_drafters_share_one_tree_by_value():
    """Unit, adaptive.valued_tree by hand: a lookup copy valued 0.8, 0.6 (rates 0.8, 0.75) and the heads'
    nodes 0.5 (9), 0.25 (9, 4), 0.1 (3). Free positions take every node, the copy first among siblings
    (tree.main_chain is the copy); at +0.2 a node the three best (2.9/1.6 = 1.81 against the copy's
    2.4/1.4); when a tree costs 0.3 more, the copy's chain alone (1.71 against 2.9/1.9 = 1.53), not a
    prefix of the nodes by value; a path both offer counts once, at the larger value; max_nodes caps the tree."""
    from gateway.adaptive import TreeNode, chain_nodes, valued_tree
    from specd_common import tree

    copy = chain_nodes([7, 8], [0.8, 0.75])
    heads = [TreeNode((9,), 0.5), TreeNode((9, 4), 0.25), TreeNode((3,), 0.1)]
    nodes, rate = valued_tree([copy, heads], per_position(0.0))
    tokens, parents = tree.from_paths([node.path for node in nodes])
    assert (tokens, parents) == ([7, 9, 3, 8, 4], [-1, -1, -1, 0, 1]) and tree.main_chain(parents) == [0, 3]
    assert rate == pytest.approx(3.25)
    nodes, rate = valued_tree([copy, heads], per_position(0.2))
    assert [node.path for node in nodes] == [(7,), (9,), (7, 8)] and rate == pytest.approx(2.9 / 1.6)
    nodes, rate = valued_tree([copy, heads], per_position(0.2, tree_extra=0.3))
    assert [node.path for node in nodes] == [(7,), (7, 8)] and rate == pytest.approx(2.4 / 1.4)
    nodes, rate = valued_tree([copy, [TreeNode((7,), 0.9)]], per_position(0.0))
    assert [node.path for node in nodes] == [(7,), (7, 8)] and rate == pytest.approx(1 + 0.9 + 0.6)
    nodes, rate = valued_tree([copy, heads], per_position(0.0), max_nodes=2)  # no more than a Verify scores
    assert [node.path for node in nodes] == [(7,), (7, 8)]


def free_round(generation):
    """The planner's round as (drafts, parents, copied, headed); the plan is kept as generation.last_plan."""
    from gateway.proposers import HEADS, JOINED

    plan = generation.last_plan = generation.planner.plan(generation.context())
    return plan.drafts, plan.parents, plan.copied, plan.source in (HEADS, JOINED)


def test_a_lookup_copy_and_the_heads_share_a_round_alone():
    """Unit, the engine: a request alone with a lookup copy (5 6 ... 5 6 → 7 8 5 6 ...) whose first token is
    right half the time and confident heads drafts one tree: the copy first (its estimate learns from the main
    chain), the heads' best beside it; beside another request (no trees) the copy alone, cut by its
    own estimate as before; heads worth nothing leave the round to the copy and keep their proposals."""
    costs = StepCosts()
    for positions in range(1, 14):
        costs.observe_verify(positions, 0.100 + 0.002 * (positions - 1))
    heads = HeadProposals([[9, 17], [10, 18], [11, 19]], [[0.9, 0.05], [0.8, 0.1], [0.7, 0.1]])

    def with_copy(running: int = 1, proposals: HeadProposals = heads):
        generation = head_policy_generation(costs, branches=2)
        generation.lookup.max_tokens = 8  # the CLI's default
        generation.sequence[:] = [5, 6, 7, 8, 5, 6]
        generation._running = lambda: running
        for hit in (0, 1) * 5:
            generation.lookup.acceptance.update(1, hit)  # the copy's first token holds half the time
        generation.heads.proposals = proposals
        return generation

    alone = with_copy()
    drafts, parents, copied, headed = free_round(alone)
    assert headed and copied >= 1 and drafts[0] == 7 and 9 in drafts
    assert parents[drafts.index(9)] == -1  # the heads' best beside the copy's first token
    assert alone.last_plan.head_nodes == {i for i, token in enumerate(drafts) if token in (9, 10, 11, 17, 18, 19)}
    assert not alone.heads.proposals  # taken
    beside = with_copy(running=2)
    drafts, parents, copied, headed = free_round(beside)
    assert parents == [] and not headed and drafts == [7, 8, 5, 6, 7, 8, 5, 6][:copied]
    timid = with_copy(proposals=HeadProposals([[9], [10], [11]], [[0.001], [0.001], [0.001]]))
    drafts, parents, copied, headed = free_round(timid)
    assert not headed and parents == [] and timid.heads.proposals  # the copy's rule; the proposals stay


def test_a_head_round_is_shaped_by_the_heads_confidence_and_the_requests_calibration():
    """Unit, the engine with confidences from the verify: the round is confident_tree's shape as a chain
    with leaves (alone), a chain beside another request; a request whose heads keep promising more
    than the target accepts scales their values down (HeadCalibration) and drafts less; heads never
    confident enough to draft still get a one-token probe every PROBE_EVERY_ROUNDS rounds."""
    from gateway.policy import POLICY

    PROBE_EVERY_ROUNDS = POLICY.probe_every_rounds

    costs = StepCosts()
    for positions in range(1, 8):
        costs.observe_verify(positions, 0.100 + 0.010 * (positions - 1))  # + 0.1 a position, relative
    proposals = HeadProposals(TOKENS, CONFIDENCES)
    alone = head_policy_generation(costs, branches=2)
    alone.heads.proposals = proposals
    assert head_round(alone) == ([7, 8, 18], [-1, 0, 0])  # tree.chain_with_leaves([[7], [8, 18]])
    shared = head_policy_generation(costs, branches=2)
    shared._running = lambda: 2
    shared.heads.proposals = proposals
    assert head_round(shared) == ([7, 8], [])  # a chain: the best of 2.35/1.2 and 2.53/1.3
    for _ in range(20):
        alone.heads.calibration.observe([0.9, 0.72], [0, 0])  # nothing it drafted was accepted: scale 2 / 11 at depth 1
    alone.heads.proposals = proposals
    assert head_round(alone) == ([7], [])  # 1 + 0.9 · 0.12 over 1.1 still pays, barely
    timid = head_policy_generation(costs, branches=2)
    drafted = []
    for _ in range(2 * PROBE_EVERY_ROUNDS + 2):
        timid.heads.proposals = HeadProposals([[7], [8], [9]], [[0.01], [0.01], [0.01]])
        drafted.append(head_round(timid)[0])
    assert drafted.count([7]) == 2 and drafted.count([]) == 2 * PROBE_EVERY_ROUNDS
    assert drafted[PROBE_EVERY_ROUNDS] == [7]
    last = head_policy_generation(costs, branches=2, max_new_tokens=1)  # one token left: it is the bonus, no room to draft
    for _ in range(PROBE_EVERY_ROUNDS + 2):
        last.heads.proposals = HeadProposals([[7], [8], [9]], [[0.01], [0.01], [0.01]])
        assert head_round(last) == ([], [])


def draft_shape(generation) -> tuple[int, int]:
    return generation.draft.shape(generation.context())


def test_a_draft_tree_keeps_the_alternatives_that_pay():
    """Unit: with draft_branches 3 and a draft service, a round asks the draft for a tree only where the
    measured costs and the rescue estimate promise more tokens/s than a chain (the same choice as the
    heads'), and verifies only the alternatives of the first w drafts; a chain round asks for none.
    Beside other requests no tree is drafted (a tree pass cannot share a batched pass)."""
    from gateway.proposers import DRAFT, RoundPlan
    from specd.v1 import draft_pb2

    flat, steep = StepCosts(), StepCosts()
    for positions in range(1, 11):
        flat.observe_verify(positions, 0.100 + 0.0005 * positions)
        steep.observe_verify(positions, 0.100 + 0.020 * positions)
    requests = []
    tree_reply = draft_pb2.ProposeResponse(token_ids=[10, 20, 30, 11, 21, 31, 12, 22, 32], parents=[-1, -1, -1, 0, 0, 0, 3, 3, 3])

    def with_draft(costs: StepCosts, running: int = 1):
        generation = head_policy_generation(costs, draft_service=True, branches=3)
        generation.draft.link.replica = SimpleNamespace(stub=SimpleNamespace(Propose=lambda request, timeout: requests.append(request) or tree_reply))
        generation._running = lambda: running
        return generation

    generation = with_draft(flat)
    k, widened = draft_shape(generation)
    assert (k, widened) == (3, 3)  # nearly free positions: alternatives beside every draft
    generation.draft.rescue.observe(0, True)
    for _ in range(20):
        generation.draft.rescue.observe(1, False)  # alternatives beside the second draft never hit
    k, widened = draft_shape(generation)
    assert (k, widened) == (3, 1)
    drafts, _, parents = generation.draft.propose(RoundPlan(DRAFT, k=k, widened=widened), generation.sequence, generation.rng)
    assert requests[-1].branches == 3
    assert (drafts, parents) == ([10, 20, 30, 11, 12], [-1, -1, -1, 0, 3])
    assert draft_shape(with_draft(steep))[1] == 0  # dear positions: a chain
    assert draft_shape(with_draft(flat, running=2))[1] == 0  # beside another request: a chain
    generation.draft.propose(RoundPlan(DRAFT, k=2), generation.sequence, generation.rng)
    assert requests[-1].branches == 1


def test_head_rounds_are_weighed_against_plain_rounds_that_do_not_ask():
    """Asking for proposals makes a pass dearer, so a head round (whose Verify asks, for the round after
    it) is weighed against a plain round that does not ask. Plain passes of 100 ms and asking ones of
    110 ms (one position) and 125 ms (two), alternating until the extra is learned: heads accepted 20%
    of the time promise 1.248 tokens per 125 ms (9.98/s) against 10/s for plain rounds, so they are not
    asked; priced by the asking passes (110 ms), plain rounds would promise 9.1/s and the heads would be."""
    from gateway.adaptive import AcceptanceEstimate

    costs = StepCosts()
    for _ in range(60):
        costs.observe_verify(1, 0.100, heads=False)
        costs.observe_verify(1, 0.110, heads=True)
        costs.observe_verify(2, 0.125, heads=True)
    assert costs.heads_extra_s == pytest.approx(0.010, abs=1e-3)
    generation = head_policy_generation(costs)
    generation.heads.acceptance = AcceptanceEstimate(prior=0.2)
    assert not asks_heads(generation)
    for _ in range(3):
        costs.observe_verify(1, 0.120, heads=False)  # plain rounds dearer: now the heads pay
    assert asks_heads(generation)


@pytest.mark.parametrize("recipe", ["medusa-tiny", "medusa-chain-tiny", "medusa-fusion-tiny"])
def test_training_medusa_heads_end_to_end(tmp_path, recipe):
    """`specd train-draft --recipe medusa-tiny` (and its chained heads) on a tiny random target: saves
    heads that load, and that predict the held-out answers better than untrained (identity) heads."""
    from draft_training.medusa_training import MEDUSA_RECIPES, build_heads, medusa_evaluation
    from specd_engine.models import load_causal_lm
    from tests.test_train_feature_head import train_on_a_tiny_target
    from verify_service.medusa import load_heads

    run = train_on_a_tiny_target(tmp_path, recipe, head_scale=10.0)  # peaked: the soft targets carry signal
    folder = run["root"] / "work" / "medusa"
    for name in ("medusa_heads.safetensors", "medusa_heads.json", "recipe.json", "eval.json", "training.json"):
        assert (folder / name).exists()
    target = load_causal_lm(str(run["target"]))
    trained = load_heads(folder, target.model)
    assert trained.config.chained_input == MEDUSA_RECIPES[recipe].chained_input
    assert trained.config.fusion_layers == MEDUSA_RECIPES[recipe].fusion_layers
    if trained.config.fusion_layers:  # the fusion was trained away from its zero start
        assert trained.fusion.weight.abs().sum() > 0
    untrained = build_heads(target, trained.vocab_ids, "", MEDUSA_RECIPES[recipe]).eval()
    before = medusa_evaluation(untrained, target, run["root"] / "work", 0)["top1_by_head"]
    after = json.loads((folder / "eval.json").read_text())["top1_by_head"]
    assert after[0] > before[0] + 0.1, (before, after)
    # the leak-free chains: every held-out answer when the corpus shares nothing, none when it holds their prompts
    from draft_training.distill_data import load_records
    from draft_training.train_prompts import passage_check

    held_out = [r["tokens"][: r["start"]].tolist() for r in load_records(run["root"] / "work" / "data", "gen-eval")]
    unrelated = medusa_evaluation(trained, target, run["root"] / "work", 0, passage_check([[1, 2, 3]]))
    assert unrelated["leak_free"]["held_out_answers"] == len(held_out) and unrelated["leak_free"]["k2"] == unrelated["k2"]
    leaked = medusa_evaluation(trained, target, run["root"] / "work", 0, passage_check(held_out))
    assert leaked["leak_free"]["held_out_answers"] == 0 and sum(leaked["leak_free"]["leaked_by_kind"].values()) == len(held_out)


# --- the system ----------------------------------------------------------------------------------
def test_greedy_with_head_rounds_equals_target_only_and_transformers(medusa_cluster, tiny):
    stub = medusa_cluster.stub()
    for prompt in PROMPTS:
        speculative = generate(stub, text=prompt, max_new_tokens=40)
        target_only = generate(stub, text=prompt, max_new_tokens=40, disable_speculation=True)
        assert list(speculative.token_ids) == list(target_only.token_ids)
        assert list(speculative.token_ids) == hf_greedy(tiny.target, list(speculative.prompt_token_ids), 40)
        assert speculative.stats.head_rounds > 0
    assert wait_for_no_sessions(medusa_cluster) == {"verify": 0}


def test_greedy_with_head_trees_equals_target_only(medusa_cluster, tiny):
    """draft_branches 2 with no draft service: head rounds verify the heads' best chain with their second
    candidates beside it (fixed policy: every head round; adaptive: where measured costs say so), and
    the output is target-only's."""
    stub = medusa_cluster.stub()
    for prompt in PROMPTS:
        target_only = generate(stub, text=prompt, max_new_tokens=40, disable_speculation=True)
        for policy in (FIXED, 0):
            trees = generate(stub, text=prompt, max_new_tokens=40, draft_branches=2, num_draft_tokens=3, draft_length_policy=policy)
            assert list(trees.token_ids) == list(target_only.token_ids), (prompt, policy)
            if policy == FIXED:
                assert trees.stats.tree_rounds == trees.stats.head_rounds > 0
    assert wait_for_no_sessions(medusa_cluster) == {"verify": 0}


def test_greedy_with_lookup_copies_and_heads_in_one_tree_equals_target_only(tiny, medusa_heads, monkeypatch):
    """The gateway's own lookup copies on (the CLI's default, 8) beside the heads, no draft service:
    where a copy exists the round may verify it and the heads' candidates in one tree
    (RoundPlanner._joined, counted by a spy), and the output is target-only's; on the sampling path
    too (top_k 1, so its output is greedy's: each candidate judged as a fixed token with its one-hot q,
    the rule tests/test_tree_sampling.py checks for exactness), whose rounds draft trees of the heads'
    candidates (joined with a copy only where the heads' nodes outvalue the copy's: machine-dependent,
    not asserted). Costs are frozen (start_heads_cluster),
    so the rounds' shapes follow the tokens, not the machine's load."""
    from gateway.planner import RoundPlanner

    joined = []
    original = RoundPlanner._joined

    def spy(self, copy, ctx, rival):
        result = original(self, copy, ctx, rival)
        joined.append(result is not None)
        return result

    monkeypatch.setattr(RoundPlanner, "_joined", spy)
    running = start_heads_cluster(tiny.target, medusa_heads, lookup_tokens=8)
    try:
        stub = running.stub()
        for prompt in PROMPTS:
            target_only = generate(stub, text=prompt, max_new_tokens=40, disable_speculation=True)
            speculative = generate(stub, text=prompt, max_new_tokens=40, draft_branches=4)
            assert list(speculative.token_ids) == list(target_only.token_ids), prompt
        assert any(joined), "no round joined a copy and the heads"
        joined.clear()
        # the sampling path with a one-token support (top_k 1): a sampled request that asks for trees joins
        # too, judges each candidate as a fixed token (multi_candidate_sample) and must emit greedy's tokens
        sampling = common_pb2.SamplingParams(temperature=1.0, top_k=1)
        # with top_k 1 a sampled round keeps what a greedy one keeps, so sampled requests start from what the
        # greedy ones above learned (server-wide estimates): left to the sampled table's own priors the
        # untrained heads' nodes were valued below the copies' on a 2-core AMD EPYC and never joined
        backends = running.gateway.servicer.backends
        backends.sampled_estimates = backends.greedy_estimates
        head_rounds = tree_rounds = 0
        for prompt in PROMPTS:
            target_only = generate(stub, text=prompt, max_new_tokens=40, disable_speculation=True)
            sampled = generate(stub, text=prompt, max_new_tokens=40, draft_branches=4, sampling=sampling)
            assert list(sampled.token_ids) == list(target_only.token_ids), prompt
            head_rounds, tree_rounds = head_rounds + sampled.stats.head_rounds, tree_rounds + sampled.stats.tree_rounds
        print(f"sampled: {sum(joined)} joined rounds, {head_rounds} head rounds, {tree_rounds} tree rounds")
        assert head_rounds and tree_rounds, "no sampled round drafted a tree of the heads' candidates"
        assert wait_for_no_sessions(running) == {"verify": 0}
    finally:
        running.stop()


def test_the_gateways_default_trees_shape_greedy_adaptive_rounds_only(medusa_cluster):
    """--draft-branches (default 4) applies to greedy adaptive requests; a sampled or fixed-policy
    request drafts chains unless it asks for trees itself (sampled trees lost side by side, and a
    fixed-policy tree costs every round its extra positions)."""
    from specd.v1 import generate_pb2

    servicer = medusa_cluster.gateway.servicer
    assert servicer.options.draft_branches == 4
    spec = lambda **fields: servicer.to_spec(generate_pb2.GenerateRequest(text="hi", **fields))  # noqa: E731
    sampling = common_pb2.SamplingParams(temperature=0.7)
    assert spec().branches == 4
    assert spec(sampling=sampling).branches == 1 and spec(draft_length_policy=FIXED).branches == 1
    assert spec(sampling=sampling, draft_branches=3).branches == 3 and spec(draft_length_policy=FIXED, draft_branches=2).branches == 2


def test_served_head_rounds_match_the_simulation_on_the_same_tokens(medusa_cluster):
    """Fixed k = 3, no draft service, no lookup: every round after the first drafts the heads' proposals
    of the row before the last committed token. With untrained heads those are the target's own next
    token at that row (tokens[t + 1] at row t), so the rounds are simulated exactly from the answer;
    the served passes and accepted tokens must match, and an off-by-one row would not (checked)."""
    checked_off_by_one = 0
    for prompt in PROMPTS:
        reply = generate(medusa_cluster.stub(), text=prompt, max_new_tokens=40, draft_length_policy=FIXED, num_draft_tokens=3)
        tokens = list(reply.prompt_token_ids) + list(reply.token_ids)
        start = len(reply.prompt_token_ids)
        right = [[tokens[t + 1]] * HEADS if t + 1 < len(tokens) else [] for t in range(len(tokens))]
        passes, accepted = simulate_chain(right, tokens, start, 3)
        stats = reply.stats
        assert (stats.target_passes, stats.accepted_tokens, stats.head_rounds) == (passes, sum(accepted), len(accepted)), prompt
        shifted = [[tokens[t]] * HEADS for t in range(len(tokens))]  # the row one too early
        checked_off_by_one += simulate_chain(shifted, tokens, start, 3) != (passes, accepted)
        assert sum(accepted) > 0 or prompt != PROMPTS[1], "the repeating prompt's answer repeats a token"
    assert checked_off_by_one >= 1, "the prompts must tell the right row from the one before it"


def test_sampled_head_rounds_are_reproducible_with_a_seed(medusa_cluster):
    """A seeded sampled request under the adaptive policy is judged by the coupled rule: its answer is
    target-only decoding's with the same seed, token for token, however its rounds were cut, chains
    and trees alike. Under the fixed policy (one-hot q, the rejection rule) it repeats itself too."""
    stub = medusa_cluster.stub()
    sampling = common_pb2.SamplingParams(temperature=0.8)
    alone = list(generate(stub, text=PROMPTS[1], max_new_tokens=30, sampling=sampling, seed=11, disable_speculation=True).token_ids)
    first = generate(stub, text=PROMPTS[1], max_new_tokens=30, sampling=sampling, seed=11)
    second = generate(stub, text=PROMPTS[1], max_new_tokens=30, sampling=sampling, seed=11)
    assert list(first.token_ids) == list(second.token_ids) == alone
    assert first.stats.head_rounds > 0  # a near-uniform tiny target: the heads' drafts rarely hold, and the planner stops
    cool = common_pb2.SamplingParams(temperature=0.05)  # near its argmax, which the untrained heads propose: drafts are kept
    cool_alone = generate(stub, text=PROMPTS[1], max_new_tokens=30, sampling=cool, seed=11, disable_speculation=True)
    cool_spec = generate(stub, text=PROMPTS[1], max_new_tokens=30, sampling=cool, seed=11)
    assert list(cool_spec.token_ids) == list(cool_alone.token_ids) and cool_spec.stats.accepted_tokens > 0
    adaptive_trees = generate(stub, text=PROMPTS[1], max_new_tokens=30, sampling=sampling, seed=11, draft_branches=2)
    assert list(adaptive_trees.token_ids) == alone
    other_seed = generate(stub, text=PROMPTS[1], max_new_tokens=30, sampling=sampling, seed=12, disable_speculation=True)
    assert list(other_seed.token_ids) != alone  # the seed decides the answer
    # trees of the heads' candidates when sampling under the fixed policy (every head round), judged as
    # fixed tokens with their own one-hot q (the rule's exactness: tests/test_tree_sampling.py)
    trees = [generate(stub, text=PROMPTS[1], max_new_tokens=30, sampling=sampling, seed=11, draft_branches=2,
                      draft_length_policy=FIXED) for _ in range(2)]
    assert list(trees[0].token_ids) == list(trees[1].token_ids)
    assert trees[0].stats.tree_rounds == trees[0].stats.head_rounds > 1  # head rounds go on after sampled trees


def test_the_verify_reports_its_heads(medusa_cluster, tiny):
    import grpc

    from specd.v1 import verify_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{medusa_cluster.verify.port}") as channel:
        info = verify_pb2_grpc.VerifyServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)
    assert info.medusa_heads == HEADS
    batch_costs = info.runtime_profile.batch_costs  # timed at start-up with the heads' proposals; the gateway's cap reads them
    assert {cost.rows for cost in batch_costs} == {2, 4, 8, 16, 32} and all(cost.milliseconds > 0 for cost in batch_costs)  # up to --max-batch-size
    product = json.loads(info.runtime_config)["heads_product"]  # the heads' product precision, measured at start-up per row count
    assert set(product) == {"1", "2", "4", "8"} and all(choice.split()[0] in ("float32", "bfloat16") for choice in product.values())


def test_the_verify_refuses_too_many_head_candidates_and_runs_the_heads_asked_for(medusa_cluster):
    import grpc

    from specd.v1 import verify_pb2, verify_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{medusa_cluster.verify.port}") as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="many", prompt_token_ids=[5, 17]), timeout=10)
        try:
            with pytest.raises(grpc.RpcError) as caught:
                stub.Verify(verify_pb2.VerifyRequest(session_id="many", return_head_drafts=True, head_candidates=5), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "head_candidates" in caught.value.details()
            reply = stub.Verify(verify_pb2.VerifyRequest(session_id="many", commit=common_pb2.Commit(prefix_length=2),
                                                         return_head_drafts=True, head_candidates=4), timeout=10)
            assert reply.head_drafts.candidates == 4 and len(reply.head_drafts.token_ids) == HEADS * 4
            with pytest.raises(grpc.RpcError) as caught:
                stub.Verify(verify_pb2.VerifyRequest(session_id="many", return_head_drafts=True, head_depth=-1), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "head_depth" in caught.value.details()
            for depth in (1, HEADS + 5):  # the first head's proposals alone; a depth past the heads: all of them
                again = stub.Verify(verify_pb2.VerifyRequest(session_id="many", commit=common_pb2.Commit(prefix_length=2),
                                                             return_head_drafts=True, head_candidates=4, head_depth=depth), timeout=10)
                shown = min(depth, HEADS)
                assert again.head_drafts.heads == shown and list(again.head_drafts.token_ids) == list(reply.head_drafts.token_ids)[: 4 * shown]
        finally:
            stub.Release(common_pb2.ReleaseRequest(session_id="many"), timeout=10)


def test_the_verify_draws_over_grpc(medusa_cluster):
    """A sampled session's Verify with coupled_draw answers one token a row, the same for the same seed
    and position, and no distributions; without it, the distributions."""
    import grpc

    from specd.v1 import verify_pb2, verify_pb2_grpc

    sampling = common_pb2.SamplingParams(temperature=1.0)
    with grpc.insecure_channel(f"127.0.0.1:{medusa_cluster.verify.port}") as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        replies = []
        for name in ("drawn-a", "drawn-b"):
            stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id=name, prompt_token_ids=[5, 17], sampling=sampling), timeout=10)
            try:
                replies.append(stub.Verify(verify_pb2.VerifyRequest(session_id=name, commit=common_pb2.Commit(prefix_length=2),
                                                                    draft_token_ids=[3, 4],
                                                                    coupled_draw=verify_pb2.CoupledDraw(seed=9)), timeout=10))
                plain = stub.Verify(verify_pb2.VerifyRequest(session_id=name, commit=common_pb2.Commit(prefix_length=2)), timeout=10)
            finally:
                stub.Release(common_pb2.ReleaseRequest(session_id=name), timeout=10)
        assert len(replies[0].sampled_token_ids) == 3 and not replies[0].target_probs
        assert replies[0].sampled_token_ids == replies[1].sampled_token_ids
        assert len(plain.target_probs) == 1 and not plain.sampled_token_ids


def test_a_start_up_cache_of_other_precisions_is_measured_over(tiny, tmp_path):
    """A verify started on a cache written before int8 was a choice must measure the heads' product
    again (a cached table without int8 once stopped the verify at start-up with a KeyError)."""
    from specd_engine import runtime_cache

    heads, _ = random_token_heads(tiny, chained=True)
    before = runtime_cache.StartupTimings("verify", {"model": "tiny"}, tmp_path)
    before.measured["heads product"] = {(1, 1, "float32"): 0.001, (1, 1, "bfloat16"): 0.002}
    assert before.finish() is not None
    timings = runtime_cache.StartupTimings("verify", {"model": "tiny"}, tmp_path)
    assert "heads product" in timings.cached
    record = heads.tune_product(rows=(1,), repeats=1, measure=timings.measure)
    assert "int8" in record[1] and heads.product_dtypes[1] in ("float32", "bfloat16", "int8")


def test_a_prompt_length_past_the_prompt_is_refused(medusa_cluster):
    import grpc

    from specd.v1 import verify_pb2, verify_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{medusa_cluster.verify.port}") as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="long", prompt_token_ids=[5, 17], prompt_length=3), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_length" in caught.value.details()
