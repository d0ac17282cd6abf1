"""Charts drawn on the server as inline SVG: lines over versions or time, and histograms (pure).

Why SVG from the server rather than a JavaScript charting library: the pages are rendered on the
server anyway, an inline ``<svg>`` needs no build step, no vendored bundle and no network (the
console works offline and under a ``script-src 'self'`` policy), it draws with scripts off, and
every label goes through the same escaping as the rest of the page. The console's data is small
(a point per version, a bar per staleness step), which is where SVG is at its best.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from markupsafe import Markup, escape

#: Series colours, in order (colour-blind safe: Okabe-Ito).
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00")


def _fmt(value: float) -> str:
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.3g}"
    return f"{value:.2e}"


def _span(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if lo == hi:
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    return lo, hi


def _open(title: str, width: int, height: int) -> str:
    return (f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
            f'aria-label="{escape(title)}"><title>{escape(title)}</title>')


def _empty(head: str, width: int, height: int) -> Markup:
    return Markup(head + f'<text x="{width // 2}" y="{height // 2}" text-anchor="middle" class="empty">'
                  f'no data yet</text></svg>')


def line_chart(series: dict[str, Sequence[tuple[float, float | None]]], *, title: str, x_label: str,
               y_label: str, width: int = 640, height: int = 240) -> Markup:
    """Lines of ``(x, y)`` points, one per named series (``y`` None: a gap), with axes and a legend."""
    points = [(x, y) for pts in series.values() for x, y in pts if y is not None and math.isfinite(y)]
    head = _open(title, width, height)
    if not points:
        return _empty(head, width, height)
    left, right, top, bottom = 56, 12, 24, 36
    x0, x1 = _span([p[0] for p in points])
    y0, y1 = _span([p[1] for p in points])

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y: float) -> float:
        return height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)

    parts = [head, f'<text x="{left}" y="14" class="chart-title">{escape(title)}</text>',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" class="axis"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" class="axis"/>']
    for y in (y0, (y0 + y1) / 2, y1):
        parts.append(f'<text x="{left - 4}" y="{sy(y) + 4:.1f}" text-anchor="end" class="tick">{escape(_fmt(y))}</text>')
    for x in (x0, x1):
        parts.append(f'<text x="{sx(x):.1f}" y="{height - bottom + 14}" text-anchor="middle" class="tick">'
                     f'{escape(_fmt(x))}</text>')
    parts.append(f'<text x="{(left + width - right) / 2:.0f}" y="{height - 4}" text-anchor="middle" class="label">'
                 f'{escape(x_label)}</text>')
    parts.append(f'<text x="12" y="{(top + height - bottom) / 2:.0f}" text-anchor="middle" class="label" '
                 f'transform="rotate(-90 12 {(top + height - bottom) / 2:.0f})">{escape(y_label)}</text>')
    for i, (name, pts) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        runs: list[list[str]] = [[]]
        for x, y in sorted(pts, key=lambda p: p[0]):
            if y is None or not math.isfinite(y):
                runs.append([])
                continue
            runs[-1].append(f"{sx(x):.1f},{sy(y):.1f}")
        for run in runs:
            if len(run) > 1:
                parts.append(f'<polyline points="{" ".join(run)}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
            elif run:
                cx, cy = run[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{colour}"/>')
        lx = width - right - 150
        ly = top + 4 + 14 * i
        parts.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{lx + 14}" y="{ly + 1}" class="legend">{escape(name)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def bar_chart(bars: Sequence[tuple[str, float]], *, title: str, x_label: str, y_label: str,
              width: int = 420, height: int = 200) -> Markup:
    """One bar per ``(label, value)`` (value >= 0), labelled below, with the largest value on the axis."""
    head = _open(title, width, height)
    if not bars:
        return _empty(head, width, height)
    left, right, top, bottom = 48, 8, 24, 36
    top_value = max(v for _, v in bars) or 1.0
    slot = (width - left - right) / len(bars)
    parts = [head, f'<text x="{left}" y="14" class="chart-title">{escape(title)}</text>',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" class="axis"/>',
             f'<text x="{left - 4}" y="{top + 4}" text-anchor="end" class="tick">{escape(_fmt(top_value))}</text>',
             f'<text x="{left - 4}" y="{height - bottom}" text-anchor="end" class="tick">0</text>']
    for i, (label, value) in enumerate(bars):
        h = max(0.0, value) / top_value * (height - top - bottom)
        x = left + i * slot + slot * 0.1
        parts.append(f'<rect x="{x:.1f}" y="{height - bottom - h:.1f}" width="{slot * 0.8:.1f}" height="{h:.1f}" '
                     f'fill="{COLOURS[0]}"><title>{escape(label)}: {escape(_fmt(value))}</title></rect>')
        parts.append(f'<text x="{x + slot * 0.4:.1f}" y="{height - bottom + 14}" text-anchor="middle" class="tick">'
                     f'{escape(label)}</text>')
    parts.append(f'<text x="{(left + width - right) / 2:.0f}" y="{height - 4}" text-anchor="middle" class="label">'
                 f'{escape(x_label)}</text>')
    parts.append(f'<text x="10" y="{(top + height - bottom) / 2:.0f}" text-anchor="middle" class="label" '
                 f'transform="rotate(-90 10 {(top + height - bottom) / 2:.0f})">{escape(y_label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
