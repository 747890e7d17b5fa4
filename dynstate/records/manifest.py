"""Metadata records of a store and their JSON form. Pure: no I/O.

A store's metadata is a commit log (one record per version), periodic checkpoints that
materialize a version's shard list, and content-addressed chunks that hold runs of shard
entries shared between checkpoints. ``docs/format.md`` is the prose form of this module; the
names of the files are :mod:`dynstate.paths`', the checksummed JSON every file shares is
:mod:`dynstate.records.codec`'s.

One file, under 500 lines, because its types (row groups, shard entries, shard lists,
commit records, schemas) are one format, checked field by field as docs/format.md reads.
"""

from __future__ import annotations

import base64
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import paths
from ..errors import (
    ChecksumMismatchError,
    CorruptStoreError,
    UnsafePathError,
    UnsupportedFormatError,
)
from . import codec

if TYPE_CHECKING:
    # Only schema files need pyarrow at run time (schema_from_json imports it): listing and
    # inspecting commands read JSON records alone and should not pay its ~0.2-0.4 s import.
    import pyarrow as pa

FORMAT = 1
# Records and stores that hold outcomes or a generator state are written with format 2, so
# that a dynstate which knows no outcomes refuses them instead of misreading the store; this
# dynstate reads both (dynstate/log/outcomes.py).
OUTCOMES_FORMAT = 2
# A checkpoint every K versions bounds the log records read to open any version to K - 1.
CHECKPOINT_INTERVAL = 100
# Entries per chunk: shard lists are stored as runs of this many entries so that consecutive
# checkpoints of a growing lineage share (not copy) everything but their tail.
CHUNK_ENTRIES = 256

OPS = ("create", "append", "reset", "compact")

# File names are made and matched in dynstate.paths; these are re-exported for the callers
# that read them as ``manifest.log_path`` and so on.
META_DIR = paths.META_DIR
DATA_DIR = paths.DATA_DIR
STORE_FILE = paths.STORE_FILE
HEAD_HINT = paths.HEAD_HINT
GC_FILE = paths.GC_FILE
log_path = paths.log_path
checkpoint_path = paths.checkpoint_path
chunk_path = paths.chunk_path
schema_path = paths.schema_path
tag_path = paths.tag_path
# The encoding of every store file lives in dynstate.records.codec, re-exported for the same
# callers.
READ_FORMAT = codec.READ_FORMAT
MAX_COUNT = codec.MAX_COUNT
MAX_JSON_DEPTH = codec.MAX_JSON_DEPTH
MAX_INT_DIGITS = codec.MAX_INT_DIGITS
utc_now = codec.utc_now
sha256 = codec.sha256
_canonical = codec.canonical
encode = codec.encode
decode = codec.decode
load_json = codec.load_json


class RowGroups(NamedTuple):
    """Where a shard's row groups lie and what they hash to, so that a reader can fetch and
    verify only the ones it needs (docs/format.md, "Row groups"). The file is cut into
    consecutive byte segments: one per row group (the first also holds the leading magic),
    then the footer; ``bytes`` and ``sha256`` have one entry per segment, ``rows`` one per
    row group. ``template``: the digest of the footer template its row groups decode with
    (:mod:`dynstate.records.footers`), or None (written before templates, or a schema without one):
    then a reader needs the footer."""

    rows: tuple[int, ...]
    bytes: tuple[int, ...]
    sha256: str  # the segments' SHA-256s in hex, concatenated: one string parses fast
    template: str | None = None

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "rows": list(self.rows),
            "bytes": list(self.bytes),
            "sha256": self.sha256,
        }
        if self.template is not None:
            obj["template"] = self.template
        return obj

    def digest(self, segment: int) -> str:
        return self.sha256[64 * segment : 64 * segment + 64]

    @classmethod
    def checked(cls, obj: Any, rows: int, nbytes: int, where: str) -> RowGroups:
        """RowGroups from an untrusted entry of a shard of ``rows`` rows and ``nbytes`` bytes
        (both already checked to lie in [0, MAX_COUNT]): the segments must add up to the
        shard, or a reader would verify the wrong bytes."""
        try:
            counts, sizes, digests = obj["rows"], obj["bytes"], obj["sha256"]
            template = obj.get("template")
        except (KeyError, TypeError, AttributeError):
            raise CorruptStoreError(f"{where} has a malformed row group entry {obj!r}") from None
        if not (
            isinstance(counts, list)
            and isinstance(sizes, list)
            and isinstance(digests, str)
            and len(sizes) == len(counts) + 1
            and len(digests) == 64 * len(sizes)
            and _counts(counts, rows)
            and _counts(sizes, nbytes)
            and paths.is_hex(digests)
            and (template is None or paths.is_digest(template))
        ):
            raise CorruptStoreError(
                f"{where} has a malformed row group entry for a shard of {rows} rows and "
                f"{nbytes} bytes; the record is damaged — reset to a version without it"
            )
        return cls(tuple(counts), tuple(sizes), digests, template)


