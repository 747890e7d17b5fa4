"""Compaction keeps every row in order, leaves older versions readable, and loses nothing to
writers that append while it runs."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import s3_url
from hypothesis import given, settings
from hypothesis import strategies as st
from s3_faults import FaultProxy

from dynstate import (
    CommitConflictError,
    InvalidDataError,
    ShardRef,
    StorageError,
    Store,
    VersionCollectedError,
    collect_garbage,
)
from dynstate.maintenance import compact as compaction
from dynstate.maintenance.compact import compact, compact_if_needed, plan
from dynstate.maintenance.verify import verify_store
from dynstate.records import manifest as m
from dynstate.records.rowgroups import OBJECT_STORE_GROUP_ROWS

SMALL = 16384  # target bytes: about 15 tiny (~1 KiB) shards per compacted shard


def _round(step: int, rows: int) -> list[dict]:
    return [
        {"step": step, "row": j, "prompt": f"task {step}.{j} " + "x" * (j % 7)} for j in range(rows)
    ]


def _rows(store: Store, version: int | None = None) -> list[dict]:
    return store.snapshot(version).to_arrow().to_pylist()


def _assert_same_rows(expected: list[dict], got: list[dict]) -> None:
    assert len(got) == len(expected)
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have == want, f"row {i} differs after compaction"


def _data_files(store: Store) -> set[str]:
    return set(store.storage.list("data"))


def _fill(store: Store, rounds: int, rows: int = 3) -> list[dict]:
    expected: list[dict] = []
    for step in range(rounds):
        batch = _round(step, rows + step % 4)
        store.append(batch, meta={"step": step})
        expected.extend(batch)
    return expected


def test_compaction_keeps_every_row_in_order(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    expected = _fill(store, 24)
    before = {v: _rows(store, v) for v in (0, 1, 13, store.head)}
    old_head = store.snapshot()
    new = compact(store, target_bytes=SMALL)
    assert new == old_head.version + 1
    record = store.commit_record(new)
    assert record.op == "compact" and record.target == old_head.version
    snap = store.snapshot(new)
    assert 1 < len(snap.shards) < len(old_head.shards) // 4
    _assert_same_rows(expected, snap.to_arrow().to_pylist())
    # Row identity, one row at a time through the index (SPEC §3.4).
    tables = [snap.read_shard(i) for i in range(len(snap.shards))]
    for i in range(snap.num_rows):
        shard, offset = snap.locate(i)
        assert tables[shard].slice(offset, 1).to_pylist()[0] == expected[i], f"row {i}"
    # Older versions, read through a fresh handle, are untouched.
    fresh = Store.open(store_url)
    for v, rows in before.items():
        assert _rows(fresh, v) == rows
    assert fresh.snapshot().num_rows == len(expected)


def test_large_shards_are_reused_and_runs_merged(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    big = pa.table(
        {
            "step": [2] * 2000,
            "row": list(range(2000)),
            "prompt": [f"big {i} " * 4 for i in range(2000)],
        }
    )
    store.append(_round(0, 2))
    store.append(_round(1, 2))
    store.append(big)
    store.append(_round(3, 2))
    store.append(_round(4, 2))
    shards = store.snapshot().shards
    target = shards[2].bytes  # the big shard is at the target: kept as it is
    expected = _rows(store)
    compact(store, target_bytes=target)
    after = store.snapshot().shards
    assert len(after) == 3
    assert after[1] == shards[2]
    assert {after[0].path, after[2].path}.isdisjoint(s.path for s in shards)
    _assert_same_rows(expected, _rows(store))


def test_nothing_to_compact_commits_nothing() -> None:
    store = Store.open(f"memory://compact/{uuid.uuid4().hex}", create=True)
    assert compact(store) == 0  # empty store
    store.append(_round(0, 5))
    files = _data_files(store)
    assert compact(store) == store.head == 1
    assert _data_files(store) == files


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "big"])
def test_bad_target_raises_and_changes_nothing(bad) -> None:
    store = Store.open(f"memory://compact/{uuid.uuid4().hex}", create=True)
    _fill(store, 3)
    files = _data_files(store)
    with pytest.raises(InvalidDataError, match="target_bytes"):
        compact(store, target_bytes=bad)
    assert store.refresh() == 3 and _data_files(store) == files


def test_schema_evolved_store_compacts() -> None:
    store = Store.open(f"memory://compact/{uuid.uuid4().hex}", create=True)
    _fill(store, 5)
    store.append([{"step": 5, "row": 0, "prompt": "p", "score": 0.5}], allow_new_columns=True)
    late = pa.table(
        {"step": [6], "row": [0], "prompt": ["q"], "score": pa.array([None], pa.float64())}
    )
    store.append(late)
    expected = _rows(store)
    assert expected[0]["score"] is None and expected[-2]["score"] == 0.5
    compact(store, target_bytes=SMALL)
    assert len(store.snapshot().shards) == 1
    _assert_same_rows(expected, _rows(store))
    assert store.snapshot().schema.names == ["step", "row", "prompt", "score"]


def _race(monkeypatch, writer: Store, action) -> None:
    """Run ``action(writer)`` once, while compaction is between planning and commit."""
    real = compaction._write_group
    fired: list[bool] = []

    def write_group(*args, **kwargs):
        out = real(*args, **kwargs)
        if not fired:
            fired.append(True)  # before the action: it may compact, re-entering this hook
            action(writer)
        return out

    monkeypatch.setattr(compaction, "_write_group", write_group)


@pytest.mark.parametrize("same_handle", [False, True])
def test_appends_during_compaction_are_kept(store_url, monkeypatch, same_handle) -> None:
    store = Store.open(store_url, create=True)
    expected = _fill(store, 12)
    base = store.head
    late = [_round(100, 4), _round(101, 2)]
    # A stale handle loses the exclusive create and rebases; the same handle rebases at once.
    writer = store if same_handle else Store.open(store_url)
    _race(monkeypatch, writer, lambda w: [w.append(batch) for batch in late])
    new = compact(store, target_bytes=SMALL)
    assert new == base + 3
    assert store.commit_record(new).target == base
    _assert_same_rows(expected + late[0] + late[1], _rows(store))
    # The late rounds' own shards are reused after the compacted ones.
    tail = store.snapshot().shards[-2:]
    late_shards = [store.commit_record(v).add[0] for v in (base + 1, base + 2)]
    assert list(tail) == late_shards
    assert _rows(Store.open(store_url), base + 2) == expected + late[0] + late[1]


@pytest.mark.parametrize("op", ["reset", "compact"])
def test_reset_or_compact_during_compaction_aborts_cleanly(store_url, monkeypatch, op) -> None:
    store = Store.open(store_url, create=True)
    _fill(store, 10)
    files = _data_files(store)
    other = Store.open(store_url)
    if op == "reset":
        _race(monkeypatch, other, lambda w: w.reset(4))
    else:
        _race(monkeypatch, other, lambda w: compact(w, target_bytes=SMALL))
    with pytest.raises(CommitConflictError, match="run it again"):
        compact(store, target_bytes=SMALL)
    # Nothing of the failed compaction remains: head is the other writer's, files are theirs.
    fresh = Store.open(store_url)
    assert fresh.head == 11
    assert fresh.commit_record(fresh.head).op == op
    new_files = _data_files(fresh) - files
    theirs = {s.path.split("/")[-1] for s in fresh.snapshot().shards}
    assert new_files <= theirs


def test_compacting_an_older_version_keeps_later_rounds() -> None:
    url = f"memory://compact/{uuid.uuid4().hex}"
    store = Store.open(url, create=True)
    expected = _fill(store, 8)
    compact(store, target_bytes=SMALL, version=5)
    assert store.head == 9
    assert store.commit_record(9).target == 5
    _assert_same_rows(expected, _rows(store))
    assert len(store.snapshot().shards) == 1 + 3


def test_older_version_behind_a_reset_is_refused_before_writing() -> None:
    store = Store.open(f"memory://compact/{uuid.uuid4().hex}", create=True)
    _fill(store, 6)
    store.reset(3)
    files = _data_files(store)
    with pytest.raises(CommitConflictError, match="version 7 is a reset"):
        compact(store, target_bytes=SMALL, version=5)
    assert store.refresh() == 7 and _data_files(store) == files


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_concurrent_writer_thread_loses_nothing(tmp_path, backend) -> None:
    url = f"memory://compact/{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path / "s")
    store = Store.open(url, create=True)
    expected = _fill(store, 6)
    rounds = [_round(200 + i, 1 + i % 3) for i in range(30)]
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            own = Store.open(url)
            for batch in rounds:
                own.append(batch)
        except BaseException as exc:  # surfaced in the main thread's assert below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    compactions = 0
    while thread.is_alive() or compactions == 0:
        compact(store, target_bytes=SMALL)
        compactions += 1
    thread.join()
    assert not errors
    compact(store, target_bytes=SMALL)
    fresh = Store.open(url)
    _assert_same_rows(expected + [r for b in rounds for r in b], _rows(fresh))
    ops = [c.op for c in fresh.versions()]
    assert ops.count("append") == 6 + 30 and "compact" in ops
    assert len(fresh.snapshot().shards) <= 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=300), max_size=40), st.integers(1, 400))
def test_plan_keeps_order_and_merges_only_small_runs(sizes: list[int], target: int) -> None:
    shards = [ShardRef(f"data/{i}.parquet", 1, b, "0" * 64) for i, b in enumerate(sizes)]
    steps = plan(shards, target)
    flat = [s for step in steps for s in (step if isinstance(step, list) else (step,))]
    assert flat == shards
    for step in steps:
        if isinstance(step, list):
            assert len(step) > 1
            assert all(s.bytes * 2 < target for s in step)
            assert sum(s.bytes for s in step) <= target or len(step) == 1


def test_compact_if_needed_follows_the_policy() -> None:
    store = Store.open(f"memory://compact/{uuid.uuid4().hex}", create=True)
    expected = _fill(store, 5)
    assert compact_if_needed(store, max_small_shards=5, target_bytes=SMALL) is None
    assert store.head == 5
    store.append(_round(5, 3))
    expected += _round(5, 3)
    new = compact_if_needed(store, max_small_shards=5, target_bytes=SMALL)
    assert new == 7 and store.commit_record(7).op == "compact"
    _assert_same_rows(expected, _rows(store))
    assert compact_if_needed(store, max_small_shards=5, target_bytes=SMALL) is None
    with pytest.raises(InvalidDataError, match="max_small_shards"):
        compact_if_needed(store, max_small_shards=0)


_CHILD = """
import sys
from dynstate import Store
from dynstate.maintenance.compact import compact

