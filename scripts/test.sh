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
# Triton kernels, where installed, are tested on the CPU through its interpreter.
export TRITON_INTERPRET=1
exec python -m pytest -q -p no:cacheprovider --timeout=900 test "$@"
