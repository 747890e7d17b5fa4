"""Cold open + first batch (issue 23.1), side by side in one process: a fresh
``VersionedDataset`` on a 1M-row, 100-shard store reading 256 random rows, against
``datasets.load_from_disk`` + ``ds[list]`` and ``lance.dataset`` + ``take`` on the same rows,
each round with new handles and new random indices (the OS page cache stays warm for all:
dropping it would disturb the other users of the machine). Reported: medians, per-round
ratios, the load average around each figure. Then the same store on the loopback S3 server:
the first batch's time and the bytes its shard reads fetched, against the store's size.

Targets: cold open + first batch <= 2x HF and <= Lance; on S3 bytes read <= 5 % of the store.

``--fresh N`` adds N rounds in which each contender's open + first batch is the first call of
a fresh interpreter (its library imported before the clock starts): what the in-process
rounds, which warm each contender up once, do not show — a lazy import or a first-use set-up
on the read path (pyarrow imported pandas on dynstate's first batch until 2026-12-02).

    python tools/bench/bench_cold.py                              # 1M rows, 100 shards
    python tools/bench/bench_cold.py --row-groups 1024,4096,16384 # the row-group size sweep
    python tools/bench/bench_cold.py --rows 200000 --skip-s3      # quicker
    python tools/bench/bench_cold.py --skip-s3 --fresh 9          # and in fresh processes

Lance (``pylance``) and ``datasets`` are benchmark-only dependencies, never imported by the
library.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: loopback_s3

from bench_resume import rows_table

import dynstate.records.rowgroups as rowgroups
from dynstate import Store, VersionedDataset
from dynstate import fresh as kept_rounds

BATCH = 256
# The store's shards read from Parquet: no decoded files (the commit writes them locally).
NO_DECODED = "dynstate columns, Parquet only"


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def build(url: str, table: pa.Table, shards: int, **options: Any) -> Store:
    store = Store.open(url, create=True, **options)
    per = table.num_rows // shards
    for k in range(shards):
        store.append(table.slice(k * per, per))
    return store


def _ours(
    url: str, options: dict[str, Any], fmt: str, decoded: bool = True
) -> Callable[[list[int]], Any]:
    def run(idx: list[int]) -> Any:
        ds = VersionedDataset(url, storage_options=options, cache_dir=None)
        if decoded:
            return ds.read_batch(idx, fmt)
        # The Parquet path alone: as on a machine that did not write the store (no decoded
        # files the commit or an earlier reader left; docs/api.md).
        os.environ["DYNSTATE_DECODED_CACHE"] = "0"
        try:
            return ds.read_batch(idx, fmt)
        finally:
            del os.environ["DYNSTATE_DECODED_CACHE"]

    return run


def build_whole(url: str, table: pa.Table, shards: int, **options: Any) -> Store:
    """The store as dynstate wrote it before row groups were recorded (one row group per
    shard, no ``groups`` in the entries): every read fetches and verifies shards whole."""
    import pyarrow.parquet as pq

    import dynstate.writes as writes

    def whole(part: pa.Table, sink: Any, row_group_rows: int | None = None) -> None:
        pq.write_table(part, sink)

    saved = writes.write_shard
    writes.write_shard = whole  # type: ignore[assignment]
    try:
        return build(url, table, shards, **options)
    finally:
        writes.write_shard = saved


def contenders(root: Path, table: pa.Table, url: str) -> dict[str, Callable[[list[int]], Any]]:
    import datasets
    import lance

    hf_path = root / "hf"
    if not hf_path.exists():
        datasets.Dataset(table).save_to_disk(str(hf_path))
    lance_path = root / "lance"
    if not lance_path.exists():
        lance.write_dataset(table, str(lance_path))

    def hf(idx: list[int]) -> Any:
        return datasets.load_from_disk(str(hf_path))[idx]  # a dict of column lists

    def lance_take(idx: list[int]) -> Any:
        return lance.dataset(str(lance_path)).take(idx).to_pydict()

    cases = {
        "dynstate columns": _ours(url, {}, "columns"),
        "dynstate rows": _ours(url, {}, "rows"),
        NO_DECODED: _ours(url, {}, "columns", decoded=False),
        "HF load_from_disk+ds[list]": hf,
        "Lance dataset+take": lance_take,
    }
    whole = root / "store-whole"
    if whole.exists():
        cases["dynstate columns, whole shards"] = _ours(str(whole), {}, "columns")
    return cases


def rounds(cases: dict[str, Callable[[list[int]], Any]], n: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {name: [] for name in cases}
    loads = []
    for case in cases.values():
        case(rng.choice(n, BATCH, replace=False).tolist())  # imports, first-touch pages
    for r in range(repeats):
        idx = rng.choice(n, BATCH, replace=False).tolist()
        names = list(cases) if r % 2 == 0 else list(cases)[::-1]
        for name in names:
            t = time.perf_counter()
            cases[name](idx)
            times[name].append(time.perf_counter() - t)
        loads.append(os.getloadavg()[0])
    return {"times": times, "load": loads}


# One contender's open + first batch as the first call of a fresh interpreter, its library
# imported before the clock starts; prints the seconds it took.
FRESH = """
import sys, time
import numpy as np
kind, path, seed, n, batch = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
idx = np.random.default_rng(seed).choice(n, batch, replace=False).tolist()
if kind == "dynstate columns":
    from dynstate import VersionedDataset
    def run():
        return VersionedDataset(path, cache_dir=None).read_batch(idx, "columns")
