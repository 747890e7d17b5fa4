"""Staged parts land exactly once: a commit racing a discard or a second commit of the same
part, parts given twice, parts of another store (attacker findings F6, F7, F13, F14)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import uuid

import pytest

from dynstate import (
    CommitConflictError,
    InvalidDataError,
    LeaseExpiredError,
    StateMismatchError,
    Store,
)
from dynstate.log.leases import outcome_path
from dynstate.maintenance.verify import verify_store


def _rows(store: Store) -> list[int]:
    if store.head == 0:
        return []
    return store.snapshot().to_arrow().column("id").to_pylist()


def test_discard_after_commit_refuses_and_keeps_files(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    part = store.stage([{"id": 1}])
    other = Store.open(str(tmp_path / "s"))
    assert other.commit_staged([pickle.loads(pickle.dumps(part))]) == 1
    with pytest.raises(CommitConflictError):
        store.discard([part])
    assert verify_store(Store.open(str(tmp_path / "s")), all_versions=True).problems == []
    assert _rows(Store.open(str(tmp_path / "s"))) == [1]


def test_commit_after_discard_is_refused(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    part = store.stage([{"id": 1}])
    Store.open(str(tmp_path / "s")).discard([pickle.loads(pickle.dumps(part))])
    with pytest.raises(LeaseExpiredError, match="discarded"):
        store.commit_staged([part])
    assert Store.open(str(tmp_path / "s")).head == 0


def test_late_claim_after_commit_finished_is_refused(tmp_path):
    # The F13 interleaving: the loser checked the lease before the winner ended it, then
    # renewed it (recreating the lease file) and claimed. The outcome tombstone refuses it.
    store = Store.open(str(tmp_path / "s"), create=True)
    part = store.stage([{"id": 1}])
    loser = Store.open(str(tmp_path / "s"))
    assert Store.open(str(tmp_path / "s")).commit_staged([part]) == 1
    assert os.path.exists(tmp_path / "s" / outcome_path(part.lease))
    loser.log.leases.renew(part.lease)
    with pytest.raises(CommitConflictError):
        loser.log.leases.claim({part.lease}, uuid.uuid4().hex)
    with pytest.raises(CommitConflictError):
        loser.commit_staged([part])
    assert _rows(Store.open(str(tmp_path / "s"))) == [1]


def _race(args):
    url, blob, op, barrier = args
    part = pickle.loads(blob)
    store = Store.open(url)
    barrier.wait()
    try:
        if op == "commit":
            return ("commit", store.commit_staged([part]))
        store.discard([part])
        return ("discard", None)
    except (CommitConflictError, LeaseExpiredError) as exc:
        return (op, type(exc).__name__)


def _run_race(url, blob, ops):
    ctx = mp.get_context("spawn")
    barrier = ctx.Manager().Barrier(len(ops))
    with ctx.Pool(len(ops)) as pool:
        return pool.map(_race, [(url, blob, op, barrier) for op in ops])


@pytest.mark.slow
@pytest.mark.parametrize("ops", [("commit", "discard"), ("commit", "commit")])
def test_racing_processes_decide_exactly_once(tmp_path, ops):
    for trial in range(4):
        url = str(tmp_path / f"s{trial}")
        stager = Store.open(url, create=True)
        part = stager.stage([{"id": trial}])  # the stager stays alive
        results = _run_race(url, pickle.dumps(part), ops)
        store = Store.open(url)
        assert verify_store(store, all_versions=True).problems == []
        won = [r for r in results if r[1] is None or isinstance(r[1], int)]
        assert len(won) == 1, results
        if won[0][0] == "commit":
            assert _rows(store) == [trial]
        else:
            assert store.head == 0
            assert results == [("commit", "LeaseExpiredError"), ("discard", None)]


def test_same_part_twice_is_refused_before_anything(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    part = store.stage([{"id": 1}, {"id": 2}])
    with pytest.raises(InvalidDataError, match="twice"):
        store.commit_staged([part, part])
    assert store.head == 0
    assert store.commit_staged([part]) == 1
    assert _rows(store) == [1, 2]


def test_part_of_another_store_names_both(tmp_path):
    x = Store.open(str(tmp_path / "x"), create=True)
    y = Store.open(str(tmp_path / "y"), create=True)
    part = x.stage([{"id": 1}])
    with pytest.raises(StateMismatchError) as info:
        y.commit_staged([part])
    assert x.store_id in str(info.value) and y.store_id in str(info.value)
    assert x.commit_staged([part]) == 1


def test_verify_flags_a_shard_listed_twice(tmp_path):
    import dataclasses
    import json

    from dynstate.records import manifest as m

    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"id": 1}])
    store.append([{"id": 2}])
    assert verify_store(Store.open(url), all_versions=True).problems == []
    # A record (written by an older dynstate) whose round re-adds the previous round's shard.
    record = store.commit_record(2)
    first = store.commit_record(1).add[0]
    forged = dataclasses.replace(
        record,
        add=(first,),
        num_rows=record.num_rows - record.add[0].rows + first.rows,
        num_bytes=record.num_bytes - record.add[0].bytes + first.bytes,
    )
    path = tmp_path / "s" / m.log_path(2)
    path.write_bytes(m.encode(forged.to_json()))
    assert json.loads(path.read_bytes())  # a valid record
    for all_versions in (False, True):
        problems = verify_store(Store.open(url), all_versions=all_versions).problems
        assert any("listed twice" in p for p in problems), problems


def _stage_in_worker(args):
    url, i = args
    return Store.open(url).stage([{"id": i}])


@pytest.mark.slow
def test_part_staged_by_an_exited_process_survives_gc(tmp_path):
    """F8: the pool worker that staged exits; the parent that unpickled its parts renews
    their leases, so a gc with the default grace keeps them and the commit lands."""
    from dynstate.maintenance.gc import collect_garbage

    url = str(tmp_path / "s")
    Store.open(url, create=True)
    with mp.get_context("spawn").Pool(2) as pool:
        parts = pool.map(_stage_in_worker, [(url, 1), (url, 2)])
    collect_garbage(Store.open(url), dry_run=False)  # the workers are gone
    store = Store.open(url)
    assert store.commit_staged(parts) == 1
    assert _rows(store) == [1, 2]
    assert verify_store(Store.open(url), all_versions=True).problems == []


@pytest.mark.parametrize("damage", ["checksum", "not json", "directory"])
def test_verify_lists_a_damaged_tag_and_checks_the_rest(tmp_path, damage):
    """F1: a damaged tag file is a problem of its own; verify still checks everything else."""
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"id": 1}])
    store.tag("good", 1)
    store.tag("ckpt", 1)
    tag = tmp_path / "s" / "_dynstate" / "tags" / "ckpt.json"
    if damage == "checksum":
        tag.write_text(json.dumps({**json.loads(tag.read_text()), "version": 2}))
    elif damage == "not json":
        tag.write_text("{not json")
    else:
        tag.unlink()
        tag.mkdir()
    # ... and a shard is missing too: it must still be found.
    shard = store.snapshot().shards[0].path
    os.remove(tmp_path / "s" / shard)
    report = verify_store(Store.open(url), all_versions=True)
    assert any("ckpt.json" in p for p in report.problems), report.problems
    assert any(shard in p for p in report.problems), report.problems
