"""Outcome files, their lineage and the per-row aggregates: the only code that reads or
writes them. :class:`Outcomes` (one per commit log, :func:`outcomes_of`) is what the store,
the writer, compaction, gc and verify ask (gc's and verify's side: :mod:`.outcome_refs`).
One file past 400 lines because :class:`Outcomes` is one cache-holding object — lineages,
decoded files and aggregates are shared by its reading, writing and checkpointing, and a
split would spread one object's private state over modules.

Every version has an ordered *outcome file list*, like its shard list: an append adds the
files of its round's outcomes (``outcomes.add`` in its record); a reset or a compaction
carries the complete list of its source (``outcomes.base``); ``_dynstate/outcomes/<v>.json``
(an *outcome checkpoint*, written after every 100th commit and for each gc floor) repeats the
complete list of ``v`` with a per-row aggregate over it. So the outcomes of any version are
found by walking at most 99 records back, exactly as its shards are, and the statistics at
a version cost one aggregate plus the files appended since it — never the whole history.
Outcome files live in ``data/`` under the writer's lease, so gc, leases and symlink checks
treat them exactly as shards. See docs/format.md, "Outcomes".
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import paths
from ..errors import (
    ChecksumMismatchError,
    CorruptStoreError,
    DynstateError,
    InvalidDataError,
    MissingShardError,
)
from ..records import manifest as m
from ..records.aggregate import Aggregate
from ..records.manifest import Commit, ShardRef
from ..records.outcomes import (
    DEFAULT_HALF_LIFE,
    DEFAULT_SUCCESS_ABOVE,
    MAX_SCORE,
    Ranges,
    as_numpy,
    check_generator_state,
    check_outcomes,
    overlap,
    steps_of,
    unify_extras,
    union,
    valid_ranges,
)
from ..records.rowgroups import read_parquet
from ..threads import ProcessPool
from .catalog import Touches
from .leases import shard_path

if TYPE_CHECKING:
    from ..storage import DeferredSync
    from .commits import Log

log = logging.getLogger("dynstate")

# The names of outcome checkpoints and aggregates are made and matched in dynstate.paths.
OUTCOME_DIR = paths.OUTCOME_DIR
AGGREGATE_DIR = paths.AGGREGATE_DIR
checkpoint_path = paths.outcome_checkpoint_path
aggregate_path = paths.aggregate_path

# The outcome files' Parquet compression, as the shards' (any Parquet reader reads each; see
# encode_outcome_file): LZ4 encodes 2,048 records as fast as Snappy, 3 % smaller, and
# decodes them in 100 µs instead of 139 (a lineage walk decodes every file it reads).
OUTCOME_COMPRESSION = "lz4"
OUTCOME_SCHEMA = pa.schema([("row", pa.int64()), ("step", pa.int64()), ("score", pa.float64())])
_OUTCOME_TYPES = list(OUTCOME_SCHEMA.types)


@dataclass(frozen=True)
class AggregateRef:
    """A stored per-row aggregate over the first ``files`` files of an outcome list."""

    path: str
    bytes: int
    sha256: str
    files: int
    success_above: float
    half_life: float

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "files": self.files,
            "success_above": self.success_above,
            "half_life": self.half_life,
        }

    @classmethod
    def from_json(cls, obj: Any, where: str) -> AggregateRef:
        try:
            path, digest = obj["path"], obj["sha256"]
            if paths.match_aggregate(path) != digest:
                from ..errors import UnsafePathError

                raise UnsafePathError(
                    f"{where} names aggregate {path!r}, which is not an aggregate of this store; "
                    "the record was tampered with — reset past it"
                )
            nbytes, files = obj["bytes"], obj["files"]
            above, half = obj["success_above"], obj["half_life"]
            if not (
                type(nbytes) is int
                and type(files) is int
                and nbytes >= 0
                and files >= 0
                and isinstance(above, (int, float))
                and isinstance(half, (int, float))
                and half > 0
            ):
                raise TypeError("malformed aggregate entry")
            return cls(path, nbytes, digest, files, float(above), float(half))
        except (KeyError, TypeError) as exc:
            raise CorruptStoreError(f"{where} has a malformed aggregate entry ({exc})") from exc


@dataclass(frozen=True)
class Lineage:
    """What a version's lineage holds: its outcome files in order — a stored list (a
    checkpoint's or a base record's, left unexpanded: statistics need only what follows the
    aggregate) then ``tail`` — the steps they cover, the number of records, the newest
    stored aggregate over a prefix of the files, and the generator state committed last
    (None: none). :meth:`Outcomes.files` expands it."""

    version: int
    prefix: m.ShardList | None = None
    prefix_count: int = 0
    where: str = ""
    tail: tuple[ShardRef, ...] = ()
    steps: tuple[tuple[int, int], ...] = ()
    records: int = 0
    aggregate: AggregateRef | None = None
    state: Any = None

    @property
    def count(self) -> int:
        """How many outcome files the lineage holds."""
        return self.prefix_count + len(self.tail)

    @property
    def step_ranges(self) -> Ranges:
        return [list(r) for r in self.steps]


def _prefix(shard_list: m.ShardList) -> int:
    return len(shard_list.chunks) * m.CHUNK_ENTRIES + len(shard_list.tail)


@dataclass(frozen=True)
class Pending:
    """One commit's checked outcomes and state; ``ref``/``lease`` once the file is written."""

    table: pa.Table | None
    steps: Ranges
    state: Any
    checked_at: int
    ref: ShardRef | None = None
    lease: str | None = None


