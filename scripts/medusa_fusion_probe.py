"""Is fusing lower layers worth it? Two arms from the same heads, on the same records, same steps.

EAGLE-3 feeds its draft the target's low, middle and high layer features instead of the last alone.
Whether that pays for Medusa heads on the default target is a measurement: both arms start from the
same saved heads (`--init-head`), train the same steps on the same batches (the records whose fused
layers' outputs are stored; same seed) and are evaluated on the same held-out answers
(medusa_evaluation). The only difference: the second arm's input also fuses the outputs of
`--layers` (a zero-initialized projection: it starts as the first arm). Extract the layers' outputs
first, e.g. `specd train-draft --recipe medusa-fusion-corpus --work-dir W --tf-minutes 15
--train-minutes 0.01 --skip-eval` (the records of the corpus it reaches in 15 minutes), then

    .venv/bin/python scripts/medusa_fusion_probe.py --work-dir W --init-head verify_service/heads/smollm2-135m-instruct \\
        --epochs 2 --threads 2 --output docs/benchmarks/medusa/fusion_probe.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from specd_common.config import DEFAULT_TARGET


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", required=True, help="a medusa-fusion-corpus work dir (feature and layer shards, held-out answers)")
    parser.add_argument("--init-head", required=True, help="the heads both arms start from")
    parser.add_argument("--base-recipe", default="medusa-chain2-corpus", help="the first arm's recipe (its shape must fit --init-head)")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 15], help="decoder layers the second arm fuses")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--output", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from draft_training.feature_training import load_feature_records
    from draft_training.loop import train_draft
    from draft_training.medusa_training import MEDUSA_RECIPES, medusa_evaluation, medusa_loss, starting_heads
    from specd_app.bench import emit_report, machine_facts
    from specd_common.models import load_causal_lm

    work = Path(args.work_dir)
    target = load_causal_lm(args.target, device="cpu", dtype="float32")
    base = replace(MEDUSA_RECIPES[args.base_recipe], epochs=args.epochs, train_minutes=0.0)
    arms = {"final features": base, f"fused layers {args.layers}": replace(base, fusion_layers=list(args.layers))}
    records = load_feature_records(work, target.model.config.max_position_embeddings, base.generated_repeats, args.layers)
    report = {"command": " ".join(["python", "scripts/medusa_fusion_probe.py", *argv]), "machine": machine_facts(),
              "train_records": len({r["id"] for r in records}),
              "train_answer_positions_per_epoch": sum(len(r["tokens"]) - r["start"] for r in records), "arms": {}}
    for index, (name, recipe) in enumerate(arms.items()):
        heads = starting_heads(target, Path(args.init_head), recipe)
        started = time.monotonic()
        state = train_draft(heads, records, recipe, work / f"probe-arm{index}", torch.device("cpu"), loss_fn=medusa_loss)
        report["arms"][name] = {"train_seconds": round(time.monotonic() - started), "steps": state["step"],
                                "last_history": state["history"][-3:], **medusa_evaluation(heads.eval(), target, work, 0)}
    emit_report(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
