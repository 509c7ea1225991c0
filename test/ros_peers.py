"""Small ROS processes the interface tests talk to (run as `python -m ros_peers ...` from test/)."""
import sys
import time

import rclpy


def chunk_publisher(topic: str, count: int) -> None:
    from flashrt_ros.msg import ActionChunk

    rclpy.init()
    node = rclpy.create_node("chunk_publisher")
    pub = node.create_publisher(ActionChunk, topic, 10)
    end = time.monotonic() + 30
    while pub.get_subscription_count() == 0 and time.monotonic() < end:
        rclpy.spin_once(node, timeout_sec=0.05)
    for i in range(count):
        msg = ActionChunk(horizon=3, action_dim=2, decision_id=i + 1, prefix_id=7, dt=0.02,
                          joint_names=["a", "b"], stages_ran=["observe", "act"])
        msg.actions = [float(i + 0.5 * k) for k in range(6)]
        msg.latency_ms = 1.25
        pub.publish(msg)
        rclpy.spin_once(node, timeout_sec=0.05)
    time.sleep(1.0)
    node.destroy_node()
    rclpy.shutdown()


def snapshot_server() -> None:
    from flashrt_ros.srv import SnapshotCapsule

    rclpy.init()
    node = rclpy.create_node("snapshot_server")

    def handle(request, response):
        response.ok = request.tier in ("device", "host", "disk")
        response.message = f"{request.name}@{request.tier}" if response.ok else f"unknown tier '{request.tier}'"
        response.capsule_id = f"cap-{request.name}" if response.ok else ""
        return response

    node.create_service(SnapshotCapsule, "snapshot_test", handle)
    try:
        rclpy.spin(node)
    except Exception:
        pass


if __name__ == "__main__":
    if sys.argv[1] == "chunks":
        chunk_publisher(sys.argv[2], int(sys.argv[3]))
    else:
        snapshot_server()
