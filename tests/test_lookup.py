"""Prompt lookup's bounds (specd_common/lookup.py), the one implementation the gateway's lookup rounds,
the n-gram drafter and the offline evaluations share; tests/test_units.py has its basic cases."""

from __future__ import annotations

import pytest

from specd_common.lookup import prompt_lookup


def test_the_longest_recurring_ngram_wins_over_a_later_shorter_one():
    # "2 3" recurs at 1..2 (followed by 8 3); "3" alone recurs later, at 4 (followed by 9 2)
    assert prompt_lookup([1, 2, 3, 8, 3, 9, 2, 3], k=2) == [8, 3]


def test_min_ngram_leaves_out_shorter_matches():
    assert prompt_lookup([4, 5, 6, 5], k=2) == [6, 5]  # "5" recurs
    assert prompt_lookup([4, 5, 6, 5], k=2, min_ngram=2) == []  # "6 5" does not


def test_a_min_ngram_above_the_longest_tried_is_still_looked_up():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 4]
    assert prompt_lookup(tokens, k=1, min_ngram=4) == [9]  # n starts at max(max_ngram, min_ngram)
    assert prompt_lookup(tokens, k=1, min_ngram=5) == []  # "9 1 2 3 4" does not recur
    assert prompt_lookup(tokens, k=1, min_ngram=2, max_ngram=1) == [9]


def test_a_match_at_the_very_start_counts():
    assert prompt_lookup([1, 2, 5, 1, 2], k=1, min_ngram=2) == [5]


def test_short_sequences_and_no_tokens_asked():
    assert prompt_lookup([], k=3) == []
    assert prompt_lookup([7], k=3) == []
    assert prompt_lookup([7, 7], k=3) == [7, 7, 7]  # the copy runs on into itself
    assert prompt_lookup([1, 2, 1, 2], k=2, min_ngram=4) == []  # no earlier room for a 4-gram
    assert prompt_lookup([1, 2, 1], k=0) == []


def test_min_ngram_below_one_is_refused():
    with pytest.raises(ValueError, match="≥ 1"):
        prompt_lookup([1, 2, 1], k=2, min_ngram=0)


def test_the_ngram_drafter_takes_the_same_bound():
    from draft_service.drafters import NgramDrafter
    from specd_common.params import Warp

    drafter = NgramDrafter(min_ngram=2)
    session = drafter.open([4, 5, 6, 5], Warp())
    assert drafter.propose(session, 2, rng=None).token_ids == []  # "6 5" does not recur (the default, 1, copies "5")
    session = NgramDrafter().open([4, 5, 6, 5], Warp())
    assert NgramDrafter().propose(session, 2, rng=None).token_ids == [6, 5]
    with pytest.raises(ValueError):
        NgramDrafter(min_ngram=0)


def test_offline_evaluation_copies_first_and_holds_the_copy_as_pending_tokens():
    """draft_eval.lookup_first: a copy where the last n-gram recurs (the drafter is not asked), else the
    drafter's drafts; min_ngram 0 always asks the drafter."""
    from types import SimpleNamespace

    from draft_training.draft_eval import lookup_first

    asked = []
    drafter = SimpleNamespace(propose=lambda session, k, rng: asked.append(k) or SimpleNamespace(token_ids=[42] * k))
    session = SimpleNamespace(sequence=SimpleNamespace(tokens=[1, 2, 3, 1, 2]))
    assert lookup_first(drafter, session, 2, None, min_ngram=2) == [3, 1] and not asked
    assert session.sequence.tokens == [1, 2, 3, 1, 2, 3, 1]
    session.sequence.tokens = [1, 2, 3, 1, 2]
    assert lookup_first(drafter, session, 2, None, min_ngram=3) == [42, 42] and asked == [2]
    assert lookup_first(drafter, session, 1, None, min_ngram=0) == [42] and asked == [2, 1]
