#!/bin/bash
# A/B of the stack, how docs/benchmarks/ab_model_thread_{old,new}_{1,2}.json were made (2026-11-24 02:55-03:08 UTC, 2-vCPU AMD EPYC VM):
# old = commit 3ba5484 checked out in /tmp/wt-old, new = the model-thread + rows/cols change; same prompts, old then new, twice.
set -x
for round in 1 2; do
for side in old new; do
  if [ $side = old ]; then root=/tmp/wt-old; else root=/work/main; fi
  (cd $root && PYTHONPATH=$root:$root/protos /work/main/.venv/bin/python -m specd_app.cli bench --prompts docs/benchmarks/heldout_prompts.jsonl --limit 14 --max-new-tokens 64 --medusa --no-hf --output /work/bench/ab_${side}_${round}.json) > /work/logs/ab_${side}_${round}.log 2>&1
done
done
