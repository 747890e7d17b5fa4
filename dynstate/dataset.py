"""VersionedDataset: a map-style dataset over one version of a store, safe in DataLoader
workers, with a bounded shard cache."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from torch.utils.data import Dataset

from . import manifest as m
from .errors import DynstateError
from .rounds import conform
from .snapshot import Snapshot, verify_shard_bytes
from .store import Store

log = logging.getLogger("dynstate")

DEFAULT_CACHE_BYTES = 512 * 2**20
_CELL_ROWS = 32


# Sampler indices carry the version they were drawn from in their high bits, so a DataLoader
# worker reads the row from exactly the version the sampler pinned, even if its own copy of
# the dataset is older or the store was reset since. Plain ints: 30x cheaper to send to a
# worker than an int subclass with an attribute.
_ROW_BITS = 40
_ROW_MASK = (1 << _ROW_BITS) - 1


def encode_index(version: int, row: int) -> int:
    """An index meaning "row ``row`` of version ``version``" (rows < 2**40)."""
    return ((version + 1) << _ROW_BITS) | row


def decode_index(index: int) -> tuple[int | None, int]:
    """(version or None, row) of a dataset index; plain row numbers have no version."""
    index = int(index)
    if index < 0:
        raise IndexError(f"negative row index {index}")
    if index <= _ROW_MASK:
        return None, index
    return (index >> _ROW_BITS) - 1, index & _ROW_MASK


class ShardCache:
    """Decoded shards in memory, least-recently-used first out, bounded in bytes. Remote shards
    are also kept on local disk (bounded too) so that re-reading them costs no request."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, disk_dir: str | None = None):
        self.max_bytes = max_bytes
        self.disk_dir = disk_dir
        self._tables: OrderedDict[str, pa.Table] = OrderedDict()
        self._cells: dict[str, tuple[list[str], list[pa.ChunkedArray]]] = {}
        self._bytes = 0
        self._disk: OrderedDict[str, int] = OrderedDict()
        self._disk_bytes = 0
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        self.hits = 0
        self.misses = 0

    def get(self, store: Store, shard: m.ShardRef, schema: pa.Schema | None, version: int):
        key = shard.sha256
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                self._tables.move_to_end(key)
                self.hits += 1
                return table if schema is None else conform(table, schema)
        self.misses += 1
        table = self._load(store, shard, version)
        with self._lock:
            if key not in self._tables:
                self._tables[key] = table
                self._bytes += table.nbytes
                while self._bytes > self.max_bytes and len(self._tables) > 1:
                    gone, old = self._tables.popitem(last=False)
                    self._cells.pop(gone, None)
                    self._bytes -= old.nbytes
        return table if schema is None else conform(table, schema)

    def cells(self, store: Store, shard: m.ShardRef, schema: pa.Schema | None, version: int):
        """(column names, columns) of a shard for cell-by-cell reads; kept with the cached table
        because building them costs ~10 µs, as much as reading a row."""
        cells = self._cells.get(shard.sha256)
        if cells is None:
            table = self.get(store, shard, schema, version)
            cells = (table.column_names, table.columns)
            with self._lock:
                if self._tables.get(shard.sha256) is table:  # not conformed: same every time
                    self._cells[shard.sha256] = cells
        else:
            with self._lock:
                if shard.sha256 in self._tables:
                    self._tables.move_to_end(shard.sha256)
                    self.hits += 1
        return cells

    def _load(self, store: Store, shard: m.ShardRef, version: int) -> pa.Table:
        if store.storage.local or self.disk_dir is None:
            return pq.read_table(pa.BufferReader(store.read_shard_bytes(shard, version=version)))
        path = os.path.join(self.disk_dir, f"{shard.sha256}.parquet")
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            verify_shard_bytes(data, shard, f"local cache of {store.display_url}")
        except (OSError, DynstateError):
            data = store.read_shard_bytes(shard, version=version)
            self._remember_on_disk(path, shard, data)
        return pq.read_table(pa.BufferReader(data))

    def prefetch(self, store: Store, shards: Sequence[m.ShardRef]) -> None:
        """Download remote ``shards`` into the disk cache in the background, so that the
        process that reads them next (often a DataLoader worker sharing the cache folder)
        finds them local. A no-op for local stores."""
        if store.storage.local or self.disk_dir is None:
            return
        for shard in shards:
            path = os.path.join(self.disk_dir, f"{shard.sha256}.parquet")
            with self._lock:
                if shard.sha256 in self._inflight or os.path.exists(path):
                    continue
                self._inflight.add(shard.sha256)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(2, thread_name_prefix="dynstate-prefetch")
            self._pool.submit(self._fetch_to_disk, store, shard, path)

    def _fetch_to_disk(self, store: Store, shard: m.ShardRef, path: str) -> None:
        try:
            self._remember_on_disk(path, shard, store.read_shard_bytes(shard))
        except DynstateError as exc:  # the reader will fetch it itself and report
            log.debug("prefetch of %s failed: %s", shard.path, exc)
        finally:
            with self._lock:
                self._inflight.discard(shard.sha256)

    def _remember_on_disk(self, path: str, shard: m.ShardRef, data: bytes) -> None:
        try:
            os.makedirs(self.disk_dir, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            log.debug("shard cache write failed: %s", exc)
            return
        with self._lock:
            self._disk[shard.sha256] = len(data)
            self._disk_bytes += len(data)
            while self._disk_bytes > self.max_bytes and len(self._disk) > 1:
                old, size = self._disk.popitem(last=False)
                self._disk_bytes -= size
                try:
                    os.unlink(os.path.join(self.disk_dir, f"{old}.parquet"))
                except OSError:
                    pass


class VersionedDataset(Dataset):
    """Map-style dataset over one version (a number, a tag, or None for the head) of a store.

    It pickles without rows, so DataLoader workers receive it cheaply and reopen the store
    themselves. Indices from :class:`~dynstate.VersionedSampler` carry their version; a plain
    index beyond the pinned version moves the dataset to the store's head.

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
    ) -> None:
        if isinstance(store_or_url, Store):
            self._store: Store | None = store_or_url
            self.url = store_or_url.url
            self.storage_options = store_or_url.storage.storage_options
        else:
            self._store = None
            self.url = str(store_or_url)
            self.storage_options = dict(storage_options or {})
        self.cache_bytes = cache_bytes
        self.cache_dir = cache_dir
        self.columns = list(columns) if columns is not None else None
        self._pid = os.getpid()
        self._cache: ShardCache | None = None
        store = self.store
        self.store_id = store.store_id
        self.version = store.resolve(version)

    # -- per-process state -------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = None
        state["_cache"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = -1  # reopen lazily in this process

    @property
    def store(self) -> Store:
        if self._store is None or self._pid != os.getpid():
            # A forked worker must not share the parent's filesystem clients or caches.
            self._store = Store.open(self.url, storage_options=self.storage_options)
            self._cache = None
            self._pid = os.getpid()
        return self._store

    @property
    def cache(self) -> ShardCache:
        store = self.store
        if self._cache is None:
            disk = None
            if not store.storage.local:
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
        return self.version

    def refresh(self) -> int:
        """Move to the store's head."""
        return self.pin(None)

    # -- access ------------------------------------------------------------------------------

    def prefetch(self, version: int, indices: Sequence[int]) -> None:
        """Start downloading the shards that hold ``indices`` of ``version`` (remote stores)."""
        if self.store.storage.local:
            return  # local shards are read where they lie: nothing to warm
        snap = self.store.snapshot(version)
        wanted = {snap.locate(int(i))[0] for i in indices if 0 <= i < snap.num_rows}
        self.cache.prefetch(self.store, [snap.shards[i] for i in sorted(wanted)])

    def __len__(self) -> int:
        return self.snapshot().num_rows

    def _snapshot_for(self, version: int | None, row: int) -> Snapshot:
        if version is not None:
            return self.store.snapshot(version)
        snap = self.snapshot()
        if row >= snap.num_rows:
            # Rows appended after this copy was made (e.g. in a worker): follow the head.
            self.refresh()
            snap = self.snapshot()
        return snap

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Fetch several rows at once, one decode per shard touched."""
        out: list[dict[str, Any] | None] = [None] * len(indices)
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        snaps: dict[int | None, Snapshot] = {}  # by the index's version: ~5 µs saved per row
        for pos, index in enumerate(indices):
            version, row = decode_index(index)
            snap = snaps.get(version)
            if snap is None or row >= snap.num_rows:
                snap = snaps[version] = self._snapshot_for(version, row)
            shard, row = snap.locate(row)
            groups.setdefault((snap.version, shard), []).append((pos, row))
        for (version, shard), wanted in groups.items():
            snap = self.store.snapshot(version)
            positions = [row for _, row in wanted]
            if len(positions) <= _CELL_ROWS and self.columns is None:
                # take() costs ~100 µs per call whatever its size, a cell ~3 µs: up to ~32 rows
                # (random access, a batch spread over shards) are faster read cell by cell.
                ref = snap.shards[shard]
                names, columns = self.cache.cells(self.store, ref, snap.schema, version)
                cells = list(zip(names, columns, strict=True))
                rows = [{n: c[r].as_py() for n, c in cells} for r in positions]
            else:
                table = self.cache.get(self.store, snap.shards[shard], snap.schema, version)
                if self.columns is not None:
                    table = table.select(self.columns)
                rows = table.take(positions).to_pylist()
            for (pos, _), row in zip(wanted, rows, strict=True):
                out[pos] = row
        return out  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"VersionedDataset({self.store.display_url!r}, version={self.version})"
