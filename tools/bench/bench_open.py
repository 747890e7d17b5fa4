"""Open the latest version and count its rows (issue 23.2), dynstate beside Lance, at 10,
1,000 and 5,000 versions of 64-row commits on local disk: `Store.open(url).snapshot().num_rows`
against `lance.dataset(uri).count_rows()`, each a new handle, alternating, several rounds.

dynstate is timed three ways: "repeat" (a later open in the same process, as a loader
worker's refresh or a long-lived service sees it: chunks and records whose bytes this process
decoded before are read and hashed but not parsed again), "first" (those per-process memos
cleared before each open, as the first open of a fresh process pays) and "first + list" (a
first open that also reads the head's shard list, ``snapshot().shards``: what reading its
rows needs first — a snapshot reads it only when asked, so counting rows does not). Lance is a
benchmark-only dependency. Never part of the tests.

    python tools/bench/bench_open.py                       # stores built once under --dir
    python tools/bench/bench_open.py --sizes 10,1000 --rounds 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import pyarrow as pa

from dynstate import Store
from dynstate.records import manifest as m


def small_round(k: int, rows: int = 64) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(k * rows, (k + 1) * rows), pa.int64()),
            "prompt": pa.array([f"task {k}.{j}" for j in range(rows)]),
        }
    )


def build(root: Path, versions: int) -> tuple[str, str | None]:
    """A dynstate store and (if pylance is installed) a Lance dataset of ``versions`` versions,
    built once under ``root``."""
    path, lpath = root / f"dynstate-{versions}", root / f"lance-{versions}"
    if not (path / ".complete").exists():
        store = Store.open(str(path), create=True)
        for k in range(store.refresh(), versions - 1):
            store.append(small_round(k), meta={"step": k})
        (path / ".complete").write_text(str(versions))
    try:
        import lance
    except ImportError:
        return str(path), None
    if not (lpath / ".complete").exists():
        # The same rounds as the store's (its version 0 is the empty store it was created as).
        lance.write_dataset(small_round(0), str(lpath), mode="overwrite")
        for k in range(1, versions - 1):
            lance.write_dataset(small_round(k), str(lpath), mode="append")
        (lpath / ".complete").write_text(str(versions))
    return str(path), str(lpath)


def _forget() -> None:
    """What a fresh process has not decoded yet (the memos of dynstate.records.manifest; absent
    before issue 23, so the same script times an older checkout)."""
    for memo in ("_DECODED", "_RECORDS"):
        getattr(m, memo, {}).clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".bench-out/open", help="where stores are built once")
    parser.add_argument("--sizes", default="10,1000,5000", help="versions per store")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}; median [min] of {args.rounds} rounds, ms")  # fmt: skip
    for versions in [int(s) for s in args.sizes.split(",")]:
        url, lance_uri = build(root, versions)
        times: dict[str, list[float]] = {"repeat": [], "first": [], "list": [], "lance": []}
        rows = Store.open(url).snapshot().num_rows  # warm the page cache and the memos
        for _ in range(args.rounds):
            t = time.perf_counter()
            assert Store.open(url).snapshot().num_rows == rows
            times["repeat"].append(time.perf_counter() - t)
            _forget()
            t = time.perf_counter()
            assert Store.open(url).snapshot().num_rows == rows
            times["first"].append(time.perf_counter() - t)
            _forget()
            t = time.perf_counter()
            assert len(Store.open(url).snapshot().shards) == versions - 1
            times["list"].append(time.perf_counter() - t)
            if lance_uri is not None:
                import lance

                t = time.perf_counter()
                assert lance.dataset(lance_uri).count_rows() == rows
                times["lance"].append(time.perf_counter() - t)
        med = {k: 1e3 * statistics.median(v) for k, v in times.items() if v}
        low = {k: 1e3 * min(v) for k, v in times.items() if v}
        line = (f"  {versions:>5,} versions ({rows:,} rows): dynstate repeat "
                f"{med['repeat']:.2f} [{low['repeat']:.2f}], first {med['first']:.2f} "
                f"[{low['first']:.2f}], first + list {med['list']:.2f} "
                f"[{low['list']:.2f}]")  # fmt: skip
        if "lance" in med:
            line += (f"; Lance {med['lance']:.2f} [{low['lance']:.2f}]; ratio repeat "
                     f"{med['repeat'] / med['lance']:.2f}x, first "
                     f"{med['first'] / med['lance']:.2f}x")  # fmt: skip
        print(line)


if __name__ == "__main__":
    main()
