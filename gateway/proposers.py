"""Who proposes a round's drafts, each proposer with the state that says how good its drafts are.

  LookupProposer  the gateway's own prompt-lookup copies: free (no model runs, no call).
  HeadProposer    the verify's Medusa heads' proposals, returned by the last Verify: free, but asking
                  for them makes that Verify dearer, so it is asked only when a head round could pay.
  DraftProposer   the draft service: a Propose round trip per round; when it fails only speed is lost.

Each owns its acceptance estimate per draft position (and, for trees, how often its alternatives
rescue a missed draft), its calibration, its back-off and its probe counter, and learns only from
the rounds whose drafts were its own (`learn`). gateway/planner.py weighs their offers; the engine
runs the round. Free drafts are deterministic: their q is one-hot.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import grpc
import numpy as np

from gateway.adaptive import (AcceptanceEstimate, HeadCalibration, SharedEstimates, StepCosts, TreeNode, best_rate, best_shape,
                              chain_nodes, confident_tree, depth_sums, expected_tokens, head_nodes)
from gateway.features import FeatureLog, HeadProposals, head_drafts_after_tree, head_drafts_at
from gateway.links import Link, SessionSet
from gateway.policy import POLICY, SpeculationPolicy
from gateway.rejection import RoundOutcome
from specd.v1 import common_pb2, draft_pb2, verify_pb2
from specd_common import tree
from specd_common.lookup import prompt_lookup
from specd_common.sequence import common_prefix

log = logging.getLogger(__name__)

PLAIN, LOOKUP, HEADS, JOINED, DRAFT = "plain", "lookup", "heads", "joined", "draft"  # where a round's drafts came from
FORCED = "forced"  # structured output: the tokens the grammar forces (gateway.engine, jump-forward)


@dataclass(frozen=True)
class RoundContext:
    """What every proposer reads to plan one round."""

    sequence: Sequence[int]  # the committed tokens: prompt + generated
    tokens_left: int  # new tokens the request may still emit (the last of a round is the bonus)
    allowed: bool  # the server's load lets requests speculate now (the speculation cap)
    alone: bool  # no other request shares the verify's passes: a tree pass holds nobody up
    costs: StepCosts
    position_s: float = 0.0  # what one more verified position of this request costs the round of every request sharing its passes (0 alone; Backends.position_price_s)

    def draft_cap(self, longest: int) -> int:
        """At most `longest` drafts, and one token fewer than the request may still emit."""
        return max(0, min(longest, self.tokens_left - 1))

    def tree_branches(self, branches: int) -> int:
        """Candidates a position may take this round: trees only for a request running alone. Beside
        other requests a tree's extra positions cost every request sharing the pass (a padded batch
        pads them all; since ragged passes, its own positions only: not re-measured yet)."""
        return branches if self.alone else 1

    def free_cost(self, k: int, heads: bool = False, tree: bool = False) -> float:
        """Seconds of a round of k drafts made without a call (`tree`: k nodes that are not a chain).
        heads: its Verify asks for the heads' proposals when it drafts (a plain round does not);
        otherwise priced at the share of Verifies that ask."""
        return self.costs.round_cost_s(k, drafting=False, heads=(k > 0) if heads else None, tree=tree) + self.shared_cost(k)

    def shared_cost(self, k: int) -> float:
        """Seconds k drafted positions add to the round of the requests that share this one's passes,
        summed over them: beside others a request's own Verify hardly lengthens when it drafts (the
        pass is everyone's), but each of its rows delays every request in the pass. Priced so, a
        request drafts only the positions that pay for the batch (k = 1-2 among 8 on 2 cores, not 3-4)."""
        return k * self.position_s


@dataclass
class RoundPlan:
    """The drafts one round verifies and whose they are."""

    source: str = PLAIN  # PLAIN, LOOKUP, HEADS, JOINED (a lookup copy and the heads in one tree), DRAFT or FORCED
    drafts: list[int] = field(default_factory=list)  # [n]; a DRAFT round's arrive with its Propose
    parents: list[int] = field(default_factory=list)  # [n] a tree's parent of each node (-1: the root); [] for a chain
    k: int = 0  # DRAFT: drafts to ask the draft service for
    widened: int = 0  # DRAFT: how many of them get alternatives beside them (a tree)
    copied: int = 0  # nodes of a lookup copy that lead the tree's main chain
    head_nodes: frozenset = frozenset()  # which nodes the heads offered
    head_predicted: Optional[list[float]] = None  # the heads' nodes' values by depth, unscaled (HeadCalibration learns from them)
    expected: float = 1.0  # tokens the planner expects the round to keep (drafts + the recovered/bonus token)


@dataclass(frozen=True)
class Verdict:
    """What the target made of a round's drafts, as the proposers learn from it."""

    chain: int  # drafts in the round's main chain (a chain round: all; what k counts)
    kept: int  # of the main chain, accepted
    accepted: int  # accepted in all (a tree's alternative may add one beyond the kept chain)
    kept_nodes: Sequence[int]  # the accepted nodes' indices
    missed_beside_alternatives: bool  # a tree whose first missed chain draft had alternatives beside it

    @classmethod
    def of(cls, drafts: list[int], parents: list[int], outcome: RoundOutcome) -> "Verdict":
        if not parents:
            return cls(len(drafts), outcome.accepted, outcome.accepted, range(outcome.accepted), False)
        chain = tree.main_chain(parents)
        kept = common_prefix(chain, list(outcome.path))
        beside = kept < len(chain) and parents.count(parents[chain[kept]]) > 1
        return cls(len(chain), kept, outcome.accepted, outcome.path, beside)


