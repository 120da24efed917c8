"""``report.md``: the report dict as Markdown.

The first screen (about 40 lines) tells the story: the headline, the verdict (naming a leak and
its holder when one was active), the largest tensor groups with their holders, then the
suggestions. Details follow: breakdown, step profile, findings, timeline, snapshot, exception, environment.
"""

from __future__ import annotations

from typing import Any

from gpumemd.report import view
from gpumemd.report.fmt import fmt_bytes, fmt_time


def _code(text: str) -> str:
    """Inline code that may itself hold backticks (a holder's name)."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in rows]
    return lines


def headline(report: dict[str, Any]) -> str:
    """One sentence: what failed, where, when."""
    b = report.get("breakdown") or {}
    exc = report.get("exception") or {}
    step = report.get("step")
    return (f"{exc.get('type', 'OOM')} on {b.get('device', '?')} (rank {report.get('rank')}, "
            + (f"step {step}, " if step is not None else "") + f"phase {report.get('phase')}): "
            f"requested {fmt_bytes(b.get('requested_bytes'))} of {fmt_bytes(b.get('total_bytes'))}; "
            f"verdict: {b.get('verdict', 'unknown')}")


def step_profile_note(profile: dict[str, Any]) -> str:
    """Which step the step profile comes from (shared with the HTML)."""
    return (f"Measured on step {profile.get('step')} on {profile.get('device')} (the last sampled step); "
            f"{profile.get('saved_tensors')} tensors saved for backward. Points this device cannot measure "
            "are left out.")


def _heading(title: str) -> list[str]:
    return ["", f"## {title}", ""]


def _verdict(report: dict[str, Any]) -> list[str]:
    b = report.get("breakdown") or {}
    first, *rest = view.verdict_lines(report)
    out = [*_heading("Verdict"), f"**{b.get('verdict')}** — {first}"]
    for line in rest:
        out += ["", line]
    return out


def _groups(report: dict[str, Any]) -> list[str]:
    out = _heading("Largest tensor groups")
    tensors = report.get("tensors") or {}
    if not tensors.get("available"):
        return [*out, f"No tensor census: {tensors.get('note')}."]
    rows = view.group_rows(tensors, view.leak_of(report))
    columns = view.group_columns(rows)
    cells = [view.group_cells(row, columns) for row in rows[:view.GROUPS_SHOWN]]
    return [*out, *_table(columns, cells), "", view.groups_note(tensors, rows, view.GROUPS_SHOWN)]


def _suggestions(report: dict[str, Any]) -> list[str]:
    out = _heading("Suggestions")
    suggestions = report.get("suggestions") or []
    if not suggestions:
        return [*out, report.get("suggestions_none") or "No suggestion: the measurements point at no single cause."]
    for n, s in enumerate(suggestions, 1):
        out += [f"{n}. **{s['title']}** — saves about {fmt_bytes(s['saving_bytes'])}. {s['why']}"]
        if s.get("how"):
            out += [f"   {_code(s['how'])}"]
    return out


def _breakdown(report: dict[str, Any]) -> list[str]:
    b = report.get("breakdown") or {}
    return [*_heading("Breakdown"), *_table(["part", "bytes", "of total"], view.breakdown_rows(b)), "",
            view.totals_sentence(report)]


def _step_profile(report: dict[str, Any]) -> list[str]:
    profile = report.get("step_profile")
    if not isinstance(profile, dict):
        return []  # not measured (attach(step_profile=True) turns it on)
    rows = [[f.get("label"), fmt_bytes(f.get("nbytes"))] for f in profile.get("figures", [])]
    return [*_heading("Step profile"), step_profile_note(profile), "", *_table(["point", "bytes"], rows)]


def _findings(report: dict[str, Any]) -> list[str]:
    findings = report.get("findings") or []
    lines = [f"- {f['state']} {f['kind']} on {f['series']}: {view.sentence(f['summary'])}" for f in findings]
    return [*_heading("Leak findings"), *(lines or ["None."])]


def _timeline(report: dict[str, Any]) -> list[str]:
    timeline = report.get("timeline") or []
    out = _heading("Timeline")
    if not timeline:
        return [*out, "No steps."]
    return [*out, view.timeline_intro(timeline), "", *_table(*view.timeline_table(timeline))]


def _snapshot(report: dict[str, Any]) -> list[str]:
    snap = report.get("snapshot") or {}
    if not snap.get("file"):
        return [*_heading("Allocator snapshot"), "None (no CUDA allocator in this process)."]
    return [*_heading("Allocator snapshot"),
            f"`{snap['file']}` (taken at {snap.get('source')}): open it at pytorch.org/memory_viz or with "
            f"`python -m torch.cuda._memory_viz trace_plot {snap['file']} -o trace.html`."]


def _exception(report: dict[str, Any]) -> list[str]:
    exc = report.get("exception") or {}
    out = [*_heading("Exception"), "```", f"{exc.get('type')}: {exc.get('message')}", "```"]
    if exc.get("traceback"):
        out += ["", "```", str(exc["traceback"]).rstrip(), "```"]
    return out


def _environment(report: dict[str, Any]) -> list[str]:
    env = report.get("environment") or {}
    out = [*_heading("Environment"), *(f"- {k}: `{v}`" for k, v in env.items())]
    if report.get("memory_summary"):
        out += [*_heading("torch.cuda.memory_summary()"), "```", str(report["memory_summary"]).rstrip(), "```"]
    return out


def render_markdown(report: dict[str, Any]) -> str:
    out = [f"# gpumemd OOM report — rank {report.get('rank')}, step {report.get('step')}", "",
           headline(report), "", f"Written {fmt_time(report.get('created_at'))} via {report.get('source')}.",
           *([f"Outcome: {report['outcome']}."] if report.get("outcome") else []), "",
           "Contents: " + " · ".join(f"[{t}](#{view.slug(t)})" for t in view.sections(report))]
    for part in (_verdict, _groups, _suggestions, _breakdown, _step_profile, _findings, _timeline, _snapshot,
                 _exception, _environment):
        out += part(report)
    return "\n".join(out) + "\n"
