"""The committed draft-training corpus: compact shards, resumable extension, one recipe per corpus."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from draft_training.corpus import Corpus, CorpusRecipe, Record, corpus_prompts, extend_corpus, read_shard, write_shard
from draft_training.distill_data import Budget
from draft_training.train_prompts import is_held_out

RECIPE = CorpusRecipe(max_new_tokens=5, sampled_share=0.5)


@pytest.fixture
def data_dir(tmp_path):
    """The shared sets' shape, a few rows each (the synthetic kinds are built from them)."""
    directory = tmp_path / "data"
    directory.mkdir()
    rows = {
        "gsm8k_train.jsonl": [{"id": f"gsm8k:{i}", "category": "math", "prompt": f"What is {i} plus {i}? It is simple."} for i in range(200)],
        "humaneval.jsonl": [{"id": f"he:{i}", "category": "code", "prompt": f"def f{i}(x):"} for i in range(5)],
        "seed_tasks.jsonl": [{"id": f"seed:{i}", "category": "chat", "prompt": f"Say hi {i}."} for i in range(5)],
        "gpteacher_roleplay.jsonl": [{"id": f"rp:{i}", "category": "roleplay", "prompt": f"You are a pirate {i}."} for i in range(5)],
    }
    for name, content in rows.items():
        (directory / name).write_text("".join(json.dumps(row) + "\n" for row in content))
    return directory


def test_shards_round_trip_token_ids_compactly(tmp_path):
    records = [Record([1, 2, 65535, 4], 2, "a", "math", "greedy"), Record([7, 8, 9], 1, "b", "roleplay", "sampled")]
    path = write_shard(tmp_path, records)
    assert read_shard(path) == records
    assert np.load(path)["tokens"].dtype == np.uint16
    with pytest.raises(ValueError, match="uint16"):
        write_shard(tmp_path, [Record([70000], 0, "c", "qa", "greedy")])


def test_prompts_cover_every_kind_early_and_skip_held_out_ones(data_dir):
    rows = corpus_prompts(data_dir, RECIPE)
    kinds = {row["category"] for row in rows}
    assert {"math", "code", "chat", "roleplay", "writing", "translation", "summarization", "qa"} <= kinds
    assert {row["category"] for row in rows[: len(kinds)]} == kinds  # round robin over kinds
    held_out = CorpusRecipe().held_out_fraction

    assert not any(is_held_out(row["id"], held_out) for row in rows)


def test_the_corpus_grows_across_runs_without_repeating_and_keeps_its_recipe(tiny, data_dir, tmp_path):
    from specd_engine.models import load_causal_lm

    target = load_causal_lm(str(tiny.target))
    directory = tmp_path / "corpus"
    first = extend_corpus(target, directory, data_dir, RECIPE, Budget(0), limit=8, batch_size=4)
    second = extend_corpus(target, directory, data_dir, RECIPE, Budget(0), limit=8, batch_size=4)
    reread = Corpus.open(directory)
    assert len(first.records) >= 8 and len(reread.records) == len(second.records) >= 16
    pairs = [(record.id, record.mode) for record in reread.records]
    assert len(pairs) == len(set(pairs))  # nothing answered twice
    assert {record.mode for record in reread.records} == {"greedy", "sampled"}
    for record in reread.records:
        assert 1 <= len(record.tokens) - record.start <= RECIPE.max_new_tokens
    with pytest.raises(ValueError, match="same recipe"):
        extend_corpus(target, directory, data_dir, replace(RECIPE, temperature=0.3), Budget(0), limit=1, batch_size=4)


def test_feature_training_reads_the_committed_corpus_without_held_out_prompts():
    from draft_training.feature_training import FEATURE_RECIPES, corpus_sources
    from specd_common.config import DEFAULT_TARGET

    recipe = FEATURE_RECIPES["feature-corpus"]
    sources = corpus_sources(DEFAULT_TARGET, recipe.held_out_fraction)
    assert len(sources) >= 252  # what was committed when this test was written; the corpus only grows
    assert all(s["id"].startswith(("corpus:greedy:", "corpus:sampled:")) for s in sources)
    assert not any(is_held_out(s["id"].split(":", 2)[2], recipe.held_out_fraction) for s in sources)
    assert all(0 < s["start"] < len(s["tokens"]) for s in sources)


def test_leaking_prompts_finds_a_held_out_passage_under_another_template():
    from draft_training.train_prompts import leaking_prompts

    passage = [501, 502, 503, 504, 505, 506, 507]
    template = [9, 8, 7, 6, 5, 4]  # shared by every prompt: common wording, not a passage
    prompts = [template + passage, template + [601, 602, 603, 604, 605, 606, 607], template + passage[:5] + [700, 701]]
    held_out = [[1, 2] + passage + [3]]  # the same passage under another template
    assert leaking_prompts(prompts, held_out) == [True, False, False]  # five shared tokens are not six
    # a gram in at least max_prompts training prompts says nothing about a passage
    assert leaking_prompts(prompts, [template], max_prompts=3) == [False, False, False]
    assert leaking_prompts(prompts, [template], max_prompts=4) == [True, True, True]


def test_corpus_sources_start_at_a_record_and_leave_out_held_out_passages():
    from draft_training.corpus import corpus_dir
    from draft_training.feature_training import FEATURE_RECIPES, corpus_sources
    from specd_common.config import DEFAULT_TARGET

    records = Corpus.open(corpus_dir(DEFAULT_TARGET)).records
    fraction = FEATURE_RECIPES["feature-corpus"].held_out_fraction
    leaked = records[260]  # its prompt, as if a held-out prompt held the same passage
    sources = corpus_sources(DEFAULT_TARGET, fraction, [leaked.tokens[: leaked.start]], first=250)
    ids = [s["id"] for s in sources]
    assert f"corpus:{leaked.mode}:{leaked.id}" not in ids
    # (a corpus job running beside the test may append records: they come after these)
    expected = [f"corpus:{r.mode}:{r.id}" for r in records[250:]]
    known = [i for i in expected if i in set(ids)]
    assert len(known) < len(expected) and ids[: len(known)] == known  # records from 250 on, in order
    everything = [s["id"] for s in corpus_sources(DEFAULT_TARGET, fraction)][: len(records)]
    assert everything == [f"corpus:{r.mode}:{r.id}" for r in records]  # no held-out prompts given: nothing left out


