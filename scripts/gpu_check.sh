#!/usr/bin/env bash
# GPU checks: install every package in place with this machine's python, run the GPU-marked tests
# and the benchmarks, print a short table last. This is what runs on the H200 (no network, no
# nox); `nox -s gpu` calls it too. Logs and JSON go to $OUT when it is set.
#   scripts/gpu_check.sh [tests|bench|all] [extra nano-engine bench arguments]
#   (modes combine with commas: tests,serve)
#   scripts/gpu_check.sh serve [bench_serving.py arguments]   (the serving benchmark; first run
#   scripts/fetch_server_wheels.sh here and carry .whl/; the trace: benchmarks/traces; the
#   server's own extra flags in $SERVE_ARGS, e.g. "-dp 2 --data-parallel-backend mp")
#   scripts/gpu_check.sh sweep [sweep_decode.py arguments]   (the decode kernel's tiles, each
#   variant checked against the default's; a line per case with its fastest variant last)
#   scripts/gpu_check.sh install   (only the install, before one's own commands)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
WHAT=${1:-all}
shift || true
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

echo "== install ($($PY --version), torch $($PY -c "import torch; print(torch.__version__)"))"
for pkg in packages/*/; do
  $PY -m pip install -q --no-build-isolation --no-deps -e "$pkg" 2>&1 | tail -n 3
done
$PY -c 'from nano_kvcache import ops; assert ops.extension_available(), "extension not built"'
# The server's and structured outputs' dependencies travel as wheels in .whl/ (that machine has
# no network; scripts/fetch_server_wheels.sh gets them).
if [[ -d .whl ]]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi

tests_rc=0
if [[ ,$WHAT, == *,tests,* || $WHAT == all ]]; then
  echo "== GPU tests"
  set +e
  # (the server tests are CPU-only and import openai and fastapi, which that machine lacks)
  $PY -m pytest -q -m gpu packages/*/tests tests --ignore packages/engine/tests/test_server.py \
    --ignore packages/engine/tests/test_server_hostile.py \
    2>&1 | tee "$OUT/gpu_tests.log"
  tests_rc=${PIPESTATUS[0]}
  set -e
fi

if [[ ,$WHAT, == *,bench,* || $WHAT == all ]]; then
  echo "== benchmarks"
  $PY benchmarks/bench_store_kvcache.py --json "$OUT/bench_store_kvcache.json" \
    | tee "$OUT/bench_kernels.log"
  $PY benchmarks/bench_attention.py --json "$OUT/bench_attention.json" \
    | tee -a "$OUT/bench_kernels.log"
  $PY benchmarks/bench_moe.py --json "$OUT/bench_moe.json" | tee -a "$OUT/bench_kernels.log"
  $PY benchmarks/bench_fp8_matmul.py --json "$OUT/bench_fp8_matmul.json" \
    | tee -a "$OUT/bench_kernels.log"
  # nano-vllm's benchmark: Qwen3-0.6B config, dummy weights, 256 requests of 100-1024 in and out.
  for backend in ${ENGINE_BACKENDS:-triton}; do
    nano-engine bench benchmarks/configs/qwen3-0.6b.json --load-format dummy \
      --attention-backend "$backend" --max-model-len 2048 --json "$OUT/engine_$backend.json" "$@" \
      | tee "$OUT/engine_$backend.log"
  done
fi

if [[ ,$WHAT, == *,sweep,* ]]; then
  echo "== decode tile sweep"
  $PY benchmarks/sweep_decode.py --json "$OUT/sweep_decode.json" "$@" | tee "$OUT/sweep_decode.log"
fi

if [[ ,$WHAT, == *,serve,* ]]; then
  # The serving benchmark (its dependencies: .whl/, installed above); the trace is $TRACE.
  TRACE=${TRACE:-benchmarks/traces/azure_llm_2023_conv.csv}
  # shellcheck disable=SC2086  # (SERVE_ARGS: several flags)
  nano-engine -v serve benchmarks/configs/qwen3-0.6b.json --load-format dummy \
    --skip-tokenizer-init --max-model-len 16384 --served-model-name qwen3-0.6b --port 8000 \
    ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8000/health > /dev/null; do
    if ! kill -0 "$server" 2> /dev/null; then
      echo "the server exited:"; tail -n 20 "$OUT/server.log"; exit 1
    fi
    sleep 0.5
  done
  $PY benchmarks/bench_serving.py --model qwen3-0.6b --trace "$TRACE" "$@" \
    --json "$OUT/serving.json" --plot "$OUT/serving.png" | tee "$OUT/serving.log"
  kill -TERM "$server"
  wait "$server" || true
fi

echo "== summary"
[[ -f $OUT/gpu_tests.log ]] && echo "gpu tests: $(tail -n 1 "$OUT/gpu_tests.log")"
[[ -f $OUT/bench_kernels.log ]] && cat "$OUT/bench_kernels.log"
for f in "$OUT"/engine_*.log; do [[ -f $f ]] && echo "$(basename "$f" .log): $(head -n 2 "$f")"; done
[[ -f $OUT/sweep_decode.log ]] && { grep "fastest" "$OUT/sweep_decode.log" || true; }
[[ -f $OUT/serving.log ]] && cat "$OUT/serving.log" && grep "generation" "$OUT/server.log" | cut -c 12-
exit "$tests_rc"
