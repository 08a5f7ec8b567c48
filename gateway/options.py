"""The gateway's request-handling settings (the flags of `specd serve gateway` that are not about sockets).

The defaults here are the flags' defaults (specd_app/cli.py reads them), so a gateway built in code
runs as `specd serve gateway` does."""

from __future__ import annotations

from dataclasses import dataclass

from specd_common.tree import MAX_DRAFT_TOKENS, MAX_PLAIN_STEPS, MAX_SPECULATED_OUTCOMES

DRAFT_TIMEOUT_S = 5.0  # a draft slower than this is treated as down: speculation must never stall a request
MAX_QUEUE_S = 30.0  # a client without a deadline waits at most about this long for its first token, else is refused
SESSION_LEASE_S = 6.0  # a model service frees a session this long after its gateway stopped renewing it


@dataclass(frozen=True)
class GatewayOptions:
    """How the gateway runs requests: the flags of `specd serve gateway` that are not about sockets."""

    num_draft_tokens: int = 3  # default k (the cap under the adaptive policy)
    draft_length_policy: str = "adaptive"  # or "fixed"
    draft_timeout_s: float = DRAFT_TIMEOUT_S
    max_waiting: int = 64  # requests that may queue for a slot beyond the running ones
    max_speculative_requests: int = -1  # above this many running requests, rounds are target-only; 0: no limit; < 0: from measured costs
    speculated_outcomes: int = 4  # while the target verifies, the draft prepares next round's drafts for this many outcomes; 0: none
    draft_branches: int = 4  # candidates per drafted position a greedy adaptive request may draft a tree with (gateway/engine.py)
    lookup_tokens: int = 8  # longest prompt-lookup copy the gateway proposes itself (a lookup round); 0: none
    lookup_min_ngram: int = 2  # shortest suffix n-gram a copy needs (specd_common.lookup.prompt_lookup's min_ngram)
    plain_steps: int = 4  # passes one Verify of a round with nothing to draft decodes: the round trip is paid once in 4
    connect_timeout_s: float = 600.0  # how long start-up waits for the model services
    resolve_period_s: float = 5.0  # dns:/// replica pools are looked up again this often (and after a failure)
    auth_token: str = ""  # required as `authorization: Bearer <token>` when set
    max_queue_s: float = MAX_QUEUE_S  # without a deadline, a request whose first token is estimated this far away is refused
    session_lease_s: float = SESSION_LEASE_S  # model services free this gateway's sessions this long after it stops renewing them

    def __post_init__(self) -> None:
        if self.draft_length_policy not in ("adaptive", "fixed"):
            raise ValueError(f"draft length policy must be 'adaptive' or 'fixed', got {self.draft_length_policy!r}")
        if not 0 <= self.speculated_outcomes <= MAX_SPECULATED_OUTCOMES:
            raise ValueError(f"speculated outcomes must be in [0, {MAX_SPECULATED_OUTCOMES}], got {self.speculated_outcomes}")
        if not 1 <= self.plain_steps <= MAX_PLAIN_STEPS:
            raise ValueError(f"plain steps must be in [1, {MAX_PLAIN_STEPS}], got {self.plain_steps}")
        if not 0 <= self.lookup_tokens <= MAX_DRAFT_TOKENS or self.lookup_min_ngram < 1:
            raise ValueError(f"lookup tokens must be in [0, {MAX_DRAFT_TOKENS}] and lookup min n-gram ≥ 1, "
                             f"got {self.lookup_tokens} and {self.lookup_min_ngram}")
