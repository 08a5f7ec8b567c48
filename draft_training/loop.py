"""The training loop every `specd train-draft` recipe shares: batching by answer tokens, a warmup +
cosine schedule, AdamW, checkpoints every two minutes and at the end, and a wall-clock budget, so a
run on a CPU finishes on time and a rerun with the same work dir resumes where it stopped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from draft_training.distill_data import Budget

log = logging.getLogger(__name__)


def write_json(path: Path, value) -> None:
    """Atomic JSON write (tmp + rename)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2))
    os.replace(tmp, path)


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


def learning_rate(step: int, total: int, recipe, start: int = 0) -> float:
    """Linear warmup, then cosine decay to 10% of the peak, over the segment of steps [start, total)."""
    step, total = step - start, total - start
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = min(1.0, (step - recipe.warmup_steps) / max(1, total - recipe.warmup_steps))
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def steps_added(state: dict, asked: dict, planned: int) -> int:
    """Steps a finished run trains on when rerun with a larger budget (--train-minutes, the run's total,
    or --epochs) than it finished under: what the added minutes afford at its measured pace, capped by the
    planned epochs. The next batches in the run's order are ones it has not seen yet. Zero otherwise, so a
    rerun with the same arguments redoes nothing."""
    had = state["budget"]
    more_minutes = bool(asked["minutes"]) and asked["minutes"] > (had["minutes"] or math.inf)
    if not (more_minutes or asked["epochs"] > had["epochs"]) or state["step"] == 0:
        return 0
    affordable = planned - state["step"]
    if asked["minutes"]:
        seconds_per_step = state["train_seconds"] / state["step"]
        affordable = min(affordable, int((asked["minutes"] * 60 - state["train_seconds"]) / seconds_per_step))
    return max(0, affordable)


def save_checkpoint(path: Path, draft, optimizer, state: dict) -> None:
    """Model, optimizer and loop state, atomically."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": draft.state_dict(), "optimizer": optimizer.state_dict(), "state": state}, tmp)
    os.replace(tmp, path)


def train_draft(draft, records: list[dict], recipe, work: Path, device: torch.device, loss_fn) -> dict:
    """Train `draft` on `records`, resuming from train/ckpt.pt; returns the loop state (history included).

    `recipe` has lr, warmup_steps, epochs, batch_tokens, train_minutes and seed;
    loss_fn(draft, batch, device) → (loss, agreement) (feature_training.feature_loss)."""
    ckpt_path = work / "train" / "ckpt.pt"
    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    draft.to(device).train()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.98))
    budget_asked = {"minutes": recipe.train_minutes, "epochs": recipe.epochs}
    state = {"step": 0, "total_steps": 0, "segment_start": 0, "budget": budget_asked, "history": [], "train_seconds": 0.0, "done": False}
    if ckpt_path.exists():
        checkpoint = torch.load(ckpt_path, weights_only=False)
        draft.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        state = {"segment_start": 0, "budget": budget_asked, **checkpoint["state"]}
        log.info("train: resumed at step %d of %d", state["step"], state["total_steps"])
    epoch_batches = len(make_batches(records, recipe.batch_tokens, 0))
    planned = recipe.epochs * epoch_batches
    if state["done"]:
        added = steps_added(state, budget_asked, planned)
        if added <= 0:
            return state
        state.update(done=False, segment_start=state["step"], total_steps=state["step"] + added, budget=budget_asked)
        log.info("train: the larger budget adds %d steps after step %d, under a new warmup and cosine", added, state["step"])
    state["total_steps"] = state["total_steps"] or planned
    log.info("train: %d records, %d answer tokens, %d steps per epoch, %d planned", len(records),
             sum(answer_length(r) for r in records), epoch_batches, planned)
    budget, last_save, window = Budget(max(0.01, recipe.train_minutes - state["train_seconds"] / 60) if recipe.train_minutes else 0), time.monotonic(), []
    batches: dict[int, list[list[int]]] = {}  # this epoch's batches, shuffled once an epoch
    while state["step"] < state["total_steps"] and not budget.spent():
        started = time.monotonic()  # a step's time includes its batch's assembly: the budget is wall time
        epoch, index = divmod(state["step"], epoch_batches)
        if epoch not in batches:
            batches = {epoch: make_batches(records, recipe.batch_tokens, recipe.seed + epoch)}
        batch = [records[i] for i in batches[epoch][index]]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(state["step"], state["total_steps"], recipe, state["segment_start"])
        loss, agreement = loss_fn(draft, batch, device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        if state["step"] + 1 == 10 and device.type == "cuda":  # the budget's estimate below must count the GPU's time, not the queue's
            torch.cuda.synchronize(device)
        state["step"] += 1
        state["train_seconds"] += time.monotonic() - started
        window.append(torch.stack((loss.detach().float(), agreement.detach().float())))  # read at the log line: no sync a step
        if state["step"] == 10 and recipe.train_minutes and state["total_steps"] == planned:
            affordable = int(recipe.train_minutes * 60 / (state["train_seconds"] / 10))
            state["total_steps"] = max(recipe.warmup_steps + 1, min(planned, affordable))
            log.info("train: %.2f s/step; the %.0f-minute budget affords %d steps (%.1f epochs)",
                     state["train_seconds"] / 10, recipe.train_minutes, affordable, affordable / epoch_batches)
        if state["step"] % 10 == 0 or state["step"] == state["total_steps"]:
            mean_loss, mean_agree = torch.stack(window).mean(dim=0).tolist()
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


def write_run_records(output: Path, recipe: dict, report: dict, state: dict) -> None:
    """What a finished run leaves beside the weights: recipe.json (the recipe and the data it saw),
    eval.json (the held-out evaluation) and training.json (steps, time, loss history)."""
    training = {k: state[k] for k in ("step", "total_steps", "train_seconds", "history")}
    for name, value in (("recipe", recipe), ("eval", report), ("training", training)):
        write_json(output / f"{name}.json", value)


def _log_to_file(path: Path) -> None:
    """Mirror this run's log lines into the work dir, so the training log survives with the checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)


def start_run(args, recipe) -> tuple[Path, torch.device, object]:
    """What every train-draft run does first: threads, the log mirrored into the work dir, the recipe
    recorded, the target loaded (float32). Returns (work dir, device, loaded target)."""
    from specd_engine.models import load_causal_lm, pick_device

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    _log_to_file(work / "train-draft.log")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    device = pick_device(args.device)
    log.info("train-draft: recipe %s on %s, %d threads, work dir %s", args.recipe, device, torch.get_num_threads(), work)
    write_json(work / "recipe.json", {"name": args.recipe, "target": args.target, **asdict(recipe)})
    return work, device, load_causal_lm(args.target, device=str(device), dtype="float32")
