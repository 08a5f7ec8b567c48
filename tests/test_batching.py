"""Batch scheduling: a batched forward equals one-session-at-a-time, and the batcher groups concurrent calls.

Correctness first: the ragged pass (and transformers' forward, a feed at a time) must give every session the logits
(and the cache) it would get alone, for ragged pasts, ragged draft lengths, trees, prompt chunks,
empty caches and after rollbacks.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import pytest
import torch

from specd_engine.batching import BatchPolicy, ForwardBatcher, make_batcher
from specd_common.errors import InvalidArgument
from specd_engine.lm import CausalLM
from specd_engine.sessions import Feed, KVSession
from specd_engine.models import load_causal_lm

ATOL = 1e-4

PROMPTS = [list(range(5, 17)), [20], [30, 31, 32], list(range(40, 63)), [7, 8]]


@pytest.fixture(scope="module")
def lm(tiny) -> CausalLM:
    return CausalLM(load_causal_lm(str(tiny.target), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def reference_lm(tiny) -> CausalLM:
    """transformers' forward (what serves architectures the lean forward does not)."""
    return CausalLM(load_causal_lm(str(tiny.target), device="cpu", dtype="float32"), lean=False)


def assert_caches_match(reference, batched) -> None:
    """Same keys/values at every layer (the batched pass left each session's cache as a solo pass would)."""
    assert reference.cache.get_seq_length() == batched.cache.get_seq_length()
    for ref_layer, layer in zip(reference.cache.layers, batched.cache.layers):
        assert layer.keys.shape == ref_layer.keys.shape
        torch.testing.assert_close(layer.keys, ref_layer.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(layer.values, ref_layer.values, atol=ATOL, rtol=0)


def run_rounds(lm: CausalLM, rounds: Sequence[Sequence[tuple[int, list[int], list[int]]]]) -> None:
    """Drive twin sessions through the same rounds: (prefix_length, append, drafts) per session per round;
    one twin alone with `forward`, the other in one batch; logits, argmax and caches must agree."""
    solo = [lm.new_session(prompt) for prompt in PROMPTS]
    batched = [lm.new_session(prompt) for prompt in PROMPTS]
    for round_ in rounds:
        requests = []
        for one, other, (prefix_length, append, drafts) in zip(solo, batched, round_):
            for session in (one, other):
                session.apply_commit(prefix_length or len(session.tokens), append)
            requests.append((other, drafts))
        expected = [lm.forward(session, drafts) for session, (_, _, drafts) in zip(solo, round_)]
        got = lm.forward_batch(requests)
        for want, have, one, other in zip(expected, got, solo, batched):
            assert have.shape == want.shape
            torch.testing.assert_close(have, want, atol=ATOL, rtol=0)
            assert torch.equal(have.argmax(-1), want.argmax(-1))
            assert one.tokens == other.tokens and one.cached == other.cached
            assert_caches_match(one, other)


def count_passes(monkeypatch, engine: type) -> list[int]:
    """Feeds per pass of the pass engine `engine` (passes.py), recorded while the test runs."""
    passes: list[int] = []
    real = engine.run
    monkeypatch.setattr(engine, "run", lambda self, feeds, *args: passes.append(len(feeds)) or real(self, feeds, *args))
    return passes


def test_a_batch_of_sessions_is_one_model_pass(lm, reference_lm, monkeypatch):
    """Sessions as new_session makes them, one after a tree, share one pass of the lean forward's ragged
    engine; transformers' forward (other architectures) runs a pass a feed, with the same logits."""
    from specd_engine.passes import RaggedPasses, TransformersPasses

    ragged, apart = count_passes(monkeypatch, RaggedPasses), count_passes(monkeypatch, TransformersPasses)
    logits = []
    for model in (lm, reference_lm):
        sessions = [model.new_session(prompt) for prompt in PROMPTS[:3]]
        model.forward_tree(sessions[0], [1, 2, 3], [-1, -1, 0])
        model.settle_tree(sessions[0], [0, 2])
        logits.append(model.forward_batch([(session, [4]) for session in sessions]))
    assert ragged[-1] == 3 and apart[-1] == 3
    for one, other in zip(*logits):
        torch.testing.assert_close(one, other, atol=ATOL, rtol=0)


def test_a_ragged_pass_attends_in_place_and_its_cost_does_not_grow_with_the_others_context(lm, monkeypatch):
    """No session's cache is copied into a batch: every cache buffer keeps its storage, and the bytes a
    pass allocates beside three sessions holding 480 positions each exceed those beside three holding
    20 by far less than one session's cache (a padded batch would copy all three caches, every layer)."""
    from torch.profiler import ProfilerActivity, profile


    def allocated(context: int) -> tuple[int, int]:
        sessions = [lm.new_session([(7 * i + row) % 300 + 1 for i in range(context)]) for row in range(3)]
        buffers = [layer._key_buffer.data_ptr() for session in sessions for layer in session.cache.layers]
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            lm.forward_batch([(session, [4, 5]) for session in sessions])
        assert [layer._key_buffer.data_ptr() for session in sessions for layer in session.cache.layers] == buffers
        one_cache = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in sessions[0].cache.layers)
        return sum(event.cpu_memory_usage for event in prof.key_averages() if event.cpu_memory_usage > 0), one_cache

    short, _ = allocated(20)
    long, one_cache = allocated(480)
    assert long - short < 0.5 * one_cache, (short, long, one_cache)


