#!/usr/bin/env bash
# Issue 9 on the device machine: GPU tests of the loss terms, mixed precision and compile, then the
# mixed-precision benchmark (fp32 classifier, bf16 e) at gemma2 and llama3 and the training loop with
# the fp32 lm_head weight. Results under $OUT. Carry .whl (../shared/tools/device-wheels with
# cut-cross-entropy==25.1.1 liger-kernel==0.8.5).
set -uo pipefail
export PYTHONUNBUFFERED=1 CCE_AUTOTUNE_CACHE_DIR=/tmp/cc CCE_AUTOTUNE_DATA_DIR=/tmp/real
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${TEST_S:-170} python3 -m pytest -q -p no:cacheprovider -n 8 --tb=short tests/test_loss_terms.py tests/test_compile.py tests/test_loss.py tests/test_tile_map.py tests/test_planner.py > "$OUT/pytest_gpu.txt" 2>&1
CCE_AUTOTUNE_EXPLAIN=1 timeout ${BENCH_S:-150} python3 -m cce_autotune.bench --classifier fp32 --data lm --shapes gemma2,llama3 --reps ${REPS:-50} --out "$OUT" --tag mixed --methods torch,cce_autotune,cce_autotune_cast,cce_autotune_all16,apple_cce,liger_flce > "$OUT/bench_mixed.txt" 2>&1
timeout ${TRAIN_S:-120} python3 -m cce_autotune.bench --train --shapes gpt768,gpt2048 --methods torch,cce_autotune,cce_autotune_cast,apple_cce,liger_flce --out "$OUT" --tag train > "$OUT/train.txt" 2>&1
rm -f "$OUT"/*.png
grep -E "plan \(|FAIL|Error|Traceback" "$OUT/bench_mixed.txt" | sort | uniq -c | head -20
grep -E "fw\+bw|fw " "$OUT/bench_mixed.txt" | tail -30; grep train_step "$OUT/train.txt" | head -12; tail -15 "$OUT/pytest_gpu.txt"
