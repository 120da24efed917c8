"""The last known state, as a small JSON file beside the findings: what a SIGKILL leaves behind.

A process the kernel's OOM killer (or ``kill -9``, or a cgroup limit) ends runs no handler: nothing
it knew reaches a report unless it was already on disk. The agent keeps ``gpumemd-state-rank<R>.json``
in the output directory, replaced whole (temp file + rename) as the job runs: step, memory (allocator,
headroom, host RSS, DataLoader workers), the last census's largest groups, the newest findings, the OOM
reports, and ``ended`` once it ended cleanly. ``gpumemd report`` on the output directory reads it back:
a file with no ``ended`` from a process that is gone says the job vanished, and what it was doing then;
``gpumemd top`` reads it live.

Bounded: at most ``MAX_FINDINGS`` findings and ``MAX_GROUPS`` groups, each sentence cut at ``MAX_TEXT``
characters, the last ``MAX_REPORTS`` report paths; a few KiB whatever the job. Pure apart from
``load_states`` (reads files).
"""

from __future__ import annotations

import glob
import heapq
import json
import os
import re
from typing import TYPE_CHECKING, Any

from gpumemd.analysis.leak_headline import projection_words
from gpumemd.announce import caught_text, fix_words
from gpumemd.records.device import cuda_index
from gpumemd.records.findings import live_worst_first
from gpumemd.records.plain import plain
from gpumemd.records.step import ending_words
from gpumemd.report.fmt import fmt_bytes, fmt_time
from gpumemd.report.schema import STATE_SCHEMA, schema_errors

if TYPE_CHECKING:
    from gpumemd.records.findings import Finding
    from gpumemd.records.step import AgentState

SCHEMA = 1
MAX_FINDINGS = 8
MAX_TEXT = 600
MAX_REPORTS = 5
MAX_GROUPS = 3  # the census's largest tensor groups, with their holders (``gpumemd top`` shows them)
MAX_FILE_BYTES = 4 * 2**20  # the writer's files are a few KiB
NEAR_OOM_SHARE = 0.05
"""Headroom under this share of a device's (or the host's) memory is "near out of memory": the same
threshold as the ``GpumemdVanishedWhileAtRisk`` alert's."""

_NAME = re.compile(r"gpumemd-state-rank(\d+)\.json$")


def state_file(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, f"gpumemd-state-rank{rank}.json")


def state_document(state: AgentState, *, written_at: float, seconds_per_step: float | None) -> dict[str, Any]:
    """What the file holds for ``state``: small, bounded, JSON-ready."""
    ident, workers = state.identity, state.workers
    live = live_worst_first(state.findings)
    return {
        "schema": SCHEMA, "pid": ident.pid or os.getpid(), "rank": ident.rank, "world_size": ident.world_size,
        "hostname": ident.hostname, "attached_at": state.attached_at, "written_at": written_at,
        "step": state.step, "steps_total": state.steps_total, "phase": state.phase,
        "seconds_per_step": seconds_per_step, "headroom": headroom(state),
        "findings": [_finding(f) for f in live[:MAX_FINDINGS]], "findings_more": max(0, len(live) - MAX_FINDINGS),
        "findings_cleared": sum(1 for f in state.findings if f.state == "cleared"),
        "ooms_total": state.ooms_total, "reports": list(state.reports[-MAX_REPORTS:]),
        "ooms_caught": state.ooms_caught, "oom_caught_steps": list(state.oom_caught_steps),
        "ended": state.ended, "ended_at": state.ended_at, "run": state.run,
        "allocator": [{"device": cuda_index(a.device), "allocated_bytes": a.allocated_bytes,
                       "reserved_bytes": a.reserved_bytes, "peak_bytes": a.allocated_peak_bytes,
                       "cap_bytes": a.cap_bytes} for a in state.allocator],
        "workers": None if workers is None else {"count": len(workers.workers), "rss_bytes": workers.rss_bytes},
        "tensors": _tensors(state),
    }