def test_trees_and_prompt_chunks_share_a_ragged_pass_with_chains(lm):
    """One run_feeds pass over a chain, a draft tree and a prompt's chunk gives each what it gets
    alone: the chain's and the tree's logits, and the prompt's cache."""
    tokens, parents = [11, 12, 13, 21], [-1, 0, 1, -1]
    alone = [lm.new_session(PROMPTS[0]), lm.new_session(PROMPTS[3]), lm.new_session(list(range(60, 90)), prefill=False)]
    together = [lm.new_session(PROMPTS[0]), lm.new_session(PROMPTS[3]), lm.new_session(list(range(60, 90)), prefill=False)]
    want = [lm.forward(alone[0], [4, 5]), lm.forward_tree(alone[1], tokens, parents)]
    lm.run_feeds([lm.prefill_feed(alone[2], 16)])
    got = lm.run_feeds([lm.chain_feed(together[0], [4, 5]), lm.tree_feed(together[1], tokens, parents),
                        lm.prefill_feed(together[2], 16)])
    assert got[2] is None and together[2].cached == 16
    for have, expected in zip(got, want):
        torch.testing.assert_close(have, expected, atol=ATOL, rtol=0)
        assert torch.equal(have.argmax(-1), expected.argmax(-1))
    for one, other in zip(alone, together):
        assert_caches_match(one, other)


@pytest.mark.parametrize("forward", ["lean", "transformers"])
def test_batched_forward_matches_one_at_a_time_over_rounds_with_rollbacks(lm, reference_lm, forward):
    """Ragged pasts (1 to 23 tokens, one empty cache), ragged drafts (0 to 5), then partial rollbacks
    (keep some drafts, append a correction) and full ones (back into the prompt)."""
    run_rounds(
        lm if forward == "lean" else reference_lm,
        [
            [(0, [], [1, 2, 3]), (0, [], []), (0, [], [4]), (0, [], [7, 8, 9, 10, 11]), (0, [], [3, 3])],
            [(13, [50], [9, 9]), (1, [60], [5, 6, 7]), (3, [61, 62], []), (25, [], [1]), (2, [70], [71, 72, 73])],
            [(8, [], [4, 5, 6]), (3, [1], [2]), (5, [], [8, 8, 8, 8]), (20, [90, 91], [92]), (6, [74], [])],
            [(0, [], [100, 101]), (0, [], [102]), (0, [], [103, 104, 105]), (0, [], []), (0, [], [106])],
        ],
    )


