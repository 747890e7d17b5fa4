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
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .. import manifest as m
from ..errors import CommitConflictError, DynstateError, InvalidDataError
from ..log import shard_path
from ..log.outcomes import outcomes_of
from ..manifest import Commit, ShardRef
from ..rounds import check_meta
from ..snapshot import Snapshot
from ..store import Store

log = logging.getLogger("dynstate")

DEFAULT_TARGET_BYTES = 128 * 2**20
# Decoded rows buffered before they are written as one row group of a compacted shard.
_ROW_GROUP_BYTES = 32 * 2**20

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
    snap = store.snapshot(version)
    base = snap.version
    # Refuse early, before writing anything, when the head is not ``base`` plus appends.
    _appended_since(store, base, store.refresh())
    steps = plan(snap.shards, target_bytes)
    if all(isinstance(step, ShardRef) for step in steps):
        log.info("nothing to compact in version %d of %s", base, store.display_url)
        return base
    store.log.require_writable()
    written: list[ShardRef] = []
    attempts: list[Commit] = []
    # The new shards are staged files like any round's: a lease keeps gc away from them.
    lease = store.log.leases.acquire()
    try:
        compacted = _rewrite(store, snap, steps, written, lease, progress)
        if snap.schema is not None:
            store.log.put_schema(snap.schema)
        store.log.leases.claim({lease}, uuid.uuid4().hex)
        new_version = store.log.commit(
            lambda parent: _compact_record(store, parent, base, compacted, meta),
            sources=[base],
            attempts=attempts,
        )
    except BaseException:
        if _any_committed(store, attempts):
            store.log.leases.end({lease}, committed=True)
        else:
            for shard in written:
                _delete_quietly(store, shard.path)
            store.log.leases.end({lease}, committed=False)
        raise
    store.log.leases.end({lease}, committed=True)
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
    written: list[ShardRef],
    lease: str,
    progress: Callable[[int, int], None] | None = None,
) -> list[ShardRef]:
    """The compacted shard list of ``snap``; new shards are added to ``written`` as they are
    written, so that a failure part-way can remove them."""
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
            out.append(_write_group(store, snap, step, written, lease, tick))
    store.storage.sync_dir(m.DATA_DIR)
    return out


def _write_group(
    store: Store,
    snap: Snapshot,
    group: list[ShardRef],
    written: list[ShardRef],
    lease: str,
    tick: Callable[[], None] | None = None,
) -> ShardRef:
    """Write the rows of a run of shards, in order, as one shard. Source shards are read one
    at a time (verified, shaped like the snapshot's schema so older shards gain later nullable
    columns) and written as row groups of about ``_ROW_GROUP_BYTES``, so memory stays near
    the output's size rather than several times the decoded group."""
    path = shard_path(lease)
    rows = 0
    with store.storage.new_shard(path) as sink:
        writer: pq.ParquetWriter | None = None
        pending: list[pa.Table] = []
        pending_bytes = 0
        try:
            for shard in group:
                table = store.read_shard(shard, snap.schema, version=snap.version)
                if writer is None:
                    writer = pq.ParquetWriter(sink, snap.schema or table.schema)
                pending.append(table)
                pending_bytes += table.nbytes
                rows += table.num_rows
                if tick is not None:
                    tick()
                if pending_bytes >= _ROW_GROUP_BYTES:
                    writer.write_table(pa.concat_tables(pending))
                    pending, pending_bytes = [], 0
            if pending and writer is not None:
                writer.write_table(pa.concat_tables(pending))
        finally:
            if writer is not None:
                writer.close()
    ref = ShardRef(path, rows, sink.size, sink.sha256)
    written.append(ref)
    return ref


def _appended_since(store: Store, base: int, head: int) -> list[ShardRef]:
    """The shards added by versions ``base+1 … head``, which must all be appends."""
    added: list[ShardRef] = []
    for v in range(base + 1, head + 1):
        record = store.commit_record(v)
        if record.op != "append":
            raise CommitConflictError(
                f"cannot compact version {base} of {store.display_url}: version {v} is a "
                f"{record.op}, so the head is no longer version {base} plus appends; compact "
                "the head instead (run it again)"
            )
        added.extend(record.add)
    return added


def _compact_record(
    store: Store, parent: Commit, base: int, compacted: list[ShardRef], meta: dict[str, Any]
) -> Commit:
    shards = compacted + _appended_since(store, base, parent.version)
    shard_list = store.log.put_shard_list(shards)
    # The new record stands alone like its shard list: it carries the lineage's outcomes.
    outcomes, state = outcomes_of(store.log).carry(parent.version)
    if parent.num_rows != sum(s.rows for s in shards):  # pragma: no cover - invariant
        raise CommitConflictError(
            f"compaction of {store.display_url} does not match version {parent.version} "
            f"({parent.num_rows} rows); run it again"
        )
    return Commit(
        store.store_id,
        parent.version + 1,
        parent.version,
        "compact",
        m.utc_now(),
        # Rounds appended meanwhile may have added nullable columns; the head's schema is a
        # superset of base's, and shards read back are conformed to it.
        parent.schema,
        parent.num_rows,
        len(shards),
        sum(s.bytes for s in shards),
        base=shard_list,
        target=base,
        meta=meta,
        outcomes=outcomes,
        generator_state=state,
    )


def _any_committed(store: Store, attempts: list[Commit]) -> bool:
    """Whether one of our records may have been committed even though an error was raised
    (an object store can apply a PUT and then fail the response). When unsure, say yes:
    leaving orphan shards for gc is safe, deleting committed ones is not."""
    try:
        return store.log.landed(attempts) is not None
    except BaseException:
        return True


def _delete_quietly(store: Store, rel: str) -> None:
    try:
        store.storage.delete(rel)
    except DynstateError as exc:
        log.warning("could not remove %s of %s: %s (gc will)", rel, store.display_url, exc)


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
    snap = store.snapshot()
    small = sum(1 for s in snap.shards if s.bytes * 2 < target_bytes)
    if small <= max_small_shards:
        return None
    new = compact(store, target_bytes=target_bytes, meta=meta, version=snap.version)
    # Small shards between large ones cannot be merged; then nothing was committed.
    return None if new == snap.version else new
