"""One request's life: sessions on both services, round after round, every exit path released.

A round reads as its phases:
  1. plan     the planner (gateway/planner.py) weighs the proposers' offers (gateway/proposers.py): a
              lookup copy, the verify's Medusa heads, both in one tree, the draft service, or none;
              a constrained answer (structured output, gateway/grammar.py) first drafts what its
              grammar forces, and its drafts are cut where the grammar forbids one;
  2. propose  free drafts are already made; the draft service is asked for its k (a Propose);
  3. verify   the target applies the last commit and scores the drafts plus one position (over the
              tokens the grammar allows there, for a constrained answer);
  4. judge    accept / reject / correct (gateway.rejection) with the request's seeded RNG;
  5. commit   every proposer learns from the verdict; both services learn the commit on their next
              request (gateway/links.py), so a round costs one RPC per service;
  6. emit     the kept drafts and the recovered/bonus token; stop on EOS, length or a stop string.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import grpc
import numpy as np

from gateway.backends import Backends
from gateway.features import tree_path_rows
from gateway.grammar import CompiledGrammar
from gateway.guard import PlainRounds, SpeculationGuard
from gateway.links import Link, SessionSet
from gateway.observe import GenerationObserver
from gateway.options import GatewayOptions
from gateway.planner import RoundPlanner
from gateway.policy import POLICY
from gateway.proposers import (DRAFT, FORCED, HEADS, JOINED, PLAIN, DraftProposer, HeadProposer, LookupProposer, RoundContext,
                               RoundPlan)
from gateway.rejection import (RoundOutcome, coupled_tree_verify, coupled_verify, greedy_tree_verify, greedy_verify,
                               rejection_sample, tree_rejection_sample)
from gateway.text import TextStream
from gateway.verify_batch import coalescer_of
from specd.v1 import common_pb2, generate_pb2, verify_pb2
from specd_common.distributions import decode_distribution, one_hot, position_uniforms
from specd_common.errors import ResourceExhausted, Unavailable
from specd_common.masks import allowed_tokens, restrict
from specd_common import tree
from specd_common.params import Warp

log = logging.getLogger(__name__)

DEFAULT_RPC_TIMEOUT_S = 120.0  # a call's limit when the client set no deadline
MAX_FORCED_DRAFTS = 16  # forced tokens drafted in one round (at most tree.MAX_DRAFT_TOKENS, a chain's cap)
DEADLINE_SLACK_S = 0.05  # a timed-out call is the replica's fault only while the client has this much time left
REPLICA_FAULTS = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.NOT_FOUND,  # the replica restarted and lost the session
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


class FinishReason:
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"


@dataclass(frozen=True)
class GenerationSpec:
    """A validated request, in domain terms."""

    prompt_ids: list[int]
    max_new_tokens: int
    warp: Warp
    seed: int
    stop: tuple[str, ...] = ()
    speculate: bool = True
    num_draft_tokens: int = 3
    adaptive: bool = True  # choose k each round (gateway.adaptive); num_draft_tokens is then the cap
    branches: int = 1  # greedy: candidates per drafted position; > 1 drafts a tree (specd_common/tree.py)
    reproducible: bool = False  # seeded sampling: every draft is judged by the coupled rule (gateway.rejection), so
    # the answer is target-only decoding's with that seed however rounds cut it; the draft service drafts greedily
    grammar: Optional[CompiledGrammar] = None  # structured output: the answer matches it (drafts are then chains)
    top_logprobs: Optional[int] = None  # report each token's logprob and this many likeliest tokens (None: no logprobs)


@dataclass
class SpeculationStats:
    target_passes: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_tokens_per_position: list[int] = field(default_factory=list)  # [max k seen]
    accepted_tokens_per_position: list[int] = field(default_factory=list)  # [max k seen]
    wire_bytes: int = 0  # Propose + Verify messages, both directions
    round_seconds: float = 0.0
    model_seconds: float = 0.0  # inside the services' model work
    draft_model_seconds: float = 0.0  # the draft's part of it
    rejected_rounds: int = 0
    draft_cache_lookups: int = 0  # Proposes after one that asked the draft to prepare the next round
    draft_cache_hits: int = 0  # ... answered from what it prepared while the target verified
    draft_wait_seconds: float = 0.0  # time spent waiting for Proposes
    draft_cache_hit_wait_seconds: float = 0.0  # ... of which on cache hits
    draft_cache_lookup_wait_seconds: float = 0.0  # ... on the lookups (hits and misses)
    lookup_rounds: int = 0  # rounds whose drafts were the gateway's prompt-lookup copies
    head_rounds: int = 0  # rounds whose drafts were the verify's Medusa heads' proposals
    tree_rounds: int = 0  # rounds that verified a tree (a chain with alternatives beside it)
    predicted_tokens: float = 0.0  # the planner's expected tokens kept, summed over rounds (RoundPlan.expected)
    predicted_tokens_squared_error: float = 0.0  # Σ (kept − expected)² over rounds: the noise around that sum
    forced_rounds: int = 0  # rounds whose drafts were the tokens the grammar forces (no drafter asked)
    forced_tokens: int = 0  # ... and those tokens
    rested_rounds: int = 0  # rounds run plain because the request's speculation lost to plain rounds (gateway/guard.py)

    def count_prediction(self, expected: float, kept: int) -> None:
        """A round the planner expected to keep `expected` tokens kept `kept` (drafts + the recovered or bonus token)."""
        self.predicted_tokens += expected
        self.predicted_tokens_squared_error += (kept - expected) ** 2

    def count_passes(self, drafted: int, accepted: int, expected: float, passes: int = 1) -> None:
        """A round's target passes (count_round, count_prediction): one, or a plain call's several, each
        keeping the one token expected."""
        for _ in range(passes):
            self.count_round(drafted, accepted)
            self.count_prediction(expected, accepted + 1)

    def count_round(self, drafted: int, accepted: int) -> None:
        """One target pass with `drafted` drafts of which the first `accepted` were kept."""
        self.target_passes += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.rejected_rounds += accepted < drafted
        grow = drafted - len(self.draft_tokens_per_position)
        if grow > 0:
            self.draft_tokens_per_position += [0] * grow
            self.accepted_tokens_per_position += [0] * grow
        for position in range(drafted):
            self.draft_tokens_per_position[position] += 1
            self.accepted_tokens_per_position[position] += position < accepted

    def account(self, request: Any, response: Any, draft: bool = False) -> None:
        """Bytes on the wire and time inside the model, for the overhead numbers in the stats."""
        self.wire_bytes += request.ByteSize() + response.ByteSize()
        self.model_seconds += response.model_seconds
        if draft:
            self.draft_model_seconds += response.model_seconds


@dataclass
class Chunk:
    """What one round adds to the answer; the last chunk carries finish_reason."""

    token_ids: list[int]
    text: str
    finish_reason: Optional[str] = None
    logprobs: list[generate_pb2.TokenLogprob] = field(default_factory=list)  # one per token, when asked for


class Generation:
    """One request's life: prefill both services, run rounds, release both, whatever happens.

    Faults: a draft that errors or is too slow only costs speed (DraftProposer drops it and re-opens
    it after a back-off; the rounds go on target-only, still exact). A verify replica that fails is
    replaced by another one, primed with the prompt plus everything generated so far, and the round
    is retried: nothing is duplicated or lost. With no replica left, the client gets UNAVAILABLE
    with the tokens generated so far in the trailing metadata.
    """

    def __init__(
        self,
        backends: Backends,
        spec: GenerationSpec,
        time_remaining: Callable[[], Optional[float]] = lambda: None,
        is_active: Callable[[], bool] = lambda: True,
        cut_off: Callable[[], bool] = lambda: False,
        speculation_allowed: Callable[[], bool] = lambda: True,
        running: Callable[[], int] = lambda: 1,
        options: GatewayOptions = GatewayOptions(),
    ):
        self.backends = backends
        self.spec = spec
        self.request_id = uuid.uuid4().hex
        self.rng = np.random.default_rng(spec.seed)
        self.sequence: list[int] = list(spec.prompt_ids)  # prompt + generated: what both services commit to
        self.generated: list[int] = []
        self.stats = SpeculationStats()
        # a sampled round of n positions costs more than a greedy one (every row's p is warped, sent and
        # decoded; the heads read several rows), so each kind of request prices rounds by its own kind's
        self.costs = backends.costs if spec.warp.greedy else backends.sampled_costs
        shared = getattr(backends, "greedy_estimates" if spec.warp.greedy else "sampled_estimates", None)  # the priors
        self.max_length = backends.target_info.max_sequence_length
        self._time_remaining = time_remaining
        self._is_active = is_active
        self._cut_off = cut_off  # the gateway's shutdown grace is over: end with the partial answer
        self._speculation_allowed = speculation_allowed
        self._running = running  # requests this gateway runs now (the batch this request's rounds share)
        self._plain_steps_cap = options.plain_steps  # passes a plain round's Verify may decode (_plain_steps)
        self._text = TextStream(backends.tokenizer.decode, spec.stop)
        self.sessions = SessionSet(self.request_id, spec.warp.to_proto(common_pb2.SamplingParams), backends.keeper)
        self._verify = Link()
        self._next_scored = False  # the verify's prefill scored the next position: the next round is plain and free
        self.draft = DraftProposer(backends, self.sessions, speculate=spec.speculate, adaptive=spec.adaptive,
                                   num_draft_tokens=spec.num_draft_tokens, branches=spec.branches,
                                   greedy_drafts=spec.reproducible and not spec.warp.greedy,
                                   outcomes=options.speculated_outcomes, timeout_s=options.draft_timeout_s,
                                   rpc_timeout=self._timeout, stats=self.stats, policy=POLICY, shared=shared)
        self.lookup = LookupProposer(options.lookup_tokens if spec.speculate else 0, options.lookup_min_ngram, spec.adaptive,
                                     spec.num_draft_tokens, POLICY, shared)
        self.heads = HeadProposer(backends.target_info.medusa_heads if spec.speculate else 0, spec.adaptive, spec.num_draft_tokens,
                                  self.draft.branches, POLICY, shared)
        self.planner = RoundPlanner(self.lookup, self.heads, self.draft)
        plain = getattr(backends, "greedy_plain" if spec.warp.greedy else "sampled_plain", None) or PlainRounds()
        self.guard = SpeculationGuard(plain, lambda: self.costs.verify_s(1, heads=False), judges=spec.adaptive and spec.speculate)
        self.grammar = spec.grammar.start() if spec.grammar is not None else None  # where the answer is in its grammar

    @property
    def speculate(self) -> bool:
        """Whether the draft service drafts for this request."""
        return self.draft.enabled

    @property
    def text(self) -> str:
        return self._text.text

    def run(self) -> Iterator[Chunk]:
        """Yield one Chunk per round until a stop condition; sessions are released on every exit path."""
        observer = GenerationObserver(self)  # spans and metrics (gateway/observe.py)
        try:
            self._unless_cut_off()
            observer.prefill(self._open_sessions)
            while self._is_active():
                self._unless_cut_off()
                chunk = observer.round(self._round)
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            observer.finish()
            self.sessions.release_all()

    def _unless_cut_off(self) -> None:
        """Between rounds: when the gateway's shutdown grace is over, end with UNAVAILABLE and the
        tokens made so far, as when the verify is lost (the streamed ones are already sent)."""
        if self._cut_off():
            raise self._interrupted("the gateway shut down before the answer was complete; retry on another replica")

    def context(self, load_allows: Optional[bool] = None) -> RoundContext:
        """What the proposers read to plan this round: speculation is allowed when the load allows it
        (load_allows; None: asked now, once a round) and the request's own speculation has not lost to
        plain rounds as served (gateway/guard.py)."""
        load_allows = self._speculation_allowed() if load_allows is None else load_allows
        return RoundContext(self.sequence, self._tokens_left(), load_allows and self.guard.allows(), self._running() <= 1,
                            self.costs, self.backends.position_price_s(self._running()))

    def _round(self) -> Chunk:
        started = time.perf_counter()
        load_allows = self._speculation_allowed()
        ctx = self.context(load_allows)
        self.draft.stop_if_unfed(load_allows)
        if ctx.allowed:  # a draft session that failed competes again once its back-off is over
            self.draft.reopen_if_due(list(self.sequence))
        # 1-2. Plan and propose. A round whose one row the prefill scored runs no pass: plain, the first token
        free, self._next_scored = self._next_scored, False  # comes at once; no price learns from it
        plan = RoundPlan(PLAIN) if free else self._forced_plan(ctx) or self.planner.plan(ctx)
        draft_probs = self._propose(plan)
        masks = constrain(self.grammar, plan, draft_probs, self.backends.target_info.vocab_size)
        proposed = time.perf_counter()
        # 3. Verify; meanwhile a draft service with a speculation cache prepares the next round's drafts
        steps = self._plain_steps(plan, free, ctx)
        scores = self._verify_drafts(plan, self.planner.decide_heads_ask(ctx), masks, steps)
        # 4. Judge (a plain call that decoded several passes: its tokens are the target's own)
        outcome = self._judge(plan, draft_probs, scores, masks)
        decoded = decoded_tokens(plan, scores, self.spec.warp.greedy)
        passes = max(len(decoded), 1)
        # 5. Commit
        verdict = self.planner.learn(plan, outcome)
        self._commit(plan, scores, outcome)
        self._verify.sync.agreed += passes - 1  # the verify's session holds every decoded token but the last
        self.stats.count_passes(verdict.chain, outcome.accepted, plan.expected, passes)
        self.stats.lookup_rounds += bool(plan.copied)
        self.stats.head_rounds += plan.source in (HEADS, JOINED)
        self.stats.tree_rounds += bool(plan.parents)
        if plan.source == FORCED:
            self.stats.forced_rounds += 1
            self.stats.forced_tokens += len(plan.drafts)
        # 6. Emit
        emitted = decoded or outcome.emitted(plan.drafts)
        chunk = self._emit(emitted, round_logprobs(scores, emitted, self.spec.top_logprobs, self.spec.warp.greedy))
        if self.spec.speculate and not free:  # the speculation cap weighs rounds of requests that want speculation, allowed or not
            self.backends.observe_round(len(emitted), len(plan.drafts) + 1, time.perf_counter() - started,
                                        self._running(), ctx.allowed, passes)
        self.heads.receive(scores, len(plan.drafts), plan.parents, outcome, self.spec.warp.greedy or bool(scores.sampled_token_ids),
                           len(self.sequence))
        if self.draft.features is not None:
            self.draft.features.truncate(len(self.sequence) - 1)  # only committed positions' features stay
        seconds = time.perf_counter() - started
        if not free:
            self._measure_costs(plan, started, proposed, passes)
            self.guard.observe(len(emitted), seconds, plain=not plan.drafts and not self.heads.asked, alone=ctx.alone,
                               forced=plan.source == FORCED, expected=plan.expected)
        self.stats.rested_rounds = self.guard.rested
        if log.isEnabledFor(logging.DEBUG):  # what the planner chose and expected against what the round did
            log.debug("round %s %s: %d drafts%s, expected %.2f tokens, kept %d, %.1f ms (verify priced %.1f ms)",
                      self.request_id[:8], plan.source, len(plan.drafts), " asking for proposals" if self.heads.asked else "",
                      plan.expected, outcome.accepted + 1, 1e3 * seconds,
                      1e3 * (self.costs.verify_s(len(plan.drafts) + 1, self.heads.asked) or 0.0))
        self.stats.round_seconds += seconds
        return chunk

    def _forced_plan(self, ctx: RoundContext) -> Optional[RoundPlan]:
        """Jump-forward: a constrained answer whose grammar allows one continuation from here drafts it
        with no drafter asked. Such drafts are verified like any (they are the canonical tokens of the
        forced text; the target may still prefer another split of the same bytes), and are kept almost
        always, so they are drafted whenever the request speculates, under load too."""
        if self.grammar is None or not self.spec.speculate:
            return None
        forced = self.grammar.forced(ctx.draft_cap(MAX_FORCED_DRAFTS))
        return RoundPlan(FORCED, forced, expected=len(forced) + 1.0) if forced else None

    def _propose(self, plan: RoundPlan) -> list:
        """Fill the plan's drafts (the draft service's, for a DRAFT round); returns their q (sampling):
        one-hot for free drafts, which are deterministic."""
        if plan.source == DRAFT:
            plan.drafts, draft_probs, plan.parents = self.draft.propose(plan, self.sequence, self.rng)
            return draft_probs
        return [] if self.spec.warp.greedy else [one_hot(token) for token in plan.drafts]

    def _measure_costs(self, plan: RoundPlan, started: float, proposed: float, passes: int = 1) -> None:
        """The round's time after its Propose (the Verify, judging the drafts, decoding distributions,
        committing and emitting: all a round costs beside its drafts) and its Propose's into the shared
        step costs of its kind (adaptive.StepCosts): the planner prices a round as it was served (a plain
        call of several passes, each pass its share)."""
        costs = self.costs
        costs.observe_verify(len(plan.drafts) + 1, (time.perf_counter() - proposed) / passes, heads=self.heads.asked,
                             tree=bool(plan.parents))
        if plan.source == DRAFT and proposed - started > POLICY.min_draft_s:
            costs.observe_draft(plan.k, proposed - started)

    def _commit(self, plan: RoundPlan, scores: verify_pb2.VerifyResponse, outcome: RoundOutcome) -> None:
        """What the verify's sequence keeps: a chain's accepted drafts; after a tree its sequence ends at
        the committed tokens and the next commit appends the kept path. A feature drafter gets the
        kept path's features."""
        if not plan.parents:
            self._verify.sync.agreed += outcome.accepted
        elif self.draft.features is not None:
            self.draft.features.put(tree_path_rows(scores.features, len(plan.drafts), outcome.path))

    # --- sessions ------------------------------------------------------------------------------
    def _open_sessions(self) -> None:
        """The verify session now; the draft's only while speculation is allowed (under load it is
        not, and a draft session would cost a prefill that no round uses; it opens in the first round
        that may draft, with every committed token and feature)."""
        allowed = self._speculation_allowed()
        self.draft.stop_if_unfed(allowed)
        self._open_verify()
        if self.draft.enabled and allowed:
            self.draft.open(self.sequence)

    def _timeout(self) -> float:
        remaining = self._time_remaining()  # None when the client set no deadline
        return DEFAULT_RPC_TIMEOUT_S if remaining is None else max(min(remaining, DEFAULT_RPC_TIMEOUT_S), 0.001)

    def _open_verify(self) -> None:
        """Prime a verify replica with the sequence so far, trying each healthy replica once."""
        pool, features = self.backends.verify, self.draft.features
        codes = []
        while (replica := pool.pick(exclude=self._verify.failed)) is not None:
            try:
                reply = self.sessions.open(self._verify, pool, replica, verify_pb2.VerifyPrefillRequest, self.sequence,
                                           self._timeout(), return_features=features is not None,
                                           feature_layers=self.draft.feature_layers(), prompt_length=len(self.spec.prompt_ids))
                self._next_scored = reply.next_scored
                if features is not None:
                    features.put(reply.features)
                return
            except grpc.RpcError as error:
                if not self._replica_fault(error):
                    raise
                log.warning("verify replica %s failed (%s); trying another", replica.address, error.code())
                self._verify.failed.append(replica)
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    pool.mark_failed(replica)
                codes.append(error.code())
        if codes and all(code == grpc.StatusCode.RESOURCE_EXHAUSTED for code in codes):
            raise ResourceExhausted("every verify replica is at its session limit; retry later")
        raise self._interrupted("no verify replica is available")

    # --- one round -----------------------------------------------------------------------------
    def _tokens_left(self) -> int:
        """New tokens this request may still emit (its own limit and the model's context)."""
        return min(self.spec.max_new_tokens - len(self.generated), self.max_length - len(self.sequence))

    def _plain_steps(self, plan: RoundPlan, free: bool, ctx: RoundContext) -> int:
        """Passes this round's Verify may decode (VerifyRequest.plain_steps): several where it drafts
        nothing and the next rounds could not either (speculation off, not allowed under load, resting)
        and only tokens come back (no grammar, log probabilities or features); else 1. Why: docs/design/batching.md."""
        if free or plan.drafts or (self.spec.speculate and ctx.allowed) or self.grammar is not None \
                or self.spec.top_logprobs is not None or self.draft.features is not None:
            return 1
        return max(min(self._plain_steps_cap, self._tokens_left()), 1)

    def _verify_drafts(self, plan: RoundPlan, ask_heads: bool, masks: list[common_pb2.TokenMask],
                       steps: int = 1) -> verify_pb2.VerifyResponse:
        """Score the drafts (a tree when the plan has parents), on another replica if this one fails;
        a plain round decodes up to `steps` passes."""
        features = self.draft.features
        coupled = (verify_pb2.CoupledDraw(seed=self.spec.seed, return_target_probs=self.spec.top_logprobs is not None)
                   if self._coupled(plan) else None)  # the coupled rule's draws, made by the verify: a token a row, not p
        while True:
            request = verify_pb2.VerifyRequest(
                session_id=self._verify.session_id,
                commit=self._verify.sync.commit(self.sequence),
                draft_token_ids=plan.drafts,
                draft_parents=plan.parents,
                return_features=features is not None,
                return_head_drafts=ask_heads,
                head_candidates=self.heads.candidates_per_head(), head_depth=self.heads.depth if ask_heads else 0,
                head_rows=self.heads.rows_to_ask(plan, self.spec.warp.greedy or coupled is not None) if ask_heads else 0,
                allowed_tokens=masks,
                top_logprobs=max(self.spec.top_logprobs, 1) if self.spec.top_logprobs is not None and self.spec.warp.greedy else 0,
                coupled_draw=coupled,
                plain_steps=steps if steps > 1 else 0,
                stop_token_ids=self.backends.target_info.eos_token_ids if steps > 1 else (),
            )
            try:
                scores = coalescer_of(self._verify.replica).verify(request, self._timeout())
            except grpc.RpcError as error:
                if not self._replica_fault(error):
                    raise
                log.warning("verify replica %s failed (%s) mid-request; replaying on another", self._verify.replica.address, error.code())
                self._verify.failed.append(self._verify.replica)
                self.backends.verify.mark_failed(self._verify.replica)
                self._open_verify()
                continue
            self._verify.sync.agreed = len(self.sequence)
            self.stats.account(request, scores)
            if features is not None and not plan.parents:  # a tree's are kept after judging (_commit)
                features.put(scores.features)
            return scores

    def _judge(self, plan: RoundPlan, draft_probs: list, scores: verify_pb2.VerifyResponse,
               masks: list[common_pb2.TokenMask]) -> RoundOutcome:
        drafts, parents = plan.drafts, plan.parents
        # greedy: the argmax; the coupled rule drawn by the verify: its draws. Drafts are kept while equal.
        chosen = list(scores.argmax_token_ids if self.spec.warp.greedy else scores.sampled_token_ids)
        if chosen:
            return greedy_tree_verify(drafts, parents, chosen) if parents else greedy_verify(drafts, chosen)
        vocab_size = self.backends.target_info.vocab_size
        p = np.stack([decode_distribution(d) for d in scores.target_probs])  # [k + 1, V] (a tree: [n + 1, V])
        if self._coupled(plan):  # a verify that does not draw (an older one): the gateway draws the same rule
            depth = max(tree.depths(parents), default=0) if parents else len(drafts)
            uniforms = position_uniforms(self.spec.seed, len(self.sequence), depth + 1)
            return coupled_tree_verify(drafts, parents, p, uniforms) if parents else coupled_verify(drafts, p, uniforms)
        if parents:  # a later sibling's q is its first sibling's (sent once)
            q_rows = [decode_distribution(d, vocab_size) if d.probs else None for d in draft_probs]
            return tree_rejection_sample(drafts, parents, q_rows, p, self.rng)
        q = np.stack([decode_distribution(d, vocab_size) for d in draft_probs]) if drafts else np.zeros((0, p.shape[1]))
        for row, mask in zip(range(len(drafts)), masks):  # a kept draft is q's draw given the grammar allows it
            q[row] = restrict(q[row], allowed_tokens(mask, vocab_size))
        return rejection_sample(drafts, q, p, self.rng)

    def _coupled(self, plan: RoundPlan) -> bool:
        """A sampled round judged by the coupled rule: its drafts were not drawn from a q the gateway holds
        (the heads', lookup copies, forced tokens, a draft that drafts greedily; no drafts at all)."""
        return not self.spec.warp.greedy and (plan.source != DRAFT or self.draft.greedy_drafts)

    def _emit(self, tokens: list[int], logprobs: list[generate_pb2.TokenLogprob] = ()) -> Chunk:
        """Append tokens one by one until a stop condition; return what the client gets this round."""
        eos = set(self.backends.target_info.eos_token_ids)
        taken: list[int] = []
        finish = None
        for token in tokens:
            taken.append(token)
            if token in eos:
                finish = FinishReason.EOS
            elif len(self.generated) + len(taken) >= self.spec.max_new_tokens:
                finish = FinishReason.LENGTH
            elif len(self.sequence) + len(taken) >= self.max_length:
                finish = FinishReason.LENGTH
            if finish:
                break
        self.sequence.extend(taken)
        self.generated.extend(taken)
        if self.grammar is not None:
            self.grammar.advance(taken)
        delta = self._text.push(taken)
        logprobs = list(logprobs[: len(taken)])
        if delta.stopped:
            return Chunk(taken, delta.text, FinishReason.STOP, logprobs)
        text = delta.text + (self._text.flush() if finish else "")
        return Chunk(taken, text, finish, logprobs)

    def _interrupted(self, reason: str) -> Unavailable:
        """UNAVAILABLE that reports what was generated so far (trailing metadata), so nothing is lost."""
        error = Unavailable(f"{reason}; {len(self.generated)} tokens were generated before it (see trailing metadata)")
        error.trailing_metadata = (
            ("specd-generated-token-ids", ",".join(map(str, self.generated))),
            ("specd-generated-text-bin", self._text.text.encode()),
        )
        return error

    def _replica_fault(self, error: grpc.RpcError) -> bool:
        """Errors that say the replica, not the request, is at fault: try elsewhere rather than fail.
        A deadline is the replica's fault only while the client's own deadline has not passed."""
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            remaining = self._time_remaining()
            return remaining is None or remaining > DEADLINE_SLACK_S
        return error.code() in REPLICA_FAULTS