def test_a_batch_of_one_and_duplicates(lm):
    """A single request takes today's unbatched path; one session twice in a batch is refused."""
    session, twin = lm.new_session(PROMPTS[0]), lm.new_session(PROMPTS[0])
    [logits] = lm.forward_batch([(session, [1, 2])])
    torch.testing.assert_close(logits, lm.forward(twin, [1, 2]), atol=0, rtol=0)
    with pytest.raises(ValueError):
        lm.forward_batch([(session, [3]), (session, [4])])


def test_batch_over_the_context_limit_is_refused_before_running(lm):
    """An over-long request is INVALID_ARGUMENT and the other sessions in the batch are untouched."""
    fine, long = lm.new_session(PROMPTS[2]), lm.new_session([i % 300 for i in range(lm.max_length - 2)])
    with pytest.raises(InvalidArgument):
        lm.forward_batch([(fine, [1]), (long, [1, 2, 3])])
    assert fine.tokens == PROMPTS[2] and fine.cached == len(PROMPTS[2]) - 1


class FakeSession:
    """A session as the batcher sees one: its identity, and when its stream began (KVSession.prefilled_at)."""

    prefilled_at = float("-inf")


class FakeLM:
    """Records the batches it is given; answers each request with a [len(extra) + 1, 1] tensor."""

    max_length = 1000

    def __init__(self, seconds_per_pass: float = 0.01):
        self.batches: list[list[object]] = []
        self.seconds_per_pass = seconds_per_pass
        self.fail = False

    def check_room(self, session, extra) -> None:
        if len(extra) > 10:
            raise InvalidArgument("too many drafts")

    def chain_feed(self, session, extra):
        return Feed(session, list(extra), logits=len(extra) + 1, extra=list(extra))

    @staticmethod
    def unprefilled(session) -> int:
        return 0

    def run_feeds(self, feeds):
        self.batches.append([feed.session for feed in feeds])
        time.sleep(self.seconds_per_pass)
        if self.fail:
            raise RuntimeError("device lost")
        return [torch.zeros(feed.logits, 1) for feed in feeds]


def concurrent_rounds(batcher: ForwardBatcher, sessions: list[object], rounds: int) -> None:
    """Every session calls forward once per round, all at once; rounds are separated by a barrier."""
    barrier = threading.Barrier(len(sessions))

    def drive(session: object) -> None:
        for _ in range(rounds):
            barrier.wait()
            assert batcher.forward(session, [1, 2]).shape == (3, 1)

    with ThreadPoolExecutor(len(sessions)) as pool:
        list(pool.map(drive, sessions))


def test_batcher_gathers_the_active_sessions_into_one_pass():
    """Once the batcher has seen the sessions, a round of concurrent calls is one pass of all of them:
    it waits for the known sessions, and closes the moment they are all in (not at max_wait)."""
    fake = FakeLM()
    batcher = ForwardBatcher(fake, BatchPolicy(max_batch_size=8, max_wait_ms=3000, wait_fraction=1000))
    sessions = [FakeSession() for _ in range(4)]
    try:
        concurrent_rounds(batcher, sessions, rounds=2)  # the batcher learns who is active
        warm_up = len(fake.batches)
        started = time.monotonic()
        concurrent_rounds(batcher, sessions, rounds=1)
        elapsed = time.monotonic() - started
    finally:
        batcher.close()
    assert [len(batch) for batch in fake.batches[warm_up:]] == [4]
    assert all(len(set(map(id, batch))) == len(batch) for batch in fake.batches)
    assert elapsed < 1.5  # closed on the count; waiting out max_wait would take 3 s
    assert batcher.stats.requests == 12


