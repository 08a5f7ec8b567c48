"""`buf lint` (npm @bufbuild/buf, a devDependency of clients/node) passes on protos/ with protos/buf.yaml.

Every rule buf.yaml ignores is explained there; a new lint finding fails this test.
"""

from __future__ import annotations

import subprocess

from tests.specd_stack import REPO, ensure_node_modules


def test_buf_lint_passes_on_protos():
    buf = ensure_node_modules() / ".bin" / "buf"
    result = subprocess.run([str(buf), "lint"], cwd=REPO / "protos", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"buf lint found:\n{result.stdout}{result.stderr}"


def test_buf_lint_catches_a_violation(tmp_path):
    """The configuration is live: a badly named message in a copy of the protos fails lint."""
    buf = ensure_node_modules() / ".bin" / "buf"
    (tmp_path / "specd" / "v1").mkdir(parents=True)
    (tmp_path / "buf.yaml").write_text((REPO / "protos" / "buf.yaml").read_text())
    for proto in (REPO / "protos" / "specd" / "v1").glob("*.proto"):
        (tmp_path / "specd" / "v1" / proto.name).write_text(proto.read_text())
    (tmp_path / "specd" / "v1" / "extra.proto").write_text('syntax = "proto3";\npackage specd.v1;\nmessage bad_name {}\n')
    result = subprocess.run([str(buf), "lint"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "bad_name" in result.stdout
