"""gc against live writers (issue 13): appender processes and stage/commit_staged rounds much
slower than the grace period, against gc in a tight loop at grace 0. Every acknowledged
version reads back, verify passes, nothing foreign is deleted — on a local disk and on S3.
A writer paused past its lease finds its commit refused, never committed broken; a stale
handle cannot reset or tag a collected version."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dynstate import CommitConflictError, LeaseExpiredError, Store, VersionCollectedError
from dynstate.maintenance.gc import collect_garbage
from dynstate.maintenance.verify import verify_store
from dynstate.records import manifest as m

WRITER = textwrap.dedent(
    """
    import json, sys, time
    from dynstate import Store
    url, mode = sys.argv[1], sys.argv[2]
    writer, rounds, pause = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    store = Store.open(url, lease_ttl_s=2.0)
    for i in range(rounds):
        rows = [{"writer": writer, "round": i, "row": j, "text": "x" * 100} for j in range(40)]
        meta = {"writer": writer, "round": i}
        if mode == "append":
            version = store.append(rows, meta=meta, shard_bytes=1500)
        else:
            part = store.stage(rows, shard_bytes=1500)
            time.sleep(pause)  # a slow round: generation, a Ray gather...
            version = store.commit_staged([part], meta=meta)
        print(json.dumps({"version": version, "writer": writer, "round": i}), flush=True)
    """
)

FOREIGN = {
    "precious.txt": b"do not touch",
    "data/precious.txt": b"mine",
    "data/notes.parquet": b"x",
}


def _put_foreign(url: str) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    for rel, data in FOREIGN.items():
        fs.makedirs(f"{root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{root}/{rel}", data)


def _foreign_intact(url: str) -> bool:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return all(fs.cat_file(f"{root}/{rel}") == data for rel, data in FOREIGN.items())


def _gc_loop(url: str, stop: threading.Event, errors: list[BaseException], runs: list[int]) -> None:
    store = Store.open(url)
    while not stop.is_set():
        try:
            collect_garbage(store, grace_s=0, dry_run=False)
            runs[0] += 1
        except BaseException as exc:  # reported by the test
            errors.append(exc)
            return


def _run_writers(url: str, specs: list[tuple[str, int, float]]) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, url, mode, str(w), str(rounds), str(pause)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w, (mode, rounds, pause) in enumerate(specs)
    ]
    acked = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        acked += [json.loads(line) for line in out.splitlines()]
    return acked


def _check(url: str, acked: list[dict]) -> None:
    store = Store.open(url)
    for ack in acked:
        version = ack["version"]
        record = store.commit_record(version)
        assert record.meta == {"writer": ack["writer"], "round": ack["round"]}
        rows = store.snapshot(version).to_arrow().to_pylist()
        added = rows[len(rows) - record.rows_added :]
        assert [(r["writer"], r["round"]) for r in added] == [(ack["writer"], ack["round"])] * 40
    assert sorted(a["version"] for a in acked) == list(range(1, store.refresh() + 1))
    report = verify_store(store, all_versions=True)
    assert report.ok, report.problems


@pytest.mark.slow
def test_gc_at_grace_0_never_loses_a_live_writers_round(durable_url: str) -> None:
    store = Store.open(durable_url, create=True)
    _put_foreign(durable_url)
    stop, errors, runs = threading.Event(), [], [0]
    gc = threading.Thread(target=_gc_loop, args=(durable_url, stop, errors, runs))
    gc.start()
    try:
        # Three appenders, and two writers whose rounds stay staged 4 s: longer than their
        # 2 s lease (renewed by the heartbeat) and than any grace period gc is given here.
        acked = _run_writers(
            durable_url, [("append", 6, 0), ("append", 6, 0), ("append", 6, 0),
                          ("stage", 3, 4.0), ("stage", 3, 4.0)]
        )  # fmt: skip
    finally:
        stop.set()
        gc.join()
    assert not errors, errors
    assert runs[0] >= 3, "gc should have run while the writers wrote"
    _check(durable_url, acked)
    assert _foreign_intact(durable_url)
    # Once the writers are gone, gc leaves exactly what the versions need (and foreign files).
    result = collect_garbage(store, grace_s=0, dry_run=False)
    assert set(result.foreign) >= {"data/precious.txt", "data/notes.parquet"}
    live = {s.path for r in store.versions() for s in store.snapshot(r.version).shards}
    data = {f"data/{n}" for n in store.storage.list("data")} - {
        "data/precious.txt",
        "data/notes.parquet",
    }
    assert data == live
    _check(durable_url, acked)
    assert _foreign_intact(durable_url)


def test_gc_never_follows_a_symlinked_data_folder(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"id": 1}])
    elsewhere = tmp_path / "other-disk"
    os.rename(tmp_path / "store" / "data", elsewhere)
    os.symlink(elsewhere, tmp_path / "store" / "data")
    # Files with dynstate's own shard names, but on the other side of the link.
    lookalike = elsewhere / f"{'a' * 32}.parquet"
    lookalike.write_bytes(b"someone else's shard")
    (elsewhere / "precious.txt").write_bytes(b"keep")
    result = collect_garbage(Store.open(url), grace_s=0, dry_run=False)
    assert result.removed == []
    assert lookalike.exists() and (elsewhere / "precious.txt").exists()
    assert Store.open(url).snapshot().to_arrow().to_pylist() == [{"id": 1}]
    # A file that is itself a symlink is not followed either.
    os.unlink(tmp_path / "store" / "data")
    os.rename(elsewhere, tmp_path / "store" / "data")
    target = tmp_path / "target.parquet"
    target.write_bytes(b"outside")
    os.symlink(target, tmp_path / "store" / "data" / f"{'b' * 32}.parquet")
    collect_garbage(Store.open(url), grace_s=0, dry_run=False)
    assert target.exists() and os.path.islink(tmp_path / "store" / "data" / f"{'b' * 32}.parquet")


PAUSED = textwrap.dedent(
    """
    import sys
    from dynstate import LeaseExpiredError, Store
    store = Store.open(sys.argv[1], lease_ttl_s=0.5)
    part = store.stage([{"id": i} for i in range(10)])
    print("staged", flush=True)
    sys.stdin.readline()
    try:
        print("committed", store.commit_staged([part], meta={"step": 1}), flush=True)
    except LeaseExpiredError as exc:
        print("expired", exc, flush=True)
    """
)


def _planned(store: Store) -> list[str]:
    """What gc at grace 0 would remove now (a dry run: it ends no lease)."""
    return [r.path for r in collect_garbage(store, grace_s=0).removed]


def test_a_writer_paused_past_its_lease_is_refused_not_committed_broken(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"id": -1}])
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSED, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "staged"
        os.kill(proc.pid, signal.SIGSTOP)  # alive, but its heartbeat stops
        # Real time, end to end (the other lease tests let gc's clock run ahead instead): wait
        # until the storage's own clock says the 0.5 s lease ran out, as dry runs plan.
        deadline = time.monotonic() + 60
        while not any(p.startswith("data/") for p in _planned(store)):
            assert time.monotonic() < deadline, "the paused writer's lease never ran out"
            time.sleep(0.1)
        result = collect_garbage(store, grace_s=0, dry_run=False)
        removed = {r.path for r in result.removed}
        assert any(p.startswith("data/") for p in removed) and result.kept_leased == 0
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.startswith("expired"), out
    assert "stage the round again" in out
    assert Store.open(url).head == 1  # nothing committed
    assert verify_store(Store.open(url), all_versions=True).ok


def test_a_live_writers_lease_outlasts_gc(tmp_path) -> None:
    """The same round, not paused: its heartbeat keeps the lease, gc keeps the shards."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    writer = Store.open(url, lease_ttl_s=0.5)
    part = writer.stage([{"id": i} for i in range(10)])
    for _ in range(4):
        time.sleep(0.4)
        result = collect_garbage(store, grace_s=0, dry_run=False)
        assert result.kept_leased == len(part.shards) and result.removed == []
    assert writer.commit_staged([part]) == 1
    assert writer.snapshot().num_rows == 10
    # The lease ended with the commit; its outcome stays as a tombstone against a second commit.
    assert [n.endswith(".outcome.json") for n in writer.storage.list(f"{m.META_DIR}/leases")] == [
        True
    ]


