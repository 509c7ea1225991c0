"""`flashrt demo`: the policy node, synthetic sensors and a chunk listener as separate processes.

The demo process itself is a ROS client: it drives snapshot / fork / restore through the capsule services
while the node runs, then prints what arrived (rate, latency, observation age, prefix refreshes) and exits
0 when chunks arrived at the configured act rate (within 20%).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from flashrt_ros.ros_env import apply_isolated_env
from flashrt_ros.synthetic import joint_names

RATE_TOLERANCE = 0.20


def _spawn(args, env, log_path):
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc, timeout=5.0):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def node_arguments(cameras: int, joints: int, act_rate: float, observe_rate: float, config: str | None,
                   prompt: str, max_age_ms: float = 500.0, image_size=(240, 320)) -> list[str]:
    topics = ",".join(f'"camera{i}/image_raw"' for i in range(cameras))
    names = ",".join(f'"{n}"' for n in joint_names(joints))
    ros = ["-p", "autostart:=true", "-p", f"camera_topics:=[{topics}]", "-p", f"joint_names:=[{names}]",
           "-p", f"prompt:={prompt}", "-p", f"act_rate_hz:={act_rate}", "-p", f"observe_rate_hz:={observe_rate}",
           "-p", f"max_observation_age_ms:={max_age_ms}", "-p", "device:=cpu", "-p", "cpu_threads:=1",
           "-p", f"image_height:={image_size[0]}", "-p", f"image_width:={image_size[1]}"]
    if config:
        ros += ["-p", f"contract:={os.path.abspath(config)}"]
    return ["flashrt_ros.policy_node", "--ros-args", "-r", "__node:=policy_node", *ros]


def _call(node, client, request, timeout=10.0):
    import rclpy

    future = client.call_async(request)
    rclpy.spin_until_future_complete(node, future, timeout_sec=timeout)
    if not future.done():
        raise RuntimeError(f"service {client.srv_name} did not answer within {timeout} s")
    return future.result()


def capsule_clients(node) -> dict:
    """Clients of the node's capsule services. Create them early: a client used right after discovery can
    lose its first response (the server's response writer has not found it yet)."""
    from flashrt_ros.srv import DropCapsule, ForkCapsule, ListCapsules, RestoreCapsule, SnapshotCapsule

    return {name: node.create_client(t, f"/policy_node/{name}") for name, t in (
        ("snapshot", SnapshotCapsule), ("fork", ForkCapsule), ("list_capsules", ListCapsules),
        ("restore", RestoreCapsule), ("drop_capsule", DropCapsule))}


def exercise_capsules(node, clients) -> list[str]:
    """snapshot -> fork -> list -> restore -> drop through the services; returns one line per call."""
    from flashrt_ros.srv import DropCapsule, ForkCapsule, ListCapsules, RestoreCapsule, SnapshotCapsule

    for client in clients.values():
        if not client.wait_for_service(timeout_sec=30.0):
            raise RuntimeError(f"service {client.srv_name} not available")
    lines = []
    snap = _call(node, clients["snapshot"], SnapshotCapsule.Request(name="demo_start", tier="host"))
    lines.append(f"snapshot  ok={snap.ok} id={snap.capsule_id} {snap.message}")
    time.sleep(0.5)  # let the policy run on so the restore really rewinds something
    fork = _call(node, clients["fork"], ForkCapsule.Request(capsule_id=snap.capsule_id, name="branch_b"))
    lines.append(f"fork      ok={fork.ok} id={fork.capsule_id}")
    listing = _call(node, clients["list_capsules"], ListCapsules.Request())
    lines.append(f"list      ok={listing.ok} " + ", ".join(f"{c.capsule_id}:{c.name}@{c.tier}" for c in listing.capsules))
    restore = _call(node, clients["restore"], RestoreCapsule.Request(capsule_id=snap.capsule_id))
    lines.append(f"restore   ok={restore.ok} {restore.message}")
    bad = _call(node, clients["restore"], RestoreCapsule.Request(capsule_id="no-such-capsule"))
    lines.append(f"restore of an unknown id -> ok={bad.ok} ({bad.message})")
    drop = _call(node, clients["drop_capsule"], DropCapsule.Request(capsule_id=fork.capsule_id))
    lines.append(f"drop      ok={drop.ok} {drop.message}")
    ok = snap.ok and fork.ok and listing.ok and restore.ok and drop.ok and not bad.ok
    return lines, ok


def run_listener(argv=None) -> None:
    """A separate process: records every ActionChunk for `--duration` seconds, writes JSON."""
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    from flashrt_ros.msg import ActionChunk

    parser = argparse.ArgumentParser(prog="flashrt-chunk-listener")
    parser.add_argument("--topic", default="/policy_node/action_chunk")
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--out", required=True)
    args, ros_args = parser.parse_known_args(argv)
    rclpy.init(args=ros_args)
    node = rclpy.create_node("chunk_listener")
    rows = []

    def on_chunk(msg):
        now = time.time_ns()
        sent = msg.publish_stamp.sec * 10**9 + msg.publish_stamp.nanosec
        obs = msg.observation_stamp.sec * 10**9 + msg.observation_stamp.nanosec
        rows.append({"t": now * 1e-9, "decision_id": msg.decision_id, "prefix_id": msg.prefix_id,
                     "latency_ms": msg.latency_ms, "observation_age_ms": msg.observation_age_ms,
                     "transport_ms": (now - sent) / 1e6, "obs_to_arrival_ms": (now - obs) / 1e6,
                     "ran": list(msg.stages_ran), "horizon": msg.horizon, "action_dim": msg.action_dim,
                     "finite": bool(np.all(np.isfinite(np.asarray(msg.actions))))})

    node.create_subscription(ActionChunk, args.topic, on_chunk, QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE))
    diagnostics = {}

    def on_diagnostics(msg):
        for status in msg.status:
            if status.name == "/policy_node: policy":  # (named by the node's fully qualified name)
                diagnostics.update({kv.key: kv.value for kv in status.values}, level=int(status.level[0]),
                                   message=status.message)

    node.create_subscription(DiagnosticArray, "/diagnostics", on_diagnostics, 10)
    end = time.monotonic() + args.duration
    while time.monotonic() < end:
        rclpy.spin_once(node, timeout_sec=0.05)
    with open(args.out, "w") as f:
        json.dump({"chunks": rows, "diagnostics": diagnostics}, f)
    node.destroy_node()
    rclpy.shutdown()


