"""`make deploy-check` passes on the repository and fails on broken manifests and Dockerfiles.

The check renders every overlay with `kubectl kustomize`, validates it strictly and offline
(kubernetes-validate), runs the policy checks (deploy/lint_manifests.py) and the Dockerfile intent
lint (deploy/lint_dockerfiles.py). Here each layer is shown to catch what it is for.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.specd_stack import REPO, repo_env, require_tool

CHECK = REPO / "deploy" / "check.sh"


@pytest.fixture(autouse=True)
def _kubectl():
    require_tool("kubectl", "install kubectl (it renders the Kustomize overlays: kubectl kustomize)")


def run_check(k8s_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = {**repo_env(), "PYTHON": sys.executable}
    args = [str(CHECK)] + ([str(k8s_dir)] if k8s_dir else [])
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def broken_copy(tmp_path: Path, relative: str, old: str, new: str) -> Path:
    """A copy of deploy/k8s with one text replacement in one file."""
    k8s = tmp_path / "k8s"
    shutil.copytree(REPO / "deploy" / "k8s", k8s)
    target = k8s / relative
    text = target.read_text()
    assert old in text, f"{old!r} not in {relative}: the test needs updating"
    target.write_text(text.replace(old, new, 1))
    return k8s


def test_make_deploy_check_passes():
    make = require_tool("make", "install make")
    result = subprocess.run(
        [make, "-s", "deploy-check", f"PY={sys.executable}"], cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "deploy-check: OK" in result.stdout
    for overlay in ("cpu", "dev", "prod", "prod-tls"):
        assert f"overlay {overlay}:" in result.stdout


@pytest.mark.parametrize(
    "relative, old, new, expected",
    [
        # an unknown field: only strict validation rejects it
        ("base/gateway.yaml", "          imagePullPolicy: IfNotPresent", "          imagePullPolicy: IfNotPresent\n          imagePullPolicyy: Always", "imagePullPolicyy"),
        # a wrong type
        ("base/verify.yaml", "            failureThreshold: 90", '            failureThreshold: "ninety"', "ninety"),
        # a kind no schema knows (kubernetes-validate only warns; deploy-check fails)
        ("base/gateway.yaml", "kind: HorizontalPodAutoscaler", "kind: HorizontalPodAutoscalr", "HorizontalPodAutoscalr"),
        # a hostPort publishes verify on the node's address, past the Service and the NetworkPolicy
        ("base/verify.yaml", "              containerPort: 50053", "              containerPort: 50053\n              hostPort: 50053", "hostPort exposes"),
        # TLS on the model services but a gateway that does not dial TLS: it could never connect
        ("components/tls/gateway.yaml", "            - name: SPECD_TLS_CA ", "            - name: SPECD_TLS_CA_UNUSED ", "the gateway could not connect"),
        # a TLS port probed directly: kubelet's gRPC probe cannot do TLS, the pod would never be ready
        ("components/tls/models.yaml", "            - name: SPECD_HEALTH_PORT", "            - name: SPECD_HEALTH_PORT_UNUSED", "needs SPECD_HEALTH_PORT"),
        # a CPU verify whose CPUs are a burstable share: no cores of its own, threads measured on contended ones
        ("overlays/cpu/cpu-verify.yaml", '            limits:\n              cpu: "4"', '            limits:\n              cpu: "6"', "requests must equal limits"),
        ("overlays/cpu/cpu-verify.yaml", 'cpu: "4"\n              memory: 8Gi\n              ephemeral-storage: 2Gi\n            limits:\n              cpu: "4"',
         'cpu: "3500m"\n              memory: 8Gi\n              ephemeral-storage: 2Gi\n            limits:\n              cpu: "3500m"', "must be whole CPUs"),
        # a CPU verify that still asks for a GPU
        ("overlays/cpu/cpu-verify.yaml", "              ephemeral-storage: 2Gi\n", "              ephemeral-storage: 2Gi\n              nvidia.com/gpu: \"1\"\n", "on CPU must not ask for a GPU"),
        # a draft service deployed that the gateway never dials
        ("overlays/cpu/kustomization.yaml", "  - patch: |-\n      $patch: delete\n      apiVersion: apps/v1", "  - patch: |-\n      $patch: merge\n      apiVersion: apps/v1", "would never be asked"),
    ],
    ids=["unknown-field", "wrong-type", "unknown-kind", "host-port", "tls-mismatch", "tls-probe", "cpu-burstable", "cpu-fraction",
         "cpu-gpu", "cpu-idle-draft"],
)
def test_broken_manifest_fails_validation(tmp_path, relative, old, new, expected):
    result = run_check(broken_copy(tmp_path, relative, old, new))
    assert result.returncode != 0, result.stdout
    assert expected in result.stdout + result.stderr


def test_policy_violation_fails(tmp_path):
    """Schema-valid but against the design: the verify Service is no longer headless."""
    result = run_check(broken_copy(tmp_path, "base/verify.yaml", "  clusterIP: None ", "  type: ClusterIP "))
    assert result.returncode != 0
    assert "specd-verify must be headless" in result.stdout


def test_dockerfile_lint_catches_torch_in_the_gateway_image(tmp_path):
    docker = tmp_path / "docker"
    shutil.copytree(REPO / "deploy" / "docker", docker)
    dockerfile = docker / "gateway.Dockerfile"
    text = dockerfile.read_text()
    install = "pip install -r /tmp/requirements-gateway.txt"
    assert install in text
    dockerfile.write_text(text.replace(install, install + " torch"))
    result = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "lint_dockerfiles.py"), str(docker)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "the gateway image installs 'torch'" in result.stdout


def test_gateway_needs_only_what_its_image_installs():
    """Importing the gateway (and the CLI that serves it) loads no torch, and every third-party
    module it loads comes from a distribution in deploy/docker/requirements-gateway.txt."""
    code = (
        "import json, sys, importlib.metadata as md\n"
        "import gateway.app, gateway.service, specd_app.cli\n"
        "dists = md.packages_distributions()\n"
        "top = {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)\n"
        "print(json.dumps({m: dists.get(m, []) for m in sorted(top)}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd="/", env=repo_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    modules = json.loads(result.stdout.splitlines()[-1])
    assert "torch" not in modules and "transformers" not in modules
    allowed = {
        line.split("==")[0].strip().lower().replace("_", "-")
        for line in (REPO / "deploy" / "docker" / "requirements-gateway.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    # what those pin pull in transitively, and specd itself
    allowed |= {"specd", "typing-extensions", "markupsafe", "huggingface-hub", "importlib-metadata", "zipp", "googleapis-common-protos", "opentelemetry-api", "opentelemetry-semantic-conventions", "opentelemetry-proto", "opentelemetry-exporter-otlp-proto-common", "deprecated", "wrapt",
                # pulled in by starlette and uvicorn (the HTTP API)
                "anyio", "sniffio", "idna", "h11", "click"}
    ours = {"specd", "specd_common", "gateway", "draft_service", "verify_service", "google", "_distutils_hack"}
    # grpc tries `import grpc_tools` and carries on without it; cython_runtime is Cython's own
    ours |= {"grpc_tools", "cython_runtime"}
    foreign = {
        module: dists for module, dists in modules.items()
        if module not in ours and not module.startswith("_") and not {d.lower().replace("_", "-") for d in dists} & allowed
    }
    assert not foreign, f"the gateway imports modules its image does not install: {foreign}"


def test_dockerfile_lint_catches_a_package_left_out_of_the_image(tmp_path):
    """`pip install .` succeeds without a package folder; the CLI then fails at its first import."""
    docker = tmp_path / "docker"
    shutil.copytree(REPO / "deploy" / "docker", docker)
    dockerfile = docker / "verify.Dockerfile"
    line = "COPY draft_training ./draft_training\n"
    assert line in dockerfile.read_text()
    dockerfile.write_text(dockerfile.read_text().replace(line, ""))
    result = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "lint_dockerfiles.py"), str(docker)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "draft_training/ is never copied in" in result.stdout
