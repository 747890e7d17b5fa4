"""The growth chart of ``dynstate serve``, drawn on the server as inline SVG (no script, no
CDN): rows added per round and total rows over training steps, with the run's events marked.

The data is the library's model (:func:`dynstate.history.growth`, also what ``dynstate plot``
draws, and part of ``/api/store``); :func:`growth_svg` turns it into markup and computes
nothing the model lacks. The row lineage graph is :mod:`.graph`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from ..history.growth import buckets
from .svg import fmt, grid, ticks

__all__ = ["COLORS", "growth_svg"]

# Colours of the marks, also used by the legend and the stylesheet.
COLORS = {
    "bar": "#3b6fb6",
    "import": "#8fa9d6",
    "line": "#2e8b57",
    "reset": "#c0392b",
    "crash": "#222222",
    "compact": "#7f8c8d",
    "lost": "#e67e22",
    "empty": "#8e44ad",
    "missing": "#f5cba7",
}

# Markers drawn at most (a store can hold thousands of resets); the page's list has them all.
_MAX_MARKS = 300


def _tip(p: dict[str, Any], axis: str, extra: str = "") -> str:
    where = f"{axis} {fmt(p['x'])}"
    if p.get("placed"):
        where = f"after {where}" if p["kind"] != "import" else f"before step {fmt(p['x'] + 1)}"
    gen = f" ({p['generator']})" if p.get("generator") else ""
    name = "import" if p["kind"] == "import" else f"version {p['version']}"
    if p["kind"] == "import":
        name += f" (version {p['version']})"
    rows = "row" if p["rows_added"] == 1 else "rows"
    return f"{name}{extra}, {where}: +{p['rows_added']:,} {rows}{gen}"


def growth_svg(data: dict[str, Any], *, width: int = 960, link: str = "versions/") -> str:
    """Rows added per round (bars, top) and total rows (line, bottom) over the x axis, with the
    markers of the growth model. Bars link to their version's page. The scales are the
    model's: an import far larger than the rounds is drawn cut at the top with its number, so
    that the rounds keep a readable height."""
    points = data["points"]
    if not points:
        return '<p class="empty">No rounds yet.</p>'
    axis, scale = data["axis"], data["scale"]
    left, right, top, panel, gap = 64, 16, 26, 120, 26
    plot_w = width - left - right
    height = top + 2 * panel + gap + 44
    ghosts = [(g, m) for m in data["markers"] for g in m.get("abandoned_points") or []]
    xs = [p["x"] for p in points] + [g["x"] for g, _ in ghosts]
    xs += [m["x"] for m in data["markers"] if m["kind"] == "crash"]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (x1 - x0) * 0.02
    x0, x1 = x0 - pad, x1 + pad

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    bar_top = max(1, scale["bars"])
    lo, hi = scale["total"]
    hi = max(hi, lo + 1)
    y_bars, y_line = top, top + panel + gap
    base_y = y_line + panel

    def sy_total(v: float) -> float:
        return y_line + panel - (v - lo) / (hi - lo) * panel

    out = [
        f'<svg class="growth" role="img" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg" data-axis="{escape(axis)}">',
        f"<title>growth over {escape(axis)}s</title>",
    ]
    # More rounds than pixels: bars of buckets of whole steps, each the mean of its rounds.
    bucketed = buckets(data, plot_w // 3) if len(points) + len(ghosts) > plot_w // 2 else None
    if bucketed is not None and bucketed["size"] > 1:
        per = "step" if axis == "step" else "version"
        caption = (
            f"rows added per round: each bar the mean of the rounds in {bucketed['size']} "
            f"{per}s (hover for the count)"
        )
    else:
        caption = "rows added per round"
    out.append(
        f'<text class="axis-label bars-caption" x="{left}" y="{top - 8}">{escape(caption)}</text>'
    )
    # Axes and grid; the counts (rows, totals) take whole ticks only.
    out.append('<g class="bars-axis">')
    for t in ticks(0, bar_top, 4, whole=True):
        y = y_bars + panel - t / bar_top * panel
        out.append(grid(left, width - right, y, t))
    out.append('</g><g class="total-axis">')
    for t in ticks(lo, hi, 5, whole=True):
        out.append(grid(left, width - right, sy_total(t), t))
    out.append("</g>")
    for y0, label in ((y_bars, "rows added"), (y_line, "total rows")):
        out.append(
            f'<text class="axis-label" x="14" y="{y0 + panel / 2:.1f}" '
            f'transform="rotate(-90 14 {y0 + panel / 2:.1f})" text-anchor="middle">{label}</text>'
        )
    for t in ticks(min(xs), max(xs), 10, whole=True):
        out.append(
            f'<text class="tick x-tick" x="{sx(t):.1f}" y="{base_y + 16}" text-anchor="middle">'
            f"{fmt(t)}</text>"
        )
    out.append(
        f'<text class="axis-label" x="{left + plot_w / 2:.1f}" y="{base_y + 34}" '
        f'text-anchor="middle">{escape(axis)}</text>'
    )
    # Steps without a round: shaded bands behind everything.
    for m in data["markers"]:
        if m["kind"] == "missing":
            a, b = sx(m["x"] - 0.4), sx(m["x_end"] + 0.4)
            out.append(
                f'<rect class="mark-missing" x="{a:.1f}" y="{top}" width="{max(b - a, 2):.1f}" '
                f'height="{base_y - top}" fill="{COLORS["missing"]}" opacity="0.6">'
                f"<title>{escape(m['label'])}</title></rect>"
            )
    distinct = sorted(set(xs))
    gaps = [b - a for a, b in itertools.pairwise(distinct) if b > a]
    unit = min(gaps) if gaps else 1
    bar_w = max(1.0, min(24.0, 0.8 * unit / (x1 - x0) * plot_w))
    if bucketed is not None:
        out.extend(_bucket_bars(data, bucketed, sx, y_bars, panel, bar_top, link))
    else:
        out.extend(_bars(data, ghosts, sx, bar_w, y_bars, panel, bar_top, link))
    # Total rows along the lineage.
    path: list[str] = []
    stride = max(1, len(points) // plot_w)
    for i, p in enumerate(points):
        if i % stride and i != len(points) - 1 and p["kind"] != "reset":
            continue
        path.append(f"{'M' if not path else 'L'}{sx(p['x']):.1f},{sy_total(p['total_rows']):.1f}")
    out.append(
        f'<path class="total" d="{" ".join(path)}" fill="none" stroke="{COLORS["line"]}" '
        'stroke-width="2"/>'
    )
    totals = {p["version"]: p["total_rows"] for p in points}
    for m in data["markers"]:  # what a rollback abandoned: a dashed total off the lineage
        branch = m.get("abandoned_points") or []
        if branch:
            start = totals.get(m["version"], branch[0]["total_rows"] - branch[0]["rows_added"])
            d = [f"M{sx(m['x']):.1f},{sy_total(start):.1f}"]
            d += [f"L{sx(g['x']):.1f},{sy_total(g['total_rows']):.1f}" for g in branch]
            out.append(
                f'<path class="abandoned-total" d="{" ".join(d)}" fill="none" '
                f'stroke="{COLORS["reset"]}" stroke-width="1.5" stroke-dasharray="4,3" '
                'opacity="0.8"/>'
            )
    out.extend(_marks(data, sx, top, y_bars, panel, base_y, link))
    out.append("</svg>")
    return "".join(out)


def _bars(
    data: dict[str, Any],
    ghosts: list[tuple[dict[str, Any], dict[str, Any]]],
    sx: Callable[[float], float],
    bar_w: float,
    y0: float,
    panel: int,
    bar_top: int,
    link: str,
) -> list[str]:
    """One bar per round; rounds sharing an x (a step-less round placed by the step before,
    the abandoned round of a step made again) side by side within the step's width."""
    axis, clipped = data["axis"], set(data["scale"]["clipped"])
    drawn: list[tuple[dict[str, Any], dict[str, Any] | None]]
    drawn = [(p, None) for p in data["points"] if p["rows_added"] > 0]
    drawn += [(g, m) for g, m in ghosts if g["rows_added"] > 0]
    by_x: dict[float, list[tuple[dict[str, Any], dict[str, Any] | None]]] = {}
    for item in drawn:
        by_x.setdefault(item[0]["x"], []).append(item)
    out: list[str] = []
    labels: list[str] = []  # drawn last, over the bars they may cross
    for x, group in by_x.items():
        w = bar_w / len(group)
        for k, (p, reset) in enumerate(group):
            left = sx(x) - bar_w / 2 + k * w
            cut = p["version"] in clipped and reset is None
            h = panel if cut else max(1.0, min(1.0, p["rows_added"] / bar_top) * panel)
            y = y0 + panel - h
            href = quoteattr(f"{link}{p['version']}")
            if reset is not None:
                tip = _tip(p, axis, f" (abandoned by the reset in version {reset['version']})")
                out.append(
                    f'<a href={href}><rect class="mark-abandoned" x="{left:.1f}" y="{y:.1f}" '
                    f'width="{w:.1f}" height="{h:.1f}" fill="none" stroke="{COLORS["reset"]}" '
                    f'stroke-width="1.5" stroke-dasharray="3,2" data-version="{p["version"]}">'
                    f"<title>{escape(tip)}</title></rect></a>"
                )
                continue
            color = COLORS["import"] if p["kind"] == "import" else COLORS["bar"]
            out.append(
                f'<a href={href}><rect class="bar{" import" if p["kind"] == "import" else ""}" '
                f'x="{left:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{color}" '
                f'data-version="{p["version"]}" data-rows="{p["rows_added"]}">'
                f"<title>{escape(_tip(p, axis))}</title></rect></a>"
            )
            if cut:  # a break across the bar, and the number the bar stands for
                yb = y0 + 16
                out.append(
                    f'<path class="clip" d="M{left - 2:.1f},{yb + 3:.1f} L{left + w + 2:.1f},'
                    f'{yb - 3:.1f} M{left - 2:.1f},{yb + 8:.1f} L{left + w + 2:.1f},{yb + 2:.1f}" '
                    'stroke="white" stroke-width="2.5"/>'
                )
                labels.append(
                    f'<text class="mark-label clip-label" x="{left + w + 4:.1f}" y="{y0 + 10}" '
                    'stroke="white" stroke-width="3" paint-order="stroke">'
                    f"{p['rows_added']:,} rows (import, cut)</text>"
                )
    return out + labels


