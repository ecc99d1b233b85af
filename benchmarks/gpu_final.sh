#!/usr/bin/env bash
# Last device-machine run of a session: the side-by-side benchmark (LM-like data with the peers,
# random data for ours and PyTorch), then the tile-map probe of one shape. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 CCE_AUTOTUNE_CACHE_DIR=/tmp/cc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 --tb=short tests/test_tile_map.py > "$OUT/pytest_gpu.txt" 2>&1; tail -1 "$OUT/pytest_gpu.txt"
timeout 300 python3 -m cce_autotune.bench --shapes gemma2,llama3,mistral --data lm --reps 60 --out "$OUT" --tag lm > "$OUT/bench_lm.txt" 2>&1
timeout 120 python3 -m cce_autotune.bench --shapes gemma2,llama3,mistral --data random --no-peers --methods cce_autotune,cce_autotune_cold,torch --reps 40 --out "$OUT" --tag random > "$OUT/bench_random.txt" 2>&1
grep -v Warn "$OUT/bench_lm.txt" | tail -45; tail -22 "$OUT/bench_random.txt"
