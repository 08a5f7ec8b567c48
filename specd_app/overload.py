"""The overload benchmark (`make overload`): more clients than the machine can serve, for a while.

It starts the default stack as `specd up` does (or uses one given with --gateway/--http), then runs
`--grpc-clients` gRPC streaming and `--http-clients` HTTP clients for `--duration` seconds. Each client
sends one request after another: a long prompt (docs/benchmarks/long_prompts.jsonl, 750-2,000 tokens)
with probability `--long-share`, else a short one (heldout_prompts.jsonl), `--min-new`..`--max-new`
new tokens, a `--deadline` per request; a refused request waits its Retry-After before the next.

What a user of a server under overload needs, and what it reports:
  * every request either answered within its deadline or refused at once (within 1 s): `good_share`;
  * short prompts' time to first token (p50/p95): they must not wait behind long prefills;
  * afterwards, no session left on the model services (seconds until they hold none) and the verify's
    memory back near where it started (RSS before and after, when this run started the stack).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import grpc

from specd.v1 import generate_pb2, generate_pb2_grpc
from specd_app.bench import machine_facts, percentile

log = logging.getLogger("specd.overload")
REPO = Path(__file__).resolve().parent.parent
FAST_REFUSAL_S = 1.0  # a refusal later than this counts as a failure: the client waited for nothing


@dataclass
class Outcome:
    """One request as its client saw it."""

    client: str  # "grpc" or "http"
    long: bool
    prompt_chars: int
    max_new_tokens: int
    status: str  # ok, refused, deadline, error:<code>
    seconds: float
    first_token_s: Optional[float] = None  # streaming clients only
    tokens: int = 0


@dataclass
class Workload:
    long_prompts: list[str]
    short_prompts: list[str]
    long_share: float
    min_new: int
    max_new: int
    deadline_s: float

    def draw(self, rng: random.Random) -> tuple[bool, str, int]:
        long = rng.random() < self.long_share
        prompt = rng.choice(self.long_prompts if long else self.short_prompts)
        return long, prompt, rng.randint(self.min_new, self.max_new)


def read_prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def grpc_request(stub, prompt: str, max_new: int, deadline_s: float, long: bool) -> tuple[Outcome, float]:
    started = time.monotonic()
    first, tokens = None, 0
    try:
        for message in stub.GenerateStream(generate_pb2.GenerateRequest(text=prompt, max_new_tokens=max_new), timeout=deadline_s):
            if message.token_ids and first is None:
                first = time.monotonic() - started
            tokens += len(message.token_ids)
        status = "ok"
    except grpc.RpcError as error:
        code = error.code()
        status = ("refused" if code == grpc.StatusCode.RESOURCE_EXHAUSTED else
                  "deadline" if code == grpc.StatusCode.DEADLINE_EXCEEDED else f"error:{code.name}")
        if status == "refused":
            retry = dict(error.trailing_metadata() or ()).get("retry-after")
            return Outcome("grpc", long, len(prompt), max_new, status, time.monotonic() - started, first, tokens), float(retry or 1)
    return Outcome("grpc", long, len(prompt), max_new, status, time.monotonic() - started, first, tokens), 0.0


def http_request(base: str, model: str, prompt: str, max_new: int, deadline_s: float, long: bool) -> tuple[Outcome, float]:
    started = time.monotonic()
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_new}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"content-type": "application/json"})
    retry = 0.0
    try:
        with urllib.request.urlopen(request, timeout=deadline_s) as response:
            answer = json.loads(response.read())
        status, tokens = "ok", answer["usage"]["completion_tokens"]
    except urllib.error.HTTPError as error:
        status, tokens = ("refused" if error.code == 429 else f"error:{error.code}"), 0
        retry = float(error.headers.get("retry-after") or 1) if error.code == 429 else 0.0
    except (TimeoutError, urllib.error.URLError) as error:
        status, tokens = ("deadline" if "timed out" in str(error) else f"error:{type(error).__name__}"), 0
    return Outcome("http", long, len(prompt), max_new, status, time.monotonic() - started, None, tokens), retry


def run_clients(gateway: str, http_base: str, workload: Workload, grpc_clients: int, http_clients: int,
                duration_s: float, seed: int = 7) -> list[Outcome]:
    """Every client sends requests back to back until duration_s has passed (the last may run past it)."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + duration_s
    model = ""
    if http_clients:
        with urllib.request.urlopen(f"{http_base}/v1/models", timeout=30) as response:
            model = json.loads(response.read())["data"][0]["id"]

    def client(index: int, kind: str) -> None:
        rng = random.Random(seed * 1000 + index)
        stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(gateway)) if kind == "grpc" else None
        time.sleep(rng.random() * 2)  # arrivals spread over two seconds, not one instant
        while time.monotonic() < stop_at:
            long, prompt, max_new = workload.draw(rng)
            if kind == "grpc":
                outcome, retry = grpc_request(stub, prompt, max_new, workload.deadline_s, long)
            else:
                outcome, retry = http_request(http_base, model, prompt, max_new, workload.deadline_s, long)
            with lock:
                outcomes.append(outcome)
            if retry:
                time.sleep(min(retry, max(0.0, stop_at - time.monotonic())))

    threads = [threading.Thread(target=client, args=(i, "grpc" if i < grpc_clients else "http"), daemon=True)
               for i in range(grpc_clients + http_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(duration_s + workload.deadline_s + 60)
    return outcomes


def _percentile(values: Sequence[float], q: float) -> Optional[float]:
    return percentile(values, q) if values else None  # bench's nearest rank; None for no values


def summarize(outcomes: Sequence[Outcome], deadline_s: float) -> dict:
    """The counts and shares a user judges overload by (module docstring)."""
    ok = [o for o in outcomes if o.status == "ok" and o.seconds <= deadline_s]
    fast_refusals = [o for o in outcomes if o.status == "refused" and o.seconds <= FAST_REFUSAL_S]
    short_ttft = [o.first_token_s for o in outcomes if not o.long and o.first_token_s is not None]
    statuses: dict[str, int] = {}
    for outcome in outcomes:
        statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
    return {
        "requests": len(outcomes),
        "statuses": statuses,
        "completed_in_deadline": len(ok),
        "refused_within_1s": len(fast_refusals),
        "good_share": round((len(ok) + len(fast_refusals)) / max(len(outcomes), 1), 3),
        "completed_tokens": sum(o.tokens for o in ok),
        "short_first_token_s": {"p50": _round(_percentile(short_ttft, 0.5)), "p95": _round(_percentile(short_ttft, 0.95)),
                                "count": len(short_ttft)},
        "completed_seconds_p95": {"short": _round(_percentile([o.seconds for o in ok if not o.long], 0.95)),
                                  "long": _round(_percentile([o.seconds for o in ok if o.long], 0.95))},
        "refusal_seconds_p95": _round(_percentile([o.seconds for o in outcomes if o.status == "refused"], 0.95)),
    }


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 3)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def open_sessions(metrics_port: int, service: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("specd_active_sessions{") and f'service="{service}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_drained(metrics_ports: dict, timeout_s: float = 60.0) -> Optional[float]:
    """Seconds until every model service reports no open session (None if not within timeout_s)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if all(open_sessions(port, service) == 0 for service, port in metrics_ports.items()):
            return round(time.monotonic() - started, 2)
        time.sleep(0.2)
    return None


def start_stack(target: str, threads: int) -> tuple[dict, dict, dict]:
    """The default `specd up` stack on free ports: (name → Popen, name → port, service → metrics port)."""
    import socket

    from specd_app.stack import service_commands, start_in_order, wait_until_serving
    from specd_app.stack_choice import resolve_drafter

    drafter, draft_model = resolve_drafter("auto", "", target)
    names = ("gateway", "draft", "verify", "http", "m-verify", "m-draft", "m-gateway")
    sockets = [socket.socket() for _ in names]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = {name: sock.getsockname()[1] for name, sock in zip(names, sockets)}
    for sock in sockets:
        sock.close()
    commands = service_commands("127.0.0.1", ports, target, drafter, draft_model, threads, 3)
    for name in commands:
        commands[name] = [*commands[name], "--metrics-port", str(ports[f"m-{name}"])]
    children = start_in_order(commands, "127.0.0.1", ports)
    if not wait_until_serving(f"127.0.0.1:{ports['gateway']}", children, {"requested": False}):
        for child in children.values():
            child.kill()
        raise SystemExit("the stack did not start")
    metrics = {name: ports[f"m-{name}"] for name in commands if name != "gateway"}
    return children, ports, metrics


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per service (0 = measured)")
    parser.add_argument("--grpc-clients", type=int, default=20)
    parser.add_argument("--http-clients", type=int, default=10)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds clients keep sending")
    parser.add_argument("--deadline", type=float, default=60.0, help="each request's deadline, seconds")
    parser.add_argument("--long-share", type=float, default=0.4)
    parser.add_argument("--min-new", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--long-prompts", type=Path, default=REPO / "docs/benchmarks/long_prompts.jsonl")
    parser.add_argument("--short-prompts", type=Path, default=REPO / "docs/benchmarks/heldout_prompts.jsonl")
    parser.add_argument("--output", type=Path, help="write the report (JSON) here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    workload = Workload(read_prompts(args.long_prompts), read_prompts(args.short_prompts), args.long_share,
                        args.min_new, args.max_new, args.deadline)
    children, ports, metrics = start_stack(args.target, args.threads)
    try:
        verify_pid = children["verify"].pid
        gateway, http_base = f"127.0.0.1:{ports['gateway']}", f"http://127.0.0.1:{ports['http']}"
        run_clients(gateway, http_base, Workload(workload.long_prompts[:1], workload.short_prompts[:1], 0.5, 4, 4, 120),
                    1, 0, duration_s=1)  # warm-up: one long and one short request's code paths, before measuring
        wait_drained(metrics)
        rss_before = rss_mb(verify_pid)
        started = time.monotonic()
        outcomes = run_clients(gateway, http_base, workload, args.grpc_clients, args.http_clients, args.duration)
        elapsed = time.monotonic() - started
        drained_s = wait_drained(metrics)
        time.sleep(3)  # the reaper's last heap trim after the final releases
        rss_after = rss_mb(verify_pid)
    finally:
        from specd_app.stack import stop_children

        stop_children(children, timeout_s=30)
    report = {
        "command": "python -m specd_app.overload " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": machine_facts(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "output"},
        "elapsed_s": round(elapsed, 1),
        **summarize(outcomes, args.deadline),
        "sessions_drained_after_s": drained_s,
        "verify_rss_mb": {"before": round(rss_before), "after": round(rss_after), "ratio": round(rss_after / rss_before, 3)},
        "outcomes": [asdict(o) for o in outcomes],
    }
    text = json.dumps(report, indent=1)
    if args.output:
        args.output.write_text(text + "\n")
    summary = {k: v for k, v in report.items() if k != "outcomes"}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
