"""``gpumemd report DIR``: summarise one OOM report, or every rank's reports side by side.

DIR is one report directory, or a directory holding several (an output dir, every rank's). In an
output dir, each rank's last known state (``report.last_state``) is shown too. Missing,
truncated or foreign files give one line and exit code 2. ``snapshot.pickle`` is checked through the
restricted unpickler only: a report someone sends you cannot run code on your machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any, TextIO

from gpumemd.analysis.snapshot_summary import summarize_snapshot
from gpumemd.cli.errors import CliError
from gpumemd.cli.escape import escaped
from gpumemd.probes.snapshots.snapshot_load import load_snapshot
from gpumemd.probes.snapshots.snapshot_rules import SnapshotLoadError
from gpumemd.records.oom import breakdown_label
from gpumemd.report import view
from gpumemd.report.build import OUTCOME_WORDS, OUTCOMES
from gpumemd.report.fmt import fmt_bytes, fmt_time
from gpumemd.report.last_state import at_risk, ending, load_states, pid_alive, state_lines
from gpumemd.report.load import REPORT_FILE, SNAPSHOT_FILE, find_report_dirs, load_report
from gpumemd.report.markdown import headline

_SUGGESTIONS = 5
# headed by breakdown_label; "activations" (graph retained + invisible, no item of its own) reads as itself
_COLUMNS = ("parameters", "gradients", "optimizer_state", "activations", "reserved_unallocated")


def _say(out: TextIO, line: str) -> None:
    """Print one line of the summary: its values come from the files, so it is printed escaped."""
    print(escaped(line), file=out)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="summarise OOM report directories (one, or every rank's)")
    p.add_argument("dir", help="a report directory, or a directory holding several (e.g. the output dir)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
    p.set_defaults(func=run)


def _snapshot_check(directory: str) -> dict[str, Any] | None:
    path = os.path.join(directory, SNAPSHOT_FILE)
    if not os.path.exists(path):
        return None
    try:
        snapshot = load_snapshot(path)
    except SnapshotLoadError as err:
        raise CliError(f"{path}: {err}") from None
    shape = _snapshot_shape_error(snapshot)
    if shape is not None:
        raise CliError(f"{path} is not a PyTorch memory snapshot: {shape}")
    devices = summarize_snapshot(snapshot)
    return {
        "file": path,
        "devices": [
            {"device": d.cuda_index, "segments": s.segments, "reserved_bytes": s.reserved_bytes,
             "allocated_bytes": s.allocated_bytes, "largest_free_block_bytes": s.largest_free_block_bytes,
             "trace_entries": s.trace_entries}
            for d, s in sorted(devices.items(), key=lambda ds: ds[0].order)
        ],
    }


def _snapshot_shape_error(snapshot: dict[str, Any] | list[Any]) -> str | None:
    """The first top-level field of the wrong shape (the summary reads past anything deeper), or None."""
    if isinstance(snapshot, list):
        return None
    traces = snapshot.get("device_traces")
    if traces is not None and not isinstance(traces, list):
        return f"device_traces: expected a list (one per device), got {type(traces).__name__}"
    if isinstance(traces, list):
        bad = next((i for i, t in enumerate(traces) if not isinstance(t, list)), None)
        if bad is not None:
            return f"device_traces[{bad}]: expected a list of trace entries, got {type(traces[bad]).__name__}"
    bad = next((i for i, s in enumerate(snapshot["segments"]) if not isinstance(s, dict)), None)
    if bad is not None:
        return f"segments[{bad}]: expected a segment dict, got {type(snapshot['segments'][bad]).__name__}"
    return None


def _item(report: dict[str, Any], key: str) -> int | None:
    items = report["breakdown"].get("items") or []
    if key == "activations":
        nbytes = {i.get("key"): i.get("nbytes", 0) for i in items}
        return int(nbytes.get("graph_retained", 0) or 0) + int(nbytes.get("invisible", 0) or 0)
    return next((int(i.get("nbytes", 0)) for i in items if i.get("key") == key), None)


def _say_columns(out: TextIO, rows: list[list[str]], right: tuple[int, ...] = (), indent: str = "") -> None:
    """Rows of cells as aligned lines (columns in ``right`` right-aligned), two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))] if rows else []
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        _say(out, indent + "  ".join(cells).rstrip())


