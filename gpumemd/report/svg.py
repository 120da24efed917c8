"""Inline SVG charts for ``report.html``: the step timeline and the breakdown bar.

Plain SVG text with no script, font or image: an air-gapped cluster opens it as-is.
"""

from __future__ import annotations

from html import escape
from typing import Any

from gpumemd.report.fmt import fmt_bytes

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")


def breakdown_bar(items: list[dict[str, Any]], total: int | None, width: int = 900, height: int = 46) -> str:
    """A stacked horizontal bar of the breakdown items against the device total."""
    scale_total = max(total or 0, sum(max(0, int(i["nbytes"])) for i in items), 1)
    x = 0.0
    parts = [f'<svg width="{width}" height="{height + 24}" '
             f'role="img" aria-label="memory breakdown">']
    for n, item in enumerate(items):
        w = width * max(0, int(item["nbytes"])) / scale_total
        if w < 0.1:  # invisible at this scale; the legend and the table still list it
            continue
        colour = PALETTE[n % len(PALETTE)]
        title = escape(f"{item['label']}: {fmt_bytes(item['nbytes'])}")
        parts.append(f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" fill="{colour}">'
                     f"<title>{title}</title></rect>")
        x += w
    parts.append(f'<text x="0" y="{height + 16}" font-size="12">0</text>')
    parts.append(f'<text x="{width}" y="{height + 16}" font-size="12" text-anchor="end">'
                 f"{escape(fmt_bytes(scale_total))}</text>")
    parts.append("</svg>")
    return "".join(parts)


def legend(items: list[dict[str, Any]]) -> str:
    rows = []
    for n, item in enumerate(items):
        colour = PALETTE[n % len(PALETTE)]
        rows.append(f'<span class="key"><svg width="10" height="10"><rect width="10" height="10" '
                    f'fill="{colour}"/></svg> {escape(item["label"])}: {escape(fmt_bytes(item["nbytes"]))}</span>')
    return " ".join(rows)


def timeline_chart(rows: list[dict[str, Any]], series: list[tuple[str, str]],
                   width: int = 900, height: int = 260) -> str:
    """Lines of ``series`` ((key, label) pairs) over the step records; empty string without data."""
    points = {key: [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int)] for key, _ in series}
    points = {k: v for k, v in points.items() if v}
    if not points:
        return ""
    steps = [s for v in points.values() for s, _ in v]
    values = [b for v in points.values() for _, b in v]
    s0, s1 = min(steps), max(steps)
    top = max(values) or 1
    left, bottom, pad = 70, 24, 8

    def px(step: int) -> float:
        return left + (width - left - pad) * ((step - s0) / (s1 - s0) if s1 > s0 else 0.5)

    def py(value: int) -> float:
        return pad + (height - bottom - pad) * (1 - value / top)

    parts = [f'<svg width="{width}" height="{height}" role="img" '
             f'aria-label="memory per step">',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - pad}" y2="{height - bottom}" stroke="#888"/>',
             f'<line x1="{left}" y1="{pad}" x2="{left}" y2="{height - bottom}" stroke="#888"/>',
             f'<text x="{left - 4}" y="{pad + 10}" font-size="11" text-anchor="end">{escape(fmt_bytes(top))}</text>',
             f'<text x="{left - 4}" y="{height - bottom}" font-size="11" text-anchor="end">0</text>',
             f'<text x="{left}" y="{height - 6}" font-size="11">step {s0}</text>',
             f'<text x="{width - pad}" y="{height - 6}" font-size="11" text-anchor="end">step {s1}</text>']
    labels = dict(series)
    for n, (key, pts) in enumerate(points.items()):
        colour = PALETTE[n % len(PALETTE)]
        path = " ".join(f"{px(s):.1f},{py(b):.1f}" for s, b in pts)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}">'
                     f"<title>{escape(labels[key])}</title></polyline>")
        parts.append(f'<text x="{left + 8 + 150 * n}" y="{pad + 12}" font-size="11" fill="{colour}">'
                     f"{escape(labels[key])}</text>")
    parts.append("</svg>")
    return "".join(parts)
