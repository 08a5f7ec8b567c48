"""`specd up` supervises its three children the way Kubernetes would: a child that exits is restarted
after a back-off (1 s, doubling to 30 s; reset once it has run for a minute), and logged.

While the draft is down the gateway answers target-only (and resumes speculation once the draft's
health check says SERVING again); while the verify is down requests end UNAVAILABLE with their
partial answer and new ones fail fast; the gateway's channels reconnect by themselves when the
restarted process listens again. Only a stop request (Ctrl-C, SIGTERM) ends everything.
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 60.0  # a child that ran this long starts its next back-off from the beginning again


@dataclass
class Child:
    """One supervised service: how to start it, the running process, and its restart state."""

    name: str
    command: list[str]
    process: Optional[subprocess.Popen] = None
    started_at: float = 0.0
    backoff_s: float = FIRST_BACKOFF_S
    restart_at: Optional[float] = None  # set while it waits to be restarted
    restarts: int = 0


@dataclass
class Supervisor:
    """Restarts children that exit. `step` is called in a loop; `spawn` and `clock` are injectable so the
    policy can be tested without processes."""

    children: dict[str, Child]
    spawn: Callable[[list[str]], subprocess.Popen] = field(default=subprocess.Popen)
    clock: Callable[[], float] = field(default=time.monotonic)

    def step(self) -> None:
        """Notice exits, schedule restarts with back-off, start the children that are due."""
        now = self.clock()
        for child in self.children.values():
            if child.restart_at is None and child.process is not None and child.process.poll() is not None:
                if now - child.started_at >= HEALTHY_AFTER_S:
                    child.backoff_s = FIRST_BACKOFF_S
                child.restart_at = now + child.backoff_s
                log.warning("%s exited with code %s; restarting it in %.0f s", child.name, child.process.returncode, child.backoff_s)
                child.backoff_s = min(child.backoff_s * 2, MAX_BACKOFF_S)
            if child.restart_at is not None and now >= child.restart_at:
                child.process, child.started_at, child.restart_at = self.spawn(child.command), now, None
                child.restarts += 1
                log.info("%s restarted (restart %d)", child.name, child.restarts)
