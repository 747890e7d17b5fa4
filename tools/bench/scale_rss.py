"""Worker of tools/bench/scale.py: loader memory over a store of N rows, in a fresh process.

    python tools/bench/scale_rss.py /tmp/dynstate-bench-scale/rss-1000000 1000000 --build-only
    python tools/bench/scale_rss.py /tmp/dynstate-bench-scale/rss-1000000 1000000

Builds the store once (rounds of 100k rows, 1 MiB shards), then iterates a shuffled
``StatefulDataLoader`` over ``VersionedDataset`` + ``VersionedSampler`` with a bounded shard
cache, and prints one JSON line: resident memory before opening the dataset, after iterating,
and the process peak. What must not grow with N is everything but the cache.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.compute as pc

ROUND_ROWS = 100_000
WORDS = [f"w{i:04d}{'abcdefgh'[i % 8] * (i % 5)}" for i in range(4096)]


def _round(start: int, rows: int) -> pa.Table:
    ids = pa.array(range(start, start + rows), pa.int64())
    vocab = pa.array(WORDS)
    words = [pc.take(vocab, pc.bit_wise_and(pc.multiply(ids, k), 4095)) for k in (7, 31, 131, 521)]
    prompt = pc.binary_join_element_wise(
        "Solve task ", pc.cast(ids, pa.string()), ": ", *words, " "
    )
    return pa.table(
        {"id": ids, "prompt": prompt, "reward": pc.divide(pc.cast(ids, pa.float64()), 7)}
    )


def build(path: Path, rows: int) -> None:
    from dynstate import Store

    store = Store.open(str(path), create=True)
    have = store.snapshot().num_rows
    if have > rows:
        raise SystemExit(f"{path} holds {have} rows, more than {rows}; delete it")
    t0 = time.perf_counter()
    while have < rows:
        n = min(ROUND_ROWS, rows - have)
        store.append(_round(have, n), shard_bytes=2**20, meta={"first_id": have})
        have += n
    if time.perf_counter() - t0 > 1:
        print(f"  built {path.name} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)


def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("path", type=Path)
    parser.add_argument("rows", type=int)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--cache-mib", type=int, default=64)
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    if args.build_only:
        build(args.path, args.rows)
        return 0
    # Building in this process would leave its allocations in the baseline; build apart.
    from dynstate import Store, StoreNotFoundError

    try:
        rows = Store.open(str(args.path)).snapshot().num_rows
    except StoreNotFoundError:
        rows = None
    if rows != args.rows:
        raise SystemExit(f"{args.path} does not hold {args.rows} rows; run with --build-only")

    import torch  # noqa: F401  (imported before the baseline so it is not counted)
    from torchdata.stateful_dataloader import StatefulDataLoader

    from dynstate import VersionedDataset, VersionedSampler

    before = _rss_mib()
    dataset = VersionedDataset(str(args.path), cache_bytes=args.cache_mib * 2**20)
    sampler = VersionedSampler(dataset, shuffle=True, seed=0, batch_size=args.batch_size)
    loader = StatefulDataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, collate_fn=lambda rows: rows
    )
    t0 = time.perf_counter()
    seen = 0
    for i, batch in enumerate(loader):
        seen += len(batch)
        if i + 1 >= args.batches:
            break
    took = time.perf_counter() - t0
    state = loader.state_dict()
    after = _rss_mib()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {
        "rows": args.rows,
        "shards": len(dataset.snapshot().shards),
        "rows_read": seen,
        "cache_mib": args.cache_mib,
        "rss_before_mib": round(before, 1),
        "rss_after_mib": round(after, 1),
        "loader_rss_mib": round(after - before, 1),
        "peak_rss_mib": round(peak, 1),
        "state_bytes": len(json.dumps(state, default=str)),
        "ms_per_batch": round(took / max(1, args.batches) * 1000, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
