"""Growth plot of a store: rows added per round and total rows over training steps, with the
events that shape a run marked: resets and rollbacks (and the checkpoint a rollback resumed
from, the rounds it rolled back and where the run crashed: what a crash cost), compactions,
lost, empty and missing rounds. It draws the growth model of :func:`dynstate.history.growth`,
the one ``dynstate serve`` draws too.

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
from ..history import growth
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
    """The x-axis label and one point per version of the head's lineage, oldest first, as
    ``dynstate plot --json`` lists them: the points of the growth model
    (:func:`dynstate.history.growth`) with ``event`` None, ``"reset"``, ``"rollback"`` (a
    reset that resumed a run from a checkpoint) or ``"compact"``, and ``label`` saying what it
    was."""
    model = growth(store)
    resets = {m["version"]: m for m in model["markers"] if m["kind"] == "reset"}
    points = []
    for p in model["points"]:
        event, label = None, None
        if p["op"] == "reset":
            m = resets[p["version"]]
            if m["rollback"]:
                at = m["checkpoint_step"]
                where = f"step {at}" if at is not None else f"version {m['target']}"
                event, label = "rollback", f"resumed from the checkpoint at {where}"
            else:
                event, label = "reset", f"reset to version {m['target']}"
        elif p["op"] == "compact":
            event, label = "compact", "compaction"
        points.append({**p, "event": event, "label": label})
    return model["axis"], points


def abandoned_points(store: Store, points: list[dict[str, Any]] | None = None) -> list[dict]:
    """Rounds a reset or rollback left behind (for a rollback, the rounds a crashed run
    committed after its checkpoint), from the growth model, with ``event="abandoned"`` and
    ``cause`` the reset's event. ``points`` is accepted for callers of the earlier form."""
    out = []
    for m in growth(store)["markers"]:
        for g in m.get("abandoned_points") or []:
            out.append(
                {
                    **g,
                    "event": "abandoned",
                    "label": f"rolled back by version {m['version']}",
                    "cause": "rollback" if m["rollback"] else "reset",
                }
            )
    return out


# Characters of small legend text across the figure's width, entry markers included.
_LEGEND_CHARS = 140

_STYLE = {
    "rollback": {"color": "tab:red", "linestyle": "--"},
    "reset": {"color": "tab:orange", "linestyle": "--"},
    "compact": {"color": "tab:gray", "linestyle": ":"},
    "crash": {"color": "black", "linestyle": ":"},
}


