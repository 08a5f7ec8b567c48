"""Small pure pieces: n-gram lookup, KV-sync commits, wire distributions, warping, text stream, session store."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from specd_common.lookup import copy_forward, prompt_lookup
from gateway.admission import Admission
from gateway.links import ServiceSync
from gateway.policy import POLICY, SpeculationPolicy
from gateway.text import TextStream
from specd_common.distributions import decode_distribution, encode_distribution, one_hot, sample_from
from specd_common.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from specd_common.params import Warp
from specd_common.sequence import TokenSequence
from specd_common.sessions import SessionStore
from specd_engine.warping import warp_probs


# --- n-gram prompt lookup ---------------------------------------------------------------------
def test_prompt_lookup_continues_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert prompt_lookup(tokens, k=2) == [7, 8]  # the latest earlier "1 2 3" is followed by 7 8


def test_prompt_lookup_falls_back_to_shorter_ngrams_and_to_nothing():
    assert prompt_lookup([4, 5, 6, 5], k=2) == [6, 5]
    assert prompt_lookup([1, 2, 3], k=3) == []
    assert prompt_lookup([7], k=3) == []


def test_a_copy_that_reaches_the_end_runs_on_into_itself():
    """A loop near the end gives k tokens, the loop continued (LZ77's overlapping copy)."""
    assert prompt_lookup([4, 5, 6, 5], k=4) == [6, 5, 6, 5]  # "5" at 1 is followed by 6 5, then by the copy
    assert prompt_lookup([9, 70, 70, 70], k=5) == [70] * 5
    assert copy_forward([1, 2, 3], 1, 5) == [2, 3, 2, 3, 2]
    assert copy_forward([1, 2, 3], 0, 2) == [1, 2]


# --- KV sync ------------------------------------------------------------------------------------
def test_commit_rolls_back_speculation_and_is_idempotent():
    cropped = []
    sequence = TokenSequence(tokens=[1, 2, 3, 10, 11, 12], max_length=100, cached=6, on_crop=cropped.append)
    sequence.apply_commit(4, [20])  # keep the prompt + 1 accepted draft, append the correction
    assert sequence.tokens == [1, 2, 3, 10, 20] and sequence.cached == 4 and cropped == [2]
    sequence.apply_commit(4, [20])  # a retried RPC
    assert sequence.tokens == [1, 2, 3, 10, 20] and sequence.cached == 4 and cropped == [2]
    assert sequence.pending() == [20]


def test_commit_keeps_one_token_pending_when_everything_was_accepted():
    sequence = TokenSequence(tokens=[1, 2, 3], max_length=100, cached=3, on_crop=lambda n: None)
    sequence.apply_commit(3, [])
    assert sequence.pending() == [3]


@pytest.mark.parametrize("prefix", [0, 7, -1])
def test_commit_outside_the_sequence_is_refused(prefix):
    with pytest.raises(InvalidArgument, match="prefix_length"):
        TokenSequence(tokens=[1, 2, 3], max_length=100).apply_commit(prefix, [])


def test_commit_past_the_model_limit_is_refused():
    with pytest.raises(InvalidArgument, match="limit"):
        TokenSequence(tokens=[1, 2, 3], max_length=4).apply_commit(3, [4, 5])


def test_service_sync_sends_what_the_service_has_not_seen():
    sync = ServiceSync(agreed=3)
    commit = sync.commit([1, 2, 3, 4, 5])
    assert commit.prefix_length == 3 and list(commit.append_token_ids) == [4, 5]


# --- distributions on the wire -------------------------------------------------------------------
def test_float16_values_equal_numpys_conversion_for_every_bit_pattern():
    """The fast float16 decoding must give numpy's values for all 65,536 patterns (normals, subnormals,
    zeros, and the sign/inf/NaN ones it leaves to numpy), and for a row that mixes them."""
    from specd_common.distributions import float16_values

    every = np.arange(2**16, dtype="<u2")
    np.testing.assert_array_equal(float16_values(every.tobytes()), every.view("<f2").astype(np.float64))  # NaN == NaN here
    finite = every[every < 0x7C00]
    np.testing.assert_array_equal(float16_values(finite.tobytes()), finite.view("<f2").astype(np.float64))
    assert float16_values(b"").shape == (0,)


def test_dense_distribution_round_trips_within_float16():
    probs = np.random.default_rng(0).dirichlet(np.ones(1000)).astype(np.float32)
    message = encode_distribution(probs)
    assert not message.token_ids and len(message.probs) == 2000
    np.testing.assert_allclose(decode_distribution(message), probs, rtol=2e-3, atol=1e-7)


def test_sparse_distribution_is_exact_and_small():
    probs = np.zeros(5000, dtype=np.float32)
    probs[[3, 77, 4000]] = [0.5, 0.25, 0.25]
    message = encode_distribution(probs)
    assert list(message.token_ids) == [3, 77, 4000]
    np.testing.assert_array_equal(decode_distribution(message), probs)


def peaked_row(vocab: int, scale: float, seed: int = 0) -> np.ndarray:
    """A softmax row [V] whose tail rounds to zero in float16, as a warped LM row's does."""
    logits = np.random.default_rng(seed).standard_normal(vocab) * scale
    row = np.exp(logits - logits.max())
    return (row / row.sum()).astype(np.float32)


@pytest.mark.parametrize("scale, form", [(4.0, "support_bitmap"), (12.0, "token_ids")])
def test_a_full_row_sends_only_its_float16_nonzeros_and_decodes_bit_for_bit(scale, form):
    """Every float32 entry is nonzero, but most round to zero in float16: the message carries the rest
    (as a bitmap, or as ids when very few), and decodes to exactly what the dense float16 row decodes to."""
    probs = peaked_row(49152, scale)
    half = probs.astype("<f2")
    message = encode_distribution(probs)
    from specd.v1 import common_pb2

    assert message.encoding == common_pb2.PROB_ENCODING_FLOAT16
    assert bool(message.support_bitmap) == (form == "support_bitmap") and bool(message.token_ids) == (form == "token_ids")
    assert message.ByteSize() < 0.5 * 2 * len(probs), message.ByteSize()
    expected = half.astype(np.float64) / half.astype(np.float64).sum()
    np.testing.assert_array_equal(decode_distribution(message), expected)


def test_a_head_vocabulary_q_is_sparse_float16_and_sampled_as_decoded():
    """encode_over: a q over a reduced vocabulary in any id order; sample_sparse draws from the decoded q."""
    from specd_common.distributions import encode_over, sample_sparse

    vocab, rng = 1000, np.random.default_rng(3)
    ids = rng.permutation(vocab)[:200]  # [200] unsorted
    values = peaked_row(200, 1.0, seed=4)
    message = encode_over(ids, values, vocab)
    q = decode_distribution(message)
    assert q.shape == (vocab,) and set(np.flatnonzero(q)) <= set(ids.tolist())
    np.testing.assert_allclose(q[ids], values / values.sum(), rtol=2e-3, atol=1e-6)
    draws = np.bincount([sample_sparse(message, rng) for _ in range(20000)], minlength=vocab) / 20000
    assert np.abs(draws - q).max() < 0.01


def test_a_distribution_with_both_sparse_forms_or_a_short_bitmap_is_invalid_argument():
    message = encode_distribution(peaked_row(4096, 5.0))
    assert message.support_bitmap
    both, short = type(message)(), type(message)()
    both.CopyFrom(message)
    both.token_ids.extend([1])
    short.CopyFrom(message)
    short.probs = short.probs[:-2]  # one value fewer than the bitmap's set bits
    for bad in (both, short):
        with pytest.raises(InvalidArgument):
            decode_distribution(bad)


def test_one_hot_takes_the_receivers_vocabulary():
    dense = decode_distribution(one_hot(4), vocab_size=10)
    assert dense.shape == (10,) and dense[4] == 1.0


def test_malformed_distribution_is_invalid_argument():
    message = encode_distribution(np.full(8, 0.125, dtype=np.float32))
    message.vocab_size = 9
    with pytest.raises(InvalidArgument):
        decode_distribution(message)


def test_sample_from_respects_zeros():
    probs = np.array([0.0, 0.3, 0.0, 0.7])
    rng = np.random.default_rng(0)
    assert {sample_from(probs, rng) for _ in range(200)} == {1, 3}


# --- warping ------------------------------------------------------------------------------------
def test_top_k_keeps_k_tokens():
    probs = warp_probs(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), Warp(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = warp_probs(logits, Warp(temperature=1.0, top_p=0.75))
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(probs[0, :2], torch.tensor([0.625, 0.375]))


@pytest.mark.parametrize("spread", [8.0, 0.05])  # peaked rows (nucleus among the best 256) and flat ones (thousands)
def test_nucleus_among_the_best_drops_what_a_full_sort_drops(spread):
    """warping.outside_nucleus looks among each row's best tokens first, widening as needed; it must drop
    exactly what a sort of the whole vocabulary drops, whatever the nucleus's size."""
    from specd_engine.warping import outside_nucleus

    torch.manual_seed(0)
    scores = torch.randn(5, 49152) * spread
    probs = scores.softmax(dim=-1)
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    for top_p in (0.1, 0.5, 0.9, 0.999):
        expected = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, ordered.cumsum(-1) - ordered >= top_p)
        assert torch.equal(outside_nucleus(scores, top_p), expected)
        assert (~expected).sum(dim=-1).min() >= 1


def test_temperature_sharpens():
    logits = torch.tensor([[0.0, 1.0]])
    assert warp_probs(logits, Warp(temperature=0.5))[0, 1] > warp_probs(logits, Warp(temperature=1.0))[0, 1]


@pytest.mark.parametrize(
    "fields", [dict(temperature=-1), dict(temperature=1e9), dict(top_k=-3), dict(top_p=1.5), dict(top_p=-0.1)]
)
def test_bad_sampling_params_are_refused(fields):
    from specd.v1 import common_pb2

    with pytest.raises(InvalidArgument):
        Warp.from_proto(common_pb2.SamplingParams(**fields))


# --- text stream --------------------------------------------------------------------------------
def _decode(ids):
    return "".join(chr(i) for i in ids)


def test_text_stream_cuts_before_a_stop_string_across_rounds():
    stream = TextStream(_decode, stop=["END"])
    first = stream.push([ord(c) for c in "hello E"])
    assert first.text == "hello" and not first.stopped  # the last len("END") - 1 characters wait
    second = stream.push([ord(c) for c in "ND more"])
    assert second.stopped and first.text + second.text == "hello " and stream.text == "hello "


def test_text_stream_holds_back_incomplete_characters():
    stream = TextStream(lambda ids: "ab\ufffd" if len(ids) == 1 else "ab€")
    assert stream.push([1]).text == "ab"
    assert stream.push([2]).text == "€"


# --- session store ------------------------------------------------------------------------------
def test_session_store_bounds_and_errors():
    store = SessionStore(max_sessions=1, idle_timeout_s=10)
    store.create("a", 1)
    with pytest.raises(AlreadyExists):
        store.create("a", 2)
    with pytest.raises(ResourceExhausted):
        store.create("b", 2)
    with pytest.raises(NotFound):
        with store.use("b"):
            pass
    assert store.release("a") and not store.release("a")


def test_idle_sessions_expire():
    now = [0.0]
    store = SessionStore(max_sessions=4, idle_timeout_s=5, clock=lambda: now[0])
    store.create("old", 1)
    now[0] = 3.0
    store.create("new", 2)
    now[0] = 6.0
    assert store.expire_idle() == ["old"] and len(store) == 1


def test_the_service_is_told_of_each_session_released_or_expired():
    now, dropped = [0.0], []
    store = SessionStore(max_sessions=4, idle_timeout_s=5, clock=lambda: now[0], on_drop=dropped.append)
    store.create("released", "state of released")
    store.create("idle", "state of idle")
    assert store.release("released") and not store.release("released") and not store.release("unknown")
    now[0] = 6.0
    assert store.expire_idle() == ["idle"]
    assert dropped == ["state of released", "state of idle"]


# --- admission ----------------------------------------------------------------------------------
def test_admission_queues_then_refuses():
    admission = Admission(max_active=1, max_waiting=1, max_wait_s=5)
    order: list[str] = []
    first_in, release_first = threading.Event(), threading.Event()

    def first():
        with admission.slot():
            order.append("first")
            first_in.set()
            release_first.wait(5)

    def second():
        with admission.slot():
            order.append("second")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    assert first_in.wait(5)
    threads[1].start()
    deadline = time.monotonic() + 5
    while admission.waiting < 1:  # the second request is queued behind the first
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(ResourceExhausted, match="busy"):  # a third finds the queue full
        with admission.slot():
            pass
    release_first.set()
    for thread in threads:
        thread.join(5)
    assert order == ["first", "second"]


def test_admission_wait_is_bounded_by_the_deadline():
    admission = Admission(max_active=1, max_waiting=4)
    with admission.slot():
        with pytest.raises(ResourceExhausted, match="within 0.1"):
            with admission.slot(deadline_s=0.1):
                pass


# --- adaptive draft length ------------------------------------------------------------------------
def test_best_draft_length_trades_acceptance_against_cost():
    from gateway.adaptive import best_rate

    def best_draft_length(acceptance, max_k, cost):
        return best_rate(acceptance, max_k, cost)[0]

    flat = lambda k: 1.0  # noqa: E731  verifying more positions is free: draft as much as allowed
    assert best_draft_length(0.8, 4, flat) == 4
    steep = lambda k: 1.0 + 0.5 * k  # noqa: E731  each draft costs half a target step
    assert best_draft_length(0.1, 4, steep) == 0  # drafts that are rarely accepted are not worth it
    measured = {0: 0.052, 1: 0.057, 2: 0.059, 3: 0.080, 4: 0.101}.get  # feasibility.md's step costs
    assert best_draft_length(0.7, 4, measured) == 2


def test_step_costs_are_measured_and_extrapolated_optimistically():
    from gateway.adaptive import StepCosts

    costs = StepCosts(SpeculationPolicy(cost_smoothing=0.5))
    assert costs.round_cost_s(3) == 1.0  # nothing measured yet
    costs.observe_verify(1, 0.05)
    costs.observe_verify(3, 0.06)
    costs.observe_draft(2, 0.004)
    assert costs.verify_s(2) == 0.05 and costs.verify_s(4) == 0.06
    assert costs.round_cost_s(4) == pytest.approx(0.06 + 0.008)
    costs.observe_verify(3, 0.08)
    assert costs.verify_s(3) == pytest.approx(0.07)
    costs.observe_verify(7, 0.09)
    assert costs.round_cost_s(2, branches=3) == pytest.approx(0.09 + 0.004)  # a tree verifies 2 × 3 + 1 positions
    assert costs.round_cost_s(2, branches=3, widened=1) == pytest.approx(0.07 + 0.004)  # alternatives beside the first: 5


def test_verifies_that_asked_for_head_proposals_are_priced_with_what_asking_added():
    from gateway.adaptive import StepCosts

    costs = StepCosts(SpeculationPolicy(cost_smoothing=0.5))
    costs.observe_verify(1, 0.100)
    assert costs.verify_s(1, heads=True) == costs.verify_s(1, heads=False) == 0.100  # nothing asked yet: no extra
    costs.observe_verify(1, 0.110, heads=True)  # 10 ms beyond a plain pass of its size
    assert costs.heads_extra_s == pytest.approx(0.005)  # moving average from 0
    assert costs.verify_s(1, heads=False) == pytest.approx(0.100 + 0.5 * (0.105 - 0.100))  # it entered the table less the extra
    costs.observe_verify(2, 0.125, heads=True)  # no plain pass of 2 measured: the table learns it, the extra does not move
    assert costs.heads_extra_s == pytest.approx(0.005)
    assert costs.verify_s(2, heads=True) == pytest.approx(0.125) and costs.verify_s(2, heads=False) == pytest.approx(0.120)
    assert costs.verify_s(2) == pytest.approx(0.120 + costs.heads_share * 0.005)  # either kind: the share that asks
    assert costs.round_cost_s(1, drafting=False, heads=True) == pytest.approx(0.125)


def test_one_slow_asking_pass_does_not_price_the_heads_out_for_good():
    """A first asking pass measured on a slow moment (the verify's serving trials run some passes on
    one thread) must not stand for good: rounds that do not ask keep measuring every size, and the
    heads are priced from them. The earlier table of asking passes apart kept 65 ms where passes took
    37 and a draft-service stack never took a head round again (bench_s40)."""
    from gateway.adaptive import StepCosts

    costs = StepCosts()
    costs.observe_verify(4, 0.065, heads=True)  # the stray first sample
    for _ in range(40):  # the draft service's rounds: 4 positions, no proposals asked
        costs.observe_verify(4, 0.037)
    assert costs.verify_s(4, heads=True) < 0.040
    assert costs.verify_s(1, heads=True) == costs.verify_s(4, heads=True)  # the only size measured prices the others


def test_a_size_priced_out_by_one_slow_pass_is_tried_again_once_stale():
    """One slow pass at a size must not price it out for good: the policy stops choosing it, so
    nothing would measure it again. Once `stale_after` Verifies passed without it, it is priced by
    the fresh sizes around it, and its next measurement replaces the old average."""
    from gateway.adaptive import StepCosts

    costs = StepCosts(SpeculationPolicy(cost_smoothing=0.1, stale_after_verifies=10))
    costs.observe_verify(2, 0.030)
    costs.observe_verify(4, 0.090)  # the spike: 4 positions really take ~0.037
    for _ in range(9):
        costs.observe_verify(2, 0.030)
    assert costs.verify_s(4) == pytest.approx(0.090)  # still fresh: the spike stands
    costs.observe_verify(2, 0.030)  # the 10th Verify without it
    assert costs.verify_s(4) == pytest.approx(0.030)  # stale: the only fresh size's price, so it is tried
    costs.observe_verify(4, 0.037)
    assert costs.verify_s(4) == pytest.approx(0.037)  # replaced, not averaged with the spike
    costs.observe_verify(4, 0.047)
    assert costs.verify_s(4) == pytest.approx(0.038)  # fresh again: a moving average
    costs.tree_extra_s = 0.004
    for _ in range(10):
        costs.observe_verify(2, 0.030)
    costs.observe_verify(4, 0.045, tree=True)  # stale again, measured by a tree: the chain's price is the tree's less its extra
    assert costs.verify_s(4) == pytest.approx(0.041) and costs.tree_extra_s == 0.004


def test_stale_sizes_are_priced_from_the_fresh_ones_around_them():
    """Interpolated between fresh sizes, extrapolated above the largest: not the cheaper neighbour's
    price, or every rarely used size would be retried each `stale_after` Verifies."""
    from gateway.adaptive import StepCosts

    costs = StepCosts(SpeculationPolicy(cost_smoothing=1.0, stale_after_verifies=5))
    for positions, seconds in ((6, 0.070), (12, 0.200), (5, 0.090)):  # 12 and a spike at 5 go stale
        costs.observe_verify(positions, seconds)
    for _ in range(5):
        costs.observe_verify(2, 0.030)
        costs.observe_verify(8, 0.050)
    assert costs.verify_s(5) == pytest.approx(0.030 + 0.020 * 3 / 6)  # between the fresh 2 and 8
    assert costs.verify_s(12) == pytest.approx(0.050 + 0.020 / 6 * 4)  # beyond the fresh 8: their slope
    assert costs.verify_s(10) == pytest.approx(0.050)  # never measured: the largest measured below it (tried once)


def test_with_the_verifys_start_up_costs_unserved_sizes_are_priced_not_guessed():
    """A size not served yet costs the nearest fresh size plus what the verify's start-up table says
    the extra positions add: a 12-node tree beside a served 2-position chain is dear, not the
    chain's price (the optimistic guess had trees of 7-18 nodes tried at 110-330 ms a round)."""
    from gateway.adaptive import StepCosts

    costs = StepCosts(SpeculationPolicy(cost_smoothing=1.0, stale_after_verifies=5))
    costs.set_prior({1: 0.040, 2: 0.050, 4: 0.065, 8: 0.107})  # the 2-core EPYC's int4 passes
    costs.observe_verify(1, 0.047)  # served: a pass plus ~7 ms of RPC and batching
    costs.observe_verify(2, 0.058)
    assert costs.verify_s(4) == pytest.approx(0.058 + 0.015)  # from the nearest served size, 2
    assert costs.verify_s(13) == pytest.approx(0.058 + 0.107 + 0.042 / 4 * 5 - 0.050)  # beyond 8: the slope of 4..8
    assert costs.verify_s(3) == pytest.approx(0.058 + 0.0075)  # the tie 2 / 4 goes to the served one
    for _ in range(5):
        costs.observe_verify(1, 0.047)  # 2 goes stale: priced from 1 and the table, not its old average
    assert costs.verify_s(2) == pytest.approx(0.047 + 0.010)


def test_a_size_is_priced_no_dearer_than_a_fresh_larger_one():
    from gateway.adaptive import StepCosts

    costs = StepCosts(SpeculationPolicy(cost_smoothing=0.5))
    costs.observe_verify(3, 0.080)  # a spike
    costs.observe_verify(5, 0.045)
    assert costs.verify_s(3) == pytest.approx(0.045) and costs.verify_s(4) == pytest.approx(0.045)
    assert costs.verify_s(6) == pytest.approx(0.045)


def test_a_tree_verify_is_priced_as_a_chain_of_its_size_plus_what_trees_took_beyond_it():
    from gateway.adaptive import StepCosts

    costs = StepCosts(SpeculationPolicy(cost_smoothing=0.5))
    costs.observe_verify(1, 0.050)
    costs.observe_verify(4, 0.060)
    costs.observe_verify(4, 0.066, tree=True)  # 6 ms beyond the chain of 4 positions
    costs.observe_verify(4, 0.064, tree=True)
    assert costs.tree_extra_s == pytest.approx(0.5 * 0.006 + 0.5 * (0.004 - 0.003))  # moving average from 0
    assert costs.verify_s(4) == 0.060  # the chain table is the chains'
    assert costs.round_cost_s(3, drafting=False) == 0.060  # a chain
    assert costs.round_cost_s(3, drafting=False, tree=True) == pytest.approx(0.060 + costs.tree_extra_s)
    assert costs.round_cost_s(1, branches=3, drafting=False) == pytest.approx(0.060 + costs.tree_extra_s)  # 1 + 2 alternatives
    costs.observe_verify(6, 0.080, tree=True)  # no chain of 6 measured: the tree's time is the best guess of 6 positions
    assert costs.verify_s(6) == 0.080 and costs.tree_extra_s == pytest.approx(0.0035)


# A verify's start-up batch costs on the 2-core AMD EPYC VM (`specd serve verify`; rows → positions per
# row → ms of one batched round, the heads' proposals included; Scorer.measure_batch_costs)
EPYC_BATCH_COSTS = {2: {1: 76.0, 4: 99.3, 8: 122.2}, 4: {1: 86.5, 4: 142.9, 8: 172.4}, 8: {1: 124.6, 4: 228.0, 8: 291.3}}
HEADS_ROUNDS = {4: 1.0}  # every round verifies 3 drafts


def test_a_batch_costs_as_much_as_its_longest_row():
    from gateway.adaptive import expected_batch_cost

    costs = {1: 10.0, 4: 40.0, 8: 80.0}
    assert expected_batch_cost(costs, {4: 1.0}, 8) == pytest.approx(40.0)
    assert expected_batch_cost(costs, {1: 0.5, 4: 0.5}, 1) == pytest.approx(25.0)
    assert expected_batch_cost(costs, {1: 0.5, 4: 0.5}, 2) == pytest.approx(0.25 * 10 + 0.75 * 40)  # P(both plain) = 1/4
    # one row in 50 copying 8 tokens (9 positions, priced flat beyond 8) makes 15% of 8-row batches cost 80
    long_copies = expected_batch_cost(costs, {4: 0.98, 9: 0.02}, 8)
    assert long_copies == pytest.approx(0.98 ** 8 * 40 + (1 - 0.98 ** 8) * 80)


def test_a_ragged_batch_costs_its_rows_own_positions():
    """One ragged pass (no padding): rows of 1 and 4 positions half the time each cost what rows of 2.5
    do, however many rows there are; a rare long copy adds its own share only."""
    from gateway.adaptive import expected_batch_cost, speculation_cap

    costs = {1: 10.0, 4: 40.0, 8: 80.0}
    assert expected_batch_cost(costs, {1: 0.5, 4: 0.5}, 8, ragged=True) == pytest.approx(25.0)
    assert expected_batch_cost(costs, {4: 0.98, 9: 0.02}, 8, ragged=True) == pytest.approx(41.0)  # 4.1 positions on average
    # rounds of 1 or 4 positions, half and half, yielding 1.6 tokens a pass: padded, 15 in 16 batches
    # of 4 rows cost 4 positions' time (139.4 ms × 1.1 > 86.5 ms × 1.6), so the cap stops at 2 rows;
    # ragged, 2.5 positions' time pays at every size (8 rows: 176.3 ms × 1.1 < 124.6 ms × 1.6): no cap
    half = {(2, True): measured_rounds(1.6, {1: 0.5, 4: 0.5})}
    assert speculation_cap(EPYC_BATCH_COSTS, half) == 2
    assert speculation_cap(EPYC_BATCH_COSTS, half, ragged=True) == 0


def measured_rounds(tokens_per_pass: float, positions_share: dict[int, float] = HEADS_ROUNDS, round_s: float = 0.1):
    """A kind of round as RoundShapes reports it once measured (the speculation cap's input)."""
    from gateway.adaptive import RoundShape

    return RoundShape(POLICY.min_shape_rounds, tokens_per_pass, round_s, positions_share)


@pytest.mark.parametrize(
    "shares, tokens_per_pass, cap",
    [
        (HEADS_ROUNDS, 1.75, 4),  # 4 rows drafting cost 1.65x a plain round; 8 rows 1.83x
        (HEADS_ROUNDS, 1.85, 0),  # drafting pays at every measured batch size: no cap
        (HEADS_ROUNDS, 1.6, 2),  # 2 rows: 1.31x < 1.6; 4 rows: 1.65x ≥ 1.6
        (HEADS_ROUNDS, 1.3, 1),  # pays nowhere: a request running alone still decides for itself
        ({4: 0.98, 9: 0.02}, 1.87, 4),  # a long copy now and then: 8 rows cost 1.91x (15% of batches hold one)
        ({4: 1.0}, 1.87, 0),  # without them the same yield pays at 8 rows (1.83x)
    ],
)
def test_speculation_cap_is_the_largest_batch_where_speculating_rows_pay(shares, tokens_per_pass, cap):
    """Only speculating rounds among 2 requests measured: their yield stands in for every larger batch (the model decides)."""
    from gateway.adaptive import speculation_cap

    two = {(2, True): measured_rounds(tokens_per_pass, shares)}
    assert speculation_cap(EPYC_BATCH_COSTS, two, policy=SpeculationPolicy(speculation_margin=1.0)) == cap
    # the default margin asks that much more of the yield
    assert speculation_cap(EPYC_BATCH_COSTS, {(2, True): measured_rounds(tokens_per_pass * POLICY.speculation_margin, shares)}) == cap


def test_the_default_margin_keeps_speculation_to_clear_gains():
    from gateway.adaptive import speculation_cap

    assert POLICY.speculation_margin > 1
    two = {(2, True): measured_rounds(1.75)}
    assert speculation_cap(EPYC_BATCH_COSTS, two, policy=SpeculationPolicy(speculation_margin=1.0)) == 4  # 4 rows promise 1.75 / 1.65 = +6%
    assert speculation_cap(EPYC_BATCH_COSTS, two) == 2  # not a clear gain


def test_a_cap_in_force_is_kept_at_half_the_margin():
    """Hysteresis: a yield between the two thresholds keeps the cap where it is, up or down (on the
    2-core EPYC an estimate near the threshold flipped the cap between 1 and 2 with every round)."""
    from gateway.adaptive import speculation_cap

    between = {(2, True): measured_rounds(1.31 * 1.07)}  # 2 rows cost 1.31x: 7% above, 10% not reached
    assert speculation_cap(EPYC_BATCH_COSTS, between) == 1
    assert speculation_cap(EPYC_BATCH_COSTS, between, current=1) == 1
    assert speculation_cap(EPYC_BATCH_COSTS, between, current=2) == 2
    assert speculation_cap(EPYC_BATCH_COSTS, between, current=0) == 2  # no cap: held at 2, 4 rows (1.65x) lose
    below = {(2, True): measured_rounds(1.31 * 1.04)}
    assert speculation_cap(EPYC_BATCH_COSTS, below, current=2) == 1


def test_a_position_beside_others_is_priced_by_what_it_delays_everyone():
    """Beside others a draft is priced by the seconds it adds to the whole round: from the verify's
    start-up batch costs until rounds at that size are measured both ways, then by what speculating
    rounds took over plain ones per position drafted."""
    from gateway.adaptive import position_price_s

    xeon = {1: 14.9, 4: 27.9, 8: 50.7}  # 8 rows, 2-vCPU Xeon, ms
    assert position_price_s(xeon, {}, 8) == pytest.approx((27.9 - 14.9) / 3 / 1e3)
    assert position_price_s({1: 14.9}, {}, 8) == 0.0  # nothing to price a position by
    measured = {(8, False): measured_rounds(1.0, {1: 1.0}, round_s=0.020),
                (8, True): measured_rounds(2.2, {1: 0.2, 4: 0.5, 5: 0.3}, round_s=0.041)}  # 2.7 drafts a round
    assert position_price_s(xeon, measured, 8) == pytest.approx(0.021 / 2.7)
    assert position_price_s(xeon, {(8, True): measured[8, True]}, 8) == pytest.approx(13e-3 / 3)  # one kind only: start-up
    hardly = {**measured, (8, True): measured_rounds(1.05, {1: 0.95, 2: 0.05}, round_s=0.021)}
    assert position_price_s(xeon, hardly, 8) == pytest.approx(13e-3 / 3)  # 0.05 drafts a round price nothing


def test_a_request_beside_others_drafts_fewer_positions_than_alone():
    """The same acceptance drafts 3 positions alone (its own Verify barely lengthens) and fewer among 8,
    where each position delays all 8 requests."""
    from gateway.adaptive import StepCosts, best_rate
    from gateway.proposers import RoundContext

    costs = StepCosts()
    for positions, ms in {1: 20.0, 2: 20.5, 3: 21.0, 4: 21.5}.items():
        costs.observe_verify(positions, ms / 1e3)
    chain = [0.55, 0.6, 0.6]  # conditional acceptance by position
    alone = RoundContext([1], 64, True, True, costs)
    among_8 = RoundContext([1], 64, True, False, costs, position_s=8e-3)
    assert best_rate(chain, 3, alone.free_cost)[0] == 3
    assert best_rate(chain, 3, among_8.free_cost)[0] == 1
    assert among_8.free_cost(2) == pytest.approx(alone.free_cost(2) + 16e-3)


def test_speculation_cap_stops_at_the_first_batch_size_that_loses():
    from gateway.adaptive import speculation_cap

    odd = {2: {1: 70.0, 4: 140.0}, 4: {1: 100.0, 4: 110.0}}  # 4 rows would pay, 2 do not: rows share passes in order
    assert speculation_cap(odd, {(2, True): measured_rounds(1.8)}, policy=SpeculationPolicy(speculation_margin=1.0)) == 1


def test_speculation_cap_is_tried_at_the_load_served_until_speculating_rounds_are_measured():
    from gateway.adaptive import RoundShape, speculation_cap

    assert speculation_cap(EPYC_BATCH_COSTS, {}) == 2  # cold: the smallest size
    # served only plain, mostly among 8 (a steady load): speculation is tried there, not at 2, which
    # a gateway kept at 8 streams would hardly ever measure
    steady = {(8, False): RoundShape(3000, 1.0, 0.05, {1: 1.0}), (4, False): RoundShape(60, 1.0, 0.04, {1: 1.0})}
    assert speculation_cap(EPYC_BATCH_COSTS, steady) == 8
    assert speculation_cap(EPYC_BATCH_COSTS, {(4, False): measured_rounds(1.0)}) == 4
    # a yield measured among 4 in a burst's tail (1.3 tokens a pass: 2 rows do not pay by the model) does
    # not end the trial at 8 before 8's own speculating rounds are measured
    assert speculation_cap(EPYC_BATCH_COSTS, steady | {(4, True): measured_rounds(1.3)}) == 8
    # those of requests running alone are no sample of a shared pass: 2 is tried
    assert speculation_cap(EPYC_BATCH_COSTS, {(1, True): measured_rounds(1.2)}) == 2
    assert speculation_cap(EPYC_BATCH_COSTS, {(1, True): measured_rounds(3.0)}) == 2


def test_no_trial_runs_where_even_a_lone_requests_yield_would_not_pay():
    """The EPYC's flat verify (2026-12-07 start-up: 8 rows of 4 positions cost 3x 8 rows of one) with
    requests alone yielding 2.31 tokens a pass: beside 7 others that cannot pay, so 8 is not tried and the
    model decides (2 rows pay by it, 4 do not); the padded costs of before (1.83x) let the trial run."""
    from gateway.adaptive import RoundShape, speculation_cap

    flat = {2: {1: 6.58, 4: 12.34, 8: 19.89}, 4: {1: 8.33, 4: 19.27, 8: 35.08}, 8: {1: 11.24, 4: 33.61, 8: 60.92}}
    steady = {(8, False): RoundShape(3000, 1.0, 0.05, {1: 1.0}), (1, True): measured_rounds(2.31, {3: 0.5, 4: 0.5})}
    assert speculation_cap(flat, steady, ragged=True) == 2
    assert speculation_cap(EPYC_BATCH_COSTS, steady) == 8
    assert speculation_cap(flat, steady | {(1, True): measured_rounds(3.5, {3: 0.5, 4: 0.5})}, ragged=True) == 8


def test_a_trial_at_the_served_size_ends_by_the_measured_rates():
    """Once the trial's speculating rounds among 8 are measured, their rate decides at 8, and their yield
    prices the sizes not measured both ways (smaller ones too: 2 and 4 rows cost less than 8)."""
    from gateway.adaptive import RoundShape, speculation_cap

    plain = RoundShape(3000, 1.0, 0.05, {1: 1.0})  # 20 tokens/s a request
    paying = {(8, False): plain, (8, True): measured_rounds(1.9, round_s=0.08)}  # 23.8 tokens/s
    assert speculation_cap(EPYC_BATCH_COSTS, paying, current=8) == 0  # 2, 4 by the model from 8's yield; 8 measured
    losing = {(8, False): plain, (8, True): measured_rounds(1.9, round_s=0.11)}  # 17.3 tokens/s
    assert speculation_cap(EPYC_BATCH_COSTS, losing, current=8) == 4  # 8 loses; 2 and 4 rows pay by the model
    assert speculation_cap(EPYC_BATCH_COSTS, {(8, False): plain, (8, True): measured_rounds(1.2, round_s=0.07)}) == 1
    # a burst's tail measured among 4 (1.3 tokens a pass: the model says no) does not overrule 8's measured win
    assert speculation_cap(EPYC_BATCH_COSTS, paying | {(4, True): measured_rounds(1.3)}, current=8) == 0
    # measured both ways, a loss at 4 stands
    lost_at_4 = {(4, True): measured_rounds(1.3, round_s=0.08), (4, False): measured_rounds(1.0, round_s=0.05)}
    assert speculation_cap(EPYC_BATCH_COSTS, paying | lost_at_4, current=8) == 2


def test_a_yield_measured_at_a_batch_size_replaces_the_one_from_fewer_requests():
    """The 2-core EPYC's 4-stream runs: rounds among ≤ 2 requests yielded 2.4 tokens a pass (the prompts
    that end a run), among 4 requests 1.85; the smaller sizes' yield only stands in until B's is measured."""
    from gateway.adaptive import speculation_cap

    few = {(2, True): measured_rounds(2.4)}
    assert speculation_cap(EPYC_BATCH_COSTS, few) == 0  # 8 rows cost 1.83x × 1.1 < 2.4: tried everywhere
    assert speculation_cap(EPYC_BATCH_COSTS, few | {(4, True): measured_rounds(1.7)}) == 2  # 1.65x × 1.1 > 1.7 at 4
    # what 4 yields stands in for 8 in turn
    assert speculation_cap(EPYC_BATCH_COSTS, few | {(4, True): measured_rounds(1.9)}) == 4


def test_measured_rates_at_a_batch_size_overrule_the_model():
    """Where rounds were measured both ways at one size, tokens per second decide, whatever the
    start-up costs promise: the model's +9% at 4 rows was a 7–11% loss end to end on the 2-core EPYC."""
    from gateway.adaptive import speculation_cap

    few = {(2, True): measured_rounds(2.4)}
    losing = few | {(4, True): measured_rounds(1.85, round_s=0.110), (4, False): measured_rounds(1.0, round_s=0.055)}
    assert speculation_cap(EPYC_BATCH_COSTS, losing) == 2  # 16.8 < 18.2 tokens/s a request
    paying = few | {(4, True): measured_rounds(1.85, round_s=0.090), (4, False): measured_rounds(1.0, round_s=0.055)}
    assert speculation_cap(EPYC_BATCH_COSTS, paying) == 4  # 20.6 > 18.2; 8 rows by the model from 4's yield: 1.83x × 1.1 > 1.85
    # the other way round: the model says no at 2 rows (1.31x × 1.1 > 1.3), the measured rates say yes
    cheap = {(2, True): measured_rounds(1.3, round_s=0.070), (2, False): measured_rounds(1.0, round_s=0.060)}
    assert speculation_cap(EPYC_BATCH_COSTS, cheap) == 2  # and 4 rows, by the model from 2's yield, do not pay


def test_measured_rates_must_differ_by_a_margin_to_start_speculating_and_not_lose_to_go_on():
    from gateway.adaptive import speculation_cap

    assert POLICY.measured_margin > 1
    few = {(2, True): measured_rounds(2.4)}
    plain = measured_rounds(1.0, round_s=0.055)  # 18.2 tokens/s a request
    slightly = few | {(4, True): measured_rounds(1.85, round_s=0.099), (4, False): plain}  # 18.7: +3%
    assert speculation_cap(EPYC_BATCH_COSTS, slightly, current=2) == 2  # not enough to start
    assert speculation_cap(EPYC_BATCH_COSTS, slightly, current=4) == 4  # enough to go on
    losing = few | {(4, True): measured_rounds(1.85, round_s=0.103), (4, False): plain}  # 18.0: −1%
    assert speculation_cap(EPYC_BATCH_COSTS, losing, current=4) == 2


def test_round_shapes_average_each_kind_of_round_apart():
    from gateway.adaptive import RoundShapes

    rounds = RoundShapes()
    assert rounds.measured() == {}
    for _ in range(POLICY.min_shape_rounds // 2):
        rounds.observe(3, 4, 0.2, rows=4, speculating=True)
        assert rounds.measured() == {}  # a few rounds say little
        rounds.observe(1, 1, 0.1, rows=4, speculating=True)
        rounds.observe(1, 1, 0.05, rows=4, speculating=False)
    assert set(rounds.measured()) == {(4, True)} and rounds.count == 3 * (POLICY.min_shape_rounds // 2)
    for _ in range(POLICY.min_shape_rounds // 2):
        rounds.observe(1, 1, 0.05, rows=4, speculating=False)
    shapes = rounds.measured()
    assert shapes[(4, True)].tokens_per_pass == pytest.approx(2.0)  # the first rounds count equally
    assert shapes[(4, True)].round_s == pytest.approx(0.15) and shapes[(4, True)].tokens_per_s == pytest.approx(2.0 / 0.15)
    assert shapes[(4, True)].positions_share == pytest.approx({4: 0.5, 1: 0.5})
    assert shapes[(4, False)].tokens_per_s == pytest.approx(20.0)
    for _ in range(int(1 / POLICY.yield_smoothing) * 10):
        rounds.observe(1, 1, 0.1, rows=4, speculating=True)
    later = rounds.measured()[(4, True)]
    assert later.tokens_per_pass == pytest.approx(1.0, abs=1e-3) and later.positions_share[1] == pytest.approx(1.0, abs=1e-3)


def test_a_kind_of_round_unseen_for_long_is_forgotten_so_its_verdict_is_retried():
    """A size whose speculating rounds lost runs no more of them; after POLICY.stale_rounds other rounds their
    measurement is dropped, the model decides again, and speculation there gets measured anew."""
    from gateway.adaptive import RoundShapes

    rounds = RoundShapes()
    for _ in range(POLICY.min_shape_rounds):
        rounds.observe(2, 4, 0.2, rows=4, speculating=True)
    for _ in range(POLICY.stale_rounds):
        rounds.observe(1, 1, 0.05, rows=4, speculating=False)
    assert set(rounds.measured()) == {(4, True), (4, False)}  # the last speculating round was POLICY.stale_rounds ago
    rounds.observe(1, 1, 0.05, rows=4, speculating=False)
    assert set(rounds.measured()) == {(4, False)}


def test_a_round_counts_at_the_smallest_measured_batch_size_that_holds_its_requests():
    from gateway.adaptive import RoundShapes

    sizes = [2, 4, 8]
    assert [RoundShapes.bucket(rows, sizes) for rows in range(1, 11)] == [1, 2, 4, 4, 8, 8, 8, 8, 8, 8]
    assert RoundShapes.bucket(3, []) == 1  # a verify that does not batch


def test_the_gateway_caps_speculation_by_its_verify_replicas_measured_batch_costs():
    """Backends.speculation_cap: per verify replica from the costs its typed runtime_profile reports and
    the rounds measured here, times the serving replicas; the smallest batch before rounds are measured;
    no cap without costs (runtime_config's JSON, for logs, is not read); a change stands for
    POLICY.cap_hold_rounds rounds. Backends.observe_round counts a round at its requests' batch size per replica."""
    import json
    from types import SimpleNamespace

    from gateway.backends import Backends
    from specd.v1 import common_pb2

    def backends(info: common_pb2.GetModelInfoResponse, replicas: int) -> Backends:
        pool = SimpleNamespace(replicas=lambda: [SimpleNamespace(eligible=True)] * replicas + [SimpleNamespace(eligible=False)])
        return Backends(verify=pool, draft=None, target_info=info, tokenizer=None)

    measured = common_pb2.GetModelInfoResponse(runtime_profile=common_pb2.RuntimeProfile(batch_costs=[
        common_pb2.BatchCost(rows=b, positions=n, milliseconds=ms) for b, by_n in EPYC_BATCH_COSTS.items() for n, ms in by_n.items()]))
    one = backends(measured, replicas=1)
    assert one._verify_batch_costs == EPYC_BATCH_COSTS
    assert one.speculation_cap() == 2  # no rounds measured yet: the smallest measured batch
    for _ in range(POLICY.min_shape_rounds):
        one.observe_round(round(1.75 * POLICY.speculation_margin), 4, 0.1, running=2, speculating=True)
    assert set(one.rounds.measured()) == {(2, True)}
    assert one.speculation_cap() == 4  # a yield of 2 tokens: 8 rows (1.83x × 1.1) do not pay
    for _ in range(POLICY.min_shape_rounds):  # among 3 requests (the 4-row size) rounds pay less than plain ones
        one.observe_round(2, 4, 0.2, running=3, speculating=True)
        one.observe_round(1, 1, 0.05, running=3, speculating=False)
    assert one.speculation_cap() == 4  # a changed cap stands for POLICY.cap_hold_rounds rounds
    for _ in range(POLICY.cap_hold_rounds - 2 * POLICY.min_shape_rounds - 1):
        one.observe_round(1, 1, 0.05, running=3, speculating=False)
    assert one.speculation_cap() == 4
    one.observe_round(1, 1, 0.05, running=3, speculating=False)
    assert one.speculation_cap() == 2
    two = backends(measured, replicas=2)
    for _ in range(POLICY.min_shape_rounds):
        two.observe_round(2, 4, 0.1, running=3, speculating=True)  # 2 rows a replica
    assert set(two.rounds.measured()) == {(2, True)}
    assert two.speculation_cap() == 8  # 4 rows per replica, two replicas
    # a verify whose profile holds no batch costs (it does not batch) gets no cap, whatever its log JSON says
    logged = {"threads": 1, "batch_costs_ms": {str(b): {str(n): ms for n, ms in by_n.items()} for b, by_n in EPYC_BATCH_COSTS.items()}}
    unmeasured = backends(common_pb2.GetModelInfoResponse(runtime_config=json.dumps(logged)), replicas=1)
    for _ in range(POLICY.min_shape_rounds):
        unmeasured.observe_round(2, 4, 0.1, running=3, speculating=True)
    assert unmeasured.speculation_cap() == 0


def test_acceptance_estimate_ignores_drafts_after_the_first_rejection():
    from gateway.adaptive import AcceptanceEstimate

    estimate = AcceptanceEstimate(prior=0.9, policy=SpeculationPolicy(prior_weight=1e-9, decay=1.0))
    for _ in range(10):
        estimate.update(drafted=4, accepted=1)  # accept, reject, (two unexamined)
    assert estimate.chain(2) == pytest.approx([POLICY.max_acceptance, 0.0], abs=1e-6)  # not 1/4 a draft


def test_acceptance_per_position_makes_falling_acceptance_draft_shorter():
    from gateway.adaptive import AcceptanceEstimate, best_rate, expected_tokens

    assert expected_tokens([0.5], 2) == pytest.approx(1.75)  # (1 − α^3) / (1 − α)
    assert expected_tokens([0.6, 0.3, 0.2], 3) == pytest.approx(1 + 0.6 + 0.18 + 0.036)
    # alternatives beside each draft keep a token where the draft missed: P(≥ j kept) = reach_{j−1} (a_j + (1 − a_j) s_j)
    assert expected_tokens([0.5], 3, [0.3]) == pytest.approx(1 + 0.65 * (1 + 0.5 + 0.25))
    assert expected_tokens([0.6, 0.3], 2, [0.4, 0.0]) == pytest.approx(1 + (0.6 + 0.4 * 0.4) + 0.6 * 0.3)
    estimate = AcceptanceEstimate(prior=0.5, policy=SpeculationPolicy(prior_weight=1e-9, decay=1.0))
    for _ in range(20):  # first draft accepted in 60% of rounds, the second in a third of those
        for accepted in (2, 1, 1, 0, 0):
            estimate.update(drafted=3, accepted=accepted)
    chain = estimate.chain(3)
    assert chain == pytest.approx([0.6, 1 / 3, 0.0], abs=1e-6)
    cost = lambda k: 1.0 + 0.15 * k  # noqa: E731
    pooled = 4 / 9  # one α over every position: 4 accepted of 9 examined
    assert best_rate(pooled, 3, cost)[0] > best_rate(chain, 3, cost)[0] == 1


def test_acceptance_estimate_returns_to_the_prior_when_not_drafting():
    from gateway.adaptive import AcceptanceEstimate

    estimate = AcceptanceEstimate(prior=0.5)
    for _ in range(5):
        estimate.update(drafted=3, accepted=0)
    low = estimate.chain(1)[0]
    for _ in range(30):
        estimate.update(drafted=0, accepted=0)
    assert low < 0.2 and estimate.chain(1)[0] == pytest.approx(0.5, abs=0.05)


def test_a_new_request_starts_from_what_requests_of_its_kind_kept():
    """The server-wide estimates (SharedEstimates): requests whose drafts kept ~20% at position 1 teach
    the shared estimate, and the next request's estimate starts there instead of at the constant
    prior (0.5), before it has drafted at all; a position the server never saw borrows from the one
    before it. A request that stops drafting drifts back to the shared estimate, not to 0.5. Heads'
    calibration alike, per depth."""
    from gateway.adaptive import AcceptanceEstimate, SharedEstimates

    shared = SharedEstimates.fresh()
    for request in range(10):
        estimate = AcceptanceEstimate(shared=shared.heads)
        for round_ in range(10):
            estimate.update(drafted=1, accepted=int(round_ % 5 == 0))  # 2 kept in 10
    newcomer = AcceptanceEstimate(shared=shared.heads)
    first, second = newcomer.chain(2)
    assert first == pytest.approx(0.2, abs=0.06) and second == pytest.approx(first)
    for _ in range(40):
        newcomer.update(drafted=0, accepted=0)
    assert newcomer.chain(1)[0] == pytest.approx(first, abs=0.02)
    for _ in range(30):
        shared.head_calibration.observe([0.8, 0.6], [0.4, 0.1])
    from gateway.adaptive import HeadCalibration

    calibration = HeadCalibration(shared=shared.head_calibration)
    assert calibration.scales(2) == pytest.approx([0.5, 1 / 6], abs=0.06)  # the shared calibration's own prior weighs in


# --- bench report --------------------------------------------------------------------------------
def test_bench_report_computes_speedup_and_alpha():
    from specd.v1 import generate_pb2
    from specd_app.bench import Sample, markdown_table, report

    stats = generate_pb2.SpeculationStats(
        target_passes=10, draft_tokens=30, accepted_tokens=15, rejected_rounds=8,
        draft_tokens_per_position=[10, 10, 10], accepted_tokens_per_position=[8, 5, 2],
        wire_bytes=2000, round_seconds=1.0, model_seconds=0.9,
    )
    results = {
        "target_only": ([Sample("math", tokens=25, seconds=2.5)], 2.5),
        "specd": ([Sample("math", tokens=25, seconds=1.0, stats=stats)], 1.0),
    }
    out = report(results, k=3)
    specd = out["modes"]["specd"]["overall"]
    assert specd["speedup"] == 2.5 and out["modes"]["specd"]["by_category"]["math"]["speedup"] == 2.5
    assert specd["alpha"] == round(15 / 23, 4) and specd["tokens_per_target_pass"] == 2.5
    assert specd["acceptance_per_position"] == [0.8, 0.5, 0.2]
    assert specd["wire_bytes_per_round"] == 200 and specd["outside_models_share"] == 0.1
    assert "| specd | 25.0 | 2.5 |" in markdown_table(out)


def test_bench_gives_the_noise_of_realized_against_predicted_tokens_a_pass():
    """Rounds that kept 1, 3, 1, 3 tokens where 2 each were expected: realized 2.0, predicted 2.0,
    and (kept − expected) a round of spread 1.155 (sample deviation) over √4 rounds: ± 0.577. Two
    answers' rounds pool."""
    from specd.v1 import generate_pb2
    from specd_app.bench import prediction_standard_error, realized_cell

    def answer(kept: list[int], expected: float):
        return generate_pb2.SpeculationStats(target_passes=len(kept), accepted_tokens=sum(kept) - len(kept),
                                             predicted_tokens=expected * len(kept),
                                             predicted_tokens_squared_error=sum((k - expected) ** 2 for k in kept))

    assert prediction_standard_error([answer([1, 3], 2.0), answer([1, 3], 2.0)]) == pytest.approx(0.5774, abs=1e-4)
    assert prediction_standard_error([answer([2, 2, 2], 2.0)]) == 0.0  # every round as expected
    assert prediction_standard_error([answer([1], 2.0)]) == 0.0  # one round says nothing of its noise
    cell = realized_cell({"realized_tokens_per_pass": 2.0, "predicted_tokens_per_pass": 2.0, "prediction_standard_error": 0.5774})
    assert cell == "2.0 ± 0.5774 (2.0)"


def test_bench_report_compares_every_mode_with_llama_cpp_and_lookup_with_its_own_engine():
    """llama.cpp's modes: llamacpp_lookup's speedup is over llamacpp_target, every mode reads vs both baselines."""
    from specd_app.bench import Sample, markdown_table, report

    results = {"target_only": ([Sample("qa", tokens=20, seconds=1.0)], 1.0), "specd": ([Sample("qa", tokens=40, seconds=1.0)], 1.0),
               "hf_target": ([Sample("qa", tokens=10, seconds=1.0)], 1.0),
               "llamacpp_target": ([Sample("qa", tokens=80, seconds=1.0)], 1.0),
               "llamacpp_lookup": ([Sample("qa", tokens=100, seconds=1.0)], 1.0)}
    modes = report(results, k=3)["modes"]
    assert modes["llamacpp_lookup"]["overall"]["speedup"] == 1.25 and modes["specd"]["overall"]["speedup"] == 2.0
    assert modes["specd"]["overall"]["vs_llamacpp_target"] == 0.5 and modes["specd"]["overall"]["vs_hf_target"] == 4.0
    assert "| specd | 40.0 | 2.0 | 4.0 | 0.5 |" in markdown_table({"modes": modes})


def test_the_llama_cpp_runner_counts_tokens_to_eos_or_the_limit_and_asks_for_the_same_choice():
    """LlamaCppRunner over a stand-in for llama_cpp.Llama: tokens up to and including an EOS or the
    limit, each prompt prefilled anew, greedy as top-k 1 and sampling without llama.cpp's extra samplers."""
    from specd_app.bench import LlamaCppRunner, Sampling
    from specd_common.params import Warp

    class Model:
        def __init__(self, stream):
            self.stream, self.calls = stream, []

        def generate(self, ids, reset, **sampler):
            self.calls.append((list(ids), reset, sampler))
            yield from self.stream

    class Tokenizer:
        def encode_prompt(self, text, raw):
            return [len(text)]

    runner = LlamaCppRunner.__new__(LlamaCppRunner)
    runner.sampling, runner.tokenizer, runner.eos_ids = Sampling(), Tokenizer(), {2}
    runner._models = {0: Model([5, 6, 2, 7, 8]), 3: Model(iter(range(10, 100)))}
    assert runner.run({"prompt": "abc", "category": "qa"}, 64, None).tokens == 3  # the EOS counts, nothing after it
    sample = runner.run({"prompt": "abcd"}, 16, 3)
    assert sample.tokens == 16 and len(sample.itl_s) == 15 and sample.ttft_s > 0
    ids, reset, greedy = runner._models[0].calls[0]
    assert ids == [3] and reset and greedy["top_k"] == 1 and greedy["repeat_penalty"] == 1.0 and greedy["min_p"] == 0.0
    runner.sampling = Sampling(Warp(temperature=0.7, top_p=0.9))
    assert runner.sampler() == {"min_p": 0.0, "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                "top_k": 0, "temp": 0.7, "top_p": 0.9}


def test_bench_report_shows_the_speedup_of_each_repeat():
    """With several repeats (concurrency > 1), each mode's speedup within each repeat, and its range in the table."""
    from specd_app.bench import Sample, add_repeat_spread, markdown_table, report

    results = {"target_only": ([Sample("chat", tokens=100, seconds=2.0)], 2.0), "specd": ([Sample("chat", tokens=100, seconds=1.8)], 1.8)}
    out = report(results, k=3)
    add_repeat_spread(out, {"target_only": [40.0, 60.0], "specd": [44.0, 57.0]})
    specd = out["modes"]["specd"]["overall"]
    assert specd["speedup_by_repeat"] == [1.1, 0.95] and specd["tokens_per_s_by_repeat"] == [44.0, 57.0]
    assert out["modes"]["target_only"]["overall"]["speedup_by_repeat"] == [1.0, 1.0]
    assert "| specd | 55.56 | 1.111 (0.95–1.1) |" in markdown_table(out)
    single = report(results, k=3)
    add_repeat_spread(single, {"target_only": [50.0], "specd": [55.0]})  # one repeat: no spread to show
    assert "speedup_by_repeat" not in single["modes"]["specd"]["overall"]


def test_bench_reports_the_cores_each_process_kept_busy():
    """CPU seconds by process around a mode's runs become cores (CPU over wall seconds), busiest first,
    shown as the verify's and the whole stack's; a real process's count grows while it works."""
    import subprocess
    import sys
    import time

    from specd_app.bench import Sample, add_cores, add_cpu, cpu_seconds, cpu_snapshot, markdown_table, report

    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        before = cpu_snapshot({"verify": child})
        time.sleep(1.0)
        after = cpu_snapshot({"verify": child})
    finally:
        child.kill()
        child.wait(timeout=30)
    assert after["verify"] - before["verify"] > 0.1  # it spun for the second (on a core shared with others)
    assert after["client"] >= before["client"]
    assert cpu_seconds(child.pid) is None  # gone
    results = {"target_only": ([Sample("chat", tokens=100, seconds=2.0)], 2.0), "specd": ([Sample("chat", tokens=100, seconds=1.0)], 1.0)}
    out = report(results, k=3)
    cpu: dict = {}
    add_cpu(cpu, {"verify": 1.0, "gateway": 0.5, "client": 2.0}, {"verify": 4.0, "gateway": 0.9, "client": 2.2, "draft": 9.0})
    assert cpu == pytest.approx({"verify": 3.0, "gateway": 0.4, "client": 0.2})  # one missing from a snapshot is left out
    add_cores(out, {"target_only": cpu}, results)
    overall = out["modes"]["target_only"]["overall"]
    assert list(overall["cores_by_process"]) == ["verify", "gateway", "client"] and overall["cores"] == 1.8
    assert overall["cores_by_process"]["verify"] == 1.5
    table = markdown_table(out)
    assert "| 1.5 / 1.8 |" in table and table.splitlines()[-1].endswith("| - |")  # specd: not measured


def test_switchable_linear_computes_what_linear_computes_in_every_layout():
    import torch

    from specd_engine.autotune import COLS, LAYOUTS, MKL, PLAIN, PREPACKED, ROWS, TALL
    from specd_engine.layouts import LayoutSwitch, SwitchableLinear, available_layouts, make_linears_switchable

    torch.manual_seed(0)
    # the first layer is tall (32 outputs from 16 inputs: the W·xᵀ path), the second is not
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False))
    assert {PLAIN, TALL, COLS, ROWS} <= available_layouts() <= set(LAYOUTS)
    batch, step = torch.randn(2, 3, 16), torch.randn(1, 1, 16)  # [B, T, in]: several rows, and one (a decoding step)
    switch = LayoutSwitch()
    with torch.inference_mode():
        expected = [model(batch), model(step)]
        replaced = make_linears_switchable(model, switch, {PLAIN, PREPACKED, MKL, TALL, COLS, ROWS})
        assert TALL in available_layouts() and model[0].tall and not model[2].tall
        assert replaced == 2 and isinstance(model[0], SwitchableLinear) and isinstance(model[2], SwitchableLinear)
        for layout in sorted(available_layouts()):
            switch.layout = layout
            for x, want in zip((batch, step), expected):
                got = model(x)
                assert got.shape == want.shape
                assert torch.allclose(got, want, atol=1e-5), layout
                # a transposed view made a ragged pass's later steps 2.4x slower at 16-32 sessions
                assert model[0](x).is_contiguous(), layout
        assert model[0].rows_weight.shape == (16, 32) and model[0].rows_weight.is_contiguous()  # Wᵀ [in, out]


def test_a_layer_keeps_only_the_weights_of_the_layouts_it_runs():
    """rows alone: the transposed copy and the bias, no ordinary weight; it still computes the same."""
    import torch

    from specd_engine.autotune import ROWS
    from specd_engine.layouts import LayoutSwitch, make_linears_switchable

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32))
    x = torch.randn(3, 16)
    with torch.inference_mode():
        want = model(x)
        make_linears_switchable(model, LayoutSwitch(ROWS), {ROWS})
        assert model[0].weight is None and model[0].bias is not None and model[0].rows_weight is not None
        assert torch.allclose(model(x), want, atol=1e-5)


def test_a_closing_health_watch_never_waits_for_the_servicers_lock():
    """grpc_health's set() holds its lock while it sends to each watcher, and a send waits for gRPC's
    event thread; the close callback of a watcher runs on that thread. Ours must return at once even
    while the lock is held (else: the deadlock WatchSafeHealthServicer describes), and still forget
    the watcher once the lock is free."""
    import threading

    from specd_common.server import WatchSafeHealthServicer

    servicer = WatchSafeHealthServicer()
    told = []
    servicer._send_response_callbacks[""] = {told.append}
    closed = servicer._on_close_callback(told.append, "")
    with servicer._lock:  # what set() holds while it sends
        finished = threading.Event()
        threading.Thread(target=lambda: (closed(), finished.set()), daemon=True).start()
        assert finished.wait(2.0), "the close callback waited for the health servicer's lock"
    for _ in range(100):
        if not servicer._send_response_callbacks[""]:
            break
        threading.Event().wait(0.02)
    assert servicer._send_response_callbacks[""] == set() and told == [None]


def test_specd_up_with_heads_starts_no_draft_service():
    """`specd up --drafter heads`: the verify and a gateway told there is no draft service (its
    Medusa heads and lookup copies draft); any other drafter: all three, the gateway pointed at it."""
    from specd_app.cli import HEADS_ONLY, build_parser
    from specd_app.stack import service_commands

    ports = {"gateway": 1, "draft": 2, "verify": 3, "http": 0}
    heads_only = service_commands("127.0.0.1", ports, "target", HEADS_ONLY, "", 0, 3)
    assert list(heads_only) == ["verify", "gateway"]
    gateway = build_parser().parse_args(heads_only["gateway"][3:])  # after `python -m specd_app.cli`
    assert gateway.draft_address == "" and gateway.verify_address == "127.0.0.1:3"
    full = service_commands("127.0.0.1", ports, "target", "feature", "HEAD", 0, 3)
    assert list(full) == ["verify", "draft", "gateway"]
    assert build_parser().parse_args(full["gateway"][3:]).draft_address == "127.0.0.1:2"


def test_bench_runs_specd_on_the_heads_gateway_when_they_are_the_default():
    """`specd bench`'s modes: where `specd up` would draft with the verify's heads, specd runs on the
    gateway with no draft service and the draft service's stack is measured beside it as
    specd_<drafter> (with the fixed-k modes, which need it; the tree modes are specd's own drafter's,
    on its gateway); otherwise specd is the main gateway's and --medusa adds specd_medusa."""
    from specd_app.cli import bench_service_modes

    modes, gateways = bench_service_modes(3, [3], [2], cache_ab="", medusa=True, heads_beside="feature")
    assert [m for m, _ in modes] == ["target_only", "specd", "specd_feature", "specd_k3", "specd_tree2"]
    assert gateways == {"specd": "medusa", "specd_tree2": "medusa"}
    assert dict(modes)["specd_k3"] == {"num_draft_tokens": 3, "draft_length_policy": 1}
    assert dict(modes)["specd_tree2"] == {"num_draft_tokens": 3, "draft_branches": 2}
    modes, gateways = bench_service_modes(3, [], [], cache_ab="nocache", medusa=True, heads_beside="")
    assert [m for m, _ in modes] == ["target_only", "specd", "specd_nocache", "specd_medusa"]
    assert gateways == {"specd_nocache": "nocache", "specd_medusa": "medusa"}
    modes, gateways = bench_service_modes(3, [3], [], cache_ab="nocache", medusa=True, heads_beside="feature")
    assert [m for m, _ in modes] == ["target_only", "specd", "specd_feature", "specd_k3", "specd_feature_nocache", "specd_k3_nocache"]
    assert gateways == {"specd": "medusa", "specd_feature_nocache": "nocache", "specd_k3_nocache": "nocache"}
    assert dict(modes)["specd_k3_nocache"] == dict(modes)["specd_k3"]
    # fixed speculation caps beside the measured one: the default request on gateways of their own
    modes, gateways = bench_service_modes(3, [], [], cache_ab="", medusa=True, heads_beside="feature", caps=[0, 4])
    assert [m for m, _ in modes] == ["target_only", "specd", "specd_feature", "specd_cap0", "specd_cap4"]
    assert gateways == {"specd": "medusa", "specd_cap0": "cap0", "specd_cap4": "cap4"}
    assert dict(modes)["specd_cap4"] == dict(modes)["specd"]
    # heads from other runs, each on a verify and gateway of its own, with the default request
    modes, gateways = bench_service_modes(3, [], [], cache_ab="", medusa=True, heads_beside="feature", heads=["old", "new"])
    assert [m for m, _ in modes] == ["target_only", "specd", "specd_feature", "specd_heads_old", "specd_heads_new"]
    assert gateways == {"specd": "medusa", "specd_heads_old": "heads-old", "specd_heads_new": "heads-new"}
    assert dict(modes)["specd_heads_new"] == dict(modes)["specd"]


def test_bench_samples_every_mode_alike():
    """`specd bench --temperature`: the services and transformers get the same temperature and top-p
    (transformers' default top-k of 50 switched off, as the gateway has none); greedy sends nothing
    (the gateway's default) and generates greedily; a seed is sent only when given (it would fix k)."""
    from specd_app.bench import Sampling
    from specd_common.params import Warp

    assert Sampling().request_fields() == {} and Sampling().generate_kwargs() == {"do_sample": False}
    fields = Sampling(Warp(temperature=0.8, top_p=0.9)).request_fields()
    assert set(fields) == {"sampling"} and fields["sampling"].temperature == pytest.approx(0.8)
    assert fields["sampling"].top_p == pytest.approx(0.9) and fields["sampling"].top_k == 0
    assert Sampling(Warp(temperature=0.8, top_p=0.9)).generate_kwargs() == {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 0}
    assert Sampling(Warp(temperature=0.8), seed=7).request_fields()["seed"] == 7


def test_bench_heads_flags_name_real_heads_folders(tmp_path):
    """`specd bench --heads NAME=DIR`: folders with a heads config are taken (resolved), and each
    mistake is refused with what to fix: no '=', a name that cannot be a mode name, a name twice,
    a folder without heads."""
    from specd_app.cli import parse_heads_flags
    from verify_service.medusa import CONFIG_FILE

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / CONFIG_FILE).write_text("{}")
    assert parse_heads_flags([f"old_1={tmp_path / 'a'}"]) == {"old_1": str((tmp_path / "a").resolve())}
    for values, says in ([str(tmp_path / "a")], "NAME=DIR"), ([f"Old-1={tmp_path / 'a'}"], "lowercase"), \
            ([f"x={tmp_path / 'a'}", f"x={tmp_path / 'a'}"], "twice"), ([f"x={tmp_path}"], CONFIG_FILE):
        with pytest.raises(SystemExit, match=says):
            parse_heads_flags(values)
