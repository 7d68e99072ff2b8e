"""The `photon` console command.

Subcommands register themselves: a module listed in COMMAND_MODULES (or appended to it by a
plugin) defines `register(subparsers)`, adding its parser and setting `func=handler(args)`
via set_defaults. Modules that are not installed are skipped.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

# Optional command modules owned by other parts of photon (replay, play, diff, bench, ...).
COMMAND_MODULES = [
    "photon_core.scheduler.cli",
    "photon_core.fast.cli",
    "photon_ros.cli",
]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder or Hugging Face id")
    p.add_argument("--revision", default=None, help="Hugging Face revision")
    p.add_argument("--image", required=True, help="image file")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])


def _run_skill(args) -> int:
    from . import Task, load_model

    kw = {}
    if args.skill in ("detect", "point"):
        kw = {"object": args.object or "", "max_objects": args.max_objects}
    elif args.skill == "query":
        kw = {"question": args.question or "", "max_tokens": args.max_tokens,
              "temperature": args.temperature, "top_p": args.top_p}
    else:
        kw = {"caption_length": args.length, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "top_p": args.top_p}
    task = Task(args.skill, **kw).validate()
    model = load_model(args.model, device=args.device, dtype=args.dtype,
                       revision=args.revision, progress=sys.stderr.isatty())
    res = model.run(model.encode_image(args.image), task)
    print(json.dumps({**res.output, "finish_reason": res.finish_reason, "tokens": res.tokens,
                      "timings": {k: round(v, 3) for k, v in res.timings.items()}}))
    return 0


def _make_test_model(args) -> int:
    from .models import families

    fams = families()
    if args.family not in fams:
        print(f"unknown model family {args.family!r}; known: {', '.join(sorted(fams))}",
              file=sys.stderr)
        return 2
    kw = {"fast": args.fast, "old_layout": args.old_layout} if args.family == "moondream2" else {}
    out = fams[args.family].make_test_model(args.dir, seed=args.seed, **kw)
    print(json.dumps({"written": str(out)}))
    return 0


def register_builtin(sub) -> None:
    for skill in ("detect", "point", "query", "caption"):
        p = sub.add_parser(skill, help=f"run {skill} on one image, print JSON")
        _add_model_args(p)
        if skill in ("detect", "point"):
            p.add_argument("--object", required=True)
            p.add_argument("--max-objects", type=int, default=50)
        else:
            if skill == "query":
                p.add_argument("--question", required=True)
            else:
                p.add_argument("--length", default="normal", choices=["short", "normal", "long"])
            p.add_argument("--max-tokens", type=int, default=128)
            p.add_argument("--temperature", type=float, default=0.0)
            p.add_argument("--top-p", type=float, default=1.0)
        p.set_defaults(func=_run_skill, skill=skill)

    p = sub.add_parser("make-test-model", help="write a tiny random checkpoint for tests")
    p.add_argument("family", help="moondream2")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fast", action="store_true",
                   help="smaller vision tower (faster; the reference code cannot load it)")
    p.add_argument("--old-layout", action="store_true", help="use the older tensor names")
    p.set_defaults(func=_make_test_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="photon", description="photon_ros engine tools")
    sub = parser.add_subparsers(dest="command", required=True)
    register_builtin(sub)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and (name == e.name or name.startswith(e.name + ".")):
                continue  # not installed / not written yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:   # bad input: one clear line, not a traceback
        print(f"photon {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
