"""`specd train-draft`: distil a small draft model from a target, resumably, under a time budget.

Stages, each resumable from <work-dir>:
  1. data   — the target's greedy answers to held-out prompts (for eval) and to training prompts,
              then its distributions on public reference answers (teacher-forced), as shards in data/;
  2. train  — the draft (draft_model.py) learns the target's top-k next-token distribution on the
              answer positions (soft cross-entropy), checkpointing to train/ckpt.pt;
  3. eval   — simulated greedy speculation on the held-out answers (draft_eval.py), per task kind;
  4. save   — a normal transformers folder (bf16 safetensors + the target's tokenizer) in <output>.
Stages stop at their wall-clock budget, so a CPU run finishes on time with whatever data it has;
a GPU (auto-detected) simply gets further within the same budget.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from draft_service import distill_data
from draft_service.distill_data import Budget
from draft_service.draft_model import DraftShape, build_draft
from draft_service.draft_report import render_readme
from draft_service.train_prompts import KINDS, load_all_prompts, select_prompts

log = logging.getLogger(__name__)


@dataclass
class Recipe:
    """Everything that decides the result; saved next to the draft so it can be reproduced."""

    train_per_kind: dict = field(default_factory=dict)  # kind → max training prompts
    eval_per_kind: int = 12  # held-out prompts per kind
    held_out_fraction: float = 0.1
    max_new_tokens: int = 128
    gen_batch: int = 16
    teacher_force_rows: int = 0  # extra rows with public reference answers (GSM8K, seed tasks)
    top_k: int = 32
    shape: DraftShape = field(default_factory=DraftShape)
    epochs: int = 8
    batch_tokens: int = 2048  # answer positions per optimizer step (about)
    lr: float = 2e-3
    warmup_steps: int = 30
    gen_minutes: float = 0.0  # budgets; 0 = unlimited
    tf_minutes: float = 0.0
    train_minutes: float = 0.0
    seed: int = 0


RECIPES = {
    # A test-sized run on a tiny target: seconds on one CPU thread.
    "tiny": Recipe(
        train_per_kind={kind: 6 for kind in KINDS}, eval_per_kind=2, max_new_tokens=24, gen_batch=8,
        teacher_force_rows=8, top_k=8, shape=DraftShape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64),
        epochs=30, batch_tokens=256, lr=1e-2, warmup_steps=5,
    ),
    # The shipped CPU run: every stage bounded so the whole recipe takes about 90 minutes on one thread.
    "cpu": Recipe(
        train_per_kind={"math": 600, "code": 190, "chat": 160, "writing": 220, "translation": 165, "summarization": 290, "qa": 135},
        eval_per_kind=12, teacher_force_rows=3000, gen_minutes=40, tf_minutes=8, train_minutes=30,
        batch_tokens=1024, lr=3e-3, warmup_steps=10,
    ),
    # With a GPU: all prompts, longer answers, no budgets.
    "full": Recipe(
        train_per_kind={kind: 100_000 for kind in KINDS}, eval_per_kind=24, max_new_tokens=256, gen_batch=64,
        teacher_force_rows=8000, epochs=4, batch_tokens=16384, lr=1e-3,
        shape=DraftShape(hidden=192, layers=2, heads=3, kv_heads=1, intermediate=512),
    ),
}


def resolve_recipe(name: str, overrides: dict) -> Recipe:
    """A named recipe with command-line overrides (only those given)."""
    recipe = replace(RECIPES[name], **{k: v for k, v in overrides.items() if v is not None})
    return recipe


def run_data_stages(target, recipe: Recipe, data_dir: Path, work: Path) -> None:
    """Stage 1: eval answers, training answers, then teacher-forced reference answers."""
    from specd_common.models import eos_token_ids

    rows = load_all_prompts(data_dir)
    eos = eos_token_ids(target)
    common = dict(batch_size=recipe.gen_batch, max_new_tokens=recipe.max_new_tokens, top_k=recipe.top_k, eos_ids=eos)
    eval_rows = select_prompts(rows, {k: recipe.eval_per_kind for k in KINDS}, True, recipe.held_out_fraction, recipe.seed)
    distill_data.generate_stage(target.model, target.tokenizer, eval_rows, work / "data", "gen-eval", budget=Budget(0), **common)
    train_rows = select_prompts(rows, recipe.train_per_kind, False, recipe.held_out_fraction, recipe.seed)
    distill_data.generate_stage(
        target.model, target.tokenizer, train_rows, work / "data", "gen-train", budget=Budget(recipe.gen_minutes), **common
    )
    if recipe.teacher_force_rows:
        generated = {row["id"] for row in train_rows}
        references = [row for row in select_prompts(rows, {k: 100_000 for k in KINDS}, False, recipe.held_out_fraction, recipe.seed)
                      if row.get("reference") and row["id"] not in generated][: recipe.teacher_force_rows]
        distill_data.teacher_force_stage(
            target.model, target.tokenizer, references, work / "data", "tf-train", batch_size=recipe.gen_batch,
            top_k=recipe.top_k, max_answer_tokens=recipe.max_new_tokens, budget=Budget(recipe.tf_minutes),
        )


def write_json(path: Path, value) -> None:
    """Atomic JSON write (tmp + rename)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2))
    os.replace(tmp, path)


