"""``report.html``: one self-contained page (inline style and SVG; no script, font, image or link
that loads anything; the only links are the table of contents' in-page anchors).

The sections come in report.md's order (``markdown``), a table of contents first. Every value from
the report is escaped: messages and holder lines are user data.
"""

from __future__ import annotations

import re
from html import escape
from typing import Any

from gpumemd.report import view
from gpumemd.report.fmt import fmt_bytes, fmt_time
from gpumemd.report.markdown import headline, step_profile_note
from gpumemd.report.svg import breakdown_bar, legend, timeline_chart

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;max-width:1000px;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}pre{background:#f6f6f6;padding:.8em;overflow-x:auto}
pre.wrap{white-space:pre-wrap;overflow-wrap:anywhere}
.verdict{font-weight:bold}.key{display:inline-block;margin-right:1em;font-size:.85em}
nav{font-size:.9em}nav a{margin-right:.8em;white-space:nowrap}tr.leak td{background:#fff3e0}
.also{border-left:4px solid #e8702a;padding-left:.6em}code{background:#f3f3f3;padding:0 .2em}
"""
_NUMERIC = frozenset({"bytes", "graph kept alive", "of total", "step", *(label for _, label in view.TIMELINE_COLUMNS)})


def _e(value: Any) -> str:
    return escape("-" if value is None else str(value))


_BACKTICKED = re.compile(r"`([^`<>]+)`")


def _prose(value: Any) -> str:
    """Escaped text with its `names` (holders, variables) set as code, as Markdown would show them."""
    return _BACKTICKED.sub(r"<code>\1</code>", _e(value))


def _table(headers: list[str], rows: list[list[Any]], row_class: list[str] | None = None) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for n, row in enumerate(rows):
        cls = f' class="{row_class[n]}"' if row_class and row_class[n] else ""
        cells = "".join(f'<td class="n">{_e(v)}</td>' if h in _NUMERIC else f"<td>{_prose(v)}</td>"
                        for h, v in zip(headers, row, strict=True))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _h2(title: str) -> str:
    return f'<h2 id="{view.slug(title)}">{_e(title)}</h2>'


def _verdict(report: dict[str, Any]) -> str:
    b = report.get("breakdown") or {}
    first, *rest = view.verdict_lines(report)
    out = [_h2("Verdict"), f'<p><span class="verdict">{_e(b.get("verdict"))}</span> — {_prose(first)}</p>']
    out += [f'<p class="also">{_prose(line)}</p>' for line in rest]
    return "".join(out)


def _groups(report: dict[str, Any]) -> str:
    tensors = report.get("tensors") or {}
    if not tensors.get("available"):
        return _h2("Largest tensor groups") + f"<p>No tensor census: {_e(tensors.get('note'))}.</p>"
    rows = view.group_rows(tensors, view.leak_of(report))
    columns = view.group_columns(rows)
    shown = rows[:view.GROUPS_SHOWN]
    table = _table(columns, [view.group_cells(r, columns) for r in shown], ["leak" if r.leaking else "" for r in shown])
    return _h2("Largest tensor groups") + table + f"<p>{_e(view.groups_note(tensors, rows, view.GROUPS_SHOWN))}</p>"


def _suggestions(report: dict[str, Any]) -> str:
    suggestions = report.get("suggestions") or []
    if not suggestions:
        why = report.get("suggestions_none") or "No suggestion: the measurements point at no single cause."
        return _h2("Suggestions") + f"<p>{_prose(why)}</p>"
    return _h2("Suggestions") + "<ol>" + "".join(
        f"<li><b>{_prose(s['title'])}</b> — saves about {_e(fmt_bytes(s['saving_bytes']))}. {_prose(s['why'])}"
        + (f"<br><code>{_e(s['how'])}</code>" if s.get("how") else "") + "</li>"
        for s in suggestions) + "</ol>"


def _breakdown(report: dict[str, Any]) -> str:
    b = report.get("breakdown") or {}
    rows = view.breakdown_rows(b)
    drawn = [{**i, "label": row[0]} for i, row in zip(b.get("items") or [], rows, strict=True) if i.get("nbytes")]
    total = b.get("total_bytes") or 0
    return "".join([
        _h2("Breakdown"), breakdown_bar(drawn, total or None, total_label=view.total_axis_label(b)),
        f"<p>{legend(drawn)}</p>",
        _table(["part", "bytes", "of total"], rows),
        f"<p>{_e(view.totals_sentence(report))}</p>",
    ])


def _step_profile(report: dict[str, Any]) -> str:
    profile = report.get("step_profile")
    if not isinstance(profile, dict):  # only with attach(step_profile=True)
        return ""
    rows = [[f.get("label"), fmt_bytes(f.get("nbytes"))] for f in profile.get("figures", [])]
    return _h2("Step profile") + f"<p>{_e(step_profile_note(profile))}</p>" + _table(["point", "bytes"], rows)


def _findings(report: dict[str, Any]) -> str:
    findings = report.get("findings") or []
    if not findings:
        return _h2("Leak findings") + "<p>None.</p>"
    return _h2("Leak findings") + "<ul>" + "".join(
        f"<li>{_e(f['state'])} {_e(f['kind'])} on {_e(f['series'])}: {_prose(view.sentence(f['summary']))}</li>"
        for f in findings) + "</ul>"


def _timeline(report: dict[str, Any]) -> str:
    timeline = report.get("timeline") or []
    device = (report.get("breakdown") or {}).get("device")
    chart = timeline_chart(timeline, view.chart_series(timeline, device), view.chart_markers(report))
    out = [_h2("Timeline"), chart or "<p>No step was recorded before the OOM.</p>"]
    if timeline:
        out += [f"<p>{_e(view.timeline_intro(timeline))}</p>", _table(*view.timeline_table(timeline))]
    return "".join(out)


def _snapshot(report: dict[str, Any]) -> str:
    snap = report.get("snapshot") or {}
    if not snap.get("file"):
        return _h2("Allocator snapshot") + "<p>None (no CUDA allocator in this process).</p>"
    return (_h2("Allocator snapshot") + f"<p><code>{_e(snap['file'])}</code> (taken at {_e(snap.get('source'))}): "
            "drag it into pytorch.org/memory_viz, or run <code>python -m torch.cuda._memory_viz stats "
            f"{_e(snap['file'])}</code>.</p>")


def _exception(report: dict[str, Any]) -> str:
    exc = report.get("exception") or {}
    # The message wraps: CUDA's runs to one line of several hundred characters, with the request
    # size ("Tried to allocate ...") that matters most in its middle.
    out = _h2("Exception") + f"<pre class=\"wrap\">{_e(exc.get('type'))}: {_e(exc.get('message'))}</pre>"
    if exc.get("traceback"):
        out += f"<pre>{_e(exc['traceback'])}</pre>"
    return out


def _environment(report: dict[str, Any]) -> str:
    env = report.get("environment") or {}
    out = _h2("Environment") + _table(["key", "value"], [[k, v] for k, v in env.items()])
    if report.get("memory_summary"):
        out += _h2("torch.cuda.memory_summary()") + f"<pre>{_e(report['memory_summary'])}</pre>"
    return out


def render_html(report: dict[str, Any]) -> str:
    parts = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>gpumemd OOM report, rank {_e(report.get('rank'))} step {_e(report.get('step'))}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>gpumemd OOM report — rank {_e(report.get('rank'))}, step {_e(report.get('step'))}</h1>",
        f"<p>{_e(headline(report))}</p>",
        f"<p>Written {_e(fmt_time(report.get('created_at')))} via {_e(report.get('source'))}.</p>",
        "<nav>Contents: " + "".join(f'<a href="#{view.slug(t)}">{_e(t)}</a>' for t in view.sections(report)) + "</nav>",
    ]
    parts += [part(report) for part in (_verdict, _groups, _suggestions, _breakdown, _step_profile, _findings,
                                        _timeline, _snapshot, _exception, _environment)]
    parts.append("</body></html>\n")
    return "".join(parts)
