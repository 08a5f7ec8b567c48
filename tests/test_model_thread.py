"""One thread runs a model service's torch work (specd_engine/model_thread.py says why: a second
OpenMP team in the process slows every multi-threaded pass after it)."""

from __future__ import annotations

import contextvars
import os
import threading

import pytest
import torch

from specd_engine import model_thread
from specd_engine.model_thread import ModelThread


def test_calls_run_in_order_on_one_thread_in_the_callers_context():
    worker = ModelThread("test-model")
    try:
        request = contextvars.ContextVar("request", default="unset")
        request.set("caller's")
        seen = [worker.run(lambda: (threading.get_ident(), request.get())) for _ in range(3)]
        assert {ident for ident, _ in seen} == {worker.thread.ident} and worker.thread.ident != threading.get_ident()
        assert [value for _, value in seen] == ["caller's"] * 3  # a span opened there stays the RPC's child
        assert worker.run(worker.run, threading.get_ident) == worker.thread.ident  # a nested call runs directly
        with pytest.raises(ZeroDivisionError):
            worker.run(lambda: 1 / 0)  # re-raised in the caller
        assert worker.run(lambda: 2) == 2  # and the thread still serves
    finally:
        worker.stop()
        worker.thread.join(timeout=10)
    assert not worker.thread.is_alive()


def test_every_pass_and_the_scorers_own_torch_work_run_on_the_model_thread(tiny, monkeypatch):
    """Prefill, batched chain passes, tree passes, the heads, the features' encoding and the
    sampling softmax: all on the one model thread, none on the caller's (a gRPC thread in service)."""
    from draft_training.medusa_training import MedusaRecipe, build_heads
    from specd_engine.batching import BatchPolicy
    from specd_engine.models import load_causal_lm
    from specd_common.params import Warp
    from verify_service import scorer as scorer_module
    from verify_service.scorer import Scorer

    loaded = load_causal_lm(str(tiny.target), device="cpu", dtype="float32")
    heads = build_heads(loaded, torch.arange(loaded.model.config.vocab_size), "", MedusaRecipe(num_heads=2)).eval()
    scorer = Scorer(loaded, BatchPolicy(max_batch_size=4), threads=1, prepack="off", medusa=heads)
    threads: dict[str, set[int]] = {}

    def record(what: str) -> None:
        threads.setdefault(what, set()).add(threading.get_ident())

    if scorer.lm.lean is not None:  # every pass is a ragged one
        ragged = scorer.lm.lean.forward_ragged
        monkeypatch.setattr(scorer.lm.lean, "forward_ragged", lambda *args, **kwargs: (record("pass"), ragged(*args, **kwargs))[1])
    else:
        loaded.model.register_forward_pre_hook(lambda module, args: record("pass"))
    ranked = heads.ranked  # every proposal, native (verify_service/native_heads.py) or the framework's
    monkeypatch.setattr(heads, "ranked", lambda *args, **kwargs: (record("heads"), ranked(*args, **kwargs))[1])
    for name in ("encode_features", "warp_probs"):
        real = getattr(scorer_module, name)
        monkeypatch.setattr(scorer_module, name, lambda *args, _real=real, _name=name: (record(_name), _real(*args))[1])

    greedy = scorer.open([5, 17, 42], Warp(), keep_features=True)
    assert scorer.last_features(greedy).data  # the prompt's features
    scores = scorer.score(greedy, [9, 10], features=True, head_drafts=True)  # through the batcher
    assert scores.features.data and scores.head_drafts.token_ids
    scorer.score(greedy, [3, 4, 5], parents=[-1, 0, 0])  # a tree
    sampled = scorer.open([5, 17, 42], Warp(temperature=1.0))
    assert len(scorer.score(sampled, [9]).target_probs) == 2

    assert set(threads) == {"pass", "heads", "encode_features", "warp_probs"}
    assert set().union(*threads.values()) == {model_thread.shared().thread.ident} != {threading.get_ident()}
    scorer.batcher.close()


def test_the_profiler_records_its_window_of_calls_and_writes_their_operators(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECD_PROFILE_CALLS", "2:3")
    thread = ModelThread(name="profiled")
    a = torch.ones(8, 8)
    try:
        for _ in range(2):  # before the window: not recorded
            thread.run(torch.add, a, a)
        for _ in range(3):
            thread.run(torch.mm, a, a)
        thread.run(torch.sub, a, a)  # after it
    finally:
        thread.stop()
    table = (tmp_path / f"profile-{os.getpid()}.txt").read_text()
    assert table.startswith("3 model-thread calls after 2")
    assert "aten::mm" in table and "aten::add" not in table and "aten::sub" not in table
