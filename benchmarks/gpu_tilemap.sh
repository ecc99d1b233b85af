#!/usr/bin/env bash
# Device run: GPU tests of the tile map and the search-space sweep, then the tile-map probe.
set -uo pipefail
export PYTHONUNBUFFERED=1 CCE_AUTOTUNE_CACHE_DIR=/tmp/cc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 --tb=short tests/test_tile_map.py > "$OUT/pytest_gpu.txt" 2>&1
grep -E "FAILED|passed|failed|Error" "$OUT/pytest_gpu.txt" | tail -8
timeout 330 python3 benchmarks/probe_tilemap.py ${PROBE_SHAPES:-gemma2 llama3 mistral} 2>&1 | tee "$OUT/probe.txt" | grep -v Warning
