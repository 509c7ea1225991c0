#!/usr/bin/env bash
# One whole GPU round on the device machine (see docs/gpu-machine.md): GPU tests, then the benchmarks,
# JSON results under $OUT, one log ($OUT/round.log), and a summary table printed last.
#   FLASHRT_COMMIT=<sha> scripts/gpu_round.sh [tests|bench|all|adopt|w2|compile|views|profile|nopdl|runtime|pi0|rtc|precision|smolvla] [extra pytest args]
# adopt: bench_adopt with graph capture and the torch.compile baseline in one process (issue 8; ~9 min:
# compile alone ~330 s; the JSON is rewritten after every phase). compile: bench_pi05 W2 with the
# lerobot-compile baseline (issue 3; ~7 min). pi0: bench_pi0 W2 with parity (vs the fp32 reference and LeRobot
# fp32 / bf16) and both LeRobot baselines (~7.5 min with the pi0.5 tuning cache carried, more cold: compile
# alone ~300 s; FLASHRT_PI0_SKIP_COMPILE=1 leaves it out, ~2-4 min). Each needs a device call of its own.
# (scripts/before_after.sh: the pi0.5 W2 before/after of an old source tree, a call of its own too.)
# Device call: carry [".whl"] (LeRobot 0.6.1 and its pinned wheels, see docs/gpu-machine.md; the LeRobot
# golden fixtures are tracked in test/fixtures/ and travel with the tree). The device tool returns at
# most 8 files: by default this writes 8 (W2 only; FLASHRT_WORKLOADS=w2,views1,views3 adds two: then run
# the profile separately).
# tests: the whole GPU suite outgrew one device call (~6-7 min at 3ca414b, 49 tests; 52 since): run it as two,
# FLASHRT_TEST_PART=engine and FLASHRT_TEST_PART=rest.
# FLASHRT_KEEP_TUNING=1: also return the engine's tuning cache ($OUT/tuning/*.json). Put those files into
# .cache/tuning/ here and add ".cache/tuning" to the call's carry: a fresh machine then skips the ~215 s of
# GEMM / attention tuning (the cache checks each choice once), which `compile` needs to fit in one call.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"; shift || true
OUT="${OUT:-$(mktemp -d)}"
LOG="$OUT/round.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Compiled kernels on the GPU (the kernel tests default to the interpreter otherwise).
export TRITON_INTERPRET=0
# Caches under the project's git-ignored .cache/ (add `/.cache/` to .git/info/exclude): the device keeps
# ignored files between the calls of a warm machine, so a later call skips Triton compiles, the engine's
# GEMM / attention tuning (~2 min per fresh process on an H200) and inductor's work for torch.compile.
mkdir -p .cache
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.cache/triton}" \
  FLASHRT_TUNING_CACHE="${FLASHRT_TUNING_CACHE:-$PWD/.cache/tuning}" \
  TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
status=0
if [[ "$what" == tests || "$what" == all ]]; then
  echo "== GPU tests ==" | tee -a "$LOG"
  # FLASHRT_TEST_PATHS: which test files (default: all); FLASHRT_TEST_PART=engine|rest splits the suite in two
  # device calls (test/test_pi05_engine.py alone, then the others), each well inside a call's 600 s
  paths="${FLASHRT_TEST_PATHS:-test}"
  if [[ "${FLASHRT_TEST_PART:-}" == engine ]]; then paths="test/test_pi05_engine.py"; fi
  if [[ "${FLASHRT_TEST_PART:-}" == rest ]]; then paths="test --ignore=test/test_pi05_engine.py"; fi
  # shellcheck disable=SC2086
  timeout "${FLASHRT_TEST_TIMEOUT:-560}" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=12 \
    --continue-on-collection-errors "$@" $paths 2>&1 | tee -a "$LOG" | tail -40
  status=${PIPESTATUS[0]}
fi
bench() {  # name, timeout seconds, arguments...
  local name=$1 limit=$2; shift 2
  echo "== $name $* ==" | tee -a "$LOG"
  timeout "$limit" python3 "benchmarks/$name.py" "$@" 2>&1 | tee -a "$LOG" | tail -20
}
if [[ "$what" == bench || "$what" == all ]]; then
  bench bench_pi05 420 --out-dir "$OUT" --workloads "${FLASHRT_WORKLOADS:-w2}" --skip-compile
  bench bench_runtime 260 --engine fused --json "$OUT/runtime_pi05_w2_fused.json"
  bench bench_capsule 90 --fused-kv --runtime --json "$OUT/capsule_h200.json"
  bench bench_kernels 180 --json "$OUT/kernels_h200.json"
  bench bench_adopt 240 --compile-mode none --json "$OUT/adopt_pi05_w2.json"
  bench profile_pi05 260 --json "$OUT/profile_pi05_w2.json"
