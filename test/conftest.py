"""Test-wide settings. DDS must stay on loopback in every test (workplace rule):
ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST is set before any rclpy.init(), and each run
gets its own ROS_DOMAIN_ID so parallel runs (and the parallel workers of one run) don't see
each other."""
import os
import random
import tempfile

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
os.environ.setdefault("ROS_DOMAIN_ID", str(random.randint(1, 101)))
# pytest-xdist workers (scripts/test.sh runs two): one domain each, so two node tests that
# run at once never see each other's topics
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and _worker[2:].isdigit():
    os.environ["ROS_DOMAIN_ID"] = str((int(os.environ["ROS_DOMAIN_ID"]) - 1
                                       + int(_worker[2:])) % 101 + 1)
os.environ.setdefault("ROS_LOG_DIR", tempfile.mkdtemp(prefix="photon-roslog-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Property tests (hypothesis): in CI (CI=true, .ci/run) the same draws every run, so a run
# fails for a change and not for the luck of the draw; by hand they draw anew each run
# (`--hypothesis-seed=N` to explore: docs/benchmarks.md, simulator section, session 7).
try:
    from hypothesis import settings as _hyp_settings
except ImportError:                 # hypothesis is a test dependency; only its tests need it
    _hyp_settings = None
if _hyp_settings is not None:
    _hyp_settings.register_profile("ci", derandomize=True, database=None)
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        _hyp_settings.load_profile("ci")
