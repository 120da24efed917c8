"""What the human renderings (report.md, report.html, ``gpumemd report``) show, decided once (pure).

The renderers only lay these out: the verdict sentences, the ranked tensor groups (one row per
group, whatever the report's age), the breakdown words, the timeline columns that hold data, and
the table of contents. Everything reads the report dict (report.json), so old reports render too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpumemd.records.device import Device
from gpumemd.records.oom import breakdown_label
from gpumemd.records.samples import HOST_LIMIT_WORDS
from gpumemd.report.fmt import fmt_bytes

GROUPS_SHOWN = 10  # tensor groups on the first screen; report.json keeps up to build.TOP_GROUPS


def sentence(text: Any) -> str:
    """``text`` as a sentence ending in a full stop ("-" when absent)."""
    if not isinstance(text, str) or not text.strip():
        return "-"
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else text + "."


# --- the verdict ---------------------------------------------------------------------------------


def leak_of(report: dict[str, Any]) -> dict[str, Any] | None:
    leak = (report.get("breakdown") or {}).get("leak")
    return leak if isinstance(leak, dict) else None


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """The verdict's reason; then, when the error did not name its device, which device the breakdown
    shows and why; then, when a leak was active but did not cause this OOM, a line naming it."""
    b = report.get("breakdown") or {}
    lines = [sentence(b.get("verdict_why"))]
    note = b.get("device_note")  # optional: absent from older reports and when the error named its device
    if isinstance(note, str) and note.strip():
        lines.append(sentence(note))
    leak = leak_of(report)
    if leak is not None and b.get("verdict") != "leak" and leak.get("summary"):
        lines.append(f"Also leaking: {sentence(leak['summary'])}")
    return lines


# --- tensor groups -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupRow:
    """One census group as a row: ``count × dtype[shape]``, its bytes, and who holds it."""

    nbytes: int
    graph_bytes: int
    count: int
    dtype: str
    shape: tuple[int, ...]
    device: str
    category: str
    who: str  # the parameter/state name, else the holder line, else "-"
    leaking: bool

    @property
    def total(self) -> int:
        return self.nbytes + self.graph_bytes

    @property
    def tensors(self) -> str:
        return f"{self.count:,} × {self.dtype.removeprefix('torch.')}[{', '.join(str(d) for d in self.shape)}]"


def _key(group: Any) -> tuple[Any, ...]:
    """A group's identity (device, dtype, shape, category, name), from a report.json group or key."""
    if not isinstance(group, dict):
        return ()
    shape = group.get("shape")
    return (group.get("device"), group.get("dtype"), tuple(shape) if isinstance(shape, list) else None,
            group.get("category"), group.get("name"))


def group_rows(tensors: dict[str, Any], leak: dict[str, Any] | None = None) -> list[GroupRow]:
    """The census groups, largest (own + graph bytes) first, each exactly once: report.json's
    ``groups``, or, for a report without them, its largest tensors grouped the same way."""
    source = tensors.get("groups")
    if not isinstance(source, list) or not source:
        source = [{**t, "count": 1} for t in tensors.get("top") or []]
    keys = (leak or {}).get("group_keys")
    leaking = {_key(k) for k in keys} if isinstance(keys, list) else set()
    merged: dict[tuple[Any, ...], GroupRow] = {}
    for g in source:
        key = _key(g)
        who = g.get("name") or g.get("holder") or "-"
        row = merged.get(key)
        merged[key] = GroupRow(
            nbytes=(row.nbytes if row else 0) + int(g.get("nbytes") or 0),
            graph_bytes=(row.graph_bytes if row else 0) + int(g.get("graph_bytes") or 0),
            count=(row.count if row else 0) + int(g.get("count") or 1),
            dtype=str(g.get("dtype")), shape=key[2] or (), device=str(g.get("device")),
            category=str(g.get("category")).replace("_", " "), who=row.who if row and row.who != "-" else who,
            leaking=key in leaking,
        )
    return sorted(merged.values(), key=lambda r: r.total, reverse=True)


def group_columns(rows: list[GroupRow]) -> list[str]:
    """Column names for ``group_cells``: a device column only when there is more than one device, a
    graph column only when some group keeps autograd graph alive."""
    cols = ["bytes", "tensors", "category", "held by / name"]
    if len({r.device for r in rows}) > 1:
        cols.insert(2, "device")
    if any(r.graph_bytes for r in rows):
        cols.append("graph kept alive")
    return cols


LEAK_MARK = " ← the leak"


def group_cells(row: GroupRow, columns: list[str]) -> list[str]:
    """The row's cells for ``columns``; the leak's groups say so next to their holder."""
    who = row.who + (LEAK_MARK if row.leaking else "")
    values = {"bytes": fmt_bytes(row.total), "tensors": row.tensors, "device": row.device,
              "category": row.category, "held by / name": who, "graph kept alive": fmt_bytes(row.graph_bytes)}
    return [values[c] for c in columns]


