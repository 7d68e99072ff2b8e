"""Launch the photon_ros perception node.

    ros2 launch photon_ros perception.launch.py model:=vikhyatk/moondream2 device:=cuda
    ros2 launch photon_ros perception.launch.py model:=/models/md2 camera_topic:=/cam/image_raw

Arguments: model, params_file (default: config/perception.yaml of the installed package),
device, dtype, engine, namespace, use_sim_time, camera_topic (replaces the first camera's topic in a
single-camera setup), auto_activate, log_level. The node reads the same YAML both as its
ROS parameters file and through its `params_file` parameter.
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
from launch_ros.parameter_descriptions import ParameterValue


def generate_launch_description() -> LaunchDescription:
    default_params = os.path.join(get_package_share_directory("photon_ros"), "config",
                                  "perception.yaml")
    args = [
        DeclareLaunchArgument("model", description="model folder or Hugging Face id"),
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="ROS 2 parameters file with cameras and tasks"),
        DeclareLaunchArgument("device", default_value="cpu", description="cpu | cuda | cuda:N"),
        DeclareLaunchArgument("dtype", default_value="fp32", description="fp32 | bf16 | fp16"),
        DeclareLaunchArgument("engine", default_value="auto",
                              description="auto (fast path on CUDA) | reference | fast"),
        DeclareLaunchArgument("namespace", default_value="", description="node namespace"),
        DeclareLaunchArgument("use_sim_time", default_value="false"),
        DeclareLaunchArgument("camera_topic", default_value="",
                              description="topic of the (first) camera; empty = from the YAML"),
        DeclareLaunchArgument("auto_activate", default_value="true"),
        DeclareLaunchArgument("log_level", default_value="info"),
    ]
    params_file = LaunchConfiguration("params_file")
    node = Node(
        package="photon_ros",
        executable="perception_node",
        name="perception_node",
        namespace=LaunchConfiguration("namespace"),
        output="screen",
        emulate_tty=True,
        parameters=[
            params_file,
            {
                # value_type=str: launch_ros YAML-parses plain substitutions (a model folder
                # named "2024" would arrive as an integer and fail configure)
                "params_file": ParameterValue(params_file, value_type=str),
                "model": ParameterValue(LaunchConfiguration("model"), value_type=str),
                "device": ParameterValue(LaunchConfiguration("device"), value_type=str),
                "dtype": ParameterValue(LaunchConfiguration("dtype"), value_type=str),
                "engine": ParameterValue(LaunchConfiguration("engine"), value_type=str),
                "camera_topic": ParameterValue(LaunchConfiguration("camera_topic"), value_type=str),
                "use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool),
                "auto_activate": ParameterValue(LaunchConfiguration("auto_activate"),
                                                value_type=bool),
            },
        ],
        arguments=["--ros-args", "--log-level", LaunchConfiguration("log_level")],
    )
    return LaunchDescription(args + [node])
