#!/usr/bin/env bash
# Issue 21 (defects) on one H200: the CUDA tests of what changed, then this tree against the package at
# the end of issue 20 (carry .old_pkg: `git archive 81dd965 cce_autotune templates search_spaces
# tuned_configs | tar -x -C .old_pkg`), alternating, in one session: two losses on one classifier
# (benchmarks/two_losses.py), the head's fw+bw on LM-like data, and the host time per call
# (benchmarks/host_ab.py: the verdict's fingerprint is one more small copy on reused-verdict calls).
# Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 CCE_AUTOTUNE_CACHE_DIR=/tmp/cc
NEW=$PWD
OLD=$PWD/.old_pkg
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
X=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider $X tests/test_loss_terms.py tests/test_accuracy.py \
  tests/test_codegen.py tests/test_loss.py tests/test_errors.py tests/test_dispatch.py tests/test_db.py \
  tests/test_heads.py tests/test_compile.py tests/test_planner.py > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_gpu.txt"
for tree in OLD NEW; do
  (cd /tmp && PYTHONPATH=${!tree} timeout 120 python3 $NEW/benchmarks/two_losses.py --tag "$tree" \
    --shape 8192:128256:2048 --steps ${STEPS:-40}) 2>&1 | grep -v -i "warn\|detach"
done
for run in 1 2; do
  for tree in OLD NEW; do
    (cd /tmp && PYTHONPATH=${!tree} timeout 60 python3 $NEW/benchmarks/host_ab.py --tag "$tree$run" \
      --shape 8192:50000:768 --shape 8192:128256:2048 --calls 150) 2>&1 | grep -v -i "warn\|detach\|drift"
  done
done
for run in $(seq ${BENCH_RUNS:-2}); do
  for tree in OLD NEW; do
    (cd /tmp && PYTHONPATH=${!tree} timeout 150 python3 -m cce_autotune.bench --no-peers --out "$OUT" \
      --tag "$tree$run" --data lm --shapes gemma2,llama3 --methods torch,cce_autotune,cce_autotune_exact \
      --reps ${REPS:-30}) > "$OUT/bench_$tree$run.txt" 2>&1
    echo "== bench $tree$run rc $?"; grep -E "fw\+bw" "$OUT/bench_$tree$run.txt" | tail -8
  done
done
