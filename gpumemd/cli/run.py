"""``gpumemd run [options] script.py [args...]``: run a script as ``__main__`` with the agent attached.

The script sees what ``python script.py args...`` would give it: ``sys.argv == [script, *args]``,
``sys.path[0]`` is the script's directory, ``__name__ == "__main__"``; its ``sys.exit(code)`` is our
exit code and an uncaught exception prints its usual traceback (through ``sys.excepthook``, so the
agent's and the user's hooks see it) and exits 1. ``gpumemd run -m pkg.mod args...`` runs a module
like ``python -m``.

Every ``Config`` field is an option generated from ``gpumemd.config`` (``--port 9400``,
``--census/--no-census``, ...), on top of the ``GPUMEMD_*`` environment; options go before the
script, everything after the script belongs to it. Launchers:

- torchrun: ``torchrun --nproc-per-node 8 --no-python gpumemd run train.py`` (``--no-python`` execs
  the worker command as given), or ``torchrun --nproc-per-node 8 -m gpumemd run train.py`` (torchrun
  runs ``python -u -m gpumemd run train.py``); torchrun's RANK/LOCAL_RANK/WORLD_SIZE give the rank.
- Slurm: ``srun --ntasks-per-node 8 gpumemd run train.py``; SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import io
import os
import runpy
import sys
import types
from collections.abc import Sequence
from typing import Any

import gpumemd
from gpumemd.cli.errors import CliError
from gpumemd.components.hook_printing import print_hook_failure
from gpumemd.config import Config, ConfigError, field_docs, field_types
from gpumemd.config_renamed import RENAMED
from gpumemd.doctor.config_checks import option_name, parse_override
from gpumemd.log_once import log_once
from gpumemd.records.step import exit_ending
from gpumemd.signal_endings import uncaught_ending

# Options of ``gpumemd run`` itself that are not Config fields (names must never collide).
_OWN_DESTS = frozenset({"target", "module", "func", "command"})


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run a Python script (or -m module) with the agent attached",
        description=(
            "Run SCRIPT as __main__ with the gpumemd agent attached, exactly as `python SCRIPT ARGS` "
            "would (argv, exit code, tracebacks). Options go before the script; GPUMEMD_* environment "
            "variables set the same options. Under torchrun: `torchrun --no-python gpumemd run train.py` "
            "or `torchrun -m gpumemd run train.py`; under Slurm: `srun gpumemd run train.py`."
        ),
        usage="gpumemd run [options] (script.py | -m module) [args...]",
        # No abbreviations: argparse matches every argument, the script's own too, against our option
        # names, and a script's `--leak` (the start of several of ours) was refused as ambiguous.
        allow_abbrev=False,
    )
    add_config_options(p)
    p.add_argument(
        "-m",
        dest="module",
        nargs=argparse.REMAINDER,
        metavar="MODULE [ARGS]",
        help="run a library module as a script, like `python -m` (must be the last gpumemd option)",
    )
    p.add_argument("target", nargs=argparse.REMAINDER, metavar="script.py [args...]",
                   help="the script and its own arguments")
    p.set_defaults(func=run)


def unknown_options(extra: Sequence[str]) -> str:
    """The one line for options ``gpumemd run`` does not have, each with its close matches
    (``--prot`` -> did you mean ``--port``?)."""
    import difflib

    known = [option_name(field) for field in field_types()] + ["-m", "--help"]
    named = [arg.split("=", 1)[0] for arg in extra if arg.startswith("-")] or list(extra)
    parts = []
    for name in named:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        parts.append(f"{name} (did you mean {' or '.join(close)}?)" if close else name)
    return (f"unrecognized option{'s' if len(parts) > 1 else ''}: {', '.join(parts)}; options go before the "
            "script (gpumemd run --help lists them)")


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """One option per Config field; values stay text (None = not given) and are parsed in ``run``."""
    defaults = Config()
    group = parser.add_argument_group("agent options (also GPUMEMD_<NAME> environment variables)")
    for name, doc in field_docs().items():
        assert name not in _OWN_DESTS, f"Config field {name} collides with a `gpumemd run` option"
        default = getattr(defaults, name)
        help_text = (doc + f" (default: {default}; env GPUMEMD_{name.upper()})").replace("%", "%%")
        shown = {"action": argparse.BooleanOptionalAction} if field_types()[name] is bool else {"metavar": name.upper()}
        group.add_argument(option_name(name), dest=name, default=None, help=help_text, **shown)
    for old, new in RENAMED.items():  # the old names still work, out of --help
        action = argparse.BooleanOptionalAction if field_types()[new] is bool else "store"
        group.add_argument(option_name(old), dest=old, action=action, default=None, help=argparse.SUPPRESS)


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The Config fields given on the command line, parsed; a bad value is a CliError naming the option."""
    overrides: dict[str, Any] = {}
    given: dict[str, str] = {}  # field -> the option name typed (an old one for a renamed option)
    for name, field in [*((n, n) for n in field_docs()), *RENAMED.items()]:
        raw = getattr(args, name, None)
        if raw is None:
            continue
        if name != field:
            log_once(f"--{name}", "gpumemd: %s is deprecated; use %s (same meaning)",
                     _typed(name, raw), _typed(field, raw))
            if field in overrides:
                continue  # the option under its name now wins
        overrides[field] = _parse_option(name, field, raw)
        given[field] = name
    try:
        Config.from_sources(os.environ, **overrides)  # validate here, so errors name the option
    except ConfigError as err:
        if err.field in overrides:
            raise CliError(err.render(f"{option_name(given[err.field])}={{value}}")) from None
        raise  # from a GPUMEMD_* variable: the message already names it
    return overrides