def training_records(work: Path, max_length: int) -> list[dict]:
    """Generated and teacher-forced training records, each cut to the draft's context length."""
    records = distill_data.load_records(work / "data", "gen-train") + distill_data.load_records(work / "data", "tf-train")
    kept = []
    for record in records:
        cut = min(len(record["tokens"]), max_length)
        if cut - record["start"] >= 1:
            answer = cut - record["start"]
            kept.append(dict(record, tokens=record["tokens"][:cut], topk_ids=record["topk_ids"][:answer], topk_logits=record["topk_logits"][:answer]))
    return kept


def answer_length(record: dict) -> int:
    """Answer positions of a record (where the loss is taken)."""
    return len(record["tokens"]) - record["start"]


def make_batches(records: list[dict], batch_tokens: int, seed: int) -> list[list[int]]:
    """Shuffled record indices grouped so each batch has about `batch_tokens` answer positions."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    batches, current, size = [], [], 0
    for index in order:
        current.append(index)
        size += answer_length(records[index])
        if size >= batch_tokens:
            batches.append(current)
            current, size = [], 0
    if current:
        batches.append(current)
    return batches


def distillation_loss(draft, batch: list[dict], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy against the target's renormalised top-k at every answer position.

    Returns (loss, agreement) where agreement is the fraction of positions whose draft argmax is
    the target's argmax: the quantity greedy acceptance depends on.
    """
    width = max(len(r["tokens"]) for r in batch)
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B, W], right-padded
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for i, record in enumerate(batch):
        input_ids[i, : len(record["tokens"])] = record["tokens"].long()
        attention[i, : len(record["tokens"])] = 1
    hidden = draft.model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).last_hidden_state  # [B, W, d]
    rows = torch.cat([hidden[i, r["start"] - 1 : len(r["tokens"]) - 1] for i, r in enumerate(batch)])  # [N, d]
    log_q = torch.log_softmax(draft.lm_head(rows).float(), dim=-1)  # [N, V]
    topk_ids = torch.cat([r["topk_ids"] for r in batch]).long().to(device)  # [N, K]
    p = torch.softmax(torch.cat([r["topk_logits"] for r in batch]).float().to(device), dim=-1)  # [N, K]
    loss = -(p * log_q.gather(1, topk_ids)).sum(dim=1).mean()
    agreement = (log_q.argmax(dim=1) == topk_ids[:, 0]).float().mean()
    return loss, agreement


