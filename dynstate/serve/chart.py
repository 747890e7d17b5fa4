"""Pictures of ``dynstate serve``, drawn on the server as inline SVG (no script, no CDN): the
growth of a store over training steps, and the lineage graph of one row.

:func:`growth` is the data (it is part of ``/api/store``); :func:`growth_svg` and
:func:`graph_svg` turn data into markup.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from ..errors import DynstateError
from ..history import lineage
from ..manifest import Commit
from ..store import Store

# Colours of the marks, also used by the legend and the stylesheet.
COLORS = {
    "bar": "#3b6fb6",
    "line": "#2e8b57",
    "reset": "#c0392b",
    "compact": "#7f8c8d",
    "lost": "#e67e22",
    "empty": "#8e44ad",
    "missing": "#f5cba7",
}


# Rounds of an abandoned branch read for the chart, per reset (a far reset abandons many).
_ABANDONED_POINTS = 200


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def growth(store: Store, chain: Sequence[Commit], floor: int) -> dict[str, Any]:
    """One point per version of a lineage (``chain``, oldest first), with what happened to
    the data marked: resets (rollbacks) and the rounds they abandoned, compactions, rounds
    recorded as lost, empty rounds, and steps with no round at all."""
    appends = [r for r in chain if r.op == "append"]
    by_step = bool(appends) and all(_number(r.meta.get("step")) for r in appends)
    points: list[dict[str, Any]] = []
    markers: list[dict[str, Any]] = []
    x: float = 0
    last_step: Any = None
    for record in chain:
        if record.version == 0 and record.num_rows == 0:
            continue  # the empty root version
        meta = record.meta
        step = meta.get("step")
        x = (step if _number(step) else x) if by_step else record.version
        kind = record.op
        if record.op == "append":
            if meta.get("lost"):
                kind = "lost"
            elif record.rows_added == 0:
                kind = "empty"
            else:
                kind = "round"
        point = {
            "version": record.version,
            "x": x,
            "op": record.op,
            "kind": kind,
            "rows_added": record.rows_added,
            "total_rows": record.num_rows,
            "step": step,
            "generator": meta.get("generator"),
            "created": record.created,
        }
        points.append(point)
        if kind in ("lost", "empty"):
            label = "lost round" if kind == "lost" else "empty round"
            if meta.get("error"):
                label += f" (generator failed: {str(meta['error'])[:120]})"
            markers.append({"kind": kind, "version": record.version, "x": x, "label": label})
        elif record.op == "reset":
            markers.append(_reset_marker(store, record, x, by_step))
        elif record.op == "compact":
            markers.append(
                {
                    "kind": "compact",
                    "version": record.version,
                    "x": x,
                    "label": f"compaction: {record.num_shards} shards",
                }
            )
        if by_step and record.op == "append" and isinstance(step, int):
            if isinstance(last_step, int) and step > last_step + 1:
                missing = list(range(last_step + 1, step))
                markers.append(
                    {
                        "kind": "missing",
                        "version": record.version,
                        "x": last_step + 1,
                        "x_end": step - 1,
                        "steps": missing[:100],
                        "label": f"no round for step {_span(missing)}",
                    }
                )
            last_step = step
    return {"axis": "step" if by_step else "version", "floor": floor, "points": points,
            "markers": markers}  # fmt: skip


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _reset_marker(store: Store, record: Commit, x: float, by_step: bool) -> dict[str, Any]:
    """A reset, with the branch it abandoned: the rounds a crashed run committed after its
    checkpoint (up to :data:`_ABANDONED_POINTS` of them, newest last)."""
    target = record.target
    before = record.meta.get("rollback_from", record.parent)
    dropped = None
    try:
        dropped = store.commit_record(int(before)).num_rows - record.num_rows
    except (DynstateError, TypeError, ValueError):
        pass  # the abandoned head was collected: the count is unknown, the reset is not
    abandoned = [target + 1, record.version - 1] if target is not None else None
    label = f"reset to version {target}"
    if abandoned and abandoned[0] <= abandoned[1]:
        label += f"; versions {abandoned[0]}-{abandoned[1]} abandoned"
    if dropped:
        label += f" ({dropped} rows dropped)"
    return {
        "kind": "reset",
        "version": record.version,
        "x": x,
        "target": target,
        "abandoned": abandoned,
        "rows_dropped": dropped,
        "abandoned_points": _branch(store, record, by_step, x),
        "label": label,
    }


def _branch(store: Store, reset: Commit, by_step: bool, x: float) -> list[dict[str, Any]]:
    """The versions a reset left, from the one after its target up to its parent, along the
    parent's lineage, oldest first."""
    if reset.target is None or reset.parent is None or reset.parent <= reset.target:
        return []
    points = []
    try:
        branch = itertools.islice(lineage(store, reset.parent, reset.target + 1), _ABANDONED_POINTS)
        records = [store.commit_record(v) for v in branch]
    except DynstateError:
        return []  # collected by gc: the reset's label still says what it dropped
    for record in reversed(records):
        step = record.meta.get("step")
        x = (step if _number(step) else x) if by_step else record.version
        points.append(
            {
                "version": record.version,
                "x": x,
                "op": record.op,
                "rows_added": record.rows_added,
                "total_rows": record.num_rows,
                "step": step,
                "generator": record.meta.get("generator"),
            }
        )
    return points


