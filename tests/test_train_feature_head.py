"""`specd train-draft --recipe feature-tiny` end to end on a tiny random target: trains, saves, serves, helps."""

from __future__ import annotations

import json

import pytest

from tests.test_train_draft import assert_a_finished_run_resumes_without_redoing_work, train_on_a_tiny_target

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = train_on_a_tiny_target(tmp_path_factory.mktemp("train_feature_head"), "feature-tiny")
    return {**run, "head": run["draft"]}


def test_trained_head_is_small_and_serves_through_make_drafter(trained: dict) -> None:
    import numpy as np

    from draft_service.app import make_drafter
    from specd_common.features import encode_features
    from specd_common.params import Warp
    from draft_service import feature_data
    from specd_common.models import load_causal_lm

    for name in ("feature_head.safetensors", "feature_head.json", "recipe.json", "eval.json", "training.json"):
        assert (trained["head"] / name).exists()
    drafter = make_drafter("feature", str(trained["head"]))  # the target comes from the head's own config
    target = load_causal_lm(str(trained["target"]))
    prompt = target.tokenizer("hello world, how are you")["input_ids"]
    session = drafter.open(prompt, Warp())
    drafter.add_features(session, encode_features(feature_data.target_features(target.model, [prompt])[0][:-1], 0))
    assert len(drafter.propose(session, 3, np.random.default_rng(0)).token_ids) == 3


def test_trained_head_drafts_better_than_an_untrained_one(trained: dict) -> None:
    from draft_service.draft_eval import evaluate_drafter
    from draft_service.feature_drafter import FeatureDrafter
    from draft_service.feature_training import build_head, eval_records
    from specd_common.models import describe_model, load_causal_lm

    target = load_causal_lm(str(trained["target"]))
    held_out = eval_records(target, trained["root"] / "work", 0)
    assert held_out, "the run keeps held-out answers for evaluation"
    trained_report = json.loads((trained["head"] / "eval.json").read_text())["draft"]
    vocab = torch.load(trained["root"] / "work" / "train" / "vocab.pt")
    untrained = FeatureDrafter(build_head(target, vocab, "").eval(), describe_model(target), 512)
    before = evaluate_drafter(untrained, held_out, ks=(3,))["k=3"]["all"]["tokens_per_pass"]
    after = trained_report["k=3"]["all"]["tokens_per_pass"]
    assert after > before + 0.2, (before, after)


def test_a_finished_run_resumes_without_redoing_work(trained: dict) -> None:
    assert_a_finished_run_resumes_without_redoing_work(trained)
