"""What gc must keep and what it may collect at once, read through the log: the shards,
chunks, schemas and outcome files every kept version needs (:class:`References`), and the
files the versions being collected named (:func:`references_below`). Reads only; the
deleting is :func:`dynstate.maintenance.gc.collect_garbage`'s.
"""

from __future__ import annotations

import logging

from .. import paths
from ..errors import CorruptStoreError
from ..log import outcome_refs
from ..records import manifest as m
from ..store import Store

log = logging.getLogger("dynstate")


class References:
    """Shards, chunks and schemas that kept versions need. The shard set equals the union of
    every kept version's materialized list: a version's list is the floor's, or the latest
    base record's, followed by the rounds appended since."""

    def __init__(self, store: Store, floor: int) -> None:
        self.store = store
        self.floor = floor
        self.shards = {s.path for s in store.log.materialize(floor)}
        self.outcomes = outcome_refs.References(store.log, floor)
        self.chunks: set[str] = set()
        self.schemas: set[str] = set()
        for version in store.log.checkpoint_versions(floor):
            shard_list = store.log.read_checkpoint(version)
            if shard_list is not None:  # None: removed since the listing
                self.chunks.update(shard_list.chunks)

    def add_versions(self, start: int, end: int) -> None:
        for version in range(start, end + 1):
            record = self.store.commit_record(version)
            if record.schema is not None:
                self.schemas.add(record.schema)
            self.shards.update(s.path for s in record.add)
            self.outcomes.add_record(record, full=version > self.floor)
            if record.base is not None:
                self.chunks.update(record.base.chunks)
                if version > self.floor:
                    self.shards.update(s.path for s in self.store.log.materialize(version))

    def needs(self, rel: str) -> bool:
        if self.outcomes.needs(rel):
            return True
        match = paths.classify(rel)
        if match is None:
            return False
        if match.kind == "shard":
            return rel in self.shards
        if match.kind == "chunk":
            return match.parts in self.chunks
        if match.kind == "schema":
            return match.parts in self.schemas
        return False


def references_below(store: Store, start: int, floor: int) -> set[str]:
    """Files the versions being collected referred to: removed without waiting out the grace
    period, since they are committed data and not a live writer's work in progress. Read
    through the log (records below the floor, their checkpoints, the chunks they name); a
    damaged one is skipped with a warning, and what it named is judged as an orphan."""
    shards: set[str] = set()
    chunks: set[str] = set()
    schemas: set[str] = set()
    lists: list[m.ShardList] = []
    for version in range(start, floor):
        try:
            record = store.log.record(version)
        except CorruptStoreError as exc:
            log.warning("gc: reading collected version %d of %s: %s", version, store.display_url,
                        exc)  # fmt: skip
            record = None
        if record is not None:
            shards.update(s.path for s in record.add)
            if record.schema is not None:
                schemas.add(record.schema)
            if record.base is not None:
                lists.append(record.base)
        try:
            checkpoint = store.log.read_checkpoint(version)
        except CorruptStoreError as exc:
            log.warning("gc: reading the collected checkpoint of version %d of %s: %s", version,
                        store.display_url, exc)  # fmt: skip
            checkpoint = None
        if checkpoint is not None:
            lists.append(checkpoint)
    for shard_list in lists:
        shards.update(s.path for s in shard_list.tail)
        for digest in shard_list.chunks:
            chunks.add(digest)
            try:
                entries = store.log.read_chunk(digest)
            except CorruptStoreError as exc:
                log.warning("gc: reading chunk %s: %s", digest[:12], exc)
                entries = None
            shards.update(s.path for s in entries or ())
    return shards | {paths.chunk_path(c) for c in chunks} | {paths.schema_path(s) for s in schemas}