_last_tensors: list[Any] = [None, None]  # the last census and its part: a census lasts many writes


def _tensors(state: AgentState) -> dict[str, Any] | None:
    """The last census's largest groups with their holders, as report.json's ``tensors.groups`` says them."""
    census = state.census
    if census is None:
        return None
    if _last_tensors[0] is census:
        return _last_tensors[1]
    groups = heapq.nlargest(MAX_GROUPS, census.groups, key=lambda g: g.nbytes + g.graph_bytes)
    part = {"step": census.step, "tensor_count": census.tensor_count, "total_bytes": census.total_bytes,
            "groups": [{**plain(g.key), "count": g.count, "nbytes": g.nbytes, "graph_bytes": g.graph_bytes,
                        "holder": (g.holder or "")[:MAX_TEXT] or None} for g in groups]}
    _last_tensors[:] = [census, part]
    return part


def headroom(state: AgentState) -> list[dict[str, Any]]:
    """Free memory where the job allocates: each CUDA device (NVML's free) and the host (available)."""
    out: list[dict[str, Any]] = [{"where": f"cuda:{cuda_index(s.device)}", "free_bytes": s.free_bytes,
                                  "total_bytes": s.total_bytes} for s in state.nvml]
    host = state.host
    if host is not None and host.available_bytes is not None:
        out.append({"where": "host", "free_bytes": host.available_bytes, "total_bytes": host.total_bytes,
                    "rss_bytes": host.rss_bytes, "limit": host.limit_words})
    return out


def _finding(f: Finding) -> dict[str, Any]:
    return {"state": f.state, "kind": f.kind, "series": f.series, "device": cuda_index(f.device),
            "slope_bytes_per_step": f.slope_bytes_per_step, "growth_bytes": f.growth_bytes,
            "steps_to_oom": f.steps_to_oom, "hours_to_oom": f.hours_to_oom, "updated_step": f.updated_step,
            "added_at": f.added_at, "headline": (f.headline or "")[:MAX_TEXT], "summary": f.summary[:MAX_TEXT],
            "fix": fix_words(f)}


def at_risk(doc: dict[str, Any]) -> str | None:
    """Why the job was at risk when last written (a live leak finding, or headroom under 5%), or None."""
    findings = doc.get("findings") or []
    if findings:
        return f"{findings[0]['state']} {findings[0]['kind']}"
    for room in doc.get("headroom") or []:
        free, total = room.get("free_bytes"), room.get("total_bytes")
        if isinstance(free, int) and isinstance(total, int) and total > 0 and free < NEAR_OOM_SHARE * total:
            return f"near out of memory on {room['where']} ({fmt_bytes(free)} free of {fmt_bytes(total)})"
    return None


class StateLoadError(ValueError):
    pass


def load_states(root: str) -> list[dict[str, Any]]:
    """The state files directly in ``root``, by rank; a foreign, cut or malformed file is a
    ``StateLoadError`` naming the file and the field (the file is outside input: a report someone sent)."""
    docs = [_load_state(path) for path in sorted(glob.glob(os.path.join(glob.escape(root), "gpumemd-state-rank*.json")))
            if _NAME.search(path)]
    return sorted(docs, key=lambda d: (d.get("rank") or 0))