def test_a_stale_handle_cannot_reset_or_tag_a_collected_version(durable_url: str) -> None:
    store = Store.open(durable_url, create=True)
    for step in range(5):
        store.append([{"step": step}], meta={"step": step})
    stale = Store.open(durable_url)
    stale.snapshot(2)  # cached, from before the gc
    collect_garbage(Store.open(durable_url), keep=2, grace_s=0, dry_run=False)
    with pytest.raises(VersionCollectedError, match="oldest kept is 4"):
        stale.reset(2)
    with pytest.raises(VersionCollectedError, match="oldest kept is 4"):
        stale.tag("best", 2)
    fresh = Store.open(durable_url)
    assert fresh.head == 5 and fresh.tags() == {}
    assert collect_garbage(fresh, grace_s=0, dry_run=False).floor_after == 4  # gc and ls still work
    assert verify_store(fresh, all_versions=True).ok
    assert stale.reset(4) == 6  # a kept version still can be
    assert stale.snapshot().to_arrow().column("step").to_pylist() == [0, 1, 2, 3]


def test_commit_of_staged_parts_twice_is_refused(tmp_path) -> None:
    store = Store.open(str(tmp_path / "store"), create=True)
    part = store.stage([{"id": 1}])
    assert store.commit_staged([part]) == 1
    other = Store.open(str(tmp_path / "store"))
    # The lease ended with the first commit (its outcome stays as a tombstone): a second
    # commit of the same files, from this handle or another, is refused, not committed twice.
    for handle in (store, other):
        with pytest.raises(CommitConflictError, match="already committed"):
            handle.commit_staged([part])
    assert Store.open(str(tmp_path / "store")).head == 1


