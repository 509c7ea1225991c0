"""A test rig around a policy_node process: sensor publishers we control, chunk/diagnostics recorders,
lifecycle and capsule clients, all spun by a background executor in the test process."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from trajectory_msgs.msg import JointTrajectory

from flashrt_ros.conversions import rgb_to_image
from flashrt_ros.msg import ActionChunk
from flashrt_ros.synthetic import camera_frame, joint_names, joint_positions

H, W, JOINTS = 48, 64, 5


def camera_topics(name: str, compressed: bool = False) -> list[str]:
    return [f"/{name}_cam{i}" + ("/compressed" if compressed else "") for i in range(2)]


def node_command(name: str, act_rate=20.0, observe_rate=5.0, autostart=False, contract=None, max_age_ms=400.0,
                 sim_time=False, namespace="", compressed=False, params=()):
    topics = ",".join(f'"{t}"' for t in camera_topics(name, compressed))
    joints = ",".join(f'"{n}"' for n in joint_names(JOINTS))
    cmd = [sys.executable, "-m", "flashrt_ros.policy_node", "--ros-args", "-r", f"__node:={name}",
           "-p", f"camera_topics:=[{topics}]", "-p", f"joint_state_topic:=/{name}_joints",
           "-p", f"joint_names:=[{joints}]", "-p", f"image_height:={H}", "-p", f"image_width:={W}",
           "-p", f"act_rate_hz:={act_rate}", "-p", f"observe_rate_hz:={observe_rate}",
           "-p", f"max_observation_age_ms:={max_age_ms}", "-p", "device:=cpu", "-p", "cpu_threads:=1",
           "-p", "prompt:=stack the blocks", "-p", f"autostart:={'true' if autostart else 'false'}",
           "-p", "diagnostics_period_s:=0.2", "-p", "publish_joint_trajectory:=true"]
    if contract:
        cmd += ["-p", f"contract:={contract}"]
    if sim_time:
        cmd += ["-p", "use_sim_time:=true"]
    if namespace:
        cmd += ["-r", f"__ns:={namespace}"]
    for param in params:  # more node parameters, "name:=value"
        cmd += ["-p", param]
    return cmd


class Rig:
    def __init__(self, context, name: str, log_path: str, **node_kwargs):
        self.name = name
        self.fqn = f"{node_kwargs.get('namespace', '')}/{name}"  # the node's fully qualified name
        # compressed: the cameras send CompressedImage (PNG); huge_png: what mode "huge_png" sends on camera 1
        self.compressed = bool(node_kwargs.get("compressed"))
        self.huge_png = b""
        self.extra_png = b""  # sent on camera 1 at 10 Hz, between its ordinary frames, while set
        # sim_time: the rig publishes /clock (from 1000 s on, at wall speed) and stamps its sensors with it;
        # jump_clock() sends it back, as a simulation reset does
        self.sim_time = bool(node_kwargs.get("sim_time"))
        self._sim_base_ns = 1000 * 10**9 - time.monotonic_ns()
        self.proc = subprocess.Popen(node_command(name, **node_kwargs), env=dict(os.environ),
                                     stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.log_path = log_path
        self.node = rclpy.create_node(f"rig_{name}", context=context)
        self.cams = [self.node.create_publisher(CompressedImage if self.compressed else Image, topic,
                                                qos_profile_sensor_data)
                     for topic in camera_topics(name, self.compressed)]
        self.joints = self.node.create_publisher(JointState, f"/{name}_joints", qos_profile_sensor_data)
        self.chunks: list[tuple[float, ActionChunk]] = []
        self.diagnostics: list[DiagnosticArray] = []
        self.status_times: list[float] = []  # when each of self.diagnostics arrived (time.monotonic())
        self.trajectories: list[JointTrajectory] = []
        self.node.create_subscription(JointTrajectory, f"{self.fqn}/joint_trajectory", self.trajectories.append, 10)
        self.node.create_subscription(ActionChunk, f"{self.fqn}/action_chunk",
                                      lambda m: self.chunks.append((time.monotonic(), m)),
                                      QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 10)
        self._clients = {}
        from flashrt_ros.srv import DropCapsule, ForkCapsule, ListCapsules, RestoreCapsule, SnapshotCapsule

        from rcl_interfaces.srv import SetParameters

        for srv_type, service in ((ChangeState, "change_state"), (GetState, "get_state"),
                                  (SetParameters, "set_parameters"),
                                  (SnapshotCapsule, "snapshot"), (RestoreCapsule, "restore"), (ForkCapsule, "fork"),
                                  (ListCapsules, "list_capsules"), (DropCapsule, "drop_capsule")):
            self.client(srv_type, service)  # created now, used seconds later: discovery is complete by then
        self.mode = "good"  # what the sensor timers publish; see _publish
        self.t0 = time.time()
        self.node.create_timer(1 / 15, self._publish_cameras)
        self.node.create_timer(1 / 50, self._publish_joints)
        self.node.create_timer(1 / 10, self._publish_extra_png)
        if self.sim_time:
            from rosgraph_msgs.msg import Clock

            clock_pub = self.node.create_publisher(Clock, "/clock", 10)
            self.node.create_timer(1 / 200, lambda: clock_pub.publish(Clock(clock=self._stamp())))
        self.executor = SingleThreadedExecutor(context=context)
        self.executor.add_node(self.node)
        self._spin = threading.Thread(target=self.executor.spin, daemon=True)
        self._spin.start()

    def _on_diag(self, msg):
        if any(s.name == f"{self.fqn}: policy" for s in msg.status):
            self.status_times.append(time.monotonic())
            self.diagnostics.append(msg)

    def sim_now_ns(self) -> int:
        return time.monotonic_ns() + self._sim_base_ns

    def jump_clock(self, back_s: float) -> None:
        self._sim_base_ns -= int(back_s * 1e9)

    def _stamp(self, back_s: float = 0.0):
        now = self.sim_now_ns() if self.sim_time else self.node.get_clock().now().nanoseconds
        return rclpy.time.Time(nanoseconds=now - int(back_s * 1e9)).to_msg()

    def _publish_cameras(self):
        if self.mode == "silent":
            return
        t = time.time() - self.t0
        for i, pub in enumerate(self.cams):
            h, w = {"other_size": (H + 8, W + 24),  # letterboxed by the node
                    "thin_frame": (600, 2)}.get(self.mode, (H, W))  # too thin to letterbox: refused
            if self.compressed:
                msg = self._compressed_frame(i, camera_frame(i, t, h, w))
            else:
                msg = rgb_to_image(camera_frame(i, t, h, w), Image, self._stamp(), f"cam{i}")
            if self.mode == "bad_encoding":
                msg.encoding = "yuv422"
            if self.mode == "short_data" and not self.compressed:
                msg.data = bytes(msg.data)[: len(msg.data) // 2]
            if self.mode in ("backwards", "replayed"):  # replayed: as a replay re-sends them after a rewind
                msg.header.stamp = self._stamp(back_s=0.2 if self.mode == "backwards" else 3.0)
            pub.publish(msg)

    def _compressed_frame(self, i: int, rgb) -> CompressedImage:
        import cv2

        huge = self.mode == "huge_png" and i == 1
        data = self.huge_png if huge else cv2.imencode(".png", rgb[..., ::-1])[1].tobytes()
        msg = CompressedImage(format="png", data=data)
        msg.header.stamp, msg.header.frame_id = self._stamp(), f"cam{i}"
        return msg

    def _publish_extra_png(self):
        if self.extra_png:
            msg = CompressedImage(format="png", data=self.extra_png)
            msg.header.stamp, msg.header.frame_id = self._stamp(), "cam1"
            self.cams[1].publish(msg)

    def _publish_joints(self):
        if self.mode == "silent":
            return
        names = joint_names(JOINTS)
        pos = joint_positions(time.time() - self.t0, JOINTS).astype(float).tolist()
        if self.mode == "nan_joints":
            pos[1] = float("nan")
        if self.mode == "missing_joint":
            names, pos = names[:-1], pos[:-1]
        if self.mode == "duplicate_joint":  # the first joint named again, with another value
            names, pos = names + names[:1], pos + [pos[0] + 0.5]
        msg = JointState(name=names, position=pos)
        # backwards: behind the last stamp, within the age limit; old: 5 s behind (before the node started);
        # future: a clock a minute ahead
        back = {"backwards": 0.2, "replayed": 3.0, "old": 5.0, "future": -60.0}.get(self.mode, 0.0)
        msg.header.stamp = self._stamp(back_s=back)
        if self.mode == "zero_stamp":
            msg.header.stamp.sec, msg.header.stamp.nanosec = 0, 0
        self.joints.publish(msg)

    # ---- helpers the tests use ----
    def wait(self, predicate, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return True
            if self.proc.poll() is not None:
                raise AssertionError(f"policy_node exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.02)
        return predicate()

    def client(self, srv_type, name: str):
        """One client per service, kept: a client used right after discovery can lose its first response."""
        key = (srv_type, name)
        if key not in self._clients:
            self._clients[key] = self.node.create_client(srv_type, f"{self.fqn}/{name}")
        return self._clients[key]

    def call(self, srv_type, name: str, request, timeout: float = 30.0):
        client = self.client(srv_type, name)
        assert client.wait_for_service(timeout_sec=timeout), f"{self.fqn}/{name} not available\n{self.log()}"
        future = client.call_async(request)
        assert self.wait(future.done, timeout), f"{self.fqn}/{name} did not answer"
        return future.result()

    def transition(self, transition_id: int) -> bool:
        return self.call(ChangeState, "change_state", ChangeState.Request(
            transition=Transition(id=transition_id))).success

    def state(self) -> str:
        return self.call(GetState, "get_state", GetState.Request()).current_state.label

    def chunks_since(self, t: float):
        return [m for (tm, m) in list(self.chunks) if tm >= t]

    def last_status(self):
        return self.diagnostics[-1].status[0] if self.diagnostics else None

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-3000:]

    def close(self):
        self.executor.shutdown()
        self._spin.join(10)  # the spin thread may still be building a wait set with this node's entities
        self.node.destroy_node()
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def rig_factory(ros_context, tmp_path):
    """make(name, **node_kwargs) -> a Rig; every rig made is closed after the test."""
    rigs = []

    def make(name, **kwargs):
        rig = Rig(ros_context, name, str(tmp_path / f"{name}.log"), **kwargs)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


def status_values(status) -> dict:
    """{key: value} of a DiagnosticStatus ({} for None)."""
    return {kv.key: kv.value for kv in status.values} if status is not None else {}


def actions_of(msg) -> np.ndarray:
    return np.asarray(msg.actions, dtype=np.float32).reshape(msg.horizon, msg.action_dim)


CONFIGURE, CLEANUP, ACTIVATE, DEACTIVATE = (Transition.TRANSITION_CONFIGURE, Transition.TRANSITION_CLEANUP,
                                            Transition.TRANSITION_ACTIVATE, Transition.TRANSITION_DEACTIVATE)
