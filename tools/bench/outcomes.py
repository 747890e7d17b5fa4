"""Cost of outcomes (issue 21), on a local store of ``--rows`` rows (default 1M):

1. **Recording**: the per-step cost of committing a round *with* ``--outcomes`` (default
   2,048) outcome records against the same round committed without them into a store of the
   same size, alternated step by step, over ``--commit-steps`` steps (the aggregate written
   with every 100th version is part of the mean). Target: the outcomes add at most 10 % to
   the round's commit.
2. **Statistics at the head** of the store after each of ``--steps`` (default 1,000 and
   10,000) steps of ``--outcomes`` records each, measured 50 steps past an aggregate (the
   middle of the worst case: up to 99 outcome files after it): a fresh handle's
   ``outcome_stats()`` (cold), the same handle again after one more step (warm), a fresh
   handle with a non-default threshold (the aggregate's score histogram: bounded like the
   default) and with a non-default half-life (reads every record: the exact fallback).
   Targets: cold at most 1 s at 10,000 steps, and 10,000 within 1.5x of 1,000.
3. **Cold statistics in a fresh process** (issue 45.3, ``--fresh N``): N rounds, each two fresh
   interpreters in alternating order over the store of each ``--steps`` figure. One opens the
   store and calls ``outcome_stats()``; the other is a pass-rate tracker kept the way a trainer
   keeps one, a ``torch.save``d dict of the same per-row state as dynstate's aggregate (7
   tensors over every row, taken from the store's own statistics), which it ``torch.load``s
   and divides into pass rates and mean scores. Each times only that work, after importing
   its libraries (numpy and pyarrow; torch). Target: within 1.5x the tracker (per-round
   ratios, median).

Never part of the tests; the store is built once under ``--dir`` and grown from there.

    python tools/bench/outcomes.py --dir /tmp/bench-outcomes
    python tools/bench/outcomes.py --rows 100000 --steps 300,3000   # a quicker, smaller run
    python tools/bench/outcomes.py --commit-steps 300 --steps 0     # part 1 only
    python tools/bench/outcomes.py --commit-steps 300 --steps 0 --round-rows 1024
    python tools/bench/outcomes.py --commit-steps 100 --steps 0 --rows 100000 --s3  # loopback S3
    python tools/bench/outcomes.py --commit-steps 0 --steps 1000,10000 --fresh 15   # part 3

``--s3``: part 1 on stores in the loopback S3 server (moto, ``tools/loopback_s3.py``) instead of
``--dir``: there the outcome file is one more PUT, sent while the round's shard is.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa


def round_table(step: int, n: int = 64) -> pa.Table:
    """A generator's round: ``n`` new tasks."""
    return pa.table(
        {
            "step": pa.array([step] * n, pa.int64()),
            "prompt": pa.array([f"step {step} task {i} " + "x" * 80 for i in range(n)]),
        }
    )


def outcome_table(step: int, num_rows: int, n: int, rng: np.random.Generator) -> pa.Table:
    return pa.table(
        {
            "row": pa.array(rng.integers(0, num_rows, n), pa.int64()),
            "step": pa.array(np.full(n, step), pa.int64()),
            "score": pa.array(rng.integers(0, 2, n).astype(np.float64)),
            "length": pa.array(rng.integers(10, 2000, n), pa.int64()),
        }
    )


def open_or_build(path: Path | str, rows: int, **options: object) -> object:
    from dynstate import Store

    store = Store.open(str(path), create=True, **options)
    if store.head == 0:
        started = time.perf_counter()
        store.append(
            pa.table(
                {
                    "step": pa.array(np.zeros(rows, np.int64)),
                    "prompt": pa.array([f"seed task {i}" for i in range(rows)]),
                }
            ),
            meta={"step": 0},
        )
        print(f"  seeded {rows:,} rows in {time.perf_counter() - started:.1f} s", flush=True)
    return store


def grow(store: object, until_step: int, outcomes: int, rng: np.random.Generator) -> None:
    """Steps (one empty-round commit with outcomes each) until the head's step is ``until``."""
    head = store.commit_record(store.head)  # type: ignore[attr-defined]
    step = int(head.meta.get("step", 0))
    started, first = time.perf_counter(), step
    num_rows = head.num_rows
    while step < until_step:
        step += 1
        store.append(  # type: ignore[attr-defined]
            [],
            meta={"step": step},
            outcomes=outcome_table(step, num_rows, outcomes, rng),
        )
        if step % 1000 == 0:
            rate = (step - first) / (time.perf_counter() - started)
            print(f"  step {step:,} ({rate:.0f} steps/s)", flush=True)


