"""The shard cache: decoded shards and row groups in memory, least recently used first out,
bounded in bytes, with remote shards also kept (bounded) on local disk and prefetched there in
the background. A shard whose row groups its commit recorded is read a row group at a time
(:mod:`.ranged`) until most of it is wanted; once all its row groups are decoded they are
joined into the whole shard, which can then join a block.

A shard decoded whole is also written, once, as an Arrow IPC file in a folder on local disk
(:class:`Decoded`), and every later read of it in any process — a DataLoader worker, the next
epoch's workers, a resumed run — maps that file instead of decoding the Parquet again: the
file is named by the shard's content checksums and, on a local store, by the shard file's
identity and change times, so it never answers for other bytes."""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from .. import fresh
from ..decoded import Decoded, switched_on
from ..errors import DynstateError
from ..records import manifest as m
from ..records.manifest import cache_id
from ..records.rounds import conform
from ..records.rowgroups import read_parquet
from ..snapshot import verify_shard_bytes
from ..store import Store
from .ranged import Footers, read_groups
from .view import View

log = logging.getLogger("dynstate")

DEFAULT_CACHE_BYTES = 512 * 2**20


def _key(
    shard: m.ShardRef, schema: pa.Schema | None, fingerprint: str | None
) -> tuple[tuple[str, str], str | None]:
    """A whole decoded shard's cache key: its :func:`cache_id` and the schema it was
    conformed to (None: as written)."""
    return (cache_id(shard), fingerprint if schema is not None else None)


def _numpy_view(column: pa.Array | pa.ChunkedArray) -> np.ndarray | None:
    """A zero-copy numpy view of a null-free integer or float column, whose ``tolist()`` gives
    exactly the Python values Arrow's ``as_py()`` gives, ~10x faster; None for other columns."""
    if not isinstance(column, pa.Array) or column.null_count:
        return None
    t = column.type
    if pa.types.is_integer(t):
        dtype = np.dtype(f"{'i' if pa.types.is_signed_integer(t) else 'u'}{t.bit_width // 8}")
    elif pa.types.is_float32(t) or pa.types.is_float64(t):
        dtype = np.dtype(f"f{t.bit_width // 8}")
    else:
        return None
    # From the data buffer, not Array.to_numpy: that imports pandas (when installed, as
    # with datasets or verl) on its first call, ~0.1 s of a fresh process's first batch.
    data = column.buffers()[1]
    if data is None:  # an empty array may have no data buffer
        view = np.empty(0, dtype)
    else:
        view = np.frombuffer(data, dtype, len(column), column.offset * dtype.itemsize)
    view.flags.writeable = False  # the decoded shard's own memory, shared by every read
    return view


class _Shard:
    """A decoded shard shaped like its version's schema, with what reads need prepared once:
    one contiguous array per column (a take() on a chunked column concatenates it first) and
    numpy views of the numeric ones.

    A part (:meth:`split`) is ``rows`` rows of a ``base`` from ``start`` on, cached under its
    row group's key; its own table, arrays and views are sliced only when first used — a
    batch reads the rows of a decode through its base (one piece per decoded shard, not one
    per row group)."""

    __slots__ = ("arrays", "base", "names", "nbytes", "rows", "start", "table", "views")

    def __init__(self, table: pa.Table):
        columns = table.columns
        if any(c.num_chunks > 1 for c in columns):
            try:
                table = table.combine_chunks()
                columns = table.columns
            except (pa.ArrowInvalid, pa.ArrowCapacityError):
                pass  # a string column over 2 GiB stays chunked: slower reads, same rows
        self.table = table
        self.names = tuple(table.schema.names)
        self.arrays: list[pa.Array | pa.ChunkedArray] = [
            c.chunk(0) if c.num_chunks == 1 else c for c in columns
        ]
        self.views = [_numpy_view(a) for a in self.arrays]
        # What the entry keeps alive: its buffers whole (a slice holds all of its parent's).
        # Summed without walking offsets: ~30x cheaper than Table.nbytes, paid per decode.
        self.nbytes = table.get_total_buffer_size()
        self.base: _Shard | None = None  # a whole decode is its own base (no cycle)
        self.start = 0
        self.rows = table.num_rows

    def __getattr__(self, name: str) -> Any:
        # Only reached for an unset slot: a part's table, arrays or views, sliced now.
        base = object.__getattribute__(self, "base")
        if base is None or name not in ("table", "arrays", "views"):
            raise AttributeError(name)
        start, n = self.start, self.rows
        self.table = base.table.slice(start, n)
        self.arrays = [a.slice(start, n) for a in base.arrays]
        self.views = [None if v is None else v[start : start + n] for v in base.views]
        return object.__getattribute__(self, name)

    @property
    def root(self) -> _Shard:
        """The decode this one's rows lie in (itself, or a part's base)."""
        return self if self.base is None else self.base

    def split(self, counts: Sequence[int]) -> list[_Shard]:
        """Consecutive runs of ``counts`` rows (summing to this one's rows) as parts that share
        this one's arrays and views: a decode of a few row groups of a shard prepares its
        columns once, not once per group."""
        if len(counts) == 1:
            return [self]
        out, start = [], 0
        total = max(1, self.rows)
        base = self.root
        for n in counts:
            part = _Shard.__new__(_Shard)
            part.names = self.names
            part.nbytes = self.nbytes * n // total
            part.base = base
            part.start = self.start + start
            part.rows = n
            out.append(part)
            start += n
        return out


