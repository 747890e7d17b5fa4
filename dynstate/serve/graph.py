"""The lineage graph of one row in ``dynstate serve``: the rows it was derived from (its
``_dynstate_source`` column, followed upwards), the rows derived from it (the version's
:class:`~dynstate.serve.lineage.DescendantIndex`), both bounded, and the picture of them as
inline SVG."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from ..snapshot import Snapshot
from ..text import chat_text, preview_order
from .lineage import SOURCE_COLUMN, DescendantIndex

__all__ = ["ancestors", "descendants", "graph_svg", "preview", "sources"]

DEPTH = 8
NODES = 40

Reader = Callable[[Snapshot, Sequence[int]], list[dict[str, Any]]]


def ancestors(
    snap: Snapshot, row: int, values: dict[str, Any], read: Reader
) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Rows ``row`` of ``snap`` was derived from (its ``_dynstate_source``), and theirs,
    breadth first, at most :data:`DEPTH` deep and :data:`NODES` rows; ``read`` reads the
    values of rows. The nodes, and the edges between kept rows as ``[source, child]``."""
    nodes: list[dict[str, Any]] = []
    edges: list[list[int]] = []
    seen = {row}
    frontier = [(row, values)]
    for depth in range(1, DEPTH + 1):
        nxt: list[int] = []
        for child, vals in frontier:
            for src in sources(vals):
                edges.append([src, child])
                if src in seen or not 0 <= src < snap.num_rows:
                    continue
                seen.add(src)
                if len(nodes) >= NODES:
                    continue
                nodes.append({"row": src, "depth": depth})
                nxt.append(src)
        if not nxt:
            break
        frontier = list(zip(nxt, read(snap, nxt), strict=True))
    kept = {n["row"] for n in nodes} | {row}
    return nodes, [e for e in edges if e[0] in kept and e[1] in kept]


def descendants(index: DescendantIndex, row: int) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Rows derived from ``row``, and from them, by the version's descendant index (bounded
    like :func:`ancestors`)."""
    nodes: list[dict[str, Any]] = []
    edges: list[list[int]] = []
    seen = {row}
    frontier = [row]
    depth = 0
    while frontier and len(nodes) < NODES and depth < DEPTH:
        depth += 1
        nxt = []
        for parent in frontier:
            for child in index.children_of(parent):
                if len(nodes) >= NODES and child not in seen:
                    continue
                edges.append([parent, child])
                if child in seen:
                    continue
                seen.add(child)
                nodes.append({"row": child, "depth": depth})
                nxt.append(child)
        frontier = nxt
    return nodes, edges


def sources(values: Mapping[str, Any]) -> list[int]:
    """The row numbers a row names as its sources."""
    raw = values.get(SOURCE_COLUMN)
    if not isinstance(raw, list):
        return []
    return [int(x) for x in raw if isinstance(x, int) and not isinstance(x, bool)]


def preview(values: Mapping[str, Any]) -> str:
    """A row in a few words: its first text (or chat) column, a usual prompt column first
    (as the CLI's previews), else its first column."""
    for name in preview_order(list(values)):
        value = values[name]
        text = value if isinstance(value, str) else chat_text(value)
        if text is not None and not name.startswith("_dynstate"):
            return text[:80]
    for name, value in values.items():
        if not name.startswith("_dynstate"):
            return str(value)[:80]
    return ""


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
