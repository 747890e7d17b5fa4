"""One large round (issue 23.2): ``Store.append`` of a ~99 MB Arrow table beside what a user
would pick instead, in one process, on the same local disk, alternating, several rounds:

* pylance 14.0.2 ``lance.write_dataset(table, uri, mode="append")``,
* deltalake 1.6.6 ``write_deltalake(uri, table, mode="append")``,
* ``pyarrow.parquet.write_table`` to a new file, then an fsync of it (the least a durable
  Parquet round costs), and a bare ``write_table`` (page cache only),
* and ``Store.append`` again with the shard sink inline (hashing and writing on the
  encoder's thread, as before its writer thread): the A/B of that thread.

Each contender first gets a 10-row slice of the table so that every timed call is a steady
state append. The order rotates every round; the load average is recorded before and after.
Reported: median [min-max] per contender and the median of the per-round ratios to dynstate.
Then (unless ``--no-profile``) one append of the same table is split into Parquet's encoder
(as ``write_table`` runs it, and with dynstate's layout: shards of 64 MiB, row groups of the
random-access size, no statistics, the dictionaries ``write_shard`` picks per column), the
per-row-group hashing, the whole-shard hashing, the write and fsync, write_shard to disk
with the sink's writer thread and without, and what is left (the commit); one shard is
encoded under dynstate's and pyarrow's dictionary settings; and a cProfile of one append.

Never part of the tests; Lance and Delta are benchmark-only dependencies
(``pip install 'dynstate[bench]'``).

    python tools/bench/bench_round.py                      # 99 MB, 5 rounds, and the profile
    python tools/bench/bench_round.py --mb 20 --repeats 3  # quicker
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import math
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_store import _fsync_file as _fsync
from bench_store import big_table

from dynstate import Store
from dynstate.records.rowgroups import dictionary_columns
from dynstate.storage import base as storage_base
from dynstate.storage.base import ShardSink


def contenders(base: Path, table: pa.Table) -> dict[str, Callable[[int], None]]:
    """name -> one append of ``table`` (round ``i``), each set up with a first small slice."""
    import lance
    from deltalake import write_deltalake

    first = table.slice(0, 10)
    store = Store.open(str(base / "dynstate"), create=True)
    store.append(first)
    lance_uri = str(base / "lance")
    lance.write_dataset(first, lance_uri)
    delta_uri = str(base / "delta")
    write_deltalake(delta_uri, first)
    files = base / "parquet"
    files.mkdir()

    def write_fsync(i: int) -> None:
        path = files / f"round-{i}.parquet"
        pq.write_table(table, path)
        _fsync(path)

    inline = Store.open(str(base / "dynstate-inline"), create=True)
    inline.append(first)

    def append_inline(i: int) -> None:
        """The same append with the shard sink hashing and writing on the encoder's thread
        (as before issue 23): the A/B of its writer thread, interleaved with the rest."""
        saved = storage_base.PIPELINE_AFTER
        storage_base.PIPELINE_AFTER = 1 << 62
        try:
            inline.append(table)
        finally:
            storage_base.PIPELINE_AFTER = saved

    return {
        "dynstate append": lambda i: store.append(table),
        "  sink inline": append_inline,
        "lance append": lambda i: lance.write_dataset(table, lance_uri, mode="append"),
        "delta append": lambda i: write_deltalake(delta_uri, table, mode="append"),
        "write_table+fsync": write_fsync,
        "write_table": lambda i: pq.write_table(table, files / f"bare-{i}.parquet"),
    }


def side_by_side(base: Path, table: pa.Table, repeats: int) -> None:
    runs = contenders(base, table)
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    loads = [os.getloadavg()[0]]
    for i in range(repeats):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            started = time.perf_counter()
            runs[name](i)
            times[name].append(time.perf_counter() - started)
        loads.append(os.getloadavg()[0])
    ours = times["dynstate append"]
    print(f"\n{repeats} rounds, rotating order, load {min(loads):.1f}-{max(loads):.1f}")
    print(f"  {'':20} {'median':>8}  {'[min-max]':17} dynstate/this (median of rounds)")
    for name in names:
        spread = times[name]
        ratio = statistics.median(a / b for a, b in zip(ours, spread, strict=True))
        print(f"  {name:20} {statistics.median(spread):7.3f} s  [{min(spread):.3f}-"
              f"{max(spread):.3f}]  {ratio:5.2f}x")  # fmt: skip


class _Null(io.RawIOBase):
    """A Python file object that drops what it is given, so that pyarrow calls back into
    Python for each write exactly as it does with dynstate's hashing sink."""

    def __init__(self) -> None:
        self.size = 0
        self.calls = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.size += n
        self.calls += 1
        return n

    def tell(self) -> int:
        return self.size


