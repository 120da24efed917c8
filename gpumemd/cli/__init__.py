"""The ``gpumemd`` command line: ``main(argv) -> exit code``; errors are one line and exit code 2."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import warnings
from collections.abc import Sequence

from gpumemd._version import __version__
from gpumemd.cli import run
from gpumemd.cli.errors import CliError
from gpumemd.cli.escape import escaped
from gpumemd.signal_endings import die_by

# Subcommand -> module. Each module defines ``add_parser(subparsers)``, which registers its parser
# and sets ``func=run`` where ``run(args) -> int``. Modules must not import torch at import time.
COMMANDS: dict[str, str] = {
    "demo": "gpumemd.cli.demo",
    "report": "gpumemd.cli.report",
    "run": "gpumemd.cli.run",
    "estimate": "gpumemd.cli.estimate",
    "doctor": "gpumemd.cli.doctor",
    "export": "gpumemd.cli.export",
    "top": "gpumemd.cli.top",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpumemd", description="A memory flight recorder for long PyTorch jobs."
    )
    parser.add_argument("--version", action="version", version=f"gpumemd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
        if extra and getattr(args, "command", None) == "run":  # a mistyped option: name the close ones
            print(f"gpumemd run: {run.unknown_options(extra)}", file=sys.stderr)
            return 2
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")  # as parse_args says it
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with warnings.catch_warnings():
            if args.command != "run":  # `run` leaves the script's warnings as python would show them
                # torch warns at import when NumPy is absent; gpumemd's own commands never need it
                warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
            return int(args.func(args))
    # ValueError: bad input found below the commands (a configuration error from attach(), a malformed
    # report or state file, a bad estimate): its message is the one line, as a CliError's
    except (CliError, ValueError) as err:
        print(f"gpumemd {args.command}: {escaped(str(err))}", file=sys.stderr)  # it may quote a file's bytes
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `gpumemd report ... | head`: the reader left; say nothing more (and let the interpreter's
        # final flush of stdout go nowhere instead of raising again).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def console_main() -> None:
    code = main()
    if run.interrupted and sys.platform != "win32":  # as python: die by the signal itself
        die_by(signal.SIGINT)
    sys.exit(code)