def test_a_finish_makes_every_callers_reply_from_one_call_per_pass():
    """With `finish`, a pass's replies are made in one call that gets every caller's tag with its logits;
    each caller gets the reply for its own tag."""
    fake = FakeLM()
    finished: list[list[str]] = []

    def finish(tags, logits):
        finished.append(list(tags))
        return [f"{tag}:{rows.shape[0]}" for tag, rows in zip(tags, logits)]

    batcher = ForwardBatcher(fake, BatchPolicy(max_batch_size=8, max_wait_ms=3000, wait_fraction=1000), finish=finish)
    sessions = [FakeSession() for _ in range(3)]
    barrier = threading.Barrier(len(sessions))

    def drive(index: int) -> list[str]:
        replies = []
        for _ in range(3):
            barrier.wait()
            replies.append(batcher.forward(sessions[index], [1] * index, tag=f"s{index}"))
        return replies

    try:
        with ThreadPoolExecutor(len(sessions)) as pool:
            replies = list(pool.map(drive, range(len(sessions))))
    finally:
        batcher.close()
    assert replies == [[f"s{i}:{i + 1}"] * 3 for i in range(3)]  # each caller its own reply
    assert len(finished) == len(fake.batches) and sorted(finished[-1]) == ["s0", "s1", "s2"]  # one call a pass, the last with all


def test_the_window_shrinks_to_a_share_of_a_pass():
    """Waiting for a straggler must not cost more than a fraction of the pass it would save."""
    fake = FakeLM(seconds_per_pass=0.02)
    batcher = ForwardBatcher(fake, BatchPolicy(max_batch_size=8, max_wait_ms=1000, wait_fraction=0.25))
    try:
        assert batcher.window_s() == 1.0  # nothing measured yet
        batcher.forward(FakeSession(), [1])
        assert 0.004 <= batcher.window_s() < 0.1
    finally:
        batcher.close()


def test_batcher_respects_max_batch_size():
    fake = FakeLM()
    batcher = ForwardBatcher(fake, BatchPolicy(max_batch_size=3, max_wait_ms=20))
    try:
        concurrent_rounds(batcher, [FakeSession() for _ in range(7)], rounds=3)
    finally:
        batcher.close()
    assert max(len(batch) for batch in fake.batches) == 3
    assert batcher.stats.requests == 21


def test_a_lone_session_never_waits():
    """One active session: each call goes out at once although max_wait is a full second."""
    fake = FakeLM(seconds_per_pass=0.0)
    batcher = ForwardBatcher(fake, BatchPolicy(max_batch_size=8, max_wait_ms=1000))
    session = FakeSession()
    try:
        started = time.monotonic()
        for _ in range(5):
            batcher.forward(session, [1])
        assert time.monotonic() - started < 0.5
    finally:
        batcher.close()


def test_batcher_errors_reach_the_callers():
    """A bad request fails its caller before queueing; a failed pass fails every caller in it."""
    fake = FakeLM()
    batcher = ForwardBatcher(fake, BatchPolicy(max_batch_size=4, max_wait_ms=1))
    try:
        with pytest.raises(InvalidArgument):
            batcher.forward(FakeSession(), list(range(11)))
        assert fake.batches == []
        fake.fail = True
        with pytest.raises(RuntimeError, match="device lost"):
            batcher.forward(FakeSession(), [1])
    finally:
        batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.forward(FakeSession(), [1])


def test_batch_size_one_is_todays_path(lm):
    assert make_batcher(lm, BatchPolicy(max_batch_size=1)) is None
    assert isinstance(make_batcher(lm, BatchPolicy(max_batch_size=2)), ForwardBatcher)


def test_batcher_on_a_real_model_matches_solo_passes(lm):
    """Threads driving real sessions through the batcher get the logits each would get alone."""
    batcher = ForwardBatcher(lm, BatchPolicy(max_batch_size=8, max_wait_ms=20))
    drafts = [[1, 2, 3], [], [4], [5, 6], [7, 8, 9]]
    try:
        sessions = [lm.new_session(prompt) for prompt in PROMPTS]
        with ThreadPoolExecutor(len(sessions)) as pool:
            got = list(pool.map(batcher.forward, sessions, drafts))
    finally:
        batcher.close()
    for prompt, extra, have in zip(PROMPTS, drafts, got):
        torch.testing.assert_close(have, lm.forward(lm.new_session(prompt), extra), atol=ATOL, rtol=0)
    assert batcher.stats.batches < len(PROMPTS)  # some of them shared a pass


