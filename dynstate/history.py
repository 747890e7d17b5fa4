"""A store's history as plain data: lineage, one row per version, a version's full record, the
difference between two versions and the growth of a lineage. The CLI, ``dynstate serve`` and
``dynstate plot`` render these; scripts can use them directly."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from typing import Any

from . import manifest as m
from .errors import DynstateError
from .manifest import Commit
from .store import Store


def lineage(store: Store, version: int, floor: int = 0) -> list[int]:
    """Versions whose rows ``version`` carries, newest first, down to ``floor`` (the log's
    one lineage walker, which also stops at the gc floor)."""
    return list(itertools.takewhile(lambda v: v >= floor, store.lineage(version)))


def ranges(versions: list[int]) -> str:
    """``[0, 1, 2, 5, 6]`` as ``"0-2, 5-6"``."""
    parts: list[tuple[int, int]] = []
    for v in sorted(versions):
        if parts and parts[-1][1] == v - 1:
            parts[-1] = (parts[-1][0], v)
        else:
            parts.append((v, v))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def version_rows(
    store: Store,
    *,
    include_abandoned: bool = False,
    limit: int | None = None,
    newest_first: bool = True,
    refresh: bool = True,
    tags: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """One row per kept version, as ``dynstate ls`` shows them, newest first (oldest first
    with ``newest_first=False``). Status is "head", "abandoned" (not in the head's lineage;
    listed only with ``include_abandoned``) or None. ``limit`` keeps the newest rows and only
    their records are read, so the cost does not grow with the store's history. A caller
    that has just refreshed the store and read its ``tags`` (as :func:`summary` does) can pass
    ``refresh=False`` and the tags to save those requests."""
    head = store.refresh() if refresh else store.head
    floor = store.floor
    if include_abandoned:
        oldest = max(floor, head - limit + 1) if limit else floor
        versions = list(range(head, oldest - 1, -1))
        line = set(itertools.takewhile(lambda v: v >= oldest, store.lineage(head)))
    else:
        versions = list(itertools.islice(store.lineage(head), limit))
        line = set(versions)
    by_version: dict[int, list[str]] = {}
    for name, v in sorted((store.tags() if tags is None else tags).items()):
        by_version.setdefault(v, []).append(name)
    rows = [
        version_row(store.commit_record(v), head, line, by_version.get(v, [])) for v in versions
    ]
    return rows if newest_first else rows[::-1]


def version_row(record: Commit, head: int, line: set[int], tags: list[str]) -> dict[str, Any]:
    status = "head" if record.version == head else None
    if record.version not in line:
        status = "abandoned"
    return {
        "version": record.version,
        "op": record.op,
        "target": record.target,
        "rows_added": record.rows_added,
        "total_rows": record.num_rows,
        "shards": record.num_shards,
        "bytes": record.num_bytes,
        "step": record.meta.get("step"),
        "generator": record.meta.get("generator"),
        "created": record.created,
        "tags": tags,
        "status": status,
        # A rollback's training step, and a round's failure (an empty round is not "+0").
        "rollback_step": record.meta.get("rollback_step") if record.op == "reset" else None,
        "error": _error_text(record.meta.get("error")),
    }


def _error_text(error: Any) -> str | None:
    """A round's recorded failure (``meta["error"]``) as one line, or None."""
    if error is None or error is False or error == "":
        return None
    return " ".join(str(error).split())[:200]


def summary(store: Store) -> dict[str, Any]:
    """The store at a glance, as the header of ``dynstate ls`` shows it: reads the head's and
    the oldest kept version's records and the tags, whatever the length of the history."""
    head = store.refresh()
    floor = store.floor
    last, first = store.commit_record(head), store.commit_record(floor)
    return {
        "url": store.display_url,
        "store_id": store.store_id,
        "head": head,
        "oldest": floor,
        "versions": head - floor + 1,
        "rows": last.num_rows,
        "bytes": last.num_bytes,
        "shards": last.num_shards,
        "tags": dict(sorted(store.tags().items())),
        "first_commit": first.created,
        "last_commit": last.created,
    }


