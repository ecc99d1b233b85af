#!/usr/bin/env bash
# Last device-machine run of a session: GPU tests of the planner's strategies, then the side-by-side
# benchmark on LM-like and real data (with the peers), random data, and the training loop.
# Results under $OUT (at most 8 files come back). Carry .whl (../shared/tools/device-wheels with
# cut-cross-entropy==25.1.1 liger-kernel==0.8.5).
set -uo pipefail
export PYTHONUNBUFFERED=1 CCE_AUTOTUNE_CACHE_DIR=/tmp/cc CCE_AUTOTUNE_DATA_DIR=/tmp/real
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${TEST_S:-90} python3 -m pytest -q -x -p no:cacheprovider -n 8 --tb=short tests/test_planner.py tests/test_tile_map.py > "$OUT/pytest_gpu.txt" 2>&1
CCE_AUTOTUNE_EXPLAIN=1 timeout ${BENCH_S:-330} python3 -m cce_autotune.bench --data lm,real --reps ${REPS:-50} --out "$OUT" --tag lm_real > "$OUT/bench_lm_real.txt" 2>&1
timeout ${RANDOM_S:-60} python3 -m cce_autotune.bench --data random --no-peers --methods torch,cce_autotune,cce_autotune_exact --reps 40 --out "$OUT" --tag random > "$OUT/bench_random.txt" 2>&1
rm -f "$OUT"/bench_*random.png
timeout ${TRAIN_S:-100} python3 -m cce_autotune.bench --train --shapes gpt768,gpt2048 --methods torch,cce_autotune,cce_autotune_exact,apple_cce,liger_flce --out "$OUT" --tag train > "$OUT/train.txt" 2>&1
grep -E "plan \(|FAIL|Error|Traceback" "$OUT/bench_lm_real.txt" | sort | uniq -c | head -30
tail -60 "$OUT/bench_lm_real.txt" | grep -E "fw\+bw|fw "; grep -E "fw\+bw" "$OUT/bench_random.txt" | tail -9; grep train_step "$OUT/train.txt" | head -10; tail -3 "$OUT/pytest_gpu.txt"
