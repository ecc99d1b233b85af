#!/usr/bin/env bash
# One device-machine session: install carried wheels, run the test-suite on the GPU (real compiled
# kernels), then the side-by-side benchmark. Everything lands in $OUT.
# Usage (device tool, carry .whl): bash benchmarks/gpu_session.sh [bench args...]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
export CCE_AUTOTUNE_CACHE_DIR=/tmp/cce_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider -n 8 tests/test_loss.py tests/test_variants.py tests/test_errors.py tests/test_codegen.py 2>&1 | tail -25 | tee "$OUT/pytest_gpu.txt"
fi
python3 -m cce_autotune.bench --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.txt"
