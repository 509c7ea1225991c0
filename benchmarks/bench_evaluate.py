"""`flashrt evaluate` throughput: bags per minute on a local Ray cluster, and how it scales with workers.

CPU (default): 40 short bags (1 s: ten decisions of the tiny model at 56x56 images, act 10 Hz, observe 5 Hz)
evaluated with 1 and 2 CPU workers; the scaling ratio is the 2-worker rate over the 1-worker rate (each worker
gets cores / workers torch threads, as `flashrt evaluate` gives them).
    python benchmarks/bench_evaluate.py [--bags 40] [--workers 1,2] [--out benchmarks/results/evaluate_cpu_tiny.json]
GPU (--gpu): the same bags (longer: --duration 5) through the full-size pi0.5 contract (config/pi05.yaml, random
weights unless --checkpoint), one actor holding the whole GPU against several sharing it (Ray fractional GPUs).
    python benchmarks/bench_evaluate.py --gpu [--actors-per-gpu 1,2,4] [--out benchmarks/results/evaluate_gpu_pi05.json]
Per configuration: end-to-end bags/min (Ray start, runtime builds and every bag), steady bags/min (first result
to last), and the mean replay time per bag inside a worker. Bags are made once (4 seeds, copied to --bags).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import random
import shutil
import sys
import tempfile
import time

import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import REPO, write_result  # noqa: E402
from bench_node_soak import cpu_name  # noqa: E402


def small_contract(path: pathlib.Path) -> pathlib.Path:
    """The tiny model at 56x56 images, act 10 Hz, observe 5 Hz: a 1 s bag is ten decisions on a CPU."""
    data = yaml.safe_load((REPO / "config" / "pi05_tiny.yaml").read_text())
    data["model"]["options"].update(image_height=56, image_width=56)
    data["stages"]["act"]["trigger"]["rate_hz"] = 10
    data["stages"]["observe"]["trigger"]["rate_hz"] = 5
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def make_bags(root: pathlib.Path, n: int, duration: float, contract: pathlib.Path) -> pathlib.Path:
    from flashrt_ros.replay.make_bag import make_bag

    bags = root / "bags"
    made = []
    for seed in range(min(4, n)):
        made.append(bags / f"seed{seed}")
        make_bag(made[-1], duration=duration, seed=seed, config=contract, height=120, width=160)
    for i in range(len(made), n):
        shutil.copytree(made[i % len(made)], bags / f"copy{i:03d}")
    return bags


def measure(bags, contract, report, **kw) -> dict:
    from flashrt_ros.evaluate import evaluate

    stamps = []
    t0 = time.perf_counter()
    data = evaluate([str(bags)], report, config=contract, progress=False,
                    on_result=lambda row: stamps.append(time.perf_counter()), **kw)
    wall = time.perf_counter() - t0
    n = len(stamps)
    rows = [r for r in data["rows"] if r["status"] == "ok"]
    import json

    per_bag = [json.loads((pathlib.Path(report) / "bags" / f"{r['key']}.json").read_text())["replay_wall_s"]
               for r in rows]
    return {"bags": n, "ok": len(rows), "wall_s": wall, "first_result_s": stamps[0] - t0 if stamps else None,
            "bags_per_min": n * 60 / wall, "steady_bags_per_min": (n - 1) * 60 / (stamps[-1] - stamps[0])
            if n > 1 and stamps[-1] > stamps[0] else None,
            "replay_s_per_bag_mean": sum(per_bag) / len(per_bag) if per_bag else None,
            "decisions": data["totals"]["decisions"]}


def table(rows: list[tuple[str, dict]]) -> str:
    head = ["configuration", "bags", "wall s", "first result s", "bags/min", "steady bags/min", "replay s/bag"]
    lines = [head]
    for name, r in rows:
        lines.append([name, str(r["bags"]), f"{r['wall_s']:.1f}", f"{r['first_result_s']:.1f}",
                      f"{r['bags_per_min']:.1f}", f"{r['steady_bags_per_min']:.1f}" if r["steady_bags_per_min"]
                      else "-", f"{r['replay_s_per_bag_mean']:.2f}"])
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bags", type=int, default=40)
    p.add_argument("--duration", type=float, default=None, help="seconds per bag (default 1; --gpu: 5)")
    p.add_argument("--workers", default="1,2", help="CPU worker counts to compare (default 1,2)")
    p.add_argument("--gpu", action="store_true", help="full-size pi0.5 on the GPU: actors sharing it vs one")
    p.add_argument("--actors-per-gpu", default="1,2,4", help="--gpu: actors per GPU to compare (default 1,2,4)")
    p.add_argument("--contract", default=None, help="--gpu: contract (default config/pi05.yaml)")
    p.add_argument("--checkpoint", default=None, help="--gpu: LeRobot checkpoint folder (default: random weights)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")  # (no ROS graph is used; the rule holds)
    os.environ.setdefault("ROS_DOMAIN_ID", str(random.randint(1, 200)))
    os.environ.setdefault("ROS_LOG_DIR", tempfile.mkdtemp(prefix="flashrt_roslog_"))
    duration = args.duration or (5.0 if args.gpu else 1.0)
    with tempfile.TemporaryDirectory(prefix="bench_evaluate_") as tmp:
        root = pathlib.Path(tmp)
        made_with = small_contract(root / "tiny_small.yaml")
        t = time.perf_counter()
        bags = make_bags(root, args.bags, duration, made_with)
        print(f"made {args.bags} bags of {duration:g} s in {time.perf_counter() - t:.0f} s", flush=True)
        results = []
        if args.gpu:
            import torch

            contract = pathlib.Path(args.contract or REPO / "config" / "pi05.yaml")
            for m in [int(x) for x in args.actors_per_gpu.split(",")]:
                name = f"{torch.cuda.device_count()} GPU x {m} actor(s)"
                results.append((name, measure(bags, contract, root / f"report_gpu{m}", device="cuda",
                                              actors_per_gpu=m, checkpoint=args.checkpoint)))
                print(table(results[-1:]), flush=True)
            workload = {"contract": str(contract), "checkpoint": args.checkpoint, "bags": args.bags,
                        "bag_s": duration, "made_with": "tiny 56x56 act 10 Hz (references only)"}
            out = args.out or REPO / "benchmarks" / "results" / "evaluate_gpu_pi05.json"
            ratios = {f"{name} / 1 actor": r["steady_bags_per_min"] / results[0][1]["steady_bags_per_min"]
                      for name, r in results[1:] if r["steady_bags_per_min"]}
        else:
            for w in [int(x) for x in args.workers.split(",")]:
                results.append((f"{w} CPU worker(s)", measure(bags, made_with, root / f"report_cpu{w}", workers=w,
                                                              device="cpu")))
                print(table(results[-1:]), flush=True)
            workload = {"contract": "config/pi05_tiny.yaml at 56x56 images, act 10 Hz, observe 5 Hz", "bags": args.bags,
                        "bag_s": duration, "decisions_per_bag": round(duration * 10) + 1}
            out = args.out or REPO / "benchmarks" / "results" / "evaluate_cpu_tiny.json"
            base = results[0][1]
            ratios = {f"{name} / {results[0][0]}": {
                "steady": r["steady_bags_per_min"] / base["steady_bags_per_min"],
                "end_to_end": r["bags_per_min"] / base["bags_per_min"]} for name, r in results[1:]}
    print()
    print(table(results))
    print("scaling:", ", ".join(f"{k}: {v if isinstance(v, float) else v['steady']:.2f}x" for k, v in ratios.items()))
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()}
    write_result(out, workload, {name: r for name, r in results}, extra={"scaling": ratios, "machine": machine})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
