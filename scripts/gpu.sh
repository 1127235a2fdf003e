#!/usr/bin/env bash
# Issue 14's GPU checks and measurements in one command, on a machine with one NVIDIA GPU:
#   bash scripts/gpu.sh [RESULTS_DIR]
# 1. versions (GPU, driver, CUDA, CuPy, PyTorch); 2. the `gpu`-marked tests (cupy engine on the
# device, NCCL on one rank); 3. benchmarks/gpu.py: gpt-medium's AdamW step (batch 8, seq 1024)
# through `parc run --engine cupy` against PyTorch eager, fp32 and TF32, with per-op profiles.
# Needs parc's dependencies, CuPy and PyTorch. Wheels found in .whl/ (for a machine that cannot
# reach a package index) are installed into a private directory first.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-${OUT:-out/gpu}}
WORK=${PARC_GPU_WORK:-/tmp/parc-gpu}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS" "$WORK"
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/parc-site .whl/*.whl
  export PYTHONPATH=/tmp/parc-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$RESULTS/gpu.txt"
$PY -c "import cupy, torch; print('cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), 'torch', torch.__version__)" | tee -a "$RESULTS/gpu.txt"
set +e
timeout 300 $PY -m pytest -q -p no:cacheprovider -m gpu tests/exec/test_gpu.py 2>&1 | tee "$RESULTS/gpu-tests.log" | tail -15
tests=${PIPESTATUS[0]}
set -e
$PY benchmarks/gpu.py all --work "$WORK" --results "$RESULTS/results.json" "${@:2}" 2>&1 | tee "$RESULTS/gpu-bench.log"
echo "gpu tests exit code: $tests"
exit "$tests"
