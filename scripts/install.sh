#!/usr/bin/env bash
# Installs photon_ros and everything it needs into ./.venv (idempotent).
# The ROS 2 Kilted runtime comes from PyPI wheels; the interfaces are built by CMake
# (ament_cmake + rosidl from wheels) through scikit-build-core.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PHOTON_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
stamp="$VENV/.photon-deps-$(cat scripts/requirements-*.txt | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  python -m pip install -q --upgrade pip
  # torch: the CPU build here; a CUDA machine keeps whatever torch it already has.
  if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "${PHOTON_TORCH:-torch==2.13.0}"
  fi
  python -m pip install -q -r scripts/requirements-ros.txt -r scripts/requirements-py.txt
  touch "$stamp"
fi
# The package itself: msg/srv/action build (CMake) + photon_core + photon_ros.
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
python -m pip install -q --no-build-isolation --no-deps "${PHOTON_PIP_EDITABLE:-.}"
# The ROS 2 launch system and command line (ros2 launch/run/topic/lifecycle/..., launch_testing,
# vision_msgs) are not on PyPI: CI lays a copy of shared/ beside the clone with their sources.
# Where that copy is missing (a user's machine) the launch and CLI tests skip and say why.
KIT=${PHOTON_ROS2_CLI:-../shared/ros2-cli}
if [ -f "$KIT/install.sh" ]; then
  bash "$KIT/install.sh" "$(command -v python)"
else
  echo "install.sh: no $KIT (the ROS 2 launch system and command line): the launch and CLI" \
       "tests will be skipped"
fi
