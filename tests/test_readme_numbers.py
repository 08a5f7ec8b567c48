"""Every benchmark number in the README comes from the saved result file it cites (issue 18).

The README's Benchmarks section cites its JSON reports (docs/benchmarks/*.json) before each table;
every number in a table's measured columns, and in the per-task-kind line, must be a value of a
cited report (rounded as the README writes it), and every cited report must hold the command, the
machine and the date it was made with. The current table is what `make bench` writes
(docs/benchmarks/bench.json), made by the Makefile's command, on the date the README names: after a
new `make bench`, the table and the date are updated from the new report, or these tests fail.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])")
CITATION = re.compile(r"docs/benchmarks/[\w./-]+\.json(?!l)")
CURRENT = "docs/benchmarks/bench.json"  # what `make bench` writes and the current table cites


def benchmarks_section() -> str:
    return (REPO / "README.md").read_text().split("\n## Benchmarks", 1)[1].split("\n## ", 1)[0]


def tables_with_citations(section: str) -> list[tuple[list[str], list[list[str]]]]:
    """(files cited since the previous table, rows of cells) for each markdown table, header and rule excluded."""
    found, cited, rows = [], [], []
    for line in section.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
            continue
        if rows:
            found.append((cited, rows[2:]))
            cited, rows = [], []
        cited = cited + CITATION.findall(line)
    return found


def reported_values(path: str) -> list[float]:
    """Every number a report holds: per mode (overall, per task kind, per position, per repeat) and,
    in the concurrency reports, one at a time against many at once and the arrival test's."""
    return list(numbers_in(json.loads((REPO / path).read_text())))


def numbers_in(value) -> Iterator[float]:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            yield from numbers_in(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield float(value)


def unexplained(text: str, values: list[float]) -> list[str]:
    """Numbers in text that no value explains at the precision written."""
    missing = []
    for number in NUMBER.findall(text.replace(",", "")):
        decimals = len(number.split(".")[1]) if "." in number else 0
        half_unit = 0.5 * 10.0**-decimals + 1e-9  # 1.585 may be written 1.58 or 1.59
        if not any(abs(value - float(number)) <= half_unit for value in values):
            missing.append(number)
    return missing


def test_each_table_cites_reports_with_command_machine_and_date():
    tables = tables_with_citations(benchmarks_section())
    assert tables
    for cited, rows in tables:
        assert cited, f"a benchmark table cites no results file: {rows[0]}"
        for path in cited:
            report = json.loads((REPO / path).read_text())
            assert report.get("command") and report.get("machine", {}).get("cpu"), path
            assert re.match(r"\d{4}-\d\d-\d\d", report["machine"].get("date", "")), f"{path} has no date"


def test_every_table_number_is_in_the_report_it_cites():
    for cited, rows in tables_with_citations(benchmarks_section()):
        values = [value for path in cited for value in reported_values(path)]
        for row in rows:
            measured = " ".join(cell for cell in row[1:] if cell != "-")  # the first column names the row
            assert not unexplained(measured, values), (row, cited)


def test_the_per_task_kind_line_is_in_the_main_report():
    section = benchmarks_section()
    line = section.split("Per task kind", 1)[1].split("\n\n", 1)[0]
    assert "translation" in line
    current = CITATION.findall(section.split("**Current", 1)[1])[0]  # the report the current table comes from
    assert current == CURRENT
    assert not unexplained(line, reported_values(current))


def without_output(command: str) -> list[str]:
    words = shlex.split(command.replace("$(SPECD)", "specd").replace("\\\n", " "))
    at = words.index("--output")
    return words[:at] + words[at + 2:]


def test_the_current_table_is_what_make_bench_writes_with_its_date():
    recipe = (REPO / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0].split("\n", 1)[1]
    assert f"--output {CURRENT}" in recipe
    report = json.loads((REPO / CURRENT).read_text())
    assert without_output(report["command"]) == without_output(recipe.strip()), "bench.json was made by another command"
    section = benchmarks_section()
    current = section.split("**Current", 1)[1].split("\n|", 1)[0]
    assert report["machine"]["date"][:10] in current, "the README's current table names another date than bench.json's"
    assert [paths for paths, _ in tables_with_citations(section)][0][-1] == CURRENT


def test_the_check_catches_a_number_no_report_holds():
    values = reported_values(CURRENT)
    rate = json.loads((REPO / CURRENT).read_text())["modes"]["target_only"]["overall"]["tokens_per_s"]
    assert unexplained(f"{rate} | 1.0", values) == []
    assert unexplained(f"{rate} | 98765.43", values) == ["98765.43"]
