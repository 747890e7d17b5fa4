"""A spike for issue 23's S3 target: decode a shard's row group without its footer.

A random batch on S3 fetches, per shard it touches, the row groups holding its rows and the
shard's footer (the Parquet metadata pyarrow needs to decode anything). The footer is ~63
bytes of Thrift per column chunk; at 128 rows per group it is as large as the groups a batch
reads, so the bytes a first batch fetches cannot go under ~5.6 % of the store (see
docs/benchmarks.md). This spike shows that the footers need not be fetched at all:

* a row group's own bytes hold its column chunks as runs of pages, each page with a header
  that gives its sizes and its value (or, in data pages v2, row) count, so the page headers
  alone say where each column chunk starts and ends and what the footer would say of it;
* everything else in a footer (the Parquet schema, the Arrow schema, the codec, created_by)
  is the same for every shard of one schema written by one writer: one footer, fetched once
  per process, is a template;
* a footer for that one row group, built from the template and the page headers, and the
  group's bytes make a small Parquet file that pyarrow decodes.

It builds the cold-read benchmark's store (1M rows, 100 shards) at the row-group sizes
asked for, draws the same first batch as ``bench_cold.py``'s S3 run, checks that every row
group it touches decodes, through a synthesized footer, to exactly what pyarrow reads with
the real footer, and reports what the batch would fetch with and without footers (bytes and
ranged requests, computed from the recorded segments: the "with" figure is what the loopback
S3 run measures), and the decode time per group both ways. Nothing here is used by the
library; it is the measurement behind the design proposed in docs/benchmarks.md.

    python tools/bench/bench_footerless.py --row-groups 128,256 --dir /tmp/bfl
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import struct
import sys
import time
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cold import BATCH, build
from bench_resume import rows_table

import dynstate.rowgroups as rowgroups
from dynstate import Store

# -- Thrift compact protocol: just enough to read a footer and page headers ------------------

STOP, TRUE, FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(13)
Fields = list[tuple[int, int, Any]]  # (field id, type, value) in the order read


def _varint(b: Any, i: int) -> tuple[int, int]:
    shift = out = 0
    while True:
        x = b[i]
        i += 1
        out |= (x & 0x7F) << shift
        if x < 0x80:
            return out, i
        shift += 7


def _unzigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _read_value(b: Any, i: int, t: int) -> tuple[Any, int]:
    if t in (TRUE, FALSE):  # a bool inside a list: one byte
        return b[i] == 1, i + 1
    if t == BYTE:
        return b[i], i + 1
    if t in (I16, I32, I64):
        v, i = _varint(b, i)
        return _unzigzag(v), i
    if t == DOUBLE:
        return bytes(b[i : i + 8]), i + 8
    if t == BINARY:
        n, i = _varint(b, i)
        return bytes(b[i : i + n]), i + n
    if t in (LIST, SET):
        head = b[i]
        i += 1
        n, elem = head >> 4, head & 0xF
        if n == 15:
            n, i = _varint(b, i)
        items = []
        for _ in range(n):
            v, i = _read_value(b, i, elem)
            items.append(v)
        return (elem, items), i
    if t == STRUCT:
        return read_struct(b, i)
    raise ValueError(f"Thrift type {t} does not occur in Parquet metadata")


def read_struct(b: Any, i: int) -> tuple[Fields, int]:
    fields: Fields = []
    last = 0
    while True:
        head = b[i]
        i += 1
        if head == STOP:
            return fields, i
        t, delta = head & 0xF, head >> 4
        if delta:
            fid = last + delta
        else:
            v, i = _varint(b, i)
            fid = _unzigzag(v)
        if t in (TRUE, FALSE):
            fields.append((fid, TRUE, t == TRUE))
        else:
            v, i = _read_value(b, i, t)
            fields.append((fid, t, v))
        last = fid


def _put_varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _put_int(out: bytearray, n: int) -> None:
    _put_varint(out, (n << 1) ^ (n >> 63))


def _write_value(out: bytearray, t: int, v: Any) -> None:
    if t == BYTE:
        out.append(v & 0xFF)
    elif t in (I16, I32, I64):
        _put_int(out, v)
    elif t == DOUBLE:
        out += v
    elif t == BINARY:
        _put_varint(out, len(v))
        out += v
    elif t in (LIST, SET):
        elem, items = v
        if len(items) < 15:
            out.append((len(items) << 4) | elem)
        else:
            out.append(0xF0 | elem)
            _put_varint(out, len(items))
        for x in items:
            if elem in (TRUE, FALSE):
                out.append(1 if x else 2)
            else:
                _write_value(out, elem, x)
    elif t == STRUCT:
        out += write_fields(v, 0) + b"\x00"
    else:
        raise ValueError(f"Thrift type {t}")


def write_fields(fields: Fields, last: int) -> bytes:
    """The fields' encoding, field ids delta-coded from ``last``, without the stop byte."""
    out = bytearray()
    for fid, t, v in fields:
        wire = (TRUE if v else FALSE) if t == TRUE else t
        delta = fid - last
        if 0 < delta <= 15:
            out.append((delta << 4) | wire)
        else:
            out.append(wire)
            _put_int(out, fid)
        if t != TRUE:
            _write_value(out, t, v)
        last = fid
    return bytes(out)