_INT = {int}


def _counts(values: list[Any], total: int) -> bool:
    """Whether every value is an int (not a bool), none negative, and they add up to
    ``total`` (itself at most MAX_COUNT, so no value exceeds it). A cold open checks the
    entries of every shard of the version, ~80 numbers each: built-ins, not a Python loop."""
    if not values:
        return total == 0
    return set(map(type, values)) == _INT and min(values) >= 0 and sum(values) == total


class ShardRef(NamedTuple):
    """One immutable Parquet file of a version: its path relative to the store root.
    (A named tuple: versions of 10k shards are opened by building 10k of these.)
    ``groups`` is None for shards written before row groups were recorded: those are read
    and verified whole."""

    path: str
    rows: int
    bytes: int
    sha256: str
    groups: RowGroups | None = None

    def to_json(self) -> dict[str, Any]:
        obj = {"path": self.path, "rows": self.rows, "bytes": self.bytes, "sha256": self.sha256}
        if self.groups is not None:
            obj["groups"] = self.groups.to_json()
        return obj

    @classmethod
    def from_json(cls, obj: Any, where: str) -> ShardRef:
        try:
            return cls.checked(
                obj["path"], obj["rows"], obj["bytes"], obj["sha256"], where, obj.get("groups")
            )
        except (KeyError, TypeError) as exc:
            raise CorruptStoreError(f"{where} has a malformed shard entry {obj!r}") from exc

    @classmethod
    def checked(
        cls, path: Any, rows: Any, nbytes: Any, digest: Any, where: str, groups: Any = None
    ) -> ShardRef:
        """A ShardRef from untrusted values, refusing paths outside ``data/``."""
        if not paths.is_shard_reference(path):
            raise UnsafePathError(
                f"{where} names shard {path!r}, which is outside the store's data/ folder; "
                "the record was tampered with — do not read this version, reset past it"
            )
        if not (
            type(rows) is int
            and type(nbytes) is int
            and 0 <= rows <= MAX_COUNT
            and 0 <= nbytes <= MAX_COUNT
        ):
            raise CorruptStoreError(f"{where} has a malformed shard entry for {path}")
        if not paths.is_digest(digest):
            raise CorruptStoreError(f"{where} has a malformed checksum for {path}")
        if groups is None:
            return cls(path, rows, nbytes, digest)
        return cls(path, rows, nbytes, digest, RowGroups.checked(groups, rows, nbytes, where))


@dataclass(frozen=True)
class ShardList:
    """A full, ordered shard list stored as chunk references plus an inline tail."""

    chunks: tuple[str, ...]
    tail: tuple[ShardRef, ...]

    def to_json(self) -> dict[str, Any]:
        return {"chunks": list(self.chunks), "tail": [s.to_json() for s in self.tail]}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> ShardList:
        if not isinstance(obj, dict) or not isinstance(obj.get("chunks"), list):
            raise CorruptStoreError(f"{where} has a malformed shard list")
        for digest in obj["chunks"]:
            if not paths.is_digest(digest):
                raise UnsafePathError(f"{where} names chunk {digest!r}, which is not a chunk id")
        tail = obj.get("tail", [])
        if not isinstance(tail, list):
            raise _wrong(where, "shard list tail", tail, "a list of shard entries")
        return cls(tuple(obj["chunks"]), tuple(ShardRef.from_json(s, where) for s in tail))