def test_batching_flags_and_environment(monkeypatch):
    from specd_app.cli import build_parser

    args = build_parser().parse_args(["serve", "verify", "--max-batch-size", "4", "--batch-wait-ms", "3"])
    assert BatchPolicy.from_args(args) == BatchPolicy(max_batch_size=4, max_wait_ms=3.0)
    monkeypatch.setenv("SPECD_MAX_BATCH_SIZE", "1")
    args = build_parser().parse_args(["serve", "draft"])
    assert not BatchPolicy.from_args(args).enabled


def test_concurrent_streams_through_the_services_match_single_streams(tiny):
    """Eight concurrent greedy requests through batching verify and draft services give exactly the
    tokens each gives alone, and the services really did batch. A batch waits only a fraction of a
    pass for sessions it expects, and the tiny draft's pass is ~1 ms: whether two Proposes meet
    depends on how the gateway's threads are scheduled, so the eight go up to three times (each time
    exact) until the draft has batched too."""
    from specd.v1 import common_pb2, generate_pb2
    from tests.conftest import start_cluster

    prompts = [f"the quick brown fox {i}" for i in range(8)]

    def generate(stub, text: str) -> list[int]:
        request = generate_pb2.GenerateRequest(
            text=text, raw=True, max_new_tokens=12, sampling=common_pb2.SamplingParams(temperature=0.0)
        )
        return list(stub.Generate(request, timeout=60).token_ids)

    cluster = start_cluster(tiny.target, "model", tiny.draft_noisy)
    try:
        stub = cluster.stub()
        alone = [generate(stub, text) for text in prompts]
        verify_stats = cluster.verify.servicer.scorer.batcher.stats
        draft_stats = cluster.draft.servicer.drafter.batcher.stats
        for _ in range(3):
            with ThreadPoolExecutor(len(prompts)) as pool:
                together = list(pool.map(lambda text: generate(stub, text), prompts))
            assert together == alone
            if max(verify_stats.sizes) > 1 and max(draft_stats.sizes) > 1:
                break
    finally:
        cluster.stop()
    assert max(verify_stats.sizes) > 1 and max(draft_stats.sizes) > 1


def test_a_prompt_prefilled_in_chunks_equals_one_pass(lm, monkeypatch):
    """Chunked prefill (PREFILL_CHUNK positions a pass) leaves the same cache, next logits and target
    features as feeding the whole prompt at once."""
    import specd_engine.lm as lm_module

    prompt = [(11 * i) % 300 + 1 for i in range(23)]
    whole = lm.new_session(prompt, keep_features=True)
    monkeypatch.setattr(lm_module, "PREFILL_CHUNK", 5)  # 22 cached positions: chunks of 5, 5, 5, 5, 2
    chunked = lm.new_session(prompt, keep_features=True)
    assert chunked.cached == whole.cached == 22 and chunked.cache.get_seq_length() == 22
    assert chunked.fed_start == 0 and chunked.fed_features.shape == whole.fed_features.shape == (22, lm.loaded.model.config.hidden_size)
    torch.testing.assert_close(chunked.fed_features, whole.fed_features, atol=ATOL, rtol=0)
    assert_caches_match(whole, chunked)
    torch.testing.assert_close(lm.forward(chunked, [7, 8]), lm.forward(whole, [7, 8]), atol=ATOL, rtol=0)


