"""Self-distillation data: the target's own greedy answers, and its top-k next-token distribution.

`generate`: the target answers prompts greedily (batched); the logits of each generation step are
exactly the teacher signal for that position, so generating yields text and targets at once. Public
reference answers are read as they are (`clean_reference`); feature_data.py runs the target over them.

A record: tokens [T] (chat-templated prompt + answer), `start` (first answer position), and for each
answer position j in [start, T) the target's top-k at the position before it: topk_ids [T - start, K]
(int32) and topk_logits [T - start, K] (float16). Shards are written atomically and a resumed run
skips prompt ids already stored, so an interrupted stage loses at most one batch.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

log = logging.getLogger(__name__)


@dataclass
class Budget:
    """A wall-clock limit for a stage; minutes <= 0 means unlimited."""

    minutes: float

    def __post_init__(self) -> None:
        self.started = time.monotonic()

    def spent(self) -> bool:
        return self.minutes > 0 and time.monotonic() - self.started > self.minutes * 60


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as one user message through the chat template (as the gateway sends it)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def save_shard(directory: Path, prefix: str, records: list[dict]) -> Path:
    """Write records as the next numbered shard, atomically (tmp + rename)."""
    directory.mkdir(parents=True, exist_ok=True)
    index = len(list(directory.glob(f"{prefix}-*.pt")))
    path = directory / f"{prefix}-{index:05d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(records, tmp)
    os.replace(tmp, path)
    return path


def load_records(directory: Path, prefix: str) -> list[dict]:
    """Every record of every shard with this prefix, in shard order."""
    records: list[dict] = []
    for path in sorted(directory.glob(f"{prefix}-*.pt")):
        records.extend(torch.load(path, weights_only=False))
    return records


def stored_ids(directory: Path, prefix: str) -> set[str]:
    """Prompt ids already distilled (for resuming)."""
    return {record["id"] for record in load_records(directory, prefix)}


def _length_sorted_batches(rows: list[dict], lengths: list[int], batch_size: int) -> Iterator[list[int]]:
    """Indices in batches of similar prompt length (less padding), chunk by chunk so order stays mixed."""
    chunk = batch_size * 4
    for begin in range(0, len(rows), chunk):
        order = sorted(range(begin, min(begin + chunk, len(rows))), key=lambda i: lengths[i])
        for offset in range(0, len(order), batch_size):
            yield order[offset : offset + batch_size]


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] → (ids [..., k] int32, logits [..., k] float16), sorted best first."""
    values, ids = torch.topk(logits.float(), k, dim=-1)
    return ids.to(torch.int32), values.to(torch.float16)


def left_padded(prompts: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned for batched generation: input ids and attention mask, both [B, longest]."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, width]
    attention = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, width]
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention[row, width - len(prompt) :] = 1
    return input_ids, attention


def cut_at_eos(answer: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """The answer up to and including its first end-of-sequence token (all of it when there is none)."""
    length = next((i + 1 for i, token in enumerate(answer) if token in eos_ids), len(answer))
    return list(answer[:length])


@torch.inference_mode()
def generate_batch(model, prompts: Sequence[list[int]], max_new_tokens: int, eos_ids: Sequence[int], pad_id: int, top_k: int) -> list[dict]:
    """Greedy answers for a batch of prompts (left-padded), with the top-k of every step's logits."""
    device = next(model.parameters()).device
    input_ids, attention = left_padded(prompts, pad_id)
    width = input_ids.shape[1]
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=pad_id,
        eos_token_id=list(eos_ids),
    )
    answers = output.sequences[:, width:].cpu()  # [B, steps]
    ids, values = _topk(torch.stack(output.logits, dim=1).cpu(), top_k)  # [B, steps, K] each
    records = []
    for row, prompt in enumerate(prompts):
        answer = answers[row].tolist()
        length = len(cut_at_eos(answer, eos_ids))
        records.append(
            {
                "tokens": torch.tensor(prompt + answer[:length], dtype=torch.int32),
                "start": len(prompt),
                "topk_ids": ids[row, :length].clone(),
                "topk_logits": values[row, :length].clone(),
            }
        )
    return records


def generate_stage(
    model, tokenizer, rows: list[dict], directory: Path, prefix: str, *, batch_size: int, max_new_tokens: int,
    top_k: int, eos_ids: Sequence[int], budget: Budget,
) -> int:
    """Distil target answers for `rows` into shards; resumable; stops at the budget. Returns stored count."""
    done = stored_ids(directory, prefix)
    todo = [row for row in rows if row["id"] not in done]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    prompts = [chat_prompt_ids(tokenizer, row["prompt"]) for row in todo]
    log.info("generate[%s]: %d prompts stored, %d to go", prefix, len(done), len(todo))
    started, tokens = time.monotonic(), 0
    for batch in _length_sorted_batches(todo, [len(p) for p in prompts], batch_size):
        if budget.spent():
            log.info("generate[%s]: time budget of %.0f min spent", prefix, budget.minutes)
            break
        records = generate_batch(model, [prompts[i] for i in batch], max_new_tokens, eos_ids, pad_id, top_k)
        for index, record in zip(batch, records):
            record.update(id=todo[index]["id"], category=todo[index]["category"])
        save_shard(directory, prefix, records)
        done.update(todo[i]["id"] for i in batch)
        tokens += sum(len(r["topk_ids"]) for r in records)
        elapsed = time.monotonic() - started
        log.info("generate[%s]: %d/%d prompts, %d answer tokens this run, %.1f tok/s", prefix, len(done), len(rows), tokens, tokens / elapsed)
    return len(done)


def clean_reference(row: dict) -> str:
    """A public reference answer as plain prose: GSM8K calculator marks removed, '#### n' spelled out."""
    text = re.sub(r"<<[^>]*>>", "", row.get("reference", ""))
    return re.sub(r"\n?#### *(.+)$", r"\nThe answer is \1.", text.strip())