_CACHE_FILES = 512
# Reads of the outcome files a call needs and has not cached, many at once.
_READS = ProcessPool("dynstate-outcome-read")
_CACHE_DENSE = 2


class Outcomes:
    """Outcome lineages, files and aggregates of one store, with caches of what never
    changes once written (records, checkpoints, files, aggregates)."""

    def __init__(self, log_: Log) -> None:
        self.log = log_
        self.storage = log_.storage
        self._lineages: OrderedDict[int, Lineage] = OrderedDict()
        # lineages walked while an outcome checkpoint on their way was in flight, with its
        # version: reused only while it still is (see lineage)
        self._provisional: dict[int, tuple[int, Lineage]] = {}
        self._files: OrderedDict[str, pa.Table] = OrderedDict()
        self._files_lock = threading.Lock()  # files are read from a thread pool
        self._dense: list[tuple[tuple[float, float], int, str | None, Aggregate]] = []
        self._since: int | None = None  # set once store.json says the store holds outcomes
        # bytes of aggregates this handle just named in a record or checkpoint, to rewrite
        # one a concurrent gc removed before that create (see restore_named)
        self._named_aggregates: OrderedDict[str, bytes] = OrderedDict()
        self._named_lock = threading.Lock()
        self._aggregate_touches = Touches(limit=4)
        # the outcome checkpoint written in the background (write_checkpoint), one at a time
        self._checkpointing: threading.Thread | None = None
        self._checkpoint_lock = threading.Lock()

    @property
    def display_url(self) -> str:
        return self.log.display_url

    # -- lineage ---------------------------------------------------------------------------

    def lineage(self, version: int) -> Lineage:
        """The outcomes of ``version``'s lineage: walk back to the nearest base record
        (create, reset, compaction), outcome checkpoint or the gc floor — at most K - 1
        records, as for shards. A gc since this handle last read the floor may have collected
        records on the way from the older floor: then the floor is read again and the walk
        starts over from it, or, if ``version`` itself is below it now,
        :class:`VersionCollectedError` (:meth:`Log.walk_kept`, as for shard lists)."""
        return self.log.walk_kept(version, self._walk)

    def _walk(self, version: int) -> Lineage:
        cached = self._lineages.get(version) or self._provisional_lineage(version)
        if cached is not None:
            return cached
        since = self.outcomes_since()
        if since is None or version <= since:
            return Lineage(version)  # nothing in this lineage was committed with outcomes
        adds: list[tuple[list[ShardRef], Ranges, int]] = []
        state: Any = None
        in_flight: int | None = None  # the checkpoint in flight this lineage would miss
        floor = self.log.floor
        v = version
        while True:
            if v <= since:
                base = Lineage(v)
                break
            if v != version and v in self._lineages:
                base = self._lineages[v]
                break
            if v != version:
                provisional = self._provisional.get(v)
                if provisional is not None and self._checkpoint_in_flight(provisional[0]):
                    in_flight, base = provisional
                    break
            record = self.log.commit_record(v)
            if state is None and record.generator_state is not None:
                state = record.generator_state
            if record.base is not None or record.op != "append":
                base = self._base_of(record)
                break
            if v == floor or v % m.CHECKPOINT_INTERVAL == 0:
                # Asked before the read: a checkpoint this handle is still writing appears
                # later, and a lineage cached without it would name no aggregate for good.
                if in_flight is None and self._checkpoint_in_flight(v):
                    in_flight = v
                found = self.read_checkpoint(v)
                if found is not None:
                    base = found
                    break
                if v == floor:
                    # A floor without an outcome checkpoint was published by a dynstate that
                    # knew no outcomes; nothing below it held any (such a dynstate refuses a
                    # store that does).
                    adds.append(self._add_of(record))
                    base = Lineage(v)
                    break
            adds.append(self._add_of(record))
            v -= 1
        tail = list(base.tail)
        steps = base.step_ranges
        records = base.records
        for add_files, add_steps, add_records in reversed(adds):
            tail.extend(add_files)
            if add_steps:
                steps = union(steps, add_steps)
            records += add_records
        result = replace(
            base,
            version=version,
            tail=tuple(tail),
            steps=tuple((a, b) for a, b in steps),
            records=records,
            state=state if state is not None else base.state,
        )
        if in_flight is None:
            self._lineages[version] = result
            if len(self._lineages) > 256:
                self._lineages.popitem(last=False)
        else:
            # Right for its files and steps, only without the aggregate to come: the next
            # commit's step check walks one record back to it, not ~100 to the checkpoint
            # below, for as long as the checkpoint is written (~0.5 s: ~100 commits).
            self._provisional[version] = (in_flight, result)
            while len(self._provisional) > 256:
                self._provisional.pop(next(iter(self._provisional)))
        return result

    def _provisional_lineage(self, version: int) -> Lineage | None:
        """The lineage of ``version`` walked while the checkpoint it would stop at was in
        flight, while it still is; once that checkpoint is written they are all dropped, so
        the next walk finds it (and its aggregate)."""
        found = self._provisional.get(version)
        if found is None:
            return None
        if self._checkpoint_in_flight(found[0]):
            return found[1]
        self._provisional.clear()
        return None

    def _checkpoint_in_flight(self, version: int) -> bool:
        """Whether this handle is writing the outcome checkpoint of ``version`` right now."""
        thread = self._checkpointing
        return (
            thread is not None
            and thread.is_alive()
            and thread.name == _checkpoint_thread_name(version)
        )

    def outcomes_since(self) -> int | None:
        """None while the store holds no outcomes (``store.json`` at format 1); else the
        newest version that cannot hold any (the head when the store was marked). Read after
        the version asked about was resolved: a store is marked before its first record with
        outcomes is created, so a version that holds them is never missed."""
        if self._since is not None:
            return self._since
        raw = self.storage.try_read(m.STORE_FILE)
        if raw is None:
            self.log.require_store()  # raises: the store was deleted while open
            raw = self.storage.read(m.STORE_FILE)  # it came back meanwhile
        obj = m.decode(raw, self.log.where(m.STORE_FILE))
        if obj.get("format", 1) < m.OUTCOMES_FORMAT:
            return None
        since = obj.get("outcomes_since", -1)
        self._since = since if type(since) is int and since >= -1 else -1
        return self._since

    def _where(self, record: Commit) -> str:
        return self.log.where(m.log_path(record.version))

    def _add_of(self, record: Commit) -> tuple[list[ShardRef], Ranges, int]:
        field = record.outcomes
        if field is None:
            return [], [], 0
        where = self._where(record)
        if not isinstance(field.get("add"), list):
            raise CorruptStoreError(f"{where} has malformed outcomes (no add list)")
        files = [ShardRef.from_json(s, where) for s in field["add"]]
        return files, _steps(field, where), _count(field, "records", where)

    def added(self, record: Commit) -> list[ShardRef]:
        """The outcome files an append record adds (none for other records)."""
        field = record.outcomes
        if field is None or record.base is not None or record.op != "append":
            return []
        return self._add_of(record)[0]

    def _base_of(self, record: Commit) -> Lineage:
        field = record.outcomes
        if field is None:
            return Lineage(record.version)
        where = self._where(record)
        if "base" not in field:
            raise CorruptStoreError(f"{where} has malformed outcomes (a {record.op} needs base)")
        files = m.ShardList.from_json(field["base"], where)
        aggregate = field.get("aggregate")
        return Lineage(
            record.version,
            files,
            _prefix(files),
            where,
            steps=tuple((a, b) for a, b in _steps(field, where)),
            records=_count(field, "records", where),
            aggregate=None if aggregate is None else AggregateRef.from_json(aggregate, where),
        )

    def read_checkpoint(self, version: int) -> Lineage | None:
        rel = checkpoint_path(version)
        raw = self.storage.try_read(rel)
        if raw is None:
            return None
        where = self.log.where(rel)
        obj = m.decode(raw, where)
        if obj.get("store_id") != self.log.store_id or obj.get("version") != version:
            raise CorruptStoreError(
                f"{where} belongs to version {obj.get('version')!r} of store "
                f"{obj.get('store_id')!r}; it was copied from elsewhere — remove it"
            )
        files = m.ShardList.from_json(obj.get("files"), where)
        aggregate = obj.get("aggregate")
        return Lineage(
            version,
            files,
            _prefix(files),
            where,
            steps=tuple((a, b) for a, b in _steps(obj, where)),
            records=_count(obj, "records", where),
            aggregate=None if aggregate is None else AggregateRef.from_json(aggregate, where),
            state=obj.get("generator_state"),
        )

    # -- a lineage's file list ------------------------------------------------------------

    def files(self, lineage: Lineage) -> list[ShardRef]:
        """Every outcome file of the lineage, in order."""
        head = [] if lineage.prefix is None else self._expand(lineage)
        return [*head, *lineage.tail]

    def files_from(self, lineage: Lineage, start: int) -> list[ShardRef]:
        if start >= lineage.prefix_count:
            return list(lineage.tail[start - lineage.prefix_count :])
        return self.files(lineage)[start:]

    def file_at(self, lineage: Lineage, index: int) -> ShardRef:
        """The ``index``-th file, expanding at most the one chunk that holds it."""
        if index >= lineage.prefix_count:
            return lineage.tail[index - lineage.prefix_count]
        assert lineage.prefix is not None
        chunk, offset = divmod(index, m.CHUNK_ENTRIES)
        if chunk < len(lineage.prefix.chunks):
            one = m.ShardList((lineage.prefix.chunks[chunk],), ())
            return self.log.expand(one, lineage.where)[offset]
        return lineage.prefix.tail[index - len(lineage.prefix.chunks) * m.CHUNK_ENTRIES]

    def _expand(self, lineage: Lineage) -> list[ShardRef]:
        assert lineage.prefix is not None
        files = self.log.expand(lineage.prefix, lineage.where)
        if len(files) != lineage.prefix_count:
            raise CorruptStoreError(
                f"{lineage.where} names {lineage.prefix_count} outcome files but its chunks "
                f"hold {len(files)}; run `dynstate verify`"
            )
        return files

    def lineage_files(self, version: int) -> list[ShardRef]:
        return self.files(self.lineage(version))

    # -- reading ---------------------------------------------------------------------------

    def read_file(
        self, ref: ShardRef, version: int | None = None, *, cache: bool = True
    ) -> pa.Table:
        """One outcome file, verified against its recorded size and checksum; kept in the
        handle's cache unless ``cache`` is False."""
        with self._files_lock:
            cached = self._files.get(ref.path)
            if cached is not None:
                self._files.move_to_end(ref.path)
                return cached
        at = f" (version {version})" if version is not None else ""
        where = f"{self.display_url}{at}"

        def check(data: bytes) -> None:
            if len(data) != ref.bytes or m.sha256(data) != ref.sha256:
                raise ChecksumMismatchError(
                    f"outcome file {ref.path} of {where} does not match its checksum; restore "
                    "it or reset to a version without it"
                )

        try:
            data = self.storage.read(ref.path, check=check)
        except FileNotFoundError:
            raise MissingShardError(
                f"outcome file {ref.path} of {where} is missing; restore it, or reset the "
                "store to a version that does not use it"
            ) from None
        try:
            table = read_parquet(data)
        except (pa.ArrowException, OSError) as exc:
            raise CorruptStoreError(
                f"outcome file {ref.path} of {where} is not readable Parquet ({exc})"
            ) from None
        if table.num_rows != ref.rows or table.schema.names[:3] != list(OUTCOME_SCHEMA.names):
            raise CorruptStoreError(
                f"outcome file {ref.path} of {where} does not hold the {ref.rows} outcome "
                "records its commit record names"
            )
        if version is not None:
            self._check_file(table, ref.path, version, where)
        if cache:
            self._cache_file(ref.path, table)
        return table

    def _check_file(
        self,
        table: pa.Table,
        path: str,
        version: int,
        where: str,
        *,
        rows: tuple[int, str] | None = None,
        steps: tuple[tuple[int, int], ...] | None = None,
    ) -> None:
        """The writer's bounds (:func:`dynstate.records.outcomes.check_outcomes`), applied to a file
        read back: bytes that match their checksum may still have been written by a tool
        that knew no bounds, and statistics index rows and fold steps and scores with them.
        Every file of ``version``'s lineage names rows of that version (rows only ever grow
        along a lineage) and steps its records list; scores lie within ``MAX_SCORE`` and
        float fields are finite (or null). ``rows`` and ``steps`` narrow the first two where
        the caller knows the record that added the file (verify): (the rows of the version it
        was appended to, that version's name), and the steps that record lists."""

        def damaged(why: str) -> CorruptStoreError:
            return CorruptStoreError(
                f"outcome file {path} of {where} {why}; the file is damaged — run `dynstate "
                "verify`, and reset to a version without it"
            )

        # Each bound is one numpy reduction over a column (a file is read whole, once per
        # handle): 2,048 records of four columns are checked in ~50 us, a quarter of the
        # time their decoding takes (measured on a loaded 2-core machine: 51 us, 199 us).
        columns = table.columns
        if table.schema.types[:3] != _OUTCOME_TYPES or any(c.null_count for c in columns[:3]):
            first = table.schema.remove_metadata()
            raise damaged(f"has columns {first}, not {OUTCOME_SCHEMA} without nulls")
        if not table.num_rows:
            return
        num_rows, of = rows or (self.log.commit_record(version).num_rows, f"version {version}")
        values = as_numpy(columns[0])
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= num_rows:
            bad = low if low < 0 else high
            raise damaged(f"names row {bad}, but {of} has {num_rows} rows")
        listed = self.lineage(version).steps if steps is None else steps
        outside = _outside(as_numpy(columns[1]), listed)
        if outside is not None:
            whose = f"version {version}'s lineage" if steps is None else f"version {version}"
            raise damaged(f"names step {outside}, which the commit records of {whose} do not list")
        magnitude = np.abs(as_numpy(columns[2]))
        if not magnitude.max() <= MAX_SCORE:  # NaN fails it too
            worst = as_numpy(columns[2])[np.argmax(~(magnitude <= MAX_SCORE))]
            raise damaged(f"holds score {worst}, beyond |score| <= {MAX_SCORE:g}")
        for name, column in zip(table.column_names[3:], columns[3:], strict=True):
            if not pa.types.is_floating(column.type):
                continue
            if column.null_count:
                # rare (an extra column with nulls); pyarrow.compute costs a fresh process 40 ms
                import pyarrow.compute as pc

                finite = pc.all(pc.fill_null(pc.is_finite(column), True)).as_py()
            else:
                finite = np.isfinite(as_numpy(column)).all()
            if not finite:
                raise damaged(f"holds NaN or infinity in {name!r}")

    def _cache_file(self, path: str, table: pa.Table) -> None:
        with self._files_lock:
            self._files[path] = table
            self._files.move_to_end(path)
            while len(self._files) > _CACHE_FILES:
                self._files.popitem(last=False)

    def _read_files(self, refs: list[ShardRef], version: int) -> list[pa.Table]:
        with self._files_lock:
            tables: list[pa.Table | None] = [self._files.get(r.path) for r in refs]
            for ref, table in zip(refs, tables, strict=True):
                if table is not None:
                    self._files.move_to_end(ref.path)
        missing = [i for i, table in enumerate(tables) if table is None]
        # Only the newest files a cache holds are kept: a lineage longer than the cache would
        # otherwise evict, file by file, what the next call reads first, and re-read it all.
        newest = len(refs) - _CACHE_FILES

        def read_one(i: int) -> pa.Table:
            return self.read_file(refs[i], version, cache=i >= newest)

        if len(missing) <= 2:
            read = [read_one(i) for i in missing]
        else:
            # Object stores answer many small GETs at once far faster than one after another.
            try:
                read = list(_READS.executor(8).map(read_one, missing))
            except RuntimeError:
                # "cannot schedule new futures after interpreter shutdown": the background
                # checkpoint runs on while a normal exit waits for it (write_checkpoint). Any
                # other RuntimeError is raised again by the same reads one after another.
                read = [read_one(i) for i in missing]
        for i, table in zip(missing, read, strict=True):
            tables[i] = table
        return [t for t in tables if t is not None]

    def records(self, version: int) -> pa.Table:
        """Every outcome record of ``version``'s lineage, oldest commit first; extra columns
        a commit lacks are null there."""
        lineage = self.lineage(version)
        tables = self._read_files(self.files(lineage), version)
        if not tables:
            return OUTCOME_SCHEMA.empty_table()
        return pa.concat_tables(unify_extras(tables), promote_options="default")

    def read_aggregate(self, ref: AggregateRef) -> Aggregate:
        where = self.log.where(ref.path)
        data = self.storage.read(ref.path)
        if len(data) != ref.bytes or m.sha256(data) != ref.sha256:
            raise ChecksumMismatchError(f"{where} does not match its checksum; it was modified")
        try:
            table = read_parquet(data)
        except (pa.ArrowException, OSError) as exc:
            raise CorruptStoreError(f"{where} is not readable Parquet ({exc})") from None
        return Aggregate.from_table(table, where)

    def aggregate(
        self,
        version: int,
        success_above: float = DEFAULT_SUCCESS_ABOVE,
        half_life: float = DEFAULT_HALF_LIFE,
    ) -> Aggregate:
        """The per-row aggregate of ``version``: from the newest stored aggregate (or one this
        handle computed) over a prefix of its outcome list, plus the files after it."""
        return self._aggregate(version, success_above, half_life).copy()

    def _aggregate(self, version: int, success_above: float, half_life: float) -> Aggregate:
        """:meth:`aggregate`, shared with this handle's cache: never modify it."""
        lineage = self.lineage(version)
        num_rows = self.log.commit_record(version).num_rows
        params = (success_above, half_life)
        count = lineage.count
        last = self.file_at(lineage, count - 1).path if count else None
        start, agg, owned = 0, None, False
        for cached_params, k, cached_last, cached in self._dense:
            # File names are unique and every list is a lineage's, in order: two lists that
            # hold the same file at one index agree on everything before it.
            # (A version of fewer rows with the same files: a reset past rows added later.)
            if (
                cached_params == params
                and start < k <= count
                and cached.num_rows <= num_rows
                and self.file_at(lineage, k - 1).path == cached_last
            ):
                start, agg = k, cached
        stored = lineage.aggregate
        if (
            stored is not None
            and start < stored.files <= count
            and (stored.success_above, stored.half_life) == params
        ):
            try:
                agg, start, owned = self.read_aggregate(stored), stored.files, True
            except (FileNotFoundError, DynstateError) as exc:
                # Aggregates only repeat what the files say: fold the files instead.
                log.warning("outcome aggregate of %s unusable (%s)", self.display_url, exc)
        if agg is None:
            agg, start, owned = Aggregate.empty(num_rows, success_above, half_life), 0, True
        tables = self._read_files(self.files_from(lineage, start), version)
        if start == count and agg.num_rows == num_rows:
            return agg  # nothing to add
        # the cached aggregate stays as it was
        if agg.num_rows < num_rows:
            agg = agg.grow(num_rows)
        elif not owned:
            agg = agg.copy()
        if tables:
            # one pass over all of them (extra columns play no part)
            agg.fold(pa.concat_tables([t.select(["row", "step", "score"]) for t in tables]))
        self._dense = [e for e in self._dense if e[0] != params or e[2] != last]
        self._dense.append((params, count, last, agg))
        del self._dense[:-_CACHE_DENSE]
        return agg

    def stats(
        self, version: int, success_above: float, half_life: float, pending: Any = None
    ) -> pa.Table:
        """The statistics of ``version``; with ``pending`` (outcomes in any form ``append``
        takes, not committed yet: a step in progress), as if they were committed on top of
        it. Pending outcomes are checked as a commit's are — rows of ``version``, steps its
        lineage has no outcomes for (else they would count twice) — and nothing is written.

        Any ``success_above`` with the default half-life comes from the default aggregate's
        score histogram (bounded like the default). Without one (more than
        ``MAX_SCORE_VALUES`` distinct scores), and for another half-life, it comes from an
        aggregate of those parameters, which no stored aggregate is: every record is read
        once per handle, then only the files a later version adds."""
        agg = self._aggregate(version, DEFAULT_SUCCESS_ABOVE, DEFAULT_HALF_LIFE)
        if half_life != DEFAULT_HALF_LIFE or agg.successes_above(success_above) is None:
            agg = self._aggregate(version, success_above, half_life)
        if pending is None:
            return agg.stats(success_above)
        record = self.log.commit_record(version)
        table = check_outcomes(pending, self.display_url, record.num_rows, version)
        steps = steps_of(table)
        self._check_new_steps(steps, record, pending=True)
        mine = agg.copy()  # the cached aggregate stays that of the committed version
        mine.fold(table.select(["row", "step", "score"]))
        if mine.successes_above(success_above) is None:  # the pending scores widened it
            mine = self._aggregate(version, success_above, half_life).copy()
            mine.fold(table.select(["row", "step", "score"]))
        return mine.stats(success_above)

    def generator_state(self, version: int) -> Any:
        state = self.lineage(version).state
        # A copy the caller may change; not through json: a process whose int string limit
        # is lower than the store's bound (640 digits at least) reads the state all the same.
        return None if state is None else copy.deepcopy(state)

    # -- writing ---------------------------------------------------------------------------

    def check(self, outcomes: Any, generator_state: Any, head: Commit) -> Pending | None:
        """Validate a commit's outcomes and state against the head it will be appended to,
        before anything is written."""
        if outcomes is None and generator_state is None:
            return None
        url = self.display_url
        table, steps = None, []
        if outcomes is not None:
            table = check_outcomes(outcomes, url, head.num_rows, head.version)
            steps = steps_of(table)
            self._check_new_steps(steps, head)
            if table.num_rows == 0:
                table = None
        state = (
            None
            if generator_state is None
            else check_generator_state(generator_state, url, exact=True)
        )
        if table is None and state is None:
            return None
        return Pending(table, steps, state, head.version)

    def _check_new_steps(self, steps: Ranges, parent: Commit, *, pending: bool = False) -> None:
        if not steps:
            return
        dup = overlap(self.lineage(parent.version).step_ranges, steps)
        if not dup:
            return
        listed = ", ".join(map(str, dup))
        if pending:
            raise InvalidDataError(
                f"pending outcomes for {self.display_url}: step(s) {listed} already have "
                f"outcomes in version {parent.version}, so they would count twice; pass only "
                "the outcomes of the step in progress (not committed yet)"
            )
        raise InvalidDataError(
            f"outcomes for {self.display_url}: step(s) {listed} already have outcomes in the "
            f"lineage of version {parent.version}; each step's outcomes are committed once "
            "(roll back to before that step to record them again)"
        )

    def write(self, pending: Pending, *, sync: bool = True) -> Pending:
        """Write the outcome file under a lease of its own (gc leaves it alone until the
        commit names it, as it does a round's shards), for parts staged elsewhere
        (``commit_staged``); ``append`` writes it under its round's lease with
        :meth:`write_file`. ``sync=False``: the caller makes the ``data/`` entry durable."""
        if pending.ref is not None:
            return pending  # written already
        self.mark_store()
        if pending.table is None:
            return pending
        lease = self.log.leases.acquire()
        try:
            written = self.write_file(pending, lease)
            if sync:
                self.storage.sync_dir(m.DATA_DIR)
        except BaseException:
            self.log.leases.end({lease}, committed=False, tombstone=False)
            raise
        return written

    def write_file(
        self, pending: Pending, lease: str, *, deferred: DeferredSync | None = None
    ) -> Pending:
        """Write (and fsync) the outcome file of ``pending`` under ``lease``, which the caller
        holds and ends; the ``data/`` folder is the caller's to sync. ``deferred``: its fsync
        is left to that :class:`DeferredSync` with the round's shards (append). On failure
        the partial file is removed. Call :meth:`mark_store` first."""
        assert pending.table is not None and pending.ref is None
        path = shard_path(lease)
        try:
            encoded = encode_outcome_file(pending.table)
            with self.storage.new_shard(path, deferred=deferred) as sink:
                sink.write(encoded)  # hashed and counted once, in one write
        except BaseException:
            try:
                self.storage.delete(path)
            except DynstateError as exc:
                log.warning("could not remove %s: %s (gc will)", path, exc)
            raise
        ref = ShardRef(path, pending.table.num_rows, sink.size, sink.sha256)
        # The next outcome checkpoint folds this file: it need not read back what it wrote.
        self._cache_file(path, pending.table)
        return replace(pending, ref=ref, lease=lease)

    def mark_store(self) -> None:
        """Before the first commit with outcomes, ``store.json`` goes to format 2, so that a
        dynstate that knows no outcomes refuses the store (its gc would remove outcome files
        as orphans, its compaction and reset would drop them) instead of misreading it. It
        also names ``outcomes_since``: a head read *before* store.json was found unmarked,
        so no version up to it holds outcomes (lineage walks stop there)."""
        if self._since is not None:
            return
        head = self.log.refresh()
        where = self.log.where(m.STORE_FILE)
        obj = m.decode(self.storage.read(m.STORE_FILE), where)
        if obj.get("format", 1) >= m.OUTCOMES_FORMAT:
            return
        obj["format"] = m.OUTCOMES_FORMAT
        obj["outcomes_since"] = head
        self.storage.put(m.STORE_FILE, m.encode(obj))
        log.info("%s now holds outcomes (store format %d)", self.display_url, m.OUTCOMES_FORMAT)

    def append_fields(self, pending: Pending | None, parent: Commit) -> tuple[Any, Any]:
        """(``outcomes``, ``generator_state``) of an append record on ``parent``; the checks
        run again when another writer committed after :meth:`check`."""
        if pending is None:
            return None, None
        field = None
        if pending.table is not None and pending.ref is not None:
            if parent.version != pending.checked_at:
                top = int(as_numpy(pending.table.column("row")).max())
                if top >= parent.num_rows:
                    raise InvalidDataError(
                        f"outcomes for {self.display_url} name row {top}, but version "
                        f"{parent.version} (committed meanwhile) has {parent.num_rows} rows; "
                        "nothing was committed"
                    )
                self._check_new_steps(pending.steps, parent)
            field = {
                "add": [pending.ref.to_json()],
                "steps": pending.steps,
                "records": pending.ref.rows,
            }
        return field, pending.state

    def carry(self, version: int) -> tuple[Any, Any]:
        """(``outcomes``, ``generator_state``) of a reset to, or a compaction of, ``version``:
        its complete outcome list (chunks written now), so the new record stands alone like
        its shard list does."""
        self.flush()  # a reset or compaction names the aggregate a checkpoint in flight stores
        lineage = self.lineage(version)
        if not lineage.count and lineage.state is None:
            return None, None
        aggregate = lineage.aggregate
        if aggregate is not None and not self._touch_aggregate(aggregate):
            aggregate = None  # it only repeats what the files say: statistics fold them
        field = {
            "base": self.log.put_shard_list(self.files(lineage)).to_json(),
            "steps": lineage.step_ranges,
            "records": lineage.records,
            "aggregate": None if aggregate is None else aggregate.to_json(),
        }
        return field, lineage.state

    def _touch_aggregate(self, ref: AggregateRef) -> bool:
        """Rewrite a stored aggregate a new record is about to name (it may be an hour old
        and named only by a checkpoint a gc collects meanwhile): its fresh time tells gc it is
        in use, as for chunks, and its bytes are kept for :meth:`restore_named`. False if it
        cannot be read intact (the record then names none)."""
        try:
            data = self.storage.read(ref.path)
        except FileNotFoundError:
            return False
        if len(data) != ref.bytes or m.sha256(data) != ref.sha256:
            log.warning("outcome aggregate %s does not match its checksum", ref.path)
            return False
        self.storage.put(ref.path, data)
        self._keep_aggregate(ref.path, data)
        return True

    def _keep_aggregate(self, path: str, data: bytes) -> None:
        self._aggregate_touches.note(path)
        with self._named_lock:  # the background checkpoint keeps its aggregate too
            self._named_aggregates[path] = data
            self._named_aggregates.move_to_end(path)
            while len(self._named_aggregates) > 4:  # one per commit in flight is plenty
                self._named_aggregates.popitem(last=False)

    def restore_named(self, record: Commit) -> None:
        """After ``record`` was created: rewrite the aggregate it names if a gc removed it
        between our write and the create (its outcome chunks: :meth:`Catalog.restore_named`)."""
        field = record.outcomes
        if isinstance(field, dict) and field.get("aggregate") is not None:
            where = self.log.where(m.log_path(record.version))
            ref = AggregateRef.from_json(field["aggregate"], where)
            self._restore_aggregate(ref, f"version {record.version}")

    def _restore_aggregate(self, ref: AggregateRef, named_by: str) -> None:
        """Write the aggregate ``named_by`` names again if a gc removed it, or if this
        handle's write of it is old (a writer paused before the create: gc may have judged it
        old and be about to delete it; :meth:`Catalog.restore_named`)."""
        data = self._named_aggregates.get(ref.path)
        if data is None:
            return
        if not self._aggregate_touches.due(ref.path):
            if self.storage.exists(ref.path):
                return
            log.warning(
                "outcome aggregate %s of %s of %s was removed by a concurrent gc; rewritten",
                ref.sha256[:12],
                named_by,
                self.display_url,
            )
        self.storage.put(ref.path, data)
        self._aggregate_touches.note(ref.path)

    def write_checkpoint(self, record: Commit, *, background: bool = False) -> None:
        """The outcome checkpoint of ``record``'s version: its complete outcome list and an
        aggregate over all of it (after every 100th commit, and for a gc floor).

        ``background=True`` (the commit's upkeep) returns at once and writes it on a thread
        of its own: the fold and the 1M-row aggregate take ~0.3-0.6 s, ~6 ms a step when
        paid by every 100th commit. It is a cache — a lineage walk that finds no checkpoint
        at a multiple of 100 walks on to the one below — so nothing waits for it: not the
        commit, not the next one (only the next checkpoint of this handle, one in flight at
        most), not a reader. A normal exit waits for it (the thread is not a daemon);
        :meth:`flush` waits for it too. A SIGKILL meanwhile leaves at most an aggregate no
        checkpoint names (written first, content addressed: gc's orphan). A failure is
        logged, never raised into a later call. A gc floor calls it synchronously: the
        floor's checkpoint must exist before ``gc.json`` names it."""
        if not background:
            self._write_checkpoint(record)
            return
        if self.outcomes_since() is None:
            return  # a store without outcomes: no thread, as before
        with self._checkpoint_lock:
            previous = self._checkpointing
            if previous is not None:
                previous.join()
            thread = threading.Thread(
                target=self._write_checkpoint_logged,
                args=(record,),
                name=_checkpoint_thread_name(record.version),
                daemon=False,  # interpreter exit joins it: a normal exit keeps the checkpoint
            )
            self._checkpointing = thread
            thread.start()

    def flush(self) -> None:
        """Wait for the outcome checkpoint this handle writes in the background, if any."""
        thread = self._checkpointing
        if thread is not None:
            thread.join()

    def _write_checkpoint_logged(self, record: Commit) -> None:
        try:
            self._write_checkpoint(record)
        except Exception as exc:  # a thread's error has no caller: log it, as upkeep does
            log.warning(
                "outcome checkpoint of version %d of %s not written: %s (statistics read "
                "the checkpoint below it and the files since)",
                record.version,
                self.display_url,
                exc,
                exc_info=not isinstance(exc, DynstateError),
            )

    def _write_checkpoint(self, record: Commit) -> None:
        rel = checkpoint_path(record.version)
        if self.outcomes_since() is None or self.storage.exists(rel):
            return
        lineage = self.lineage(record.version)
        aggregate = None
        if lineage.count:
            agg = self._aggregate(record.version, DEFAULT_SUCCESS_ABOVE, DEFAULT_HALF_LIFE)
            aggregate = self._put_aggregate(agg, lineage.count)
        files = self.log.put_shard_list(self.files(lineage))
        body: dict[str, Any] = {
            "format": m.OUTCOMES_FORMAT,
            "store_id": self.log.store_id,
            "version": record.version,
            "files": files.to_json(),
            "steps": lineage.step_ranges,
            "records": lineage.records,
            "aggregate": None if aggregate is None else aggregate.to_json(),
        }
        if lineage.state is not None:
            body["generator_state"] = lineage.state
        self.storage.create_if_absent(rel, m.encode(body))
        # A gc that listed files before the create may have taken them for unreferenced.
        named = f"the outcome checkpoint of version {record.version}"
        self.log.restore_chunks(files, named)
        if aggregate is not None:
            self._restore_aggregate(aggregate, named)
        # The next lineage walks stop here, with the aggregate.
        self._lineages.pop(record.version, None)

    def _put_aggregate(self, agg: Aggregate, files: int) -> AggregateRef:
        sink = pa.BufferOutputStream()
        table = agg.to_table()
        # lz4, as shards and outcome files: a cold read decodes it ~1/3 faster than zstd, for
        # ~1/4 more bytes. `row` delta-coded: in the dense form 0, 1, 2, ... is nearly free.
        pq.write_table(
            table,
            sink,
            compression=OUTCOME_COMPRESSION,
            use_dictionary=[name for name in table.column_names if name != "row"],
            column_encoding={"row": "DELTA_BINARY_PACKED"},
        )
        data = sink.getvalue().to_pybytes()
        digest = m.sha256(data)
        # Rewritten even if present (content-addressed): its fresh time tells gc it is in use.
        self.storage.put(aggregate_path(digest), data)
        self._keep_aggregate(aggregate_path(digest), data)
        return AggregateRef(
            aggregate_path(digest), len(data), digest, files, agg.success_above, agg.half_life
        )