def describe(
    store: Store, version: int | str | None = None, *, lineage_limit: int | None = None
) -> dict[str, Any]:
    """Everything about one version, as ``dynstate show`` prints it. The lineage and the
    status come from walking records back; ``lineage_limit`` caps each walk (the lineage then
    ends in "…", and a status that would need more is "unknown"), so that the cost does not
    grow with the history."""
    snap = store.snapshot(version)
    record = snap.commit
    head = store.refresh()
    floor = store.floor

    def walk(start: int, stop: int) -> tuple[list[int], bool]:
        """The lineage of ``start`` down to ``stop``, and whether the limit cut it short."""
        steps = itertools.takewhile(lambda v: v >= stop, store.lineage(start))
        got = list(itertools.islice(steps, lineage_limit)) if lineage_limit else list(steps)
        return got, bool(lineage_limit) and len(got) == lineage_limit and got[-1] > stop

    line, cut = walk(record.version, floor)
    status = "head" if record.version == head else None
    if status is None:
        above, unknown = walk(head, record.version)
        if record.version not in above:
            status = "unknown" if unknown else "abandoned"
    return {
        "url": store.display_url,
        "store_id": store.store_id,
        "version": record.version,
        "op": record.op,
        "parent": record.parent,
        "target": record.target,
        "created": record.created,
        "status": status,
        "rows": snap.num_rows,
        "rows_added": record.rows_added,
        "shards": len(snap.shards),
        "bytes": record.num_bytes,
        "tags": sorted(n for n, v in store.tags().items() if v == record.version),
        "lineage": (
            f"{ranges(line)}, … (the newest {len(line):,} versions read)"
            if cut
            else f"{ranges(line)} ({len(line)} versions)"
        ),
        "meta": record.meta,
        "schema": [
            {"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in snap.schema or []
        ],
        "shard_list": [s.to_json() for s in snap.shards],
    }


def diff(
    store: Store, v1: int | str | None, v2: int | str | None, *, shards: bool = False
) -> dict[str, Any]:
    """How ``v2``'s rows differ from ``v1``'s, by lineage: a version's rows are the rounds
    appended along its lineage, in order, so both lineages are walked back to where they meet
    (their common version, whose rows both start with). Rounds only ``v2`` carries are added
    rows, rounds only ``v1`` carries removed ones; a compaction or a reset to the same content
    changes no row. Reads the records back to the meeting point only. With ``shards``, also
    the shard files added and removed."""
    a, b = store.resolve(v1), store.resolve(v2)
    ra, rb = store.commit_record(a), store.commit_record(b)
    only_a, only_b, common = _diverged(store, a, b)
    added = sum(store.commit_record(v).rows_added for v in only_b)
    removed = sum(store.commit_record(v).rows_added for v in only_a)
    shared = store.commit_record(common).num_rows if common is not None else 0
    if common is None:  # the lineages meet only below the gc floor: compare whole versions
        added, removed = rb.num_rows, ra.num_rows
    sa, sb = store.snapshot(a), store.snapshot(b)
    schema = None
    if ra.schema != rb.schema and sa.schema is not None and sb.schema is not None:
        schema = m.describe_schema_diff(sa.schema, sb.schema)
    out: dict[str, Any] = {
        "url": store.display_url,
        "from": a,
        "to": b,
        "rows": [ra.num_rows, rb.num_rows],
        "added_rows": added,
        "removed_rows": removed,
        "shared_rows": shared,
        "common_version": common,
        "added_versions": sorted(v for v in only_b if store.commit_record(v).rows_added),
        "removed_versions": sorted(v for v in only_a if store.commit_record(v).rows_added),
        "extends": removed == 0 and common is not None,
        "same_rows": added == 0 and removed == 0 and common is not None,
        "schema_change": schema,
        "shards": [ra.num_shards, rb.num_shards],
    }
    if shards:
        a_paths, b_paths = {s.path for s in sa.shards}, {s.path for s in sb.shards}
        out["shards_added"] = [s.to_json() for s in sb.shards if s.path not in a_paths]
        out["shards_removed"] = [s.to_json() for s in sa.shards if s.path not in b_paths]
    return out


def _diverged(store: Store, a: int, b: int) -> tuple[list[int], list[int], int | None]:
    """Versions only ``a``'s lineage has, only ``b``'s, and the newest version both share
    (None if they share none above the gc floor). Lineages descend, so advancing whichever
    walk is ahead finds the meeting point after reading only the versions that differ."""
    walk_a, walk_b = store.lineage(a), store.lineage(b)
    only_a: list[int] = []
    only_b: list[int] = []
    x, y = next(walk_a, None), next(walk_b, None)
    while x is not None and y is not None and x != y:
        if x > y:
            only_a.append(x)
            x = next(walk_a, None)
        else:
            only_b.append(y)
            y = next(walk_b, None)
    if x is not None and x == y:
        return only_a, only_b, x
    only_a += [x, *walk_a] if x is not None else []
    only_b += [y, *walk_b] if y is not None else []
    return only_a, only_b, None


# -- growth ------------------------------------------------------------------------------------

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
        head = store.refresh()
        chain = [store.commit_record(v) for v in reversed(lineage(store, head, floor))]
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
            label = f"compaction: {record.num_shards} shards"
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
        label += f"; versions {abandoned[0]}-{abandoned[1]} abandoned"
    if dropped:
        label += f" ({dropped} rows dropped)"
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


def _nice_floor(lo: int, hi: int) -> int:
    """``lo`` rounded down to a round number, on the order of the span ``hi - lo``."""
    mag = 10 ** max(0, len(str(max(1, (hi - lo) // 2))) - 1)
    return lo // mag * mag
