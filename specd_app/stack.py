"""The one-machine stack `specd up` and `specd bench` run: which device each model service gets, the
`specd serve ...` command lines, and starting the services in order, waiting for them and stopping them
(gateways first). Everything here is about processes and ports; what the stack is for is in cli.py.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, MutableMapping, Optional, Sequence

from gateway.options import GatewayOptions
from specd_engine import autotune
from specd_common.config import HEADS_ONLY
from specd_common.security import load_token

log = logging.getLogger("specd")


def spawn_in_own_session(command: list[str]) -> subprocess.Popen:
    """A `specd up` child in a session of its own: a terminal's Ctrl-C (or hang-up) reaches only
    `specd up`, which stops the children in order (stop_children), not all of them at once."""
    return subprocess.Popen(command, start_new_session=True)


def share_stack_token(environ: MutableMapping[str, str], token: str, token_file: str) -> str:
    """Set `specd up`'s bearer token for the whole stack: checked here (an empty or unreadable file
    stops `up` before anything starts), then left in `environ` as SPECD_AUTH_TOKEN_FILE (an absolute
    path) or SPECD_AUTH_TOKEN, the variables every `specd serve` reads, so the children and their
    restarts inherit it and no command line shows it in `ps`. Returns the token ('' = none) for the demo."""
    loaded = load_token(token, token_file)
    for name in ("SPECD_AUTH_TOKEN", "SPECD_AUTH_TOKEN_FILE"):
        environ.pop(name, None)
    if token_file:
        environ["SPECD_AUTH_TOKEN_FILE"] = str(Path(token_file).resolve())
    elif loaded:
        environ["SPECD_AUTH_TOKEN"] = loaded
    return loaded


def spawn_services(
    host: str, ports: dict, target: str, drafter: str, draft_model: str, threads: int, num_draft_tokens: int,
    devices: Optional[dict] = None, dtype: str = "auto",
) -> dict:
    """verify, draft and gateway as child processes (`specd serve ...`), started in order; name → Popen."""
    commands = service_commands(host, ports, target, drafter, draft_model, threads, num_draft_tokens, devices, dtype)
    return start_in_order(commands, host, ports)


def service_devices(verify: str = "auto", draft: str = "auto", count: Optional[int] = None) -> dict:
    """Each model service's device: the named one, or for 'auto' spread over the `count` CUDA devices
    visible (default: counted now). Why spread: the draft and the verify on one GPU take turns on it,
    and the draft's work while the target verifies (its speculation cache) needs a device of its own."""
    if count is None:
        from specd_engine.models import visible_cuda_devices

        count = visible_cuda_devices()
    spread = {"verify": "cuda:0", "draft": "cuda:1" if count > 1 else "cuda:0"} if count else {"verify": "cpu", "draft": "cpu"}
    return {"verify": spread["verify"] if verify == "auto" else verify, "draft": spread["draft"] if draft == "auto" else draft}


def service_commands(
    host: str, ports: dict, target: str, drafter: str, draft_model: str, threads: int, num_draft_tokens: int,
    devices: Optional[dict] = None, dtype: str = "auto",
) -> dict:
    """The `specd serve ...` command line of each service of a one-machine stack, in start order.
    devices: service → --device (service_devices; none given: each service's own 'auto'); dtype: both
    model services' --dtype."""
    serve = [sys.executable, "-m", "specd_app.cli", "serve"]
    common = ["--host", host, "--threads", str(threads)] + ([] if dtype == "auto" else ["--dtype", dtype])
    device = {name: ["--device", where] for name, where in (devices or {}).items()}
    caps = stack_thread_caps(autotune.available_cores())  # the cores this process may use (affinity, cgroup quota)
    commands = {
        "verify": serve + ["verify", *common, *device.get("verify", []), "--max-threads", str(caps["verify"]),
                           "--port", str(ports["verify"]), "--model", target],
    }
    if drafter == HEADS_ONLY:  # no draft service: the verify's Medusa heads and the gateway's lookup copies draft
        commands["gateway"] = gateway_command(host, ports, num_draft_tokens, "--draft-address", "")
        return commands
    commands["draft"] = serve + ["draft", *common, *device.get("draft", []), "--max-threads", str(caps["draft"]), "--port", str(ports["draft"]),
                                 "--drafter", drafter, "--model", draft_model, "--target", target]
    commands["gateway"] = gateway_command(host, ports, num_draft_tokens, *split_gateway_flags(devices))
    return commands


