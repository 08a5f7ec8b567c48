#!/usr/bin/env bash
# Copy what scripts/gpu_train_heads.sh WORK has produced so far into OUT (the device tool's $OUT):
# each finished draft folder as a tar, the run logs, the status file.
set -uo pipefail
work=${1:?work dir}
out=${2:?output dir}
cat "$work/status" 2>/dev/null
for stage in medusa-run/medusa feature-run/draft; do
  [ -d "$work/$stage" ] && tar cf "$out/$(dirname "$stage").tar" -C "$work" "$stage"
done
for log in medusa-run feature-run; do
  [ -f "$work/$log/train-draft.log" ] && cp "$work/$log/train-draft.log" "$out/$log.log"
done
[ -f "$work.log" ] && tail -c 200000 "$work.log" >"$out/job.log"
ls -la "$out"
