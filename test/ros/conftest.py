"""Markers of the ROS tests: `soak` = the long-running CI soak (test_soak_ci.py); deselect
with `-m "not soak"` for a quick local run."""


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: the 60-second soak against the real node (CI)")