def split_gateway_flags(devices: Optional[dict]) -> tuple[str, ...]:
    """The gateway flags of a one-machine split stack: the draft's speculation cache only where the draft
    has a device of its own. On shared cores its work during a Verify slows that Verify more than it
    saves: on a 2-core EPYC VM the verify's 4-position pass takes 40 ms on 2 threads and 59 ms on 1,
    and with the cache drafting beside it a fixed k = 3 round took 111 ms against 70 without
    (docs/benchmarks/split/greedy_2.json; sampled, 143 ms against 79: sampled_a.json)."""
    return () if draft_has_own_device(devices) else ("--speculated-outcomes", "0")


def draft_has_own_device(devices: Optional[dict]) -> bool:
    """Draft and verify on different devices: two GPUs, or one GPU and the CPU (not the CPU twice: the same cores)."""
    devices = devices or {}
    draft, verify = str(devices.get("draft", "cpu")), str(devices.get("verify", "cpu"))
    return draft != verify and "cuda" in (draft[:4], verify[:4])


def start_in_order(commands: dict, host: str, ports: dict, stop: Optional[dict] = None,
                   spawn: Callable[[list[str]], subprocess.Popen] = subprocess.Popen) -> dict:
    """Start the services one after another: each model service measures its own forward passes at
    start-up to choose its runtime (specd_engine/autotune.py), and two services measuring at once on
    shared cores would each time the other's load. The draft starts once the verify serves, the
    gateway once the draft does. Returns name → Popen (fewer if one died while starting, or a stop
    was requested: stop["requested"])."""
    stop = {"requested": False} if stop is None else stop
    children: dict = {}
    for name, command in commands.items():
        children[name] = spawn(command)
        if name != "gateway" and not wait_until_serving(f"{host}:{ports[name]}", children, stop):
            break  # the caller's wait for the gateway reports which child died
    return children


def stack_thread_caps(cores: int) -> dict:
    """How `specd up` shares one machine's cores: the verify may measure its way up to all cores, per
    forward size; the draft up to one. The draft runs between verify passes and its step is small.

    History: the verify was capped at all cores but one while it used one thread count for every
    size (a second thread made a decoding step slower on a 2-core AMD EPYC VM and the gateway's
    threads preempted its workers: 8.8 tok/s target-only with 2 threads, 12.8 with 1). Since the
    count is chosen per forward size (a decoding step keeps 1 thread there, a 4-position verify pass
    takes 2: 80 vs 87–110 ms), the uncapped stack was faster in every mode on that VM, side by side
    with transformers (2026-11-23, `specd bench ... --fixed-k 3`: target-only 0.95x vs 0.86x of
    transformers, adaptive specd 0.99x vs 0.91x; HISTORY.md). Both services still measure within their
    cap (specd_engine/autotune.py)."""
    return {"verify": cores, "draft": 1}


def gateway_command(host: str, ports: dict, num_draft_tokens: int, *extra: str) -> list[str]:
    """`specd serve gateway` on ports["gateway"], pointed at the draft and verify on the same host;
    its HTTP API on ports["http"] when given, else off."""
    return [
        sys.executable, "-m", "specd_app.cli", "serve", "gateway", "--host", host,
        "--port", str(ports["gateway"]), "--http-port", str(ports.get("http", 0)),
        "--verify-address", f"{host}:{ports['verify']}",
        "--draft-address", f"{host}:{ports['draft']}",
        "--num-draft-tokens", str(num_draft_tokens),
        *extra,
    ]


