"""The DraftService servicer: a thin adapter from protobuf to a Drafter and back."""

from __future__ import annotations

import time

import numpy as np
import grpc

from draft_service.drafters import DraftSession, Drafter, Proposal
from draft_service.speculation import SpeculationCache, SpeculationJob, resolve_or_none
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specd_common.errors import grpc_errors, require
from specd_common.sequence import validate_token_ids
from specd_common.tree import MAX_BRANCHES, MAX_DRAFT_TOKENS, MAX_SPECULATED_OUTCOMES, MAX_TREE_NODES
from specd_common.sessions import SessionStore, drop_if_abandoned
from specd_common.telemetry import kv_rollback
from specd_common.params import Warp

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Prefill / Propose / Release over a bounded session store."""

    def __init__(self, drafter: Drafter, sessions: SessionStore[DraftSession]):
        self.drafter = drafter
        self.sessions = sessions
        self.vocab_size = drafter.info().vocab_size or None  # None: a model-free drafter takes any id
        self.reads_features = getattr(drafter, "wants_target_features", False)
        # the speculation cache (draft_service/speculation.py), where the drafter offers it
        self.speculation = SpeculationCache(drafter).start() if getattr(drafter, "speculation_cache", False) else None
        drafter.info().speculation_cache = self.speculation is not None
        self.cache_hits = 0  # Proposes answered from the cache

    def stop(self) -> None:
        """Stop the speculation worker (the server is stopping)."""
        if self.speculation is not None:
            self.speculation.stop()

    def _check_ids(self, token_ids, what: str) -> None:
        if self.vocab_size:
            validate_token_ids(token_ids, self.vocab_size, what)

    @grpc_errors
    def Prefill(self, request: draft_pb2.DraftPrefillRequest, context: grpc.ServicerContext):
        require(len(request.prompt_token_ids) > 0, "prompt_token_ids must hold at least one token")
        self._check_ids(request.prompt_token_ids, "prompt_token_ids")
        limit = self.drafter.info().max_sequence_length  # 0: a model-free drafter has none
        require(
            not limit or len(request.prompt_token_ids) < limit,
            f"prompt has {len(request.prompt_token_ids)} tokens; this drafter's model takes at most {limit - 1}",
        )
        warp = Warp.from_proto(request.sampling)
        if self.speculation is not None:  # a re-opened session starts afresh: nothing prepared for the old one
            self.speculation.drop(request.session_id)
        # id, slot and KV budget claimed before any drafting work
        with self.sessions.opening(request.session_id, len(request.prompt_token_ids), request.lease_seconds) as keep:
            session = self.drafter.open(list(request.prompt_token_ids), warp)
            if self.reads_features:
                self.drafter.add_features(session, request.target_features)
            keep(session)
        drop_if_abandoned(self.sessions, request.session_id, context)
        return draft_pb2.DraftPrefillResponse(sequence_length=len(session.sequence.tokens))

    @grpc_errors
    def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.ServicerContext):
        k, branches = request.num_draft_tokens, max(1, request.branches)
        require(1 <= k <= MAX_DRAFT_TOKENS, f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {k}")
        require(0 <= request.branches <= MAX_BRANCHES and k * branches <= MAX_TREE_NODES,
                f"branches must be in [0, {MAX_BRANCHES}] with num_draft_tokens × branches ≤ {MAX_TREE_NODES}, "
                f"got {request.branches} × {k}")
        require(0 <= request.speculate_outcomes <= MAX_SPECULATED_OUTCOMES,
                f"speculate_outcomes must be in [0, {MAX_SPECULATED_OUTCOMES}], got {request.speculate_outcomes}")
        self._check_ids(request.commit.append_token_ids, "commit.append_token_ids")
        job = self.speculation.take(request.session_id) if self.speculation is not None else None
        with self.sessions.use(request.session_id) as session:
            started = time.perf_counter()
            prepared = resolve_or_none(job, self.drafter, request.commit.prefix_length, request.commit.append_token_ids)
            with kv_rollback(session.sequence):
                session.sequence.apply_commit(request.commit.prefix_length, request.commit.append_token_ids)
            length = len(session.sequence.tokens)
            self.sessions.account(request.session_id, length + k)  # the KV budget, before any drafting work
            if self.reads_features:
                self.drafter.add_features(session, request.target_features)
            proposal = usable(prepared, k, branches)
            hit = proposal is not None
            if hit:
                session.sequence.tokens.extend(proposal.token_ids)  # pending, as after a propose
            else:
                proposal = self.drafter.propose(session, k, np.random.default_rng(request.seed), branches)
            model_seconds = time.perf_counter() - started
            self._prepare_next(request, session, length, proposal, hit)
        return draft_pb2.ProposeResponse(
            token_ids=proposal.token_ids,
            draft_probs=proposal.draft_probs,
            parents=proposal.parents,
            sequence_length=length,
            model_seconds=model_seconds,
            cache_hit=hit,
        )

    def _prepare_next(self, request: draft_pb2.ProposeRequest, session: DraftSession, length: int, proposal: Proposal,
                      hit: bool) -> None:
        """Count a cache hit, and queue the preparation of the next round's drafts when the request asks
        for it (a chain that drafted something)."""
        self.cache_hits += hit
        if request.speculate_outcomes and self.speculation is not None and not proposal.parents and proposal.token_ids:
            self.speculation.schedule(request.session_id, SpeculationJob(
                session, length, tuple(proposal.token_ids), request.num_draft_tokens, request.speculate_outcomes,
                request.next_seed))

    @grpc_errors
    def Release(self, request: common_pb2.ReleaseRequest, context: grpc.ServicerContext):
        if self.speculation is not None:
            self.speculation.drop(request.session_id)
        return common_pb2.ReleaseResponse(released=self.sessions.release(request.session_id))

    @grpc_errors
    def KeepAlive(self, request: common_pb2.KeepAliveRequest, context: grpc.ServicerContext):
        unknown = self.sessions.renew(request.session_ids)
        return common_pb2.KeepAliveResponse(renewed=len(request.session_ids) - len(unknown), unknown_session_ids=unknown)

    @grpc_errors
    def GetModelInfo(self, request: common_pb2.GetModelInfoRequest, context: grpc.ServicerContext):
        return self.drafter.info()


def usable(prepared, k: int, branches: int):
    """A prepared chain answers a Propose for k drafts in a chain when it holds at least k (its first
    k are what drafting k would draw: the same generator, consumed in the same order)."""
    if prepared is None or branches > 1 or len(prepared.token_ids) < k:
        return None
    return Proposal(token_ids=list(prepared.token_ids[:k]), draft_probs=list(prepared.draft_probs[:k]))


def add_to_server(servicer: DraftServicer, server: grpc.Server) -> None:
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
