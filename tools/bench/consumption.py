"""Cost of recording consumption (issue 42.7): a dynamic-sampling step's round committed with
its outcomes, against the same round and outcomes committed with the step's consumption
record too, into two stores of the same size, alternated step by step in one process.

Each step: ``DynamicSampling`` over the second store draws generation batches of
``--gen-batch`` rows, a stand-in scorer gives every row ``--group`` scores (a third of the
groups all equal, so the zero-variance rule filters them), and ``--train-groups`` groups are
trained (default 256 x 8 = 2,048 responses); the surplus is carried. The timed part is the
``append`` alone: a 64-row round plus the trained responses' outcomes, with and without
``consumption=batch.record``. Target: at most +5 %.

Then the resume's lookup: the record of step ``at`` that ``DynamicSampling.resume(at)``
continues from (``Store.consumption.of_step``), on a fresh handle while the head is one step
on (a crash right after the step's round), at step 10 and at the last step but one, counting
the storage calls (the storage's read and list methods wrapped) — the same number at both is
the claim "the same storage work at step 10,000 as at 10".

    python tools/bench/consumption.py --dir /tmp/bench-consumption
    python tools/bench/consumption.py --dir /tmp/bench-consumption --steps 60 --s3  # loopback S3

Never part of the tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

ROUND_ROWS = 64


def seed_rows(rows: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "prompt": pa.array([f"seed task {i} " + "x" * 60 for i in range(rows)]),
        }
    )


def round_table(step: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(np.arange(ROUND_ROWS, dtype=np.int64) + 10_000_000 * (step + 1)),
            "prompt": pa.array([f"step {step} task {i} " + "x" * 60 for i in range(ROUND_ROWS)]),
        }
    )


def make_scorer(group: int) -> Any:
    def score(items: list[dict[str, Any]], step: int) -> list[list[float]]:
        out = []
        for item in items:
            key = int(item["id"]) * 7 + step
            if key % 3 == 0:
                out.append([1.0] * group)  # no signal: filtered
            else:
                out.append([float((key + k) % 2) for k in range(group)])
        return out

    return score


class Counting:
    """Counts the storage calls a store makes (reads and listings), by wrapping the storage's
    own methods on the instance."""

    NAMES = ("read", "read_ranges", "try_read", "read_many", "exists", "size", "list", "modified")

    def __init__(self, storage: Any) -> None:
        self.calls = 0
        for name in self.NAMES:
            method = getattr(storage, name, None)
            if method is not None:
                setattr(storage, name, self._wrap(method))

    def _wrap(self, method: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return method(*args, **kwargs)

        return counted


def build(url: str, rows: int, options: dict[str, Any]) -> Any:
    from dynstate import Store

    store = Store.open(url, create=True, storage_options=options)
    if store.head == 0:
        store.append(seed_rows(rows), meta={"step": -1})
    return store


def run(args: argparse.Namespace, base: str, options: dict[str, Any]) -> None:
    from dynstate import DynamicSampling, VersionedDataset, VersionedSampler

    plain = build(f"{base}/plain", args.rows, options)
    store = build(f"{base}/consumed", args.rows, options)
    ds = VersionedDataset(f"{base}/consumed", storage_options=options)
    sampler = VersionedSampler(ds, seed=0)
    dyn = DynamicSampling(
        ds,
        sampler,
        gen_batch_size=args.gen_batch,
        train_groups=args.train_groups,
        max_gen_batches=None,
        surplus="carry",
    )
    dyn.resume(None)
    score = make_scorer(args.group)
    with_record, without = [], []
    lookups: dict[int, tuple[int, float]] = {}
    responses = []
    for step in range(args.steps):
        batch = dyn.next_batch(step, score)
        outcomes = batch.outcomes()
        responses.append(len(outcomes))
        table = round_table(step)
        for which in (0, 1) if step % 2 else (1, 0):
            t0 = time.perf_counter()
            if which == 0:
                plain.append(table, meta={"step": step}, outcomes=outcomes)
                without.append(time.perf_counter() - t0)
            else:
                store.append(
                    table,
                    meta={"step": step},
                    outcomes=outcomes,
                    rows_version=batch.rows_version,
                    consumption=batch.record,
                )
                with_record.append(time.perf_counter() - t0)
        if step in (11, args.steps - 1):  # a resume from the checkpoint of the step before
            lookups[step - 1] = lookup(f"{base}/consumed", options, step - 1)
    print(
        f"  {args.steps} steps of {statistics.median(responses):,.0f} responses "
        f"({args.train_groups} groups x {args.group}), a {ROUND_ROWS}-row round each"
    )
    for name, fn in (("median", statistics.median), ("mean", statistics.fmean)):
        a, b = fn(without), fn(with_record)
        print(
            f"  {name}: round + outcomes {a * 1e3:.1f} ms, + consumption record "
            f"{b * 1e3:.1f} ms (+{(b - a) * 1e3:.2f} ms, {b / a:.3f}x)"
        )
    for at, (calls, elapsed) in lookups.items():
        print(
            f"  resume at step {at} (the head one step on): the record of step {at} from a "
            f"fresh handle in {calls} storage calls, {elapsed * 1e3:.1f} ms"
        )


def lookup(url: str, options: dict[str, Any], at: int) -> tuple[int, float]:
    """What ``DynamicSampling.resume(at)`` reads before it rolls back, from a fresh handle:
    the record of step ``at`` (``Store.consumption.of_step``)."""
    from dynstate import Store

    fresh = Store.open(url, storage_options=options)
    counter = Counting(fresh.storage)
    t0 = time.perf_counter()
    record = fresh.consumption.of_step(fresh.head, at)
    elapsed = time.perf_counter() - t0
    assert record is not None, at
    return counter.calls, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where the two local stores go")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gen-batch", type=int, default=128)
    parser.add_argument("--train-groups", type=int, default=256)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--s3", action="store_true", help="on the loopback S3 server")
    args = parser.parse_args(argv)
    print(f"consumption record cost, load {os.getloadavg()[0]:.1f}", flush=True)
    if args.s3:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: loopback_s3
        from loopback_s3 import loopback_s3

        with loopback_s3("bench-consumption") as server:
            run(args, "s3://bench-consumption", {"endpoint_url": server.endpoint})
    else:
        base = args.dir or tempfile.mkdtemp(prefix="dynstate-bench-consumption-")
        run(args, base, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