def wait_until_serving(address: str, children: dict, stop: dict, timeout_s: float = 900.0) -> bool:
    """Poll a service's health until SERVING; False if a child dies, a stop is requested or time runs out."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and not stop["requested"]:
            dead = [name for name, child in children.items() if child.poll() is not None]
            if dead:
                log.error("%s exited (code %s) before %s was ready", ", ".join(dead),
                          ", ".join(str(children[name].returncode) for name in dead), address)
                return False
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    return False


def stop_children(children: dict, timeout_s: float = 60.0) -> None:
    """Stop the gateways first, then the model services: a gateway's requests get its grace to finish,
    and it releases their sessions on draft and verify as they end, so those must still serve
    meanwhile (then, holding no session, they stop at once). SIGTERM each group and wait for it;
    a child still running timeout_s after the first SIGTERM is killed (logged), so a stuck service
    never costs a benchmark its report."""
    deadline = time.monotonic() + timeout_s
    gateways = {name: child for name, child in children.items() if name.startswith("gateway")}
    models = {name: child for name, child in children.items() if name not in gateways}
    for group in (gateways, models):
        running = {name: child for name, child in group.items() if child.poll() is None}
        if running:
            log.info("stopping %s", ", ".join(running))
        for child in running.values():
            child.send_signal(signal.SIGTERM)
        for name, child in running.items():
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s of SIGTERM; killed", name, timeout_s)
                child.kill()
                child.wait()


def start_local_stack(
    target: str, num_draft_tokens: int, drafter: str, draft_model: str, threads: int, cache_ab: str = "", medusa: bool = False,
    caps: Sequence[int] = (), caps_without_draft: bool = False, heads: Optional[dict] = None, devices: Optional[dict] = None,
    dtype: str = "auto",
) -> tuple[str, dict, dict, dict]:
    """The three services as child processes on free ports, plus more gateways sharing the draft and
    verify when asked: cache_ab ("cache" or "nocache": --speculated-outcomes on or 0), "medusa" (no draft service: the verify's Medusa heads
    and lookup copies draft) and "capN" for each of `caps` (speculation cap fixed at N; with no draft
    service when caps_without_draft, as the gateway specd runs on then); and for each name → folder of
    `heads`, a verify serving those heads with a gateway "heads-NAME" (no draft service) in front.
    Returns the gateway address, name → extra gateway address, the children and service name → address."""
    outcomes = {"cache": str(GatewayOptions().speculated_outcomes), "nocache": "0"}
    flags = {cache_ab: ("--speculated-outcomes", outcomes[cache_ab])} if cache_ab else {}
    if medusa:
        flags["medusa"] = ("--draft-address", "")
    for cap in caps:
        flags[f"cap{cap}"] = ("--max-speculative-requests", str(cap)) + (("--draft-address", "") if caps_without_draft else ())
    heads = heads or {}
    ports = free_ports("127.0.0.1", 3 + len(flags) + 2 * len(heads))
    named = dict(zip(("gateway", "draft", "verify"), ports))
    children = spawn_services("127.0.0.1", named, target, drafter, draft_model, threads, num_draft_tokens, devices, dtype)
    address, extra = f"127.0.0.1:{ports[0]}", {}
    for (name, gateway_flags), port in zip(flags.items(), ports[3:]):
        extra[name] = f"127.0.0.1:{port}"
        children[f"gateway-{name}"] = subprocess.Popen(
            gateway_command("127.0.0.1", {**named, "gateway": port}, num_draft_tokens, *gateway_flags, "--metrics-port", "-1")
        )
    spare = iter(ports[3 + len(flags) :])  # two ports for each heads folder
    for name, folder in heads.items():
        verify_port, gateway_port = next(spare), next(spare)
        own = {**named, "verify": verify_port, "gateway": gateway_port}
        verify = service_commands("127.0.0.1", own, target, drafter, draft_model, threads, num_draft_tokens, devices, dtype)["verify"]
        children[f"verify-heads-{name}"] = subprocess.Popen([*verify, "--medusa-heads", folder, "--metrics-port", "-1"])  # one at a time: each measures its passes at start-up; /metrics port is the main verify's
        if not wait_until_serving(f"127.0.0.1:{verify_port}", children, {"requested": False}):
            abandon_stack(children)
        extra[f"heads-{name}"] = f"127.0.0.1:{gateway_port}"
        children[f"gateway-heads-{name}"] = subprocess.Popen(
            gateway_command("127.0.0.1", own, num_draft_tokens, "--draft-address", "", "--metrics-port", "-1"))
    for gateway in (address, *extra.values()):
        if not wait_until_serving(gateway, children, {"requested": False}):
            abandon_stack(children)
    return address, extra, children, {name: f"127.0.0.1:{port}" for name, port in named.items()}


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports free on `host` a moment ago (all bound at once, so none repeats)."""
    import contextlib
    import socket

    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def abandon_stack(children: dict) -> None:
    """A local stack that did not start: kill what runs of it (leave nothing behind) and exit."""
    for child in children.values():
        child.kill()
    raise SystemExit("the local stack did not start; see the log above")