# The columns every chunk has; "groups" is added only to chunks with row group entries.
_CHUNK_FIELDS = ("path", "rows", "bytes", "sha256")


def split_chunks(shards: list[ShardRef]) -> tuple[list[tuple[str, bytes]], ShardList]:
    """Cut ``shards`` into content-addressed chunks; returns (chunk files, shard list).
    Chunks are columnar (one list per field): 10k entries parse several times faster than
    10k objects."""
    full = len(shards) - len(shards) % CHUNK_ENTRIES
    files: list[tuple[str, bytes]] = []
    for start in range(0, full, CHUNK_ENTRIES):
        run = shards[start : start + CHUNK_ENTRIES]
        columns: dict[str, list[Any]] = {
            name: [getattr(s, name) for s in run] for name in _CHUNK_FIELDS
        }
        if any(s.groups is not None for s in run):  # absent otherwise: old chunks stay valid
            columns["groups"] = [None if s.groups is None else s.groups.to_json() for s in run]
        data = _canonical({"format": FORMAT, **columns})
        files.append((sha256(data), data))
    return files, ShardList(tuple(d for d, _ in files), tuple(shards[full:]))


# Chunks decoded in this process, by content address (most recent last). Bytes whose SHA-256
# is the digest always decode to the same entries, so a chunk read again — by the next
# ``Store.open``, a loader worker's refresh, a later version sharing it — is still read and
# hashed (it must exist and be intact) but not parsed and checked entry by entry again.
# Bounded: 256 chunks hold 65,536 shard entries.
_DECODED: OrderedDict[str, tuple[ShardRef, ...]] = OrderedDict()
_DECODED_MAX = 256
_DECODED_LOCK = threading.Lock()


def decode_chunk(digest: str, data: bytes, where: str) -> list[ShardRef]:
    if sha256(data) != digest:
        raise ChecksumMismatchError(
            f"{where} does not match its content address; the chunk was modified — "
            "restore it or reset the store past the versions that use it"
        )
    with _DECODED_LOCK:
        known = _DECODED.get(digest)
        if known is not None:
            _DECODED.move_to_end(digest)
            return list(known)
    entries = _decode_chunk(data, where)
    with _DECODED_LOCK:
        _DECODED[digest] = tuple(entries)
        while len(_DECODED) > _DECODED_MAX:
            _DECODED.popitem(last=False)
    return entries


def _decode_chunk(data: bytes, where: str) -> list[ShardRef]:
    obj = load_json(data, where)
    if not isinstance(obj, dict) or type(obj.get("format", 0)) is not int:
        raise CorruptStoreError(f"{where} is not a chunk of shard entries")
    if obj.get("format", 0) > FORMAT:
        raise UnsupportedFormatError(f"{where} uses format {obj['format']}; upgrade dynstate")
    try:
        columns = [obj[name] for name in _CHUNK_FIELDS]
        columns.append(obj.get("groups") or [None] * len(columns[0]))
        if len({len(c) for c in columns}) != 1:
            raise CorruptStoreError(f"{where} has columns of different lengths")
        return [
            ShardRef.checked(p, r, b, d, where, g) for p, r, b, d, g in zip(*columns, strict=True)
        ]
    except (KeyError, TypeError) as exc:
        raise CorruptStoreError(f"{where} is not a chunk of shard entries") from exc


# Commit records decoded in this process, by their exact bytes: the same bytes always decode
# to the same record, so opening a store again (a loader worker, a refresh, the next command
# of a long-lived process) still reads each record it needs but parses, checksums and checks
# it once. Keyed by content, not name, so a name that holds other bytes now is decoded anew.
_RECORDS: OrderedDict[bytes, Commit] = OrderedDict()
_RECORDS_MAX = 4096


def decode_record(raw: bytes, where: str) -> Commit:
    """The commit record in ``raw`` (a log file's bytes), verified (:func:`decode`) and
    checked field by field (:meth:`Commit.from_json`)."""
    key = raw if type(raw) is bytes else bytes(raw)
    with _DECODED_LOCK:
        known = _RECORDS.get(key)
        if known is not None:
            _RECORDS.move_to_end(key)
            return known
    record = Commit.from_json(decode(key, where), where)
    with _DECODED_LOCK:
        _RECORDS[key] = record
        while len(_RECORDS) > _RECORDS_MAX:
            _RECORDS.popitem(last=False)
    return record


