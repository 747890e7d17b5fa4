"""A spike for issue 23's S3 target: decode a shard's row group without its footer.

A random batch on S3 fetches, per shard it touches, the row groups holding its rows and the
shard's footer (the Parquet metadata pyarrow needs to decode anything). The footer is ~63
bytes of Thrift per column chunk; at 128 rows per group it is as large as the groups a batch
reads, so the bytes a first batch fetches cannot go under ~5.6 % of the store (see
docs/benchmarks.md). This spike shows that the footers need not be fetched at all:

* a row group's own bytes hold its column chunks as runs of pages, each page with a header
  that gives its sizes and its value (or, in data pages v2, row) count, so the page headers
  alone say where each column chunk starts and ends and what the footer would say of it;
* everything else in a footer (the Parquet schema, the Arrow schema, the codec, created_by)
  is the same for every shard of one schema written by one writer: one footer, fetched once
  per process, is a template;
* a footer for that one row group, built from the template and the page headers, and the
  group's bytes make a small Parquet file that pyarrow decodes.

It builds the cold-read benchmark's store (1M rows, 100 shards) at the row-group sizes
asked for, draws the same first batch as ``bench_cold.py``'s S3 run, checks that every row
group it touches decodes, through a synthesized footer, to exactly what pyarrow reads with
the real footer, and reports what the batch would fetch with and without footers (bytes and
ranged requests, computed from the recorded segments: the "with" figure is what the loopback
S3 run measures), and the decode time per group both ways. It measures the library's own
:mod:`dynstate.records.footers` (docs/format.md, "Footer templates") on the bytes of a local store.

    python tools/bench/bench_footerless.py --row-groups 128,256 --dir /tmp/bfl
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys
import time
from itertools import accumulate
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cold import BATCH, build
from bench_resume import rows_table

import dynstate.records.rowgroups as rowgroups
from dynstate import Store
from dynstate.records.footers import Template, mini_file, template_for

# -- the measurement -------------------------------------------------------------------------


def _ranges(segments: list[int]) -> int:
    """How many ranged reads fetch these sorted segments (adjacent ones travel together)."""
    return sum(1 for k, s in enumerate(segments) if k == 0 or s != segments[k - 1] + 1)


def measure(store: Store, root: Path, num_rows: int, repeats: int) -> None:
    shards = store.snapshot().shards
    total = sum(s.bytes for s in shards)
    starts = list(accumulate((s.rows for s in shards), initial=0))
    idx = np.random.default_rng(1).choice(num_rows, BATCH, replace=False).tolist()
    wanted: dict[int, set[int]] = {}
    for row in idx:
        k = bisect.bisect_right(starts, row) - 1
        groups = shards[k].groups
        assert groups is not None
        g = bisect.bisect_right(list(accumulate(groups.rows, initial=0)), row - starts[k]) - 1
        wanted.setdefault(k, set()).add(g)
    with_bytes = without_bytes = with_requests = without_requests = 0
    template: Template | None = None
    work = []
    for k, groups_wanted in sorted(wanted.items()):
        shard = shards[k]
        info = shard.groups
        assert info is not None
        bounds = [0, *accumulate(info.bytes)]
        footer_at = len(info.rows)
        picked = sorted(groups_wanted)
        group_bytes = sum(info.bytes[g] for g in picked)
        with_bytes += group_bytes + info.bytes[footer_at]
        with_requests += _ranges([*picked, footer_at])
        without_bytes += group_bytes
        without_requests += _ranges(picked)
        data = (root / shard.path).read_bytes()
        if template is None:  # the one footer a process fetches: the first shard's
            # as the reader learns it: rebuilt from the footer's schema, kept if the record names it
            template = template_for(pq.ParquetFile(pa.BufferReader(data)).schema_arrow, "lz4")
            if template is None or template.digest != info.template:
                raise SystemExit(f"shard {shard.path}: its footer does not imply its template")
            without_bytes += info.bytes[footer_at]
            without_requests += 1
        # segment 0 holds the leading magic
        pieces = [(bounds[g] + (4 if g == 0 else 0), bounds[g + 1], info.rows[g]) for g in picked]
        work.append((shard.path, data, picked, pieces))
    assert template is not None
    checked = fallbacks = 0
    for path, data, picked, pieces in work:
        expected = pq.ParquetFile(pa.BufferReader(data)).read_row_groups(picked)
        for g, (lo, hi, rows) in zip(picked, pieces, strict=True):
            mini = mini_file(template, memoryview(data)[lo:hi], rows)
            if mini is None:
                fallbacks += 1
                continue
            got = pq.ParquetFile(pa.BufferReader(mini)).read_row_group(0)
            if not got.equals(expected.slice(sum(p[2] for p in pieces[: picked.index(g)]), rows)):
                raise SystemExit(f"shard {path}: row group {g} decodes differently")
            checked += 1
    footer_s: list[float] = []
    synth_s: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _, data, picked, _ in work:  # the footer parsed, then the groups: today's read
            real = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False)
            real.read_row_groups(picked, use_threads=False)
        footer_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _, data, _, pieces in work:
            parts = []
            for lo, hi, rows in pieces:
                mini = mini_file(template, memoryview(data)[lo:hi], rows)
                assert mini is not None
                small = pq.ParquetFile(pa.BufferReader(mini), pre_buffer=False)
                parts.append(small.read_row_group(0, use_threads=False))
            pa.concat_tables(parts)
        synth_s.append(time.perf_counter() - t0)
    groups_read = sum(len(w[2]) for w in work)
    print(
        f"  first batch of {BATCH} rows: {len(work)} shards, {groups_read} row groups; "
        f"{checked} decoded through a synthesized footer to exactly the real footer's "
        f"decode, {fallbacks} could not be"
    )
    print(
        f"  with footers:    {with_bytes / total:.1%} of the store ({with_bytes / 2**20:.2f} of "
        f"{total / 2**20:.1f} MiB), {with_requests} ranged reads"
    )
    print(
        f"  without footers: {without_bytes / total:.1%} of the store "
        f"({without_bytes / 2**20:.2f} MiB, one footer), {without_requests} ranged reads"
    )
    print(
        f"  decoding the batch's groups, median of {repeats} (in memory, one thread): "
        f"each footer parsed {statistics.median(footer_s) * 1e3:.1f} ms, footers "
        f"synthesized {statistics.median(synth_s) * 1e3:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--row-groups", default="128,256")
    parser.add_argument("--dir", default="/tmp/dynstate-bench-footerless")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    table = rows_table(args.rows)
    for size in (int(s) for s in args.row_groups.split(",")):
        path = Path(args.dir) / f"store-{size}"
        if path.exists():
            store = Store.open(str(path))
        else:
            rowgroups.ROW_GROUP_ROWS = rowgroups.OBJECT_STORE_GROUP_ROWS = size
            store = build(str(path), table, args.shards)
        print(f"row groups of {size} rows ({args.rows:,} rows, {args.shards} shards):")
        measure(store, path, args.rows, args.repeats)


if __name__ == "__main__":
    main()