def test_a_reply_that_fails_fails_its_caller_alone():
    """A `finish` that cannot make one caller's reply hands back its exception: that caller's forward
    raises it, the others in the same pass get their replies (one session's fault is not the batch's)."""
    fake = FakeLM()

    def finish(tags, logits):
        return [ValueError(f"no reply for {tag}") if tag == "bad" else f"{tag}:{rows.shape[0]}" for tag, rows in zip(tags, logits)]

    batcher = ForwardBatcher(fake, BatchPolicy(max_batch_size=8, max_wait_ms=3000, wait_fraction=1000), finish=finish)
    tags = ["good", "bad", "also good"]
    barrier = threading.Barrier(len(tags))

    def drive(tag: str) -> list:
        session, replies = FakeSession(), []
        for _ in range(3):  # the batcher learns who is active: the later passes hold all three
            barrier.wait()
            try:
                replies.append(batcher.forward(session, [1], tag=tag))
            except ValueError as error:
                replies.append(error)
        return replies

    try:
        with ThreadPoolExecutor(len(tags)) as pool:
            good, bad, also_good = pool.map(drive, tags)
    finally:
        batcher.close()
    assert max(len(batch) for batch in fake.batches) == 3
    assert good == ["good:2"] * 3 and also_good == ["also good:2"] * 3
    assert all(isinstance(reply, ValueError) and "bad" in str(reply) for reply in bad)


def test_the_prefill_budget_is_the_prompts_fair_share_of_a_measured_pass():
    """Rounds alone cost 30 ms + 2 ms a position; a prompt position priced beside them costs 4 ms.
    Beside 4 rounds feeding 16 positions (62 ms), one or two waiting prompts get MIN_PREFILL_SHARE of
    the pass (a third: 31 ms, 7 positions); seven waiting beside one round of 4 positions most of it
    (7 × 38 ms / 4 ms = 66); nobody protected: a whole chunk; unmeasured: the smallest chunk. A whole
    chunk's positions (unpriced) and a pass of prompt positions alone teach nothing of the price;
    dearer positions (a long prompt's late chunks attend to more) shrink the next chunks."""
    from specd_engine.batching import MIN_PREFILL_CHUNK, MIN_PREFILL_SHARE, PrefillBudget, _Line
    from specd_engine.lm import PREFILL_CHUNK

    assert MIN_PREFILL_SHARE == pytest.approx(1 / 3)
    budget = PrefillBudget()
    assert budget.positions(16, 4, 1) == MIN_PREFILL_CHUNK and budget.positions(0, 0, 3) == PREFILL_CHUNK
    for positions in (4, 16, 8, 16):
        budget.observe(0.030 + 0.002 * positions, positions, 0, priced=False)
    assert budget.cost.rounds_s(16) == pytest.approx(0.062)
    assert budget.positions(16, 4, 1) == MIN_PREFILL_CHUNK  # the position price is still unmeasured
    budget.observe(0.062 + 0.004 * 10, 16, 10, priced=True)
    assert budget.cost.position_s == pytest.approx(0.004)
    assert budget.positions(16, 4, 2) == budget.positions(16, 4, 1) == 7
    assert budget.positions(4, 1, 7) == 66 and budget.positions(16, 0, 1) == PREFILL_CHUNK
    assert budget.positions(4, 1, 1000) == PREFILL_CHUNK
    # prompt rows costing in blocks (a dense prompt product's 64): whole blocks, at least one
    assert budget.positions(16, 4, 1, granule=64) == 64 and budget.positions(4, 1, 7, granule=64) == 64
    assert budget.positions(4, 1, 7, granule=16) == 64 and budget.positions(4, 1, 1000, granule=64) == PREFILL_CHUNK
    budget.observe(0.062 + 0.0015 * 512, 16, 512, priced=False)  # a whole chunk beside unprotected streams
    budget.observe(0.040 + 0.004 * 7, 0, 7, priced=True)  # prompt positions alone: no rounds to price them beside
    assert budget.cost.position_s == pytest.approx(0.004)
    for _ in range(30):
        budget.observe(0.062 + 0.008 * 7, 16, 7, priced=True)
    assert budget.cost.position_s == pytest.approx(0.008, rel=0.01) and budget.positions(16, 4, 1) == MIN_PREFILL_CHUNK
    flat = _Line()
    flat.observe(8, 0.05)
    assert flat.fit() is None and flat.at(20) == pytest.approx(0.05)  # one size: its mean, no slope


