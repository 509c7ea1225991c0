"""pi0.5 on the GPU: the fused engine vs LeRobot 0.6.1 eager and torch.compile, in one process (GPU round).

Writes into --out-dir, each file as soon as its workload is done (so a run cut short keeps what finished):
  pi05_w2.json          W2 (2 views, 48-token prompt, 10 steps, chunk 50, bf16) with lerobot-eager and
                        lerobot-compile, per-stage TFLOP/s and GB/s, parity
  pi05_views1.json      1 view,  lerobot-eager only (a new input shape would mean another compile)
  pi05_views3.json      3 views, lerobot-eager only
  pi05_w2_siglip_fp32.json  W2 with SigLIP in fp32 as LeRobot keeps it (speed and parity of that choice)
  pi05_parity.json      the parity section of every workload above, side by side (a run without W2 writes
                        pi05_parity_views.json for views1 / views3, else pi05_parity_<workloads>.json, so
                        that it never replaces the W2 run's file)
The compiled baseline (its first call compiles for minutes) runs right after W2 and is added to pi05_w2.json.
benchmarks/bench_pi0.py is this script for pi0 (`main(argv, kind="pi0")`: files pi0_*.json).

    python benchmarks/bench_pi05.py --out-dir benchmarks/results [--workloads w2,views1] [--skip-compile]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's flashrt_core first
from _common import write_result  # noqa: E402

from flashrt_bench.harness import (PARITY_TARGETS, bench_compiled, bench_model, document, print_table,  # noqa: E402
                                random_inputs, workload_config)
from flashrt_bench.lerobot import COMPILE_NOTE  # noqa: E402

WORKLOADS = ("w2", "views1", "views3", "siglip32")


def result_file(workload: str, kind: str = "pi05") -> str:
    """pi05_w2.json, pi05_views1.json, pi05_views3.json, pi05_w2_siglip_fp32.json (pi0: pi0_...)."""
    return f"{kind}_" + {"siglip32": "w2_siglip_fp32"}.get(workload, workload) + ".json"


def parity_file(workloads: list[str], kind: str = "pi05") -> str:
    """The parity summary's file name for a run of these workloads: pi05_parity.json only with W2 in it."""
    if "w2" in workloads:
        return f"{kind}_parity.json"
    if set(workloads) <= {"views1", "views3"}:
        return f"{kind}_parity_views.json"
    return f"{kind}_parity_" + "_".join(workloads) + ".json"


def write(out_dir: pathlib.Path, name: str, run: dict) -> None:
    doc = document(run)
    print_table(doc)
    path = out_dir / name
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {path}", flush=True)


def add_compiled(out, w2, shared, mode, iters, kind: str = "pi05") -> None:
    """Add lerobot-compile to the W2 run (same process, weights and inputs, so the ratio is from one run)."""
    config = workload_config(2, 48, 10, 50, kind)
    inputs = random_inputs(config, 0, "cuda")
    try:
        w2["results"]["lerobot-compile"] = bench_compiled(shared["lerobot"], inputs, mode, 3, iters, print)
        w2["extra"]["notes"].append(COMPILE_NOTE % mode)
    except Exception as exc:
        w2["results"]["lerobot-compile"] = {"error": f"{type(exc).__name__}: {exc}"}
    r = w2["results"]["lerobot-compile"]
    if "p50_ms" in r:
        r["flashrt_speedup"] = r["p50_ms"] / w2["results"]["flashrt"]["p50_ms"]
    write(out, result_file("w2", kind), w2)


def parse_args(argv=None, doc: str | None = None):
    p = argparse.ArgumentParser(description=doc or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma list of w2, views1, views3, siglip32 (default: all)")
    p.add_argument("--skip-compile", action="store_true", help="leave out lerobot-compile (minutes of compiling)")
    p.add_argument("--compile-mode", default="default")
    p.add_argument("--parity", action=argparse.BooleanOptionalAction, default=True,
                   help="the parity checks (default: on; --no-parity leaves them out)")
    p.add_argument("--engine", default="fused", choices=("fused", "reference"),
                   help="flashrt rows: the fused engine (default) or the eager reference")
    return p.parse_args(argv)


def main(argv=None, kind: str = "pi05", doc: str | None = None) -> int:
    args = parse_args(argv, doc)
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    todo = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in todo if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown[0]!r}")
    shared: dict = {}  # random weights and the LeRobot policy, built once for every workload
    t0 = time.time()
    common = dict(prompt_len=48, steps=10, chunk=50, dtype="bf16", iters=args.iters, shared=shared,
                  parity=args.parity, engine=args.engine)
    w2, parity = None, {}
    for name in todo:
        file = result_file(name, kind)
        if name == "w2":
            w2 = bench_model(kind, views=2, baselines=("lerobot-eager",), **common)
            write(out, file, w2)
            if not args.skip_compile and "lerobot" in shared:  # before the other workloads: the key ratio
                add_compiled(out, w2, shared, args.compile_mode, args.iters, kind)
        elif name in ("views1", "views3"):
            write(out, file, bench_model(kind, views=int(name[-1]), baselines=("lerobot-eager",), **common))
        else:  # siglip32
            write(out, file, bench_model(kind, views=2, baselines=(), vision_dtype="fp32", **common))
        print(f"[bench_{kind}] {name} done, {time.time() - t0:.0f} s so far", flush=True)
        if args.parity:
            parity[name] = json.loads((out / file).read_text()).get("parity", {})
            write_result(out / parity_file(todo, kind), {"model": kind, "workloads": list(parity),
                                                         "weights": "normal(0, 0.02)", "targets": PARITY_TARGETS},
                         parity)
    return 0


if __name__ == "__main__":
    sys.exit(main())
