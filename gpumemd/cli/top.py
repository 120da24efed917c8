"""``gpumemd top [DIR ...]``: a live view of every rank writing to the given output directories.

It reads the state files the agents keep there (``gpumemd-state-rank<R>.json``, ``report.last_state``)
and nothing else: it never signals, attaches to or slows a job (a ``kill(pid, 0)`` tells a live pid
from a gone one). ``report.top_frame`` turns the files into a frame; this module lays it out: in place with
the standard library's curses (``q`` quits, a resize redraws), or once as text or JSON (``--once``,
``--json``) for scripts. Every string from a file is printed escaped (``cli.escape``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from typing import Any, TextIO

from gpumemd.cli.errors import CliError
from gpumemd.cli.escape import escaped
from gpumemd.report.fmt import fmt_bytes
from gpumemd.report.last_state import load_states, pid_alive
from gpumemd.report.top_frame import History, frame

BAR = 20
SPARK = "▁▂▃▄▅▆▇█"
ANSI = {"bad": "\033[1;31m", "warn": "\033[33m", "dim": "\033[2m", "head": "\033[1m"}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("top", help="watch a running job's memory, rank by rank, worst first",
                       description="Watch every rank writing to the output directories DIR (default "
                                   "./gpumemd-out): memory against its limit, the largest tensor groups, leak "
                                   "findings with their time to out-of-memory, OOM reports; q quits.")
    p.add_argument("dirs", metavar="DIR", nargs="*", default=["gpumemd-out"], help="a job's output directory")
    p.add_argument("--once", action="store_true", help="print one frame as text and exit")
    p.add_argument("--json", action="store_true", help="print one frame as JSON and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.set_defaults(func=run)


def read_frame(dirs: list[str], history: History) -> dict[str, Any]:
    """Read every state file in ``dirs`` now, feed the sparklines' history, and build the frame."""
    docs = [doc for d in dirs for doc in load_states(d)]  # a malformed file: StateLoadError, one line (cli.main)
    host = socket.gethostname()
    for doc in docs:
        history.add(doc)
    return frame(docs, alive={d["_file"]: pid_alive(d, host) for d in docs}, now=time.time(), history=history)


def _bar(used: Any, limit: Any) -> str:
    if not isinstance(used, int) or not isinstance(limit, int) or limit <= 0:
        return ""
    full = min(BAR, round(BAR * used / limit))
    return f"[{'#' * full}{'-' * (BAR - full)}] {100 * used / limit:.0f}%"


