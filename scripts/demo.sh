#!/usr/bin/env bash
# Installs everything (./.venv) and runs the main job: a sample camera bag replayed through the
# perception pipeline. Pass a Moondream 2 folder or hub id to use real weights:
#   bash scripts/demo.sh --model /path/to/moondream2
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
export ROS_LOG_DIR=${ROS_LOG_DIR:-$(mktemp -d)}
exec photon demo "$@"
