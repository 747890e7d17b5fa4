"""Reading part of a shard: its footer and the row groups a batch needs, fetched as byte
ranges (ranged GETs on object stores, all of a batch's at once), each verified against the
checksum its commit recorded before a byte of it is decoded (docs/format.md, "Row groups")."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ChecksumMismatchError, CorruptStoreError
from ..records import manifest as m
from ..records.footers import Template, implied_template, mini_file
from ..records.rowgroups import layout_matches
from ..store import Store
from ..threads import ProcessPool

# Parsed footers kept per process; each is a few KB to a few tens of KB.
_FOOTERS = 4096
# Threads that decode the shards of one read, and the fewest shards worth handing to them
# (a hand-off costs ~50 µs, a shard's decode ~0.3-0.5 ms). Only on machines with more than
# two cores: on the 2-core VM the benchmarks run on, with other jobs holding the cores, a
# cold 256-row batch over ~95 shards measured 1.01-1.13x *slower* on two threads than on one
# (the decode is ~60 % of it; the rest holds the GIL), at ~10 % more CPU.
_DECODERS = min(4, os.cpu_count() or 1)
_PARALLEL_SHARDS = 4 if _DECODERS > 2 else 1 << 62


def segment_bounds(groups: m.RowGroups) -> list[int]:
    """The byte offsets where each segment (row groups, then the footer) starts, and the
    file's end."""
    return [0, *accumulate(groups.bytes)]


def group_starts(groups: m.RowGroups) -> np.ndarray:
    """The first row of each row group within its shard, and the shard's row count."""
    return np.asarray([0, *accumulate(groups.rows)], dtype=np.int64)


class Footer:
    """A parsed footer that matched its shard's record, and how much of its layout has been
    checked against the record so far (:func:`~dynstate.records.rowgroups.layout_matches`): the
    counts of the first ``counted`` row groups and the byte ranges of the groups in
    ``placed``. A read checks only what it relies on, once per footer and process."""

    __slots__ = ("counted", "meta", "placed")

    def __init__(self, meta: pq.FileMetaData):
        self.meta = meta
        self.counted = 0
        self.placed: set[int] = set()


class Footers:
    """Parsed, verified footers by the row-group entry they match (:func:`footer_key`),
    least recently used first out; and the footer templates (:mod:`dynstate.records.footers`) those
    footers proved, by digest, with which the row groups of other shards naming the same
    digest are decoded without their footers."""

    def __init__(self, limit: int = _FOOTERS):
        self._items: OrderedDict[m.RowGroups, Footer] = OrderedDict()
        self._templates: dict[str, Template] = {}
        # Digests a verified footer naming them did not imply (written by another pyarrow,
        # say): their shards are read with their footers from then on, not first made to
        # wait for a footer that teaches nothing and then read again.
        self._refused: set[str] = set()
        self._lock = threading.Lock()
        self._limit = limit

    def template(self, groups: m.RowGroups) -> Template | None:
        if groups.template is None:
            return None
        with self._lock:
            return self._templates.get(groups.template)

    def refused(self, digest: str) -> bool:
        with self._lock:
            return digest in self._refused

    def learn(self, groups: m.RowGroups, meta: pq.FileMetaData) -> None:
        """Keep the template a verified footer implies when it is the one its shard's
        record names (a record naming another decodes nothing with it)."""
        if groups.template is None or meta.num_row_groups == 0:
            return
        with self._lock:
            if groups.template in self._templates:
                return
        template = implied_template(meta)
        with self._lock:
            if template is not None and template.digest == groups.template:
                self._templates[template.digest] = template
            else:
                self._refused.add(groups.template)

    def get(self, digest: m.RowGroups) -> Footer | None:
        with self._lock:
            footer = self._items.get(digest)
            if footer is not None:
                self._items.move_to_end(digest)
            return footer

    def put(self, digest: m.RowGroups, footer: Footer) -> None:
        with self._lock:
            self._items[digest] = footer
            while len(self._items) > self._limit:
                self._items.popitem(last=False)


def footer_key(groups: m.RowGroups) -> m.RowGroups:
    """A parsed footer is cached under the whole row-group entry it was checked against:
    its checksum says which footer it is, and its cuts are what the footer's layout was
    found to match (a tampered record with the same footer but other cuts misses)."""
    return groups


def _wrong_record(shard: m.ShardRef, where: str, rows: int, groups: int) -> CorruptStoreError:
    info = shard.groups
    assert info is not None
    return CorruptStoreError(
        f"shard {shard.path} of {where} holds {rows} rows in {groups} row groups but its "
        f"commit record says {shard.rows} in {len(info.rows)} (or its row groups lie "
        "elsewhere); the record is wrong — reset to a version without it"
    )


