"""The `specd` command: serve one service, bring all three up, or generate through a gateway.

  specd serve verify|draft|gateway [flags]   one service (flags also read from SPECD_* env vars)
  specd up [--target M] [--drafter auto|ngram|model|feature --draft-model M | --drafter heads]   all three (or two) on localhost
  specd generate --gateway HOST:PORT --prompt TEXT [--json]   one request
      [--tls-ca CA.pem [--tls-client-cert C --tls-client-key K]] [--token T]   over TLS, with a bearer token
  specd train-draft --work-dir DIR [--recipe feature-cpu|...]   train a draft (feature head) for the target
  specd bench --prompts FILE.jsonl... [--concurrency C [--sequential-too]] [--fixed-k K...] [--branches B...] [--cache-ab]   measure
  specd bench --prompts SHORT.jsonl --arrival [--arrival-streams K]   running streams' latency while a long prompt prefills

Security (docs/security.md): --tls-cert/--tls-key[/--tls-client-ca] on any `serve`, --tls-ca and
--tls-client-cert/--tls-client-key on the gateway toward draft and verify, --auth-token[-file] on any `serve`
(the gateway sends its token to draft and verify) and on `up` (one token for all three).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from gateway.options import GatewayOptions
from specd_app.long_prompts import LONG_PROMPTS
from specd_app.stack import (draft_has_own_device, service_commands, service_devices, share_stack_token, spawn_in_own_session,
                             start_in_order, start_local_stack, stop_children, wait_until_serving)
from specd_engine import autotune
from specd_common.config import (
    DEFAULT_HTTP_PORT,
    DEFAULT_PORTS,
    DEFAULT_TARGET,
    HEAD_DRAFTERS,
    HEADS_ONLY,
    ServerConfig,
    StartupMeasurement,
    add_client_tls_flags,
    add_flag,
    add_model_flags,
    add_server_flags,
    client_tls_from_args,
    draft_service_default,
    resolve_medusa_heads,
)
from specd_common.lookup import LONGEST_NGRAM, SHORTEST_NGRAM
from specd_common.security import SecurityConfigError, bearer_metadata, load_token

log = logging.getLogger("specd")
DEMO_PROMPT = "Explain in two sentences why the sky is blue."
GATEWAY_DEFAULTS = GatewayOptions()  # the gateway flags' defaults: one source, gateway/options.py
# --lookup-min-ngram N means the same on the gateway and the draft service (specd_common/lookup.py)
LOOKUP_MIN_NGRAM_HELP = (f"shortest n-gram a prompt-lookup copy needs: the copy continues the latest earlier occurrence "
                         f"of the sequence's last n tokens, n tried from {LONGEST_NGRAM} (or N, if larger) down to N")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given, for reports that name their command
    logging.basicConfig(
        level=os.environ.get("SPECD_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args) or 0
    except SecurityConfigError as error:
        log.error("%s", error)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="Speculative decoding over gRPC.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run one service").add_subparsers(dest="service", required=True)
    verify = serve.add_parser("verify", help="the target model")
    add_server_flags(verify, "verify")
    add_model_flags(verify, DEFAULT_TARGET)
    add_flag(verify, "prepack", "auto", "CPU linear weights: auto (measured at start-up, per forward size), on (oneDNN-prepacked), "
             "mkl (MKL-packed one-row GEMM), tall (W·xᵀ for the LM head and MLP gate/up), cols (W·xᵀ for every layer), "
             "rows (x·Wᵀ from a transposed copy), off (plain)",
             choices=["auto", "on", "mkl", "tall", "cols", "rows", "off"])
    add_flag(verify, "forward", "auto", "the target's passes: auto (specd_engine/lean_forward.py where it serves the model and "
             "agrees with transformers on a start-up probe; flat where an int4 CPU verify has specd's attention kernel, else "
             "ragged), ragged (that model, each session's cache its own), flat (that model in one flat pass over a KV store "
             "allocated at start-up, one slot a session, attention by specd's kernel in place or folded into a call a key width; "
             "on a CPU only where the machine keeps a row's bits so) or transformers (transformers' own forward)",
             choices=list(autotune.FORWARDS))
    add_flag(verify, "kv-dtype", "auto", "what a flat pass's KV store keeps keys and values as: auto (bfloat16 where specd's "
             "attention kernel serves an int4 verify, whose products already take bfloat16 inputs: decoding reads the whole "
             "store each pass, and half the bytes cut its attention time; else the model's dtype), float32 or bfloat16",
             choices=list(autotune.KV_DTYPES))
    add_flag(verify, "weights", "auto", "the target's decoder weights: float (as loaded: greedy output equals transformers' "
             "float32), int4 (CPU: 4-bit groups, bfloat16 inputs, an 8-bit LM head; ~2x faster; greedy output equals this "
             "verify's own target-only) or auto (int4 on a CPU for a model whose file stores them in 4 bits, as the default "
             "target's GGUF does; else float); docs/design/cpu-vs-llama-cpp.md", choices=["auto", "float", "int4"])
    add_flag(verify, "int4-kernel", "auto", "int4 products: auto (specd's tile kernel where a C compiler is found: AMX, else AVX-512 "
             "VNNI with 8-bit input groups, else AVX-512 BF16; SPECD_INT4_ISA names one; else PyTorch's), tiles (an error "
             "where they cannot run) or torch (PyTorch's kernel); docs/design/engine-room.md", choices=["auto", "tiles", "torch"])
    add_flag(verify, "kv-token-budget", 0, "positions all sessions may hold before Prefill/Verify get RESOURCE_EXHAUSTED "
             "(0 = half the memory free after loading over the target's KV bytes per position; -1 = no budget)")
    add_flag(verify, "medusa-heads", "auto", "Medusa heads proposing drafts from the target's last hidden state: a heads folder, "
             "auto (the shipped heads for the default target) or none")
    add_auth_token_flags(verify, "every VerifyService RPC (the gateway sends its own --auth-token)")
    verify.set_defaults(func=serve_verify)
    draft = serve.add_parser("draft", help="the drafter")
    add_server_flags(draft, "draft")
    add_model_flags(draft, "")
    add_flag(draft, "drafter", "ngram", "drafter backend: ngram (no model), model (a small LM, --model), feature (specd's feature head "
             "folder, --model) or eagle3 (an EAGLE-3 head folder in the EAGLE authors' or speculators' layout, --model)")
    add_flag(draft, "target", "", "feature and eagle3 drafters: the target whose embedding and LM head it reads (default: the one "
             "named in a feature head; an EAGLE-3 head names none)")
    add_flag(draft, "kv-token-budget", 0, "positions all draft sessions may hold before Prefill/Propose get RESOURCE_EXHAUSTED "
             "(0 = half the memory free after loading over the drafter's bytes per position, none for ngram; -1 = no budget)")
    add_flag(draft, "lookup-min-ngram", SHORTEST_NGRAM, f"ngram drafter: {LOOKUP_MIN_NGRAM_HELP} (other drafters propose no "
             "copies: the gateway's lookup rounds do, deciding per request whether they pay)")
    add_auth_token_flags(draft, "every DraftService RPC (the gateway sends its own --auth-token)")
    draft.set_defaults(func=serve_draft)
    gateway = serve.add_parser("gateway", help="the public API")
    add_server_flags(gateway, "gateway")
    add_gateway_flags(gateway)
    gateway.set_defaults(func=serve_gateway)

    up = commands.add_parser("up", help="run verify, gateway and (unless the drafter is heads) draft on localhost")
    add_flag(up, "target", DEFAULT_TARGET, "target model")
    add_flag(up, "drafter", "auto", "auto (when the target has shipped Medusa heads: the draft service's stack or heads-only, "
             "whichever measured faster on this machine at the first start, cached; else the shipped feature head for the "
             f"default target, else ngram), ngram, model, feature, eagle3, or {HEADS_ONLY} (no draft service: the verify's "
             "Medusa heads and lookup copies draft)")
    up.add_argument("--remeasure", action="store_true", help="--drafter auto: measure both stacks again, ignoring the cached choice")
    add_flag(up, "draft-model", "", "draft model (--drafter model) or head folder (--drafter feature or eagle3)")
    add_flag(up, "host", "127.0.0.1", "address all three bind")
    add_flag(up, "gateway-port", DEFAULT_PORTS["gateway"], "gateway port")
    add_flag(up, "http-port", DEFAULT_HTTP_PORT, "the gateway's OpenAI-compatible HTTP port (0 = off)")
    add_flag(up, "draft-port", DEFAULT_PORTS["draft"], "draft port")
    add_flag(up, "verify-port", DEFAULT_PORTS["verify"], "verify port")
    add_flag(up, "threads", 0, "torch threads for each model service (0 = default)")
    add_device_flags(up)
    add_flag(up, "num-draft-tokens", GATEWAY_DEFAULTS.num_draft_tokens, "default draft tokens per round")
    add_auth_token_flags(up, "every RPC of all three services (passed to them in the environment, never on their command lines)")
    up.add_argument("--demo", nargs="?", const=DEMO_PROMPT, default=None, help="send one demo prompt once ready")
    up.add_argument("--exit-after-demo", action="store_true", help="stop everything after the demo")
    up.set_defaults(func=run_up)

    bench = commands.add_parser("bench", help="compare target-only, specd and transformers on prompt files")
    bench.add_argument("--prompts", required=True, nargs="+", help="JSONL files, a prompt (and category) a line")
    bench.add_argument("--limit", type=int, default=8, help="first N prompts of each file")
    bench.add_argument("--max-new-tokens", type=int, default=64)
    bench.add_argument("--concurrency", type=int, default=1, help="streams at a time in the service modes")
    bench.add_argument("--repeats", type=int, default=1, help="with --concurrency > 1: run the service modes this many times, "
                       "in order then in reverse (ABBA), so a drift of the machine's speed hits every mode alike; the report "
                       "gives each repeat's speedup (on a shared 2-core VM one repeat's ratio was off by up to 20%%: use 4 or more)")
    bench.add_argument("--num-draft-tokens", type=int, default=GATEWAY_DEFAULTS.num_draft_tokens, help="k for hf_assisted; the cap for adaptive specd")
    bench.add_argument("--fixed-k", type=int, nargs="*", default=[], help="also run specd with these fixed k")
    bench.add_argument("--branches", type=int, nargs="*", default=[],
                       help="also run specd (adaptive k) with these many candidates per position for its trees (1: chains only)")
    bench.add_argument("--gateway", default="", help="a running gateway; default: start one on free ports")
    bench.add_argument("--target", default=DEFAULT_TARGET, help="target model (local stack and transformers modes)")
    bench.add_argument("--drafter", default="auto", help=f"auto (as `specd up`), {HEADS_ONLY}, ngram, model, feature or eagle3 (local stack; "
                       "hf_assisted uses the model, else prompt lookup). With heads, specd runs on a gateway with no draft "
                       "service and the modes that need one (fixed k, trees, no cache) use a draft service of the target's default drafter")
    bench.add_argument("--draft-model", default="", help="draft model (--drafter model) or head folder (--drafter feature or eagle3)")
    bench.add_argument("--threads", type=int, default=0, help="torch threads per model service of the local stack")
    add_device_flags(bench)
    bench.add_argument("--dtype", default="auto", help="both model services' and transformers' dtype: auto (bf16 on CUDA, fp32 "
                       "on CPU), float32, float16, bfloat16")
    bench.add_argument("--cache-ab", action="store_true", help="also run each mode of the draft service's gateway on a second "
                       "gateway with its speculation cache switched the other way (<mode>_cache where the local stack runs without "
                       "it, as on shared cores; <mode>_nocache where it runs with it): the cache's effect side by side")
    bench.add_argument("--cap", type=int, nargs="*", default=[], help="also run specd_capN for each N: the default specd on a "
                       "gateway of its own whose --max-speculative-requests is fixed at N, side by side with the measured cap")
    bench.add_argument("--medusa", action="store_true", help="also run specd_medusa: a second gateway with no draft service, "
                       "drafting with the verify's Medusa heads (and lookup copies) alone")
    bench.add_argument("--heads", nargs="*", default=[], metavar="NAME=DIR",
                       help="also run specd_heads_NAME for each: the default request on a verify of its own serving the Medusa "
                       "heads in DIR, behind a gateway with no draft service (heads from different training runs side by side "
                       "through the services)")
    bench.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above 0 every mode samples at this "
                       "temperature (and --top-p), the transformers modes too")
    bench.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature (1: off)")
    bench.add_argument("--json-schema", default="", help="structured output: every service mode's request must answer in JSON "
                       "matching this schema file (GenerateRequest.constraint), target_only too; the report adds each mode's "
                       "forced-round share. The transformers modes cannot be constrained: use --no-hf")
    bench.add_argument("--seed", type=int, default=None, help="seed every sampled prompt (reproducible samples: a seeded request is "
                       "judged by the coupled rule, whatever k its rounds take; the default is no seed, as most users send)")
    bench.add_argument("--sequential-too", action="store_true", help="with --concurrency N > 1: also run every service mode one "
                       "request at a time, and report both side by side (N at once over one at a time, TTFT and ITL of each, "
                       "each prompt's prefill, and how close N at once comes to all prefills + batched decoding)")
    bench.add_argument("--arrival", action="store_true", help="instead of throughput: --arrival-streams requests from --prompts "
                       "decode --max-new-tokens each; once each has --arrival-after tokens, the longest prompt of --arrival-prompts "
                       "is sent; reports the running streams' inter-token latency before it arrived and during its prefill")
    bench.add_argument("--arrival-streams", type=int, default=4, help="--arrival: streams decoding when the long prompt arrives")
    bench.add_argument("--arrival-after", type=int, default=20, help="--arrival: tokens each stream has emitted before it arrives")
    bench.add_argument("--arrival-prompts", default=str(LONG_PROMPTS), help="--arrival: the JSONL file whose longest prompt arrives")
    bench.add_argument("--no-hf", action="store_true", help="skip the in-process baselines (transformers; llama.cpp where installed)")
    bench.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    bench.add_argument("--output", default="", help="write the JSON report here (and, for the speedup report, the PNG plot next to it)")
    bench.set_defaults(func=run_bench)

    from draft_training.cli import add_corpus_parser, add_train_draft_parser

    add_train_draft_parser(commands)
    add_corpus_parser(commands)

    generate = commands.add_parser("generate", help="send one request to a gateway")
    add_flag(generate, "gateway", f"127.0.0.1:{DEFAULT_PORTS['gateway']}", "gateway HOST:PORT")
    generate.add_argument("--prompt", required=True, help="prompt text (through the chat template)")
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--num-draft-tokens", type=int, default=0)
    generate.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    generate.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    generate.add_argument("--json", action="store_true", help="print one JSON object")
    generate.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    generate.add_argument("--tls", action="store_true", help="TLS with the system's trust roots (implied by --tls-ca)")
    add_client_tls_flags(generate, "the gateway")
    add_flag(generate, "token", "", "bearer token sent as 'authorization: Bearer <token>'")
    generate.set_defaults(func=run_generate)
    return parser


def add_gateway_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `specd serve gateway`; those that build GatewayOptions take its defaults (gateway_options)."""
    defaults = GATEWAY_DEFAULTS
    add_flag(parser, "verify-address", f"127.0.0.1:{DEFAULT_PORTS['verify']}", "VerifyService HOST:PORT, dns:///NAME:PORT (every A/AAAA record a replica) or dns://DNS_SERVER:PORT/NAME:PORT; comma-separated for several")
    add_flag(parser, "draft-address", f"127.0.0.1:{DEFAULT_PORTS['draft']}", "DraftService addresses, as --verify-address ('' = none)")
    add_flag(parser, "resolve-period", defaults.resolve_period_s, "seconds between DNS lookups of dns:/// addresses (also looked up after a replica fails)")
    add_flag(parser, "num-draft-tokens", defaults.num_draft_tokens, "default draft tokens per round (the cap under the adaptive policy)")
    add_flag(parser, "draft-length-policy", defaults.draft_length_policy, "adaptive (k chosen per round from measured costs) or fixed")
    add_flag(parser, "draft-branches", defaults.draft_branches, "candidates per drafted position, 1..4, for greedy adaptive requests: above 1 a round may draft and "
             "verify a tree (the drafter's chain plus its runners-up beside it; the heads' most confident nodes) where measured costs say it pays; "
             "1 = chains only. A sampled or fixed-policy request drafts a tree only when it asks for one (draft_branches)")
    add_flag(parser, "lookup-tokens", defaults.lookup_tokens, "longest prompt-lookup copy the gateway drafts itself when the sequence's last n-gram "
             "occurred before (a lookup round: no draft round trip; length chosen per round from measured costs; 0 = off)")
    add_flag(parser, "lookup-min-ngram", defaults.lookup_min_ngram, f"lookup rounds: {LOOKUP_MIN_NGRAM_HELP}")
    add_flag(parser, "plain-steps", defaults.plain_steps, "passes one Verify decodes for a request that drafts nothing (speculation "
             "off, not allowed under load, or resting): its tokens arrive this many at a time and the round trip is paid once for them "
             "(1 = a round trip a token; docs/design/batching.md)")
    add_flag(parser, "max-speculative-requests", defaults.max_speculative_requests, "above this many running requests, rounds are target-only (0 = no limit; -1 = auto: "
             "the most at which the verify's batch costs, measured at its start-up, and the tokens a round yields here say speculating pays)")
    add_flag(parser, "speculated-outcomes", defaults.speculated_outcomes, "while the target verifies, a draft service with a speculation "
             "cache prepares the next round's drafts for this many likely outcomes (0 = off; docs/design/speculation-cache.md)")
    add_flag(parser, "connect-timeout", defaults.connect_timeout_s, "seconds to wait for the model services at start")
    add_flag(parser, "max-waiting", defaults.max_waiting, "requests that may wait for a slot (max-sessions run); more get RESOURCE_EXHAUSTED")
    add_flag(parser, "draft-timeout", defaults.draft_timeout_s, "a Propose slower than this drops to target-only rounds for a while")
    add_flag(parser, "max-queue-time", defaults.max_queue_s, "a request without a deadline whose first token is estimated further away "
             "than this many seconds is refused at once (RESOURCE_EXHAUSTED / 429 with Retry-After); with a deadline, the deadline decides")
    add_flag(parser, "session-lease", defaults.session_lease_s, "seconds after which draft and verify free this gateway's sessions "
             "once it stops renewing them (it died); renewed every quarter of it while requests run")
    add_client_tls_flags(parser, "draft and verify")
    add_auth_token_flags(parser, "the public API, and send it to draft and verify")
    add_flag(parser, "http-port", DEFAULT_HTTP_PORT, "OpenAI-compatible HTTP API port on --host, TLS as the gRPC port (0 = off)")


