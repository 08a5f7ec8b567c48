"""`specd up --drafter auto`: whether the draft service runs, decided by measuring both stacks here.

The split stack (draft service + verify + gateway) pays where the draft has a device of its own and
its drafts beat the verify's Medusa heads; the heads-only stack (no draft service) pays where draft
and verify would share cores the verify needs. Which holds depends on the machine and the heads, so
`specd up` measures it on the first start. Both gateways run in front of one verify and one draft,
the calibration prompts go through them in turn (A B, then B A), and the split stack is kept only
when it was faster in greedy tokens per second in every pass; otherwise the difference is within
what the order of a pass moves, a tie, and a tie keeps heads-only. The choice is cached per machine, target and heads, like the services'
start-up timings (specd_engine/runtime_cache.py); `specd up --remeasure` measures again.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from specd_app.stack import (free_ports, gateway_command, service_commands, spawn_in_own_session, split_gateway_flags,
                             start_in_order, stop_children, wait_until_serving)
from specd_engine import runtime_cache
from specd_common.config import HEADS_ONLY, draft_service_default, resolve_medusa_heads

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
CHOICE_RULE = 2  # in the cache key: a choice made by an earlier rule (1: faster overall) is measured again

Generate = Callable[[str, str, int], int]  # (gateway address, prompt, max new tokens) → tokens generated


def resolve_drafter(drafter: str, draft_model: str, target: str, one_cpu: Optional[bool] = None) -> tuple[str, str]:
    """'auto' → HEADS_ONLY where the draft and the verify would share one CPU (no CUDA device; pass
    one_cpu to decide for another machine) and the target has shipped Medusa heads, else the draft
    service's own default (draft_service_default). Any other choice is returned as given. This is
    `specd bench`'s rule (which runs both stacks anyway) and `specd up`'s for targets without
    Medusa heads; with them, `specd up` measures both stacks (specd_app/stack_choice.py).

    Why heads on one CPU: a draft service there runs on the cores the target needs, and every round
    pays its gRPC hop, its own step and the verify's feature shipping; the heads cost ~3 ms inside
    the verify's pass. Side by side on the 2-core EPYC VM the heads-only stack was faster in every
    run (8 of 8; README's table: `make bench` 2026-11-24 06:46, 25.82 vs 24.67 tok/s).
    On a GPU the draft service keeps its own device, so the feature head stays the choice there."""
    if drafter != "auto":
        return drafter, draft_model
    if one_cpu is None:
        import torch

        one_cpu = not torch.cuda.is_available()
    if one_cpu and resolve_medusa_heads("auto", target):
        return HEADS_ONLY, ""
    return draft_service_default(target)


def measure_stacks(addresses: dict[str, str], generate: Generate, prompts: Sequence[str] = CALIBRATION_PROMPTS,
                   tokens: int = CALIBRATION_TOKENS, passes: int = CALIBRATION_PASSES,
                   stopped: Callable[[], bool] = lambda: False) -> dict[str, list[float]]:
    """Greedy tokens per second of each stack (name → gateway address) in each pass, its prompts
    interleaved with the others' in alternating order (the first pass A B, the next B A); {} when
    `stopped()` turns true between requests (Ctrl-C while measuring ends the start-up within one
    request, and nothing is cached)."""
    names = list(addresses)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for number in range(passes):
        seconds, generated = {name: 0.0 for name in names}, {name: 0 for name in names}
        for prompt in prompts:
            for name in names if number % 2 == 0 else names[::-1]:
                if stopped():
                    return {}
                started = time.perf_counter()
                generated[name] += generate(addresses[name], prompt, tokens)
                seconds[name] += time.perf_counter() - started
        for name in names:
            rates[name].append(generated[name] / seconds[name] if seconds[name] else 0.0)
    return rates


def choose(rates: dict[str, list[float]]) -> str:
    """The split stack only when it measured faster in every pass (rates: measure_stacks'): a draft
    service must pay for its process, its memory and its round trips. Each pass runs the stacks in the
    other order, so a lead smaller than what the order moves does not hold in both: a tie, which on a
    2-core CPU it is (2026-11-29, Xeon: one start measured split 40.1 against heads 38.6 tokens/s, and
    side by side sampled they were level, 0.995x and 1.008x their own target-only), keeps heads-only."""
    split, heads = rates.get(SPLIT, []), rates.get(HEADS, [])
    return SPLIT if split and len(split) == len(heads) and all(a > b for a, b in zip(split, heads)) else HEADS


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


def save_choice(key: dict, rates: dict[str, list[float]], folder: Optional[str] = None) -> dict:
    """Cache the choice and the rates it was made from (measure_stacks': each pass's, and their mean)."""
    record = {"format": runtime_cache.FORMAT, "key": key, "choice": choose(rates),
              "tokens_per_s": {name: round(statistics.fmean(found), 2) for name, found in rates.items()},
              "tokens_per_s_by_pass": {name: [round(rate, 2) for rate in found] for name, found in rates.items()},
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


def up_choice_key(args: argparse.Namespace, devices: dict) -> dict:
    """What `specd up --drafter auto`'s measured choice depends on: the machine and its software, the
    target, the draft service's and the verify's default heads, the services' devices and threads."""
    drafter, head = draft_service_default(args.target)
    return {"rule": CHOICE_RULE, "machine": runtime_cache.machine_key(devices["verify"]),  # service_devices: "auto" is already resolved
            "target": args.target, "drafter": drafter, "head": head, "medusa": resolve_medusa_heads("auto", args.target),
            "devices": devices, "threads": args.threads, "num_draft_tokens": args.num_draft_tokens,
            "weights": os.environ.get("SPECD_WEIGHTS", "auto")}  # the verify's --weights (specd up passes the environment on)


def measure_and_choose(args: argparse.Namespace, ports: dict, devices: dict, commands: dict, children: dict, stop: dict,
                       key: dict, token: str) -> dict:
    """Start verify and draft, put a gateway of each stack in front of them on free ports, measure both
    (measure_stacks), cache the choice, stop both gateways and the draft service if it lost;
    then start the chosen gateway on its own port, so clients reach it only once the choice is made.
    Returns the commands of what runs (the supervisor restarts from them)."""
    models = {name: command for name, command in commands.items() if name != "gateway"}
    children.update(start_in_order(models, args.host, ports, stop, spawn=spawn_in_own_session))
    if stop["requested"] or len(children) < len(models):
        return commands
    spare = free_ports(args.host, 2)
    addresses = {SPLIT: f"{args.host}:{spare[0]}", HEADS: f"{args.host}:{spare[1]}"}
    trial = {"split": gateway_command(args.host, {**ports, "gateway": spare[0], "http": 0}, args.num_draft_tokens,
                                      *split_gateway_flags(devices), "--metrics-port", "-1"),
             "heads": gateway_command(args.host, {**ports, "gateway": spare[1], "http": 0}, args.num_draft_tokens,
                                      "--draft-address", "", "--metrics-port", "-1")}
    trials = {f"gateway-trial-{name}": spawn_in_own_session(command) for name, command in trial.items()}
    children.update(trials)
    try:
        rates = {}
        if all(wait_until_serving(address, children, stop) for address in addresses.values()):
            rates = measure_stacks(addresses, functools.partial(grpc_generate, token=token),
                                                stopped=lambda: stop["requested"])
    finally:
        stop_children({name: children.pop(name) for name in trials})
    if not rates:  # stopped, or a trial gateway did not start: serve the split stack, measure at the next start
        if not stop["requested"]:
            children["gateway"] = spawn_in_own_session(commands["gateway"])
        return commands
    record = save_choice(key, rates)
    log.info("drafter auto: %s tok/s by pass → %s (cached in %s)", record["tokens_per_s_by_pass"], record["choice"], choice_path(key))
    if record["choice"] == HEADS:
        stop_children({"draft": children.pop("draft")})
        commands = service_commands(args.host, ports, args.target, HEADS_ONLY, "", args.threads, args.num_draft_tokens, devices)
        args.drafter, args.draft_model = HEADS_ONLY, ""
    children["gateway"] = spawn_in_own_session(commands["gateway"])
    return commands
