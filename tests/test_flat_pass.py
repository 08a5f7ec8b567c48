"""The flat pass over a KV store allocated up front (specd_engine/flat_pass.py, `--forward flat`).

What it promises: with products that score each row alone (int4), a position's logits are the same
bits whatever shares its pass: alone, in a chain of six, as a tree's node, beside 31 other sessions,
and after its prompt was prefilled in chunks of 4, 16 or 512. float32 on a CPU cannot promise that:
MKL's products round a row differently by how many rows a GEMM holds (`make pass-anatomy`)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from specd_common.errors import ResourceExhausted
from specd_engine import flat_pass, int4_tiles, native_decoder, quantized, store_attention

PROMPT = [(7 * i) % 50 + 3 for i in range(60)]
DRAFTS = [11, 2, 30, 8, 41, 17]


def native_unavailable(lm) -> str:
    """Why specd's attention kernel cannot serve this model here ("" where it can)."""
    return store_attention.unavailable(lm.lean.layers[0], torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module", params=["native", "folded"])
def flat(tiny, request):
    """The tiny target's flat pass, its attention by specd's kernel (store_attention) or folded SDPA calls."""
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    if request.param == "native" and native_unavailable(lm):
        pytest.skip(f"store attention: {native_unavailable(lm)}")
    real = store_attention.unavailable
    if request.param == "folded":
        store_attention.unavailable = lambda *args: "asked for folded SDPA"
    try:
        assert lm.use_flat_pass(slots=48)
    finally:
        store_attention.unavailable = real
    assert lm.passes.native == (request.param == "native") and lm.passes.fold == (request.param == "folded")
    return lm


def decoded(lm, prompt=PROMPT, tokens=DRAFTS, budget: int = 512) -> torch.Tensor:
    """The rows after each of `tokens`, decoded one position a pass after `prompt` prefilled in chunks of
    `budget`: [len(tokens), V]."""
    session = lm.new_session(prompt, prefill=False)
    while lm.unprefilled(session):
        lm.run_feeds([lm.prefill_feed(session, budget)])
    lm.forward(session)
    return torch.cat([lm.forward(session, [token])[-1:] for token in tokens])


def test_a_position_scores_the_same_bits_whatever_shares_its_pass(flat):
    alone = decoded(flat)
    chain = flat.new_session(PROMPT)
    flat.forward(chain)
    assert torch.equal(flat.forward(chain, DRAFTS), alone)  # a chain of six

    others = [flat.new_session([(3 * i + j) % 50 + 3 for i in range(20 + 5 * j)]) for j in range(31)]
    for other in others:
        flat.forward(other)
    mine = flat.new_session(PROMPT)
    flat.forward(mine)
    beside = flat.forward_batch([(mine, DRAFTS)] + [(other, [5, 6][: 1 + j % 2]) for j, other in enumerate(others)])
    assert torch.equal(beside[0], alone)  # beside 31 sessions with one or two rows each

    for budget in (4, 16, 512):  # the prompt's chunks
        assert torch.equal(decoded(flat, budget=budget), alone), budget


def test_a_position_past_one_key_block_scores_alike_beside_longer_and_shorter_sessions(flat):
    """Rows wider than a FOLD_KEY_BLOCK, a chain crossing into the next block, beside sessions whose
    rows read other widths: each row reads its own width, so its bits are those of decoding it alone
    (padded to the pass's widest, a row over 278 keys rounded otherwise than over its own 320)."""
    block = flat_pass.FOLD_KEY_BLOCK
    prompt = [(11 * i) % 50 + 3 for i in range(block - 3)]
    alone = decoded(flat, prompt)
    others = [flat.new_session([(5 * i + j) % 50 + 3 for i in range(length)]) for j, length in enumerate((block + 200, 30))]
    mine = flat.new_session(prompt)
    for session in others + [mine]:
        flat.forward(session)
    beside = flat.forward_batch([(mine, DRAFTS)] + [(other, [5, 6]) for other in others])
    assert torch.equal(beside[0], alone)


def test_a_tree_node_scores_the_bits_of_decoding_its_path(flat):
    tokens, parents = [11, 2, 9, 30], [-1, 0, 0, 1]
    session = flat.new_session(PROMPT)
    flat.forward(session)
    rows = flat.forward_tree(session, tokens, parents)  # [5, V]
    for node, path in ((1, [11, 2]), (2, [11, 9]), (3, [11, 2, 30])):
        assert torch.equal(rows[1 + node], decoded(flat, tokens=path)[-1]), node
    flat.settle_tree(session, [0, 1, 3])  # keep 11 → 2 → 30: the cache then holds that path
    assert torch.equal(flat.forward(session, [8])[-1], decoded(flat, tokens=[11, 2, 30, 8])[-1])


def test_one_attention_call_a_layer_or_one_a_session_give_the_same_bits(flat):
    sessions = [flat.new_session(PROMPT[: 30 + 9 * j]) for j in range(4)]
    for session in sessions:
        flat.forward(session)
    feeds = [flat.chain_feed(session, DRAFTS[: 1 + j]) for j, session in enumerate(sessions)]
    modes = flat.passes.fold, flat.passes.native
    flat.passes.fold = flat.passes.native = False  # what a GPU's eager passes do (short keys here, which any width reads alike)
    try:
        flat.passes.gather = False
        apart = flat.run_feeds_then_rewind(feeds)
        flat.passes.gather = True
        gathered = flat.run_feeds_then_rewind(feeds)
    finally:
        flat.passes.gather, (flat.passes.fold, flat.passes.native) = False, modes
    assert all(torch.equal(a, b) for a, b in zip(apart, gathered))
    decoder, flat.passes.decoder = flat.passes.decoder, None  # the framework's layers, whose bits SDPA's layers share
    try:
        assert all(torch.equal(a, b) for a, b in zip(apart, flat.run_feeds_then_rewind(feeds)))  # the fixture's own attention
    finally:
        flat.passes.decoder = decoder


@pytest.mark.parametrize("attention", ["native", "folded", "gathered"])
def test_a_pass_makes_as_many_operations_for_two_sessions_as_for_eight(flat, attention):
    """With one attention call a layer (specd's kernel or folded, in place, or over gathered keys), nothing
    inside a pass's layers loops over its sessions (the torch profiler counts the operators of
    forward_flat, on the model thread where it runs)."""
    from torch.profiler import ProfilerActivity, profile

    if attention == "native" and native_unavailable(flat):
        pytest.skip(f"store attention: {native_unavailable(flat)}")
    if attention == "folded" and not flat_pass.probe_folding(flat.lean.layers[0], torch.device("cpu")):
        pytest.skip("this machine's SDPA rounds a row by the rows folded beside it")
    sessions = [flat.new_session(PROMPT[: 20 + 4 * j]) for j in range(8)]
    for session in sessions:
        flat.forward(session)
    layer = flat.lean.layers[0]
    group = layer.heads // layer.kv_heads if attention == "folded" else 0

    def operations(count: int) -> int:
        parts = [(flat_pass.slot_of(s.cache), s.cache.get_seq_length(), 1, None, None) for s in sessions[1 : count + 1]]
        rows = flat_pass.flat_rows(parts, flat.loaded.device, group, native=attention == "native")
        assert (rows.folds is not None and len(rows.folds) == 1) == bool(group)
        ids = torch.full((count,), 7, dtype=torch.long)
        with profile(activities=[ProfilerActivity.CPU]) as run:
            flat_pass.forward_flat(flat.lean, flat.store, ids, rows, gather=True)
        return sum(1 for event in run.events() if event.name.startswith("aten::"))

    two, seven = flat.run(operations, 2), flat.run(operations, 7)
    assert two == seven and two > 10 * len(flat.lean.layers), (two, seven)


def test_folded_attention_groups_rows_by_their_own_key_width_and_sessions_by_row_count():
    """flat_rows's folds (fold_rows): a row reads the keys it sees in whole FOLD_KEY_BLOCKs, its own width whatever shares
    its pass; decode rows of one width fold into one call over the block of slots they hold, a chain
    crossing a block boundary splits there, and a tree's rows gather their compacted keys."""
    block = flat_pass.FOLD_KEY_BLOCK
    parts = [(2, 9, 1, None, None), (5, block - 2, 3, None, None), (4, 70, 1, None, None)]  # (slot, cached, rows, positions, tree mask)
    folds = flat_pass.flat_rows(parts, torch.device("cpu"), fold_group=2).folds
    padded = flat_pass.query_rows(2)  # a row's query rows a key head in a call
    by_rows = {(fold.keys, fold.rows): fold for fold in folds}
    assert sorted(by_rows) == [(block, 1), (block, 2), (2 * block, 1)]
    decode = by_rows[(block, 1)]  # slots 2 and 4, slot 3 idle between
    assert (decode.first, decode.slots) == (2, 3) and decode.pass_rows.tolist() == [0, 4] and decode.at.tolist() == [0, 2]
    assert (decode.mask[1] == 0).sum(-1).tolist() == [[1] * padded]  # the idle slot's padded query rows see column 0 only
    chain = by_rows[(block, 2)]
    assert chain.pass_rows.tolist() == [1, 2] and ((chain.mask[0, 0] == 0).sum(-1)).tolist() == [block - 1] * padded + [block] * padded
    crossing = by_rows[(2 * block, 1)]  # the chain's third row sees block + 1 keys: the next width
    assert crossing.pass_rows.tolist() == [3] and (crossing.mask[0, 0] == 0).sum(-1).tolist() == [block + 1] * padded

    tree = torch.ones((3, 13), dtype=torch.bool).tril(10)  # 10 cached, then a root and two children of it
    tree[2, 11] = False  # the second child does not see the first
    gathered, = flat_pass.flat_rows([(1, 10, 3, [10, 11, 11], tree)], torch.device("cpu"), fold_group=2).folds
    assert gathered.columns is not None and gathered.gather_slots.tolist() == [1, 1, 1]
    assert gathered.columns[2, :12].tolist() == list(range(11)) + [12]  # committed, the root, its own: compacted


def test_a_cpu_whose_attention_rounds_a_row_by_its_neighbours_keeps_the_ragged_pass(tiny, monkeypatch):
    """The start-up probe (flat_pass.probe_folding): where SDPA rounds a query row by the rows folded
    beside it, a CPU keeps the ragged pass, and a position still scores alike whatever shares its pass."""
    import torch.nn.functional as F

    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    real = F.scaled_dot_product_attention

    def skewed(query, *args, **kwargs):  # a block of more than one row's query heads rounds otherwise
        out = real(query, *args, **kwargs)
        return out + 1e-3 if query.shape[-2] > query.shape[1] and query.shape[0] == 3 else out

    monkeypatch.setattr(F, "scaled_dot_product_attention", skewed)
    monkeypatch.setattr(store_attention, "unavailable", lambda *args: "a CPU without AVX-512")  # else specd's kernel attends
    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    assert not flat_pass.probe_folding(lm.lean.layers[0], torch.device("cpu"))
    assert not lm.use_flat_pass(slots=8) and lm.store is None  # the ragged pass serves, exactly
    alone = decoded(lm)
    others = [lm.new_session(PROMPT[: 20 + 7 * j]) for j in range(3)]
    mine = lm.new_session(PROMPT)
    for session in others + [mine]:
        lm.forward(session)
    beside = lm.forward_batch([(mine, DRAFTS)] + [(other, [5]) for other in others])
    assert torch.equal(beside[0], alone)


def test_sessions_hold_slots_until_they_end(tiny):
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    assert lm.use_flat_pass(slots=2, capacity=100)
    assert lm.store.capacity == 256 and lm.max_length < lm.store.capacity  # 100 in whole FOLD_KEY_BLOCKs
    first, second = lm.new_session(PROMPT), lm.new_session(PROMPT)
    with pytest.raises(ResourceExhausted, match="all 2 KV slots"):
        lm.new_session(PROMPT)
    assert torch.equal(lm.forward(second, [3]), lm.forward(first, [3]))
    del first
    gc.collect()
    third = lm.new_session(PROMPT)  # the first's slot came back
    assert lm.store.free_slots == 0 and third.cached == len(PROMPT)  # the prefill scored the last token (prescores)


@pytest.mark.parametrize("prompt_kernel", [None] + ([quantized.PROMPT_TILES] if int4_tiles.prompt_kernel() else []))
def test_the_default_target_in_int4_scores_a_position_alike_in_chains_trees_and_any_prompt_chunks(prompt_kernel):
    """The real default target (its own copy: packing changes a model in place), flat: a chain of six
    drafts, decoding after prompt chunks of 16 and of 512, and a tree's nodes score each position with
    the bits of decoding it; with prompt rows through the int4 products or the prompt tiles (AMX)."""
    from specd_common.config import DEFAULT_TARGET
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(DEFAULT_TARGET, device="cpu", dtype="float32"), weights="int4")
    assert lm.use_flat_pass(slots=8, capacity=2048)
    lm.use_prompt_kernel(prompt_kernel)
    prompt = lm.loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe."}],
                                                     add_generation_prompt=True, return_dict=True)["input_ids"]
    drafts = [504, 3632, 28, 2216, 216, 314]
    chain = lm.new_session(prompt)
    lm.forward(chain)
    together = lm.forward(chain, drafts)  # [6, V]
    assert torch.equal(decoded(lm, prompt, drafts, budget=16), together)
    assert torch.equal(decoded(lm, prompt, drafts, budget=512), together)

    # a tree whose grandchild has a masked sibling between its ancestors' columns and its own: read
    # uncompacted, its keys' vector lanes shift and its logits differed by 0.07
    tokens, parents = [504, 3632, 1046, 28], [-1, 0, 0, 1]
    session = lm.new_session(prompt)
    lm.forward(session)
    rows = lm.forward_tree(session, tokens, parents)  # [5, V]
    for node, path in ((1, [504, 3632]), (2, [504, 1046]), (3, [504, 3632, 28])):
        assert torch.equal(rows[1 + node], decoded(lm, prompt, path)[-1]), node

    # past one key block, beside a session four times as long and a short one: rows padded to the pass's
    # widest (the flat pass before 2026-11-29) scored logits up to 0.28 apart from decoding them alone
    long_prompt = (prompt * 80)[:300]
    alone = decoded(lm, long_prompt, drafts)
    others = [lm.new_session((prompt * 80)[1:length]) for length in (1200, 30)]
    mine = lm.new_session(long_prompt)
    for session in others + [mine]:
        lm.forward(session)
    assert torch.equal(lm.forward_batch([(mine, drafts)] + [(other, [5, 6]) for other in others])[0], alone)


