"""The growth model of a lineage: one point per version, the events that shaped the run as
markers, and the scales to draw them on. ``dynstate serve`` (:mod:`dynstate.serve.chart`) and
``dynstate plot`` (:mod:`dynstate.maintenance.plot`) draw it; ``/api/store`` and
``dynstate plot --json`` return it."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Sequence
from typing import Any

from ..errors import DynstateError
from ..records.manifest import Commit
from ..store import Store

# Rounds of an abandoned branch read per reset (a far reset abandons many).
ABANDONED_POINTS = 200
# Missing steps listed one by one per gap (the gap's bounds and count are always given).
_MISSING_LISTED = 100
# A step outside this range is not drawn at its value: a float cannot place it among ordinary
# steps (and a 400-digit one cannot be converted at all); the point sits by the step before.
_MAX_STEP = 2**63
# The import is drawn clipped when it is this many times the largest round: on one linear
# scale it would flatten every round to a line.
_CLIP_RATIO = 2


def _step(meta: dict[str, Any]) -> int | float | None:
    value = meta.get("step")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not (-_MAX_STEP < value < _MAX_STEP):  # also False for NaN
        return None
    return value


def _kind(record: Commit) -> str:
    if record.op != "append":
        return record.op
    if record.meta.get("lost"):
        return "lost"
    return "empty" if record.rows_added == 0 else "round"


def growth(
    store: Store, chain: Sequence[Commit] | None = None, floor: int | None = None
) -> dict[str, Any]:
    """How the head's lineage grew, as the data both ``dynstate serve``'s chart and
    ``dynstate plot`` draw: one point per version (``chain``: the lineage's records oldest
    first, down to ``floor``; read from the store when not given), the events that shaped the
    run as markers, and the scales to draw them on.

    The x axis is the training step (``meta["step"]``) when any append along the lineage has
    one, else the version. On a step axis a record without a step is placed by the step before
    it (``placed``: a reset, a compaction, a round written by hand), and the rows written before
    the first step (the import; dynstate's verl import writes no step) sit one step before it.
    Markers: ``reset`` (with the rounds it abandoned, ``abandoned_points``, and ``rollback``
    when it resumed a run from a checkpoint), ``crash`` (where a rolled-back run died: after
    its last abandoned round), ``compact``, ``lost``, ``empty`` and ``missing`` (steps with no
    round, as a span). ``scale["bars"]`` is the rows-added axis, chosen for the rounds: an
    import more than twice the largest round is listed in ``scale["clipped"]`` and drawn cut
    at the top with its number; ``scale["total"]`` the total-rows axis. The size of the result
    is bounded by the records read, whatever the steps."""
    if floor is None:
        floor = store.floor
    if chain is None:
        head = store.latest()
        line = itertools.takewhile(lambda v: v >= floor, store.lineage(head))
        chain = [store.commit_record(v) for v in reversed(list(line))]
    records = [r for r in chain if not (r.version == 0 and r.num_rows == 0)]
    steps = [_step(r.meta) for r in records if r.op == "append"]
    first = next((s for s in steps if s is not None), None)
    axis = "version" if first is None else "step"
    points: list[dict[str, Any]] = []
    markers: list[dict[str, Any]] = []
    x: float = first - 1 if first is not None else 0
    last_step: Any = None
    for record in records:
        step = _step(record.meta) if record.op == "append" else None
        placed = axis == "step" and step is None
        x = record.version if axis == "version" else (x if step is None else step)
        kind = _kind(record)
        if kind == "round" and not points and record.num_rows == record.rows_added:
            kind = "import"  # the lineage's first rows: what the run started from
        points.append(_point(record, x, kind, step, placed))
        if kind in ("lost", "empty"):
            label = "lost round" if kind == "lost" else "empty round"
            if record.meta.get("error"):
                label += f" (generator failed: {str(record.meta['error'])[:120]})"
            markers.append({"kind": kind, "version": record.version, "x": x, "label": label})
        elif record.op == "reset":
            reset = _reset_marker(store, record, x, axis, floor)
            markers.append(reset)
            crash = _crash_marker(reset, axis)
            if crash is not None:
                markers.append(crash)
        elif record.op == "compact":
            shards = "shard" if record.num_shards == 1 else "shards"
            label = f"compaction: {record.num_shards:,} {shards}"
            markers.append({"kind": "compact", "version": record.version, "x": x, "label": label})
        if isinstance(step, int) and record.op == "append":
            if isinstance(last_step, int) and step > last_step + 1:
                markers.append(_missing(record.version, last_step + 1, step - 1))
            last_step = step
    return {
        "axis": axis,
        "floor": floor,
        "points": points,
        "markers": markers,
        "scale": _scale(points, markers),
    }


def _point(record: Commit, x: float, kind: str, step: Any, placed: bool) -> dict[str, Any]:
    return {
        "version": record.version,
        "x": x,
        "op": record.op,
        "kind": kind,
        "rows_added": record.rows_added if record.op == "append" else 0,
        "total_rows": record.num_rows,
        "step": step,
        "placed": placed,
        "generator": record.meta.get("generator"),
        "created": record.created,
    }


def _missing(version: int, a: int, b: int) -> dict[str, Any]:
    span = str(a) if a == b else f"{a}-{b}"
    return {
        "kind": "missing",
        "version": version,
        "x": a,
        "x_end": b,
        "count": b - a + 1,
        "steps": list(range(a, min(b, a + _MISSING_LISTED - 1) + 1)),  # never the whole gap
        "label": f"no round for step {span}",
    }


def _reset_marker(store: Store, record: Commit, x: float, axis: str, floor: int) -> dict[str, Any]:
    """A reset, with the branch it abandoned: for a rollback, the rounds a crashed run
    committed after its checkpoint (up to :data:`ABANDONED_POINTS` of them, oldest first)."""
    target = record.target
    before = record.meta.get("rollback_from", record.parent)
    dropped = None
    if isinstance(before, int) and not isinstance(before, bool):
        with contextlib.suppress(DynstateError):  # collected: the count is unknown, not the reset
            dropped = store.commit_record(before).num_rows - record.num_rows
    abandoned = [target + 1, record.version - 1] if target is not None else None
    rollback = "rollback_from" in record.meta
    at = record.meta.get("rollback_step")
    if at is None and target is not None and target >= floor:
        with contextlib.suppress(DynstateError):
            at = _step(store.commit_record(target).meta)
    if rollback:
        where = f"step {at}" if at is not None else f"version {target}"
        label = f"rollback: resumed from the checkpoint at {where} (reset to version {target})"
    else:
        label = f"reset to version {target}"
    if abandoned and abandoned[0] <= abandoned[1]:
        a, b = abandoned
        label += f"; version {a} abandoned" if a == b else f"; versions {a}-{b} abandoned"
    if dropped:
        label += f" ({dropped:,} row{'' if dropped == 1 else 's'} dropped)"
    return {
        "kind": "reset",
        "version": record.version,
        "x": x,
        "target": target,
        "rollback": rollback,
        "checkpoint_step": at,
        "abandoned": abandoned,
        "rows_dropped": dropped,
        "abandoned_points": _branch(store, record, axis, x, floor),
        "label": label,
    }


def _branch(store: Store, reset: Commit, axis: str, x: float, floor: int) -> list[dict[str, Any]]:
    """The versions a reset left, from the one after its target up to its parent, along the
    parent's lineage, oldest first; step-less ones placed by the step before them."""
    if reset.target is None or reset.parent is None or reset.parent <= reset.target:
        return []
    try:
        stop = max(reset.target + 1, floor)
        branch = itertools.islice(store.lineage(reset.parent), ABANDONED_POINTS)
        records = [store.commit_record(v) for v in itertools.takewhile(lambda v: v >= stop, branch)]
    except DynstateError:
        return []  # collected by gc: the reset's label still says what it dropped
    points = []
    for record in reversed(records):
        step = _step(record.meta) if record.op == "append" else None
        x = record.version if axis == "version" else (x if step is None else step)
        points.append(_point(record, x, _kind(record), step, axis == "step" and step is None))
    return points


def _crash_marker(reset: dict[str, Any], axis: str) -> dict[str, Any] | None:
    """Where a run that was rolled back died: after the last round it committed."""
    ghosts = reset["abandoned_points"]
    if not reset["rollback"] or not ghosts:
        return None
    last = ghosts[-1]
    if axis == "step":
        x = max(g["x"] for g in ghosts) + 0.5
        label = f"crash: the run died after step {max(g['x'] for g in ghosts)}"
    else:
        x = last["version"] + 0.5
        label = f"crash: the run died after version {last['version']}"
    label += f"; its rounds after the checkpoint were rolled back by version {reset['version']}"
    return {"kind": "crash", "version": reset["version"], "x": x, "label": label}


def _scale(points: list[dict[str, Any]], markers: list[dict[str, Any]]) -> dict[str, Any]:
    ghosts = [g for m in markers for g in m.get("abandoned_points") or []]
    drawn = [*points, *ghosts]
    rounds = [p["rows_added"] for p in drawn if p["kind"] != "import"]
    imports = [p for p in points if p["kind"] == "import"]
    top = max([1, *rounds])
    clipped = [p["version"] for p in imports if rounds and p["rows_added"] > _CLIP_RATIO * top]
    if not clipped:
        top = max([top, *(p["rows_added"] for p in imports)])
    totals = [p["total_rows"] for p in drawn] or [0]
    lo, hi = min(totals), max(1, max(totals))
    # Total rows from zero, unless the import is clipped: then from just below the import,
    # so that rounds small next to it still show as steps of the line.
    lo = _nice_floor(lo, hi) if clipped and lo < hi else 0
    return {"bars": top, "clipped": clipped, "total": [lo, hi]}


def buckets(model: dict[str, Any], slots: int) -> dict[str, Any]:
    """The rounds of a growth model in at most ``slots`` bars, for a chart with more rounds
    than room: the x axis cut into buckets of ``size`` whole steps (or versions), each bar
    the **mean** rows added per round of the rounds in it, so that it reads on the same
    rows-added-per-round axis as one bar per round (``scale["bars"]``; a mean never exceeds
    the largest round). A sum would grow with the bucket's round count, which varies with
    where the buckets fall. The import is not a round and stays its own bar; resets and
    compactions hold no rounds. Each bucket: ``x_from``/``x_to`` (its x range, inclusive),
    ``first``/``last`` (the versions of its first and last round), ``rounds``, ``rows``
    (their sum) and ``mean``. Buckets without a round are left out."""
    rounds = [p for p in model["points"] if p["op"] == "append" and p["kind"] != "import"]
    if not rounds:
        return {"size": 1, "buckets": []}
    lo = math.floor(min(p["x"] for p in rounds))
    hi = math.floor(max(p["x"] for p in rounds))
    size = max(1, math.ceil((hi - lo + 1) / max(1, slots)))
    out: dict[int, dict[str, Any]] = {}
    for p in rounds:
        k = (math.floor(p["x"]) - lo) // size
        b = out.setdefault(
            k,
            {
                "x_from": lo + k * size,
                "x_to": lo + (k + 1) * size - 1,
                "first": p["version"],
                "last": p["version"],
                "rounds": 0,
                "rows": 0,
            },
        )
        b["last"] = p["version"]
        b["rounds"] += 1
        b["rows"] += p["rows_added"]
    for b in out.values():
        b["mean"] = b["rows"] / b["rounds"]
    return {"size": size, "buckets": [out[k] for k in sorted(out)]}


def _nice_floor(lo: int, hi: int) -> int:
    """``lo`` rounded down to a round number, on the order of the span ``hi - lo``."""
    mag = 10 ** max(0, len(str(max(1, (hi - lo) // 2))) - 1)
    return lo // mag * mag
