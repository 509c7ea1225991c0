"""The policy node's soak: the node process itself, its cameras at 30 Hz, its capsule services called every 10 s.

bench_soak.py soaks `Runtime` in one process; this runs what a robot runs: `policy_node` (the tiny model on the CPU
at its contract's rates, `config/pi05_tiny.yaml`: act 50 Hz, observe 10 Hz; or --contract / --device), synthetic
cameras and joints as another process, and this process as the robot side: it records every chunk, the node's
/diagnostics, and every 10 s calls snapshot (device, then disk), list, restore, fork, export (into capsule_dir),
import and the drops that keep the capsule count flat, timing each reply. Every 10 s it reads the node's RSS.
    python benchmarks/bench_node_soak.py --minutes 9 [--device cpu] [--out benchmarks/results/node_soak_cpu_tiny.json]
Writes: ticks (chunks and their rate), gaps between chunks over 1.5 act periods (the chunk topic's deadline) and the
node's own deadline-miss and overrun counters, service latencies per verb, memory growth (RSS after the first
minute, and its slope).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402

CALL_EVERY_S = 10.0
WARMUP_S = 60.0  # memory growth is measured from here (imports, first allocations and caches come before)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Robot:
    """The robot's side of the node: chunk and /diagnostics recorders, the capsule clients (spun in a thread)."""

    def __init__(self, node_name: str):
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import QoSProfile, ReliabilityPolicy

        from flashrt_ros.msg import ActionChunk
        from flashrt_ros.srv import (DropCapsule, ExportCapsule, ForkCapsule, ImportCapsule, ListCapsules,
                                     RestoreCapsule, SnapshotCapsule)

        self.node = rclpy.create_node("soak_robot")
        self.chunks: list[tuple[float, int, float]] = []  # (arrival monotonic, first-action stamp ns, latency ms)
        self.status: dict[str, str] = {}
        self.node.create_subscription(ActionChunk, f"/{node_name}/action_chunk", self._on_chunk,
                                      QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 10)
        self.types = {"snapshot": SnapshotCapsule, "list_capsules": ListCapsules, "restore": RestoreCapsule,
                      "fork": ForkCapsule, "export_capsule": ExportCapsule, "import_capsule": ImportCapsule,
                      "drop_capsule": DropCapsule}
        self.clients = {v: self.node.create_client(t, f"/{node_name}/{v}") for v, t in self.types.items()}
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        threading.Thread(target=self.executor.spin, daemon=True).start()

    def _on_chunk(self, msg):
        stamp = msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec
        self.chunks.append((time.monotonic(), stamp, float(msg.latency_ms)))

    def _on_diag(self, msg):
        for status in msg.status:
            if status.name.endswith("policy_node: policy"):
                self.status = {kv.key: kv.value for kv in status.values} | {"message": status.message}

    def call(self, verb: str, timeout: float = 60.0, **fields):
        """(reply, seconds) of one service call."""
        client = self.clients[verb]
        if not client.wait_for_service(timeout_sec=timeout):
            raise SystemExit(f"service {verb} not available")
        start = time.monotonic()
        future = client.call_async(self.types[verb].Request(**fields))
        while not future.done():
            if time.monotonic() - start > timeout:
                raise SystemExit(f"service {verb} did not answer within {timeout} s")
            time.sleep(0.001)
        return future.result(), time.monotonic() - start


def capsule_round(robot: Robot, n: int, latencies: dict, failures: list) -> None:
    """One round of the services; every capsule it makes is dropped again, so the store stays the same size."""
    def call(verb, **fields):
        reply, took = robot.call(verb, **fields)
        latencies.setdefault(verb, []).append(took * 1e3)
        if not reply.ok:
            failures.append(f"round {n} {verb}: {reply.message}")
        return reply

    snap = call("snapshot", name=f"soak{n}", tier="device" if n % 2 else "disk")
    call("list_capsules")
    call("restore", capsule_id=snap.capsule_id, rewind_time=False)
    fork = call("fork", capsule_id=snap.capsule_id, name=f"fork{n}")
    call("export_capsule", id=snap.capsule_id, path=f"exports/soak{n}")
    imported = call("import_capsule", path=f"exports/soak{n}", tier="host")
    for cid in (fork.capsule_id, imported.id, snap.capsule_id):
        if cid:
            call("drop_capsule", capsule_id=cid)


def stats_ms(xs) -> dict:
    a = np.asarray(xs, dtype=float)
    return {"n": int(a.size), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max())} if a.size else {"n": 0}


