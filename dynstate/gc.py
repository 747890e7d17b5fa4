"""Garbage collection: remove files no kept version needs, and versions beyond a retention rule.

Two kinds of garbage:

* **Orphans** — files that no commit record refers to: shards of rounds whose writer died
  before committing (or staged parts never committed), temporary files of interrupted local
  writes, chunks of checkpoints never finished. A live writer's files look exactly like these
  until it commits, so an orphan goes only once it is older than a grace period.
* **Collected versions** — with a retention rule, the versions below a new *floor* ``f``. The
  floor never passes the head or a tagged version (tags pin checkpoint versions), and every
  shard a kept version lists stays, whichever record first added it.

Collection is ordered so that a crash at any point leaves a readable store: first a
checkpoint of version ``f`` (so ``f`` can be materialized without older records), then
``_dynstate/gc.json`` naming the floor (readers refuse older versions from then on), then the
shards only collected versions used, then the collected records and checkpoints. A rerun
finishes whatever an interrupted one left.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from . import manifest as m
from .errors import CorruptStoreError, InvalidDataError
from .store import Store

log = logging.getLogger("dynstate")

DEFAULT_GRACE_S = 3600.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_VERSION_FILE = re.compile(r"^(\d{20})\.json$")


def parse_duration(text: str) -> float:
    """Seconds in ``"90"``, ``"30s"``, ``"15m"``, ``"2h"``, ``"7d"`` or ``"1w"``."""
    match = _DURATION.match(text)
    if match is None:
        raise InvalidDataError(
            f"cannot read duration {text!r}; write a number with an optional unit s, m, h, d "
            "or w, e.g. 30m or 7d"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True)
class Removal:
    """One file gc removes (or would remove, in a dry run)."""

    path: str
    bytes: int
    reason: str  # "orphan" or "collected"


@dataclass
class GcResult:
    url: str
    dry_run: bool
    head: int
    floor_before: int
    floor_after: int
    removed: list[Removal] = field(default_factory=list)
    kept_young: int = 0  # orphans left alone because they are younger than the grace period

    @property
    def versions_collected(self) -> list[int]:
        return list(range(self.floor_before, self.floor_after))

    @property
    def bytes_freed(self) -> int:
        return sum(r.bytes for r in self.removed)

    def to_json(self) -> dict[str, object]:
        return {
            "url": self.url,
            "dry_run": self.dry_run,
            "head": self.head,
            "floor_before": self.floor_before,
            "floor_after": self.floor_after,
            "versions_collected": self.versions_collected,
            "files_removed": len(self.removed),
            "bytes_freed": self.bytes_freed,
            "kept_young": self.kept_young,
            "removed": [
                {"path": r.path, "bytes": r.bytes, "reason": r.reason} for r in self.removed
            ],
        }


def gc_floor(store: Store) -> int:
    """The oldest version not yet collected (0 if gc never collected any)."""
    raw = store.storage.try_read(m.GC_FILE)
    if raw is None:
        return 0
    return int(m.decode(raw, f"{store.display_url}/{m.GC_FILE}")["floor"])


def retention_floor(
    store: Store, *, keep: int | None = None, older_than_s: float | None = None
) -> int:
    """The floor a retention rule asks for: never above the head or a tagged version."""
    head = store.refresh()
    floor = gc_floor(store)
    if keep is None and older_than_s is None:
        return floor
    if keep is not None and older_than_s is not None:
        raise InvalidDataError(
            f"gc of {store.display_url}: give either keep or older_than, not both"
        )
    candidate = head
    if keep is not None:
        if keep < 1:
            raise InvalidDataError(
                f"gc of {store.display_url}: keep must be at least 1 (the head), not {keep}"
            )
        candidate = head - keep + 1
    else:
        cutoff = datetime.now(timezone.utc).timestamp() - float(older_than_s or 0)
        # Walk down from the head while versions are recent; only that run is loaded.
        while candidate - 1 >= floor and _created(store, candidate - 1) >= cutoff:
            candidate -= 1
    for version in store.tags().values():
        candidate = min(candidate, version)
    return max(floor, candidate)


def _created(store: Store, version: int) -> float:
    created = store.commit_record(version).created
    return datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()


def collect_garbage(
    store: Store,
    *,
    keep: int | None = None,
    older_than_s: float | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> GcResult:
    """Remove orphans older than ``grace_s`` and, with ``keep`` (newest versions to keep) or
    ``older_than_s``, the versions the rule lets go. ``dry_run`` only reports.
    ``progress(done, total)`` is called as files are removed."""
    if grace_s < 0:
        raise InvalidDataError(f"gc of {store.display_url}: the grace period cannot be negative")
    floor_before = gc_floor(store)
    floor = retention_floor(store, keep=keep, older_than_s=older_than_s)
    # List before computing references: a file committed in between is then seen as
    # referenced, and one written after the listing is not considered at all.
    files = _list_files(store)
    head = store.refresh()
    if floor > floor_before and not dry_run:
        _pin_floor(store, floor)
    keep_shards, keep_chunks, keep_schemas = _references(store, floor, head)
    collected = _references_below(store, floor_before, floor)
    now = time.time()
    result = GcResult(store.display_url, dry_run, head, floor_before, floor)
    for rel in files:
        reason = _classify(rel, floor, keep_shards, keep_chunks, keep_schemas)
        if reason is None:
            continue
        if reason == "orphan" and rel in collected:
            reason = "collected"
        if reason == "orphan" and not _old_enough(store, rel, now, grace_s):
            result.kept_young += 1
            continue
        result.removed.append(Removal(rel, _size(store, rel), reason))
    if not dry_run:
        # Data before metadata: an interrupted run leaves records the floor already hides.
        result.removed.sort(key=lambda r: (r.path.startswith(m.META_DIR), r.path))
        for done, removal in enumerate(result.removed, 1):
            store.storage.delete(removal.path)
            if progress is not None:
                progress(done, len(result.removed))
        log.info(
            "gc of %s: removed %d files (%d bytes), floor %d -> %d",
            store.display_url,
            len(result.removed),
            result.bytes_freed,
            floor_before,
            floor,
        )
    return result


def _pin_floor(store: Store, floor: int) -> None:
    """Make ``floor`` readable on its own, then publish it."""
    shards = store.snapshot(floor).shards
    record = store.commit_record(floor)
    files, shard_list = m.split_chunks(list(shards))
    for digest, data in files:
        store.storage.create_if_absent(m.chunk_path(digest), data)
    checkpoint = {
        "format": m.FORMAT,
        "store_id": record.store_id,
        "version": floor,
        "schema": record.schema,
        "num_rows": record.num_rows,
        "shards": shard_list.to_json(),
    }
    store.storage.create_if_absent(m.checkpoint_path(floor), m.encode(checkpoint))
    store.storage.put(m.GC_FILE, m.encode({"format": m.FORMAT, "floor": floor}))
    store.refresh()


def _references(store: Store, floor: int, head: int) -> tuple[set[str], set[str], set[str]]:
    """Shards, chunks and schemas that versions ``floor..head`` need. The shard set equals
    the union of every kept version's materialized list: a version's list is the floor's,
    or the latest base record's, followed by the rounds appended since."""
    shards = {s.path for s in store.snapshot(floor).shards}
    chunks: set[str] = set()
    schemas: set[str] = set()
    for version in range(floor, head + 1):
        record = store.commit_record(version)
        if record.schema is not None:
            schemas.add(record.schema)
        shards.update(s.path for s in record.add)
        if record.base is not None:
            chunks.update(record.base.chunks)
            if version > floor:
                shards.update(s.path for s in store.snapshot(version).shards)
    for name in store.storage.list(f"{m.META_DIR}/checkpoints"):
        match = _VERSION_FILE.match(name)
        if match is None or int(match.group(1)) < floor:
            continue
        rel = f"{m.META_DIR}/checkpoints/{name}"
        raw = store.storage.try_read(rel)
        if raw is not None:
            obj = m.decode(raw, f"{store.display_url}/{rel}")
            chunks.update(m.ShardList.from_json(obj["shards"], rel).chunks)
    return shards, chunks, schemas


