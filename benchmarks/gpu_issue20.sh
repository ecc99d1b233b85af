#!/usr/bin/env bash
# Issue 20 (the runtime reshaped, behaviour unchanged) on one H200: this tree against the package as it
# was before the move (carry .old_pkg: `git archive 05ddb2f cce_autotune templates search_spaces
# tuned_configs | tar -x -C .old_pkg`), in one process each, alternating, on the same GPU.
#   PHASE=a  the CUDA tests of the planner, strategies, loss, layout and compile; then the benchmark on
#            LM-like data (gemma2, llama3, mistral), old / new / old / new.
#   PHASE=b  the layout tests on CUDA; real data (the small GPTs' hidden states; their training is cached
#            between the runs), old / new.
#   PHASE=c  the CUDA tests of the planner, loss, accuracy check, tile map and compile; the host time per call
#            (benchmarks/host_ab.py) old / new / old / new.
#   PHASE=h  the host time per call alone, old / new three times.
#   PHASE=d  the training loop at 50000 x 768, old / new.
# Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 CCE_AUTOTUNE_CACHE_DIR=/tmp/cc CCE_AUTOTUNE_DATA_DIR=/tmp/real
NEW=$PWD
OLD=$PWD/.old_pkg
bench() {  # tree tag args...
  local tree=$1 tag=$2; shift 2
  (cd /tmp && PYTHONPATH=$tree timeout ${BENCH_S:-150} python3 -m cce_autotune.bench --no-peers --out "$OUT" --tag "$tag" "$@") \
    > "$OUT/$tag.txt" 2>&1
  echo "== $tag rc $?"; grep -E "fw\+bw|train_step" "$OUT/$tag.txt" | tail -12
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
case "${PHASE:-a}" in
a)
  timeout ${TEST_S:-200} python3 -m pytest -q -x -p no:cacheprovider tests/test_layout.py tests/test_planner.py \
    tests/test_loss.py tests/test_accuracy.py tests/test_compile.py > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest rc $?"; tail -3 "$OUT/pytest_gpu.txt"
  M=torch,cce_autotune,cce_autotune_exact,cce_autotune_unlimited
  for run in 1 2; do
    bench "$OLD" "old_lm$run" --data lm --methods $M --reps ${REPS:-40}
    bench "$NEW" "new_lm$run" --data lm --methods $M --reps ${REPS:-40}
  done ;;
b)
  timeout ${TEST_S:-150} python3 -m pytest -q -x -p no:cacheprovider tests/test_layout.py > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest rc $?"; tail -3 "$OUT/pytest_gpu.txt"
  M=torch,cce_autotune,cce_autotune_exact,cce_autotune_unlimited
  BENCH_S=270 bench "$OLD" old_real --data real --shapes gpt768,gpt2048 --methods $M --reps ${REPS:-40}
  BENCH_S=120 bench "$NEW" new_real --data real --shapes gpt768,gpt2048 --methods $M --reps ${REPS:-40} ;;
c)
  X=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
  timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider $X tests/test_planner.py tests/test_loss.py \
    tests/test_accuracy.py tests/test_tile_map.py tests/test_compile.py > "$OUT/pytest_gpu2.txt" 2>&1
  echo "pytest rc $?"; tail -3 "$OUT/pytest_gpu2.txt"
  for run in 1 2 3; do
    for tree in OLD NEW; do
      (cd /tmp && PYTHONPATH=${!tree} timeout 60 python3 $NEW/benchmarks/host_ab.py --tag "$tree$run" \
        --shape 8192:50000:768 --shape 8192:128256:2048 --calls 150) 2>&1 | grep -v Warning
    done
  done
  ;;
h)
  for run in 1 2 3; do
    for tree in OLD NEW; do
      (cd /tmp && PYTHONPATH=${!tree} timeout 60 python3 $NEW/benchmarks/host_ab.py --tag "$tree$run" \
        --shape 8192:50000:768 --shape 8192:128256:2048 --calls 150) 2>&1 | grep -v -i "warn\|detach\|drift"
    done
  done ;;
d)
  BENCH_S=150 bench "$OLD" old_train --train --shapes gpt768 --methods torch,cce_autotune,cce_autotune_exact
  BENCH_S=150 bench "$NEW" new_train --train --shapes gpt768 --methods torch,cce_autotune,cce_autotune_exact ;;
esac