def add_auth_token_flags(parser: argparse.ArgumentParser, where: str) -> None:
    """--auth-token / --auth-token-file (env SPECD_AUTH_TOKEN / SPECD_AUTH_TOKEN_FILE), read by load_token."""
    add_flag(parser, "auth-token", GATEWAY_DEFAULTS.auth_token, f"require 'authorization: Bearer <token>' on {where} ('' = open)")
    add_flag(parser, "auth-token-file", "", "read the bearer token from this file (a mounted Secret)")


def _set_threads(threads: int) -> None:
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def serve_verify(args: argparse.Namespace) -> None:
    from specd_engine import model_thread
    from specd_engine.batching import BatchPolicy
    from specd_engine.models import load_causal_lm
    from specd_common.server import wait_for_termination
    from verify_service.app import start_verify_server

    from specd_engine import int4_tiles

    try:
        int4_tiles.use(args.int4_kernel)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    loaded = model_thread.shared().run(load_causal_lm, args.model, args.device, args.dtype)  # where the model runs
    running = start_verify_server(
        loaded, ServerConfig.from_args(args), batching=BatchPolicy.from_args(args), threads=args.threads, prepack=args.prepack,
        max_threads=args.max_threads, kv_token_budget=args.kv_token_budget,
        medusa_heads=resolve_medusa_heads(args.medusa_heads, args.model), forward=args.forward, kv_dtype=args.kv_dtype,
        auth_token=load_token(args.auth_token, args.auth_token_file), startup=StartupMeasurement.from_args(args),
        weights=weights_for(args.weights, args.model),
    )
    wait_for_termination(running, args.grace)