class LookupProposer:
    """Prompt lookup: what followed the latest earlier occurrence of the sequence's last n-gram
    (specd_common/lookup.py), cut to the length its own measured acceptance pays for."""

    def __init__(self, max_tokens: int, min_ngram: int, adaptive: bool, num_draft_tokens: int,
                 policy: SpeculationPolicy = POLICY, shared: Optional[SharedEstimates] = None):
        self.max_tokens = (max_tokens if adaptive else num_draft_tokens) if max_tokens else 0  # 0: no lookup rounds
        self.min_ngram, self.adaptive = min_ngram, adaptive
        self.acceptance = AcceptanceEstimate(policy=policy, shared=shared and shared.lookup)  # copies behave unlike any model's drafts

    def copy(self, ctx: RoundContext) -> list[int]:
        """The whole copy the sequence offers now ([] when nothing recurs or speculation is paused)."""
        cap = ctx.draft_cap(self.max_tokens)
        return prompt_lookup(ctx.sequence, cap, min_ngram=self.min_ngram) if cap and ctx.allowed else []

    def nodes(self, copy: list[int]) -> list[TreeNode]:
        """The copy as tree nodes valued by its acceptance per position (for a tree shared with the heads)."""
        return chain_nodes(copy, self.acceptance.chain(len(copy)))

    def best(self, copy: list[int], ctx: RoundContext) -> tuple[int, float]:
        """How much of the copy to verify and the tokens per second it promises (the fixed policy: all)."""
        if not self.adaptive:
            return len(copy), float("inf")
        k, _, rate = best_shape(self.acceptance.chain(len(copy)), len(copy), None, lambda k, _: ctx.free_cost(k))  # chains only
        return k, rate

    def expected(self, copy: list[int], k: int) -> float:
        """Tokens a round verifying the copy's first k tokens is expected to keep."""
        return expected_tokens(self.acceptance.chain(len(copy)), k)

    def decline(self) -> None:
        """Not drafted this round: the estimate forgets toward its prior, so copies are tried again later."""
        self.acceptance.update(0, 0)

    def learn(self, plan: RoundPlan, verdict: Verdict) -> None:
        if plan.copied:
            self.acceptance.update(plan.copied, min(verdict.kept, plan.copied))


@dataclass(frozen=True)
class HeadAsk:
    """What this round's Verify asks of the heads (HeadProposer.ask): proposals or not, from how many
    heads (VerifyRequest.head_depth), and whether not asking declines a head round."""

    asked: bool = False
    depth: int = 0
    declined: bool = False


TAKEN, DECLINED, NO_OFFER = "taken", "declined", "none"  # what became of a HeadOffer (HeadProposer.settle)


class HeadOffer(NamedTuple):
    """A head round on offer (HeadProposer.offer), or None, and what settling it records."""

    plan: Optional[RoundPlan]
    outcome: str  # TAKEN (a round or a probe), DECLINED (no round paid) or NO_OFFER (nothing to judge)


