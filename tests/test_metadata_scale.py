"""Metadata stays small as commits pile up (SPEC §3.8): its total grows linearly with the
number of commits, and opening the head reads metadata proportional to the head's shards, not
to the history."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from dynstate import CorruptStoreError, Store, VersionCollectedError
from dynstate.maintenance.compact import compact
from dynstate.maintenance.gc import collect_garbage
from dynstate.records import manifest as m
from dynstate.storage import Storage

T = TypeVar("T")
N = 300  # versions; the store is grown to 3N (+ a partial checkpoint interval) once
HEAD = 3 * N + m.CHECKPOINT_INTERVAL - 1  # 1,000 versions: the most records back to a checkpoint


def _metadata_bytes(store: Store) -> int:
    fs = store.storage.fs
    return sum(fs.size(p) for p in fs.find(store.storage.path(m.META_DIR)))


def _counted(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], T]) -> tuple[T, list[str]]:
    """``fn()`` and the files it read (a name once per read, missing ones included)."""
    read: list[str] = []
    real = Storage.read

    def counting_read(self: Storage, rel: str, **kwargs: Any) -> bytes:
        read.append(rel)
        return real(self, rel, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Storage, "read", counting_read)
        return fn(), read


def _open_head_cost(url: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, int]:
    """(reads, bytes read, shards) for a fresh process-like handle to open the head and
    read its shard list (what reading its rows needs first)."""
    m._DECODED.clear()
    m._RECORDS.clear()
    shards, read = _counted(monkeypatch, lambda: Store.open(url).snapshot().shards)
    storage = Store.open(url).storage
    return len(read), sum(len(d) for d in storage.read_many(read) if d is not None), len(shards)


def _count_head_rows(url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What a fresh process-like handle reads to open the store and count the head's rows
    (``Store.open(url).snapshot().num_rows``), then to list the head's shards."""
    m._DECODED.clear()
    m._RECORDS.clear()

    def open_and_count() -> tuple[Any, int]:
        snap = Store.open(url).snapshot()
        return snap, snap.num_rows

    (snap, rows), read = _counted(monkeypatch, open_and_count)
    shards, walked = _counted(monkeypatch, lambda: snap.shards)
    return {"rows": rows, "read": read, "shards": shards, "walked": walked}


@pytest.fixture(scope="module")
def grown() -> dict[str, Any]:
    """One store grown in small rounds, measured on the way at N, N + 50, 3N, 3N + 50."""
    url = f"memory://metadata-scale/{uuid.uuid4().hex}"
    store = Store.open(url, create=True)
    marks = {N: "meta", N + 50: "open", 3 * N: "meta", 3 * N + 50: "open", HEAD: "count"}
    out: dict[str, Any] = {"url": url, "meta": {}, "open": {}}
    monkeypatch = pytest.MonkeyPatch()
    try:
        for step in range(1, HEAD + 1):
            rows = [{"step": step, "prompt": f"task {step}.{j}", "answer": j} for j in range(3)]
            store.append(rows, meta={"step": step, "generator": "test"})
            if marks.get(step) == "meta":
                out["meta"][step] = _metadata_bytes(store)
            elif marks.get(step) == "open":
                out["open"][step] = _open_head_cost(url, monkeypatch)
            elif marks.get(step) == "count":
                out["count"] = _count_head_rows(url, monkeypatch)
    finally:
        monkeypatch.undo()
    out["store"] = store
    return out


def test_metadata_bytes_grow_linearly(grown: dict[str, Any]) -> None:
    small, large = grown["meta"][N], grown["meta"][3 * N]
    assert large <= 3.6 * small, f"{N} versions: {small} B, {3 * N} versions: {large} B"


def test_opening_the_head_reads_metadata_proportional_to_its_shards(grown) -> None:
    reads_small, bytes_small, shards_small = grown["open"][N + 50]
    reads_large, bytes_large, shards_large = grown["open"][3 * N + 50]
    # Records read: at most one checkpoint interval of log records, the chunks of the head's
    # shard list and a few fixed files — not one per version of the history.
    bound = m.CHECKPOINT_INTERVAL + shards_large // m.CHUNK_ENTRIES + 20
    assert reads_large <= bound
    assert reads_large <= reads_small + 10
    # Bytes read follow the shard count (the shard list must be read), not the version count.
    assert bytes_large / shards_large <= 1.3 * bytes_small / shards_small