def serve_draft(args: argparse.Namespace) -> None:
    from draft_service.app import make_drafter, start_draft_server
    from specd_engine.batching import BatchPolicy
    from specd_common.server import wait_for_termination

    if args.drafter not in HEAD_DRAFTERS:  # a head drafter measures its own threads (tune_feature_drafter)
        _set_threads(args.threads)
    if args.drafter in ("model", *HEAD_DRAFTERS) and not args.model:
        raise SystemExit(f"--drafter {args.drafter} needs --model (a model: hub id, folder or GGUF file; a head: its folder)")
    drafter = make_drafter(args.drafter, args.model, args.device, args.dtype, BatchPolicy.from_args(args), target=args.target,
                           lookup_min_ngram=args.lookup_min_ngram, threads=args.threads, max_threads=args.max_threads,
                           startup=StartupMeasurement.from_args(args))
    running = start_draft_server(drafter, ServerConfig.from_args(args), kv_token_budget=args.kv_token_budget,
                                 auth_token=load_token(args.auth_token, args.auth_token_file))
    wait_for_termination(running, args.grace)


def serve_gateway(args: argparse.Namespace) -> None:
    from gateway.app import start_gateway_server
    from specd_common.server import wait_for_termination

    running = start_gateway_server(
        args.verify_address, args.draft_address or None, ServerConfig.from_args(args), gateway_options(args), client_tls_from_args(args),
        http_port=args.http_port or None,
    )
    wait_for_termination(running, args.grace)