@pytest.fixture(scope="module")
def default_flat():
    """The default target in int4, flat, with the prompt tiles where this CPU runs them (its own copy)."""
    from specd_common.config import DEFAULT_TARGET
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(DEFAULT_TARGET, device="cpu", dtype="float32"), weights="int4")
    assert lm.use_flat_pass(slots=24, capacity=2048)
    if native_decoder.unavailable(lm.lean, lm.store):
        pytest.skip(f"native decoder: {native_decoder.unavailable(lm.lean, lm.store)}")
    lm.use_prompt_kernel(quantized.PROMPT_TILES if int4_tiles.prompt_kernel() else None)
    return lm


def test_the_native_decoder_scores_within_rounding_of_the_framework_s_layers(default_flat):
    """Every layer in one native call (native_decoder) computes the framework pass's math: on real prompts,
    a chain's logits and the captured layers' outputs agree with the framework's layers to the rounding of
    bfloat16 product inputs (their sums run in other orders), with the same argmax at every position."""
    lm = default_flat
    assert lm.passes.native_layers
    lm.capture_layers([4, 20])
    questions = ["Name three rivers of Europe.", "Write a haiku about rain on a tin roof.", "What is 17 times 23?"]
    prompts = [lm.loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                       return_dict=True)["input_ids"] for text in questions]

    def scored(native: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        decoder, lm.passes.decoder = lm.passes.decoder, lm.passes.decoder if native else None
        try:
            made = []
            for prompt in prompts:
                session = lm.new_session(prompt[:-6], keep_features=True)
                lm.forward(session)
                made.append((lm.forward(session, prompt[-6:]), session.fed_layers[-6:].clone()))  # [7, V], [6, 2, C]
            return made
        finally:
            lm.passes.decoder = decoder

    # the products' inputs in bfloat16 (AVX-512 VNNI's 8-bit groups would round the two orders' sums to different
    # levels: a coarser rounding than the one this holds the layers' math to)
    bfloat16_inputs = [isa for isa in int4_tiles.runnable_instruction_sets() if isa != "avx512-vnni"]
    try:
        with int4_tiles.instruction_set_as(bfloat16_inputs[0] if bfloat16_inputs else None):
            made = lm.run(lambda: (scored(True), scored(False)))
        for (logits, layers), (reference, reference_layers) in zip(*made):
            assert torch.equal(logits.argmax(-1), reference.argmax(-1))
            assert (logits - reference).abs().max() <= 2e-2 * reference.abs().max()
            assert (layers - reference_layers).abs().max() <= 2e-2 * reference_layers.abs().max()
            assert not torch.equal(layers[:, 0], layers[:, 1])  # two layers' outputs, not one twice
    finally:
        lm.capture_layers([])


def test_a_native_pass_s_rows_keep_their_bits_when_prompt_rows_sit_on_both_sides_of_them(default_flat):
    """A pass whose prompt rows are not one run (a chunk, a round, another chunk): the native call gathers each
    kernel's rows, and every row scores as it does alone: the round's logits, and the chunks' caches (each
    session's next logits as after prefilling alone)."""
    lm = default_flat
    prompt = lm.loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a lighthouse at night."}],
                                                     add_generation_prompt=True, return_dict=True)["input_ids"]

    def mixed() -> tuple[list, list]:
        first, round_, last = (lm.new_session(prompt[: len(prompt) - cut], prefill=False) for cut in (0, 3, 5))
        while lm.unprefilled(round_):
            lm.run_feeds([lm.prefill_feed(round_, 512)])
        lm.forward(round_)
        together = lm.run_feeds([lm.prefill_feed(first, 512), lm.chain_feed(round_, DRAFTS[:3]), lm.prefill_feed(last, 512)])
        return together[1], [lm.forward(first), lm.forward(last)]

    def apart() -> tuple[torch.Tensor, list]:
        round_ = lm.new_session(prompt[: len(prompt) - 3])
        lm.forward(round_)
        return lm.forward(round_, DRAFTS[:3]), [lm.forward(lm.new_session(prompt[: len(prompt) - cut])) for cut in (0, 5)]

    (round_logits, nexts), (alone, alone_nexts) = lm.run(lambda: (mixed(), apart()))
    assert torch.equal(round_logits, alone)
    assert all(torch.equal(a, b) for a, b in zip(nexts, alone_nexts))


