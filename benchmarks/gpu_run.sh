#!/usr/bin/env bash
# Everything slime checks on one H200, in one device call, logs under $OUT. Needs the wheel parts of
# scripts/gpu_wheels.sh: the previous call (same warm machine) copied .whlparts/a/part_aa to /tmp/whl_a/,
# this call carries .whlparts/b. Steps: install wheels -> GPU tests -> engine benchmark -> trainer benchmark ->
# colocated GRPO smoke run. Each step's log goes to $OUT/<step>.log; a summary table prints last.
set -u
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
cat /tmp/whl_a/part_aa .whlparts/b/part_ab > /tmp/wheels.tar && mkdir -p /tmp/whl && tar xf /tmp/wheels.tar -C /tmp/whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/whl/*.whl > $OUT/install.log 2>&1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
step() { name=$1; shift; start=$(date +%s); "$@" > $OUT/$name.log 2>&1; rc=$?; echo "$name rc=$rc $(( $(date +%s) - start ))s" >> $OUT/summary.txt; }
step gpu_tests python3 -m pytest -q -m gpu tests
step bench_engine python3 benchmarks/bench_engine.py --preset qwen3-0.6b
step bench_train python3 benchmarks/bench_train.py
step grpo_smoke python3 benchmarks/gpu_grpo_smoke.py $OUT/grpo
cat $OUT/summary.txt; for f in gpu_tests bench_engine bench_train grpo_smoke; do echo "== $f"; tail -5 $OUT/$f.log; done
