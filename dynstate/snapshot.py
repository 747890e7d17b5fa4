"""Views of a store's content: :class:`Snapshot` (one committed version, immutable) and
:class:`Staged` (shards written but not committed yet), and the check every shard read passes.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa

from . import manifest as m
from .errors import ChecksumMismatchError
from .manifest import Commit, ShardRef


class ShardReader(Protocol):
    """What a snapshot reads through (a :class:`dynstate.Store`)."""

    @property
    def display_url(self) -> str: ...

    def read_shard(
        self, shard: ShardRef, schema: pa.Schema | None = None, *, version: int | None = None
    ) -> pa.Table: ...


@dataclass(frozen=True)
class Staged:
    """Shards written but not committed, with the schema they were validated against and
    the lease that protects them from gc until they are committed."""

    shards: tuple[ShardRef, ...]
    schema: pa.Schema | None
    validated: str | None  # schema fingerprint of the head they were checked against
    lease: str | None = None
    store: str | None = None  # the id of the store it was staged in (None: an older dynstate)

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.shards)


class Snapshot:
    """An immutable view of one version: its shards in order, row offsets and schema."""

    def __init__(
        self,
        store: ShardReader,
        commit: Commit,
        shards: Sequence[ShardRef],
        schema: pa.Schema | None,
    ):
        self.store = store
        self.commit = commit
        self.shards: tuple[ShardRef, ...] = tuple(shards)
        self.schema = schema
        offsets = [0]
        for shard in self.shards:
            offsets.append(offsets[-1] + shard.rows)
        self.offsets: list[int] = offsets

    @property
    def version(self) -> int:
        return self.commit.version

    @property
    def num_rows(self) -> int:
        return self.offsets[-1]

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return (
            f"Snapshot({self.store.display_url!r}, version={self.version}, "
            f"num_rows={self.num_rows}, shards={len(self.shards)})"
        )

    def locate(self, row: int) -> tuple[int, int]:
        """(shard index, row within that shard) of logical row ``row``."""
        if not 0 <= row < self.num_rows:
            raise IndexError(
                f"row {row} out of range for version {self.version} of "
                f"{self.store.display_url} ({self.num_rows} rows)"
            )
        shard = bisect.bisect_right(self.offsets, row) - 1
        return shard, row - self.offsets[shard]

    def read_shard(self, index: int) -> pa.Table:
        return self.store.read_shard(self.shards[index], self.schema, version=self.version)

    def to_arrow(self) -> pa.Table:
        """This version's rows, in order, as one table."""
        tables = [self.read_shard(i) for i in range(len(self.shards))]
        if tables:
            return pa.concat_tables(tables)
        return self.schema.empty_table() if self.schema is not None else pa.table({})


def verify_shard_bytes(data: bytes, shard: ShardRef, where: str) -> None:
    if len(data) != shard.bytes:
        raise ChecksumMismatchError(
            f"shard {shard.path} of {where} is truncated or altered: {len(data)} bytes, "
            f"{shard.bytes} committed; restore it or reset to a version without it"
        )
    if m.sha256(data) != shard.sha256:
        raise ChecksumMismatchError(
            f"shard {shard.path} of {where} does not match its checksum; restore it or reset "
            "to a version without it"
        )