def test_the_target_writes_prompts_once_the_sets_are_answered(tiny, tmp_path, monkeypatch):
    """Magpie-style prompts (corpus.self_prompts): seeded by their batch index, user turns that ended,
    never on the held-out side; extend_corpus answers them after the prompt sets (emptied here) and a
    second run goes on at the next batch index instead of rewriting an id."""
    import draft_training.corpus as corpus_module
    from specd_engine.models import load_causal_lm

    target = load_causal_lm(str(tiny.target))
    first = corpus_module.self_prompts(target, 0, 16, RECIPE, max_tokens=48)
    assert first and first == corpus_module.self_prompts(target, 0, 16, RECIPE, max_tokens=48)  # seeded by the batch index
    assert [row["prompt"] for row in corpus_module.self_prompts(target, 1, 16, RECIPE, max_tokens=48)] != [row["prompt"] for row in first]
    assert all(row["id"].startswith("self-0-") and row["category"] == "self" for row in first)
    assert not any(is_held_out(row["id"], RECIPE.held_out_fraction) for row in first)
    monkeypatch.setattr(corpus_module, "corpus_prompts", lambda data_dir, recipe: [])  # every set answered
    directory = tmp_path / "corpus"
    for _ in range(2):
        extend_corpus(target, directory, tmp_path, RECIPE, Budget(2), limit=4, batch_size=8, written_prompts=True, self_prompt_tokens=48)
    records = Corpus.open(directory).records
    assert len(records) >= 8 and {record.kind for record in records} == {"self"}
    pairs = [(record.id, record.mode) for record in records]
    assert len(pairs) == len(set(pairs))
    batches_used = {record.id.split("-")[1] for record in records}
    assert len(batches_used) >= 2  # the second run started a batch of its own
    prefix = corpus_module.user_turn_prefix(target.tokenizer)
    assert all(record.tokens[: len(prefix)] == prefix and record.start > len(prefix) for record in records)


def test_corpus_sources_cap_each_kind_and_keep_the_thin_ones_whole():
    from collections import Counter

    from draft_training.corpus import corpus_dir
    from draft_training.feature_training import FEATURE_RECIPES, corpus_sources
    from specd_common.config import DEFAULT_TARGET

    fraction = FEATURE_RECIPES["feature-corpus"].held_out_fraction
    every = Counter(s["category"] for s in corpus_sources(DEFAULT_TARGET, fraction))
    cap = min(every.values()) + 1  # the thinnest kind stays whole; the corpus only grows, so this follows it
    capped = Counter(s["category"] for s in corpus_sources(DEFAULT_TARGET, fraction, kind_cap=cap))
    assert capped == {kind: min(count, cap) for kind, count in every.items()}
    assert max(every.values()) > cap  # and the cap cuts the large kinds
    assert len(Corpus.open(corpus_dir(DEFAULT_TARGET)).records) >= sum(every.values())


def test_passage_check_flags_a_reused_passage_not_one_shared_phrase():
    from draft_training.train_prompts import passage_check

    def leaked_held_out(prompts, held_out, **limits):
        holds_passage = passage_check(prompts, **limits)
        return [holds_passage(tokens) for tokens in held_out]

    passage = list(range(500, 520))  # 20 tokens: 15 six-grams
    template = [9, 8, 7, 6, 5, 4]
    training = [template + passage, template + list(range(600, 620))] + [template + [1, 2, 3]] * 20  # the template is common
    reused = [1, 2] + passage + [3]  # the whole passage under another template
    phrase = [700, 701, 702, 703] + passage[:6] + list(range(800, 820))  # one shared gram among 25
    fresh = list(range(900, 930))
    assert leaked_held_out(training, [reused, phrase, fresh]) == [True, False, False]
    assert leaked_held_out(training, [phrase], min_share=0.01) == [True]  # any shared gram, at a low enough share
    assert leaked_held_out(training, [template + [1, 2, 3]]) == [False]  # grams in ≥ max_prompts prompts are not passages


def test_the_fresh_benchmark_prompts_hold_no_corpus_passage():
    """docs/benchmarks/fresh_prompts.jsonl was written for the benchmark with passages of its own: the
    held-out file's translation and summarization prompts reuse GSM8K passages the corpus answers
    under other templates, so heads trained on the corpus score high there. The corpus grows every
    session (with prompts the target writes itself): this keeps the fresh file fresh."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from draft_training.distill_data import chat_prompt_ids
    from draft_training.feature_training import corpus_prompts
    from draft_training.train_prompts import passage_check
    from specd_common.config import DEFAULT_TARGET
    from specd_engine.models import resolve_model_path

    benchmarks = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_TARGET))
    holds_passage = passage_check(corpus_prompts(DEFAULT_TARGET))

    def leaking(name: str) -> list[str]:
        rows = [json.loads(line) for line in (benchmarks / name).read_text().splitlines()]
        return [row["id"] for row in rows if holds_passage(chat_prompt_ids(tokenizer, row["prompt"]))]

    assert leaking("fresh_prompts.jsonl") == []
    assert len(leaking("heldout_prompts.jsonl")) >= 4  # the check can fail: it finds the held-out file's reused passages
