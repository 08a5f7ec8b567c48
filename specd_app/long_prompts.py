"""docs/benchmarks/long_prompts.jsonl: summarization- and RAG-sized prompts for `specd bench` (issue 43).

Short prompts (~100 tokens) hide what long ones cost a server: a prefill that is compute-bound and a
KV cache that every batched pass must read. These prompts are assembled, deterministically, from the
public sets in ../shared/data (licenses in its README.md): GPTeacher roleplay answers as documents to
summarize, GSM8K problem statements as passages to answer a question from, HumanEval stubs as code
to summarize. Each prompt is filled to a token budget counted with the default target's tokenizer:
the first rows at ROW_BUDGETS (the long set `--limit 8` takes), the last rows near 2,000 tokens, the
prompts `specd bench --arrival` sends into running streams.

The draft corpus (draft_training) is built from the same shared sets, so a drafter may have seen
these passages under other templates: read specd's speedup over target-only on them as optimistic;
what this file is for is how each mode scales from one stream to many.

Rebuild (after changing a budget or a template): `make long-prompts`; tests/test_bench_concurrency.py
checks the file is what this module writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

from draft_training.cli import SHARED_DATA

REPO = Path(__file__).resolve().parents[1]
LONG_PROMPTS = REPO / "docs" / "benchmarks" / "long_prompts.jsonl"
MIN_TOKENS = 700  # issue 43's "long": at least this many prompt tokens (raw text, before the chat template)
# (kind, least tokens, most tokens) of each row, in file order: eight rows of 750-1,100 tokens, then
# two near 2,000 (the arrival prompts). A document that would pass the most is skipped, so a row
# ends between its two bounds.
ROW_BUDGETS = (
    ("documents", 760, 860), ("passages", 800, 900), ("code", 840, 960), ("documents", 880, 980),
    ("passages", 920, 1020), ("code", 960, 1080), ("documents", 1000, 1100), ("passages", 760, 860),
    ("passages", 1900, 2050), ("documents", 1900, 2050),
)
CATEGORY = {"documents": "summarization", "passages": "rag", "code": "summarization"}
# where each source is read from: past the rows the held-out and fresh prompt files quote
START = {"gpteacher_roleplay.jsonl": 1000, "gsm8k_train.jsonl": 5000, "humaneval.jsonl": 40}
MAX_DOCUMENT_TOKENS = 320  # longer documents are skipped: a row should hold several


def rows_of(data_dir: Path, name: str) -> Iterator[dict]:
    with open(data_dir / name) as lines:
        for index, line in enumerate(lines):
            if index >= START[name]:
                yield json.loads(line)


def split_question(problem: str) -> tuple[str, str]:
    """A GSM8K problem → (statement, question): its last sentence when that asks something."""
    statement, _, question = problem.strip().rpartition(". ")
    question = question.strip()
    return (statement.strip() + ".", question) if statement and question.endswith("?") else ("", "")


def documents(data_dir: Path) -> Iterator[str]:
    for row in rows_of(data_dir, "gpteacher_roleplay.jsonl"):
        yield row["reference"].strip()


def passages(data_dir: Path) -> Iterator[tuple[str, str]]:
    """(statement, question) of each GSM8K problem that splits into both."""
    for row in rows_of(data_dir, "gsm8k_train.jsonl"):
        statement, question = split_question(row["prompt"])
        if statement:
            yield statement, question


def code(data_dir: Path) -> Iterator[str]:
    for row in rows_of(data_dir, "humaneval.jsonl"):
        yield row["prompt"].strip()


def render(kind: str, parts: list, question: str = "") -> str:
    if kind == "documents":
        body = "\n\n".join(f"Document {i}:\n{text}" for i, text in enumerate(parts, 1))
        return ("Summarize each of the documents below in one sentence, then write a short paragraph on what "
                f"they have in common.\n\n{body}")
    if kind == "passages":
        body = "\n".join(f"[{i}] {text}" for i, text in enumerate(parts, 1))
        return ("Answer the question using only the passages below, and say which passage you used.\n\n"
                f"{body}\n\nQuestion: {question}")
    body = "\n\n".join(f"```python\n{text}\n```" for text in parts)
    return ("Below are Python functions from one code base, each with its docstring. For each, say in one line "
            f"what it does, then name two that could share a helper and why.\n\n{body}")


def fill(kind: str, source: Iterator, low: int, high: int, count_tokens: Callable[[str], int]) -> str:
    """A prompt of `kind` with parts taken from `source` until it holds at least `low` tokens; a part
    that would take it past `high`, or that alone passes MAX_DOCUMENT_TOKENS, is skipped (consumed).
    Passages: the question is that of the row's middle passage (the answer is not at either end)."""
    parts: list = []
    for part in source:
        text = part[0] if kind == "passages" else part
        if count_tokens(text) > MAX_DOCUMENT_TOKENS:
            continue
        trial = parts + [part]
        question = trial[len(trial) // 2][1] if kind == "passages" else ""
        prompt = render(kind, [p[0] if kind == "passages" else p for p in trial], question)
        size = count_tokens(prompt)
        if size > high:
            continue
        parts = trial
        if size >= low:
            return prompt
    raise ValueError(f"{kind}: the source ran out before {low} tokens")


def build_long_prompts(count_tokens: Callable[[str], int], data_dir: Path = SHARED_DATA) -> list[dict]:
    """The rows of long_prompts.jsonl, the same for the same data and tokenizer."""
    sources = {"documents": documents(data_dir), "passages": passages(data_dir), "code": code(data_dir)}
    rows = []
    for index, (kind, low, high) in enumerate(ROW_BUDGETS):
        prompt = fill(kind, sources[kind], low, high, count_tokens)
        rows.append({"id": f"long-{kind}-{index}", "category": CATEGORY[kind], "prompt": prompt})
    return rows


def default_token_counter() -> Callable[[str], int]:
    """Prompt tokens by the default target's tokenizer (raw text: the chat template adds ~20 more)."""
    from transformers import AutoTokenizer

    from specd_common.config import DEFAULT_TARGET
    from specd_engine.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_TARGET))
    return lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)


def write_long_prompts(path: Path = LONG_PROMPTS, data_dir: Path = SHARED_DATA) -> list[dict]:
    rows = build_long_prompts(default_token_counter(), data_dir)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return rows


if __name__ == "__main__":
    for row in write_long_prompts():
        print(row["id"], len(row["prompt"]), "characters")
