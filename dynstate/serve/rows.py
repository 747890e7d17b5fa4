"""A page of a version's rows: filters on columns and on the round that wrote each row,
a text search over string columns, facets, and reading only the shards a page needs.

A filter's query parameter is ``col.NAME`` for any column (``col.limit=7`` filters a column
named ``limit``) or the plain ``NAME`` for a name that is none of the page's own parameters:
the pages build ``col.NAME`` links, so no column name collides with a page parameter.

Round filters (``generator``, ``step``, ``round``) select row ranges from the commit records
alone. Data filters and the search scan the version's shards in order and stop once the page is
full; a scan that reaches the end is cached, so its count and facets are exact.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import InvalidDataError
from ..loading.cache import ShardCache
from ..records.codec import dumps
from ..snapshot import Snapshot
from ..store import Store
from ..text import python_rows
from .lineage import Rounds

MAX_LIMIT = 500
# Query parameters that choose rows by their outcome statistics (dynstate.history.outcomes).
OUTCOME_PARAMS = ("sort", "min_pass_rate", "max_pass_rate", "min_attempts", "max_attempts")
RESERVED = frozenset({"offset", "limit", "q", *OUTCOME_PARAMS})
# The query parameter ``col.NAME`` filters column NAME, whatever the name.
FILTER_PREFIX = "col."
# Filters that select rows by the round that wrote them, unless the data has such a column.
ROUND_FIELDS = ("generator", "step", "round")


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


def filter_param(column: str) -> str:
    """The query parameter that filters ``column``, whatever its name."""
    return FILTER_PREFIX + column


def filter_params(column: str) -> tuple[str, ...]:
    """Every query parameter that filters ``column``: ``col.NAME``, and the plain name unless
    it is a page parameter or itself reads as ``col.…``."""
    if column in RESERVED or column.startswith(FILTER_PREFIX):
        return (filter_param(column),)
    return (filter_param(column), column)


def column_filters(items: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """The column filters of a query string's ``(key, value)`` pairs, by column name: every
    ``col.NAME``, and every other key that is not a page parameter."""
    filters: dict[str, list[str]] = {}
    for key, value in items:
        if key.startswith(FILTER_PREFIX):
            filters.setdefault(key[len(FILTER_PREFIX) :], []).append(value)
        elif key not in RESERVED:
            filters.setdefault(key, []).append(value)
    return filters


def round_text(value: Any) -> str:
    """A round's step or generator (any JSON value its meta holds) as the round filters
    compare it and the facets count it: ``null``, text as is, a number as Python writes it,
    a list or an object as JSON."""
    if value is None:
        return "null"
    if isinstance(value, (str, int, float)):
        return str(value)
    return dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def _facet_key(value: Any) -> Any:
    # A list or an object in meta cannot key a dict: counted (and shown) by its text.
    return value if value is None or isinstance(value, (str, int, float)) else round_text(value)


def int_param(value: str | None, name: str, default: int, lo: int, hi: int | None) -> int:
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


class RowQuery:
    """Pages of rows of one store's versions, with a cache of complete scans. Decoded shards
    come from the dataset's shard cache (:class:`dynstate.loading.cache.ShardCache`: bounded
    in bytes, least recently used out, keyed by checksum and schema; shards are immutable, so
    a cached table never goes stale)."""

    def __init__(self, store: Store, *, cache_bytes: int = 256 * 2**20):
        self.store = store
        self.shards = ShardCache(cache_bytes)
        self._matches: OrderedDict[tuple[Any, ...], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def page(
        self,
        snap: Snapshot,
        rounds: Rounds,
        offset: str | None,
        limit: str | None,
        q: str | None,
        filters: Mapping[str, Sequence[str]],
        *,
        order: np.ndarray | None = None,
    ) -> dict[str, Any]:
        """``limit`` rows from ``offset`` of the rows that pass ``filters`` and contain ``q``;
        ``total`` is None while a scan has not reached the end. ``order``: only these rows,
        in this order (rows chosen by their outcome statistics); the other filters then
        scan the whole version once (cached), so the total is exact."""
        start = int_param(offset, "offset", 0, 0, None)
        n = int_param(limit, "limit", 50, 1, MAX_LIMIT)
        q = (q or "").strip()
        round_filters, data_filters = self._split_filters(snap, filters)
        ranges = _round_ranges(rounds, round_filters)
        page: list[int]
        total: int | None
        matches: np.ndarray | None = None
        if order is not None:
            chosen = _in_ranges(order, ranges)
            if data_filters or q:
                # a scan for a page of every row reaches the end: ``every`` is all matches
                found, _, every = self._scan(snap, ranges, data_filters, q, 0, snap.num_rows)
                chosen = chosen[np.isin(chosen, every if every is not None else found)]
            total, matches = int(chosen.size), chosen
            page = chosen[start : start + n].tolist()
        elif data_filters or q:
            page, total, matches = self._scan(snap, ranges, data_filters, q, start, n)
        else:
            total = sum(b - a for a, b in ranges)
            page = _take_ranges(ranges, start, n)
        exact = not (data_filters or q) or order is not None
        facets = self._facets(snap, rounds, round_filters, exact, matches)
        values = self.read(snap, page)
        return {
            "rows_in_version": snap.num_rows,
            "offset": start,
            "limit": n,
            "q": q,
            "filters": {k: list(vals) for k, vals in filters.items()},
            "total": total,
            "next_offset": start + n if total is None or start + n < total else None,
            "columns": snap.schema.names if snap.schema is not None else [],
            "facets": facets,
            "rows": [self.row_json(rounds, i, v) for i, v in zip(page, values, strict=True)],
        }

    def _split_filters(
        self, snap: Snapshot, filters: Mapping[str, Sequence[str]]
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
                    f"unknown column {key!r} to filter version {snap.version} of "
                    f"{self.store.display_url}"
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
            table = self.table(snap, i)
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
        them all (``matches``). Otherwise — or for a field that is itself filtered on, since the
        scan covered only the rounds it selects — they count the rows the round filters select,
        and say so (``exact`` false)."""
        out: dict[str, Any] = {}
        names = snap.schema.names if snap.schema is not None else []
        for field in ("generator", "step"):
            if field in names:
                continue
            others = {k: vals for k, vals in round_filters.items() if k != field}
            counts: dict[Any, int] = {}
            scanned = matches is not None and field not in round_filters
            if matches is not None and field not in round_filters:
                rows = _in_ranges(matches, _round_ranges(rounds, others))
                idx = rounds.of_rows(rows)
                for seg_i, c in zip(*np.unique(idx, return_counts=True), strict=True):
                    value = _facet_key(getattr(rounds.segments[int(seg_i)], field))
                    counts[value] = counts.get(value, 0) + int(c)
            else:
                for seg in rounds.segments:
                    if _round_ranges_pass(seg, others):
                        value = _facet_key(getattr(seg, field))
                        counts[value] = counts.get(value, 0) + seg.stop - seg.start
            selected = set(round_filters.get(field, []))
            ordered = sorted(counts.items(), key=lambda kv: (-kv[1], _order(kv[0])))
            out[field] = {
                "exact": exact or scanned,
                "values": [
                    {"value": value, "count": c, "selected": round_text(value) in selected}
                    for value, c in ordered[:50]
                ],
                "more": max(0, len(ordered) - 50),
            }
        return out

    def table(self, snap: Snapshot, index: int) -> pa.Table:
        """Shard ``index`` of ``snap``, shaped like its version's schema."""
        shard = snap.shards[index]
        schema = snap.schema
        return self.shards.shard(self.store, shard, schema, snap.commit.schema, snap.version).table

    def read(self, snap: Snapshot, rows: Sequence[int]) -> list[dict[str, Any]]:
        """Values of ``rows`` of ``snap``, reading only the shards they are in."""
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for pos, row in enumerate(rows):
            shard, local = snap.locate(row)
            by_shard.setdefault(shard, []).append((pos, local))
        out: list[dict[str, Any]] = [{} for _ in rows]
        for shard, wanted in by_shard.items():
            table = self.table(snap, shard)
            taken = table.take(pa.array([local for _, local in wanted], pa.int64()))
            for (pos, _), values in zip(wanted, python_rows(taken), strict=True):
                out[pos] = {k: jsonable(x) for k, x in values.items()}
        return out

    def row_json(self, rounds: Rounds, row: int, values: dict[str, Any]) -> dict[str, Any]:
        seg = rounds.of_row(row)
        return {
            "row": row,
            "round": seg.version if seg else None,
            "step": seg.step if seg else None,
            "generator": seg.generator if seg else None,
            "values": values,
        }


def _order(value: Any) -> tuple[int, float, str]:
    """Ties of a facet in natural order: numbers by value (step 2 before step 10), then text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, "" if value is None else str(value))


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
        if round_text(getattr(seg, "version" if key == "round" else key)) not in values:
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
        except (ValueError, OverflowError, pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise InvalidDataError(
                f"cannot compare column {name!r} ({column.type}) of version {version} of {url} "
                f"with {list(values)}: {exc}; filter it by values of its type"
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
        number = int(value)
        signed = pa.types.is_signed_integer(t)
        lo, hi = (
            (-(2 ** (t.bit_width - 1)), 2 ** (t.bit_width - 1) - 1)
            if signed
            else (0, 2**t.bit_width - 1)
        )
        if not lo <= number <= hi:
            raise ValueError(f"{value} is outside {t}'s range, {lo} to {hi}")
        return number
    if pa.types.is_floating(t):
        return float(value)
    if pa.types.is_boolean(t):
        if value.lower() in ("true", "1", "yes"):
            return True
        if value.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"{value!r} is not a boolean")
    return value
