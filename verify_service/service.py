"""The VerifyService servicer: a thin adapter from protobuf to the Scorer and back."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import grpc
import numpy as np
import torch

from specd.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from specd_common.errors import SpecdError, grpc_errors, require, unexpected
from specd_common.masks import allowed_tokens
from specd_common.sequence import validate_token_ids
from specd_common.sessions import SessionStore, drop_if_abandoned
from specd_common.telemetry import kv_rollback
from specd_common.tree import MAX_DRAFT_TOKENS, MAX_PLAIN_STEPS, MAX_TREE_NODES, MAX_VERIFY_PARTS, validate_tree
from specd_common.params import Warp, check_top_logprobs
from verify_service.scorer import Scorer, VerifySession

MAX_HEAD_CANDIDATES = 4  # VerifyRequest.head_candidates
SERVICE_NAME = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name


class VerifyServicer(verify_pb2_grpc.VerifyServiceServicer):
    """Prefill / Verify / Release over a bounded session store."""

    def __init__(self, scorer: Scorer, sessions: SessionStore[VerifySession]):
        self.scorer = scorer
        self.sessions = sessions
        self.vocab_size = scorer.lm.vocab_size
        # a VerifyBatch's parts wait in the batcher side by side, each on its own thread
        self._part_threads = ThreadPoolExecutor(MAX_VERIFY_PARTS, thread_name_prefix="specd-verify-part")

    @grpc_errors
    def Prefill(self, request: verify_pb2.VerifyPrefillRequest, context: grpc.ServicerContext):
        require(len(request.prompt_token_ids) > 0, "prompt_token_ids must hold at least one token")
        validate_token_ids(request.prompt_token_ids, self.vocab_size, "prompt_token_ids")
        warp = Warp.from_proto(request.sampling)
        validate_token_ids(warp.biased_tokens, self.vocab_size, "sampling.logit_bias")
        require(request.return_features or not request.feature_layers, "feature_layers apply only with return_features")
        require(0 <= request.prompt_length <= len(request.prompt_token_ids),
                f"prompt_length must be in [0, {len(request.prompt_token_ids)}] (0: every token is the prompt), "
                f"got {request.prompt_length}")
        self.scorer.check_feature_layers(request.feature_layers)  # before a session is claimed
        prompt_tokens = len(request.prompt_token_ids)
        # id, slot and KV budget claimed before the forward; a caller that goes stops its prefill between chunks
        with self.sessions.opening(request.session_id, prompt_tokens, request.lease_seconds) as keep:
            session = self.scorer.open(list(request.prompt_token_ids), warp, keep_features=request.return_features,
                                       prompt_length=request.prompt_length or None,
                                       wanted=context.is_active, feature_layers=request.feature_layers)
            keep(session)
        drop_if_abandoned(self.sessions, request.session_id, context)
        return verify_pb2.VerifyPrefillResponse(
            sequence_length=len(session.sequence.tokens), features=self.scorer.last_features(session),
            next_scored=session.sequence.scored is not None,
        )

    @grpc_errors
    def Verify(self, request: verify_pb2.VerifyRequest, context: grpc.ServicerContext):
        return self._verify(request)

    @grpc_errors
    def VerifyBatch(self, request: verify_pb2.VerifyBatchRequest, context: grpc.ServicerContext):
        """Each part as its own Verify, all at once on the parts' threads, so the batcher scores them in
        one pass; a part's failure is its result alone. Why: on the 2-vCPU Xeon 8 sessions driven
        straight at the verify made 430 tokens/s in-process and 342 through one unary Verify each: the
        calls, not the pass, cost a fifth of the throughput (docs/design/batching.md)."""
        parts = request.parts
        require(1 <= len(parts) <= MAX_VERIFY_PARTS, f"parts must hold 1 to {MAX_VERIFY_PARTS} Verifies, got {len(parts)}")
        ids = [part.session_id for part in parts]
        require(len(set(ids)) == len(ids), "each part must be of a different session (a session's rounds follow one another)")
        results = list(self._part_threads.map(self._part_result, parts))
        return verify_pb2.VerifyBatchResponse(results=results)

    def _part_result(self, part: verify_pb2.VerifyRequest) -> verify_pb2.VerifyBatchResult:
        """One part's response, or the status its Verify would fail with (grpc_errors' mapping)."""
        try:
            return verify_pb2.VerifyBatchResult(response=self._verify(part))
        except SpecdError as error:
            code, message = error.code, str(error)
        except Exception:
            code, message = unexpected("VerifyBatch")
        return verify_pb2.VerifyBatchResult(code=code.value[0], message=message)

    def _verify(self, request: verify_pb2.VerifyRequest) -> verify_pb2.VerifyResponse:
        drafts, parents = list(request.draft_token_ids), list(request.draft_parents)
        most = MAX_TREE_NODES if parents else MAX_DRAFT_TOKENS
        require(len(drafts) <= most, f"at most {most} draft tokens ({MAX_DRAFT_TOKENS} in a chain, {MAX_TREE_NODES} "
                                     f"in a tree), got {len(drafts)}")
        validate_token_ids(drafts, self.vocab_size, "draft_token_ids")
        validate_token_ids(request.commit.append_token_ids, self.vocab_size, "commit.append_token_ids")
        if parents:
            validate_tree(drafts, parents)
        require(0 <= request.head_candidates <= MAX_HEAD_CANDIDATES,
                f"head_candidates must be in [0, {MAX_HEAD_CANDIDATES}], got {request.head_candidates}")
        require(0 <= request.head_rows <= MAX_TREE_NODES + 1,
                f"head_rows must be in [0, {MAX_TREE_NODES + 1}] (0: every row), got {request.head_rows}")
        require(request.head_depth >= 0, f"head_depth must be ≥ 0 (0: every head), got {request.head_depth}")
        check_top_logprobs(request.top_logprobs)
        steps = check_plain_steps(request, self.vocab_size)
        allowed = self._allowed(request.allowed_tokens, len(drafts) + 1)
        with self.sessions.use(request.session_id) as session:
            with kv_rollback(session.sequence):
                self.scorer.settle_tree(session, request.commit.prefix_length, request.commit.append_token_ids)
                session.sequence.apply_commit(request.commit.prefix_length, request.commit.append_token_ids)
            length = len(session.sequence.tokens)
            self.sessions.account(request.session_id, length + len(drafts) + steps - 1)  # the KV budget, before the forward
            started = time.perf_counter()
            scores = self.scorer.score(session, drafts, parents, request.return_features, request.return_head_drafts,
                                       request.head_candidates, request.head_rows, allowed, request.top_logprobs,
                                       request.coupled_draw if request.HasField("coupled_draw") else None, request.head_depth,
                                       steps, request.stop_token_ids)
            model_seconds = time.perf_counter() - started
        return verify_pb2.VerifyResponse(
            argmax_token_ids=scores.argmax_token_ids,
            target_probs=scores.target_probs,
            sampled_token_ids=scores.sampled_token_ids,
            sequence_length=length,
            model_seconds=model_seconds,
            features=scores.features,
            head_drafts=scores.head_drafts,
            logprobs=scores.logprobs,
        )

    def _allowed(self, masks: Sequence[common_pb2.TokenMask], rows: int) -> Optional[torch.Tensor]:
        """A constrained Verify's masks as bool [rows, V], checked (structured output); None without masks."""
        if not masks:
            return None
        require(len(masks) == rows, f"allowed_tokens must hold one mask per scored position ({rows}), got {len(masks)}")
        return torch.from_numpy(np.stack([allowed_tokens(mask, self.vocab_size, f"allowed_tokens[{row}]")
                                          for row, mask in enumerate(masks)]))

    @grpc_errors
    def Release(self, request: common_pb2.ReleaseRequest, context: grpc.ServicerContext):
        return common_pb2.ReleaseResponse(released=self.sessions.release(request.session_id))

    @grpc_errors
    def KeepAlive(self, request: common_pb2.KeepAliveRequest, context: grpc.ServicerContext):
        unknown = self.sessions.renew(request.session_ids)
        return common_pb2.KeepAliveResponse(renewed=len(request.session_ids) - len(unknown), unknown_session_ids=unknown)

    @grpc_errors
    def GetModelInfo(self, request: common_pb2.GetModelInfoRequest, context: grpc.ServicerContext):
        return self.scorer.info()


def check_plain_steps(request: verify_pb2.VerifyRequest, vocab_size: int) -> int:
    """The passes a Verify decodes (VerifyRequest.plain_steps; 0 means 1), checked: several only for a
    plain round that reads one row a pass (no drafts, masks, log probabilities or features)."""
    steps = request.plain_steps or 1
    require(1 <= steps <= MAX_PLAIN_STEPS, f"plain_steps must be in [0, {MAX_PLAIN_STEPS}], got {request.plain_steps}")
    validate_token_ids(request.stop_token_ids, vocab_size, "stop_token_ids")
    if steps > 1:
        require(not request.draft_token_ids and not request.allowed_tokens and not request.top_logprobs
                and not request.return_features and not request.coupled_draw.return_target_probs,
                "plain_steps > 1 decodes plain rounds only: send no drafts, allowed_tokens, top_logprobs, "
                "return_features or coupled_draw.return_target_probs with it")
    return steps


def add_to_server(servicer: VerifyServicer, server: grpc.Server) -> None:
    verify_pb2_grpc.add_VerifyServiceServicer_to_server(servicer, server)
