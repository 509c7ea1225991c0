"""Runtime benchmark: cost of an act-only tick and of observe+act, and a real-time mixed-rate run.

    python benchmarks/bench_runtime.py [--config config/pi05.yaml] [--device cuda] [--engine reference]
        [--graphs stage] [--duration 10] [--modes deferred,inline] [--json benchmarks/results/runtime_pi05_w2.json]

Workload: config/pi05.yaml = full-size pi0.5 W2 (2 views 224x224, 48-token prompt, 10 flow steps, chunk 50,
bf16, random weights). Tick costs are CUDA-event GPU time of the stages plus the host wall time of `step`
(host parts, launches, and the final copy of the actions). The mixed run steps the runtime on the wall clock
at the act rate for `--duration` s with a fresh observation every tick; a deadline miss is a tick whose step
did not finish within one act period, or a period the scheduler had to skip.
Modes, each a fresh runtime in the same process: `inline` (observe runs before act in its tick) and
`deferred` (the contract with `observe` deferred: at an observe tick act uses the previous prefix and observe
runs behind it on the same stream, off the tick's critical path). For deferred ticks the GPU time of a tick
counts its own stages plus the deferred observe it launched (read back at the next synchronizing step).
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flashrt_core.contract.runtime import Runtime  # noqa: E402
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import commit as git_commit  # noqa: E402  (honours FLASHRT_COMMIT where there is no .git)

MS = 1_000_000


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def summary(xs):
    return {"mean": float(np.mean(xs)), "p50": pct(xs, 50), "p99": pct(xs, 99), "max": float(np.max(xs)),
            "n": len(xs)}


def make_inputs(rt, rng):
    b = rt.contract.buffers
    views, h, w, _ = b["images"].shape
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(views)], \
        rng.uniform(-1, 1, b["state"].shape[0]).astype(np.float32)


DEVICE_KEYS = ("observe", "act", "observe+act", "act+observe")


def gpu_ms(res):
    """GPU ms of the device stages this step ran in order (deferred ones are counted by deferred_gpu_ms)."""
    return sum(v for k, v in res.stage_latency_ms.items() if k in DEVICE_KEYS and k not in res.deferred)


def deferred_gpu_ms(res):
    return sum(v for k, v in res.deferred_latency_ms.items() if k in DEVICE_KEYS)


def tick_costs(rt, rng, iters):
    """Act-only ticks (no new frames: observe is late and reuses the prefix) and observe+act ticks."""
    imgs, st = make_inputs(rt, rng)
    rates = rt.stage_rates()
    obs_period, act_period = int(1e9 / rates["observe"]) + 1, int(1e9 / rates["act"]) + 1
    t = 0
    rt.set_observation(images=imgs, state=st, stamp_ns=t)
    rt.step(t)
    act, full, act_wall, full_wall = [], [], [], []
    for i in range(iters):
        t += obs_period  # observe is due at every tick
        imgs, st = make_inputs(rt, rng)
        rt.set_observation(images=imgs, state=st, stamp_ns=t)
        r = rt.step(t)
        assert sorted(r.ran) == ["act", "observe"], r.ran
        observe_step = r
        r = rt.step(t + act_period)  # act only (it also reads back a deferred observe's GPU time)
        assert r.ran == ["act"], r.ran
        full.append(gpu_ms(observe_step) + deferred_gpu_ms(r))
        full_wall.append(observe_step.latency_ms)
        act.append(gpu_ms(r))
        act_wall.append(r.latency_ms)
    return {"act_only_gpu_ms": summary(act), "act_only_step_ms": summary(act_wall),
            "observe_act_gpu_ms": summary(full), "observe_act_step_ms": summary(full_wall)}


def mixed_run(rt, rng, duration_s, act_hz):
    """Real time: tick at the act rate on the wall clock; a fresh camera frame before every tick."""
    period = int(1e9 / act_hz)
    frames = [make_inputs(rt, rng) for _ in range(8)]
    start = time.perf_counter_ns()
    last = rt.runtime_meta()["last_stamp_ns"] or 0
    offset = last + 1_000 * MS - start  # the simulated ticks above used their own clock: keep stamps increasing
    imgs, st = frames[-1]
    rt.set_observation(images=imgs, state=st, stamp_ns=start + offset)
    rt.step(start + offset)  # moves the schedule onto the wall clock; the jump's misses are not counted
    misses_before = dict(rt.buffers.ledger.misses)
    start = time.perf_counter_ns()
    ticks, late_ticks, dropped, gpu, wall, ran_observe, no_actions = 0, 0, 0, [], [], 0, 0
    to_actions = []  # host ms until the actions were on the host (what a publisher waits for)
    next_tick = start
    while True:
        now = time.perf_counter_ns()
        if now - start >= duration_s * 1e9:
            break
        if now < next_tick:
            time.sleep((next_tick - now) / 1e9)
            now = time.perf_counter_ns()
        imgs, st = frames[ticks % len(frames)]
        rt.set_observation(images=imgs, state=st, stamp_ns=now + offset)
        r = rt.step(now + offset)
        done = time.perf_counter_ns()
        ticks += 1
        if gpu:  # a deferred stage's GPU time belongs to the tick that launched it
            gpu[-1] += deferred_gpu_ms(r)
        gpu.append(gpu_ms(r))
        wall.append(r.latency_ms)
        if r.actions_ms is not None:
            to_actions.append(r.actions_ms)
        ran_observe += "observe" in r.ran
        no_actions += r.actions is None
        if done > next_tick + period:  # finished after the next tick was due
            late_ticks += 1
        next_tick += period
        if done > next_tick:  # like a timer that overran: the periods that passed get no tick
            missed = (done - next_tick) // period + 1
            dropped += missed
            next_tick += missed * period
    skipped = {k: rt.buffers.ledger.misses[k] - misses_before[k] for k in misses_before}
    return {"duration_s": duration_s, "act_hz": act_hz, "ticks": ticks, "observe_runs": ran_observe,
            "gpu_ms_per_tick": summary(gpu), "step_ms_per_tick": summary(wall),
            "actions_ms_per_tick": summary(to_actions),
            "deadline_misses": late_ticks + dropped, "late_ticks": late_ticks, "dropped_periods": dropped,
            "scheduler_missed_periods": skipped, "ticks_without_actions": no_actions}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "config" / "pi05.yaml"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--engine", default="reference", choices=["reference", "fused"])
    ap.add_argument("--graphs", default=None, choices=["stage", "plan", "off"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--observe-hz", type=float, default=10.0)
    ap.add_argument("--act-hz", type=float, default=50.0)
    ap.add_argument("--modes", default="deferred,inline", help="comma list of inline, deferred")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from flashrt_core.contract.spec import load_contract

    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - {"inline", "deferred"})
    if unknown:
        ap.error(f"--modes: unknown mode {unknown[0]!r} (inline, deferred)")
    base = load_contract(args.config).with_overrides(
        dtype=args.dtype, rates={"observe": args.observe_hz, "act": args.act_hz},
        limits={"max_observation_age_ms": None}, options={"engine": args.engine})
    result = {
        "benchmark": "runtime", "config": pathlib.Path(args.config).name, "engine": args.engine,
        "dtype": base.model.dtype, "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "none",
        "torch": torch.__version__, "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "prefix_len": base.dims["prefix_len"], "modes": {},
    }
    for mode in modes:
        contract = base.with_overrides(deferred={"observe": mode == "deferred"})
        if args.graphs:  # not a contract override: set on the validated contract of each mode
            contract = type(contract)(**{**vars(contract), "graphs": args.graphs})
        t0 = time.perf_counter()
        rt = Runtime(contract, device=args.device, seed=0)
        build_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        rt.set_prompt("pick up the red cube and put it in the bowl")
        t0 = time.perf_counter()
        rt.warmup()
        capture_s = time.perf_counter() - t0
        costs = tick_costs(rt, rng, args.iters)
        mixed = mixed_run(rt, rng, args.duration, args.act_hz)
        graphs = (rt.contract.graphs if rt.graphs.enabled else f"{rt.contract.graphs} (engine-owned graphs)"
                  if getattr(rt.binding, "owns_graphs", False) else "off")
        engine = getattr(getattr(rt.binding, "policy", None), "engine", None)
        result["modes"][mode] = {"graphs": graphs, "build_s": build_s, "capture_s": capture_s,
                                 "graph_captures": rt.graphs.captures, **costs, "mixed": mixed,
                                 # stage hooks (contract copies) that could not join the engine's graphs
                                 "engine_hook_capture_errors": {"/".join(k): v for k, v in
                                                                getattr(engine, "hook_capture_errors", {}).items()}}
        rt.close()
        del rt
        print(f"pi0.5 runtime  {result['config']}  engine={args.engine}  graphs={graphs}  mode={mode}  "
              f"{result['dtype']}  {result['gpu']}")
        print(f"{'what':<28}{'mean ms':>10}{'p50':>10}{'p99':>10}{'max':>10}")
        rows = [(k, costs[k]) for k in ("act_only_gpu_ms", "act_only_step_ms", "observe_act_gpu_ms",
                                        "observe_act_step_ms")]
        rows += [("mixed " + k, mixed[k]) for k in ("gpu_ms_per_tick", "step_ms_per_tick", "actions_ms_per_tick")]
        for label, st in rows:
            print(f"{label:<28}{st['mean']:>10.3f}{st['p50']:>10.3f}{st['p99']:>10.3f}{st['max']:>10.3f}")
        print(f"mixed run: {mixed['ticks']} ticks in {mixed['duration_s']} s at {mixed['act_hz']} Hz, "
              f"{mixed['observe_runs']} observes, deadline misses {mixed['deadline_misses']} "
              f"({mixed['late_ticks']} late ticks + {mixed['dropped_periods']} dropped periods), "
              f"scheduler missed periods {mixed['scheduler_missed_periods']}")
        write(result, args.json)  # after every mode: a run cut short still leaves the modes it finished
    return 0


def write(result: dict, path) -> None:
    """Summary rows (for scripts/summarize_results.py) from the modes measured so far, then the JSON."""
    result["results"] = {f"{m} {k}": {"p50_ms": v[k]["p50"], "p99_ms": v[k]["p99"]}
                         for m, v in result["modes"].items() for k in ("act_only_step_ms", "observe_act_step_ms")}
    for m, v in result["modes"].items():
        result["results"][f"{m} mixed 10s"] = {"deadline_misses": v["mixed"]["deadline_misses"],
                                               "gpu_ms_per_tick_mean": v["mixed"]["gpu_ms_per_tick"]["mean"],
                                               "step_ms_p99": v["mixed"]["step_ms_per_tick"]["p99"]}
    if path:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
