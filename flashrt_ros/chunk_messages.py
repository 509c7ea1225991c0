"""The messages a decision is published as: flashrt_ros/ActionChunk, and optionally a JointTrajectory on the
chunk's own time axis."""
from __future__ import annotations

from builtin_interfaces.msg import Time
from rclpy.duration import Duration
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from flashrt_ros import conversions
from flashrt_ros.msg import ActionChunk


def action_chunk_message(result, actions, joint_names, dt_s: float, published) -> ActionChunk:
    """A runtime StepResult and its checked actions [horizon, width] -> ActionChunk, time-aligned: the first
    action is due at the tick the chunk was computed for; at `published` (rclpy Time) the robot is `now_index`
    actions into it (0 unless the tick ran longer than an action period)."""
    msg = ActionChunk()
    dt_ns = int(round(dt_s * 1e9))
    msg.header.stamp = conversions.ns_to_stamp(result.now_ns, Time)
    msg.now_index = max(0, (published.nanoseconds - result.now_ns) // dt_ns)
    msg.publish_stamp = published.to_msg()
    msg.joint_names = list(joint_names)
    msg.horizon, msg.action_dim = int(actions.shape[0]), int(actions.shape[1])
    msg.actions = actions.reshape(-1).tolist()
    msg.dt = float(dt_s)
    msg.decision_id = int(result.decision_id)
    msg.prefix_id = int(result.prefix_id)
    msg.observation_stamp = conversions.ns_to_stamp(result.observation_stamp_ns, Time)
    msg.observation_age_ms = float(result.observation_age_ms)
    msg.latency_ms = float(result.latency_ms)
    msg.stages_ran = [s for s in result.ran if s not in result.deferred]  # the stages behind this chunk
    return msg


def trajectory_message(chunk: ActionChunk, actions) -> JointTrajectory | None:
    """The chunk's actions from the one due at publish on, on the chunk's own time axis (header.stamp = its
    first action, point k at k * dt): a joint_trajectory_controller replaces the running trajectory from now
    with it, so consecutive chunks splice into one continuous trajectory at the right index. None without
    joint names, or for a chunk published after its last action was due (nothing left to execute)."""
    names = list(chunk.joint_names)
    if not names or chunk.now_index >= actions.shape[0]:
        return None
    dt_ns = int(round(chunk.dt * 1e9))
    traj = JointTrajectory()
    traj.header = chunk.header
    traj.joint_names = names
    for k in range(chunk.now_index, actions.shape[0]):
        point = JointTrajectoryPoint()
        point.positions = actions[k, : len(names)].astype(float).tolist()
        point.time_from_start = Duration(nanoseconds=k * dt_ns).to_msg()
        traj.points.append(point)
    return traj
