"""photon_ros: ROS 2 adapter for the photon_core perception engine.

The interfaces generated from msg/, srv/ and action/ live in this same package
(`from photon_ros.msg import DetectionArray`); README.md explains the layout. When the code
runs from a source checkout (tests, development), the generated subpackages are found in the
installed copy of `photon_ros` through the extended package path below.
"""
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
__version__ = "0.1.0"
