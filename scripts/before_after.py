"""The summary of scripts/before_after.sh: two W2 bench files (pi05_w2_old.json, pi05_w2_new.json in OUT) ->
pi05_w2_before_after.json in OUT, and a table. Exit 1 unless whole-decision and act-only p50 are within the
tolerance of each other (|new - old| / old).

    python3 scripts/before_after.py OUT WORK [--tolerance 0.02] [--old-commit SHA] [--new-commit SHA]
WORK holds old.status / new.status ("<exit code> <seconds>") written by the shell script.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import write_result  # noqa: E402

NUMBERS = ("flashrt_p50_ms", "act_only_p50_ms", "observe_ms", "act_ms", "lerobot_eager_p50_ms")
JUDGED = {"whole_decision": "flashrt_p50_ms", "act_only": "act_only_p50_ms"}
RESULT = "pi05_w2_before_after.json"


def run_summary(out: pathlib.Path, work: pathlib.Path, name: str) -> tuple[dict, dict | None]:
    """(the numbers of one run, its whole bench document or None where it wrote none)."""
    status = work / f"{name}.status"
    code, seconds = status.read_text().split() if status.exists() else ("?", "0")
    row = {"exit": code, "wall_s": float(seconds)}
    path = out / f"pi05_w2_{name}.json"
    if not path.exists():
        return row, None
    doc = json.loads(path.read_text())
    results, stages = doc.get("results", {}), doc.get("stages", {})
    row.update(commit=doc.get("commit"), flashrt_p50_ms=results.get("flashrt", {}).get("p50_ms"),
               act_only_p50_ms=results.get("flashrt-act-only", {}).get("p50_ms"),
               lerobot_eager_p50_ms=results.get("lerobot-eager", {}).get("p50_ms"),
               observe_ms=stages.get("observe", {}).get("ms"), act_ms=stages.get("act", {}).get("ms"),
               flashrt_build_s=doc.get("flashrt_build_s"), engine_options=doc.get("engine_options"),
               parity={k: {m: v[m] for m in ("cosine", "rel_l2", "pass")}
                       for k, v in doc.get("parity", {}).items() if isinstance(v, dict) and "cosine" in v})
    return row, doc


def gemm_picks(doc: dict) -> dict:
    """(rows, weight shape, geglu, dtype) -> chosen candidate, over the bench file's gemm_choices (the fusion
    fields differ between engine versions, so they are not part of the key)."""
    return {(g["m"], tuple(g["weight"]), g["geglu"], g["dtype"]): g["choice"] for g in doc.get("gemm_choices", [])}


def summarize(out: pathlib.Path, work: pathlib.Path, tolerance: float, old_commit: str, new_commit: str) -> dict:
    (old, old_doc), (new, new_doc) = run_summary(out, work, "old"), run_summary(out, work, "new")
    change = {k: (new[k] - old[k]) / old[k] for k in NUMBERS if old.get(k) and new.get(k)}
    passed = {label: key in change and abs(change[key]) <= tolerance for label, key in JUDGED.items()}
    passed["all"] = all(passed.values())
    extra = {"pass": passed, "tolerance": tolerance,
             "note": "one run each, old first, in separate processes on one machine; lerobot-eager is the same "
                     "code in both runs: its change is the machine's drift between them"}
    if old_doc and new_doc:
        a, b = gemm_picks(old_doc), gemm_picks(new_doc)
        both = a.keys() & b.keys()
        extra["gemm_choices_compared"] = {
            "shapes_in_both": len(both), "only_old": len(a.keys() - b.keys()), "only_new": len(b.keys() - a.keys()),
            "different_choice": sorted(f"m={k[0]} w={list(k[1])} {k[3]}: {a[k]} -> {b[k]}" for k in both
                                       if a[k] != b[k])}
    workload = {"model": "pi05", "workload": "w2", "bench": "benchmarks/bench_pi05.py --workloads w2 --skip-compile",
                "old_commit": old_commit, "new_commit": new_commit, "order": ["old", "new"]}
    return write_result(out / RESULT, workload, {"old": old, "new": new, "change": change}, extra)


def print_table(doc: dict, out=print) -> None:
    old, new, change = (doc["results"][k] for k in ("old", "new", "change"))

    def show(v):
        return f"{v:>10.3f}" if isinstance(v, (int, float)) else f"{'-':>10}"
    out(f"\n{'pi0.5 W2':<22} {'old':>10} {'new':>10} {'change':>9}")
    for key in NUMBERS:
        ch = f"{100 * change[key]:>+8.2f}%" if key in change else f"{'-':>9}"
        out(f"{key:<22} {show(old.get(key))} {show(new.get(key))} {ch}")
    w, p = doc["workload"], doc["pass"]
    out(f"old {w['old_commit']} exit {old['exit']} in {old['wall_s']:.0f} s; new {w['new_commit']} exit {new['exit']} "
        f"in {new['wall_s']:.0f} s; within {100 * doc['tolerance']:.0f}%: whole decision {p['whole_decision']}, "
        f"act-only {p['act_only']}")
    differ = doc.get("gemm_choices_compared", {}).get("different_choice")
    if differ:
        out(f"GEMM choices that differ ({len(differ)}): " + "; ".join(differ[:6]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=pathlib.Path)
    p.add_argument("work", type=pathlib.Path)
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--old-commit", default="old")
    p.add_argument("--new-commit", default="new")
    args = p.parse_args(argv)
    doc = summarize(args.out, args.work, args.tolerance, args.old_commit, args.new_commit)
    print_table(doc)
    print(f"wrote {args.out / RESULT}")
    return 0 if doc["pass"]["all"] else 1


if __name__ == "__main__":
    sys.exit(main())