def field(fields: Fields, fid: int, default: Any = None) -> Any:
    for f, _, v in fields:
        if f == fid:
            return v
    return default


# -- page headers ----------------------------------------------------------------------------

DATA_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 2, 3
RLE = 3


def page_header(b: Any, i: int) -> tuple[int, int, int, int, int | None, tuple[Any, ...], int]:
    """(page type, uncompressed size, compressed size, values, rows (v2 pages) or None,
    encodings, where the page's data starts)."""
    header, end = read_struct(b, i)
    ptype, usize, csize = field(header, 1), field(header, 2), field(header, 3)
    if ptype == DATA_PAGE:
        sub = field(header, 5)
        return (
            ptype,
            usize,
            csize,
            field(sub, 1),
            None,
            tuple(field(sub, k) for k in (2, 3, 4)),
            end,
        )
    if ptype == DICTIONARY_PAGE:
        sub = field(header, 7)
        return ptype, usize, csize, field(sub, 1), None, (field(sub, 2),), end
    if ptype == DATA_PAGE_V2:
        sub = field(header, 8)
        return ptype, usize, csize, field(sub, 1), field(sub, 3), (field(sub, 4), RLE), end
    return ptype, usize, csize, 0, None, (), end


# -- the footer of one row group, from a template and the group's pages ---------------------


class Template:
    """What every footer of one schema and writer shares, taken from one real footer: the
    bytes before and after its row groups and, per column, the fields that do not depend on
    the data (type, path, codec). Which leaf columns repeat (lists): their v1 data pages
    count values, not rows, so their chunk ends cannot be found from the pages alone."""

    def __init__(self, footer: bytes):
        meta, end = read_struct(footer, 0)
        assert end == len(footer)
        self.prefix = write_fields([f for f in meta if f[0] in (1, 2)], 0)
        self.suffix = write_fields([f for f in meta if f[0] > 4], 4) + b"\x00"
        columns = field(field(meta, 4)[1][0], 1)[1]
        self.columns = []
        for chunk in columns:
            cmeta = field(chunk, 3)
            self.columns.append(
                (
                    write_fields([f for f in cmeta if f[0] == 1], 0),
                    write_fields([f for f in cmeta if f[0] in (3, 4)], 2),
                )
            )
        n = len(columns)
        self.list_head = bytes([(n << 4) | STRUCT]) if n < 15 else bytes([0xF0 | STRUCT, n])
        self.repeated = _repeated_leaves(field(meta, 2)[1])


