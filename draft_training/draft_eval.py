"""Measure a drafter offline: simulated greedy speculation against the target's own answers, and cost.

Greedy speculative decoding emits exactly the target's greedy continuation, so a round can be
simulated without the target: the drafter proposes k tokens from the true prefix, the round keeps
the longest prefix equal to the target's answer, plus one target token (the correction or bonus).
This runs the real serving path (Drafter.open / propose, then the commit the gateway would send),
so what is measured is what `specd up` would see, minus the target's time.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from specd_engine.features import encode_features
from specd_engine.lm import CausalLM
from specd_common.lookup import prompt_lookup
from specd_common.params import Warp

log = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Counts from simulated rounds; per-position counts give the acceptance at each draft slot."""

    tokens: int = 0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    reached: list = field(default_factory=list)  # [k] rounds where slot i was drafted and slots < i accepted
    hits: list = field(default_factory=list)  # [k] rounds where slot i was accepted

    def add_round(self, k: int, accepted: int, drafted: int) -> None:
        self.reached += [0] * (k - len(self.reached))
        self.hits += [0] * (k - len(self.hits))
        for slot in range(min(drafted, accepted + 1)):
            self.reached[slot] += 1
            self.hits[slot] += slot < accepted
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted

    def merge(self, other: "SpecStats") -> None:
        """Add another answer's counts (slot by slot)."""
        width = max(len(self.reached), len(other.reached))
        self.reached = [a + b for a, b in zip(self.reached + [0] * (width - len(self.reached)), other.reached + [0] * (width - len(other.reached)))]
        self.hits = [a + b for a, b in zip(self.hits + [0] * (width - len(self.hits)), other.hits + [0] * (width - len(other.hits)))]
        self.tokens += other.tokens
        self.passes += other.passes
        self.drafted += other.drafted
        self.accepted += other.accepted

    def summary(self) -> dict:
        return {
            "tokens_per_pass": round(self.tokens / max(1, self.passes), 3),
            "acceptance": round(self.accepted / max(1, self.drafted), 3),
            "per_position": [round(h / max(1, r), 3) for h, r in zip(self.hits, self.reached)],
            "tokens": self.tokens,
            "passes": self.passes,
        }


def simulate_answer(drafter, record: dict, k: int, stats: SpecStats, lookup_min_ngram: int = 0) -> None:
    """Greedy speculation over one held-out answer: propose k, keep the matching prefix, commit.
    A feature drafter is sent the record's target features as the gateway would send them.
    lookup_min_ngram ≥ 1: a prompt-lookup copy first (lookup_first); 0: the drafter alone."""
    tokens = record["tokens"].tolist()
    start = record["start"]
    answer = tokens[start:]
    session = drafter.open(tokens[:start], Warp())
    rng = np.random.default_rng(0)
    position = 0  # answer tokens already emitted
    sent = 0  # feature rows the drafter holds
    while position < len(answer):
        if getattr(drafter, "wants_target_features", False):
            drafter.add_features(session, encode_features(record["features"][sent : start + position - 1], sent))
            sent = start + position - 1
        budget = min(k, len(answer) - position - 1)  # the last token always comes from the target
        proposal = lookup_first(drafter, session, budget, rng, lookup_min_ngram) if budget > 0 else []
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == answer[position + accepted]:
            accepted += 1
        stats.add_round(k, accepted, len(proposal))
        emitted = accepted + 1
        session.sequence.apply_commit(start + position + accepted, [answer[position + accepted]])
        position += emitted
    stats.tokens += len(answer)


def lookup_first(drafter, session, k: int, rng: np.random.Generator, min_ngram: int) -> list[int]:
    """A prompt-lookup copy of up to k tokens where the sequence's last n-gram (min_ngram ≥ 1) recurs,
    else the drafter's k drafts (min_ngram 0: always the drafter's). Like a gateway lookup round with
    its copy capped at k: the copy is held as the draft's pending tokens, which the commit rolls back,
    and the drafter reads the round's tokens on its next proposal."""
    copy = prompt_lookup(session.sequence.tokens, k, min_ngram=min_ngram) if min_ngram else []
    if copy:
        session.sequence.tokens.extend(copy)
        return copy
    return drafter.propose(session, k, rng).token_ids


def _report(records: list[dict], simulate, ks) -> dict:
    """Per k: overall and per task kind tokens per pass, acceptance and per-position acceptance."""
    report = {}
    for k in ks:
        overall, by_kind = SpecStats(), defaultdict(SpecStats)
        for index, record in enumerate(records):
            stats = SpecStats()
            simulate(index, record, k, stats)
            overall.merge(stats)
            by_kind[record["category"]].merge(stats)
        report[f"k={k}"] = {"all": overall.summary(), "by_kind": {kind: s.summary() for kind, s in sorted(by_kind.items())}}
        log.info("eval k=%d: %.2f tokens/pass, acceptance %.3f, per position %s", k, overall.tokens / max(1, overall.passes),
                 overall.accepted / max(1, overall.drafted), overall.summary()["per_position"])
    return report


def evaluate_drafter(drafter, records: list[dict], ks=(2, 3, 4), lookup_min_ngram: int = 0) -> dict:
    """Any Drafter through its serving interface (open / propose / commit), round by round; with
    lookup_min_ngram ≥ 1, prompt-lookup copies first (lookup_first)."""
    return _report(records, lambda _, record, k, stats: simulate_answer(drafter, record, k, stats, lookup_min_ngram), ks)


def forward_ms(loaded, prompt: list[int], positions: int = 1, repeats: int = 15) -> float:
    """Median ms of one cached forward over `positions` new tokens after `prompt` (rolled back each time)."""
    lm = CausalLM(loaded)
    session = lm.new_session(prompt)
    extra = prompt[-positions + 1 :] if positions > 1 else []
    times = []
    for _ in range(repeats + 2):
        length = len(session.tokens)
        started = time.perf_counter()
        lm.forward(session, extra)
        times.append((time.perf_counter() - started) * 1000)
        session.apply_commit(length, [])
    return round(statistics.median(times[2:]), 2)
