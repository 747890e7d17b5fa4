"""Outcome pictures of ``dynstate serve``, inline SVG like :mod:`.chart`: rows per pass-rate
band after each step (from :meth:`dynstate.history.outcomes.OutcomeViews.band_series`) and one
row's pass rate over its steps (from ``row_steps``). Markup only: the numbers are the
library's."""

from __future__ import annotations

from typing import Any
from xml.sax.saxutils import escape, quoteattr

from ..records.aggregate import pass_rate
from .svg import fmt, grid, ticks


def band_color(i: int, bins: int) -> str:
    """Red for the band of the hardest rows through amber to green for the easiest."""
    t = i / max(bins - 1, 1)
    hue = 120 * t
    return f"hsl({hue:.0f}, 62%, {46 + 6 * (1 - abs(2 * t - 1)):.0f}%)"


def _band_label(band: dict[str, Any], last: bool) -> str:
    closing = "]" if last else ")"
    return f"[{band['low']:.0%}, {band['high']:.0%}{closing}"


def band_svg(
    series: dict[str, Any],
    *,
    width: int = 960,
    title: str = "trained rows per pass-rate band after each step",
    css: str = "bands",
) -> str:
    """One stacked column per step kept: the rows in each band (``series``: ``steps``,
    ``counts`` per step, ``bins`` and ``bands``), the hardest band at the bottom."""
    steps, counts = series["steps"], series["counts"]
    if not steps:
        return '<p class="empty">no outcomes recorded</p>'
    bins = series["bins"]
    left, right, top, plot_h = 64, 16, 12, 220
    height = top + plot_h + 40
    plot_w = width - left - right
    most = max(1, max(sum(c) for c in counts))
    col = plot_w / len(steps)
    out = [
        f'<svg class="{css}" role="img" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
    ]
    for t in ticks(0, most, 4, whole=True):
        out.append(grid(left, width - right, top + plot_h - t / most * plot_h, t))
    out.append(
        f'<text class="axis-label" x="14" y="{top + plot_h / 2:.1f}" '
        f'transform="rotate(-90 14 {top + plot_h / 2:.1f})" text-anchor="middle">rows</text>'
    )
    for k, (step, column) in enumerate(zip(steps, counts, strict=True)):
        x = left + k * col
        y = top + plot_h
        out.append(f'<g class="step" data-step="{step}">')
        for i, n in enumerate(column):
            if not n:
                continue
            h = n / most * plot_h
            y -= h
            label = _band_label(series["bands"][i], i == bins - 1)
            tip = f"step {step}: {n:,} row{'' if n == 1 else 's'} with pass rate {label}"
            out.append(
                f'<rect class="band band-{i}" x="{x:.2f}" y="{y:.2f}" '
                f'width="{max(col - (1 if col > 3 else 0), 0.5):.2f}" height="{h:.2f}" '
                f'fill="{band_color(i, bins)}" data-rows="{n}"><title>{escape(tip)}</title></rect>'
            )
        out.append("</g>")
    for t in ticks(steps[0], steps[-1], 8, whole=True):
        # the column of the first step kept at or after the tick
        k = next((j for j, s in enumerate(steps) if s >= t), len(steps) - 1)
        x = left + (k + 0.5) * col
        out.append(
            f'<text class="tick" x="{x:.1f}" y="{top + plot_h + 16}" '
            f'text-anchor="middle">{fmt(t)}</text>'
        )
    out.append(
        f'<text class="axis-label" x="{left + plot_w / 2:.1f}" y="{height - 6}" '
        'text-anchor="middle">step</text>'
    )
    out.append("</svg>")
    return "".join(out)


