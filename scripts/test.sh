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
PYTEST=(python -m pytest -q -rs -p no:cacheprovider --timeout=900)
if [ $# -gt 0 ]; then              # a selection (paths, -k ...): one serial run over test/
  exec "${PYTEST[@]}" test "$@"
fi
# The engine tests (CPU-bound, one core each) and the colcon build route on
# PHOTON_TEST_WORKERS workers (pytest-xdist, whole files per worker: module fixtures are built
# once); then the other ROS tests one at a time, since their nodes, cameras and DDS share the
# machine's cores and some of them time things. (CI's 2 cores: ~24 -> ~14 min.)
# Each worker's torch / numpy threads get the cores divided by the workers (1 on CI's 2 cores):
# on this machine (2 cores) the engine tests took 622 s with 1 thread per worker, 744 s with
# torch / numpy at their default 2 threads per worker (session 47).
rc=0
BUILD_ROUTES=test/ros/test_build_routes.py
WORKERS=${PHOTON_TEST_WORKERS:-2}
THREADS=$(( $(nproc) / (WORKERS > 1 ? WORKERS : 1) )); [ "$THREADS" -ge 1 ] || THREADS=1
OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS} \
  "${PYTEST[@]}" -n "$WORKERS" --dist loadfile test/core "$BUILD_ROUTES" || rc=$?
"${PYTEST[@]}" test/ros --ignore="$BUILD_ROUTES" || rc=$?
exit $rc
