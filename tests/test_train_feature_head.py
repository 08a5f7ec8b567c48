"""`specd train-draft --recipe feature-tiny` end to end on a tiny random target: trains, saves, serves, helps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tiny_models import build_model, build_tokenizer

torch = pytest.importorskip("torch")


def write_prompt_files(data_dir: Path) -> None:
    """Small stand-ins for the shared GSM8K / HumanEval / seed-task files, same fields."""
    data_dir.mkdir()
    rows = {
        "gsm8k_train.jsonl": [
            {"id": f"gsm8k-train-{i}", "category": "math", "prompt": f"Natalia sold {i} clips in April and {2 * i} in May. How many?",
             "reference": f"She sold {i} + {2 * i} = <<{i}+{2 * i}={3 * i}>>{3 * i} clips.\n#### {3 * i}"}
            for i in range(200)
        ],
        "humaneval.jsonl": [{"id": f"HumanEval/{i}", "category": "code", "prompt": f"def add_{i}(a, b):\n"} for i in range(20)],
        "seed_tasks.jsonl": [{"id": f"seed_task_{i}-0", "category": "chat", "prompt": f"hello world, how are you today {i}?",
                              "reference": "I am fine, thank you. " * 12} for i in range(30)],
    }
    for name, items in rows.items():
        (data_dir / name).write_text("".join(json.dumps(item) + "\n" for item in items))


def train_on_a_tiny_target(root: Path, recipe: str, head_scale: float = 3.0) -> dict:
    """`specd train-draft --recipe <recipe>` on a tiny random target and the stand-in prompt files
    (head_scale: see build_model; larger makes the target's distributions more peaked)."""
    from specd_app.cli import main

    target = build_model(root / "target", seed=0, tokenizer=build_tokenizer(), head_scale=head_scale)
    write_prompt_files(root / "data")
    argv = ["train-draft", "--target", str(target), "--recipe", recipe, "--work-dir", str(root / "work"),
            "--data-dir", str(root / "data"), "--device", "cpu", "--threads", "1"]
    assert main(argv) == 0
    return {"root": root, "target": target, "draft": root / "work" / "draft", "argv": argv}


def assert_a_finished_run_resumes_without_redoing_work(trained: dict) -> None:
    """Rerunning with the same work dir finds the data and the finished checkpoint: no new shards, same step."""
    from specd_app.cli import main

    work = trained["root"] / "work"
    shards = sorted(p.name for p in (work / "data").iterdir())
    step = torch.load(work / "train" / "ckpt.pt", weights_only=False)["state"]["step"]
    assert main(trained["argv"] + ["--skip-eval"]) == 0
    assert sorted(p.name for p in (work / "data").iterdir()) == shards
    assert torch.load(work / "train" / "ckpt.pt", weights_only=False)["state"]["step"] == step


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = train_on_a_tiny_target(tmp_path_factory.mktemp("train_feature_head"), "feature-tiny")
    return {**run, "head": run["draft"]}


def test_trained_head_is_small_and_serves_through_make_drafter(trained: dict) -> None:
    import numpy as np

    from draft_service.app import make_drafter
    from specd_engine.features import encode_features
    from specd_common.params import Warp
    from draft_training import feature_data
    from specd_engine.models import load_causal_lm

    for name in ("feature_head.safetensors", "feature_head.json", "recipe.json", "eval.json", "training.json"):
        assert (trained["head"] / name).exists()
    drafter = make_drafter("feature", str(trained["head"]))  # the target comes from the head's own config
    target = load_causal_lm(str(trained["target"]))
    prompt = target.tokenizer("hello world, how are you")["input_ids"]
    session = drafter.open(prompt, Warp())
    drafter.add_features(session, encode_features(feature_data.target_features(target.model, [prompt])[0][:-1], 0))
    assert len(drafter.propose(session, 3, np.random.default_rng(0)).token_ids) == 3


def test_trained_head_drafts_better_than_an_untrained_one(trained: dict) -> None:
    from draft_training.draft_eval import evaluate_drafter
    from draft_service.feature_drafter import FeatureDrafter
    from draft_training.feature_training import build_head, eval_records
    from specd_engine.models import describe_model, load_causal_lm

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


def test_training_goes_on_from_a_saved_head_of_the_same_vocabulary(trained: dict, tmp_path: Path) -> None:
    """`--init-head`: a run starts from a saved head's weights and vocabulary map (fine-tuning, not a fresh
    head), records it in recipe.json, and refuses a head made for another vocabulary. The run also trains
    three drafting steps (`--ttt-passes 3`, the training-time test)."""
    import shutil

    from draft_service.feature_head import CONFIG_FILE, load_head
    from draft_training.feature_training import starting_head
    from specd_app.cli import main
    from specd_engine.models import load_causal_lm

    target = load_causal_lm(str(trained["target"]))
    saved = load_head(trained["head"], target.model)
    start = starting_head(target, trained["head"])
    assert start.training and torch.equal(start.vocab_ids, saved.vocab_ids)
    assert torch.equal(start.fc.weight, saved.fc.weight)

    work = tmp_path / "work"
    shutil.copytree(trained["root"] / "work" / "data", work / "data")  # the same data, not generated again
    argv = [arg if arg != str(trained["root"] / "work") else str(work) for arg in trained["argv"]]
    assert main(argv + ["--init-head", str(trained["head"]), "--epochs", "1", "--skip-eval", "--ttt-passes", "3"]) == 0
    recipe = json.loads((work / "recipe.json").read_text())
    assert recipe["init_head"] == str(trained["head"].resolve()) and recipe["ttt_passes"] == 3
    further = load_head(work / "draft", target.model)
    assert torch.equal(further.vocab_ids, saved.vocab_ids)
    assert not torch.equal(further.fc.weight, saved.fc.weight)  # it trained

    other = tmp_path / "other-vocabulary"
    shutil.copytree(trained["head"], other)
    config = json.loads((other / CONFIG_FILE).read_text())
    (other / CONFIG_FILE).write_text(json.dumps({**config, "vocab_digest": "0" * 16}))
    with pytest.raises(ValueError, match="another vocabulary"):
        starting_head(target, other)


def test_every_recipe_can_be_named_on_the_command_line() -> None:
    from draft_training.cli import MEDUSA_RECIPE_NAMES, RECIPE_NAMES
    from draft_training.feature_training import FEATURE_RECIPES
    from draft_training.medusa_training import MEDUSA_RECIPES

    assert set(RECIPE_NAMES) == set(FEATURE_RECIPES)
    assert set(MEDUSA_RECIPE_NAMES) == set(MEDUSA_RECIPES)


def test_stored_records_are_loaded_for_the_runs_sources_and_with_their_layers(tmp_path):
    """load_feature_records: a run whose sources leave out the reference answers a work dir holds
    trains without them (--reference-rows 0); with layers, only records whose layer outputs are
    stored, each with its own (joined by id, not by order)."""
    from draft_training.distill_data import save_shard
    from draft_training.feature_data import layer_prefix
    from draft_training.feature_training import load_feature_records

    def record(id_: str, value: float) -> dict:
        return {"id": id_, "category": "chat", "tokens": torch.arange(6, dtype=torch.int32), "start": 2,
                "features": torch.full((6, 4), value, dtype=torch.float16)}

    data = tmp_path / "data"
    save_shard(data, "feat-train", [record("corpus:greedy:a", 1.0), record("ref:b", 2.0), record("corpus:greedy:c", 3.0)])
    save_shard(data, layer_prefix([1, 2]), [{"id": i, "layer_features": torch.full((5, 2, 4), v, dtype=torch.float16)}
                                            for i, v in (("corpus:greedy:c", 3.0), ("ref:b", 2.0))])
    every = load_feature_records(tmp_path, 100, generated_repeats=2)
    assert [r["id"] for r in every] == ["corpus:greedy:a"] * 2 + ["ref:b"] + ["corpus:greedy:c"] * 2
    own = load_feature_records(tmp_path, 100, 1, sources=[{"id": "corpus:greedy:a"}, {"id": "corpus:greedy:c"}])
    assert [r["id"] for r in own] == ["corpus:greedy:a", "corpus:greedy:c"]
    layered = load_feature_records(tmp_path, 100, 1, layers=[1, 2])
    assert [r["id"] for r in layered] == ["ref:b", "corpus:greedy:c"]
    assert all(float(r["layer_features"][0, 0, 0]) == float(r["features"][0, 0]) for r in layered)


def test_capped_by_kind_keeps_thin_kinds_whole_and_spreads_the_cap_over_a_large_one():
    from draft_training.feature_training import capped_by_kind

    kinds = ["math"] * 9 + ["chat", "math", "chat"]  # math at 0..8 and 10, chat at 9 and 11
    kept = capped_by_kind(kinds, 3)
    assert kept == [0, 4, 9, 10, 11]  # math's first, middle and last; both chats; original order
    assert capped_by_kind(kinds, 20) == list(range(12))  # a cap above every kind keeps everything
    assert capped_by_kind(kinds, 1) == [0, 9]


def test_kind_repeats_pull_thin_kinds_toward_an_equal_share_within_the_cap():
    from draft_training.feature_training import kind_repeats

    repeats = kind_repeats({"math": 900, "code": 300, "chat": 90, "translation": 10}, max_repeat=4)
    # mean 325: math and code stay once, chat nears it (325/90 = 3.6 → 4), translation is capped at 4
    assert repeats == {"math": 1, "code": 1, "chat": 4, "translation": 4}
    assert kind_repeats({"math": 100, "chat": 100}, 8) == {"math": 1, "chat": 1}  # balanced already
    assert kind_repeats({}, 4) == {}


def test_kind_balance_repeats_thin_kinds_generated_answers_but_not_references(tmp_path):
    from draft_training.distill_data import save_shard
    from draft_training.feature_training import load_feature_records

    def record(id_: str, kind: str, length: int) -> dict:
        return {"id": id_, "category": kind, "tokens": torch.arange(length, dtype=torch.int32), "start": 1,
                "features": torch.zeros((length, 4), dtype=torch.float16)}

    save_shard(tmp_path / "data", "feat-train", [record("corpus:greedy:m", "math", 51), record("corpus:greedy:c", "chat", 11),
                                                  record("ref:r", "chat", 11)])
    ids = [r["id"] for r in load_feature_records(tmp_path, 100, generated_repeats=2, kind_balance=3)]
    # answer positions: math 50, chat 10 (the reference's do not count): mean 30 → chat counts 3 times more
    assert ids.count("corpus:greedy:m") == 2 and ids.count("ref:r") == 1
    assert ids.count("corpus:greedy:c") == 2 * 3
    plain = [r["id"] for r in load_feature_records(tmp_path, 100, generated_repeats=2)]
    assert plain.count("corpus:greedy:c") == 2