@pytest.mark.parametrize("tag_first", [True, False])
def test_a_tag_made_while_gc_runs_is_kept_or_refused(tmp_path, monkeypatch, tag_first) -> None:
    """gc reads the tags, decides its floor and publishes it; a tag made in between is either
    seen by gc after publishing (which lowers the floor back to it) or sees the new floor
    (and is refused) — never a tag of a collected version."""
    from dynstate.log import Log

    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(6):
        store.append([{"step": step}])
    tagger = Store.open(url)
    real = Log.publish_floor
    outcome: list[object] = []

    def racing_publish(self: Log, floor: int, **kwargs: object) -> None:
        if not outcome and tag_first:  # the tagger read the old floor before gc published
            tagger.tag("late", 2)
            outcome.append("tagged")
        real(self, floor, **kwargs)
        if not outcome:  # the tagger comes after the floor is out
            with pytest.raises(VersionCollectedError, match="oldest kept is 5"):
                tagger.tag("late", 2)
            outcome.append("refused")

    monkeypatch.setattr(Log, "publish_floor", racing_publish)
    result = collect_garbage(Store.open(url), keep=2, grace_s=0, dry_run=False)
    monkeypatch.undo()
    again = Store.open(url)
    if tag_first:
        assert outcome == ["tagged"] and result.floor_after == 2
        assert again.tags() == {"late": 2}
        assert again.snapshot("late").to_arrow().column("step").to_pylist() == [0, 1]
    else:
        assert outcome == ["refused"] and result.floor_after == 5
        assert again.tags() == {}
    assert verify_store(again, all_versions=True).ok