def test_a_native_pass_runs_a_fixed_handful_of_operators_whatever_its_sessions(default_flat):
    """With every layer in one native call, a pass's framework operators (the torch profiler's count) are the
    embedding, the rotary embedding and the final norm: as many for two sessions as for seven, and not a
    tenth of the framework's pass, which runs ~30 a layer."""
    from torch.profiler import ProfilerActivity, profile

    lm = default_flat
    sessions = [lm.new_session(PROMPT[: 20 + 4 * j]) for j in range(8)]
    for session in sessions:
        lm.forward(session)

    def operations(count: int, native: bool = True) -> int:
        parts = [(flat_pass.slot_of(s.cache), s.cache.get_seq_length(), 1, None, None) for s in sessions[1 : count + 1]]
        rows = flat_pass.flat_rows(parts, lm.loaded.device, 0, native=True)
        ids = torch.full((count,), 7, dtype=torch.long)
        with profile(activities=[ProfilerActivity.CPU]) as run:
            if native:
                lm.passes.decoder.forward(ids, rows)
            else:
                flat_pass.forward_flat(lm.lean, lm.store, ids, rows, gather=False)
        return sum(1 for event in run.events() if event.name.startswith("aten::"))

    two, seven, framework = lm.run(operations, 2), lm.run(operations, 7), lm.run(operations, 7, False)
    assert two == seven and 10 * seven < framework, (two, seven, framework)


