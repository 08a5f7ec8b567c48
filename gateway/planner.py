"""The round planner: each round, the drafts that promise the most expected tokens per second.

The candidates, cheapest to ask first:
  joined   a lookup copy and the Medusa heads' candidates in one tree (EAGLE-2's dynamic tree over
           every drafter that needs no call), for a request running alone;
  lookup   the copy alone, cut to the length its acceptance pays for;
  heads    the heads' confident nodes;
  draft    the draft service's k drafts (its rate prices the Propose);
  plain    no drafts: one target step, always a candidate, so drafts that keep failing stop costing.
A free candidate is taken only when it promises more than the draft service's round; a candidate
not taken forgets a little toward its prior, so it is tried again later (the text may change kind).
Why these rules and the numbers behind them: docs/design/policy.md.
"""

from __future__ import annotations

from typing import Optional

from gateway.adaptive import valued_tree
from gateway.proposers import (DRAFT, JOINED, LOOKUP, PLAIN, DraftProposer, HeadProposer, LookupProposer, RoundContext,
                               RoundPlan, Verdict, tree_expected, tree_of)
from gateway.rejection import RoundOutcome


class RoundPlanner:
    """Weighs the proposers' offers for one request and tells each what its round came to."""

    def __init__(self, lookup: LookupProposer, heads: HeadProposer, draft: DraftProposer):
        self.lookup, self.heads, self.draft = lookup, heads, draft

    def plan(self, ctx: RoundContext) -> RoundPlan:
        """This round's drafts (free ones in full; a draft-service round's k and tree width). Plans only:
        the draft service's session is the engine's to (re)open (Generation._round)."""
        rival = self.draft.rate(ctx)  # tokens/s of the draft service's best round; 0 when none is open
        copy = self.lookup.copy(ctx)
        if copy and self.heads.can_join(ctx) and (joined := self._joined(copy, ctx, rival)) is not None:
            return joined
        if copy:
            k, rate = self.lookup.best(copy, ctx)
            if k and rate > rival:
                return RoundPlan(LOOKUP, copy[:k], copied=k, expected=self.lookup.expected(copy, k))
            self.lookup.decline()
        offer = self.heads.offer(ctx, rival, self.draft.enabled)
        self.heads.settle(offer)
        if offer.plan is not None:
            return offer.plan
        k, widened = self.draft.shape(ctx)
        return RoundPlan(DRAFT, k=k, widened=widened, expected=self.draft.expected(ctx, k, widened)) if k else RoundPlan(PLAIN)

    def decide_heads_ask(self, ctx: RoundContext) -> bool:
        """Decide, and record, whether this round's Verify asks for the heads' proposals (for the next
        round): HeadProposer.ask answers, record_ask keeps the answer."""
        return self.heads.record_ask(self.heads.ask(ctx, self.draft.rate(ctx), self.draft.enabled))

    def learn(self, plan: RoundPlan, outcome: RoundOutcome) -> Verdict:
        """Each proposer learns from the round; returns the verdict (what of the drafts was kept)."""
        verdict = Verdict.of(plan.drafts, plan.parents, outcome)
        self.lookup.learn(plan, verdict)
        self.heads.learn(plan, verdict)
        self.draft.learn(plan, verdict, outcome)
        return verdict

    def _joined(self, copy: list[int], ctx: RoundContext, rival: float) -> Optional[RoundPlan]:
        """The copy's nodes (valued by the copies' acceptance per position) and the heads' (by their
        calibrated confidence) in one tree: the nodes that pay for their verified positions, priced as
        a Verify that asks for proposals. A copy whose first token misses then still has the heads'
        guesses beside it. The copy's nodes come first, so the tree's main chain is the copy as far as
        it was taken. None when no node of the heads pays (the copy alone decides; the proposals stay)."""
        nodes, rate = valued_tree([self.lookup.nodes(copy), self.heads.nodes(ctx)], self.heads.round_cost(ctx))
        raw = self.heads.raw_values(ctx)
        if not any(node.path in raw for node in nodes) or rate <= rival:
            return None
        copied = sum(node.path == tuple(copy[: len(node.path)]) for node in nodes)
        if not copied:
            self.lookup.decline()
        drafts, parents = tree_of(nodes)
        return self.heads.joined(RoundPlan(JOINED, drafts, parents, copied=copied, expected=tree_expected(nodes)), nodes, raw)
