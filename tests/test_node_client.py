"""The Node.js example client (clients/node) streams a generation from a gateway run by `specd up`.

Needs node and npm; `npm ci` runs here when clients/node/node_modules is missing (CI starts fresh).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from tests.specd_stack import NODE_CLIENT, ensure_node_modules, require_tool, specd_up
from tests.tiny_models import build_model


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    ensure_node_modules()  # before starting servers: a failing npm ci should not leave them running
    root = tmp_path_factory.mktemp("node-client")
    with specd_up(build_model(root / "target", seed=0), root / "specd-up.log") as running:
        yield running


def run_client(*args: str) -> subprocess.CompletedProcess:
    node = require_tool("node", "install Node.js >= 18 (Debian: apt-get install nodejs)")
    return subprocess.run([node, "client.js", *args], cwd=NODE_CLIENT, capture_output=True, text=True, timeout=60)


def test_node_client_streams_a_generation(stack):
    result = run_client("--address", stack.address("gateway"), "--prompt", "hello", "--max-new-tokens", "6")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["finish_reason"] in {"eos", "length", "stop"}
    assert 1 <= len(summary["token_ids"]) <= 6
    assert summary["messages"] >= 1 and summary["time_to_first_token_s"] is not None
    assert summary["usage"]["completion_tokens"] == len(summary["token_ids"])
    assert summary["prompt_token_ids"], "the first stream message carries the prompt ids"
    assert summary["stats"]["target_passes"] >= 1
    # the text streamed before the summary is the concatenated text of the stream messages
    assert result.stdout.startswith(summary["text"])


def test_node_client_reports_grpc_errors(stack):
    result = run_client("--address", stack.address("gateway"), "--prompt", "hello", "--max-new-tokens=-1")
    assert result.returncode == 2
    assert "INVALID_ARGUMENT" in result.stderr


def test_node_client_asks_for_json_under_a_schema(stack, tmp_path):
    """--json-schema: the answer streamed to the Node client is JSON that its schema accepts."""
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["name", "legs"], "additionalProperties": False}
    (tmp_path / "cat.schema.json").write_text(json.dumps(schema))
    result = run_client("--address", stack.address("gateway"), "--prompt", "Invent a cat.", "--max-new-tokens", "60",
                        "--json-schema", str(tmp_path / "cat.schema.json"), "--quiet")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["finish_reason"] == "eos" and summary["stats"]["forced_rounds"] >= 1
    jsonschema.validate(json.loads(summary["text"]), schema)