store = Store.open(sys.argv[1])
print("ready", flush=True)
for step in range(int(sys.argv[2]), 10_000):
    store.append([{"step": step, "row": j, "prompt": f"task {step}.{j}"} for j in range(2)])
    print("appended", flush=True)
    if step % 3 == 0:
        compact(store, target_bytes=16384)
        print("compacted", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_sigkill_during_compaction_leaves_last_version_readable(tmp_path, seed) -> None:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(6):
        store.append([{"step": step, "row": j, "prompt": f"task {step}.{j}"} for j in range(2)])
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, url, "6"], stdout=subprocess.PIPE, text=True
    )
    rng = random.Random(seed)
    try:
        # Count progress lines rather than seconds, so the kill lands at a spread of points
        # (mid-append, mid-rewrite, mid-commit) however loaded the machine is.
        assert child.stdout is not None
        for _ in range(rng.randint(1, 12)):
            assert child.stdout.readline()
        time.sleep(rng.uniform(0, 0.05))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    fresh = Store.open(url)
    head = fresh.snapshot()
    rounds = [c for c in fresh.versions() if c.op == "append"]
    want = [
        {"step": step, "row": j, "prompt": f"task {step}.{j}"}
        for step in range(len(rounds))
        for j in range(2)
    ]
    _assert_same_rows(want, head.to_arrow().to_pylist())
    for record in fresh.versions()[1:]:
        assert fresh.snapshot(record.version).num_rows == record.num_rows
    # The killed compaction's leftovers do not stop the next one.
    compact(fresh, target_bytes=SMALL)
    _assert_same_rows(want, _rows(Store.open(url)))


