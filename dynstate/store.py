"""Store: an append-only, versioned collection of Parquet shards. Orchestration only — the
record formats live in :mod:`dynstate.manifest`, the filesystem in :mod:`dynstate.storage`.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from . import manifest as m
from .errors import (
    ChecksumMismatchError,
    CommitConflictError,
    CorruptStoreError,
    DynstateError,
    InvalidDataError,
    MissingShardError,
    SchemaMismatchError,
    StorageError,
    StoreExistsError,
    StoreNotFoundError,
    VersionCollectedError,
    VersionNotFoundError,
)
from .manifest import Commit, ShardRef
from .rounds import check_meta, conform, conform_round, to_table
from .snapshot import Snapshot, Staged, verify_shard_bytes
from .storage import Storage, is_safe_name

log = logging.getLogger("dynstate")

DEFAULT_SHARD_BYTES = 64 * 2**20
_MAX_COMMIT_ATTEMPTS = 200


class Store:
    """A versioned store at an fsspec URL. Open with :meth:`Store.open`.

    >>> store = Store.open("memory://doc/store", create=True)
    >>> store.append([{"prompt": "1+1", "answer": "2"}], meta={"step": 0})
    1
    >>> store.snapshot().num_rows
    1
    """

    def __init__(self, storage: Storage, store_id: str, *, single_writer: bool = False):
        self.storage = storage
        self.store_id = store_id
        self.single_writer = single_writer
        self._records: dict[int, Commit] = {}
        self._schemas: dict[str, pa.Schema] = {}
        self._chunks: dict[str, list[ShardRef]] = {}
        self._snapshots: dict[int, Snapshot] = {}
        self._head = 0
        self._gc_floor = 0
        self._write_checked = False

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        url: str,
        *,
        create: bool = False,
        storage_options: dict[str, Any] | None = None,
        single_writer: bool = False,
    ) -> Store:
        """Open the store at ``url`` (a local path, ``file://``, ``s3://bucket/prefix``,
        ``memory://``). With ``create=True`` an empty store is made if none exists there.
        ``single_writer=True`` allows writing to backends without conditional writes, on the
        promise that only one process ever writes."""
        storage = Storage(url, storage_options)
        raw = storage.try_read(m.STORE_FILE)
        if raw is None:
            if not create:
                raise StoreNotFoundError(
                    f"no dynstate store at {storage.display_url}; check the URL, or pass "
                    "create=True to make a new store there"
                )
            raw = cls._create(storage, single_writer)
        ident = m.decode(raw, f"{storage.display_url}/{m.STORE_FILE}")
        store = cls(storage, str(ident["store_id"]), single_writer=single_writer)
        store.refresh()
        return store

    @staticmethod
    def _create(storage: Storage, single_writer: bool) -> bytes:
        foreign = [n for n in storage.list("") if n != m.META_DIR]
        if foreign:
            raise StoreExistsError(
                f"{storage.display_url} already holds files ({', '.join(foreign[:3])}) but no "
                "dynstate store; choose an empty location for a new store"
            )
        storage.require_exclusive_create(single_writer)
        store_id = uuid.uuid4().hex
        raw = m.encode({"format": m.FORMAT, "store_id": store_id, "created": m.utc_now()})
        try:
            storage.create(m.STORE_FILE, raw)
        except FileExistsError:
            return storage.read(m.STORE_FILE)  # another process created it first
        root = Commit(
            store_id, 0, None, "create", m.utc_now(), None, 0, 0, 0, base=m.ShardList((), ())
        )
        storage.create_if_absent(m.log_path(0), m.encode(root.to_json()))
        storage.create_if_absent(m.checkpoint_path(0), _checkpoint_bytes(root, root.base))
        log.info("created store %s (id %s)", storage.display_url, store_id)
        return raw

    # -- identity and versions ---------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def display_url(self) -> str:
        return self.storage.display_url

    @property
    def head(self) -> int:
        """The latest committed version number (as of the last refresh or own commit)."""
        return self._head

    def __repr__(self) -> str:
        return f"Store({self.display_url!r}, head={self._head})"

    def refresh(self) -> int:
        """Look for versions committed by other processes; returns the head."""
        gc = self.storage.try_read(m.GC_FILE)
        if gc is not None:
            self._gc_floor = int(m.decode(gc, self._where(m.GC_FILE))["floor"])
        hint = self.storage.try_read(m.HEAD_HINT)
        start = max(self._head, self._gc_floor)
        if hint is not None:
            try:
                start = max(start, int(json.loads(hint)["version"]))
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring unreadable head hint in %s", self.display_url)
        if self._load_record(start) is None:
            # Hints are advisory; fall back to the last version known to exist.
            start = max(self._head, self._gc_floor)
            if self._load_record(start) is None:
                raise CorruptStoreError(
                    f"{self.display_url} has no commit record for version {start}; run "
                    "`dynstate verify` to see what is damaged"
                )
        self._head = self._probe_forward(start)
        return self._head

    def _probe_forward(self, known: int) -> int:
        """Largest version with a record, starting from one that exists. Records are gap-free,
        so gallop forward and then bisect: O(log n) reads, no LIST."""
        step = 1
        lo = known
        while self._load_record(lo + step) is not None:
            lo += step
            step *= 2
        hi = lo + step  # missing
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._load_record(mid) is not None:
                lo = mid
            else:
                hi = mid
        return lo

    def _where(self, rel: str) -> str:
        return f"{self.display_url}/{rel}"

    def _load_record(self, version: int) -> Commit | None:
        cached = self._records.get(version)
        if cached is not None:
            return cached
        rel = m.log_path(version)
        raw = self.storage.try_read(rel)
        if raw is None:
            return None
        commit = Commit.from_json(m.decode(raw, self._where(rel)), self._where(rel))
        if commit.version != version or commit.store_id != self.store_id:
            raise CorruptStoreError(
                f"{self._where(rel)} claims version {commit.version} of store "
                f"{commit.store_id}; it was copied from elsewhere — remove it"
            )
        self._records[version] = commit
        return commit

    def commit_record(self, version: int) -> Commit:
        """The commit record of ``version``."""
        self._check_version(version)
        record = self._load_record(version)
        if record is None:
            if version < self._head:
                raise VersionCollectedError(
                    f"version {version} of {self.display_url} was removed by garbage "
                    f"collection (oldest kept is {self._gc_floor}); use a later version"
                )
            raise VersionNotFoundError(self._not_found(version))
        return record

    def _not_found(self, version: Any) -> str:
        return (
            f"version {version} not found in {self.display_url} (latest is {self._head}); "
            "pass version=None for the latest"
        )

    def _check_version(self, version: int) -> None:
        if version > self._head:
            self.refresh()
        if version < 0 or version > self._head:
            raise VersionNotFoundError(self._not_found(version))
        if version < self._gc_floor:
            raise VersionCollectedError(
                f"version {version} of {self.display_url} was removed by garbage collection "
                f"(oldest kept is {self._gc_floor}); use a later version"
            )

    def versions(self, *, start: int = 0) -> list[Commit]:
        """Commit records of every kept version from ``start`` on, oldest first."""
        self.refresh()
        return [self.commit_record(v) for v in range(max(start, self._gc_floor), self._head + 1)]

    def resolve(self, version: int | str | None = None) -> int:
        """A version number from a number, a tag name or None (the head)."""
        if version is None:
            return self.refresh()
        if isinstance(version, bool) or not isinstance(version, (int, str)):
            raise VersionNotFoundError(
                f"version must be an int, a tag name or None, not {version!r} ({self.display_url})"
            )
        if isinstance(version, str):
            if version.isdigit():
                version = int(version)
            else:
                return self._tag_version(version)
        self._check_version(version)
        return version

    # -- tags --------------------------------------------------------------------------------

    def tags(self) -> dict[str, int]:
        """All tags and the versions they name."""
        out = {}
        for name in self.storage.list(f"{m.META_DIR}/tags"):
            if name.endswith(".json") and not name.startswith("."):
                out[name[:-5]] = self._tag_version(name[:-5])
        return out

    def _tag_version(self, name: str) -> int:
        raw = self.storage.try_read(m.tag_path(name)) if is_safe_name(name) else None
        if raw is None:
            raise VersionNotFoundError(
                f"no tag {name!r} in {self.display_url}; `dynstate ls` lists versions and tags"
            )
        version = int(m.decode(raw, self._where(m.tag_path(name)))["version"])
        self._check_version(version)
        return version

    def tag(self, name: str, version: int | str | None = None, *, force: bool = False) -> None:
        """Name a version. Tags are never moved unless ``force=True``; tagged versions are
        kept by garbage collection."""
        if not is_safe_name(name) or name.isdigit():
            raise InvalidDataError(
                f"invalid tag name {name!r} for {self.display_url}: use letters, digits, '.', "
                "'_' and '-', starting with a letter or digit, and not only digits"
            )
        target = self.resolve(version)
        raw = m.encode({"format": m.FORMAT, "version": target, "created": m.utc_now()})
        self._require_writable()
        try:
            self.storage.create(m.tag_path(name), raw)
        except FileExistsError:
            current = self._tag_version(name)
            if current == target:
                return
            if not force:
                raise StoreExistsError(
                    f"tag {name!r} in {self.display_url} already names version {current}; "
                    "pass force=True to move it"
                ) from None
            self.storage.put(m.tag_path(name), raw)

    def untag(self, name: str) -> None:
        self._tag_version(name)
        self.storage.delete(m.tag_path(name))

    # -- snapshots ---------------------------------------------------------------------------

    def snapshot(self, version: int | str | None = None) -> Snapshot:
        """An immutable view of ``version`` (a number, a tag, or None for the head)."""
        number = self.resolve(version)
        snap = self._snapshots.get(number)
        if snap is None:
            record = self.commit_record(number)
            snap = Snapshot(self, record, self._materialize(number), self.schema_of(record))
            if len(self._snapshots) > 64:
                self._snapshots.pop(next(iter(self._snapshots)))
            self._snapshots[number] = snap
        return snap

    def schema_of(self, record: Commit) -> pa.Schema | None:
        fp = record.schema
        if fp is None:
            return None
        schema = self._schemas.get(fp)
        if schema is None:
            rel = m.schema_path(fp)
            try:
                raw = self.storage.read(rel)
            except FileNotFoundError:
                raise CorruptStoreError(
                    f"schema {fp[:12]} of version {record.version} is missing from "
                    f"{self.display_url}; run `dynstate verify`"
                ) from None
            schema = m.schema_from_json(m.decode(raw, self._where(rel)), self._where(rel))
            if m.schema_fingerprint(schema) != fp:
                raise ChecksumMismatchError(f"{self._where(rel)} does not match its name")
            self._schemas[fp] = schema
        return schema

    def _materialize(self, version: int) -> list[ShardRef]:
        """The ordered shard list of ``version``: from the nearest base (checkpoint, reset or
        compaction record) at or below it, plus the appends since — at most K records."""
        tails: list[tuple[ShardRef, ...]] = []
        v = version
        while True:
            if v < self._gc_floor:
                raise VersionCollectedError(
                    f"version {version} of {self.display_url} depends on collected metadata; "
                    f"the oldest kept version is {self._gc_floor}"
                )
            record = self.commit_record(v)
            if record.base is not None:
                shards = self._expand(record.base, self._where(m.log_path(v)))
                break
            # At the gc floor the checkpoint is the only way back, even for the floor itself.
            if v == self._gc_floor or v % m.CHECKPOINT_INTERVAL == 0:
                shards = self._load_checkpoint(v)
                if shards is not None:
                    break
            tails.append(record.add)
            v -= 1
        for add in reversed(tails):
            shards.extend(add)
        return shards

    def _load_checkpoint(self, version: int) -> list[ShardRef] | None:
        rel = m.checkpoint_path(version)
        raw = self.storage.try_read(rel)
        if raw is None:
            return None  # its writer died before writing it; replay further back instead
        obj = m.decode(raw, self._where(rel))
        return self._expand(
            m.ShardList.from_json(obj["shards"], self._where(rel)), self._where(rel)
        )

    def _expand(self, shard_list: m.ShardList, where: str) -> list[ShardRef]:
        out: list[ShardRef] = []
        for digest in shard_list.chunks:
            chunk = self._chunks.get(digest)
            if chunk is None:
                rel = m.chunk_path(digest)
                try:
                    raw = self.storage.read(rel)
                except FileNotFoundError:
                    raise CorruptStoreError(
                        f"{where} refers to chunk {digest[:12]}, which is missing from "
                        f"{self.display_url}; run `dynstate verify`"
                    ) from None
                chunk = m.decode_chunk(digest, raw, self._where(rel))
                self._chunks[digest] = chunk
            out.extend(chunk)
        out.extend(shard_list.tail)
        return out

    def read_shard(
        self, shard: ShardRef, schema: pa.Schema | None = None, *, version: int | None = None
    ) -> pa.Table:
        """Read one shard, verified against its recorded size and checksum."""
        data = self.read_shard_bytes(shard, version=version)
        table = pq.read_table(pa.BufferReader(data))
        return conform(table, schema) if schema is not None else table

    def read_shard_bytes(self, shard: ShardRef, *, version: int | None = None) -> bytes:
        at = f" (version {version})" if version is not None else ""
        where = f"{self.display_url}{at}"
        try:
            # Verified inside the read, so a body cut short in transit is fetched again.
            data = self.storage.read(
                shard.path, check=lambda d: verify_shard_bytes(d, shard, where)
            )
        except FileNotFoundError:
            raise MissingShardError(
                f"shard {shard.path} of {self.display_url}{at} is missing; restore it, or reset "
                "the store to a version that does not use it"
            ) from None
        return data

    # -- writing -----------------------------------------------------------------------------

    def _require_writable(self) -> None:
        if not self._write_checked:
            self.storage.require_exclusive_create(self.single_writer)
            self._write_checked = True

    def append(
        self,
        data: Any,
        *,
        meta: dict[str, Any] | None = None,
        allow_new_columns: bool = False,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> int:
        """Commit ``data`` (a pyarrow Table, a list of dicts, a pandas DataFrame or a
        ``datasets.Dataset``) as one new version; returns its number. An empty round is a
        valid commit. ``allow_new_columns`` lets a round add nullable columns."""
        meta = check_meta(meta, self.display_url)
        staged = self.stage(data, allow_new_columns=allow_new_columns, shard_bytes=shard_bytes)
        return self.commit_staged([staged], meta=meta)

    def stage(
        self,
        data: Any,
        *,
        allow_new_columns: bool = False,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> Staged:
        """Validate ``data`` against the head's schema and write its shards, without
        committing. Several staged parts (from other processes too: a :class:`Staged` pickles)
        become one version with :meth:`commit_staged`; uncommitted shards stay invisible and
        are removed by gc."""
        table = to_table(data, self.display_url)
        self._require_writable()
        head = self._load_record(self.refresh())
        assert head is not None
        table, schema = self._conform_round(table, head, allow_new_columns)
        shards = self._write_shards(table, shard_bytes)
        return Staged(tuple(shards), schema, head.schema)

    def commit_staged(self, parts: Sequence[Staged], *, meta: dict[str, Any] | None = None) -> int:
        """Commit staged parts, in the given order, as one new version; returns its number.
        On failure the parts' shards are removed and nothing is committed."""
        shards = [s for part in parts for s in part.shards]
        try:
            meta = check_meta(meta, self.display_url)
            schemas = {m.schema_fingerprint(p.schema) for p in parts if p.schema is not None}
            if len(schemas) > 1:
                raise SchemaMismatchError(
                    f"staged parts for {self.display_url} have different schemas; stage every "
                    "part of a round with the same columns"
                )
            schema = next((p.schema for p in parts if p.schema is not None), None)
            validated = next((p.validated for p in parts if p.schema is not None), None)
            self._require_writable()
            if schema is not None:
                self._put_schema(schema)
            return self._commit_loop(
                lambda parent: self._append_record(parent, shards, schema, validated, meta)
            )
        except BaseException as exc:
            # A rejected or failed round must leave nothing behind but what gc would remove.
            # After a StorageError the commit may have landed unseen: keep its shards for gc.
            if not isinstance(exc, StorageError):
                self.discard(parts)
            raise

    def discard(self, parts: Sequence[Staged]) -> None:
        """Remove the shards of staged parts that will not be committed."""
        for part in parts:
            for shard in part.shards:
                self._delete_quietly(shard.path)

    def _conform_round(
        self, table: pa.Table, head: Commit, allow_new_columns: bool
    ) -> tuple[pa.Table, pa.Schema | None]:
        current = self.schema_of(head)
        if table.num_columns == 0 and table.num_rows == 0:
            return table, current  # an empty round with no columns fits any schema
        if current is None:
            schema = m.normalize_schema(table.schema)
            return table.replace_schema_metadata(None), schema
        return conform_round(table, current, allow_new_columns, self.display_url, head.version)

    def _append_record(
        self,
        parent: Commit,
        shards: list[ShardRef],
        schema: pa.Schema | None,
        validated: str | None,
        meta: dict[str, Any],
    ) -> Commit:
        fp = m.schema_fingerprint(schema) if schema is not None else parent.schema
        if parent.schema != validated and schema is not None:
            # Another writer changed the schema after we checked: only a round whose written
            # shards still mean the same thing under the new schema may go on.
            parent_schema = self.schema_of(parent)
            if parent_schema is not None and m.schema_fingerprint(parent_schema) != fp:
                raise SchemaMismatchError(
                    f"the schema of {self.display_url} changed at version {parent.version} "
                    "while this round was being written: "
                    + m.describe_schema_diff(parent_schema, schema)
                    + "; convert the round and append again"
                )
        return Commit(
            store_id=self.store_id,
            version=parent.version + 1,
            parent=parent.version,
            op="append",
            created=m.utc_now(),
            schema=fp,
            num_rows=parent.num_rows + sum(s.rows for s in shards),
            num_shards=parent.num_shards + len(shards),
            num_bytes=parent.num_bytes + sum(s.bytes for s in shards),
            add=tuple(shards),
            meta=meta,
        )

    def _commit_loop(self, make: Any) -> int:
        """Create the next version's record exclusively; on a lost race, rebase and retry."""
        for attempt in range(_MAX_COMMIT_ATTEMPTS):
            parent = self._load_record(self._head)
            assert parent is not None
            record = make(parent)
            try:
                self._publish(record)
            except FileExistsError:
                self.refresh()
                time.sleep(random.uniform(0, min(0.05, 0.001 * 2 ** min(attempt, 6))))
                continue
            return record.version
        raise CommitConflictError(
            f"gave up committing to {self.display_url} after {_MAX_COMMIT_ATTEMPTS} lost races; "
            "too many concurrent writers — retry, or write rounds from fewer processes"
        )

    def _publish(self, record: Commit) -> None:
        self.storage.create(m.log_path(record.version), m.encode(record.to_json()))
        self._records[record.version] = record
        self._head = max(self._head, record.version)
        log.debug("committed version %d to %s", record.version, self.display_url)
        # Everything below is an optimization; a crash here loses nothing.
        try:
            if record.version % m.CHECKPOINT_INTERVAL == 0:
                self._write_checkpoint(record)
            # No fsync: the hint only ever names a version already durable, and a hint lost
            # or torn by a power cut is ignored by refresh(), which then probes.
            hint = json.dumps({"version": record.version}).encode()
            self.storage.put(m.HEAD_HINT, hint, durable=False)
        except DynstateError as exc:
            log.warning("post-commit upkeep of %s failed: %s", self.display_url, exc)

    def _write_checkpoint(self, record: Commit) -> None:
        shard_list = self._put_shard_list(self._materialize(record.version))
        self.storage.create_if_absent(
            m.checkpoint_path(record.version), _checkpoint_bytes(record, shard_list)
        )

    def _put_shard_list(self, shards: list[ShardRef]) -> m.ShardList:
        files, shard_list = m.split_chunks(shards)
        for digest, data in files:
            if digest in self._chunks:
                continue
            self.storage.create_if_absent(m.chunk_path(digest), data)
            self._chunks[digest] = m.decode_chunk(digest, data, digest)
        return shard_list

    def _put_schema(self, schema: pa.Schema) -> None:
        fp = m.schema_fingerprint(schema)
        if fp in self._schemas:
            return
        self.storage.create_if_absent(m.schema_path(fp), m.encode(m.schema_to_json(schema)))
        self._schemas[fp] = schema

    def _write_shards(self, table: pa.Table, shard_bytes: int) -> list[ShardRef]:
        if table.num_rows == 0:
            return []
        per_shard = max(1, math.ceil(table.num_rows * shard_bytes / max(table.nbytes, 1)))
        written: list[ShardRef] = []
        try:
            for start in range(0, table.num_rows, per_shard):
                part = table.slice(start, per_shard)
                path = f"{m.DATA_DIR}/{uuid.uuid4().hex}.parquet"
                with self.storage.new_shard(path) as sink:
                    pq.write_table(part, sink)
                ref = ShardRef(path, part.num_rows, sink.size, sink.sha256)
                written.append(ref)
            self.storage.sync_dir(m.DATA_DIR)
        except BaseException:
            for shard in written:
                self._delete_quietly(shard.path)
            raise
        return written

    def _delete_quietly(self, rel: str) -> None:
        try:
            self.storage.delete(rel)
        except DynstateError as exc:
            log.warning("could not remove %s: %s (gc will)", self._where(rel), exc)

    def commit_base(
        self,
        shards: list[ShardRef],
        *,
        op: str,
        schema: pa.Schema | None,
        meta: dict[str, Any] | None = None,
        target: int | None = None,
        expected_parent: int | None = None,
    ) -> int:
        """Commit a version whose complete shard list is ``shards`` (reset, compaction).
        With ``expected_parent``, fail instead of rebasing if someone committed meanwhile."""
        self._require_writable()
        meta = check_meta(meta, self.display_url)
        shard_list = self._put_shard_list(list(shards))
        if schema is not None:
            self._put_schema(schema)
        fp = m.schema_fingerprint(schema) if schema is not None else None

        def make(parent: Commit) -> Commit:
            if expected_parent is not None and parent.version != expected_parent:
                raise CommitConflictError(
                    f"{self.display_url} moved from version {expected_parent} to "
                    f"{parent.version} during {op}; run it again"
                )
            return Commit(
                self.store_id,
                parent.version + 1,
                parent.version,
                op,
                m.utc_now(),
                fp,
                sum(s.rows for s in shards),
                len(shards),
                sum(s.bytes for s in shards),
                base=shard_list,
                target=target,
                meta=meta,
            )

        self.refresh()
        return self._commit_loop(make)

    def reset(self, version: int | str, *, meta: dict[str, Any] | None = None) -> int:
        """Make ``version``'s content the new head, as a new version. Versions committed
        after it stay listed and readable (as abandoned) until garbage collection."""
        snap = self.snapshot(version)
        return self.commit_base(
            list(snap.shards), op="reset", schema=snap.schema, meta=meta, target=snap.version
        )


def _checkpoint_bytes(record: Commit, shard_list: m.ShardList) -> bytes:
    return m.encode(
        {
            "format": m.FORMAT,
            "store_id": record.store_id,
            "version": record.version,
            "schema": record.schema,
            "num_rows": record.num_rows,
            "shards": shard_list.to_json(),
        }
    )