def bench_recording(
    plain_store: object,
    store: object,
    steps: int,
    outcomes: int,
    rng: np.random.Generator,
    round_rows: int = 64,
) -> None:
    """The same rounds into two stores of the same size, one without and one with outcomes,
    alternated step by step: each store's upkeep (the outcome aggregate every 100th version
    included) lands in its own figures."""
    plain, with_outcomes = [], []
    head = store.commit_record(store.head)  # type: ignore[attr-defined]
    step = int(head.meta.get("step", 0))
    for _ in range(steps):
        step += 1
        num_rows = store.snapshot().num_rows  # type: ignore[attr-defined]
        table = outcome_table(step, num_rows, outcomes, rng)
        # Which store goes first alternates: the second of two commits in a row meets
        # warmer caches (or the first one's flush), and each side gets that equally.
        for which in (0, 1) if step % 2 else (1, 0):
            t0 = time.perf_counter()
            if which == 0:
                plain_store.append(round_table(step, round_rows), meta={"step": step})  # type: ignore[attr-defined]
                plain.append(time.perf_counter() - t0)
            else:
                store.append(round_table(step, round_rows), meta={"step": step}, outcomes=table)  # type: ignore[attr-defined]
                with_outcomes.append(time.perf_counter() - t0)
    for name, fn in (("median", statistics.median), ("mean", statistics.fmean), ("max", max)):
        a, b = fn(plain), fn(with_outcomes)
        print(
            f"  {name}: round {a * 1e3:.1f} ms, round + {outcomes:,} outcomes {b * 1e3:.1f} ms "
            f"(+{(b - a) * 1e3:.2f} ms, +{(b - a) / a:.0%})"
        )
    # What no storage layout saves: the records' check and their Parquet encode, in series
    # on this thread with nothing else running, for the last step's records.
    from dynstate.log.outcomes import encode_outcome_file, outcomes_of

    head = store.commit_record(store.head)  # type: ignore[attr-defined]
    step += 1
    table = outcome_table(step, head.num_rows, outcomes, rng)
    floor = []
    for _ in range(100):
        t0 = time.perf_counter()
        pending = outcomes_of(store.log).check(table, None, head)  # type: ignore[attr-defined]
        encode_outcome_file(pending.table)
        floor.append(time.perf_counter() - t0)
    a, f = statistics.median(plain), statistics.median(floor)
    print(f"  check + encode alone: median {f * 1e3:.2f} ms ({f / a:.0%} of the plain round)")
    # the outcome checkpoint (every 100th version) is written in the background: how long
    # until it lands after the commit returned, waited for here once the steps are timed

    t0 = time.perf_counter()
    outcomes_of(store.log).flush()  # type: ignore[attr-defined]
    print(f"  outcome checkpoint still in flight at the end: {time.perf_counter() - t0:.3f} s")


def bench_recording_s3(args: argparse.Namespace, rng: np.random.Generator) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: loopback_s3
    from loopback_s3 import loopback_s3

    with loopback_s3("bench-outcomes") as server:
        options = {"storage_options": {"endpoint_url": server.endpoint}}
        plain = open_or_build("s3://bench-outcomes/plain", args.rows, **options)
        store = open_or_build("s3://bench-outcomes/outcomes", args.rows, **options)
        bench_recording(plain, store, args.commit_steps, args.outcomes, rng, args.round_rows)


def bench_stats(url: str, outcomes: int, rng: np.random.Generator) -> float:
    from dynstate import Store

    store = Store.open(url)
    t0 = time.perf_counter()
    stats = store.outcome_stats()
    cold = time.perf_counter() - t0
    head = store.commit_record(store.head)
    step = int(head.meta["step"]) + 1
    store.append(
        [], meta={"step": step}, outcomes=outcome_table(step, head.num_rows, outcomes, rng)
    )
    t0 = time.perf_counter()
    store.outcome_stats()
    warm = time.perf_counter() - t0
    fresh = Store.open(url)
    t0 = time.perf_counter()
    fresh.outcome_stats(success_above=0.9)
    threshold = time.perf_counter() - t0
    fresh = Store.open(url)
    t0 = time.perf_counter()
    fresh.outcome_stats(half_life=3.0)
    exact = time.perf_counter() - t0
    trained = int(np.count_nonzero(stats.column("attempts").to_numpy()))
    print(
        f"  head {head.version:,} ({stats.num_rows:,} rows, {trained:,} trained): cold "
        f"{cold:.3f} s, warm (one step later) {warm:.3f} s, other threshold (histogram) "
        f"{threshold:.3f} s, other half-life (every record) {exact:.2f} s",
        flush=True,
    )
    return cold


