"""Content-addressed and derived metadata of a store: chunks of shard lists, schemas and
checkpoints, with caches (they never change once written). :class:`dynstate.log.Log` builds
on it."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from .. import paths
from ..errors import ChecksumMismatchError, CorruptStoreError
from ..records import manifest as m
from ..records.manifest import Commit, ShardRef
from ..storage import Storage

if TYPE_CHECKING:
    import pyarrow as pa  # only schemas are Arrow objects, built by dynstate.records.manifest

log = logging.getLogger("dynstate")

#: A content-addressed file this handle wrote longer ago than this before the record (or
#: checkpoint) naming it was created is written again after that create. gc removes such a
#: file once it is unreferenced and an hour old by the storage's clock (gc's BUSY_S) and
#: judges that age again right before the delete; a writer paused between its write and its
#: create (SIGSTOP, a suspended VM) comes back to a file gc may have judged old meanwhile, and
#: the rewrite gives it a stamp past gc's second judgement. Far below BUSY_S, far above what a
#: commit normally takes between the two.
REWRITE_AFTER_S = 60.0


class Touches:
    """When this handle last wrote each content-addressed file (bounded: the most recent
    ``limit``). Elapsed time is taken by both the monotonic and the wall clock, the larger
    counting: the monotonic clock stops while a machine is suspended, the wall clock may step;
    a rewrite too many costs one small PUT, one too few a file."""

    def __init__(self, limit: int = 4096) -> None:
        self._at: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()  # the background outcome checkpoint writes too

    def __getstate__(self) -> dict[str, int]:
        # a handle sent to another process (a Ray task, a spawned worker) starts with no
        # writes of its own: these times are this process's
        return {"limit": self._limit}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["limit"])  # type: ignore[misc]

    def note(self, rel: str) -> None:
        with self._lock:
            self._at[rel] = (time.monotonic(), time.time())
            self._at.move_to_end(rel)
            while len(self._at) > self._limit:
                self._at.popitem(last=False)

    def due(self, rel: str) -> bool:
        """Whether ``rel``, written by this handle, was written over :data:`REWRITE_AFTER_S`
        ago (False for a file it did not write: nothing says it was paused)."""
        at = self._at.get(rel)
        if at is None:
            return False
        return max(time.monotonic() - at[0], time.time() - at[1]) > REWRITE_AFTER_S


class Catalog:
    """Chunks, schemas and checkpoints of one store, read through caches."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._schemas: dict[str, pa.Schema] = {}
        self._chunks: dict[str, list[ShardRef]] = {}
        self._touches = Touches()

    @property
    def display_url(self) -> str:
        return self.storage.display_url

    def where(self, rel: str) -> str:
        return f"{self.display_url}/{rel}"

    # -- checkpoints and chunks ------------------------------------------------------------

    def checkpoint(self, version: int) -> list[ShardRef] | None:
        """The complete shard list the checkpoint of ``version`` holds, or None if there is no
        checkpoint file (its writer died before writing it; replay further back instead)."""
        shard_list = self.read_checkpoint(version)
        if shard_list is None:
            return None
        return self.expand(shard_list, self.where(paths.checkpoint_path(version)))

    def read_checkpoint(self, version: int) -> m.ShardList | None:
        """The shard list (chunk references and tail) of ``version``'s checkpoint, decoded and
        checked but not expanded; None if there is no such file. A damaged file raises
        :class:`CorruptStoreError` naming it."""
        rel = paths.checkpoint_path(version)
        raw = self.storage.try_read(rel)
        if raw is None:
            return None
        obj = m.decode(raw, self.where(rel))
        return m.ShardList.from_json(obj.get("shards"), self.where(rel))

    def checkpoint_versions(self, floor: int = 0) -> list[int]:
        """The versions from ``floor`` on that have a checkpoint file, by one listing. A name
        counts only if :func:`dynstate.paths.match_checkpoint` accepts it; anything else in
        the folder is not a checkpoint."""
        found = []
        for name in self.storage.list(paths.CHECKPOINT_DIR):
            version = paths.match_checkpoint(f"{paths.CHECKPOINT_DIR}/{name}")
            if version is not None and version >= floor:
                found.append(version)
        return sorted(found)

    def read_chunk(self, digest: str, *, cached: bool = True) -> list[ShardRef] | None:
        """The shard entries of chunk ``digest`` (checked against its content address), or
        None if the file is missing. A damaged chunk raises (:class:`ChecksumMismatchError`,
        :class:`CorruptStoreError`) naming it. ``cached=False`` reads the file even if this
        handle read it before (verify: the file must be there now)."""
        chunk = self._chunks.get(digest) if cached else None
        if chunk is None:
            rel = paths.chunk_path(digest)
            try:
                raw = self.storage.read(rel)
            except FileNotFoundError:
                return None
            chunk = m.decode_chunk(digest, raw, self.where(rel))
            self._chunks[digest] = chunk
        return chunk

    def expand(self, shard_list: m.ShardList, where: str) -> list[ShardRef]:
        out: list[ShardRef] = []
        for digest in shard_list.chunks:
            chunk = self.read_chunk(digest)
            if chunk is None:
                raise CorruptStoreError(
                    f"{where} refers to chunk {digest[:12]}, which is missing from "
                    f"{self.display_url}; run `dynstate verify`"
                )
            out.extend(chunk)
        out.extend(shard_list.tail)
        return out

    def put_shard_list(self, shards: list[ShardRef]) -> m.ShardList:
        """Cut ``shards`` into chunks and write every chunk, also one this handle wrote or read
        before: the cache says only that the file existed once, and gc may have collected it
        since (a reset and ``gc --keep`` between two calls); rewriting it restores it and
        refreshes the time by which gc judges it."""
        files, shard_list = m.split_chunks(shards)
        for digest, data in files:
            self._touch(paths.chunk_path(digest), data)
            if digest not in self._chunks:
                self._chunks[digest] = m.decode_chunk(digest, data, digest)
        return shard_list

    # -- schemas ---------------------------------------------------------------------------

    def schema(self, fp: str | None, version: int, *, cached: bool = True) -> pa.Schema | None:
        """The schema ``fp`` that ``version`` names; a missing or damaged file raises naming
        it. ``cached=False`` reads the file even if this handle read it before (verify)."""
        if fp is None:
            return None
        schema = self._schemas.get(fp) if cached else None
        if schema is None:
            rel = paths.schema_path(fp)
            try:
                raw = self.storage.read(rel)
            except FileNotFoundError:
                raise CorruptStoreError(
                    f"schema {fp[:12]} of version {version} is missing from "
                    f"{self.display_url}; run `dynstate verify`"
                ) from None
            schema = m.schema_from_json(m.decode(raw, self.where(rel)), self.where(rel))
            if m.schema_fingerprint(schema) != fp:
                raise ChecksumMismatchError(f"{self.where(rel)} does not match its name")
            self._schemas[fp] = schema
        return schema

    def put_schema(self, schema: pa.Schema) -> None:
        """Write the schema file before a record names it, every time (see
        :meth:`put_shard_list`: a cached schema may have been collected since)."""
        fp = m.schema_fingerprint(schema)
        self._touch(paths.schema_path(fp), m.encode(m.schema_to_json(schema)))
        self._schemas.setdefault(fp, schema)

    def restore_named(self, record: Commit) -> None:
        """After ``record`` was created: make sure the schema and chunks it names exist — of
        its shard list and of its outcome list (a reset's or compaction's ``outcomes.base``) —
        rewriting any that a gc removed between our write and the record's create (a gc that
        read the head before the record existed counts them as unreferenced), and any this
        handle wrote longer than :data:`REWRITE_AFTER_S` before (a writer paused meanwhile:
        gc may have judged it old and be about to delete it). Rewriting is safe: they are
        content-addressed, and this handle holds their content."""
        if record.schema is not None:
            schema = self._schemas.get(record.schema)
            rel = paths.schema_path(record.schema)
            if schema is not None and self._restore_due(rel, f"version {record.version}"):
                self._touch(rel, m.encode(m.schema_to_json(schema)))
        named = f"version {record.version}"
        if record.base is not None:
            self.restore_chunks(record.base, named)
        field = record.outcomes
        if isinstance(field, dict) and field.get("base") is not None:
            where = self.where(paths.log_path(record.version))
            self.restore_chunks(m.ShardList.from_json(field["base"], where), named)

    def restore_chunks(self, shard_list: m.ShardList, named_by: str) -> None:
        """Rewrite any chunk of ``shard_list`` whose content this handle holds (it wrote or
        read it) and that is missing now, or that this handle wrote long before (see
        :meth:`restore_named`): ``named_by`` (a record, a checkpoint) was created naming it,
        and a gc that listed files before that create may have removed it."""
        for digest in shard_list.chunks:
            rel = paths.chunk_path(digest)
            entries = self._chunks.get(digest)
            if entries is None or not self._restore_due(rel, named_by):
                continue
            files, _ = m.split_chunks(entries)
            self._touch(rel, files[0][1])

    def _restore_due(self, rel: str, named_by: str) -> bool:
        """Whether ``rel``, just named by ``named_by``, must be written again: it is missing
        (a concurrent gc removed it; logged), or this handle's write of it is old."""
        if self._touches.due(rel):
            return True
        if self.storage.exists(rel):
            return False
        log.warning(
            "%s of %s of %s was removed by a concurrent gc; rewritten",
            rel,
            named_by,
            self.display_url,
        )
        return True

    def _touch(self, rel: str, data: bytes) -> None:
        """Write a content-addressed file, whether or not it exists (same name, same bytes):
        its fresh time tells gc that a commit is about to name it — gc leaves unreferenced
        metadata younger than an hour alone, and this one may be an old orphan."""
        self.storage.put(rel, data)
        self._touches.note(rel)


def checkpoint_bytes(record: Commit, shard_list: m.ShardList) -> bytes:
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
