"""The dyngen step (issue 45.4): a generator appends a round of 64 rows, then the trainer reads a
batch of 256 random rows over every row of the new head. dynstate against the seed's in-memory
loop, side by side in one process on the same rows and the same indices, reported as per-step
medians and their ratio; never part of the tests.

* dynstate: a local store seeded with ``--rows`` rows (int ``id``, a ~100-character ``prompt``,
  float ``score``; one round), one ``VersionedDataset`` over it; each step
  ``v = store.append(new_rows)`` (a list of 64 row dicts, what a generator returns), then
  ``ds.pin(v)`` and ``ds.read_batch(indices, "columns")`` (``--format rows``:
  ``ds.__getitems__``, what a DataLoader gets).
* the seed's loop: an in-memory ``datasets.Dataset`` of the same rows; each step
  ``ds = concatenate_datasets([ds, Dataset.from_dict(new64)])``, then ``ds[indices]`` (a dict
  of columns; ``--format rows``: ``ds.__getitems__(indices)``, a list of row dicts).

Both get the same new rows and the same 256 random indices (over all rows of the new head,
unsorted, repeats allowed) each step; every step's two batches are compared (outside the
timed part), and the run stops if they differ. The contenders alternate which goes first,
step by step. Reported for each window of ``--steps`` (the first 300, the first 1,000 steps
of one run): the median and the mean step of each, the ratio of the medians, and the median
of the per-step ratios. ``--profile`` adds a cProfile of dynstate's steps. ``--no-fsync``
(diagnosis only, never a figure to compare) patches ``os.fsync`` out, to show what of
dynstate's step is waiting for the disk. ``DYNSTATE_FRESH_BYTES=0`` turns off the kept
tables of fresh rounds (:mod:`dynstate.fresh`): every step then decodes what it reads.

    python tools/bench/dyngen.py                             # 10k and 1M rows, 300 and 1,000 steps
    python tools/bench/dyngen.py --rows 10000 --steps 300    # quicker
    python tools/bench/dyngen.py --rows 10000 --steps 300 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import datasets
from bench_resume import WORDS, rows_table

import dynstate
from dynstate import Store, VersionedDataset

BATCH = 256
ROUND = 64


def new_rounds(start: int, steps: int, seed: int) -> list[list[dict[str, Any]]]:
    """``steps`` rounds of ``ROUND`` rows each, ids from ``start`` on, as a generator
    returns them (row dicts)."""
    rng = random.Random(seed)
    out = []
    i = start
    for _ in range(steps):
        rows = []
        for _ in range(ROUND):
            text = f"Variation {i}: "
            while len(text) < 100:
                text += rng.choice(WORDS) + " "
            rows.append({"id": i, "prompt": text[:100], "score": i / 7})
            i += 1
        out.append(rows)
    return out


def as_columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {name: [r[name] for r in rows] for name in rows[0]}


def run(
    n: int, steps: int, fmt: str, seed: int, folder: Path, profile: bool
) -> tuple[list[float], list[float], cProfile.Profile | None]:
    table = rows_table(n, seed)
    rounds = new_rounds(n, steps, seed + 1)
    rng = random.Random(seed + 2)
    indices = [[rng.randrange(n + (s + 1) * ROUND) for _ in range(BATCH)] for s in range(steps)]

    path = folder / f"store-{n}"
    shutil.rmtree(path, ignore_errors=True)
    store = Store.open(str(path), create=True)
    store.append(table)
    ours = VersionedDataset(store)
    theirs = datasets.Dataset(datasets.table.InMemoryTable(table))
    # Warm both once over the seed (the seed shard decoded, HF's formatter set up): the
    # steps then measure the steady state a run is in after its first batch.
    warm = [rng.randrange(n) for _ in range(BATCH)]
    if ours.read_batch(warm, "columns") != theirs[warm]:
        raise SystemExit("the seed rows differ between dynstate and datasets")

    profiler = cProfile.Profile() if profile else None
    t_ours: list[float] = []
    t_theirs: list[float] = []

    def step_ours(s: int) -> Any:
        v = store.append(rounds[s])
        ours.pin(v)
        if fmt == "rows":
            return ours.__getitems__(indices[s])
        return ours.read_batch(indices[s], "columns")

    def step_theirs(s: int) -> Any:
        nonlocal theirs
        theirs = datasets.concatenate_datasets(
            [theirs, datasets.Dataset.from_dict(as_columns(rounds[s]))]
        )
        if fmt == "rows":
            return theirs.__getitems__(indices[s])
        return theirs[indices[s]]

    for s in range(steps):
        order = ("ours", "theirs") if s % 2 == 0 else ("theirs", "ours")
        got: dict[str, Any] = {}
        for name in order:
            if name == "ours":
                if profiler is not None:
                    profiler.enable()
                start = time.perf_counter()
                got[name] = step_ours(s)
                t_ours.append(time.perf_counter() - start)
                if profiler is not None:
                    profiler.disable()
            else:
                start = time.perf_counter()
                got[name] = step_theirs(s)
                t_theirs.append(time.perf_counter() - start)
        if got["ours"] != got["theirs"]:
            raise SystemExit(f"step {s}: dynstate's batch differs from datasets'")
    shutil.rmtree(path, ignore_errors=True)
    return t_ours, t_theirs, profiler


def report(n: int, windows: list[int], ours: list[float], theirs: list[float]) -> None:
    for w in windows:
        a, b = ours[:w], theirs[:w]
        ma, mb = statistics.median(a), statistics.median(b)
        per_step = statistics.median(x / y for x, y in zip(a, b, strict=True))
        print(
            f"{n:>9,} rows, {w:>5,} steps: dynstate {ma * 1e3:6.2f} ms (mean "
            f"{statistics.fmean(a) * 1e3:6.2f}), datasets {mb * 1e3:6.2f} ms (mean "
            f"{statistics.fmean(b) * 1e3:6.2f}); ratio of medians {ma / mb:.2f}x, "
            f"median per-step ratio {per_step:.2f}x, of means "
            f"{statistics.fmean(a) / statistics.fmean(b):.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="10000,1000000", help="seed sizes, comma-separated")
    parser.add_argument("--steps", default="300,1000", help="windows reported, comma-separated")
    parser.add_argument("--format", default="columns", choices=("columns", "rows"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="where the stores live (default: a temp dir)")
    parser.add_argument("--profile", action="store_true", help="cProfile dynstate's steps")
    parser.add_argument("--no-fsync", action="store_true", help="diagnosis: os.fsync patched out")
    args = parser.parse_args()
    if args.no_fsync:
        os.fsync = lambda fd: None
    sizes = [int(x) for x in args.rows.split(",")]
    windows = sorted(int(x) for x in args.steps.split(","))
    folder = Path(args.dir or tempfile.mkdtemp(prefix="dynstate-bench-dyngen-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs; "
        f"format {args.format}; DYNSTATE_FRESH_BYTES={os.environ.get('DYNSTATE_FRESH_BYTES')}"
        f"{'; fsync PATCHED OUT' if args.no_fsync else ''}; dynstate from "
        f"{os.path.dirname(dynstate.__file__)}",
        file=sys.stderr,
    )
    try:
        for n in sizes:
            ours, theirs, profiler = run(
                n, windows[-1], args.format, args.seed, folder, args.profile
            )
            report(n, windows, ours, theirs)
            if profiler is not None:
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(35)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    print(
        f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
