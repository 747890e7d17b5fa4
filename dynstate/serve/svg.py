"""What the pictures of ``dynstate serve`` share: round tick values, short number labels and
grid lines (inline SVG markup)."""

from __future__ import annotations

import math

__all__ = ["fmt", "grid", "ticks"]


def ticks(lo: float, hi: float, count: int = 6, *, whole: bool = False) -> list[float]:
    """Round numbers from ``lo`` to ``hi``; ``whole``: integers only (steps, versions)."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    if whole:
        step = max(1, round(step))
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]


def fmt(v: float) -> str:
    if abs(v) >= 1e9:
        return f"{v:.3g}"
    if abs(v) >= 1e6:
        return f"{v / 1e6:g}M"
    if abs(v) >= 1e4:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def grid(x_from: float, x_to: float, y: float, value: float) -> str:
    return (
        f'<line class="grid" x1="{x_from}" x2="{x_to}" y1="{y:.1f}" y2="{y:.1f}"/>'
        f'<text class="tick" x="{x_from - 6}" y="{y + 4:.1f}" text-anchor="end">'
        f"{fmt(value)}</text>"
    )
