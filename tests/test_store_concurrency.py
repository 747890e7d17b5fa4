"""Several processes append to one store at once: every round lands exactly once, as its own
version, and version numbers have no gaps (SPEC §3.2)."""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter

from dynstate import Store

WRITERS = 4
ROUNDS = 25
ROWS = 3


def _writer(url: str, writer: int, barrier, results) -> None:
    # Each process its own Store, as separate hosts would have.
    store = Store.open(url)
    barrier.wait(timeout=120)
    versions = []
    for k in range(ROUNDS):
        data = [{"writer": writer, "round": k, "row": r} for r in range(ROWS)]
        versions.append(store.append(data, meta={"writer": writer, "round": k}))
    results.put((writer, versions))


def test_concurrent_writers_lose_nothing(durable_url: str) -> None:
    store = Store.open(durable_url, create=True)
    store.append([{"writer": -1, "round": -1, "row": 0}])
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(WRITERS)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(durable_url, w, barrier, results)) for w in range(WRITERS)
    ]
    for p in procs:
        p.start()
    returned = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    fresh = Store.open(durable_url)
    assert fresh.head == 1 + WRITERS * ROUNDS
    # Each writer got distinct, increasing version numbers; together they are gap-free.
    claimed = sorted(v for vs in returned.values() for v in vs)
    assert claimed == list(range(2, 2 + WRITERS * ROUNDS))
    for vs in returned.values():
        assert vs == sorted(vs)

    records = fresh.versions()
    assert [r.version for r in records] == list(range(fresh.head + 1))
    for r in records[1:]:
        assert r.parent == r.version - 1 and r.op == "append"
    # The record of each version is the round its writer was told it committed.
    for writer, vs in returned.items():
        for k, v in enumerate(vs):
            assert records[v].meta == {"writer": writer, "round": k}
            assert records[v].rows_added == ROWS

    table = fresh.snapshot().to_arrow()
    columns = [table.column(c).to_pylist() for c in ("writer", "round", "row")]
    keys = list(zip(*columns, strict=True))
    counts = Counter(keys)
    assert all(n == 1 for n in counts.values())
    assert len(keys) == 1 + WRITERS * ROUNDS * ROWS
    # Within the head, each writer's rounds appear in the order it committed them, and every
    # version's rows are a prefix of the head's (row identity under contention).
    for writer in range(WRITERS):
        order = [k for w, k, r in keys if w == writer and r == 0]
        assert order == list(range(ROUNDS))
    assert fresh.snapshot(50).to_arrow().to_pylist() == table.slice(0, 1 + 49 * ROWS).to_pylist()