def test_graphed_passes_pad_rows_into_a_spare_slot_and_keep_every_row_s_bits(tiny):
    """GraphedPasses (CUDA graphs on a GPU) replayed eagerly on the CPU over the same static buffers: a
    pass padded to its shape gives its rows the bits of the unpadded pass, and the padding writes only
    the spare slot."""
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    assert lm.use_flat_pass(slots=8)
    sessions = [lm.new_session(PROMPT[: 25 + 10 * j]) for j in range(3)]
    for session in sessions:
        lm.forward(session)
    feeds = [lm.chain_feed(session, DRAFTS[: 2 + j]) for j, session in enumerate(sessions)]
    eager = lm.run_feeds_then_rewind(feeds)
    lm.passes.graphs = flat_pass.GraphedPasses(lm.lean, lm.store, lm.store.claim())
    replayed = lm.run_feeds_then_rewind(feeds)  # 9 rows: the 32-row shape
    again = lm.run_feeds_then_rewind(feeds)  # the captured shape, replayed
    assert set(lm.passes.graphs.graphs) == {(32, flat_pass.GRAPH_MIN_KEYS)}
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(eager, replayed, again))
    assert all(torch.equal(row, decoded(lm, PROMPT[: 25 + 10 * j], DRAFTS[: 2 + j])) for j, row in enumerate(replayed))
    sessions[0].keep_features = True
    lm.forward(sessions[0], [3])
    kept = sessions[0].fed_features.clone()
    lm.forward(sessions[1], [4, 5])  # the same shape, replayed again
    assert torch.equal(sessions[0].fed_features, kept)  # features are the pass's own, not the shape's buffer


