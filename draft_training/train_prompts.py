"""Prompts for self-distilling a draft: the shared public sets plus templated prompts for missing kinds.

Users send writing, coding, translation, summarization, QA and math; the shared data covers math
(GSM8K), code (HumanEval) and chat (Self-Instruct seeds). The missing kinds are built from small
topic lists crossed with instruction templates, reusing public text (GSM8K questions, seed-task
references) as the passages to translate or summarize, so every prompt is reproducible offline.
Rows are split into train and held-out by a hash of their id, never by position, so adding rows
never moves an old row across the split.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import random
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

KINDS = ("math", "code", "chat", "writing", "translation", "summarization", "qa")

TOPICS = [
    "the ocean", "a rainy city", "friendship", "learning to cook", "space travel", "a lost dog", "autumn",
    "a small bakery", "the first day of school", "mountains", "a robot that dreams", "coffee", "a long train ride",
    "gardening", "an old library", "winter mornings", "a football match", "the internet", "a lighthouse keeper",
    "electric cars", "honey bees", "a birthday party", "moving to a new country", "the moon", "music festivals",
    "a job interview", "recycling", "a forest at night", "volunteering", "a broken phone",
]
WRITING_TEMPLATES = [
    "Write a short poem about {topic}.",
    "Write a short story (three paragraphs) about {topic}.",
    "Write a friendly email inviting a colleague to a talk about {topic}.",
    "Write a product description for something related to {topic}.",
    "Write a blog post introduction about {topic}.",
    "Write a haiku about {topic}.",
    "Give me five creative title ideas for an article about {topic}.",
    "Write a persuasive paragraph arguing that everyone should care about {topic}.",
]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]
TRANSLATION_TEMPLATES = [
    "Translate the following sentence into {language}: {text}",
    "Translate to {language}:\n{text}",
    "How do you say this in {language}? \"{text}\"",
]
SUMMARY_TEMPLATES = [
    "Summarize the following text in one sentence:\n{text}",
    "Give a short summary of this passage:\n{text}",
    "TL;DR:\n{text}",
    "List the key points of the following text as bullet points:\n{text}",
]
CONCEPTS = [
    "photosynthesis", "inflation", "a black hole", "machine learning", "the water cycle", "democracy",
    "vaccines", "gravity", "the French Revolution", "DNA", "blockchain", "climate change", "the stock market",
    "a compiler", "the immune system", "plate tectonics", "an algorithm", "renewable energy", "the Roman Empire",
    "a neural network", "supply and demand", "the speed of light", "antibiotics", "a database index",
    "the greenhouse effect", "the Pythagorean theorem", "evolution", "an operating system", "the Moon landing",
    "a prime number",
]
QA_TEMPLATES = [
    "What is {concept}?",
    "Explain {concept} to a ten-year-old.",
    "Why is {concept} important?",
    "Give three facts about {concept}.",
    "What are the pros and cons of {concept}?",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the words in a sentence", "merges two sorted lists", "removes duplicates from a list while keeping order",
    "computes the factorial of n", "checks whether a string is a palindrome", "finds the largest element of a list",
    "flattens a nested list", "converts Celsius to Fahrenheit", "sorts a list of dictionaries by a key",
    "reads a CSV file and returns its rows", "computes the average of a list of numbers",
    "returns the most common character in a string", "implements binary search",
]
CODE_TEMPLATES = [
    "Write a Python function that {task}.",
    "Write a JavaScript function that {task}.",
    "Write a Python function that {task}, with a docstring and an example.",
]


def read_jsonl(path: Path) -> list[dict]:
    """One JSON object a line."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _first_sentence(text: str) -> str:
    """A short passage for translation: the first sentence of a public question."""
    head = text.strip().split(". ")[0].strip()
    return head if head.endswith((".", "?", "!")) else head + "."


def _templated(kind: str, templates: list[str], fills: Iterable[dict]) -> Iterator[dict]:
    """Rows from templates × fill values, ids stable across runs."""
    for index, (template, fill) in enumerate(itertools.product(templates, fills)):
        yield {"id": f"{kind}-{index}", "category": kind, "prompt": template.format(**fill)}


