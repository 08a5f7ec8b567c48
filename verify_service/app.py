"""Build and start a VerifyService server (used by `specd serve verify`, `specd up` and the tests)."""

from __future__ import annotations

from typing import Sequence

from specd_common.batching import BatchPolicy
from specd_common.config import ServerConfig
from specd_common.models import LoadedModel
from specd_common.server import RunningServer, start_server
from specd_common.sessions import SessionStore
from verify_service.scorer import Scorer
from verify_service.service import SERVICE_NAME, VerifyServicer, add_to_server


def start_verify_server(
    loaded: LoadedModel, config: ServerConfig, interceptors: Sequence = (), batching: BatchPolicy = BatchPolicy()
) -> RunningServer:
    sessions: SessionStore = SessionStore(config.max_sessions, config.session_idle_timeout_s)
    sessions.start_reaper()
    servicer = VerifyServicer(Scorer(loaded, batching), sessions)
    running = start_server(lambda s: add_to_server(servicer, s), [SERVICE_NAME], config.host, config.port, config.max_workers, interceptors)
    running.servicer = servicer
    return running