def gateway_options(args: argparse.Namespace) -> GatewayOptions:
    """GatewayOptions from the parsed flags of `specd serve gateway` (add_gateway_flags)."""
    return GatewayOptions(
        num_draft_tokens=args.num_draft_tokens,
        draft_length_policy=args.draft_length_policy,
        draft_timeout_s=args.draft_timeout,
        max_waiting=args.max_waiting,
        max_speculative_requests=args.max_speculative_requests,
        speculated_outcomes=args.speculated_outcomes,
        draft_branches=args.draft_branches,
        lookup_tokens=args.lookup_tokens,
        lookup_min_ngram=args.lookup_min_ngram,
        plain_steps=args.plain_steps,
        connect_timeout_s=args.connect_timeout,
        resolve_period_s=args.resolve_period,
        max_queue_s=args.max_queue_time,
        session_lease_s=args.session_lease,
        auth_token=load_token(args.auth_token, args.auth_token_file),
    )


def run_up(args: argparse.Namespace) -> int:
    """Start the three services (two with --drafter heads) as child processes, wait until the gateway is
    healthy, optionally demo. --drafter auto with shipped Medusa heads measures both stacks at the first
    start (specd_app/stack_choice.py) before the gateway takes its port."""
    from specd_app import stack_choice

    devices = service_devices(args.verify_device, args.draft_device)
    calibrate, key = False, {}
    if args.drafter == "auto" and resolve_medusa_heads("auto", args.target):
        key = stack_choice.up_choice_key(args, devices)
        record = None if args.remeasure else stack_choice.cached_choice(key)
        calibrate = record is None
        chosen = draft_service_default(args.target) if calibrate or record["choice"] == stack_choice.SPLIT else (HEADS_ONLY, "")
        log.info("drafter auto → %s", "measuring the draft service's stack against heads-only first" if calibrate else
                 f"{' '.join(filter(None, chosen))} (measured {record['measured_at']}: {record['tokens_per_s']} tok/s; --remeasure to measure again)")
    else:
        chosen = stack_choice.resolve_drafter(args.drafter, args.draft_model, args.target)
        if args.drafter == "auto":
            log.info("drafter auto → %s (a draft service)", " ".join(filter(None, chosen)))
    args.drafter, args.draft_model = chosen
    if args.drafter in ("model", *HEAD_DRAFTERS) and not args.draft_model:
        raise SystemExit(f"--drafter {args.drafter} needs --draft-model")
    from specd_app.supervise import Child, Supervisor

    token = share_stack_token(os.environ, args.auth_token, args.auth_token_file)  # children (and restarts) inherit it
    ports = {"gateway": args.gateway_port, "draft": args.draft_port, "verify": args.verify_port, "http": args.http_port}
    commands = service_commands(args.host, ports, args.target, args.drafter, args.draft_model, args.threads, args.num_draft_tokens, devices)
    gateway_address = f"{args.host}:{args.gateway_port}"
    stop = {"requested": False, "demo": False}

    def request_stop(*_: object) -> None:
        if not stop["requested"]:
            log.info("stopping: the gateway first (its requests get up to --grace to finish), then the model services")
        stop["requested"] = True
        if stop["demo"]:  # cancel the demo's call (the gateway frees its sessions) rather than wait for it
            stop["demo"] = False
            raise KeyboardInterrupt

    hang_up = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)  # under nohup it stays ignored
    for sig in (signal.SIGTERM, signal.SIGINT, *hang_up):  # before any child starts: none is left behind
        signal.signal(sig, request_stop)
    children: dict = {}
    try:
        if calibrate:
            commands = stack_choice.measure_and_choose(args, ports, devices, commands, children, stop, key, token)
        else:
            children.update(start_in_order(commands, args.host, ports, stop, spawn=spawn_in_own_session))
        if not wait_until_serving(gateway_address, children, stop):
            return 0 if stop["requested"] else 1
        draft = "no draft service" if args.drafter == HEADS_ONLY else f"draft {args.host}:{args.draft_port}"
        log.info("specd is up: gateway %s (%s, verify %s:%d)", gateway_address, draft, args.host, args.verify_port)
        if args.http_port:
            log.info("OpenAI-compatible API: http://%s:%d/v1 (curl examples in README.md)", args.host, args.http_port)
        if args.demo:
            log.info("demo prompt: %s", args.demo)
            demo = ["generate", "--gateway", gateway_address, "--prompt", args.demo, "--token", token]
            run_demo(build_parser().parse_args(demo), stop)
            if args.exit_after_demo:
                return 0
        if stop["requested"]:
            return 0
        log.info("serving until Ctrl-C; a service that exits is restarted")
        started = time.monotonic()
        supervisor = Supervisor({name: Child(name, commands[name], children[name], started) for name in children},
                                spawn=spawn_in_own_session)
        while not stop["requested"]:
            supervisor.step()
            children.update({name: child.process for name, child in supervisor.children.items()})
            time.sleep(0.2)
        return 0
    finally:
        stop_children(children, timeout_s=30)