# The two fresh interpreters of part 3: each prints the seconds of its work alone.
FRESH_DYNSTATE = """
import sys, time
import numpy, pyarrow, pyarrow.parquet  # dynstate's dependencies, as a trainer has them
import dynstate
t = time.perf_counter()
stats = dynstate.Store.open(sys.argv[1]).outcome_stats()
print(time.perf_counter() - t)
"""
FRESH_TRACKER = """
import sys, time
import torch
t = time.perf_counter()
state = torch.load(sys.argv[1])
attempts = state["attempts"].clamp(min=1)
pass_rate = state["successes"] / attempts
mean_score = state["score_sum"] / attempts
print(time.perf_counter() - t)
"""


def save_tracker(url: str, path: Path) -> None:
    """The tracker's file: the head's per-row state as tensors, as a trainer would save it."""
    import torch

    from dynstate import Store

    stats = Store.open(url).outcome_stats()
    attempts = stats.column("attempts").to_numpy()
    mean = stats.column("mean_score").fill_null(0.0).to_numpy()
    state = {
        "attempts": attempts,
        "successes": stats.column("successes").to_numpy(),
        "score_sum": mean * attempts,
        "ewma_num": stats.column("ewma_score").fill_null(0.0).to_numpy(),
        "ewma_den": (attempts > 0).astype(np.float64),
        "first_step": stats.column("first_step").fill_null(-1).to_numpy(),
        "last_step": stats.column("last_step").fill_null(-1).to_numpy(),
    }
    torch.save({k: torch.from_numpy(np.array(v)) for k, v in state.items()}, path)


def bench_fresh(url: str, rounds: int) -> None:
    tracker = Path(url) / "tracker.pt"  # beside the store; no part of it
    save_tracker(url, tracker)
    mine, theirs, ratios = [], [], []
    for i in range(rounds):
        times = {}
        for which in ("dynstate", "tracker") if i % 2 else ("tracker", "dynstate"):
            program, arg = (
                (FRESH_DYNSTATE, url) if which == "dynstate" else (FRESH_TRACKER, tracker)
            )
            argv = [sys.executable, "-c", program, str(arg)]
            out = subprocess.run(argv, capture_output=True, text=True, check=True)
            times[which] = float(out.stdout.split()[-1])
        mine.append(times["dynstate"])
        theirs.append(times["tracker"])
        ratios.append(times["dynstate"] / times["tracker"])
    print(
        f"  fresh process, {rounds} rounds: outcome_stats() {statistics.median(mine) * 1e3:.0f} ms "
        f"[{min(mine) * 1e3:.0f}-{max(mine) * 1e3:.0f}], tracker's torch.load + divide "
        f"{statistics.median(theirs) * 1e3:.0f} ms [{min(theirs) * 1e3:.0f}-"
        f"{max(theirs) * 1e3:.0f}]: {statistics.median(ratios):.2f}x "
        f"[{min(ratios):.2f}-{max(ratios):.2f}]",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/dynstate-bench-outcomes")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--outcomes", type=int, default=2048)
    parser.add_argument("--steps", default="1000,10000", help="0: skip part 2")
    parser.add_argument("--commit-steps", type=int, default=200, help="0: skip part 1")
    parser.add_argument(
        "--round-rows", type=int, default=64, help="rows of each step's round in part 1"
    )
    parser.add_argument("--s3", action="store_true", help="part 1 on loopback S3")
    parser.add_argument(
        "--fresh", type=int, default=0, help="part 3: rounds of fresh interpreters (0: skip)"
    )
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if args.commit_steps:
        print(
            f"1. recording {args.outcomes:,} outcomes per step with a round of "
            f"{args.round_rows:,} rows ({args.commit_steps} steps)"
        )
        if args.s3:
            bench_recording_s3(args, rng)
        else:
            plain = open_or_build(base / f"record-plain-{args.rows}", args.rows)
            store = open_or_build(base / f"record-{args.rows}", args.rows)
            bench_recording(plain, store, args.commit_steps, args.outcomes, rng, args.round_rows)

    steps_list = [int(s) for s in args.steps.split(",") if int(s) > 0]
    if not steps_list:
        return _done()
    print(f"2. statistics at the head ({args.rows:,} rows, {args.outcomes:,} outcomes per step)")
    colds = []
    for steps in steps_list:
        url = base / f"stats-{args.rows}-{args.outcomes}-{steps}"
        store = open_or_build(url, args.rows)
        grow(store, steps + 50, args.outcomes, rng)  # 50 steps past the aggregate at `steps`
        colds.append(bench_stats(str(url), args.outcomes, rng))
        if args.fresh:
            bench_fresh(str(url), args.fresh)
    if len(colds) > 1:
        print(f"  cold ratio, last / first: {colds[-1] / colds[0]:.2f}x")
    return _done()


def _done() -> int:
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