class _Buffered:
    """ShardSink's hashing, with the bytes gathered into 1 MiB writes (a prototype, to
    measure what pyarrow's many small writes cost dynstate's sink in system calls)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._hash = hashlib.sha256()
        self._pending = bytearray()
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._hash.update(view)
        self._pending += view
        if len(self._pending) >= 1 << 20:
            self.drain()
        self.size += view.nbytes
        return view.nbytes

    def drain(self) -> None:
        view = memoryview(self._pending)
        while view:
            view = view[os.write(self._fd, view) :]
        self._pending = bytearray()

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass


def _best(fn: Callable[[], Any], repeats: int) -> float:
    """Fastest of ``repeats`` runs: the work's cost with the least of the machine's noise."""
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return min(out)


def encodings(part: pa.Table, rows: int, repeats: int) -> None:
    """One shard encoded with dynstate's layout (its per-column dictionaries, then pyarrow's
    and other settings), beside ``write_table``'s defaults, and the same for a table of
    low-cardinality columns (what a setting that saves time on distinct values costs where
    the dictionary pays)."""
    import numpy as np

    def layout(data: pa.Table, **options: Any) -> Callable[[], int]:
        # write_shard's own settings, the dictionaries it picks per column included
        options.setdefault("use_dictionary", dictionary_columns(data, rows))

        def run() -> int:
            sink = _Null()
            with pq.ParquetWriter(sink, data.schema, write_statistics=False, **options) as w:
                for start in range(0, data.num_rows, rows):
                    w.write_table(data.slice(start, rows), row_group_size=rows)
            return sink.size

        return run

    def defaults(data: pa.Table) -> Callable[[], int]:
        def run() -> int:
            sink = _Null()
            pq.write_table(data, sink)
            return sink.size

        return run

    rng = np.random.default_rng(0)
    n = part.num_rows
    low = pa.table({
        "reward": pa.array(rng.integers(0, 2, n).astype("float64")),
        "generator": pa.array(np.array(["gen-a", "gen-b", "gen-c"])[rng.integers(0, 3, n)]),
        "step": pa.array(np.repeat(np.arange(n // 4096 + 1), 4096)[:n]),
    })  # fmt: skip
    print(f"\nEncoding one shard ({n:,} rows, {rows:,} a row group), fastest of {repeats}, "
          f"load {os.getloadavg()[0]:.1f}:")  # fmt: skip
    for label, data in (("this table", part), ("low-cardinality columns", low)):
        cases = {
            "write_table defaults": defaults(data),
            "dynstate's layout": layout(data),
            "  use_dictionary=True (pyarrow's)": layout(data, use_dictionary=True),
            "  use_dictionary=False": layout(data, use_dictionary=False),
            "  dictionary_pagesize_limit=16 KiB": layout(data, dictionary_pagesize_limit=16384),
        }
        print(f"  {label}:")
        for name, run in cases.items():
            size = run()
            print(f"    {name:36} {_best(run, repeats):6.3f} s  {size / 2**20:6.1f} MB")


def profile(base: Path, table: pa.Table, repeats: int) -> None:
    """Where one append of ``table`` spends its time, each step timed alone (fastest of
    ``repeats``), then a cProfile of one append."""
    from dynstate import writes
    from dynstate.records import rowgroups

    shard_bytes = writes.DEFAULT_SHARD_BYTES
    per_shard = max(1, math.ceil(table.num_rows * shard_bytes / max(table.nbytes, 1)))
    parts = [table.slice(s, per_shard) for s in range(0, table.num_rows, per_shard)]
    rows = max(rowgroups.ROW_GROUP_ROWS, -(-parts[0].num_rows // rowgroups.MAX_ROW_GROUPS))
    # write_shard's per-column choice, so that the encoder's lines time what it really runs
    dictionary = [dictionary_columns(part, rows) for part in parts]

    def encode_default() -> None:
        pq.write_table(table, pa.BufferOutputStream())

    def encode_layout(sink_of: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            for part, dictionaries in zip(parts, dictionary, strict=True):
                with pq.ParquetWriter(
                    sink_of(), part.schema, write_statistics=False, use_dictionary=dictionaries
                ) as writer:
                    for start in range(0, part.num_rows, rows):
                        writer.write_table(part.slice(start, rows), row_group_size=rows)

        return run

    def segments() -> None:
        for part in parts:
            rowgroups.write_shard(part, _Null())

    encoded = []
    for part in parts:
        sink = pa.BufferOutputStream()
        rowgroups.write_shard(part, sink)
        encoded.append(sink.getvalue())

    def whole_hash() -> None:
        for data in encoded:
            hashlib.sha256(memoryview(data)).hexdigest()

    out = base / "profile"
    out.mkdir()
    counter = iter(range(10**6))

    def write_fsync() -> None:
        k = next(counter)
        for j, data in enumerate(encoded):
            path = out / f"w{k}-{j}.parquet"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync(out)  # the directory

    def to_disk(sink_of: Callable[[int], Any]) -> Callable[[], None]:
        """write_shard of each part into ``sink_of(fd)`` on a new file, fsynced (+ the dir)."""

        def run() -> None:
            k = next(counter)
            for j, part in enumerate(parts):
                fd = os.open(out / f"s{k}-{j}.parquet", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    sink = sink_of(fd)
                    rowgroups.write_shard(part, sink)
                    if hasattr(sink, "drain"):
                        sink.drain()
                    if hasattr(sink, "finish"):
                        sink.finish()
                    os.fsync(fd)
                finally:
                    os.close(fd)
            _fsync(out)  # the directory

        return run

    def inline_sink(fd: int) -> ShardSink:
        return ShardSink(fd, pipeline_after=1 << 62)

    store = Store.open(str(base / "profiled"), create=True)
    store.append(table.slice(0, 10))
    steps = {
        "encode, write_table's settings (in memory)": _best(encode_default, repeats),
        "encode, dynstate's layout (in memory)": _best(
            encode_layout(pa.BufferOutputStream), repeats
        ),
        "  same through a Python sink": _best(encode_layout(_Null), repeats),
        "  + per-row-group SHA-256 (write_shard)": _best(segments, repeats),
        "whole-shard SHA-256 (ShardSink)": _best(whole_hash, repeats),
        "write + fsync of the bytes, dir fsync": _best(write_fsync, repeats),
        "write_shard -> ShardSink(fd) + fsyncs": _best(to_disk(ShardSink), repeats),
        "  same, sink inline (no writer thread)": _best(to_disk(inline_sink), repeats),
        "  same, sink writing 1 MiB at a time": _best(to_disk(_Buffered), repeats),
        "Store.append, all of it": _best(lambda: store.append(table), repeats),
    }
    null = _Null()
    rowgroups.write_shard(parts[0], null)
    print(f"\nOne append of {table.nbytes / 2**20:.0f} MB Arrow = {len(parts)} shard(s), "
          f"{sum(len(d) for d in encoded) / 2**20:.0f} MB Parquet, {rows:,} rows per row group; "
          f"fastest of {repeats}, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"  (pyarrow calls the Python sink {null.calls:,} times for a shard of "
          f"{null.size / 2**20:.0f} MB)")  # fmt: skip
    for name, seconds in steps.items():
        print(f"  {name:44} {seconds:6.3f} s")
    shards = steps["write_shard -> ShardSink(fd) + fsyncs"]
    print(f"  {'left for the commit (append - the shards)':44} "
          f"{steps['Store.append, all of it'] - shards:6.3f} s")  # fmt: skip
    encodings(parts[0], rows, repeats)
    prof = cProfile.Profile()
    prof.enable()
    store.append(table)
    prof.disable()
    print("\ncProfile of one append (tottime):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=100, help="table size (bench_store's shape)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=".bench-out", help="where the stores are written")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="round-", dir=args.dir))
    try:
        table = big_table(args.mb)
        print(f"table: {table.num_rows:,} rows, {table.nbytes / 2**20:.0f} MB Arrow; "
              f"pyarrow {pa.__version__}, python {sys.version.split()[0]}, "
              f"{os.cpu_count()} CPUs, under {base}")  # fmt: skip
        side_by_side(base, table, args.repeats)
        if not args.no_profile:
            profile(base, table, args.repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
