"""`dynstate serve` benchmark (issue 16): start-up on a store of 10,000 versions, descendant
lookups on a store of 1,000,000 rows, and the first pass-rate band chart of a long run.

* **Start-up** — ``python -m dynstate.serve DIR --port 0`` is started as a user would start
  it; measured: until the server answers its first page of versions (target < 2 s), until
  ``/api/store`` with the growth chart over the whole lineage answers, and until the store page
  does. Baseline in the same run: a bare ``python -c "import dynstate; Store.open(DIR)"``.
* **Descendants** — the first lookup builds the per-version index (it reads the
  ``_dynstate_source`` column of every shard once); then row pages (``/api/versions/head/rows/
  {i}``, over HTTP, with ancestors and descendants) for random rows (target < 1 s). Baseline:
  finding one row's children by scanning the version's source column, which is what a lookup
  without an index costs.

* **Bands** (issue 21) — the first ``/outcomes`` document (statistics and rows per pass-rate
  band at ``--points`` steps) of a store of ``--steps`` steps of ``--outcomes`` outcome
  records each, on a fresh server: where it is cheaper it reads one stored aggregate and the
  outcome files after it per point, else every record once. Baseline: reading every outcome
  record of the lineage, what the first chart always read before.

The stores are built once into ``--dir`` (in memory, then copied to disk: writing 10,000
versions with an fsync each is not what is measured) and reused by later runs.

    python tools/bench/bench_serve.py --dir /tmp/serve-bench
    python tools/bench/bench_serve.py --dir /tmp/serve-bench --versions 2000 --rows 200000
    python tools/bench/bench_serve.py --dir /tmp/serve-bench --sections startup
    python tools/bench/bench_serve.py --dir /tmp/serve-bench --sections bands --steps 2000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa

from dynstate import Store

SOURCE = pa.list_(pa.int64())


def _copy_out(memory_url: str, target: Path) -> None:
    fs = fsspec.filesystem("memory")
    root = memory_url.removeprefix("memory://")
    for path in fs.find(root):
        rel = path.lstrip("/")[len(root.lstrip("/")) :].lstrip("/")
        out = target / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(fs.cat_file(path))
    fs.rm(root, recursive=True)


def build_versions(target: Path, versions: int) -> None:
    """``versions`` small rounds (8 rows each), a rollback every 1,000 and a few empty ones."""
    url = f"memory://bench-serve/{uuid.uuid4().hex}"
    store = Store.open(url, create=True)
    step = 0
    started = time.perf_counter()
    while store.head < versions - 1:
        if store.head % 1000 == 999:
            store.reset(store.head - 3, meta={"rollback_from": store.head})
            step -= 3
            continue
        n = 0 if step % 97 == 0 else 8
        rows = [{"prompt": f"task {step}.{j}", "answer": str(j), "_dynstate_source": [j]}
                for j in range(n)]  # fmt: skip
        table = pa.Table.from_pylist(
            rows,
            pa.schema(
                [("prompt", pa.string()), ("answer", pa.string()), ("_dynstate_source", SOURCE)]
            ),
        )
        store.append(table, meta={"step": step, "generator": f"g{step % 3}"})
        step += 1
        if store.head % 1000 == 0:
            print(f"  {store.head} versions ({time.perf_counter() - started:.0f} s)", flush=True)
    _copy_out(url, target)


def build_rows(target: Path, rows: int, rounds: int, seed: int = 0) -> None:
    """``rows`` rows in ``rounds`` rounds; each generated row names 1-3 earlier rows as
    sources, more often recent ones (as a generator working from the latest failures)."""
    url = f"memory://bench-serve/{uuid.uuid4().hex}"
    store = Store.open(url, create=True)
    rng = np.random.default_rng(seed)
    per = rows // rounds
    total = 0
    for k in range(rounds):
        ids = np.arange(total, total + per)
        if total == 0:
            offsets = np.zeros(per + 1, dtype=np.int32)
            values = np.empty(0, dtype=np.int64)
        else:
            counts = rng.integers(1, 4, per)
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            recent = rng.random(offsets[-1]) < 0.7
            lo = np.where(recent, max(0, total - 5 * per), 0)
            values = (lo + rng.random(offsets[-1]) * (total - lo)).astype(np.int64)
        table = pa.table(
            {
                "prompt": pa.array([f"task {i}" for i in ids]),
                "reward": pa.array(rng.random(per)),
                "_dynstate_source": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            }
        )
        store.append(table, meta={"step": k, "generator": "proposer"})
        total += per
        if (k + 1) % 100 == 0:
            print(f"  {total} rows", flush=True)
    _copy_out(url, target)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=600) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


def startup(path: Path, repeats: int) -> None:
    base_cmd = [sys.executable, "-c", f"import dynstate; dynstate.Store.open({str(path)!r})"]
    bare = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(base_cmd, check=True)
        bare.append(time.perf_counter() - t0)
    first, full, page = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynstate.serve", str(path), "--port", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = proc.stdout.readline()
            base = line.split(" at ")[1].split()[0].rstrip("/")
            while _get(base + "/api/versions?limit=50")[0] != 200:
                time.sleep(0.005)
            first.append(time.perf_counter() - t0)
            status, body = _get(base + "/api/store")
            assert status == 200, body[:300]
            full.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            assert _get(base + "/")[0] == 200
            page.append(time.perf_counter() - t1)
            info = json.loads(body)
        finally:
            proc.terminate()
            proc.wait(30)
    med = statistics.median
    print(f"store: {info['versions']} versions, {info['rows']} rows, head {info['head']}, "
          f"{len(info['growth']['markers'])} marks on the chart")  # fmt: skip
    print(
        f"  bare `import dynstate; Store.open`:           {med(bare):6.2f} s (median of {repeats})"
    )
    print(
        f"  serve: first page of versions answered after {med(first):6.2f} s "
        f"({med(first) / med(bare):.2f}x the bare open; target < 2 s)"
    )
    print(f"  serve: /api/store with the growth chart after {med(full):6.2f} s")
    print(f"  then the store page (HTML + SVG) in           {med(page):6.2f} s")


def descendants(path: Path, lookups: int) -> None:
    from dynstate.serve.api import StoreView
    from dynstate.serve.lineage import source_edges

    store = Store.open(str(path))
    snap = store.snapshot()
    print(f"store: {snap.num_rows} rows in {len(snap.shards)} shards, head {store.head}")
    rng = random.Random(1)
    targets = [rng.randrange(snap.num_rows // 2) for _ in range(lookups)]

    # Baseline: one row's children without an index: scan the version's source column.
    t0 = time.perf_counter()
    found = []
    for i in range(len(snap.shards)):
        src, child = source_edges(snap.read_shard(i), snap.offsets[i])
        found.append(child[src == targets[0]])
    scan_children = sorted(set(np.concatenate(found).tolist()))
    scan = time.perf_counter() - t0

    view = StoreView(store)
    t0 = time.perf_counter()
    index = view.lineage.index(store.head)
    build = time.perf_counter() - t0
    assert index.children_of(targets[0]) == scan_children
    t0 = time.perf_counter()
    for t in targets:
        index.children_of(t)
    per_lookup = (time.perf_counter() - t0) / len(targets)

    import threading

    import uvicorn

    from dynstate.serve.app import create_app
    from dynstate.serve.net import address, bind

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(view, warm=False), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    base = address(sock)
    pages = []
    for t in targets:
        t0 = time.perf_counter()
        status, body = _get(f"{base}/api/versions/head/rows/{t}")
        pages.append(time.perf_counter() - t0)
        assert status == 200, body[:300]
    server.should_exit = True
    thread.join()
    pages.sort()
    print(f"  baseline: one row's children by scanning the source column: {scan:.2f} s")
    print(f"  index build (first lookup of this version):  {build:.2f} s "
          f"({index.edges} edges; {build / scan:.2f}x one scan)")  # fmt: skip
    print(f"  lookup in the built index:                   {per_lookup * 1e6:.0f} us "
          f"({scan / per_lookup:,.0f}x faster than a scan)")  # fmt: skip
    print(
        f"  row page over HTTP (content, ancestors, descendants, previews), {len(pages)} random "
        f"rows: median {statistics.median(pages):.3f} s, p95 {pages[int(0.95 * len(pages))]:.3f}"
        f" s, max {pages[-1]:.3f} s (target < 1 s)"
    )


def build_outcomes(target: Path, steps: int, outcomes: int, rows: int) -> None:
    """``rows`` prompts, then ``steps`` empty rounds, each with ``outcomes`` scored samples."""
    url = f"memory://bench-serve/{uuid.uuid4().hex}"
    store = Store.open(url, create=True)
    store.append(pa.table({"prompt": [f"p{i}" for i in range(rows)]}))
    rng = np.random.default_rng(0)
    for step in range(steps):
        scored = pa.table(
            {
                "row": rng.integers(0, rows, outcomes),
                "step": np.full(outcomes, step),
                "score": rng.random(outcomes),
            }
        )
        store.append([], meta={"step": step}, outcomes=scored)
    _copy_out(url, target)


def bands(path: Path, repeats: int, points: int) -> None:
    from dynstate.history.outcomes import OutcomeViews

    def timed(fn: object) -> float:
        store = Store.open(str(path))  # a fresh handle: nothing cached
        t0 = time.perf_counter()
        fn(store)  # type: ignore[operator]
        return time.perf_counter() - t0

    def series(store: Store) -> None:
        out["doc"] = OutcomeViews(store).band_series(store.head, points=points)

    def fold(store: Store) -> None:
        OutcomeViews(store)._fold(store.head, 10)  # the earlier way, forced

    out: dict[str, dict] = {}
    timed(series)  # imports and the page cache, untimed
    baseline = [timed(lambda st: st.outcome_records()) for _ in range(repeats)]
    folded = [timed(fold) for _ in range(repeats)]
    first = [timed(series) for _ in range(repeats)]
    med = statistics.median
    doc = out["doc"]
    print(
        f"store: {doc['rows']:,} rows, {doc['steps_recorded']:,} steps, "
        f"{doc['records']:,} outcome records; {len(doc['steps'])} points"
    )
    print(f"  baseline: reading every outcome record:       {med(baseline):6.2f} s")
    print(f"  the fold of every record (the earlier way):   {med(folded):6.2f} s")
    print(
        f"  first band series (the cheaper way chosen):   {med(first):6.2f} s "
        f"({med(first) / med(folded):.2f}x the fold)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/dynstate-serve-bench")
    parser.add_argument("--versions", type=int, default=10_000)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lookups", type=int, default=50)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--outcomes", type=int, default=2_048)
    parser.add_argument("--points", type=int, default=240)
    parser.add_argument("--sections", default="startup,descendants")
    args = parser.parse_args()
    sections = args.sections.split(",")
    root = Path(args.dir)
    many = root / f"versions-{args.versions}"
    big = root / f"rows-{args.rows}-{args.rounds}"
    if "startup" in sections and not (many / "_dynstate").exists():
        print(f"building a store of {args.versions} versions in {many} ...")
        build_versions(many, args.versions)
    if "descendants" in sections and not (big / "_dynstate").exists():
        print(f"building a store of {args.rows} rows in {big} ...")
        build_rows(big, args.rows, args.rounds)
    scored = root / f"outcomes-{args.steps}-{args.outcomes}-{args.rows}"
    if "bands" in sections and not (scored / "_dynstate").exists():
        print(f"building a store of {args.steps} steps in {scored} ...")
        build_outcomes(scored, args.steps, args.outcomes, args.rows)
    if "startup" in sections:
        print(f"\n== start-up ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}) ==")
        startup(many, args.repeats)
    if "descendants" in sections:
        print(f"\n== descendants (load {os.getloadavg()[0]:.1f}) ==")
        descendants(big, args.lookups)
    if "bands" in sections:
        print(f"\n== bands (load {os.getloadavg()[0]:.1f}) ==")
        bands(scored, args.repeats, args.points)


if __name__ == "__main__":
    main()
