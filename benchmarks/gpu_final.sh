#!/usr/bin/env bash
# Last device-machine run of a session: GPU tests of the tile map, cce-tune of the three benchmark
# shapes, then the side-by-side benchmark with the freshly tuned configs (LM-like data with the
# peers, random data for ours and PyTorch). Results under $OUT (at most 8 files come back).
set -uo pipefail
export PYTHONUNBUFFERED=1 CCE_AUTOTUNE_CACHE_DIR=/tmp/cc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 --tb=line tests/test_tile_map.py 2>&1 | tail -3
for spec in "256128 2304 ${BUDGET_GEMMA:-100}" "128256 4096 ${BUDGET_LLAMA:-90}" "32768 4096 ${BUDGET_MISTRAL:-80}"; do
  set -- $spec
  T0=$(date +%s)
  timeout $(( $3 + 40 )) python3 -m cce_autotune.cli --gpu h200 --vocab $1 --hidden $2 --tokens 8192 --trials 30 \
    --budget-minutes $(python3 -c "print($3/60)") --out "$OUT/tuned" > /tmp/tune_$1.txt 2>&1
  echo "cce-tune --vocab $1 --hidden $2: rc=$? wall=$(( $(date +%s) - T0 ))s" | tee -a "$OUT/tune_summary.txt"
  grep -E "winner|failed, |done" /tmp/tune_$1.txt | tail -8 >> "$OUT/tune_summary.txt"
done
rm -f "$OUT/tuned/"*.lock
export CCE_AUTOTUNE_CONFIG_DIR=$OUT/tuned
timeout 240 python3 -m cce_autotune.bench --shapes gemma2,llama3,mistral --data lm --reps 60 --out "$OUT" --tag lm > "$OUT/bench_lm.txt" 2>&1
timeout 120 python3 -m cce_autotune.bench --shapes gemma2,llama3,mistral --data random --no-peers --methods cce_autotune,cce_autotune_cold,torch --reps 40 --out "$OUT" --tag random > "$OUT/bench_random.txt" 2>&1
rm -f "$OUT/bench_NVIDIA_H200_random.png"
cat "$OUT/tune_summary.txt" | grep -E "rc=|winner"; grep -v Warn "$OUT/bench_lm.txt" | tail -45; tail -22 "$OUT/bench_random.txt"
