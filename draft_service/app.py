"""Build and start a DraftService server (used by `specd serve draft`, `specd up` and the tests)."""

from __future__ import annotations

from typing import Sequence

from draft_service.drafters import Drafter, ModelDrafter, NgramDrafter
from draft_service.service import SERVICE_NAME, DraftServicer, add_to_server
from specd_common.batching import BatchPolicy
from specd_common.config import ServerConfig
from specd_common.server import RunningServer, start_observed_server
from specd_common.sessions import SessionStore


def make_drafter(
    kind: str, model: str = "", device: str = "auto", dtype: str = "auto", batching: BatchPolicy = BatchPolicy()
) -> Drafter:
    """'ngram' → prompt lookup; 'model' → a Hugging Face draft model loaded from `model`, batching
    concurrent sessions' drafting steps per `batching`."""
    if kind == "ngram":
        return NgramDrafter()
    if kind == "model":
        from specd_common.models import load_causal_lm

        return ModelDrafter(load_causal_lm(model, device=device, dtype=dtype), batching)
    raise ValueError(f"unknown drafter {kind!r}; use 'model' or 'ngram'")


def start_draft_server(drafter: Drafter, config: ServerConfig, interceptors: Sequence = ()) -> RunningServer:
    sessions: SessionStore = SessionStore(config.max_sessions, config.session_idle_timeout_s)
    sessions.start_reaper()
    servicer = DraftServicer(drafter, sessions)
    return start_observed_server("draft", lambda s: add_to_server(servicer, s), SERVICE_NAME, servicer, sessions, config, interceptors)