def synthetic_rows(gsm8k: list[dict], seeds: list[dict]) -> list[dict]:
    """Writing, translation, summarization, QA and extra code prompts (deterministic)."""
    passages = [row["prompt"] for row in gsm8k[:60]] + [row.get("reference", "") for row in seeds if len(row.get("reference", "")) > 200]
    sentences = [_first_sentence(row["prompt"]) for row in gsm8k[100:160]]
    pairs = [{"language": language, "text": text} for text, language in zip(sentences, itertools.cycle(LANGUAGES))]
    rows = list(_templated("writing", WRITING_TEMPLATES, [{"topic": t} for t in TOPICS]))
    rows += list(_templated("translation", TRANSLATION_TEMPLATES, pairs))
    rows += list(_templated("summarization", SUMMARY_TEMPLATES, [{"text": p} for p in passages[:80]]))
    rows += list(_templated("qa", QA_TEMPLATES, [{"concept": c} for c in CONCEPTS]))
    rows += list(_templated("code-extra", CODE_TEMPLATES, [{"task": t} for t in CODE_TASKS]))
    for row in rows:
        row["category"] = row["category"].replace("-extra", "")
    return rows


def load_all_prompts(data_dir: Path) -> list[dict]:
    """Every prompt row: the shared sets (category math/code/chat) plus the synthetic kinds."""
    gsm8k = read_jsonl(data_dir / "gsm8k_train.jsonl")
    code = read_jsonl(data_dir / "humaneval.jsonl")
    seeds = read_jsonl(data_dir / "seed_tasks.jsonl")
    return gsm8k + code + seeds + synthetic_rows(gsm8k, seeds)


def is_held_out(row_id: str, fraction: float) -> bool:
    """Stable split by a hash of the prompt id: the same row is always on the same side."""
    digest = int(hashlib.sha256(row_id.encode()).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < fraction


LEAK_NGRAM, LEAK_MAX_PROMPTS = 6, 20


def leaking_prompts(prompts: Sequence[Sequence[int]], held_out: Sequence[Sequence[int]], n: int = LEAK_NGRAM,
                    max_prompts: int = LEAK_MAX_PROMPTS) -> list[bool]:
    """Which training prompts (token ids) share a rare n-gram with some held-out prompt.

    The split is by prompt id, but the synthetic summarization, translation and writing prompts reuse
    one passage, topic or task under several templates, so a training prompt can hold a held-out
    prompt's passage under another id; answers to it would teach the passage. An n-gram is rare when
    fewer than `max_prompts` training prompts hold it: template wording and chat markup are common and
    say nothing about the passage."""
    found = [_grams(tokens, n) for tokens in prompts]
    spread = collections.Counter(gram for prompt in found for gram in prompt)
    held = {gram for tokens in held_out for gram in _grams(tokens, n) if spread[gram] < max_prompts}
    return [bool(prompt & held) for prompt in found]


LEAKED_SHARE = 0.2


def passage_check(prompts: Sequence[Sequence[int]], n: int = LEAK_NGRAM, max_prompts: int = LEAK_MAX_PROMPTS,
                  min_share: float = LEAKED_SHARE) -> Callable[[Sequence[int]], bool]:
    """A test of whether a held-out prompt holds a passage of the training prompts: at least
    `min_share` of its n-grams are rare ones (in 1 to `max_prompts` - 1 of `prompts`). leaking_prompts,
    seen from the held-out side: heads trained before that filter learned those passages, so their
    numbers on these prompts are inflated, and heads are compared fairly on the others. One shared
    gram is no evidence here (77 of the 84 held-out prompts share one with the corpus); a reused
    passage shares most of its grams (held-out summarization prompts 0.57–0.85, translation
    0.20–0.45, half of math 0.73–0.81, while chat, QA and writing stay at or under 0.15; 2026-11-25).
    The training prompts' n-grams are counted once, here, however many prompts are tested."""
    spread = collections.Counter(gram for tokens in prompts for gram in _grams(tokens, n))

    def holds_passage(tokens: Sequence[int]) -> bool:
        grams = _grams(tokens, n)
        return sum(0 < spread[gram] < max_prompts for gram in grams) / max(1, len(grams)) >= min_share

    return holds_passage


def _grams(tokens: Sequence[int], n: int) -> set[tuple[int, ...]]:
    tokens = list(tokens)
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def select_prompts(rows: list[dict], per_kind: dict[str, int], held_out: bool, fraction: float, seed: int = 0) -> list[dict]:
    """Up to per_kind[kind] rows of each kind from one side of the split, shuffled across kinds.

    The shuffle interleaves kinds so that a run stopped by its time budget still covers all of them.
    """
    by_kind: dict[str, list[dict]] = {}
    for row in rows:
        if is_held_out(row["id"], fraction) == held_out:
            by_kind.setdefault(row["category"], []).append(row)
    chosen = [row for kind, limit in per_kind.items() for row in by_kind.get(kind, [])[:limit]]
    random.Random(seed).shuffle(chosen)
    return chosen
