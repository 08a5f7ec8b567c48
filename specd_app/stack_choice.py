"""`specd up --drafter auto`: whether the draft service runs, decided by measuring both stacks here.

The split stack (draft service + verify + gateway) pays where the draft has a device of its own and
its drafts beat the verify's Medusa heads; the heads-only stack (no draft service) pays where draft
and verify would share cores the verify needs. Which holds depends on the machine and the heads, so
`specd up` measures it on the first start. Both gateways run in front of one verify and one draft,
the calibration prompts go through them in turn (A B, then B A), and the faster stack in greedy
tokens per second is kept (a tie keeps heads-only). The choice is cached per machine, target and heads, like the services'
start-up timings (specd_common/runtime_cache.py); `specd up --remeasure` measures again.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from specd_common import runtime_cache

log = logging.getLogger(__name__)

SPLIT, HEADS = "split", "heads"
# Prompts of the kinds users send (chat, code, math, writing); none is in the training corpus.
CALIBRATION_PROMPTS = (
    "Give three tips for keeping a houseplant alive in winter.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "A train travels 120 km in 1.5 hours. What is its average speed? Explain step by step.",
    "Write a short paragraph describing a quiet morning at the sea.",
)
CALIBRATION_TOKENS = 48  # enough rounds per prompt for the adaptive policy to settle, ~1-2 s each on a CPU
CALIBRATION_PASSES = 2  # A B, then B A: a drift of the machine's speed hits both stacks alike

Generate = Callable[[str, str, int], int]  # (gateway address, prompt, max new tokens) → tokens generated


def measure_stacks(addresses: dict[str, str], generate: Generate, prompts: Sequence[str] = CALIBRATION_PROMPTS,
                   tokens: int = CALIBRATION_TOKENS, passes: int = CALIBRATION_PASSES,
                   stopped: Callable[[], bool] = lambda: False) -> dict[str, float]:
    """Greedy tokens per second of each stack (name → gateway address), its prompts interleaved with
    the others' in alternating order; {} when `stopped()` turns true between requests (Ctrl-C while
    measuring ends the start-up within one request, and nothing is cached)."""
    seconds, generated = {name: 0.0 for name in addresses}, {name: 0 for name in addresses}
    names = list(addresses)
    for number in range(passes):
        for prompt in prompts:
            for name in names if number % 2 == 0 else names[::-1]:
                if stopped():
                    return {}
                started = time.perf_counter()
                generated[name] += generate(addresses[name], prompt, tokens)
                seconds[name] += time.perf_counter() - started
    return {name: generated[name] / seconds[name] if seconds[name] else 0.0 for name in names}


def choose(rates: dict[str, float]) -> str:
    """The split stack only when it measured faster: a draft service must pay for its process, its
    memory and its round trips (a tie, which on a 2-core CPU it is, keeps heads-only)."""
    return SPLIT if rates.get(SPLIT, 0.0) > rates.get(HEADS, 0.0) else HEADS


def choice_path(key: dict, folder: Optional[str] = None) -> Path:
    return runtime_cache.runtime_folder(folder or "") / f"up-drafter-{runtime_cache.digest(key)}.json"


def cached_choice(key: dict, folder: Optional[str] = None) -> Optional[dict]:
    """The record of an earlier measurement for exactly this key, or None."""
    path = choice_path(key, folder)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if record.get("key") != key or record.get("choice") not in (SPLIT, HEADS):
        return None
    return record


def save_choice(key: dict, rates: dict[str, float], folder: Optional[str] = None) -> dict:
    record = {"format": runtime_cache.FORMAT, "key": key, "choice": choose(rates),
              "tokens_per_s": {name: round(rate, 2) for name, rate in rates.items()},
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    runtime_cache.write(choice_path(key, folder), record)
    return record


def grpc_generate(address: str, prompt: str, tokens: int, token: str = "") -> int:
    """One greedy request through a gateway (with the stack's bearer token, if any); returns the tokens it generated."""
    import grpc

    from specd.v1 import generate_pb2, generate_pb2_grpc
    from specd_common.security import bearer_metadata

    with grpc.insecure_channel(address) as channel:
        reply = generate_pb2_grpc.GenerateServiceStub(channel).Generate(
            generate_pb2.GenerateRequest(text=prompt, max_new_tokens=tokens), timeout=300, metadata=bearer_metadata(token))
    return len(reply.token_ids)
