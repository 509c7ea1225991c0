"""Where the time of a pi0.5 decision goes on the GPU: per-kernel profile of the captured stage graphs, and
graph-timed GEMM candidates at the action expert's shapes (GPU round).

  python benchmarks/profile_pi05.py --json benchmarks/results/profile_pi05_w2.json [--views 2] [--pdl 0]
                                    [--ab FLAG[,FLAG...]]   (FLAG: one of AB_FLAGS below)

For each stage (`observe`, `act`) it replays the CUDA graph under torch.profiler (CUPTI records the kernels
of a graph replay one by one) and prints, per kernel name: launches per replay, total and mean GPU time,
and the share of the stage's wall time; "gaps" is wall time minus summed kernel time (launch latency and
idle SMs between dependent kernels). It also prints the engine's own GEMM choices: the picker timed cuBLAS
and every skinny Triton configuration in a CUDA graph with the weights cycled past L2 (`gemm_choices` in
the JSON keeps every candidate's time).
--ab FLAG also builds an engine with that `Pi05Engine` flag flipped from its default (`norm_in_gemm`: the
expert's AdaRMS norms and gated residuals inside its GEMMs; `rope_in_attention`: the expert's attention
rotates q/k on load instead of a split/rotate kernel; `l2_prefetch`: the expert's glue kernels warm the
next GEMMs' weights into L2; `rope_in_gemm`: the QKV GEMM's epilogue splits, rotates and writes q/k/v;
`attention_merge_apart`: the attention tuning may also pick two-kernel split merges; `gemm_preload`
(default on): skinny GEMM candidates that request weight tiles before the PDL wait in their K loop join
the tuning; `early_modulation` (default on): the expert's norms read their modulation rows before the PDL
wait; `early_positions` (default on): the split/rotate kernel reads positions and cos / sin rows before
the PDL wait; `fused_euler` (default on): the flow step's update in the action-out GEMM, the fp32 state
read by the action-in GEMM; `gemm_tma`: skinny GEMM candidates that read their weight tiles through TMA
descriptors join the tuning; `reduce_in_norm` (default on): the o and down GEMMs leave their split-K
partials to the norm kernel after them; `reduce_in_rotate` (default on): the QKV GEMM leaves its partials
to the split/rotate kernel; several comma-separated flags are flipped together)
from the same weights, prints the action cosine between the two engines, profiles the variant's act stage
in the same process (`act_<flag>_<on|off>` in the JSON) and times both act graphs without the profiler,
alternating replays (`ab_timing`), so the two compare within one run; likewise both engines' whole decisions
(`decision()`: both stage graphs, or overlap_decision's one graph; `ab_decision_timing`) and observe graphs
(`ab_observe_timing`).
"""
from __future__ import annotations

import argparse
import ast
import collections
import inspect
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _common import write_result  # noqa: E402

from flashrt_core.bench import CEILINGS, random_inputs, random_state, workload_config  # noqa: E402


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


# Pi05Engine flags an A/B may flip
AB_FLAGS = ("norm_in_gemm", "rope_in_attention", "l2_prefetch", "rope_in_gemm", "attention_merge_apart",
            "gemm_preload", "early_modulation", "early_positions", "fused_euler", "gemm_tma", "reduce_in_norm",
            "reduce_in_rotate", "overlap_decision", "gemm_mid", "patch_gemm", "gelu_epilogue", "rerank_in_graph")


def ab_flags(text: str) -> list[str]:
    """--ab: one Pi05Engine flag or several, comma-separated (the variant flips them all)."""
    flags = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in flags if f not in AB_FLAGS]
    if not flags or unknown:
        raise argparse.ArgumentTypeError(f"--ab: flags from {', '.join(AB_FLAGS)}; got {text!r}")
    return flags