def _print_groups(report: dict[str, Any], out: TextIO) -> None:
    tensors = report.get("tensors") or {}
    if not tensors.get("available"):
        _say(out, f"tensors: {tensors.get('note')}")
        return
    rows = view.group_rows(tensors, view.leak_of(report))
    when = f"; {view.census_when(tensors)}" if tensors.get("note") else ""  # an earlier census: say so
    _say(out, f"largest tensor groups ({view.census_summary(tensors, rows)}{when}):")
    columns = view.group_columns(rows)
    _say_columns(out, [view.group_cells(r, columns) for r in rows[:view.GROUPS_SHOWN]], right=(0,), indent="  ")


def _print_breakdown(report: dict[str, Any], out: TextIO) -> None:
    b = report["breakdown"]
    _say(out, f"breakdown of {b.get('device')} (total {fmt_bytes(b.get('total_bytes') or None)}, peak seen "
              f"{fmt_bytes(report.get('peak_bytes'))}):")
    if isinstance(b.get("cap_bytes"), int) or b.get("host_limit") not in (None, "ram"):  # the total is a cap or limit
        _say(out, f"  {view.total_words(b)}")
    _say_columns(out, view.breakdown_rows(b), right=(1, 2), indent="  ")


def _print_one(report: dict[str, Any], snap: dict[str, Any] | None, out: TextIO) -> None:
    b = report["breakdown"]
    _say(out, f"gpumemd OOM report: {report['_dir']}")
    _say(out, headline(report))
    # whether the job caught it or died of it (a report written before it said so: from its source)
    outcome = report.get("outcome") or OUTCOMES.get(str(report.get("source")))
    _say(out, f"written {fmt_time(report.get('created_at'))} via {report.get('source')}"
              + (f" · outcome: {outcome}" if outcome else ""))
    why, *also = view.verdict_lines(report)
    _say(out, f"verdict: {b.get('verdict')}: {why}")
    for line in also:
        _say(out, line)
    _print_groups(report, out)
    suggestions = report.get("suggestions") or []
    _say(out, "suggestions:" if suggestions else "suggestions: none")
    for n, s in enumerate(suggestions[:_SUGGESTIONS], 1):
        _say(out, f"  {n}. {s['title']} (saves ~{fmt_bytes(s.get('saving_bytes'))}): {s['why']}")
    _print_breakdown(report, out)
    for f in report.get("findings") or []:
        _say(out, f"finding: {f['state']} {f['kind']} on {f['series']}: {f['summary']}")
    if snap is not None:
        for d in snap["devices"]:
            _say(out, f"snapshot: {snap['file']} device {d['device']}: {d['segments']} segments, reserved "
                  f"{fmt_bytes(d['reserved_bytes'])}, largest free block {fmt_bytes(d['largest_free_block_bytes'])}, "
                  f"{d['trace_entries']} trace entries")


def _leak_cell(report: dict[str, Any]) -> str | None:
    """"`kept` 1.50 GiB": the leak active at this rank's OOM, or None."""
    leak = view.leak_of(report)
    return None if leak is None else f"{leak.get('holder')} {fmt_bytes(leak.get('held_bytes'))}"