def plural(n: Any, noun: str) -> str:
    """``1 tensor``, ``787 tensors``, ``? tensors`` for a count the report does not have."""
    if not isinstance(n, int) or isinstance(n, bool):
        return f"? {noun}s"
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def census_summary(tensors: dict[str, Any], rows: list[GroupRow]) -> str:
    """"787 tensors in 18 groups, 1.50 GiB"."""
    return (f"{plural(tensors.get('tensor_count'), 'tensor')} in {plural(len(rows), 'group')}, "
            f"{fmt_bytes(tensors.get('total_bytes'))}")


def census_when(tensors: dict[str, Any]) -> str:
    """"census at the OOM, after step 799"; or, when the census shown is an earlier one, which and why
    ("the last census, after step 611: census at the OOM failed (MemoryError)"): its groups are
    smaller than at the OOM by whatever grew since."""
    step = tensors.get("step")
    when = f"after step {step}" if isinstance(step, int) and step >= 0 else "before the first step ended"
    note = tensors.get("note")
    return f"the last census, {when}: {note}" if note else f"census at the OOM, {when}"


def groups_note(tensors: dict[str, Any], rows: list[GroupRow], shown: int) -> str:
    """"787 tensors in 18 groups, 1.50 GiB (census at the OOM, after step 799); 8 smaller groups (116 B)
    are in report.json"."""
    text = f"{census_summary(tensors, rows)} ({census_when(tensors)})"
    if len(rows) > shown:
        rest = sum(r.total for r in rows[shown:])
        text += f"; {plural(len(rows) - shown, 'smaller group')} ({fmt_bytes(rest)}) in report.json"
    return text + "."


# --- breakdown, timeline -------------------------------------------------------------------------


def item_label(item: dict[str, Any], device: Any, limit: Any = None) -> str:
    """The words for a breakdown item, the same in every rendering (``limit``: the breakdown's
    ``host_limit``, what host items partition)."""
    known = Device.parse(device) if isinstance(device, str) else None  # report.json spells it "cuda:0", "cpu"
    return breakdown_label(str(item.get("key")), known, item.get("label"), limit)


def breakdown_rows(b: dict[str, Any]) -> list[list[str]]:
    """Each breakdown item as [label, bytes, share of the total] ("-" without a total), in every rendering."""
    total = b.get("total_bytes") or 0
    return [[item_label(i, b.get("device"), b.get("host_limit")), fmt_bytes(i["nbytes"]),
             f"{100 * i['nbytes'] / total:.1f}%" if total else "-"] for i in b.get("items") or []]


def totals_sentence(report: dict[str, Any]) -> str:
    """The line under the breakdown: what it is measured against, then the figures the report has
    ("requested 4.00 MiB; allocated …; peak seen 5.48 GiB."). A CPU OOM has no allocator figures nor
    free blocks: "largest free block -" there read as a figure that was missing."""
    b = report.get("breakdown") or {}
    figures = (("requested", b.get("requested_bytes")), ("allocated", b.get("allocated_bytes")),
               ("reserved", b.get("reserved_bytes")), ("largest free block", b.get("largest_free_block_bytes")),
               ("peak seen", report.get("peak_bytes")))
    return "; ".join([total_words(b), *(f"{name} {fmt_bytes(n)}" for name, n in figures if n is not None)]) + "."


def total_words(b: dict[str, Any]) -> str:
    """What the breakdown's items are measured against: "Device total: 79.10 GiB", or under a
    per-process cap "Process cap: 12.00 GiB (fraction 0.50 of the device's 24.00 GiB); free under it
    30.00 MiB; free on the device 10.20 GiB; outside PyTorch 1.50 GiB (not counted against the cap)"."""
    cap = b.get("cap_bytes")
    if b.get("device") == "cpu":
        return host_words(b)
    if not isinstance(cap, int):
        return f"Device total: {fmt_bytes(b.get('total_bytes'))}"
    fraction = b.get("memory_fraction")
    of = f"fraction {fraction:.2f} of " if isinstance(fraction, (int, float)) else ""
    return (f"Process cap: {fmt_bytes(cap)} ({of}the device's {fmt_bytes(b.get('device_total_bytes'))}); "
            f"free under it {fmt_bytes(b.get('headroom_bytes'))}; free on the device "
            f"{fmt_bytes(b.get('device_free_bytes'))}; outside PyTorch {fmt_bytes(b.get('non_pytorch_bytes'))} "
            "(not counted against the cap)")


_AXIS_LABELS = {"ram": "host RAM", "cgroup": "cgroup limit", "rlimit_as": "RLIMIT_AS", "rlimit_data": "RLIMIT_DATA"}