def _draw(fig: Any, title: str, model: dict[str, Any]) -> int:
    """The growth model on two axes: rows added per round (bars, on the model's scale: a large
    import is cut, with its number) and total rows (line), markers on both; returns the
    number of lines the legend under them takes."""
    from matplotlib.ticker import MaxNLocator

    top, bottom = fig.subplots(2, 1, sharex=True)
    points, scale = model["points"], model["scale"]
    ghosts = [(g, m) for m in model["markers"] for g in m.get("abandoned_points") or []]
    xs = sorted({p["x"] for p in points} | {g["x"] for g, _ in ghosts})
    gaps = [b - a for a, b in itertools.pairwise(xs) if b > a]
    width = 0.8 * min(gaps) if gaps else 0.8
    ceiling = scale["bars"] * 1.1
    by_x: dict[float, list[tuple[dict[str, Any], Any]]] = {}
    for item in [(p, None) for p in points if p["rows_added"] > 0] + [
        (g, m) for g, m in ghosts if g["rows_added"] > 0
    ]:
        by_x.setdefault(item[0]["x"], []).append(item)
    bars: dict[str, list[list[float]]] = {"round": [[], [], []], "import": [[], [], []]}
    lost: list[list[float]] = [[], [], []]
    for x, group in by_x.items():
        w = width / len(group)  # rounds sharing an x side by side
        for k, (p, reset) in enumerate(group):
            at = x - width / 2 + (k + 0.5) * w
            cut = reset is None and p["version"] in scale["clipped"]
            target = (
                lost if reset is not None else bars["import" if p["kind"] == "import" else "round"]
            )
            target[0].append(at)
            target[1].append(ceiling if cut else p["rows_added"])
            target[2].append(w)
            if cut:
                text = f"{p['rows_added']:,} rows (import, cut)"
                top.annotate(text, (at, ceiling), xytext=(4, -12), textcoords="offset points",
                             fontsize="small")  # fmt: skip
    top.bar(bars["round"][0], bars["round"][1], width=bars["round"][2], color="tab:blue")
    if bars["import"][0]:
        top.bar(bars["import"][0], bars["import"][1], width=bars["import"][2],
                color="lightsteelblue", label="import")  # fmt: skip
    if lost[0]:
        # What the crash cost: rounds committed after the checkpoint and rolled back on resume.
        top.bar(lost[0], lost[1], width=lost[2], color="none", edgecolor="tab:red", hatch="//",
                label="abandoned rounds (rolled back or reset)")  # fmt: skip
    top.set_ylim(0, ceiling)
    # Rows are counts: whole ticks only (0, 1, 2, not 0.5 steps) on both axes.
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_ylabel("rows added" + (" (import cut)" if scale["clipped"] else ""))
    top.set_title(f"{title}: growth")
    bottom.plot([p["x"] for p in points], [p["total_rows"] for p in points], marker="o",
                markersize=3, color="tab:green")  # fmt: skip
    totals = {p["version"]: p["total_rows"] for p in points}
    lo, hi = scale["total"]
    bottom.set_ylim(lo, hi + max(1, hi - lo) * 0.05)
    bottom.set_ylabel("total rows")
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel(model["axis"])
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    seen: set[str] = set()
    for m in model["markers"]:
        kind = m["kind"]
        if kind == "missing":
            for ax in (top, bottom):
                ax.axvspan(m["x"] - 0.4, m["x_end"] + 0.4, color="peachpuff", alpha=0.6)
            continue
        if kind in ("lost", "empty"):
            top.plot([m["x"]], [0], marker="^" if kind == "lost" else "o", linestyle="none",
                     color="tab:orange" if kind == "lost" else "tab:purple",
                     label=None if kind in seen else f"{kind} round", clip_on=False)  # fmt: skip
            seen.add(kind)
            continue
        event = "rollback" if m.get("rollback") else kind
        style = _STYLE[event]
        for ax in (top, bottom):
            ax.axvline(m["x"], **style, linewidth=1.2)
        branch = m.get("abandoned_points") or []
        if branch:
            start = totals.get(m["version"], branch[0]["total_rows"] - branch[0]["rows_added"])
            bottom.plot([m["x"], *(g["x"] for g in branch)],
                        [start, *(g["total_rows"] for g in branch)],
                        color="tab:red", linestyle="--", linewidth=1)  # fmt: skip
        if event == "rollback":
            at = m["checkpoint_step"]
            name = f"rollback: resumed from the checkpoint at step {at}" if at is not None else (
                f"rollback to version {m['target']}")  # fmt: skip
            bottom.plot([m["x"]], [totals.get(m["version"], lo)], marker="*", markersize=14,
                        color="tab:red", linestyle="none")  # fmt: skip
        elif event == "crash":
            name = m["label"].split(";")[0]
        else:
            name = event
        # One legend entry per kind of event; a rollback's and a crash's text say where.
        if event not in seen or event in ("rollback", "crash"):
            bottom.plot([], [], **style, label=name)
            seen.add(event)
    # One legend under both axes: inside, it would hide the newest rounds.
    handles, labels = [], []
    for ax in (top, bottom):
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    if handles:
        # As many columns as the longest entry allows across the figure: a rollback's and a
        # crash's entries say where, and three of them in a row ran off the image's edges.
        longest = max(len(text) for text in labels)
        ncol = max(1, min(3, _LEGEND_CHARS // (longest + 8)))
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize="small",
                   frameon=False)  # fmt: skip
        return -(-len(labels) // ncol)
    return 0


def growth_figure(store: Store) -> tuple[Any, dict[str, Any]]:
    """The growth plot of ``store`` as a laid-out matplotlib ``Figure``, and the growth model
    it draws (what :func:`plot_growth` saves)."""
    fig = _figure(figsize=(9, 6))
    model = growth(store)
    rows = _draw(fig, store.display_url, model)
    fig.tight_layout(rect=(0, 0.035 * rows, 1, 1))
    return fig, model


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
    fig, model = growth_figure(store)
    parent = os.path.dirname(os.path.abspath(out))
    tmp = os.path.join(parent, f".{uuid.uuid4().hex}.png.tmp")
    try:
        os.makedirs(parent, exist_ok=True)  # as export does: a new folder for OUT is made
        # "tight": whatever the legend holds, nothing of it is cut at the image's edges.
        fig.savefig(tmp, format="png", bbox_inches="tight", pad_inches=0.1)
        os.replace(tmp, out)
    except OSError as exc:
        # OUT, not the temporary name, which would mean nothing to the user
        why = exc.strerror or type(exc).__name__
        raise StorageError(
            f"cannot write the plot to {out}: {why}; choose a path you can write to"
        ) from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    log.info("plotted %d versions of %s to %s", len(model["points"]), store.display_url, out)
    return len(model["points"])
