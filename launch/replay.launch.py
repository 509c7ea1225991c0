"""Replay a rosbag2 onto topics against a running policy node and record what it publishes.

    ros2 launch flashrt_ros replay.launch.py bag:=/data/episode_01 report:=/tmp/replay_report \
        image_height:=240 image_width:=320

The included policy.launch.py arguments (camera_topics, device, image_height/width, ...) are accepted here
too; image_height/width must match the bag's camera images (the node rejects other sizes). Leave namespace
empty: the bag's topics are played as recorded.
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, ExecuteProcess, IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration


def generate_launch_description():
    share = get_package_share_directory("flashrt_ros")
    args = [
        DeclareLaunchArgument("bag", description="rosbag2 directory (mcap or sqlite3) to replay"),
        DeclareLaunchArgument("config", default_value=os.path.join(share, "config", "pi05_tiny.yaml"),
                              description="execution contract YAML; its `replay:` section maps bag topics"),
        DeclareLaunchArgument("checkpoint", default_value="", description="LeRobot pi0.5 checkpoint directory"),
        DeclareLaunchArgument("report", default_value="replay_report", description="report output directory"),
    ]
    policy = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(os.path.join(share, "launch", "policy.launch.py")),
        launch_arguments={"config": LaunchConfiguration("config"),
                          "checkpoint": LaunchConfiguration("checkpoint"), "autostart": "true"}.items())
    replay = ExecuteProcess(
        cmd=["flashrt", "replay", LaunchConfiguration("bag"), "--config", LaunchConfiguration("config"),
             "--report", LaunchConfiguration("report"), "--realtime"],
        output="screen")
    return LaunchDescription(args + [policy, replay])