class HeadProposer:
    """The verify's Medusa heads: each head's candidates after the last committed token, with their
    confidences, arrive with a Verify that asked for them. A round takes the nodes that pay by their
    calibrated confidence (adaptive.confident_tree); heads that never look confident enough still
    draft one token every probe_every_rounds rounds, since the calibration learns only from drafts."""

    def __init__(self, heads: int, adaptive: bool, num_draft_tokens: int, branches: int,
                 policy: SpeculationPolicy = POLICY, shared: Optional[SharedEstimates] = None):
        self.heads = heads  # 0: no head rounds
        self.adaptive, self.num_draft_tokens, self.branches = adaptive, num_draft_tokens, branches
        self.policy = policy
        self.acceptance = AcceptanceEstimate(policy=policy, shared=shared and shared.heads)
        self.rescue = AcceptanceEstimate(prior=policy.rescue_prior, policy=policy, shared=shared and shared.head_rescue)
        self.calibration = HeadCalibration(policy, shared=shared and shared.head_calibration)
        self.proposals = HeadProposals()  # from the last Verify
        self.asked = False  # the last Verify asked for proposals (its cost is priced apart)
        self.depth = 0  # ... from that many heads (VerifyRequest.head_depth; 0: all)
        self._declined = False  # the last Verify did not ask: no head round could pay
        self._declined_rounds = 0  # rounds in a row whose proposals did not pay (a probe follows)

    def ask(self, ctx: RoundContext, rival_rate: float, draft_enabled: bool) -> HeadAsk:
        """Whether this round's Verify should return proposals for the next round (a query: record_ask
        keeps the answer): only when a head round could pay by the heads' acceptance so far (proposals
        cost every pass that asks, used or not; the fixed policy: when no draft service drafts). Not
        asking counts as declining. And from how many heads (`depth`): as many as the best chain by that
        acceptance drafts, and heads_past_best_chain more (a probe: one; the fixed policy:
        num_draft_tokens), since each head costs the verify a product over its vocabulary (one head
        0.35 ms, three 1.0 ms beside a 6.4 ms one-row pass of the default target, natively on a 2-vCPU
        Xeon: docs/design/medusa-heads.md)."""
        if not self.heads or not ctx.allowed:
            return HeadAsk()
        if not self.adaptive:
            return HeadAsk(not draft_enabled, min(self.heads, self.num_draft_tokens))
        k, rate = best_rate(self.acceptance.chain(self.heads), self.heads, lambda k: ctx.free_cost(k, heads=True))
        if bool(k) and rate > rival_rate:
            return HeadAsk(True, min(self.heads, k + self.policy.heads_past_best_chain))
        probe = self._probe_due()
        return HeadAsk(probe, 1 if probe else 0, declined=not probe)

    def record_ask(self, ask: HeadAsk) -> bool:
        """This round's Verify asks as `ask` says (its cost is priced apart; a declined one forgets when
        the next round settles its offer); returns whether it asks."""
        self.asked, self.depth, self._declined = ask.asked, ask.depth, ask.declined
        return ask.asked

    def _probe_due(self) -> bool:
        """probe_every_rounds rounds in a row took no head round: the next one drafts one head token,
        beside a draft service too (its estimate would otherwise never move from what last declined it)."""
        return self._declined_rounds >= self.policy.probe_every_rounds

    @staticmethod
    def rows_to_ask(plan: RoundPlan, known_row: bool) -> int:
        """Rows of a sampled chain's Verify that return proposals (VerifyRequest.head_rows): the pending
        token's and one more for each draft the round expects to keep, rounded down. Where the gateway
        judges, a sampled round's kept length is known only after judging, so the verify would run the
        heads' product on every row (on the 2-core EPYC a 4-position sampled pass took 109 ms with
        proposals at all 4 rows, 72 without); a round that keeps more than expected finds no proposals
        and drafts otherwise next round. 0 (every row) where the verify knows the row the caller reads
        (`known_row`: greedy, or the coupled rule's draws made there) and for trees, which it answers
        at one row or all."""
        if known_row or plan.parents:
            return 0
        return min(len(plan.drafts), int(plan.expected - 1.0)) + 1

    def candidates_per_head(self) -> int:
        """Candidates a head returns when asked (0: the verify's default, one)."""
        return self.branches if self.asked and self.branches > 1 else 0

    def receive(self, scores: verify_pb2.VerifyResponse, drafts: int, parents: list[int], outcome: RoundOutcome,
                known_row: bool, committed: int) -> None:
        """Keep the proposals after the last committed token (`committed` tokens) from a Verify's reply
        (`known_row`: the verify chose the row, greedy or drawing the coupled rule's tokens)."""
        if parents and not known_row:  # the verify sent every row: the sampled path picks its own
            self.proposals = head_drafts_after_tree(scores.head_drafts, drafts, outcome.path)
        else:
            self.proposals = head_drafts_at(scores.head_drafts, committed - 2)

    def can_join(self, ctx: RoundContext) -> bool:
        """Whether the proposals may share a tree with a lookup copy this round."""
        return self.adaptive and not self._declined and bool(self.proposals) and ctx.tree_branches(self.branches) > 1

    def nodes(self, ctx: RoundContext) -> list[TreeNode]:
        """The proposals as tree nodes valued by their calibrated confidence (without taking them)."""
        tokens, confidences = self._candidates(self.proposals, ctx)
        return head_nodes(tokens, confidences, self.calibration.scales(len(tokens)))

    def raw_values(self, ctx: RoundContext) -> dict[tuple[int, ...], float]:
        """The proposals' nodes' path products (unscaled), by path: what HeadCalibration compares with
        what the target kept."""
        return {node.path: node.value for node in head_nodes(*self._candidates(self.proposals, ctx))}

    def round_cost(self, ctx: RoundContext) -> Callable[[int, bool], float]:
        """Seconds of a round of n free nodes whose Verify asks for proposals (`tree`: not a chain)."""
        return lambda n, tree: ctx.free_cost(n, heads=True, tree=tree)

    def available(self) -> HeadProposals:
        """The last Verify's proposals as a round may use them (a query): none when it did not ask."""
        return HeadProposals() if self._declined else self.proposals

    def take(self) -> HeadProposals:
        """The last Verify's proposals, once (available); a Verify that did not ask declined a head round:
        the count of declined rounds grows and the estimate forgets."""
        proposals, self.proposals = self.available(), HeadProposals()
        if self._declined:
            self._declined = False
            self._declined_rounds += 1
            self.acceptance.update(0, 0)
        return proposals

    def offer(self, ctx: RoundContext, rival_rate: float, draft_enabled: bool) -> HeadOffer:
        """A head round from the last Verify's proposals, or none when there are none, speculation is
        paused or the rival (the draft service) promises more tokens per second (a query: settle
        takes the proposals and records the outcome). The fixed policy drafts every candidate of the
        first num_draft_tokens heads, only where no draft service drafts."""
        proposals = self.available()
        if not proposals or not ctx.allowed:
            return HeadOffer(None, NO_OFFER)
        if not self.adaptive:
            if draft_enabled:
                return HeadOffer(None, NO_OFFER)
            drafts, parents = every_candidate(proposals.tokens[: ctx.draft_cap(self.num_draft_tokens)])
            return HeadOffer(RoundPlan(HEADS, drafts, parents) if drafts else None, NO_OFFER)
        tokens, confidences = self._candidates(proposals, ctx)
        scales = self.calibration.scales(len(tokens))
        nodes, rate = confident_tree(tokens, confidences, scales, self.round_cost(ctx))
        if not (nodes and rate > rival_rate):
            if not (tokens and self._probe_due()):
                return HeadOffer(None, DECLINED)
            nodes = [TreeNode((tokens[0][0],), min(confidences[0][0] * scales[0], 1.0))]  # one token, so the calibration and the estimate learn
        drafts, parents = tree_of(nodes)
        raw = {node.path: node.value for node in head_nodes(tokens, confidences)}
        return HeadOffer(RoundPlan(HEADS, drafts, parents, head_nodes=frozenset(range(len(nodes))),
                                   head_predicted=depth_sums(nodes, raw), expected=tree_expected(nodes)), TAKEN)

    def settle(self, offer: HeadOffer) -> None:
        """The round has chosen: the proposals are taken (a Verify that did not ask declined a head
        round), and the offer's outcome recorded: a round taken or probed starts the count of declined
        rounds again; a declined offer counts one and the estimate forgets a little."""
        self.take()
        if offer.outcome == TAKEN:
            self._declined_rounds = 0
        elif offer.outcome == DECLINED:
            self._declined_rounds += 1
            self.acceptance.update(0, 0)

    def joined(self, plan: RoundPlan, nodes: list[TreeNode], raw: dict[tuple[int, ...], float]) -> RoundPlan:
        """Record that a round took these of the heads' nodes (`raw`: the heads' paths → unscaled values)."""
        self.take()
        self._declined_rounds = 0
        plan.head_predicted = depth_sums([node for node in nodes if node.path in raw], raw)
        plan.head_nodes = frozenset(i for i, node in enumerate(nodes) if node.path in raw)
        return plan

    def learn(self, plan: RoundPlan, verdict: Verdict) -> None:
        if plan.source == HEADS or (plan.source == JOINED and not plan.copied):
            self.acceptance.update(verdict.chain, verdict.kept)
        if verdict.missed_beside_alternatives and plan.source in (HEADS, JOINED) and not plan.copied:
            self.rescue.observe(verdict.kept, verdict.accepted > verdict.kept)
        if plan.head_predicted is not None:
            depths = tree.depths(plan.parents) if plan.parents else range(1, len(plan.drafts) + 1)
            kept = [0] * len(plan.head_predicted)
            for node in verdict.kept_nodes:
                if node in plan.head_nodes and depths[node] <= len(kept):
                    kept[depths[node] - 1] += 1
            self.calibration.observe(plan.head_predicted, kept)

    def _candidates(self, proposals: HeadProposals, ctx: RoundContext) -> tuple[list[list[int]], list[list[float]]]:
        """What a round chooses among: the first heads' (one fewer than tokens left) first candidates
        (tree_branches) and their confidences. A verify that sends no confidences gets the heads'
        measured acceptance per position in their place, best candidates only."""
        cap = ctx.draft_cap(len(proposals.tokens))
        if not proposals.confidences:
            rates = self.acceptance.chain(cap)
            return [c[:1] for c in proposals.tokens[:cap]], [[rate] for rate in rates]
        branches = ctx.tree_branches(min(len(proposals.tokens[0]), self.branches))
        return [c[:branches] for c in proposals.tokens[:cap]], [p[:branches] for p in proposals.confidences[:cap]]