def _references_below(store: Store, start: int, floor: int) -> set[str]:
    """Files the versions being collected referred to: removed without waiting out the grace
    period, since they are committed data and not a live writer's work in progress."""
    shards: set[str] = set()
    chunks: set[str] = set()
    schemas: set[str] = set()
    lists: list[m.ShardList] = []
    for version in range(start, floor):
        for rel in (m.log_path(version), m.checkpoint_path(version)):
            raw = store.storage.try_read(rel)
            if raw is None:
                continue
            try:
                obj = m.decode(raw, rel)
                if rel.startswith(f"{m.META_DIR}/log/"):
                    commit = m.Commit.from_json(obj, rel)
                    shards.update(s.path for s in commit.add)
                    if commit.schema is not None:
                        schemas.add(commit.schema)
                    if commit.base is not None:
                        lists.append(commit.base)
                else:
                    lists.append(m.ShardList.from_json(obj["shards"], rel))
            except (CorruptStoreError, KeyError) as exc:
                log.warning("gc: reading collected %s of %s: %s", rel, store.display_url, exc)
    for shard_list in lists:
        shards.update(s.path for s in shard_list.tail)
        for digest in shard_list.chunks:
            chunks.add(digest)
            raw = store.storage.try_read(m.chunk_path(digest))
            if raw is not None:
                try:
                    shards.update(s.path for s in m.decode_chunk(digest, raw, digest))
                except CorruptStoreError as exc:
                    log.warning("gc: reading chunk %s: %s", digest[:12], exc)
    return shards | {m.chunk_path(c) for c in chunks} | {m.schema_path(s) for s in schemas}