# The decoding threads (fresh in a forked child: a DataLoader worker has none of its
# parent's).
_DECODE = ProcessPool("dynstate-decode")


def _where(store: Store, version: int | None) -> str:
    return f"{store.display_url}" + (f" (version {version})" if version is not None else "")


def read_groups(
    store: Store,
    wanted: Sequence[tuple[m.ShardRef, Sequence[int]]],
    version: int | None,
    footers: Footers,
) -> list[pa.Table]:
    """The row groups ``wanted`` (shard, sorted group numbers) decoded, one table per shard
    holding its groups in that order.
    One storage call fetches every range the batch lacks; adjacent segments travel as one
    range and are verified one by one. Raises ChecksumMismatchError naming the shard and
    segment when bytes differ from their record. On an object store, shards whose record
    names a footer template this process holds are decoded without their footers; one that
    waited for a template no footer taught fetches its footer in a second call."""
    where = _where(store, version)
    ranges: list[tuple[str, int, int]] = []
    # Per range: (index into wanted, first segment, last segment + 1)
    spans: list[tuple[int, int, int]] = []
    # The footer each shard's read uses, looked up once: fetched with its groups if None
    # and no template decodes them. Templates only on object stores, where a footer costs
    # its bytes and often a request of its own; a local footer is one read, parsed faster
    # by pyarrow than its groups' footers are built here.
    # A template not known yet is learned from the footer of the first shard naming it,
    # fetched in this batch: the other shards naming it wait for it (``waiting``).
    known: list[Footer | None] = []
    templates: list[Template | None] = []
    waiting: list[int] = []
    learning: set[str] = set()
    all_bounds: list[list[int]] = []
    footerless = not store.reads_in_place
    for k, (shard, groups) in enumerate(wanted):
        assert shard.groups is not None  # callers pick whole-shard reads for the others
        bounds = segment_bounds(shard.groups)
        all_bounds.append(bounds)
        segments = list(groups)
        known.append(footers.get(footer_key(shard.groups)))
        digest = shard.groups.template
        template, waits = None, False
        if footerless and known[-1] is None and digest is not None and not footers.refused(digest):
            template = footers.template(shard.groups)
            if template is None:
                waits = digest in learning
                learning.add(digest)
                if waits:
                    waiting.append(k)
        templates.append(template)
        if known[-1] is None and template is None and not waits:
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
    _fetch(store, wanted, all_bounds, ranges, spans, got, version, where)

    def decode(k: int) -> pa.Table:
        shard, groups = wanted[k]
        info = shard.groups
        assert info is not None
        template = templates[k] if k not in late else footers.template(info)
        if template is not None:
            return _decode_footerless(shard, groups, got, k, all_bounds[k], template, where)
        table = _decode(shard, groups, got, k, all_bounds[k], known[k], footers, where)
        if footerless and known[k] is None:
            footer = footers.get(footer_key(info))
            if footer is not None:
                footers.learn(info, footer.meta)
        return table

    late = set(waiting)
    now = [k for k in range(len(wanted)) if k not in late]
    out: dict[int, pa.Table] = dict(zip(now, _map(decode, now), strict=True))
    if late:
        # The footers fetched above taught their templates; a shard whose template did
        # not come (the footer naming it implies another) needs its footer after all: only
        # that is fetched, its groups are in ``got`` already.
        ready = [k for k in waiting if footers.template(_groups(wanted[k][0])) is not None]
        out.update(zip(ready, _map(decode, ready), strict=True))
        rest = [k for k in waiting if k not in out]
        if rest:
            spans = [(k, len(_groups(wanted[k][0]).rows), len(all_bounds[k]) - 1) for k in rest]
            ranges = [
                (wanted[k][0].path, all_bounds[k][lo], all_bounds[k][hi]) for k, lo, hi in spans
            ]
            _fetch(store, wanted, all_bounds, ranges, spans, got, version, where)
            out.update(zip(rest, _map(decode, rest), strict=True))
    return [out[k] for k in range(len(wanted))]


def _fetch(
    store: Store,
    wanted: Sequence[tuple[m.ShardRef, Sequence[int]]],
    all_bounds: list[list[int]],
    ranges: list[tuple[str, int, int]],
    spans: list[tuple[int, int, int]],
    got: dict[tuple[int, int], memoryview],
    version: int | None,
    where: str,
) -> None:
    """Fetch ``ranges`` in one storage call and put each of their segments, once its
    SHA-256 equals its record, in ``got`` by (index into wanted, segment). ``spans``: per
    range, (index into wanted, first segment, last segment + 1)."""

    def check(data: list[bytes]) -> None:
        for (k, lo, hi), blob in zip(spans, data, strict=True):
            shard = wanted[k][0]
            groups = shard.groups
            assert groups is not None
            bounds = all_bounds[k]
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
    except FileNotFoundError as exc:
        missing: FileNotFoundError | None = exc
    else:
        missing = None
    if missing is not None:
        # Outside the handler, so that errors of these reads do not carry "no such key" as
        # their context (storage's error table reads S3's code along that chain).
        for shard, _ in wanted:
            if not store.storage.exists(shard.path):
                # The one home of the "missing" and "collected" errors raises them.
                store.read_shard_bytes(shard, version=version)
        raise missing