fi
if [[ "$what" == adopt ]]; then
  bench bench_adopt 570 --capture --compile-mode default --json "$OUT/adopt_pi05_w2.json"
fi
if [[ "$what" == profile ]]; then  # per-kernel act/observe profile (~4 min)
  bench profile_pi05 560 --json "$OUT/profile_pi05_w2.json"
fi
if [[ "$what" == nopdl ]]; then  # the same profile without PDL (GPUs before sm_90 have none; ~4 min)
  bench profile_pi05 560 --pdl 0 --json "$OUT/profile_pi05_w2_nopdl.json"
fi
if [[ "$what" == views ]]; then  # 1 and 3 views (engine, act-only, LeRobot eager; ~4 min with the tuning cache)
  bench bench_pi05 560 --out-dir "$OUT" --workloads views1,views3 --skip-compile
fi
if [[ "$what" == w2 ]]; then  # W2 without the compiled baseline (~4 min with tuning, ~2 min with the cache)
  bench bench_pi05 560 --out-dir "$OUT" --workloads w2 --skip-compile
fi
if [[ "$what" == compile ]]; then
  bench bench_pi05 570 --out-dir "$OUT" --workloads w2
fi
if [[ "$what" == pi0 ]]; then  # pi0_w2.json + pi0_parity.json
  bench bench_pi0 570 --out-dir "$OUT" --workloads w2 --parity ${FLASHRT_PI0_SKIP_COMPILE:+--skip-compile}
fi
if [[ "$what" == precision ]]; then  # each expert GEMM alone, then the presets (~5 min with the tuning cache)
  bench bench_precision 150 --part gemms --json "$OUT/precision_gemms.json"
  bench bench_precision 400 --part presets --presets "${FLASHRT_PRESETS:-bf16,fp8,w4a16,fp8+w4a16}" \
    --json "$OUT/precision_pi05_w2.json"
fi
if [[ "$what" == rtc ]]; then  # rtc_pi05_w2.json + rtc_pi0_w2.json: RTC parity vs LeRobot, act with / without RTC
  bench bench_rtc 280 --model pi05 --json "$OUT/rtc_pi05_w2.json"
  bench bench_rtc 280 --model pi0 --json "$OUT/rtc_pi0_w2.json"
fi
if [[ "$what" == runtime ]]; then  # the contract runtime (both observe modes) and the capsules (~4 min with the cache)
  bench bench_runtime 400 --engine fused --json "$OUT/runtime_pi05_w2_fused.json"
  bench bench_capsule 150 --fused-kv --runtime --json "$OUT/capsule_h200.json"
fi
if [[ "$what" == smolvla ]]; then
  # smolvla_w2_<gpu>.json: SmolVLA W2, the engine vs LeRobot eager and torch.compile, parity (bf16 and fp32), the
  # per-stage bytes / FLOPs / floors (benchmarks/bench_smolvla.py). The JSON is rewritten after each phase, so a
  # run that the timeout ends while LeRobot compiles keeps every other number. FLASHRT_SMOLVLA_SKIP_COMPILE=1 leaves
  # the compiled baseline out; FLASHRT_SMOLVLA_TIMEOUT (default 540 s) bounds it inside one 600 s device call.
  echo "== bench_smolvla ==" | tee -a "$LOG"
  timeout "${FLASHRT_SMOLVLA_TIMEOUT:-540}" python3 benchmarks/bench_smolvla.py --out-dir "$OUT" \
    ${FLASHRT_SMOLVLA_SKIP_COMPILE:+--skip-compile} 2>&1 | tee -a "$LOG" | tail -60
  status=${PIPESTATUS[0]}
fi
if [[ -n "${FLASHRT_KEEP_TUNING:-}" ]]; then
  mkdir -p "$OUT/tuning" && cp .cache/tuning/*.json "$OUT/tuning/" 2>/dev/null
fi
python3 scripts/summarize_results.py "$OUT" | tee -a "$LOG"
exit $status
