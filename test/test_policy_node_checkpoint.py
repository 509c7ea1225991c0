"""policy_node loaded with a checkpoint folder exactly as LeRobot saves it: cameras by the checkpoint's feature
order, the state from JointState (by joint_names) or from a Float64MultiArray topic, chunks in robot units with
the checkpoint's action names, equal to what the contract runtime computes from the same inputs and seed (which
test_lerobot_checkpoint checks against LeRobot's own pipeline)."""
import os

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")

from conftest import spin_until  # noqa: E402
from lerobot_checkpoint import cases, checkpoint_copy, hub_cache  # noqa: E402

CASE = cases()[1]  # 240x320 and 120x160 frames: the node letterboxes them with the replay's function
TASK = CASE["task"].strip().replace("_", " ")  # (as the prompt cleans it; a ROS parameter keeps no newline)
NAMES = ["shoulder_pan", "shoulder_lift", "elbow", "wrist_flex", "wrist_roll", "gripper"]
SEED = 4


def expected_chunk(checkpoint, decision_id: int) -> np.ndarray:
    """What the runtime gives at decision `decision_id` for the same (letterboxed) frames, state and seed."""
    from flashrt_core import Runtime
    from flashrt_core.lerobot.preprocess import letterbox

    rt = Runtime.from_config(os.path.join(os.path.dirname(__file__), "..", "config", "pi05.yaml"),
                             checkpoint=str(checkpoint), dtype="float32", seed=SEED)
    rt.set_prompt(TASK)
    frames = [letterbox(f, 224, 224) for f in CASE["frames"]]
    out = None
    for d in range(decision_id):
        rt.set_observation(images=frames, state=CASE["state"][0].numpy(), stamp_ns=1 + d * 200_000_000)
        out = rt.step(1 + d * 200_000_000).actions
    return out


@pytest.mark.parametrize("state_source", ["joint_states", "state_vector"])
def test_node_publishes_the_runtime_chunk_in_robot_units(tmp_path, monkeypatch, ros_node, spawn, state_source):
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import Float64MultiArray, Header

    from flashrt_ros.conversions import rgb_to_image
    from flashrt_ros.msg import ActionChunk

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache(tmp_path / "hub")))
    checkpoint = checkpoint_copy(tmp_path)
    name = f"ckpt_node_{state_source}"
    cams = [f"/{name}/front", f"/{name}/wrist"]
    args = ["flashrt_ros.policy_node", "--ros-args", "-r", f"__node:={name}",
            "-p", f"checkpoint:={checkpoint}", "-p", "device:=cpu", "-p", "dtype:=float32", "-p", f"seed:={SEED}",
            "-p", f"camera_topics:=[{','.join(cams)}]", "-p", f"prompt:='{TASK}'",
            "-p", "act_rate_hz:=5.0", "-p", "observe_rate_hz:=5.0", "-p", "max_observation_age_ms:=5000.0",
            "-p", "autostart:=true", "-p", "cpu_threads:=1"]
    if state_source == "joint_states":
        args += ["-p", f"joint_state_topic:=/{name}/joints", "-p", f"joint_names:=[{','.join(NAMES)}]"]
    else:
        args += ["-p", f"state_topic:=/{name}/state"]
    spawn(*args, log=str(tmp_path / "node.log"))

    qos = rclpy.qos.qos_profile_sensor_data
    img_pubs = [ros_node.create_publisher(Image, t, qos) for t in cams]
    state_pub = (ros_node.create_publisher(JointState, f"/{name}/joints", qos) if state_source == "joint_states"
                 else ros_node.create_publisher(Float64MultiArray, f"/{name}/state", qos))
    chunks = []
    ros_node.create_subscription(ActionChunk, f"/{name}/action_chunk", chunks.append,
                                 rclpy.qos.QoSProfile(depth=50, reliability=rclpy.qos.ReliabilityPolicy.RELIABLE))
    state = CASE["state"][0].numpy().astype(np.float64)
    # the robot's joint order differs from the checkpoint's: joint_names puts them back
    order = [5, 2, 0, 4, 1, 3]

    def publish():
        stamp = ros_node.get_clock().now().to_msg()
        for pub, frame in zip(img_pubs, CASE["frames"]):
            pub.publish(rgb_to_image(frame, Image, stamp))
        if state_source == "joint_states":
            state_pub.publish(JointState(header=Header(stamp=stamp), name=[NAMES[i] for i in order],
                                         position=[float(state[i]) for i in order]))
        else:
            state_pub.publish(Float64MultiArray(data=state.tolist()))
    ros_node.create_timer(0.05, publish)
    log = (tmp_path / "node.log")
    assert spin_until(ros_node, lambda: len(chunks) >= 2, 120), log.read_text() if log.exists() else "no log"
    msg = chunks[-1]
    assert list(msg.joint_names) == NAMES and (msg.horizon, msg.action_dim) == (50, 6)
    got = np.asarray(msg.actions, np.float32).reshape(50, 6)
    want = expected_chunk(checkpoint, msg.decision_id)
    # fp32 both, but the node runs one CPU thread: another summation order, ~1e-6 of the actions' scale
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    assert np.abs(got[:, :5] - state[:5]).max() < np.abs(got[:, :5]).max()  # robot units, near the state


