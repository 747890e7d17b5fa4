"""A store's history as plain data: lineage, one row per version, a version's full record, the
difference between two versions and (:mod:`.growth`) the growth of a lineage. The CLI,
``dynstate serve`` and ``dynstate plot`` render these; scripts can use them directly."""

from __future__ import annotations

import itertools
import logging
from typing import Any

from ..records import manifest as m
from ..records.manifest import Commit
from ..store import Store
from .growth import ABANDONED_POINTS, growth

log = logging.getLogger("dynstate")

__all__ = [
    "ABANDONED_POINTS",
    "describe",
    "diff",
    "growth",
    "lineage",
    "ranges",
    "readable_tags",
    "summary",
    "version_row",
    "version_rows",
]


def lineage(store: Store, version: int, floor: int = 0) -> list[int]:
    """Versions whose rows ``version`` carries, newest first, down to ``floor`` (the log's
    one lineage walker, which also stops at the gc floor)."""
    return list(itertools.takewhile(lambda v: v >= floor, store.lineage(version)))


def readable_tags(store: Store) -> dict[str, int]:
    """The tags that can be read, by name; each damaged tag file is a warning (naming the
    file and how to drop it) instead of an error, so that one bad file does not hide the
    history. gc, which must keep what every tag names, reads them strictly (Store.tags)."""
    tags, damaged = store.check_tags()
    for error in damaged.values():
        log.warning("%s", error)
    return dict(sorted(tags.items()))


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
    before: int | None = None,
) -> list[dict[str, Any]]:
    """One row per kept version, as ``dynstate ls`` shows them, newest first (oldest first
    with ``newest_first=False``). Status is "head", "abandoned" (not in the head's lineage;
    listed only with ``include_abandoned``) or None. ``limit`` keeps the newest rows and only
    their records are read, so the cost does not grow with the store's history; with
    ``include_abandoned``, ``before`` starts the rows below that version (a page further
    down, as ``dynstate serve`` pages them). A caller that has just refreshed the store and
    read its ``tags`` (as :func:`summary` does) can pass ``refresh=False`` and the tags to
    save those requests."""
    head = store.latest() if refresh else store.head
    floor = store.floor
    if include_abandoned:
        top = head if before is None else min(head, before - 1)
        oldest = max(floor, top - limit + 1) if limit else floor
        versions = list(range(top, oldest - 1, -1))
        store.commit_records(versions)  # fetched together; the walk below finds them read
        line = set(itertools.takewhile(lambda v: v >= oldest, store.lineage(head)))
    else:
        versions = list(
            itertools.islice(store.lineage(head, ahead=limit or head - floor + 1), limit)
        )
        line = set(versions)
    by_version: dict[int, list[str]] = {}
    for name, v in sorted((readable_tags(store) if tags is None else tags).items()):
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


def summary(store: Store, *, refresh: bool = True) -> dict[str, Any]:
    """The store at a glance, as the header of ``dynstate ls`` shows it: reads the head's and
    the oldest kept version's records and the tags, whatever the length of the history.
    ``refresh=False``: the caller has just refreshed the store (a command that opened it), so
    the head and floor it found stand for this call too, rather than being read again."""
    head = store.latest() if refresh else store.head
    floor = store.floor
    store.commit_records((head, floor))
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
        "tags": readable_tags(store),
        "first_commit": first.created,
        "last_commit": last.created,
    }


def describe(
    store: Store,
    version: int | str | None = None,
    *,
    lineage_limit: int | None = None,
    refresh: bool = True,
) -> dict[str, Any]:
    """Everything about one version, as ``dynstate show`` prints it. The lineage and the
    status come from walking records back; ``lineage_limit`` caps each walk (the lineage then
    ends in "…", and a status that would need more is "unknown"), so that the cost does not
    grow with the history. ``refresh=False`` as for :func:`summary`."""
    snap = store.snapshot(store.head if version is None and not refresh else version)
    record = snap.commit
    head = store.latest() if refresh else store.head
    floor = store.floor

    def walk(start: int, stop: int) -> tuple[list[int], bool]:
        """The lineage of ``start`` down to ``stop``, and whether the limit cut it short."""
        ahead = lineage_limit or start - stop + 1
        steps = itertools.takewhile(lambda v: v >= stop, store.lineage(start, ahead=ahead))
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
        "tags": sorted(n for n, v in readable_tags(store).items() if v == record.version),
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