def test_a_flat_pass_that_fails_its_start_up_probe_leaves_the_ragged_pass_serving(tiny, monkeypatch, caplog):
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    monkeypatch.setattr(flat_pass, "forward_flat", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("no kernel")))
    assert not lm.use_flat_pass(slots=4)
    assert lm.store is None and "no kernel" in caplog.text
    session = lm.new_session(PROMPT)
    assert lm.forward(session, DRAFTS).shape[0] == len(DRAFTS) + 1  # served by the ragged pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages go back to the system through Linux's madvise")
def test_a_released_slot_gives_its_pages_back_and_the_lowest_free_slot_is_claimed_first():
    """A CPU store's slot spans the model's context: what a past session wrote must not stay resident
    once it ends (its pages read as zeros after, finite), and a neighbour's columns stay as they were."""
    store = flat_pass.KVStore(layers=1, kv_heads=2, head_dim=64, slots=3, capacity=4096, device=torch.device("cpu"),
                              dtype=torch.float32)
    first, second = store.claim(), store.claim()
    assert (first, second) == (0, 1)
    store.keys[0][first].fill_(1.0)
    store.keys[0][second].fill_(2.0)
    store.release(first)
    forgotten = store.keys[0][first]  # [Hkv, capacity, D]: 2 MiB, its whole pages given back (not a partial one at an edge)
    assert (forgotten == 0).float().mean() > 0.99 and torch.isfinite(forgotten).all()
    assert (store.keys[0][second] == 2.0).all()
    assert store.claim() == 0  # the lowest free slot: sessions sit in a block a folded call spans


