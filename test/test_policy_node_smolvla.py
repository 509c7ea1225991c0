"""policy_node with a SmolVLA checkpoint folder exactly as LeRobot 0.6.1 saves it and its VLM in the hub cache
(as `hf download` leaves it): the node takes config/smolvla.yaml by the folder's type, and its chunks are the
runtime's for the same frames, state and seed (test_runtime_smolvla: the runtime is the policy API, which
test_smolvla_policy checks against LeRobot's whole pipeline)."""
import os
import shutil

import numpy as np
import pytest
import torch

rclpy = pytest.importorskip("rclpy")

from conftest import spin_until  # noqa: E402
from smolvla_cases import FIXTURES, model  # noqa: E402

FOLDER = FIXTURES / "lerobot_smolvla_three_cams"
VLM = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
SEED = 7
TASK = "pick up the red cube"


def vlm_hub_cache(dest):
    """A hub cache holding the fixture's SmolVLM2-shaped VLM folder under the checkpoint's vlm_model_name."""
    snap = dest / ("models--" + VLM.replace("/", "--")) / "snapshots" / "0123abcd"
    shutil.copytree(FOLDER / "hf_vlm", snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("0123abcd")
    return dest


def test_node_with_a_smolvla_checkpoint_publishes_the_runtime_chunk(tmp_path, monkeypatch, ros_node, spawn):
    from flashrt_core import Runtime
    from flashrt_core.lerobot.preprocess import letterbox
    from sensor_msgs.msg import Image
    from std_msgs.msg import Float64MultiArray

    from flashrt_ros.conversions import rgb_to_image
    from flashrt_ros.msg import ActionChunk

    monkeypatch.setenv("HF_HUB_CACHE", str(vlm_hub_cache(tmp_path / "hub")))
    checkpoint = tmp_path / "smolvla_ckpt"
    shutil.copytree(FOLDER / "checkpoint", checkpoint)
    # frames of three sizes: the node letterboxes them to the contract's 96x96 with SmolVLA's own padding (top
    # and left, as LeRobot pads them; pi0.5's is centred)
    case = model("lerobot_smolvla_three_cams")[3]["top_120x160_wrist_48x64_side_100x90"]
    frames = [case.tensors[f"frame.{n}"].numpy() for n in ("top", "wrist", "side")]
    state = case.tensors["state_raw"][0].numpy().astype(np.float64)
    name = "smolvla_node"
    cams = [f"/{name}/{n}" for n in ("top", "wrist", "side")]
    spawn("flashrt_ros.policy_node", "--ros-args", "-r", f"__node:={name}", "-p", f"checkpoint:={checkpoint}",
          "-p", "device:=cpu", "-p", "dtype:=float32", "-p", f"seed:={SEED}",
          "-p", f"camera_topics:=[{','.join(cams)}]",
          "-p", f"state_topic:=/{name}/state", "-p", f"prompt:='{TASK}'", "-p", "image_height:=96",
          "-p", "image_width:=96", "-p", "act_rate_hz:=5.0", "-p", "observe_rate_hz:=5.0",
          "-p", "max_observation_age_ms:=5000.0", "-p", "autostart:=true", "-p", "cpu_threads:=1",
          log=str(tmp_path / "node.log"))
    qos = rclpy.qos.qos_profile_sensor_data
    pubs = [ros_node.create_publisher(Image, t, qos) for t in cams]
    spub = ros_node.create_publisher(Float64MultiArray, f"/{name}/state", qos)
    chunks = []
    ros_node.create_subscription(ActionChunk, f"/{name}/action_chunk", chunks.append,
                                 rclpy.qos.QoSProfile(depth=50, reliability=rclpy.qos.ReliabilityPolicy.RELIABLE))

    def publish():
        stamp = ros_node.get_clock().now().to_msg()
        for pub, frame in zip(pubs, frames):
            pub.publish(rgb_to_image(frame, Image, stamp))
        spub.publish(Float64MultiArray(data=state.tolist()))
    ros_node.create_timer(0.05, publish)
    log = tmp_path / "node.log"
    assert spin_until(ros_node, lambda: len(chunks) >= 2, 120), log.read_text() if log.exists() else "no log"
    msg = chunks[-1]
    assert (msg.horizon, msg.action_dim) == (50, 7)
    got = np.asarray(msg.actions, np.float32).reshape(50, 7)
    # the runtime the node runs, on the same inputs and seed (its contract: the packaged one of the folder's type)
    rt = Runtime.from_config(os.path.join(os.path.dirname(__file__), "..", "config", "smolvla.yaml"),
                             checkpoint=str(checkpoint), dtype="float32", seed=SEED,
                             options={"image_height": 96, "image_width": 96})
    rt.set_prompt(TASK)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as the node's cpu_threads: the bilinear resize's rounding to uint8 follows it)
    try:
        fitted = [letterbox(f, 96, 96, "top_left") for f in frames]
    finally:
        torch.set_num_threads(threads)
    want = None
    for d in range(msg.decision_id):
        rt.set_observation(images=fitted, state=state.astype(np.float32), stamp_ns=1 + d * 200_000_000)
        want = rt.step(1 + d * 200_000_000).actions
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
