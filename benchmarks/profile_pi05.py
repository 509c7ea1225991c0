"""Where the time of a pi0.5 decision goes on the GPU: per-kernel profile of the captured stage graphs, and
graph-timed GEMM candidates at the action expert's shapes (GPU round).

  python benchmarks/profile_pi05.py --json benchmarks/results/profile_pi05_w2.json [--views 2]

For each stage (`observe`, `act`) it replays the CUDA graph under torch.profiler (CUPTI records the kernels
of a graph replay one by one) and prints, per kernel name: launches per replay, total and mean GPU time,
and the share of the stage's wall time; "gaps" is wall time minus summed kernel time (launch latency and
idle SMs between dependent kernels). The GEMM section times cuBLAS and every skinny Triton configuration
of `engine_gemm.CONFIGS` inside a CUDA graph, with the weight rotated through enough copies to overflow
L2 (as in a decision, where 0.6 GB of expert weights stream per step), and prints GB/s against the copy
ceiling of shared/notes/gpu.md.
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _common import write_result  # noqa: E402

from flashrt_core.bench import CEILINGS, random_inputs, random_state, workload_config  # noqa: E402

L2_FLUSH_BYTES = 160 * 2 ** 20  # > the H200's 50 MB L2 (with margin)


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


def time_rotating(fn_for, copies: int, reps: int = 5) -> float:
    """Mean us per call of fn_for(i) for i cycling over `copies` weight copies, captured as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(copies):
            fn_for(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn_for(i)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / copies)
    del graph
    return statistics.median(samples)


def gemm_candidates(config, dtype) -> list[dict]:
    """cuBLAS vs every skinny Triton config at the action expert's GEMM shapes (M = chunk), graph-timed."""
    from flashrt_core import kernels as K
    from flashrt_core.models.pi05 import engine_gemm as G

    e, m = config.expert, config.chunk_size
    shapes = {"qkv": ((e.heads + 2 * e.kv_heads) * e.head_dim, e.width, False),
              "o": (e.width, e.heads * e.head_dim, False),
              "gate_up (geglu)": (2 * e.mlp, e.width, True),
              "down": (e.width, e.mlp, False)}
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k, geglu) in shapes.items():
        x = (torch.randn(m, k, generator=gen, device="cuda") * 0.5).to(dtype)
        nbytes = n * k * x.element_size()
        copies = max(2, min(64, -(-L2_FLUSH_BYTES // nbytes)))
        ws = [(torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(dtype) for _ in range(copies)]
        cands = {"cublas": None, **{str(c): c for c in G.CONFIGS}}
        for cname, cfg in cands.items():
            if cfg is None:
                fn = (lambda i: K.geglu(torch.nn.functional.linear(x, ws[i]))) if geglu else \
                    (lambda i: torch.nn.functional.linear(x, ws[i]))
            else:
                kw = G._kwargs(cfg, geglu)
                fn = (lambda i, kw=kw: G.skinny_linear(x, ws[i], geglu=geglu, **kw))
            try:
                us = time_rotating(fn, copies)
            except Exception as exc:  # noqa: BLE001 - a config the GPU rejects is a result too
                torch.cuda.synchronize()
                rows.append({"gemm": name, "candidate": cname, "error": str(exc).splitlines()[0][:100]})
                continue
            gbps = nbytes / us / 1e3
            rows.append({"gemm": name, "n": n, "k": k, "m": m, "candidate": cname, "us": us, "gbps": gbps,
                         "vs_copy_ceiling": gbps / (CEILINGS["copy_tbps"] * 1e3)})
        best = min((r for r in rows if r["gemm"] == name and "us" in r), key=lambda r: r["us"])
        print(f"gemm {name:<16} [{m}x{k}] x [{n}x{k}]^T: best {best['candidate']} {best['us']:.2f} us "
              f"({best['gbps']:.0f} GB/s); cublas "
              + next(f"{r['us']:.2f} us" for r in rows if r["gemm"] == name and r["candidate"] == "cublas"))
        del ws
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--json", default="benchmarks/results/profile_pi05_w2.json")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--gemm", default="auto", help="engine GEMM mode: auto, torch, triton")
    p.add_argument("--no-gemm-sweep", action="store_true")
    p.add_argument("--pdl", type=int, default=1, help="1: programmatic dependent launch (default), 0: off")
    p.add_argument("--no-attention-tuning", action="store_true")
    args = p.parse_args(argv)
    from flashrt_core.models.pi05 import convert
    from flashrt_core.models.pi05.engine import Pi05Engine

    config = workload_config(args.views, 48, 10, 50)
    w32 = convert(config, random_state(config, 0, "cuda"))
    engine = Pi05Engine(w32, device="cuda", dtype=torch.bfloat16, gemm=args.gemm, pdl=bool(args.pdl),
                        tune_attention=not args.no_attention_tuning)
    del w32
    inputs = random_inputs(config, 0, "cuda")
    engine.sample_actions(*(inputs[k] for k in ("images", "image_masks", "lang_tokens", "lang_mask", "noise")))
    torch.cuda.synchronize()
    print(f"engine built: pdl={engine.pdl}, gemm choices " + ", ".join(
        f"{r['weight']}{'g' if r['geglu'] else ''}:{r['choice']}" for r in engine.linear.report()))
    print("attention choices: " + ", ".join(f"{r['q']}:{r['choice']}" for r in engine.attend.report()))
    profiles = {}
    for stage in ("observe", "act"):
        profiles[stage] = profile_graph(getattr(engine, stage), args.reps)
        print_profile(stage, profiles[stage], args.top)
    gemms = [] if args.no_gemm_sweep else gemm_candidates(config, torch.bfloat16)
    workload = {"model": "pi05", "views": args.views, "prompt_len": 48, "steps": 10, "chunk": 50,
                "dtype": "bfloat16", "gemm_mode": args.gemm, "pdl": bool(args.pdl),
                "tune_attention": not args.no_attention_tuning, "reps": args.reps}
    write_result(args.json, workload, {"profiles": profiles, "gemm_candidates": gemms},
                 {"gemm_choices": engine.linear.report(), "attention_choices": engine.attend.report(),
                  "ceilings": CEILINGS})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
