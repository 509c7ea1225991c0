"""Replay a rosbag2 onto topics against a policy node, record what the node publishes, then shut down.

    ros2 launch flashrt_ros replay.launch.py bag:=/data/episode_01 report:=/tmp/replay_report \
        image_height:=240 image_width:=320

Starts policy.launch.py's node (autostart) with the same arguments (params_file, checkpoint, camera_topics,
joint_state_topic, device, image_height/width, engine, tokenizer; namespace stays empty: the bag's topics are
played as recorded) and `flashrt replay BAG --realtime` beside it. The contract describes the model, not the
robot's topics, so the replay maps bag topics to the node's inputs from the node's own configuration: the same
params_file, with the camera_topics and joint_state_topic arguments over it, and its report uses the contract and
checkpoint the node takes. Frames of another size than image_height/width are letterboxed to it. When the replay
ends, the launch shuts down, node included; a failed replay (or a node that cannot configure) ends it with an error.
"""
import importlib.util
import os


POLICY_LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "policy.launch.py")


def _policy_launch():
    """policy.launch.py beside this file (its argument table and parameter rules are the node's)."""
    path = POLICY_LAUNCH
    spec = importlib.util.spec_from_file_location("flashrt_policy_launch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay_command(values: dict) -> list:
    """`flashrt replay` for these launch argument values (the topic mapping the node's parameters give)."""
    from flashrt_ros.run_cli import file_parameters  # (the node's sections of the file, as rcl applies them)

    policy = _policy_launch()
    cmd = ["flashrt", "replay", values["bag"], "--realtime", "--report", values["report"], "--timeout",
           values["node_timeout"], "--no-progress"]
    # the node's contract and checkpoint, as the node takes them: the arguments over the params_file's values
    node = {**file_parameters(values.get("params_file", ""), "policy_node")[0],
            **{p: v for p, v in (("contract", values.get("config", "")), ("checkpoint", values.get("checkpoint", "")))
               if v}}
    if node.get("contract"):
        cmd += ["--config", node["contract"]]
    if node.get("checkpoint"):
        cmd += ["--checkpoint", node["checkpoint"]]
    if values.get("params_file"):
        cmd += ["--topics", values["params_file"]]
    given = policy.node_parameters({name: values.get(name, "") for name in ("camera_topics", "joint_state_topic")})
    if "camera_topics" in given:
        cmd += ["--cameras", ",".join(given["camera_topics"])]
    if "joint_state_topic" in given:
        cmd += ["--joints", given["joint_state_topic"]]
    return cmd


def _replay_ended(event, context):
    """The replay ended: the launch shuts down, with an error (a non-zero status of `ros2 launch`) if it failed."""
    from launch.actions import LogInfo, Shutdown

    if event.returncode != 0:
        raise RuntimeError(f"flashrt replay failed (exit code {event.returncode}): its output above says why")
    return [LogInfo(msg="flashrt replay finished: shutting down"), Shutdown(reason="replay finished")]


def _launch_replay(context):
    from launch.actions import ExecuteProcess, RegisterEventHandler
    from launch.event_handlers import OnProcessExit

    replay = ExecuteProcess(cmd=replay_command(dict(context.launch_configurations)), output="screen",
                            name="flashrt_replay")
    return [RegisterEventHandler(OnProcessExit(target_action=replay, on_exit=_replay_ended)), replay]


def generate_launch_description():
    from ament_index_python.packages import get_package_share_directory
    from launch import LaunchDescription
    from launch.actions import DeclareLaunchArgument, IncludeLaunchDescription, OpaqueFunction
    from launch.launch_description_sources import PythonLaunchDescriptionSource
    from launch.substitutions import LaunchConfiguration

    share = get_package_share_directory("flashrt_ros")
    policy = _policy_launch()
    args = [
        DeclareLaunchArgument("bag", description="rosbag2 folder (mcap or sqlite3) to replay"),
        DeclareLaunchArgument("config", default_value="",
                              description="execution contract YAML, for the node and the replay's report; '' = "
                                          "the node's own choice (the params_file's contract, else the packaged "
                                          "one for its checkpoint, else the built-in tiny model's)"),
        DeclareLaunchArgument("report", default_value="replay_report", description="report output folder"),
        DeclareLaunchArgument("node_timeout", default_value="300",
                              description="seconds the replay waits for the node (configure loads the weights "
                                          "and, on a first GPU start, tunes the kernels)"),
        DeclareLaunchArgument("params_file", default_value=os.path.join(share, "config", "policy_node.yaml"),
                              description="the node's parameters file; also maps the bag's camera and joint "
                                          "topics; '' = none"),
    ]
    passed = ["params_file", "config"]
    for name, (_, _, description) in policy.OVERRIDES.items():
        if name != "config":
            args.append(DeclareLaunchArgument(name, default_value="",
                                              description=f"{description}; '' = the params_file's value"))
            passed.append(name)
    node = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(POLICY_LAUNCH),
        launch_arguments=[(name, LaunchConfiguration(name)) for name in passed]
        + [("autostart", "true"), ("namespace", "")])
    return LaunchDescription(args + [node, OpaqueFunction(function=_launch_replay)])
