#!/bin/sh
# Install llama.cpp (llama-cpp-python, compiled here) for `specd bench`'s llamacpp_* modes: the CPU
# user's other choice, built for this CPU (-march=native). Then a smoke test evaluates a 4-token
# prompt on the target's GGUF. Where it dies (on a 2-vCPU Xeon VM, 2026-11-28: SIGILL at an AMX
# `tilezero` in libggml-cpu, a CPU that lists AMX under a kernel that does not let it run), it is built
# again with the vector extensions the CPU lists named one by one and AMX left out.
# Usage: scripts/setup_llama_cpp.sh PIP PYTHON
set -e
PIP=$1 PY=$2
VERSION=0.3.36
smoke() {
	"$PY" - <<'PYTHON'
import llama_cpp
from specd_engine.models import embedded_gguf_path
llm = llama_cpp.Llama(model_path=str(embedded_gguf_path()), n_ctx=256, n_threads=1, verbose=False)
for _ in llm.generate([1, 2, 3, 4], reset=True):
    break
PYTHON
}
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) $PIP install --quiet llama-cpp-python==$VERSION
if smoke; then
	exit 0
fi
echo "llama.cpp built with -march=native fails on this machine: building it again without AMX" >&2
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
args="-DGGML_NATIVE=OFF"
for pair in avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI avx512f:AVX512 \
	avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
	case "$flags" in *" ${pair%%:*} "*) args="$args -DGGML_${pair#*:}=ON" ;; esac
done
CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) $PIP install --quiet --no-cache-dir --force-reinstall --no-deps \
	llama-cpp-python==$VERSION
smoke
