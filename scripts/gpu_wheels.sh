#!/usr/bin/env bash
# Build .gpubundle/site.tar.xz: the Python 3.12 packages the H200 image lacks or may lack (ray, sglang-router,
# fastapi, the rollout client's aiohttp, ...),
# installed into one folder, trimmed of what slime never loads (ray's Java jars, RLlib, Tune, Serve, Data, Train,
# dashboard source maps) and xz-compressed to ~50 MB, under the device tool's 64 MiB carry limit, so one call
# carries everything. benchmarks/gpu_run.sh unpacks it into /tmp/site. `.gpubundle/` is git-ignored through
# .git/info/exclude.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.gpubundle/" .git/info/exclude 2>/dev/null || echo "/.gpubundle/" >> .git/info/exclude
site=$(mktemp -d)
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any"
# megatron-core 0.16.1 (cp312 wheel, needs only torch, numpy, packaging): --train-backend megatron.
# xxhash, zstandard: disk delta weight sync (--update-weight-mode delta).
# transformers 5.24 (the image has 5.17): the version the CPU tests use (the VL image processors need >= 5.18).
# anthropic, bm25s, pylatexenc: the agent adapter tests, the search_r1 example and the math reward import them.
# openai (and its HTTP stack): benchmarks/bench_agent_adapter.py drives the agent adapter with the official client.
# fastapi 0.115 / starlette 0.46: newer fastapi imports opentelemetry, which the image lacks.
.venv/bin/python -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLATFORMS --target "$site" --no-compile \
  ray==2.60.0 jsonschema jsonschema-specifications referencing rpds-py \
  sglang-router==0.3.2 setproctitle orjson==3.13.0 \
  math-verify==0.9.0 latex2sympy2_extended antlr4-python3-runtime==4.13.2 \
  fastapi==0.115.12 starlette==0.46.2 pydantic pydantic-core annotated-types typing-inspection uvicorn \
  aiohttp multidict yarl frozenlist aiosignal aiohappyeyeballs propcache \
  openai==3.57.0 httpx2 httpcore2 truststore httpx httpcore h11 anyio sniffio distro jiter certifi idna \
  megatron-core==0.16.1 xxhash==4.1.0 zstandard==0.25.0 \
  anthropic==2.17.0 docstring-parser opentelemetry-api importlib-metadata zipp bm25s==0.3.16 \
  transformers==5.24.0 tokenizers==0.23.3 huggingface-hub==2.4.0 hf-xet typer click shellingham rich markdown-it-py mdurl
# pylatexenc (slime's math reward) ships only an sdist: a pure-Python wheel built here, installed the same way.
.venv/bin/python -m pip wheel -q --no-deps pylatexenc==2.10 -w "$site.wheels"
.venv/bin/python -m pip install -q --no-deps --target "$site" --no-compile "$site".wheels/pylatexenc-*.whl
rm -rf "$site.wheels"
(cd "$site" && rm -rf ray/jars ray/rllib ray/tune ray/serve ray/data ray/llm ray/train ray/air/examples bin &&
 find ray/dashboard/client/build -name "*.map" -delete)
mkdir -p .gpubundle
tar cf - -C "$site" . | xz -T0 -6 > .gpubundle/site.tar.xz
rm -rf "$site" .whlparts
ls -la .gpubundle
