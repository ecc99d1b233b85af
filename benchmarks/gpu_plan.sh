#!/usr/bin/env bash
# Device-machine session of the planner work (issue 8): GPU tests of the strategies, the planner's
# choices against forced strategies and the peers (LM-like and real data), a profile of one mapped
# call at a small real head, and the training-loop benchmark. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 CCE_AUTOTUNE_CACHE_DIR=/tmp/cc CCE_AUTOTUNE_DATA_DIR=/tmp/real
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${TEST_S:-150} python3 -m pytest -q -x -p no:cacheprovider -n 8 --tb=short tests/test_planner.py tests/test_tile_map.py 2>&1 | tail -4
CCE_AUTOTUNE_EXPLAIN=1 timeout ${PROBE_S:-300} python3 benchmarks/probe_plan.py ${SHAPES:-lm:gemma2,lm:llama3,lm:mistral,real:gpt768,real:gpt2048,real:gpt4096} > $OUT/probe.txt 2>&1
timeout 60 python3 benchmarks/profile_call.py real gpt768 > $OUT/profile.txt 2>&1
grep -v Warn $OUT/probe.txt | grep -E "plan|FAIL|Error|Traceback" | sort | uniq -c | sort -rn | head -40
timeout ${TRAIN_S:-150} python3 -m cce_autotune.bench --train --shapes ${TRAIN_SHAPES:-gpt768,gpt2048} --methods torch,cce_autotune,cce_autotune_exact,apple_cce,liger_flce --out $OUT --tag train > $OUT/train.txt 2>&1
grep -E "train_step|FAIL|Error" $OUT/train.txt | head -20
grep -E "^(gemma2|llama3|mistral|gpt)" $OUT/probe.txt | grep -E "fw\+bw| fw " | head -80
