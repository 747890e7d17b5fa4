"""Choosing a step's rows over 1M weighted rows: dynstate's selection vs numpy's
``Generator.choice(p=...)`` over the same weights, side by side in one process, round after
round, reported as ratios (issue 22.4).

    python tools/bench/selection.py [--rows 1000000] [--batch 256] [--rounds 30]
                                    [--trained 256] [--added 16]

Each round, as in a run with outcomes every step (mix mode: the statistics version changes
every step): ``--trained`` rows get one more attempt, ``--added`` rows join untried, and a
step of ``--batch`` rows is chosen by learnability weights. Per round, timed apart:

* numpy: ``Generator.choice(rows, batch, p=p)`` with ``p`` the round's weights normalized
  (the normalizing is not timed: the baseline is numpy's choice alone);
* dynstate refresh + draw: the sampler's :class:`Selector` given the round's statistics
  table (finds the changed rows, re-weighs them and the added ones, updates the blocks that
  hold them), then the step's draw — what every step costs in mix mode;
* dynstate build + draw: the weights built over every row (a resume, a policy that is not
  row-local) — for reference;
* dynstate draw: the plan unchanged (epoch mode between epochs).

The statistics tables are made outside the timings (in a run the store makes them,
incrementally). Medians over the rounds; the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import pyarrow as pa

from dynstate.loading.selection import Learnability, Selector, step_rng


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--trained", type=int, default=256)
    ap.add_argument("--added", type=int, default=16)
    args = ap.parse_args()
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    attempts = rng.integers(0, 9, args.rows)
    successes = np.minimum(attempts, rng.integers(0, 9, args.rows))
    policy = Learnability()
    selector = Selector(policy)
    gen = np.random.default_rng(1)
    times: dict[str, list[float]] = {"numpy": [], "refresh": [], "build": [], "draw": []}
    checked = 0
    for r in range(args.rounds + 1):
        table = pa.table({"attempts": attempts, "successes": successes})
        weights = policy.weights(table)
        p = weights / weights.sum()
        n = len(attempts)
        t0 = time.perf_counter()
        gen.choice(n, size=args.batch, p=p)
        t1 = time.perf_counter()
        refreshed = selector.plan(r, lambda t=table: t, 0, "bench")
        got = refreshed.draw(step_rng(0, 0, r), args.batch)
        t2 = time.perf_counter()
        built = policy.plan(table, 0, "bench").draw(step_rng(0, 0, r), args.batch)
        t3 = time.perf_counter()
        refreshed.draw(step_rng(1, 0, r), args.batch)
        t4 = time.perf_counter()
        if (got != built).any():
            raise SystemExit(f"round {r}: refreshed weights drew other rows than built ones")
        checked += 1
        t_numpy, t_refresh, t_build, t_draw = t1 - t0, t2 - t1, t3 - t2, t4 - t3
        if r:  # round 0 builds the selector's weights: not a refresh
            for key, t in zip(times, (t_numpy, t_refresh, t_build, t_draw), strict=True):
                times[key].append(t)
        # the next round's statistics: some rows trained once more, some rows added
        attempts, successes = attempts.copy(), successes.copy()
        hit = rng.integers(0, len(attempts), args.trained)
        np.add.at(attempts, hit, 1)
        np.add.at(successes, hit, rng.integers(0, 2, args.trained))
        attempts = np.concatenate([attempts, np.zeros(args.added, np.int64)])
        successes = np.concatenate([successes, np.zeros(args.added, np.int64)])
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["numpy"]
    print(
        f"rows={args.rows:,} (+{args.added}/round) batch={args.batch} trained={args.trained}/round"
        f" rounds={args.rounds} (median); load {load_before[0]:.1f} before,"
        f" {os.getloadavg()[0]:.1f} after, {os.cpu_count()} cpus"
    )
    rows = [
        ("numpy Generator.choice(p=...)", "numpy"),
        ("dynstate refresh (changed rows) + draw", "refresh"),
        ("dynstate build (every row) + draw", "build"),
        ("dynstate draw (weights unchanged)", "draw"),
    ]
    for label, key in rows:
        print(f"{label:40s} {med[key] * 1e3:8.3f} ms   {med[key] / base:5.2f}x")
    print(
        f"refreshed weights drew exactly what built ones drew in {checked} rounds; "
        f"{selector.reweighed:,} rows re-weighed over {args.rounds} refreshes"
    )


if __name__ == "__main__":
    main()
