"""Build and start a DraftService server (used by `specd serve draft`, `specd up` and the tests)."""

from __future__ import annotations

import copy
import logging
from typing import Callable, Sequence

from draft_service.drafters import Drafter, ModelDrafter, NgramDrafter
from draft_service.service import SERVICE_NAME, DraftServicer, add_to_server
from specd_engine import autotune, runtime_cache
from specd_engine.batching import BatchPolicy
from specd_common.config import HEAD_DRAFTERS, ServerConfig, StartupMeasurement
from specd_common.lookup import SHORTEST_NGRAM
from specd_common.security import token_interceptors
from specd_common.server import RunningServer, start_observed_server
from specd_common.sessions import SessionStore

log = logging.getLogger(__name__)


def make_drafter(
    kind: str, model: str = "", device: str = "auto", dtype: str = "auto", batching: BatchPolicy = BatchPolicy(), target: str = "",
    lookup_min_ngram: int = SHORTEST_NGRAM, threads: int = 0, max_threads: int = 0, startup: StartupMeasurement = StartupMeasurement(),
) -> Drafter:
    """'ngram' → prompt lookup of suffix n-grams down to `lookup_min_ngram` tokens; 'model' → a
    Hugging Face draft model loaded from `model`, batching concurrent sessions' drafting steps per
    `batching`; 'feature' → a feature head folder (`model`) over its target's embedding and LM head
    (`target`, default: the target named in the head); 'eagle3' → an EAGLE-3 head folder in a published
    layout (draft_service/eagle3_head.py) over `target`'s. startup: where a head drafter caches its
    start-up timings and how long they may take (specd_engine/runtime_cache.py)."""
    if kind == "ngram":
        return NgramDrafter(min_ngram=lookup_min_ngram)
    if kind in HEAD_DRAFTERS:
        return load_feature_drafter(model, target, dtype, threads, max_threads, startup, device, kind=kind)
    if kind == "model":
        from specd_engine.models import load_causal_lm

        return ModelDrafter(load_causal_lm(model, device=device, dtype=dtype), batching)
    raise ValueError(f"unknown drafter {kind!r}; use 'eagle3', 'feature', 'model' or 'ngram'")


def load_feature_drafter(
    folder: str, target: str = "", dtype: str = "auto", threads: int = 0, max_threads: int = 0,
    startup: StartupMeasurement = StartupMeasurement(), device: str = "cpu", kind: str = "feature",
) -> Drafter:
    """A FeatureDrafter: the head from `folder` (kind 'feature': specd's own; 'eagle3': an EAGLE-3
    checkpoint, which names no target: `target` is required), bound to its target's embedding and LM
    head, on `device` ('auto': CUDA when present, as every model service).

    Of the target only those two matrices are read from its safetensors (its config and tokenizer
    besides, for shapes and the gateway's vocabulary check; the whole target is loaded on the CPU
    only where its files hold no safetensors); the head refuses a target of another shape. dtype 'auto'
    and threads 0 are measured at start-up (tune_feature_drafter): bfloat16 halves the weights a step
    reads (a single step 2.57 → 1.48 ms on an AVX512-BF16 CPU, same held-out acceptance) and is slow
    where the CPU has no bf16 instructions; drafts never change what the target accepts, so the
    head's precision is a speed choice only."""
    import torch
    from pathlib import Path

    from draft_service.feature_drafter import FeatureDrafter
    from draft_service.feature_head import load_head_over, target_matrices
    from specd_engine.models import (describe_model, load_causal_lm, load_model_shell, max_sequence_length, parse_dtype,
                                     pick_device, read_model_matrices, use_device)

    torch_device = pick_device(device)
    use_device(torch_device)
    config = head_config(kind, folder)
    target = target or config.get("target", "")
    if not target:
        raise ValueError(f"the {kind} head in {folder} names no target: pass the target it drafts for (--target)")
    loaded, path = load_model_shell(target)
    matrices = read_model_matrices(loaded, path)
    if matrices is None:  # no safetensors to read them from: the whole target, once
        loaded = load_causal_lm(target, device="cpu", dtype="float32")
        matrices = target_matrices(loaded.model)
    if kind == "eagle3":
        from draft_service.eagle3_head import load_eagle3

        head = load_eagle3(Path(folder), matrices[0], target_num_layers=loaded.model.config.num_hidden_layers)
    else:
        head = load_head_over(Path(folder), *matrices)
    del matrices
    info = describe_model(loaded)
    if config.get("vocab_digest") and config["vocab_digest"] != info.vocab_digest:
        raise ValueError(f"feature head {folder} was trained for a target with another vocabulary than {loaded.name!r}")
    info.model_name = f"{kind}-head:{Path(folder).name}"
    max_length = max_sequence_length(loaded)
    key = {**runtime_cache.machine_key(str(torch_device)), **runtime_cache.model_key(loaded.name, loaded.model),
           "head": runtime_cache.digest(config), "head_device": str(torch_device)}
    del loaded
    dtypes = [torch.float32, torch.bfloat16] if dtype == "auto" else [parse_dtype(dtype, torch_device)]
    drafters = {str(d).removeprefix("torch."): FeatureDrafter(copy.deepcopy(head).to(device=torch_device, dtype=d), info, max_length, kind)
                for d in dtypes}
    key.update(dtypes=list(drafters), threads=autotune.threads_to_try(threads, max_threads))
    timings = runtime_cache.StartupTimings.open(f"draft-{kind}", key, startup.cache_dir, startup.remeasure, startup.budget_s)
    drafter, runtime = tune_feature_drafter(drafters, threads, max_threads, measure=timings.measure, source=lambda: timings.source)
    timings.finish()
    drafter.info().runtime_config = runtime
    log.info("draft runtime: %s head %s, %s", kind, folder, runtime)
    return drafter


