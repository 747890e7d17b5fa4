"""Reading part of a shard: its footer and the row groups a batch needs, fetched as byte
ranges (ranged GETs on object stores, all of a batch's at once), each verified against the
checksum its commit recorded before a byte of it is decoded (docs/format.md, "Row groups")."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import manifest as m
from ..errors import ChecksumMismatchError, CorruptStoreError
from ..rowgroups import layout_matches, read_footer
from ..store import Store

# Parsed footers kept per process; each is a few KB to a few tens of KB.
_FOOTERS = 4096


def segment_bounds(groups: m.RowGroups) -> list[int]:
    """The byte offsets where each segment (row groups, then the footer) starts, and the
    file's end."""
    return [0, *accumulate(groups.bytes)]


def group_starts(groups: m.RowGroups) -> np.ndarray:
    """The first row of each row group within its shard, and the shard's row count."""
    return np.asarray([0, *accumulate(groups.rows)], dtype=np.int64)


class Footers:
    """Parsed, verified footers by the row-group entry they match (:func:`footer_key`),
    least recently used first out."""

    def __init__(self, limit: int = _FOOTERS):
        self._items: OrderedDict[m.RowGroups, pq.FileMetaData] = OrderedDict()
        self._lock = threading.Lock()
        self._limit = limit

    def get(self, digest: m.RowGroups) -> pq.FileMetaData | None:
        with self._lock:
            meta = self._items.get(digest)
            if meta is not None:
                self._items.move_to_end(digest)
            return meta

    def put(self, digest: m.RowGroups, meta: pq.FileMetaData) -> None:
        with self._lock:
            self._items[digest] = meta
            while len(self._items) > self._limit:
                self._items.popitem(last=False)


def footer_key(groups: m.RowGroups) -> m.RowGroups:
    """A parsed footer is cached under the whole row-group entry it was checked against:
    its checksum says which footer it is, and its cuts are what the footer's layout was
    found to match (a tampered record with the same footer but other cuts misses)."""
    return groups


def _where(store: Store, version: int | None) -> str:
    return f"{store.display_url}" + (f" (version {version})" if version is not None else "")


def read_groups(
    store: Store,
    wanted: Sequence[tuple[m.ShardRef, Sequence[int]]],
    version: int | None,
    footers: Footers,
) -> list[list[pa.Table]]:
    """The row groups ``wanted`` (shard, sorted group numbers) as tables, in that order.
    One storage call fetches every range the batch lacks; adjacent segments travel as one
    range and are verified one by one. Raises ChecksumMismatchError naming the shard and
    segment when bytes differ from their record."""
    where = _where(store, version)
    ranges: list[tuple[str, int, int]] = []
    # Per range: (index into wanted, first segment, last segment + 1)
    spans: list[tuple[int, int, int]] = []
    for k, (shard, groups) in enumerate(wanted):
        assert shard.groups is not None  # callers pick whole-shard reads for the others
        bounds = segment_bounds(shard.groups)
        segments = list(groups)
        if footers.get(footer_key(shard.groups)) is None:
            segments.append(len(shard.groups.rows))  # the footer: the last segment
        if not segments:
            continue
        first = prev = segments[0]
        for seg in [*segments[1:], None]:
            if seg is not None and seg == prev + 1:
                prev = seg
                continue
            ranges.append((shard.path, bounds[first], bounds[prev + 1]))
            spans.append((k, first, prev + 1))
            if seg is not None:
                first = prev = seg
    got: dict[tuple[int, int], memoryview] = {}

    def check(data: list[bytes]) -> None:
        got.clear()
        for (k, lo, hi), blob in zip(spans, data, strict=True):
            shard = wanted[k][0]
            groups = shard.groups
            assert groups is not None
            bounds = segment_bounds(groups)
            view = memoryview(blob)
            if len(view) != bounds[hi] - bounds[lo]:
                raise ChecksumMismatchError(
                    f"shard {shard.path} of {where} is truncated: {len(view)} bytes where "
                    f"{bounds[hi] - bounds[lo]} were asked for; restore it or reset to a "
                    "version without it"
                )
            for seg in range(lo, hi):
                piece = view[bounds[seg] - bounds[lo] : bounds[seg + 1] - bounds[lo]]
                if hashlib.sha256(piece).hexdigest() != groups.digest(seg):
                    what = "footer" if seg == len(groups.rows) else f"row group {seg}"
                    raise ChecksumMismatchError(
                        f"shard {shard.path} of {where} does not match its checksum ({what}); "
                        "restore it or reset to a version without it"
                    )
                got[(k, seg)] = piece

    try:
        store.storage.read_ranges(ranges, check=check)
    except FileNotFoundError:
        for shard, _ in wanted:
            if not store.storage.exists(shard.path):
                # The one home of the "missing" and "collected" errors raises them.
                store.read_shard_bytes(shard, version=version)
        raise
    out = []
    for k, (shard, groups) in enumerate(wanted):
        out.append(_decode(shard, groups, got, k, footers, where))
    return out


def _decode(
    shard: m.ShardRef,
    groups: Sequence[int],
    got: dict[tuple[int, int], memoryview],
    k: int,
    footers: Footers,
    where: str,
) -> list[pa.Table]:
    info = shard.groups
    assert info is not None
    meta = footers.get(footer_key(info))
    try:
        if meta is None:
            meta = read_footer(got[(k, len(info.rows))])
            ends = segment_bounds(info)[1:]
            if meta.num_rows != shard.rows or not layout_matches(meta, ends, list(info.rows)):
                raise CorruptStoreError(
                    f"shard {shard.path} of {where} holds {meta.num_rows} rows in "
                    f"{meta.num_row_groups} row groups but its commit record says {shard.rows} "
                    f"in {len(info.rows)} (or its row groups lie elsewhere); the record is wrong "
                    "— reset to a version without it"
                )
            footers.put(footer_key(info), meta)
        # A buffer the size of the file holding only the verified row groups, at their
        # offsets: the reader, given the verified footer, reads only their column chunks,
        # which the writer checked lie inside them.
        bounds = segment_bounds(info)
        buffer = pa.allocate_buffer(shard.bytes)
        target = np.frombuffer(buffer, dtype=np.uint8)
        for g in groups:
            target[bounds[g] : bounds[g + 1]] = np.frombuffer(got[(k, g)], dtype=np.uint8)
        table = pq.ParquetFile(pa.BufferReader(buffer), metadata=meta).read_row_groups(
            list(groups), use_threads=False
        )
    except (pa.ArrowException, OSError) as exc:
        raise CorruptStoreError(
            f"shard {shard.path} of {where} is not a readable Parquet file ({exc}); restore it "
            "or reset to a version without it"
        ) from None
    out, start = [], 0
    for g in groups:
        n = info.rows[g]
        out.append(table.slice(start, n))
        start += n
    return out
