#!/usr/bin/env bash
# The prepared device check of issue 44 (docs/gpu.md): the serving path's tests on the device, then
# `specd bench` against transformers `generate` on the same device, into one JSON result file.
#
#   make gpu-check [GPU_CHECK_ARGS="--device cpu --out DIR"]
#   scripts/gpu_check.sh [--device cuda|cpu] [--out DIR]   the check (default: cuda, docs/benchmarks/gpu/)
#   scripts/gpu_check.sh stage | gather                     the staging steps (scripts/lib/gpu_stage.sh says how)
#
# The check (--device cuda), within 8 minutes: `pytest -m gpu tests/test_gpu.py` on the device
# (greedy equal to generate in float32, tiny models and the default target; bfloat16/float16
# agreement measured; draft and verify on the device; batched equal alone; seeded sampling
# repeats), then `specd bench` (its services' model threads profiled: SPECD_PROFILE_DIR) on the default target (BENCH_ARGS, default bfloat16, 8 held-out
# prompts, 64 tokens; the verify's passes BENCH_FORWARD, default flat: specd_engine/flat_pass.py, CUDA graphs) with
# transformers `generate` on the same GPU, then the engine room's fixed-shape
# flat pass eager and replayed as CUDA graphs beside its ragged pass (scripts/graphed_pass.py, ~1 minute); writes
# OUT/gpu_check-<date>.json: machine (GPU, driver, CUDA, torch, transformers), the tests'
# outcome and measurements, the bench report. --device cpu runs the same Python on a tiny random
# target with few tokens (CI: tests/test_scripts.py), writing to --out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# shellcheck source=scripts/lib/gpu_stage.sh
. scripts/lib/gpu_stage.sh
staging_verb "$@"

device_and_out docs/benchmarks/gpu "$@"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH=.:protos${PYTHONPATH:+:$PYTHONPATH} SPECD_GPU_RESULTS=$work SPECD_TEST_DEVICE=$device

if [ "$device" != cpu ]; then  # on the lent machine: install what was staged
  install_staged
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  prompts=(--prompts docs/benchmarks/heldout_prompts.jsonl)
  bench_args=${BENCH_ARGS:---limit 8 --max-new-tokens 64 --dtype bfloat16}
  target=()
  tests_timeout=300 bench_timeout=180  # measured on an H200: 255 s and 135 s
  graphed_args=(--device "$device" --dtype bfloat16 --repeats 8) graphed_timeout=100
else  # CI: the same steps on a tiny random target, few tokens
  "$PY" -c "import sys; from tests.tiny_models import build_model; build_model(__import__('pathlib').Path(sys.argv[1]), seed=0)" "$work/tiny"
  printf '{"prompt": "hello world", "category": "chat"}\n{"prompt": "def add(a, b):", "category": "code"}\n' >"$work/prompts.jsonl"
  prompts=(--prompts "$work/prompts.jsonl")
  bench_args=${BENCH_ARGS:---limit 2 --max-new-tokens 8 --threads 1}
  target=(--target "$work/tiny")
  tests_timeout=120 bench_timeout=120
  graphed_args=(--device cpu --target "$work/tiny" --context 64 --repeats 3) graphed_timeout=120
  export SPECD_PROFILE_CALLS=${SPECD_PROFILE_CALLS:-5:10}  # a short bench: its window starts early
fi

started=$(date +%s)
set +e
timeout "$tests_timeout" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$work/pytest.log"
tests_rc=${PIPESTATUS[0]}
tests_s=$(( $(date +%s) - started ))
# shellcheck disable=SC2086
SPECD_FORWARD=${BENCH_FORWARD:-flat} SPECD_PROFILE_DIR="$work/profile" timeout "$bench_timeout" "$PY" -m specd_app.cli bench "${prompts[@]}" "${target[@]}" $bench_args --json --output "$work/bench.json" \
  >"$work/bench.log" 2>&1
bench_rc=$?
timeout "$graphed_timeout" "$PY" scripts/graphed_pass.py "${graphed_args[@]}" --out "$work/graphed.json" >"$work/graphed.log" 2>&1
set -e
tail -5 "$work/bench.log"
"$PY" - "$work" "$out" "$device" "$tests_rc" "$bench_rc" "$tests_s" <<'EOF'
import json, os, subprocess, sys, time
from pathlib import Path

from specd_app.bench import machine_facts

work, out, device, tests_rc, bench_rc, tests_s = sys.argv[1:]
work = Path(work)
summary = [line for line in (work / "pytest.log").read_text().splitlines() if " passed" in line or " failed" in line]
result = {
    "command": f"scripts/gpu_check.sh --device {device}", "check": "issue 44",
    "bench_forward": os.environ.get("BENCH_FORWARD", "flat"), "device": device, "machine": machine_facts(),
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "tests": {"exit_code": int(tests_rc), "summary": summary[-1] if summary else "", "seconds": int(tests_s),
              "measured": json.loads((work / "tests.json").read_text()) if (work / "tests.json").exists() else {}},
    "bench": {"exit_code": int(bench_rc),
              "report": json.loads((work / "bench.json").read_text()) if (work / "bench.json").exists() else None,
              "log_tail": (work / "bench.log").read_text()[-3000:] if int(bench_rc) else ""},
    # the engine's flat pass beside its ragged one, eager and as CUDA graphs (scripts/graphed_pass.py)
    "graphed_pass": json.loads((work / "graphed.json").read_text()) if (work / "graphed.json").exists()
                    else {"log_tail": (work / "graphed.log").read_text()[-3000:]},
    # each model service's operators over a window of its model thread's calls (model_thread.CallProfiler)
    "profiles": {path.name: path.read_text() for path in sorted((work / "profile").glob("*.txt"))},
}
path = Path(out) / f"gpu_check-{device.replace(':', '')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
path.write_text(json.dumps(result, indent=1) + "\n")
print(f"wrote {path}: tests exit {tests_rc}, bench exit {bench_rc}")
EOF
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
