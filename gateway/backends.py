"""The model services as the gateway sees them: replica pools, what they reported, the tokenizer.

A request pins one draft and one verify replica (its KV caches live there), chosen least-loaded from
each role's pool (gateway/pool.py, which also discovers and health-watches the replicas). A verify
replica that fails mid-request is swapped for another by replaying the sequence on it
(gateway.engine); a failed draft only costs speed.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from gateway.adaptive import (RoundShapes, SharedEstimates, StepCosts, describe_shapes, position_price_s, speculation_cap,
                              tokens_by_pass)
from gateway.grammar import Grammars
from gateway.guard import PlainRounds
from gateway.links import SessionKeeper
from gateway.policy import POLICY
from gateway.pool import Pool, PoolMetrics, RESOLVE_PERIOD_S
from gateway.tokenizer import GatewayTokenizer
from specd.v1 import common_pb2, draft_pb2_grpc, verify_pb2_grpc
from specd_common.errors import FailedPrecondition, Unavailable

log = logging.getLogger(__name__)


@dataclass
class Backends:
    """Verify replicas (at least one), draft replicas (maybe none), the target's info and tokenizer."""

    verify: Pool[verify_pb2_grpc.VerifyServiceStub]
    draft: Pool[draft_pb2_grpc.DraftServiceStub]
    target_info: common_pb2.GetModelInfoResponse
    tokenizer: GatewayTokenizer
    first: dict = field(default_factory=dict)  # role → the first replica's info, which sets the pool's rules
    costs: StepCosts = field(default_factory=StepCosts)  # measured greedy round times, for adaptive draft length
    sampled_costs: StepCosts = field(default_factory=StepCosts)  # ... sampled ones: each position's distribution is warped, sent and decoded
    greedy_estimates: SharedEstimates = field(default_factory=SharedEstimates.fresh)  # what drafters kept across greedy requests
    sampled_estimates: SharedEstimates = field(default_factory=SharedEstimates.fresh)  # ... and across sampled ones
    greedy_plain: PlainRounds = field(default_factory=PlainRounds)  # what a plain greedy round costs as served (gateway/guard.py)
    sampled_plain: PlainRounds = field(default_factory=PlainRounds)  # ... a sampled one
    rounds: RoundShapes = field(default_factory=RoundShapes)  # what speculating rounds yield and verify, for the speculation cap
    keeper: SessionKeeper = field(default_factory=lambda: SessionKeeper(lease_s=0))  # leases renewed, failed releases retried
    report_cap: Callable[[int], None] = field(default=lambda cap: None, repr=False)  # the speculation cap changed (a gauge)
    _last_cap: Optional[int] = field(default=None, repr=False)  # logged and reported when it changes
    _replica_cap: tuple[int, int] = field(default=(-1, 0), repr=False)  # (rounds observed, one replica's cap) last computed
    _cap_changed_at: int = field(default=-POLICY.cap_hold_rounds, repr=False)  # rounds observed at the cap's last change (it then holds)

    def __post_init__(self) -> None:
        """Round sizes not served yet are priced from the verify's start-up pass costs (StepCosts.set_prior)."""
        pass_s = {cost.positions: cost.milliseconds / 1e3 for cost in self.target_info.runtime_profile.pass_costs}
        if pass_s:
            self.costs.set_prior(pass_s)
            self.sampled_costs.set_prior(pass_s)

    @property
    def draft_info(self) -> Optional[common_pb2.GetModelInfoResponse]:
        """What the drafts are (None until one has answered: a draft pool found empty at start, e.g. a
        DNS name whose pods are not ready yet, gets its rules from the first draft that joins)."""
        return self.first.get("draft")

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Structured output's compiler for the target's tokenizer (its own tokenizer is built on first use)."""
        return Grammars(self.target_info.tokenizer_json, self.target_info.vocab_size, self.target_info.eos_token_ids)

    @functools.cached_property
    def _verify_batch_costs(self) -> dict[int, dict[int, float]]:
        """rows → positions → ms of a batched round, as the target's first verify replica measured them
        at start-up (GetModelInfo.runtime_profile; runtime_config's JSON is for logs only); empty when it did not."""
        costs: dict[int, dict[int, float]] = {}
        for cost in self.target_info.runtime_profile.batch_costs:
            costs.setdefault(cost.rows, {})[cost.positions] = cost.milliseconds
        return costs

    def speculation_cap(self) -> int:
        """Requests this gateway may run while they speculate (0 = no cap): adaptive.speculation_cap
        for one verify replica, from the batch costs it measured at start-up and the rounds measured
        here at each batch size (tokens they yield, seconds they take, positions they verify, with
        speculation allowed or not), times the verify replicas serving. Until rounds are measured
        the cap is the smallest measured batch (2): a busy gateway that starts cold does not bet
        every batch on drafts it knows nothing of (on the 2-core EPYC, speculating in 8-stream
        batches lost 17%); then, until speculating rounds among others are, the batch size served
        most, where they are tried and measured. No cap when the verify measured no batch costs (it
        does not batch: requests then share no passes, and each one's own policy decides)."""
        costs = self._verify_batch_costs
        if not costs:
            return 0
        cap = self._cap_per_replica(costs) * self._serving_replicas()
        if cap != self._last_cap:
            log.info("speculation cap: %s running requests (rounds by batch size, speculating or not: %s)",
                     cap or "no cap", describe_shapes(self.rounds.measured()))
            self._last_cap = cap
            self.report_cap(cap)
        return cap

    def position_price_s(self, running: int) -> float:
        """What one more verified position of a request costs the round of the `running` requests that
        share one verify replica's passes (adaptive.position_price_s at their batch size; 0 alone)."""
        rows, costs = self._rows_per_replica(running), self._verify_batch_costs
        if rows <= 1 or not costs:
            return 0.0
        bucket = RoundShapes.bucket(rows, list(costs))
        return position_price_s(costs[bucket], self.rounds.measured(), bucket)

    def observe_round(self, tokens: int, positions: int, seconds: float, running: int, speculating: bool, passes: int = 1) -> None:
        """One round's shape for the speculation cap, counted at the batch size its `running`
        requests (this gateway's, spread over the serving verify replicas) make; a plain call of several
        `passes` counts as that many plain rounds, a token and its share of the seconds each."""
        rows = RoundShapes.bucket(self._rows_per_replica(running), list(self._verify_batch_costs))
        for emitted in tokens_by_pass(tokens, passes):
            self.rounds.observe(emitted, positions, seconds / passes, rows, speculating)

    def _rows_per_replica(self, running: int) -> int:
        """The batch `running` requests of this gateway make on each serving verify replica (rounded up)."""
        return -(-running // self._serving_replicas())

    def _serving_replicas(self) -> int:
        return max(1, sum(replica.eligible for replica in self.verify.replicas()))

    def _cap_per_replica(self, costs: dict[int, dict[int, float]]) -> int:
        """adaptive.speculation_cap for one verify replica, recomputed only after a new round was
        measured (every request asks several times a round, and the answer changes only with the
        rounds), and not within policy.cap_hold_rounds rounds of its last change."""
        rounds = self.rounds.count
        computed_at, current = self._replica_cap
        if computed_at < 0 or (computed_at != rounds and rounds - self._cap_changed_at >= POLICY.cap_hold_rounds):
            cap = speculation_cap(costs, self.rounds.measured(), current=None if computed_at < 0 else current,
                                  ragged=self.target_info.runtime_profile.ragged)
            if computed_at >= 0 and cap != current:
                self._cap_changed_at = rounds
            self._replica_cap = (rounds, cap)
        return self._replica_cap[1]

    @classmethod
    def connect(
        cls,
        verify_addresses: Sequence[str],
        draft_addresses: Sequence[str],
        dial: Callable[[str, str], Any],
        timeout_s: float,
        resolve_period_s: float = RESOLVE_PERIOD_S,
        metrics: PoolMetrics = PoolMetrics(),
    ) -> "Backends":
        """Find the replicas and ask each who it is (waiting up to timeout_s for every one found to
        answer); refuse mismatched vocabularies: at start as an error, later by leaving the replica out."""
        if not verify_addresses:
            raise FailedPrecondition("the gateway needs at least one verify service address")
        first: dict[str, common_pb2.GetModelInfoResponse] = {}  # the first verify and draft to answer set the rules

        def admit_verify(info: common_pb2.GetModelInfoResponse) -> str:
            reference = first.setdefault("verify", info)
            return vocabulary_mismatch(reference, info, "verify replica")

        def admit_draft(info: common_pb2.GetModelInfoResponse) -> str:
            reference = first.setdefault("draft", info)
            if info.wants_target_features != reference.wants_target_features:
                return f"draft {info.model_name!r} and draft {reference.model_name!r} are different kinds of drafter; run one kind per pool"
            return vocabulary_mismatch(first["verify"], info, "draft") or features_unavailable(first["verify"], info)

        pools = dict(resolve_period_s=resolve_period_s, metrics=metrics)
        verify = Pool("verify", verify_addresses, dial, verify_pb2_grpc.VerifyServiceStub, admit_verify, **pools).start()
        draft = Pool("draft", draft_addresses, dial, draft_pb2_grpc.DraftServiceStub, admit_draft, **pools)
        try:
            if not verify.wait_settled(timeout_s) and "verify" not in first:
                raise Unavailable(f"no verify replica answered within {timeout_s} s: {', '.join(verify_addresses)}")
            refuse_at_start(verify)
            if draft.configured:
                draft.start()
                if not draft.wait_settled(timeout_s, need=0):
                    log.warning("not every draft replica answered; serving target-only where none does")
                refuse_at_start(draft)
        except BaseException:
            verify.stop()
            draft.stop()
            raise
        target_info = first["verify"]
        return cls(verify, draft, target_info, GatewayTokenizer(target_info), first)

    def follow_verify_health(self, set_serving: Callable[[bool], None]) -> None:
        """Report the gateway SERVING while a verify replica serves: without a target it can answer
        nothing, so load balancers and readiness probes should send clients elsewhere meanwhile.
        (Drafts are not followed: without one, requests are still served exactly, target-only.)"""
        self.verify.on_serving_change = set_serving
        set_serving(self.verify.any_serving())

    def begin_stop(self) -> None:
        """The server is stopping: its own shutdown decides its health from here."""
        self.verify.on_serving_change = lambda serving: None

    def stop(self, grace_s: float = 0.0) -> None:
        self.begin_stop()
        self.keeper.stop()  # before the channels close: its last try at failed releases needs them
        self.verify.stop()
        self.draft.stop()


def refuse_at_start(pool: Pool) -> None:
    """A replica refused while the gateway starts is a configuration error: say it instead of serving around it."""
    refused = [replica.refused for replica in pool.replicas() if replica.refused]
    if refused:
        raise FailedPrecondition(refused[0])


def vocabulary_mismatch(target: common_pb2.GetModelInfoResponse, other: common_pb2.GetModelInfoResponse, role: str = "draft") -> str:
    """Why `other` cannot serve beside `target` ('' if it can): a model drafter must speak the target's
    token ids; a model-free drafter (no vocabulary) always does."""
    if other.vocab_digest and other.vocab_digest != target.vocab_digest:
        return (f"{role} {other.model_name!r} and target {target.model_name!r} have different vocabularies "
                f"(digests {other.vocab_digest[:12]} vs {target.vocab_digest[:12]}); pick a {role} that shares "
                "the target's tokenizer")
    return ""


def features_unavailable(target: common_pb2.GetModelInfoResponse, draft: common_pb2.GetModelInfoResponse) -> str:
    """A feature drafter needs a verify service that can return the target's features ('' when it can)."""
    if draft.wants_target_features and not target.hidden_size:
        return (f"draft {draft.model_name!r} reads the target's features but verify {target.model_name!r} does not "
                "report a hidden size (an older verify service?); upgrade the verify service or use another drafter")
    return ""
