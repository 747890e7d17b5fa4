"""The JSON documents of ``dynstate serve``, built from the library: every HTML page renders
one of these, and ``/api/...`` returns it as is. Keys follow the CLI's ``--json`` output where
the two overlap (``ls``, ``show``, ``diff``, ``inspect``).

Every builder reads only what it returns: a page of versions reads the records on that page,
a page of rows the shards those rows are in. Filters on data columns and text search scan the
one version asked about, shard by shard, and stop once the page is full.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import DynstateError, InvalidDataError, VersionNotFoundError
from ..gc import gc_floor
from ..history import _row as _version_row  # one row of `dynstate ls --json`: same keys
from ..history import describe, diff, lineage
from ..manifest import ShardRef
from ..snapshot import Snapshot
from ..store import Store
from .chart import growth
from .lineage import SOURCE_COLUMN, LineageCache, Rounds

log = logging.getLogger("dynstate")

MAX_LIMIT = 500
RESERVED = frozenset({"offset", "limit", "q"})
# Filters that select rows by the round that wrote them, unless the data has such a column.
ROUND_FIELDS = ("generator", "step", "round")
_ANCESTOR_DEPTH = 8
_GRAPH_NODES = 40


class RowNotFoundError(DynstateError, LookupError):
    """A row number outside a version's rows."""


_USERINFO = re.compile(r"[^\s/@'\"]+:[^\s/@'\"]+@")


