"""Growth plot of a store: rows added per round and total rows, over training steps.

matplotlib is an optional extra (``dynstate[plot]``), imported only when a plot is drawn.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

from .errors import MissingDependencyError, StorageError
from .gc import gc_floor
from .history import lineage
from .store import Store

log = logging.getLogger("dynstate")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependencyError(
            "plotting needs matplotlib, which is not installed; pip install 'dynstate[plot]'"
        ) from exc
    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def growth_points(store: Store) -> tuple[str, list[dict[str, Any]]]:
    """The x-axis label and one point per version of the head's lineage, oldest first: ``x``
    is ``meta["step"]`` where every version has one ("step"), else the version ("version")."""
    versions = sorted(lineage(store, store.refresh(), gc_floor(store)))
    records = [store.commit_record(v) for v in versions]
    # Resets and compactions usually carry no step: they sit at the step of the round before.
    appends = [r for r in records if r.op == "append"]
    by_step = bool(appends) and all(_is_number(r.meta.get("step")) for r in appends)
    points = []
    x: float = 0
    for record in records:
        if record.version == 0 and record.num_rows == 0:
            continue  # the empty root version has nothing to plot
        step = record.meta.get("step")
        x = (step if _is_number(step) else x) if by_step else record.version
        points.append(
            {
                "version": record.version,
                "x": x,
                "rows_added": record.rows_added,
                "total_rows": record.num_rows,
            }
        )
    return ("step" if by_step else "version"), points


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot_growth(store: Store, out: str | os.PathLike[str]) -> int:
    """Draw rows added per round (bars) and total rows (line) over steps to ``out`` (PNG);
    returns the number of versions plotted."""
    plt = _pyplot()
    label, points = growth_points(store)
    xs = [p["x"] for p in points]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    try:
        gaps = [b - a for a, b in itertools.pairwise(xs) if b > a]
        width = 0.8 * min(gaps) if gaps else 0.8
        top.bar(xs, [p["rows_added"] for p in points], width=width, color="tab:blue")
        top.set_ylabel("rows added")
        top.set_title(f"{store.display_url}: growth")
        bottom.plot(xs, [p["total_rows"] for p in points], marker="o", color="tab:green")
        bottom.set_ylabel("total rows")
        bottom.set_xlabel(label)
        fig.tight_layout()
        try:
            fig.savefig(os.fspath(out), format="png")
        except OSError as exc:
            raise StorageError(f"cannot write the plot to {os.fspath(out)}: {exc}") from exc
    finally:
        plt.close(fig)
    log.info("plotted %d versions of %s to %s", len(points), store.display_url, out)
    return len(points)
