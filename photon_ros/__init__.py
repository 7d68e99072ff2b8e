"""photon_ros: ROS 2 adapter for the photon_core perception engine.

The interfaces generated from msg/, srv/ and action/ live in this same package
(`from photon_ros.msg import DetectionArray`); see README.md for why the layout works.
"""
__version__ = "0.1.0"
