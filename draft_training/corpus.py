"""The draft-training corpus kept in the repository: the target's own answers as token ids, accumulated.

Generating answers is the costly step on a CPU (the target decodes every token), and token ids are
small, so every session adds to one corpus instead of regenerating: `specd draft-corpus --minutes N`
answers prompts not yet in it, greedy and sampled, and appends a shard. Features and teacher signals
are recomputed from the ids by one teacher-forced pass (draft_training/feature_data.py), which costs
a fraction of generating.

Layout: draft_training/corpus/<target name>/answers-NNNNN.npz, each shard holding
  tokens  uint16 [N]   every record's prompt + answer ids, concatenated (vocabularies < 65,536)
  offsets int64 [R+1]  record r is tokens[offsets[r]:offsets[r+1]]
  starts  int32 [R]    first answer position of each record (the prompt is before it)
  ids, kinds, modes    str [R]  prompt id, task kind, "greedy" or "sampled"
plus recipe.json (how answers are made). Shards are written atomically; a rerun skips (id, mode)
pairs already stored, so an interrupted run loses at most one batch.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from draft_training.distill_data import Budget, chat_prompt_ids, cut_at_eos, left_padded
from draft_training.train_prompts import is_held_out, load_all_prompts, read_jsonl

log = logging.getLogger(__name__)

CORPUS_ROOT = Path(__file__).resolve().parent / "corpus"
# prompts the target writes itself (self_prompts): how long a user turn may run, how short it may be, a seed offset
SELF_PROMPT_MAX_TOKENS, SELF_PROMPT_MIN_TOKENS, SELF_PROMPT_SEED = 96, 6, 1_000_003
EXTRA_SETS = {"gpteacher_roleplay.jsonl": "roleplay", "gpteacher_codegen.jsonl": "code"}


@dataclass(frozen=True)
class CorpusRecipe:
    """How the corpus's answers are made; saved beside it so a session extends it the same way."""

    max_new_tokens: int = 192
    max_prompt_tokens: int = 768
    sampled_share: float = 0.25  # this share of prompts (by id hash) is also answered with sampling
    temperature: float = 0.7
    top_p: float = 0.9
    held_out_fraction: float = 0.1  # the same split as train_prompts: held-out prompts are never answered here
    seed: int = 0


@dataclass
class Record:
    tokens: list[int]
    start: int
    id: str
    kind: str
    mode: str  # "greedy" or "sampled"


@dataclass
class Corpus:
    """The shards of one target's corpus, read lazily."""

    directory: Path
    records: list[Record] = field(default_factory=list)

    @classmethod
    def open(cls, directory: Path) -> "Corpus":
        corpus = cls(directory)
        for shard in sorted(directory.glob("answers-*.npz")):
            corpus.records += read_shard(shard)
        return corpus

    def stored(self) -> set[tuple[str, str]]:
        return {(record.id, record.mode) for record in self.records}

    def answer_tokens(self) -> int:
        return sum(len(record.tokens) - record.start for record in self.records)