elif kind == "HF load_from_disk+ds[list]":
    import datasets
    def run():
        return datasets.load_from_disk(path)[idx]
else:
    import lance
    def run():
        return lance.dataset(path).take(idx).to_pydict()
t = time.perf_counter()
run()
print(time.perf_counter() - t)
"""


def fresh_rounds(root: Path, url: str, n: int, repeats: int) -> dict[str, Any]:
    paths = {
        "dynstate columns": url,
        "HF load_from_disk+ds[list]": str(root / "hf"),
        "Lance dataset+take": str(root / "lance"),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    loads = []
    for r in range(repeats):
        names = list(paths) if r % 2 == 0 else list(paths)[::-1]
        for name in names:
            done = subprocess.run(
                [sys.executable, "-c", FRESH, name, paths[name], str(1000 + r), str(n), str(BATCH)],
                capture_output=True,
                text=True,
                check=True,
            )
            times[name].append(float(done.stdout.split()[-1]))
        loads.append(os.getloadavg()[0])
    return {"times": times, "load": loads}


def report(label: str, result: dict[str, Any]) -> None:
    times = result["times"]
    print(
        f"\n{label} — {len(times['dynstate columns'])} rounds, 1-min load during the rounds "
        f"{min(result['load']):.2f}-{max(result['load']):.2f}"
    )
    for name, ts in times.items():
        ms = [t * 1e3 for t in ts]
        print(f"  {name:31s} median {statistics.median(ms):7.1f} ms  [{min(ms):.1f}-{max(ms):.1f}]")
    peers = ["HF load_from_disk+ds[list]", "Lance dataset+take"]
    if "dynstate columns, whole shards" in times:
        peers.append("dynstate columns, whole shards")
    for mine in ("dynstate columns", NO_DECODED):
        if mine not in times:
            continue
        for peer in peers:
            ratios = [a / b for a, b in zip(times[mine], times[peer], strict=True)]
            print(
                f"  {mine} / {peer:31s} median {statistics.median(ratios):.2f}x "
                f"[{min(ratios):.2f}-{max(ratios):.2f}]"
            )


def bench_s3(table: pa.Table, shards: int, repeats: int, baseline: bool) -> None:
    from loopback_s3 import loopback_s3

    with loopback_s3("bench-cold") as server:
        options = {"endpoint_url": server.endpoint}
        url = "s3://bench-cold/store"
        build(url, table, shards, storage_options=options)
        first_batch_s3(server, url, options, table, repeats, "row groups")
        if baseline:
            url = "s3://bench-cold/whole"
            build_whole(url, table, shards, storage_options=options)
            first_batch_s3(server, url, options, table, repeats, "whole shards (before)")


def first_batch_s3(
    server: Any, url: str, options: dict[str, Any], table: pa.Table, repeats: int, label: str
) -> None:
    refs = Store.open(url, storage_options=options).snapshot().shards
    shards, total = len(refs), sum(s.bytes for s in refs)
    rng = np.random.default_rng(1)
    fetched, times, requests = [], [], []
    for _ in range(repeats):
        # A fresh disk cache too: a shard read whole is kept there and would cost no request.
        cache_dir = tempfile.mkdtemp(prefix="bench-cold-cache-")
        ds = VersionedDataset(url, storage_options=options, cache_dir=cache_dir)
        storage = ds.store.storage
        got = [0]
        cat_ranges, cat = storage._cat_ranges, storage._cat

        def counted_ranges(ranges, _f=cat_ranges, _got=got):
            out = _f(ranges)
            _got[0] += sum(len(b) for b in out)
            return out

        def counted_cat(rel, _f=cat, _got=got):
            out = _f(rel)
            if rel.startswith("data/"):
                _got[0] += len(out)
            return out

        storage._cat_ranges, storage._cat = counted_ranges, counted_cat
        mark = server.count()
        idx = rng.choice(table.num_rows, BATCH, replace=False).tolist()
        t = time.perf_counter()
        ds.read_batch(idx, "columns")
        times.append(time.perf_counter() - t)
        requests.append(server.count() - mark)
        fetched.append(got[0])
        shutil.rmtree(cache_dir, ignore_errors=True)
    share = [f / total * 100 for f in fetched]
    print(
        f"\nloopback S3, {label}: first batch of {BATCH} random rows with a fresh dataset "
        f"(store {total / 2**20:.1f} MiB in {shards} shards), load {_load()}:"
    )
    print(
        f"  time median {statistics.median(times) * 1e3:.0f} ms "
        f"[{min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}], requests median "
        f"{statistics.median(requests):.0f}"
    )
    print(
        f"  shard bytes read median {statistics.median(fetched) / 2**20:.2f} MiB = "
        f"{statistics.median(share):.1f} % of the store [{min(share):.1f}-{max(share):.1f}]"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--row-groups",
        default=None,
        help="comma-separated rows per row group to build and measure (default: the "
        "library's, 256 locally and 128 on S3)",
    )
    parser.add_argument("--dir", default=None, help="where to build (default: a temp folder)")
    parser.add_argument(
        "--fresh", type=int, default=0, help="rounds in fresh interpreters, after the others"
    )
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--only-s3", action="store_true")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also time a store written as before row groups were recorded (read whole)",
    )
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-cold-"))
    root.mkdir(parents=True, exist_ok=True)
    table = rows_table(args.rows)
    print(
        f"{args.rows:,} rows ({table.nbytes / 2**20:.0f} MiB in Arrow), {args.shards} shards, "
        f"batch {BATCH}; load at start {_load()} (1/5/15 min; {os.cpu_count()} CPUs)"
    )
    chosen = args.row_groups is not None
    sizes = [int(s) for s in args.row_groups.split(",")] if chosen else [rowgroups.ROW_GROUP_ROWS]
    try:
        if args.baseline and not args.only_s3:
            shutil.rmtree(root / "store-whole", ignore_errors=True)
            build_whole(str(root / "store-whole"), table, args.shards)
        for size in [] if args.only_s3 else sizes:
            rowgroups.ROW_GROUP_ROWS = size
            path = root / f"store-{size}"
            shutil.rmtree(path, ignore_errors=True)
            store = build(str(path), table, args.shards)
            # Cold means as a new process finds it: not the tables this one kept of its
            # commits (dynstate/fresh.py). The decoded files the commits wrote stay; the
            # "Parquet only" case reads without them.
            kept_rounds.FRESH.max_bytes = 0
            kept_rounds.FRESH.clear()
            total = sum(s.bytes for s in store.snapshot().shards)
            cases = contenders(root, table, str(path))
            result = rounds(cases, args.rows, args.repeats)
            report(f"row groups of {size} rows, store {total / 2**20:.1f} MiB", result)
            if args.fresh:
                fresh = fresh_rounds(root, str(path), args.rows, args.fresh)
                report(f"fresh interpreters, row groups of {size} rows", fresh)
        if not args.skip_s3:
            if chosen:  # S3 stores are written with OBJECT_STORE_GROUP_ROWS
                size = sizes[-1] if len(sizes) == 1 else sizes[0]
                rowgroups.OBJECT_STORE_GROUP_ROWS = size
            bench_s3(table, args.shards, args.repeats, args.baseline)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
