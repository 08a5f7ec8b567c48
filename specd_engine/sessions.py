"""A session of the engine and what one pass asks of it.

A KVSession is a TokenSequence whose cached positions live in a KV cache (kv_cache.py, or a slot of
the flat pass's store); a Feed is one session's part of a pass: the tokens it feeds and what it
wants back. CausalLM (lm.py) makes the feeds, a pass engine (passes.py) runs them, and the session
takes back its rows (`take_round` / `take_prefill_chunk`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from transformers import DynamicCache

from specd_common import tree
from specd_common.sequence import TokenSequence


@dataclass
class PendingTree:
    """A scored draft tree whose keys/values sit in the cache after the committed tokens, until
    CausalLM.settle_tree keeps one path of it: cache rows base + i hold node i."""

    base: int  # committed tokens (and cache rows) before the nodes
    tokens: list[int]
    parents: list[int]


@dataclass(frozen=True)
class ScoredRow:
    """What a prefill computed at the prompt's last token (CausalLM.prescores): that row's logits, final
    hidden state and captured layers. The session's next chain or tree reads it as its row 0 instead of
    feeding the token again, so the first round after a prompt needs a pass only for its drafts."""

    logits: torch.Tensor  # [1, V]
    hidden: torch.Tensor  # [1, H]
    layers: Optional[torch.Tensor]  # [1, L, H] (CausalLM.capture_layers), or None


@dataclass
class Feed:
    """One session's part of a pass: the tokens it feeds and what it wants back. A chain feeds its
    pending tokens and drafts (`extra`, which join the sequence); a tree its pending tokens and the
    tree's nodes (`tree`, at `positions`, seeing each other by `mask`); a prefill chunk part of a
    prompt, wanting no logits (its last chunk may keep its last row's: `scores_last`). A round whose
    row 0 a prefill scored (`scored`) feeds only its drafts, maybe none."""

    session: "KVSession"
    tokens: list[int]
    logits: int  # logits of the last `logits` positions come back; 0: none (a prefill chunk)
    extra: list[int] = field(default_factory=list)  # a chain's drafts
    tree: Optional[PendingTree] = None  # a tree's nodes
    positions: Optional[list[int]] = None  # a tree's positions; None: consecutive after the cache
    mask: Optional[torch.Tensor] = None  # a tree's bool [n, cached + n], True = may attend
    scored: Optional[ScoredRow] = None  # a round: its row 0, scored by the prefill (KVSession.scored)
    scores_last: bool = False  # a prefill chunk that ends the prompt and keeps its last row's scores
    prompt_rows: int = 0  # its first rows are prompt positions (dense products, tiles), by position: set by CausalLM.run_feeds

    @property
    def logit_rows(self) -> int:
        """How many rows' logits the pass computes for it: its last `logits`, or a scoring chunk's last row."""
        return 1 if self.scores_last else self.logits

    @property
    def is_round(self) -> bool:
        """A chain or tree (logits come back), not a prefill chunk."""
        return bool(self.logits) or self.scored is not None


class KVSession(TokenSequence):
    """A TokenSequence whose cached positions live in a DynamicCache.

    With keep_features, every forward also leaves the final hidden state of the positions it read
    in fed_features [n, H] (from position fed_start): what feature drafters are sent; where the model
    captures decoder layers' outputs too (CausalLM.capture_layers), those in fed_layers [n, L, H]. After a tree
    pass (CausalLM.forward_tree) `tree` says which cache rows hold its nodes. After a prefill that scored
    the prompt's last token (CausalLM.prescores), the cache holds every token and `scored` the next
    position's scores, until a round reads them or a commit moves the sequence on."""

    cache: DynamicCache
    keep_features: bool = False
    fed_start: int = 0
    fed_features: Optional[torch.Tensor] = None
    fed_layers: Optional[torch.Tensor] = None
    prefill_parts: Optional[list] = None  # a chunked prefill's (features, layers) so far, joined once the prompt is cached
    tree: Optional[PendingTree] = None
    prefilled_at: float = float("-inf")  # the batcher's clock when its prompt was cached (-inf: not by a batcher)
    prompt_length: int = 0  # positions [0, prompt_length) are the request's prompt: prefilled, they may take dense products
    scored: Optional[ScoredRow] = None  # the next position's scores, from the prefill (no token is pending then)

    def apply_commit(self, prefix_length: int, append: Sequence[int]) -> None:
        """TokenSequence.apply_commit, once no tree's nodes sit in the cache past the committed rows. A
        commit that keeps the sequence as it is keeps the prefill's scored row (and the cache it needs);
        any other drops it."""
        if self.tree is not None:
            raise RuntimeError("a scored draft tree is pending: CausalLM.settle_tree must keep its path before a commit")
        if self.scored is not None and prefix_length == len(self.tokens) and not append:
            return
        self.scored = None
        super().apply_commit(prefix_length, append)

    def take_round(self, feed: Feed, start: int, logits: Optional[torch.Tensor], hidden: Optional[torch.Tensor],
                   layers: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A chain's or tree's pass is done: its logits [feed.logits, V], final hidden rows [n, H] and
        captured layers [n, L, H] from position `start` (None where it fed nothing). Returns the
        round's logits [k + 1, V], its row 0 the prefill's where that scored it; keeps the features
        where asked, and moves the session on (drafts join the tokens, a tree waits to be settled)."""
        scored = feed.scored
        if scored is not None:  # row 0 is the prefill's: [1 + n, ...]
            logits = scored.logits if logits is None else torch.cat((scored.logits, logits))
            hidden = scored.hidden if hidden is None else torch.cat((scored.hidden, hidden))
            if scored.layers is not None:  # (a prefill before any layer was captured kept none)
                layers = scored.layers if layers is None else torch.cat((scored.layers, layers))
            start, self.scored = start - 1, None
        if self.keep_features:
            self.fed_start, self.fed_features, self.fed_layers = start, hidden, layers
        self.tokens.extend(feed.extra)
        self.cached, self.tree = len(self.tokens), feed.tree
        return logits

    def take_prefill_chunk(self, feed: Feed, start: int, end: int, logits: Optional[torch.Tensor], hidden: torch.Tensor,
                           layers: Optional[torch.Tensor]) -> None:
        """A prefill chunk's pass is done (positions [start, start + n); the prefill caches positions
        before `end`): a chunk that ends the prompt and scores its last row keeps that row (`scored`,
        from logits [1, V]); the features are kept aside and the prompt's joined once, after its last
        chunk (they are those of one pass; joining at every chunk would copy them once a chunk)."""
        if feed.scores_last:
            self.scored = ScoredRow(logits.clone(), hidden[-1:].clone(), layers[-1:].clone() if layers is not None else None)
            hidden, layers = hidden[:-1], layers[:-1] if layers is not None else None
        self.cached += len(feed.tokens)
        if not self.keep_features:
            return
        parts = self.prefill_parts = (self.prefill_parts if start > 0 else None) or []
        parts.append((hidden, layers))
        if start + len(feed.tokens) >= end:  # the prompt's last chunk
            self.fed_start, self.fed_features = 0, torch.cat([features for features, _ in parts])  # [n, H]
            self.fed_layers = torch.cat([part for _, part in parts]) if layers is not None else None  # [n, L, H]
            self.prefill_parts = None


def tree_mask(past: int, fed: int, parents: Sequence[int]) -> torch.Tensor:
    """Which columns each row of a tree's pass may see (bool [fed + nodes, past + fed + nodes], True =
    may attend): the `past` cached positions, the `fed` pending tokens causally, and each node its
    pending tokens, its ancestors and itself (specd_common/tree.py)."""
    nodes = len(parents)
    mask = torch.zeros((fed + nodes, past + fed + nodes), dtype=torch.bool)  # [q, kv]
    mask[:, :past] = True
    mask[:fed, past : past + fed] = torch.ones((fed, fed), dtype=torch.bool).tril()
    mask[fed:, past : past + fed] = True
    mask[fed:, past + fed :] = torch.tensor(tree.ancestry(parents), dtype=torch.bool).reshape(nodes, nodes)
    return mask