def learning_rate(step: int, total: int, recipe: Recipe) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = min(1.0, (step - recipe.warmup_steps) / max(1, total - recipe.warmup_steps))
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(path: Path, draft, optimizer, state: dict) -> None:
    """Model, optimizer and loop state, atomically."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": draft.state_dict(), "optimizer": optimizer.state_dict(), "state": state}, tmp)
    os.replace(tmp, path)


def train_draft(draft, records: list[dict], recipe: Recipe, work: Path, device: torch.device, loss_fn=distillation_loss) -> dict:
    """Stage 2: distil into `draft`, resuming from train/ckpt.pt; returns the loop state (history included).

    loss_fn(draft, batch, device) → (loss, agreement); the feature head brings its own (feature_training.py)."""
    ckpt_path = work / "train" / "ckpt.pt"
    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    draft.to(device).train()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.98))
    state = {"step": 0, "total_steps": 0, "history": [], "train_seconds": 0.0, "done": False}
    if ckpt_path.exists():
        checkpoint = torch.load(ckpt_path, weights_only=False)
        draft.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        state = checkpoint["state"]
        log.info("train: resumed at step %d of %d", state["step"], state["total_steps"])
    if state["done"]:
        return state
    epoch_batches = len(make_batches(records, recipe.batch_tokens, 0))
    planned = recipe.epochs * epoch_batches
    state["total_steps"] = state["total_steps"] or planned
    log.info("train: %d records, %d answer tokens, %d steps per epoch, %d planned", len(records),
             sum(answer_length(r) for r in records), epoch_batches, planned)
    budget, last_save, window = Budget(max(0.01, recipe.train_minutes - state["train_seconds"] / 60) if recipe.train_minutes else 0), time.monotonic(), []
    while state["step"] < state["total_steps"] and not budget.spent():
        epoch, index = divmod(state["step"], epoch_batches)
        batch = [records[i] for i in make_batches(records, recipe.batch_tokens, recipe.seed + epoch)[index]]
        started = time.monotonic()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(state["step"], state["total_steps"], recipe)
        loss, agreement = loss_fn(draft, batch, device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        state["step"] += 1
        state["train_seconds"] += time.monotonic() - started
        window.append((loss.item(), agreement.item()))
        if state["step"] == 10 and recipe.train_minutes and state["total_steps"] == planned:
            affordable = int(recipe.train_minutes * 60 / (state["train_seconds"] / 10))
            state["total_steps"] = max(recipe.warmup_steps + 1, min(planned, affordable))
            log.info("train: %.2f s/step; the %.0f-minute budget affords %d steps (%.1f epochs)",
                     state["train_seconds"] / 10, recipe.train_minutes, affordable, affordable / epoch_batches)
        if state["step"] % 10 == 0 or state["step"] == state["total_steps"]:
            mean_loss, mean_agree = (sum(v) / len(window) for v in zip(*window))
            state["history"].append({"step": state["step"], "epoch": round(state["step"] / epoch_batches, 2), "loss": round(mean_loss, 4), "agreement": round(mean_agree, 4)})
            log.info("train: step %d/%d epoch %.2f loss %.3f agreement %.3f lr %.2e (%.0f s)", state["step"], state["total_steps"],
                     state["step"] / epoch_batches, mean_loss, mean_agree, optimizer.param_groups[0]["lr"], state["train_seconds"])
            window = []
        if time.monotonic() - last_save > 120:
            save_checkpoint(ckpt_path, draft, optimizer, state)
            last_save = time.monotonic()
    state["done"] = True
    save_checkpoint(ckpt_path, draft, optimizer, state)
    draft.eval()
    return state


def evaluation(draft_loaded, target, work: Path, limit: int) -> dict:
    """Stage 3: simulated greedy speculation on held-out answers (trained draft and n-gram), and cost."""
    from draft_service.draft_eval import cost_report, evaluate_drafter, evaluate_model, teacher_forced_agreement
    from draft_service.drafters import NgramDrafter

    records = distill_data.load_records(work / "data", "gen-eval")[: limit or None]
    log.info("eval: %d held-out answers, %d tokens", len(records), sum(len(r["topk_ids"]) for r in records))
    prompt = records[0]["tokens"][: records[0]["start"]].tolist() if records else [0]
    return {
        "held_out_answers": len(records),
        "teacher_forced_agreement": round(teacher_forced_agreement(draft_loaded.model, records), 4),
        "draft": evaluate_model(draft_loaded.model, records),
        "ngram": evaluate_drafter(NgramDrafter(), records),
        "cost": cost_report(draft_loaded, target, prompt),
    }


def save_draft(draft, tokenizer, output: Path, extra: dict) -> None:
    """Stage 4: a transformers folder (bf16 safetensors, the target's tokenizer) plus the run's JSON records."""
    output.mkdir(parents=True, exist_ok=True)
    draft.to(torch.bfloat16).save_pretrained(output)
    tokenizer.save_pretrained(output)
    for name, value in extra.items():
        write_json(output / f"{name}.json", value)
    (output / "README.md").write_text(render_readme(output.name, extra["recipe"], extra["training"], extra["eval"]))
    size = sum(p.stat().st_size for p in output.iterdir() if p.is_file())
    log.info("saved the draft to %s (%.1f MB)", output, size / 1e6)


def _log_to_file(path: Path) -> None:
    """Mirror this run's log lines into the work dir, so the training log survives with the checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)


def start_run(args, recipe) -> tuple[Path, torch.device, object]:
    """What every train-draft run does first: threads, the log mirrored into the work dir, the recipe
    recorded, the target loaded (float32). Returns (work dir, device, loaded target)."""
    from specd_common.models import load_causal_lm, pick_device

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    _log_to_file(work / "train-draft.log")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    device = pick_device(args.device)
    log.info("train-draft: recipe %s on %s, %d threads, work dir %s", args.recipe, device, torch.get_num_threads(), work)
    write_json(work / "recipe.json", {"name": args.recipe, "target": args.target, **asdict(recipe)})
    return work, device, load_causal_lm(args.target, device=str(device), dtype="float32")


def run_train_draft(args) -> int:
    """The `specd train-draft` command: data → train → eval → save, each stage resumable."""
    from specd_common.models import LoadedModel

    overrides = {"gen_minutes": args.gen_minutes, "tf_minutes": args.tf_minutes, "train_minutes": args.train_minutes, "epochs": args.epochs}
    recipe = resolve_recipe(args.recipe, overrides)
    work, device, target = start_run(args, recipe)
    run_data_stages(target, recipe, Path(args.data_dir), work)
    records = training_records(work, target.model.config.max_position_embeddings)
    draft = build_draft(target.model, recipe.shape, recipe.seed)
    state = train_draft(draft, records, recipe, work, device)
    draft_loaded = LoadedModel(name=f"draft-for-{args.target}", model=draft.eval(), tokenizer=target.tokenizer, device=device)
    if args.skip_eval:  # keep an earlier evaluation of this (finished) checkpoint, if there is one
        report = json.loads((work / "eval.json").read_text()) if (work / "eval.json").exists() else {}
    else:
        report = evaluation(draft_loaded, target, work, args.eval_limit)
        write_json(work / "eval.json", report)
    output = Path(args.output or work / "draft")
    data_summary = {"train_records": len(records), "train_answer_tokens": sum(len(r["topk_ids"]) for r in records)}
    save_draft(draft, target.tokenizer, output, {
        "recipe": {"name": args.recipe, "target": args.target, **asdict(recipe), **data_summary},
        "eval": report, "training": {k: state[k] for k in ("step", "total_steps", "train_seconds", "history")},
    })
    return 0

