"""The three images, run as the Kustomize dev overlay wires them (`make images && make test-images`).

Marked `images`: it needs a Docker engine and the images `make images` builds, so `make test` leaves
it out (it would not fit CI's budget: the images take minutes to build) and `make test-images` runs it
on purpose. Without an engine or the images it fails saying what to run, never skips.

What it checks, against containers on a user-defined Docker network whose aliases are the Services'
names (so the gateway's `dns:///specd-verify:50053` resolves through Docker's DNS, as through a
headless Service):
- env, ports and image tags come from `kubectl kustomize deploy/k8s/overlays/dev`; overridden only
  where this machine differs from a cluster: the models (the embedded default target and its shipped
  feature head: no hub), SPECD_DEVICE=cpu, one thread each, no OTLP endpoint (no Jaeger here);
- every container's own HEALTHCHECK turns healthy, and the probes' endpoints answer: gRPC health
  (with the readiness probe's service name) in the model containers, GET /health on the gateway;
- greedy output through the gateway container (gRPC and the HTTP API) equals the host's `specd up`;
- killing the draft container mid-stream: the request goes on target-only, still exact.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
import uuid

import grpc
import pytest
import yaml

from specd.v1 import generate_pb2, generate_pb2_grpc
from specd_common.config import DEFAULT_TARGET
from tests.specd_stack import REPO, specd_up

pytestmark = pytest.mark.images

FEATURE_HEAD = "draft_service/heads/smollm2-135m-instruct"
OVERRIDES = {
    "verify": {"SPECD_MODEL": DEFAULT_TARGET},
    "draft": {"SPECD_DRAFTER": "feature", "SPECD_MODEL": f"/opt/specd/{FEATURE_HEAD.removeprefix('draft_service/')}",
              "SPECD_TARGET": DEFAULT_TARGET},
}
COMMON_OVERRIDES = {"SPECD_DEVICE": "cpu", "SPECD_THREADS": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": None}
PROMPT = "Why is the sky blue?"
MAX_NEW = 48


def docker(*args: str, timeout_s: float = 120, check: bool = True) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout.strip()


@pytest.fixture(scope="module")
def wiring() -> dict:
    """{role: {image, env, ports, readiness}} from the rendered dev overlay."""
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.fail("no Docker engine answers: run `make images` (it installs and starts one)", pytrace=False)
    rendered = subprocess.run(["kubectl", "kustomize", str(REPO / "deploy/k8s/overlays/dev")], capture_output=True, text=True, check=True).stdout
    documents = [d for d in yaml.safe_load_all(rendered) if d]
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in documents if d["kind"] == "ConfigMap"}
    roles = {}
    for deployment in (d for d in documents if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("specd-")):
        role = deployment["metadata"]["name"].removeprefix("specd-")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        roles[role] = {
            "image": container["image"],
            "env": container_env(container, config_maps, role),
            "ports": [port["containerPort"] for port in container["ports"]],
            "readiness": container["readinessProbe"],
        }
        if subprocess.run(["docker", "image", "inspect", container["image"]], capture_output=True).returncode != 0:
            pytest.fail(f"image {container['image']} is not built: run `make images`", pytrace=False)
    assert set(roles) == {"gateway", "draft", "verify"}
    return roles


def container_env(container: dict, config_maps: dict, role: str) -> dict:
    """The container's environment as Kubernetes would set it, with this machine's overrides."""
    env = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), ""), item["value"])
        elif "configMapKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = config_maps[ref["name"]][ref["key"]]
        elif "fieldRef" in item["valueFrom"]:
            env[item["name"]] = f"specd-{role}-0"  # metadata.name / namespace stand-ins
        # secretKeyRef (the optional hub token): not set, as with no Secret
    for key, value in {**COMMON_OVERRIDES, **OVERRIDES.get(role, {})}.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@pytest.fixture(scope="module")
def containers(wiring, tmp_path_factory):
    """The three containers on their own network; yields {role: container name} and the gateway's host ports."""
    suffix = uuid.uuid4().hex[:8]
    network = f"specd-test-{suffix}"
    docker("network", "create", network)
    names = {role: f"specd-{role}-{suffix}" for role in wiring}
    try:
        for role in ("verify", "draft", "gateway"):
            spec = wiring[role]
            env = [flag for key, value in spec["env"].items() for flag in ("-e", f"{key}={value}")]
            published = [flag for port in spec["ports"] for flag in ("-p", f"127.0.0.1::{port}")] if role == "gateway" else []
            docker("run", "-d", "--name", names[role], "--network", network, "--network-alias", f"specd-{role}",
                   "--cpus", "2", "--memory", "6g", *env, *published, spec["image"])
        yield names
    finally:
        logs = tmp_path_factory.mktemp("container-logs")
        for role, name in names.items():
            (logs / f"{role}.log").write_text(container_logs(name))
            docker("rm", "-f", name, check=False, timeout_s=60)
        docker("network", "rm", network, check=False)


