"""The target side of a round: apply the commit, one forward over pending + drafted tokens, report p."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from specd.v1 import common_pb2
from specd_common.batching import BatchPolicy, make_batcher
from specd_common.distributions import encode_distribution
from specd_common.features import encode_features
from specd_common.lm import CausalLM, KVSession
from specd_common.models import LoadedModel, describe_model
from specd_common.params import Warp
from specd_common.warping import warp_probs


@dataclass
class VerifySession:
    """One request's target state: token sequence with KV cache, and its warping."""

    sequence: KVSession
    warp: Warp


@dataclass
class Scores:
    """The target's view of k + 1 positions: argmax ids when greedy, encoded p when sampling."""

    argmax_token_ids: list[int] = field(default_factory=list)  # [k + 1] (greedy)
    target_probs: list[common_pb2.Distribution] = field(default_factory=list)  # [k + 1] (sampling)
    features: Optional[common_pb2.TargetFeatures] = None  # the positions read, when the session keeps them


class Scorer:
    """Wraps the target model for many sessions."""

    def __init__(self, loaded: LoadedModel, batching: BatchPolicy = BatchPolicy()):
        self.lm = CausalLM(loaded, prepack_cpu=True)
        self.batcher = make_batcher(self.lm, batching)  # None: one session per forward
        self._info = describe_model(loaded)
        self._info.hidden_size = loaded.model.config.hidden_size

    def info(self) -> common_pb2.GetModelInfoResponse:
        return self._info

    def open(self, prompt: Sequence[int], warp: Warp, keep_features: bool = False) -> VerifySession:
        return VerifySession(self.lm.new_session(prompt, keep_features), warp)

    @staticmethod
    def last_features(session: VerifySession) -> Optional[common_pb2.TargetFeatures]:
        """The features of the positions the session's last forward read (None unless it keeps them)."""
        sequence = session.sequence
        if not sequence.keep_features or sequence.fed_features is None:
            return None
        return encode_features(sequence.fed_features, sequence.fed_start)

    def score(self, session: VerifySession, draft_token_ids: Sequence[int]) -> Scores:
        """One target forward over the pending token(s) and the drafts: k + 1 next-token positions.
        Concurrent sessions' calls share one batched pass when batching is on."""
        logits = (self.batcher or self.lm).forward(session.sequence, draft_token_ids)  # [k + 1, V]
        features = self.last_features(session)
        if session.warp.greedy:
            return Scores(argmax_token_ids=torch.argmax(logits, dim=-1).tolist(), features=features)
        probs = warp_probs(logits, session.warp).cpu().numpy()  # [k + 1, V]
        return Scores(target_probs=[encode_distribution(row) for row in probs], features=features)
