#!/usr/bin/env bash
# Device-machine run: GPU tests of the tile map and the search-space sweep, then cce-tune for the
# three benchmark shapes (all kernels); results under $OUT (at most 8 files come back).
set -uo pipefail
export PYTHONUNBUFFERED=1 CCE_AUTOTUNE_CACHE_DIR=/tmp/cc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 --tb=short tests/test_tile_map.py tests/test_loss.py \
  tests/test_variants.py -k "tile_map or mapped or live or search_space or row_layouts or ignored or nan" > "$OUT/pytest_gpu.txt" 2>&1
grep -E "FAILED|passed|failed|Error" "$OUT/pytest_gpu.txt" | tail -8
for spec in "256128 2304 ${BUDGET_GEMMA:-130}" "128256 4096 ${BUDGET_LLAMA:-110}" "32768 4096 ${BUDGET_MISTRAL:-90}"; do
  set -- $spec
  T0=$(date +%s)
  timeout $(( $3 + 40 )) python3 -m cce_autotune.cli --gpu h200 --vocab $1 --hidden $2 --tokens 8192 --trials 30 \
    --budget-minutes $(python3 -c "print($3/60)") --out "$OUT/tuned" > "$OUT/tune_$1.txt" 2>&1
  echo "cce-tune --vocab $1 --hidden $2: rc=$? wall=$(( $(date +%s) - T0 ))s" | tee -a "$OUT/tune_summary.txt"
  grep -E "winner|failed, |done" "$OUT/tune_$1.txt" | tail -8 | tee -a "$OUT/tune_summary.txt"
done
CCE_AUTOTUNE_CONFIG_DIR=$OUT/tuned python3 -m cce_autotune.cli show --gpu h200 --vocab 256128,128256,32768 --tokens 8192 > "$OUT/show.txt" 2>&1
tail -30 "$OUT/show.txt"