def _list_files(store: Store) -> list[str]:
    out = [f"{m.DATA_DIR}/{n}" for n in store.storage.list(m.DATA_DIR)]
    for sub in ("log", "checkpoints", "chunks", "schemas", "probe", "tags"):
        out.extend(f"{m.META_DIR}/{sub}/{n}" for n in store.storage.list(f"{m.META_DIR}/{sub}"))
    out.extend(f"{m.META_DIR}/{n}" for n in store.storage.list(m.META_DIR) if _is_tmp(n))
    return out


def _is_tmp(name: str) -> bool:
    return name.startswith(".tmp-")


def _classify(
    rel: str, floor: int, shards: set[str], chunks: set[str], schemas: set[str]
) -> str | None:
    """Why ``rel`` may go ("orphan" / "collected"), or None if it stays."""
    directory, name = rel.rsplit("/", 1)
    if _is_tmp(name) or directory == f"{m.META_DIR}/probe":
        return "orphan"  # an interrupted local write or an abandoned capability probe
    if directory == m.DATA_DIR:
        return None if rel in shards else "orphan"
    if directory in (f"{m.META_DIR}/log", f"{m.META_DIR}/checkpoints"):
        match = _VERSION_FILE.match(name)
        return "collected" if match and int(match.group(1)) < floor else None
    if directory == f"{m.META_DIR}/chunks" and name.endswith(".json"):
        return None if name[:-5] in chunks else "orphan"
    if directory == f"{m.META_DIR}/schemas" and name.endswith(".json"):
        return None if name[:-5] in schemas else "orphan"
    return None  # tags, the store file and anything not ours stay


def _old_enough(store: Store, rel: str, now: float, grace_s: float) -> bool:
    if grace_s <= 0:
        return True
    try:
        modified = store.storage.modified(rel)
    except FileNotFoundError:
        return False
    if modified is None:
        return False  # no timestamp: it could be a live writer's, so leave it
    return now - modified >= grace_s


def _size(store: Store, rel: str) -> int:
    try:
        return store.storage.size(rel)
    except FileNotFoundError:
        return 0