def _load_state(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_FILE_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        raise StateLoadError(f"{path}: not a readable gpumemd state file ({exc})") from None
    if len(text) > MAX_FILE_BYTES:
        raise StateLoadError(f"{path}: larger than {MAX_FILE_BYTES // 2**20} MiB, not a state file gpumemd wrote")
    try:
        doc = json.loads(text)
    except ValueError as exc:  # not JSON, or an integer of more digits than Python converts
        raise StateLoadError(f"{path}: not a readable gpumemd state file ({exc})") from None
    except RecursionError:
        raise StateLoadError(f"{path}: nested too deeply, not a state file gpumemd wrote") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise StateLoadError(f"{path}: not a gpumemd state file of schema {SCHEMA}")
    error = schema_errors(doc, STATE_SCHEMA)
    if error is not None:
        raise StateLoadError(f"{path} is malformed: {error}")
    return {**doc, "_file": path}


def ending(doc: dict[str, Any], *, alive: bool | None) -> str:
    """How the process ended, in words: cleanly (and how), still running, or vanished."""
    if doc.get("ended"):
        return f"{ending_words(doc['ended'])} at {fmt_time(doc.get('ended_at'))}"
    if alive:
        return "still running (its pid is alive on this host)"
    why = "killed by SIGKILL, the OOM killer, or a crash of the interpreter"
    if alive is None:
        return f"no clean exit recorded: vanished ({why}), or still running on {doc.get('hostname') or 'its host'}"
    return f"VANISHED: no clean exit recorded ({why})"


def _at_step(step: Any) -> str:
    return "before the first step ended" if step is None else f"at step {step}"


def state_lines(doc: dict[str, Any], *, alive: bool | None) -> list[str]:
    """The text ``gpumemd report`` prints for one state file."""
    who = f"rank {doc.get('rank')} (pid {doc.get('pid')}" + (f" on {doc['hostname']}" if doc.get("hostname") else "")
    lines = [f"last known state of {who}): {doc['_file']}",
             f"  {ending(doc, alive=alive)}",
             f"  last written {fmt_time(doc.get('written_at'))} {_at_step(doc.get('step'))} "
             f"({doc.get('steps_total')} steps since attach, phase {doc.get('phase')})"]
    risk = at_risk(doc)
    if risk and not doc.get("ended"):
        lines.append(f"  at risk when last seen: {risk}")
    lines += [f"  headroom {room['where']}: {fmt_bytes(room.get('free_bytes'))} free of "
              f"{fmt_bytes(room.get('total_bytes'))}" for room in doc.get("headroom") or []]
    for f in doc.get("findings") or []:
        steps, hours = f.get("steps_to_oom"), f.get("hours_to_oom")
        to_oom = projection_words(steps, hours if isinstance(hours, int | float) else None)[0] \
            if isinstance(steps, int | float) else None  # the words the finding's line and the exit line use
        to_oom = f" · out of memory in {to_oom}" if to_oom else ""
        said = f.get("headline") or f["summary"]
        lines.append(f"  finding: {f['state']} {f['kind']} on {f['series']}{to_oom}: {said}")
        if f.get("fix"):  # the exit line's advice, which pointed here: a person reading after a kill never saw it
            lines.append(f"    fix: {f['fix']}")
    if doc.get("findings_more"):
        run = f", the lines of run {doc['run']}" if isinstance(doc.get("run"), str) else ""
        lines.append(f"  and {doc['findings_more']} more findings (leak-findings-rank{doc.get('rank')}.jsonl{run})")
    if not doc.get("findings"):
        cleared = doc.get("findings_cleared")  # the exit line's "N growths cleared": said after a kill too
        where = f"{'its' if cleared == 1 else 'their'} lines are in leak-findings-rank{doc.get('rank')}.jsonl"
        lines.append("  no live leak finding" + (f" ({cleared} cleared: {where})" if cleared else ""))
    if isinstance(doc.get("ooms_caught"), int) and doc["ooms_caught"] > 0:
        steps = [s for s in doc.get("oom_caught_steps") or [] if isinstance(s, int)]
        lines.append(f"  {caught_text(doc['ooms_caught'], steps)}")
    return lines + [f"  OOM report: {path}" for path in doc.get("reports") or []]


def pid_alive(doc: dict[str, Any], hostname: str) -> bool | None:
    """Whether the process that wrote ``doc`` still runs: None when it ran on another host (cannot tell)."""
    if doc.get("hostname") and doc["hostname"] != hostname:
        return None
    pid = doc.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid of this host is that large
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True
