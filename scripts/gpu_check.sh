#!/usr/bin/env bash
# GPU checks: install every package in place with this machine's python, run the GPU-marked tests
# and the kernel benchmarks, print a short table last. This is what runs on the H200 (no network,
# no nox); `nox -s gpu` calls it too. Results (logs, JSON) go to $OUT when it is set.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1

echo "== install ($($PY --version), torch $($PY -c "import torch; print(torch.__version__)"), scikit-build-core $($PY -c "import scikit_build_core as s; print(s.__version__)"))"
for pkg in packages/*/; do
  $PY -m pip install -q --no-build-isolation --no-deps -e "$pkg" 2>&1 | tail -n 3
done
$PY -c 'from nano_kvcache import ops; assert ops.extension_available(), "extension not built"'

echo "== GPU tests"
set +e
$PY -m pytest -q -m gpu packages/*/tests tests "$@" 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
set -e

echo "== benchmarks"
$PY benchmarks/bench_store_kvcache.py --json "$OUT/bench_store_kvcache.json" | tee "$OUT/bench.log"

echo "== summary"
echo "gpu tests: $(tail -n 1 "$OUT/gpu_tests.log")"
cat "$OUT/bench.log"
exit "$tests_rc"