def container_logs(container: str, tail: str = "all") -> str:
    """What the container's process wrote (specd logs to stderr)."""
    result = subprocess.run(["docker", "logs", "--tail", tail, container], capture_output=True, text=True, timeout=30)
    return result.stdout + result.stderr


def host_port(container: str, port: int) -> int:
    return int(docker("port", container, str(port)).splitlines()[0].rsplit(":", 1)[1])


def wait_healthy(container: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (status := docker("inspect", "-f", "{{.State.Health.Status}}", container)) != "healthy":
        assert docker("inspect", "-f", "{{.State.Running}}", container) == "true", f"{container} exited:\n" + container_logs(container, "40")
        assert time.monotonic() < deadline, f"{container} is {status} after {timeout_s:.0f} s:\n" + container_logs(container, "40")
        time.sleep(2)


def generate(address: str) -> generate_pb2.GenerateResponse:
    with grpc.insecure_channel(address) as channel:
        request = generate_pb2.GenerateRequest(text=PROMPT, max_new_tokens=MAX_NEW)  # text: chat-templated as one user turn
        return generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=300)


def test_images_run_as_the_manifests_wire_them(wiring, containers, tmp_path):
    for role in ("verify", "draft", "gateway"):
        wait_healthy(containers[role], timeout_s=600)

    # the readiness probes' endpoints, as the kubelet would ask them
    for role in ("verify", "draft"):
        service = wiring[role]["readiness"]["grpc"].get("service", "")
        docker("exec", containers[role], "python", "/opt/specd/healthcheck.py", service)
    http = host_port(containers["gateway"], 8000)
    assert wiring["gateway"]["readiness"]["httpGet"]["path"] == "/health"
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=10) as response:
        assert response.status == 200

    # greedy output through the containers equals the host stack's
    gateway = f"127.0.0.1:{host_port(containers['gateway'], 50051)}"
    answer = generate(gateway)
    in_images = list(answer.token_ids)
    with specd_up(DEFAULT_TARGET, tmp_path / "host.log", timeout_s=600, drafter=("--drafter", "feature", "--draft-model", str(REPO / FEATURE_HEAD))) as host:
        on_host = list(generate(host.address("gateway")).token_ids)
    assert in_images == on_host and len(in_images) > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=10) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_NEW, "temperature": 0})
    request = urllib.request.Request(f"http://127.0.0.1:{http}/v1/chat/completions", body.encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.loads(response.read())
    assert reply["choices"][0]["message"]["content"] == answer.text
    assert reply["usage"]["completion_tokens"] == len(in_images)

    # the draft container killed mid-stream: the stream goes on target-only, exactly
    with grpc.insecure_channel(gateway) as channel:
        stream = generate_pb2_grpc.GenerateServiceStub(channel).GenerateStream(
            generate_pb2.GenerateRequest(text=PROMPT, max_new_tokens=MAX_NEW), timeout=300)
        tokens = list(next(stream).token_ids)
        docker("kill", containers["draft"])
        tokens += [t for message in stream for t in message.token_ids]
    assert tokens == in_images


def test_the_gateway_image_has_no_torch(wiring):
    image = wiring["gateway"]["image"]
    found = docker("run", "--rm", "--entrypoint", "python", image, "-c",
                   "import importlib.util as u; print([m for m in ('torch', 'transformers') if u.find_spec(m)])")
    assert found == "[]"