@pytest.mark.parametrize("honoured", [True, False], ids=["intent", "intent-expired"])
@pytest.mark.parametrize("keep", [1, 2])
def test_a_reset_racing_a_gc_never_leaves_a_head_gc_may_empty(
    tmp_path, monkeypatch, keep, honoured
) -> None:
    """gc publishes a floor past a reset's target while the reset's record is being created.
    The reset's intent (written before it read the floor) makes that gc lower its floor to the
    target: the reset stands. Where gc no longer honours the intent (the writer paused past
    INTENT_S, here an intent made stale at once), the floor re-check after the create is the
    last line: if that gc's floor passed the reset's parent, it saw the record (and keeps its
    files): the reset stands. Otherwise the writer cannot know: it commits a reset back to its
    parent and raises VersionCollectedError."""
    from dynstate.log import Log, intents

    if not honoured:
        monkeypatch.setattr(intents, "INTENT_S", -1.0)
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(6):
        store.append([{"step": step}])
    real = Log._publish
    fired: list[bool] = []
    floors: list[int] = []

    def publish_then_gc(self: Log, record) -> None:
        real(self, record)
        if record.op == "reset" and not fired:
            fired.append(True)
            result = collect_garbage(Store.open(url), keep=keep, grace_s=0, dry_run=False)
            floors.append(result.floor_after)

    monkeypatch.setattr(Log, "_publish", publish_then_gc)
    if keep == 1 or honoured:
        assert store.reset(2) == 7
        expected = [0, 1]
        assert floors == ([2] if honoured else [7])
    else:
        with pytest.raises(VersionCollectedError, match="oldest kept is 6"):
            store.reset(2)
        expected = list(range(6))
    monkeypatch.undo()
    again = Store.open(url)
    assert again.snapshot().to_arrow().column("step").to_pylist() == expected
    assert verify_store(again, all_versions=True).ok
    assert not os.listdir(os.path.join(url, "_dynstate", "tag-intents"))  # settled: removed


