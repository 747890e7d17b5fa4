"""VersionedDataset: a map-style dataset over one version of a store, safe in DataLoader
workers, with a bounded shard cache.

The index encoding and the dataset: the process-local state a worker rebuilds after
unpickling (``_view``, ``store``, ``cache``). What a read needs of one version lives in
:mod:`.view`, batch assembly in :mod:`.batch`."""

from __future__ import annotations

import bisect
import operator
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from ..errors import InvalidDataError, RowOutOfRangeError, VersionNotFoundError
from ..records.codec import whole
from ..records.columns import int64_array
from ..snapshot import Snapshot
from ..store import Store
from .batch import _merge_columns, _row_maker, _rows, arrow_batch, columns_at, row_source
from .cache import DEFAULT_CACHE_BYTES, ShardCache
from .view import View

BATCH_FORMATS = ("rows", "columns", "arrow")


# Sampler indices carry the version they were drawn from in their high bits, so a DataLoader
# worker reads the row from exactly the version the sampler pinned, even if its own copy of
# the dataset is older or the store was reset since. Plain ints: 30x cheaper to send to a
# worker than an int subclass with an attribute.
_ROW_BITS = 40
_ROW_MASK = (1 << _ROW_BITS) - 1


def encode_index(version: int, row: int) -> int:
    """An index meaning "row ``row`` of version ``version``" (rows < 2**40). Anything else
    would name another row (row 2**40 of version 1 is row 0 of version 2; version -1 a plain
    row): :class:`InvalidDataError`."""
    v, r = whole(version), whole(row)
    if v is None or r is None:
        raise InvalidDataError(
            f"encode_index takes a whole version and row, not {version!r} and {row!r}"
        )
    if v < 0 or not 0 <= r < 1 << _ROW_BITS:
        raise InvalidDataError(
            f"encode_index(version={v}, row={r}): a version >= 0 and a row from 0 to 2**40 - 1"
        )
    return ((v + 1) << _ROW_BITS) | r


def _is_bool(value: Any) -> bool:
    """A boolean (Python's, numpy's or a tensor's), which ``operator.index`` and numpy take
    for 0 or 1: a mask's element is no row."""
    return isinstance(value, (bool, np.bool_)) or "bool" in str(getattr(value, "dtype", ""))


def decode_index(index: int) -> tuple[int | None, int]:
    """(version or None, row) of a dataset index; plain row numbers have no version."""
    if _is_bool(index):
        raise InvalidDataError(
            f"a dataset index is an int (a row, or a VersionedSampler index), not the boolean "
            f"{index!r}; pass the row number"
        )
    try:
        # an int or what stands for one (numpy ints, an int tensor), never a float truncated
        # or a string parsed: a row nobody asked for
        index = operator.index(index)
    except TypeError:
        raise InvalidDataError(
            f"a dataset index is an int (a row, or a VersionedSampler index), not {index!r}"
        ) from None
    if index < 0:
        raise RowOutOfRangeError(
            f"negative row index {index}; VersionedDataset indices are row numbers from 0"
        )
    if index <= _ROW_MASK:
        return None, index
    return (index >> _ROW_BITS) - 1, index & _ROW_MASK


def _column_names(columns: Sequence[str] | None) -> list[str] | None:
    """``columns`` as a list of distinct names: one name given as a string is not read as its
    letters, and a name asked twice would give an Arrow batch two fields of one name."""
    if columns is None:
        return None
    if isinstance(columns, (str, bytes)) or not all(isinstance(c, str) for c in columns):
        raise InvalidDataError(
            f"columns must be a list of column names, not {columns!r}; e.g. columns=['prompt']"
        )
    names = list(columns)
    twice = sorted({c for c in names if names.count(c) > 1})
    if twice:
        raise InvalidDataError(f"columns names {twice} more than once; name each column once")
    return names


