"""Resume and loading benchmark (issue 3): dynstate against the baselines a user would
otherwise reach for, side by side in one process, reported as ratios; never part of the tests.

1. random row access: ``VersionedDataset[i]`` vs ``datasets.Dataset[i]`` (in memory), same rows,
   same random indices, warm (target: ours <= 0.5x datasets' time per row);
2. resume at 0, 1M and 10M consumed rows: ``VersionedSampler.load_state_dict`` + first batch of
   indices vs torchdata's ``RandomSampler`` restore, which replays what was consumed (target:
   ours flat, >= 20x faster at 10M); and a resume's time to its first batch of rows (open +
   restore + read, nothing cached; target <= 0.1 s at 10M consumed, local);
3. ``StatefulDataLoader`` throughput, ``num_workers=2``, over ``VersionedDataset`` +
   ``VersionedSampler`` vs over an in-memory ``datasets.Dataset`` + ``RandomSampler``
   (target: >= 0.9x); and the same with ``num_workers=0``.

    python tools/bench/bench_resume.py            # stores are built once under --dir
    python tools/bench/bench_resume.py --quick    # fewer rows, batches and repeats
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from dynstate import Store, VersionedDataset, VersionedSampler

WORDS = ["sum", "prime", "graph", "root", "modulo", "vector", "matrix", "digit", "angle", "area"]
BATCH = 64


def rows_table(n: int, seed: int = 0) -> pa.Table:
    """``n`` rows of an int id, a ~100-character prompt and a float."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        text = f"Task {i}: "
        while len(text) < 100:
            text += rng.choice(WORDS) + " "
        prompts.append(text[:100])
    return pa.table(
        {
            "id": pa.array(range(n), pa.int64()),
            "prompt": pa.array(prompts, pa.string()),
            "score": pa.array([i / 7 for i in range(n)], pa.float64()),
        }
    )


