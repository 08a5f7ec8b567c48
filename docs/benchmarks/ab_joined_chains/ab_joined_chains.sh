#!/bin/bash
# A/B of joined rounds beside other requests (two streams: the copy's chain and the heads' compete by
# value instead of a copy preempting the heads), how the JSON files here were made (2026-11-25, 2-vCPU
# AMD EPYC VM, no GPU): old = commit 1485ffd checked out in /tmp/wt_old, new = commit eef6fad's engine
# (main at 688613d); order new, old, old, new so a drift of the VM's speed hits both sides.
run() {  # $1 = code dir, $2 = output
  PYTHONPATH=$1 .venv/bin/python -c "import sys; sys.argv=['specd']+sys.argv[1:]; from specd_app.cli import main; sys.exit(main())" \
    bench --prompts docs/benchmarks/heldout_prompts.jsonl --limit 14 --max-new-tokens 64 --no-hf --concurrency 2 --branches 1 --output $2
}
D=docs/benchmarks/ab_joined_chains
run /work/main $D/new_1.json; run /tmp/wt_old $D/old_1.json; run /tmp/wt_old $D/old_2.json; run /work/main $D/new_2.json
# Result (17:00-17:07 UTC): specd tokens a pass 2.083 / 2.098 (new) against 2.098 / 2.103 (old), speedup
# over each run's own target-only 1.394 / 1.29 against 1.473 / 1.431: no gain, so the engine change was
# reverted (valued_tree keeps `trees` for scripts/free_trees_offline.py's ":chains" policies).
