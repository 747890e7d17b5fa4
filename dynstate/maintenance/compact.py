"""Compaction: rewrite runs of small shards as target-size shards in a new version.

A compaction never changes a version's logical rows or their order (SPEC §3.4): the new
version lists, in place of each run of consecutive small shards, shards holding exactly those
rows concatenated. Shards already at least half the target size are reused as they are. Old
shards are not deleted, so readers of earlier versions are unaffected; ``dynstate gc`` removes
them once no kept version refers to them.

Compaction races with writers: while version ``v`` is rewritten, other processes may append
``v+1 … h``. The commit then rebases onto ``h`` by keeping those rounds' shards after the
compacted ones — nothing is lost. If any of those versions is a reset or another compaction
the rewrite no longer describes the head, so it is abandoned with :class:`CommitConflictError`
and its new shards are removed.

This module only plans and rewrites: the new shards are staged and committed by the store's
writer (:meth:`dynstate.writes.Writer.stage_written`, :meth:`~dynstate.writes.Writer.commit_base`),
the one commit protocol — lease, claim, exclusive create, the checks after it, and what happens
to the shards when the record's outcome is unknown.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import InvalidDataError
from ..records.manifest import ShardRef
from ..records.rounds import check_meta
from ..records.rowgroups import ShardWriter, group_rows
from ..snapshot import Snapshot
from ..store import Store

log = logging.getLogger("dynstate")

DEFAULT_TARGET_BYTES = 128 * 2**20

# A plan step: either a shard kept as it is (a ShardRef) or a run of shards to merge (a list).
Step = ShardRef | list[ShardRef]


def plan(shards: Sequence[ShardRef], target_bytes: int) -> list[Step]:
    """Group consecutive shards smaller than ``target_bytes / 2`` into runs of about
    ``target_bytes``; everything else, and runs of one, stays as it is. Order is kept."""
    steps: list[Step] = []
    run: list[ShardRef] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if len(run) == 1:
            steps.append(run[0])
        elif run:
            steps.append(list(run))
        run.clear()
        size = 0

    for shard in shards:
        if shard.bytes * 2 >= target_bytes:
            flush()
            steps.append(shard)
            continue
        if run and size + shard.bytes > target_bytes:
            flush()
        run.append(shard)
        size += shard.bytes
    flush()
    return steps


def compact(
    store: Store,
    *,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    version: int | str | None = None,
    meta: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Rewrite the small shards of ``version`` (default: the head) as shards of about
    ``target_bytes`` and commit the result as a new version (``op="compact"``) with the same
    rows in the same order; returns its number. Rounds appended by other writers meanwhile are
    kept after the compacted rows. If there is nothing to merge, nothing is committed and
    ``version``'s number is returned. ``progress(done, total)`` counts source shards read.

    >>> store = Store.open("memory://doc/compact", create=True)
    >>> for step in range(3):
    ...     _ = store.append([{"step": step}])
    >>> compact(store)
    4
    >>> len(store.snapshot().shards)
    1
    """
    if isinstance(target_bytes, bool) or not isinstance(target_bytes, int) or target_bytes < 1:
        raise InvalidDataError(
            f"target_bytes for compacting {store.display_url} must be a positive int, "
            f"not {target_bytes!r}"
        )
    meta = check_meta(meta, store.display_url)
    writer = store.writer
    snap = store.snapshot(store.resolve(version))  # not a look of the caller's handle
    base = snap.version
    # Refuse early, before writing anything, when the head is not ``base`` plus appends.
    writer.appended_since(base, store.latest())
    steps = plan(snap.shards, target_bytes)
    if all(isinstance(step, ShardRef) for step in steps):
        log.info("nothing to compact in version %d of %s", base, store.display_url)
        return base
    compacted, staged = writer.stage_written(
        lambda new_path: _rewrite(store, snap, steps, new_path, progress), snap.schema
    )
    new_version = writer.commit_base(
        compacted,
        op="compact",
        schema=snap.schema,
        meta=meta,
        target=base,
        staged=staged,
        appends_after=base,
    )
    log.info(
        "compacted version %d of %s: %d shards -> %d (version %d)",
        base,
        store.display_url,
        len(snap.shards),
        len(compacted),
        new_version,
    )
    return new_version


def _rewrite(
    store: Store,
    snap: Snapshot,
    steps: list[Step],
    new_path: Callable[[], str],
    progress: Callable[[int, int], None] | None = None,
) -> list[ShardRef]:
    """The compacted shard list of ``snap``: runs are written as new shards named by
    ``new_path`` (the writer removes them if this fails part-way)."""
    out: list[ShardRef] = []
    total = sum(len(step) for step in steps if not isinstance(step, ShardRef))
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    for step in steps:
        if isinstance(step, ShardRef):
            out.append(step)
        else:
            out.append(_write_group(store, snap, step, new_path(), tick))
    return out


def _write_group(
    store: Store,
    snap: Snapshot,
    group: list[ShardRef],
    path: str,
    tick: Callable[[], None] | None = None,
) -> ShardRef:
    """Write the rows of a run of shards, in order, as one shard at ``path``, in the row
    groups a round's shards have (recorded, so a batch reads only those it needs). Source
    shards are read one at a time (verified, shaped like the snapshot's schema so older shards
    gain later nullable columns), so memory stays near one source shard's size."""
    rows = 0
    with store.storage.new_shard(path) as sink:
        writer: ShardWriter | None = None
        try:
            for shard in group:
                table = store.read_shard(shard, snap.schema, version=snap.version)
                if writer is None:
                    per_group = group_rows(sum(s.rows for s in group), local=store.reads_in_place)
                    writer = ShardWriter(sink, snap.schema or table.schema, per_group)
                writer.write(table)
                rows += table.num_rows
                if tick is not None:
                    tick()
            groups = writer.close() if writer is not None else None
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
    return ShardRef(path, rows, sink.size, sink.sha256, groups)


def compact_if_needed(
    store: Store,
    *,
    max_small_shards: int = 1000,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    meta: dict[str, Any] | None = None,
) -> int | None:
    """Compact the head when it has more than ``max_small_shards`` shards smaller than
    ``target_bytes / 2`` — a policy a training loop can call after each round. Returns the
    new version, or None when the head is compact enough (then nothing is read or written
    beyond the head's metadata, or when its small shards stand alone between large ones)."""
    if isinstance(max_small_shards, bool) or not isinstance(max_small_shards, int):
        raise InvalidDataError(
            f"max_small_shards for {store.display_url} must be an int, not {max_small_shards!r}"
        )
    if max_small_shards < 1:
        raise InvalidDataError(
            f"max_small_shards for {store.display_url} must be at least 1, not {max_small_shards}"
        )
    snap = store.snapshot(store.resolve(None))
    small = sum(1 for s in snap.shards if s.bytes * 2 < target_bytes)
    if small <= max_small_shards:
        return None
    new = compact(store, target_bytes=target_bytes, meta=meta, version=snap.version)
    # Small shards between large ones cannot be merged; then nothing was committed.
    return None if new == snap.version else new