def test_only_streams_running_before_a_prompt_arrived_hold_its_prefill_back(lm, monkeypatch):
    """A stream prefilled before the oldest waiting prompt arrived keeps its share of the pass (the
    prompt gets what the budget leaves it: the smallest chunk while no pass was measured); streams
    that started after it (a burst's first answers) do not: it gets a whole chunk."""
    import specd_engine.batching as batching_module
    import specd_engine.lm as lm_module
    from specd_engine.batching import MIN_PREFILL_CHUNK, _Prefill

    monkeypatch.setattr(lm_module, "PREFILL_CHUNK", 64)  # the tiny model holds 512 positions
    monkeypatch.setattr(batching_module, "PREFILL_CHUNK", 64)
    batcher = ForwardBatcher(lm, BatchPolicy(max_batch_size=8, max_wait_ms=1))
    batcher.close()  # no worker: the queue is driven by hand below
    prompt = lm.new_session([(3 * i) % 300 + 1 for i in range(100)], prefill=False)
    batcher._prefills.append(_Prefill(prompt, arrived=10.0))
    before, after = lm.new_session([5, 6, 7]), lm.new_session([8, 9, 10])
    before.prefilled_at, after.prefilled_at = 9.0, 11.0
    assert batching_module.PrefillBudget().cost.position_s is None  # unmeasured: a protected stream keeps the chunk small

    def chunk(running) -> int:
        ((feed, _),), _ = batcher._prefill_feeds(decoding=len(running), streaming_since=batcher._streams_since(running))
        return len(feed.tokens)

    assert chunk([before, after]) == chunk([before]) == MIN_PREFILL_CHUNK
    assert chunk([after]) == chunk([]) == 64
    batcher._streaming = {id(before): before.prefilled_at}  # it had a round in the last pass; its next one is on its way back
    assert batcher._streams_since([before]) == [9.0] and chunk([]) == MIN_PREFILL_CHUNK


def test_a_finished_streams_session_no_longer_holds_the_next_prompt_back(lm, monkeypatch):
    """One request after another: the first one's session, released after its last round, is forgotten
    (ForwardBatcher.forget), so the next prompt is prefilled in one pass, not a small chunk beside a
    stream that has ended and then the rest (two passes before its first token). A batch no longer waits
    for the forgotten session either."""
    batcher = ForwardBatcher(lm, BatchPolicy(max_batch_size=8, max_wait_ms=1))
    passes: list[int] = []
    run_feeds = lm.run_feeds
    monkeypatch.setattr(lm, "run_feeds", lambda feeds: passes.append(len(feeds)) or run_feeds(feeds))
    try:
        def request(prompt: list[int], forget: bool) -> KVSession:
            session = lm.new_session(prompt, prefill=False)
            batcher.prefill(session)
            for _ in range(2):  # its rounds: it streams in the passes after its prefill
                session.tokens.append(int(torch.argmax(batcher.forward(session)[-1])))
            if forget:
                batcher.forget(session)
            return session

        request(PROMPTS[0], forget=False)
        passes.clear()
        remembered = request([(7 * i) % 300 + 1 for i in range(40)], forget=True)
        assert len(passes) == 4  # a small chunk beside the ended stream, the rest, two rounds
        assert id(remembered) not in batcher._streaming and batcher._batch_target() == 0
        passes.clear()
        request([(11 * i) % 300 + 1 for i in range(40)], forget=True)
        assert len(passes) == 3  # the whole prompt in one pass, then the two rounds
    finally:
        batcher.close()


def test_prefill_chunks_come_in_the_granule_prompt_rows_cost_in(lm, monkeypatch):
    """Float weights: rows cost one by one. int4 with tiles: 16 (lean_forward.PROMPT_TILE); with a dense
    prompt product: its whole block of 64 rows (quantized.PROMPT_BLOCK), which costs the same for 16 rows."""
    from specd_engine import lean_forward, quantized

    assert lm.prefill_granule == 1
    monkeypatch.setattr(lm.ragged, "tiles", True)
    assert lm.prefill_granule == lean_forward.PROMPT_TILE == 16
    monkeypatch.setattr(lm.ragged, "prompt_kernel", "bfloat16")
    assert lm.prefill_granule == quantized.PROMPT_BLOCK == 64