def test_a_stale_snapshot_of_a_collected_version_says_so(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(4):
        store.append([{"step": step}])
    old = store.snapshot(2)
    store.reset(1)  # version 5: the shard of step 1 is needed by no kept version
    collect_garbage(Store.open(url), keep=1, grace_s=0, dry_run=False)
    with pytest.raises(VersionCollectedError, match="oldest kept is 5"):
        old.to_arrow()


def test_staged_parts_outlive_the_handle_that_staged_them(tmp_path) -> None:
    """A Ray task stages, returns its part and drops its store handle; the driver commits
    later. The process still renews the lease, so gc at grace 0 keeps the shards meanwhile."""
    import gc as python_gc

    url = str(tmp_path / "store")
    Store.open(url, create=True)
    worker = Store.open(url, lease_ttl_s=0.5)
    part = worker.stage([{"id": i} for i in range(10)])
    del worker
    python_gc.collect()
    for _ in range(3):
        time.sleep(0.7)
        assert collect_garbage(Store.open(url), grace_s=0, dry_run=False).kept_leased == len(
            part.shards
        )
    driver = Store.open(url)
    assert driver.commit_staged([part]) == 1
    assert driver.snapshot().num_rows == 10


def test_a_round_with_one_expired_part_commits_nothing_and_leaks_nothing(tmp_path) -> None:
    """Two parts, the second's lease expired by gc (its writer died): the commit is refused,
    the first part is removed, and the next gc removes what is left of the round."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    first = store.stage([{"id": 1}])
    writer = Store.open(url, lease_ttl_s=0.5)
    second = writer.stage([{"id": 2}])
    writer.log.leases.forget({second.lease})  # as if its process had stopped
    # A minute later by gc's clock: the second lease (0.5 s) ran out, the first (120 s) did
    # not — were it renewed or not.
    later = Store.open(url)
    minute_on = lambda: later.storage.now() + 60  # noqa: E731
    collect_garbage(later, grace_s=0, dry_run=False, clock=minute_on)  # expires the second only
    with pytest.raises(LeaseExpiredError, match="stage the round again"):
        store.commit_staged([first, second])
    assert Store.open(url).head == 0
    assert not any(store.storage.exists(s.path) for s in first.shards)  # removed at once
    collect_garbage(Store.open(url), grace_s=0, dry_run=False)
    assert store.storage.list("data") == []


def _retention_loop(url: str, stop: threading.Event, errors: list[BaseException]) -> None:
    store = Store.open(url)
    while not stop.is_set():
        try:
            collect_garbage(store, keep=3, grace_s=0, dry_run=False)
        except BaseException as exc:  # reported by the test
            errors.append(exc)
            return


@pytest.mark.slow
def test_retention_gc_against_live_writers_keeps_every_round_in_the_head(tmp_path) -> None:
    """gc --keep 3 --grace 0 in a tight loop while rounds are appended and staged: old
    versions go, but the head holds every acknowledged round exactly once, every kept version
    reads back, and verify passes."""
    url = str(tmp_path / "store")
    Store.open(url, create=True)
    stop, errors = threading.Event(), []
    gc = threading.Thread(target=_retention_loop, args=(url, stop, errors))
    gc.start()
    try:
        acked = _run_writers(url, [("append", 5, 0), ("append", 5, 0), ("stage", 2, 3.0)])
    finally:
        stop.set()
        gc.join()
    assert not errors, errors
    store = Store.open(url)
    head_rows = store.snapshot().to_arrow().to_pylist()
    rounds = [(r["writer"], r["round"]) for r in head_rows if r["row"] == 0]
    assert sorted(rounds) == sorted((a["writer"], a["round"]) for a in acked)
    assert store.log.floor > 0  # retention did collect versions meanwhile
    for record in store.versions():
        assert store.snapshot(record.version).num_rows == record.num_rows
    assert verify_store(store, all_versions=True).ok


def test_a_writer_with_a_head_from_before_gc_commits_on_top(durable_url: str) -> None:
    """A round staged at head 2, committed after others appended and gc removed the records
    of versions 0-4: the record names below the floor are free again, and a commit there would
    be invisible. It lands on the head instead."""
    store = Store.open(durable_url, create=True)
    for step in range(2):
        store.append([{"step": step}])
    slow = Store.open(durable_url)
    part = slow.stage([{"step": 99}])
    other = Store.open(durable_url)
    for step in range(2, 5):
        other.append([{"step": step}])
    assert collect_garbage(other, keep=1, grace_s=0, dry_run=False).floor_after == 5
    assert slow.commit_staged([part]) == 6
    again = Store.open(durable_url)
    assert again.snapshot().to_arrow().column("step").to_pylist() == [0, 1, 2, 3, 4, 99]


def test_a_reset_paused_past_its_intent_reads_the_floor_again_before_its_create(
    tmp_path, monkeypatch
) -> None:
    """A resetter paused after writing its intent and reading the floor (here: every intent
    counts as old at once, RENEW_S 0) while a gc that no longer honoured the intent (INTENT_S
    passed) collected its target: before its create it writes the intent again and reads the
    floor again, and refuses the collected target with nothing created. Without a pause the
    same reset stands."""
    from dynstate.log import intents

    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(6):
        store.append([{"step": step}])
    store.reset(1)  # versions 2-6 abandoned: only version 1's shard is on the head's lineage
    monkeypatch.setattr(intents, "RENEW_S", 0.0)
    renew = intents.Intent.renew
    fired: list[int] = []

    def paused_renew(self):
        if not fired:  # what gc did during the pause: the intent had gone stale
            monkeypatch.setattr(intents, "INTENT_S", -1.0)
            result = collect_garbage(Store.open(url), keep=1, grace_s=0, dry_run=False)
            fired.append(result.floor_after)
            monkeypatch.setattr(intents, "INTENT_S", 3600.0)
        return renew(self)

    monkeypatch.setattr(intents.Intent, "renew", paused_renew)
    head = Store.open(url).head
    with pytest.raises(VersionCollectedError, match="version 4"):
        store.reset(4)
    assert fired == [head]
    again = Store.open(url)
    assert again.head == head
    assert again.snapshot().to_arrow().column("step").to_pylist() == [0]
    assert verify_store(again, all_versions=True).ok
    assert not os.listdir(os.path.join(url, "_dynstate", "tag-intents"))
    monkeypatch.setattr(intents.Intent, "renew", renew)
    assert store.append([{"step": 9}]) == head + 1
    assert store.reset(head) == head + 2  # renewed at the create, target kept: it stands
    assert Store.open(url).snapshot().to_arrow().column("step").to_pylist() == [0]
