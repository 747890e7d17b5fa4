"""Batch assembly for :class:`~dynstate.VersionedDataset`: where a batch's rows lie (blocks,
shards or row groups of the cache, the missing row groups fetched together), column values
gathered from them, and rows, columns or an Arrow batch built from those."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import SchemaMismatchError
from ..records.columns import int64_array
from ..store import Store
from .cache import ShardCache, _Shard
from .ranged import group_starts
from .view import View

# Up to this many rows of one column of one shard are read cell by cell: an Arrow take()
# costs ~3 µs per call whatever its size, one cell ~0.5 µs.
_CELL_ROWS = 6
_TAKE = pc.get_function("take")
_TAKE_OPTIONS = pc.TakeOptions()


@functools.lru_cache(maxsize=256)
def _row_maker(names: tuple[str, ...]) -> Callable[..., dict[str, Any]]:
    """A function of one value per column that returns the row as a dict, built as a dict
    display: twice as fast as ``dict(zip(...))`` or the comprehension ``to_pylist`` runs.
    Keys are written with repr(), so any column name is a literal; duplicate names keep the
    last value, as ``to_pylist`` does."""
    args = ", ".join(f"_{i}" for i in range(len(names)))
    body = ", ".join(f"{name!r}: _{i}" for i, name in enumerate(names))
    return eval(f"lambda {args}: {{{body}}}")


# (decoded data, positions in the rows asked for or None for all of them, rows within it)
_Piece = tuple["_Shard", "np.ndarray | None", np.ndarray]


def _split(ids: np.ndarray) -> list[tuple[int, np.ndarray | None]]:
    """(id, positions holding it) for each distinct id, in id order; positions None when all
    ids are the same (the common case: no gather needed)."""
    first = int(ids[0])
    if (ids == first).all():
        return [(first, None)]
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    cuts = (np.flatnonzero(sorted_ids[1:] != sorted_ids[:-1]) + 1).tolist()
    return [
        (int(sorted_ids[a]), order[a:b]) for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)
    ]


def _take(data: _Shard, column: int, local: np.ndarray) -> list[Any]:
    """Python values of one column of a shard at ``local`` rows, in that order."""
    np_view = data.views[column]
    if np_view is not None:
        return np_view[local].tolist()
    array = data.arrays[column]
    if len(local) <= _CELL_ROWS:
        return [array[i].as_py() for i in local.tolist()]
    # The compute function called directly: Array.take() adds ~5 µs of Python per call.
    return _TAKE.call([array, int64_array(local)], _TAKE_OPTIONS).to_pylist()


def _rows(names: tuple[str, ...], values: list[list[Any]], n: int) -> list[dict[str, Any]]:
    if not names:
        return [{} for _ in range(n)]
    return list(map(_row_maker(names), *values))


def _merge_columns(
    parts: list[tuple[np.ndarray, View, list[list[Any]]]], n: int
) -> dict[str, list[Any]]:
    if len(parts) == 1:
        _, view, values = parts[0]
        return dict(zip(view.names, values, strict=True))
    out: dict[str, list[Any]] = {}
    for _, view, _ in parts:
        for name in view.names:
            out.setdefault(name, [None] * n)
    for positions, view, values in parts:
        where = positions.tolist()
        for name, column in zip(view.names, values, strict=True):
            target = out[name]
            for p, value in zip(where, column, strict=True):
                target[p] = value
    return out


def starts_of(view: View, shard: int) -> np.ndarray:
    """The first row of each row group of a shard of ``view`` (which has them), and its end."""
    starts = view.group_starts.get(shard)
    if starts is None:
        info = view.shards[shard].groups
        assert info is not None
        starts = view.group_starts[shard] = group_starts(info)
    return starts


def _whole(cache: ShardCache, store: Store, view: View, index: int) -> _Shard:
    snap = view.snap
    return cache.shard(store, view.shards[index], snap.schema, view.fingerprint, snap.version)


def row_source(
    cache: ShardCache, store: Store, view: View, index: int, local: int
) -> tuple[_Shard, int]:
    """The decoded data holding row ``local`` of shard ``index`` of ``view``, and the row's
    place in it: the whole shard when it is cached or has no row groups, else its row group."""
    shard = view.shards[index]
    snap = view.snap
    if shard.groups is None or cache.cached(shard, snap.schema, view.fingerprint):
        return _whole(cache, store, view, index), local
    starts = starts_of(view, index)
    group = int(np.searchsorted(starts, local, side="right")) - 1
    if not cache.has_groups(shard, snap.schema, view.fingerprint, [group]) and cache.reads_whole(
        store, shard, 1
    ):
        return _whole(cache, store, view, index), local
    entry = cache.groups(store, [(shard, [group])], snap.schema, view.fingerprint, snap.version)
    return entry[0][0], local - int(starts[group])


def pieces(cache: ShardCache, store: Store, view: View, rows: np.ndarray) -> list[_Piece]:
    """Where ``rows`` (in range, at least one) lie: per block of shards the cache holds as
    one table, else per shard or, for a shard read in part, per row group, the decoded data,
    the positions in ``rows`` it serves and the rows within it. The row groups the cache
    lacks are fetched in one storage call (concurrent ranged GETs on object stores)."""
    by_block: list[tuple[int, np.ndarray | None]]
    by_shard: list[tuple[int, np.ndarray | None]]
    if len(view.blocks) == 1:
        by_block = [(0, None)]
    else:
        by_block = _split(np.searchsorted(view.block_offsets, rows, side="right") - 1)
    out: list[_Piece] = []
    # Shards read by row group: (shard, positions, rows within it, [(group, sub)])
    partial: list[tuple[int, np.ndarray | None, np.ndarray, list[tuple[int, Any]]]] = []
    snap = view.snap
    for block, where in by_block:
        lo, hi = view.blocks[block]
        block_rows = rows if where is None else rows[where]
        if hi - lo > 1:
            entry = cache.block(view, block, store)
            if entry is not None:
                out.append((entry, where, block_rows - view.offsets[lo]))
                continue
            by_shard = _split(np.searchsorted(view.np_offsets, block_rows, side="right") - 1)
        else:
            by_shard = [(lo, None)]
        for index, sub in by_shard:
            shard_rows = block_rows if sub is None else block_rows[sub]
            here = sub if where is None else (where if sub is None else where[sub])
            local = shard_rows - view.offsets[index]
            shard = view.shards[index]
            if shard.groups is not None and len(shard.groups.rows) > 1:
                whole = cache.cached(shard, snap.schema, view.fingerprint)
                if whole is not None:
                    out.append((whole, here, local))
                    continue
                starts = starts_of(view, index)
                split = _split(np.searchsorted(starts, local, side="right") - 1)
                groups = [g for g, _ in split]
                if cache.has_groups(
                    shard, snap.schema, view.fingerprint, groups
                ) or not cache.reads_whole(store, shard, len(split)):
                    partial.append((index, here, local, split))
                    continue
            out.append((_whole(cache, store, view, index), here, local))
    if partial:
        wanted = [(view.shards[index], [g for g, _ in split]) for index, _, _, split in partial]
        decoded = cache.groups(store, wanted, snap.schema, view.fingerprint, snap.version)
        for (index, here, local, split), entries in zip(partial, decoded, strict=True):
            starts = starts_of(view, index)
            root = entries[0].root
            if len(entries) > 1 and all(e.base is root for e in entries):
                # Row groups decoded together: one piece over their decode (one take per
                # column for the shard, not one per group).
                at_parts: list[np.ndarray] = []
                row_parts: list[np.ndarray] = []
                for (group, sub), entry in zip(split, entries, strict=True):
                    assert sub is not None  # several groups: each serves some of the rows
                    at_parts.append(sub if here is None else here[sub])
                    row_parts.append(local[sub] - (int(starts[group]) - entry.start))
                out.append((root, np.concatenate(at_parts), np.concatenate(row_parts)))
                continue
            for (group, sub), entry in zip(split, entries, strict=True):
                at = here if sub is None else (sub if here is None else here[sub])
                group_rows = local if sub is None else local[sub]
                out.append((entry, at, group_rows - starts[group]))
    return out


def columns_at(cache: ShardCache, store: Store, view: View, rows: np.ndarray) -> list[list[Any]]:
    """The values of ``view.names`` at ``rows`` (in range), one list per column, in the
    order of ``rows``: one take per column per block, shard or row group touched, numeric
    columns through numpy, the pieces put back in order with one inverse permutation."""
    n = len(rows)
    cols = view.positions if view.positions is not None else range(len(view.names))
    if n == 0:
        return [[] for _ in cols]
    found = pieces(cache, store, view, rows)
    if len(found) == 1:
        data, where, local = found[0]
        if where is not None:
            # One piece need not hold the rows in the order asked: row groups decoded
            # together are one piece whose rows run group by group. Put them back.
            ordered = np.empty(n, dtype=local.dtype)
            ordered[where] = local
            local = ordered
        return [_take(data, c, local) for c in cols]
    inverse: list[int] | None = None
    out = []
    for c in cols:
        maybe = [data.views[c] for data, _, _ in found]
        np_views = [v for v in maybe if v is not None]
        if len(np_views) == len(maybe) and len({v.dtype for v in np_views}) == 1:
            gathered = np.empty(n, dtype=np_views[0].dtype)
            for v, (_, where, local) in zip(np_views, found, strict=True):
                gathered[where] = v[local]
            out.append(gathered.tolist())
            continue
        in_piece_order: list[Any] = []
        for data, _, local in found:
            in_piece_order += _take(data, c, local)
        if inverse is None:
            order = np.concatenate([where for _, where, _ in found])
            inv = np.empty(n, dtype=np.int64)
            inv[order] = np.arange(n)
            inverse = inv.tolist()
        out.append(list(map(in_piece_order.__getitem__, inverse)))
    return out


def arrow_batch(
    cache: ShardCache,
    store: Store,
    groups: list[tuple[np.ndarray, View, np.ndarray]],
    n: int,
    empty: View,
) -> pa.RecordBatch:
    """The rows of ``groups`` (positions in the batch, view, rows) as one record batch in
    the batch's order; ``empty`` gives the schema of a batch with no rows."""
    tables, positions = [], []
    for batch_positions, view, rows in groups:
        if len(rows) == 0:
            continue
        for data, where, local in pieces(cache, store, view, rows):
            table = data.table
            if view.positions is not None:
                table = table.select(view.positions)
            tables.append(table.take(int64_array(local)))
            positions.append(batch_positions if where is None else batch_positions[where])
    if not tables:
        schema = empty.snap.schema if empty.snap.schema is not None else pa.schema([])
        if empty.positions is not None:
            schema = pa.schema([schema.field(i) for i in empty.positions])
        return pa.RecordBatch.from_pylist([], schema=schema)
    try:
        table = pa.concat_tables(tables, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        # rows of several versions (a sampler's tagged indices) whose columns a reset let
        # change type: no one Arrow type holds both, the "rows" and "columns" formats can
        raise SchemaMismatchError(
            f"an arrow batch of {store.display_url} joins rows of versions whose columns "
            f"cannot be one Arrow schema ({exc}); read each version's rows in a batch of its "
            "own, or use batch_format='rows' or 'columns'"
        ) from None
    order = np.concatenate(positions)
    if not (order[1:] > order[:-1]).all():
        inverse = np.empty(n, dtype=np.int64)
        inverse[order] = np.arange(n)
        table = table.take(int64_array(inverse))
    if table.num_columns == 0:  # columns=[]: the rows' count is all there is
        return pa.RecordBatch.from_struct_array(pa.array([{}] * n, type=pa.struct([])))
    return table.combine_chunks().to_batches()[0]