def run_demo(args: argparse.Namespace, stop: dict) -> None:
    """`specd generate` once; a stop request meanwhile cancels it (run_up's handler raises
    KeyboardInterrupt into the call, whose channel then closes) and says so, without a traceback."""
    try:
        stop["demo"] = True
        run_generate(args)
        stop["demo"] = False  # inside the try: a stop arriving just before this line is caught below
    except KeyboardInterrupt:
        log.info("demo cancelled")


def add_device_flags(parser: argparse.ArgumentParser) -> None:
    for service in ("verify", "draft"):
        add_flag(parser, f"{service}-device", "auto", f"the {service} service's device: auto (with two or more CUDA devices visible "
                 "the verify on cuda:0 and the draft on cuda:1; with one, both on it; with none, cpu), cpu, cuda or cuda:N")


def run_bench(args: argparse.Namespace) -> int:
    import contextlib

    import grpc

    from specd.v1 import generate_pb2_grpc
    from specd_app import bench
    from specd_common.params import Warp

    if (args.cache_ab or args.medusa or args.cap) and args.gateway:
        raise SystemExit("--cache-ab, --medusa and --cap start more gateways next to the local stack they start; with --gateway "
                         "there is none to start: run that gateway (--speculated-outcomes 0, --draft-address '' or "
                         "--max-speculative-requests N) and bench it alone")
    if any(cap < 0 for cap in args.cap):
        raise SystemExit("--cap values are speculation caps: 0 (none) or more running requests")
    if not (0 <= args.temperature <= 2 and 0 < args.top_p <= 1):
        raise SystemExit(f"--temperature must be in [0, 2] and --top-p in (0, 1]; got {args.temperature} and {args.top_p}")
    sampling = bench.Sampling(Warp(temperature=args.temperature, top_p=args.top_p), args.seed)
    heads = parse_heads_flags(args.heads)
    if heads and args.gateway:
        raise SystemExit("--heads starts a verify and a gateway for each heads folder next to the local stack; with --gateway there is none")
    from specd_app.stack_choice import resolve_drafter

    args.drafter, args.draft_model = resolve_drafter(args.drafter, args.draft_model, args.target)
    heads_default = args.drafter == HEADS_ONLY and not args.gateway  # a given gateway is benched as it is
    if heads_default:  # specd runs on the no-draft gateway; the draft service serves the modes that need one
        args.drafter, args.draft_model = draft_service_default(args.target)
        args.medusa = True
    rows = [row for path in args.prompts for row in bench.load_prompts(path, args.limit)]
    devices = service_devices(args.verify_device, args.draft_device)  # transformers runs where the verify does
    cache_ab = ("nocache" if draft_has_own_device(devices) else "cache") if args.cache_ab else ""
    service_modes, mode_gateway = bench_service_modes(
        args.num_draft_tokens, args.fixed_k, args.branches, cache_ab, args.medusa,
        args.drafter if heads_default else "", args.cap, list(heads),
    )
    constraint = bench.schema_constraint(args.json_schema) if args.json_schema else {}
    service_modes = [(mode, {**fields, **sampling.request_fields(), **constraint}) for mode, fields in service_modes]
    hf_modes = [] if args.no_hf or args.arrival else [("hf_target", None), ("hf_assisted", args.num_draft_tokens)]
    if constraint and hf_modes:
        raise SystemExit("--json-schema constrains the service modes only; transformers' modes would answer free text: add --no-hf")
    if args.repeats < 1 or (args.repeats > 1 and args.concurrency == 1 and not args.arrival):
        raise SystemExit("--repeats must be >= 1, and applies with --concurrency > 1 or --arrival (one stream already interleaves every prompt)")
    if args.sequential_too and (args.concurrency < 2 or args.arrival):
        raise SystemExit("--sequential-too compares one at a time with --concurrency N > 1 (and is not an --arrival measurement)")
    if args.arrival and (args.arrival_streams < 1 or args.arrival_after < 1 or args.arrival_after >= args.max_new_tokens):
        raise SystemExit("--arrival needs --arrival-streams >= 1 and 1 <= --arrival-after < --max-new-tokens (the streams "
                         "must still be decoding when the long prompt arrives)")
    long_row = bench.longest_prompt(args.arrival_prompts) if args.arrival else None
    repeats = args.repeats if args.concurrency > 1 or args.arrival else 1
    levels = [1, args.concurrency] if args.sequential_too else [args.concurrency]  # streams at a time, each service mode
    per_mode = args.arrival_streams + 1 if args.arrival else len(rows) * len(levels)
    progress = bench.Progress(len(service_modes) * repeats * per_mode + len(rows) * len(hf_modes))
    children: dict = {}
    address, extra_gateways, runtime = args.gateway, {}, {}
    if not address:
        address, extra_gateways, children, addresses = start_local_stack(
            args.target, args.num_draft_tokens, args.drafter, args.draft_model, args.threads, cache_ab, args.medusa,
            caps=args.cap, caps_without_draft=heads_default, heads=heads, devices=devices, dtype=args.dtype,
        )
    mode_address = {mode: extra_gateways[name] for mode, name in mode_gateway.items()}
    results_at = {level: {} for level in levels}  # streams at a time → mode → (samples, wall seconds)
    by_repeat = {level: {} for level in levels}  # streams at a time → mode → tokens/s of each repeat (concurrency > 1)
    cpu_at = {level: {} for level in levels}  # streams at a time → mode → process → CPU seconds (concurrency > 1)
    results, arrivals = results_at[args.concurrency], {}
    try:
        _set_threads(args.threads)  # the in-process transformers modes get the services' thread budget (0: all cores)
        # transformers assists with a model draft; for n-gram and feature drafters, with prompt lookup
        hf = None if not hf_modes else bench.HFRunner(args.target, args.draft_model if args.drafter == "model" else "", rows[0]["prompt"],
                                                      sampling, device=devices["verify"], dtype=args.dtype)
        baselines = in_process_baselines(hf, hf_modes, args, rows[0]["prompt"], sampling)  # mode → prompt row → Sample
        progress.add(len(rows) * (len(baselines) - len(hf_modes)))
        if args.arrival:  # each mode in turn, in order then reversed (ABBA) over the repeats
            for repeat in range(repeats):
                for mode, fields in service_modes[:: -1 if repeat % 2 else 1]:
                    progress.stage(mode)
                    with grpc.insecure_channel(mode_address.get(mode) or address) as channel:
                        run = bench.run_arrival(generate_pb2_grpc.GenerateServiceStub(channel), rows, long_row, args.arrival_streams,
                                                args.max_new_tokens, args.arrival_after, progress, **fields)
                    arrivals.setdefault(mode, []).append(run)
        elif args.concurrency == 1:  # side by side: every prompt through every mode in turn
            with contextlib.ExitStack() as stack:
                modes = {}
                for mode, fields in service_modes:
                    target_address = mode_address.get(mode) or address
                    stub = generate_pb2_grpc.GenerateServiceStub(stack.enter_context(grpc.insecure_channel(target_address)))
                    bench.stream_one(stub, rows[0], 8, **fields)  # warm-up, not counted
                    modes[mode] = functools.partial(bench.stream_one, stub, max_new_tokens=args.max_new_tokens, **fields)
                modes.update(baselines)
                results = bench.run_interleaved(modes, rows, progress)
        else:  # every (mode, streams at a time) in order, then reversed (ABBA) over the repeats
            plan = [(mode, fields, level) for mode, fields in service_modes for level in levels]
            for repeat in range(args.repeats):
                for mode, fields, level in plan[:: -1 if repeat % 2 else 1]:
                    progress.stage(mode if len(levels) == 1 else f"{mode} x{level}")
                    target_address = mode_address.get(mode) or address
                    samples, wall = bench.run_service_mode(target_address, rows, args.max_new_tokens, level, progress, children,
                                                           cpu_at[level].setdefault(mode, {}), **fields)
                    earlier, earlier_wall = results_at[level].get(mode, ([], 0.0))
                    results_at[level][mode] = (earlier + samples, earlier_wall + wall)
                    by_repeat[level].setdefault(mode, []).append(sum(sample.tokens for sample in samples) / wall)
            if baselines:  # one stream: what one user of transformers or llama.cpp gets
                results.update(bench.run_interleaved(baselines, rows, progress))
        if children:  # after the runs: what start-up chose and what serving trials settled since
            runtime = bench.stack_runtime(addresses)
    finally:
        stop_children(children)
    progress.close()
    if args.arrival:
        report = {"arrival": {mode: bench.arrival_report(runs) for mode, runs in arrivals.items()}}
    else:
        report = bench.report(results, args.num_draft_tokens)
        bench.add_repeat_spread(report, by_repeat[args.concurrency])
        bench.add_cores(report, cpu_at[args.concurrency], results_at[args.concurrency])
    if args.sequential_too:
        sequential = bench.report(results_at[1], args.num_draft_tokens)
        bench.add_repeat_spread(sequential, by_repeat[1])
        bench.add_cores(sequential, cpu_at[1], results_at[1])
        report["sequential"] = sequential["modes"]
        report["scaling"] = bench.scaling(sequential, report, {mode: samples for mode, (samples, _) in results_at[1].items()},
                                          args.concurrency)
    report["machine"] = bench.machine_facts()
    report["command"] = " ".join(["specd", *args.argv])
    report["stack_runtime"] = runtime
    report["pass_pricing"] = autotune.pass_pricing(runtime.get("verify", {}))
    report["settings"] = {
        "prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency, "repeats": repeats, "specd_drafter": HEADS_ONLY if heads_default else args.drafter,
        "drafter": args.drafter, "draft_model": args.draft_model,
        "target": args.target, "threads": args.threads, "devices": devices, "dtype": args.dtype, "cache_ab": cache_ab, "medusa": args.medusa, "heads": heads,
        "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "sequential_too": args.sequential_too,
        "json_schema": args.json_schema,
    }
    if args.arrival:
        report["settings"].update(arrival_streams=args.arrival_streams, arrival_after=args.arrival_after,
                                  arrival_prompt=f"{args.arrival_prompts}#{long_row['id']}")
    if args.output:
        with open(args.output, "w") as out:
            json.dump(report, out, indent=2)
        if not (args.arrival or args.sequential_too):  # the plot is of speedup per kind and acceptance
            bench.plot(report, args.output.rsplit(".", 1)[0] + ".png")
    tables = [bench.arrival_table(report)] if args.arrival else [bench.markdown_table(report), bench.kinds_table(report)]
    if args.sequential_too:
        tables.append(bench.scaling_table(report))
    if report.get("pass_pricing"):
        tables.append(bench.pricing_line(report["pass_pricing"]))
    print(json.dumps(report, indent=2) if args.json else "\n\n".join(tables))
    return 0