def _groups(shard: m.ShardRef) -> m.RowGroups:
    assert shard.groups is not None
    return shard.groups


def _map(fn: Callable[[int], pa.Table], items: list[int]) -> list[pa.Table]:
    if len(items) < _PARALLEL_SHARDS:
        return [fn(k) for k in items]
    # Parquet decodes with the GIL released: a cold batch spread over dozens of shards
    # decodes them on a few threads at once.
    return list(_DECODE.executor(_DECODERS).map(fn, items))


def _decode_footerless(
    shard: m.ShardRef,
    groups: Sequence[int],
    got: dict[tuple[int, int], memoryview],
    k: int,
    bounds: list[int],
    template: Template,
    where: str,
) -> pa.Table:
    """The row groups ``groups`` of one shard, each decoded from its verified bytes with a
    footer built from ``template`` and its pages (:func:`dynstate.records.footers.mini_file`)."""
    info = shard.groups
    assert info is not None
    parts = []
    try:
        for g in groups:
            # segment 0 also holds the file's leading magic
            piece = got[(k, g)][4:] if g == 0 else got[(k, g)]
            data = mini_file(template, piece, info.rows[g])
            if data is None:
                raise CorruptStoreError(
                    f"row group {g} of shard {shard.path} of {where} does not hold the "
                    f"{info.rows[g]} rows of columns its commit record says; the record "
                    "is wrong — reset to a version without it"
                )
            small = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False)
            parts.append(small.read_row_group(0, use_threads=False))
    except (pa.ArrowException, OSError) as exc:
        raise CorruptStoreError(
            f"shard {shard.path} of {where} is not a readable Parquet file ({exc}); restore it "
            "or reset to a version without it"
        ) from None
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


def _decode(
    shard: m.ShardRef,
    groups: Sequence[int],
    got: dict[tuple[int, int], memoryview],
    k: int,
    bounds: list[int],
    footer: Footer | None,
    footers: Footers,
    where: str,
) -> pa.Table:
    """The row groups ``groups`` of one shard, decoded: one table, the groups in order."""
    info = shard.groups
    assert info is not None
    ends = bounds[1:]
    try:
        # A buffer the size of the file holding only the verified segments, at their
        # offsets: the reader, given the verified footer, reads only the column chunks of
        # the groups asked for, which are checked below to lie inside them. (In memory:
        # nothing for pyarrow's read-ahead to coalesce.)
        buffer = pa.allocate_buffer(shard.bytes)
        target = np.frombuffer(buffer, dtype=np.uint8)
        for g in groups:
            target[bounds[g] : bounds[g + 1]] = np.frombuffer(got[(k, g)], dtype=np.uint8)
        if footer is None:
            footer_at = len(info.rows)
            target[bounds[footer_at] :] = np.frombuffer(got[(k, footer_at)], dtype=np.uint8)
            # The footer is parsed where it lies in the buffer: one reader set up, not two.
            parquet = pq.ParquetFile(pa.BufferReader(buffer), pre_buffer=False)
            footer = Footer(parquet.metadata)
            meta = footer.meta
            # One check of a fresh footer: its group count and what this read relies on
            # (a check of the count alone first would repeat its first half).
            if meta.num_rows != shard.rows or not layout_matches(
                meta, ends, list(info.rows), groups
            ):
                raise _wrong_record(shard, where, meta.num_rows, meta.num_row_groups)
            footer.counted = max(groups, default=-1) + 1
            footer.placed.update(groups)
            footers.put(footer_key(info), footer)
        else:
            parquet = pq.ParquetFile(
                pa.BufferReader(buffer), metadata=footer.meta, pre_buffer=False
            )
            unplaced = [g for g in groups if g not in footer.placed]
            if unplaced:
                meta = footer.meta
                if not layout_matches(meta, ends, list(info.rows), unplaced, footer.counted):
                    raise _wrong_record(shard, where, meta.num_rows, meta.num_row_groups)
                footer.counted = max(footer.counted, max(unplaced) + 1)
                footer.placed.update(unplaced)
        table = parquet.read_row_groups(list(groups), use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise CorruptStoreError(
            f"shard {shard.path} of {where} is not a readable Parquet file ({exc}); restore it "
            "or reset to a version without it"
        ) from None
    return table
