"""A shard's row groups: written at a size chosen for random access, each with its byte
range and SHA-256 recorded, so that a reader fetches and verifies only the row groups a batch
needs (docs/format.md, "Row groups").

The writer cuts the file at the points where pyarrow finished each row group and hashes each
segment as it streams past; it then checks the cuts against the footer's own column-chunk
offsets, and records nothing (the shard is then read and verified whole, as before) if they
disagree.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .columns import owned_buffer
from .footers import shard_template
from .manifest import RowGroups

log = logging.getLogger("dynstate")

# Rows per row group. A random batch reads one row group per row it asks for, so the bytes
# it reads grow with this size; the footer, its parse time and the manifest grow with the
# number of row groups (~70-200 footer bytes per column per group, 64 hex digits + two
# numbers per group in the manifest), and so does the footer's parse, once per shard and
# process. docs/format.md gives the figures behind the choice.
ROW_GROUP_ROWS = 256
# Rows per row group in stores on object stores (S3, memory://). There a reader fetches no
# footer but the first of each schema (dynstate.records.footers), so a random batch's bytes are its
# row groups alone, and halving them halves what it fetches (7.6 -> 3.2 % of the store for
# 256 random rows of 1M); locally, where the footer is parsed per shard, 256 reads faster.
OBJECT_STORE_GROUP_ROWS = 128
# At most this many row groups a shard (larger groups in larger shards): a 64 MiB shard of
# short rows would otherwise carry thousands, each in its footer and its commit entry.
MAX_ROW_GROUPS = 256
# The codec of a shard's column chunks: LZ4 (Parquet's LZ4_RAW, interoperable since Arrow 4,
# Spark 3.3, DuckDB, polars). A random batch decompresses a whole row group per row it asks
# for; LZ4 makes such a read ~1.4x as fast as Snappy, pyarrow's default, for ~1.25x the bytes
# (docs/format.md gives the figures).
COMPRESSION = "lz4"


class _Segments:
    """A write-only file object in front of a shard sink that also hashes the bytes since the
    last cut, so each row group's checksum costs no second pass over the data."""

    def __init__(self, sink: Any):
        self._sink = sink
        self._hash = hashlib.sha256()
        self._size = 0
        self._start = 0
        self._tail: list[bytes] | None = None  # the footer's bytes, kept to check the cuts
        self.cuts: list[tuple[int, str]] = []  # (end offset, sha256) per finished segment
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._hash.update(view)
        if self._tail is not None:
            self._tail.append(bytes(view))
        written = self._sink.write(view)
        self._size += len(view)
        return written if written is not None else len(view)

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        self._sink.flush()

    def cut(self) -> None:
        self.cuts.append((self._size, self._hash.hexdigest()))
        self._hash = hashlib.sha256()

    def keep_tail(self) -> None:
        self._tail = []

    def tail(self) -> bytes:
        return b"".join(self._tail or [])


