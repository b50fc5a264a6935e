#!/usr/bin/env bash
# Download the wheels the H200 image lacks (Python 3.12) and split them into two parts under 60 MB each, for two
# consecutive device calls (the device tool carries at most 64 MiB per call). Writes .whlparts/{a,b}/ (git-ignored
# through .git/info/exclude). See benchmarks/gpu_run.sh for how the parts are joined and installed there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whlparts/" .git/info/exclude 2>/dev/null || echo "/.whlparts/" >> .git/info/exclude
rm -rf .whlparts && mkdir -p .whlparts/all .whlparts/a .whlparts/b
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any"
# fastapi 0.115 / starlette 0.46: newer fastapi imports opentelemetry, which the image lacks.
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLATFORMS -d .whlparts/all \
  ray==2.60.0 jsonschema jsonschema-specifications referencing rpds-py \
  sglang-router==0.3.2 setproctitle orjson \
  math-verify==0.9.0 latex2sympy2_extended antlr4-python3-runtime==4.13.2 \
  fastapi==0.115.12 starlette==0.46.2 pydantic pydantic-core annotated-types typing-inspection uvicorn
tar cf .whlparts/wheels.tar -C .whlparts/all .
split -b 57M .whlparts/wheels.tar .whlparts/part_
mv .whlparts/part_aa .whlparts/a/ && mv .whlparts/part_ab .whlparts/b/
rm -rf .whlparts/all .whlparts/wheels.tar
ls -la .whlparts/a .whlparts/b
