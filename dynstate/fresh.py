"""Fresh shards: the Arrow tables this process just committed as shards, kept decoded (bounded,
newest kept) so that its next read of one takes the table instead of reading and decoding the
Parquet file back. A generator that appends a small round and then samples a batch over the
new head reads the round's rows at once; without this each step decoded the shards it had
just encoded.

An entry is keyed by the shard's record entry (:class:`~dynstate.records.manifest.ShardRef`:
its path, rows, size, content checksum and row-group checksums), so a read finds it only
through a record that names exactly the file this process wrote: never stale, never another
shard's rows, and across a reset or a rollback the same shard's rows. It is a copy Arrow owns
(the caller's buffers may be changed after the commit), shaped as a decode of the file gives
it (the schema pyarrow reads back: a list's item field is named ``element`` there), and kept
only where it holds what that decode holds: no type whose values a Parquet round trip
changes (dictionaries, which a read rebuilds; ``date64``, stored as days), and a read-back
schema that differs from the written one in nested field names at most.
Other processes never see it: they map the decoded file that the commit wrote from it on a
local store (:func:`dynstate.loading.cache.keep_decoded`), or decode the file. Reads conform
it to their version's schema as they do a decoded shard
(:meth:`dynstate.loading.cache.ShardCache.shard`, the one reader).

``DYNSTATE_FRESH_BYTES`` bounds it (default 64 MiB; 0 turns it off); a table over an eighth
of the bound (a large round) is not kept."""

from __future__ import annotations

import io
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import pyarrow as pa

from .records.manifest import ShardRef
from .records.rowgroups import read_parquet, write_shard

log = logging.getLogger("dynstate")

DEFAULT_FRESH_BYTES = 64 * 2**20


