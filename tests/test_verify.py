"""verify reads the store's files through the log's own calls, and reads them now: a handle
that read a schema, chunk or checkpoint before still sees that it is gone or damaged; files in
the checkpoint folder that the log does not name are not checkpoints."""

from __future__ import annotations

import pytest

from dynstate import CorruptStoreError, Store, paths
from dynstate.maintenance.verify import verify_store
from dynstate.records import manifest as m


def _store(tmp_path, shards: int = 300) -> tuple[str, Store]:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"i": i} for i in range(shards)], shard_bytes=1)  # one full chunk
    store.reset(1)  # a base record naming that chunk
    return url, store


def _one(store: Store, folder: str) -> str:
    (name,) = store.storage.list(f"{m.META_DIR}/{folder}")
    return f"{m.META_DIR}/{folder}/{name}"


def test_a_long_lived_handle_sees_a_removed_schema(tmp_path) -> None:
    _, store = _store(tmp_path)
    assert verify_store(store, all_versions=True).ok  # the handle has read the schema
    store.storage.delete(_one(store, "schemas"))
    report = verify_store(store)
    assert any("schema" in p and "missing" in p for p in report.problems), report.problems


def test_checkpoints_and_their_chunks_are_read_from_the_files(tmp_path) -> None:
    url, store = _store(tmp_path)
    store.log.publish_floor(2)  # a checkpoint of version 2 naming the chunk
    assert verify_store(store).ok
    chunk = _one(store, "chunks")
    store.storage.delete(chunk)
    report = verify_store(store)
    assert f"chunk {store.display_url}/{chunk} named by a checkpoint is missing" in (
        report.problems
    )
    store.storage.put(chunk, b"{}")  # damaged: its content no longer matches its name
    report = verify_store(Store.open(url))
    assert any("content address" in p for p in report.problems), report.problems


def test_a_damaged_checkpoint_is_named_and_foreign_names_are_ignored(tmp_path) -> None:
    url, store = _store(tmp_path, shards=3)
    folder = f"{m.META_DIR}/checkpoints"
    for foreign in ("notes.json", "1.json", "0000000000000000000x.json", "README"):
        store.storage.put(f"{folder}/{foreign}", b"not json")
    assert verify_store(Store.open(url)).ok
    assert store.log.checkpoint_versions() == [0]
    store.storage.put(m.checkpoint_path(0), b"not json")
    report = verify_store(Store.open(url))
    assert len(report.problems) == 1 and m.checkpoint_path(0) in report.problems[0]


def test_damaged_tags_are_reported_apart_from_the_rest(tmp_path) -> None:
    url, store = _store(tmp_path, shards=3)
    store.tag("good", 1)
    store.tag("bad", 2)
    store.storage.put(m.tag_path("bad"), b'{"format": 1, "version": "two"}')
    tags, damaged = store.check_tags()
    assert tags == {"good": 1} and set(damaged) == {"bad"}
    assert isinstance(damaged["bad"], CorruptStoreError)
    with pytest.raises(CorruptStoreError, match=r"bad\.json"):
        store.tags()
    report = verify_store(Store.open(url))
    assert len(report.problems) == 1 and m.tag_path("bad") in report.problems[0]


def test_a_new_store_has_the_log_s_first_version(tmp_path) -> None:
    store = Store.open(tmp_path / "new", create=True)
    record = store.commit_record(0)
    assert record.op == "create" and record.base is not None and not record.base.chunks
    assert store.log.checkpoint(0) == []
    assert store.log.checkpoint_versions() == [0]
    assert verify_store(store, all_versions=True).ok


def test_removed_newest_records_are_found_through_the_head_hint(tmp_path) -> None:
    """The head is found by probing record names, so deleting the newest commit records makes
    the store read as an older head without an error; verify finds it, because the head hint
    names the newer version, and says which records are gone."""
    root = tmp_path / "s"
    store = Store.open(str(root), create=True)
    for i in range(4):
        store.append([{"x": i}])
    assert store.head == 4
    assert verify_store(Store.open(str(root))).problems == []
    for version in (3, 4):
        (root / paths.log_path(version)).unlink()
    reopened = Store.open(str(root))
    assert reopened.head == 2
    problems = verify_store(reopened).problems
    assert any("names version 4" in p and "3-4 were removed" in p for p in problems), problems


def test_a_commit_landing_while_verify_runs_is_not_taken_for_removed_records(
    tmp_path, monkeypatch
) -> None:
    """A writer that commits (and moves the head hint) after verify found the head is not
    damage: the hinted version's record is there."""
    root = tmp_path / "s"
    store = Store.open(str(root), create=True)
    store.append([{"x": 0}])
    writer = Store.open(str(root))
    real = type(store.log).hinted_head

    def late_commit(log):
        writer.append([{"x": 1}])  # lands between verify's refresh and its read of the hint
        return real(log)

    monkeypatch.setattr(type(store.log), "hinted_head", late_commit)
    report = verify_store(Store.open(str(root)))
    assert report.problems == [], report.problems


def test_a_shard_its_version_schema_cannot_read_is_named(tmp_path, monkeypatch) -> None:
    """A store an earlier release wrote with a pandas Categorical of ints kept the schema's
    ``dictionary<int64>`` while Parquet gives the column back as ``int64``, and Arrow has no
    cast back: every read of the version failed, and verify said nothing. Made here by
    turning off what this release does instead (store such dictionaries as their values, and
    try the read's cast at write); verify now names the shard, the column and both types."""
    import pandas as pd

    from dynstate.records import columns, rounds

    monkeypatch.setattr(rounds, "storable", lambda table: table)
    monkeypatch.setattr(columns, "_parquet_roundtrip", lambda schema: None)
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append(pd.DataFrame({"level": pd.Categorical([3, 1, 3])}))
    monkeypatch.undo()
    report = verify_store(Store.open(str(tmp_path / "s")))
    (problem,) = report.problems
    assert "holds column level as int64" in problem
    assert "dictionary<values=int64" in problem and "cannot read" in problem