def pass_rate_svg(points: list[dict[str, Any]], total: int, *, width: int = 720) -> str:
    """A row's pass rate through each step it was trained at (line) and each step's own
    share of successes (dots): ``points`` are the steps drawn (``OutcomeViews.row_steps``'s
    ``chart``: all of the row's ``total`` steps, or as many evenly spaced ones as a page
    draws), so the picture's size is bounded whatever the history."""
    if not points:
        return ""
    left, right, top, plot_h = 48, 16, 10, 140
    height = top + plot_h + 36
    plot_w = width - left - right
    x0, x1 = points[0]["step"], points[-1]["step"]
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1

    def sx(step: float) -> float:
        return left + (step - x0) / (x1 - x0) * plot_w

    def sy(rate: float) -> float:
        return top + plot_h - rate * plot_h

    out = [
        f'<svg class="pass-rate" role="img" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg">',
        "<title>pass rate over the steps this row was trained at"
        + (
            f" ({len(points):,} of its {total:,} steps, evenly spaced)"
            if total > len(points)
            else ""
        )
        + "</title>",
    ]
    for t in (0, 0.5, 1):
        y = sy(t)
        out.append(
            f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{t:.0%}</text>'
        )
    line = " ".join(f"{sx(p['step']):.1f},{sy(p['pass_rate']):.1f}" for p in points)
    out.append(
        f'<polyline class="rate" fill="none" stroke="#2e8b57" stroke-width="2" points="{line}"/>'
    )
    for p in points:
        own = float(pass_rate(p["successes"], p["attempts"]))
        tip = (
            f"step {p['step']}: {p['successes']}/{p['attempts']} passed; "
            f"pass rate so far {p['pass_rate']:.0%}"
        )
        out.append(
            f'<circle class="step-rate" cx="{sx(p["step"]):.1f}" cy="{sy(own):.1f}" r="3.5" '
            f'fill="#3b6fb6" data-step={quoteattr(str(p["step"]))}><title>{escape(tip)}</title>'
            "</circle>"
        )
    for t in ticks(x0, x1, 6, whole=True):
        out.append(
            f'<text class="tick" x="{sx(t):.1f}" y="{top + plot_h + 16}" '
            f'text-anchor="middle">{fmt(t)}</text>'
        )
    out.append(
        f'<text class="axis-label" x="{left + plot_w / 2:.1f}" y="{height - 4}" '
        'text-anchor="middle">step</text>'
    )
    out.append("</svg>")
    return "".join(out)


def filtered_svg(steps: list[dict[str, Any]], *, width: int = 960) -> str:
    """One column per step (``consumption_series``' ``steps``): the share of the groups it
    drew that the filter took out, 0 to 100 %; a step that drew nothing has no column."""
    if not steps:
        return ""
    left, right, top, plot_h = 64, 16, 12, 160
    height = top + plot_h + 40
    plot_w = width - left - right
    col = plot_w / len(steps)
    out = [
        f'<svg class="filtered" role="img" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg">',
        "<title>share of the groups drawn that the filter took out, per step</title>",
    ]
    for t in (0, 0.25, 0.5, 0.75, 1.0):
        y = top + plot_h - t * plot_h
        out.append(
            f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{t:.0%}</text>'
        )
    for k, entry in enumerate(steps):
        share = entry["filtered_share"]
        if share is None:
            continue
        h = share * plot_h
        tip = (
            f"step {entry['step']}: {entry['filtered']:,} of {entry['drawn']:,} groups drawn "
            f"filtered ({share:.0%}); {entry['trained']:,} trained, {entry['carry']:,} carried"
            + (f", {entry['in_flight']:,} in flight" if entry.get("in_flight") else "")
        )
        out.append(
            f'<rect class="share" x="{left + k * col:.2f}" y="{top + plot_h - h:.2f}" '
            f'width="{max(col - (1 if col > 3 else 0), 0.5):.2f}" height="{h:.2f}" '
            f'data-step="{entry["step"]}" data-filtered="{entry["filtered"]}" '
            f'data-drawn="{entry["drawn"]}"><title>{escape(tip)}</title></rect>'
        )
    first, last = steps[0]["step"], steps[-1]["step"]
    for t in ticks(first, last, 8, whole=True):
        k = next((j for j, e in enumerate(steps) if e["step"] >= t), len(steps) - 1)
        out.append(
            f'<text class="tick" x="{left + (k + 0.5) * col:.1f}" y="{top + plot_h + 16}" '
            f'text-anchor="middle">{fmt(t)}</text>'
        )
    out.append(
        f'<text class="axis-label" x="{left + plot_w / 2:.1f}" y="{height - 6}" '
        'text-anchor="middle">step</text>'
    )
    out.append("</svg>")
    return "".join(out)
