"""Growth plot of a store: rows added per round and total rows over training steps, with the
events that shape a run marked: resets and rollbacks (and the checkpoint a rollback resumed
from, and the rounds it rolled back: what a crash cost), and compactions.

matplotlib is an optional extra (``dynstate[plot]``), imported only when a plot is drawn, and
used through its object API (a ``Figure`` on the Agg canvas): no pyplot state, no global
backend switch in the caller's process."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import uuid
from typing import Any

from ..errors import MissingDependencyError, StorageError, StoreExistsError
from ..history import lineage
from ..store import Store

log = logging.getLogger("dynstate")


def _figure(**kwargs: Any) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingDependencyError(
            "plotting needs matplotlib, which is not installed; pip install 'dynstate[plot]'"
        ) from exc
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def growth_points(store: Store) -> tuple[str, list[dict[str, Any]]]:
    """The x-axis label and one point per version of the head's lineage, oldest first: ``x``
    is ``meta["step"]`` where every append has one ("step"), else the version ("version").
    ``event`` is None, ``"reset"``, ``"rollback"`` (a reset that resumed a run from a
    checkpoint) or ``"compact"``; ``label`` says what it was."""
    head = store.refresh()
    versions = sorted(lineage(store, head, store.log.floor))
    records = [store.commit_record(v) for v in versions]
    by_version = {r.version: r for r in records}
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
        event, label = None, None
        if record.op == "reset":
            target = by_version.get(record.target) if record.target is not None else None
            at = target.meta.get("step") if target is not None else None
            if "rollback_from" in record.meta:
                event = "rollback"
                where = f"step {at}" if _is_number(at) else f"version {record.target}"
                label = f"resumed from the checkpoint at {where}"
            else:
                event, label = "reset", f"reset to version {record.target}"
        elif record.op == "compact":
            event, label = "compact", "compaction"
        points.append(
            {
                "version": record.version,
                "x": x,
                "rows_added": record.rows_added,
                "total_rows": record.num_rows,
                "op": record.op,
                "event": event,
                "label": label,
            }
        )
    return ("step" if by_step else "version"), points


def abandoned_points(store: Store, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rounds a reset or rollback left behind (committed after its target, before it: for a
    rollback, the rounds a crashed run committed after its checkpoint), as points like
    :func:`growth_points`' with ``event="abandoned"``. Reads only those records."""
    kept = {p["version"] for p in points}
    out = []
    for point in points:
        if point["event"] not in ("reset", "rollback"):
            continue
        record = store.commit_record(point["version"])
        for v in range((record.target or 0) + 1, record.version):
            if v in kept or v < store.log.floor:
                continue
            lost = store.commit_record(v)
            step = lost.meta.get("step")
            out.append(
                {
                    "version": v,
                    "x": step if _is_number(step) else v,
                    "rows_added": lost.rows_added,
                    "total_rows": lost.num_rows,
                    "op": lost.op,
                    "event": "abandoned",
                    "label": f"rolled back by version {record.version}",
                    "cause": point["event"],
                }
            )
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_STYLE = {
    "rollback": {"color": "tab:red", "linestyle": "--"},
    "reset": {"color": "tab:orange", "linestyle": "--"},
    "compact": {"color": "tab:gray", "linestyle": ":"},
}


def plot_growth(store: Store, out: str | os.PathLike[str], *, overwrite: bool = False) -> int:
    """Draw rows added per round (bars) and total rows (line) over steps to ``out`` (PNG),
    with resets, rollbacks and compactions marked; returns the number of versions plotted.
    ``out`` is never the store or inside it (InvalidDataError), and an existing ``out`` is
    replaced only with ``overwrite`` (else StoreExistsError); the PNG appears complete or not
    at all."""
    from .export import output_plan

    out = os.fspath(out)
    # Checked before drawing: a mistyped OUT must not cost a store file or a user's file.
    if output_plan(store, out, action="plot to") is not None and not overwrite:
        raise StoreExistsError(
            f"{out} exists; choose another path or pass overwrite=True to replace it"
        )
    fig = _figure(figsize=(9, 6))
    label, points = growth_points(store)
    xs = [p["x"] for p in points]
    top, bottom = fig.subplots(2, 1, sharex=True)
    gaps = [b - a for a, b in itertools.pairwise(xs) if b > a]
    width = 0.8 * min(gaps) if gaps else 0.8
    top.bar(xs, [p["rows_added"] for p in points], width=width, color="tab:blue")
    lost = abandoned_points(store, points) if label == "step" else []
    if lost:
        # What the crash cost: rounds committed after the checkpoint and rolled back on resume.
        top.bar([p["x"] for p in lost], [p["rows_added"] for p in lost], width=width,
                color="none", edgecolor="tab:red", hatch="//",
                label="rounds rolled back (committed after the checkpoint)")  # fmt: skip
        top.legend(loc="upper right", fontsize="small")
        crashed = [p["x"] for p in lost if "rollback" in str(p.get("cause"))]
        if crashed:
            # The run died after its last rolled-back round and before the rollback.
            at = max(crashed) + 0.5
            for ax in (top, bottom):
                ax.axvline(at, color="black", linestyle=":", linewidth=1.2)
            bottom.plot([], [], color="black", linestyle=":",
                        label=f"crash (after step {max(crashed)})")  # fmt: skip
    top.set_ylabel("rows added")
    top.set_title(f"{store.display_url}: growth")
    bottom.plot(xs, [p["total_rows"] for p in points], marker="o", color="tab:green")
    bottom.set_ylabel("total rows")
    bottom.set_xlabel(label)
    seen: set[str] = set()
    for p in points:
        if p["event"] is None:
            continue
        style = _STYLE[p["event"]]
        for ax in (top, bottom):
            ax.axvline(p["x"], **style, linewidth=1.2)
        # One legend entry per kind of event; the rollback's text names its checkpoint.
        name = p["label"] if p["event"] == "rollback" else p["event"]
        if p["event"] not in seen or p["event"] == "rollback":
            bottom.plot([], [], **style, label=name)
            seen.add(p["event"])
        if p["event"] == "rollback":
            bottom.plot([p["x"]], [p["total_rows"]], marker="*", markersize=14,
                        color="tab:red", linestyle="none")  # fmt: skip
    if seen:
        bottom.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    tmp = os.path.join(os.path.dirname(os.path.abspath(out)), f".{uuid.uuid4().hex}.png.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, out)
    except OSError as exc:
        raise StorageError(f"cannot write the plot to {out}: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    log.info("plotted %d versions of %s to %s", len(points), store.display_url, out)
    return len(points)