def sparkline(values: list[int], width: int) -> str:
    """The last ``width`` values, each as one of eight heights between their least and their most."""
    values = values[-width:] if width > 0 else []
    if len(values) < 2:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1
    return "".join(SPARK[(v - low) * (len(SPARK) - 1) // span] for v in values)


def _step_time(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return ""
    return f"  {seconds * 1000:.1f} ms/step" if seconds < 1 else f"  {seconds:.2f} s/step"


def _memory(line: dict[str, Any], width: int) -> str:
    if line["where"] == "host":
        text = f"  host    RSS {fmt_bytes(line['rss_bytes'])}"
    else:
        text = (f"  {line['where']:<7} allocated {fmt_bytes(line['allocated_bytes'])}  reserved "
                f"{fmt_bytes(line['reserved_bytes'])}  peak {fmt_bytes(line['peak_bytes'])}")
    limit = line["limit_bytes"]
    if isinstance(limit, int):  # else unknown: no NVML for the device's total
        text += f" of {fmt_bytes(limit)} ({line['limit']})  {_bar(line['used_bytes'], limit)}"
    return f"{text}  {sparkline(line['history'], width - len(text) - 3)}".rstrip()


def rank_lines(r: dict[str, Any], width: int) -> list[tuple[str, str]]:
    """One rank's block as (text, colour tag) lines."""
    tag = {"vanished": "bad", "ended": "dim"}.get(r["status"], "head")
    step = f"step {r['step']:,}" if isinstance(r["step"], int) else "before its first step"
    age = f"  written {r['age_s']:.0f} s ago" if isinstance(r["age_s"], int | float) else ""
    lines = [(f"rank {r['rank']}  {r['status'].upper()}  {r['host']} pid {r['pid']}  {step}"
              f"{_step_time(r['seconds_per_step'])}  phase {r['phase']}{age}", tag)]
    if r["ending"]:
        lines.append((f"  {r['ending']}", tag))
    lines += [(_memory(line, width), "") for line in r["memory"]]
    workers = r["workers"] or {}
    if workers.get("count"):
        # every child of the job (DataLoader workers, and a `sleep` it started as well): not named as workers
        count = workers["count"]
        lines.append((f"  workers {count} child process{'es' if count != 1 else ''}, RSS "
                      f"{fmt_bytes(workers.get('rss_bytes'))}", ""))
    elif r["workers"]:
        lines.append(("  workers none (no child processes)", ""))
    if r["tensor_groups"]:
        lines.append((f"  largest tensor groups (census at step {r['census_step']}):", ""))
    lines += [(f"    {fmt_bytes(g['bytes']):>11}  {g['tensors']}  {g['category']}"
               + (f"  held by {g['held_by']}" if g["held_by"] != "-" else ""), "") for g in r["tensor_groups"]]
    for f in r["findings"]:
        oom = f" · out of memory in {f['to_oom']}" if f["to_oom"] else ""
        tag = "bad" if f["state"] == "confirmed" else "warn"
        lines += [(f"  finding {f['state']} {f['kind']} {f['rate'] or '?'}{oom}", tag),
                  (f"    {f['said']}", "")]
    if r["findings_more"]:
        lines.append((f"  and {r['findings_more']} more findings", ""))
    if r["last_oom_report"]:
        lines.append((f"  OOM     {r['ooms_total']} so far; last report: {r['last_oom_report']}", "bad"))
    return lines


def frame_lines(view: dict[str, Any], width: int, *, live: bool = False) -> list[tuple[str, str]]:
    head = (f"gpumemd top  {len(view['ranks'])} rank(s): {view['running']} running, {view['vanished']} vanished, "
            f"{view['ended']} ended  {time.strftime('%H:%M:%S', time.localtime(view['at']))}"
            + ("  (q quits)" if live else ""))
    lines = [(head, "head")]
    for r in view["ranks"]:
        lines += [("", ""), *rank_lines(r, width)]
    return lines


def print_once(view: dict[str, Any], out: TextIO) -> None:
    colour = out.isatty() and not os.environ.get("NO_COLOR")  # https://no-color.org: set and not empty
    for text, tag in frame_lines(view, 120):
        safe = escaped(text)
        print(f"{ANSI[tag]}{safe}\033[0m" if colour and tag else safe, file=out)


def _live(dirs: list[str], interval: float) -> int:
    try:
        import curses
    except ImportError:
        raise CliError("the live view needs Python's curses module, which this Python lacks (on Windows: "
                       "pip install windows-curses); --once and --json work without it") from None
    history = History()
    for name in ("COLUMNS", "LINES"):  # curses would take a stale size from them over the terminal's, resizes too
        os.environ.pop(name, None)

    def loop(screen: Any) -> int:
        colours = _curses_colours(curses)
        screen.timeout(max(50, round(interval * 1000)))  # getch waits this long for a key: the refresh
        while True:
            view = read_frame(dirs, history)
            height, width = screen.getmaxyx()
            screen.erase()
            for y, (text, tag) in enumerate(frame_lines(view, width, live=True)[:height]):
                with contextlib.suppress(curses.error):  # the window shrank while drawing: the next frame fits
                    screen.addnstr(y, 0, escaped(text), max(0, width - 1), colours.get(tag, 0))
            screen.refresh()
            key = screen.getch()
            if key in (ord("q"), ord("Q")):
                return 0

    return int(curses.wrapper(loop))


def _curses_colours(curses: Any) -> dict[str, int]:
    """Colour pairs by tag, unless the terminal has none or ``NO_COLOR`` is set (bold and dim stay)."""
    attrs = {"head": curses.A_BOLD, "dim": curses.A_DIM, "bad": curses.A_BOLD, "warn": 0}
    if os.environ.get("NO_COLOR") or not curses.has_colors():
        return attrs
    curses.use_default_colors()
    curses.init_pair(1, curses.COLOR_RED, -1)
    curses.init_pair(2, curses.COLOR_YELLOW, -1)
    return {**attrs, "bad": curses.color_pair(1) | curses.A_BOLD, "warn": curses.color_pair(2)}


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if not 0.05 <= args.interval <= 3600:
        raise CliError(f"--interval={args.interval} is not valid: expected seconds between 0.05 and 3600")
    for d in args.dirs:
        if not os.path.isdir(d):
            raise CliError(f"{d} is not a directory: pass a job's output directory (GPUMEMD_OUTPUT_DIR, "
                           "default ./gpumemd-out)")
    view = read_frame(args.dirs, History())
    if not view["ranks"]:
        raise CliError(f"nothing to watch: no gpumemd-state-rank<R>.json in {', '.join(args.dirs)} (is a job with "
                       "gpumemd attached writing there?)")
    if args.json:
        print(json.dumps(view, indent=1), file=out)  # ASCII: json escapes every control character
        return 0
    if args.once:
        print_once(view, out)
        return 0
    if not (sys.stdin.isatty() and out.isatty()):
        raise CliError("the live view needs a terminal: use --once or --json in scripts and pipes")
    return _live(args.dirs, args.interval)
