"""photon_ros subcommands of the `photon` command (photon_core.cli imports this module and
calls `register`). Registering imports only the argument definitions (numpy at most):
rclpy, rosbags and torch are imported when a command runs."""
from __future__ import annotations

import importlib

# name -> (module, help)
COMMANDS = {
    "replay": ("photon_ros.replay", "run the perception tasks over a rosbag2 bag, write a result bag"),
    "play": ("photon_ros.play", "publish a bag's camera topics (+ /clock) at recorded timing"),
    "diff": ("photon_ros.diff", "compare two result bags; non-zero exit on regression; report"),
    "make-sample-bag": ("photon_ros.sample_bag", "write a small synthetic camera bag"),
    "demo": ("photon_ros.demo", "sample bag -> pipeline -> result bag + report (README main job)"),
}


def parse_pairs(items, sep: str, option: str, form: str) -> dict[str, str]:
    """Repeated `option` values "KEY<sep>VALUE" -> {KEY: VALUE}; a value without sep is a
    ValueError naming the option and its form (e.g. "--camera wants NAME=TOPIC")."""
    out = {}
    for item in items:
        if sep not in item:
            raise ValueError(f"{option} wants {form}, got {item!r}")
        k, v = item.split(sep, 1)
        out[k] = v
    return out


def _runner(module_name: str):
    def run(args) -> int:
        return importlib.import_module(module_name).main(args)
    return run


def register(sub) -> None:
    for name, (module_name, help_) in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_, description=(module.__doc__ or "").strip().split("\n\n")[0])
        module.add_arguments(p)
        p.set_defaults(func=_runner(module_name))
