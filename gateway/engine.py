"""The speculative loop: one request, round by round, with both services' KV caches kept in sync.

A round, in order:
  1. Propose: the draft applies the last round's commit and drafts k tokens (skipped when k = 0).
     A lookup round skips the draft altogether: when the sequence's last n-gram occurred before, the
     gateway proposes what followed it (prompt lookup), as many tokens as pay by their own measured
     acceptance; the draft learns those tokens from its next commit, like any skipped round.
     A head round likewise takes the verify service's Medusa heads' proposals from the last pass
     (verify_service/medusa.py), when they promise more tokens per second than the draft.
  2. Verify: the target applies the same commit and scores the k drafts plus one position.
  3. Accept / reject / correct (gateway.rejection) with the request's seeded RNG.
  4. Emit the accepted drafts and the recovered/bonus token; stop on EOS, length or a stop string.
The commit (how much of each service's sequence survives, and what to append) rides on the next
request to each service, so a round costs exactly one RPC per service.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import grpc
import numpy as np

from gateway.observe import GenerationObserver
from gateway.rejection import RoundOutcome, greedy_tree_verify, greedy_verify, rejection_sample, tree_rejection_sample
from gateway.text import TextStream
from gateway.adaptive import (AcceptanceEstimate, HeadCalibration, TreeNode, best_rate, chain_nodes, confident_tree, head_nodes,
                              valued_tree)
from gateway.backends import Backends
from gateway.pool import Pool, Replica
from gateway.features import FeatureLog, HeadProposals, head_drafts_after_tree, head_drafts_at, tree_path_rows
from gateway.options import GatewayOptions
from specd.v1 import common_pb2, draft_pb2, verify_pb2
from specd_common import tree
from specd_common.distributions import decode_distribution, one_hot
from specd_common.errors import ResourceExhausted, Unavailable
from specd_common.lookup import prompt_lookup
from specd_common.params import Warp
from specd_common.sequence import common_prefix

log = logging.getLogger(__name__)

DEFAULT_RPC_TIMEOUT_S = 120.0
RELEASE_TIMEOUT_S = 5.0
DRAFT_BACKOFF_S = 1.0
DRAFT_MAX_BACKOFF_S = 30.0
DRAFT_PROBE_S = 0.2  # longest a health check of a draft that failed before may take
PROBE_EVERY_ROUNDS = 8  # adaptive k: after this many rounds without drafts, draft one token to re-measure
# Until measured, the chance that a drafter's next best candidates hold the target's token where its best
# does not: held-out offline, the shipped heads' second candidate at position 1 is right in ~27% of
# the rounds the first misses (a prior only: each request measures its own per drafter, Generation._rescue)
RESCUE_PRIOR = 0.3
HEADS, DRAFT = "heads", "draft"  # the drafters whose trees' alternatives are estimated apart (Generation._rescue)
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
    lookahead_rounds: int = 0  # overlap: look-aheads drafted while the target verified
    lookahead_hits: int = 0  # ... and those whose drafts were used by the next round
    lookup_rounds: int = 0  # rounds whose drafts were the gateway's prompt-lookup copies
    head_rounds: int = 0  # rounds whose drafts were the verify's Medusa heads' proposals
    tree_rounds: int = 0  # rounds that verified a tree (a chain with alternatives beside it)

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


@dataclass
class Chunk:
    """What one round adds to the answer; the last chunk carries finish_reason."""

    token_ids: list[int]
    text: str
    finish_reason: Optional[str] = None


@dataclass
class ServiceSync:
    """How far a service's token sequence agrees with the gateway's committed one."""

    agreed: int  # the service's first `agreed` tokens equal the committed sequence's

    def commit(self, sequence: Sequence[int]) -> common_pb2.Commit:
        """Keep what agrees, append what the service has not seen (corrections, bonus, skipped rounds)."""
        return common_pb2.Commit(prefix_length=self.agreed, append_token_ids=sequence[self.agreed :])


@dataclass
class Link:
    """This request's session on one replica of a service."""

    session_id: str = ""
    replica: Optional[Replica] = None  # the pinned replica; None while closed
    features_sent: int = 0  # feature drafters: rows of target features the session has been sent
    sync: ServiceSync = field(default_factory=lambda: ServiceSync(agreed=0))
    failed: list[Replica] = field(default_factory=list)  # replicas that failed during this request

    @property
    def open(self) -> bool:
        return self.replica is not None


def head_round(steps: list[list[int]]) -> tuple[list[int], list[int]]:
    """A head round's drafts and parents from each head's candidates (best first, distinct): the best
    ones as a chain (parents []) when there is one candidate a head, else the chain with the others
    beside each as leaves (tree.chain_with_leaves)."""
    if all(len(candidates) == 1 for candidates in steps):
        return [candidates[0] for candidates in steps], []
    return tree.chain_with_leaves(steps)


def tree_round(nodes: Sequence[TreeNode]) -> tuple[list[int], list[int]]:
    """A free round's drafts and parents from adaptive.valued_tree's nodes (parents first): a chain
    (parents []) when no node has a sibling."""
    drafts, parents = tree.from_paths([node.path for node in nodes])
    return (drafts, []) if parents == tree.chain_parents(len(drafts)) else (drafts, parents)


