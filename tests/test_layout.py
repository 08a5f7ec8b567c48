"""The package layering stays as the README's code map says (a lint, run with the suite).

  specd_app (CLI, `specd up`, bench)      draft_training (offline, `specd train-draft`)
        │ may import everything below            │ may import the serving packages
  gateway   draft_service   verify_service       (serving: never imports the two above,
        │            │             │               nor one service another)
        │       specd_engine (the engine room: models, passes, KV, batcher, model thread; torch)
        │            │
  specd_common (shared, torch-free) ── specd.v1 (generated protos)

Imports are read with `ast`, function-level imports included, so a lazy import cannot hide a
dependency that points the wrong way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVING = ("gateway", "draft_service", "verify_service")
ABOVE_SERVING = ("specd_app", "draft_training")
# package → packages of this repository it must never import
FORBIDDEN = {
    "specd_common": ("specd_engine",) + SERVING + ABOVE_SERVING,
    "specd_engine": SERVING + ABOVE_SERVING,
    "gateway": ("specd_engine", "draft_service", "verify_service") + ABOVE_SERVING,
    "draft_service": ("gateway", "verify_service") + ABOVE_SERVING,
    "verify_service": ("gateway", "draft_service") + ABOVE_SERVING,
    "draft_training": ("specd_app",),
}
PACKAGES = tuple(FORBIDDEN) + ("specd_app",)


def imported_modules(path: Path) -> set[str]:
    """Every module name an `import` or `from … import` in this file names (absolute imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules_of(package: str) -> dict[str, Path]:
    return {f"{package}.{path.stem}": path for path in sorted((REPO / package).glob("*.py")) if path.stem != "__init__"}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the directed graph as a list of nodes (first == last), or [] if it has none."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_points_up_or_sideways(package):
    wrong = {
        f"{module} imports {name}"
        for module, path in modules_of(package).items()
        for name in imported_modules(path)
        if name.split(".")[0] in FORBIDDEN[package]
    }
    assert not wrong, sorted(wrong)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_a_package(package):
    modules = modules_of(package)
    graph = {module: {name for name in imported_modules(path) if name in modules} for module, path in modules.items()}
    assert find_cycle(graph) == []


def test_specd_common_runs_no_model():
    """What every service shares imports no torch or transformers at any level: a module that needs them
    runs a model, and belongs in the engine room (specd_engine), which the gateway never imports (numpy
    stays: the gateway reads distributions with it)."""
    heavy = ("torch", "transformers")
    wrong = {f"{module} imports {name}" for module, path in modules_of("specd_common").items()
             for name in imported_modules(path) if name.split(".")[0] in heavy}
    assert not wrong, sorted(wrong)


def test_the_draft_service_trains_nothing():
    """Offline training lives in draft_training/; the draft service only serves drafts and loads heads."""
    for path in (REPO / "draft_service").glob("*.py"):
        text = path.read_text()
        for marker in ("torch.optim", ".backward(", "zero_grad"):
            assert marker not in text, f"{path.name} contains {marker!r}: training code belongs in draft_training/"


def class_lines(path: Path, name: str) -> int:
    """How many lines class `name` in `path` spans (its decorators and docstring included)."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise AssertionError(f"{path.name} defines no class {name}")


def test_a_generation_runs_rounds_and_the_proposers_keep_their_own_state():
    """gateway/engine.py's Generation keeps sessions, KV sync, faults and emission (at most 350 lines);
    what says how good a drafter's drafts are (acceptance, calibration, back-off, probes) lives in that
    drafter's proposer (gateway/proposers.py), and the choice among them in the planner."""
    engine = REPO / "gateway" / "engine.py"
    assert class_lines(engine, "Generation") <= 350
    names = imported_modules(engine)
    for estimate in ("AcceptanceEstimate", "HeadCalibration", "confident_tree", "valued_tree", "best_shape"):
        assert not any(name.endswith("." + estimate) for name in names), f"engine.py uses {estimate}: a proposer's or the planner's"
    assert "PROBE" not in engine.read_text() and "backoff" not in engine.read_text()


def test_the_engine_runs_every_pass_through_one_engine_and_causal_lm_stays_small():
    """specd_engine/lm.py's CausalLM makes a pass's feeds and hands each session its rows back (at most
    300 lines); the passes themselves are the pass engines' (passes.py, flat_pass.py), the runtime and
    its start-up measurements tuning.py's, a session's own bookkeeping sessions.py's. The engine has
    one forward path a model: CausalLM runs every feed through `self.passes.run`, no pass of its own."""
    lm = REPO / "specd_engine" / "lm.py"
    assert class_lines(lm, "CausalLM") <= 300
    text = lm.read_text()
    assert text.count("self.passes.run(") == 1
    assert "forward_ragged" not in text and "forward_flat" not in text and "self.loaded.model(" not in text
    assert not (REPO / "specd_engine" / "kv_batch.py").exists()


def test_every_policy_threshold_has_its_principle():
    """One SpeculationPolicy holds the policy's constants, each with a one-line comment saying why."""
    path = REPO / "gateway" / "policy.py"
    lines = path.read_text().splitlines()
    fields = [line for line in lines if line.startswith("    ") and ": " in line and " = " in line and not line.strip().startswith(("#", "def", "return"))]
    assert len(fields) >= 15
    assert all("  # " in line for line in fields), [line for line in fields if "  # " not in line]


def test_a_round_limit_has_one_value_that_every_service_reads():
    """The gateway, draft and verify check a round's sizes against the same constants (specd_common/tree.py):
    a second definition could let the gateway send what a service refuses."""
    from specd_common import tree

    limits = [name for name in vars(tree) if name.startswith("MAX_")]
    assert {"MAX_DRAFT_TOKENS", "MAX_BRANCHES", "MAX_TREE_NODES", "MAX_SPECULATED_OUTCOMES"} <= set(limits)
    redefined = []
    for package in ("gateway", "draft_service", "verify_service", "specd_engine"):
        for path in (REPO / package).glob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Assign) and any(getattr(target, "id", "") in limits for target in node.targets):
                    redefined.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert redefined == []