def _parse_option(name: str, field: str, raw: str | bool) -> Any:
    """One option's value for Config ``field``, given as ``--name``; a bad one is a CliError naming it."""
    if isinstance(raw, bool):
        return raw
    try:
        return parse_override(field, raw)  # `--port ''` unsets a GPUMEMD_PORT from the environment
    except ConfigError as err:
        raise CliError(f"{option_name(name)}={raw!r} is not valid: expected {err.accepted}") from None


def _typed(name: str, raw: str | bool) -> str:
    """The option as typed: ``--phases``, ``--no-phases``, ``--history-steps``."""
    return option_name(("no_" if raw is False else "") + name)


def run(args: argparse.Namespace) -> int:
    overrides = config_overrides(args)
    command = list(args.target or [])
    if command and command[0] == "--":
        command = command[1:]
    if args.module is not None:
        if not args.module:
            raise CliError("-m needs a module name, e.g. `gpumemd run -m mypkg.train --epochs 3`")
        target, script_args, is_module = args.module[0], args.module[1:], True
        _check_module(target)
    elif command:
        target, script_args, is_module = command[0], command[1:], False
        _check_script(target)
    else:
        raise CliError("nothing to run: give a script (`gpumemd run train.py --lr 3e-4`) or -m module")

    agent = gpumemd.attach(**overrides)  # ValueError from a GPUMEMD_* variable: one line, exit 2 (cli.main)
    ending = "exit"
    try:
        code, ending = _execute(target, script_args, is_module)
        return code
    finally:
        agent.stop(ending)  # how the script ended, which atexit cannot learn here (records.step.ending_words)
        gpumemd.detach()


def _check_script(target: str) -> None:
    """What python accepts: a file, or a directory (or zip) with ``__main__.py``; one line otherwise."""
    if os.path.isdir(target):
        if not os.path.isfile(os.path.join(target, "__main__.py")):
            raise CliError(f"{target!r} is a directory with no __main__.py: give the path of a Python script "
                           "(or of a directory or zip with __main__.py)")
    elif not os.path.exists(target):
        raise CliError(f"can't open file {target!r}: no such file (give the path of a Python script)")