def _repeated_leaves(schema: list[Fields]) -> list[bool]:
    out: list[bool] = []

    def walk(i: int, repeated: bool) -> int:
        element = schema[i]
        repeated = repeated or field(element, 3) == 2  # repetition_type REPEATED
        children = field(element, 5, 0)
        if not children:
            out.append(repeated)
            return i + 1
        j = i + 1
        for _ in range(children):
            j = walk(j, repeated)
        return j

    j = 1
    for _ in range(field(schema[0], 5, 0)):
        j = walk(j, False)
    return out


def mini_file(template: Template, group: Any, rows: int) -> bytes | None:
    """A Parquet file holding ``group`` (one row group's bytes, without the leading magic)
    and a footer describing it, or None when its pages do not say where each column ends."""
    at = 4  # the group follows the leading magic
    foot = bytearray(template.prefix)
    foot += b"\x16"  # num_rows
    _put_int(foot, rows)
    foot += b"\x19\x1c\x19"  # row_groups: a list of one struct; its columns: a list
    foot += template.list_head
    i, n, total = 0, len(group), 0
    for (type_field, path_codec), repeated in zip(template.columns, template.repeated, strict=True):
        start, seen, values, uncompressed = i, 0, 0, 0
        encodings: set[int] = set()
        dictionary = data = None
        while seen < rows:
            if i >= n:
                return None
            ptype, usize, csize, nvalues, nrows, encs, end = page_header(group, i)
            uncompressed += end - i + usize
            if ptype == DICTIONARY_PAGE:
                dictionary = i
            elif ptype in (DATA_PAGE, DATA_PAGE_V2):
                data = i if data is None else data
                if nrows is None and repeated:
                    return None
                seen += nvalues if nrows is None else nrows
                values += nvalues
            else:
                return None
            encodings.update(e for e in encs if e is not None)
            i = end + csize
        if seen != rows or data is None:
            return None
        total += uncompressed
        foot += b"\x26\x00\x1c"  # file_offset 0, then meta_data
        foot += type_field
        foot += b"\x19"
        foot.append((len(encodings) << 4) | I32)
        for e in sorted(encodings):
            _put_int(foot, e)
        foot += path_codec
        for value in (values, uncompressed, i - start):
            foot += b"\x16"
            _put_int(foot, value)
        foot += b"\x26"
        _put_int(foot, data + at)
        if dictionary is not None:
            foot += b"\x26"
            _put_int(foot, dictionary + at)
        foot += b"\x00\x00"
    if i != n:
        return None
    for delta_type, value in ((b"\x16", total), (b"\x16", rows), (b"\x26", at), (b"\x16", n)):
        foot += delta_type
        _put_int(foot, value)
    foot += b"\x00"
    foot += template.suffix
    return b"PAR1" + bytes(group) + bytes(foot) + struct.pack("<I", len(foot)) + b"PAR1"


# -- the measurement -------------------------------------------------------------------------


def _ranges(segments: list[int]) -> int:
    """How many ranged reads fetch these sorted segments (adjacent ones travel together)."""
    return sum(1 for k, s in enumerate(segments) if k == 0 or s != segments[k - 1] + 1)