def every_candidate(steps: list[list[int]]) -> tuple[list[int], list[int]]:
    """Each head's candidates (best first, distinct): the best ones as a chain (parents []) when there is
    one candidate a head, else that chain with the others beside each as leaves."""
    if all(len(candidates) == 1 for candidates in steps):
        return [candidates[0] for candidates in steps], []
    return tree.chain_with_leaves(steps)


def tree_expected(nodes: Sequence[TreeNode]) -> float:
    """Tokens a round of these nodes is expected to keep: 1 + the sum of their values (valued_tree)."""
    return 1.0 + sum(min(node.value, POLICY.max_acceptance) for node in nodes)


def tree_of(nodes: Sequence[TreeNode]) -> tuple[list[int], list[int]]:
    """A round's drafts and parents from chosen nodes (parents first): parents [] for a chain."""
    drafts, parents = tree.from_paths([node.path for node in nodes])
    return (drafts, []) if parents == tree.chain_parents(len(drafts)) else (drafts, parents)


class DraftProposer:
    """The draft service's session for one request: drafts k tokens (a chain, or a tree with
    alternatives beside the first drafts) a round. A draft that errors or is slower than its timeout
    is dropped and re-opened after a back-off (doubling); a draft that failed before is first asked
    for its health, so a frozen one does not stall the stream for a whole timeout.

    With a draft service that has a speculation cache (draft_service/speculation.py), each chain's
    Propose also asks it to prepare the next round's drafts for `outcomes` likely verification
    outcomes while the target verifies, drawn with the seed the next Propose will carry (seeds are
    drawn one Propose ahead), so a hit costs one round trip and seeded output stays reproducible."""

    def __init__(self, backends: Any, sessions: SessionSet, *, speculate: bool, adaptive: bool, num_draft_tokens: int,
                 branches: int, outcomes: int, timeout_s: float, rpc_timeout: Callable[[], float], stats: Any,
                 greedy_drafts: bool = False, policy: SpeculationPolicy = POLICY, shared: Optional[SharedEstimates] = None):
        self.backends, self.sessions, self.stats, self.policy = backends, sessions, stats, policy
        self.greedy_drafts = greedy_drafts  # a sampled request's draft session drafts its argmax (no q: the coupled rule)
        self.enabled = speculate and backends.draft.configured and backends.draft_info is not None
        self.features = FeatureLog() if self.enabled and backends.draft_info.wants_target_features else None
        self.outcomes = outcomes if self.enabled and getattr(backends.draft_info, "speculation_cache", False) else 0
        self.branches = branches
        self.adaptive, self.num_draft_tokens = adaptive, num_draft_tokens
        self.timeout_s, self._rpc_timeout = timeout_s, rpc_timeout
        self.link = Link()
        self.acceptance = AcceptanceEstimate(policy=policy, shared=shared and shared.draft)
        self.rescue = AcceptanceEstimate(prior=policy.rescue_prior, policy=policy, shared=shared and shared.draft_rescue)
        self._retry_at, self._backoff_s = 0.0, policy.draft_backoff_s
        self._idle_rounds = 0  # rounds in a row without drafts (a one-token probe follows)
        self._next_seed: Optional[int] = None  # the seed the draft prepared the next round with (None: none prepared)

    # --- session --------------------------------------------------------------------------------
    def feature_layers(self) -> list[int]:
        """The target layers whose hidden states the drafter reads (an EAGLE-3 head's low, middle and high
        ones); [] for the final hidden state."""
        return list(self.backends.draft_info.target_feature_layers) if self.features is not None else []

    def stop_if_unfed(self, allowed: bool) -> None:
        """A feature drafter needs the target's features of every committed position, which every Verify
        returns (~1.2 KB a position): while speculation is paused by load they would cost every request
        for drafts that may never come, so such a request stops collecting them and leaves the draft
        service out (its session could not be fed any more). Lookup and head rounds go on."""
        if self.features is not None and not allowed:
            self.features, self.enabled = None, False

    def open(self, sequence: list[int]) -> None:
        """(Re)open a draft session; on failure speculation pauses and is retried after a back-off."""
        pool = self.backends.draft
        replica = pool.pick()
        if replica is None:
            return self._down(None, "no draft replica serves", mark=False)
        if not pool.usable(replica, min(self.policy.draft_probe_s, self._timeout())):
            pool.release(replica)
            return self._down(replica, "failed before and gives no SERVING answer to a health check", mark=False)
        try:
            extra = {"target_features": self.features.slice(0, len(sequence) - 1)} if self.features is not None else {}
            if self.greedy_drafts:
                extra["sampling"] = common_pb2.SamplingParams()
            self.sessions.open(self.link, pool, replica, draft_pb2.DraftPrefillRequest, sequence, self._timeout(), **extra)
            self._backoff_s = self.policy.draft_backoff_s
        except grpc.RpcError as error:  # whatever the draft's trouble, the target alone can answer
            self._down(replica, str(error.code()))

    def reopen_if_due(self, sequence: list[int]) -> None:
        """Re-open the session when it is closed (it failed, or was not opened under load) and its back-off is over."""
        if self.enabled and not self.link.open and time.monotonic() >= self._retry_at:
            self.open(sequence)

    def _down(self, replica: Any, reason: str, mark: bool = True) -> None:
        log.warning("draft %s failed (%s); target-only rounds for %.1f s", replica.address if replica else "pool", reason,
                    self._backoff_s)
        if mark and replica is not None:
            self.backends.draft.mark_failed(replica)
        self.link.replica = None
        self._next_seed = None
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.policy.draft_max_backoff_s)

    def _timeout(self) -> float:
        return min(self._rpc_timeout(), self.timeout_s)

    # --- planning -------------------------------------------------------------------------------
    def best(self, ctx: RoundContext) -> tuple[int, int, float]:
        """The round the draft service would draft now (adaptive.best_shape): (k, widened, tokens/s)."""
        cap = ctx.draft_cap(self.num_draft_tokens)
        branches = ctx.tree_branches(self.branches)
        rescue = self.rescue.chain(cap) if branches > 1 else None
        return best_shape(self.acceptance.chain(cap), cap, rescue,
                          lambda k, w: ctx.costs.round_cost_s(k, self.branches, widened=w) + ctx.shared_cost(k))

    def expected(self, ctx: RoundContext, k: int, widened: int) -> float:
        """Tokens a round of k drafts, alternatives beside the first `widened`, is expected to keep."""
        rescue = self.rescue.chain(widened) + [0.0] * (k - widened) if widened and self.branches > 1 else ()
        return expected_tokens(self.acceptance.chain(k), k, rescue)

    def rate(self, ctx: RoundContext) -> float:
        """Expected tokens per second of its round now (0 when no session is open)."""
        return self.best(ctx)[2] if self.enabled and self.link.open else 0.0

    def shape(self, ctx: RoundContext) -> tuple[int, int]:
        """k for this round and how many drafts get alternatives (the fixed policy: k = the cap, all of
        them); (0, 0) without a live session. A request that has not drafted for probe_every_rounds
        rounds drafts one token, so its estimate stays current."""
        return self._shape(ctx)

    def _shape(self, ctx: RoundContext) -> tuple[int, int]:
        if not (self.enabled and ctx.allowed and self.link.open):
            return 0, 0
        cap = ctx.draft_cap(self.num_draft_tokens)
        if not self.adaptive:
            return cap, cap
        k, widened, _ = self.best(ctx)
        self._idle_rounds = 0 if k else self._idle_rounds + 1
        if self._idle_rounds > self.policy.probe_every_rounds:
            self._idle_rounds = 0
            return min(1, cap), 0
        return k, widened

    # --- drafting -------------------------------------------------------------------------------
    def propose(self, plan: RoundPlan, sequence: list[int], rng: np.random.Generator) -> tuple[list[int], list, list[int]]:
        """Drafts, their q (sampling) and a tree's parents ([] for a chain) from a Propose; nothing when
        the draft fails. A tree keeps only the alternatives beside its first plan.widened drafts
        (tree.widened_nodes). A chain's Propose asks for the next round to be prepared."""
        chain = self.branches <= 1 or not plan.widened
        seed = self._next_seed if self._next_seed is not None else int(rng.integers(2**63))
        request = draft_pb2.ProposeRequest(
            session_id=self.link.session_id,
            commit=self.link.sync.commit(sequence),
            num_draft_tokens=plan.k,
            seed=seed,
            branches=1 if chain else self.branches,
            speculate_outcomes=self.outcomes if chain else 0,
        )
        if request.speculate_outcomes:
            request.next_seed = int(rng.integers(2**63))
        if self.features is not None:
            request.target_features.CopyFrom(self.features.slice(self.link.features_sent, len(sequence) - 1))
        asked, self._next_seed = self._next_seed is not None, None
        started = time.perf_counter()
        try:
            proposal = self.link.replica.stub.Propose(request, timeout=self._timeout())
        except grpc.RpcError as error:
            self._down(self.link.replica, str(error.code()))
            return [], [], []
        waited = time.perf_counter() - started
        self.stats.draft_wait_seconds += waited
        self.stats.draft_cache_lookups += asked
        self.stats.draft_cache_hits += proposal.cache_hit
        self.stats.draft_cache_hit_wait_seconds += waited if proposal.cache_hit else 0.0
        self.stats.draft_cache_lookup_wait_seconds += waited if asked else 0.0
        if request.speculate_outcomes and proposal.token_ids:
            self._next_seed = request.next_seed
        self.link.sync.agreed = len(sequence)
        self.link.features_sent = len(sequence) - 1
        self.stats.account(request, proposal, draft=True)
        tokens, probs, parents = list(proposal.token_ids), list(proposal.draft_probs), list(proposal.parents)
        if parents:
            kept = tree.widened_nodes(parents, plan.widened)
            tokens, parents = [tokens[i] for i in kept], tree.reindexed(parents, kept)
            probs = [probs[i] for i in kept] if probs else []
        return tokens, probs, parents

    # --- learning -------------------------------------------------------------------------------
    def learn(self, plan: RoundPlan, verdict: Verdict, outcome: RoundOutcome) -> None:
        """Its estimates learn from its own rounds and from plain ones (which forget toward the prior,
        so a request that stopped drafting tries again); its session keeps what of its chain was kept."""
        if plan.source in (PLAIN, DRAFT):
            self.acceptance.update(verdict.chain, verdict.kept)
        if plan.source == DRAFT and verdict.missed_beside_alternatives:
            self.rescue.observe(verdict.kept, verdict.accepted > verdict.kept)
        if plan.source == DRAFT and plan.drafts:
            drafts = plan.drafts
            chain = [drafts[node] for node in tree.main_chain(plan.parents)] if plan.parents else drafts
            self.link.sync.agreed += common_prefix(chain, outcome.emitted(drafts)[: outcome.accepted])
