"""`make_bag`: a sample rosbag2 with synthetic sensors and the actions the Runtime computes from them.

Two moving cameras (sensor_msgs/Image rgb8) at 30 Hz, joint states at 200 Hz, a prompt latched at the
start, and one flashrt_ros/ActionChunk per decision. The actions come from the same bag-clock player that
`replay` uses, fed the very messages written to the bag, so replaying the bag with the same contract and
seed reproduces them exactly. Messages are written in bag-time order while they are produced (a heap holds
those that could still be overtaken), so memory stays flat on long bags.
"""
from __future__ import annotations

import heapq
import itertools
import math
from pathlib import Path

import numpy as np

from flashrt_ros import synthetic
from flashrt_ros.replay import bagio
from flashrt_ros.replay.bagio import ACTION_CHUNK, IMAGE, JOINT_STATE, STRING, BagEvent
from flashrt_ros.replay.errors import ReplayError
from flashrt_ros.replay.player import BagClockPlayer
from flashrt_ros.replay.progress import Progress
from flashrt_ros.replay.runtimes import build_runtime, default_config
from flashrt_ros.replay.staged import staged_folder
from flashrt_ros.replay.topics import TopicMap

NS = 1_000_000_000
START_NS = 1_767_225_600 * NS  # 2026-01-01T00:00:00Z: real-looking stamps, identical for every run