def encode_outcome_file(table: pa.Table) -> pa.Buffer:
    """An outcome file's Parquet bytes. Encoded into memory, not through the storage's
    Python sink: pyarrow then calls back into Python (taking the GIL from the commit's own
    thread) for every page and footer part; one buffer is one hash update and one write.
    Read whole, never filtered: no statistics; steps and rows repeat little, so plain
    encoding is as small as dictionaries and ~40 % faster to write."""
    out = pa.BufferOutputStream()
    pq.write_table(
        table, out, use_dictionary=False, write_statistics=False, compression=OUTCOME_COMPRESSION
    )
    return out.getvalue()


def _outside(steps: Any, ranges: tuple[tuple[int, int], ...]) -> int | None:
    """A step of ``steps`` (a numpy array) outside the sorted ``ranges``, or None. A file
    usually holds one step, or a few in one range: its least and greatest settle it."""
    if not ranges:
        return int(steps[0]) if len(steps) else None
    firsts = np.array([a for a, _ in ranges], dtype=np.int64)
    lasts = np.array([b for _, b in ranges], dtype=np.int64)
    low, high = steps.min(), steps.max()
    at = int(np.searchsorted(firsts, low, side="right")) - 1
    if at >= 0 and high <= lasts[at]:
        return None  # both in one range, so everything between them is too
    distinct = np.unique(steps)
    at_each = np.searchsorted(firsts, distinct, side="right") - 1
    inside = (at_each >= 0) & (distinct <= lasts[np.maximum(at_each, 0)])
    return None if inside.all() else int(distinct[np.argmin(inside)])


