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
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .manifest import RowGroups

log = logging.getLogger("dynstate")

# Rows per row group. A random batch reads one row group per row it asks for, so the bytes
# it reads grow with this size; the footer, its parse time and the manifest grow with the
# number of row groups (~70-200 footer bytes per column per group, 64 hex digits + two
# numbers per group in the manifest), and so does the footer's parse, once per shard and
# process. docs/format.md gives the figures behind the choice.
ROW_GROUP_ROWS = 256
# At most this many row groups a shard (larger groups in larger shards): a 64 MiB shard of
# short rows would otherwise carry thousands, each in its footer and its commit entry.
MAX_ROW_GROUPS = 256


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


def write_shard(table: pa.Table, sink: Any, row_group_rows: int | None = None) -> RowGroups | None:
    """Write ``table`` to ``sink`` as Parquet in row groups of ``row_group_rows`` rows (by
    default ROW_GROUP_ROWS, or more so that there are at most MAX_ROW_GROUPS); returns where
    each lies and its checksum, or None when the file's layout did not come out as the cuts
    say (then readers verify it whole)."""
    rows = row_group_rows or max(ROW_GROUP_ROWS, -(-table.num_rows // MAX_ROW_GROUPS))
    out = _Segments(sink)
    counts = []
    # No column statistics: dynstate never prunes by them, and without them a footer is
    # ~2.3x smaller and parses ~25 % faster — it is read before any row of its shard.
    with pq.ParquetWriter(
        out, table.schema, write_statistics=False, use_dictionary=dictionary_columns(table, rows)
    ) as writer:
        for start in range(0, table.num_rows, rows):
            part = table.slice(start, rows)
            writer.write_table(part, row_group_size=rows)
            out.cut()
            counts.append(part.num_rows)
        out.keep_tail()
    out.cut()
    ends = [end for end, _ in out.cuts]
    if not _layout_matches(out.tail(), ends, counts):
        log.warning("row groups of a shard did not land where expected; it will be read whole")
        return None
    sizes = [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    return RowGroups(tuple(counts), tuple(sizes), "".join(d for _, d in out.cuts))


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


def read_footer(footer: bytes | memoryview) -> pq.FileMetaData:
    """The metadata of a Parquet file from its footer segment alone (the serialized metadata,
    its length and the trailing magic)."""
    return pq.read_metadata(pa.BufferReader(footer))
