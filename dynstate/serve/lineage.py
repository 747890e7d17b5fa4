"""What the web view knows about where rows come from, cached per version.

* :class:`Rounds` — which round (append version, step, generator) wrote which rows of a
  version. Built from the commit records of the version's lineage only (no row is read).
* :class:`DescendantIndex` — for every row of a version, the rows derived from it: the
  ``_dynstate_source`` column (a list of row numbers; row numbers are stable along a lineage)
  inverted into two sorted arrays, so a lookup is a binary search. Building it reads that
  column of every shard once; the index of a newer version of the same lineage extends the
  older one's with only the rows added since.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..history import lineage
from ..records.manifest import Commit
from ..store import Store

log = logging.getLogger("dynstate")

# The lineage column verl generators write (dynstate.verl.generator.SOURCE_COLUMN); not
# imported from there, because dynstate.verl imports verl.
SOURCE_COLUMN = "_dynstate_source"


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, stop)`` of a version, written by one round (``version`` None: rows of
    rounds that garbage collection removed the records of)."""

    start: int
    stop: int
    version: int | None
    step: Any
    generator: Any
    created: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "step": self.step,
            "generator": self.generator,
            "created": self.created,
            "rows": [self.start, self.stop],
        }


class Rounds:
    """The rounds whose rows make up one version, oldest first, as row segments."""

    def __init__(self, version: int, num_rows: int, chain: list[Commit], floor: int):
        self.version = version
        self.num_rows = num_rows
        self.chain = chain  # oldest first, down to the gc floor
        segments: list[Segment] = []
        covered = 0
        for record in chain:
            if record.op != "append" or record.rows_added == 0:
                continue
            start = record.num_rows - record.rows_added
            if start > covered and not segments:
                segments.append(Segment(0, start, None, None, None, None))
            meta = record.meta
            segments.append(
                Segment(
                    start,
                    record.num_rows,
                    record.version,
                    meta.get("step"),
                    meta.get("generator"),
                    record.created,
                )
            )
            covered = record.num_rows
        if not segments and num_rows:
            # Every round of these rows is below the gc floor (or behind a compaction base).
            segments.append(Segment(0, num_rows, None, None, None, None))
        elif covered < num_rows:
            segments.append(Segment(covered, num_rows, None, None, None, None))
        self.segments = segments
        self._starts = [s.start for s in segments]
        self.floor = floor

    def of_row(self, row: int) -> Segment | None:
        i = bisect.bisect_right(self._starts, row) - 1
        if i < 0 or row >= self.segments[i].stop:
            return None
        return self.segments[i]

    def of_rows(self, rows: np.ndarray) -> np.ndarray:
        """Index into :attr:`segments` of each row."""
        return np.searchsorted(np.asarray(self._starts), rows, side="right") - 1


class DescendantIndex:
    """``_dynstate_source`` of one version, inverted: which rows name row ``i`` as a source."""

    def __init__(self, version: int, num_rows: int, sources: np.ndarray, children: np.ndarray):
        order = np.argsort(sources, kind="stable")
        self.version = version
        self.num_rows = num_rows
        self.sources = sources[order]
        self.children = children[order]
        self.build_s = 0.0

    @property
    def edges(self) -> int:
        return int(self.sources.size)

    def children_of(self, row: int) -> list[int]:
        lo = np.searchsorted(self.sources, row, side="left")
        hi = np.searchsorted(self.sources, row, side="right")
        return sorted(set(self.children[lo:hi].tolist()))


