#!/usr/bin/env bash
# Issue 22 (speed in the user's loop) on one H200. Phases ($PHASES, default "tests lm mixed train"):
#   tests: the CUDA tests of what changed (the launcher's series, the map's and the fingerprint's kernels, the
#          chunk loop replayed as a CUDA graph too);
#   lm:    the head's fw+bw side by side with PyTorch, Apple's CCE and Liger (carry .whl:
#          ../shared/tools/device-wheels cut-cross-entropy==25.1.1 liger-kernel==0.8.5) on LM-like data,
#          every mode of ours ($LM_SHAPES, $METHODS);
#   mixed: the fp32 classifier under autocast on real hidden states ($MIXED_SHAPES);
#   train: whole training steps, fp32 master weights under bf16 autocast ($TRAIN_SHAPES);
#   hf:    whole steps of Hugging Face models built from configs ($HF_FAMILIES, default llama,qwen3,gemma2),
#          unpatched, patched and with Liger's patch (carry transformers: --deps transformers==5.24.0);
#   grid:  `cce-bench --grid` on $GRID_DATA (default lm,sampled) at $GRID_SHAPES (default: every head), every
#          mode and the peers (the whole grid takes about 15 minutes on an H200: split it over two runs);
#          $GRID_METHODS names other methods (cce_autotune_replayed: loops replayed as CUDA graphs).
#   knobs: an A/B of kernel knobs in one run ($KNOBS, default an example:
#          lse_forward.num_splits=8,backward.chunk_v=2048): ours as dispatched and in exact mode, with the
#          configs' variants and with the knobs changed, at $KNOB_SHAPES on LM-like data.
# Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 CCE_AUTOTUNE_CACHE_DIR=/tmp/cc PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$HOME/site"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
PEERS=apple_cce,liger_flce
for phase in ${PHASES:-tests lm mixed train}; do
  case $phase in
  tests)
    X=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
    timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider $X tests/test_loss.py tests/test_loss_terms.py tests/test_errors.py \
      tests/test_determinism.py tests/test_planner.py tests/test_compile.py tests/test_variants.py tests/test_sweep.py \
      tests/test_launch.py tests/test_tile_map.py tests/test_accuracy.py tests/test_replay.py > "$OUT/pytest_gpu.txt" 2>&1
    echo "pytest rc $?"; tail -1 "$OUT/pytest_gpu.txt" ;;
  lm)
    M=${METHODS:-torch,cce_autotune,cce_autotune_exact,cce_autotune_deterministic,cce_autotune_unlimited,$PEERS}
    timeout ${LM_S:-300} python3 -m cce_autotune.bench --out "$OUT" --tag lm --data lm --shapes ${LM_SHAPES:-mistral,llama3,gemma2} \
      --methods "$M" --reps ${REPS:-30} > "$OUT/bench_lm.txt" 2>&1
    echo "== bench lm rc $?"; grep -E "^[a-z0-9]+ lm: .*fw\+bw|matmul" "$OUT/bench_lm.txt" | cut -c1-175 ;;
  mixed)
    timeout ${MIXED_S:-200} python3 -m cce_autotune.bench --out "$OUT" --tag mixed --data real --classifier fp32 \
      --shapes ${MIXED_SHAPES:-8192:32000:4096} --methods "torch,cce_autotune,cce_autotune_exact,cce_autotune_cast,$PEERS" \
      --reps ${REPS:-30} > "$OUT/bench_mixed.txt" 2>&1
    echo "== bench mixed rc $?"; grep -E "real: .*fw\+bw|matmul" "$OUT/bench_mixed.txt" | cut -c1-175 ;;
  train)
    timeout ${TRAIN_S:-300} python3 -m cce_autotune.bench --out "$OUT" --tag train --train --data real \
      --shapes ${TRAIN_SHAPES:-gpt768,gpt4096} --methods "torch,cce_autotune,cce_autotune_exact,cce_autotune_cast,$PEERS" \
      --loop-steps ${LOOP_STEPS:-30} > "$OUT/bench_train.txt" 2>&1
    echo "== bench train rc $?"; grep -E "train_step" "$OUT/bench_train.txt" | head -20 ;;
  hf)
    timeout ${HF_S:-400} python3 -m cce_autotune.bench --out "$OUT" --tag hf --train --hf ${HF_FAMILIES:-llama,qwen3,gemma2} \
      --methods unpatched,cce_autotune,liger_flce --loop-steps ${LOOP_STEPS:-20} > "$OUT/bench_hf.txt" 2>&1
    echo "== bench hf rc $?"; grep -E "train_step|hf" "$OUT/bench_hf.txt" | head -20 ;;
  grid)
    timeout ${GRID_S:-540} python3 -m cce_autotune.bench --grid --out "$OUT" --tag ${GRID_TAG:-grid} --data ${GRID_DATA:-lm,sampled} \
      ${GRID_SHAPES:+--shapes $GRID_SHAPES} ${GRID_METHODS:+--methods $GRID_METHODS} --reps ${REPS:-20} > "$OUT/bench_grid.txt" 2>&1
    echo "== bench grid rc $? (the CSV holds every head that finished)"; grep -E "fw\+bw" "$OUT/bench_grid.txt" | cut -c1-175 ;;
  knobs)
    timeout ${KNOB_S:-400} python3 -m cce_autotune.bench --grid --out "$OUT" --tag knobs --data lm \
      --shapes ${KNOB_SHAPES:-50257x768,50000x2048,32000x4096,128256x2048,128256x4096} \
      --knobs ${KNOBS:-lse_forward.num_splits=8,backward.chunk_v=2048} --reps ${REPS:-20} \
      --methods torch,cce_autotune_dispatched,cce_autotune_knobs,cce_autotune_exact_dispatched,cce_autotune_exact_knobs \
      > "$OUT/bench_knobs.txt" 2>&1
    echo "== bench knobs rc $?"; grep -E "fw|matmul" "$OUT/bench_knobs.txt" | cut -c1-175 ;;
  esac
done
