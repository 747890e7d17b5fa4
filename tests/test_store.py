"""The store contract, run on every backend (memory://, local directory, s3:// on moto)."""

from __future__ import annotations

import pickle

import datasets
import pandas as pd
import pyarrow as pa
import pytest

from dynstate import (
    InvalidDataError,
    SchemaMismatchError,
    Store,
    StoreExistsError,
    StoreNotFoundError,
    VersionNotFoundError,
)
from dynstate.records import manifest as m


def rows(start: int, n: int) -> list[dict]:
    return [{"id": i, "text": f"row {i}", "score": i / 2} for i in range(start, start + n)]


def ids(store: Store, version: int | str | None = None) -> list[int]:
    table = store.snapshot(version).to_arrow()
    # Before the first non-empty round a store has no columns at all.
    return table.column("id").to_pylist() if table.num_rows else []


def test_open_missing_store_raises(store_url: str) -> None:
    with pytest.raises(StoreNotFoundError, match="create=True"):
        Store.open(store_url)


def test_create_is_idempotent_and_empty(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    again = Store.open(store_url, create=True)
    assert again.store_id == store.store_id
    assert store.head == 0
    snap = store.snapshot()
    assert (snap.version, snap.num_rows) == (0, 0)
    assert snap.to_arrow().num_rows == 0
    assert [c.op for c in store.versions()] == ["create"]


@pytest.mark.parametrize("kind", ["arrow", "pylist", "pandas", "datasets"])
def test_every_input_type_round_trips(store_url: str, kind: str) -> None:
    data = rows(0, 5)
    table = pa.Table.from_pylist(data)
    given = {
        "arrow": table,
        "pylist": data,
        "pandas": pd.DataFrame(data),
        "datasets": datasets.Dataset.from_list(data),
    }[kind]
    store = Store.open(store_url, create=True)
    v = store.append(given, meta={"step": 3, "generator": kind})
    assert v == 1
    got = Store.open(store_url).snapshot(v)
    assert got.num_rows == 5
    assert got.to_arrow().to_pylist() == data
    record = store.commit_record(v)
    assert record.op == "append" and record.parent == 0
    assert record.meta == {"step": 3, "generator": kind}
    # A second round of the same kind fits the schema the first one fixed.
    store.append(given)
    assert ids(store) == [0, 1, 2, 3, 4] * 2


def test_mixed_input_types_share_one_schema(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    store.append(pd.DataFrame(rows(0, 2)))  # pandas makes large_string
    store.append(datasets.Dataset.from_list(rows(2, 2)))
    store.append(rows(4, 2))
    assert ids(store) == list(range(6))


def test_datasets_with_indices_mapping(store_url: str) -> None:
    ds = datasets.Dataset.from_list(rows(0, 6)).select([5, 3, 1])
    store = Store.open(store_url, create=True)
    store.append(ds)
    assert ids(store) == [5, 3, 1]


def test_empty_round_is_a_commit(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    assert store.append([]) == 1
    assert store.append(rows(0, 2)) == 2
    assert store.append([]) == 3
    assert store.append(pa.Table.from_pylist(rows(0, 1)).slice(0, 0)) == 4
    for v in (1, 2, 3, 4):
        assert store.commit_record(v).op == "append"
    assert ids(store, 1) == []
    assert ids(store, 3) == ids(store, 4) == [0, 1]
    assert Store.open(store_url).head == 4


def test_large_round_splits_into_shards(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    data = rows(0, 1000)
    v = store.append(data, shard_bytes=4096)
    snap = store.snapshot(v)
    assert len(snap.shards) > 3
    assert sum(s.rows for s in snap.shards) == 1000
    assert len({s.path for s in snap.shards}) == len(snap.shards)
    assert snap.to_arrow().to_pylist() == data
    record = store.commit_record(v)
    assert record.num_shards == len(snap.shards)
    assert record.num_bytes == sum(s.bytes for s in snap.shards)
    assert all(snap.read_shard(i).num_rows == s.rows for i, s in enumerate(snap.shards))


def test_time_travel_and_row_identity(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    expected = {0: []}
    start = 0
    for v in range(1, 9):
        n = v % 3  # includes empty rounds
        assert store.append(rows(start, n), meta={"step": v}, shard_bytes=64) == v
        start += n
        expected[v] = list(range(start))
    for reader in (store, Store.open(store_url)):
        assert reader.head == 8
        assert [c.version for c in reader.versions()] == list(range(9))
        for v, want in expected.items():
            assert ids(reader, v) == want
            assert reader.snapshot(v).num_rows == len(want)
    # Row i of a version is row i of every later version.
    fresh = Store.open(store_url)
    tables = [fresh.snapshot(v).to_arrow().to_pylist() for v in range(9)]
    for v in range(9):
        for w in range(v, 9):
            assert tables[w][: len(tables[v])] == tables[v]


def test_unknown_version_raises(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    store.append(rows(0, 1))
    for bad in (2, -1, "nope", 1.5):
        with pytest.raises(VersionNotFoundError):
            store.snapshot(bad)
    with pytest.raises(VersionNotFoundError, match="latest is 1"):
        store.snapshot(7)


def test_other_process_commits_are_seen(store_url: str) -> None:
    a = Store.open(store_url, create=True)
    b = Store.open(store_url)
    a.append(rows(0, 2))
    a.append(rows(2, 2))
    assert b.snapshot().version == 2  # snapshot(None) refreshes
    assert b.append(rows(4, 1)) == 3  # b rebases onto a's commits
    assert ids(a) == list(range(5))


def test_tags(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    store.append(rows(0, 2))
    store.append(rows(2, 2))
    store.tag("first", 1)
    store.tag("first", 1)  # idempotent
    store.tag("latest")  # None tags the head
    assert store.tags() == {"first": 1, "latest": 2}
    assert ids(store, "first") == [0, 1]
    assert Store.open(store_url).snapshot("latest").version == 2
    with pytest.raises(StoreExistsError, match="force=True"):
        store.tag("first", 2)
    assert store.tags()["first"] == 1
    store.tag("first", 2, force=True)
    assert Store.open(store_url).tags()["first"] == 2
    for bad in ("", "../x", "a/b", ".hidden", "123", "a b", "x" * 200):
        with pytest.raises(InvalidDataError, match="invalid tag name"):
            store.tag(bad, 1)
    with pytest.raises(VersionNotFoundError):
        store.tag("future", 9)
    with pytest.raises(VersionNotFoundError, match="no tag"):
        store.snapshot("missing")
    assert store.tags() == {"first": 2, "latest": 2}
    store.untag("latest")
    assert store.tags() == {"first": 2}


def test_reset_is_a_new_version_and_keeps_abandoned(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    for v in range(1, 5):
        store.append(rows(10 * v, 3), shard_bytes=64)
    before = {v: ids(store, v) for v in range(5)}
    new = store.reset(2, meta={"reason": "resume"})
    assert new == 5
    record = store.commit_record(5)
    assert (record.op, record.target, record.parent) == ("reset", 2, 4)
    assert record.meta == {"reason": "resume"}
    assert ids(store) == before[2]
    # Abandoned versions stay listed and readable, also from a fresh Store.
    fresh = Store.open(store_url)
    assert [c.version for c in fresh.versions()] == list(range(6))
    for v, want in before.items():
        assert ids(fresh, v) == want
    # The lineage goes on from the reset content; row identity holds from there.
    assert store.append(rows(99, 1)) == 6
    assert ids(fresh, 6) == [*before[2], 99]
    store.tag("good", 1)
    assert store.reset("good") == 7
    assert ids(Store.open(store_url)) == before[1]
    assert ids(store, 0) == []
    assert store.reset(0) == 8 and ids(store) == []


def _cross_checkpoints(store_url: str, n: int) -> None:
    store = Store.open(store_url, create=True)
    added = []
    for v in range(1, n + 1):
        # One single-row shard per version: shard lists grow past a chunk (256 entries).
        assert store.append([{"id": v}]) == v
        added.extend(store.commit_record(v).add)
    probe = sorted({1, 100, 101, 199, 200, 201, 256, 257, n - 1, n} & set(range(n + 1)))
    # Each probe opened with no caches, so it is built from the nearest checkpoint (and its
    # chunks) plus the appends since, not from the writer's memory.
    for v in probe:
        snap = Store.open(store_url).snapshot(v)
        assert list(snap.shards) == added[:v]
        assert snap.num_rows == v
    assert ids(Store.open(store_url)) == list(range(1, n + 1))
    assert store.reset(n // 2) == n + 1
    assert ids(Store.open(store_url)) == list(range(1, n // 2 + 1))


def test_versions_cross_checkpoints(store_url: str) -> None:
    # Remote reads cost real requests: a short walk past the first checkpoint is enough there.
    n = 300 if store_url.startswith("memory://") else 103
    _cross_checkpoints(store_url, n)
    store = Store.open(store_url)
    assert store.storage.exists(m.checkpoint_path(100))
    if n >= 300:
        assert store.storage.list(f"{m.META_DIR}/chunks"), "300 shards should make a chunk"


def test_missing_checkpoint_falls_back_to_log(tmp_path) -> None:
    # A writer killed between commit and checkpoint leaves no checkpoint: readers replay.
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for v in range(1, 106):
        store.append([{"id": v}])
    store.storage.delete(m.checkpoint_path(100))
    assert ids(Store.open(url), 103) == list(range(1, 104))


def test_a_refused_round_names_only_what_differs(tmp_path) -> None:
    """A list column read from Parquet (its item field named ``element``) and the same column
    from Python lists (``item``) are one type to a round's check; a round refused for its
    extra column named the list column as a changed type too, sending the user after a
    difference that is none."""
    import pyarrow as pa

    store = Store.open(str(tmp_path / "s"), create=True)
    element = pa.list_(pa.field("element", pa.int64()))
    store.append(pa.table({"id": [0], "xs": pa.array([[1, 2]], element)}))
    with pytest.raises(SchemaMismatchError) as err:
        store.append([{"id": 1, "xs": [3], "extra": 1}])
    assert "unexpected columns: extra" in str(err.value)
    assert "changed types" not in str(err.value)
    store.append([{"id": 1, "xs": [3]}])
    assert store.snapshot().to_arrow().column("xs").to_pylist() == [[1, 2], [3]]


def test_add_nullable_columns_opt_in(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    store.append([{"id": 0, "text": "a"}])
    with pytest.raises(SchemaMismatchError, match="unexpected columns: extra"):
        store.append([{"id": 1, "text": "b", "extra": 1.5}])
    assert store.head == 1
    v = store.append([{"id": 1, "text": "b", "extra": 1.5}], allow_new_columns=True)
    assert v == 2
    fresh = Store.open(store_url)
    assert fresh.snapshot(1).to_arrow().column_names == ["id", "text"]
    head = fresh.snapshot().to_arrow()
    assert head.column_names == ["id", "text", "extra"]
    assert head.column("extra").to_pylist() == [None, 1.5]
    # A round with the columns in another order still fits.
    store.append(pa.table({"extra": [2.5], "text": ["c"], "id": [2]}))
    assert ids(store) == [0, 1, 2]


def test_stage_and_commit_staged(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    store.append(rows(0, 2))
    parts = [store.stage(rows(10, 3), shard_bytes=64), store.stage(rows(20, 2))]
    # Staged parts travel between processes.
    parts = [pickle.loads(pickle.dumps(p)) for p in parts]
    assert [p.num_rows for p in parts] == [3, 2]
    assert Store.open(store_url).head == 1  # staged is not committed
    v = store.commit_staged(parts, meta={"parts": 2})
    assert v == 2
    assert ids(Store.open(store_url)) == [0, 1, 10, 11, 12, 20, 21]
    assert store.commit_record(v).meta == {"parts": 2}


def test_discard_removes_staged_shards(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    part = store.stage(rows(0, 3))
    assert all(store.storage.exists(s.path) for s in part.shards)
    store.discard([part])
    assert not any(store.storage.exists(s.path) for s in part.shards)
    assert store.head == 0


def test_create_refuses_non_empty_foreign_dir(tmp_path) -> None:
    root = tmp_path / "busy"
    root.mkdir()
    (root / "notes.txt").write_text("not a store")
    with pytest.raises(StoreExistsError, match=r"notes\.txt"):
        Store.open(str(root), create=True)
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]
    with pytest.raises(StoreNotFoundError):
        Store.open(str(root))


def test_file_url_and_plain_path_are_the_same_store(tmp_path) -> None:
    path = tmp_path / "store"
    Store.open(str(path), create=True).append(rows(0, 2))
    assert ids(Store.open(f"file://{path}")) == [0, 1]


def test_store_and_staged_parts_pickle(tmp_path) -> None:
    """A store handle travels to spawned workers and Ray tasks: it pickles (its storage
    reconnects, its leases stay with the process that holds them), and so does a Staged."""
    import pickle

    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"id": 1}])
    part = store.stage([{"id": 2}])
    copy = pickle.loads(pickle.dumps(store))
    assert copy.commit_staged([pickle.loads(pickle.dumps(part))]) == 2
    assert copy.snapshot().to_arrow().column("id").to_pylist() == [1, 2]


def test_a_store_and_its_snapshots_form_no_cycle(tmp_path) -> None:
    """A store caching snapshots that point back at it formed a cycle, left to the cyclic
    collector — at interpreter exit with torch loaded that aborted the process (exit 134).
    Reference counting alone must free a store, its snapshots and their Arrow data."""
    import gc
    import weakref

    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"id": 1}])
    store.append([{"id": 2}])
    gc.disable()
    try:
        store = Store.open(url)
        snap = store.snapshot()
        assert snap.to_arrow().num_rows == 2
        assert store.snapshot(1).num_rows == 1 and store.snapshot().num_rows == 2
        gone = weakref.ref(store)
        del store, snap
        assert gone() is None
    finally:
        gc.enable()


def test_a_cached_snapshot_outlives_its_store_handle(tmp_path) -> None:
    url = str(tmp_path / "s")
    Store.open(url, create=True).append([{"id": 1}])
    snap = Store.open(url).snapshot()
    assert snap.to_arrow().column("id").to_pylist() == [1]


def test_open_takes_a_pathlib_path_and_refuses_a_non_path(tmp_path) -> None:
    store = Store.open(tmp_path / "run", create=True)
    store.append([{"a": 1}])
    assert Store.open(tmp_path / "run").snapshot().to_arrow().to_pylist() == [{"a": 1}]
    with pytest.raises(InvalidDataError, match="non-empty string or a path"):
        Store.open(5)  # type: ignore[arg-type]