def test_counting_the_head_rows_reads_no_shard_list(grown) -> None:
    """Open + count at 1,000 versions (issue 23.2): store.json, gc.json, the head hint, the
    head's record and the probe past it, then the snapshot's refresh (gc.json, hint, probe) —
    no record below the head, no checkpoint, chunk or schema. The shard list is read when
    asked for: the records back to the checkpoint, it and its chunks."""
    count = grown["count"]
    assert count["rows"] == 3 * HEAD
    read = count["read"]
    fixed = {m.STORE_FILE, m.GC_FILE, m.HEAD_HINT, m.log_path(HEAD), m.log_path(HEAD + 1)}
    assert set(read) <= fixed, read
    assert len(read) <= 8, read
    assert read.count(m.log_path(HEAD)) == 1, read
    walked, below = count["walked"], HEAD - HEAD % m.CHECKPOINT_INTERVAL
    assert [p for p in walked if p.startswith(f"{m.META_DIR}/log/")] == [
        m.log_path(v) for v in range(HEAD - 1, below - 1, -1)
    ]
    assert m.checkpoint_path(below) in walked
    assert len(count["shards"]) == HEAD and sum(s.rows for s in count["shards"]) == 3 * HEAD


def test_compaction_shrinks_the_head_shard_list(grown, monkeypatch) -> None:
    store: Store = grown["store"]
    before = _open_head_cost(grown["url"], monkeypatch)
    compact(store)
    reads, nbytes, shards = _open_head_cost(grown["url"], monkeypatch)
    assert shards == 1
    assert nbytes < before[1] / 10
    assert reads < before[0]


# -- a snapshot reads its shard list when first asked: errors come then ----------------------


def _small(tmp_path) -> tuple[str, Store]:
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    for step in range(6):
        store.append([{"id": 10 * step + j} for j in range(3)], meta={"step": step})
    return url, store


def test_a_damaged_record_below_the_head_raises_when_rows_are_read(tmp_path) -> None:
    url, store = _small(tmp_path)
    rel = m.log_path(3)
    store.storage.put(rel, store.storage.read(rel)[:-40])  # torn: not JSON any more
    snap = Store.open(url).snapshot()
    assert snap.version == 6 and snap.num_rows == 18  # from the head's record alone
    for read in (lambda: snap.shards, lambda: snap.locate(0), snap.to_arrow):
        with pytest.raises(CorruptStoreError, match=rel):
            read()
    with pytest.raises(CorruptStoreError, match=rel):
        Store.open(url).snapshot(4).to_arrow()


def test_a_row_count_the_shard_list_does_not_hold_is_refused(tmp_path) -> None:
    """A record whose count was altered (a valid checksum: a tool that knows the format)
    while every shard entry is true: counting shows the record's figure, as `dynstate ls`
    does, and reading rows refuses the version, naming it."""
    url, store = _small(tmp_path)
    rel = m.log_path(6)
    body = m.decode(store.storage.read(rel), rel)
    store.storage.put(rel, m.encode({**body, "num_rows": 99}))
    m._RECORDS.clear()
    snap = Store.open(url).snapshot()
    assert snap.num_rows == 99
    with pytest.raises(CorruptStoreError, match=r"version 6 .* counts 99 rows .* holds 18"):
        snap.to_arrow()


def test_a_snapshot_read_after_a_gc_walks_from_the_new_floor(tmp_path) -> None:
    """A snapshot made before a gc and read after it: the head's is read from the floor's
    checkpoint (its handle's floor was older and the records below were collected); one of
    a collected version raises VersionCollectedError."""
    url, store = _small(tmp_path)
    reader = Store.open(url)
    head, old = reader.snapshot(), reader.snapshot(2)
    assert collect_garbage(store, keep=2, grace_s=0, dry_run=False).floor_after == 5
    assert head.to_arrow().column("id").to_pylist() == [
        10 * s + j for s in range(6) for j in range(3)
    ]
    with pytest.raises(VersionCollectedError, match=r"version 2 .*oldest kept is 5"):
        _ = old.shards
