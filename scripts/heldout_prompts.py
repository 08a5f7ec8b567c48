"""Write the benchmark's held-out prompt file: prompts of every task kind that no draft trains on.

`specd train-draft` splits prompts into train and held-out by a hash of their id (train_prompts.py);
this takes the first `--per-kind` held-out prompts of each kind, interleaved by kind, so that
`specd bench --prompts docs/benchmarks/heldout_prompts.jsonl` measures a trained draft on text it
has not seen.

    .venv/bin/python scripts/heldout_prompts.py --data-dir ../shared/data --per-kind 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draft_training.train_prompts import KINDS, load_all_prompts, select_prompts

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data"))
    parser.add_argument("--per-kind", type=int, default=2)
    parser.add_argument("--output", default=str(REPO / "docs" / "benchmarks" / "heldout_prompts.jsonl"))
    args = parser.parse_args()
    held_out = select_prompts(load_all_prompts(Path(args.data_dir)), {kind: 12 for kind in KINDS}, True, 0.1, 0)
    by_kind: dict[str, list[dict]] = {}
    for row in held_out:
        by_kind.setdefault(row["category"], []).append(row)
    rows = [by_kind[kind][i] for i in range(args.per_kind) for kind in KINDS if i < len(by_kind.get(kind, []))]
    Path(args.output).write_text("".join(json.dumps({k: row[k] for k in ("id", "category", "prompt")}) + "\n" for row in rows))


if __name__ == "__main__":
    main()
