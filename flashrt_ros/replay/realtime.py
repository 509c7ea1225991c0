"""`replay --realtime`: play a bag onto ROS topics at bag rate against a running policy_node and record the
ActionChunks it publishes; the report then comes from the chunks' own fields (compute latency per set of
stages that ran, observation age) and their actions against the bag's recorded ones.

Header stamps are shifted onto the ROS clock (the node measures observation age against its own clock), and
back again for the report, so decision times line up with the bag's recorded chunks. Messages are sent as
CDR bytes serialized by rosbags (no rclpy message objects for frames), chunks are received raw and decoded
with rosbags too.
"""
from __future__ import annotations

import os
import time

import numpy as np

from flashrt_ros.replay import bagio
from flashrt_ros.replay.bagio import BagSource
from flashrt_ros.replay.errors import ReplayError
from flashrt_ros.replay.player import RecordedChunk, TickRecord
from flashrt_ros.replay.progress import Progress
from flashrt_ros.replay.report import build_report

NS = 1_000_000_000
DRAIN_S = 1.0  # after the last message: time for the node's last chunks to arrive


def _shift(store, msg, offset_ns: int) -> None:
    stamp = msg.header.stamp
    ns = int(stamp.sec) * NS + int(stamp.nanosec) + offset_ns
    msg.header.stamp = store.types["builtin_interfaces/msg/Time"](sec=ns // NS, nanosec=ns % NS)


def _chunk_tick(store, raw: bytes, offset_ns: int) -> TickRecord:
    m = store.deserialize_cdr(raw, bagio.ACTION_CHUNK)
    obs = int(m.observation_stamp.sec) * NS + int(m.observation_stamp.nanosec)
    stamp = int(m.header.stamp.sec) * NS + int(m.header.stamp.nanosec)
    tick_ns = (obs + round(m.observation_age_ms * 1e6) if obs else stamp) - offset_ns
    actions = np.asarray(m.actions, np.float32).reshape(int(m.horizon), int(m.action_dim))
    key = "+".join(m.stages_ran) or "tick"
    return TickRecord(t_ns=tick_ns, ran=list(m.stages_ran), latency_ms=float(m.latency_ms),
                      stage_latency_ms={key: float(m.latency_ms)}, decision_id=int(m.decision_id), actions=actions,
                      observation_age_ms=float(m.observation_age_ms),
                      observation_stamp_ns=obs - offset_ns if obs else None, reason=None, prefix_id=int(m.prefix_id))


def replay_realtime(bag, config, *, report_dir=None, topics, prompt=None, node="/policy_node", progress=True,
                    seed=0, timeout_s=60.0, action_dt_s: float = 0.02, checkpoint=None):
    from flashrt_core.contract.spec import configured_contract, load_contract
    from flashrt_core.errors import FlashRTError
    from flashrt_ros.ros_env import apply_isolated_env

    os.environ.setdefault("ROS_DOMAIN_ID", "0")  # the running node's domain: ROS's default unless set
    apply_isolated_env()
    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from sensor_msgs.msg import CompressedImage, Image, JointState
    from std_msgs.msg import String

    from flashrt_ros.msg import ActionChunk

    try:  # (the node's contract, for the report: with the node's checkpoint where it takes one)
        contract = load_contract(config) if checkpoint is None else configured_contract(config, checkpoint=checkpoint)
    except FlashRTError as e:
        raise ReplayError(f"{config}: {e}") from None
    store = bagio.typestore()
    node_ns = "/" + node.strip("/")
    t_wall = time.perf_counter()
    source = BagSource(bag, topics, need_prompt=prompt is None)
    chunks: list[tuple[int, bytes]] = []
    recorded: list[RecordedChunk] = []
    error, offset, sent, bar = None, 0, 0, None
    rclpy.init()
    ros = rclpy.create_node("flashrt_replay")
    try:
        source.open()
        types = {bagio.IMAGE: Image, bagio.COMPRESSED: CompressedImage, bagio.JOINT_STATE: JointState}
        pubs = {}
        for topic, (role, _) in source.roles.items():
            if role in ("camera", "joints"):
                pubs[topic] = ros.create_publisher(types[source.info.topics[topic]["type"]], topic,
                                                   qos_profile_sensor_data)
        reliable = QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE)
        prompt_pub = ros.create_publisher(String, f"{node_ns}/prompt", 10)
        ros.create_subscription(ActionChunk, f"{node_ns}/action_chunk",
                                lambda raw: chunks.append((time.monotonic_ns(), raw)), reliable, raw=True)
        deadline = time.monotonic() + timeout_s
        while prompt_pub.get_subscription_count() == 0 or any(p.get_subscription_count() == 0 for p in pubs.values()):
            if time.monotonic() > deadline:
                raise ReplayError(f"no policy node: nothing subscribes to {node_ns}/prompt and the mapped topics "
                                  f"after {timeout_s:.0f} s (is `{node_ns.strip('/')}` running in ROS_DOMAIN_ID "
                                  f"{os.environ['ROS_DOMAIN_ID']}?)")
            rclpy.spin_once(ros, timeout_sec=0.05)
        if prompt is not None:
            prompt_pub.publish(String(data=prompt))
        bag0 = source.info.start_ns
        offset = ros.get_clock().now().nanoseconds - bag0
        wall0 = time.monotonic_ns()
        bar = Progress(bag0, source.info.end_ns, enabled=progress)
        for ev in source.events():
            while (wait := wall0 + (ev.log_ns - bag0) - time.monotonic_ns()) > 0:
                rclpy.spin_once(ros, timeout_sec=min(wait / NS, 0.01))
            if ev.role == "actions":
                recorded.append(RecordedChunk.from_msg(ev))
                continue
            if ev.role == "prompt":
                if prompt is None:
                    prompt_pub.publish(String(data=ev.msg.data))
                continue
            _shift(store, ev.msg, offset)
            pubs[ev.topic].publish(bytes(store.serialize_cdr(ev.msg, ev.msg.__msgtype__)))
            sent += 1
            bar.update(ev.log_ns, len(chunks))
        end = time.monotonic() + DRAIN_S
        while time.monotonic() < end:
            rclpy.spin_once(ros, timeout_sec=0.05)
        if not chunks:
            raise ReplayError(f"{node_ns}/action_chunk: no chunks received while playing {sent} messages "
                              "(see the node's log: prompt set? observation too old?)")
    except ReplayError as e:
        error = str(e)
    finally:
        source.close()
        if bar is not None:
            bar.close(bar.start + bar.span, len(chunks))
        ros.destroy_node()
        rclpy.shutdown()
    ticks = sorted((_chunk_tick(store, raw, offset) for _, raw in chunks), key=lambda t: t.t_ns)
    report = build_report(mode="realtime", config=config, seed=seed, topics=topics, info=source.info, ticks=ticks,
                          recorded=recorded, contract=contract, wall_s=time.perf_counter() - t_wall, error=error,
                          action_dt_s=action_dt_s)
    report.data["node"] = node_ns
    report.data["messages_sent"] = sent
    if report_dir is not None:
        report.write(report_dir)
    if error:
        raise ReplayError(error, report=report, report_dir=report_dir)
    return report