def _overview(reports: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(reports, key=lambda r: (r.get("created_at") or 0, r.get("rank") or 0))
    first = ordered[0]
    return {
        "first": {"rank": first.get("rank"), "step": first.get("step"), "created_at": first.get("created_at"),
                  "dir": first["_dir"]},
        "ranks": sorted({r.get("rank") for r in reports if isinstance(r.get("rank"), int)}),
        "reports": [
            {"dir": r["_dir"], "rank": r.get("rank"), "step": r.get("step"), "created_at": r.get("created_at"),
             "device": r["breakdown"].get("device"), "verdict": r["breakdown"].get("verdict"),
             "requested_bytes": r["breakdown"].get("requested_bytes"), "peak_bytes": r.get("peak_bytes"),
             "breakdown": {k: _item(r, k) for k in _COLUMNS}, "leak": _leak_cell(r),
             "outcome": OUTCOME_WORDS.get(str(r.get("source")), r.get("source"))}
            for r in sorted(reports, key=lambda r: (r.get("rank") or 0, r.get("created_at") or 0))
        ],
    }


def _print_overview(overview: dict[str, Any], out: TextIO) -> None:
    first = overview["first"]
    _say(out, f"{len(overview['reports'])} OOM reports from {len(overview['ranks'])} rank(s); rank {first['rank']} "
              f"failed first (step {first['step']}, {fmt_time(first['created_at'])})")
    head = ["rank", "step", "time", "outcome", "device", "requested", "peak", *(breakdown_label(k) for k in _COLUMNS),
            "verdict", "leak"]
    rows = [[str(r["rank"]), str(r["step"]), fmt_time(r["created_at"])[11:], str(r["outcome"]), str(r["device"]),
             fmt_bytes(r["requested_bytes"]), fmt_bytes(r["peak_bytes"]),
             *(fmt_bytes(r["breakdown"][k]) for k in _COLUMNS), str(r["verdict"]), r.get("leak") or "-"]
            for r in overview["reports"]]
    _say_columns(out, [head, *rows])


def _state_views(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each state file as read, with what the report concludes: how it ended, and whether it vanished."""
    host = socket.gethostname()
    return [{**doc, "ending": ending(doc, alive=alive), "vanished": not doc.get("ended") and alive is False,
             "at_risk": at_risk(doc)} for doc in states for alive in [pid_alive(doc, host)]]


def _print_states(states: list[dict[str, Any]], earlier: list[str], out: TextIO) -> None:
    host = socket.gethostname()
    for n, doc in enumerate(states):
        if n:
            print(file=out)
        for line in state_lines(doc, alive=pid_alive(doc, host)):
            _say(out, line)
    if earlier:
        print(file=out)
        _say(out, _earlier_line(earlier))


def _this_run(reports: list[dict[str, Any]], states: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The reports of the run whose state files are here, and the directories of those written before it
    attached: jobs run again in one output dir (the default ./gpumemd-out) left last week's OOM
    report printed under this run's state as if this run had run out of memory."""
    attached = [doc["attached_at"] for doc in states if isinstance(doc.get("attached_at"), int | float)]
    if not attached:
        return reports, []
    since = min(attached)
    this: list[dict[str, Any]] = []
    older: list[dict[str, Any]] = []
    for r in reports:
        (older if isinstance(r.get("created_at"), int | float) and r["created_at"] < since else this).append(r)
    return this, [r["_dir"] for r in sorted(older, key=lambda r: r["created_at"])]


def _earlier_line(earlier: list[str]) -> str:
    """"2 OOM reports of earlier runs here (before this run attached), not shown: gpumemd report <dir>
    reads the newest" (``earlier``: their directories, oldest first)."""
    runs = "an earlier run" if len(earlier) == 1 else "earlier runs"
    what = "1 OOM report" if len(earlier) == 1 else f"{len(earlier)} OOM reports"
    return f"{what} of {runs} here (before this run attached), not shown: gpumemd report {earlier[-1]} reads the newest"


def _root(given: str) -> str:
    """The directory to read: ``given``, or the directory of a ``report.json`` given itself."""
    root = given
    if os.path.isfile(root):
        if os.path.basename(root) != REPORT_FILE:
            raise CliError(f"{root} is a file: pass a report directory (the folder holding {REPORT_FILE}) "
                           "or the output dir")
        root = os.path.dirname(root) or "."  # report.json itself: read its directory
    if not os.path.isdir(root):
        raise CliError(f"{root} does not exist: pass a report directory or the output dir")
    return root


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    root = _root(args.dir)
    dirs = find_report_dirs(root)
    states = load_states(root)  # a malformed file (or report below) is a ValueError: one line, exit 2 (cli.main)
    if not dirs and not states:
        raise CliError(f"no gpumemd report in {root} (expected report.json, report directories inside, or the "
                       "gpumemd-state-rank<R>.json an agent keeps in its output dir)")
    reports, earlier = _this_run([load_report(d) for d in dirs], states)
    if states and not args.json:
        _print_states(states, earlier, out)
        if reports:
            print(file=out)
    if not reports:  # then there are states
        if args.json:
            print(json.dumps({"last_state": _state_views(states), "earlier_reports": earlier}, indent=1), file=out)
        return 0
    if len(reports) == 1:
        report = reports[0]
        snap = _snapshot_check(report["_dir"])
        if args.json:
            extra = {"last_state": _state_views(states), "earlier_reports": earlier} if states else {}
            print(json.dumps({**report, "snapshot_check": snap, **extra}, indent=1), file=out)  # ASCII: escapes it all
        else:
            _print_one(report, snap, out)
        return 0
    for report in reports:
        _snapshot_check(report["_dir"])  # a tampered snapshot anywhere is worth a refusal
    overview = _overview(reports)
    if states:
        overview["last_state"], overview["earlier_reports"] = _state_views(states), earlier
    if args.json:
        print(json.dumps(overview, indent=1), file=out)
    else:
        _print_overview(overview, out)
    return 0
