#!/usr/bin/env bash
# One whole GPU round on the device machine (see ../shared/notes/gpu.md): GPU tests, then every
# benchmark, JSON results copied to $OUT, and a summary table printed last.
#   scripts/gpu_round.sh [tests|bench|all] [extra pytest args]
# Wheels carried in .whl/ (LeRobot 0.6.1 and its pinned deps) are installed into /tmp/site first.
# Device call: carry [".whl", ".fixtures"], command `FLASHRT_COMMIT=<sha> scripts/gpu_round.sh all`.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"; shift || true
OUT="${OUT:-$(mktemp -d)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Compiled kernels on the GPU (the kernel tests default to the interpreter otherwise).
export TRITON_INTERPRET=0
# shared/ does not travel to the GPU machine: carry a copy of ../shared/reference as .fixtures/reference.
[ -d .fixtures/reference ] && export FLASHRT_SHARED="$PWD/.fixtures"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
status=0
if [[ "$what" == tests || "$what" == all ]]; then
  echo "== GPU tests =="
  timeout 900 python3 -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
    --junitxml="$OUT/gpu_tests.xml" "$@" test 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ "$what" == bench || "$what" == all ]]; then
  for bench in ${FLASHRT_BENCHES:-benchmarks/bench_*.py}; do
    echo "== $bench =="
    timeout "${FLASHRT_BENCH_TIMEOUT:-600}" python3 "$bench" --out-dir "$OUT" 2>&1 | tee "$OUT/$(basename "$bench" .py).log" | tail -30
  done
fi
python3 scripts/summarize_results.py "$OUT"
exit $status
