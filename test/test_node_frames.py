"""The policy node's camera frames: its executor callback only checks the stamp, a thread of the node's own decodes
and letterboxes the newest frame of each camera; frames held when the node drops its sensor state (a clock reset,
a rewind, cleanup) are dropped, the one being fitted at that moment too."""
import random
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.ros
pytest.importorskip("rclpy")


def _image(rng, height, width, stamp_ns):
    from sensor_msgs.msg import Image

    msg = Image(height=height, width=width, encoding="rgb8", step=3 * width)
    msg.data = rng.integers(0, 256, size=height * width * 3, dtype=np.uint8).tobytes()
    msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp_ns, 1_000_000_000)
    return msg


def _wait(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def node(ros_context):
    from flashrt_ros.policy_node import PolicyNode

    n = PolicyNode(f"frames_node_{random.randint(0, 1 << 30)}", context=ros_context)
    n._frame_shape = (48, 64, 3)  # (what configure sets from the contract)
    yield n
    n.destroy_node()


def test_frames_are_letterboxed_by_the_nodes_thread_and_the_callback_returns_at_once(node):
    from flashrt_core.lerobot.preprocess import letterbox

    rng = np.random.default_rng(5)
    now = node.get_clock().now().nanoseconds
    big = _image(rng, 1080, 1920, now)
    started = time.perf_counter()
    node._on_image(0, "/cam0", big)  # (what the executor runs: a stamp check, no decode)
    assert time.perf_counter() - started < 0.05
    assert _wait(lambda: 0 in node._images)
    rgb, stamp = node._images[0]
    assert stamp == now and rgb.shape == (48, 64, 3)
    want = letterbox(np.frombuffer(bytes(big.data), np.uint8).reshape(1080, 1920, 3), 48, 64)
    np.testing.assert_array_equal(rgb, want)  # the same function as before, bit for bit


def test_a_frame_being_fitted_when_the_sensor_state_is_dropped_is_dropped_too(node, monkeypatch):
    from flashrt_ros import policy_node

    entered, release = threading.Event(), threading.Event()
    real = policy_node.letterbox

    def slow(*args):
        entered.set()
        release.wait(10)
        return real(*args)
    monkeypatch.setattr(policy_node, "letterbox", slow)
    rng = np.random.default_rng(6)
    now = node.get_clock().now().nanoseconds
    node._on_image(1, "/cam1", _image(rng, 48, 64, now))
    assert entered.wait(10)
    node.rewound(now - 1)  # e.g. a restore with rewind_time to a snapshot older than that frame
    release.set()
    time.sleep(0.3)
    assert 1 not in node._images
    monkeypatch.setattr(policy_node, "letterbox", real)
    node._on_image(1, "/cam1", _image(rng, 48, 64, now + 1000))  # (stamps after the watermark are taken again)
    assert _wait(lambda: 1 in node._images) and node._images[1][1] == now + 1000


def test_a_one_channel_camera_is_taken_and_warned_of_once(node):
    """mono8 / 16UC1 frames on a camera slot (a depth or IR camera wired there by mistake, most likely) are
    taken as grey RGB, and said once per camera in the log and on /diagnostics."""
    from sensor_msgs.msg import Image

    from flashrt_ros.conversions import rgb_to_image

    rng = np.random.default_rng(7)
    now = node.get_clock().now().nanoseconds
    colour = _image(rng, 48, 64, now)
    node._on_image(0, "/cam0", colour)
    assert node.health.setup_warnings == []
    for k, encoding in enumerate(("16UC1", "mono8", "16UC1")):
        msg = rgb_to_image(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), Image, encoding=encoding)
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now + (k + 1) * 1_000_000, 1_000_000_000)
        node._on_image(1, "/cam1", msg)
    assert node.health.setup_warnings == ["camera /cam1 sends 16UC1 frames (one channel: depth, IR or mono); they "
                                          "are taken as grey RGB, but the model was trained on colour frames"]
    assert _wait(lambda: 1 in node._images) and node._images[1][0].shape == (48, 64, 3)