def test_groups_are_written_in_row_groups_across_source_shards_and_keep_order() -> None:
    store = Store.open(f"memory://compact/{uuid.uuid4().hex}", create=True)
    expected = _fill(store, 40, rows=20)  # ~21-24 rows a round: row groups straddle rounds
    store.append([{"step": 40, "row": 0, "prompt": "p", "score": 1.5}], allow_new_columns=True)
    expected = _rows(store)
    compact(store, target_bytes=2**30)
    (shard,) = store.snapshot().shards
    assert shard.groups is not None and sum(shard.groups.rows) == shard.rows == len(expected)
    g = OBJECT_STORE_GROUP_ROWS  # a memory:// store is an object store
    assert shard.groups.rows == (g,) * (len(expected) // g) + (len(expected) % g,)
    meta = pq.ParquetFile(pa.BufferReader(store.read_shard_bytes(shard))).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == list(
        shard.groups.rows
    )
    _assert_same_rows(expected, _rows(store))
    _assert_same_rows(expected, _rows(Store.open(store.url)))


def test_small_shards_between_large_ones_are_left_alone() -> None:
    store = Store.open(f"memory://compact/{uuid.uuid4().hex}", create=True)
    big = pa.table({"step": [1] * 3000, "row": list(range(3000)), "prompt": ["b" * 20] * 3000})
    for step in range(3):
        store.append(_round(step, 1))
        store.append(big)
    target = 2 * min(s.bytes for s in store.snapshot().shards if s.rows == 3000)
    files = _data_files(store)
    assert compact(store, target_bytes=target) == 6
    assert compact_if_needed(store, max_small_shards=1, target_bytes=target) is None
    assert store.refresh() == 6 and _data_files(store) == files


# -- one commit protocol: compaction and reset commit through the writer ----------------------


@pytest.fixture
def late_proxy(s3_endpoint):
    with FaultProxy(s3_endpoint) as proxy:
        yield proxy


def _s3_store(proxy: FaultProxy, url: str, create: bool = False) -> Store:
    options = {"endpoint_url": proxy.url, "config_kwargs": {"retries": {"max_attempts": 1}}}
    store = Store.open(url, create=create, storage_options=options)
    store.storage.retry_base_s = 0.001
    return store


def _new_data(store: Store, before: set[str]) -> set[str]:
    return {f"data/{name}" for name in _data_files(store) - before}


@pytest.mark.s3
def test_compaction_record_put_delivered_late_finds_its_shards(late_proxy, s3_endpoint) -> None:
    """Every PUT of the compaction's record is held (the client gives up, the request is still
    on its way): the new shards must stay — through a gc too — so that the record, when it
    lands, names files that exist."""
    url = s3_url()
    store = _s3_store(late_proxy, url, create=True)
    expected = _fill(store, 6)
    before = _data_files(store)
    late_proxy.hold(method="PUT", path_contains=f"/{m.META_DIR}/log/")
    with pytest.raises(StorageError, match="may still reach the store") as info:
        compact(store, target_bytes=SMALL)
    assert "version 7" in str(info.value) and "compaction" in str(info.value)
    late_proxy.stop_holding()
    direct = Store.open(url, storage_options={"endpoint_url": s3_endpoint})
    written = _new_data(direct, before)
    assert written, "the compaction wrote no shard"
    result = collect_garbage(direct, grace_s=0, dry_run=False)
    assert not any(r.path.startswith("data/") for r in result.removed), result.removed
    assert late_proxy.held and late_proxy.release(0) == 200  # the late PUT lands
    direct = Store.open(url, storage_options={"endpoint_url": s3_endpoint})
    assert direct.head == 7 and direct.commit_record(7).op == "compact"
    assert {s.path for s in direct.snapshot().shards} == written
    _assert_same_rows(expected, _rows(direct))
    assert direct.append(_round(50, 2)) == 8
    assert verify_store(direct, all_versions=True).ok


@pytest.mark.s3
def test_compaction_record_put_that_can_no_longer_land_removes_its_shards(
    late_proxy, s3_endpoint
) -> None:
    """Another writer takes the version before the compaction settles it: a late copy can only
    meet a 412 now, so the compaction's new shards go and nothing else changes."""
    url = s3_url()
    store = _s3_store(late_proxy, url, create=True)
    expected = _fill(store, 6)
    before = _data_files(store)
    other = Store.open(url, storage_options={"endpoint_url": s3_endpoint})
    settle = store.log.settle

    def other_writer_first(record):
        late_proxy.stop_holding()
        assert other.append(_round(60, 2)) == 7
        return settle(record)

    store.log.settle = other_writer_first
    late_proxy.hold(method="PUT", path_contains=f"/{m.META_DIR}/log/")
    with pytest.raises(StorageError) as info:
        compact(store, target_bytes=SMALL)
    assert "may still reach" not in str(info.value)
    assert late_proxy.held and late_proxy.release(0) == 412
    direct = Store.open(url, storage_options={"endpoint_url": s3_endpoint})
    assert direct.head == 7 and direct.commit_record(7).op == "append"
    _assert_same_rows(expected + _round(60, 2), _rows(direct))
    assert _new_data(direct, before) == {direct.commit_record(7).add[0].path}
    assert verify_store(direct, all_versions=True).ok


@pytest.mark.s3
def test_reset_record_put_delivered_late_goes_through_the_same_path(
    late_proxy, s3_endpoint
) -> None:
    """A reset is committed by the same writer call: its record of unknown outcome is settled
    and reported as such (not a bare storage error), and lands late as the head."""
    url = s3_url()
    store = _s3_store(late_proxy, url, create=True)
    expected = _fill(store, 4)
    late_proxy.hold(method="PUT", path_contains=f"/{m.META_DIR}/log/")
    with pytest.raises(StorageError, match="may still reach the store") as info:
        store.reset(2)
    assert "version 5" in str(info.value) and "reset" in str(info.value)
    late_proxy.stop_holding()
    assert late_proxy.held and late_proxy.release(0) == 200
    direct = Store.open(url, storage_options={"endpoint_url": s3_endpoint})
    assert direct.head == 5 and direct.commit_record(5).target == 2
    _assert_same_rows(expected[: direct.snapshot(2).num_rows], _rows(direct))
    assert verify_store(direct, all_versions=True).ok


@pytest.mark.s3
def test_reset_whose_reply_is_lost_returns_its_version(late_proxy, s3_endpoint) -> None:
    """The first PUT of a reset's record is applied and its reply lost (every retry too): the
    writer settles the name, finds its own record, and returns the version."""
    url = s3_url()
    store = _s3_store(late_proxy, url, create=True)
    _fill(store, 4)
    settle = store.log.settle

    def deliver_first(record):
        late_proxy.stop_holding()
        assert late_proxy.release(0) == 200  # the held PUT arrives before the settle
        return settle(record)

    store.log.settle = deliver_first
    late_proxy.hold(method="PUT", path_contains=f"/{m.META_DIR}/log/")
    assert store.reset(2) == 5
    direct = Store.open(url, storage_options={"endpoint_url": s3_endpoint})
    assert direct.head == 5 and direct.commit_record(5).op == "reset"
    assert verify_store(direct, all_versions=True).ok


@pytest.mark.parametrize("honoured", [True, False], ids=["intent", "intent-expired"])
@pytest.mark.parametrize("keep", [1, 2])
def test_compaction_racing_a_gc_past_its_base_is_undone_once(
    tmp_path, monkeypatch, keep, honoured
) -> None:
    """gc runs right after the compaction's record (of version 4, rounds 5 and 6 appended
    after it) is created. The compaction's intent (written before it read the floor) makes
    that gc keep version 4: the compaction stands. Where gc no longer honours the intent (the
    writer paused past INTENT_S; here made stale at once): a floor past the parent (keep 1)
    means that gc saw the record: the compaction stands. A floor past the base but not the
    parent (keep 2): the writer cannot know, so it commits one reset back to its parent and
    raises; the compacted version stays readable (kept above the floor) and its shards are
    never removed."""
    from dynstate.log import Log, intents

    if not honoured:
        monkeypatch.setattr(intents, "INTENT_S", -1.0)
    undone = keep == 2 and not honoured
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    expected = _fill(store, 6)
    real = Log._publish
    fired: list[bool] = []

    def publish_then_gc(self: Log, record) -> None:
        real(self, record)
        if record.op == "compact" and not fired:
            fired.append(True)
            collect_garbage(Store.open(url), keep=keep, grace_s=0, dry_run=False)

    monkeypatch.setattr(Log, "_publish", publish_then_gc)
    if not undone:
        assert compact(store, target_bytes=SMALL, version=4) == 7
    else:
        with pytest.raises(VersionCollectedError, match="oldest kept is 6"):
            compact(store, target_bytes=SMALL, version=4)
    monkeypatch.undo()
    again = Store.open(url)
    assert again.head == (8 if undone else 7)  # one undo, never two
    if undone:
        undo = again.commit_record(8)
        assert undo.op == "reset" and undo.target == 6 and undo.meta == {"undo": 7}
    _assert_same_rows(expected, _rows(again))
    _assert_same_rows(expected, _rows(again, 7))
    collect_garbage(again, grace_s=0, dry_run=False)
    assert verify_store(Store.open(url), all_versions=True).ok