def _block_name(key: tuple[Any, ...], parts: list[str]) -> str:
    """A block's file name: one digest of its cache key (the parts' digest and the schema
    fingerprint they were conformed to) and its shards' file names (:meth:`Decoded.name`)."""
    return m.sha256((repr(key) + "".join(parts)).encode())


class ShardCache:
    """Decoded shards in memory, least-recently-used first out, bounded in bytes. Remote shards
    are also kept on local disk (bounded too) so that re-reading them costs no request."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, disk_dir: str | None = None):
        self.max_bytes = max_bytes
        self.disk_dir = disk_dir
        self.decoded = Decoded(
            os.path.join(disk_dir, "decoded") if disk_dir is not None and switched_on() else None,
            max_bytes,
        )
        # Keyed by (checksum, schema fingerprint): a shard read under a newer, wider schema
        # is conformed once, not on every read; a row group by (checksum, fingerprint, group);
        # a block by ("block", fingerprint, digest).
        self._shards: OrderedDict[tuple[Any, ...], _Shard] = OrderedDict()
        self.footers = Footers()
        self._partial: dict[str, int] = {}  # row groups fetched so far, by shard checksum
        self._bytes = 0
        self._disk: OrderedDict[str, int] = OrderedDict()
        self._disk_bytes = 0
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """Bytes of decoded shards held now (at most ``max_bytes``, or one shard above it)."""
        return self._bytes

    def shard(
        self,
        store: Store,
        shard: m.ShardRef,
        schema: pa.Schema | None,
        fingerprint: str | None,
        version: int,
    ) -> _Shard:
        entry = self.cached(shard, schema, fingerprint)
        if entry is not None:
            return entry
        key = _key(shard, schema, fingerprint)
        with self._lock:
            self.misses += 1
        # A shard this process committed is taken as it wrote it (:mod:`dynstate.fresh`),
        # and conformed below like any other.
        table = fresh.FRESH.get(shard)
        name = folder = None
        if table is None:
            name = self.decoded.name(store, shard)  # before the bytes are read (its docstring)
            folder = self.decoded.folder
            if name is not None and folder is not None:
                table = self.decoded.read_named(folder, name, shard.rows)
        if table is None:
            table = self._load(store, shard, version)
            if name is not None and folder is not None:
                self.decoded.write_named(folder, name, table)
        entry = _Shard(conform(table, schema) if schema is not None else table)
        with self._lock:
            if key not in self._shards:
                self._shards[key] = entry
                self._bytes += entry.nbytes
                if shard.groups is not None:  # row groups read earlier are now redundant
                    for g in range(len(shard.groups.rows)):
                        old = self._shards.pop((*key, g), None)
                        if old is not None:
                            self._bytes -= old.nbytes
                self._evict()
        return entry

    def cached(self, shard: m.ShardRef, schema: pa.Schema | None, fingerprint: str | None):
        """The whole shard if it is decoded already, else None."""
        key = _key(shard, schema, fingerprint)
        with self._lock:
            entry = self._shards.get(key)
            if entry is not None:
                self._shards.move_to_end(key)
                self.hits += 1
            return entry

    def has_groups(
        self, shard: m.ShardRef, schema: pa.Schema | None, fingerprint: str | None, groups: Any
    ) -> bool:
        """Whether every row group in ``groups`` of the shard is decoded already."""
        fp = fingerprint if schema is not None else None
        cid = cache_id(shard)
        return all((cid, fp, g) in self._shards for g in groups)

    def reads_whole(self, store: Store, shard: m.ShardRef, groups: int) -> bool:
        """Whether a read that needs ``groups`` of the shard's row groups should read it
        whole: no row groups recorded (an older store), all of them wanted (one range, one
        decode), or a copy on the local disk cache. Decoding costs about its rows, so any
        row group skipped saves more than the extra pieces cost."""
        info = shard.groups
        if info is None or groups >= len(info.rows) or fresh.FRESH.has(shard):
            return True  # (a shard this process just committed: no decode at all)
        if self.decoded.has(store, shard):
            return True  # decoded by another process: a map, cheaper than any decode
        # A shard read again and again (a loader's epoch over a store the cache holds) is
        # read whole once a quarter of it has been asked for: one decode instead of dozens
        # of row-group reads until every group has been seen. A cold batch, or a store far
        # larger than the cache, keeps reading row groups.
        seen = self._partial.get(shard.sha256, 0)
        if 4 * (seen + groups) >= len(info.rows) and 3 * shard.bytes <= self.max_bytes // 4:
            return True
        if store.reads_in_place or self.disk_dir is None:
            return False
        return os.path.exists(os.path.join(self.disk_dir, f"{shard.sha256}.parquet"))

    def groups(
        self,
        store: Store,
        wanted: Sequence[tuple[m.ShardRef, Sequence[int]]],
        schema: pa.Schema | None,
        fingerprint: str | None,
        version: int,
    ) -> list[list[_Shard]]:
        """The decoded row groups ``wanted`` (shard, sorted group numbers), shaped like
        ``schema``; those not cached are fetched together in one storage call."""
        fp = fingerprint if schema is not None else None
        out: list[list[_Shard | None]] = []
        missing: list[tuple[int, m.ShardRef, list[int]]] = []
        with self._lock:
            for shard, groups in wanted:
                found: list[_Shard | None] = []
                lacking = []
                cid = cache_id(shard)
                for g in groups:
                    key = (cid, fp, g)
                    entry = self._shards.get(key)
                    if entry is None:
                        lacking.append(g)
                        self.misses += 1
                    else:
                        self._shards.move_to_end(key)
                        self.hits += 1
                    found.append(entry)
                if lacking:
                    missing.append((len(out), shard, lacking))
                out.append(found)
        if missing:
            tables = read_groups(store, [(s, g) for _, s, g in missing], version, self.footers)
            for (k, shard, lacking), decoded in zip(missing, tables, strict=True):
                info = shard.groups
                assert info is not None
                whole = _Shard(conform(decoded, schema) if schema is not None else decoded)
                parts = whole.split([info.rows[g] for g in lacking])
                entries = dict(zip(lacking, parts, strict=True))
                row = out[k]
                for i, g in enumerate(wanted[k][1]):
                    if row[i] is None:
                        row[i] = entries[g]
                with self._lock:
                    if len(self._partial) > 65536:
                        self._partial.clear()  # a hint only: forgetting costs group reads
                    self._partial[shard.sha256] = self._partial.get(shard.sha256, 0) + len(lacking)
                    cid = cache_id(shard)
                    for g, entry in entries.items():
                        key = (cid, fp, g)
                        if key not in self._shards:
                            self._shards[key] = entry
                            self._bytes += entry.nbytes
                    self._join(shard, fp)
                    self._evict()
        return out  # type: ignore[return-value]  # every None was filled above

    def _join(self, shard: m.ShardRef, fp: str | None) -> None:
        """With the lock held: once every row group of ``shard`` is decoded, replace them by
        the whole shard (one take per column for a batch, and it can join a block)."""
        assert shard.groups is not None
        cid = cache_id(shard)
        if (cid, fp) in self._shards:
            return
        # Called after every decode of a few groups of a shard with dozens: stop at the
        # first group missing (group 0 for most of a cold batch's shards).
        shards = self._shards
        keys = []
        for g in range(len(shard.groups.rows)):
            key = (cid, fp, g)
            if key not in shards:
                return
            keys.append(key)
        parts = [shards[key] for key in keys]
        try:
            entry = _Shard(pa.concat_tables([p.table for p in parts]))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            return
        for key in keys:
            old = self._shards.pop(key)
            self._bytes -= old.nbytes
        self._shards[(cid, fp)] = entry
        self._bytes += entry.nbytes

    def block(self, view: View, block: int, store: Store) -> _Shard | None:
        """Consecutive shards of a version as one contiguous table, so that a batch spread
        over them costs one take per column instead of one per shard. Formed only from
        shards already decoded (a concatenation, no decode: a cache too small to hold them
        never forms blocks, and random reads keep per-shard granularity), or mapped from
        the decoded file of the block that an earlier process formed; the parts leave the
        cache when their block enters it."""
        key = view.block_keys[block]
        if key is None:
            return None  # a block of one shard is that shard
        with self._lock:
            entry = self._shards.get(key)
            if entry is not None:
                self._shards.move_to_end(key)
                self.hits += 1
                return entry
            if block in view.too_big:
                return None
            parts = view.parts(block)
        lo, hi = view.blocks[block]
        rows = (view.offsets[hi] if hi < len(view.offsets) else view.num_rows) - view.offsets[lo]
        folder = self.decoded.where(store)
        name = None
        if folder is not None:
            names = [self.decoded.name(store, s) for s in view.shards[lo:hi]]
            if None not in names:
                name = _block_name(key, names)  # type: ignore[arg-type]  # no None, above
        if folder is not None and name is not None:
            mapped = self.decoded.read_named(folder, name, rows)
            if mapped is not None:
                entry = _Shard(mapped)
                if entry.nbytes > self.max_bytes // 4:
                    view.too_big.add(block)  # written under a larger cache: not here
                    return None
                return self._enter_block(key, parts, entry)
        with self._lock:
            found = []
            for part in parts:
                entry = self._shards.get(part)
                if entry is None:
                    return None  # not all decoded yet (or evicted): read shard by shard
                found.append(entry)
            if sum(p.nbytes for p in found) > self.max_bytes // 4:
                view.too_big.add(block)  # decoded sizes do not change: never ask again
                return None
        tables = [p.table for p in found]
        try:
            entry = _Shard(pa.concat_tables(tables))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            return None  # parts that do not line up (never for one version's shards)
        if folder is not None and name is not None:
            # Named by the parts' files and the schema they were conformed to: a process
            # that later reads this version maps the block, not its parts one by one.
            self.decoded.write_named(folder, name, entry.table)
        return self._enter_block(key, parts, entry)

    def _enter_block(self, key: tuple[Any, ...], parts: list[Any], entry: _Shard) -> _Shard:
        with self._lock:
            if key not in self._shards:
                self._shards[key] = entry
                self._bytes += entry.nbytes
                for part in parts:
                    old = self._shards.pop(part, None)
                    if old is not None:
                        self._bytes -= old.nbytes
                self._evict()
            return self._shards.get(key, entry)

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and len(self._shards) > 1:
            _, old = self._shards.popitem(last=False)
            self._bytes -= old.nbytes

    def _load(self, store: Store, shard: m.ShardRef, version: int) -> pa.Table:
        if store.reads_in_place or self.disk_dir is None:
            return read_parquet(store.read_shard_bytes(shard, version=version))
        path = os.path.join(self.disk_dir, f"{shard.sha256}.parquet")
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            verify_shard_bytes(data, shard, f"local cache of {store.display_url}")
        except (OSError, DynstateError):
            data = store.read_shard_bytes(shard, version=version)
            self._remember_on_disk(path, shard, data)
        return read_parquet(data)

    def prefetch(self, store: Store, shards: Sequence[m.ShardRef]) -> None:
        """Download remote ``shards`` into the disk cache in the background, so that the
        process that reads them next (often a DataLoader worker sharing the cache folder)
        finds them local. A no-op for local stores."""
        if store.reads_in_place or self.disk_dir is None:
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
        if self.disk_dir is None:
            return
        disk_dir = self.disk_dir
        try:
            os.makedirs(disk_dir, exist_ok=True)
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
                    os.unlink(os.path.join(disk_dir, f"{old}.parquet"))
                except OSError:
                    pass
