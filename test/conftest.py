"""Test-wide settings. DDS must stay on loopback in every test (workplace rule):
ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST is set before any rclpy.init(), and each run
gets its own ROS_DOMAIN_ID so parallel runs don't see each other."""
import os
import random
import tempfile

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
os.environ.setdefault("ROS_DOMAIN_ID", str(random.randint(1, 101)))
os.environ.setdefault("ROS_LOG_DIR", tempfile.mkdtemp(prefix="photon-roslog-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
