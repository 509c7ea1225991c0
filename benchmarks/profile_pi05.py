"""Where the time of a pi0.5 decision goes on the GPU: per-kernel profile of the captured stage graphs, and
graph-timed GEMM candidates at the action expert's shapes (GPU round).

  python benchmarks/profile_pi05.py --json benchmarks/results/profile_pi05_w2.json [--views 2] [--pdl 0]

For each stage (`observe`, `act`) it replays the CUDA graph under torch.profiler (CUPTI records the kernels
of a graph replay one by one) and prints, per kernel name: launches per replay, total and mean GPU time,
and the share of the stage's wall time; "gaps" is wall time minus summed kernel time (launch latency and
idle SMs between dependent kernels). It also prints the engine's own GEMM choices: the picker timed cuBLAS
and every skinny Triton configuration in a CUDA graph with the weights cycled past L2 (`gemm_choices` in
the JSON keeps every candidate's time). Engine variants are not built here: the engine has no A/B flags
(the decisions and their A/B numbers: docs/performance-history.md).
"""
from __future__ import annotations

import argparse
import ast
import collections
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _common import write_result  # noqa: E402

from flashrt_bench.harness import CEILINGS, random_inputs, random_state, workload_config  # noqa: E402


def profile_graph(replay, reps: int = 5) -> dict:
    """Kernel table of `replay` (one stage graph replay), averaged over `reps` replays."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start.record()
        for _ in range(reps):
            replay()
        end.record()
        torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / reps
    per = collections.defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.device_time > 0:
            per[evt.name][0] += 1
            per[evt.name][1] += evt.device_time
    rows = sorted(({"kernel": k[:110], "launches": n / reps, "total_us": t / reps, "mean_us": t / max(n, 1),
                    "share": t / reps / wall_us} for k, (n, t) in per.items()), key=lambda r: -r["total_us"])
    busy = sum(r["total_us"] for r in rows)
    launches = sum(r["launches"] for r in rows)
    return {"wall_us": wall_us, "kernel_us": busy, "gaps_us": wall_us - busy, "launches": launches,
            "gap_per_launch_us": (wall_us - busy) / max(launches, 1), "kernels": rows}


def print_profile(stage: str, p: dict, top: int = 25) -> None:
    print(f"\n== {stage}: wall {p['wall_us']:.0f} us, kernels {p['kernel_us']:.0f} us, gaps {p['gaps_us']:.0f} us, "
          f"{p['launches']:.0f} launches ({p['gap_per_launch_us']:.2f} us gap each)")
    print(f"{'kernel':<70} {'n':>6} {'total us':>9} {'mean us':>8} {'share':>6}")
    for r in p["kernels"][:top]:
        print(f"{r['kernel'][:70]:<70} {r['launches']:>6.0f} {r['total_us']:>9.1f} {r['mean_us']:>8.2f} "
              f"{100 * r['share']:>5.1f}%")


def gemm_table(report: list[dict], dtype_bytes: int = 2) -> None:
    """The engine picker's graph-timed candidates per GEMM shape (weights cycled past L2), as GB/s."""
    for r in report:
        n, k = r["weight"]
        times = {c: t for c, t in (r["ms"] or {}).items() if isinstance(t, float)}
        if not times:
            continue
        nbytes = n * k * dtype_bytes
        best = min(times, key=times.get)
        fused = "".join(f" +{f}" for f in r.get("fused", []))
        print(f"gemm [{r['m']}x{k}] x [{n}x{k}]^T{' geglu' if r['geglu'] else ''}{fused}: chose {r['choice']} "
              f"{times[r['choice']] * 1e3:.2f} us ({nbytes / times[r['choice']] / 1e6:.0f} GB/s); fastest {best}; "
              f"cublas {times.get('cublas', float('nan')) * 1e3:.2f} us")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--json", default="benchmarks/results/profile_pi05_w2.json")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--gemm", default="auto", help="engine GEMM mode: auto, torch, triton")
    p.add_argument("--pdl", type=int, default=1, help="1: programmatic dependent launch (default), 0: off")
    p.add_argument("--no-attention-tuning", action="store_true")
    p.add_argument("--gemm-configs", help="only these skinny GEMM candidates, e.g. '[(32, 256, 1, 4, 3)]' (a "
                   "shorter tuning when device time is short; the JSON records them)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from flashrt_core.engine import gemm as engine_gemm
    from flashrt_core.models.pi05 import convert
    from flashrt_core.models.pi05.engine import Pi05Engine

    if args.gemm_configs:
        engine_gemm.CONFIGS[:] = [tuple(c) for c in ast.literal_eval(args.gemm_configs)]

    config = workload_config(args.views, 48, 10, 50)
    w32 = convert(config, random_state(config, 0, "cuda"))
    options = dict(dtype=torch.bfloat16, gemm=args.gemm, pdl=bool(args.pdl),
                   tune_attention=not args.no_attention_tuning)
    engine = Pi05Engine(w32, device="cuda", **options)
    del w32
    inputs = random_inputs(config, 0, "cuda")
    names = ("images", "image_masks", "lang_tokens", "lang_mask", "noise")
    engine.sample_actions(*(inputs[k] for k in names))
    torch.cuda.synchronize()
    print(f"engine built: pdl={engine.pdl}, gemm choices " + ", ".join(
        f"{r['weight']}{'g' if r['geglu'] else ''}:{r['choice']}" for r in engine.linear.report()))
    print("attention choices: " + ", ".join(f"{r['q']}:{r['choice']}" for r in engine.attend.report()))
    profiles = {}
    for stage in ("observe", "act"):
        profiles[stage] = profile_graph(getattr(engine, stage), args.reps)
        print_profile(stage, profiles[stage], args.top)
    gemm_table(engine.linear.report())
    workload = {"model": "pi05", "views": args.views, "prompt_len": 48, "steps": 10, "chunk": 50,
                "dtype": "bfloat16", "gemm_mode": args.gemm, "pdl": bool(args.pdl),
                "tune_attention": not args.no_attention_tuning, "reps": args.reps,
                "gemm_configs": [list(c) for c in engine_gemm.CONFIGS]}
    extra = {"gemm_choices": engine.linear.report(), "attention_choices": engine.attend.report(),
             "ceilings": CEILINGS}
    write_result(args.json, workload, {"profiles": profiles}, extra)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