@dataclass(frozen=True)
class Commit:
    """The record of one version. Appends list only the shards they add; ``reset`` and
    ``compact`` carry the complete new shard list in ``base``."""

    store_id: str
    version: int
    parent: int | None
    op: str
    created: str
    schema: str | None
    num_rows: int
    num_shards: int
    num_bytes: int
    add: tuple[ShardRef, ...] = ()
    base: ShardList | None = None
    target: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # The round's outcomes (an append) or the lineage's (a reset, a compaction), and the
    # generator state: plain JSON, interpreted by dynstate.log.outcomes. Either makes the
    # record format 2.
    outcomes: dict[str, Any] | None = None
    generator_state: Any = None
    # What the round's step consumed (an append only; dynstate.records.consumption): format
    # 2 like outcomes, whose stores it needs anyway (a consuming loop records outcomes).
    consumption: dict[str, Any] | None = None

    @property
    def rows_added(self) -> int:
        return sum(s.rows for s in self.add)

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "format": FORMAT,
            "store_id": self.store_id,
            "version": self.version,
            "parent": self.parent,
            "op": self.op,
            "created": self.created,
            "schema": self.schema,
            "num_rows": self.num_rows,
            "num_shards": self.num_shards,
            "num_bytes": self.num_bytes,
            "add": [s.to_json() for s in self.add],
            "meta": self.meta,
        }
        if self.base is not None:
            obj["base"] = self.base.to_json()
        if self.target is not None:
            obj["target"] = self.target
        if self.outcomes is not None:
            obj["outcomes"] = self.outcomes
        if self.generator_state is not None:
            obj["generator_state"] = self.generator_state
        if self.consumption is not None:
            obj["consumption"] = self.consumption
        if (
            self.outcomes is not None
            or self.generator_state is not None
            or self.consumption is not None
        ):
            obj["format"] = OUTCOMES_FORMAT
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str) -> Commit:
        try:
            op = obj["op"]
            if op not in OPS:
                raise CorruptStoreError(f"{where} has unknown op {op!r}")
            base = obj.get("base")
            meta = obj.get("meta")
            if meta is not None and not isinstance(meta, dict):
                raise _wrong(where, "meta", meta, "an object")
            if not isinstance(obj["add"], list):
                raise _wrong(where, "add", obj["add"], "a list of shard entries")
            schema = obj["schema"]
            if schema is not None and not isinstance(schema, str):
                raise _wrong(where, "schema", schema, "a schema fingerprint")
            parent, target = obj["parent"], obj.get("target")
            return cls(
                store_id=_text(obj, "store_id", where),
                version=_count(obj, "version", where),
                parent=None if parent is None else _count(obj, "parent", where),
                op=op,
                created=_timestamp(obj, "created", where),
                schema=schema,
                num_rows=_count(obj, "num_rows", where),
                num_shards=_count(obj, "num_shards", where),
                num_bytes=_count(obj, "num_bytes", where),
                add=tuple(ShardRef.from_json(s, where) for s in obj["add"]),
                base=None if base is None else ShardList.from_json(base, where),
                target=None if target is None else _count(obj, "target", where),
                meta=dict(meta or {}),
                outcomes=_outcomes_field(obj, where),
                generator_state=obj.get("generator_state"),
                consumption=_object_field(obj, "consumption", where),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptStoreError(
                f"{where} is missing field {exc}; the record is damaged — run `dynstate verify` "
                "and restore it from a backup or reset to an earlier version"
            ) from exc


def _outcomes_field(obj: dict[str, Any], where: str) -> dict[str, Any] | None:
    value = obj.get("outcomes")
    if value is not None and not isinstance(value, dict):
        raise _wrong(where, "outcomes", value, "an object")
    return value


def _object_field(obj: dict[str, Any], name: str, where: str) -> dict[str, Any] | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, dict):
        raise _wrong(where, name, value, "an object")
    return value


