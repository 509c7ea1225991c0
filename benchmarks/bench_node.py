"""Policy-node overhead on this machine (CPU, tiny model): image message in -> ActionChunk out, minus compute.

Runs the policy node, synthetic cameras/joints and a chunk listener as separate processes (as `flashrt
demo` does) and, for every chunk, splits the time from the observation's stamp to the chunk's arrival:
    wait      = observation age when the tick started (the observation waited for the act timer)
    compute   = the stages' latency reported in the chunk
    overhead  = arrival - stamp - wait - compute  (tick bookkeeping, message build, publish, DDS, callback)
plus the in-process cost of converting one camera message to model input, per encoding.
    python benchmarks/bench_node.py [--duration 10] [--out-dir benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402


def conversion_costs(repeats: int = 200) -> dict:
    import cv2
    from sensor_msgs.msg import CompressedImage, Image

    from flashrt_ros import conversions as cv
    from flashrt_ros.synthetic import camera_frame

    rgb = camera_frame(0, 0.3, 480, 640)
    cases = {enc: cv.rgb_to_image(rgb, Image, encoding=enc) for enc in ("rgb8", "bgr8", "mono8", "16UC1")}
    ok, jpeg = cv2.imencode(".jpg", rgb[..., ::-1])
    cases["jpeg"] = CompressedImage(format="jpeg", data=jpeg.tobytes())
    out = {}
    for name, msg in cases.items():
        fn = cv.compressed_to_rgb if name == "jpeg" else cv.image_to_rgb
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn(msg)
            times.append((time.perf_counter() - t) * 1e3)
        out[f"convert_640x480_{name}"] = {"p50_ms": float(np.percentile(times, 50)),
                                          "p99_ms": float(np.percentile(times, 99))}
    return out


def node_path(duration: float, act_rate: float, observe_rate: float) -> dict:
    from flashrt_ros.demo import _spawn, _stop, node_arguments
    from flashrt_ros.ros_env import apply_isolated_env

    env = apply_isolated_env()
    work = tempfile.mkdtemp(prefix="flashrt_bench_node_")
    out = os.path.join(work, "chunks.json")
    procs = [
        _spawn(node_arguments(2, 7, act_rate, observe_rate, None, "pick up the red cube"), env,
               os.path.join(work, "node.log")),
        _spawn(["flashrt_ros.synthetic", "--cameras", "2", "--joints", "7"], env, os.path.join(work, "sensors.log")),
    ]
    listener = _spawn(["flashrt_ros.demo", "--duration", str(duration), "--out", out], env,
                      os.path.join(work, "listener.log"))
    try:
        listener.wait(timeout=duration + 60)
    finally:
        for proc in procs + [listener]:
            _stop(proc)
    rows = json.load(open(out))["chunks"]
    rows = [r for r in rows if r["t"] >= rows[0]["t"] + 1.0]  # skip the first second (discovery, warm-up)
    if len(rows) < 5:
        raise SystemExit(f"too few chunks ({len(rows)}); logs in {work}")
    wait = np.array([r["observation_age_ms"] for r in rows])
    compute = np.array([r["latency_ms"] for r in rows])
    total = np.array([r["obs_to_arrival_ms"] for r in rows])
    overhead = total - wait - compute
    stats = lambda a: {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}
    return {"chunks": len(rows), "image_to_chunk_total": stats(total), "wait_for_tick": stats(wait),
            "compute": stats(compute), "overhead_excluding_compute_and_wait": stats(overhead),
            "publish_to_listener": stats(np.array([r["transport_ms"] for r in rows]))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--act-rate", type=float, default=20.0)
    parser.add_argument("--observe-rate", type=float, default=5.0)
    parser.add_argument("--out-dir", default=str(pathlib.Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    try:
        import rclpy  # noqa: F401
    except ImportError:
        print("bench_node needs rclpy (run it in the project's .venv); skipped")
        return 2
    results = conversion_costs()
    results.update(node_path(args.duration, args.act_rate, args.observe_rate))
    print(f"{'measure':<42} {'p50 ms':>9} {'p99 ms':>9}")
    for name, entry in results.items():
        if isinstance(entry, dict):
            print(f"{name:<42} {entry['p50_ms']:>9.3f} {entry['p99_ms']:>9.3f}")
    import platform

    path = pathlib.Path(args.out_dir) / "node_overhead_cpu_tiny.json"
    write_result(path, workload={"model": "pi05 tiny", "device": "cpu", "cameras": 2, "image": "240x320 rgb8",
                                 "act_rate_hz": args.act_rate, "observe_rate_hz": args.observe_rate,
                                 "duration_s": args.duration, "cpu": platform.processor() or platform.machine(),
                                 "cores": os.cpu_count()},
                 results=results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
