"""A store's history as plain data: lineage, one row per version, a version's full record and
the difference between two versions. The CLI renders these; scripts can use them directly."""

from __future__ import annotations

import itertools
from typing import Any

from . import manifest as m
from .gc import gc_floor
from .manifest import Commit
from .resume import walk_lineage
from .store import Store


def lineage(store: Store, version: int, floor: int = 0) -> list[int]:
    """Versions whose rows ``version`` carries, newest first, down to ``floor``
    (:func:`dynstate.resume.walk_lineage`, stopped at the gc floor)."""
    return list(itertools.takewhile(lambda v: v >= floor, walk_lineage(store, version)))


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
    store: Store, *, include_abandoned: bool = False, limit: int | None = None
) -> list[dict[str, Any]]:
    """One row per kept version, oldest first, as ``dynstate ls`` shows them. Status is
    "head", "abandoned" (not in the head's lineage; listed only with ``include_abandoned``)
    or None. ``limit`` keeps the newest rows; only the records shown are read."""
    head, floor = store.refresh(), gc_floor(store)
    if include_abandoned:
        versions = list(range(max(floor, head - limit + 1 if limit else floor), head + 1))
        line = set(lineage(store, head, versions[0]))
    else:
        line = set(lineage(store, head, floor)[:limit])
        versions = sorted(line)
    tags: dict[int, list[str]] = {}
    for name, v in sorted(store.tags().items()):
        tags.setdefault(v, []).append(name)
    return [_row(store.commit_record(v), head, line, tags.get(v, [])) for v in versions]


def _row(record: Commit, head: int, line: set[int], tags: list[str]) -> dict[str, Any]:
    status = "head" if record.version == head else None
    if record.version not in line:
        status = "abandoned"
    return {
        "version": record.version,
        "op": record.op,
        "rows_added": record.rows_added,
        "total_rows": record.num_rows,
        "shards": record.num_shards,
        "bytes": record.num_bytes,
        "step": record.meta.get("step"),
        "generator": record.meta.get("generator"),
        "created": record.created,
        "tags": tags,
        "status": status,
    }


def describe(store: Store, version: int | str | None = None) -> dict[str, Any]:
    """Everything about one version, as ``dynstate show`` prints it."""
    snap = store.snapshot(version)
    record = snap.commit
    head, floor = store.refresh(), gc_floor(store)
    line = lineage(store, record.version, floor)
    status = "head" if record.version == head else None
    if status is None and record.version not in lineage(store, head, record.version):
        status = "abandoned"
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
        "lineage": f"{ranges(line)} ({len(line)} versions)",
        "meta": record.meta,
        "schema": [
            {"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in snap.schema or []
        ],
        "shard_list": [s.to_json() for s in snap.shards],
    }


def diff(store: Store, v1: int | str | None, v2: int | str | None) -> dict[str, Any]:
    """How ``v2`` differs from ``v1``: rows, shards added and removed, schema change, and the
    leading rows they share (row identity: a shared shard prefix is shared rows)."""
    a, b = store.snapshot(v1), store.snapshot(v2)
    prefix = 0
    while prefix < min(len(a.shards), len(b.shards)) and a.shards[prefix] == b.shards[prefix]:
        prefix += 1
    a_paths, b_paths = {s.path for s in a.shards}, {s.path for s in b.shards}
    schema = None
    if a.commit.schema != b.commit.schema and a.schema is not None and b.schema is not None:
        schema = m.describe_schema_diff(a.schema, b.schema)
    return {
        "url": store.display_url,
        "from": a.version,
        "to": b.version,
        "rows": [a.num_rows, b.num_rows],
        "shards": [len(a.shards), len(b.shards)],
        "shared_prefix_rows": a.offsets[prefix],
        "extends": prefix == len(a.shards),
        "schema_change": schema,
        "added": [s.to_json() for s in b.shards if s.path not in a_paths],
        "removed": [s.to_json() for s in a.shards if s.path not in b_paths],
    }
