"""Inline SVG charts for ``report.html``: the step timeline and the breakdown bar.

Plain SVG text with no script, font or image: an air-gapped cluster opens it as-is. Both axes carry
ticks in round numbers with their units (bytes in binary units, as everywhere in gpumemd), and the
timeline marks the steps that matter (the leak's onset, the OOM).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Any

from gpumemd.analysis.units import UNITS
from gpumemd.report.fmt import fmt_bytes

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#e15759",
           "#ff9da7", "#9c755f", "#bab0ac")
MARKER_COLOURS = {"leak": "#e8702a", "oom": "#c0392b"}  # marker kind -> colour (others: grey)
# Breakdown items whose colour carries meaning: the leak stands out, what is free recedes.
ITEM_COLOURS = {"leaked": "#e15759", "free": "#e4e4e4", "headroom": "#e4e4e4", "reserved_unallocated": "#bab0ac",
                "non_pytorch": "#9c755f", "process_other": "#c9c1bb"}
_HALO = 'stroke="white" stroke-width="3" paint-order="stroke"'  # keeps a label legible over a line
_FONT = 'font-family="system-ui,sans-serif"'


def nice_step(span: float, ticks: int = 5) -> float:
    """A round tick spacing (1, 2, 2.5 or 5 × 10^k) that cuts ``span`` into about ``ticks`` parts."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def byte_ticks(top: float, ticks: int = 5) -> tuple[list[float], str, float]:
    """Ticks from 0 to at least ``top`` bytes, round in one binary unit: ([0, 0.5, ..., 2.0], "GiB", 2**30)."""
    power = 0
    while power < len(UNITS) - 1 and top >= 1024 ** (power + 1):
        power += 1
    scale = float(1024**power)
    step = nice_step(top / scale, ticks)
    count = max(1, math.ceil(top / scale / step - 1e-9))
    return [i * step for i in range(count + 1)], UNITS[power], scale


def step_ticks(first: int, last: int, ticks: int = 8) -> list[int]:
    """Round step numbers inside [first, last] (at least one)."""
    step = max(1, int(nice_step(last - first, ticks)))
    start = math.ceil(first / step) * step
    return list(range(start, last + 1, step)) or [first]


def item_colour(item: dict[str, Any], n: int) -> str:
    """The colour of the ``n``-th breakdown item, the same in the bar and its legend."""
    return ITEM_COLOURS.get(str(item.get("key")), PALETTE[n % len(PALETTE)])


