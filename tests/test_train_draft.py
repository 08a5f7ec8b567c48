"""`specd train-draft --recipe tiny` end to end on a tiny random target: it trains, saves, serves, and helps.

Runs in well under two minutes on one CPU thread: a few dozen prompts, 24-token answers, a 1-layer
32-wide draft. The held-out answers come from prompts the run never trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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


def train_on_a_tiny_target(root: Path, recipe: str) -> dict:
    """`specd train-draft --recipe <recipe>` on a tiny random target and the stand-in prompt files."""
    from specd_common.cli import main

    target = build_model(root / "target", seed=0, tokenizer=build_tokenizer())
    write_prompt_files(root / "data")
    argv = ["train-draft", "--target", str(target), "--recipe", recipe, "--work-dir", str(root / "work"),
            "--data-dir", str(root / "data"), "--device", "cpu", "--threads", "1"]
    assert main(argv) == 0
    return {"root": root, "target": target, "draft": root / "work" / "draft", "argv": argv}


def assert_a_finished_run_resumes_without_redoing_work(trained: dict) -> None:
    """Rerunning with the same work dir finds the data and the finished checkpoint: no new shards, same step."""
    from specd_common.cli import main

    work = trained["root"] / "work"
    shards = sorted(p.name for p in (work / "data").iterdir())
    step = torch.load(work / "train" / "ckpt.pt", weights_only=False)["state"]["step"]
    assert main(trained["argv"] + ["--skip-eval"]) == 0
    assert sorted(p.name for p in (work / "data").iterdir()) == shards
    assert torch.load(work / "train" / "ckpt.pt", weights_only=False)["state"]["step"] == step


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return train_on_a_tiny_target(tmp_path_factory.mktemp("train_draft"), "tiny")


def test_trained_draft_is_a_normal_model_folder_that_serves(trained: dict) -> None:
    from draft_service.drafters import ModelDrafter
    from specd_common.models import load_causal_lm, vocab_digest
    from specd_common.params import Warp

    draft, target = load_causal_lm(str(trained["draft"])), load_causal_lm(str(trained["target"]))
    assert vocab_digest(draft.tokenizer) == vocab_digest(target.tokenizer)
    drafter = ModelDrafter(draft)
    session = drafter.open(target.tokenizer("hello world")["input_ids"], Warp())
    proposal = drafter.propose(session, 3, np.random.default_rng(0))
    assert len(proposal.token_ids) == 3
    for name in ("recipe.json", "eval.json", "training.json", "config.json", "model.safetensors"):
        assert (trained["draft"] / name).exists()


def test_trained_draft_agrees_with_the_target_more_than_an_untrained_one(trained: dict) -> None:
    from draft_service.distill_data import load_records
    from draft_service.draft_eval import teacher_forced_agreement
    from draft_service.draft_model import build_draft
    from draft_service.training import RECIPES
    from specd_common.models import load_causal_lm

    held_out = load_records(trained["root"] / "work" / "data", "gen-eval")
    assert held_out, "the run keeps held-out answers for evaluation"
    target = load_causal_lm(str(trained["target"]))
    untrained = build_draft(target.model, RECIPES["tiny"].shape).eval()
    draft = load_causal_lm(str(trained["draft"]), dtype="float32")
    before = teacher_forced_agreement(untrained, held_out)
    after = teacher_forced_agreement(draft.model, held_out)
    assert after > before + 0.1, (before, after)
    report = json.loads((trained["draft"] / "eval.json").read_text())
    assert report["draft"]["k=3"]["all"]["tokens_per_pass"] > 1.0


def test_a_finished_run_resumes_without_redoing_work(trained: dict) -> None:
    assert_a_finished_run_resumes_without_redoing_work(trained)


def test_fast_evaluation_equals_round_by_round_serving(trained: dict) -> None:
    """The teacher-forced shortcut counts exactly the rounds ModelDrafter's open/propose/commit would."""
    from draft_service.distill_data import load_records
    from draft_service.draft_eval import evaluate_drafter, evaluate_model
    from draft_service.drafters import ModelDrafter
    from specd_common.models import load_causal_lm

    held_out = load_records(trained["root"] / "work" / "data", "gen-eval")
    draft = load_causal_lm(str(trained["draft"]), dtype="float32")
    assert evaluate_model(draft.model, held_out) == evaluate_drafter(ModelDrafter(draft), held_out)