class FreeRound(NamedTuple):
    """A round that needs no draft call: its drafts and their tree's parents ([] for a chain), and which
    free drafters they came from (a lookup copy, the Medusa heads, or both in one tree)."""

    drafts: list[int]
    parents: list[int]
    copied: int  # nodes of a lookup copy: the first of the tree's main chain
    headed: bool


class Generation:
    """One request's life: prefill both services, run rounds, release both, whatever happens.

    Faults: a draft that errors or is slower than draft_timeout_s is dropped and the request goes
    on with target-only rounds (still exact), re-opening the draft after a back-off. A verify
    replica that fails is replaced by another one, primed with the prompt plus everything
    generated so far, and the round is retried: nothing is duplicated or lost. With no replica
    left, the client gets UNAVAILABLE with the tokens generated so far in the trailing metadata.
    """

    def __init__(
        self,
        backends: Backends,
        spec: GenerationSpec,
        time_remaining: Callable[[], Optional[float]] = lambda: None,
        is_active: Callable[[], bool] = lambda: True,
        speculation_allowed: Callable[[], bool] = lambda: True,
        running: Callable[[], int] = lambda: 1,
        options: GatewayOptions = GatewayOptions(),
    ):
        self.backends = backends
        self.spec = spec
        # the draft service drafts for this request (False once it can no longer be fed: _skip_features_while_paused)
        self.speculate = spec.speculate and backends.draft.configured and backends.draft_info is not None
        wants_features = self.speculate and backends.draft_info.wants_target_features
        self._features = FeatureLog() if wants_features else None  # target features for a feature drafter
        self.overlap = options.overlap and self._features is None  # a look-ahead cannot wait for the target's features
        self.branches = 1 if self.overlap else spec.branches  # a look-ahead assumes a chain
        self.draft_timeout_s = options.draft_timeout_s
        self.lookup_tokens = options.lookup_tokens if spec.speculate and not self.overlap else 0  # 0: no lookup rounds
        self.lookup_min_ngram = options.lookup_min_ngram
        self.medusa_heads = backends.target_info.medusa_heads if spec.speculate and not self.overlap else 0  # 0: no head rounds
        self.request_id = uuid.uuid4().hex
        self.rng = np.random.default_rng(spec.seed)
        self.sequence: list[int] = list(spec.prompt_ids)  # prompt + generated
        self.generated: list[int] = []
        self.stats = SpeculationStats()
        self.max_length = backends.target_info.max_sequence_length
        self._time_remaining = time_remaining
        self._is_active = is_active
        self._speculation_allowed = speculation_allowed
        self._running = running  # requests this gateway runs now (the batch this request's rounds share)
        self._text = TextStream(backends.tokenizer.decode, spec.stop)
        self._verify = Link()
        self._draft = Link()
        self._draft_retry_at = 0.0
        self._draft_backoff_s = DRAFT_BACKOFF_S
        self._acceptance = AcceptanceEstimate()  # the drafter's
        self._lookup_acceptance = AcceptanceEstimate()  # prompt-lookup copies' (they behave differently)
        self._head_acceptance = AcceptanceEstimate()  # the Medusa heads'
        # a tree's alternatives, per drafter: whether one held the target's token where the chain's draft missed
        self._rescue = {HEADS: AcceptanceEstimate(prior=RESCUE_PRIOR), DRAFT: AcceptanceEstimate(prior=RESCUE_PRIOR)}
        self._head_drafts = HeadProposals()  # each head's candidates after the last committed token (from the last Verify)
        self._head_calibration = HeadCalibration()  # how the heads' confidence predicts this request's acceptance
        self._head_predicted: Optional[float] = None  # this round's heads' tree: the sum of its nodes' values
        self._head_nodes: set[int] = set()  # ... and which of the round's nodes the heads offered
        self._rounds_since_head_round = 0  # rounds the heads' confidence declined in a row (a probe follows PROBE_EVERY_ROUNDS)
        self._heads_declined = False  # the last Verify did not ask for proposals: no head round could pay
        self._asked_heads = False  # the last Verify asked for the heads' proposals (its cost is priced apart)
        self._rounds_since_draft = 0
        self._lookahead: tuple[list[int], list] = ([], [])  # overlap: next round's drafts, made during this one
        self._opened: list[tuple[Pool, Replica, str]] = []  # sessions to release at the end
        self._sessions_opened = 0

    @property
    def text(self) -> str:
        return self._text.text

    def run(self) -> Iterator[Chunk]:
        """Yield one Chunk per round until a stop condition; sessions are released on every exit path."""
        observer = GenerationObserver(self)  # spans and metrics (gateway/observe.py)
        try:
            observer.prefill(self._open_sessions)
            while self._is_active():
                chunk = observer.round(self._round)
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            observer.finish()
            self._release()

    def _round(self) -> Chunk:
        # 1. Propose (skipped when the draft is down or no tokens are left to draft; with overlap,
        #    the drafts may already have been made while the last round was being verified). A
        #    lookup round copies earlier tokens instead and leaves the draft out, a head round takes the
        #    Medusa heads' proposals, a joined round both in one tree; all are free (no draft call) and
        #    deterministic (q is one-hot)
        started = time.perf_counter()
        speculating = self.spec.speculate and self._speculation_allowed()  # this round's shape feeds the speculation cap
        self._skip_features_while_paused()
        free, parents, copied, headed = self._free_drafts()  # parents: a tree's shape; [] for a chain
        if free:
            k, drafts, draft_probs = len(free), free, [] if self.spec.warp.greedy else [one_hot(t) for t in free]
        else:
            k, widened = self._draft_shape()
            drafts, draft_probs = self._take_lookahead(k)
            if k > 0 and not drafts:
                drafts, draft_probs, parents = self._propose(k, widened)
        proposed = time.perf_counter()
        # 2. Verify, on another replica if this one fails; with overlap the draft meanwhile drafts
        #    the next round, assuming every draft of this one is accepted
        lookahead = self._start_lookahead(drafts, k) if self.overlap and drafts else None
        scores = self._verify_drafts(drafts, parents)
        self.backends.costs.observe_verify(len(drafts) + 1, time.perf_counter() - proposed, heads=self._asked_heads,
                                           tree=bool(parents))
        if k > 0 and not free and proposed - started > 1e-4:
            self.backends.costs.observe_draft(k, proposed - started)
        # 3. Accept / reject / correct
        outcome = self._judge(drafts, draft_probs, scores, parents)
        chain_nodes = tree.main_chain(parents)
        chain = [drafts[node] for node in chain_nodes] if parents else drafts  # what the draft holds; k counts these
        kept = common_prefix(chain_nodes, list(outcome.path)) if parents else outcome.accepted  # of the chain; a leaf may add one
        if copied:  # the copy's nodes lead the main chain (a joined tree may go on with the heads')
            self._lookup_acceptance.update(copied, min(kept, copied))
        else:
            (self._head_acceptance if headed else self._acceptance).update(len(chain), kept)
        if parents and not copied and kept < len(chain) and parents.count(parents[chain_nodes[kept]]) > 1:  # alternatives beside the first miss
            self._rescue[HEADS if headed else DRAFT].observe(kept, outcome.accepted > kept)
        if headed and self._head_predicted is not None:
            kept_nodes = outcome.path if parents else range(outcome.accepted)
            self._head_calibration.observe(self._head_predicted, sum(node in self._head_nodes for node in kept_nodes))
        self._head_predicted = None
        # 4. Commit (both services learn it on their next request) and emit. After a tree the verify's
        #    sequence ends at the committed tokens: the commit appends the kept path (it keeps those nodes)
        if not parents:
            self._verify.sync.agreed += outcome.accepted
        if drafts and not free:  # what of the draft's chain the round kept agrees
            self._draft.sync.agreed += common_prefix(chain, outcome.emitted(drafts)[: outcome.accepted])
        if parents and self._features is not None:
            self._features.put(tree_path_rows(scores.features, len(drafts), outcome.path))
        if lookahead is not None:
            self._finish_lookahead(lookahead, outcome)
        self.stats.count_round(len(chain), outcome.accepted)
        self.stats.lookup_rounds += bool(copied)
        self.stats.head_rounds += bool(headed)
        self.stats.tree_rounds += bool(parents)
        chunk = self._emit(outcome.emitted(drafts))
        if self.spec.speculate:  # the speculation cap weighs rounds of requests that want speculation, allowed or not
            self.backends.observe_round(len(outcome.emitted(drafts)), len(drafts) + 1, time.perf_counter() - started,
                                        self._running(), speculating)
        if parents and not self.spec.warp.greedy:  # the verify sent every row: the sampled path picks its own
            self._head_drafts = head_drafts_after_tree(scores.head_drafts, len(drafts), outcome.path)
        else:
            self._head_drafts = head_drafts_at(scores.head_drafts, len(self.sequence) - 2)
        if self._features is not None:
            self._features.truncate(len(self.sequence) - 1)  # only committed positions' features stay
        self.stats.round_seconds += time.perf_counter() - started
        return chunk

    # --- sessions ------------------------------------------------------------------------------
    def _open_sessions(self) -> None:
        """The verify session now; the draft's only while speculation is allowed (under load it is
        not, and a draft session would cost a prefill that no round uses; it opens in the first round
        that may draft, with every committed token and feature)."""
        self._skip_features_while_paused()
        self._open_verify()
        if self.speculate and self._speculation_allowed():
            self._open_draft()

    def _skip_features_while_paused(self) -> None:
        """A feature drafter needs the target's features of every committed position, which the verify
        computes and returns with each pass (1,224 bytes a position for the default target). While
        speculation is paused (load) they cost every request for drafts that may never come (8
        streams, no drafting anywhere: 0.973x target-only with them, 1.007x without; README), so a
        request that meets a paused round stops collecting them. The draft service then stays out of
        it (its session could not be fed any more); lookup and head rounds, which need no features,
        go on when the load allows."""
        if self._features is not None and not self._speculation_allowed():
            self._features = None
            self.speculate = False

    def _timeout(self) -> float:
        remaining = self._time_remaining()  # None when the client set no deadline
        return DEFAULT_RPC_TIMEOUT_S if remaining is None else max(min(remaining, DEFAULT_RPC_TIMEOUT_S), 0.001)

    def _prefill(self, link: Link, pool: Pool, request_type: type, replica: Replica, timeout_s: float, **extra: Any) -> Any:
        """Open a session holding the whole committed sequence on `replica` (reserved by pool.pick) and pin
        it to `link`; returns the reply. The reservation ends in _release, with the request's other sessions."""
        self._sessions_opened += 1
        session_id = f"{self.request_id}-{self._sessions_opened}"
        self._opened.append((pool, replica, session_id))
        sampling = self.spec.warp.to_proto(common_pb2.SamplingParams)
        reply = replica.stub.Prefill(
            request_type(session_id=session_id, prompt_token_ids=self.sequence, sampling=sampling, **extra), timeout=timeout_s
        )
        link.session_id, link.replica, link.sync = session_id, replica, ServiceSync(agreed=len(self.sequence))
        link.features_sent = len(self.sequence) - 1
        return reply

    def _open_verify(self) -> None:
        """Prime a verify replica with the sequence so far, trying each healthy replica once."""
        pool = self.backends.verify
        codes = []
        while (replica := pool.pick(exclude=self._verify.failed)) is not None:
            try:
                reply = self._prefill(
                    self._verify, pool, verify_pb2.VerifyPrefillRequest, replica, self._timeout(), return_features=self._features is not None
                )
                if self._features is not None:
                    self._features.put(reply.features)
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

    def _open_draft(self) -> None:
        """(Re)open a draft session; on failure speculation pauses and is retried after a back-off.
        A draft that failed a call before (in any request) is first asked for its health (DRAFT_PROBE_S
        at most): one that is frozen or still overloaded stays skipped without stalling the stream for
        another draft timeout."""
        pool = self.backends.draft
        replica = pool.pick()
        if replica is None:
            self._draft_down(None, "no draft replica serves", mark=False)
            return
        if not pool.usable(replica, min(DRAFT_PROBE_S, self._draft_timeout())):
            pool.release(replica)
            self._draft_down(replica, "failed before and gives no SERVING answer to a health check", mark=False)
            return
        try:
            extra = {"target_features": self._unsent_features(0)} if self._features is not None else {}
            self._prefill(self._draft, pool, draft_pb2.DraftPrefillRequest, replica, self._draft_timeout(), **extra)
            self._draft_backoff_s = DRAFT_BACKOFF_S
        except grpc.RpcError as error:  # whatever the draft's trouble, the target alone can answer
            self._draft_down(replica, str(error.code()))

    def _draft_down(self, replica: Optional[Replica], reason: str, mark: bool = True) -> None:
        log.warning("draft %s failed (%s); target-only rounds for %.1f s", replica.address if replica else "pool", reason,
                    self._draft_backoff_s)
        if mark and replica is not None:
            self.backends.draft.mark_failed(replica)
        self._draft.replica = None
        self._lookahead = ([], [])
        self._draft_retry_at = time.monotonic() + self._draft_backoff_s
        self._draft_backoff_s = min(self._draft_backoff_s * 2, DRAFT_MAX_BACKOFF_S)

    def _draft_timeout(self) -> float:
        return min(self._timeout(), self.draft_timeout_s)

    def _release(self) -> None:
        """Free every session this request opened; failures are logged, never raised."""
        calls = [
            replica.stub.Release.future(common_pb2.ReleaseRequest(session_id=session_id), timeout=RELEASE_TIMEOUT_S)
            for _, replica, session_id in self._opened
        ]
        for (pool, replica, _), call in zip(self._opened, calls):
            try:
                call.result()
            except grpc.RpcError as error:
                log.info("release failed (the replica may be gone): %s", error.code())
            pool.release(replica)
        self._opened.clear()

    # --- one round -----------------------------------------------------------------------------
    def _tokens_left(self) -> int:
        """New tokens this request may still emit (its own limit and the model's context)."""
        return min(self.spec.max_new_tokens - len(self.generated), self.max_length - len(self.sequence))

    def _free_drafts(self) -> FreeRound:
        """This round's drafts if a free drafter makes them: a lookup copy, joined in one tree with the Medusa
        heads' confident candidates where a tree may be drafted (_joined_round), else the copy alone
        (_lookup_drafts), else the heads' round (_head_round_drafts). Empty when none pays: the draft
        service's turn."""
        copy = self._lookup_copy()
        if copy and self._can_join() and (joined := self._joined_round(copy)) is not None:
            return joined
        if copied := self._lookup_drafts(copy):
            return FreeRound(copied, [], len(copied), False)
        headed, parents = self._head_round_drafts()
        return FreeRound(headed, parents, 0, bool(headed))

    def _lookup_copy(self) -> list[int]:
        """What followed the latest earlier occurrence of the sequence's last n-gram
        (specd_common/lookup.py), up to the tokens a round may draft; [] when nothing recurs or
        speculation is paused. Under the fixed policy a copy is at most num_draft_tokens long, like a draft."""
        if not self.lookup_tokens or not self._speculation_allowed():
            return []
        cap = min(self.lookup_tokens if self.spec.adaptive else self.spec.num_draft_tokens, self._tokens_left() - 1)
        return prompt_lookup(self.sequence, cap, min_ngram=self.lookup_min_ngram) if cap > 0 else []

    def _lookup_drafts(self, copy: list[int]) -> list[int]:
        """A lookup round's drafts: the copy cut to the length that maximizes expected tokens per second by
        the copies' own acceptance per position and the measured verify cost (no draft cost: the draft
        is not asked); [] when no length pays."""
        if not copy or not self.spec.adaptive:
            return copy
        k, _ = self._free_shape(len(copy), self._lookup_acceptance)
        return copy[:k]

    def _can_join(self) -> bool:
        """Whether a lookup copy and the heads' proposals may share this round's tree: the adaptive policy, a
        request that may draft trees (_tree_branches) and proposals with confidences from the last Verify."""
        return (self.spec.adaptive and not self._heads_declined and bool(self._head_drafts.confidences)
                and self._tree_branches(self.branches) > 1)

    def _joined_round(self, copy: list[int]) -> Optional[FreeRound]:
        """A lookup copy and the Medusa heads' candidates in one tree (adaptive.valued_tree): the copy's
        nodes valued by the copies' acceptance per position, the heads' by their confidence and the
        request's calibration; the round takes the nodes that pay for their verified positions (priced
        as a Verify that asks for the heads' proposals). A copy whose first token misses then still has
        the heads' guesses beside it, and heads whose chain misses the copy's. The copy's nodes come
        first, so the tree's main chain is the copy as far as it was taken (its estimate learns from
        that, the calibration from the heads' nodes). None when no node of the heads pays: the copy
        alone decides, as before (_lookup_drafts), and the proposals stay for a head round. Held
        out, offline with these rules: 2.722 tokens a pass against 2.623 for a copy that preempts the
        heads (scripts/free_trees_offline.py); through the services, four A/B pairs: 2.399 against
        2.288 tokens a pass, +3.2% tokens/s (docs/benchmarks/ab_joined/)."""
        scale = self._head_calibration.scale
        heads = head_nodes(*self._head_candidates(self._head_drafts), scale)
        nodes, _ = valued_tree([chain_nodes(copy, self._lookup_acceptance.chain(len(copy))), heads], self._head_round_cost)
        own = {node.path: node.value for node in heads}
        if not any(node.path in own for node in nodes):
            return None
        self._take_head_proposals()
        copied = sum(node.path == tuple(copy[: len(node.path)]) for node in nodes)
        if not copied:
            self._lookup_acceptance.update(0, 0)  # declined: forgets toward its prior, as _free_shape does
        self._head_predicted = sum(own.get(node.path, 0.0) for node in nodes) / scale
        self._head_nodes = {i for i, node in enumerate(nodes) if node.path in own}
        self._rounds_since_head_round = 0
        drafts, parents = tree_round(nodes)
        return FreeRound(drafts, parents, copied, True)

    def _take_head_proposals(self) -> HeadProposals:
        """The heads' proposals of the last Verify, taken once; none when that Verify did not ask for them
        (_ask_head_drafts): declined like proposals that do not pay, so their estimate forgets toward its prior."""
        proposals, self._head_drafts = self._head_drafts, HeadProposals()
        if self._heads_declined:
            self._heads_declined = False
            self._head_acceptance.update(0, 0)
            return HeadProposals()
        return proposals

    def _head_round_drafts(self) -> tuple[list[int], list[int]]:
        """A head round's drafts and, for a tree, their parents ([] for a chain): the Medusa heads'
        proposals after the last committed token (from the last Verify); none when there are none,
        speculation is paused, or the draft service's drafts promise more tokens per second. With the
        heads' confidences (every verify of this version sends them) the round is shaped by them
        (_confident_head_round): the nodes among each head's first draft_branches candidates worth
        their verified positions. Without, the older rule: cut like a lookup copy by the per-position
        estimates and, with several candidates a head, the heads' best in a chain with the others
        beside its first drafts as leaves (tree.chain_with_leaves) where that promises more
        (_free_shape). When sampling each candidate is judged as a fixed token with its own one-hot q
        (gateway.rejection.multi_candidate_sample). Under the fixed policy the heads draft
        (num_draft_tokens at most, every candidate) only where no draft service does."""
        proposals = self._take_head_proposals()
        if not proposals or not self._speculation_allowed():
            return [], []
        cap = self._head_cap(proposals)
        if not self.spec.adaptive:
            return ([], []) if self.speculate else head_round(proposals.tokens[: min(cap, self.spec.num_draft_tokens)])
        self._reopen_draft_if_due()  # so the heads are compared with a live draft, not with none
        if proposals.confidences:
            return self._confident_head_round(*self._head_candidates(proposals))
        branches = min(len(proposals.tokens[0]), self.branches)
        k, widened = self._free_shape(cap, self._head_acceptance, rival_rate=self._draft_rate(), heads=True, branches=branches)
        return head_round([candidates[: branches if i < widened else 1] for i, candidates in enumerate(proposals.tokens[:k])])

    def _confident_head_round(self, tokens: list[list[int]], confidences: list[list[float]]) -> tuple[list[int], list[int]]:
        """A head round shaped by the heads' confidence this round (adaptive.confident_tree): of the
        candidates tokens[d][r] (_head_candidates), the most valuable nodes, as many as pay for their
        verified positions (a chain when there is one candidate a head: a request beside others,
        _tree_branches); none when none pays or the draft service promises more."""
        nodes, predicted, rate = confident_tree(tokens, confidences, self._head_calibration.scale, self._head_round_cost)
        rival_rate = self._draft_rate()
        if nodes and rate > rival_rate:
            self._rounds_since_head_round = 0
        elif not rival_rate and confidences and self._rounds_since_head_round >= PROBE_EVERY_ROUNDS:
            # a one-token probe: heads less confident than they are right would never draft, and the
            # calibration learns only from rounds that do
            nodes, predicted, self._rounds_since_head_round = [TreeNode((tokens[0][0],), confidences[0][0])], confidences[0][0], 0
        else:
            self._rounds_since_head_round += 1
            self._head_acceptance.update(0, 0)  # declined: forgets toward its prior (_free_shape)
            return [], []
        self._head_predicted, self._head_nodes = predicted, set(range(len(nodes)))
        return tree_round(nodes)

    def _head_cap(self, proposals: HeadProposals) -> int:
        """How many heads' proposals a round may draft: one token fewer than the request may still emit."""
        return max(0, min(len(proposals.tokens), self._tokens_left() - 1))

    def _head_candidates(self, proposals: HeadProposals) -> tuple[list[list[int]], list[list[float]]]:
        """What a round shaped by the heads' confidence chooses among: the first _head_cap heads' first
        draft_branches candidates (one beside other requests: _tree_branches) and their confidences."""
        cap, branches = self._head_cap(proposals), self._tree_branches(min(len(proposals.tokens[0]), self.branches))
        return [c[:branches] for c in proposals.tokens[:cap]], [p[:branches] for p in proposals.confidences[:cap]]

    def _head_round_cost(self, drafts: int, tree: bool) -> float:
        """Seconds of a free round of `drafts` nodes (a tree pass when `tree`) whose Verify asks for the
        heads' proposals: how head and joined rounds are priced."""
        return self._free_cost(drafts, 1, 0, heads=True, tree=tree)

    def _ask_head_drafts(self) -> bool:
        """Whether this round's Verify should return the heads' proposals for the next round: only when a
        head round could pay by the heads' acceptance so far (the fixed policy: when no draft service
        drafts). Proposals cost the verify ~3 ms a pass on the 2-core AMD EPYC (three chained products
        over 8,192 LM-head rows; a batch's sessions share them), paid by every pass that asks, used or
        not: at 4 streams, asking every pass with head rounds in 5% of rounds, rounds took 6% longer
        than target-only's (114 vs 108 ms, docs/benchmarks/bench_c4_chain2.json). A round that does
        not ask counts as declined, so the estimate forgets toward its prior and a request asks again."""
        self._heads_declined = False
        if not self.medusa_heads or not self._speculation_allowed():
            self._asked_heads = False
        elif not self.spec.adaptive:
            self._asked_heads = not self.speculate
        else:
            k, rate = self._free_round(self.medusa_heads, self._head_acceptance, heads=True)
            self._heads_declined = not k or rate <= self._draft_rate()
            self._asked_heads = not self._heads_declined
        return self._asked_heads

    def _free_round(self, length: int, estimate: AcceptanceEstimate, heads: bool = False) -> tuple[int, float]:
        """The best number of free drafts (no draft call) out of `length` in a chain, by their acceptance
        per position and the measured verify cost alone, and the tokens per second it promises. heads:
        the drafts are the heads' proposals, so a round with drafts is priced by the Verifies that asked
        for them (every head round's does, for the round after it) and one without by those that did not."""
        k, _, rate = self._best_shape(length, estimate, None, 1, lambda k, w: self._free_cost(k, 1, w, heads))
        return k, rate

    def _free_cost(self, k: int, branches: int, widened: int, heads: bool, tree: bool = False) -> float:
        """Seconds a round of k free drafts takes, alternatives beside the first `widened` (_free_round);
        tree: k nodes that are not a chain."""
        return self.backends.costs.round_cost_s(k, branches, drafting=False, heads=k > 0 if heads else None,
                                                widened=widened, tree=tree)

    def _free_shape(self, length: int, estimate: AcceptanceEstimate, rival_rate: float = 0.0, heads: bool = False,
                    branches: int = 1) -> tuple[int, int]:
        """How many of `length` drafts that cost no draft call to verify, and (heads' candidates: branches
        > 1) beside how many of the first their alternatives go: the shape that maximizes expected
        tokens per second (_best_shape). (k, widened); (0, 0) when no length pays or `rival_rate`
        (tokens/s the draft service promises) is higher, and a declined source's estimate then forgets
        toward its prior, so a request tries it again later."""
        k, widened, rate = self._best_shape(length, estimate, self._rescue[HEADS] if heads else None, branches,
                                            lambda k, w: self._free_cost(k, branches, w, heads))
        if not k or rate <= rival_rate:
            estimate.update(0, 0)
            return 0, 0
        return k, widened

    def _best_shape(self, length: int, estimate: AcceptanceEstimate, rescue: Optional[AcceptanceEstimate], branches: int,
                    round_cost_s: Callable[[int, int], float]) -> tuple[int, int, float]:
        """The round that maximizes expected tokens per second among chains of k ≤ `length` drafts and,
        with branches > 1, trees of that chain with branches − 1 alternatives beside its first w drafts
        (tree.chain_with_leaves): (k, w, tokens/s), w = 0 for a chain. Alternatives are worth most early,
        where the chain misses first (held-out, the shipped heads' second candidate at position 1 alone
        moved 1.806 → 1.930 tokens a pass, beside all three 2.005: docs/benchmarks/heads_trees_offline.json);
        they rescue a missed draft at the request's measured `rescue` rate there (expected_tokens) and
        cost the verify their positions (round_cost_s(k, w), measured); chains only beside other
        requests (_tree_branches)."""
        widths = range(length + 1) if self._tree_branches(branches) > 1 and rescue is not None else range(1)
        best = (0, 0, -1.0)
        for widened in widths:
            rescued = rescue.chain(widened) + [0.0] * (length - widened) if widened else ()
            k, rate = best_rate(estimate.chain(length), length, lambda k: round_cost_s(k, widened), rescued)
            if rate > best[2] * (1 + 1e-9):  # ties: the fewest alternatives
                best = (k, min(widened, k), rate)
        return best

    def _tree_branches(self, branches: int) -> int:
        """Candidates a position this round may draft: `branches` for a request running alone, else 1.
        A tree pass cannot join a batched pass (its mask is its own), so beside other requests it would
        hold them up, a cost no measured verify time shows."""
        return branches if self._running() <= 1 else 1

    def _reopen_draft_if_due(self) -> None:
        """(Re)open the draft session when it is closed (it failed, or opened under load) and its back-off is over."""
        if self.speculate and not self._draft.open and time.monotonic() >= self._draft_retry_at:
            self._open_draft()

    def _draft_rate(self) -> float:
        """Expected tokens per second of a round the draft service would draft now (0 when none is open)."""
        if not (self.speculate and self._draft.open):
            return 0.0
        return self._draft_best()[2]

    def _draft_best(self) -> tuple[int, int, float]:
        """The draft service's best round now (_best_shape): (k, widened, tokens/s)."""
        cap = max(0, min(self.spec.num_draft_tokens, self._tokens_left() - 1))
        costs = self.backends.costs
        return self._best_shape(cap, self._acceptance, self._rescue[DRAFT], self.branches,
                                lambda k, w: costs.round_cost_s(k, self.branches, widened=w))

    def _draft_shape(self) -> tuple[int, int]:
        """k for this round and how many of its drafts get alternatives beside them (a tree, with
        draft_branches > 1; the fixed policy: all of them): (0, 0) without a live draft; never more drafts
        than tokens left (the last is the bonus)."""
        if not self.speculate:
            return 0, 0
        if not self._speculation_allowed():
            return 0, 0  # the server is busy enough that drafts would cost throughput
        self._reopen_draft_if_due()
        if not self._draft.open:
            return 0, 0  # no draft (down, or backing off)
        cap = max(0, min(self.spec.num_draft_tokens, self._tokens_left() - 1))
        if not self.spec.adaptive:
            return cap, cap
        k, widened, _ = self._draft_best()
        self._rounds_since_draft = 0 if k else self._rounds_since_draft + 1
        if self._rounds_since_draft > PROBE_EVERY_ROUNDS:  # a one-token probe keeps the estimate current
            self._rounds_since_draft = 0
            return min(1, cap), 0
        return k, widened

    def _propose(self, k: int, widened: int = 0) -> tuple[list[int], list[common_pb2.Distribution], list[int]]:
        """Drafts, their q (sampling) and a tree's parents ([] for a chain); nothing when the draft fails.
        With widened > 0 the draft drafts a tree and the alternatives beside its first `widened` drafts
        are kept (tree.widened_nodes)."""
        stub = self._draft.replica.stub
        request = draft_pb2.ProposeRequest(
            session_id=self._draft.session_id,
            commit=self._draft.sync.commit(self.sequence),
            num_draft_tokens=k,
            seed=int(self.rng.integers(2**63)),
            branches=self.branches if widened else 1,
        )
        if self._features is not None:
            request.target_features.CopyFrom(self._unsent_features(self._draft.features_sent))
        try:
            proposal = stub.Propose(request, timeout=self._draft_timeout())
        except grpc.RpcError as error:
            self._draft_down(self._draft.replica, str(error.code()))
            return [], [], []
        self._draft.sync.agreed = len(self.sequence)
        self._draft.features_sent = len(self.sequence) - 1
        self._account(request, proposal, draft=True)
        tokens, probs, parents = list(proposal.token_ids), list(proposal.draft_probs), list(proposal.parents)
        if parents:
            kept = tree.widened_nodes(parents, widened)
            tokens, parents = [tokens[i] for i in kept], tree.reindexed(parents, kept)
            probs = [probs[i] for i in kept] if probs else []
        return tokens, probs, parents

    def _unsent_features(self, start: int) -> common_pb2.TargetFeatures:
        """Target features from row `start` up to the committed sequence's last position but one."""
        return self._features.slice(start, len(self.sequence) - 1)

    # --- overlap (PEARL-style look-ahead) ------------------------------------------------------
    def _start_lookahead(self, drafts: list[int], k: int):
        """While the target verifies `drafts`, ask the draft for k + 1 more tokens after them. The first
        is its guess of the bonus token; if every draft is accepted and the guess is right, the other
        k are next round's drafts, drawn from q in exactly the context they will be verified in."""
        request = draft_pb2.ProposeRequest(
            session_id=self._draft.session_id,
            commit=common_pb2.Commit(prefix_length=len(self.sequence) + len(drafts)),
            num_draft_tokens=k + 1,
            seed=int(self.rng.integers(2**63)),
        )
        return request, self._draft.replica.stub.Propose.future(request, timeout=self._draft_timeout())

    def _finish_lookahead(self, lookahead, outcome: RoundOutcome) -> None:
        """Keep the look-ahead's drafts when it guessed this round's bonus token; drop them otherwise.
        Waiting for it even when it is useless keeps the RNG order, hence seeded output, deterministic."""
        request, call = lookahead
        try:
            reply = call.result()
        except grpc.RpcError as error:
            self._draft_down(self._draft.replica, str(error.code()))
            return
        self._account(request, reply, draft=True)
        self.stats.lookahead_rounds += 1
        if outcome.bonus and reply.token_ids and reply.token_ids[0] == outcome.next_token:
            self._draft.sync.agreed += 1  # the bonus token is the draft's own first look-ahead token
            self._lookahead = (list(reply.token_ids[1:]), list(reply.draft_probs[1:]))
            self.stats.lookahead_hits += 1

    def _take_lookahead(self, k: int) -> tuple[list[int], list[common_pb2.Distribution]]:
        """Drafts kept from the last round's look-ahead (at most k), or none."""
        drafts, probs = self._lookahead
        self._lookahead = ([], [])
        return drafts[:k], probs[:k]

    def _verify_drafts(self, drafts: list[int], parents: list[int]) -> verify_pb2.VerifyResponse:
        """Score the drafts (a tree when `parents` is given); a tree's features are kept after judging."""
        while True:
            request = verify_pb2.VerifyRequest(
                session_id=self._verify.session_id,
                commit=self._verify.sync.commit(self.sequence),
                draft_token_ids=drafts,
                draft_parents=parents,
                return_features=self._features is not None,
                return_head_drafts=self._ask_head_drafts(),
                head_candidates=self.branches if self._asked_heads and self.branches > 1 else 0,
            )
            try:
                scores = self._verify.replica.stub.Verify(request, timeout=self._timeout())
            except grpc.RpcError as error:
                if not self._replica_fault(error):
                    raise
                log.warning("verify replica %s failed (%s) mid-request; replaying on another", self._verify.replica.address, error.code())
                self._verify.failed.append(self._verify.replica)
                self.backends.verify.mark_failed(self._verify.replica)
                self._open_verify()
                continue
            self._verify.sync.agreed = len(self.sequence)
            self._account(request, scores)
            if self._features is not None and not parents:
                self._features.put(scores.features)
            return scores

    def _account(self, request: Any, response: Any, draft: bool = False) -> None:
        """Bytes on the wire and time inside the model, for the overhead numbers in the stats."""
        self.stats.wire_bytes += request.ByteSize() + response.ByteSize()
        self.stats.model_seconds += response.model_seconds
        if draft:
            self.stats.draft_model_seconds += response.model_seconds

    def _judge(self, drafts: list[int], draft_probs: list, scores: verify_pb2.VerifyResponse, parents: list[int]) -> RoundOutcome:
        if self.spec.warp.greedy:
            if parents:
                return greedy_tree_verify(drafts, parents, list(scores.argmax_token_ids))
            return greedy_verify(drafts, list(scores.argmax_token_ids))
        vocab_size = self.backends.target_info.vocab_size
        p = np.stack([decode_distribution(d) for d in scores.target_probs])  # [k + 1, V] (a tree: [n + 1, V])
        if parents:  # a later sibling's q is its first sibling's (sent once)
            q_rows = [decode_distribution(d, vocab_size) if d.probs else None for d in draft_probs]
            return tree_rejection_sample(drafts, parents, q_rows, p, self.rng)
        q = np.stack([decode_distribution(d, vocab_size) for d in draft_probs]) if drafts else np.zeros((0, p.shape[1]))
        return rejection_sample(drafts, q, p, self.rng)

    def _emit(self, tokens: list[int]) -> Chunk:
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
        delta = self._text.push(taken)
        if delta.stopped:
            return Chunk(taken, delta.text, FinishReason.STOP)
        text = delta.text + (self._text.flush() if finish else "")
        return Chunk(taken, text, finish)

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
            return remaining is None or remaining > 0.05
        return error.code() in REPLICA_FAULTS