def breakdown_bar(items: list[dict[str, Any]], total: int | None, width: int = 900, height: int = 40,
                  total_label: str = "device total") -> str:
    """A stacked horizontal bar of the breakdown items against their total (the device's, a cap, the
    host's RAM or limit: ``total_label`` names it on the axis), with a byte axis."""
    scale_total = max(total or 0, sum(max(0, int(i["nbytes"])) for i in items), 1)
    values, unit, scale = byte_ticks(scale_total, 8)
    axis_max = values[-1] * scale
    left, right = 24, 40
    plot = width - left - right
    x = float(left)
    parts = [f'<svg width="{width}" height="{height + 40}" viewBox="0 0 {width} {height + 40}" '
             f'role="img" aria-label="memory breakdown" {_FONT}>']
    for n, item in enumerate(items):
        w = plot * max(0, int(item["nbytes"])) / axis_max
        if w < 0.1:  # invisible at this scale; the legend and the table still list it
            continue
        title = escape(f"{item['label']}: {fmt_bytes(item['nbytes'])}")
        parts.append(f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" fill="{item_colour(item, n)}">'
                     f"<title>{title}</title></rect>")
        x += w
    if total:
        tx = left + plot * total / axis_max
        parts.append(f'<line x1="{tx:.1f}" y1="0" x2="{tx:.1f}" y2="{height + 4}" stroke="#222" stroke-width="2"/>')
    parts.append(f'<line x1="{left}" y1="{height}" x2="{left + plot}" y2="{height}" stroke="#888"/>')
    for value in values:
        tx = left + plot * value * scale / axis_max
        parts.append(f'<line x1="{tx:.1f}" y1="{height}" x2="{tx:.1f}" y2="{height + 5}" stroke="#888"/>')
        parts.append(f'<text x="{tx:.1f}" y="{height + 18}" font-size="11" text-anchor="middle">'
                     f"{value:g} {unit}</text>")
    if total:
        parts.append(f'<text x="{left + plot * total / axis_max:.1f}" y="{height + 34}" font-size="11" '
                     f'text-anchor="end">{escape(total_label)} {escape(fmt_bytes(total))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def legend(items: list[dict[str, Any]]) -> str:
    return " ".join(f'<span class="key"><svg width="10" height="10"><rect width="10" height="10" '
                    f'fill="{item_colour(item, n)}"/></svg> {escape(item["label"])}: '
                    f'{escape(fmt_bytes(item["nbytes"]))}</span>' for n, item in enumerate(items))


def _marker_lines(markers: Sequence[tuple[int, str, str]], xs: Sequence[float], *, head: float, base: float,
                  right_edge: float) -> list[str]:
    """A dashed vertical line per marker at ``xs``, labelled beside it (to its left past ``right_edge``)."""
    parts = []
    for n, ((_, label, kind), x) in enumerate(zip(markers, xs, strict=True)):
        colour = MARKER_COLOURS.get(kind, "#666")
        anchor = "end" if x > right_edge else "start"
        dx = -4 if anchor == "end" else 4
        parts.append(f'<line x1="{x:.1f}" y1="{head}" x2="{x:.1f}" y2="{base}" stroke="{colour}" '
                     f'stroke-width="1.5" stroke-dasharray="5,3"/>')
        parts.append(f'<text x="{x + dx:.1f}" y="{head + 14 + 14 * n}" font-size="11" fill="{colour}" '
                     f'text-anchor="{anchor}" {_HALO}>{escape(label.replace("`", ""))}</text>')
    return parts


def timeline_chart(rows: list[dict[str, Any]], series: list[tuple[str, str]],
                   markers: Sequence[tuple[int, str, str]] = (), width: int = 900, height: int = 300) -> str:
    """Lines of ``series`` ((key, label) pairs) over the step records, with byte ticks on the y axis,
    step ticks on the x axis and a labelled vertical line per marker ((step, label, kind) triples,
    kind "leak" or "oom"); empty string without data."""
    points = {key: [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int)] for key, _ in series}
    points = {k: v for k, v in points.items() if v}
    if not points:
        return ""
    steps = [s for v in points.values() for s, _ in v] + [m[0] for m in markers]
    s0, s1 = min(steps), max(steps)
    values, unit, scale = byte_ticks(max(b for v in points.values() for _, b in v) or 1)
    top = values[-1] * scale
    left, right, head, foot = 78, 24, 34, 44  # room for tick labels, legend above, step axis below
    plot_w, plot_h = width - left - right, height - head - foot

    def px(step: int) -> float:
        return left + plot_w * ((step - s0) / (s1 - s0) if s1 > s0 else 0.5)

    def py(value: float) -> float:
        return head + plot_h * (1 - value / top)

    base = head + plot_h
    parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="memory per step" {_FONT}>']
    for value in values:  # y axis: gridline, tick and label per round value
        y = py(value * scale)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<line x1="{left - 5}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}" stroke="#888"/>')
        parts.append(f'<text x="{left - 8}" y="{y + 4:.1f}" font-size="11" text-anchor="end">'
                     f"{value:g} {unit}</text>")
    for step in step_ticks(s0, s1):  # x axis
        x = px(step)
        parts.append(f'<line x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 5}" stroke="#888"/>')
        parts.append(f'<text x="{x:.1f}" y="{base + 18}" font-size="11" text-anchor="middle">{step}</text>')
    parts.append(f'<line x1="{left}" y1="{base}" x2="{width - right}" y2="{base}" stroke="#888"/>')
    parts.append(f'<line x1="{left}" y1="{head}" x2="{left}" y2="{base}" stroke="#888"/>')
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" font-size="12" text-anchor="middle">step</text>')
    parts.append(f'<text x="14" y="{head + plot_h / 2:.1f}" font-size="12" text-anchor="middle" '
                 f'transform="rotate(-90 14 {head + plot_h / 2:.1f})">memory ({unit})</text>')
    parts.extend(_marker_lines(markers, [px(m[0]) for m in markers], head=head, base=base,
                               right_edge=left + plot_w * 0.8))
    labels = dict(series)
    for n, (key, pts) in enumerate(points.items()):
        colour = PALETTE[n % len(PALETTE)]
        path = " ".join(f"{px(s):.1f},{py(b):.1f}" for s, b in pts)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.8" points="{path}">'
                     f"<title>{escape(labels[key])}</title></polyline>")
        if len(pts) < 3:  # too few points for a line to show
            parts.extend(f'<circle cx="{px(s):.1f}" cy="{py(b):.1f}" r="3" fill="{colour}"/>' for s, b in pts)
        parts.append(f'<rect x="{left + 10 + 160 * n}" y="{head - 24}" width="14" height="4" fill="{colour}"/>')
        parts.append(f'<text x="{left + 28 + 160 * n}" y="{head - 18}" font-size="12">{escape(labels[key])}</text>')
    parts.append("</svg>")
    return "".join(parts)