def summarize(rows: list[dict], act_rate: float, observe_rate: float) -> dict:
    if len(rows) < 3:
        return {"chunks": len(rows), "rate_hz": 0.0, "ok": False}
    # Steady state: skip the first second after the first chunk (warm-up, discovery).
    t0 = rows[0]["t"] + 1.0
    steady = [r for r in rows if r["t"] >= t0] or rows
    span = steady[-1]["t"] - steady[0]["t"]
    rate = (len(steady) - 1) / span if span > 0 else 0.0
    prefixes = sorted({r["prefix_id"] for r in steady})
    prefix_rate = (len(prefixes) - 1) / span if span > 0 else 0.0
    pct = lambda key, q: float(np.percentile([r[key] for r in steady], q))
    return {
        "chunks": len(rows), "steady_chunks": len(steady), "rate_hz": rate, "target_act_hz": act_rate,
        "prefix_refresh_hz": prefix_rate, "target_observe_hz": observe_rate,
        "compute_latency_ms_p50": pct("latency_ms", 50), "compute_latency_ms_p99": pct("latency_ms", 99),
        "transport_ms_p50": pct("transport_ms", 50), "observation_age_ms_p50": pct("observation_age_ms", 50),
        "observation_age_ms_max": pct("observation_age_ms", 100), "all_finite": all(r["finite"] for r in rows),
        "shape": f"{rows[-1]['horizon']}x{rows[-1]['action_dim']}",
        "ok": abs(rate - act_rate) <= RATE_TOLERANCE * act_rate and all(r["finite"] for r in rows),
    }