def group_rows(total_rows: int, *, local: bool = True) -> int:
    """Rows per row group of a shard of ``total_rows`` rows: ROW_GROUP_ROWS (on a local disk)
    or OBJECT_STORE_GROUP_ROWS, or more so that it has at most MAX_ROW_GROUPS."""
    rows = ROW_GROUP_ROWS if local else OBJECT_STORE_GROUP_ROWS
    return max(rows, -(-total_rows // MAX_ROW_GROUPS))


class ShardWriter:
    """Writes one shard from tables streamed in order (a round's slice, or the shards a
    compaction merges), cutting it into row groups of ``rows`` rows whatever the tables'
    sizes, and hashing each as it streams past. The column encoding is chosen from the first
    row group (:func:`dictionary_columns`). :meth:`close` writes the footer and returns the
    groups' record, or None when the layout did not come out as the cuts say."""

    def __init__(self, sink: Any, schema: pa.Schema, rows: int):
        self.rows = rows
        self._schema = schema
        self._out = _Segments(sink)
        self._writer: pq.ParquetWriter | None = None
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._counts: list[int] = []

    def write(self, table: pa.Table) -> None:
        if table.num_rows:
            self._pending.append(table)
            self._pending_rows += table.num_rows
        while self._pending_rows >= self.rows:
            self._write_group(self.rows)

    def _write_group(self, n: int) -> None:
        pending = self._pending[0] if len(self._pending) == 1 else pa.concat_tables(self._pending)
        part, rest = pending.slice(0, n), pending.slice(n)
        writer = self._open(part)
        writer.write_table(part, row_group_size=n)
        self._out.cut()
        self._counts.append(n)
        self._pending = [rest] if rest.num_rows else []
        self._pending_rows -= n

    def _open(self, first: pa.Table | None) -> pq.ParquetWriter:
        """The Parquet writer, opened for the first row group (None: a shard of no rows,
        written with pyarrow's default encoding)."""
        if self._writer is None:
            # No column statistics: dynstate never prunes by them, and without them a footer
            # is ~2.3x smaller and parses ~25 % faster; it is read before any row of its shard.
            self._writer = pq.ParquetWriter(
                self._out,
                self._schema,
                compression=COMPRESSION,
                write_statistics=False,
                use_dictionary=True if first is None else dictionary_columns(first, self.rows),
            )
        return self._writer

    def close(self) -> RowGroups | None:
        if self._pending_rows:
            self._write_group(self._pending_rows)
        writer = self._open(None)
        self._out.keep_tail()
        writer.close()
        self._out.cut()
        ends = [end for end, _ in self._out.cuts]
        if not _layout_matches(self._out.tail(), ends, self._counts):
            log.warning("row groups of a shard did not land where expected; it will be read whole")
            return None
        sizes = [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        digests = "".join(d for _, d in self._out.cuts)
        template = shard_template(self._schema, COMPRESSION) if self._counts else None
        return RowGroups(tuple(self._counts), tuple(sizes), digests, template)

    def abort(self) -> None:
        """Release the Parquet writer after a failure (the caller discards the sink)."""
        if self._writer is not None:
            try:
                self._writer.close()
            except (pa.ArrowException, OSError):  # the sink may be what failed
                pass


def write_shard(table: pa.Table, sink: Any, row_group_rows: int | None = None) -> RowGroups | None:
    """Write ``table`` to ``sink`` as Parquet in row groups of ``row_group_rows`` rows (by
    default :func:`group_rows`); returns where each lies and its checksum, or None when the
    file's layout did not come out as the cuts say (then readers verify it whole)."""
    writer = ShardWriter(sink, table.schema, row_group_rows or group_rows(table.num_rows))
    try:
        writer.write(table)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def dictionary_columns(table: pa.Table, rows: int) -> bool | list[str]:
    """The columns worth a dictionary: those whose first row group repeats its values.

    Small row groups make every group start a dictionary of its own, and a column of mostly
    distinct values (prompts, ids, rewards as floats) never fills the 1 MiB dictionary page
    at which pyarrow falls back to plain encoding: each group then pays a dictionary it does
    not use, at write (encoding a shard took 2x as long) and at every read (the dictionary
    page is most of a cold group's decode). Columns that repeat (labels, flags, steps) keep
    it: there it is 7x smaller. Nested columns keep pyarrow's default (all dictionaries)."""
    if not table.num_columns or any(pa.types.is_nested(f.type) for f in table.schema):
        return True
    import pyarrow.compute as pc  # here: a reader of shards never needs it (~40 ms to import)

    head = table.slice(0, rows)
    keep = []
    for name, column in zip(table.column_names, head.columns, strict=True):
        if pa.types.is_dictionary(column.type) or pa.types.is_boolean(column.type):
            keep.append(name)
            continue
        try:
            distinct = pc.count_distinct(column, mode="all").as_py()
        except pa.ArrowNotImplementedError:  # a type without the kernel: pyarrow's default
            keep.append(name)
            continue
        if distinct * 2 <= max(len(column), 1):
            keep.append(name)
    return keep


def _layout_matches(footer: bytes, ends: list[int], counts: list[int]) -> bool:
    try:
        meta = read_footer(footer)
    except (pa.ArrowException, OSError):
        return False
    return layout_matches(meta, ends, counts)


def layout_matches(
    meta: pq.FileMetaData,
    ends: list[int],
    counts: list[int],
    groups: Sequence[int] | None = None,
    counted: int = 0,
) -> bool:
    """Whether the footer says row group i starts where segment i-1 ended (the first just
    after the magic) and holds the rows written into it: the cuts then partition the file.
    The writer checks it before recording the cuts; a reader again, since a record may be
    tampered with and the footer is the one that says which bytes a group decodes.

    With ``groups``, only what a read of those groups relies on: their byte ranges, and the
    row counts of every group up to the last of them (a group's first row is the sum of the
    counts before it); ``counted`` leading groups' counts are known to match already. A read
    of a few groups of a shard with dozens then costs a few lookups, not dozens."""
    if meta.num_row_groups != len(counts) or len(ends) != len(counts) + 1:
        return False
    if counts and meta.num_columns == 0:
        return False
    starts = [4, *ends[:-2]]
    check = range(meta.num_row_groups) if groups is None else groups
    last = meta.num_row_groups if groups is None else max(groups, default=-1) + 1
    for i in range(counted, last):
        if meta.row_group(i).num_rows != counts[i]:
            return False
    for i in check:
        group = meta.row_group(i)
        first = group.column(0)
        begin = first.dictionary_page_offset or first.data_page_offset
        end_col = group.column(group.num_columns - 1)
        end = (end_col.dictionary_page_offset or end_col.data_page_offset) + (
            end_col.total_compressed_size
        )
        if begin != starts[i] or end > ends[i]:
            return False
    return True


def read_parquet(data: bytes | memoryview) -> pa.Table:
    """A whole Parquet file's table from its bytes, decoded on pyarrow's threads from a copy
    Arrow owns (:func:`~dynstate.records.columns.owned_buffer`: else a process may abort at exit).
    Through ParquetFile, not read_table: read_table goes through pyarrow.dataset, whose
    import (pandas with it, where installed) costs ~0.15 s of a fresh process's first read."""
    return pq.ParquetFile(pa.BufferReader(owned_buffer(data))).read()


def read_footer(footer: bytes | memoryview) -> pq.FileMetaData:
    """The metadata of a Parquet file from its footer segment alone (the serialized metadata,
    its length and the trailing magic)."""
    return pq.read_metadata(pa.BufferReader(footer))