def total_axis_label(b: dict[str, Any]) -> str:
    """The few words on the breakdown bar's total mark: "device total", "process cap", "host RAM" ..."""
    if b.get("device") == "cpu":
        limit = b.get("host_limit")
        return _AXIS_LABELS.get(limit if isinstance(limit, str) else "ram", "host limit")
    return "process cap" if isinstance(b.get("cap_bytes"), int) else "device total"


def host_words(b: dict[str, Any]) -> str:
    """What a host breakdown is measured against: "Host RAM: 23.54 GiB", or under a tighter limit
    "Host limit: the cgroup memory limit, 2.00 GiB (it leaves less room than the host's RAM)"."""
    limit = b.get("host_limit")
    total = fmt_bytes(b.get("total_bytes"))
    if limit in (None, "ram") or not isinstance(limit, str):
        return f"Host RAM: {total}"
    return f"Host limit: {HOST_LIMIT_WORDS.get(limit, limit)}, {total} (it leaves less room than the host's RAM)"


# (key, column / series label): what a timeline row may hold.
TIMELINE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("allocated_bytes", "allocated"),
    ("allocated_peak_bytes", "allocated peak"),
    ("reserved_bytes", "reserved"),
    ("rss_bytes", "process RSS"),
    ("census_total_bytes", "tensors (census)"),
)


def timeline_columns(timeline: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The timeline columns that hold a number in at least one row (no allocator columns on CPU)."""
    return [(k, label) for k, label in TIMELINE_COLUMNS if any(isinstance(r.get(k), int) for r in timeline)]


TIMELINE_SHOWN = 20  # rows in the people's tables; report.json has the whole timeline


def timeline_intro(timeline: list[dict[str, Any]]) -> str:
    """The sentence over the table: how far apart the recorded steps are, and that the last row is the
    memory at the OOM (not a step end) when the report has it."""
    shown = timeline[-TIMELINE_SHOWN:]
    recorded = [r for r in shown if r.get("at_oom") is not True]
    text = "The last steps recorded before the OOM"
    every = recorded[-1].get("steps") if recorded else None
    if isinstance(every, int) and every > 1:
        text += (f", one every {every} steps (on fast steps the agent reads memory every few steps, "
                 "to keep within its overhead budget)")
    if shown and shown[-1].get("at_oom") is True:
        text += f"; the last row is the memory at the OOM, in step {shown[-1].get('step')}"
    return text + ":"


def timeline_table(timeline: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The table's headers and the last ``TIMELINE_SHOWN`` rows' cells (bytes formatted)."""
    shown = timeline[-TIMELINE_SHOWN:]
    columns = timeline_columns(shown)
    # the reading taken in the failing step: "2387 (at the OOM)"
    rows = [[f"{r.get('step')} (at the OOM)" if r.get("at_oom") is True else str(r.get("step")), str(r.get("phase")),
             *(fmt_bytes(r.get(k)) for k, _ in columns)] for r in shown]
    return ["step", "phase", *(label for _, label in columns)], rows


def chart_series(timeline: list[dict[str, Any]], device: Any) -> list[tuple[str, str]]:
    """What the timeline chart draws: the allocator's series on a GPU, the process RSS on the host,
    and the census totals where there are at least two."""
    wanted = ("rss_bytes",) if device == "cpu" else ("allocated_bytes", "allocated_peak_bytes", "reserved_bytes")
    out = [(k, label) for k, label in timeline_columns(timeline) if k in wanted]
    if sum(isinstance(r.get("census_total_bytes"), int) for r in timeline) >= 2:
        out.append(("census_total_bytes", "tensors (census)"))
    return out


def chart_markers(report: dict[str, Any]) -> list[tuple[int, str, str]]:
    """(step, label, kind) to mark on the timeline: the leak's onset and the step that ran out of memory."""
    out = []
    leak = leak_of(report)
    if leak is not None and isinstance(leak.get("onset_step"), int):
        out.append((leak["onset_step"], f"leak onset: {leak.get('holder')} (step {leak['onset_step']})", "leak"))
    if isinstance(report.get("step"), int):
        out.append((report["step"], f"OOM (step {report['step']})", "oom"))
    return out


# --- table of contents ---------------------------------------------------------------------------


def slug(title: str) -> str:
    """The anchor GitHub (and most Markdown viewers) give a heading: "Largest tensor groups" ->
    "largest-tensor-groups"; report.html uses the same ids, so one table of contents fits both."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def sections(report: dict[str, Any]) -> list[str]:
    """The title of every section, in order: the table of contents and the headings."""
    out = ["Verdict", "Largest tensor groups", "Suggestions", "Breakdown"]
    if isinstance(report.get("step_profile"), dict):
        out.append("Step profile")
    out += ["Leak findings", "Timeline", "Allocator snapshot", "Exception", "Environment"]
    if report.get("memory_summary"):
        out.append("torch.cuda.memory_summary()")
    return out
