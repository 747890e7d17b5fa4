"""Small commit beside Lance and Delta (issue 23.2): one 64-row append on a kept handle, at
10 and 1,000 versions (optionally 5,000), local disk, in one process, alternating, several
rounds: ``Store.append`` on a kept :class:`dynstate.Store` against pylance's
``LanceDataset.insert`` (``write_dataset(..., mode="append")`` on a kept dataset) and
deltalake's ``write_deltalake(table, ..., mode="append")`` on a kept ``DeltaTable``.

dynstate fsyncs the shard, its folder, the record and the log folder before ``append``
returns (SPEC §3.1); Lance and Delta call no fsync on a local disk (strace shows none). The
library has no switch to turn fsync off, so the row "dynstate, fsync patched out" replaces
``os.fsync`` with a no-op in this process around those appends only (a measurement of what
the four fsyncs cost, never a mode of the library); "dynstate, sync not overlapped" runs the
shards' fsyncs inline again, before the record is written (what the overlap of the two
flushes changes). Lance and Delta are the ``bench`` extra, never imported by the library.
Never part of the tests.

    python tools/bench/bench_commit.py                    # 10 and 1,000 versions, 41 rounds
    python tools/bench/bench_commit.py --sizes 10,1000,5000 --rounds 61
    python tools/bench/bench_commit.py --pause-ms 10      # each append after a pause
    python tools/bench/bench_commit.py --profile          # where dynstate's append goes

Each timed append starts after an untimed ``os.sync()`` (``--no-settle``: without), in an order
drawn afresh each round (``--rotate``: rotated, as before 2026-12-02).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import os
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from dynstate import Store


def small_round(k: int, rows: int = 64) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(k * rows, (k + 1) * rows), pa.int64()),
            "prompt": pa.array([f"task {k}.{j}: what is {j} + {k}?" for j in range(rows)]),
            "reward": pa.array([(k + j) % 7 / 7 for j in range(rows)]),
        }
    )


class _NoFsync:
    """``os.fsync`` as a no-op inside the block (this process only)."""

    def __enter__(self) -> None:
        self._fsync = os.fsync
        os.fsync = lambda fd: None  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        os.fsync = self._fsync


def contenders(root: Path, versions: int) -> dict[str, Callable[[pa.Table], Any]]:
    """A kept handle of each tool on a fresh table of ``versions`` versions, as
    name -> append(table)."""
    store = Store.open(str(root / "dynstate"), create=True)
    for k in range(1, versions):  # version 0 is the empty store
        store.append(small_round(k))
    out: dict[str, Callable[[pa.Table], Any]] = {"dynstate": store.append}

    def no_fsync(table: pa.Table) -> Any:
        with _NoFsync():
            return store.append(table)

    out["dynstate, fsync patched out"] = no_fsync
    try:
        from dynstate.storage import DeferredSync
    except ImportError:  # a tree before the deferred sync (issue 23.2)
        pass
    else:

        def inline_sync(table: pa.Table) -> Any:
            # The shards' fsyncs inline again, before the record is written: what the overlap
            # of the two flushes saves (or, on a machine short of cores, costs).
            pending = DeferredSync.pending
            DeferredSync.pending = property(lambda self: False)  # type: ignore[method-assign,assignment]
            try:
                return store.append(table)
            finally:
                DeferredSync.pending = pending  # type: ignore[method-assign]

        out["dynstate, sync not overlapped"] = inline_sync
    try:
        import lance
    except ImportError:
        print("  (pylance not installed: pip install -e '.[bench]')")
    else:
        ds = lance.write_dataset(small_round(0), str(root / "lance"))
        for k in range(1, versions):
            ds.insert(small_round(k))
        out["lance"] = ds.insert
    try:
        from deltalake import DeltaTable, write_deltalake
    except ImportError:
        print("  (deltalake not installed: pip install -e '.[bench]')")
    else:
        write_deltalake(str(root / "delta"), small_round(0))
        dt = DeltaTable(str(root / "delta"))
        for k in range(1, versions):
            write_deltalake(dt, small_round(k), mode="append")
        out["delta"] = lambda table: write_deltalake(dt, table, mode="append")
    return out


def bench_size(
    root: Path,
    versions: int,
    rounds: int,
    settle: bool = True,
    pause: float = 0.0,
    shuffle: random.Random | None = None,
) -> dict[str, list[float]]:
    appends = contenders(root, versions)
    names = list(appends)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        table = small_round(10**6 + r)
        # Rotate who goes first: a disk's journal commit or another job's burst then lands
        # on each contender alike. (A rotation also fixes who runs just before whom; with
        # ``shuffle`` each round's order is drawn instead.)
        order = names[r % len(names) :] + names[: r % len(names)]
        if shuffle:
            order = shuffle.sample(names, len(names))
        for name in order:
            if settle:
                # Untimed: nothing another contender wrote (Lance, Delta and the patched-out
                # append call no fsync) is left for this one's first fsync to flush.
                os.sync()
            if pause:
                # Untimed: the peers' runtime threads idle again (one still spinning on the
                # second core delays dynstate's sync thread), and every contender starts as
                # a training step's commit does, after a pause: caches and cores cold.
                time.sleep(pause)
            t = time.perf_counter()
            appends[name](table)
            times[name].append(time.perf_counter() - t)
    return times


def _fmt(v: list[float]) -> str:
    return f"{1e3 * statistics.median(v):6.2f} [{1e3 * min(v):5.2f}]"


def report(versions: int, times: dict[str, list[float]], load: tuple[float, float]) -> None:
    print(f"  {versions:,} versions (load {load[0]:.2f} -> {load[1]:.2f}), median [min] ms:")
    for name, v in times.items():
        print(f"    {name:28s} {_fmt(v)}")
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    for mine in [k for k in med if k.startswith("dynstate")]:
        for peer in ("lance", "delta"):
            if peer in med:
                print(
                    f"    {mine} / {peer}: {med[mine] / med[peer]:.2f}x median, "
                    f"{low[mine] / low[peer]:.2f}x min"
                )


# -- where dynstate's append goes ----------------------------------------------------------


def _timed(acc: dict[str, float], calls: collections.Counter[str], owner: Any, name: str) -> None:
    """Wrap ``owner.name`` to add its inclusive time to ``acc`` (skipped where the name is
    not there: the script also profiles older trees)."""
    fn = getattr(owner, name, None)
    if fn is None:
        return
    label = f"{getattr(owner, '__name__', owner)}.{name}"

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label] += time.perf_counter() - t
            calls[label] += 1

    setattr(owner, name, wrapper)


def profile(root: Path, commits: int) -> None:
    """cProfile of ``commits`` appends, then a per-step timer (inclusive times of the commit
    protocol's steps and of the system calls that cost, median per append)."""
    store = Store.open(str(root / "profile"), create=True)
    for k in range(20):
        store.append(small_round(k))
    prof = cProfile.Profile()
    tables = [small_round(100 + k) for k in range(commits)]
    prof.enable()
    for table in tables:
        store.append(table)
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)

    from dynstate import writes
    from dynstate.log import catalog, leases
    from dynstate.log import commits as log_commits
    from dynstate.records import rounds
    from dynstate.storage import base, local

    acc: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    steps = [
        (rounds, "to_table"),
        (writes.Writer, "_conform_round"),
        (writes.Writer, "refresh"),
        (leases.Leases, "acquire"),
        (writes.Writer, "_write_round"),
        (writes, "write_shard"),
        (leases.Leases, "claim"),
        (catalog.Catalog, "put_schema"),
        (log_commits.Log, "read_floor"),
        (log_commits.Log, "_publish"),
        (log_commits.Log, "_stray"),
        (log_commits.Log, "confirm"),
        (log_commits.Log, "_upkeep"),
        (leases.Leases, "end"),
        (base.Storage, "read"),
        (base.Storage, "exists"),
        (base.Storage, "delete"),
        (local.LocalStorage, "read"),
        (local.LocalStorage, "exists"),
        (local.LocalStorage, "delete"),
        (os, "fsync"),
        (os, "link"),
        (os, "replace"),
        (os, "makedirs"),
    ]
    for owner, name in steps:
        _timed(acc, calls, owner, name)
    per: dict[str, list[float]] = collections.defaultdict(list)
    total = []
    for k in range(commits):
        before = dict(acc)
        t = time.perf_counter()
        store.append(small_round(10**6 + k))
        total.append(time.perf_counter() - t)
        for label, value in acc.items():
            per[label].append(value - before.get(label, 0.0))
    print(f"per-step timer, {commits} appends, load {os.getloadavg()[0]:.2f}: append median "
          f"{1e3 * statistics.median(total):.2f} ms [min {1e3 * min(total):.2f}]")  # fmt: skip
    print(f"  {'step (inclusive)':34s} {'median us':>10s} {'mean us':>9s} {'calls':>6s}")
    for label in sorted(per, key=lambda k: -statistics.median(per[k])):
        v = per[label] + [0.0] * (commits - len(per[label]))
        print(f"  {label:34s} {1e6 * statistics.median(v):10.0f} {1e6 * sum(v) / commits:9.0f} "
              f"{calls[label] / commits:6.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,1000", help="versions before the timed appends")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--profile", action="store_true", help="profile dynstate's append")
    parser.add_argument("--commits", type=int, default=300, help="appends profiled")
    parser.add_argument(
        "--no-settle",
        action="store_true",
        help="no os.sync() before each timed append (a contender's first fsync then also "
        "flushes what the one before it left unsynced)",
    )
    parser.add_argument(
        "--pause-ms", type=float, default=0.0, help="untimed sleep before each timed append"
    )
    parser.add_argument(
        "--rotate",
        action="store_true",
        help="rotate the order each round instead of drawing it (seeded): a rotation fixes "
        "who runs just before whom",
    )
    parser.add_argument("--shuffle", action="store_true", help="the default; kept for old commands")
    args = parser.parse_args()
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="dynstate-bench-commit-", dir=args.dir))
    try:
        if args.profile:
            profile(base, args.commits)
            return
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, 64-row appends on a "
              f"kept handle, {args.rounds} rounds alternating, under {base}")  # fmt: skip
        for versions in [int(s) for s in args.sizes.split(",")]:
            root = base / str(versions)
            root.mkdir()
            load0 = os.getloadavg()[0]
            shuffle = None if args.rotate else random.Random(0)
            settle, pause = not args.no_settle, args.pause_ms / 1e3
            times = bench_size(root, versions, args.rounds, settle, pause, shuffle)
            report(versions, times, (load0, os.getloadavg()[0]))
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