def constrain(grammar, plan: RoundPlan, draft_probs: list, vocab_size: int) -> list[common_pb2.TokenMask]:
    """A constrained answer's allowed-token masks for the round's scored positions (the verify restricts
    the target to them), with the drafts cut before the first one its grammar forbids (and their q
    with them): that draft would be rejected anyway. [] when unconstrained. Chains only
    (GenerationSpec.grammar): a tree would need a mask per branch."""
    if grammar is None:
        return []
    if plan.parents:  # never planned (GenerationSpec.branches is 1): judged as a plain round, still exact
        log.warning("a constrained request drafted a tree (%d nodes); verifying none of it", len(plan.drafts))
        del plan.drafts[:], plan.parents[:], draft_probs[:]
    allowed, masks = grammar.masks_along(plan.drafts, vocab_size)
    if allowed < len(plan.drafts):
        del plan.drafts[allowed:], draft_probs[allowed:]
        plan.copied = min(plan.copied, allowed)
        if plan.head_predicted is not None:
            plan.head_predicted = plan.head_predicted[:allowed]
    return masks


def decoded_tokens(plan: RoundPlan, scores: verify_pb2.VerifyResponse, greedy: bool) -> list[int]:
    """The tokens of a plain call that decoded several passes (VerifyRequest.plain_steps), in order; [] for
    any other round."""
    chosen = [] if plan.drafts else list(scores.argmax_token_ids if greedy else scores.sampled_token_ids)
    return chosen if len(chosen) > 1 else []


