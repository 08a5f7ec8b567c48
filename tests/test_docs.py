"""The documentation stays small and every saved result in it is one somebody cites (issue 42).

README.md describes today in at most 20 KB; docs/benchmarks holds only what README.md, a page under
docs/ or the code cites (the prompt files the Makefile and tests read, the result files the pages
cite as evidence), every file a page cites exists, every plot there is shown by a page, and no
patch or shell script is kept as a "result".
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "docs" / "benchmarks"
README_LIMIT_BYTES = 20_000
# a path into docs/benchmarks as pages and code write it: from the repo root, or relative to the page
CITED = re.compile(r"(?P<prefix>docs/|(?:\.\./)+|\./)?benchmarks/(?P<rest>[\w./-]*)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
TEXT_SUFFIXES = {".md", ".py", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".txt"}


def repo_files() -> list[Path]:
    """Tracked files and new ones git does not ignore, as they are in the working tree."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    return [REPO / name for name in listed if name and (REPO / name).is_file()]


def citing_texts() -> dict[Path, str]:
    """README.md, every page, and the code, tests and build files: what may cite a saved result.
    Saved results do not cite each other (a report's own `command` names its output)."""
    texts = {}
    for path in repo_files():
        inside_benchmarks = BENCHMARKS in path.parents
        if path.name == "Makefile" or (path.suffix in TEXT_SUFFIXES and not (inside_benchmarks and path.suffix != ".md")):
            texts[path] = path.read_text(errors="replace")
    return texts


def citations(path: Path, text: str) -> set[Path]:
    """The docs/benchmarks paths (files or folders) a text names, resolved."""
    found = set()
    for match in CITED.finditer(text):
        prefix, rest = match.group("prefix") or "", match.group("rest").rstrip(".")
        if prefix == "docs/":
            target = REPO / "docs" / "benchmarks" / rest
        elif prefix or (REPO / "docs") in path.parents:  # a link relative to the page
            target = (path.parent / prefix / "benchmarks" / rest).resolve()
        else:
            continue
        if BENCHMARKS == target or BENCHMARKS in target.parents:
            found.add(target)
    return found


def all_citations() -> dict[Path, set[Path]]:
    return {path: citations(path, text) for path, text in citing_texts().items()}


def is_cited(file: Path, cited: set[Path]) -> bool:
    return file in cited or any(folder != BENCHMARKS and folder.is_dir() and folder in file.parents for folder in cited)


def test_the_readme_stays_within_20_kb():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes: move detail to docs/ (at most {README_LIMIT_BYTES})"


def test_every_file_under_docs_benchmarks_is_cited():
    cited = set().union(*all_citations().values())
    uncited = [str(path.relative_to(REPO)) for path in sorted(BENCHMARKS.rglob("*"))
               if path.is_file() and path.name != "HISTORY.md" and not is_cited(path, cited)]
    assert not uncited, f"cited by no page, README or code (cite them or git rm them): {uncited}"


def test_every_cited_result_exists():
    missing = sorted({f"{path.relative_to(REPO)} → {target.relative_to(REPO)}"
                      for path, targets in all_citations().items() for target in targets
                      if not target.exists() and path.suffix == ".md"})
    assert not missing, missing


def test_every_plot_under_docs_benchmarks_is_shown_by_a_page():
    shown = set()
    for path, text in citing_texts().items():
        if path.suffix == ".md":
            shown |= {(path.parent / link).resolve() for link in IMAGE.findall(text)}
    unshown = [str(p.relative_to(REPO)) for p in sorted(BENCHMARKS.rglob("*.png")) if p not in shown]
    assert not unshown, f"plots no page shows: {unshown}"


def test_docs_hold_no_patches_or_scripts():
    kept = [str(p.relative_to(REPO)) for p in sorted((REPO / "docs").rglob("*")) if p.suffix in (".patch", ".diff", ".sh")]
    assert not kept, kept


def test_the_citation_check_resolves_root_relative_and_folder_citations():
    page = REPO / "docs" / "design" / "example.md"
    assert citations(page, "see [x](../benchmarks/bench.json).") == {BENCHMARKS / "bench.json"}
    assert citations(REPO / "gateway" / "x.py", "docs/benchmarks/ab_joined/, and benchmarks/other") == {BENCHMARKS / "ab_joined"}
    assert is_cited(BENCHMARKS / "ab_joined" / "new_1.json", {BENCHMARKS / "ab_joined"})
    assert not is_cited(BENCHMARKS / "bench.json", {BENCHMARKS})
