"""Each fused Triton kernel vs its plain-torch reference at full pi0.5 shapes, on CUDA.

Shapes: Gemma prefix 560 tokens x 2048 (2 views x 256 image tokens + a 48-token prompt), action expert 50
tokens x 1024, SigLIP 2 x 256 tokens x 1152, head_dim 256 with 8 q heads per kv head, camera frames 480x640.
Two timings per op, both medians of --iters samples from CUDA events:
  * graph: --reps calls captured in one CUDA graph and replayed, per call: device time without launch
    gaps, which is what the engine's captured stages pay;
  * eager: --reps calls issued from Python, per call: includes launcher and dispatch overhead.
Next to each Triton time: bytes moved (inputs read + outputs written), achieved GB/s and the fraction of the
4.22 TB/s copy ceiling of the H200 (docs/gpu-machine.md); FLOP/s for attention. Inputs are the same every call, so
they are warm in L2 like the activations of a running engine. Every row also reports the largest absolute
difference between the two backends' outputs.

    python benchmarks/bench_kernels.py [--dtype bf16] [--iters 30] [--reps 20] [--only attention,geglu]
                                       [--json benchmarks/results/kernels_<gpu>_<date>.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import sys

import torch
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import commit  # noqa: E402  (honours FLASHRT_COMMIT where there is no .git)

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's flashrt_core first

COPY_TBPS = 4.22  # measured device-to-device copy on the H200 (bytes read + written), docs/gpu-machine.md


def _nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def cases(dtype, dev):
    """(name, shape text, call(backend) -> output(s), bytes moved, flops) for every op at pi0.5 shapes."""
    from flashrt_core import kernels as K

    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dt=dtype, std=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * std).to(dt)

    out = []
    for rows, d, where in ((560, 2048, "prefix"), (50, 1024, "expert")):
        x, r, w = rnd(1, rows, d), rnd(1, rows, d), rnd(d, dt=torch.float32, std=0.1)
        out.append((f"rms_norm/{where}", f"[1,{rows},{d}]", lambda be, x=x, w=w: K.rms_norm(x, w, backend=be),
                    _nbytes(x, w) + _nbytes(x), 0))
        out.append((f"add_rms_norm/{where}", f"[1,{rows},{d}]",
                    lambda be, x=x, r=r, w=w: K.add_rms_norm(x, r, w, backend=be),
                    _nbytes(x, r, w) + 2 * _nbytes(x), 0))
    x, h, mod = rnd(1, 50, 1024), rnd(1, 50, 1024), rnd(1, 3 * 1024)
    scale, shift, gate = mod.chunk(3, dim=-1)
    out.append(("ada_rms_norm/expert", "[1,50,1024]", lambda be: K.ada_rms_norm(x, scale, shift, backend=be),
                2 * _nbytes(x) + 2 * 1024 * x.element_size(), 0))
    out.append(("gated_residual_ada_rms_norm/expert", "[1,50,1024]",
                lambda be: K.gated_residual_ada_rms_norm(x, h, gate, scale, shift, backend=be),
                4 * _nbytes(x) + 3 * 1024 * x.element_size(), 0))
    for rows, f, where in ((560, 16384, "prefix"), (50, 4096, "expert")):
        gu = rnd(1, rows, 2 * f, std=2.0)
        out.append((f"geglu/{where}", f"[1,{rows},{2 * f}]", lambda be, gu=gu: K.geglu(gu, backend=be),
                    _nbytes(gu) * 3 // 2, 0))
    xs, b4304 = rnd(2, 256, 4304), rnd(4304)
    out.append(("bias_gelu/siglip_fc1", "[2,256,4304]", lambda be: K.bias_gelu(xs, b4304, backend=be),
                2 * _nbytes(xs) + _nbytes(b4304), 0))
    xl, rl, lw, lb = rnd(2, 256, 1152), rnd(2, 256, 1152), rnd(1152), rnd(1152)
    out.append(("layer_norm/siglip", "[2,256,1152]", lambda be: K.layer_norm(xl, lw, lb, backend=be),
                2 * _nbytes(xl) + _nbytes(lw, lb), 0))
    out.append(("add_layer_norm/siglip", "[2,256,1152]", lambda be: K.add_layer_norm(xl, rl, lw, lb, backend=be),
                4 * _nbytes(xl) + _nbytes(lw, lb), 0))
    cos, sin = K.rope_cos_sin(1024, 256, device=dev)
    kc, vc = rnd(1, 1, 610, 256), rnd(1, 1, 610, 256)
    for t, offset, where in ((560, 0, "prefix"), (50, 560, "expert")):
        qkv = rnd(1, t, 10 * 256)
        pos = torch.arange(offset, offset + t, device=dev)[None]
        out.append((f"qkv_rope_cache/{where}", f"[1,{t},2560]@{offset}",
                    lambda be, qkv=qkv, pos=pos, offset=offset: K.qkv_rope_cache(
                        qkv, pos, cos, sin, kc, vc, offset, num_q_heads=8, num_kv_heads=1, backend=be),
                    2 * _nbytes(qkv) + _nbytes(pos), 0))
    mask = torch.ones(1, 560, dtype=torch.bool, device=dev)
    mask[:, 540:] = False  # 20 padded prompt tokens
    q, k, v = rnd(1, 560, 8, 256), rnd(1, 1, 560, 256), rnd(1, 1, 560, 256)
    out.append(("attention/prefix", "q[1,560,8,256] kv[1,1,560,256]",
                lambda be: K.attention(q, k, v, mask, backend=be), 2 * _nbytes(q) + _nbytes(k, v),
                4 * 560 * 560 * 8 * 256))
    qs, ks, vs = rnd(1, 50, 8, 256), rnd(1, 1, 50, 256), rnd(1, 1, 50, 256)
    out.append(("attention/expert", "q[1,50,8,256] kv 560+50",
                lambda be: K.attention(qs, k, v, mask, ks, vs, backend=be), 2 * _nbytes(qs) + _nbytes(k, v, ks, vs),
                4 * 50 * 610 * 8 * 256))
    qkv_s = rnd(2, 256, 3, 16, 72)
    qv, kv_, vv = qkv_s[:, :, 0], qkv_s[:, :, 1].transpose(1, 2), qkv_s[:, :, 2].transpose(1, 2)
    out.append(("attention/siglip", "q[2,256,16,72]", lambda be: K.attention(qv, kv_, vv, backend=be),
                _nbytes(qkv_s) + _nbytes(qv), 4 * 2 * 256 * 256 * 16 * 72))
    frames = torch.randint(0, 256, (2, 480, 640, 3), dtype=torch.uint8, device=dev, generator=g)
    out.append(("preprocess_images/2x480x640", "[2,480,640,3] u8",
                lambda be: K.preprocess_images(frames, dtype=dtype, backend=be),
                _nbytes(frames) + 2 * 3 * 224 * 224 * torch.tensor([], dtype=dtype).element_size(), 0))
    return out


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def time_eager(fn, iters, reps):
    samples = []
    for _ in range(iters):
        start, end = _events()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(samples)


def time_graph(fn, iters, reps):
    """Median us per call over `iters` replays of a CUDA graph of `reps` calls (flashrt_bench.harness.graph_ms)."""
    from flashrt_bench.harness import graph_ms

    return graph_ms(lambda _: fn(), [None] * reps, rounds=iters) * 1e3


def max_diff(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def sweep_attention(dtype, dev, iters, reps):
    """Time attention launch configs (BLOCK_M, BLOCK_N, splits, warps) at the three pi0.5 shapes, to tune
    flash_attention._blocks; configs that do not fit the GPU (shared memory, registers) are skipped."""
    from flashrt_core.kernels import reference as R
    from flashrt_core.kernels.flash_attention import attention

    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(dtype)

    mask = torch.ones(1, 560, dtype=torch.bool, device=dev)
    mask[:, 540:] = False
    k, v = rnd(1, 1, 560, 256), rnd(1, 1, 560, 256)
    qkv_s = rnd(2, 256, 3, 16, 72)
    shapes = {
        "prefix": ((rnd(1, 560, 8, 256), k, v, mask), (32, 64, 128), (1, 2, 4)),
        "expert": ((rnd(1, 50, 8, 256), k, v, mask, rnd(1, 1, 50, 256), rnd(1, 1, 50, 256)), (16, 32, 64, 128),
                   (1, 4, 8, 16, 32)),
        "siglip": ((qkv_s[:, :, 0], qkv_s[:, :, 1].transpose(1, 2), qkv_s[:, :, 2].transpose(1, 2)),
                   (32, 64, 128), (1, 2)),
    }
    results = []
    for name, (args, block_ms, splits_list) in shapes.items():
        ref = R.attention_ref(*args)
        for bm in block_ms:
            for bn in (32, 64):
                for splits in splits_list:
                    for warps in (4, 8):
                        cfg = (bm, bn, splits, warps)
                        try:
                            err = (attention(*args, config=cfg).float() - ref.float()).abs().max().item()
                            us = time_graph(lambda: attention(*args, config=cfg), iters, reps)
                        except Exception as exc:  # noqa: BLE001 - an unlaunchable config is a result too
                            torch.cuda.synchronize()
                            results.append({"shape": name, "config": cfg, "error": str(exc).splitlines()[0][:120]})
                            continue
                        results.append({"shape": name, "config": cfg, "us": us, "max_abs_diff": err})
        best = sorted((r for r in results if r["shape"] == name and "us" in r), key=lambda r: r["us"])[:3]
        print(f"attention sweep {name}: " + "; ".join(f"{r['config']} {r['us']:.2f} us" for r in best))
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--iters", type=int, default=30, help="timing samples per op (median reported)")
    p.add_argument("--reps", type=int, default=20, help="calls per sample")
    p.add_argument("--only", default="", help="comma-separated name prefixes, e.g. attention,geglu")
    p.add_argument("--sweep-attention", action="store_true", help="also time attention launch configs")
    p.add_argument("--json", default="", help="output file (default benchmarks/results/kernels_<gpu>_<date>.json)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU (none visible); nothing measured", file=sys.stderr)
        return 2
    import triton

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    dev = torch.device("cuda")
    only = [s for s in args.only.split(",") if s]
    rows = []
    for name, shape, call, nbytes, flops in cases(dtype, dev):
        if only and not any(name.startswith(o) for o in only):
            continue
        diff = max_diff(call("triton"), call("torch"))
        row = {"op": name, "shape": shape, "dtype": args.dtype, "bytes": nbytes, "flops": flops,
               "max_abs_diff": diff}
        for backend in ("triton", "torch"):
            fn = (lambda c=call, b=backend: c(b))
            row[f"{backend}_eager_us"] = time_eager(fn, args.iters, args.reps)
            try:
                row[f"{backend}_graph_us"] = time_graph(fn, args.iters, args.reps)
            except RuntimeError as err:  # not capturable: report eager time instead, and say so
                print(f"{name} [{backend}]: CUDA graph capture failed ({str(err).splitlines()[0]}); "
                      f"using the eager time", file=sys.stderr)
                torch.cuda.synchronize()
                row[f"{backend}_graph_us"] = row[f"{backend}_eager_us"]
                row[f"{backend}_graph_failed"] = True
        row["speedup_graph"] = row["torch_graph_us"] / row["triton_graph_us"]
        row["triton_GBps"] = nbytes / row["triton_graph_us"] / 1e3
        row["triton_frac_copy_ceiling"] = row["triton_GBps"] / (COPY_TBPS * 1e3)
        row["triton_TFLOPs"] = flops / row["triton_graph_us"] / 1e6 if flops else None
        rows.append(row)
        torch.cuda.empty_cache()

    if args.sweep_attention:  # split configs use one ticket workspace, as in the engine (no per-call zeros)
        from flashrt_core.kernels import new_semaphore_workspace, semaphore_workspace

        with semaphore_workspace(new_semaphore_workspace(dev)):
            sweep = sweep_attention(dtype, dev, args.iters, args.reps)
    else:
        sweep = None
    gpu = torch.cuda.get_device_name(dev)
    header = f"{'op':38s} {'shape':30s} {'triton us':>9s} {'torch us':>9s} {'x':>6s} {'GB/s':>7s} " \
             f"{'%copy':>6s} {'TFLOP/s':>8s} {'eager tri/torch us':>19s} {'max|diff|':>9s}"
    print(f"{gpu}  torch {torch.__version__}  triton {triton.__version__}  dtype {args.dtype}  "
          f"(graph-replayed medians, {args.reps} calls x {args.iters} samples)")
    print(header)
    print("-" * len(header))
    for r in rows:
        tf = f"{r['triton_TFLOPs']:8.1f}" if r["triton_TFLOPs"] else f"{'':8s}"
        print(f"{r['op']:38s} {r['shape']:30s} {r['triton_graph_us']:9.2f} {r['torch_graph_us']:9.2f} "
              f"{r['speedup_graph']:6.2f} {r['triton_GBps']:7.0f} {100 * r['triton_frac_copy_ceiling']:5.1f}% {tf} "
              f"{r['triton_eager_us']:9.1f}/{r['torch_eager_us']:<9.1f} {r['max_abs_diff']:9.2e}")
    now = datetime.datetime.now(datetime.timezone.utc)
    path = pathlib.Path(args.json) if args.json else REPO / "benchmarks" / "results" / (
        f"kernels_{gpu.replace(' ', '_')}_{now:%Y%m%d_%H%M%S}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "benchmark": "bench_kernels", "gpu": gpu, "commit": commit(), "date": now.isoformat(),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "dtype": args.dtype, "iters": args.iters, "reps": args.reps, "copy_ceiling_TBps": COPY_TBPS,
        "rows": rows, "attention_sweep": sweep}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
