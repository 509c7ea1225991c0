"""LeRobot 0.6.1 pi0.5 adopted by flashrt_core.adopt, without touching LeRobot's code.

In one process, on workload W2 (2 views 224x224, 48-token prompt, 10 flow steps, chunk 50, bf16, batch 1,
every parameter re-drawn normal(0, 0.02)): `policy.model.sample_actions(..., noise=noise)` latency of
LeRobot eager, the adopted model (per-unit swaps, optionally a CUDA graph of sample_actions) and
torch.compile; action cosine of each against eager. Prints a table and the end-to-end gate's decision, and
writes JSON via _common.write_result (gpu, commit from FLASHRT_COMMIT or git, date, workload, results).

    python3 benchmarks/bench_adopt.py [--compile-mode default|none] [--capture] [--json FILE]

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
from flashrt_core.bench import cuda_samples  # noqa: E402


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
    ap.add_argument("--rounds", type=int, default=5, help="A/B rounds per unit in the latency gate")
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
        print(f"bench_adopt: LeRobot 0.6.1 is not importable ({exc}); see shared/notes/gpu.md", file=sys.stderr)
        return 2
    from flashrt_core.adopt import accelerate, detach

    t0 = time.perf_counter()
    policy = build_policy(torch, args.views, args.prompt_len, args.dtype)
    model = policy.model
    inputs, kwargs = make_inputs(torch, args.views, args.prompt_len)
    print(f"built pi0.5 in {time.perf_counter() - t0:.0f} s", flush=True)

    def run():
        with torch.no_grad():
            return model.sample_actions(*inputs, **kwargs)

    ref = run()
    eager_ms = cuda_samples(run, iters=args.iters)
    print(f"eager p50 {statistics.median(eager_ms):.1f} ms", flush=True)

    t0 = time.perf_counter()
    _, report = accelerate(model, {**dict(zip(("images", "img_masks", "tokens", "masks"), inputs)), **kwargs},
                           method="sample_actions", capture="sample_actions" if args.capture else None,
                           rounds=args.rounds)
    adopt_s = time.perf_counter() - t0
    print(report, flush=True)
    adopted = run()
    adopted_ms = cuda_samples(run, iters=args.iters)
    adopted_cos = cosine(torch, adopted, ref)
    detach(model)
    detached_exact = bool(torch.equal(run(), ref))

    compiled_ms, compiled_cos, compile_s = None, None, None
    if args.compile_mode != "none":
        compiled = torch.compile(model.sample_actions, mode=args.compile_mode)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = compiled(*inputs, **kwargs)
        compile_s = time.perf_counter() - t0
        compiled_cos = cosine(torch, out, ref)
        compiled_ms = cuda_samples(lambda: compiled(*inputs, **kwargs), iters=args.iters)

    p50 = statistics.median
    rows = [("lerobot eager", p50(eager_ms), 1.0, "-"),
            ("adopted" + (" + graph" if args.capture else ""), p50(adopted_ms), p50(eager_ms) / p50(adopted_ms),
             f"{adopted_cos:.6f}")]
    if compiled_ms:
        rows.append((f"torch.compile {args.compile_mode}", p50(compiled_ms), p50(eager_ms) / p50(compiled_ms),
                     f"{compiled_cos:.6f}"))
    print(f"\n{'system':28s} {'p50 ms':>9s} {'speed-up':>9s} {'action cos':>11s}")
    for name, ms, speed, cos in rows:
        print(f"{name:28s} {ms:9.2f} {speed:8.2f}x {cos:>11s}")
    if compiled_ms:
        print(f"adopted vs torch.compile: {p50(compiled_ms) / p50(adopted_ms):.2f}x "
              f"(compile took {compile_s:.0f} s, adoption {adopt_s:.0f} s)")

    e = report.end_to_end
    print(f"end-to-end gate: {e.decided_by}; eager {e.latency_eager_s * 1e3:.1f} ms -> adopted "
          f"{e.latency_adopted_s * 1e3:.1f} ms ({e.gain:+.1%}), {len(report.kept)} units kept")

    def row(ms, cos):
        return {"p50_ms": p50(ms), "samples_ms": ms, "action_cos": cos} if ms else None

    results = {"lerobot eager": row(eager_ms, 1.0), "adopted": row(adopted_ms, adopted_cos),
               f"torch.compile {args.compile_mode}": row(compiled_ms, compiled_cos)}
    path = pathlib.Path(args.json)
    write_result(path, workload={"views": args.views, "prompt_len": args.prompt_len, "steps": 10, "chunk": 50,
                                 "dtype": args.dtype, "batch": 1},
                 results={k: v for k, v in results.items() if v is not None},
                 extra={"benchmark": "adopt_pi05", "torch": torch.__version__, "capture": args.capture,
                        "compile_mode": args.compile_mode, "compile_s": compile_s, "adopt_s": adopt_s,
                        "gate_decision": e.decided_by, "detach_bit_exact": detached_exact,
                        "report": report.to_dict()})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
