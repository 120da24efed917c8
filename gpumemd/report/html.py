"""``report.html``: one self-contained page (inline style and SVG; no script, font, image or link).

Every value from the report is escaped: exception messages and tensor names are user data.
"""

from __future__ import annotations

from html import escape
from typing import Any

from gpumemd.report.build import TOP_TENSORS_SHOWN
from gpumemd.report.fmt import fmt_bytes, fmt_shape, fmt_time
from gpumemd.report.markdown import headline, phases_note
from gpumemd.report.svg import breakdown_bar, legend, timeline_chart

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;max-width:1000px;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}pre{background:#f6f6f6;padding:.8em;overflow-x:auto}
.verdict{font-weight:bold}.key{display:inline-block;margin-right:1em;font-size:.85em}
"""


def _e(value: Any) -> str:
    return escape("-" if value is None else str(value))


def _table(headers: list[str], rows: list[list[tuple[Any, bool]]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="n">{_e(v)}</td>' if num else f"<td>{_e(v)}</td>" for v, num in row) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(report: dict[str, Any]) -> str:
    b = report.get("breakdown") or {}
    items = [i for i in b.get("items", []) if i.get("nbytes")]
    total = b.get("total_bytes") or 0
    parts = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>gpumemd OOM report, rank {_e(report.get('rank'))} step {_e(report.get('step'))}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>gpumemd OOM report — rank {_e(report.get('rank'))}, step {_e(report.get('step'))}</h1>",
        f"<p>{_e(headline(report))}</p>",
        f"<p>Written {_e(fmt_time(report.get('created_at')))} via {_e(report.get('source'))}.</p>",
        f"<h2>Verdict</h2><p><span class=\"verdict\">{_e(b.get('verdict'))}</span> — {_e(b.get('verdict_why'))}</p>",
        "<h2>Breakdown</h2>",
        breakdown_bar(items, total or None),
        f"<p>{legend(items)}</p>",
        _table(["part", "bytes", "of total"],
               [[(i["label"], False), (fmt_bytes(i["nbytes"]), True),
                 (f"{100 * i['nbytes'] / total:.1f}%" if total else "-", True)] for i in b.get("items", [])]),
        f"<p>Device total {_e(fmt_bytes(b.get('total_bytes')))}; requested {_e(fmt_bytes(b.get('requested_bytes')))}; "
        f"largest free block {_e(fmt_bytes(b.get('largest_free_block_bytes')))}; "
        f"peak seen {_e(fmt_bytes(report.get('peak_bytes')))}.</p>",
        "<h2>Suggestions</h2>",
    ]
    suggestions = report.get("suggestions") or []
    if suggestions:
        parts.append("<ol>" + "".join(
            f"<li><b>{_e(s['title'])}</b> — saves about {_e(fmt_bytes(s['saving_bytes']))}. {_e(s['why'])}"
            + (f"<br><code>{_e(s['how'])}</code>" if s.get("how") else "") + "</li>"
            for s in suggestions) + "</ol>")
    else:
        parts.append("<p>No suggestion: the measurements point at no single cause.</p>")
    phases = report.get("phases")
    if isinstance(phases, dict):  # only with attach(phases=True)
        parts.append("<h2>Step phases</h2>")
        parts.append(f"<p>{_e(phases_note(phases))}</p>")
        parts.append(_table(["phase", "bytes"], [[(f.get("label"), False), (fmt_bytes(f.get("nbytes")), True)]
                                                 for f in phases.get("figures", [])]))
    timeline = report.get("timeline") or []
    parts.append("<h2>Timeline</h2>")
    chart = timeline_chart(timeline, [("allocated_bytes", "allocated"), ("allocated_peak_bytes", "peak"),
                                      ("reserved_bytes", "reserved"), ("rss_bytes", "host RSS")])
    parts.append(chart or "<p>No step was recorded before the OOM.</p>")
    if timeline:
        parts.append(_table(["step", "phase", "allocated", "peak", "reserved", "host RSS"], [
            [(r["step"], True), (r["phase"], False), (fmt_bytes(r["allocated_bytes"]), True),
             (fmt_bytes(r["allocated_peak_bytes"]), True), (fmt_bytes(r["reserved_bytes"]), True),
             (fmt_bytes(r["rss_bytes"]), True)] for r in timeline[-20:]]))
    tensors = report.get("tensors") or {}
    parts.append("<h2>Largest tensors</h2>")
    if tensors.get("available"):
        parts.append(_table(["bytes", "shape", "dtype", "device", "category", "name / holder", "graph"], [
            [(fmt_bytes(t["nbytes"]), True), (fmt_shape(t["shape"]), False), (t["dtype"], False),
             (t["device"], False), (t["category"], False), (t.get("name") or t.get("holder") or "-", False),
             (fmt_bytes(t.get("graph_bytes")), True)] for t in tensors.get("top", [])[:TOP_TENSORS_SHOWN]]))
    else:
        parts.append(f"<p>No tensor census: {_e(tensors.get('note'))}.</p>")
    findings = report.get("findings") or []
    parts.append("<h2>Leak findings</h2>")
    parts.append("<ul>" + "".join(f"<li>{_e(f['state'])} {_e(f['kind'])} on {_e(f['series'])}: {_e(f['summary'])}</li>"
                                  for f in findings) + "</ul>" if findings else "<p>None.</p>")
    snap = report.get("snapshot") or {}
    parts.append("<h2>Allocator snapshot</h2>")
    if snap.get("file"):
        parts.append(f"<p><code>{_e(snap['file'])}</code> (taken at {_e(snap.get('source'))}): drag it into "
                     "pytorch.org/memory_viz, or run <code>python -m torch.cuda._memory_viz stats "
                     f"{_e(snap['file'])}</code>.</p>")
    else:
        parts.append("<p>None (no CUDA allocator in this process).</p>")
    exc = report.get("exception") or {}
    parts.append(f"<h2>Exception</h2><pre>{_e(exc.get('type'))}: {_e(exc.get('message'))}</pre>")
    if exc.get("traceback"):
        parts.append(f"<pre>{_e(exc['traceback'])}</pre>")
    env = report.get("environment") or {}
    parts.append("<h2>Environment</h2>")
    parts.append(_table(["key", "value"], [[(k, False), (v, False)] for k, v in env.items()]))
    if report.get("memory_summary"):
        parts.append(f"<h2>torch.cuda.memory_summary()</h2><pre>{_e(report['memory_summary'])}</pre>")
    parts.append("</body></html>\n")
    return "".join(parts)
