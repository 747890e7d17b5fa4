"""Nothing acknowledged is ever lost (issue 19, points 1, 2, 4 and 5): a version ``append`` or
``commit_staged`` returned is readable for as long as it is kept, whatever ran in between — a
reset and ``gc --keep 1`` behind a long-lived handle's caches, a gc while a writer is paused
(SIGSTOP) between its floor read and its record, a record PUT that lands after the client gave
up, a committer killed between its claim and its record.

The pauses are real: writer subprocesses stop themselves with SIGSTOP at the named point (a
wrapper around the one method that creates records) and are continued by the test."""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import s3_url
from s3_faults import FaultProxy

from dynstate import (
    CommitConflictError,
    LeaseExpiredError,
    StorageError,
    Store,
    collect_garbage,
    paths,
)
from dynstate.log import catalog as catalog_module
from dynstate.log.outcomes import outcomes_of
from dynstate.maintenance import gc as gc_module
from dynstate.maintenance.verify import verify_store
from dynstate.records import manifest as m


def _rows(store: Store, version: int | None = None) -> list[dict]:
    return store.snapshot(version).to_arrow().to_pylist()


def _fresh(url: str) -> Store:
    """A new handle: nothing cached from the operations under test."""
    return Store.open(url)


# -- point 1: the schema and chunk caches ------------------------------------------------------


def test_schema_cached_by_a_long_lived_handle_survives_reset_and_gc(
    store_url: str, monkeypatch
) -> None:
    """reset to 0, then gc --keep 1 collects the schema with the old versions; the handle that
    wrote it appends the same columns again: its version must name a schema that exists."""
    store = Store.open(store_url, create=True)
    assert store.append([{"a": 1}]) == 1
    operator = Store.open(store_url)
    operator.reset(0)
    # Right away gc keeps the schema (a committer may be about to name it again) ...
    result = collect_garbage(operator, keep=1, grace_s=0, dry_run=False)
    assert not any(r.path.startswith(f"{m.META_DIR}/schemas/") for r in result.removed)
    monkeypatch.setattr(gc_module, "BUSY_S", 0.0)  # ... and collects it once the hour passed
    result = collect_garbage(operator, keep=1, grace_s=0, dry_run=False)
    assert any(r.path.startswith(f"{m.META_DIR}/schemas/") for r in result.removed)
    assert store.append([{"a": 2}]) == 3
    assert _rows(_fresh(store_url)) == [{"a": 2}]
    assert _fresh(store_url).append([{"a": 3}]) == 4  # every later append works too
    assert _rows(_fresh(store_url)) == [{"a": 2}, {"a": 3}]
    assert verify_store(_fresh(store_url), all_versions=True).ok


