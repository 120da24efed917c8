"""What ``gpumemd top`` shows, decided once (pure): parsed state files in, one frame model out.

A frame is a JSON-ready dict (what ``gpumemd top --json`` prints and what the terminal view lays out):
one block per rank, worst first. It says only what the state file says (``report.last_state`` writes
and validates it), in the words ``gpumemd report`` and the findings use: one story. The sparklines'
history is the one thing the files do not hold: ``History`` keeps a bounded window of it in the
``top`` process itself.
"""

from __future__ import annotations

import collections
import math
from typing import Any

from gpumemd.analysis.leak_headline import projection_words
from gpumemd.analysis.units import format_bytes
from gpumemd.report.last_state import MAX_GROUPS, at_risk, ending
from gpumemd.report.view import group_rows

HISTORY_POINTS = 240
"""Readings kept per rank and memory line: four minutes at the state file's cadence of one a second."""
_STATUS_ORDER = {"vanished": 0, "running": 1, "ended": 2}
_FINDING_ORDER = {"confirmed": 0, "suspected": 1}


class History:
    """The recent values of each rank's memory lines, one point per state file written (bounded)."""

    def __init__(self, points: int = HISTORY_POINTS) -> None:
        self._points = points
        self._series: dict[tuple[str, str], collections.deque[tuple[float, int]]] = {}

    def add(self, doc: dict[str, Any]) -> None:
        """Take in one state file as read; a file read again (same ``written_at``) adds nothing."""
        written = doc.get("written_at")
        if not isinstance(written, int | float):
            return
        for line in memory_lines(doc):
            value = line["used_bytes"]
            if not isinstance(value, int):
                continue
            series = self._series.setdefault((doc["_file"], line["where"]), collections.deque(maxlen=self._points))
            if not series or series[-1][0] < written:
                series.append((written, value))

    def values(self, file: str, where: str) -> list[int]:
        return [v for _, v in self._series.get((file, where), ())]


def memory_lines(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each device's allocated / reserved / peak against its cap or total, then the host's RSS against
    the limit that binds; ``used_bytes`` is what the bar and the sparkline show."""
    totals = {r.get("where"): r.get("total_bytes") for r in doc.get("headroom") or []}
    lines = []
    for a in doc.get("allocator") or []:
        where = f"cuda:{a.get('device')}"
        capped = isinstance(a.get("cap_bytes"), int)
        lines.append({"where": where, "used_bytes": a.get("allocated_bytes"),
                      "allocated_bytes": a.get("allocated_bytes"), "reserved_bytes": a.get("reserved_bytes"),
                      "peak_bytes": a.get("peak_bytes"),
                      "limit_bytes": a["cap_bytes"] if capped else totals.get(where),
                      "limit": "the per-process cap" if capped else "the device's total"})
    for room in doc.get("headroom") or []:
        if room.get("where") == "host":
            lines.append({"where": "host", "used_bytes": room.get("rss_bytes"), "rss_bytes": room.get("rss_bytes"),
                          "free_bytes": room.get("free_bytes"), "limit_bytes": room.get("total_bytes"),
                          "limit": room.get("limit") or "the host's RAM"})
    return lines


def finding_view(f: dict[str, Any]) -> dict[str, Any]:
    """A finding's rate and time to out-of-memory as its own line says them ("+64.0 KiB/step", "~36 s
    (~120 steps)"), and its headline."""
    slope, steps, hours = f.get("slope_bytes_per_step"), f.get("steps_to_oom"), f.get("hours_to_oom")
    return {"state": f["state"], "kind": f["kind"], "series": f["series"],
            "rate": f"+{format_bytes(slope)}/step" if isinstance(slope, int | float) else None,
            "to_oom": projection_words(steps, hours)[0] if isinstance(steps, int | float) else None,
            "steps_to_oom": steps, "said": f.get("headline") or f["summary"]}


def rank_view(doc: dict[str, Any], *, alive: bool | None, now: float, history: History) -> dict[str, Any]:
    """One rank's block: who, where it is, its memory with recent history, tensors, findings, OOMs."""
    # "ended": a clean ending recorded; "vanished": its pid is gone without one; else "running" (alive
    # here, or on another host, where top cannot tell)
    status = "ended" if doc.get("ended") else "vanished" if alive is False else "running"
    written = doc.get("written_at")
    lines = [{**line, "history": history.values(doc["_file"], line["where"])} for line in memory_lines(doc)]
    tensors = doc.get("tensors") or {}
    groups = [{"bytes": row.total, "tensors": row.tensors, "category": row.category, "held_by": row.who}
              for row in group_rows(tensors)[:MAX_GROUPS]] if tensors.get("groups") else []
    reports = doc.get("reports") or []
    return {
        "rank": doc.get("rank"), "host": doc.get("hostname"), "pid": doc.get("pid"), "status": status,
        "ending": None if status == "running" else ending(doc, alive=alive),
        "step": doc.get("step"), "steps_total": doc.get("steps_total"), "seconds_per_step": doc.get("seconds_per_step"),
        "phase": doc.get("phase"), "written_at": written,
        "age_s": round(now - written, 3) if isinstance(written, int | float) else None,
        "memory": lines, "workers": doc.get("workers"), "census_step": tensors.get("step"), "tensor_groups": groups,
        "findings": [finding_view(f) for f in doc.get("findings") or []], "findings_more": doc.get("findings_more"),
        "at_risk": at_risk(doc), "ooms_total": doc.get("ooms_total"),
        "last_oom_report": reports[-1] if reports else None, "file": doc["_file"],
    }


def _worst_first(view: dict[str, Any]) -> tuple[Any, ...]:
    """Vanished ranks first, ended ones last; among the rest a confirmed finding before a suspected one,
    the nearest out-of-memory first, then the least headroom."""
    findings = view["findings"]
    first: dict[str, Any] = findings[0] if findings else {}
    steps = first.get("steps_to_oom")
    shares = [(line["limit_bytes"] - (line["used_bytes"] or 0)) / line["limit_bytes"]
              for line in view["memory"] if isinstance(line.get("limit_bytes"), int) and line["limit_bytes"] > 0]
    return (_STATUS_ORDER[view["status"]], _FINDING_ORDER.get(str(first.get("state")), 2),
            steps if isinstance(steps, int | float) else math.inf, min(shares, default=1.0), view["rank"] or 0)


def frame(docs: list[dict[str, Any]], *, alive: dict[str, bool | None], now: float,
          history: History) -> dict[str, Any]:
    """The whole frame: ``alive`` maps each state file to whether its pid lives (None: another host)."""
    ranks = [rank_view(doc, alive=alive.get(doc["_file"]), now=now, history=history) for doc in docs]
    ranks.sort(key=_worst_first)
    counts = collections.Counter(r["status"] for r in ranks)
    return {"at": now, "ranks": ranks, **{s: counts.get(s, 0) for s in _STATUS_ORDER}}