def bench_service_modes(
    num_draft_tokens: int, fixed_k: Sequence[int], branches: Sequence[int], cache_ab: str, medusa: bool, heads_beside: str,
    caps: Sequence[int] = (), heads: Sequence[str] = (),
) -> tuple[list, dict]:
    """`specd bench`'s modes through the services, in order: [(mode, GenerateRequest fields)], and
    mode → the second gateway serving it ("cache"/"nocache", "medusa", "capN"; the others use the main one).
    cache_ab: "cache" or "nocache" to run each mode of the draft service's gateway again (<mode>_<cache_ab>)
    on a gateway with the speculation cache on or off; "" for none.
    heads_beside: the draft service's drafter when specd's own drafter is the verify's heads (then
    specd and its trees run on the "medusa" gateway and specd_<drafter> on the main one), else ''. caps: specd
    again on a gateway whose speculation cap is fixed at each N (specd_capN). heads: names of heads
    folders, each served by a verify and a gateway of its own with no draft service (specd_heads_NAME)."""
    fixed = {"draft_length_policy": 1}  # specd.v1.DRAFT_LENGTH_POLICY_FIXED
    default = {"num_draft_tokens": num_draft_tokens}
    modes = [("target_only", {"disable_speculation": True}), ("specd", default)]
    gateway = {"specd": "medusa"} if heads_beside else {}
    if heads_beside:  # the draft service's stack under the default policy, beside specd's heads
        modes.append((f"specd_{heads_beside}", default))
    modes += [(f"specd_k{k}", {"num_draft_tokens": k, **fixed}) for k in fixed_k]
    for b in branches:  # trees of specd's own drafter: the heads' candidates where they draft
        modes.append((f"specd_tree{b}", {**default, "draft_branches": b}))
        if heads_beside:
            gateway[f"specd_tree{b}"] = "medusa"
    if cache_ab:  # each mode of the draft service's gateway again, its speculation cache switched
        for mode, fields in [(m, f) for m, f in modes if m != "target_only" and m not in gateway]:
            modes.append((f"{mode}_{cache_ab}", fields))
            gateway[f"{mode}_{cache_ab}"] = cache_ab
    if medusa and not heads_beside:  # with heads_beside, specd is that mode
        modes.append(("specd_medusa", default))
        gateway["specd_medusa"] = "medusa"
    for cap in caps:
        modes.append((f"specd_cap{cap}", default))
        gateway[f"specd_cap{cap}"] = f"cap{cap}"
    for name in heads:
        modes.append((f"specd_heads_{name}", default))
        gateway[f"specd_heads_{name}"] = f"heads-{name}"
    return modes, gateway