def test_chunk_cached_by_a_long_lived_handle_survives_gc(tmp_path, monkeypatch) -> None:
    """A handle writes a chunk for a reset that loses its race (no record names the chunk);
    an hour later gc removes it as an orphan; the handle's next reset names the same chunk."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"i": i} for i in range(300)], shard_bytes=1)  # 300 shards: one full chunk
    shards = list(store.snapshot(1).shards)
    schema = store.snapshot(1).schema
    with pytest.raises(CommitConflictError):
        store.commit_base(shards, op="reset", schema=schema, target=1, expected_parent=99)
    chunks = store.storage.list(f"{m.META_DIR}/chunks")
    assert len(chunks) == 1
    monkeypatch.setattr(gc_module, "BUSY_S", 0.0)  # as if the hour had passed
    result = collect_garbage(Store.open(url), grace_s=0, dry_run=False)
    assert f"{m.META_DIR}/chunks/{chunks[0]}" in {r.path for r in result.removed}
    assert store.reset(1) == 2
    assert [r["i"] for r in _rows(_fresh(url), 2)] == list(range(300))
    assert verify_store(_fresh(url), all_versions=True).ok


# -- writer subprocesses that stop themselves just before their record is created -------------

WRITER = textwrap.dedent(
    """
    import base64, json, os, pickle, signal, sys
    from dynstate import DynstateError, Store
    url, mode, rows = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    store = Store.open(url)
    publish = store.log._publish

    def pause_before_record(record):
        if mode == "kill-after-record":
            publish(record)
            os.kill(os.getpid(), signal.SIGKILL)
        if mode.endswith("-after-record") and not pause_before_record.done:
            # created, but stopped before the floor is read again (see Log._stray)
            publish(record)
            pause_before_record.done = True
            print(json.dumps({"paused": record.version}), flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if not pause_before_record.done:
            pause_before_record.done = True
            print(json.dumps({"paused": record.version}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        publish(record)

    pause_before_record.done = False
    store.log._publish = pause_before_record
    try:
        if mode == "append":
            out = {"version": store.append(rows)}
        elif mode.startswith("outcomes"):  # an empty round with only outcomes
            out = {"version": store.append([], outcomes=rows)}
        elif mode.startswith("meta"):  # an empty round with only meta
            out = {"version": store.append([], meta=rows)}
        elif mode == "reset":
            out = {"version": store.reset(rows)}
        else:
            part = store.stage(rows)
            print(json.dumps({"part": base64.b64encode(pickle.dumps(part)).decode()}), flush=True)
            out = {"version": store.commit_staged([part])}
    except DynstateError as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(out), flush=True)
    """
)


def _writer(url: str, mode: str, rows: list[dict]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, url, mode, json.dumps(rows)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, f"writer exited with {proc.wait()}"
    return json.loads(line)


def _wait_stopped(proc: subprocess.Popen) -> None:
    for _ in range(500):
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError("the writer did not stop")


def _continue(proc: subprocess.Popen) -> dict:
    os.kill(proc.pid, signal.SIGCONT)
    out = _line(proc)
    proc.wait(timeout=60)
    return out


def test_schema_collected_while_its_committer_is_paused(durable_url: str, monkeypatch) -> None:
    """The writer has written the schema and stops before its record; gc --keep 1 collects the
    schema (only collected versions named it); the writer's version must still read."""
    store = Store.open(durable_url, create=True)
    store.append([{"a": 1}])
    store.reset(0)  # the head has no schema: the one of version 1 is garbage after a gc
    proc = _writer(durable_url, "append", [{"a": 7}])
    try:
        assert _line(proc) == {"paused": 3}
        _wait_stopped(proc)
        # A gc that judges the paused writer's fresh schema young keeps it; one whose BUSY_S
        # has passed (a pause over an hour) collects it, and the writer must write it again.
        result = collect_garbage(Store.open(durable_url), keep=1, grace_s=0, dry_run=False)
        assert not any(r.path.startswith(f"{m.META_DIR}/schemas/") for r in result.removed)
        monkeypatch.setattr(gc_module, "BUSY_S", 0.0)
        result = collect_garbage(Store.open(durable_url), keep=1, grace_s=0, dry_run=False)
        assert any(r.path.startswith(f"{m.META_DIR}/schemas/") for r in result.removed)
        out = _continue(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out == {"version": 3}
    assert _rows(_fresh(durable_url), 3) == [{"a": 7}]
    assert _fresh(durable_url).append([{"a": 8}]) == 4
    assert verify_store(_fresh(durable_url), all_versions=True).ok


# -- point 4: a gc passes the parent of a paused writer ----------------------------------------


def test_writer_paused_while_gc_passes_its_parent_lands_above_the_floor(durable_url: str) -> None:
    """The writer read the floor (0) and stops before creating version 2; others commit 2..4 and
    gc --keep 1 moves the floor to 4, removing the records below (so the name 2 is free again).
    The writer's round must be in the head under the version it returns, never below the floor."""
    store = Store.open(durable_url, create=True)
    store.append([{"w": "base"}])
    proc = _writer(durable_url, "append", [{"w": "paused"}])
    try:
        assert _line(proc) == {"paused": 2}
        _wait_stopped(proc)
        for step in range(3):
            store.append([{"w": f"other-{step}"}])
        collect_garbage(store, keep=1, grace_s=0, dry_run=False)
        assert store.log.read_floor() == 4
        out = _continue(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "version" in out, out
    version = out["version"]
    reader = _fresh(durable_url)
    assert version >= reader.log.read_floor()
    assert version == reader.head == 5
    assert [r["w"] for r in _rows(reader, version)] == [
        "base",
        "other-0",
        "other-1",
        "other-2",
        "paused",
    ]
    assert verify_store(reader).ok


def _steps(store: Store, version: int | None = None) -> list[int]:
    return store.outcome_records(version).column("step").to_pylist()


def test_outcome_only_append_collected_right_after_its_create_is_committed_once(
    durable_url: str,
) -> None:
    """An empty round with outcomes is created as version 2; before its writer reads the floor
    again, others commit on it and gc --keep 1 collects it. It is committed (the head carries
    its outcomes), so the writer must return 2 — not commit it again, which the repeated-step
    check refuses, nor lose it."""
    store = Store.open(durable_url, create=True)
    store.append([{"w": "base"}])
    proc = _writer(durable_url, "outcomes-after-record", {"row": [0], "step": [7], "score": [1]})
    try:
        assert _line(proc) == {"paused": 2}
        _wait_stopped(proc)
        for step in range(2):
            store.append([{"w": f"other-{step}"}])  # 3 and 4 carry version 2's outcomes
        collect_garbage(store, keep=1, grace_s=0, dry_run=False)
        assert store.log.read_floor() == 4
        out = _continue(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out == {"version": 2}, out
    reader = _fresh(durable_url)
    assert reader.head == 4 and _steps(reader) == [7]
    assert verify_store(reader, all_versions=True).ok


def test_outcomes_whose_rows_gc_collected_while_their_writer_paused_are_refused(
    durable_url: str,
) -> None:
    """The writer stops before creating version 2 (an empty round with outcomes of row 0 read
    at version 1); gc --keep 1 collects versions 1-3 meanwhile. Nothing kept can tell whether a
    reset came between version 1 and the new parent, so the outcomes are refused (issue 40.2:
    outcomes bind to the rows they were scored on) with a typed error, and the store holds
    nothing of them; before, they were committed above the floor on trust."""
    store = Store.open(durable_url, create=True)
    store.append([{"w": "base"}])
    proc = _writer(durable_url, "outcomes", {"row": [0], "step": [7], "score": [1]})
    try:
        assert _line(proc) == {"paused": 2}
        _wait_stopped(proc)
        for step in range(3):
            store.append([{"w": f"other-{step}"}])
        collect_garbage(store, keep=1, grace_s=0, dry_run=False)
        out = _continue(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out["error"] == "VersionCollectedError", out
    assert "read at version 1, which gc removed" in out["message"], out
    reader = _fresh(durable_url)
    assert reader.head == 4 and _steps(reader) == []
    assert verify_store(reader, all_versions=True).ok


def test_meta_only_append_collected_right_after_its_create_is_committed_above_the_floor(
    durable_url: str,
) -> None:
    """An empty round with only meta changes no version's rows or outcomes, so nothing tells
    whether a gc saw it: created below the floor, it is committed again above it, and the kept
    versions hold it exactly once (the copy a gc saw was collected with the others)."""
    store = Store.open(durable_url, create=True)
    store.append([{"w": "base"}])
    proc = _writer(durable_url, "meta-after-record", {"note": "paused"})
    try:
        assert _line(proc) == {"paused": 2}
        _wait_stopped(proc)
        for step in range(2):
            store.append([{"w": f"other-{step}"}])
        collect_garbage(store, keep=1, grace_s=0, dry_run=False)
        out = _continue(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out == {"version": 5}, out
    reader = _fresh(durable_url)
    kept = [reader.commit_record(v).meta for v in range(reader.floor, reader.head + 1)]
    assert [m_ for m_ in kept if m_ and m_.get("note") == "paused"] == [{"note": "paused"}]
    assert verify_store(reader, all_versions=True).ok


# -- point 2 with outcomes: a reset's outcome chunks and aggregate collected while it is paused


def test_reset_outcome_list_collected_while_its_committer_is_paused(
    durable_url: str, monkeypatch
) -> None:
    """A reset carries its target's outcome list (one full chunk: 256 files) and the aggregate
    of the outcome checkpoint at 200; the writer stops before its record. A gc that moves the
    floor to 255 finds both unreferenced (the floor's list is shorter than a chunk, checkpoint
    200 is collected) and, an hour on, removes them. The reset's version must read, outcomes
    and statistics included, and verify clean."""
    store = Store.open(durable_url, create=True)
    store.append([{"w": "base"}])
    for step in range(261):
        store.append([], outcomes={"row": [0], "step": [step], "score": [step % 2]})
    assert store.head == 262
    proc = _writer(durable_url, "reset", 260)
    try:
        assert _line(proc) == {"paused": 263}
        _wait_stopped(proc)
        monkeypatch.setattr(gc_module, "BUSY_S", 0.0)  # as if the writer had slept an hour
        result = collect_garbage(Store.open(durable_url), keep=8, grace_s=0, dry_run=False)
        assert result.floor_after == 255
        removed = {r.path for r in result.removed}
        assert any(p.startswith(f"{m.META_DIR}/chunks/") for p in removed), removed
        assert any(p.startswith(f"{m.META_DIR}/aggregates/") for p in removed), removed
        out = _continue(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out == {"version": 263}, out
    reader = _fresh(durable_url)
    assert _steps(reader, 263) == list(range(259))
    stats = reader.outcome_stats(263).to_pylist()
    assert stats[0]["attempts"] == 259
    report = verify_store(reader, all_versions=True)
    assert report.ok, report


def test_checkpoint_chunks_and_aggregate_collected_before_its_create(tmp_path, monkeypatch):
    """Version 100's upkeep writes its checkpoint's chunk (300 shards) and its outcome
    checkpoint's aggregate; a gc an hour on (BUSY_S 0) runs just before each checkpoint is
    created and removes them (nothing names them yet). Each checkpoint must not name a missing
    file: a checkpoint whose chunk is gone breaks every read that replays from it."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"i": i} for i in range(300)], shard_bytes=1)  # 300 shards: one full chunk
    for step in range(98):
        store.append([], outcomes={"row": [step], "step": [step], "score": [1]})
    assert store.head == 99
    monkeypatch.setattr(gc_module, "BUSY_S", 0.0)
    create = store.storage.create_if_absent
    removed: set[str] = set()

    def gc_first(rel, data):
        if rel.endswith(f"{100:020d}.json"):
            result = collect_garbage(Store.open(url), grace_s=0, dry_run=False)
            removed.update(r.path for r in result.removed)
        return create(rel, data)

    monkeypatch.setattr(store.storage, "create_if_absent", gc_first)
    assert store.append([], outcomes={"row": [0], "step": [98], "score": [0]}) == 100
    outcomes_of(store.log).flush()  # the outcome checkpoint is written in the background
    assert any(p.startswith(f"{m.META_DIR}/chunks/") for p in removed), removed
    assert any(p.startswith(f"{m.META_DIR}/aggregates/") for p in removed), removed
    reader = _fresh(url)
    assert reader.append([{"i": 300}]) == 101
    assert [r["i"] for r in _rows(_fresh(url), 101)] == list(range(301))
    report = verify_store(_fresh(url), all_versions=True)
    assert report.ok, report


def _paused_writer_meets_gc(monkeypatch, writer: Store, url: str, target: str) -> tuple:
    """Arrange: ``writer``'s create of ``target`` (a record or an outcome checkpoint) pauses
    past gc's BUSY_S (1 s here) after the files it names were written; a gc plans meanwhile
    (they are unreferenced and old by then), and its last-moment clock reading waits until the
    writer finished (create and its checks). Returns (start, finish): ``start`` arms it,
    ``finish()`` lets the gc go on and returns its result."""
    monkeypatch.setattr(gc_module, "BUSY_S", 1.0)
    monkeypatch.setattr(catalog_module, "REWRITE_AFTER_S", 0.5, raising=False)
    planned, go = threading.Event(), threading.Event()
    results: list = []
    readings = {"n": 0}
    storage_now = gc_module._storage_now

    def gc_now(store, dry_run, clock):
        readings["n"] += 1
        if readings["n"] == 2:  # the reading the last-moment check is judged by
            planned.set()
            assert go.wait(60)
        return storage_now(store, dry_run, clock)

    monkeypatch.setattr(gc_module, "_storage_now", gc_now)

    def run_gc() -> None:
        results.append(collect_garbage(Store.open(url), grace_s=0, dry_run=False))

    gc_thread = threading.Thread(target=run_gc)

    def pausing(create):
        def paused_create(rel, data, **kwargs):
            if rel == target and not gc_thread.is_alive() and not results:
                time.sleep(1.6)  # the writer stopped between its writes and its create
                gc_thread.start()
                assert planned.wait(60)
            return create(rel, data, **kwargs)

        return paused_create

    def start() -> None:
        for name in ("create", "create_if_absent"):  # a record's, a checkpoint's
            monkeypatch.setattr(writer.storage, name, pausing(getattr(writer.storage, name)))

    def finish():
        go.set()
        gc_thread.join(60)
        assert results, "gc did not finish"
        return results[0]

    return start, finish


def test_a_commit_paused_past_busy_s_keeps_its_schema(tmp_path, monkeypatch) -> None:
    """DEFECT (fixed): a committer paused for over gc's BUSY_S between writing the schema
    its record names (and chunks, for a reset's or compaction's record) and the record's
    create came back to files a gc had judged old and unreferenced; its check after the
    create found them still there (the gc had not deleted them yet) and the gc then deleted
    them: every read of the version failed with CorruptStoreError. A write that old is now
    done again after the create, and gc judges the
    file's age a second time right before its delete."""
    url = str(tmp_path / "store")
    writer = Store.open(url, create=True)
    start, finish = _paused_writer_meets_gc(monkeypatch, writer, url, m.log_path(1))
    start()
    assert writer.append([{"i": i} for i in range(300)], shard_bytes=1) == 1
    result = finish()
    assert result.kept_young >= 1, result  # the schema, judged young at the end
    assert not [r.path for r in result.removed if r.path.startswith(m.META_DIR)], result.removed
    assert [r["i"] for r in _rows(_fresh(url), 1)] == list(range(300))
    report = verify_store(_fresh(url), all_versions=True)
    assert report.ok, report


def test_an_outcome_checkpoint_paused_past_busy_s_keeps_its_aggregate(
    tmp_path, monkeypatch
) -> None:
    """DEFECT (fixed): version 100's outcome checkpoint writer, paused for over BUSY_S
    between writing its aggregate and creating the checkpoint, found the aggregate still there
    after the create; a gc that planned meanwhile then deleted it (gc did not judge aggregates
    again before the delete): `dynstate verify` failed, naming the missing aggregate."""
    url = str(tmp_path / "store")
    writer = Store.open(url, create=True)
    writer.append([{"i": i} for i in range(4)])
    for step in range(98):
        writer.append([], outcomes={"row": [step % 4], "step": [step], "score": [step % 3]})
    assert writer.head == 99
    target = paths.outcome_checkpoint_path(100)
    start, finish = _paused_writer_meets_gc(monkeypatch, writer, url, target)
    start()
    assert writer.append([], outcomes={"row": [1], "step": [98], "score": [1]}) == 100
    outcomes_of(writer.log).flush()  # the outcome checkpoint is written in the background
    result = finish()
    assert result.kept_young >= 1, result
    checkpoint = json.loads((tmp_path / "store" / target).read_text())
    assert (tmp_path / "store" / checkpoint["aggregate"]["path"]).exists()
    report = verify_store(_fresh(url), all_versions=True)
    assert report.ok, report
    stats = _fresh(url).outcome_stats(100).to_pylist()
    assert sum(s["attempts"] for s in stats) == 99


# -- point 5: a committer killed between its claim and its record ------------------------------


def _staged_then_killed(url: str, mode: str) -> object:
    proc = _writer(url, mode, [{"x": 1}, {"x": 2}])
    try:
        part = pickle.loads(base64.b64decode(_line(proc)["part"]))
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    return part


def test_part_of_a_committer_killed_before_its_record_is_not_stored(durable_url: str) -> None:
    store = Store.open(durable_url, create=True)
    store.append([{"x": 0}])
    part = _staged_then_killed(durable_url, "kill")
    with pytest.raises(LeaseExpiredError, match="NOT stored") as info:
        store.commit_staged([part])
    assert "exited without finishing it" in str(info.value)
    assert "already committed" not in str(info.value)
    assert _fresh(durable_url).head == 1
    # What the message says is what gc does: the shards go, nothing kept names them.
    result = collect_garbage(Store.open(durable_url), grace_s=0, dry_run=False)
    assert {s.path for s in part.shards} <= {r.path for r in result.removed}
    assert verify_store(_fresh(durable_url), all_versions=True).ok


def test_part_of_a_committer_killed_after_its_record_is_committed(durable_url: str) -> None:
    store = Store.open(durable_url, create=True)
    store.append([{"x": 0}])
    part = _staged_then_killed(durable_url, "kill-after-record")
    with pytest.raises(CommitConflictError, match="already committed as version 2"):
        store.commit_staged([part])
    assert _rows(_fresh(durable_url), 2) == [{"x": 0}, {"x": 1}, {"x": 2}]
    collect_garbage(Store.open(durable_url), grace_s=0, dry_run=False)
    assert verify_store(_fresh(durable_url), all_versions=True).ok


# -- point 2: a record PUT that lands after the client gave up (S3) ----------------------------


@pytest.fixture
def late_proxy(s3_endpoint):
    with FaultProxy(s3_endpoint) as proxy:
        yield proxy


def _s3_store(proxy: FaultProxy, url: str, create: bool = False) -> Store:
    options = {"endpoint_url": proxy.url, "config_kwargs": {"retries": {"max_attempts": 1}}}
    store = Store.open(url, create=create, storage_options=options)
    store.storage.retry_base_s = 0.001
    return store


@pytest.mark.s3
def test_record_put_delivered_late_finds_its_shards(late_proxy, s3_endpoint) -> None:
    url = s3_url()
    store = _s3_store(late_proxy, url, create=True)
    store.append([{"r": 1}])
    late_proxy.hold(method="PUT", path_contains=f"/{m.META_DIR}/log/")
    with pytest.raises(StorageError, match="may still reach the store") as info:
        store.append([{"r": 2}])
    assert "version 2" in str(info.value)
    late_proxy.stop_holding()
    direct = Store.open(url, storage_options={"endpoint_url": s3_endpoint})
    # gc meanwhile keeps the shards of a commit whose record may still land...
    result = collect_garbage(direct, grace_s=0, dry_run=False)
    assert not any(r.path.startswith("data/") for r in result.removed), result.removed
    assert late_proxy.held
    assert late_proxy.release(0) == 200  # ...and here it does, late
    direct = Store.open(url, storage_options={"endpoint_url": s3_endpoint})
    assert direct.head == 2
    assert _rows(direct, 2) == [{"r": 1}, {"r": 2}]
    assert direct.append([{"r": 3}]) == 3
    assert _rows(direct) == [{"r": 1}, {"r": 2}, {"r": 3}]
    assert verify_store(direct, all_versions=True).ok


@pytest.mark.s3
def test_record_put_that_can_no_longer_land_lets_its_shards_go(late_proxy, s3_endpoint) -> None:
    """Every PUT of the round's record is held; before the writer settles, another writer takes
    version 2. A held PUT can only meet a 412 now, so the failed round's shards may go, and
    the late PUT changes nothing."""
    url = s3_url()
    store = _s3_store(late_proxy, url, create=True)
    store.append([{"r": 1}])
    other = Store.open(url, storage_options={"endpoint_url": s3_endpoint})
    settle = store.log.settle

    def other_writer_first(record):
        late_proxy.stop_holding()
        assert other.append([{"r": 99}]) == 2
        return settle(record)

    store.log.settle = other_writer_first
    late_proxy.hold(method="PUT", path_contains=f"/{m.META_DIR}/log/")
    with pytest.raises(StorageError) as info:
        store.append([{"r": 2}])
    assert "may still reach" not in str(info.value)
    assert late_proxy.held and late_proxy.release(0) == 412
    direct = Store.open(url, storage_options={"endpoint_url": s3_endpoint})
    assert direct.head == 2 and [r["r"] for r in _rows(direct)] == [1, 99]
    kept = sorted(s.path.split("/", 1)[1] for s in direct.snapshot().shards)
    assert direct.storage.list("data") == kept  # the failed round's shard is gone
    assert verify_store(direct, all_versions=True).ok
