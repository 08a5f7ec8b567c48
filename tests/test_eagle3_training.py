"""`specd train-draft --recipe eagle3-*`: EAGLE-3's training-time test drafts as the served head does,
and the tiny recipe trains, writes a checkpoint in the EAGLE authors' layout, and that checkpoint
serves exactly through the three services."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draft_service.eagle3_head import Eagle3Head, is_eagle3_checkpoint, load_eagle3, write_eagle3_checkpoint
from draft_service.feature_head import HeadCache
from tests.conftest import start_cluster
from tests.test_eagle3_serving import LAYERS, head_config
from tests.test_services import PROMPTS, assert_greedy_exact_with_drafts
from tests.test_train_feature_head import assert_a_finished_run_resumes_without_redoing_work, write_prompt_files
from tests.tiny_models import build_model, build_tokenizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    from specd_app.cli import main

    root = tmp_path_factory.mktemp("eagle3_training")
    target = build_model(root / "target", seed=3, layers=LAYERS, tokenizer=build_tokenizer(), head_scale=10.0)
    write_prompt_files(root / "data")
    argv = ["train-draft", "--target", str(target), "--recipe", "eagle3-tiny", "--work-dir", str(root / "work"),
            "--data-dir", str(root / "data"), "--device", "cpu", "--threads", "1"]
    assert main(argv) == 0
    return {"root": root, "target": target, "draft": root / "work" / "draft", "argv": argv}


def random_head(tmp_path: Path, target: Path) -> Eagle3Head:
    from transformers import AutoModelForCausalLM

    write_eagle3_checkpoint(tmp_path, head_config(target, "eagle"), seed=2)
    embedding = AutoModelForCausalLM.from_pretrained(target).get_input_embeddings().weight
    return load_eagle3(tmp_path, embedding, target_num_layers=LAYERS)


def test_each_training_step_equals_the_drafting_step_it_stands_for(tmp_path):
    """Pass j of Eagle3Head.unrolled at position t equals drafting step j after a commit at t - j + 1:
    the head's cached forward over the committed positions (the target's features), then its own
    outputs fed back one position at a time."""
    target = build_model(tmp_path / "target", seed=4, layers=LAYERS, tokenizer=build_tokenizer())
    head = random_head(tmp_path / "head", target)
    generator = torch.Generator().manual_seed(0)
    length, passes = 12, 3
    tokens = torch.randint(0, head.config.vocab_size, (1, length), generator=generator)  # [1, T]
    features = torch.randn(1, length, head.config.feature_size, generator=generator)  # [1, T, F]
    positions = torch.arange(length)
    with torch.inference_mode():
        unrolled = head.unrolled(tokens, features, positions, passes)  # passes × [1, T, H]
        for commit in (3, 6, length - passes):  # the last committed row
            cache = HeadCache()
            out = head(tokens[:, : commit + 1], features[:, : commit + 1], positions[: commit + 1], cache)[:, -1:]  # [1, 1, H]
            assert torch.allclose(out[0, 0], unrolled[0][0, commit], atol=1e-5)
            for step in range(1, passes):
                row = commit + step
                out = head(tokens[:, row : row + 1], out, positions[row : row + 1], cache)
                assert torch.allclose(out[0, 0], unrolled[step][0, row], atol=1e-5), (commit, step)


def test_the_tiny_recipe_writes_an_eagle3_checkpoint_that_learnt(trained):
    draft = trained["draft"]
    assert is_eagle3_checkpoint(draft)
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    history = json.loads((draft / "training.json").read_text())["history"]
    assert history[-1]["agreement"] > history[0]["agreement"] + 0.2, history
    per_step = json.loads((draft / "eval.json").read_text())["agreement_per_step"]["overall"]
    assert len(per_step) == 3
    untrained = held_out_agreement_of_a_fresh_head(trained)
    assert all(after > before + 0.15 for after, before in zip(per_step, untrained)), (per_step, untrained)


def held_out_agreement_of_a_fresh_head(trained) -> list[float]:
    """The same held-out measure for the head the run started from (the target's last layer)."""
    from draft_training import distill_data
    from draft_training.eagle3_training import build_head, held_out_agreement
    from specd_engine.models import load_causal_lm

    target = load_causal_lm(str(trained["target"]))
    head = build_head(target, torch.load(trained["root"] / "work" / "train" / "vocab.pt"))
    held_out = distill_data.load_records(trained["root"] / "work" / "data", "gen-eval")
    head_rows = target.model.get_output_embeddings().weight.detach()[head.vocab_ids]
    return held_out_agreement(head, target.model, head_rows, held_out, 3, torch.device("cpu"))["overall"]


def test_the_trained_head_serves_exactly_through_the_services(trained):
    running = start_cluster(trained["target"], "eagle3", trained["draft"])
    try:
        for prompt in PROMPTS[:2]:
            assert_greedy_exact_with_drafts(running, trained["target"], prompt, max_new_tokens=16)
    finally:
        running.stop()


def test_a_finished_run_resumes_without_redoing_work(trained):
    assert_a_finished_run_resumes_without_redoing_work(trained)


def test_every_eagle3_recipe_can_be_named_on_the_command_line():
    from draft_training.cli import EAGLE3_RECIPE_NAMES
    from draft_training.eagle3_training import EAGLE3_RECIPES

    assert set(EAGLE3_RECIPE_NAMES) == set(EAGLE3_RECIPES)


def test_training_goes_on_from_a_saved_head(trained, tmp_path):
    """--init-head: the saved checkpoint's weights and draft vocabulary, trained further in a new work dir."""
    from specd_app.cli import main

    argv = [*trained["argv"][:5], "--work-dir", str(tmp_path / "work"), "--data-dir", str(trained["root"] / "data"),
            "--device", "cpu", "--threads", "1", "--init-head", str(trained["draft"]), "--epochs", "2"]
    assert main(argv) == 0
    before = json.loads((trained["draft"] / "eval.json").read_text())["agreement_per_step"]["overall"]
    after = json.loads((tmp_path / "work" / "draft" / "eval.json").read_text())["agreement_per_step"]["overall"]
    assert after[0] > before[0] - 0.1  # it went on from the trained head, not from the target's last layer
    assert not (tmp_path / "work" / "train" / "vocab.pt").exists()


def test_a_larger_budget_trains_a_finished_run_on_into_unseen_batches(trained, tmp_path):
    """Rerun with more epochs than it finished under, a finished work dir goes on from its step under a new
    warmup (the rate starts low again), and ends at the new plan."""
    import shutil

    from specd_app.cli import main

    work = tmp_path / "work"
    shutil.copytree(trained["root"] / "work", work)
    before = torch.load(work / "train" / "ckpt.pt", weights_only=False)["state"]
    argv = [*trained["argv"][:5], "--work-dir", str(work), *trained["argv"][7:], "--epochs", "31"]
    assert main(argv) == 0
    after = torch.load(work / "train" / "ckpt.pt", weights_only=False)["state"]
    per_epoch = before["step"] // 30
    assert after["segment_start"] == before["step"] and after["step"] == before["step"] + per_epoch
    assert after["budget"]["epochs"] == 31 and after["done"]


def test_steps_added_only_for_a_larger_budget():
    from draft_training.loop import steps_added

    state = {"step": 100, "train_seconds": 600.0, "budget": {"minutes": 10.0, "epochs": 2}}
    assert steps_added(state, {"minutes": 10.0, "epochs": 2}, planned=1000) == 0  # the same arguments redo nothing
    assert steps_added(state, {"minutes": 15.0, "epochs": 2}, planned=1000) == 50  # 5 more minutes at 6 s a step
    assert steps_added(state, {"minutes": 60.0, "epochs": 2}, planned=300) == 200  # capped by the planned epochs
    assert steps_added(state, {"minutes": 10.0, "epochs": 3}, planned=1500) == 0  # more epochs, but no minutes left
    unlimited = {**state, "budget": {"minutes": 0.0, "epochs": 2}}
    assert steps_added(unlimited, {"minutes": 0.0, "epochs": 3}, planned=150) == 50
