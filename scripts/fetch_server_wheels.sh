#!/usr/bin/env bash
# Download the server's dependencies (nano-engine[serve], and httpx for
# benchmarks/bench_serving.py) and structured outputs' (nano-engine[structured], and jsonschema
# for its tests) as Python 3.12 wheels into .whl/, for the GPU machine, which has no network:
# `scripts/gpu_check.sh serve` (or `install`) installs them.
# Run here (with network); then carry .whl in the device call (the trace is in benchmarks/traces).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.3 pydantic_core==2.50.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 \
  opentelemetry-api==1.45.2 uvicorn==0.54.0 httptools==0.9.0 uvloop==0.23.0 prometheus_client==0.26.0 \
  typing_extensions==4.16.0 anyio==4.16.0 h11==0.16.0 click==8.5.1 idna==3.20 \
  httpx==0.28.1 httpcore==1.0.9 certifi partial-json-parser==0.2.1.1.post7 \
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  attrs
ls .whl
