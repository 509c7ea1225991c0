"""Parity of the fused pi0.5 engine (bf16) on the GPU, full size, every parameter normal(0, 0.02):
against the project's fp32 eager reference and against LeRobot 0.6.1 `PI05Policy.model.sample_actions`
(bf16 mode) with the same weights and noise. Target: action cosine >= 0.999, relative L2 <= 2e-2.

    python benchmarks/parity_lerobot.py [--views 1,2,3] [--json benchmarks/results/pi05_parity.json]
Exit status 1 if any comparison misses the target.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's flashrt_core first
from _common import write_result  # noqa: E402

from flashrt_bench.harness import PARITY_TARGETS, bench_pi05  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--views", default="1,2,3")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="benchmarks/results/pi05_parity.json")
    args = p.parse_args(argv)
    shared: dict = {}
    results, ok = {}, True
    for views in (int(v) for v in args.views.split(",")):
        run = bench_pi05(views=views, prompt_len=args.prompt_len, dtype=args.dtype, baselines=(), seed=args.seed,
                         timing=False, shared=shared)
        parity = run["extra"].get("parity", {})
        results[f"views{views}"] = parity
        for name, r in parity.items():
            if isinstance(r, dict) and "cosine" in r:
                ok &= r["pass"] or name == "reference_fp32_vs_lerobot"
                print(f"views {views}  {name:<28} cosine {r['cosine']:.6f}  rel L2 {r['rel_l2']:.2e}  "
                      f"{'PASS' if r['pass'] else 'FAIL'}", flush=True)
    workload = {"model": "pi05", "views": args.views, "prompt_len": args.prompt_len, "steps": 10, "chunk": 50,
                "dtype": args.dtype, "weights": "normal(0, 0.02)", "seed": args.seed, "targets": PARITY_TARGETS}
    write_result(args.json, workload, results)
    print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
