"""Build and start a VerifyService server (used by `specd serve verify`, `specd up` and the tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from specd_engine import model_thread
from specd_engine.batching import BatchPolicy
from specd_common.config import ServerConfig, StartupMeasurement
from specd_engine.models import LoadedModel
from specd_common.security import token_interceptors
from specd_common.server import RunningServer, start_observed_server
from specd_common.sessions import SessionStore
from verify_service.scorer import Scorer
from verify_service.service import SERVICE_NAME, VerifyServicer, add_to_server


def start_verify_server(
    loaded: LoadedModel, config: ServerConfig, interceptors: Sequence = (), batching: BatchPolicy = BatchPolicy(),
    threads: int = 0, prepack: str = "auto", max_threads: int = 0, kv_token_budget: int = 0, medusa_heads: str = "",
    forward: str = "auto", auth_token: str = "", startup: StartupMeasurement = StartupMeasurement(), weights: str = "float",
    kv_dtype: str = "auto",
) -> RunningServer:
    """threads / prepack / kv_token_budget / forward / weights: see Scorer (0 / auto: measured or derived at start-up on this machine);
    medusa_heads: a folder of Medusa heads for this target (verify_service/medusa.py), '' for none;
    auth_token: when set, every VerifyService RPC needs `authorization: Bearer <token>` (health and reflection stay open).
    startup: where the start-up timings are cached and how long they may take (specd_engine/runtime_cache.py).
    The heads and the scorer are built on the model thread, where the model runs (model_thread.py)."""
    scorer = model_thread.shared().run(make_scorer, loaded, batching, threads, prepack, max_threads, kv_token_budget, medusa_heads,
                                       forward, startup, weights, config.max_sessions, kv_dtype)
    sessions: SessionStore = SessionStore(
        config.max_sessions, config.session_idle_timeout_s, max_tokens=scorer.lm.runtime.kv_token_budget, on_drop=scorer.close
    )
    sessions.start_reaper()
    servicer = VerifyServicer(scorer, sessions)
    return start_observed_server("verify", lambda s: add_to_server(servicer, s), SERVICE_NAME, servicer, sessions, config,
                                 [*token_interceptors(auth_token), *interceptors])


def make_scorer(loaded: LoadedModel, batching: BatchPolicy, threads: int, prepack: str, max_threads: int,
                kv_token_budget: int, medusa_heads: str, forward: str = "auto",
                startup: StartupMeasurement = StartupMeasurement(), weights: str = "float",
                max_sessions: int = ServerConfig.max_sessions, kv_dtype: str = "auto") -> Scorer:
    """The target's Scorer, with the Medusa heads in `medusa_heads` ('' for none)."""
    medusa = None
    if medusa_heads:
        from specd_engine.models import vocab_digest
        from verify_service.medusa import load_heads

        medusa = load_heads(Path(medusa_heads), loaded.model, vocab_digest(loaded.tokenizer))
    return Scorer(loaded, batching, threads, prepack, max_threads, kv_token_budget, medusa, forward, startup, weights, max_sessions,
                  kv_dtype)
