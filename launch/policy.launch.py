"""Launch the FlashRT policy node (lifecycle) with a parameters file, a contract, a checkpoint and camera topics.

    ros2 launch flashrt_ros policy.launch.py params_file:=/robot/policy.yaml
    ros2 launch flashrt_ros policy.launch.py checkpoint:=/models/pi05 engine:=fused \
        camera_topics:="['/cam_high/image_raw', '/cam_wrist/image_raw/compressed']" namespace:=arm

The node's parameters come from `params_file` (default: the packaged config/policy_node.yaml). An argument below
that is left empty sets nothing, so the file's value stays; an argument given on the command line overrides the
parameter of the same name (`config` sets `contract`). Only `autostart` and `exit_on_failure` always come from
the launch file (default true, and as autostart); give autostart:=false to leave the lifecycle to a manager.
With exit_on_failure a node that cannot configure (a bad checkpoint, say) ends, and the launch with it, status 1.
"""
import os

import yaml

# launch and launch_ros are imported where they are used: the argument table and node_parameters() below are
# plain Python, so they can be checked on machines without ROS launch (the pip set-up has none).

ENGINES = ("auto", "fused", "reference")
# launch argument -> (node parameter, type, description); '' (the default of each) = the params_file's value.
OVERRIDES = {
    "config": ("contract", str, "execution contract YAML (stages, rates, buffers, model)"),
    "checkpoint": ("checkpoint", str, "LeRobot pi0.5 / pi0 checkpoint folder (as save_pretrained writes it)"),
    "camera_topics": ("camera_topics", list,
                      "camera topics in the checkpoint's camera-feature order, a YAML list (a /compressed suffix = "
                      "CompressedImage)"),
    "joint_state_topic": ("joint_state_topic", str, "sensor_msgs/JointState topic"),
    "state_topic": ("state_topic", str, "std_msgs/Float64MultiArray state topic instead of joint states"),
    "device": ("device", str, "cpu | cuda | cuda:N | auto"),
    "image_height": ("image_height", int, "height frames are letterboxed to; 0 = the contract's"),
    "image_width": ("image_width", int, "width frames are letterboxed to; 0 = the contract's"),
    "engine": ("engine", str, "auto | fused | reference (auto: fused on CUDA)"),
    "tokenizer": ("tokenizer", str, "tokenizer file or folder; the checkpoint's named tokenizer otherwise"),
}


def _value(argument: str, text: str, kind):
    if kind is str:
        if argument == "engine" and text not in ENGINES:
            raise ValueError(f"launch argument 'engine' must be one of {', '.join(ENGINES)}, not {text!r}")
        return text
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"launch argument {argument!r} must be an integer, not {text!r}") from None
    if kind is bool:
        value = yaml.safe_load(text)
        if not isinstance(value, bool):
            raise ValueError(f"launch argument {argument!r} must be true or false, not {text!r}")
        return value
    # a list of strings: a YAML list, or one name / comma-separated names
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",")]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"launch argument {argument!r} must be a list of names, e.g. \"['a', 'b']\", not {text!r}")
    return value


def node_parameters(arguments: dict) -> dict:
    """The node parameters that the given launch argument values set: only those given (not '')."""
    return {parameter: _value(name, arguments[name], kind)
            for name, (parameter, kind, _) in OVERRIDES.items() if arguments.get(name, "") != ""}


def parameter_sources(params_file: str, arguments: dict, autostart: str, exit_on_failure: str = "") -> list:
    """The node's `parameters`, in order: the params_file, then what the launch arguments set (later wins).
    exit_on_failure '' = as autostart (a node started alone ends when it cannot configure; one left to a
    lifecycle manager waits for it)."""
    sources = []
    if params_file:
        if not os.path.isfile(params_file):
            raise FileNotFoundError(f"launch argument 'params_file': no such file {params_file!r}")
        sources.append(params_file)
    overrides = node_parameters(arguments)
    overrides["autostart"] = _value("autostart", autostart, bool)
    overrides["exit_on_failure"] = (overrides["autostart"] if exit_on_failure == ""
                                    else _value("exit_on_failure", exit_on_failure, bool))
    sources.append(overrides)
    return sources


def _node_ended(event, context):
    """The node ended by itself (exit_on_failure: it could not configure): the launch ends too, with an error
    (a non-zero status of `ros2 launch`) unless the node ended cleanly or the launch was stopping anyway."""
    from launch.actions import Shutdown

    if context.is_shutdown:  # (stopped by the launch: nothing to add)
        return None
    if event.returncode:
        raise RuntimeError(f"policy_node ended with exit code {event.returncode}: its log above says why")
    return [Shutdown(reason="policy_node ended")]


def _launch_node(context):
    from launch.actions import RegisterEventHandler
    from launch.event_handlers import OnProcessExit
    from launch_ros.actions import LifecycleNode

    values = context.launch_configurations
    parameters = parameter_sources(values["params_file"], {name: values[name] for name in OVERRIDES},
                                   values["autostart"], values.get("exit_on_failure", ""))
    node = LifecycleNode(package="flashrt_ros", executable="policy_node", name="policy_node",
                         namespace=values["namespace"], output="screen", parameters=parameters)
    if not parameters[-1]["exit_on_failure"]:
        return [node]
    return [RegisterEventHandler(OnProcessExit(target_action=node, on_exit=_node_ended)), node]


def generate_launch_description():
    from ament_index_python.packages import get_package_share_directory
    from launch import LaunchDescription
    from launch.actions import DeclareLaunchArgument, OpaqueFunction

    share = get_package_share_directory("flashrt_ros")
    args = [
        DeclareLaunchArgument("params_file", default_value=os.path.join(share, "config", "policy_node.yaml"),
                              description="YAML with the node parameters (the packaged one documents them); "
                                          "'' = none"),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node and its topics"),
        DeclareLaunchArgument("autostart", default_value="true",
                              description="configure and activate at start-up (false: use a lifecycle manager); "
                                          "the params_file's autostart is not used"),
        DeclareLaunchArgument("exit_on_failure", default_value="", choices=["", "true", "false"],
                              description="a failed configure ends the node and the launch (status 1); '' = as "
                                          "autostart"),
    ]
    for name, (parameter, _, description) in OVERRIDES.items():
        sets = "" if parameter == name else f" (sets the node parameter '{parameter}')"
        args.append(DeclareLaunchArgument(
            name, default_value="", choices=["", *ENGINES] if name == "engine" else None,
            description=f"{description}{sets}; '' = the params_file's value"))
    return LaunchDescription(args + [OpaqueFunction(function=_launch_node)])
