"""``Log.on_lineage`` remembers, per ancestor, the newest version it found holding it, so that
a run's next commit (rows read at an old pinned version) walks one version instead of back to
the ancestor. Checked against a plain walk of the commit records' parents and reset targets,
on random histories of appends and resets, with the queries in random order on one handle
(the memo in use) and on fresh handles."""

from __future__ import annotations

import random

import pytest

from dynstate import Store


def plain_lineage(store: Store, version: int) -> set[int]:
    out = set()
    v: int | None = version
    while v is not None:
        out.add(v)
        record = store.commit_record(v)
        v = record.target if record.op == "reset" else record.parent
    return out


@pytest.mark.parametrize("seed", range(6))
def test_on_lineage_equals_a_plain_walk_of_the_records(tmp_path, seed) -> None:
    rng = random.Random(seed)
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"i": 0}])
    for _ in range(rng.randint(10, 30)):
        if rng.random() < 0.25 and store.head > 1:
            store.reset(rng.randint(1, store.head - 1))
        else:
            store.append([{"i": rng.randint(0, 99)}] * rng.randint(0, 2))
    head = store.head
    truth = {v: plain_lineage(store, v) for v in range(head + 1)}
    pairs = [(a, v) for v in range(head + 1) for a in range(head + 1)]
    # a run's pattern first (one old ancestor, each newer version in turn), then random order
    walks = [(1, v) for v in range(1, head + 1)] + rng.sample(pairs, len(pairs))
    log = Store.open(url).log
    for ancestor, version in walks:
        assert log.on_lineage(ancestor, version) == (ancestor in truth[version]), (
            ancestor,
            version,
        )
    for ancestor, version in rng.sample(pairs, 40):  # fresh handles: no memo
        fresh = Store.open(url).log
        assert fresh.on_lineage(ancestor, version) == (ancestor in truth[version])
