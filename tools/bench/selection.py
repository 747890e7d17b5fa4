"""Choosing a step's rows over 1M weighted rows: dynstate's selection vs numpy's
``Generator.choice(p=...)`` over the same weights, reported as ratios (issue 22.4).

    python tools/bench/selection.py [--rows 1000000] [--batch 256] [--repeats 30]

Three figures per step: numpy's choice (it normalizes and accumulates the weights on every
call), dynstate drawing from a version's built plan (what every step costs while the
statistics version stays), and dynstate rebuilding the plan from the statistics table first
(what a step costs when new statistics arrive: mix mode every step, a step-dependent policy).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyarrow as pa

from dynstate.loading.selection import Learnability, step_rng


def _stats(rows: int) -> pa.Table:
    rng = np.random.default_rng(0)
    attempts = rng.integers(0, 9, rows)
    successes = np.minimum(attempts, rng.integers(0, 9, rows))
    return pa.table({"attempts": attempts, "successes": successes})


def _median(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    stats = _stats(args.rows)
    policy = Learnability()
    weights = policy.weights(stats)
    p = weights / weights.sum()
    gen = np.random.default_rng(1)
    numpy_s = _median(lambda: gen.choice(args.rows, size=args.batch, p=p), args.repeats)
    plan = policy.plan(stats, 0, "bench")
    step = iter(range(10**9))
    draw_s = _median(lambda: plan.draw(step_rng(0, 0, next(step)), args.batch), args.repeats)
    rebuild_s = _median(
        lambda: policy.plan(stats, 0, "bench").draw(step_rng(0, 0, next(step)), args.batch),
        args.repeats,
    )
    print(f"rows={args.rows:,} batch={args.batch} (median of {args.repeats})")
    print(f"numpy Generator.choice(p=...)     {numpy_s * 1e3:8.3f} ms   1.00x")
    print(f"dynstate draw (plan built)         {draw_s * 1e3:8.3f} ms   {draw_s / numpy_s:.2f}x")
    print(
        f"dynstate rebuild from stats + draw {rebuild_s * 1e3:8.3f} ms   {rebuild_s / numpy_s:.2f}x"
    )


if __name__ == "__main__":
    main()
