"""The path a user takes, against the engine's own figures, in one process (W2 on one GPU).

    python benchmarks/bench_product_path.py [--json benchmarks/results/product_path_w2.json] [--seconds 4]

1. The engine alone (`flashrt_bench.harness.bench_pi05`, W2, no baselines): whole decision and act-only p50.
2. `Runtime.from_config("config/pi05.yaml", device="cuda")` with no engine, dtype or other option (what the
   node builds from the shipped GPU contract): the engine it picked, then a 50 Hz wall-clock run (observe
   10 Hz deferred, a fresh observation every tick): host wall time per tick, act-only ticks and observe ticks.
3. `Pi05Policy.predict_chunk` (raw uint8 frames + robot-unit state + task -> robot-unit actions, with QUANTILES
   normalization and relative actions on) on the fused bf16 engine: wall time per call (host pre-processing,
   the decision, post-processing and the copy back), 224x224 frames and 480x640 frames; and its actions
   against the same pipeline on the fp32 reference engine (cosine, relative L2).
Targets (the product-path issue): runtime act tick p50 within 10% of the engine's act-only p50; predict_chunk
p50 within 10% of the engine's whole decision.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _common import write_result  # noqa: E402
from flashrt_bench.harness import bench_pi05, random_state, workload_config  # noqa: E402
from flashrt_core.contract.runtime import Runtime  # noqa: E402
from flashrt_core.models import pi05  # noqa: E402
from flashrt_core.lerobot.normalize import FeatureNorm, Normalizer  # noqa: E402
from flashrt_core.models.pi05.policy import Pi05Policy, make_engine  # noqa: E402
from flashrt_core.lerobot.processors import Processors, relative_mask  # noqa: E402

MS = 1_000_000
TASK = "pick up the red cube and put it in the bowl"


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else float("nan")


def summary(xs) -> dict:
    return {"n": len(xs), "p50_ms": pct(xs, 50), "p90_ms": pct(xs, 90), "p99_ms": pct(xs, 99),
            "max_ms": float(max(xs)) if xs else float("nan")}


def runtime_run(seconds: float, log) -> dict:
    t0 = time.time()
    rt = Runtime.from_config(REPO / "config" / "pi05.yaml", device="cuda")
    rt.warmup()
    build_s = time.time() - t0
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    rt.set_prompt(TASK)
    period_ns = int(1e9 / rt.stage_rates()["act"])
    act, observe, misses, ticks = [], [], 0, 0
    start = time.monotonic_ns()
    deadline = start + int(seconds * 1e9)
    k = 0
    while time.monotonic_ns() < deadline:
        due = start + k * period_ns
        while time.monotonic_ns() < due:
            time.sleep(max(0.0, (due - time.monotonic_ns()) / 1e9 - 2e-4))
        now = time.monotonic_ns()
        rt.set_observation(images=frames, state=rng.uniform(-1, 1, 8).astype(np.float32), stamp_ns=now)
        t = time.perf_counter()
        res = rt.step(now)
        ms = (time.perf_counter() - t) * 1e3
        ticks += 1
        (observe if "observe" in res.ran or res.deferred else act).append(ms)
        misses += ms > period_ns / MS
        k += 1
    out = {"engine": rt.binding.engine_name, "dtype": str(rt.dtype).removeprefix("torch."),
           "build_and_warmup_s": build_s, "ticks": ticks, "over_period": misses,
           "act_only_tick": summary(act), "observe_tick": summary(observe)}
    log(f"[runtime] engine {out['engine']} {out['dtype']}: act tick p50 {out['act_only_tick']['p50_ms']:.2f} ms, "
        f"observe tick p50 {out['observe_tick']['p50_ms']:.2f} ms, {misses}/{ticks} over the period")
    rt.close()
    return out


def _policy(config, state, engine: str, dtype) -> Pi05Policy:
    weights = pi05.convert(config, state).to(device="cuda", dtype=dtype,
                                             vision_dtype=None if engine == "fused" else torch.float32)
    g = torch.Generator().manual_seed(3)
    lo = torch.rand(8, generator=g) - 1.5
    norm = Normalizer(state=FeatureNorm("QUANTILES", lo, lo + 3.0), action=FeatureNorm("QUANTILES", -torch.ones(7),
                                                                                        torch.ones(7) * 2))
    names = ("j0", "j1", "j2", "j3", "j4", "j5", "gripper")
    procs = Processors(camera_names=("observation.images.base", "observation.images.wrist"), state_dim=8,
                       action_dim=7, action_names=names, relative_mask=relative_mask(7, ["gripper"], names),
                       tokenizer_name=None, tokenizer_max_length=48, normalizer=norm, source="benchmark")
    return Pi05Policy(config, weights, make_engine(engine, weights), "cuda", dtype, seed=0,
                      tokenizer=pi05.WordTokenizer(config.vocab_size), processors=procs)


def chunk_phases(policy, frames, robot_state, noise, iters: int) -> dict:
    """predict_chunk's steps one by one, each synchronized: where its time beyond the decision goes."""
    raw = torch.from_numpy(robot_state)
    steps = {
        "images": lambda: policy.preprocess_images(frames),
        "prompt": lambda: policy.tokenize(TASK, policy.normalizer.normalize_state(raw), truncate=False),
    }
    imgs, masks = steps["images"]()
    tokens, mask = steps["prompt"]()
    steps["decision"] = lambda: policy.sample_actions(imgs, masks, tokens, mask, noise=noise)
    actions = steps["decision"]()
    steps["post"] = lambda: policy.normalizer.unnormalize_actions(actions[0, :, :7].float().cpu())
    out = {}
    for name, fn in steps.items():
        times = []
        for i in range(iters + 3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= 3:
                times.append((time.perf_counter() - t) * 1e3)
        out[name] = round(pct(times, 50), 3)
    return out


def predict_chunk_run(iters: int, log) -> dict:
    config = workload_config(2, 48, 10, 50)
    state = random_state(config, 0, "cuda")
    fused = _policy(config, state, "fused", torch.bfloat16)
    rng = np.random.default_rng(1)
    robot_state = rng.uniform(-1, 1, 8).astype(np.float32)
    noise = torch.randn(1, 50, config.action_dim, generator=torch.Generator().manual_seed(2)).cuda()
    out = {}
    for label, hw in (("frames_224x224", (224, 224)), ("frames_480x640", (480, 640))):
        frames = [rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for _ in range(2)]
        times = []
        for i in range(iters + 3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            actions = fused.predict_chunk(frames, robot_state, TASK, noise=noise)
            ms = (time.perf_counter() - t) * 1e3
            if i >= 3:
                times.append(ms)
        out[label] = {**summary(times), "phases_p50_ms": chunk_phases(fused, frames, robot_state, noise, iters)}
        log(f"[predict_chunk] {label}: p50 {out[label]['p50_ms']:.2f} ms, phases {out[label]['phases_p50_ms']}")
    frames = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    ours = fused.predict_chunk(frames, robot_state, TASK, noise=noise)
    del fused
    torch.cuda.empty_cache()
    ref = _policy(config, state, "reference", torch.float32).predict_chunk(frames, robot_state, TASK, noise=noise)
    a, b = torch.from_numpy(ours).double().flatten(), torch.from_numpy(ref).double().flatten()
    out["parity_vs_reference_fp32"] = {
        "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
        "rel_l2": float((a - b).norm() / b.norm()), "max_abs": float((a - b).abs().max())}
    log(f"[predict_chunk] vs fp32 reference: {out['parity_vs_reference_fp32']}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "product_path_w2.json"))
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_product_path needs a CUDA GPU", file=sys.stderr)
        return 2
    engine = bench_pi05(baselines=(), parity=False, iters=args.iters)
    whole, act_only = engine["results"]["flashrt"]["p50_ms"], engine["results"]["flashrt-act-only"]["p50_ms"]
    runtime = runtime_run(args.seconds, print)
    chunk = predict_chunk_run(args.iters, print)
    checks = {
        "runtime_engine_is_fused": runtime["engine"] == "fused",
        "runtime_act_tick_within_10pct_of_engine_act_only":
            runtime["act_only_tick"]["p50_ms"] <= 1.10 * act_only,
        "predict_chunk_within_10pct_of_engine_whole": chunk["frames_224x224"]["p50_ms"] <= 1.10 * whole,
    }
    doc = write_result(args.json, workload=engine["workload"],
                       results={"engine_whole": engine["results"]["flashrt"],
                                "engine_act_only": engine["results"]["flashrt-act-only"],
                                "runtime_shipped_contract": runtime, "predict_chunk": chunk},
                       extra={"checks": checks})
    rows = [("engine whole decision (bench_pi05)", whole), ("engine act-only (bench_pi05)", act_only),
            ("runtime act tick (config/pi05.yaml, no options)", runtime["act_only_tick"]["p50_ms"]),
            ("runtime observe tick (deferred)", runtime["observe_tick"]["p50_ms"]),
            ("predict_chunk 224x224 frames", chunk["frames_224x224"]["p50_ms"]),
            ("predict_chunk 480x640 frames", chunk["frames_480x640"]["p50_ms"])]
    print(f"\n{doc['gpu']}, commit {doc['commit']}, {doc['date']}")
    print(f"{'path':<52}{'p50 ms':>8}")
    for name, ms in rows:
        print(f"{name:<52}{ms:>8.2f}")
    for name, ok in checks.items():
        print(f"check {name}: {'PASS' if ok else 'FAIL'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
