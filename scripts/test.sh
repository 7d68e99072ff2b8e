#!/usr/bin/env bash
# Installs everything (./.venv) and runs the whole test suite. `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
# DDS stays on loopback; each run gets its own domain and log folder.
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
export ROS_DOMAIN_ID=${ROS_DOMAIN_ID:-$((RANDOM % 100 + 1))}
export ROS_LOG_DIR=${ROS_LOG_DIR:-$(mktemp -d)}
export HF_HUB_OFFLINE=1
# ament index of the pip route (the venv's prefix), for `ros2 launch/run photon_ros ...`
export AMENT_PREFIX_PATH=${AMENT_PREFIX_PATH:-$VIRTUAL_ENV}
if ! command -v launch_test >/dev/null || ! command -v ros2 >/dev/null; then
  echo "test.sh: the ROS 2 launch system / command line is not installed (no ../shared/ros2-cli):" \
       "test/ros/test_launch.py will be skipped"
fi
# Triton kernels, where installed, are tested on the CPU through its interpreter.
export TRITON_INTERPRET=1
exec python -m pytest -q -rs -p no:cacheprovider --timeout=900 test "$@"
