"""Launch the FlashRT policy node (lifecycle) with a contract, a checkpoint and camera topics.

    ros2 launch flashrt_ros policy.launch.py checkpoint:=/models/pi05 \
        camera_topics:="['/cam_high/image_raw', '/cam_wrist/image_raw/compressed']" namespace:=arm
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.parameter_descriptions import ParameterValue


def generate_launch_description():
    share = get_package_share_directory("flashrt_ros")
    args = [
        DeclareLaunchArgument("params_file", default_value=os.path.join(share, "config", "policy_node.yaml"),
                              description="YAML with the node parameters (documented defaults)"),
        DeclareLaunchArgument("config", default_value=os.path.join(share, "config", "pi05_tiny.yaml"),
                              description="execution contract YAML (stages, rates, buffers, model)"),
        DeclareLaunchArgument("checkpoint", default_value="",
                              description="LeRobot pi0.5 checkpoint directory; empty = built-in tiny model"),
        DeclareLaunchArgument("camera_topics", default_value="['camera0/image_raw', 'camera1/image_raw']",
                              description="camera topics in model slot order (a /compressed suffix = CompressedImage)"),
        DeclareLaunchArgument("joint_state_topic", default_value="joint_states", description="JointState topic"),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node and its topics"),
        DeclareLaunchArgument("device", default_value="auto", description="cpu | cuda | cuda:N | auto"),
        DeclareLaunchArgument("image_height", default_value="0",
                              description="camera image height; 0 = the contract's (other sizes are rejected)"),
        DeclareLaunchArgument("image_width", default_value="0",
                              description="camera image width; 0 = the contract's (other sizes are rejected)"),
        DeclareLaunchArgument("autostart", default_value="true",
                              description="configure and activate at start-up (false: use a lifecycle manager)"),
    ]
    node = LifecycleNode(
        package="flashrt_ros", executable="policy_node", name="policy_node",
        namespace=LaunchConfiguration("namespace"), output="screen",
        parameters=[LaunchConfiguration("params_file"), {
            "contract": LaunchConfiguration("config"),
            "checkpoint": LaunchConfiguration("checkpoint"),
            "camera_topics": ParameterValue(LaunchConfiguration("camera_topics"), value_type=list[str]),
            "joint_state_topic": LaunchConfiguration("joint_state_topic"),
            "device": LaunchConfiguration("device"),
            "image_height": ParameterValue(LaunchConfiguration("image_height"), value_type=int),
            "image_width": ParameterValue(LaunchConfiguration("image_width"), value_type=int),
            "autostart": ParameterValue(LaunchConfiguration("autostart"), value_type=bool),
        }],
    )
    return LaunchDescription(args + [node])