HEADS_NAME = re.compile(r"[a-z0-9_]+")


def parse_heads_flags(values: Sequence[str]) -> dict:
    """`--heads NAME=DIR ...` → {name: folder}, refusing what could not be served: a name that is not
    lowercase letters, digits and _ (it becomes a mode name), a repeated name, a folder without
    Medusa heads."""
    from verify_service.medusa import CONFIG_FILE

    heads: dict = {}
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or not HEADS_NAME.fullmatch(name) or not folder:
            raise SystemExit(f"--heads takes NAME=DIR with NAME of lowercase letters, digits and _; got {value!r}")
        if name in heads:
            raise SystemExit(f"--heads names each folder once; {name!r} is given twice")
        if not (Path(folder) / CONFIG_FILE).is_file():
            raise SystemExit(f"--heads {value}: {folder} holds no Medusa heads ({CONFIG_FILE} is missing)")
        heads[name] = str(Path(folder).resolve())
    return heads


def in_process_baselines(hf, hf_modes: list, args: argparse.Namespace, warm_prompt: str, sampling) -> dict:
    """What a user runs instead, in this process on the same cores, as mode → (prompt row → Sample):
    transformers `generate` (hf_modes), and llama.cpp on the target's own GGUF (llamacpp_target, and
    llamacpp_lookup with its prompt-lookup drafting) where the target ships as a GGUF and the optional
    llama-cpp-python package is installed (`make setup-llama-cpp`); where not, a log line says why."""
    modes = {mode: functools.partial(hf.run, max_new_tokens=args.max_new_tokens, k=k) for mode, k in hf_modes}
    if not hf_modes:
        return modes
    from specd_app import bench
    from specd_common.errors import FailedPrecondition
    from specd_engine.models import embedded_gguf_path, eos_token_ids

    try:
        import llama_cpp  # noqa: F401  (optional: `make setup-llama-cpp`)
        gguf = str(embedded_gguf_path(args.target))
    except (ImportError, KeyError, FailedPrecondition) as why:
        log.info("no llama.cpp modes: %s", why if not isinstance(why, KeyError) else f"{args.target} ships no GGUF")
        return modes
    runner = bench.LlamaCppRunner(gguf, hf.tokenizer, eos_token_ids(hf.loaded), warm_prompt, args.threads, sampling)
    for mode, k in (("llamacpp_target", None), ("llamacpp_lookup", args.num_draft_tokens)):
        modes[mode] = functools.partial(runner.run, max_new_tokens=args.max_new_tokens, k=k)
    return modes