def measure(store: Store, root: Path, num_rows: int, repeats: int) -> None:
    shards = store.snapshot().shards
    total = sum(s.bytes for s in shards)
    starts = list(accumulate((s.rows for s in shards), initial=0))
    idx = np.random.default_rng(1).choice(num_rows, BATCH, replace=False).tolist()
    wanted: dict[int, set[int]] = {}
    for row in idx:
        k = bisect.bisect_right(starts, row) - 1
        groups = shards[k].groups
        assert groups is not None
        g = bisect.bisect_right(list(accumulate(groups.rows, initial=0)), row - starts[k]) - 1
        wanted.setdefault(k, set()).add(g)
    with_bytes = without_bytes = with_requests = without_requests = 0
    template: Template | None = None
    work = []
    for k, groups_wanted in sorted(wanted.items()):
        shard = shards[k]
        info = shard.groups
        assert info is not None
        bounds = [0, *accumulate(info.bytes)]
        footer_at = len(info.rows)
        picked = sorted(groups_wanted)
        group_bytes = sum(info.bytes[g] for g in picked)
        with_bytes += group_bytes + info.bytes[footer_at]
        with_requests += _ranges([*picked, footer_at])
        without_bytes += group_bytes
        without_requests += _ranges(picked)
        data = (root / shard.path).read_bytes()
        if template is None:  # the one footer a process fetches: the first shard's
            template = Template(data[bounds[footer_at] : -8])
            without_bytes += info.bytes[footer_at]
            without_requests += 1
        # segment 0 holds the leading magic
        pieces = [(bounds[g] + (4 if g == 0 else 0), bounds[g + 1], info.rows[g]) for g in picked]
        work.append((shard.path, data, picked, pieces))
    assert template is not None
    checked = fallbacks = 0
    for path, data, picked, pieces in work:
        expected = pq.ParquetFile(pa.BufferReader(data)).read_row_groups(picked)
        for g, (lo, hi, rows) in zip(picked, pieces, strict=True):
            mini = mini_file(template, memoryview(data)[lo:hi], rows)
            if mini is None:
                fallbacks += 1
                continue
            got = pq.ParquetFile(pa.BufferReader(mini)).read_row_group(0)
            if not got.equals(expected.slice(sum(p[2] for p in pieces[: picked.index(g)]), rows)):
                raise SystemExit(f"shard {path}: row group {g} decodes differently")
            checked += 1
    footer_s: list[float] = []
    synth_s: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _, data, picked, _ in work:  # the footer parsed, then the groups: today's read
            real = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False)
            real.read_row_groups(picked, use_threads=False)
        footer_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _, data, _, pieces in work:
            parts = []
            for lo, hi, rows in pieces:
                mini = mini_file(template, memoryview(data)[lo:hi], rows)
                assert mini is not None
                small = pq.ParquetFile(pa.BufferReader(mini), pre_buffer=False)
                parts.append(small.read_row_group(0, use_threads=False))
            pa.concat_tables(parts)
        synth_s.append(time.perf_counter() - t0)
    groups_read = sum(len(w[2]) for w in work)
    print(
        f"  first batch of {BATCH} rows: {len(work)} shards, {groups_read} row groups; "
        f"{checked} decoded through a synthesized footer to exactly the real footer's "
        f"decode, {fallbacks} could not be"
    )
    print(
        f"  with footers:    {with_bytes / total:.1%} of the store ({with_bytes / 2**20:.2f} of "
        f"{total / 2**20:.1f} MiB), {with_requests} ranged reads"
    )
    print(
        f"  without footers: {without_bytes / total:.1%} of the store "
        f"({without_bytes / 2**20:.2f} MiB, one footer), {without_requests} ranged reads"
    )
    print(
        f"  decoding the batch's groups, median of {repeats} (in memory, one thread): "
        f"each footer parsed {statistics.median(footer_s) * 1e3:.1f} ms, footers "
        f"synthesized {statistics.median(synth_s) * 1e3:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--row-groups", default="128,256")
    parser.add_argument("--dir", default="/tmp/dynstate-bench-footerless")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    table = rows_table(args.rows)
    for size in (int(s) for s in args.row_groups.split(",")):
        path = Path(args.dir) / f"store-{size}"
        if path.exists():
            store = Store.open(str(path))
        else:
            rowgroups.ROW_GROUP_ROWS = size
            store = build(str(path), table, args.shards)
        print(f"row groups of {size} rows ({args.rows:,} rows, {args.shards} shards):")
        measure(store, path, args.rows, args.repeats)


if __name__ == "__main__":
    main()
