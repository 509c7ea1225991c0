"""Synthetic sensors for the demo, the tests and sample bags: moving camera images and joint states."""
from __future__ import annotations

import argparse
import math

import numpy as np


def camera_frame(camera: int, t: float, height: int = 240, width: int = 320) -> np.ndarray:
    """A deterministic moving scene (a coloured disc orbiting over a gradient) as HxWx3 uint8 RGB."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    frame = np.empty((height, width, 3), np.float32)
    frame[..., 0] = 40 + 80 * xs / width
    frame[..., 1] = 40 + 80 * ys / height
    frame[..., 2] = 60 + 30 * camera
    cx = width * (0.5 + 0.3 * math.cos(1.3 * t + camera))
    cy = height * (0.5 + 0.3 * math.sin(0.9 * t + 2 * camera))
    disc = (xs - cx) ** 2 + (ys - cy) ** 2 < (min(height, width) * 0.12) ** 2
    frame[disc] = (220, 60 + 50 * camera, 40)
    return frame.astype(np.uint8)


def joint_positions(t: float, n: int) -> np.ndarray:
    """Smooth joint trajectories in [-1, 1]."""
    k = np.arange(n, dtype=np.float64)
    return (0.8 * np.sin(0.7 * t + 0.5 * k)).astype(np.float32)


def joint_names(n: int) -> list[str]:
    return [f"joint{i}" for i in range(n)]


def run_sensors(argv=None) -> None:
    """A ROS process that publishes cameras and joint states until interrupted."""
    import rclpy
    from rclpy.executors import ExternalShutdownException
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image, JointState

    from flashrt_ros.conversions import rgb_to_image

    parser = argparse.ArgumentParser(prog="flashrt-synthetic-sensors")
    parser.add_argument("--cameras", type=int, default=2)
    parser.add_argument("--camera-rate", type=float, default=30.0)
    parser.add_argument("--joints", type=int, default=7)
    parser.add_argument("--joint-rate", type=float, default=100.0)
    parser.add_argument("--topic-prefix", default="")
    parser.add_argument("--height", type=int, default=240)
    parser.add_argument("--width", type=int, default=320)
    args, ros_args = parser.parse_known_args(argv)
    rclpy.init(args=ros_args)
    node = rclpy.create_node("synthetic_sensors")
    cams = [node.create_publisher(Image, f"{args.topic_prefix}camera{i}/image_raw", qos_profile_sensor_data)
            for i in range(args.cameras)]
    joints = node.create_publisher(JointState, f"{args.topic_prefix}joint_states", qos_profile_sensor_data)
    names = joint_names(args.joints)
    t0 = node.get_clock().now().nanoseconds

    def publish_cameras():
        now = node.get_clock().now()
        t = (now.nanoseconds - t0) * 1e-9
        for i, pub in enumerate(cams):
            pub.publish(rgb_to_image(camera_frame(i, t, args.height, args.width), Image, now.to_msg(), f"camera{i}"))

    def publish_joints():
        now = node.get_clock().now()
        msg = JointState(name=names)
        msg.header.stamp = now.to_msg()
        msg.position = joint_positions((now.nanoseconds - t0) * 1e-9, args.joints).astype(float).tolist()
        joints.publish(msg)

    node.create_timer(1.0 / args.camera_rate, publish_cameras)
    node.create_timer(1.0 / args.joint_rate, publish_joints)
    try:
        rclpy.spin(node)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()


if __name__ == "__main__":
    run_sensors()
