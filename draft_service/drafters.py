"""Drafter backends behind one small interface: open a session, propose k tokens.

Like transformers' candidate generators, a model drafter and a model-free drafter plug into the
same service. A proposal carries the exact distribution each token was sampled from (encoded as
it goes on the wire), so the gateway's rejection rule uses the very q the draft used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch

from specd_common import tree
from specd_common.lookup import LONGEST_NGRAM, SHORTEST_NGRAM, prompt_lookup
from specd.v1 import common_pb2
from specd_engine.autotune import kv_bytes_per_token
from specd_engine.batching import BatchPolicy, make_batcher
from specd_common.distributions import decode_distribution, one_hot, sample_from
from specd_engine.lm import CausalLM
from specd_engine.models import LoadedModel, describe_model
from specd_common.sequence import TokenSequence
from specd_common.params import Warp
from specd_engine.warping import encode_rows, warp_probs

NGRAM_MAX_LENGTH = 1 << 20  # a model-free drafter has no context limit of its own; the target's applies


@dataclass
class DraftSession:
    """One request's drafting state: its token sequence (with cache, for model drafters) and warping."""

    sequence: TokenSequence
    warp: Warp


@dataclass
class Proposal:
    """Drafted tokens and, when sampling, the distribution each was drawn from."""

    token_ids: list[int]
    draft_probs: list[common_pb2.Distribution] = field(default_factory=list)  # [len(token_ids)] or []
    parents: list[int] = field(default_factory=list)  # a tree (specd_common/tree.py); [] for a chain

    def chain(self) -> list[int]:
        """The drafted chain: every token of a chain, a tree's main chain."""
        return [self.token_ids[i] for i in tree.main_chain(self.parents)] if self.parents else list(self.token_ids)


class Drafter(Protocol):
    """What the DraftService needs from a backend."""

    def open(self, prompt: Sequence[int], warp: Warp) -> DraftSession: ...

    def propose(self, session: DraftSession, k: int, rng: np.random.Generator, branches: int = 1) -> Proposal:
        """Up to k tokens in a chain; with branches > 1 a drafter that can branch (greedy) may return a
        tree of the chain plus branches - 1 alternatives at each position (Proposal.parents)."""
        ...

    def info(self) -> common_pb2.GetModelInfoResponse: ...

    def bytes_per_token(self) -> int:
        """Memory one position of a session costs (its KV cache, features...); 0: negligible, no budget."""
        ...


class ModelDrafter:
    """A small causal LM sharing the target's tokenizer, drafting autoregressively with its KV cache."""

    def __init__(self, loaded: LoadedModel, batching: BatchPolicy = BatchPolicy()):
        self.lm = CausalLM(loaded)
        self.batcher = make_batcher(self.lm, batching)  # None: one session per forward
        self._info = describe_model(loaded, drafter="model")

    @property
    def device(self) -> torch.device:
        """Where the model and its sessions' caches live (the KV budget reads this device's memory)."""
        return self.lm.loaded.device

    def info(self) -> common_pb2.GetModelInfoResponse:
        return self._info

    def open(self, prompt: Sequence[int], warp: Warp) -> DraftSession:
        return DraftSession(self.lm.new_session(prompt), warp)

    def bytes_per_token(self) -> int:
        model = self.lm.loaded.model
        return kv_bytes_per_token(model.config, next(model.parameters()).element_size())

    def propose(self, session: DraftSession, k: int, rng: np.random.Generator, branches: int = 1) -> Proposal:
        """A chain (branches is not used: a tree would need a tree mask in the draft model's cache too)."""
        sequence = session.sequence
        proposal = Proposal(token_ids=[])
        for _ in range(min(k, self.lm.max_length - len(sequence.tokens))):
            logits = (self.batcher or self.lm).forward(sequence)  # [1, V]; concurrent sessions' steps share a pass
            if session.warp.greedy:
                token = int(torch.argmax(logits[-1]))
            else:
                q = encode_rows(warp_probs(logits, session.warp)[-1:])[0]
                token = sample_from(decode_distribution(q), rng)
                proposal.draft_probs.append(q)
            proposal.token_ids.append(token)
            sequence.tokens.append(token)  # pending: fed by the next step or the next round
        return proposal


class NgramDrafter:
    """Model-free prompt lookup: deterministic proposals (q is one-hot), no cache, no weights."""

    def __init__(self, min_ngram: int = SHORTEST_NGRAM, max_ngram: int = LONGEST_NGRAM):
        """min_ngram / max_ngram: the suffix n-gram lengths tried (prompt_lookup), as the gateway's lookup rounds."""
        if min_ngram < 1:
            raise ValueError(f"lookup min n-gram must be ≥ 1, got {min_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def info(self) -> common_pb2.GetModelInfoResponse:
        return common_pb2.GetModelInfoResponse(model_name=f"ngram(max_ngram={self.max_ngram})", drafter="ngram")

    def open(self, prompt: Sequence[int], warp: Warp) -> DraftSession:
        return DraftSession(TokenSequence(tokens=list(prompt), max_length=NGRAM_MAX_LENGTH), warp)

    def bytes_per_token(self) -> int:
        return 0  # token ids only: the target's context and the verify's budget bound them

    def propose(self, session: DraftSession, k: int, rng: np.random.Generator, branches: int = 1) -> Proposal:
        """A chain: the copy that followed the longest earlier match (branches is not used)."""
        tokens = prompt_lookup(session.sequence.tokens, k, max_ngram=self.max_ngram, min_ngram=self.min_ngram)
        session.sequence.tokens.extend(tokens)
        probs = [] if session.warp.greedy else [one_hot(t) for t in tokens]
        return Proposal(token_ids=tokens, draft_probs=probs)
