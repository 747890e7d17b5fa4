"""Views of a store's content: :class:`Snapshot` (one committed version, immutable) and
:class:`Staged` (shards written but not committed yet), and the check every shard read passes.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any, Protocol

import pyarrow as pa

from . import manifest as m
from .errors import ChecksumMismatchError, RowOutOfRangeError
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

    def keep_leased(self, storage: Any, ttl_s: float) -> Staged:
        """Remember where the lease lives, so that a process unpickling this part takes the
        lease over at once (see :meth:`__setstate__`)."""
        object.__setattr__(self, "_keeper", (storage, ttl_s))
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        keeper = self.__dict__.get("_keeper")
        if keeper is not None:
            state["_keeper"] = keeper
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        keeper = state.pop("_keeper", None)
        for f in fields(self):
            object.__setattr__(self, f.name, state.get(f.name, f.default))
            if f.name not in state and f.default is MISSING:
                raise TypeError(f"a pickled Staged part without {f.name!r}")
        if keeper is None:
            return
        object.__setattr__(self, "_keeper", keeper)
        if self.lease:
            # The receiving process (a pool's parent, a Ray driver) renews the lease from now
            # on: the stager may exit right after handing the part over, and gc expires the
            # lease of a process that no longer exists.
            from .log.leases import keep_alive

            keep_alive(keeper[0], keeper[1], self.lease)

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
        *,
        offsets: list[int] | None = None,
    ):
        self.store = store
        self.commit = commit
        self.shards: tuple[ShardRef, ...] = tuple(shards)
        self.schema = schema
        if offsets is None:
            offsets = [0]
            for shard in self.shards:
                offsets.append(offsets[-1] + shard.rows)
        self.offsets: list[int] = offsets  # shared with the store's cache: never modified

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
            raise RowOutOfRangeError(
                f"row {row} out of range for version {self.version} of "
                f"{self.store.display_url} ({self.num_rows} rows); ask for a row below "
                f"{self.num_rows}, or read a later version"
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