def _bucket_bars(
    data: dict[str, Any],
    bucketed: dict[str, Any],
    sx: Callable[[float], float],
    y0: float,
    panel: int,
    bar_top: int,
    link: str,
) -> list[str]:
    """More rounds than pixels: one bar per bucket of the model's :func:`buckets`, its height
    the bucket's mean rows per round on the same axis as one bar per round; the import is
    drawn on its own (cut when the model cuts it)."""
    axis, clipped = data["axis"], set(data["scale"]["clipped"])
    out = []
    for p in data["points"]:
        if p["kind"] != "import" or p["rows_added"] <= 0:
            continue
        cut = p["version"] in clipped
        h = panel if cut else max(1.0, min(1.0, p["rows_added"] / bar_top) * panel)
        href = quoteattr(f"{link}{p['version']}")
        out.append(
            f'<a href={href}><rect class="bar import" x="{sx(p["x"]) - 1:.1f}" '
            f'y="{y0 + panel - h:.1f}" width="2.4" height="{h:.1f}" fill="{COLORS["import"]}" '
            f'data-version="{p["version"]}" data-rows="{p["rows_added"]}">'
            f"<title>{escape(_tip(p, axis))}</title></rect></a>"
        )
        if cut:
            out.append(
                f'<text class="mark-label clip-label" x="{sx(p["x"]) + 4:.1f}" y="{y0 + 10}" '
                'stroke="white" stroke-width="3" paint-order="stroke">'
                f"{p['rows_added']:,} rows (import, cut)</text>"
            )
    size = bucketed["size"]
    for b in bucketed["buckets"]:
        if b["rows"] <= 0:
            continue
        h = max(1.0, min(1.0, b["mean"] / bar_top) * panel)
        a, z = b["x_from"], b["x_to"]
        left, right = sx(a - 0.5), sx(z + 0.5)
        w = max(1.0, 0.8 * (right - left))
        span = f"{axis}s {a}-{z}" if z > a else f"{axis} {a}"
        count = f"{b['rounds']} round{'s' if b['rounds'] != 1 else ''}"
        tip = (
            f"{span}: {b['mean']:,.4g} rows added per round, mean of {count} "
            f"(+{b['rows']:,} rows; versions {b['first']}-{b['last']})"
            if b["first"] != b["last"]
            else f"{span}: +{b['rows']:,} rows in 1 round (version {b['first']})"
        )
        href = quoteattr(f"{link}{b['last']}")
        out.append(
            f'<a href={href}><rect class="bar bucket" x="{(left + right - w) / 2:.1f}" '
            f'y="{y0 + panel - h:.3f}" width="{w:.1f}" height="{h:.3f}" fill="{COLORS["bar"]}" '
            f'data-first="{b["first"]}" data-last="{b["last"]}" data-rounds="{b["rounds"]}" '
            f'data-rows="{b["rows"]}" data-mean="{b["mean"]:.6g}" data-size="{size}">'
            f"<title>{escape(tip)}</title></rect></a>"
        )
    return out