def _wrong(where: str, name: str, value: Any, expected: str) -> CorruptStoreError:
    shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
    return CorruptStoreError(
        f"{where} has {name} {shown}, not {expected}; the record is damaged — run "
        "`dynstate verify` and restore it from a backup or reset to an earlier version"
    )


def _count(obj: dict[str, Any], name: str, where: str) -> int:
    value = obj[name]
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise _wrong(where, name, value, "a count from 0 to 2**63 - 1")
    return value


def _text(obj: dict[str, Any], name: str, where: str) -> str:
    value = obj[name]
    if not isinstance(value, str) or not value:
        raise _wrong(where, name, value, "a non-empty string")
    return value


def _timestamp(obj: dict[str, Any], name: str, where: str) -> str:
    value = obj[name]
    try:
        # every reader that judges an age parses it the same way
        parsed = isinstance(value, str) and datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        parsed = False
    if not parsed or parsed.tzinfo is None:
        raise _wrong(where, name, value, "an ISO 8601 UTC time (2026-11-30T00:23:28.123Z)")
    return value


def store_identity(data: bytes, where: str) -> str:
    """The store id ``store.json`` holds, or CorruptStoreError naming it."""
    obj = decode(data, where)
    if "store_id" not in obj:
        raise CorruptStoreError(f"{where} names no store_id; the file is damaged")
    return _text(obj, "store_id", where)


# -- schemas -------------------------------------------------------------------------------


def normalize_schema(schema: pa.Schema) -> pa.Schema:
    # pandas and datasets attach their own metadata; it must not change the fingerprint.
    return schema.remove_metadata()


def schema_fingerprint(schema: pa.Schema) -> str:
    return sha256(normalize_schema(schema).serialize().to_pybytes())


def schema_to_json(schema: pa.Schema) -> dict[str, Any]:
    schema = normalize_schema(schema)
    return {
        "format": FORMAT,
        "fingerprint": schema_fingerprint(schema),
        "fields": [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in schema],
        "arrow": base64.b64encode(schema.serialize().to_pybytes()).decode(),
    }


def schema_from_json(obj: dict[str, Any], where: str) -> pa.Schema:
    import pyarrow as pa

    try:
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(obj["arrow"])))
    except (KeyError, TypeError, ValueError, pa.ArrowException) as exc:
        raise CorruptStoreError(f"{where} does not hold a readable Arrow schema") from exc
    if schema_fingerprint(schema) != obj.get("fingerprint"):
        raise ChecksumMismatchError(f"{where} does not match its fingerprint; it was modified")
    return schema


def describe_schema_diff(
    expected: pa.Schema,
    got: pa.Schema,
    same: Callable[[pa.DataType, pa.DataType], bool] | None = None,
) -> str:
    """Human description of how ``got`` differs from ``expected``, naming columns. ``same``:
    which types count as one (a round's check lets a list's item name differ; default: equal
    as text)."""
    exp = {f.name: f.type for f in expected}
    new = {f.name: f.type for f in got}
    parts = []
    missing = [n for n in exp if n not in new]
    extra = [n for n in new if n not in exp]
    alike = same if same is not None else (lambda a, b: str(a) == str(b))
    changed = [f"{n} ({exp[n]} -> {new[n]})" for n in exp if n in new and not alike(new[n], exp[n])]
    if missing:
        parts.append("missing columns: " + ", ".join(missing))
    if extra:
        parts.append("unexpected columns: " + ", ".join(extra))
    if changed:
        parts.append("changed types: " + ", ".join(changed))
    if not parts and list(exp) != list(new):
        parts.append(f"column order differs ({', '.join(exp)} vs {', '.join(new)})")
    return "; ".join(parts) or "column nullability or metadata differs"


def cache_id(shard: ShardRef) -> tuple[str, str]:
    """What a decoded shard or row group is cached under: the file's checksum and, for a
    shard read a row group at a time, the checksums of its segments. A row-group read
    verifies the segments, never the whole file, so a record naming another shard's
    checksum (tampered) must not find that shard's rows in the cache: the segment
    checksums, which every byte was checked against, tell them apart."""
    return (shard.sha256, shard.groups.sha256 if shard.groups is not None else "")
