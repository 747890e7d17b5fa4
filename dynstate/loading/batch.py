"""Batch assembly for :class:`~dynstate.VersionedDataset`: column values gathered from decoded
shards, and rows or columns built from them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .cache import _Shard

if TYPE_CHECKING:
    from .dataset import _View

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
    return _TAKE.call([array, pa.array(local)], _TAKE_OPTIONS).to_pylist()


def _rows(names: tuple[str, ...], values: list[list[Any]], n: int) -> list[dict[str, Any]]:
    if not names:
        return [{} for _ in range(n)]
    return list(map(_row_maker(names), *values))


def _merge_columns(
    parts: list[tuple[np.ndarray, _View, list[list[Any]]]], n: int
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