def head_config(kind: str, folder: str) -> dict:
    """A head folder's config as JSON (specd's feature head: feature_head.json; EAGLE-3: config.json), for
    the target it names, its vocabulary digest and the start-up timings' cache key."""
    import json
    from pathlib import Path

    from draft_service.feature_head import CONFIG_FILE

    path = Path(folder) / (CONFIG_FILE if kind == "feature" else "config.json")
    if not path.exists():
        raise ValueError(f"{folder} holds no {path.name}: not a {kind} head folder")
    return json.loads(path.read_text())


def tune_feature_drafter(drafters: dict, threads: int = 0, max_threads: int = 0, repeats: int = 5,
                         measure: autotune.Measure = autotune.measure_now, source: Callable[[], str] = lambda: "measured",
                         ) -> tuple[Drafter, str]:
    """The fastest of `drafters` (dtype name → FeatureDrafter) at the fewest threads within the
    tolerance, from interleaved timings of a 3-token draft after a 32-token prompt (taken by `measure`;
    `source()` says how, once taken); sets torch's threads; returns the drafter and the choice as JSON
    (for GetModelInfo.runtime_config)."""
    import json

    import numpy as np
    import torch

    from specd_engine.features import encode_features
    from specd_common.params import Warp

    counts = autotune.threads_to_try(threads, max_threads)

    def first(source: str) -> tuple[Drafter, str]:
        torch.set_num_threads(counts[0])
        name = next(iter(drafters))
        return drafters[name], json.dumps({"device": str(drafters[name].device), "threads": counts[0], "dtype": name, "source": source})

    if len(counts) * len(drafters) == 1:
        return first("flags")

    def draft_three(drafter):
        prompt = list(range(1, 33))
        session = drafter.open(prompt, Warp())
        drafter.add_features(session, encode_features(torch.zeros((len(prompt) - 1, drafter.head.config.feature_size)), 0))
        rng = np.random.default_rng(0)

        def run() -> None:
            drafter.propose(session, 3, rng)
            del session.sequence.tokens[len(prompt):]  # drop the drafts: the next run drafts the same

        return run

    seconds = measure("draft steps", lambda: {(t, name): draft_three(d) for t in counts for name, d in drafters.items()}, repeats)
    if not seconds:  # no start-up time left to measure
        return first("default")
    best = min(drafters, key=lambda name: min(s for (t, n), s in seconds.items() if n == name))
    chosen_threads = autotune.fewest_threads({t: s for (t, n), s in seconds.items() if n == best})
    torch.set_num_threads(chosen_threads)
    record = {"device": str(drafters[best].device), "threads": chosen_threads, "dtype": best, "source": source(),
              "draft3_ms": {f"{t}:{n}": round(s * 1000, 2) for (t, n), s in seconds.items()}}
    return drafters[best], json.dumps(record, separators=(",", ":"))


def start_draft_server(
    drafter: Drafter, config: ServerConfig, interceptors: Sequence = (), kv_token_budget: int = 0, auth_token: str = "",
) -> RunningServer:
    """kv_token_budget: positions all sessions may hold (> 0), none (< 0), or 0: derived like the verify's,
    from the memory free now and the drafter's bytes per position (no budget for the n-gram drafter).
    auth_token: when set, every DraftService RPC needs `authorization: Bearer <token>` (health and reflection stay open)."""
    budget = draft_token_budget(drafter, kv_token_budget)
    log.info("draft KV-token budget: %s", budget or "none")
    sessions: SessionStore = SessionStore(config.max_sessions, config.session_idle_timeout_s, max_tokens=budget)
    sessions.start_reaper()
    servicer = DraftServicer(drafter, sessions)
    running = start_observed_server("draft", lambda s: add_to_server(servicer, s), SERVICE_NAME, servicer, sessions, config,
                                    [*token_interceptors(auth_token), *interceptors])
    running.cleanups.append(servicer.stop)
    return running


def draft_token_budget(drafter: Drafter, requested: int) -> int:
    """`requested` when set, else from the free memory of the device the drafter's sessions live on
    (a model or feature drafter on CUDA: that GPU's, not the host's)."""
    if requested:
        return max(requested, 0)
    device = str(getattr(drafter, "device", "cpu"))
    return autotune.kv_token_budget(drafter.bytes_per_token(), autotune.available_memory_bytes(device))
