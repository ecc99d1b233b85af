#!/usr/bin/env bash
# Last device-machine run of a session: GPU test-suite (full failure report), tune the gemma2 shape,
# then the side-by-side benchmark with the shipped + freshly tuned configs. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 CCE_AUTOTUNE_CACHE_DIR=/tmp/cc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 70 python3 -m pytest -q -p no:cacheprovider -n 8 --tb=short tests/test_loss.py tests/test_variants.py tests/test_errors.py tests/test_codegen.py > "$OUT/pytest_gpu.txt" 2>&1
grep -E "FAILED|passed|failed|Error" "$OUT/pytest_gpu.txt" | tail -8
T0=$(date +%s)
timeout 170 python3 -m cce_autotune.cli --gpu h200 --vocab 256128 --hidden 2304 --tokens 8192 --kernels lse_forward,backward \
  --trials 30 --budget-minutes 2 --out "$OUT/tuned" > "$OUT/tune_256128.txt" 2>&1
echo "cce-tune gemma2: rc=$? wall=$(( $(date +%s) - T0 ))s"; grep -E "winner|trials,|done" "$OUT/tune_256128.txt" | tail -6
export CCE_AUTOTUNE_CONFIG_DIR=$OUT/tuned
python3 -m cce_autotune.cli show --gpu h200 --vocab 256128 --hidden 2304 --tokens 8192 > "$OUT/show.txt" 2>&1
timeout 200 python3 -m cce_autotune.bench --shapes gemma2,llama3,mistral --data lm --reps 60 --out "$OUT" --tag lm > "$OUT/bench_lm.txt" 2>&1
timeout 100 python3 -m cce_autotune.bench --shapes gemma2,llama3,mistral --data random --no-peers --methods cce_autotune,torch --reps 40 --out "$OUT" --tag random > "$OUT/bench_random.txt" 2>&1
tail -32 "$OUT/bench_lm.txt"; tail -14 "$OUT/bench_random.txt"
