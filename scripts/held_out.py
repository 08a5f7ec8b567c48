"""What the offline scripts over a `specd train-draft` work dir's held-out answers share: their
common flags, the target and the answers (with the target's features), and the report's header
(command, date, machine), so every saved result says how, when and where it was made."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def held_out_parser(doc: str) -> argparse.ArgumentParser:
    """--work-dir, --target, --threads and --output; the script adds its own."""
    from specd_common.config import DEFAULT_TARGET

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--work-dir", required=True, help="a train-draft work dir with held-out answers (data/gen-eval-*)")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default="")
    return parser


def load_held_out(args: argparse.Namespace) -> tuple:
    """(target on the CPU in float32, the held-out answers with its features), on args.threads threads."""
    import torch

    from draft_training.feature_training import eval_records
    from specd_common.models import load_causal_lm

    torch.set_num_threads(args.threads)
    target = load_causal_lm(args.target, device="cpu", dtype="float32")
    return target, eval_records(target, Path(args.work_dir), 0)


def report_header() -> dict:
    """The command line, the date and the machine, for the top of a saved report."""
    from specd_app.bench import machine_facts

    return {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "machine": machine_facts()}