def _stamp(store, ns: int):
    return store.types["builtin_interfaces/msg/Time"](sec=ns // NS, nanosec=ns % NS)


def _header(store, ns: int, frame: str = ""):
    return store.types["std_msgs/msg/Header"](stamp=_stamp(store, ns), frame_id=frame)


def sensor_events(store, topics: TopicMap, duration: float, height: int, width: int, joints: int, prompt: str,
                  camera_hz: float = 30.0, joint_hz: float = 200.0, start_ns: int = START_NS):
    """(log_ns, role, index, topic, msgtype, msg) of every sensor message, in bag-time order."""
    Image, JointState = store.types[IMAGE], store.types[JOINT_STATE]
    names = synthetic.joint_names(joints)

    def cameras():
        for k in itertools.count():
            t = k / camera_hz
            if t > duration:
                return
            ns = start_ns + round(t * NS)
            for i, topic in enumerate(topics.cameras):
                rgb = synthetic.camera_frame(i, t, height, width)
                yield (ns, "camera", i, topic, IMAGE,
                       Image(header=_header(store, ns, f"camera{i}"), height=height, width=width, encoding="rgb8",
                             is_bigendian=0, step=width * 3, data=rgb.reshape(-1)))

    def joint_states():
        empty = np.zeros(0, np.float64)
        for k in itertools.count():
            t = k / joint_hz
            if t > duration:
                return
            ns = start_ns + round(t * NS)
            pos = synthetic.joint_positions(t, joints).astype(np.float64)
            yield (ns, "joints", 0, topics.joint_states, JOINT_STATE,
                   JointState(header=_header(store, ns), name=list(names), position=pos, velocity=empty, effort=empty))

    first = [(start_ns, "prompt", 0, topics.prompt, STRING, store.types[STRING](data=prompt))]
    return heapq.merge(first, cameras(), joint_states(), key=lambda e: e[0])


def chunk_message(store, tick, joint_names, dt: float):
    """The ActionChunk policy_node would publish for this tick. On the bag clock computing takes no time, so
    its first action is due at the tick and it is published and logged then (now_index 0); latency_ms is the
    compute time measured on this machine."""
    width = min(tick.actions.shape[1], len(joint_names)) if joint_names else tick.actions.shape[1]
    actions = np.ascontiguousarray(tick.actions[:, :width], dtype=np.float32)
    return tick.t_ns, store.types[ACTION_CHUNK](
        header=_header(store, tick.t_ns), joint_names=list(joint_names), horizon=actions.shape[0],
        action_dim=actions.shape[1], actions=actions.reshape(-1), dt=dt, decision_id=int(tick.decision_id),
        prefix_id=int(tick.prefix_id or 0), observation_stamp=_stamp(store, tick.observation_stamp_ns or 0),
        observation_age_ms=float(tick.observation_age_ms or 0.0), latency_ms=float(tick.latency_ms),
        stages_ran=list(tick.ran), now_index=0, publish_stamp=_stamp(store, tick.t_ns))


def make_bag(out, storage: str = "mcap", duration: float = 10.0, cameras: int = 2, seed: int = 0, config=None,
             height: int = 240, width: int = 320, joints: int | None = None, prompt: str = "pick up the red cube",
             device: str = "cpu", progress: bool = False, action_dt: float = 0.02, checkpoint: str | None = None,
             tokenizer: str | None = None) -> dict:
    """Write the sample bag to `out` (a new folder) and return a summary (topics, counts, decisions). The bag
    is written in a temporary folder beside `out` and moved there when complete: a failure leaves nothing.
    joints: how many the synthetic robot has (default: the contract's state width). checkpoint / tokenizer: a
    LeRobot checkpoint folder computes the recorded actions (with its model's packaged contract unless `config`
    is given), as `flashrt replay --checkpoint` replays them."""
    if not (duration > 0 and math.isfinite(duration)):
        raise ReplayError(f"duration: must be a positive number of seconds, got {duration}")
    if height <= 0 or width <= 0 or (joints is not None and joints <= 0):
        raise ReplayError(f"size and joints: must be positive, got {width}x{height} and {joints} joints")
    if not (1 <= cameras <= 8):
        raise ReplayError(f"cameras: between 1 and 8, got {cameras}")
    out = Path(out)
    if out.exists():
        raise ReplayError(f"{out}: exists already; a bag is never overwritten")
    with staged_folder(out, replace=False) as path:
        summary = _write_bag(path, storage, duration, cameras, seed, config, height, width, joints, prompt, device,
                             progress, action_dt, checkpoint, tokenizer)
    summary["path"] = str(out)
    return summary


def _write_bag(out, storage, duration, cameras, seed, config, height, width, joints, prompt, device, progress,
               action_dt, checkpoint=None, tokenizer=None) -> dict:
    """make_bag's work, into `out` (a path that does not exist yet), after its checks."""
    store = bagio.typestore()
    config = Path(config) if config is not None else default_config(checkpoint)
    topics = TopicMap(cameras=tuple(f"/camera{i}/image_raw" for i in range(cameras)))
    writer = bagio.open_writer(out, storage)  # refuses an existing path before the model is built
    runtime = build_runtime(config, seed=seed, cameras=cameras, device=device, checkpoint=checkpoint,
                            tokenizer=tokenizer)
    joints = joints or runtime.contract.buffers["state"].shape[0]
    names = synthetic.joint_names(joints)
    player = BagClockPlayer([runtime], cameras, names)
    bar = Progress(START_NS, START_NS + round(duration * NS), enabled=progress, label="make-bag")
    writer.set_custom_data("flashrt.config", str(config))
    writer.set_custom_data("flashrt.seed", str(seed))
    pending: list = []  # heap of (log_ns, n, connection, msgtype, msg) not yet safe to write
    order = itertools.count()
    counts: dict[str, int] = {}
    with writer:
        conns = {topic: writer.add_connection(topic, IMAGE, typestore=store) for topic in topics.cameras}
        conns[topics.joint_states] = writer.add_connection(topics.joint_states, JOINT_STATE, typestore=store)
        conns[topics.prompt] = writer.add_connection(topics.prompt, STRING, typestore=store,
                                                     offered_qos_profiles=[bagio.latched_qos()])
        conns[topics.actions] = writer.add_connection(topics.actions, ACTION_CHUNK, typestore=store)

        def flush(before_ns):
            while pending and (before_ns is None or pending[0][0] < before_ns):
                ns, _, topic, msgtype, msg = heapq.heappop(pending)
                writer.write(conns[topic], ns, store.serialize_cdr(msg, msgtype))
                counts[topic] = counts.get(topic, 0) + 1

        def queue_chunks(since):
            for tick in player.ticks[since:]:
                if tick.actions is not None:
                    ns, msg = chunk_message(store, tick, names, action_dt)
                    heapq.heappush(pending, (ns, next(order), topics.actions, ACTION_CHUNK, msg))

        seq: dict[str, int] = {}
        for ns, role, index, topic, msgtype, msg in sensor_events(store, topics, duration, height, width, joints,
                                                                  prompt):
            done = len(player.ticks)
            k = seq[topic] = seq.get(topic, -1) + 1
            player.push(BagEvent(role, index, topic, ns, ns, k, msg))  # stamped at capture == logged
            queue_chunks(done)
            # Later chunks come from ticks at or after `ns`, later sensors are at or after `ns`: all earlier
            # messages are final.
            flush(ns)
            heapq.heappush(pending, (ns, next(order), topic, msgtype, msg))
            bar.update(ns, player.decisions)
        done = len(player.ticks)
        player.finish()
        queue_chunks(done)
        flush(None)
    bar.close(player.last_ns or START_NS, player.decisions)
    return {"path": str(out), "storage": storage, "duration_s": duration, "config": str(config), "seed": seed,
            "topics": {t: counts.get(t, 0) for t in conns}, "decisions": player.decisions,
            "ticks": len(player.ticks)}
