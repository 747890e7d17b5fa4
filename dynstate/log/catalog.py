"""Content-addressed and derived metadata of a store: chunks of shard lists, schemas and
checkpoints, with caches (they never change once written). :class:`dynstate.log.Log` builds
on it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .. import paths
from ..errors import ChecksumMismatchError, CorruptStoreError
from ..records import manifest as m
from ..records.manifest import Commit, ShardRef
from ..storage import Storage

if TYPE_CHECKING:
    import pyarrow as pa  # only schemas are Arrow objects, built by dynstate.records.manifest

log = logging.getLogger("dynstate")


class Catalog:
    """Chunks, schemas and checkpoints of one store, read through caches."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._schemas: dict[str, pa.Schema] = {}
        self._chunks: dict[str, list[ShardRef]] = {}

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
        read the head before the record existed counts them as unreferenced). Rewriting is
        safe: they are content-addressed, and this handle holds their content."""
        if record.schema is not None and not self.storage.exists(paths.schema_path(record.schema)):
            schema = self._schemas.get(record.schema)
            if schema is not None:
                log.warning(
                    "schema %s of version %d of %s was removed by a concurrent gc; rewritten",
                    record.schema[:12],
                    record.version,
                    self.display_url,
                )
                self._touch(paths.schema_path(record.schema), m.encode(m.schema_to_json(schema)))
        named = f"version {record.version}"
        if record.base is not None:
            self.restore_chunks(record.base, named)
        field = record.outcomes
        if isinstance(field, dict) and field.get("base") is not None:
            where = self.where(paths.log_path(record.version))
            self.restore_chunks(m.ShardList.from_json(field["base"], where), named)

    def restore_chunks(self, shard_list: m.ShardList, named_by: str) -> None:
        """Rewrite any chunk of ``shard_list`` that is missing now and whose content this
        handle holds (it wrote or read it): ``named_by`` (a record, a checkpoint) was created
        naming it, and a gc that listed files before that create may have removed it."""
        for digest in shard_list.chunks:
            rel = paths.chunk_path(digest)
            entries = self._chunks.get(digest)
            if entries is None or self.storage.exists(rel):
                continue
            files, _ = m.split_chunks(entries)
            log.warning(
                "chunk %s of %s of %s was removed by a concurrent gc; rewritten",
                digest[:12],
                named_by,
                self.display_url,
            )
            self._touch(rel, files[0][1])

    def _touch(self, rel: str, data: bytes) -> None:
        """Write a content-addressed file, whether or not it exists (same name, same bytes):
        its fresh time tells gc that a commit is about to name it — gc leaves unreferenced
        metadata younger than an hour alone, and this one may be an old orphan."""
        self.storage.put(rel, data)


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