def demo(duration: float = 8.0, config: str | None = None, cameras: int = 2, joints: int = 7,
         act_rate: float = 20.0, observe_rate: float = 5.0, prompt: str = "pick up the red cube",
         json_out: str | None = None) -> int:
    if config:  # a contract that cannot load is reported now, not after the demo ran without a policy
        from flashrt_core.contract.spec import load_contract
        from flashrt_core.errors import FlashRTError

        try:
            load_contract(config)
        except FlashRTError as exc:
            print(f"flashrt demo: --config {config}: INVALID: {exc}", file=sys.stderr)
            return 1
    env = apply_isolated_env()
    import rclpy

    workdir = tempfile.mkdtemp(prefix="flashrt_demo_")
    out = os.path.join(workdir, "chunks.json")
    print(f"flashrt demo: ROS_DOMAIN_ID={env['ROS_DOMAIN_ID']} (loopback only), logs in {workdir}")
    node_proc = _spawn(node_arguments(cameras, joints, act_rate, observe_rate, config, prompt), env,
                       os.path.join(workdir, "policy_node.log"))
    sensors = _spawn(["flashrt_ros.synthetic", "--cameras", str(cameras), "--joints", str(joints)], env,
                     os.path.join(workdir, "sensors.log"))
    listener = _spawn(["flashrt_ros.demo", "--duration", str(duration), "--out", out], env,
                      os.path.join(workdir, "listener.log"))
    rclpy.init()
    client = rclpy.create_node("flashrt_demo")
    clients = capsule_clients(client)
    capsule_lines, capsules_ok = [], False
    try:
        time.sleep(min(3.0, duration / 3))
        try:
            capsule_lines, capsules_ok = exercise_capsules(client, clients)
        except RuntimeError as exc:
            capsule_lines = [f"capsule services failed: {exc}"]
        listener.wait(timeout=duration + 60)
    finally:
        for proc in (node_proc, sensors, listener):
            _stop(proc)
        client.destroy_node()
        rclpy.shutdown()
    recorded = json.load(open(out)) if os.path.exists(out) else {"chunks": [], "diagnostics": {}}
    rows, diagnostics = recorded["chunks"], recorded["diagnostics"]
    summary = summarize(rows, act_rate, observe_rate)
    summary["node_diagnostics"] = diagnostics
    summary["capsules_ok"] = capsules_ok
    span = rows[-1]["t"] - rows[0]["t"] if rows else 0.0
    print(f"\nchunks received: {summary['chunks']} in the {span:.1f} s after the first one (listener ran "
          f"{duration:.1f} s, start-up included)")
    if summary["chunks"] >= 3:
        print(f"act rate:        {summary['rate_hz']:.1f} Hz (configured {act_rate:.0f} Hz, tolerance 20%)")
        print(f"prefix refresh:  {summary['prefix_refresh_hz']:.1f} Hz (configured {observe_rate:.0f} Hz)")
        print(f"compute latency: p50 {summary['compute_latency_ms_p50']:.2f} ms, p99 {summary['compute_latency_ms_p99']:.2f} ms")
        print(f"transport:       p50 {summary['transport_ms_p50']:.2f} ms (publish -> listener)")
        print(f"observation age: p50 {summary['observation_age_ms_p50']:.1f} ms, max {summary['observation_age_ms_max']:.1f} ms")
        print(f"chunk shape:     {summary['shape']}, all finite: {summary['all_finite']}")
    stages = sorted({k.split(".")[0] for k in diagnostics if k.endswith(".rate_hz")})
    if stages:
        print("per stage (node diagnostics):")
        for stage in stages:
            get = lambda key: diagnostics.get(f"{stage}.{key}", "?")
            print(f"  {stage:<9} {get('rate_hz'):>6} Hz  latency p50 {get('latency_p50_ms')} ms, "
                  f"p99 {get('latency_p99_ms')} ms  ({get('count')} runs at the last diagnostics message)")
    print("capsules:")
    for line in capsule_lines:
        print(f"  {line}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(summary, f, indent=2)
    ok = summary["ok"] and capsules_ok
    if not ok:
        print(f"\nDEMO FAILED (see logs in {workdir})")
        for name in ("policy_node.log", "sensors.log", "listener.log"):
            tail = open(os.path.join(workdir, name)).read()[-1500:]
            print(f"--- {name} ---\n{tail}")
    else:
        print("\ndemo ok")
    return 0 if ok else 1


if __name__ == "__main__":
    run_listener()
