#!/usr/bin/env bash
# Device-machine run: GPU test-suite, then cce-tune for the benchmark shapes; results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 CCE_AUTOTUNE_CACHE_DIR=/tmp/cc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 -m pytest -q -x -p no:cacheprovider -n 8 tests/test_loss.py tests/test_variants.py tests/test_errors.py tests/test_codegen.py 2>&1 | tail -5 | tee "$OUT/pytest_gpu.txt"
python3 -c "from cce_autotune import kernels; print('fp32-out mm path:', kernels._FP32_OUT_MM)" >/dev/null
for spec in "256128 2304 150" "128256 4096 120" "32768 4096 120"; do
  set -- $spec
  T0=$(date +%s)
  timeout $(( $3 + 60 )) python3 -m cce_autotune.cli --gpu h200 --vocab $1 --hidden $2 --tokens 8192 --trials 30 \
    --budget-minutes $(python3 -c "print($3/60)") --out "$OUT/tuned" > "$OUT/tune_$1.txt" 2>&1
  echo "cce-tune --vocab $1 --hidden $2: rc=$? wall=$(( $(date +%s) - T0 ))s" | tee -a "$OUT/tune_summary.txt"
  grep -E "winner|failed, |done" "$OUT/tune_$1.txt" | tail -8 | tee -a "$OUT/tune_summary.txt"
done
cp /tmp/cc/studies.db "$OUT/" 2>/dev/null
CCE_AUTOTUNE_CONFIG_DIR=$OUT/tuned python3 -m cce_autotune.cli show --gpu h200 --vocab 256128 --hidden 2304 --tokens 8192 > "$OUT/show.txt" 2>&1
tail -12 "$OUT/show.txt"
