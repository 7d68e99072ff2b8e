"""The `photon` console command.

Subcommands register themselves: a module listed in COMMAND_MODULES (or appended to it by a
plugin) defines `register(subparsers)`, adding its parser and setting `func=handler(args)`
via set_defaults. Modules that are not installed are skipped.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from .task import (CAPTION_LENGTHS, DEFAULT_MAX_OBJECTS, DEFAULT_MAX_TOKENS, MAX_OBJECTS_LIMIT,
                   MAX_QUESTION_CHARS, MAX_TOKENS_LIMIT)

# Optional command modules owned by other parts of photon (replay, play, diff, bench, ...).
COMMAND_MODULES = [
    "photon_core.scheduler.cli",
    "photon_core.fast.cli",
    "photon_ros.cli",
]


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help that shows every option's default (where it has one worth showing) and keeps
    descriptions' line breaks."""

    def _get_help_string(self, action):
        h = action.help or ""
        if ("default" not in h.lower() and not action.required and action.option_strings
                and action.default not in (None, False, [], argparse.SUPPRESS)
                and not isinstance(action, argparse._HelpAction)):
            h += (" " if h else "") + "(default: %(default)s)"
        return h


SKILL_HELP = {
    "detect": "find every OBJECT in the image: boxes x_min/y_min/x_max/y_max, fractions 0..1",
    "point": "point at every OBJECT in the image: x/y, fractions 0..1",
    "query": "answer a QUESTION about the image",
    "caption": "describe the image",
}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="model folder (Hugging Face layout: config.json, safetensors, "
                        "tokenizer.json) or Hugging Face id, e.g. vikhyatk/moondream2; the "
                        "family (Moondream 2, Qwen 3.5, Gemma 4) comes from its config.json")
    p.add_argument("--revision", default=None, help="Hugging Face revision (branch, tag, commit)")
    p.add_argument("--image", required=True, help="image file (png, jpeg, ...)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="weights and compute precision")


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
    from .models import capabilities
    # a skill the checkpoint's family does not serve: its own message, before any loading
    capabilities(args.model, args.revision).check_skill(task.skill)
    model = load_model(args.model, device=args.device, dtype=args.dtype,
                       revision=args.revision, progress=sys.stderr.isatty())
    note = getattr(model, "test_model_note", None)
    if note:
        print(f"photon {args.skill}: WARNING: {args.model} is a {note}; pass real weights "
              "(e.g. --model vikhyatk/moondream2) for real results", file=sys.stderr)
    res = model.run(model.encode_image(args.image), task)
    out = {**res.output, "finish_reason": res.finish_reason, "tokens": res.tokens,
           "timings": {k: round(v, 3) for k, v in res.timings.items()}}
    if note:
        out["test_model"] = note
    print(json.dumps(out))
    return 0


def _make_test_model(args) -> int:
    from .models import families

    fams = families()
    if args.family not in fams:
        print(f"unknown model family {args.family!r}; known: {', '.join(sorted(fams))}",
              file=sys.stderr)
        return 2
    if args.family == "moondream2":
        kw = {"fast": args.fast, "old_layout": args.old_layout}
        if args.real_shapes:
            from .models.moondream2.model import parse_device
            try:
                kw.update(real_shapes=True, device=parse_device(args.device))
            except ValueError as e:
                print(f"photon make-test-model: error: {e}", file=sys.stderr)
                return 2
    elif args.real_shapes:
        print("photon make-test-model: error: --real-shapes is for moondream2 only",
              file=sys.stderr)
        return 2
    else:
        kw = {}
    out = fams[args.family].make_test_model(args.dir, seed=args.seed, **kw)
    print(json.dumps({"written": str(out)}))
    return 0


def register_builtin(sub) -> None:
    for skill in ("detect", "point", "query", "caption"):
        p = sub.add_parser(skill, help=SKILL_HELP[skill] + "; prints one JSON line",
                           description=SKILL_HELP[skill] + ". Prints one JSON line: the result, "
                           "finish_reason (stop | length), tokens, timings.",
                           formatter_class=_Help)
        _add_model_args(p)
        if skill in ("detect", "point"):
            p.add_argument("--object", required=True, help="what to look for, e.g. person")
            p.add_argument("--max-objects", type=int, default=DEFAULT_MAX_OBJECTS,
                           help=f"stop after this many (1..{MAX_OBJECTS_LIMIT})")
        else:
            if skill == "query":
                p.add_argument("--question", required=True,
                               help=f"the question (at most {MAX_QUESTION_CHARS} characters)")
            else:
                p.add_argument("--length", default="normal", choices=list(CAPTION_LENGTHS),
                               help="caption length")
            p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                           help=f"answer length limit in tokens (1..{MAX_TOKENS_LIMIT}); "
                                "finish_reason 'length' means it was reached")
            p.add_argument("--temperature", type=float, default=0.0,
                           help="sampling temperature; 0 = greedy")
            p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, (0, 1]")
        p.set_defaults(func=_run_skill, skill=skill)

    p = sub.add_parser("make-test-model", help="write a tiny RANDOM checkpoint (tests, demos)",
                       description="Write a tiny random checkpoint in the family's real Hugging "
                       "Face layout (config.json, safetensors, tokenizer.json, chat template "
                       "where the family has one). Its answers are meaningless: it exercises "
                       "the plumbing, not perception.",
                       formatter_class=_Help)
    p.add_argument("family", help="model family: moondream2, qwen3.5 or gemma4")
    p.add_argument("dir", help="output folder (created)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("--fast", action="store_true",
                   help="moondream2: smaller vision tower (faster; the upstream reference code "
                        "cannot load it)")
    p.add_argument("--old-layout", action="store_true",
                   help="moondream2: use the older tensor names")
    p.add_argument("--real-shapes", action="store_true",
                   help="moondream2: the real model's shapes (1.93 B parameters, 3.85 GB "
                        "in bf16) with random weights, for GPU benchmarks and soaks")
    p.add_argument("--device", default="cpu",
                   help="with --real-shapes: where the random weights are generated (cuda: "
                        "seconds; cpu: about a minute and ~8 GB of memory)")
    p.set_defaults(func=_make_test_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="photon", formatter_class=_Help,
        description="photon: vision-language perception engine (Moondream 2, Qwen 3.5, Gemma 4) "
                    "and ROS 2 tools.\n"
                    "One image:   photon detect --model DIR_OR_ID --image IMG --object person\n"
                    "Try it all:  photon demo   (sample bag -> pipeline -> result bag + report)\n"
                    "`photon COMMAND --help` shows each command's options and defaults.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_builtin(sub)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and (name == e.name or name.startswith(e.name + ".")):
                continue  # not installed / not written yet
            raise
        module.register(sub)
    for p in sub.choices.values():       # every subcommand's help shows its defaults
        if p.formatter_class is argparse.HelpFormatter:
            p.formatter_class = _Help
    return parser


def _sigterm_as_interrupt() -> None:
    """SIGTERM (systemd, docker stop, kill) ends a command the way Ctrl-C does: through
    KeyboardInterrupt, so `photon replay` closes its output bag instead of dying mid-write."""
    import signal
    import threading

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _sigterm_as_interrupt()
    try:
        return args.func(args) or 0
    except (ValueError, OSError) as e:   # bad input, bad files: one clear line, not a traceback
        print(f"photon {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"photon {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a bug: say so in one line; PHOTON_DEBUG=1 shows it all
        if os.environ.get("PHOTON_DEBUG"):
            raise
        print(f"photon {args.command}: internal error: {type(e).__name__}: {_one_line(e)} "
              "(set PHOTON_DEBUG=1 for the traceback; please report it)", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 600 else text[:597] + "..."


if __name__ == "__main__":
    sys.exit(main())
