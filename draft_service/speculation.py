"""The speculation cache: next round's drafts, prepared while the target verifies this round's.

After a Propose the draft would sit idle for a whole Verify. Instead it drafts round r + 1 for the
verification outcomes it finds likeliest: "the first a of my k drafts are kept, then the target
appends t" (t: the correction when a < k, the bonus token when a = k). The next Propose carries that
commit; when it is one of the prepared outcomes the answer is already made (SSD/"Saguaro", vLLM's
Disagg-SD speculation cache keyed by (sequence, accepted, bonus token)).

Exactness does not depend on the cache: a prepared answer's q is the distribution its tokens were
drawn from (the gateway's rejection rule needs no more). Reproducibility does: the prepared answer
must not depend on *when* it is made. So the outcomes are chosen from the drafts alone, each is drawn
from its own seed (ProposeRequest.next_seed and the outcome), and a Propose that arrives before the
background worker has reached its session computes the outcome it needs itself, by the same code.
Hit or miss is then a function of the request, never of timing.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

MAX_QUEUED = 256  # sessions waiting for the worker; beyond that a Propose simply prepares nothing (a miss, not an error)
MAX_JOBS = 1024  # jobs held for their next Propose; the oldest goes first (its session most likely ended without a Release)

Outcome = tuple[int, int]  # (a: drafts kept, t: the token the target appends after them)


def likeliest_outcomes(probs: torch.Tensor, chain: Sequence[int], count: int) -> list[Outcome]:
    """The `count` likeliest verification outcomes of a drafted chain, judged by the draft's own
    distributions as if the target agreed with them: P(a, t) = q_1(d_1)···q_a(d_a) · q_{a+1}(t), with
    t ≠ d_{a+1} for a < k (a correction) and any t for a = k (the bonus token).

    probs [k + 1, V]: the draft's distribution at each drafted position and the one after the last;
    chain [k]: the drafted tokens. Returns (a, t) pairs, likeliest first (ties: fewer kept first)."""
    k = len(chain)
    if count <= 0 or probs.shape[0] != k + 1:
        return []
    chain_t = torch.tensor(list(chain), dtype=torch.long)
    kept = probs[torch.arange(k), chain_t] if k else probs.new_zeros(0)  # [k] q_i(d_i)
    prefix = torch.cat([probs.new_ones(1), torch.cumprod(kept, 0)])  # [k + 1] P(first a kept)
    weights = probs * prefix[:, None]  # [k + 1, V]
    if k:
        weights[torch.arange(k), chain_t] = -1.0  # the drafted token is not a correction
    top = torch.topk(weights.flatten(), min(count, weights.numel()))
    width = probs.shape[1]
    pairs = [(int(i) // width, int(i) % width, float(w)) for i, w in zip(top.indices, top.values) if w > 0]
    pairs.sort(key=lambda p: (-p[2], p[0]))
    return [(a, t) for a, t, _ in pairs]


def outcome_rng(seed: int, outcome: Outcome) -> np.random.Generator:
    """The generator a prepared outcome draws from: a function of the next seed and the outcome only."""
    return np.random.default_rng([seed, outcome[0], outcome[1]])


class Speculator(Protocol):
    """What a drafter offers for the cache (FeatureDrafter implements it)."""

    def speculation_plan(self, session: Any, chain: Sequence[int], count: int) -> Any:
        """Re-read the session's pending chain (the last len(chain) tokens of its sequence) and choose
        its likeliest outcomes (plan.outcomes, in the order the worker prepares them)."""
        ...

    def speculate(self, session: Any, plan: Any, outcome: Outcome, k: int, rng: np.random.Generator) -> Any:
        """The Proposal the next round would get after `outcome`, drawn with rng."""
        ...

    def end_speculation(self, session: Any, plan: Any) -> None:
        """Drop what the plan added to the session's caches."""
        ...


