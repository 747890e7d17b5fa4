"""Row groups decoded without their shard's footer (docs/format.md, "Footer templates").

A Parquet footer holds, besides what is the same for every file of one schema written by one
writer (the Parquet and Arrow schemas, ``created_by``: the *template*), one entry per row group
and column chunk: where the chunk lies, its sizes and value count and encodings. All of that
can be read from the chunk's own page headers. So a reader that holds a template can decode
a row group from that group's bytes alone: :func:`mini_file` builds the footer of a
one-group file from the template and the group's page headers, and pyarrow decodes that.
On an object store this saves fetching every shard's footer (~63 bytes of Thrift per column
chunk, as much as a random batch's row groups at 128 rows a group): one footer per template
per process is fetched, verified and kept.

A shard's record names its template by :func:`template_digest` (``groups.template``), which
the writer computes from the footer of an *empty* file with the shard's schema and writer
options. Its prefix and suffix are byte for byte those of the shard's own footer. A reader
uses a template only for shards whose record names its digest, so it never decodes a shard
with another schema, codec or writer's conventions.

Only the Thrift compact protocol needed for that is here: reading a footer and page headers,
and writing one footer.
"""

from __future__ import annotations

import hashlib
import io
import struct
import threading
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

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


# Parquet's CompressionCodec numbers, by the names pyarrow's writers take
CODECS = {"none": 0, "snappy": 1, "gzip": 2, "brotli": 4, "zstd": 6, "lz4": 7}


def _halves(meta: Fields) -> tuple[bytes, bytes]:
    """A footer's fields before its row groups (version, schema) and after them (key-value
    metadata, created_by, column orders), encoded as in the footer."""
    if [f[0] for f in meta][:4] != [1, 2, 3, 4]:
        raise ValueError("not a Parquet footer")
    before = write_fields([f for f in meta if f[0] in (1, 2)], 0)
    after = write_fields([f for f in meta if f[0] > 4], 4) + b"\x00"
    return before, after


class Template:
    """The footer template of the shards written with one Arrow schema and codec by this
    pyarrow: the fields of a footer around its row groups — those of the footer of an empty
    file written with the same options, byte for byte the shard footer's — and, per leaf
    column, the fields of its column chunks that do not depend on the data (type, path,
    codec). :attr:`digest` names it in the records of the shards it decodes."""

    __slots__ = ("columns", "digest", "list_head", "prefix", "suffix")

    def __init__(self, schema: pa.Schema, compression: str):
        codec = CODECS[compression]
        out = io.BytesIO()
        pq.ParquetWriter(out, schema, compression=compression, write_statistics=False).close()
        data = out.getvalue()
        (size,) = struct.unpack("<I", data[-8:-4])
        meta, _ = read_struct(data[-8 - size : -8], 0)
        self.prefix, self.suffix = _halves(meta)
        elements = field(meta, 2)[1]
        leaves = _leaves(elements)
        if any(repeated for _, _, repeated in leaves):
            raise ValueError("a repeated column: data pages v1 count its values, not rows")
        self.digest = hashlib.sha256(
            b"dynstate footer template 1\n%d\n%b%b" % (codec, self.prefix, self.suffix)
        ).hexdigest()
        self.columns = [
            (
                write_fields([(1, I32, ptype)], 0),
                write_fields([(3, LIST, (BINARY, path)), (4, I32, codec)], 2),
            )
            for ptype, path, _ in leaves
        ]
        n = len(leaves)
        head = bytearray([(n << 4) | STRUCT] if n < 15 else [0xF0 | STRUCT])
        if n >= 15:
            _put_varint(head, n)
        self.list_head = bytes(head)


_TEMPLATES: dict[tuple[bytes, str], Template | None] = {}
_TEMPLATES_MAX = 256
_LOCK = threading.Lock()