# -- SVG -------------------------------------------------------------------------------------


def _ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    out = []
    v = first
    while v <= hi + 1e-9:
        out.append(v)
        v += step
    return out


def _fmt(v: float) -> str:
    if abs(v) >= 1e6:
        return f"{v / 1e6:g}M"
    if abs(v) >= 1e4:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def growth_svg(data: dict[str, Any], *, width: int = 960, link: str = "versions/") -> str:
    """Rows added per round (bars, top) and total rows (line, bottom) over the x axis, with
    the markers of :func:`growth`. Bars link to their version's page."""
    points = data["points"]
    if not points:
        return '<p class="empty">No rounds yet.</p>'
    left, right, top, panel, gap = 64, 16, 12, 120, 26
    plot_w = width - left - right
    height = top + 2 * panel + gap + 44
    ghosts = [g for m in data["markers"] for g in m.get("abandoned_points") or []]
    xs = [p["x"] for p in [*points, *ghosts]]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (x1 - x0) * 0.02
    x0, x1 = x0 - pad, x1 + pad

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    max_added = max(1, max(p["rows_added"] for p in [*points, *ghosts]))
    max_total = max(1, max(p["total_rows"] for p in [*points, *ghosts]))
    y_bars = top
    y_line = top + panel + gap
    out = [
        f'<svg class="growth" role="img" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>growth over {escape(data['axis'])}s</title>",
    ]
    # Axes and grid.
    for y0, vmax, label in ((y_bars, max_added, "rows added"), (y_line, max_total, "total rows")):
        for t in _ticks(0, vmax, 4):
            y = y0 + panel - t / vmax * panel
            out.append(
                f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
                f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
                f"{_fmt(t)}</text>"
            )
        out.append(
            f'<text class="axis-label" x="14" y="{y0 + panel / 2:.1f}" '
            f'transform="rotate(-90 14 {y0 + panel / 2:.1f})" text-anchor="middle">{label}</text>'
        )
    base_y = y_line + panel
    for t in _ticks(min(xs), max(xs), 10):
        out.append(
            f'<text class="tick" x="{sx(t):.1f}" y="{base_y + 16}" text-anchor="middle">'
            f"{_fmt(t)}</text>"
        )
    out.append(
        f'<text class="axis-label" x="{left + plot_w / 2:.1f}" y="{base_y + 34}" '
        f'text-anchor="middle">{escape(data["axis"])}</text>'
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
    # Bars: one per round, or per bucket when there are more rounds than pixels to show them.
    distinct = sorted(set(xs))
    gaps = [b - a for a, b in itertools.pairwise(distinct) if b > a]
    unit = min(gaps) if gaps else 1
    bar_w = max(1.0, min(24.0, 0.8 * unit / (x1 - x0) * plot_w))
    if len(points) > plot_w // 2:
        out.extend(_bucket_bars(points, sx, x0, x1, plot_w, y_bars, panel, max_added))
    else:
        for p in points:
            if p["rows_added"] <= 0:
                continue
            h = max(1.0, p["rows_added"] / max_added * panel)
            tip = (
                f"version {p['version']}, {data['axis']} {_fmt(p['x'])}: +{p['rows_added']} rows"
                + (f" ({p['generator']})" if p["generator"] else "")
            )
            href = quoteattr(f"{link}{p['version']}")
            out.append(
                f'<a href={href}><rect class="bar" '
                f'x="{sx(p["x"]) - bar_w / 2:.1f}" y="{y_bars + panel - h:.1f}" '
                f'width="{bar_w:.1f}" height="{h:.1f}" fill="{COLORS["bar"]}" '
                f'data-version="{p["version"]}"><title>{escape(tip)}</title></rect></a>'
            )
    # Total rows along the lineage.
    path = []
    stride = max(1, len(points) // plot_w)
    for i, p in enumerate(points):
        if i % stride and i != len(points) - 1 and points[i]["kind"] != "reset":
            continue
        y = y_line + panel - p["total_rows"] / max_total * panel
        path.append(f"{'M' if not path else 'L'}{sx(p['x']):.1f},{y:.1f}")
    out.append(
        f'<path class="total" d="{" ".join(path)}" fill="none" stroke="{COLORS["line"]}" '
        'stroke-width="2"/>'
    )
    out.extend(_ghosts(data, sx, y_bars, y_line, panel, max_added, max_total, bar_w, link))
    # Markers.
    shown = 0
    for m in data["markers"]:
        if m["kind"] == "missing":
            continue
        shown += 1
        if shown > 300:
            break
        x = sx(m["x"])
        color = COLORS[m["kind"]]
        tip = f"version {m['version']}: {m['label']}"
        href = quoteattr(f"{link}{m['version']}")
        if m["kind"] in ("reset", "compact"):
            dash = "5,3" if m["kind"] == "reset" else "2,3"
            out.append(
                f'<a href={href}><g class="mark-{m["kind"]}"><line x1="{x:.1f}" x2="{x:.1f}" '
                f'y1="{top}" y2="{base_y}" stroke="{color}" stroke-width="2" '
                f'stroke-dasharray="{dash}" pointer-events="none"/>'
                f'<text x="{x + 3:.1f}" y="{top + 10}" '
                f'fill="{color}" class="mark-label">'
                f"{'reset' if m['kind'] == 'reset' else 'compact'}</text>"
                f"<title>{escape(tip)}</title></g></a>"
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
    out.append("</svg>")
    return "".join(out)


def _ghosts(
    data: dict[str, Any],
    sx: Any,
    y_bars: float,
    y_line: float,
    panel: int,
    max_added: int,
    max_total: int,
    bar_w: float,
    link: str,
) -> list[str]:
    """Rounds a rollback abandoned, off the lineage: outlined bars and a dashed total line from
    the version the reset went back to, so the data lost around a crash stays visible."""
    color = COLORS["reset"]
    totals = {p["version"]: p["total_rows"] for p in data["points"]}
    bars = len(data["points"]) <= 440
    out = []
    for m in data["markers"]:
        ghost = m.get("abandoned_points") or []
        if not ghost:
            continue
        base = totals.get(m["version"], ghost[0]["total_rows"] - ghost[0]["rows_added"])
        y0 = y_line + panel - base / max_total * panel
        path = [f"M{sx(m['x']):.1f},{y0:.1f}"]
        for g in ghost:
            path.append(
                f"L{sx(g['x']):.1f},{y_line + panel - g['total_rows'] / max_total * panel:.1f}"
            )
            if bars and g["rows_added"] > 0:
                h = max(1.0, g["rows_added"] / max_added * panel)
                tip = f"version {g['version']} (abandoned by the reset in version {m['version']}): "
                tip += f"+{g['rows_added']} rows" + (
                    f" ({g['generator']})" if g["generator"] else ""
                )
                href = quoteattr(f"{link}{g['version']}")
                out.append(
                    f'<a href={href}><rect class="mark-abandoned" x="{sx(g["x"]) - bar_w / 2:.1f}" '
                    f'y="{y_bars + panel - h:.1f}" width="{bar_w:.1f}" height="{h:.1f}" '
                    f'fill="none" stroke="{color}" stroke-width="1.5" stroke-dasharray="3,2">'
                    f"<title>{escape(tip)}</title></rect></a>"
                )
        out.append(
            f'<path class="abandoned-total" d="{" ".join(path)}" fill="none" stroke="{color}" '
            'stroke-width="1.5" stroke-dasharray="4,3" opacity="0.8"/>'
        )
    return out


def _bucket_bars(
    points: list[dict[str, Any]],
    sx: Any,
    x0: float,
    x1: float,
    plot_w: int,
    y0: float,
    panel: int,
    max_added: int,
) -> list[str]:
    buckets = plot_w // 3
    sums: dict[int, list[Any]] = {}
    for p in points:
        b = min(buckets - 1, int((p["x"] - x0) / (x1 - x0) * buckets))
        entry = sums.setdefault(b, [0, 0, p["version"], p["version"]])
        entry[0] += p["rows_added"]
        entry[1] += 1
        entry[3] = p["version"]
    peak = max(1, max(e[0] for e in sums.values()))
    out = []
    for b, (added, rounds, first, last) in sorted(sums.items()):
        if added <= 0:
            continue
        h = max(1.0, added / peak * panel)
        x = x0 + (b + 0.5) / buckets * (x1 - x0)
        tip = f"versions {first}-{last}: +{added} rows in {rounds} versions"
        out.append(
            f'<rect class="bar" x="{sx(x) - 1:.1f}" y="{y0 + panel - h:.1f}" width="2.4" '
            f'height="{h:.1f}" fill="{COLORS["bar"]}"><title>{escape(tip)}</title></rect>'
        )
    return out


def graph_svg(detail: dict[str, Any], *, link: str, width: int = 960) -> str:
    """The row, its ancestors above and its descendants below, joined by source edges; each
    node links to its row page (``link`` + row number)."""
    row = detail["row"]
    layers: dict[int, list[dict[str, Any]]] = {0: [{"row": row, "step": None, "preview": ""}]}
    round_info = detail.get("round") or {}
    layers[0][0].update({"step": round_info.get("step"), "generator": round_info.get("generator")})
    for node in detail["ancestors"]:
        layers.setdefault(-node["depth"], []).append(node)
    for node in detail["descendants"]:
        layers.setdefault(node["depth"], []).append(node)
    per_layer = 7
    box_w, box_h, layer_h = 118, 38, 74
    order = sorted(layers)
    height = len(order) * layer_h + 10
    pos: dict[int, tuple[float, float]] = {}
    out = [
        f'<svg class="lineage" role="img" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg">',
        "<title>lineage</title>",
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        'fill="#888"/></marker></defs>',
    ]
    boxes = []
    for li, depth in enumerate(order):
        nodes = sorted(layers[depth], key=lambda n: n["row"])
        extra = len(nodes) - per_layer
        nodes = nodes[:per_layer]
        slots = len(nodes) + (1 if extra > 0 else 0)
        y = 6 + li * layer_h
        for ni, node in enumerate(nodes):
            x = (ni + 0.5) * width / slots - box_w / 2
            pos[node["row"]] = (x + box_w / 2, y)
            cls = "node self" if depth == 0 else ("node up" if depth < 0 else "node down")
            sub = f"step {node.get('step')}" if node.get("step") is not None else ""
            if node.get("generator"):
                sub += f" · {node['generator']}"
            tip = f"row {node['row']}" + (f": {node['preview']}" if node.get("preview") else "")
            href = quoteattr(f"{link}{node['row']}")
            boxes.append(
                f'<a href={href} data-row="{node["row"]}">'
                f'<g class="{cls}"><rect x="{x:.1f}" y="{y}" width="{box_w}" height="{box_h}" '
                f'rx="6"/><text x="{x + box_w / 2:.1f}" y="{y + 16}" text-anchor="middle" '
                f'class="node-title">row {node["row"]}</text><text x="{x + box_w / 2:.1f}" '
                f'y="{y + 31}" text-anchor="middle" class="node-sub">{escape(sub[:22])}</text>'
                f"<title>{escape(tip)}</title></g></a>"
            )
        if extra > 0:
            x = (slots - 0.5) * width / slots
            boxes.append(
                f'<text x="{x:.1f}" y="{y + 24}" text-anchor="middle" class="node-more">'
                f"+{extra} more</text>"
            )
    for src, child in detail["edges"]:
        if src in pos and child in pos:
            (xa, ya), (xb, yb) = pos[src], pos[child]
            if ya < yb:
                y1, y2 = ya + box_h, yb
            else:
                y1, y2 = ya, yb + box_h
            out.append(
                f'<line class="edge" x1="{xa:.1f}" y1="{y1:.1f}" x2="{xb:.1f}" y2="{y2:.1f}" '
                'stroke="#888" marker-end="url(#arrow)"/>'
            )
    out.extend(boxes)
    out.append("</svg>")
    return "".join(out)