def interleaved_ms(replays: dict, rounds: int = 30) -> dict:
    """Median / p90 ms of each stage replay, timed one replay at a time with CUDA events and alternating
    between them, so that clock and thermal drift hit both alike (no profiler attached)."""
    times = {name: [] for name in replays}
    for fn in replays.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in replays.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    out = {}
    for name, t in times.items():
        t = sorted(t)
        out[name] = {"p50_ms": t[len(t) // 2], "p90_ms": t[min(len(t) - 1, int(0.9 * len(t)))], "n": len(t)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--json", default="benchmarks/results/profile_pi05_w2.json")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--gemm", default="auto", help="engine GEMM mode: auto, torch, triton")
    p.add_argument("--pdl", type=int, default=1, help="1: programmatic dependent launch (default), 0: off")
    p.add_argument("--no-attention-tuning", action="store_true")
    p.add_argument("--ab", type=ab_flags, help="also profile act with this engine flag (or these, comma-separated) "
                                               f"flipped: {', '.join(AB_FLAGS)}")
    p.add_argument("--gemm-configs", help="only these skinny GEMM candidates, e.g. '[(32, 256, 1, 4, 3)]' (a "
                   "shorter tuning when device time is short; the JSON records them)")
    args = p.parse_args(argv)
    from flashrt_core.models.pi05 import convert, engine_gemm
    from flashrt_core.models.pi05.engine import Pi05Engine

    if args.gemm_configs:
        engine_gemm.CONFIGS[:] = [tuple(c) for c in ast.literal_eval(args.gemm_configs)]

    config = workload_config(args.views, 48, 10, 50)
    w32 = convert(config, random_state(config, 0, "cuda"))
    options = dict(dtype=torch.bfloat16, gemm=args.gemm, pdl=bool(args.pdl),
                   tune_attention=not args.no_attention_tuning)
    engine = Pi05Engine(w32, device="cuda", **options)
    # The variant shares the engine's tuning cache: only the shapes / fusions it adds are tuned anew.
    variant, variant_name = None, None
    if args.ab:  # flipped from the engine's own defaults
        flipped = {f: not inspect.signature(Pi05Engine).parameters[f].default for f in args.ab}
        flip_name = "_".join(f"{f}_{'on' if v else 'off'}" for f, v in flipped.items())
        variant_name = "act_" + flip_name
        variant = Pi05Engine(w32, device="cuda", tuning_cache=engine.tuning_cache, **flipped, **options)
    del w32
    inputs = random_inputs(config, 0, "cuda")
    names = ("images", "image_masks", "lang_tokens", "lang_mask", "noise")
    actions = engine.sample_actions(*(inputs[k] for k in names)).clone()
    if variant is not None:
        other = variant.sample_actions(*(inputs[k] for k in names))
        cos = torch.nn.functional.cosine_similarity(other.flatten().double(), actions.flatten().double(), dim=0)
        print(f"{variant_name}: action cosine vs the default engine {float(cos):.6f}")
    torch.cuda.synchronize()
    print(f"engine built: pdl={engine.pdl}, gemm choices " + ", ".join(
        f"{r['weight']}{'g' if r['geglu'] else ''}:{r['choice']}" for r in engine.linear.report()))
    print("attention choices: " + ", ".join(f"{r['q']}:{r['choice']}" for r in engine.attend.report()))
    profiles = {}
    for stage in ("observe", "act"):
        profiles[stage] = profile_graph(getattr(engine, stage), args.reps)
        print_profile(stage, profiles[stage], args.top)
    if variant is not None:
        profiles[variant_name] = profile_graph(variant.act, args.reps)
        print_profile(variant_name, profiles[variant_name], args.top)
        print(f"act wall under the profiler: default engine {profiles['act']['wall_us']:.0f} us, {variant_name} "
              f"{profiles[variant_name]['wall_us']:.0f} us")
        timing = interleaved_ms({"act": engine.act, variant_name: variant.act})
        print("act alone, interleaved, CUDA events: " + ", ".join(
            f"{n} p50 {t['p50_ms'] * 1e3:.0f} us (p90 {t['p90_ms'] * 1e3:.0f})" for n, t in timing.items()))
        profiles["ab_timing"] = timing
        observe = interleaved_ms({"observe": engine.observe, f"observe_{flip_name}": variant.observe})
        print("observe alone, interleaved, CUDA events: " + ", ".join(
            f"{n} p50 {t['p50_ms'] * 1e3:.0f} us (p90 {t['p90_ms'] * 1e3:.0f})" for n, t in observe.items()))
        profiles["ab_observe_timing"] = observe
        # a whole decision's graphs (observe + act, or the one graph of overlap_decision), buffers as filled
        decision = interleaved_ms({"decision": engine.decision, f"decision_{flip_name}": variant.decision})
        print("whole decision (graphs only), interleaved, CUDA events: " + ", ".join(
            f"{n} p50 {t['p50_ms'] * 1e3:.0f} us (p90 {t['p90_ms'] * 1e3:.0f})" for n, t in decision.items()))
        profiles["ab_decision_timing"] = decision
    gemm_table(engine.linear.report())
    if variant is not None:
        print(f"{variant_name}'s own GEMM choices (shapes it adds, or where it chose otherwise):")
        ident = ("m", "weight", "bias", "geglu", "dtype", "fused", "choice")
        shared = {tuple(str(r[k]) for k in ident) for r in engine.linear.report()}
        gemm_table([r for r in variant.linear.report() if tuple(str(r[k]) for k in ident) not in shared])
    workload = {"model": "pi05", "views": args.views, "prompt_len": 48, "steps": 10, "chunk": 50,
                "dtype": "bfloat16", "gemm_mode": args.gemm, "pdl": bool(args.pdl),
                "tune_attention": not args.no_attention_tuning, "reps": args.reps, "ab": args.ab,
                "gemm_configs": [list(c) for c in engine_gemm.CONFIGS]}
    extra = {"gemm_choices": engine.linear.report(), "attention_choices": engine.attend.report(),
             "ceilings": CEILINGS}
    if variant is not None:  # the variant's own choices (the shapes / fusions it added were tuned anew)
        extra["variant_gemm_choices"] = variant.linear.report()
        extra["variant_attention_choices"] = variant.attend.report()
    write_result(args.json, workload, {"profiles": profiles}, extra)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
