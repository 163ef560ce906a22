"""The ``ds-lowcomm`` command: ``plan`` (the library's), and the commands other installed
distributions register under the ``ds_lowcomm.commands`` entry-point group: ``compare`` is the
laboratory's (``lab/``: the reference task, installed from a checkout by ``pip install -e lab``,
which launch/env.sh runs). Each such entry point names a module (or object) with ``HELP``,
``add_arguments(parser)`` and ``run(args)``; the library never imports the laboratory itself."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from .config import ConfigError

COMMAND_GROUP = "ds_lowcomm.commands"
# Commands documented in the README that come from the laboratory: named in the error when it is absent.
LAB_COMMANDS = ("compare",)


def plugin_commands() -> dict:
    """name -> entry point, of every installed distribution's ``ds_lowcomm.commands``."""
    return {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}


def _parser(commands: dict | None = None) -> argparse.ArgumentParser:
    """The parser of ``plan`` and of ``commands`` (name -> loaded command; default: every installed one)."""
    from .plan import add_arguments

    if commands is None:
        commands = {name: ep.load() for name, ep in plugin_commands().items()}

    parser = argparse.ArgumentParser(prog="ds-lowcomm", description="Low-communication distributed training.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="predict each method's bytes, step time, memory and speed-up for a model, "
                                    "cluster and link (ds_lowcomm/plan/)")
    add_arguments(p)
    for name, command in commands.items():
        command.add_arguments(sub.add_parser(name, help=command.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    found = plugin_commands()
    if first in LAB_COMMANDS and first not in found:
        print(f"ds-lowcomm: {first!r} is a command of ds_lowcomm's laboratory (the reference task, lab/ in the "
              "repository), which is not installed: from a checkout, run `pip install -e lab --no-deps` after the "
              "library (bash launch/env.sh does both)", file=sys.stderr)
        return 2
    # load only the command asked for (``plan`` loads none); all of them to list them in --help
    names = [first] if first in found else ([] if first == "plan" else list(found))
    commands = {name: found[name].load() for name in names}
    args = _parser(commands).parse_args(argv)
    try:
        if args.command == "plan":
            from .plan import run_plan

            run_plan(args)
        else:
            commands[args.command].run(args)
    except ConfigError as err:
        print(f"ds-lowcomm: configuration error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
