"""Batched vs one-session-at-a-time serving, with the real default target.

  forward:  B sessions, each verifying `k` drafts (k + 1 positions) per round, on real prompts:
            B solo `CausalLM.forward` calls vs one `CausalLM.forward_batch`, same sessions, same rounds.
  services: verify + draft + gateway as separate processes (`specd serve`), C concurrent greedy
            Generate streams, verify/draft started with --max-batch-size 1 vs N.

Reports medians over repeats (the machine may be shared; see the spread). Usage:
  python scripts/bench_batching.py forward  [--sessions 1 4 8] [--rounds 8] [--repeats 3]
  python scripts/bench_batching.py services [--concurrency 8] [--max-new-tokens 48] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "protos")]

from specd_common.models import DEFAULT_TARGET  # noqa: E402

log = logging.getLogger("bench_batching")
PROMPT_FILES = ["gsm8k_train.jsonl", "humaneval.jsonl", "seed_tasks.jsonl"]


def load_prompts(count: int) -> list[str]:
    """`count` prompts, cycling over the three task kinds in ../shared/data."""
    data = Path(os.environ.get("SPECD_DATA_DIR", REPO.parent / "shared" / "data"))
    per_file = [[json.loads(line)["prompt"] for line in (data / name).open()][:count] for name in PROMPT_FILES]
    return [per_file[i % len(per_file)][i // len(per_file)] for i in range(count)]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def forward_rounds(lm, sessions, k: int, rounds: int, batched: bool) -> float:
    """Seconds per round: every session rolls back its last drafts, appends a correction, verifies k new drafts."""
    times = []
    for round_index in range(rounds):
        drafts = [[(7 * round_index + j + 11 * s) % 1000 + 100 for j in range(k)] for s in range(len(sessions))]
        for session in sessions:
            spoken = len(session.tokens) - k if round_index else len(session.tokens)
            session.apply_commit(spoken, [(spoken * 31) % 1000 + 100])
        started = time.perf_counter()
        if batched:
            lm.forward_batch(list(zip(sessions, drafts)))
        else:
            for session, draft in zip(sessions, drafts):
                lm.forward(session, draft)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_forward(args: argparse.Namespace) -> dict:
    import torch

    from specd_common.lm import CausalLM
    from specd_common.models import load_causal_lm

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_causal_lm(args.target, device=args.device, dtype="auto")
    lm = CausalLM(loaded)
    prompts = [chat_ids(loaded.tokenizer, text) for text in load_prompts(max(args.sessions))]
    results = {}
    for count in args.sessions:
        row = {}
        for mode in ("sequential", "batched"):
            per_round = []
            for _ in range(args.repeats):
                sessions = [lm.new_session(prompt) for prompt in prompts[:count]]
                forward_rounds(lm, sessions, args.k, 2, mode == "batched")  # warm up
                per_round.append(forward_rounds(lm, sessions, args.k, args.rounds, mode == "batched"))
            row[mode] = {
                "round_ms_median": 1000 * statistics.median(per_round),
                "round_ms_all": [round(1000 * t, 1) for t in per_round],
                "session_rounds_per_s": count / statistics.median(per_round),
            }
        row["speedup"] = row["sequential"]["round_ms_median"] / row["batched"]["round_ms_median"]
        results[count] = row
        log.info("forward B=%d: %s", count, json.dumps(row))
    lengths = sorted(len(p) for p in prompts)
    return {"prompt_tokens": lengths, "k": args.k, "threads": torch.get_num_threads(), "by_sessions": results}


def free_ports(count: int) -> list[int]:
    ports = []
    for _ in range(count):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    return ports


def run_stack(max_batch: int, args: argparse.Namespace) -> dict:
    """Start the three services with `max_batch`, run C concurrent greedy streams, stop; tokens/s and stats."""
    import grpc

    from specd.v1 import common_pb2, generate_pb2, generate_pb2_grpc
    from specd_app.cli import spawn_services, wait_until_serving

    os.environ["SPECD_MAX_BATCH_SIZE"] = str(max_batch)
    os.environ["SPECD_BATCH_WAIT_MS"] = str(args.batch_wait_ms)
    ports = dict(zip(("gateway", "draft", "verify"), free_ports(3)))
    children = spawn_services("127.0.0.1", ports, args.target, args.drafter, args.draft_model, 0, args.k)
    address = f"127.0.0.1:{ports['gateway']}"
    try:
        if not wait_until_serving(address, children, {"requested": False}):
            raise SystemExit("the stack did not start")
        prompts = load_prompts(args.concurrency)
        with grpc.insecure_channel(address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)

            def generate(text: str):
                request = generate_pb2.GenerateRequest(
                    text=text,
                    max_new_tokens=args.max_new_tokens,
                    sampling=common_pb2.SamplingParams(temperature=0.0),
                    disable_speculation=args.no_speculation,
                    num_draft_tokens=args.k,
                )
                return stub.Generate(request, timeout=900)

            generate(prompts[0])  # warm up
            walls = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                with ThreadPoolExecutor(args.concurrency) as pool:
                    responses = list(pool.map(generate, prompts))
                wall = time.perf_counter() - started
                tokens = sum(len(r.token_ids) for r in responses)
                walls.append({"wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2)})
                log.info("services max_batch=%d: %s", max_batch, walls[-1])
        return {
            "tokens_per_s_median": statistics.median(w["tokens_per_s"] for w in walls),
            "runs": walls,
            "token_ids": [list(r.token_ids) for r in responses],
        }
    finally:
        for child in children.values():
            child.send_signal(signal.SIGTERM)
        for child in children.values():
            child.wait(timeout=60)


def bench_services(args: argparse.Namespace) -> dict:
    one = run_stack(1, args)
    batched = run_stack(args.max_batch_size, args)
    same = one.pop("token_ids") == batched.pop("token_ids")
    return {
        "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens,
        "drafter": args.drafter,
        "speculation": not args.no_speculation,
        "one_at_a_time": one,
        f"batched_{args.max_batch_size}": batched,
        "speedup": batched["tokens_per_s_median"] / one["tokens_per_s_median"],
        "greedy_outputs_identical": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["forward", "services"])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--k", type=int, default=3, help="drafts verified per round")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--batch-wait-ms", type=float, default=20.0)
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--no-speculation", action="store_true")
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = bench_forward(args) if args.what == "forward" else bench_services(args)
    text = json.dumps(result, indent=2)
    if args.output:
        Path(args.output).write_text(text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
