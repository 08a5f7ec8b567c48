"""The lean forward (specd_engine/lean_forward.py) against transformers' own, pass for pass, on a tiny
random Llama: a prompt's prefill, decoding and verify passes, a draft tree, a packed batch of
sessions, and the features and captured layers feature drafters and Medusa heads read. Plus what
keeps it out where it must not serve: an unsupported model, a forward that disagrees, the switch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specd_engine import lean_forward  # noqa: E402
from specd_engine.lm import CausalLM  # noqa: E402
from specd_engine.models import load_causal_lm  # noqa: E402
from specd_common.tree import ROOT  # noqa: E402
from tests.tiny_models import build_model  # noqa: E402

ATOL = 1e-5  # float32 rounding; a wrong mask, position or weight moves logits by ~1


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("lean") / "m", seed=3, layers=3)


@pytest.fixture(scope="module")
def pair(model_path):
    """(lean, transformers): the same weights served by each forward."""
    lean = CausalLM(load_causal_lm(str(model_path), device="cpu", dtype="float32"))
    reference = CausalLM(load_causal_lm(str(model_path), device="cpu", dtype="float32"), lean=False)
    assert lean.lean is not None and reference.lean is None
    for lm in (lean, reference):
        lm.capture_layers([1, 2])
    return lean, reference


def test_chains_decode_and_verify_like_transformers(pair):
    sessions = [lm.new_session([5, 9, 14, 3, 7, 11, 2], keep_features=True) for lm in pair]
    for extra in ([], [4, 8, 15], [16], [23, 42]):  # a decoding step, then verify passes of 4, 2, 3 positions
        lean_logits, reference_logits = (lm.forward(session, extra) for lm, session in zip(pair, sessions))
        assert torch.allclose(lean_logits, reference_logits, atol=ATOL)
        assert torch.allclose(sessions[0].fed_features, sessions[1].fed_features, atol=ATOL)
        assert sessions[0].fed_layers.shape == sessions[1].fed_layers.shape == (len(sessions[0].fed_features), 2, 64)
        assert torch.allclose(sessions[0].fed_layers, sessions[1].fed_layers, atol=ATOL)


def test_a_long_prompt_prefills_like_transformers(pair, monkeypatch):
    monkeypatch.setattr("specd_engine.lm.PREFILL_CHUNK", 64)
    prompt = [(i * 7) % 300 + 1 for i in range(150)]  # three prefill chunks
    lean_logits, reference_logits = (lm.forward(lm.new_session(prompt), [1, 2]) for lm in pair)
    assert torch.allclose(lean_logits, reference_logits, atol=ATOL)


def test_a_draft_tree_scores_like_transformers(pair):
    tokens, parents = [11, 12, 13, 14, 21, 22], [ROOT, 0, 1, 0, ROOT, 4]
    sessions = [lm.new_session([3, 4, 5, 6, 7]) for lm in pair]
    lean_logits, reference_logits = (lm.forward_tree(s, tokens, parents) for lm, s in zip(pair, sessions))
    assert torch.allclose(lean_logits, reference_logits, atol=ATOL)
    for lm, session in zip(pair, sessions):
        lm.settle_tree(session, [4, 5])
    after = [lm.forward(session, [9]) for lm, session in zip(pair, sessions)]  # the kept path's cache serves on
    assert torch.allclose(after[0], after[1], atol=ATOL)


def test_a_packed_batch_scores_like_transformers(pair):
    prompts = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16])  # different cache lengths: padding
    extras = ([20], [21, 22, 23], [])
    outputs = []
    for lm in pair:
        sessions = [lm.new_session(prompt) for prompt in prompts]
        outputs.append(lm.forward_batch(list(zip(sessions, extras))))
    for lean_logits, reference_logits in zip(*outputs):
        assert torch.allclose(lean_logits, reference_logits, atol=ATOL)


def test_a_model_it_cannot_run_keeps_transformers_forward(model_path):
    loaded = load_causal_lm(str(model_path), device="cpu", dtype="float32")
    loaded.model.config.attention_bias = True  # what a Qwen2-style model would say
    assert lean_forward.unsupported(loaded.model) == "projections with biases"
    assert CausalLM(loaded).lean is None
    loaded.model.config.attention_bias, loaded.model.config.model_type = False, "gpt2"
    assert "not llama" in lean_forward.unsupported(loaded.model)


def test_a_lean_forward_that_disagrees_is_caught(model_path):
    from specd_engine.kv_cache import growing_cache

    loaded = load_causal_lm(str(model_path), device="cpu", dtype="float32")
    lean = lean_forward.LeanLlama(loaded.model)
    assert lean_forward.disagreement(lean, loaded.model, lambda: growing_cache(loaded.model.config)) == ""
    wrong = torch.nn.Linear(64, lean.layers[1].qkv.out_features, bias=False)  # a second layer's q/k/v mixed up
    with torch.no_grad():
        wrong.weight.copy_(lean.layers[1].qkv.weight.flip(0))
    lean.layers[1].qkv = wrong
    assert "logits differ" in lean_forward.disagreement(lean, loaded.model, lambda: growing_cache(loaded.model.config))


def test_the_verify_flag_keeps_transformers_forward(model_path):
    from specd_engine.batching import BatchPolicy
    from verify_service.scorer import Scorer

    loaded = load_causal_lm(str(model_path), device="cpu", dtype="float32")
    assert Scorer(loaded, BatchPolicy(max_batch_size=1), threads=1, prepack="off", forward="transformers").lm.lean is None
    with pytest.raises(ValueError, match="forward must be one of auto, ragged, flat, transformers"):
        Scorer(loaded, BatchPolicy(max_batch_size=1), threads=1, prepack="off", forward="fast")


def test_copied_layouts_alone_leave_no_second_copy_of_the_weights(model_path, pair):
    from specd_engine.autotune import ROWS

    lm = CausalLM(load_causal_lm(str(model_path), device="cpu", dtype="float32"), layouts={ROWS})
    attention = lm.loaded.model.model.layers[0].self_attn
    assert attention.q_proj.weight is None and attention.o_proj.weight is None  # only the rows copies remain
    reference = pair[1]
    lean_logits, reference_logits = (m.forward(m.new_session([5, 9, 14, 3]), [7, 11]) for m in (lm, reference))
    assert torch.allclose(lean_logits, reference_logits, atol=1e-4)  # another summation order than the plain layout's


def test_a_lean_forward_that_fails_its_probe_leaves_transformers_serving(model_path, monkeypatch):
    def broken(self, *args, **kwargs):
        raise TypeError("rotary_emb() takes 2 positional arguments")  # e.g. another transformers' module signature

    monkeypatch.setattr(lean_forward.LeanLlama, "forward_ragged", broken)
    lm = CausalLM(load_causal_lm(str(model_path), device="cpu", dtype="float32"))
    assert lm.lean is None
    assert lm.forward(lm.new_session([5, 9, 14]), [3]).shape[0] == 2  # transformers' forward serves


class _Cache:
    """What key_width_groups reads of a cache: its length."""

    def __init__(self, length: int) -> None:
        self.length = length

    def get_seq_length(self) -> int:
        return self.length


def test_a_padded_row_reads_its_own_key_width_whatever_shares_its_pass():
    """key_width_groups (the int4 verify's attention): each row reads the keys it sees padded to whole
    blocks of its own, never the pass's longest row's, so a chain crossing a block boundary makes two
    calls and each row's call is the one it makes alone; a tree's node counts only its ancestors."""
    block = lean_forward.kv_cache.ROW_KEY_BLOCK
    whole = lambda seen: -(-seen // block) * block  # noqa: E731

    def widths(groups) -> dict[int, tuple[int, int]]:  # row -> (width, keys it sees)
        return {row: (group.mask.shape[-1], int((group.mask[i] == 0).sum()))
                for group in groups for i, row in enumerate(rows_of(group))}

    def rows_of(group) -> list[int]:
        return list(range(64))[group.rows] if isinstance(group.rows, slice) else group.rows.tolist()

    cached = 4 * block - 4
    chain = widths(lean_forward.key_width_groups(lean_forward.Segment(_Cache(cached), 0, 8, padded=True)))
    assert chain == {i: (whole(cached + i + 1), cached + i + 1) for i in range(8)}
    assert len({width for width, _ in chain.values()}) == 2  # the chain crosses a block boundary
    for i in range(8):  # the same row in a shorter chain, or alone after the rows before it
        alone = widths(lean_forward.key_width_groups(lean_forward.Segment(_Cache(cached + i), 0, 1, padded=True)))
        assert alone[0] == chain[i]

    # a pending token, then a root with two children and a grandchild under the first child
    cached = 4 * block - 2  # the first two rows in one block, the deeper ones in the next
    mask = torch.zeros((5, cached + 5), dtype=torch.bool)
    mask[:, :cached] = True
    for row, sees in enumerate([[0], [0, 1], [0, 1, 2], [0, 1, 3], [0, 1, 2, 4]]):
        mask[row, [cached + s for s in sees]] = True
    groups = lean_forward.key_width_groups(lean_forward.Segment(_Cache(cached), 0, 5, mask=mask, padded=True))
    tree = widths(groups)
    assert {row: seen for row, (_, seen) in tree.items()} == {0: cached + 1, 1: cached + 2, 2: cached + 3, 3: cached + 3, 4: cached + 4}
    assert all(width == whole(seen) for width, seen in tree.values()) and len(groups) == 2
    grandchild = next(group for group in groups if 4 in rows_of(group))
    row = rows_of(grandchild).index(4)
    assert grandchild.columns[row, : cached + 4].tolist() == list(range(cached)) + [cached, cached + 1, cached + 2, cached + 4]


LAYER_OPERATORS = 180  # aten operators a layer of an int4 decoding pass may run (170 now; 189 before rows layers)


def test_an_int4_decoding_layer_stays_within_its_operator_budget(model_path):
    """A one-session int4 decoding pass runs at most LAYER_OPERATORS aten operators a decoder layer
    (the torch profiler on the model thread; a layer's share is the pass with every layer less the
    pass with one). Each operator costs microseconds on a CPU: the [B, H, n, D] layout and
    F.rms_norm's composite ran 189 a layer, ~a fifth of a one-session pass (engine-room.md)."""
    from torch.profiler import ProfilerActivity, profile

    from specd_engine.sessions import Feed

    lm = CausalLM(load_causal_lm(str(model_path)), weights="int4")
    session = lm.new_session([(7 * i) % 50 + 3 for i in range(60)])
    lm.forward(session)
    layers = lm.lean.layers

    def operators(count: int) -> int:
        lm.lean.layers = layers[:count]
        try:
            lm.run_feeds_then_rewind([Feed(session, [7], logits=1)])  # warm: first-call set-up is not the layer's
            with profile(activities=[ProfilerActivity.CPU]) as run:
                lm.run_feeds_then_rewind([Feed(session, [7], logits=1)])
            return sum(1 for event in run.events() if event.name.startswith("aten::"))
        finally:
            lm.lean.layers = layers

    per_layer = (lm.run(operators, len(layers)) - lm.run(operators, 1)) / (len(layers) - 1)
    assert 20 < per_layer <= LAYER_OPERATORS, per_layer