class FreshShards:
    """Tables of shards this process wrote, by their record entry, least recently used first
    out, at most ``max_bytes`` of Arrow buffers in all."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._tables: OrderedDict[ShardRef, pa.Table] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._as_read: dict[bytes, pa.Schema | None] = {}  # by serialized written schema
        self.hits = 0

    def __len__(self) -> int:
        return len(self._tables)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def keep(self, written: Sequence[tuple[ShardRef, pa.Table]]) -> list[tuple[ShardRef, pa.Table]]:
        """After the commit that names them: keep each shard's table (as written: the rows
        and schema the file holds), where a decode of the file gives that very table.
        Returns those kept."""
        kept: list[tuple[ShardRef, pa.Table]] = []
        if self.max_bytes <= 0:
            return kept
        for shard, table in written:
            # nbytes, not the buffers' size: a round passed as a slice of a larger table holds
            # all of its parent's buffers, and would never be kept.
            if table.num_rows != shard.rows or table.nbytes > self.max_bytes // 8:
                continue  # a large round: not kept (and not copied)
            if any(_hides_values(column) for column in table.columns):
                continue
            # Never raises: the round is committed, and a table not kept costs a decode.
            try:
                schema = self._read_schema(table.schema)
                if schema is None:
                    continue
                copy = _owned(table)
                if not copy.schema.equals(schema, check_metadata=True):
                    copy = copy.cast(schema)  # names only: the values' buffers stay
            except Exception as exc:  # the round is committed: nothing here may raise
                log.debug("the table of shard %s is not kept: %s", shard.path, exc)
                continue
            if not copy.schema.equals(schema, check_metadata=True):
                continue
            size = copy.get_total_buffer_size()
            kept.append((shard, copy))
            with self._lock:
                old = self._tables.pop(shard, None)
                if old is not None:
                    self._bytes -= old.get_total_buffer_size()
                self._tables[shard] = copy
                self._bytes += size
                while self._bytes > self.max_bytes and self._tables:
                    _, gone = self._tables.popitem(last=False)
                    self._bytes -= gone.get_total_buffer_size()
        return kept

    def get(self, shard: ShardRef) -> pa.Table | None:
        """The table this process committed as ``shard`` (exactly that record entry), or
        None: then decode the file."""
        if not self._tables:
            return None
        with self._lock:
            table = self._tables.get(shard)
            if table is not None:
                self._tables.move_to_end(shard)
                self.hits += 1
            return table

    def has(self, shard: ShardRef) -> bool:
        return shard in self._tables

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self._bytes = 0

    def _read_schema(self, schema: pa.Schema) -> pa.Schema | None:
        """The schema a decode of a shard written with ``schema`` has (``schema`` itself when
        they are equal), or None where the decode would not hold the values written: a type
        a round trip changes, or a read-back schema (that of a file of no rows, written as
        shards are) that differs in more than nested field names. Asked once per schema."""
        key = schema.serialize().to_pybytes()
        if key in self._as_read:
            return self._as_read[key]
        found: pa.Schema | None = None
        if all(_keeps_values(f.type) for f in schema):
            sink = io.BytesIO()
            write_shard(schema.empty_table(), sink)
            read = read_parquet(sink.getvalue()).schema
            if read.equals(schema, check_metadata=True):
                found = schema
            elif _renamed_only(schema, read):
                found = read
        if len(self._as_read) > 256:
            self._as_read.clear()
        self._as_read[key] = found
        return found

    def _after_fork(self) -> None:
        # A lock another thread held at the fork would stay held in the child.
        self._lock = threading.Lock()


def _keeps_values(t: pa.DataType) -> bool:
    """Whether Parquet gives back every value of type ``t`` as written."""
    # BaseExtensionType: pyarrow's own extension types (fixed_shape_tensor, uuid, ...) too
    if pa.types.is_dictionary(t) or pa.types.is_date64(t) or isinstance(t, pa.BaseExtensionType):
        return False
    return all(_keeps_values(t.field(i).type) for i in range(t.num_fields))


def _hides_values(values: pa.Array | pa.ChunkedArray) -> bool:
    """Whether ``values`` holds a null slot with child values under it: a null struct, a
    null fixed-size list (an embedding's null row keeps its ``k`` values), or a null list or
    map whose offsets span values. The writer's children keep what the caller put there, a
    decode of the file has nulls or nothing (an Arrow batch's ``field()`` or ``.values``
    would show the difference). Only nested columns are looked at."""
    t = values.type
    if t.num_fields == 0:
        return False
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    for chunk in chunks:
        if pa.types.is_struct(t):
            if chunk.null_count or any(_hides_values(chunk.field(i)) for i in range(t.num_fields)):
                return True
            continue
        if pa.types.is_fixed_size_list(t):
            if chunk.null_count and t.list_size:
                return True
        elif chunk.null_count and _spans_under_nulls(chunk):
            return True
        if pa.types.is_map(t):
            if _hides_values(chunk.keys) or _hides_values(chunk.items):
                return True
        elif _hides_values(chunk.values):  # the list kinds
            return True
    return False


def _spans_under_nulls(chunk: pa.Array) -> bool:
    """Whether a null slot of the list or map ``chunk`` spans child values (Arrow allows it;
    pyarrow's own builders leave them empty)."""
    offsets = chunk.offsets.to_numpy(zero_copy_only=False)
    nulls = chunk.is_null().to_numpy(zero_copy_only=False)
    return bool((offsets[1:] - offsets[:-1])[nulls].any())


def _renamed_only(written: pa.Schema, read: pa.Schema) -> bool:
    """Whether ``read`` is ``written`` with some nested fields of lists and maps renamed
    (names no value shows), or empty metadata dropped."""
    if (written.metadata or None) != (read.metadata or None) or written.names != read.names:
        return False
    return all(_same_field(a, b) for a, b in zip(written, read, strict=True))


def _same_field(a: pa.Field, b: pa.Field) -> bool:
    return (
        a.nullable == b.nullable
        and (a.metadata or None) == (b.metadata or None)  # {} and None: no metadata
        and _same_layout(a.type, b.type)
    )


def _same_layout(a: pa.DataType, b: pa.DataType) -> bool:
    if a == b:
        return True
    if a.id != b.id or a.num_fields != b.num_fields or not a.num_fields:
        return False
    if pa.types.is_struct(a) and [f.name for f in a] != [f.name for f in b]:
        return False  # a struct's field names are its values' keys
    if pa.types.is_fixed_size_list(a) and a.list_size != b.list_size:
        return False
    if pa.types.is_map(a) and a.keys_sorted != b.keys_sorted:
        return False
    return all(_same_field(a.field(i), b.field(i)) for i in range(a.num_fields))


def _owned(table: pa.Table) -> pa.Table:
    """A copy of ``table`` in buffers of its own (an IPC round trip): a round passed as an
    Arrow table may share memory with the caller's arrays, which the caller may change after
    the commit."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return pa.ipc.open_stream(sink.getvalue()).read_all()


def _bound() -> int:
    value = os.environ.get("DYNSTATE_FRESH_BYTES")
    if value is None:
        return DEFAULT_FRESH_BYTES
    try:
        return max(0, int(value))
    except ValueError:
        log.warning(
            "DYNSTATE_FRESH_BYTES=%r is not a whole number of bytes; using %d",
            value,
            DEFAULT_FRESH_BYTES,
        )
        return DEFAULT_FRESH_BYTES


FRESH = FreshShards(_bound())
os.register_at_fork(after_in_child=FRESH._after_fork)