class VersionedDataset(Dataset):
    """Map-style dataset over one version (a number, a tag, or None for the head) of a store.

    It pickles without rows, so DataLoader workers receive it cheaply and reopen the store
    themselves. Indices from :class:`~dynstate.VersionedSampler` carry their version; a plain
    index beyond the pinned version moves the dataset to the store's head.

    ``ds[i]`` returns one row as a dict. ``ds.__getitems__(indices)`` — what a DataLoader
    calls for a batch — returns a list of row dicts by default; with
    ``batch_format="columns"`` a dict of column lists, with ``"arrow"`` a
    ``pyarrow.RecordBatch`` (pass a ``collate_fn`` that takes that batch). :meth:`read_batch`
    gives any format without changing the dataset's.

    ``row_column="_dynstate_row"`` adds the row's number in its version to every item, under
    that name (an int64 column in the columnar formats): what a generator writes into the
    reserved ``_dynstate_source`` column of the rows it derives from a batch, since row ``i``
    of a version is row ``i`` of every later version of its lineage. The name must not be a
    column of the store.

    >>> ds = VersionedDataset("memory://doc/store")          # doctest: +SKIP
    >>> ds[0]                                                 # doctest: +SKIP
    {'prompt': '1+1', 'answer': '2'}
    """

    def __init__(
        self,
        store_or_url: Store | str,
        version: int | str | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_dir: str | None = None,
        columns: Sequence[str] | None = None,
        batch_format: str = "rows",
        row_column: str | None = None,
    ) -> None:
        if row_column is not None and (not isinstance(row_column, str) or not row_column):
            raise InvalidDataError(
                f"row_column must be a column name (a non-empty string) or None, not "
                f"{row_column!r}; e.g. row_column='_dynstate_row'"
            )
        if batch_format not in BATCH_FORMATS:
            raise InvalidDataError(
                f"batch_format must be one of {BATCH_FORMATS}, not {batch_format!r}"
            )
        if isinstance(store_or_url, Store):
            self._store: Store | None = store_or_url
            self.url = store_or_url.url
            self.storage_options = store_or_url.storage_options
        else:
            self._store = None
            self.url = str(store_or_url)
            self.storage_options = dict(storage_options or {})
        self.cache_bytes = cache_bytes
        self.cache_dir = cache_dir
        self.columns = _column_names(columns)
        self.batch_format = batch_format
        self.row_column = row_column
        self._pid = os.getpid()
        self._cache: ShardCache | None = None
        self._views: dict[int, View] = {}
        store = self.store
        self.store_id = store.store_id
        self.version = store.resolve(version)
        if version is None:
            store._looked_at(self.version)  # a dataset moving to the head (docs/outcomes.md)
        if row_column is not None:
            self._view(self.version)  # a name clash is refused here, not at the first batch

    # -- per-process state -------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = None
        state["_cache"] = None
        state["_views"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("batch_format", "rows")
        self.__dict__.setdefault("row_column", None)
        self.__dict__.setdefault("_views", {})
        self._pid = -1  # reopen lazily in this process

    @property
    def store(self) -> Store:
        if self._store is None or self._pid != os.getpid():
            # A forked worker must not share the parent's filesystem clients or caches.
            self._store = Store.open(self.url, storage_options=self.storage_options)
            self._cache = None
            self._views = {}
            self._pid = os.getpid()
        return self._store

    @property
    def cache(self) -> ShardCache:
        store = self.store
        if self._cache is None:
            disk = None
            if not store.reads_in_place:
                base = self.cache_dir or os.path.join(tempfile.gettempdir(), "dynstate-cache")
                disk = os.path.join(base, store.store_id)
            self._cache = ShardCache(self.cache_bytes, disk)
        return self._cache

    # -- versions ----------------------------------------------------------------------------

    def snapshot(self, version: int | None = None) -> Snapshot:
        return self.store.snapshot(self.version if version is None else version)

    def pin(self, version: int | str | None) -> int:
        """Move to ``version`` (None: the head); returns the version number."""
        self.version = self.store.resolve(version)
        if version is None:
            self.store._looked_at(self.version)
        return self.version

    def refresh(self) -> int:
        """Move to the store's head."""
        return self.pin(None)

    def _view(self, version: int) -> View:
        store = self.store  # first: a new process starts with no views
        view = self._views.get(version)
        if view is None:
            view = View(
                store.snapshot(version), self.columns, store.display_url, self.cache_bytes // 4
            )
            if self.row_column is not None and self.row_column in view.names:
                raise InvalidDataError(
                    f"row_column={self.row_column!r} is a column of version {version} of "
                    f"{store.display_url}; pass another name for the row numbers"
                )
            if len(self._views) >= 16:
                self._views.pop(next(iter(self._views)))
            self._views[version] = view
        return view

    def _plain_view(self, row: int) -> View:
        """The view a plain (version-less) row number is read from."""
        view = self._view(self.version)
        if row >= view.num_rows:
            # Rows appended after this copy was made (e.g. in a worker): follow the head.
            view = self._view(self.refresh())
        return view

    def _tagged_view(self, version: int, index: int) -> View:
        """The view of the version a sampler index names. An index past 2**40 that names a
        version the store never had is a row number out of range, not a missing version."""
        try:
            return self._view(version)
        except VersionNotFoundError:
            head = self.store.refresh()
            if version <= head:
                raise  # a version that existed (removed by gc, or below a reset): as it says
            raise RowOutOfRangeError(
                f"index {index} is out of range for {self.store.display_url}: not a row "
                f"number (version {self.version if self.version is not None else head} has "
                f"{self.snapshot().num_rows} rows) nor an index VersionedSampler yields (it "
                f"would name version {version}, past the latest, {head}); use an index below "
                "len(dataset)"
            ) from None

    def _out_of_range(self, view: View, row: int) -> RowOutOfRangeError:
        return RowOutOfRangeError(
            f"row {row} out of range for version {view.snap.version} of "
            f"{self.store.display_url} ({view.num_rows} rows); use an index below "
            "len(dataset), or the indices VersionedSampler yields"
        )

    # -- access ------------------------------------------------------------------------------

    def prefetch(self, version: int, indices: Sequence[int]) -> None:
        """Start downloading the shards that hold ``indices`` of ``version`` (remote stores)."""
        if self.store.reads_in_place:
            return  # local shards are read where they lie: nothing to warm
        view = self._view(version)
        rows = np.asarray(indices, dtype=np.int64)
        rows = rows[(rows >= 0) & (rows < view.num_rows)]
        wanted = np.unique(np.searchsorted(view.np_offsets, rows, side="right") - 1)
        self.cache.prefetch(self.store, [view.shards[i] for i in wanted.tolist()])

    def __len__(self) -> int:
        return self.snapshot().num_rows

    def __getitem__(self, index: int) -> dict[str, Any]:
        try:
            version, row = decode_index(index)
        except InvalidDataError:
            raise InvalidDataError(
                f"a dataset index must be an int (a row, or a VersionedSampler index) for "
                f"{self.url}, not {index!r}; use __getitems__ or read_batch for several"
            ) from None
        view = self._plain_view(row) if version is None else self._tagged_view(version, index)
        if row >= view.num_rows:
            raise self._out_of_range(view, row)
        data = None
        if len(view.shards) > 1:
            block = bisect.bisect_right(view.block_starts, row) - 1
            lo, hi = view.blocks[block]
            if hi - lo > 1:
                data = self.cache.block(view, block, self.store)
                local = row - view.offsets[lo]
        if data is None:
            shard = bisect.bisect_right(view.offsets, row) - 1
            data, local = row_source(self.cache, self.store, view, shard, row - view.offsets[shard])
        positions = view.positions if view.positions is not None else range(len(view.names))
        values = []
        for c in positions:
            np_view = data.views[c]
            values.append(
                np_view.item(local) if np_view is not None else data.arrays[c][local].as_py()
            )
        out = _row_maker(view.names)(*values)
        if self.row_column is not None:
            out[self.row_column] = row
        return out

    def __getitems__(self, indices: Sequence[int]) -> Any:
        """Several rows at once, in the order of ``indices`` (duplicates allowed): a list of
        row dicts, or the dataset's ``batch_format``."""
        return self.read_batch(indices, self.batch_format)

    def read_batch(self, indices: Sequence[int], format: str = "rows") -> Any:
        """The rows at ``indices``, in order: ``"rows"``, a list of dicts (what ``ds[i]``
        gives, one per index); ``"columns"``, a dict of column lists; ``"arrow"``, a
        ``pyarrow.RecordBatch``. Rows of versions with fewer columns (older schema) have
        None there in the columnar formats."""
        if format not in BATCH_FORMATS:
            raise InvalidDataError(f"format must be one of {BATCH_FORMATS}, not {format!r}")
        idx = self._index_array(indices)
        groups = self._groups(idx)
        n = len(idx)
        if format == "arrow":
            empty = groups[0][1] if groups else self._view(self.version)
            batch = arrow_batch(self.cache, self.store, groups, n, empty)
            if self.row_column is None:
                return batch
            numbers = int64_array(self._row_numbers(groups, n))
            return batch.append_column(self.row_column, numbers)
        cache, store = self.cache, self.store
        parts = [
            (positions, view, columns_at(cache, store, view, rows))
            for positions, view, rows in groups
        ]
        if format == "columns":
            columns = _merge_columns(parts, n)
            if self.row_column is not None:
                columns[self.row_column] = self._row_numbers(groups, n)
            return columns
        if len(parts) == 1:
            _, view, values = parts[0]
            out = _rows(view.names, values, n)
        else:
            out = [{} for _ in range(n)]  # every position is filled below
            for positions, view, values in parts:
                for p, row in zip(
                    positions.tolist(), _rows(view.names, values, len(positions)), strict=True
                ):
                    out[p] = row
        if self.row_column is not None:
            for item, number in zip(out, self._row_numbers(groups, n), strict=True):
                item[self.row_column] = number
        return out

    @staticmethod
    def _row_numbers(groups: list[tuple[np.ndarray, View, np.ndarray]], n: int) -> list[int]:
        """The row number (in its version) of each index of a batch, in the batch's order."""
        numbers = np.empty(n, dtype=np.int64)
        for positions, _, rows in groups:
            numbers[positions] = rows
        return numbers.tolist()

    # -- batch internals ---------------------------------------------------------------------

    def _index_array(self, indices: Sequence[int]) -> np.ndarray:
        """``indices`` as int64, refused unless they are a flat sequence of ints: a float is
        not truncated, a string not parsed, a nested list not flattened and a boolean mask
        not read as rows 0 and 1 (each would return rows nobody asked for)."""
        what = (
            f"dataset indices must be a flat sequence of non-negative ints (rows, or "
            f"VersionedSampler's indices) for {self.url}"
        )
        if isinstance(indices, (str, bytes)):
            raise InvalidDataError(f"{what}, not the string {indices!r}")
        if isinstance(indices, (list, tuple)) and any(type(i) is not int for i in indices):
            # numpy reads [True, 2] as the ints [1, 2]: find a boolean before it does (a
            # sampler's plain ints skip this pass)
            flag = next((i for i in indices if _is_bool(i)), None)
            if flag is not None:
                raise InvalidDataError(f"{what}, not the boolean {flag!r}; pass row numbers")
        try:
            raw = np.asarray(indices)
        except (TypeError, ValueError) as exc:
            raise InvalidDataError(f"{what}: {exc}") from None
        if raw.ndim != 1:
            shape = "one index" if raw.ndim == 0 else f"an array of shape {raw.shape}"
            raise InvalidDataError(f"{what}, not {shape}; ds[i] reads one row")
        if raw.size == 0:
            return np.empty(0, dtype=np.int64)
        kind = raw.dtype.kind
        if kind == "b":
            raise InvalidDataError(
                f"{what}, not a boolean mask; pass the rows it selects (numpy.flatnonzero(mask))"
            )
        if kind == "u" and raw.dtype.itemsize == 8 and int(raw.max()) > np.iinfo(np.int64).max:
            raise RowOutOfRangeError(f"row index {int(raw.max())} for {self.url} is out of range")
        if kind == "O":  # Python ints past int64, or a mix: each must be an int itself
            values = []
            for item in raw.tolist():
                try:
                    values.append(operator.index(item))
                except TypeError:
                    raise InvalidDataError(f"{what}, not {item!r}") from None
            if max(values) > np.iinfo(np.int64).max:
                raise RowOutOfRangeError(f"row index {max(values)} for {self.url} is out of range")
            if min(values) < 0:
                raise RowOutOfRangeError(
                    f"negative row index {min(values)} for {self.url}; VersionedDataset indices "
                    "are row numbers from 0"
                )
            return np.array(values, dtype=np.int64)
        elif kind not in "iu":
            first = raw.reshape(-1)[0]
            raise InvalidDataError(f"{what}, not {raw.dtype} values such as {first!r}")
        return raw.astype(np.int64, copy=False)

    def _groups(self, idx: np.ndarray) -> list[tuple[np.ndarray, View, np.ndarray]]:
        """(positions in the batch, view, rows) per version the batch reads, rows checked;
        ``idx``: :meth:`_index_array`'s."""
        if len(idx) and idx.min() < 0:
            raise RowOutOfRangeError(
                f"negative row index {int(idx[idx < 0][0])} for {self.url}; VersionedDataset "
                "indices are row numbers from 0"
            )
        tags = idx >> _ROW_BITS
        if len(idx) == 0 or tags.min() == tags.max():
            split = [(np.arange(len(idx)), int(tags[0]) if len(idx) else 0, idx & _ROW_MASK)]
        else:
            split = []
            for tag in np.unique(tags).tolist():
                positions = np.flatnonzero(tags == tag)
                split.append((positions, tag, idx[positions] & _ROW_MASK))
        groups = []
        for positions, tag, rows in split:
            top = int(rows.max()) if len(rows) else -1
            view = (
                self._plain_view(top)
                if tag == 0
                else self._tagged_view(tag - 1, int(idx[positions[0]]))
            )
            if top >= view.num_rows:
                raise self._out_of_range(view, top)
            groups.append((positions, view, rows))
        return groups

    def __repr__(self) -> str:
        return f"VersionedDataset({self.store.display_url!r}, version={self.version})"