def soak(minutes: float, device: str, contract: str | None) -> tuple[dict, dict]:
    import rclpy
    import yaml

    from flashrt_ros.demo import _spawn, _stop, node_arguments
    from flashrt_ros.ros_env import apply_isolated_env

    env = apply_isolated_env()
    work = pathlib.Path(tempfile.mkdtemp(prefix="flashrt_node_soak_"))
    contract = contract or str(pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml")
    stages = yaml.safe_load(open(contract))["stages"]
    act_hz = float(stages["act"]["trigger"]["rate_hz"])
    args = node_arguments(2, 7, 0.0, 0.0, contract, "pick up the red cube", max_age_ms=0.0)
    args += ["-p", f"device:={device}", "-p", f"capsule_dir:={work / 'caps'}"]
    node = _spawn(args, env, str(work / "node.log"))
    sensors = _spawn(["flashrt_ros.synthetic", "--cameras", "2", "--joints", "7", "--camera-rate", "30"], env,
                     str(work / "sensors.log"))
    rclpy.init()
    robot = Robot("policy_node")
    latencies: dict[str, list] = {}
    failures: list[str] = []
    memory: list[tuple[float, float]] = []
    try:
        deadline = time.monotonic() + 300
        while len(robot.chunks) < 5:
            if node.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the node published no chunks; log: {work / 'node.log'}")
            time.sleep(0.1)
        start = time.monotonic()
        first_chunk = len(robot.chunks)
        end, n = start + minutes * 60, 0
        while time.monotonic() < end:
            n += 1
            capsule_round(robot, n, latencies, failures)
            memory.append((time.monotonic() - start, rss_mb(node.pid)))
            print(f"{memory[-1][0]:6.0f} s  chunks {len(robot.chunks) - first_chunk:6d}  rss {memory[-1][1]:7.1f} MB"
                  f"  {robot.status.get('message', '')[:80]}", flush=True)
            time.sleep(max(0.0, start + n * CALL_EVERY_S - time.monotonic()))
        duration = time.monotonic() - start
        final = dict(robot.status)
    finally:
        _stop(sensors)
        _stop(node)
        robot.executor.shutdown()
        rclpy.shutdown()
    chunks = [c for c in robot.chunks[first_chunk:] if c[0] <= start + duration]
    gaps_s = np.diff([c[1] for c in chunks]) / 1e9
    t_mem = np.array([t for t, _ in memory])
    rss = np.array([m for _, m in memory])
    after = t_mem >= WARMUP_S
    slope = float(np.polyfit(t_mem[after] / 60, rss[after], 1)[0]) if after.sum() >= 3 else None
    results = {
        "duration_s": round(duration, 1),
        "ticks": {"chunks": len(chunks), "chunk_rate_hz": len(chunks) / duration, "act_rate_hz": act_hz,
                  "compute_latency": stats_ms([c[2] for c in chunks]),
                  "gap_between_chunks": stats_ms(gaps_s * 1e3)},
        "deadline_misses": {
            "gaps_over_1.5_act_periods": int((gaps_s > 1.5 / act_hz).sum()),
            "gaps_over_2_act_periods": int((gaps_s > 2 / act_hz).sum()),
            "node_action_chunk_deadline_misses": int(final.get("action_chunk_deadline_misses", -1)),
            "node_tick_overruns": int(final.get("tick_overruns", -1))},
        "service_latency": {verb: stats_ms(xs) for verb, xs in latencies.items()},
        "service_failures": failures,
        "service_rounds": n,
        "memory": {"rss_mb_first": float(rss[0]), "rss_mb_at_1min": float(rss[after][0]) if after.any() else None,
                   "rss_mb_last": float(rss[-1]),
                   "growth_after_1min_mb": float(rss[-1] - rss[after][0]) if after.any() else None,
                   "slope_after_1min_mb_per_min": slope, "samples": [[round(t, 1), round(m, 1)] for t, m in memory]},
        "node_diagnostics_at_end": {k: v for k, v in final.items() if not k.startswith("last_refusal")},
    }
    workload = {"what": "policy_node process (tiny pi0.5 model) with 2 synthetic 320x240 rgb8 cameras at 30 Hz and "
                        "joints at 100 Hz; capsule services every 10 s", "contract": os.path.relpath(contract),
                "device": device, "cpu": cpu_name(), "cores": os.cpu_count(), "minutes": minutes}
    return workload, results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=9.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--contract", default=None, help="contract YAML (default config/pi05_tiny.yaml)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results" /
                                             "node_soak_cpu_tiny.json"))
    args = parser.parse_args(argv)
    workload, results = soak(args.minutes, args.device, args.contract)
    ticks, misses, memory = results["ticks"], results["deadline_misses"], results["memory"]
    print(f"\n{ticks['chunks']} chunks in {results['duration_s']} s ({ticks['chunk_rate_hz']:.1f} Hz of "
          f"{ticks['act_rate_hz']:g}); gaps > 1.5 act periods: {misses['gaps_over_1.5_act_periods']}, node deadline "
          f"misses {misses['node_action_chunk_deadline_misses']}, overruns {misses['node_tick_overruns']}")
    print(f"{'service':<16} {'calls':>6} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for verb, s in results["service_latency"].items():
        print(f"{verb:<16} {s['n']:>6} {s['p50_ms']:>9.1f} {s['p99_ms']:>9.1f} {s['max_ms']:>9.1f}")
    print(f"RSS {memory['rss_mb_first']:.1f} -> {memory['rss_mb_last']:.1f} MB (after the first minute: "
          f"{memory['growth_after_1min_mb']} MB, {memory['slope_after_1min_mb_per_min']} MB/min); "
          f"service failures: {len(results['service_failures'])}")
    write_result(args.out, workload=workload, results=results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