def template_for(schema: pa.Schema, compression: str) -> Template | None:
    """The template of shards of ``schema`` and ``compression`` written by this pyarrow, or
    None when there is none (a repeated column, a codec not known here). Kept per schema
    and process: a commit asks once per shard."""
    key = (schema.serialize().to_pybytes(), compression)
    with _LOCK:
        if key in _TEMPLATES:
            return _TEMPLATES[key]
    try:
        template: Template | None = Template(schema, compression)
    except (ValueError, KeyError, IndexError, TypeError, pa.ArrowException):
        template = None
    with _LOCK:
        if len(_TEMPLATES) >= _TEMPLATES_MAX:
            _TEMPLATES.clear()
        _TEMPLATES[key] = template
    return template


# pyarrow's names of the codecs in a footer -> the names its writers take (CODECS' keys)
_CODEC_NAMES = {"LZ4": "lz4", "SNAPPY": "snappy", "ZSTD": "zstd", "GZIP": "gzip"}


def implied_template(meta: pq.FileMetaData) -> Template | None:
    """The template the shard of footer ``meta`` was written with, as this pyarrow would
    write it (its digest is compared to the record's before use), or None."""
    if meta.num_row_groups == 0:
        return None
    compression = _CODEC_NAMES.get(meta.row_group(0).column(0).compression)
    if compression is None:
        return None
    return template_for(meta.schema.to_arrow_schema(), compression)


def shard_template(schema: pa.Schema, compression: str) -> str | None:
    """The digest a shard's record names (``groups.template``), or None."""
    template = template_for(schema, compression)
    return None if template is None else template.digest


def _leaves(schema: list[Fields]) -> list[tuple[int, list[bytes], bool]]:
    """(physical type, path, whether it repeats) of each leaf column, in order."""
    out: list[tuple[int, list[bytes], bool]] = []

    def walk(i: int, path: list[bytes], repeated: bool) -> int:
        element = schema[i]
        path = [*path, field(element, 4)]
        repeated = repeated or field(element, 3) == 2  # repetition_type REPEATED
        children = field(element, 5, 0)
        if not children:
            out.append((field(element, 1), path, repeated))
            return i + 1
        j = i + 1
        for _ in range(children):
            j = walk(j, path, repeated)
        return j

    j = 1
    for _ in range(field(schema[0], 5, 0)):
        j = walk(j, [], False)
    return out


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def mini_file(template: Template, group: Any, rows: int) -> bytes | None:
    try:
        return _mini_file(template, group, rows)
    except (IndexError, ValueError, TypeError):  # page headers that are not Thrift
        return None


def _mini_file(template: Template, group: Any, rows: int) -> bytes | None:
    """A Parquet file holding ``group`` (one row group's verified bytes, without the leading
    magic) and a footer describing it, or None when its pages do not fill it exactly as
    the template's columns, ``rows`` rows each (a record that does not match its file)."""
    at = 4  # the group follows the leading magic
    foot = bytearray(template.prefix)
    foot += b"\x16"  # num_rows
    _put_int(foot, rows)
    foot += b"\x19\x1c\x19"  # row_groups: a list of one struct; its columns: a list
    foot += template.list_head
    i, n, total = 0, len(group), 0
    for type_field, path_codec in template.columns:
        start, seen, values, uncompressed = i, 0, 0, 0
        encodings: set[int] = set()
        dictionary = data = None
        while seen < rows:
            if i >= n:
                return None
            ptype, usize, csize, nvalues, nrows, encs, end = page_header(group, i)
            if not (_count(usize) and _count(csize) and _count(nvalues)):
                return None
            if nrows is not None and not _count(nrows):
                return None
            uncompressed += end - i + usize
            if ptype == DICTIONARY_PAGE:
                dictionary = i
            elif ptype in (DATA_PAGE, DATA_PAGE_V2):
                data = i if data is None else data
                seen += nvalues if nrows is None else nrows
                values += nvalues
            else:
                return None
            encodings.update(e for e in encs if e is not None)
            i = end + csize
        if seen != rows or data is None or len(encodings) >= 15:
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