def _marks(
    data: dict[str, Any],
    sx: Callable[[float], float],
    top: float,
    y_bars: float,
    panel: int,
    base_y: float,
    link: str,
) -> list[str]:
    out = []
    shown = 0
    for m in data["markers"]:
        if m["kind"] == "missing":
            continue
        shown += 1
        if shown > _MAX_MARKS:
            break
        x = sx(m["x"])
        color = COLORS[m["kind"]]
        tip = f"version {m['version']}: {m['label']}"
        href = quoteattr(f"{link}{m['version']}")
        if m["kind"] in ("reset", "compact", "crash"):
            dash = {"reset": "5,3", "compact": "2,3", "crash": "1,2"}[m["kind"]]
            name = "rollback" if m.get("rollback") else m["kind"]
            # Labels of a crash and the rollback after it would overlap: the crash's goes low.
            y_text = top + 10 if m["kind"] != "crash" else base_y - 4
            out.append(
                f'<a href={href}><g class="mark-{m["kind"]}"><line x1="{x:.1f}" x2="{x:.1f}" '
                f'y1="{top}" y2="{base_y}" stroke="{color}" stroke-width="2" '
                f'stroke-dasharray="{dash}" pointer-events="none"/>'
                f'<text x="{x + 3:.1f}" y="{y_text}" fill="{color}" class="mark-label">'
                f"{name}</text><title>{escape(tip)}</title></g></a>"
            )
        else:
            y = y_bars + panel
            shape = (
                f'<path d="M{x - 5:.1f},{y:.1f} L{x + 5:.1f},{y:.1f} L{x:.1f},{y - 9:.1f} Z" '
                f'fill="{color}"/>'
                if m["kind"] == "lost"
                else f'<circle cx="{x:.1f}" cy="{y - 4:.1f}" r="4" fill="white" '
                f'stroke="{color}" stroke-width="2"/>'
            )
            out.append(
                f'<a href={href}><g class="mark-{m["kind"]}">{shape}'
                f"<title>{escape(tip)}</title></g></a>"
            )
    return out
