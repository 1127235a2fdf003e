#!/usr/bin/env bash
# Issue 14's GPU checks and measurements in one command, on a machine with one NVIDIA GPU:
#   bash scripts/gpu.sh [RESULTS_DIR [benchmarks/gpu.py options...]]
# 1. versions (GPU, driver, CUDA, CuPy, PyTorch); 2. the `gpu`-marked tests (cupy engine on the
# device, NCCL on one rank); 3. benchmarks/gpu.py: gpt-medium's AdamW step (batch 8, seq 1024)
# through `parc run --engine cupy` against PyTorch eager, fp32 and TF32, with per-op profiles;
# `parc profile --engine cupy` (fp32 and TF32) and the plan's prediction from it; 4. the array
# engine's tests (ONNX's node cases, the tiny zoo's training steps) on the GPU (0 s: skipped).
# Needs parc's dependencies, CuPy and PyTorch. Wheels found in .whl/ (for a machine that cannot
# reach a package index) are installed into the running Python's environment first.
# Each part has its own time limit (seconds: PARC_GPU_TESTS_S, PARC_GPU_BENCH_S, PARC_GPU_NODES_S;
# PARC_GPU_TESTS_K and PARC_GPU_NODES_K select tests of parts 2 and 4 by pytest's -k);
# a part that fails or runs out of time does not stop the next.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-${OUT:-out/gpu}}
WORK=${PARC_GPU_WORK:-/tmp/parc-gpu}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS" "$WORK"
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  $PY -c "import cupy, torch, onnxruntime, numpy; print('cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), 'driver', cupy.cuda.runtime.driverGetVersion(), 'torch', torch.__version__, 'onnxruntime', onnxruntime.__version__, 'numpy', numpy.__version__)"
} 2>&1 | tee "$RESULTS/gpu.txt"
timeout -k 5 "${PARC_GPU_TESTS_S:-150}" $PY -m pytest -q -p no:cacheprovider -m gpu tests/exec/test_gpu.py \
  tests/exec/test_array_engine.py ${PARC_GPU_TESTS_K:+-k "$PARC_GPU_TESTS_K"} 2>&1 | tee "$RESULTS/gpu-tests.log" | tail -25
tests=${PIPESTATUS[0]}
timeout -k 5 "${PARC_GPU_BENCH_S:-330}" $PY benchmarks/gpu.py all --work "$WORK" --results "$RESULTS/results.json" \
  "${@:2}" 2>&1 | tee "$RESULTS/gpu-bench.log"
bench=${PIPESTATUS[0]}
nodes=0
if [ "${PARC_GPU_NODES_S:-120}" != 0 ]; then
  workers=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
  PARC_TEST_ENGINE_DEVICE=gpu timeout -k 5 "${PARC_GPU_NODES_S:-120}" $PY -m pytest -q -p no:cacheprovider $workers \
    tests/exec/test_array_engine.py -k "${PARC_GPU_NODES_K:-node_case or zoo_training}" 2>&1 \
    | tee "$RESULTS/gpu-node-cases.log" | tail -40
  nodes=${PIPESTATUS[0]}
fi
echo "exit codes: gpu tests $tests, benchmark $bench, engine tests on the GPU $nodes"
exit $(( tests || bench || nodes ))
