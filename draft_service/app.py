"""Build and start a DraftService server (used by `specd serve draft`, `specd up` and the tests)."""

from __future__ import annotations

import logging
from typing import Sequence

from draft_service.drafters import Drafter, ModelDrafter, NgramDrafter
from draft_service.service import SERVICE_NAME, DraftServicer, add_to_server
from specd_common.batching import BatchPolicy
from specd_common.config import ServerConfig
from specd_common.server import RunningServer, start_observed_server
from specd_common.sessions import SessionStore

log = logging.getLogger(__name__)


def make_drafter(
    kind: str, model: str = "", device: str = "auto", dtype: str = "auto", batching: BatchPolicy = BatchPolicy(), target: str = "",
    lookup_min_ngram: int = 2,
) -> Drafter:
    """'ngram' → prompt lookup; 'model' → a Hugging Face draft model loaded from `model`, batching
    concurrent sessions' drafting steps per `batching`; 'feature' → a feature head folder (`model`)
    over its target's embedding and LM head (`target`, default: the target named in the head), trying
    prompt lookup first when the last `lookup_min_ngram` (> 0) tokens recur."""
    if kind == "ngram":
        return NgramDrafter()
    if kind == "feature":
        return load_feature_drafter(model, target, lookup_min_ngram, dtype)
    if kind == "model":
        from specd_common.models import load_causal_lm

        return ModelDrafter(load_causal_lm(model, device=device, dtype=dtype), batching)
    raise ValueError(f"unknown drafter {kind!r}; use 'feature', 'model' or 'ngram'")


def load_feature_drafter(folder: str, target: str = "", lookup_min_ngram: int = 2, dtype: str = "auto") -> Drafter:
    """A FeatureDrafter: the head from `folder`, bound to its target's embedding and LM head.

    The target is loaded once for those two matrices (and its tokenizer, for the gateway's vocabulary
    check) and then dropped; the head refuses a target of another shape. The head runs on the CPU:
    one step is a few million multiply-adds, less than a GPU kernel launch sequence costs. dtype 'auto'
    is float32; 'bfloat16' halves the weights a step reads (a single step measured 2.57 → 1.48 ms on this
    machine's AVX512-BF16 CPU, same held-out acceptance) but was not shown faster end to end."""
    import torch
    import json
    from pathlib import Path

    from draft_service.feature_drafter import FeatureDrafter
    from draft_service.feature_head import CONFIG_FILE, load_head
    from specd_common.models import describe_model, load_causal_lm, max_sequence_length, parse_dtype

    config = json.loads((Path(folder) / CONFIG_FILE).read_text())
    loaded = load_causal_lm(target or config["target"], device="cpu", dtype="float32")
    head = load_head(Path(folder), loaded.model)
    info = describe_model(loaded)
    if config.get("vocab_digest") and config["vocab_digest"] != info.vocab_digest:
        raise ValueError(f"feature head {folder} was trained for a target with another vocabulary than {loaded.name!r}")
    info.model_name = f"feature-head:{Path(folder).name}"
    max_length = max_sequence_length(loaded)
    del loaded
    chosen = parse_dtype(dtype, torch.device("cpu"))
    log.info("feature head %s in %s", folder, chosen)
    return FeatureDrafter(head.to(chosen), info, max_length, lookup_min_ngram=lookup_min_ngram)


def start_draft_server(drafter: Drafter, config: ServerConfig, interceptors: Sequence = ()) -> RunningServer:
    sessions: SessionStore = SessionStore(config.max_sessions, config.session_idle_timeout_s)
    sessions.start_reaper()
    servicer = DraftServicer(drafter, sessions)
    return start_observed_server("draft", lambda s: add_to_server(servicer, s), SERVICE_NAME, servicer, sessions, config, interceptors)
