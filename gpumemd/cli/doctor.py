"""``gpumemd doctor [--json] [--output-dir DIR] [--port N] [--bind ADDR]``: what will work here.

One line per check (status, name, detail), then a verdict. Exit 0 when every needed check passes,
1 when one fails; 2 only for a usage error. A bad option or ``GPUMEMD_*`` value is a failed check,
not an error: saying what is wrong with the configuration is part of doctor's job.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, TextIO

from gpumemd.doctor import run_checks
from gpumemd.doctor.check import Check, failed_needed

_OPTIONS = ("output_dir", "port", "bind")  # the Config fields doctor checks against this machine


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this machine: what gpumemd can and cannot record here",
        description=(
            "Check the torch build, CUDA devices, allocator backend and settings, allocation history, NVML "
            "(and whether it sees this process, which containers can prevent), psutil, the output directory, "
            "the metrics port, the GPUMEMD_* configuration and framework versions. May initialise CUDA. "
            "Exit status: 0 when everything gpumemd needs works, 1 when a needed check fails, 2 for a usage error."
        ),
    )
    p.add_argument("--json", action="store_true", help='print {"ok": bool, "checks": [...]} instead of text')
    p.add_argument("--output-dir", dest="output_dir", default=None, metavar="DIR",
                   help="output directory to check (default: GPUMEMD_OUTPUT_DIR, else gpumemd-out)")
    p.add_argument("--port", default=None, metavar="PORT",
                   help="metrics port to check, plus LOCAL_RANK as the agent would (default: GPUMEMD_PORT, "
                        "else none; 0 picks a free port)")
    p.add_argument("--bind", default=None, metavar="ADDR",
                   help="address the metrics port is bound on (default: GPUMEMD_BIND, else 127.0.0.1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    stream = sys.stdout if out is None else out
    overrides = {name: getattr(args, name) for name in _OPTIONS if getattr(args, name) is not None}
    checks = run_checks(overrides=overrides)
    ok = not failed_needed(checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [dataclasses.asdict(c) for c in checks]}, indent=2), file=stream)
    else:
        print(render(checks), file=stream)
    return 0 if ok else 1


def render(checks: list[Check]) -> str:
    """Aligned lines, then the verdict: what failed among the needed checks, by name."""
    width = max(len(c.name) for c in checks)
    lines = [f"{c.status:<4}  {c.name:<{width}}  {c.detail}" for c in checks]
    failed = failed_needed(checks)
    warnings = sum(c.status == "warn" for c in checks)
    if failed:
        names = ", ".join(dict.fromkeys(c.name for c in failed))
        lines.append(f"{len(failed)} needed check(s) failed: {names}")
    else:
        lines.append("everything gpumemd needs works" + (f" ({warnings} warning(s) above)" if warnings else ""))
    return "\n".join(lines)
