"""Views of a store's content: :class:`Snapshot` (one committed version, immutable) and
:class:`Staged` (shards written but not committed yet), and the check every shard read passes.

A snapshot is made from its version's commit record alone: its version, row count and record
are known at once, and its shard list (up to a checkpoint interval of records and the chunks
of a checkpoint) and schema are read the first time something asks for them — opening a store
to count its rows reads no shard list (issue 23.2).
"""

from __future__ import annotations

import bisect
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from .errors import ChecksumMismatchError, CorruptStoreError, RowOutOfRangeError
from .records import manifest as m
from .records.codec import whole
from .records.manifest import Commit, ShardRef

if TYPE_CHECKING:
    # Counting a version's rows needs no Arrow: only reading them (and the schema) imports it.
    import pyarrow as pa


class ShardReader(Protocol):
    """What a snapshot reads through (a :class:`dynstate.Store`)."""

    @property
    def display_url(self) -> str: ...

    def shard_list(self, version: int) -> list[ShardRef]: ...

    def schema_of(self, record: Commit) -> pa.Schema | None: ...

    def read_shard(
        self, shard: ShardRef, schema: pa.Schema | None = None, *, version: int | None = None
    ) -> pa.Table: ...

    def read_shard_bytes(self, shard: ShardRef, *, version: int | None = None) -> bytes: ...


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


_UNREAD: Any = object()  # a schema not read yet (None is a version without one)


class Contents:
    """What a snapshot of one version is made of, filled in as it is first needed and shared
    by every snapshot of that version a store handle makes. It holds no reference to the
    store: a store -> cache -> store cycle would leave Arrow objects to be freed at interpreter
    teardown, which aborts the process when torch is loaded."""

    __slots__ = ("commit", "offsets", "schema", "shards")

    def __init__(self, commit: Commit) -> None:
        self.commit = commit
        self.shards: tuple[ShardRef, ...] | None = None
        self.offsets: list[int] | None = None  # shared by the snapshots: never modified
        self.schema: Any = _UNREAD


class Snapshot:
    """An immutable view of one version: its shards in order, row offsets and schema.

    ``version``, ``num_rows`` and ``commit`` come from the version's commit record; the shard
    list (``shards``, ``offsets``) and ``schema`` are read on first use, so a damaged or
    missing record, checkpoint or chunk on the way raises (:class:`CorruptStoreError` and its
    kin) from the first call that needs them — ``locate``, ``read_shard``, ``to_arrow``."""

    def __init__(self, store: ShardReader, contents: Contents) -> None:
        self.store = store
        self._contents = contents

    @property
    def commit(self) -> Commit:
        return self._contents.commit

    @property
    def version(self) -> int:
        return self._contents.commit.version

    @property
    def num_rows(self) -> int:
        return self._contents.commit.num_rows

    @property
    def shards(self) -> tuple[ShardRef, ...]:
        shards = self._contents.shards
        return shards if shards is not None else self._load()

    @property
    def offsets(self) -> list[int]:
        offsets = self._contents.offsets
        if offsets is None:
            self._load()
            offsets = self._contents.offsets
            assert offsets is not None
        return offsets

    @property
    def schema(self) -> pa.Schema | None:
        contents = self._contents
        if contents.schema is _UNREAD:
            contents.schema = self.store.schema_of(contents.commit)
        return contents.schema

    def _load(self) -> tuple[ShardRef, ...]:
        """Read the shard list and check that it holds the rows the record counts (offsets
        into the version are computed from it; ``num_rows`` from the record)."""
        contents = self._contents
        shards = tuple(self.store.shard_list(self.version))
        offsets = [0]
        for shard in shards:
            offsets.append(offsets[-1] + shard.rows)
        if offsets[-1] != self.num_rows:
            self._mismatch(shards, offsets[-1])
        # Offsets first: a thread that sees the shards set finds the offsets too.
        contents.offsets = offsets
        contents.shards = shards
        return shards

    def _mismatch(self, shards: tuple[ShardRef, ...], listed: int) -> None:
        """The record's row count and its shard list disagree: some record was altered. A
        shard entry that lies about its rows is the likely cause, and reading the shards
        names it (:meth:`dynstate.Store.read_shard_bytes` checks each file's row count);
        only if every entry is true is the count itself to blame. Error path only."""
        for shard in shards:
            self.store.read_shard_bytes(shard, version=self.version)
        raise CorruptStoreError(
            f"version {self.version} of {self.store.display_url} counts {self.num_rows} rows "
            f"in its commit record but its shard list holds {listed}; a record was altered — "
            "run `dynstate verify`, and reset to a version before it"
        )

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
        offsets = self.offsets
        shard = bisect.bisect_right(offsets, row) - 1
        return shard, row - offsets[shard]

    def read_shard(self, index: int) -> pa.Table:
        """The rows of shard ``index`` (0 to ``len(shards) - 1``) of this version."""
        i = whole(index)  # numpy's integers too; never a bool
        if i is None or not 0 <= i < len(self.shards):
            raise RowOutOfRangeError(
                f"version {self.version} of {self.store.display_url} has {len(self.shards)} "
                f"shards (0 to {len(self.shards) - 1}); no shard {index!r}"
            )
        return self.store.read_shard(self.shards[i], self.schema, version=self.version)

    def to_arrow(self) -> pa.Table:
        """This version's rows, in order, as one table."""
        import pyarrow as pa

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