def write_shard(directory: Path, records: Sequence[Record]) -> Path:
    """Append records as the next numbered shard, atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    if any(max(record.tokens) >= 2**16 for record in records):
        raise ValueError("token ids past 65,535 do not fit the corpus's uint16 layout")
    index = len(list(directory.glob("answers-*.npz")))
    path = directory / f"answers-{index:05d}.npz"
    lengths = [len(record.tokens) for record in records]
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez_compressed(
        tmp,
        tokens=np.concatenate([np.asarray(r.tokens, dtype=np.uint16) for r in records]),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        starts=np.asarray([r.start for r in records], dtype=np.int32),
        ids=np.asarray([r.id for r in records]),
        kinds=np.asarray([r.kind for r in records]),
        modes=np.asarray([r.mode for r in records]),
    )
    os.replace(tmp, path)
    return path


def read_shard(path: Path) -> list[Record]:
    with np.load(path) as shard:
        tokens, offsets = shard["tokens"].astype(np.int64), shard["offsets"]
        return [
            Record(tokens[offsets[i] : offsets[i + 1]].tolist(), int(shard["starts"][i]), str(shard["ids"][i]),
                   str(shard["kinds"][i]), str(shard["modes"][i]))
            for i in range(len(shard["starts"]))
        ]


def corpus_prompts(data_dir: Path, recipe: CorpusRecipe) -> list[dict]:
    """Every training prompt (held-out ones excluded): the shared sets, the synthetic kinds and the
    GPTeacher roleplay and code sets, interleaved by kind so any prefix of the work covers every kind."""
    rows = load_all_prompts(data_dir)
    for name, kind in EXTRA_SETS.items():
        if (data_dir / name).exists():
            rows += [dict(row, category=kind) for row in read_jsonl(data_dir / name)]
    rows = [row for row in rows if not is_held_out(row["id"], recipe.held_out_fraction)]
    by_kind: dict[str, list[dict]] = {}
    for row in rows:
        by_kind.setdefault(row["category"], []).append(row)
    rng = np.random.default_rng(recipe.seed)
    for kind_rows in by_kind.values():
        rng.shuffle(kind_rows)
    return [row for group in _round_robin(list(by_kind.values())) for row in group]


def _round_robin(groups: list[list[dict]]) -> Iterator[list[dict]]:
    for index in range(max(len(group) for group in groups)):
        yield [group[index] for group in groups if index < len(group)]


def wants_sampled(row_id: str, share: float) -> bool:
    return is_held_out("sampled:" + row_id, share)  # a stable hash: the same prompts every session


def wanted(rows: Sequence[dict], recipe: CorpusRecipe, stored: set[tuple[str, str]]) -> list[tuple[dict, str]]:
    """(row, mode) pairs still to answer: greedy for every row, sampled for the recipe's share of them."""
    return [(row, mode) for row in rows for mode in ("greedy", "sampled")
            if (mode == "greedy" or wants_sampled(row["id"], recipe.sampled_share)) and (row["id"], mode) not in stored]


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's tokens before a user message's content: the system turn and the user turn's header."""
    if not tokenizer.chat_template:
        raise ValueError("prompts written by the target need a chat template (the user turn's header to start from)")
    marker = "\u2063specd-user-message\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"]


def self_prompts(target, index: int, count: int, recipe: CorpusRecipe, max_tokens: int = SELF_PROMPT_MAX_TOKENS) -> list[dict]:
    """Prompts the target writes itself (Magpie, Xu et al. 2024): given only the chat template up to a
    user message, an instruction-tuned model samples what users ask it, so its own answers to them
    reach the topics the prompt sets lack. Batch `index` is seeded by it (the same prompts for the
    same machine and count). Kept: user turns that ended within max_tokens, at least
    SELF_PROMPT_MIN_TOKENS long, not on the held-out side of the split by id; rows
    {id: "self-<index>-<j>", category: "self", prompt}."""
    from specd_engine.models import eos_token_ids

    tokenizer, eos = target.tokenizer, eos_token_ids(target)
    writing = replace(recipe, max_new_tokens=max_tokens, temperature=1.0, top_p=1.0)  # the target's own distribution of user turns
    turns = answer_batch(target.model, [user_turn_prefix(tokenizer)] * count, writing, True, eos, eos[0],  # equal lengths: no padding
                         recipe.seed + SELF_PROMPT_SEED + index)
    rows = []
    for j, text in enumerate(turns):
        if text and text[-1] in eos and len(text) > SELF_PROMPT_MIN_TOKENS:
            rows.append({"id": f"self-{index}-{j}", "category": "self", "prompt": tokenizer.decode(text[:-1], skip_special_tokens=True).strip()})
    return [row for row in rows if row["prompt"] and not is_held_out(row["id"], recipe.held_out_fraction)]


def self_prompt_batches(target, recipe: CorpusRecipe, stored: set[tuple[str, str]], size: int, budget: Budget,
                        max_tokens: int = SELF_PROMPT_MAX_TOKENS) -> Iterator[tuple[list[dict], str, list[list[int]]]]:
    """batches() of prompts the target writes (self_prompts), `size` at a time, until the budget is spent;
    batch indexes go on after the stored ones, so a resumed run never rewrites a prompt id."""
    index = 1 + max((int(row_id.split("-")[1]) for row_id, _ in stored if row_id.startswith("self-")), default=-1)
    while not budget.spent():
        todo = wanted(self_prompts(target, index, size, recipe, max_tokens), recipe, stored)
        log.info("corpus: %d self-written prompts in batch %d", len({row["id"] for row, _ in todo}), index)
        yield from batches(todo, target.tokenizer, recipe, size)
        index += 1