def test_a_slot_s_memory_is_made_finite_before_a_pass_reads_it(tiny, flat):
    """The store is allocated empty (its pages stay the system's until used): whatever its memory held,
    NaN included, a pass reads only zeroed or written columns."""
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    assert lm.use_flat_pass(slots=4, kv_dtype=flat.store.kv_dtype)  # the fixture's store
    for tensor in lm.store.keys + lm.store.values:
        tensor.fill_(float("nan"))
    lm.store._finite = [0] * lm.store.slots
    assert torch.equal(decoded(lm), decoded(flat))


def test_an_int4_verify_with_specd_s_kernel_keeps_its_keys_in_bfloat16_unless_told(tiny, flat):
    """auto: bfloat16 where specd's kernel attends an int4 model (half the bytes each pass reads), float32
    where asked; a bfloat16 store where SDPA would attend is refused with what to do instead."""
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    expected = torch.bfloat16 if flat.passes.native else torch.float32
    assert flat.store.keys[0].dtype == flat.store.values[0].dtype == expected
    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    assert flat_pass.store_dtype(lm, native=True, kv_dtype="float32") == torch.float32
    assert flat_pass.store_dtype(lm, native=False) == torch.float32
    with pytest.raises(ValueError, match="--kv-dtype auto or float32"):
        flat_pass.store_dtype(lm, native=False, kv_dtype="bfloat16")


