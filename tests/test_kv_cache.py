"""The in-place KV cache (specd_engine/kv_cache.py) against transformers' DynamicLayer: the same
keys and values after any sequence of appends, crops and kept tree paths, without copying the past
on an append."""

from __future__ import annotations

import random

import torch
from transformers.cache_utils import DynamicLayer

from specd_engine import kv_cache
from specd_engine.kv_cache import GrowingLayer


def reference_keep_rows(layer: DynamicLayer, first: int, rows: list[int]) -> None:
    """What settle_tree did before: gather the kept columns."""
    keep = torch.tensor(list(range(first)) + rows, dtype=torch.long)
    layer.keys, layer.values = layer.keys.index_select(2, keep), layer.values.index_select(2, keep)


def test_a_growing_layer_holds_what_a_dynamic_layer_holds_through_appends_crops_and_kept_paths(monkeypatch):
    monkeypatch.setattr(kv_cache, "SPARE_COLUMNS", 3)  # grow often
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    growing, reference = GrowingLayer(), DynamicLayer()
    with torch.inference_mode():
        for step in range(200):
            length = reference.get_seq_length()
            action = rng.choice(["append", "append", "crop", "tree"]) if length else "append"
            if action == "append":
                new = rng.randint(1, 9)
                keys, values = torch.randn(1, 2, new, 4, generator=generator), torch.randn(1, 2, new, 4, generator=generator)
                returned = growing.update(keys, values)
                reference.update(keys, values)
                assert torch.equal(returned[0], reference.keys) and torch.equal(returned[1], reference.values)
            elif action == "crop":
                dropped = rng.randint(1, length)
                growing.crop(-dropped)
                reference.crop(-dropped)
            else:  # a tree's nodes are the last n columns; keep an ascending path of them
                nodes = rng.randint(1, length)
                first = length - nodes
                rows = sorted(rng.sample(range(first, length), rng.randint(0, nodes)))
                growing.keep_rows(first, rows)
                reference_keep_rows(reference, first, rows)
            assert growing.get_seq_length() == reference.get_seq_length(), (step, action)
            assert torch.equal(growing.keys, reference.keys) and torch.equal(growing.values, reference.values), (step, action)


def test_an_append_within_the_buffer_copies_nothing_of_the_past():
    layer = GrowingLayer()
    with torch.inference_mode():
        layer.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4))
        before = layer.keys.data_ptr(), layer.values.data_ptr()
        past = layer.keys.clone()
        layer.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == before  # the same buffer: no copy
    assert layer.get_seq_length() == 13 and torch.equal(layer.keys[:, :, :10], past)


def test_the_cache_of_a_model_is_made_of_growing_layers(tiny):
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(str(tiny.target), device="cpu", dtype="float32"))
    session = lm.new_session([5, 17, 42, 9])
    assert session.cache.layers and all(isinstance(layer, GrowingLayer) for layer in session.cache.layers)


def test_a_copied_session_scores_as_its_original_and_apart_from_it(tiny):
    """CausalLM.copy_session (the verify's batch timings start many sessions from one prefill): the
    copy's next logits are the original's, and a round on one leaves the other's cache alone."""
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(str(tiny.target), device="cpu", dtype="float32"))
    original = lm.new_session([5, 17, 42, 9, 11, 3])
    copy = lm.copy_session(original)
    assert copy.cache is not original.cache and copy.cached == original.cached == 5
    expected = lm.forward(original, [7, 8])  # [3, V]; appends 3 positions to the original's cache only
    assert copy.cache.get_seq_length() == 5 and original.cache.get_seq_length() == 8
    assert torch.equal(lm.forward(copy, [7, 8]), expected)
