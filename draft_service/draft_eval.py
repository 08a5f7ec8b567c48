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
import torch

from specd_common.features import encode_features
from specd_common.lm import CausalLM
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


def simulate_answer(drafter, record: dict, k: int, stats: SpecStats) -> None:
    """Greedy speculation over one held-out answer: propose k, keep the matching prefix, commit.
    A feature drafter is sent the record's target features as the gateway would send them."""
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
        proposal = drafter.propose(session, budget, rng).token_ids if budget > 0 else []
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == answer[position + accepted]:
            accepted += 1
        stats.add_round(k, accepted, len(proposal))
        emitted = accepted + 1
        session.sequence.apply_commit(start + position + accepted, [answer[position + accepted]])
        position += emitted
    stats.tokens += len(answer)


def simulate_matches(matches: list[bool], k: int, stats: SpecStats) -> None:
    """The same rounds as simulate_answer, from teacher-forced matches of a model drafter.

    Exact for greedy model drafts: while the first j drafted tokens equal the target's answer, the
    draft's context is the true prefix, so its next token is its teacher-forced argmax there. A round
    at position p therefore accepts the run of consecutive matches starting at p (capped at k), and
    one teacher-forced forward per answer replaces k cached forwards per round.
    """
    position = 0
    while position < len(matches):
        budget = min(k, len(matches) - position - 1)
        accepted = 0
        while accepted < budget and matches[position + accepted]:
            accepted += 1
        stats.add_round(k, accepted, budget)
        position += accepted + 1
    stats.tokens += len(matches)


@torch.inference_mode()
def teacher_forced_matches(model, record: dict) -> list[bool]:
    """Per answer position: does the model's argmax (given the true prefix) equal the target's token?"""
    device = next(model.parameters()).device
    tokens = record["tokens"].long().unsqueeze(0).to(device)  # [1, T]
    logits = model(input_ids=tokens).logits[0, record["start"] - 1 : -1]  # [T - start, V]
    return (logits.argmax(dim=-1).cpu() == record["tokens"][record["start"] :].long()).tolist()


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


def evaluate_drafter(drafter, records: list[dict], ks=(2, 3, 4)) -> dict:
    """Any Drafter through its serving interface (open / propose / commit), round by round."""
    return _report(records, lambda _, record, k, stats: simulate_answer(drafter, record, k, stats), ks)


def evaluate_model(model, records: list[dict], ks=(2, 3, 4)) -> dict:
    """A greedy model drafter, exactly and much faster, from one teacher-forced forward per answer."""
    matches = [teacher_forced_matches(model, record) for record in records]
    return _report(records, lambda index, _, k, stats: simulate_matches(matches[index], k, stats), ks)


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


def cost_report(draft, target, prompt: list[int]) -> dict:
    """Draft vs target forward cost in this process, interleaved so both see the same machine load."""
    with torch.inference_mode():
        draft_ms = [forward_ms(draft, prompt) for _ in range(3)]
        target_ms = [forward_ms(target, prompt) for _ in range(3)]
    result = {
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt),
        "draft_forward_ms": min(draft_ms),
        "target_forward_ms": min(target_ms),
    }
    result["ratio"] = round(result["draft_forward_ms"] / result["target_forward_ms"], 3)
    log.info("cost: draft %.2f ms, target %.2f ms per 1-position forward (ratio %.3f, %d threads)",
             result["draft_forward_ms"], result["target_forward_ms"], result["ratio"], result["threads"])
    return result


def teacher_forced_agreement(model, records: list[dict]) -> float:
    """Fraction of answer positions where the model's argmax equals the target's (position-1 acceptance)."""
    matches = [m for record in records for m in teacher_forced_matches(model, record)]
    return sum(matches) / max(1, len(matches))
