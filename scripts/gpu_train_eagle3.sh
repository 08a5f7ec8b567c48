#!/usr/bin/env bash
# Issue 45's prepared GPU command: in one device call of at most 10 minutes, grow the draft corpus with
# the target's own answers (batched generation on the GPU), train specd's EAGLE-3 head on the whole
# corpus (draft_training/eagle3_training.py: fused features computed on the fly, training-time test,
# bfloat16), and write back what a session commits, three files:
#   OUT/eagle3-head.tar   the checkpoint in the EAGLE authors' layout + its recipe, eval and training records
#   OUT/corpus-new.tar    the corpus shards this run added (untar into draft_training/corpus/<target>/)
#   OUT/summary.json      tokens generated and trained, their rates, epochs, held-out agreement per step
#
#   scripts/gpu_train_eagle3.sh [--device cuda|cpu] [--out DIR]
#   scripts/gpu_train_eagle3.sh stage | gather     the staging steps (scripts/lib/gpu_stage.sh)
#
# On the lent machine: the four staging calls of docs/gpu.md, the last with
# `PYTHON=python3 scripts/gpu_train_eagle3.sh --out "$OUT"` (timeout 600). Knobs (environment):
# CORPUS_MINUTES (2), TRAIN_MINUTES (4.5), EPOCHS (10), BATCH (256 prompts answered together).
# --device cpu is CI's smoke mode (tests/test_scripts.py): a tiny random target, the eagle3-tiny
# recipe, seconds of each step, the same files.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# shellcheck source=scripts/lib/gpu_stage.sh
. scripts/lib/gpu_stage.sh
staging_verb "$@"

device_and_out .gpu/out "$@"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH=.:protos${PYTHONPATH:+:$PYTHONPATH}

if [ "$device" != cpu ]; then
  install_staged
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  data=${SPECD_DATA_DIR:-$SHARED_DATA}
  target=() recipe=eagle3-corpus corpus_dir=() threads=()
  # within one 600 s call: ~20 s install, the corpus, ~90 s of loading and held-out answers, the training
  corpus_minutes=${CORPUS_MINUTES:-2} train_minutes=${TRAIN_MINUTES:-4.5} epochs=${EPOCHS:-10} batch=${BATCH:-256}
else  # CI: the same steps on a tiny random target
  "$PY" - "$work" <<'PYEOF'
import sys
from pathlib import Path
from tests.test_train_feature_head import write_prompt_files
from tests.tiny_models import build_model, build_tokenizer
build_model(Path(sys.argv[1]) / "tiny", seed=3, layers=8, tokenizer=build_tokenizer(), head_scale=10.0)
write_prompt_files(Path(sys.argv[1]) / "data")
PYEOF
  data=$work/data
  target=(--target "$work/tiny") recipe=eagle3-tiny corpus_dir=(--output-dir "$work/corpus") threads=(--threads 1)
  corpus_minutes=0.05 train_minutes=0.2 epochs=5 batch=8
fi

corpus_of() {  # the corpus folder the run extends, and its answer tokens
  "$PY" -c "
import sys
from pathlib import Path
from draft_training.corpus import Corpus, corpus_dir
from specd_common.config import DEFAULT_TARGET
folder = Path(sys.argv[2]) if sys.argv[2] else corpus_dir(sys.argv[1] or DEFAULT_TARGET)
print(folder, Corpus.open(folder).answer_tokens() if folder.is_dir() else 0)
" "${target[1]:-}" "${corpus_dir[1]:-}"
}
read -r folder tokens_before < <(corpus_of)
ls "$folder" 2>/dev/null | sort >"$work/shards-before" || true
started=$(date +%s)
"$PY" -m specd_app.cli draft-corpus "${target[@]}" "${corpus_dir[@]}" "${threads[@]}" --minutes "$corpus_minutes" --device "$device" \
  --batch-size "$batch" --self-prompts --data-dir "$data" 2>&1 | grep -v "it/s\]" | tail -3
corpus_s=$(( $(date +%s) - started ))
read -r folder tokens_after < <(corpus_of)
ls "$folder" | sort | comm -13 "$work/shards-before" - >"$work/shards-new"
tar -cf "$out/corpus-new.tar" -C "$folder" -T "$work/shards-new"

started=$(date +%s)
"$PY" -m specd_app.cli train-draft "${target[@]}" "${threads[@]}" --recipe "$recipe" --device "$device" --work-dir "$work/run" \
  --output "$work/eagle3-head" --data-dir "$data" --train-minutes "$train_minutes" --epochs "$epochs" 2>&1 \
  | grep -E "eagle3|train:|saved" | tail -12
train_s=$(( $(date +%s) - started ))
tar -cf "$out/eagle3-head.tar" -C "$work" eagle3-head

"$PY" - "$work" "$out" "$device" "$tokens_before" "$tokens_after" "$corpus_s" "$train_s" <<'PYEOF'
import json, sys
from pathlib import Path
from specd_app.bench import machine_facts
work, out, device, before, after, corpus_s, train_s = sys.argv[1], Path(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:])
head = Path(work) / "eagle3-head"
recipe, training = (json.loads((head / f"{name}.json").read_text()) for name in ("recipe", "training"))
epochs = training["history"][-1]["epoch"] if training["history"] else 0.0
summary = {
    "command": f"scripts/gpu_train_eagle3.sh --device {device}", "machine": machine_facts(),
    "corpus": {"answer_tokens_before": before, "answer_tokens_added": after - before, "seconds": corpus_s,
               "tokens_per_s": round((after - before) / max(1, corpus_s), 1),
               "new_shards": (Path(work) / "shards-new").read_text().split()},
    "train": {"recipe": recipe["name"], "answer_tokens": recipe["train_answer_tokens"], "steps": training["step"],
              "epochs": epochs, "train_seconds": round(training["train_seconds"], 1), "wall_seconds": train_s,
              "answer_positions_per_s": round(epochs * recipe["train_answer_tokens"] / max(1e-9, training["train_seconds"]), 1),
              "ttt_passes": recipe["ttt_passes"]},
    "held_out_agreement_per_step": json.loads((head / "eval.json").read_text())["agreement_per_step"],
}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps({k: summary[k] for k in ("corpus", "train")}, indent=1))
PYEOF
