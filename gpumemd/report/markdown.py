"""``report.md``: the report dict as Markdown (headline, breakdown, suggestions, tensors, timeline)."""

from __future__ import annotations

from typing import Any

from gpumemd.report.build import TOP_TENSORS_SHOWN
from gpumemd.report.fmt import fmt_bytes, fmt_shape, fmt_time


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def headline(report: dict[str, Any]) -> str:
    """One sentence: what failed, where, when."""
    b = report.get("breakdown") or {}
    exc = report.get("exception") or {}
    step = report.get("step")
    return (f"{exc.get('type', 'OOM')} on {b.get('device', '?')} (rank {report.get('rank')}, "
            f"step {step if step is not None else '-'}, phase {report.get('phase')}): "
            f"requested {fmt_bytes(b.get('requested_bytes'))} of {fmt_bytes(b.get('total_bytes'))}; "
            f"verdict: {b.get('verdict', 'unknown')}")


def phases_note(phases: dict[str, Any]) -> str:
    """Which step the phase figures come from (shared with the HTML)."""
    return (f"Measured on step {phases.get('step')} on {phases.get('device')} (the last sampled step); "
            f"{phases.get('saved_tensors')} tensors saved for backward. Phases this device cannot measure "
            "are left out.")


def _phases(phases: Any) -> list[str]:
    if not isinstance(phases, dict):
        return []  # not measured (attach(phases=True) turns it on)
    rows = [[f.get("label"), fmt_bytes(f.get("nbytes"))] for f in phases.get("figures", [])]
    return ["", "## Step phases", "", phases_note(phases), "", *_table(["phase", "bytes"], rows)]


def render_markdown(report: dict[str, Any]) -> str:
    b = report.get("breakdown") or {}
    total = b.get("total_bytes") or 0
    out = [f"# gpumemd OOM report — rank {report.get('rank')}, step {report.get('step')}", "",
           headline(report), "", f"Written {fmt_time(report.get('created_at'))} via {report.get('source')}.", ""]
    out += ["## Verdict", "", f"**{b.get('verdict')}** — {b.get('verdict_why')}", ""]
    out += ["## Breakdown", ""]
    rows = [[i["label"], fmt_bytes(i["nbytes"]), f"{100 * i['nbytes'] / total:.1f}%" if total else "-"]
            for i in b.get("items", [])]
    out += _table(["part", "bytes", "of total"], rows)
    out += ["", f"Device total: {fmt_bytes(b.get('total_bytes'))}; allocated {fmt_bytes(b.get('allocated_bytes'))}; "
            f"reserved {fmt_bytes(b.get('reserved_bytes'))}; largest free block "
            f"{fmt_bytes(b.get('largest_free_block_bytes'))}; peak seen {fmt_bytes(report.get('peak_bytes'))}.", ""]
    out += ["## Suggestions", ""]
    suggestions = report.get("suggestions") or []
    if not suggestions:
        out += ["No suggestion: the measurements point at no single cause.", ""]
    for n, s in enumerate(suggestions, 1):
        out += [f"{n}. **{s['title']}** — saves about {fmt_bytes(s['saving_bytes'])}. {s['why']}"]
        if s.get("how"):
            out += [f"   `{s['how']}`"]
    out += _phases(report.get("phases"))
    out += ["", "## Largest tensors", ""]
    tensors = report.get("tensors") or {}
    if tensors.get("available"):
        rows = [[fmt_bytes(t["nbytes"]), fmt_shape(t["shape"]), t["dtype"], t["device"], t["category"],
                 t.get("name") or t.get("holder") or "-", fmt_bytes(t.get("graph_bytes"))]
                for t in tensors.get("top", [])[:TOP_TENSORS_SHOWN]]
        out += _table(["bytes", "shape", "dtype", "device", "category", "name / holder", "graph"], rows)
        out += ["", f"{tensors.get('tensor_count')} tensors, {fmt_bytes(tensors.get('total_bytes'))} "
                f"(census of step {tensors.get('step')})."]
    else:
        out += [f"No tensor census: {tensors.get('note')}."]
    out += ["", "## Leak findings", ""]
    findings = report.get("findings") or []
    out += [f"- {f['state']} {f['kind']} on {f['series']}: {f['summary']}" for f in findings] or ["None."]
    out += ["", "## Timeline (last steps)", ""]
    timeline = report.get("timeline") or []
    rows = [[r["step"], r["phase"], fmt_bytes(r["allocated_bytes"]), fmt_bytes(r["allocated_peak_bytes"]),
             fmt_bytes(r["reserved_bytes"]), fmt_bytes(r["rss_bytes"])] for r in timeline[-20:]]
    out += _table(["step", "phase", "allocated", "peak", "reserved", "host RSS"], rows) if rows else ["No steps."]
    snap = report.get("snapshot") or {}
    out += ["", "## Allocator snapshot", ""]
    if snap.get("file"):
        out += [f"`{snap['file']}` (taken at {snap.get('source')}): open it at pytorch.org/memory_viz or with "
                f"`python -m torch.cuda._memory_viz trace_plot {snap['file']} -o trace.html`."]
    else:
        out += ["None (no CUDA allocator in this process)."]
    exc = report.get("exception") or {}
    out += ["", "## Exception", "", "```", f"{exc.get('type')}: {exc.get('message')}", "```"]
    if exc.get("traceback"):
        out += ["", "```", str(exc["traceback"]).rstrip(), "```"]
    env = report.get("environment") or {}
    out += ["", "## Environment", ""]
    out += [f"- {k}: `{v}`" for k, v in env.items()]
    if report.get("memory_summary"):
        out += ["", "## torch.cuda.memory_summary()", "", "```", str(report["memory_summary"]).rstrip(), "```"]
    return "\n".join(out) + "\n"