def test_node_with_a_pi0_checkpoint_takes_the_pi0_contract(tmp_path, ros_node, spawn, model_ckpt):
    """config.json "type": "pi0" -> the node runs config/pi0.yaml (act reads the state every tick); its chunks
    equal the runtime's for the same frames, state and seed."""
    import pathlib

    from flashrt_core import Runtime
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import Header

    from flashrt_ros.conversions import rgb_to_image
    from flashrt_ros.msg import ActionChunk

    repo = pathlib.Path(__file__).resolve().parents[1]
    ckpt = model_ckpt["pi0"]
    name = "pi0_node"
    cams = [f"/{name}/cam0", f"/{name}/cam1"]
    joints = [f"j{i}" for i in range(8)]
    spawn("flashrt_ros.policy_node", "--ros-args", "-r", f"__node:={name}", "-p", f"checkpoint:={ckpt}",
          "-p", "device:=cpu", "-p", f"seed:={SEED}", "-p", f"camera_topics:=[{','.join(cams)}]",
          "-p", f"joint_state_topic:=/{name}/joints", "-p", f"joint_names:=[{','.join(joints)}]",
          "-p", "prompt:='stack the cups'", "-p", "act_rate_hz:=5.0", "-p", "observe_rate_hz:=5.0",
          "-p", "max_observation_age_ms:=5000.0", "-p", "autostart:=true", "-p", "cpu_threads:=1",
          log=str(tmp_path / "node.log"))
    qos = rclpy.qos.qos_profile_sensor_data
    rng = np.random.default_rng(2)
    frames = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    state = rng.uniform(-1, 1, 8)
    pubs = [ros_node.create_publisher(Image, t, qos) for t in cams]
    jpub = ros_node.create_publisher(JointState, f"/{name}/joints", qos)
    chunks = []
    ros_node.create_subscription(ActionChunk, f"/{name}/action_chunk", chunks.append,
                                 rclpy.qos.QoSProfile(depth=50, reliability=rclpy.qos.ReliabilityPolicy.RELIABLE))

    def publish():
        stamp = ros_node.get_clock().now().to_msg()
        for pub, frame in zip(pubs, frames):
            pub.publish(rgb_to_image(frame, Image, stamp))
        jpub.publish(JointState(header=Header(stamp=stamp), name=joints, position=state.tolist()))
    ros_node.create_timer(0.05, publish)
    log = tmp_path / "node.log"
    assert spin_until(ros_node, lambda: len(chunks) >= 2, 120), log.read_text() if log.exists() else "no log"
    msg = chunks[-1]
    rt = Runtime.from_config(repo / "config" / "pi0.yaml", checkpoint=str(ckpt), num_cameras=2, seed=SEED)
    rt.set_prompt("stack the cups")
    for d in range(msg.decision_id):
        rt.set_observation(images=frames, state=state.astype(np.float32), stamp_ns=1 + d * 200_000_000)
        want = rt.step(1 + d * 200_000_000).actions
    got = np.asarray(msg.actions, np.float32).reshape(msg.horizon, msg.action_dim)
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()), rtol=0)
    assert "pi0" in log.read_text()