def round_logprobs(scores: verify_pb2.VerifyResponse, emitted: list[int], top: Optional[int],
                   greedy: bool) -> list[generate_pb2.TokenLogprob]:
    """Each emitted token's log probability and the likeliest tokens at its row (a chain's token i is
    scored at row i), when the request asked (top not None): greedy from the verify's log-softmax
    (RowLogprobs), sampled from the distributions the round was judged by (the same numbers in both modes)."""
    if top is None:
        return []
    if greedy:
        return [greedy_logprob(token, scores.logprobs[row], top) for row, token in enumerate(emitted)]
    return [sampled_logprob(token, decode_distribution(scores.target_probs[row]), top) for row, token in enumerate(emitted)]


def greedy_logprob(token: int, row: verify_pb2.RowLogprobs, top: int) -> generate_pb2.TokenLogprob:
    """A greedy token's entry from its row's likeliest tokens (it is the row's best; on an exact tie the
    listed best has its value)."""
    listed = dict(zip(row.token_ids, row.logprobs))
    best = [generate_pb2.TopLogprob(token_id=t, logprob=v) for t, v in zip(row.token_ids[:top], row.logprobs[:top])]
    return generate_pb2.TokenLogprob(token_id=token, logprob=listed.get(token, row.logprobs[0]), top=best)


def sampled_logprob(token: int, p: np.ndarray, top: int) -> generate_pb2.TokenLogprob:
    """A sampled token's entry from the distribution p [V] it was drawn from."""
    best = likeliest(p, top)
    with np.errstate(divide="ignore"):
        return generate_pb2.TokenLogprob(token_id=token, logprob=float(np.log(p[token])),
                                         top=[generate_pb2.TopLogprob(token_id=int(t), logprob=float(np.log(p[t]))) for t in best])


def likeliest(p: np.ndarray, n: int) -> np.ndarray:
    """The n likeliest ids of p [V], best first, ties by id: a full stable argsort's first n, from a
    partition (0.19 ms against 5.5 ms for 49,152 entries on the 2-vCPU EPYC VM, paid per sampled token)."""
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    n = min(n, p.size)
    kth = np.partition(p, p.size - n)[p.size - n]  # the n-th largest value
    candidates = np.flatnonzero(p >= kth)  # [>= n] ascending ids, so the stable sort breaks ties by id
    return candidates[np.argsort(-p[candidates], kind="stable")][:n]
