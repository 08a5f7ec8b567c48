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
    from specd_engine.batching import BatchPolicy
    from specd_engine.models import load_causal_lm
    from specd_common.params import Warp
    from verify_service.medusa import MedusaHeads
    from verify_service.scorer import Scorer

    loaded = load_causal_lm(str(tiny.target), device="cpu", dtype="float32")
    heads = build_heads(loaded, torch.arange(loaded.model.config.vocab_size), "", MedusaRecipe(num_heads=2, next_token_input=True))
    scorer = Scorer(loaded, BatchPolicy(max_batch_size=1), threads=1, prepack="off", medusa=heads.eval())
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
    from specd_engine.batching import BatchPolicy
    from specd_common.params import Warp
    from verify_service.medusa import MedusaHeads
    from verify_service.scorer import Part, Scorer

    heads, loaded = random_token_heads(tiny, chained=True)
    scorer = Scorer(loaded, BatchPolicy(max_batch_size=1), threads=1, prepack="off", medusa=heads)
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
    from specd_engine.batching import BatchPolicy
    from specd_common.params import Warp
    from verify_service.scorer import Scorer

    heads, loaded = random_token_heads(tiny, chained=True)
    scorer = Scorer(loaded, BatchPolicy(max_batch_size=1), threads=1, prepack="off", medusa=heads)
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
    """VerifyRequest.coupled_draw: a sampled session gets each row's drawn token (no distributions unless
    asked), drawn at the position each row scores (a chain's consecutive, a tree's node by its depth),
    and, as greedy, the heads' proposals of the one row the caller will read: after the drafts that
    equal the draws. A greedy session ignores it."""
    from specd.v1 import verify_pb2
    from specd_engine.batching import BatchPolicy
    from specd_common.params import Warp
    from verify_service import scorer as scorer_module
    from verify_service.scorer import Scorer

    heads, loaded = random_token_heads(tiny, chained=True)
    scorer = Scorer(loaded, BatchPolicy(max_batch_size=1), threads=1, prepack="off", medusa=heads)
    positions = []
    real = scorer_module.uniforms_at
    monkeypatch.setattr(scorer_module, "uniforms_at", lambda seed, at: positions.append(list(at)) or real(seed, at))
    prompt, warm = [5, 17, 42], Warp(temperature=1.0)
    draw = verify_pb2.CoupledDraw(seed=3)
    first = scorer.score(scorer.open(prompt, warm), [], coupled=draw).sampled_token_ids[0]
    drafts = [first, 7, 8]
    chain = scorer.score(scorer.open(prompt, warm), drafts, head_drafts=True, coupled=draw)
    assert len(chain.sampled_token_ids) == 4 and not chain.target_probs and not chain.argmax_token_ids
    assert chain.sampled_token_ids[0] == first  # the same seed and position draw the same token
    kept = next((i for i, (x, y) in enumerate(zip(drafts, chain.sampled_token_ids)) if x != y), len(drafts))
    assert kept >= 1 and len(chain.head_drafts.token_ids) == HEADS  # one row, as greedy
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
    from specd_engine.batching import BatchPolicy
    from specd_common.params import Warp
    from verify_service.medusa import MedusaHeads
    from verify_service.scorer import Part, Scorer

    heads, loaded = random_token_heads(tiny, chained=True)
    scorer = Scorer(loaded, BatchPolicy(max_batch_size=1), threads=1, prepack="off", medusa=heads)
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
    from specd_engine.batching import BatchPolicy
    from specd_common.params import Warp
    from verify_service.scorer import Part, Scorer

    heads, loaded = random_token_heads(tiny, chained=True, fusion_layers=(1, 2))
    scorer = Scorer(loaded, BatchPolicy(max_batch_size=1), threads=1, prepack="off", medusa=heads)
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
    heads.reduced = {}  # the columns changed: reduce them again
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
    from verify_service import medusa

    heads, _ = random_token_heads(tiny, chained=True)
    ms = {(1, "float32"): 0.50, (1, "bfloat16"): 0.69, (1, "int8"): 0.48, (4, "float32"): 2.42, (4, "bfloat16"): 0.81,
          (4, "int8"): 1.0, (8, "float32"): 3.0, (8, "bfloat16"): 2.9, (8, "int8"): 5.0,
          (1, "blocks float32"): 1.6, (1, "blocks int8"): 1.2, (4, "blocks float32"): 1.9, (4, "blocks int8"): 1.8,
          (8, "blocks float32"): 2.2, (8, "blocks int8"): 1.6}
    monkeypatch.setattr(autotune, "measure_interleaved", lambda runs, repeats: {key: ms[key[1:]] / 1e3 for key in runs})
    record = heads.tune_product(rows=(1, 4, 8))
    assert heads.product_dtypes == {1: "float32", 4: "bfloat16", 8: "float32"}  # 1 row and 8 rows: within the margin
    assert heads.block_dtypes == {1: "int8", 4: "float32", 8: "int8"}
    assert record[4] == ("bfloat16 (2.42 ms float32, 0.81 ms bfloat16, 1.00 ms int8); "
                         "blocks float32 (1.90 ms float32, 1.80 ms int8)")
    assert set(heads.reduced) == {"bfloat16", "rows"} and len(heads.packed_blocks) == sum(len(head) for head in heads.heads)
    assert medusa.REDUCED_MARGIN > 3.0 / 2.9
    ms[(1, "int8")], ms[(4, "bfloat16")] = 0.42, 2.5  # the AVX2-only EPYC: int8 at one row
    ms[(1, "blocks int8")] = ms[(8, "blocks int8")] = 2.5
    heads.tune_product(rows=(1, 4, 8))
    assert heads.product_dtypes == {1: "int8", 4: "int8", 8: "float32"} and set(heads.reduced) == {"int8", "rows"}
    assert set(heads.block_dtypes.values()) == {"float32"} and heads.packed_blocks == {}
    ms[(1, "int8")] = ms[(4, "int8")] = 2.5
    heads.tune_product(rows=(1, 4, 8))
    assert set(heads.product_dtypes.values()) == {"float32"} and heads.reduced == {}


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
