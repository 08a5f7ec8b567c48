"""The feature-head drafter: drafts from the target's hidden states, sent along with each commit.

It serves specd's own feature head (draft_service/feature_head.py: reads the final hidden state, feeds
back its estimate of it) and EAGLE-3 heads (draft_service/eagle3_head.py: reads a low, a middle and a
high layer side by side, feeds back its layer's output): both read (x_t, feature f_{t-1}) and score
x_{t+1} from what they return, so one drafter serves both; a head's `config.feature_size` is the width
of the target's rows it reads and `config.feature_layers` the layers they come from ((): the final one).

Session state, for a committed sequence x_0..x_{L-1}:
- `buffer[:held]` [n, H]: every target feature received so far (f_0..f_{n-1}); the gateway keeps n ≥ L - 1;
- the head's cache: one entry per token x_1..x_{c-1} read with its true preceding feature, where
  c = sequence.cached (x_0 has no preceding feature, so it never gets an entry);
- `last`: the head's estimate f̂_{c-1}, from which the next token is scored.
A proposal first reads the pending tokens x_c..x_{L-1} with their true features, then drafts k
tokens feeding its own estimates forward, and finally drops the drafted entries again: next round
the accepted ones are re-read with the target's true features.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from draft_service.drafters import DraftSession, Proposal
from draft_service.feature_head import FeatureHead, HeadCache
from draft_service.speculation import Outcome, likeliest_outcomes
from specd.v1 import common_pb2
from specd_common.distributions import decode_distribution, encode_over, sample_from, sample_sparse
from specd_common.errors import FailedPrecondition, InvalidArgument
from specd_engine.features import decode_features
from specd_common.params import Warp
from specd_common.sequence import TokenSequence
from specd_common.telemetry import model_forward
from specd_common import tree
from specd_engine.warping import warp_probs


@dataclass
class FeatureSession(DraftSession):
    """A DraftSession plus the head's cache and the target features received so far."""

    cache: HeadCache = field(default_factory=HeadCache)
    buffer: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [capacity, F]; rows [0, held) are f_0..
    held: int = 0  # target features received so far
    last: Optional[torch.Tensor] = None  # [H] the head's output at the last entry's position

    def store(self, start: int, rows: torch.Tensor) -> None:
        """Write rows [n, F] at positions start.. (start ≤ held), growing the buffer geometrically so a
        long answer costs amortized O(n) per round, not a copy of everything held."""
        needed = start + rows.shape[0]
        if needed > self.buffer.shape[0]:
            grown = torch.zeros((max(needed, 2 * self.buffer.shape[0]), rows.shape[1]), device=self.buffer.device)
            grown[:start] = self.buffer[:start]
            self.buffer = grown
        self.buffer[start:needed] = rows
        self.held = needed


@dataclass
class ChainPlan:
    """A drafted chain re-read for the speculation cache (draft_service/speculation.py)."""

    kept: int  # the head cache's length before the chain: true entries only
    start: int  # the chain's first position (the committed length)
    estimates: torch.Tensor  # [k + 1, H] the head's estimate before each chain token and after the last
    outcomes: list  # [Outcome] to prepare, most tokens kept first (each crops the cache to its own prefix)