def build_store(path: Path, table: pa.Table, rounds: int) -> Store:
    """A local store holding ``table`` as ``rounds`` appends; built once, reused if complete."""
    store = Store.open(str(path), create=True)
    have = store.snapshot().num_rows
    if have == table.num_rows:
        return store
    if have:
        raise SystemExit(f"{path} holds {have} rows, not {table.num_rows}; delete it")
    step = -(-table.num_rows // rounds)
    start = time.perf_counter()
    for k in range(rounds):
        store.append(table.slice(k * step, step), meta={"step": k})
    print(f"  built {path.name} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    # Read as a new process finds it: not through the tables this one kept of its commits.
    from dynstate import fresh

    fresh.FRESH.clear()
    return store


def as_list(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return batch


# -- 1. random row access ----------------------------------------------------------------------


def bench_access(path: Path, table: pa.Table, reads: int, repeats: int) -> dict[str, float]:
    build_store(path, table, rounds=4)
    ours = VersionedDataset(str(path))
    theirs = datasets.Dataset(datasets.table.InMemoryTable(table))
    indices = [random.Random(1).randrange(table.num_rows) for _ in range(reads)]
    for i in indices[:200]:
        if ours[i] != theirs[i]:
            raise SystemExit(f"row {i} differs: {ours[i]} vs {theirs[i]}")
    batch = indices[:BATCH]
    if ours.__getitems__(batch) != [ours[i] for i in batch]:
        raise SystemExit("a batch read differs from the same rows read one by one")
    for i in indices:  # warm both: shards decoded, pages touched
        ours[i], theirs[i]
    times: dict[str, list[float]] = {"ours": [], "datasets": []}
    for _ in range(repeats):  # interleaved, so load swings hit both alike
        for name, ds in (("ours", ours), ("datasets", theirs)):
            start = time.perf_counter()
            for i in indices:
                ds[i]
            times[name].append((time.perf_counter() - start) / reads * 1e6)
    ours_us, theirs_us = statistics.median(times["ours"]), statistics.median(times["datasets"])
    return {"ours_us": ours_us, "datasets_us": theirs_us, "ratio": ours_us / theirs_us}


# -- 2. resume ---------------------------------------------------------------------------------


def ids_store(path: Path, rows: int) -> Store:
    """``rows`` int ids in a few big rounds (the sampler never reads rows: ids suffice)."""
    store = Store.open(str(path), create=True)
    have = store.snapshot().num_rows
    if have == rows:
        return store
    if have:
        raise SystemExit(f"{path} holds {have} rows, not {rows}; delete it")
    rounds = max(1, rows // 2_000_000)
    step = -(-rows // rounds)
    start = time.perf_counter()
    for k in range(rounds):
        ids = pa.array(range(k * step, min(rows, (k + 1) * step)), pa.int64())
        store.append(pa.table({"id": ids}), meta={"step": k})
    print(f"  built {path.name} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return store


def ours_state_at(url: str, position: int, seed: int) -> dict[str, Any]:
    """The state a sampler reports after ``position`` indices of its first epoch: taken after one
    index, with the position moved on (the state is just these numbers). Checked against an
    uninterrupted sampler below."""
    sampler = VersionedSampler(VersionedDataset(url), seed=seed)
    next(iter(sampler))
    state = sampler.state_dict()
    state["position"] = position
    return state


def ours_resume(url: str, state: dict[str, Any], seed: int) -> tuple[float, list[int]]:
    ds = VersionedDataset(url)  # opening the store is outside the timing, as for torchdata
    start = time.perf_counter()
    sampler = VersionedSampler(ds, seed=seed)
    sampler.load_state_dict(state)
    it = iter(sampler)
    first = [int(next(it)) for _ in range(BATCH)]
    return time.perf_counter() - start, first


def ours_first_batch(url: str, state: dict[str, Any], seed: int) -> tuple[float, list[Any]]:
    """A resume's time to its first batch of rows, everything in: open the store, restore the
    sampler, draw a batch of indices and read their rows (a new dataset: nothing cached)."""
    start = time.perf_counter()
    ds = VersionedDataset(url)
    sampler = VersionedSampler(ds, seed=seed)
    sampler.load_state_dict(state)
    it = iter(sampler)
    rows = ds.__getitems__([next(it) for _ in range(BATCH)])
    return time.perf_counter() - start, rows


def torchdata_resume(n: int, state: dict[str, Any]) -> tuple[float, list[int]]:
    start = time.perf_counter()
    sampler = RandomSampler(range(n), generator=torch.Generator())
    it = iter(sampler)
    it.load_state_dict(state)  # what StatefulDataLoader does with the saved sampler state
    first = [next(it) for _ in range(BATCH)]
    return time.perf_counter() - start, first


def bench_resume(path: Path, rows: int, positions: list[int], repeats: int) -> list[dict]:
    url = str(path)
    ids_store(path, rows)
    seed = 7
    # Correctness first: resuming at p continues an uninterrupted sampler's stream.
    check = ours_state_at(url, 1000, seed)
    straight = VersionedSampler(VersionedDataset(url), seed=seed)
    it = iter(straight)
    stream = [int(next(it)) for _ in range(1000 + BATCH)]
    if ours_resume(url, check, seed)[1] != stream[1000:]:
        raise SystemExit("VersionedSampler resumed at 1000 differs from the uninterrupted run")
    gen = torch.Generator().manual_seed(seed)
    base_state = iter(RandomSampler(range(rows), generator=gen)).state_dict()
    results = []
    for pos in positions:
        ours_state = ours_state_at(url, pos, seed)
        theirs_state = {"yielded": pos, "generator": base_state["generator"]}
        ours_t, theirs_t, first_t = [], [], []
        for _ in range(repeats):
            ours_t.append(ours_resume(url, ours_state, seed)[0])
            theirs_t.append(torchdata_resume(rows, theirs_state)[0])
        for _ in range(max(5, repeats)):
            first_t.append(ours_first_batch(url, ours_state, seed)[0])
        o, t = statistics.median(ours_t), statistics.median(theirs_t)
        results.append(
            {
                "position": pos,
                "ours_ms": o * 1e3,
                "torchdata_ms": t * 1e3,
                "first_ms": statistics.median(first_t) * 1e3,
                "first_max_ms": max(first_t) * 1e3,
            }
        )
    return results


# -- 3. loader throughput ----------------------------------------------------------------------


def loader_rate(loader: StatefulDataLoader, batches: int) -> float:
    """Rows per second from the second batch on (worker start-up is excluded)."""
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    rows = 0
    for _ in range(batches):
        rows += len(next(it))
    return rows / (time.perf_counter() - start)


def bench_loader(
    path: Path, table: pa.Table, batches: int, repeats: int, workers: int = 2
) -> dict[str, float]:
    build_store(path, table, rounds=4)
    kw: dict[str, Any] = {"batch_size": BATCH, "num_workers": workers, "collate_fn": as_list}
    rates: dict[str, list[float]] = {"ours": [], "datasets": []}
    for _ in range(repeats):
        ds = VersionedDataset(str(path))
        ours = StatefulDataLoader(ds, sampler=VersionedSampler(ds, seed=3, batch_size=BATCH), **kw)
        rates["ours"].append(loader_rate(ours, batches))
        del ours
        hf = datasets.Dataset(datasets.table.InMemoryTable(table))
        gen = torch.Generator().manual_seed(3)
        theirs = StatefulDataLoader(hf, sampler=RandomSampler(hf, generator=gen), **kw)
        rates["datasets"].append(loader_rate(theirs, batches))
        del theirs
    o, t = statistics.median(rates["ours"]), statistics.median(rates["datasets"])
    return {"ours_rows_s": o, "datasets_rows_s": t, "ratio": o / t}


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    parser.add_argument("--dir", default="/tmp/dynstate-bench-resume", help="where stores live")
    parser.add_argument("--sections", default="access,resume,loader")
    args = parser.parse_args()
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    sections = set(args.sections.split(","))
    rows = 50_000 if args.quick else 200_000
    table = rows_table(rows) if sections & {"access", "loader"} else None

    if "access" in sections:
        reads, repeats = (5_000, 1) if args.quick else (20_000, 5)
        r = bench_access(base / f"rows-{rows}", table, reads, repeats)
        print(f"\nrandom row access, {rows:,} rows, {reads:,} random reads, warm, median")
        print(f"  {'VersionedDataset[i]':<24}{r['ours_us']:>10.1f} µs/row")
        print(f"  {'datasets.Dataset[i]':<24}{r['datasets_us']:>10.1f} µs/row")
        print(f"  ratio ours/datasets {r['ratio']:.2f}x (target <= 0.5x)", flush=True)

    if "resume" in sections:
        n, positions = (
            (2_000_000, [0, 100_000, 1_000_000])
            if args.quick
            else (12_000_000, [0, 1_000_000, 10_000_000])
        )
        results = bench_resume(base / f"ids-{n}", n, positions, 1 if args.quick else 3)
        print(f"\nresume + first batch of {BATCH} indices, {n:,}-row version, median")
        print(f"  {'consumed':>12}{'VersionedSampler':>20}{'torchdata':>14}{'speed-up':>10}")
        for r in results:
            ratio = r["torchdata_ms"] / r["ours_ms"]
            print(
                f"  {r['position']:>12,}{r['ours_ms']:>17.2f} ms{r['torchdata_ms']:>11.1f} ms"
                f"{ratio:>9.0f}x"
            )
        print("  (target: ours flat, >= 20x faster at the largest position)")
        print(f"\nresume to the first batch of {BATCH} rows (open + restore + read), median [max]")
        for r in results:
            print(f"  {r['position']:>12,}{r['first_ms']:>10.1f} ms [{r['first_max_ms']:.1f}]")
        print("  (target: <= 100 ms at 10M consumed, local)", flush=True)

    if "loader" in sections:
        batches, repeats = (200, 1) if args.quick else (2_000, 3)
        # num_workers=0 too: the CPU cost per row alone, without the scheduling of three
        # processes, which dominates the num_workers=2 figure on a small shared machine.
        for workers in (2, 0):
            r = bench_loader(base / f"rows-{rows}", table, batches, repeats, workers)
            print(
                f"\nStatefulDataLoader, num_workers={workers}, batch {BATCH}, "
                f"{batches:,} batches, median"
            )
            print(f"  {'VersionedDataset':<24}{r['ours_rows_s']:>12,.0f} rows/s")
            print(f"  {'datasets.Dataset':<24}{r['datasets_rows_s']:>12,.0f} rows/s")
            target = " (target >= 0.9x)" if workers == 2 else ""
            print(f"  ratio ours/datasets {r['ratio']:.2f}x{target}", flush=True)


if __name__ == "__main__":
    main()
