"""Capsule latency and bytes per tier, next to the copy floor.

Default state: full-size pi0.5 persistent buffers, prefix K and V for 18 layers of [1, 1, P, 256] bf16 with
P = 3*256 + 200 = 968 prefix tokens, plus the previous action chunk, the noise and the RNG state / counters.
Every op is timed as the host sees it (call returns) and until its copy is done (after a device sync);
restore also on the GPU timeline (CUDA events around it on the caller's stream). The device-tier floor is
2 * bytes / 4.2 TB/s (a copy reads and writes every byte); the issue's target is restore <= 2x floor + 50 us.

    python benchmarks/bench_capsule.py [--device cuda] [--iters 50] [--fused-kv] [--runtime]
        [--json benchmarks/results/x.json]

--fused-kv: the layout the contract runtime really keeps (one K and one V buffer for all layers: 6 buffers);
default: per-layer K/V buffers (40), as engines that keep one cache tensor per layer do.
--runtime: also time the verbs of a full-size pi0.5 contract runtime (config/pi05.yaml, W2: 2 views and a
48-token prompt, reference engine, random weights): `Runtime.snapshot / restore / fork` on the device tier,
which add the host-side state (ledger, clocks, RNG, prompt) and its checks to the copies; and the first
snapshot of a fresh runtime, without and after the capsule part of its warmup (`runtime_verbs.prepare`:
weights digest, store, spare slabs, copy paths), which moves that one-time work to configure time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's flashrt_core first
from flashrt_core.capsule import CapsuleStore, fingerprint  # noqa: E402
from flashrt_core.capsule.slab import arena  # noqa: E402
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import commit as _commit  # noqa: E402  (honours FLASHRT_COMMIT where there is no .git)

COPY_TBPS = 4.2  # measured device-to-device copy on the H200 (bytes read + written), docs/gpu-machine.md


def pi05_layout(layers=18, prefix=3 * 256 + 200, head_dim=256, chunk=50, action_dim=32, fused_kv=False):
    if fused_kv:  # one K and one V buffer for all layers
        layout = {"prefix_k": ((layers, 1, 1, prefix, head_dim), "bfloat16"),
                  "prefix_v": ((layers, 1, 1, prefix, head_dim), "bfloat16")}
    else:
        layout = {}
        for i in range(layers):
            layout[f"prefix_k.{i}"] = ((1, 1, prefix, head_dim), "bfloat16")
            layout[f"prefix_v.{i}"] = ((1, 1, prefix, head_dim), "bfloat16")
    layout.update({"prev_chunk": ((1, chunk, action_dim), "float32"),
                   "noise": ((1, chunk, action_dim), "float32"),
                   "rng_state": ((16,), "uint8"), "counters": ((4,), "int64")})
    return layout


def random_state(layout, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in layout.items():
        dt = getattr(torch, dtype)
        if dt.is_floating_point:
            t = torch.randn(shape, generator=g).to(dt)
        else:
            t = torch.randint(1, 100, shape, generator=g).to(dt)
        out[name] = t.to(device)
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, iters, after=None):
    """Median host-return and done latencies in us, and GPU-timeline us on CUDA."""
    ret, done, gpu = [], [], []
    for _ in range(iters):
        _sync(device)
        ev = None
        if device.type == "cuda":
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        if ev:
            ev[1].record()
        _sync(device)
        t2 = time.perf_counter()
        ret.append((t1 - t0) * 1e6)
        done.append((t2 - t0) * 1e6)
        if ev:
            gpu.append(ev[0].elapsed_time(ev[1]) * 1e3)
        if after:
            after(out)
    row = {"host_return_us": statistics.median(ret), "done_us": statistics.median(done)}
    if gpu:
        row["gpu_us"] = statistics.median(gpu)
    return row


def _reference_copies(live, device, iters):
    """What the bytes cost without the store: one flat copy and one multi-tensor copy of the same buffers."""
    total = sum(t.numel() * t.element_size() for t in live.values())
    src = torch.empty(total, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    rows = {"flat_copy": _time(lambda: dst.copy_(src), device, iters)}
    clones = [t.clone() for t in live.values()]
    # Typed lists of mixed dtypes fall back to one copy per tensor; int64 word views fuse into one launch.
    rows["foreach_typed"] = _time(lambda: torch._foreach_copy_(list(live.values()), clones), device, iters)
    dst_w = [t.reshape(-1).view(torch.uint8).view(torch.int64) for t in live.values()]
    src_w = [t.reshape(-1).view(torch.uint8).view(torch.int64) for t in clones]
    rows["foreach_words"] = _time(lambda: torch._foreach_copy_(dst_w, src_w), device, iters)
    return rows


def run(args) -> dict:
    device = torch.device(args.device)
    layout = pi05_layout(prefix=args.prefix, layers=args.layers, fused_kv=args.fused_kv)
    fp = fingerprint("pi05-bench", "random", "bfloat16", layout)
    live = random_state(layout, device)
    arena_flat = None
    if not args.separate:  # as the contract runtime allocates its persistent device buffers
        arena_flat, views = arena(layout, device)
        for name, t in live.items():
            views[name].copy_(t)
        live = views
    nbytes = sum(t.numel() * t.element_size() for t in live.values())
    disk_dir = pathlib.Path(args.disk_dir or tempfile.mkdtemp(prefix="flashrt_bench_caps_"))
    store = CapsuleStore(fp, device=device, disk_dir=disk_dir)
    results = {"reference": _reference_copies(live, device, args.iters)}
    for tier in args.tiers.split(","):
        iters = args.iters if tier != "disk" else max(3, args.iters // 10)
        row = {"snapshot": _time(lambda: store.snapshot("b", tier, live, {"decision_id": 1}), device, iters,
                                 after=store.drop)}
        cid = store.snapshot("keep", tier, live, {"decision_id": 1})
        row["restore"] = _time(lambda: store.restore(cid, live), device, iters)
        row["fork"] = _time(lambda: store.fork(cid, "f"), device, iters, after=store.drop)
        store.drop(cid)
        results[tier] = row
    floor_us = 2 * nbytes / (COPY_TBPS * 1e12) * 1e6
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {
        "benchmark": "capsule", "gpu": gpu, "device": str(device), "commit": args.commit or _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "buffers": len(layout), "bytes": nbytes, "prefix_tokens": args.prefix,
        "layers": args.layers, "fused_kv": args.fused_kv, "iters": args.iters,
        "live_allocation": "separate" if args.separate else "arena",
        "arena_bytes": None if arena_flat is None else arena_flat.numel(),
        "copy_floor_us": floor_us, "restore_target_us": 2 * floor_us + 50, "results": results,
    }
    if device.type == "cuda":
        restore = results.get("device", {}).get("restore", {})
        report["device_restore_meets_target"] = restore.get("done_us", 1e9) <= report["restore_target_us"]
    if args.runtime:
        report["runtime"] = runtime_verbs(device, args.iters, args.runtime_config)
    return report


def _seconds(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def first_snapshots(device, config) -> dict:
    """Seconds of the first device-tier snapshots of two fresh runtimes: one cold (the first call does the
    one-time work), one after the capsule part of warmup (timed too)."""
    from flashrt_core.capsule import runtime_verbs as capsule_verbs
    from flashrt_core.contract.runtime import Runtime

    out = {}
    for case in ("cold", "after_prepare"):
        rt = Runtime.from_config(config, device=device, seed=0, options={"engine": "reference"})
        rt.set_prompt("pick up the red cube")
        if case == "after_prepare":
            out["prepare_s"] = _seconds(lambda: capsule_verbs.prepare(rt), device)
        out[f"{case}_first_s"] = _seconds(lambda: rt.snapshot("first", "device"), device)
        out[f"{case}_second_s"] = _seconds(lambda: rt.snapshot("second", "device"), device)
        rt.close()
    return out


def runtime_verbs(device, iters, config) -> dict:
    """Device-tier snapshot / restore / fork through a contract runtime (full-size pi0.5 by default)."""
    from flashrt_core.contract.runtime import Runtime

    config = pathlib.Path(config)
    first = first_snapshots(device, config)
    rt = Runtime.from_config(config, device=device, seed=0, options={"engine": "reference"})
    rt.set_prompt("pick up the red cube")
    bufs = rt.persistent_buffers()
    nbytes = sum(t.numel() * t.element_size() for t in bufs.values())
    device_bytes = sum(t.numel() * t.element_size() for t in bufs.values() if t.device.type == device.type)
    floor_us = 2 * device_bytes / (COPY_TBPS * 1e12) * 1e6
    rows = {"snapshot": _time(lambda: rt.snapshot("b", "device"), device, iters, after=rt.drop_capsule)}
    cid = rt.snapshot("keep", "device")
    rows["restore"] = _time(lambda: rt.restore(cid), device, iters)
    rows["fork"] = _time(lambda: rt.fork(cid, "f"), device, iters, after=rt.drop_capsule)
    out = {"config": config.name, "buffers": len(bufs), "bytes": nbytes, "device_bytes": device_bytes,
           "copy_floor_us": floor_us, "restore_target_us": 2 * floor_us + 50, "results": rows,
           "restore_meets_target": rows["restore"]["done_us"] <= 2 * floor_us + 50, "first_snapshot": first}
    rt.close()
    return out


def print_table(report) -> None:
    mb = report["bytes"] / 1e6
    print(f"capsule bench on {report['gpu']}: {report['buffers']} buffers, {mb:.2f} MB, "
          f"copy floor {report['copy_floor_us']:.1f} us, restore target {report['restore_target_us']:.1f} us")
    print(f"{'tier':<10}{'op':<14}{'return us':>11}{'done us':>11}{'gpu us':>10}{'GB/s':>9}")
    for tier, row in report["results"].items():
        for op, t in row.items():
            gbps = report["bytes"] / (t["done_us"] * 1e-6) / 1e9
            gpu = f"{t['gpu_us']:.1f}" if "gpu_us" in t else "-"
            print(f"{tier:<10}{op:<14}{t['host_return_us']:>11.1f}{t['done_us']:>11.1f}{gpu:>10}{gbps:>9.1f}")
    rt = report.get("runtime")
    if rt:
        print(f"runtime verbs ({rt['config']}: {rt['buffers']} buffers, {rt['bytes'] / 1e6:.2f} MB, copy floor "
              f"{rt['copy_floor_us']:.1f} us, restore target {rt['restore_target_us']:.1f} us)")
        for op, t in rt["results"].items():
            gpu = f"{t['gpu_us']:.1f}" if "gpu_us" in t else "-"
            print(f"{'runtime':<10}{op:<14}{t['host_return_us']:>11.1f}{t['done_us']:>11.1f}{gpu:>10}{'':>9}")
        f = rt["first_snapshot"]
        print(f"first device snapshot of a fresh runtime: cold {f['cold_first_s'] * 1e3:.1f} ms (second "
              f"{f['cold_second_s'] * 1e3:.2f} ms); after warmup's capsule prepare ({f['prepare_s']:.2f} s) "
              f"{f['after_prepare_first_s'] * 1e3:.2f} ms (second {f['after_prepare_second_s'] * 1e3:.2f} ms)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiers", default="device,host,disk")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--prefix", type=int, default=3 * 256 + 200, help="prefix tokens P")
    p.add_argument("--fused-kv", action="store_true", help="one K and one V buffer for all layers")
    p.add_argument("--separate", action="store_true",
                   help="one allocation per live buffer (default: one arena, as the runtime allocates them)")
    p.add_argument("--runtime", action="store_true", help="also time Runtime.snapshot/restore/fork (pi05.yaml)")
    p.add_argument("--runtime-config", default=str(pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05.yaml"))
    p.add_argument("--disk-dir", default=None)
    p.add_argument("--commit", default=None)
    p.add_argument("--json", default=None, help="where to write the JSON report")
    args = p.parse_args(argv)
    report = run(args)
    print_table(report)
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