def _checkpoint_thread_name(version: int) -> str:
    return f"dynstate-outcome-checkpoint-{version}"


def _steps(obj: dict[str, Any], where: str) -> Ranges:
    steps = obj.get("steps")
    if not isinstance(steps, list) or not valid_ranges(steps):
        raise CorruptStoreError(f"{where} has a malformed step list in its outcomes")
    return [list(r) for r in steps]


def _count(obj: dict[str, Any], name: str, where: str) -> int:
    value = obj.get(name)
    if type(value) is not int or value < 0:
        raise CorruptStoreError(f"{where} has a malformed {name} count in its outcomes")
    return value


_BY_LOG: weakref.WeakKeyDictionary[Any, Outcomes] = weakref.WeakKeyDictionary()


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker) has no checkpoint thread, and a lock that thread
    # held at the fork would stay held there forever.
    for outcomes in list(_BY_LOG.values()):
        outcomes._files_lock = threading.Lock()
        outcomes._checkpoint_lock = threading.Lock()
        outcomes._named_lock = threading.Lock()
        outcomes._checkpointing = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def outcomes_of(log_: Log) -> Outcomes:
    """The :class:`Outcomes` of a commit log (one per log, so its caches are shared)."""
    found = _BY_LOG.get(log_)
    if found is None:
        found = _BY_LOG[log_] = Outcomes(log_)
    return found
