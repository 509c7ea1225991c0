"""LeRobot 0.6.1 pi0.5 adopted by flashrt_core.adopt, without touching LeRobot's code.

In one process, on workload W2 (2 views 224x224, 48-token prompt, 10 flow steps, chunk 50, bf16, batch 1,
every parameter re-drawn normal(0, 0.02)): `policy.model.sample_actions(..., noise=noise)` latency of
LeRobot eager, torch.compile of the untouched model, and the adopted model (per-unit swaps, optionally a
CUDA graph of sample_actions, in which case the gates time graph replays); action cosine of each against
eager. Phases run in that order (compile before adoption, and dynamo reset after it, so the two never
interact); each prints the seconds since start and rewrites the JSON (_common.write_result: gpu, commit from
FLASHRT_COMMIT or git, date, workload, results), so a run cut short by a time limit still leaves the phases
it finished. Prints a table (speed-up vs eager and vs torch.compile) and the end-to-end gate's decision.

    python3 benchmarks/bench_adopt.py [--compile-mode default|none] [--capture] [--rounds N] [--json FILE]

Import-safe without CUDA or LeRobot: `main()` says what is missing and exits 2.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))  # this checkout's flashrt_core first (an installed copy may be older)
from _common import write_result  # noqa: E402  (commit() honours FLASHRT_COMMIT where there is no .git)
from flashrt_bench.harness import cuda_samples  # noqa: E402


def build_policy(torch, views: int, prompt_len: int, dtype: str):
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    cfg = PI05Config(dtype=dtype, tokenizer_max_length=prompt_len, device="cuda")
    with torch.device("cuda"):  # LeRobot's random init is minutes on the CPU
        policy = PI05Policy(cfg)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():  # HF init leaves norm and AdaRMS weights at zero: re-draw everything
        for p in policy.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.float32).mul_(0.02).to(p.dtype))
    return policy.eval()


def make_inputs(torch, views: int, prompt_len: int):
    gen = torch.Generator(device="cuda").manual_seed(1)
    images = [torch.rand(1, 3, 224, 224, generator=gen, device="cuda") * 2 - 1 for _ in range(views)]
    masks = [torch.ones(1, dtype=torch.bool, device="cuda") for _ in range(views)]
    tokens = torch.randint(0, 257152, (1, prompt_len), generator=gen, device="cuda")
    lang_mask = torch.ones(1, prompt_len, dtype=torch.bool, device="cuda")
    lang_mask[:, prompt_len * 3 // 4:] = False  # a padded prompt, as real prompts are
    noise = torch.randn(1, 50, 32, generator=gen, device="cuda")
    return (images, masks, tokens, lang_mask), {"noise": noise}


def cosine(torch, a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--views", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=20)
    # 3 paired rounds per unit keep adoption of pi0.5 (~370 units) under about 2 minutes on the H200.
    ap.add_argument("--rounds", type=int, default=3, help="A/B rounds per unit in the latency gates (default 3)")
    ap.add_argument("--capture", action="store_true", help="also capture sample_actions as a CUDA graph")
    ap.add_argument("--compile-mode", default="default", help="torch.compile mode, or 'none' to skip")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "adopt_pi05_w2.json"))
    args = ap.parse_args(argv)

    try:
        import torch
    except ImportError:
        print("bench_adopt: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_adopt: needs CUDA (LeRobot pi0.5 at full size)", file=sys.stderr)
        return 2
    try:
        import lerobot  # noqa: F401
        from lerobot.policies.pi05.modeling_pi05 import PI05Policy  # noqa: F401
    except ImportError as exc:
        print(f"bench_adopt: LeRobot 0.6.1 is not importable ({exc}); see docs/gpu-machine.md", file=sys.stderr)
        return 2
    from flashrt_core.adopt import accelerate, detach

    started = time.perf_counter()
    p50 = statistics.median
    compile_name = f"torch.compile {args.compile_mode}"
    path = pathlib.Path(args.json)
    workload = {"views": args.views, "prompt_len": args.prompt_len, "steps": 10, "chunk": 50, "dtype": args.dtype,
                "batch": 1}
    results: dict = {}
    extra = {"benchmark": "adopt_pi05", "torch": torch.__version__, "capture": args.capture,
             "compile_mode": args.compile_mode, "rounds": args.rounds, "phases_done": [], "phase_s": {}}

    def phase_done(name: str, message: str) -> None:
        """Print the time since start and rewrite the JSON with everything measured so far."""
        elapsed = time.perf_counter() - started
        extra["phases_done"].append(name)
        extra["phase_s"][name] = elapsed
        print(f"[{elapsed:6.0f} s] {name}: {message}", flush=True)
        write_result(path, workload=workload, results=dict(results), extra=extra)

    def row(ms, cos):
        return {"p50_ms": p50(ms), "samples_ms": ms, "action_cos": cos}

    policy = build_policy(torch, args.views, args.prompt_len, args.dtype)
    model = policy.model
    inputs, kwargs = make_inputs(torch, args.views, args.prompt_len)
    print(f"[{time.perf_counter() - started:6.0f} s] built pi0.5", flush=True)

    def run():
        with torch.no_grad():
            return model.sample_actions(*inputs, **kwargs)

    ref = run()
    eager_ms = cuda_samples(run, iters=args.iters)
    results["lerobot eager"] = row(eager_ms, 1.0)
    phase_done("eager", f"p50 {p50(eager_ms):.1f} ms")

    compiled_ms = None
    if args.compile_mode != "none":
        # The untouched model, before adoption; dynamo is reset afterwards so nothing of it stays in place.
        try:
            compiled = torch.compile(model.sample_actions, mode=args.compile_mode)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = compiled(*inputs, **kwargs)
            torch.cuda.synchronize()
            extra["compile_s"] = time.perf_counter() - t0
            compiled_cos = cosine(torch, out, ref)

            def run_compiled():
                with torch.no_grad():
                    return compiled(*inputs, **kwargs)
            compiled_ms = cuda_samples(run_compiled, iters=args.iters)
            results[compile_name] = row(compiled_ms, compiled_cos)
            message = f"p50 {p50(compiled_ms):.1f} ms, first call (compilation) {extra['compile_s']:.0f} s"
        except Exception as exc:  # a baseline that cannot run is reported, not hidden
            extra["compile_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            message = f"failed: {extra['compile_error']}"
        compiled = out = None
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        phase_done("torch.compile", message)

    t0 = time.perf_counter()
    _, report = accelerate(model, {**dict(zip(("images", "img_masks", "tokens", "masks"), inputs)), **kwargs},
                           method="sample_actions", capture="sample_actions" if args.capture else None,
                           rounds=args.rounds)
    extra["adopt_s"] = time.perf_counter() - t0
    print(report, flush=True)
    e = report.end_to_end
    extra.update(gate_decision=e.decided_by, timing={"units": report.timing, "end_to_end": e.timing},
                 report=report.to_dict())
    phase_done("adoption", f"{len(report.kept)}/{len(report.units)} units kept in {extra['adopt_s']:.0f} s "
                           f"(timing: units {report.timing}, end to end {e.timing}); {e.capture}")

    adopted = run()
    adopted_ms = cuda_samples(run, iters=args.iters)
    adopted_name = "adopted" + (" + graph" if args.capture else "")
    results[adopted_name] = row(adopted_ms, cosine(torch, adopted, ref))
    graphed = vars(model).get("sample_actions")  # the captured method, when there is one
    if args.capture and hasattr(graphed, "stats"):
        # Every timed call must have replayed the graph; an eager fallback would time something else.
        extra["graph_calls"] = {"replayed": graphed.stats.fused_calls, "eager": graphed.stats.fallback_calls}
        print(f"captured sample_actions: {extra['graph_calls']}", flush=True)
    detach(model)
    extra["detach_bit_exact"] = bool(torch.equal(run(), ref))
    phase_done("adopted", f"p50 {p50(adopted_ms):.1f} ms, detach bit-exact {extra['detach_bit_exact']}")

    base = {"eager": p50(eager_ms), "compile": p50(compiled_ms) if compiled_ms else None}
    print(f"\n{'system':28s} {'p50 ms':>9s} {'vs eager':>9s} {'vs compile':>11s} {'action cos':>11s}")
    for name, r in results.items():
        vs_compile = f"{base['compile'] / r['p50_ms']:10.2f}x" if base["compile"] else f"{'-':>11s}"
        print(f"{name:28s} {r['p50_ms']:9.2f} {base['eager'] / r['p50_ms']:8.2f}x {vs_compile} "
              f"{r['action_cos']:11.6f}")
        r["speedup_vs_eager"] = base["eager"] / r["p50_ms"]
        if base["compile"]:
            r["speedup_vs_compile"] = base["compile"] / r["p50_ms"]
    if base["compile"]:
        print(f"{adopted_name} vs torch.compile: {base['compile'] / p50(adopted_ms):.2f}x "
              f"(compile took {extra['compile_s']:.0f} s, adoption {extra['adopt_s']:.0f} s)")
    print(f"end-to-end gate: {e.decided_by}; {'original graph' if e.timing == 'graph' else 'eager'} "
          f"{e.latency_eager_s * 1e3:.1f} ms -> adopted {e.latency_adopted_s * 1e3:.1f} ms ({e.gain:+.1%}), "
          f"{len(report.kept)} units kept")
    write_result(path, workload=workload, results=results, extra=extra)
    print(f"[{time.perf_counter() - started:6.0f} s] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
