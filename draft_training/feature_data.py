"""Training data for a feature head: token sequences with the target's last hidden state at every position.

A feature head (draft_service/feature_head.py) reads the target's features, so its data is the
target's own view of text: one teacher-forced forward per batch of sequences gives the final
(post-norm) hidden state at every position, from which the target's next-token distribution is
recomputed on the fly (head(feature)), so nothing else needs storing.

Sequences come from two places, both reusing distill_data:
- the target's greedy answers to training prompts of every task kind (`gen-train` shards): text in
  exactly the distribution the draft will meet when serving;
- public reference answers (GSM8K, seed tasks, HumanEval solutions): about 5x cheaper per token
  (no generation), the context is not the target's but its features and next-token choices are.

A record: id, category, tokens [T] int32, start (first answer position), features [T, H] float16.
Shards are written atomically under <work-dir>/data with prefix `feat-train`; a resumed run skips
ids already stored.

Heads that fuse lower layers (EAGLE-3's low/middle/high fusion; verify_service/medusa.py) also read
the outputs of some decoder layers. Those live in shards of their own (`layer_prefix`: records
of id and layer_features [T - start + 1, L, H] float16, the rows from start - 1 on, the only rows
a head reads), so the final-layer shards stay as they are and the extra layers can be extracted
later, for part of the records, resumably.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence

import torch

from draft_training import distill_data
from draft_training.distill_data import Budget, chat_prompt_ids, clean_reference

log = logging.getLogger(__name__)


def layer_prefix(layers: Sequence[int]) -> str:
    """The shard prefix of the outputs of decoder layers `layers` (1-based; see target_layers)."""
    return "feat-layers-" + "-".join(map(str, layers))


def right_padded(sequences: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask [B, width] for a right-padded forward, on `device`; causal
    attention makes the padding harmless to real positions."""
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros((len(sequences), width), dtype=torch.long)  # [B, width]
    attention = torch.zeros((len(sequences), width), dtype=torch.long)  # [B, width]
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.as_tensor(sequence)
        attention[row, : len(sequence)] = 1
    return input_ids.to(device), attention.to(device)


@torch.inference_mode()
def _padded_forward(model, sequences: Sequence[list[int]], hidden_states: bool = False):
    """One right-padded forward of the target's decoder over the batch. Returns the model's output
    (hidden_states too when asked)."""
    input_ids, attention = right_padded(sequences, next(model.parameters()).device)
    return model.model(input_ids=input_ids, attention_mask=attention, output_hidden_states=hidden_states)


def _final_rows(output, sequences: Sequence[list[int]]) -> list[torch.Tensor]:
    """A padded forward's final hidden state at every position of each sequence → [len(s), H] float16 each."""
    hidden = output.last_hidden_state  # [B, width, H]
    return [hidden[row, : len(sequence)].to(torch.float16).cpu() for row, sequence in enumerate(sequences)]


def _layer_rows(output, sequences: Sequence[list[int]], starts: Sequence[int], layers: Sequence[int]) -> list[torch.Tensor]:
    """A padded forward's outputs of decoder layers `layers` (1-based: layer l's output is
    hidden_states[l], before the final norm) at the rows start - 1 .. len(s) - 1 of each sequence →
    [len(s) - start + 1, L, H] float16 each: what fusing heads read besides the final features."""
    stacked = torch.stack([output.hidden_states[layer] for layer in layers], dim=2)  # [B, width, L, H]
    return [stacked[row, start - 1 : len(sequence)].to(torch.float16).cpu() for row, (sequence, start) in enumerate(zip(sequences, starts))]


def target_features(model, sequences: Sequence[list[int]]) -> list[torch.Tensor]:
    """The target's final hidden state at every position of each sequence → [len(s), H] float16 each."""
    return _final_rows(_padded_forward(model, sequences), sequences)


def target_layers(model, sequences: Sequence[list[int]], starts: Sequence[int], layers: Sequence[int]) -> list[torch.Tensor]:
    """The outputs of decoder layers `layers` at the rows start - 1 on (_layer_rows) → [len(s) - start + 1, L, H] each."""
    return _layer_rows(_padded_forward(model, sequences, hidden_states=True), sequences, starts, layers)


def target_features_and_layers(model, sequences: Sequence[list[int]], starts: Sequence[int],
                               layers: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """target_features and target_layers from one forward (what fusing heads' evaluation reads)."""
    output = _padded_forward(model, sequences, hidden_states=True)
    return _final_rows(output, sequences), _layer_rows(output, sequences, starts, layers)


def reference_sequence(tokenizer, row: dict, max_answer_tokens: int) -> tuple[list[int], int]:
    """Chat-templated prompt + the row's public reference answer (cut), and where the answer starts."""
    prompt = chat_prompt_ids(tokenizer, row["prompt"])
    answer = tokenizer(clean_reference(row), add_special_tokens=False)["input_ids"][:max_answer_tokens]
    return prompt + answer, len(prompt)


def feature_stage(
    model, sources: list[dict], directory: Path, *, batch_size: int, budget: Budget, prefix: str = "feat-train",
    layers: Sequence[int] = (),
) -> int:
    """Store features for `sources` (dicts with id, category, tokens, start) in length-sorted batches:
    the final features, or with `layers` those layers' outputs (target_layers) under layer_prefix.

    Resumable; stops at the budget. Returns the number of stored records."""
    prefix = layer_prefix(layers) if layers else prefix
    done = distill_data.stored_ids(directory, prefix)
    todo = [source for source in sources if source["id"] not in done]
    log.info("features[%s]: %d stored, %d to go", prefix, len(done), len(todo))
    started, tokens = time.monotonic(), 0
    lengths = [len(source["tokens"]) for source in todo]
    for batch in distill_data._length_sorted_batches(todo, lengths, batch_size):
        if budget.spent():
            log.info("features[%s]: time budget of %.0f min spent", prefix, budget.minutes)
            break
        chosen = [todo[i] for i in batch]
        sequences = [list(map(int, s["tokens"])) for s in chosen]
        if layers:
            rows = target_layers(model, sequences, [int(s["start"]) for s in chosen], layers)
            records = [{"id": s["id"], "layer_features": r} for s, r in zip(chosen, rows)]
        else:
            records = [
                {"id": s["id"], "category": s["category"], "tokens": torch.as_tensor(s["tokens"], dtype=torch.int32),
                 "start": int(s["start"]), "features": f}
                for s, f in zip(chosen, target_features(model, sequences))
            ]
        distill_data.save_shard(directory, prefix, records)
        done.update(s["id"] for s in chosen)
        tokens += sum(len(s["tokens"]) for s in chosen)
        log.info("features[%s]: %d records, %d tokens this run, %.1f tok/s", prefix, len(done), tokens, tokens / (time.monotonic() - started))
    return len(done)


def feature_sources(tokenizer, generated: list[dict], references: list[dict], max_answer_tokens: int) -> list[dict]:
    """What to extract features for: generated answers first (the serving distribution), then references.

    References are interleaved by kind, so a budget-stopped run keeps every kind it had."""
    sources = [{"id": r["id"], "category": r["category"], "tokens": r["tokens"], "start": r["start"]} for r in generated]
    for row in references:
        tokens, start = reference_sequence(tokenizer, row, max_answer_tokens)
        if len(tokens) > start:
            sources.append({"id": "ref:" + row["id"], "category": row["category"], "tokens": tokens, "start": start})
    return sources