@dataclass
class SpeculationJob:
    """One session's preparation for its next Propose: made after a Propose answered, resolved by the
    next one (hit, miss or never started), whatever the worker did in between."""

    session: Any
    chain_start: int  # the committed length the chain follows (the next commit's prefix_length is chain_start + a)
    chain: tuple[int, ...]
    k: int
    count: int
    seed: int
    plan: Any = None
    answers: dict = field(default_factory=dict)  # Outcome → Proposal
    done: bool = False
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def key(self, prefix_length: int, append: Sequence[int]) -> Optional[Outcome]:
        """The outcome a commit stands for, or None when it is none this job could prepare."""
        a = prefix_length - self.chain_start
        if len(append) != 1 or not 0 <= a <= len(self.chain):
            return None
        return a, int(append[0])

    def run_all(self, drafter: Speculator) -> None:
        """The worker: the plan, then one outcome per hold of the job's lock, so the next Propose waits
        for one outcome at most and then takes over; the worker stops when it has."""
        with self.lock:
            if self.done or self.cancelled:
                return
            try:
                self._plan(drafter)
            except BaseException:
                self._finish(drafter)
                raise
        for outcome in self.plan.outcomes:
            with self.lock:
                if self.done or self.cancelled:
                    return
                try:
                    self._answer(drafter, outcome)
                except BaseException:
                    self._finish(drafter)
                    raise
        with self.lock:
            self._finish(drafter)

    def resolve(self, drafter: Speculator, outcome: Optional[Outcome]):
        """The next Propose: the prepared answer for its outcome, or None (a miss). When the worker has not
        reached this outcome yet, prepares it now by the same code (the answer the worker would have made;
        outcomes are prepared most kept tokens first, so the head's cache still holds its prefix), so a hit
        never depends on how busy the worker was. Ends the job either way."""
        with self.lock:
            try:
                if outcome is None or self.cancelled:
                    return None
                if not self.done:
                    self._plan(drafter)
                    if outcome in self.plan.outcomes:
                        self._answer(drafter, outcome)
                return self.answers.get(outcome)
            finally:
                self._finish(drafter)

    def _plan(self, drafter: Speculator) -> None:
        if self.plan is None:
            self.plan = drafter.speculation_plan(self.session, self.chain, self.count)

    def _answer(self, drafter: Speculator, outcome: Outcome) -> None:
        if outcome not in self.answers:
            self.answers[outcome] = drafter.speculate(self.session, self.plan, outcome, self.k, outcome_rng(self.seed, outcome))

    def _finish(self, drafter: Speculator) -> None:
        if self.plan is not None and not self.done:
            drafter.end_speculation(self.session, self.plan)
        self.done = True


class SpeculationCache:
    """Jobs by session id, and the one background worker that runs them between Proposes. The worker
    is a single thread: on a CPU it stands for the draft's own core, on a GPU for its own stream."""

    def __init__(self, drafter: Speculator):
        self.drafter = drafter
        self._jobs: dict[str, SpeculationJob] = {}
        self._lock = threading.Lock()
        self._queue: "queue.Queue[Optional[SpeculationJob]]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None

    def start(self) -> "SpeculationCache":
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="draft-speculation", daemon=True)
            self._worker.start()
        return self

    def stop(self) -> None:
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=5)
            self._worker = None

    def take(self, session_id: str) -> Optional[SpeculationJob]:
        """The session's job for its Propose now (removed: a job serves one Propose)."""
        with self._lock:
            return self._jobs.pop(session_id, None)

    def schedule(self, session_id: str, job: SpeculationJob) -> bool:
        """Queue a job for the worker; False (nothing prepared) when the queue is full."""
        if self._queue.qsize() >= MAX_QUEUED:
            return False
        with self._lock:
            old = self._jobs.pop(session_id, None)
            if old is not None:
                old.cancelled = True
            self._jobs[session_id] = job
            while len(self._jobs) > MAX_JOBS:
                self._jobs.pop(next(iter(self._jobs))).cancelled = True
        self._queue.put(job)
        return True

    def drop(self, session_id: str) -> None:
        """The session is gone (released, expired): its job is not worth running."""
        job = self.take(session_id)
        if job is not None:
            job.cancelled = True

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                job.run_all(self.drafter)
            except Exception:  # a failed preparation is a miss; the next Propose drafts as usual
                log.exception("speculation for a session failed")
                job.cancelled = True


def resolve_or_none(job: Optional[SpeculationJob], drafter: Speculator, prefix_length: int, append: Sequence[int]):
    """The prepared Proposal for a commit, or None."""
    if job is None:
        return None
    return job.resolve(drafter, job.key(prefix_length, append))