class FeatureDrafter:
    """Drafter backend around a trained FeatureHead or an EAGLE-3 head (the module docstring)."""

    wants_target_features = True
    speculation_cache = True

    def __init__(self, head: FeatureHead, info: common_pb2.GetModelInfoResponse, max_length: int, name: str = "feature"):
        """Prompt-lookup copies are the gateway's (lookup rounds, which weigh each copy against the
        measured costs); this drafter drafts with the head only. `name`: GetModelInfo.drafter."""
        self.head = head
        self.max_length = max_length
        self._info = info
        self._info.drafter = name
        self._info.wants_target_features = True
        self._info.target_feature_layers[:] = head.config.feature_layers
        self._lock = threading.Lock()  # one head computation at a time (the device is the bottleneck)
        self._vocab_ids_cpu = head.vocab_ids.cpu()  # [V'] the head's token ids: its sparse q, its outcomes' rows

    @property
    def device(self) -> torch.device:
        """Where the head runs (and the session buffers live): the KV budget reads this device's memory."""
        return self.head.vocab_ids.device

    def info(self) -> common_pb2.GetModelInfoResponse:
        return self._info

    def open(self, prompt: Sequence[int], warp: Warp) -> FeatureSession:
        cache = HeadCache()
        sequence = TokenSequence(
            tokens=list(prompt), max_length=self.max_length, cached=1, on_crop=lambda n: cache.crop(max(0, cache.length - n))
        )
        return FeatureSession(sequence=sequence, warp=warp, cache=cache, buffer=torch.zeros((0, self.head.config.feature_size), device=self.device))

    def bytes_per_token(self) -> int:
        """A position holds one target feature row (float32) and the head's one-layer keys and values."""
        config = self.head.config
        element = next(self.head.parameters()).element_size()
        return config.feature_size * 4 + 2 * config.num_kv_heads * config.head_dim * element

    def add_features(self, session: FeatureSession, message: common_pb2.TargetFeatures) -> None:
        """Store features at their positions (overwriting any re-sent ones); they must extend what is held."""
        rows = decode_features(message, self.head.config.feature_size)  # [n, F]
        if not len(rows):
            return
        held, length = session.held, len(session.sequence.tokens)
        if message.start_position + len(rows) > length:  # a session holds one row per position at most
            raise InvalidArgument(
                f"target_features cover positions {message.start_position}..{message.start_position + len(rows) - 1} but the "
                f"session has {length} tokens; send features only for positions of the committed sequence"
            )
        if message.start_position > held:
            raise FailedPrecondition(
                f"target_features start at position {message.start_position} but the session holds features only up to "
                f"position {held - 1}; send the missing positions first"
            )
        session.store(message.start_position, rows.to(self.device))

    def propose(self, session: FeatureSession, k: int, rng: np.random.Generator, branches: int = 1) -> Proposal:
        """k drafted tokens; with branches > 1 a tree of the chain plus, at each position, branches - 1
        more candidates as leaves (free: the head scores them anyway): the next most likely tokens
        when greedy, more draws from the same q without replacement when sampling (what the
        gateway's multi-candidate rule expects)."""
        sequence = session.sequence
        length = len(sequence.tokens)
        k = min(k, self.max_length - length)
        with self._lock, torch.inference_mode():
            self._read_pending(session)
            if session.last is None or k <= 0:  # a one-token sequence has nothing to read yet
                return Proposal(token_ids=[])
            return self._draft(session, k, rng, branches)

    # --- the speculation cache -----------------------------------------------------------------
    def speculation_plan(self, session: FeatureSession, chain: Sequence[int], count: int) -> ChainPlan:
        """Read the committed tokens, then walk the pending chain with the head's own estimates (the
        target's features of these positions come only with the Verify being run now), and choose the
        `count` likeliest outcomes from the head's distributions along it."""
        with self._lock, torch.inference_mode():
            start = len(session.sequence.tokens) - len(chain)
            self._read_pending(session, start)
            kept, estimate = session.cache.length, session.last
            if estimate is None:  # a one-token sequence: nothing to draft from
                return ChainPlan(kept, start, torch.zeros(0), [])
            estimates = [estimate]
            for i, token in enumerate(chain):
                estimates.append(self._step(token, estimates[-1], start + i, session.cache))
            stacked = torch.stack(estimates)  # [k + 1, H]
            probs = torch.zeros((len(estimates), self._info.vocab_size))  # [k + 1, V]
            probs[:, self._vocab_ids_cpu] = torch.softmax(self.head.logits(stacked), -1).cpu()
            outcomes = likeliest_outcomes(probs, chain, count)
            return ChainPlan(kept, start, stacked, sorted(outcomes, key=lambda o: -o[0]))

    def speculate(self, session: FeatureSession, plan: ChainPlan, outcome: Outcome, k: int, rng: np.random.Generator) -> Proposal:
        """The next round's k drafts after the chain's first a tokens and t, drafted as a Propose would
        from there, with the head's estimates in place of the features the Verify will return."""
        a, token = outcome
        with self._lock, torch.inference_mode():
            session.cache.crop(plan.kept + a)
            estimate = self._step(token, plan.estimates[a], plan.start + a, session.cache)
            k = min(k, self.max_length - (plan.start + a + 1))
            return self._draft_steps(session, estimate, plan.start + a + 1, k, rng) if k > 0 else Proposal(token_ids=[])

    def end_speculation(self, session: FeatureSession, plan: ChainPlan) -> None:
        with self._lock:
            session.cache.crop(plan.kept)

    def _step(self, token: int, estimate: torch.Tensor, position: int, cache: HeadCache) -> torch.Tensor:
        """Read one token with the estimate before it; returns the head's estimate after it [H]."""
        with model_forward(1):
            return self.head(torch.tensor([[token]], device=self.device), estimate[None, None],
                             torch.tensor([position], device=self.device), cache)[0, -1]

    def _read_pending(self, session: FeatureSession, length: Optional[int] = None) -> None:
        """Give the head true entries for x_c..x_{L-1} (c = sequence.cached, L = length: the whole
        sequence by default), from features f_{c-1}..f_{L-2}."""
        sequence = session.sequence
        first, length = max(sequence.cached, 1), len(sequence.tokens) if length is None else length
        if first >= length:
            return
        if session.held < length - 1:
            raise FailedPrecondition(
                f"the session holds target features up to position {session.held - 1} but needs them up to "
                f"{length - 2}; send target_features with Prefill and Propose (the gateway does when GetModelInfo "
                "reports wants_target_features)"
            )
        session.cache.crop(first - 1)
        tokens = torch.tensor([sequence.tokens[first:length]], device=self.device)  # [1, n]
        positions = torch.arange(first, length, device=self.device)
        with model_forward(length - first):
            estimates = self.head(tokens, session.buffer[None, first - 1 : length - 1], positions, session.cache)
        session.last = estimates[0, -1]  # [H]
        sequence.cached = length

    def _draft(self, session: FeatureSession, k: int, rng: np.random.Generator, branches: int = 1) -> Proposal:
        """k tokens, each scored from the previous estimate; the drafted entries are dropped afterwards.
        With branches > 1 each step's other candidates join as leaves: nodes are ordered chain token,
        its alternatives, next chain token..., each step's under the previous chain token. When
        sampling, an alternative's draft_probs entry is empty: its q is its first sibling's."""
        proposal = self._draft_steps(session, session.last, len(session.sequence.tokens), k, rng, branches)
        session.sequence.tokens.extend(proposal.chain())  # pending: re-read with true features once accepted
        return proposal

    def _draft_steps(self, session: FeatureSession, estimate: torch.Tensor, position: int, k: int, rng: np.random.Generator,
                     branches: int = 1) -> Proposal:
        """k tokens from `estimate` (the head's estimate before `position`); the head cache ends as it began."""
        kept = session.cache.length
        proposal, steps = Proposal(token_ids=[]), []  # steps: [chain token, its alternatives...] a position
        for step in range(k):
            scores = self.head.logits(estimate)  # [V']
            token = self._choose(scores, session.warp, rng, proposal)
            steps.append([token] + (self._alternatives(scores, token, branches - 1, session.warp, rng, proposal) if branches > 1 else []))
            if step + 1 < k:
                estimate = self._step(token, estimate, position, session.cache)
                position += 1
        session.cache.crop(kept)
        if branches > 1:
            proposal.token_ids, proposal.parents = tree.chain_with_leaves(steps)
        else:
            proposal.token_ids = [candidates[0] for candidates in steps]
        return proposal

    def _alternatives(self, scores: torch.Tensor, chosen: int, count: int, warp: Warp, rng: np.random.Generator,
                      proposal: Proposal) -> list[int]:
        """Up to `count` more candidates for the position `chosen` was drafted for: the next most likely
        (greedy), or further draws without replacement from the q just recorded (sampling; fewer when
        q has no more support)."""
        if warp.greedy:
            best = self.head.vocab_ids[torch.topk(scores, min(count + 1, scores.shape[-1])).indices].tolist()
            return [token for token in best if token != chosen][:count]  # siblings must differ, ties included
        rest, drawn = decode_distribution(proposal.draft_probs[-1], self._info.vocab_size), []
        for _ in range(count):
            rest[drawn[-1] if drawn else chosen] = 0.0
            if rest.sum() <= 0:
                break
            drawn.append(sample_from(rest / rest.sum(), rng))
            proposal.draft_probs.append(common_pb2.Distribution())  # the same q as the first sibling
        return drawn

    def _choose(self, scores: torch.Tensor, warp: Warp, rng: np.random.Generator, proposal: Proposal) -> int:
        """scores [V'] over the head's vocabulary → a token id; when sampling, records the q it came from
        (zero outside the head's vocabulary, which the rejection rule handles exactly). Warping the V'
        scores alone gives the full-vocabulary warp's values (the rest would be -inf: no mass, never in
        top-k or top-p), and the draw reads the very float32 values sent (sample_sparse)."""
        vocab_ids = self.head.vocab_ids
        if warp.greedy:
            return int(vocab_ids[int(torch.argmax(scores))])
        probs = warp_probs(scores[None], warp)[0].cpu().numpy()  # [V']
        q = encode_over(self._vocab_ids_cpu.numpy(), probs, self._info.vocab_size)
        proposal.draft_probs.append(q)
        return sample_sparse(q, rng)
