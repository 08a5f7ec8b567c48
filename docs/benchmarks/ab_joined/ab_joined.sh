#!/bin/bash
# A/B of joined free rounds (a lookup copy and the Medusa heads in one tree), how the JSON files here
# were made (2026-11-25 12:57-13:21 UTC, 2-vCPU AMD EPYC VM, no GPU): old = commit 896d8b7 (a copy
# preempts the heads) checked out in /tmp/wt_old, new = commit fab80b9; order new, old, new, old
# (pairs 1-2), then old, new, old, new (pairs 3-4), so a drift of the VM's speed hits both sides.
run() {  # $1 = code dir, $2 = output
  PYTHONPATH=$1 .venv/bin/python -c "import sys; sys.argv=['specd']+sys.argv[1:]; from specd_app.cli import main; sys.exit(main())" \
    bench --prompts docs/benchmarks/heldout_prompts.jsonl --limit 14 --max-new-tokens 64 --branches 1 --no-hf --output $2
}
run /work/main new_1.json; run /tmp/wt_old old_1.json; run /work/main new_2.json; run /tmp/wt_old old_2.json
run /tmp/wt_old old_3.json; run /work/main new_3.json; run /tmp/wt_old old_4.json; run /work/main new_4.json
