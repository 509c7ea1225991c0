#!/usr/bin/env bash
# Before/after of the pi0.5 engine on the GPU machine, in one device call: W2 through
# `benchmarks/bench_pi05.py --workloads w2 --skip-compile` (whole decision, act-only, stages, LeRobot eager,
# parity) from an old source tree, then the same from this tree; once each, old first, each in its own
# process with its own tuning cache. Writes into $OUT (at most 8 files come back from a device call):
#   pi05_w2_before_after.json  both runs' whole-decision and act-only p50 (and observe / act stage, LeRobot
#                              eager p50 as the control: the same code in both runs), the relative change
#                              new vs old, pass where |change| <= 2% (FLASHRT_BEFORE_AFTER_TOL), the GEMM choices
#                              that differ (tuning picks by timing: a difference may come from them)
#                              (scripts/before_after.py writes it from the two bench files)
#   pi05_w2_old.json, pi05_w2_new.json   each run's own bench file
#   before_after.log
#   tuning/*.json              with FLASHRT_KEEP_TUNING=1: the new tree's tuning cache; put the files into
#                              .cache/tuning/ here and carry ".cache/tuning" so a later call skips its ~215 s
#
# Here, once (the old tree is untracked and git-ignored; COMMIT names it in the JSON):
#   grep -q '^/.old/' .git/info/exclude || echo /.old/ >> .git/info/exclude
#   rm -rf .old && mkdir .old && git archive 9184cfe flashrt_core benchmarks config | tar -x -C .old \
#     && git rev-parse --short 9184cfe > .old/COMMIT
# The old bench_pi05.py takes the same arguments (`git show 9184cfe:benchmarks/bench_pi05.py`: --out-dir,
# --iters, --workloads, --skip-compile, --compile-mode) and writes the same pi05_w2.json layout.
#
# Device call (cold machine ~8.5 min: each tree tunes its GEMMs and attention, ~215 s, since the tuning key
# hashes the kernel sources; the old tree's cache format and paths are its own anyway):
#   carry:   [".whl", ".old"]
#   command: FLASHRT_COMMIT=<sha of this tree> scripts/before_after.sh .old
#   timeout_s: 600
# What each run gets (set here): PYTHONPATH=<its tree>:/tmp/site (the LeRobot 0.6.1 wheels of .whl/,
# installed by this script), TRITON_INTERPRET=0, FLASHRT_TUNING_CACHE=.cache/tuning-old (old) or
# .cache/tuning (new: gpu_round.sh's default, so a `scripts/gpu_round.sh pi0` after it on the same warm
# machine reuses the prefix's choices), TRITON_CACHE_DIR=.cache/triton for both (keyed by kernel source),
# FLASHRT_COMMIT=<old COMMIT> for the old run (its bench would read this checkout's HEAD otherwise).
# The whole script keeps inside FLASHRT_DEADLINE_S (default 585 s): the old run gets at most
# FLASHRT_OLD_LIMIT_S (300 s), the new one what is left.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD="${1:?usage: scripts/before_after.sh OLD_TREE_DIR (see the header)}"
OLD="$(cd "$OLD" && pwd)" || exit 2
[[ -f "$OLD/benchmarks/bench_pi05.py" && -d "$OLD/flashrt_core" ]] || { echo "$OLD: no old source tree"; exit 2; }
OUT="${OUT:-$(mktemp -d)}"
LOG="$OUT/before_after.log"
TOL="${FLASHRT_BEFORE_AFTER_TOL:-0.02}"
DEADLINE="${FLASHRT_DEADLINE_S:-585}"
OLD_COMMIT="$(cat "$OLD/COMMIT" 2>/dev/null || echo old)"
NEW_COMMIT="${FLASHRT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo new)}"
mkdir -p .cache "$OUT"
WORK="$(mktemp -d)"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TRITON_CACHE_DIR="$PWD/.cache/triton"
SITE=""
WHEELS="${FLASHRT_WHEELS:-.whl}"  # (the tests point it elsewhere)
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    && SITE=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"

run() {  # name, tree, commit, tuning dir, seconds
  local name=$1 tree=$2 commit=$3 tuning=$4 limit=$5
  echo "== $name: $tree at $commit, tuning cache $tuning, limit ${limit} s ==" | tee -a "$LOG"
  mkdir -p "$WORK/$name"
  local t0=$SECONDS
  (cd "$tree" && PYTHONPATH="$tree${SITE:+:$SITE}" FLASHRT_COMMIT="$commit" FLASHRT_TUNING_CACHE="$tuning" \
    timeout "$limit" python3 benchmarks/bench_pi05.py --out-dir "$WORK/$name" --workloads w2 --skip-compile) \
    2>&1 | tee -a "$LOG" | tail -15
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s ==" | tee -a "$LOG"
  cp "$WORK/$name/pi05_w2.json" "$OUT/pi05_w2_$name.json" 2>/dev/null
  echo "$rc $((SECONDS - t0))" > "$WORK/$name.status"
}

start=$SECONDS
run old "$OLD" "$OLD_COMMIT" "$PWD/.cache/tuning-old" "${FLASHRT_OLD_LIMIT_S:-300}"
left=$((DEADLINE - (SECONDS - start) - 15))
if (( left < 60 )); then
  echo "== new: skipped, ${left} s left ==" | tee -a "$LOG"
  echo "skipped 0" > "$WORK/new.status"
else
  run new "$PWD" "$NEW_COMMIT" "$PWD/.cache/tuning" "$left"
fi
if [[ -n "${FLASHRT_KEEP_TUNING:-}" ]]; then
  mkdir -p "$OUT/tuning" && cp .cache/tuning/*.json "$OUT/tuning/" 2>/dev/null
fi

FLASHRT_COMMIT="$NEW_COMMIT" python3 scripts/before_after.py "$OUT" "$WORK" --tolerance "$TOL" \
  --old-commit "$OLD_COMMIT" --new-commit "$NEW_COMMIT" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$status"