def source_edges(table: pa.Table, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """(source row, child row) pairs of ``table``'s rows, which start at row ``offset``."""
    if SOURCE_COLUMN not in table.column_names or table.num_rows == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    column = table.column(SOURCE_COLUMN).combine_chunks()
    if not (
        (pa.types.is_list(column.type) or pa.types.is_large_list(column.type))
        and pa.types.is_integer(column.type.value_type)
    ):
        # Sources are row numbers; a list of text, floats or booleans names no row (as
        # graph.sources reads one row's), so it adds no edge rather than a cast one.
        return np.empty(0, np.int64), np.empty(0, np.int64)
    flat = pc.list_flatten(column)
    parents = pc.list_parent_indices(column)
    valid = pc.is_valid(flat)
    flat = pc.filter(flat, valid).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    parents = pc.filter(parents, valid).to_numpy(zero_copy_only=False).astype(np.int64)
    return flat, parents + offset


class LineageCache:
    """Rounds and descendant indexes of the versions a server has been asked about (LRU)."""

    def __init__(self, store: Store, *, max_versions: int = 8):
        self.store = store
        self.max_versions = max_versions
        # by (version, gc floor): a round whose record gc collected has no number for a fresh
        # reader, and must have none here once the floor rose past it
        self._rounds: OrderedDict[tuple[int, int], Rounds] = OrderedDict()
        self._indexes: OrderedDict[int, DescendantIndex] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[int, threading.Lock] = {}

    def chain(self, version: int) -> list[Commit]:
        """Commit records of ``version``'s lineage, oldest first, down to the gc floor."""
        floor = self.store.floor
        return [self.store.commit_record(v) for v in reversed(lineage(self.store, version, floor))]

    def rounds(self, version: int) -> Rounds:
        key = (version, self.store.floor)
        with self._lock:
            cached = self._rounds.get(key)
            if cached is not None:
                self._rounds.move_to_end(key)
                return cached
        record = self.store.commit_record(version)
        floor = self.store.floor
        rounds = Rounds(version, record.num_rows, self.chain(version), floor)
        with self._lock:
            self._rounds[(version, floor)] = rounds
            while len(self._rounds) > 4 * self.max_versions:
                self._rounds.popitem(last=False)
        return rounds

    def rounds_of(self, version: int, versions: list[int]) -> Rounds:
        """The rounds of ``version`` written by ``versions`` only (a diff's side: the records
        it has read already, not the whole lineage); its other rows have no round."""
        record = self.store.commit_record(version)
        chain = [self.store.commit_record(v) for v in sorted(versions)]
        return Rounds(version, record.num_rows, chain, self.store.floor)

    def cached_index(self, version: int) -> DescendantIndex | None:
        with self._lock:
            return self._indexes.get(version)

    def index(self, version: int) -> DescendantIndex:
        """The descendant index of ``version``, built on first use (one build at a time per
        version; concurrent requests wait for it)."""
        with self._lock:
            found = self._indexes.get(version)
            if found is not None:
                self._indexes.move_to_end(version)
                return found
            build_lock = self._building.setdefault(version, threading.Lock())
        with build_lock:
            with self._lock:
                found = self._indexes.get(version)
            if found is not None:
                return found
            started = time.perf_counter()
            index = self._build(version)
            index.build_s = time.perf_counter() - started
            log.info(
                "descendant index of version %d of %s: %d rows, %d edges in %.2f s",
                version,
                self.store.display_url,
                index.num_rows,
                index.edges,
                index.build_s,
            )
            with self._lock:
                self._indexes[version] = index
                self._building.pop(version, None)
                while len(self._indexes) > self.max_versions:
                    self._indexes.popitem(last=False)
            return index

    def _build(self, version: int) -> DescendantIndex:
        snap = self.store.snapshot(version)
        base = self._reusable(version)
        start = base.num_rows if base is not None else 0
        sources = [base.sources] if base is not None else []
        children = [base.children] if base is not None else []
        for i in range(len(snap.shards)):
            lo, hi = snap.offsets[i], snap.offsets[i + 1]
            if hi <= start or lo == hi:
                continue
            table = snap.read_shard(i)
            if lo < start:
                table = table.slice(start - lo)
                lo = start
            s, c = source_edges(table, lo)
            sources.append(s)
            children.append(c)
        src = np.concatenate(sources) if sources else np.empty(0, np.int64)
        kids = np.concatenate(children) if children else np.empty(0, np.int64)
        return DescendantIndex(version, snap.num_rows, src, kids)

    def _reusable(self, version: int) -> DescendantIndex | None:
        """A built index of an older version of ``version``'s lineage: its rows are the first
        rows of ``version`` (row identity), so only the rows added since need reading."""
        with self._lock:
            built = dict(self._indexes)
        if not built:
            return None
        best: DescendantIndex | None = None
        for v in lineage(self.store, version, min(built)):
            if v in built:
                best = built[v]
                break
        return best