def scrub(text: str, secrets: Sequence[str] = ()) -> str:
    """``text`` without credentials: userinfo in URLs and any of ``secrets``."""
    text = _USERINFO.sub("***@", text)
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def jsonable(value: Any) -> Any:
    """A row value as JSON: bytes as base64 text, times as ISO 8601, NaN as None."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (bytes, bytearray)):
        return "base64:" + base64.b64encode(bytes(value)).decode()
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (dt.timedelta, decimal.Decimal)):
        return str(value)
    return value


class ShardTables:
    """Decoded shards of the versions being looked at, least recently used out, bounded in
    bytes (shards are immutable, so a cached table never goes stale)."""

    def __init__(self, max_bytes: int = 256 * 2**20):
        self.max_bytes = max_bytes
        self._tables: OrderedDict[tuple[str, str | None], pa.Table] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, snap: Snapshot, index: int) -> pa.Table:
        shard: ShardRef = snap.shards[index]
        key = (shard.path, snap.commit.schema)
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                self._tables.move_to_end(key)
                return table
        table = snap.read_shard(index)
        with self._lock:
            if key not in self._tables:
                self._tables[key] = table
                self._bytes += table.nbytes
            while self._bytes > self.max_bytes and len(self._tables) > 1:
                _, old = self._tables.popitem(last=False)
                self._bytes -= old.nbytes
        return table


def _int_param(value: str | None, name: str, default: int, lo: int, hi: int | None) -> int:
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise InvalidDataError(f"{name} must be an integer, not {value!r}") from None
    if number < lo or (hi is not None and number > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise InvalidDataError(f"{name} must be {bound}, not {number}")
    return number


class StoreView:
    """Everything ``dynstate serve`` shows about one store, as JSON-able dicts."""

    def __init__(
        self,
        store: Store,
        *,
        checkpoints: Sequence[str] = (),
        url: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ):
        self.store = store
        self.url = url or store.url  # opens checkpoint datasets; never shown
        self.storage_options = dict(storage_options or {})
        self.checkpoints = list(checkpoints)
        self.lineage = LineageCache(store)
        self.tables = ShardTables()
        self._growth: tuple[int, dict[str, Any]] | None = None
        self._growth_lock = threading.Lock()
        self._checkpoint_info: dict[int, dict[str, Any]] = {}
        self._matches: OrderedDict[tuple[Any, ...], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    # -- helpers -----------------------------------------------------------------------------

    @property
    def secrets(self) -> list[str]:
        """Values never to show: credentials given as storage options or in the URL."""
        out = [str(v) for k, v in self.storage_options.items() if _secretish(k)]
        if "@" in self.url and "://" in self.url:
            userinfo = self.url.split("://", 1)[1].split("@", 1)[0]
            out.extend(part for part in userinfo.split(":") if part)
        return out

    def resolve(self, version: int | str | None) -> int:
        if version in (None, "", "head"):
            return self.store.refresh()
        return self.store.resolve(version)

    def _tags_by_version(self) -> dict[int, list[str]]:
        tags: dict[int, list[str]] = {}
        for name, v in sorted(self.store.tags().items()):
            tags.setdefault(v, []).append(name)
        return tags

    # -- store -------------------------------------------------------------------------------

    def growth(self) -> dict[str, Any]:
        """The head lineage's growth, cached per head (built once; a later head re-reads only
        records it has not read before, which the store caches)."""
        head = self.store.refresh()
        with self._growth_lock:
            if self._growth is not None and self._growth[0] == head:
                return self._growth[1]
            data = growth(self.store, self.lineage.chain(head), gc_floor(self.store))
            self._growth = (head, data)
            return data

    def store_info(self, *, with_growth: bool = True) -> dict[str, Any]:
        head = self.store.refresh()
        floor = gc_floor(self.store)
        record, first = self.store.commit_record(head), self.store.commit_record(floor)
        info: dict[str, Any] = {
            "url": self.store.display_url,
            "store_id": self.store.store_id,
            "head": head,
            "oldest": floor,
            "versions": head - floor + 1,
            "rows": record.num_rows,
            "bytes": record.num_bytes,
            "shards": record.num_shards,
            "tags": dict(sorted(self.store.tags().items())),
            "first_commit": first.created,
            "last_commit": record.created,
            "checkpoints": [{"id": k, "path": path} for k, path in enumerate(self.checkpoints)],
        }
        if with_growth:
            info["growth"] = self.growth()
        return info

    # -- versions ----------------------------------------------------------------------------

    def versions_page(self, *, limit: str | None = None, before: str | None = None) -> dict:
        """Versions newest first: ``limit`` of them below ``before`` (default: from the head).
        Reads the records shown and the head's lineage down to the oldest one shown."""
        head = self.store.refresh()
        floor = gc_floor(self.store)
        n = _int_param(limit, "limit", 50, 1, MAX_LIMIT)
        top = _int_param(before, "before", head + 1, 0, None)
        top = min(top, head + 1)
        numbers = list(range(top - 1, max(floor, top - n) - 1, -1))
        low = numbers[-1] if numbers else top
        line = set(lineage(self.store, head, low))
        tags = self._tags_by_version()
        rows = [
            _version_row(self.store.commit_record(v), head, line, tags.get(v, [])) for v in numbers
        ]
        more = bool(numbers) and numbers[-1] > floor
        return {
            "url": self.store.display_url,
            "head": head,
            "oldest": floor,
            "limit": n,
            "before": top,
            "next_before": numbers[-1] if more else None,
            "versions": rows,
        }

    def version_info(self, version: int | str | None) -> dict[str, Any]:
        """``dynstate show --json`` of one version, plus its rounds (which rows each wrote)."""
        v = self.resolve(version)
        info = describe(self.store, v)
        rounds = self.lineage.rounds(v)
        info["rounds"] = [s.to_json() for s in rounds.segments]
        info["columns"] = [f["name"] for f in info["schema"]]
        return info

    # -- rows --------------------------------------------------------------------------------

    def rows_page(
        self,
        version: int | str | None,
        *,
        offset: str | None = None,
        limit: str | None = None,
        q: str | None = None,
        filters: Mapping[str, Sequence[str]] | None = None,
    ) -> dict[str, Any]:
        v = self.resolve(version)
        snap = self.store.snapshot(v)
        start = _int_param(offset, "offset", 0, 0, None)
        n = _int_param(limit, "limit", 50, 1, MAX_LIMIT)
        q = (q or "").strip()
        columns = snap.schema.names if snap.schema is not None else []
        round_filters, data_filters = self._split_filters(v, snap, filters or {})
        rounds = self.lineage.rounds(v)
        ranges = _round_ranges(rounds, round_filters)
        page: list[int]
        matches: np.ndarray | None = None
        if data_filters or q:
            page, total, matches = self._scan(snap, ranges, data_filters, q, start, n)
        else:
            total = sum(b - a for a, b in ranges)
            page = _take_ranges(ranges, start, n)
        facets = self._facets(snap, rounds, round_filters, not (data_filters or q), matches)
        rows = self._read_rows(snap, page)
        return {
            "url": self.store.display_url,
            "version": v,
            "rows_in_version": snap.num_rows,
            "offset": start,
            "limit": n,
            "q": q,
            "filters": {k: list(vals) for k, vals in (filters or {}).items()},
            "total": total,
            "next_offset": start + n if total is None or start + n < total else None,
            "columns": columns,
            "facets": facets,
            "rows": [
                self._row_json(rounds, i, values) for i, values in zip(page, rows, strict=True)
            ],
        }

    def _split_filters(
        self, v: int, snap: Snapshot, filters: Mapping[str, Sequence[str]]
    ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        names = snap.schema.names if snap.schema is not None else []
        round_filters: dict[str, list[str]] = {}
        data_filters: dict[str, list[str]] = {}
        for key, values in filters.items():
            values = [x for x in values if x != ""]
            if not values:
                continue
            if key in names:
                data_filters[key] = values
            elif key in ROUND_FIELDS:
                round_filters[key] = values
            else:
                shown = ", ".join([*ROUND_FIELDS, *names])
                raise InvalidDataError(
                    f"unknown column {key!r} to filter version {v} of {self.store.display_url}"
                    f" by; filter by one of: {shown}"
                )
        return round_filters, data_filters

    def _scan(
        self,
        snap: Snapshot,
        ranges: list[tuple[int, int]],
        filters: dict[str, list[str]],
        q: str,
        start: int,
        n: int,
    ) -> tuple[list[int], int | None, np.ndarray | None]:
        """Rows of ``ranges`` that match, in order: the page and, if the scan reached the end,
        how many match in all and which (None when it stopped early because the page was
        full)."""
        spec = tuple(sorted((k, tuple(v)) for k, v in filters.items()))
        key = (snap.version, tuple(ranges), spec, q)
        with self._lock:
            cached = self._matches.get(key)
            if cached is not None:
                self._matches.move_to_end(key)
        if cached is not None:
            return cached[start : start + n].tolist(), int(cached.size), cached
        found: list[np.ndarray] = []
        count = 0
        complete = True
        for i in range(len(snap.shards)):
            lo, hi = snap.offsets[i], snap.offsets[i + 1]
            parts = [(max(a, lo), min(b, hi)) for a, b in ranges if a < hi and b > lo]
            if not parts:
                continue
            if count > start + n:
                complete = False
                break
            table = self.tables.get(snap, i)
            mask = _mask(table, filters, q, snap.version, self.store.display_url)
            wanted = np.zeros(table.num_rows, dtype=bool)
            for a, b in parts:
                wanted[a - lo : b - lo] = True
            hits = np.flatnonzero(mask & wanted) + lo
            found.append(hits)
            count += hits.size
        matches = np.concatenate(found) if found else np.empty(0, np.int64)
        if not complete:
            return matches[start : start + n].tolist(), None, None
        with self._lock:
            self._matches[key] = matches
            while len(self._matches) > 16:
                self._matches.popitem(last=False)
        return matches[start : start + n].tolist(), int(matches.size), matches

    def _facets(
        self,
        snap: Snapshot,
        rounds: Rounds,
        round_filters: dict[str, list[str]],
        exact: bool,
        matches: np.ndarray | None,
    ) -> dict[str, Any]:
        """Rows per generator and per step, given the other filters (Datasette's facets).
        With data filters or a search they count the matching rows once a scan has found
        them all (``matches``), else the rows the round filters select (``exact`` false)."""
        out: dict[str, Any] = {}
        names = snap.schema.names if snap.schema is not None else []
        for field in ("generator", "step"):
            if field in names:
                continue
            others = {k: vals for k, vals in round_filters.items() if k != field}
            counts: dict[Any, int] = {}
            if matches is None:
                for seg in rounds.segments:
                    if _round_ranges_pass(seg, others):
                        value = getattr(seg, field)
                        counts[value] = counts.get(value, 0) + seg.stop - seg.start
            else:
                rows = _in_ranges(matches, _round_ranges(rounds, others))
                idx = rounds.of_rows(rows)
                for seg_i, c in zip(*np.unique(idx, return_counts=True), strict=True):
                    value = getattr(rounds.segments[int(seg_i)], field)
                    counts[value] = counts.get(value, 0) + int(c)
            selected = set(round_filters.get(field, []))
            ordered = sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))
            out[field] = {
                "exact": exact or matches is not None,
                "values": [
                    {"value": value, "count": c, "selected": str(value) in selected}
                    for value, c in ordered[:50]
                ],
                "more": max(0, len(ordered) - 50),
            }
        return out

    def _read_rows(self, snap: Snapshot, rows: Sequence[int]) -> list[dict[str, Any]]:
        """Values of ``rows`` of ``snap``, reading only the shards they are in."""
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for pos, row in enumerate(rows):
            shard, local = snap.locate(row)
            by_shard.setdefault(shard, []).append((pos, local))
        out: list[dict[str, Any]] = [{} for _ in rows]
        for shard, wanted in by_shard.items():
            table = self.tables.get(snap, shard)
            taken = table.take(pa.array([local for _, local in wanted], pa.int64()))
            for (pos, _), values in zip(wanted, taken.to_pylist(), strict=True):
                out[pos] = {k: jsonable(x) for k, x in values.items()}
        return out

    def _row_json(self, rounds: Rounds, row: int, values: dict[str, Any]) -> dict[str, Any]:
        seg = rounds.of_row(row)
        return {
            "row": row,
            "round": seg.version if seg else None,
            "step": seg.step if seg else None,
            "generator": seg.generator if seg else None,
            "values": values,
        }

    # -- one row and its lineage -------------------------------------------------------------

    def row_detail(self, version: int | str | None, row: int | str) -> dict[str, Any]:
        v = self.resolve(version)
        snap = self.store.snapshot(v)
        i = self._row_number(snap, row)
        rounds = self.lineage.rounds(v)
        values = self._read_rows(snap, [i])[0]
        seg = rounds.of_row(i)
        round_info = None
        if seg is not None and seg.version is not None:
            record = self.store.commit_record(seg.version)
            round_info = {**seg.to_json(), "op": record.op, "meta": record.meta}
        ancestors, up_edges = self._ancestors(snap, i, values)
        index = self.lineage.index(v)
        descendants, down_edges = self._descendants(index, i)
        nodes = {n["row"]: n for n in [*ancestors, *descendants]}
        previews = self._read_rows(snap, list(nodes)) if nodes else []
        for (r, node), vals in zip(nodes.items(), previews, strict=True):
            node.update(self._row_json(rounds, r, {}))
            node["preview"] = _preview(vals)
            node.pop("values", None)
        return {
            "url": self.store.display_url,
            "version": v,
            "row": i,
            "round": round_info,
            "values": values,
            "sources": _sources(values),
            "ancestors": ancestors,
            "descendants": descendants,
            "edges": [*up_edges, *down_edges],
            "index": {"version": index.version, "rows": index.num_rows, "edges": index.edges},
        }

    def _row_number(self, snap: Snapshot, row: int | str) -> int:
        try:
            i = int(row)
        except (TypeError, ValueError):
            i = -1
        if not 0 <= i < snap.num_rows:
            last = f"rows are 0-{snap.num_rows - 1}" if snap.num_rows else "it has no rows"
            raise RowNotFoundError(
                f"row {row} not found in version {snap.version} of {self.store.display_url} "
                f"({last})"
            )
        return i

    def _ancestors(
        self, snap: Snapshot, row: int, values: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """Rows ``row`` was derived from, and theirs, breadth first (bounded)."""
        nodes: list[dict[str, Any]] = []
        edges: list[list[int]] = []
        seen = {row}
        frontier = [(row, values)]
        for depth in range(1, _ANCESTOR_DEPTH + 1):
            nxt: list[int] = []
            for child, vals in frontier:
                for src in _sources(vals):
                    edges.append([src, child])
                    if src in seen or not 0 <= src < snap.num_rows:
                        continue
                    seen.add(src)
                    if len(nodes) >= _GRAPH_NODES:
                        continue
                    nodes.append({"row": src, "depth": depth})
                    nxt.append(src)
            if not nxt:
                break
            frontier = list(zip(nxt, self._read_rows(snap, nxt), strict=True))
        kept = {n["row"] for n in nodes} | {row}
        return nodes, [e for e in edges if e[0] in kept and e[1] in kept]

    def _descendants(self, index: Any, row: int) -> tuple[list[dict[str, Any]], list[list[int]]]:
        nodes: list[dict[str, Any]] = []
        edges: list[list[int]] = []
        seen = {row}
        frontier = [row]
        depth = 0
        while frontier and len(nodes) < _GRAPH_NODES and depth < _ANCESTOR_DEPTH:
            depth += 1
            nxt = []
            for parent in frontier:
                for child in index.children_of(parent):
                    if len(nodes) >= _GRAPH_NODES and child not in seen:
                        continue
                    edges.append([parent, child])
                    if child in seen:
                        continue
                    seen.add(child)
                    nodes.append({"row": child, "depth": depth})
                    nxt.append(child)
            frontier = nxt
        return nodes, edges

    # -- diff --------------------------------------------------------------------------------

    def diff(self, a: int | str | None, b: int | str | None) -> dict[str, Any]:
        """``dynstate diff --json`` of two versions, plus the row ranges and rounds added and
        removed: rows up to the newest version both lineages hold are shared (row
        identity)."""
        va, vb = self.resolve(a), self.resolve(b)
        info = diff(self.store, va, vb)
        floor = gc_floor(self.store)
        line_a, line_b = lineage(self.store, va, floor), lineage(self.store, vb, floor)
        common = set(line_a) & set(line_b)
        ra, rb = self.store.commit_record(va), self.store.commit_record(vb)
        base = max(common) if common else None
        # The CLI's own figures where it has them; the same computation where it has not.
        info.setdefault("common_version", base)
        info.setdefault(
            "shared_rows", self.store.commit_record(base).num_rows if base is not None else 0
        )
        shared = info["shared_rows"]
        info.setdefault("added_rows", rb.num_rows - shared)
        info.setdefault("removed_rows", ra.num_rows - shared)
        rounds_a, rounds_b = self.lineage.rounds(va), self.lineage.rounds(vb)
        only_b, only_a = set(line_b) - common, set(line_a) - common
        info["added_range"] = [shared, rb.num_rows]
        info["removed_range"] = [shared, ra.num_rows]
        info["added_rounds"] = [s.to_json() for s in rounds_b.segments if s.version in only_b]
        info["removed_rounds"] = [s.to_json() for s in rounds_a.segments if s.version in only_a]
        return info

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint(self, k: int | str) -> dict[str, Any]:
        """What checkpoint ``k`` (of ``--checkpoint``) pins: ``dynstate inspect --json``, plus
        the next rows grouped into batches."""
        try:
            number = int(k)
        except (TypeError, ValueError):
            number = -1
        if not 0 <= number < len(self.checkpoints):
            raise RowNotFoundError(
                f"no checkpoint {k}; this server was given {len(self.checkpoints)} "
                "(dynstate serve URL --checkpoint PATH)"
            )
        cached = self._checkpoint_info.get(number)
        if cached is not None:
            return cached
        from ..checkpoint import describe_checkpoint, load_checkpoint_state

        path = self.checkpoints[number]
        _, state = load_checkpoint_state(path)
        batch = int(state.get("batch_size") or 8)
        info = describe_checkpoint(
            path,
            store_url=self.url,
            storage_options=self.storage_options or None,
            rows=min(2 * batch, 64),
        )
        info = {k: jsonable(v) for k, v in info.items()}
        info["store_url"] = scrub(str(info["store_url"]), self.secrets)
        info["id"] = number
        info["path"] = path
        info["batch_size"] = batch
        indices = info["next_indices"]
        info["next_batches"] = [
            {"rows": indices[i : i + batch], "values": info["next_rows"][i : i + batch]}
            for i in range(0, len(indices), batch)
        ]
        version = info.get("version")
        if isinstance(version, int):
            try:
                info["version_rows"] = self.store.commit_record(version).num_rows
            except VersionNotFoundError:
                info["version_rows"] = None
        self._checkpoint_info[number] = info
        return info


def _secretish(key: str) -> bool:
    key = key.lower()
    return any(word in key for word in ("secret", "key", "token", "password", "session"))


def _sources(values: Mapping[str, Any]) -> list[int]:
    raw = values.get(SOURCE_COLUMN)
    if not isinstance(raw, list):
        return []
    return [int(x) for x in raw if isinstance(x, int) and not isinstance(x, bool)]


def _preview(values: Mapping[str, Any]) -> str:
    for name, value in values.items():
        if isinstance(value, str) and not name.startswith("_dynstate"):
            return value[:80]
    for name, value in values.items():
        if not name.startswith("_dynstate"):
            return str(value)[:80]
    return ""


def _round_ranges(rounds: Rounds, filters: Mapping[str, Sequence[str]]) -> list[tuple[int, int]]:
    """Row ranges of the rounds that pass ``filters`` (values compared as text)."""
    out: list[tuple[int, int]] = []
    for seg in rounds.segments:
        if _round_ranges_pass(seg, filters):
            if out and out[-1][1] == seg.start:
                out[-1] = (out[-1][0], seg.stop)
            else:
                out.append((seg.start, seg.stop))
    return out


def _round_ranges_pass(seg: Any, filters: Mapping[str, Sequence[str]]) -> bool:
    for key, values in filters.items():
        value = getattr(seg, "version" if key == "round" else key)
        text = "null" if value is None else str(value)
        if text not in values:
            return False
    return True


def _take_ranges(ranges: list[tuple[int, int]], start: int, n: int) -> list[int]:
    out: list[int] = []
    skip = start
    for a, b in ranges:
        size = b - a
        if skip >= size:
            skip -= size
            continue
        first = a + skip
        skip = 0
        out.extend(range(first, min(b, first + n - len(out))))
        if len(out) >= n:
            break
    return out


def _in_ranges(rows: np.ndarray, ranges: list[tuple[int, int]]) -> np.ndarray:
    keep = np.zeros(rows.size, dtype=bool)
    for a, b in ranges:
        keep |= (rows >= a) & (rows < b)
    return rows[keep]


def _mask(
    table: pa.Table, filters: Mapping[str, Sequence[str]], q: str, version: int, url: str
) -> np.ndarray:
    """Which rows of ``table`` equal one of the values of every filter and contain ``q``
    (case-insensitive) in a string column."""
    mask = np.ones(table.num_rows, dtype=bool)
    for name, values in filters.items():
        column = table.column(name)
        if not _comparable(column.type):
            raise InvalidDataError(
                f"column {name!r} of version {version} of {url} is {column.type}; only plain "
                "values (text, numbers, booleans) can be filtered on — use q= to search text"
            )
        try:
            wanted = pa.array([_parse(value, column.type) for value in values], column.type)
        except (ValueError, pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise InvalidDataError(
                f"cannot compare column {name!r} ({column.type}) of version {version} of {url} "
                f"with {list(values)}: {exc}"
            ) from None
        hit = pc.is_in(column, value_set=wanted)
        mask &= hit.to_numpy(zero_copy_only=False).astype(bool) & ~np.asarray(
            column.is_null().to_numpy(zero_copy_only=False), dtype=bool
        )
    if q:
        found = np.zeros(table.num_rows, dtype=bool)
        for column, field in zip(table.columns, table.schema, strict=True):
            if pa.types.is_string(field.type) or pa.types.is_large_string(field.type):
                hit = pc.match_substring(column, q, ignore_case=True)
                found |= hit.fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
        mask &= found
    return mask


def _comparable(t: pa.DataType) -> bool:
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
    )


def _parse(value: str, t: pa.DataType) -> Any:
    if pa.types.is_integer(t):
        return int(value)
    if pa.types.is_floating(t):
        return float(value)
    if pa.types.is_boolean(t):
        if value.lower() in ("true", "1", "yes"):
            return True
        if value.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"{value!r} is not a boolean")
    return value