def weights_for(choice: str, model: str) -> str:
    """--weights auto → CausalLM's "auto" (int4 where it serves) for a model whose file stores its
    decoder in 4 bits or fewer, "float" for any other: 4-bit products would coarsen finer weights."""
    from specd_engine.models import stored_weight_bits

    if choice != "auto":
        return choice
    bits = stored_weight_bits(model)
    if bits is None or bits > 4:
        log.info("weights: auto → float (%s)", "a float model" if bits is None else f"its file stores {bits} bits a weight")
        return "float"
    return "auto"


def run_generate(args: argparse.Namespace) -> int:
    import grpc

    from specd.v1 import common_pb2, generate_pb2, generate_pb2_grpc
    from specd_common.security import open_channel

    request = generate_pb2.GenerateRequest(
        text=args.prompt,
        raw=args.raw,
        max_new_tokens=args.max_new_tokens,
        sampling=common_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p),
        stop=args.stop,
        disable_speculation=args.no_speculation,
        num_draft_tokens=args.num_draft_tokens,
    )
    if args.seed is not None:
        request.seed = args.seed
    metadata = bearer_metadata(args.token)
    with open_channel(args.gateway, client_tls_from_args(args, force=args.tls)) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        started = time.perf_counter()
        try:
            if args.stream and not args.json:
                for message in stub.GenerateStream(request, timeout=args.timeout, metadata=metadata):
                    sys.stdout.write(message.text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                return 0
            response = stub.Generate(request, timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as error:
            sys.stderr.write(f"specd generate: {error.code().name}: {error.details()}\n")
            return 2
        elapsed = time.perf_counter() - started
    result = response_to_json(response, elapsed)
    if args.json:
        print(json.dumps(result))
    else:
        stats = result["stats"]
        print(result["text"])
        print(
            f"\n[{result['finish_reason']}] {len(result['token_ids'])} tokens in {elapsed:.2f} s; "
            f"{stats['target_passes']} target passes, {stats['accepted_tokens']}/{stats['draft_tokens']} drafts "
            f"accepted, {stats['tokens_per_target_pass']:.2f} tokens per target pass",
            file=sys.stderr,
        )
    return 0


def response_to_json(response, elapsed_s: float) -> dict:
    """The --json output: text, ids, finish reason, usage and speculation stats."""
    from specd.v1 import generate_pb2

    passes = response.stats.target_passes
    return {
        "text": response.text,
        "token_ids": list(response.token_ids),
        "prompt_token_ids": list(response.prompt_token_ids),
        "finish_reason": generate_pb2.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower(),
        "usage": {"prompt_tokens": response.usage.prompt_tokens, "completion_tokens": response.usage.completion_tokens},
        "stats": {
            "target_passes": passes,
            "draft_tokens": response.stats.draft_tokens,
            "accepted_tokens": response.stats.accepted_tokens,
            "acceptance_rate": response.stats.accepted_tokens / max(1, response.stats.draft_tokens),
            "tokens_per_target_pass": len(response.token_ids) / max(1, passes),
        },
        "elapsed_s": round(elapsed_s, 4),
    }


if __name__ == "__main__":
    sys.exit(main())