@torch.inference_mode()
def answer_batch(model, prompts: Sequence[list[int]], recipe: CorpusRecipe, sampled: bool, eos_ids: Sequence[int],
                 pad_id: int, seed: int) -> list[list[int]]:
    """The target's answers to left-padded prompts (greedy, or sampled with the recipe's warp)."""
    device = next(model.parameters()).device
    input_ids, attention = left_padded(prompts, pad_id)  # [B, width] each
    width = input_ids.shape[1]
    torch.manual_seed(seed)
    warp = dict(do_sample=True, temperature=recipe.temperature, top_p=recipe.top_p, top_k=0) if sampled else dict(do_sample=False)
    output = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), max_new_tokens=recipe.max_new_tokens,
                            pad_token_id=pad_id, eos_token_id=list(eos_ids), **warp)
    return [cut_at_eos(answer, eos_ids) for answer in output[:, width:].tolist()]


def extend_corpus(target, directory: Path, data_dir: Path, recipe: CorpusRecipe, budget: Budget, limit: int = 0,
                  batch_size: int = 48, written_prompts: bool = False, self_prompt_tokens: int = SELF_PROMPT_MAX_TOKENS) -> Corpus:
    """Answer prompts the corpus lacks until the budget is spent (or `limit` > 0 records were added);
    one shard per batch; with `written_prompts`, once the prompt sets are answered, prompts the target
    writes itself (self_prompt_batches). The batch size only sets speed (a CPU decodes 64 rows ~9x
    faster per token than one, measured on a 2-core EPYC), not the answers, so it is not part of the recipe."""
    from specd_engine.models import eos_token_ids

    save_recipe(directory, recipe)
    corpus = Corpus.open(directory)
    stored = corpus.stored()
    tokenizer, eos = target.tokenizer, eos_token_ids(target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    todo = wanted(corpus_prompts(data_dir, recipe), recipe, stored)
    log.info("corpus %s: %d records (%d answer tokens) stored, %d to go", directory, len(corpus.records), corpus.answer_tokens(), len(todo))
    work = batches(todo, tokenizer, recipe, batch_size)
    if written_prompts:
        work = itertools.chain(work, self_prompt_batches(target, recipe, stored, batch_size, budget, self_prompt_tokens))
    started, made = time.monotonic(), 0
    added = 0
    for batch, mode, prompts in work:
        if budget.spent() or (limit and added >= limit):
            break
        added += len(batch)
        seed = recipe.seed + len(corpus.records)
        answers = answer_batch(target.model, prompts, recipe, mode == "sampled", eos, pad_id, seed)
        records = [Record(prompt + answer, len(prompt), row["id"], row["category"], mode)
                   for row, prompt, answer in zip(batch, prompts, answers)]
        write_shard(directory, records)
        corpus.records += records
        made += sum(len(answer) for answer in answers)
        rate = made / (time.monotonic() - started)
        log.info("corpus: %d records, %d answer tokens (+%d this run, %.1f tok/s)", len(corpus.records), corpus.answer_tokens(), made, rate)
    return corpus


def batches(todo: list[tuple[dict, str]], tokenizer, recipe: CorpusRecipe, size: int,
            window: int = 8) -> Iterator[tuple[list[dict], str, list[list[int]]]]:
    """(rows, mode, prompt ids) batches of `size` in the work's order, sorted by length within windows
    of `window` batches so left padding wastes little while every kind still comes early."""
    for start in range(0, len(todo), size * window):
        chunk = todo[start : start + size * window]
        prompts = [chat_prompt_ids(tokenizer, row["prompt"])[-recipe.max_prompt_tokens :] for row, _ in chunk]
        order = sorted(range(len(chunk)), key=lambda i: len(prompts[i]))
        for first in range(0, len(order), size):
            picked = order[first : first + size]
            for mode in ("greedy", "sampled"):
                same = [i for i in picked if chunk[i][1] == mode]
                if same:
                    yield [chunk[i][0] for i in same], mode, [prompts[i] for i in same]


def save_recipe(directory: Path, recipe: CorpusRecipe) -> None:
    """Write recipe.json, or refuse to mix answers made another way into an existing corpus."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "recipe.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved != asdict(recipe):
            raise ValueError(f"{path} was made with {saved}; extend it with the same recipe or start another folder")
        return
    path.write_text(json.dumps(asdict(recipe), indent=2) + "\n")


def corpus_dir(target_name: str) -> Path:
    """draft_training/corpus/<name>: 'embedded:smollm2-135m-instruct' → smollm2-135m-instruct."""
    return CORPUS_ROOT / target_name.split(":")[-1].strip("/").replace("/", "--")