def test_a_copied_session_scores_as_its_original(flat):
    """copy_session writes the copy's slot outside a pass (the verify's start-up batch timings): a later
    pass must read those columns, not zero them as never reached."""
    original = flat.new_session(PROMPT)
    flat.forward(original)
    copy = flat.copy_session(original)
    assert torch.equal(flat.forward(copy, DRAFTS), flat.forward(original, DRAFTS))


def test_a_flat_verify_times_its_own_passes_at_start_up(tiny):
    """Start-up timings are cached by what they time: a flat verify's passes cost otherwise than a
    ragged one's, so the two must not share an entry (they did: every flat run priced rounds by the
    ragged verify's timings)."""
    from specd_engine.batching import BatchPolicy
    from specd_engine.models import load_causal_lm
    from verify_service.scorer import Scorer

    keys = {forward: Scorer(load_causal_lm(str(tiny.target)), BatchPolicy(max_batch_size=1), threads=1, prepack="off",
                            forward=forward, weights="int4").timing_key(1, 0, BatchPolicy(max_batch_size=1))
            for forward in ("ragged", "flat")}
    assert keys["ragged"]["flat"] is False and keys["flat"]["flat"] is True


def test_a_verify_keeps_the_kv_dtype_it_is_told_and_times_it_apart(tiny):
    """--kv-dtype reaches the store through the Scorer, and start-up timings of one store's passes are
    not another's; a name outside the choices is refused before any model work."""
    from specd_engine.batching import BatchPolicy
    from specd_engine.models import load_causal_lm
    from verify_service.scorer import Scorer

    def scorer(kv_dtype: str) -> Scorer:
        return Scorer(load_causal_lm(str(tiny.target)), BatchPolicy(max_batch_size=1), threads=1, prepack="off",
                      forward="flat", weights="int4", kv_dtype=kv_dtype)

    told = scorer("float32")
    assert told.lm.store.keys[0].dtype == torch.float32
    auto = scorer("auto")
    if auto.lm.passes.native:
        assert auto.lm.store.keys[0].dtype == torch.bfloat16
        key = lambda s: s.timing_key(1, 0, BatchPolicy(max_batch_size=1))  # noqa: E731
        assert key(told)["kv_dtype"] != key(auto)["kv_dtype"]
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        scorer("float16")