def _check_module(name: str) -> None:
    """``-m name`` must be importable from here (as ``python -m`` resolves it: the working directory
    first); one line and exit 2 otherwise, not a traceback through gpumemd."""
    saved = sys.path[0] if sys.path else None
    _set_path0(os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:  # a missing parent package, or an empty/relative name
        raise CliError(f"no module named {name!r} ({exc}); check the name and the working directory") from None
    finally:
        if saved is not None:
            _set_path0(saved)
    if spec is None:
        raise CliError(f"no module named {name!r}; check the name and the working directory "
                       f"({os.getcwd()} is searched first, as with python -m)")


def _run_script(target: str) -> None:
    """Run a script file as ``__main__`` the way ``python target`` does: an absolute ``__file__`` (a
    script that chdirs and then reads next to ``__file__`` must work the same) and ``sys.argv[0]`` as
    typed (``runpy.run_path`` would make it absolute). A directory or zip with a ``__main__.py``, or
    a compiled file, goes through ``runpy``."""
    path = os.path.abspath(target)
    if not os.path.isfile(path) or (not path.endswith(".py") and _is_compiled_or_zip(path)):
        runpy.run_path(path, run_name="__main__")
        return
    with io.open_code(path) as f:  # as python reads it (audit hooks see it)
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    except BaseException:
        if saved is not None:  # put back once the exception is reported (``_execute``), as python would
            _main_after_report.append(saved)
        raise
    if saved is not None:
        sys.modules["__main__"] = saved


_main_after_report: list[types.ModuleType] = []
"""The ``__main__`` to put back after the script's uncaught exception is reported: until then the
script's module stays ``__main__``, as under ``python script.py``, so its globals are the roots an OOM
report names its tensors by (``module global `__main__.x```), not a library frame's local."""


def _is_compiled_or_zip(path: str) -> bool:
    import zipfile

    with open(path, "rb") as f:
        head = f.read(4)
    return head == importlib.util.MAGIC_NUMBER or zipfile.is_zipfile(path)


def _execute(target: str, script_args: list[str], is_module: bool) -> tuple[int, str]:
    """Run the target as ``__main__`` and turn its ending into an exit code, as ``python`` does, and
    into the agent's ``ended``."""
    saved_argv, saved_path0 = sys.argv, (sys.path[0] if sys.path else None)
    try:
        sys.argv = [target, *script_args]  # for a module, run_module(alter_sys=True) puts its file in [0]
        if is_module:
            _set_path0(os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            _set_path0(os.path.dirname(os.path.abspath(target)))
            _run_script(target)
    except SystemExit as exc:
        code = _exit_code(exc.code)
        return code, exit_ending(code)
    except KeyboardInterrupt:
        _report_uncaught()
        global interrupted
        interrupted = True  # console_main ends the process by SIGINT, as python does
        return 130, "SIGINT"
    except BaseException as exc:  # noqa: BLE001 - the script's own exception: print it as python would
        _report_uncaught()
        return 1, uncaught_ending(exc)
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            _set_path0(saved_path0)
        while _main_after_report:
            sys.modules["__main__"] = _main_after_report.pop()
    return 0, exit_ending(0)


interrupted = False
"""The script ended with an uncaught KeyboardInterrupt: ``python`` then dies by SIGINT (a shell or a
launcher sees the signal, not exit 130), and so does the ``gpumemd`` command (``console_main``)."""


def _set_path0(path: str) -> None:
    if sys.path:
        sys.path[0] = path
    else:
        sys.path.insert(0, path)


def _exit_code(code: object) -> int:
    """``sys.exit(code)`` semantics: None is 0, an int is itself, anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    try:
        text = str(code)
    except Exception:  # noqa: BLE001 - python prints an empty line when str(code) fails, and exits 1
        text = ""
    print(text, file=sys.stderr)
    return 1


def _report_uncaught() -> None:
    """Hand the exception to ``sys.excepthook`` (default: the usual traceback), minus our frames."""
    exc_type, exc, tb = sys.exc_info()
    assert exc_type is not None and exc is not None
    trimmed = _user_frames(tb)
    # Python's own printing reads ``exc.__traceback__``, not the tb argument: trim it on the exception.
    try:
        sys.excepthook(exc_type, exc.with_traceback(trimmed), trimmed)
    except SystemExit:
        raise  # python exits with the hook's code
    except BaseException as err:  # noqa: BLE001 - a failing hook: python's fallback, not ours
        print_hook_failure(err, exc_type, exc, trimmed, called_handling=True)


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """Drop the leading frames of this module and runpy, so the traceback starts in the script (None
    when no frame is the script's: a SyntaxError in it, which python shows with no frames either)."""
    own = {os.path.abspath(__file__), os.path.abspath(runpy.__file__ or "runpy.py"), "<frozen runpy>"}
    first = tb
    while first is not None and _frame_file(first) in own:
        first = first.tb_next
    return first


def _frame_file(tb: types.TracebackType) -> str:
    name = tb.tb_frame.f_code.co_filename
    return name if name.startswith("<") else os.path.abspath(name)
