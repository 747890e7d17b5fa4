"""dynstate.ray on a real local Ray cluster: rounds from parallel tasks commit once, killed
and failing tasks leave nothing visible, retries do not duplicate rows, and versions read back
as Ray Datasets hold exactly their rows."""

from __future__ import annotations

import os
import sys
import threading

import pyarrow as pa
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from conftest import s3_url  # noqa: E402

from dynstate import (  # noqa: E402
    InvalidDataError,
    MissingDependencyError,
    MissingShardError,
    RoundFailedError,
    Store,
)
from dynstate.ray import (  # noqa: E402
    commit_round,
    to_ray_dataset,
    write_ray_dataset,
    write_round,
)


@pytest.fixture(scope="module")
def ray_cluster(s3_endpoint):
    """One local Ray instance for the module. Started after the loopback S3 server, so its
    workers inherit the AWS_* variables that point s3fs at it."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    # Test helpers below run in Ray workers, which cannot import this test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()


def _rows(task: int, n: int = 5) -> list[dict]:
    return [{"task": task, "i": i, "prompt": f"t{task}-r{i}"} for i in range(n)]


def _generate(item: int) -> list[dict]:
    if item == 0:
        import time

        time.sleep(1.0)  # the first task finishes last: order must not follow completion
    return _rows(item)


def _referenced(store: Store) -> set[str]:
    return {s.path for c in store.versions() for s in store.snapshot(c.version).shards}


def _data_files(store: Store) -> set[str]:
    return {f"data/{n}" for n in store.storage.list("data") if n.endswith(".parquet")}


def _stage_then(url: str, task: int, action: str, marker: str = "") -> object:
    """A worker that stages its rows and then dies, or dies on its first attempt only."""
    staged = Store.open(url).stage(_rows(task))
    if action == "die" or (action == "die_once" and not os.path.exists(marker)):
        if marker:
            open(marker, "w").close()
        os._exit(1)
    return staged


def _seed(url: str) -> Store:
    store = Store.open(url, create=True)
    store.append(_rows(-1, 3), meta={"step": 0})
    return store


def test_round_from_four_tasks_commits_once_in_task_order(ray_cluster, tmp_path):
    store = _seed(str(tmp_path / "store"))
    version = write_round(store, range(4), _generate, meta={"step": 1})
    assert version == 2 and store.refresh() == 2
    assert store.commit_record(2).meta == {"step": 1}
    got = store.snapshot(2).to_arrow().to_pylist()
    assert got == _rows(-1, 3) + [r for t in range(4) for r in _rows(t)]
    assert _data_files(store) == _referenced(store)


def _fail_some(item: int) -> list[dict]:
    if item == 1:
        os._exit(1)  # the worker process dies before staging
    if item == 2:
        raise ValueError("generator broke")
    return _rows(item)


def test_failed_and_killed_tasks_leave_the_store_unchanged(ray_cluster, tmp_path):
    store = _seed(str(tmp_path / "store"))
    before = _data_files(store)
    with pytest.raises(RoundFailedError) as info:
        write_round(store, range(4), _fail_some, meta={"step": 1})
    assert set(info.value.failures) == {1, 2}
    assert str(tmp_path / "store") in str(info.value) and "version 1" in str(info.value)
    reopened = Store.open(str(tmp_path / "store"))
    assert reopened.head == 1
    assert reopened.snapshot().to_arrow().to_pylist() == _rows(-1, 3)
    # The successful tasks' shards were removed by the driver, not left for gc.
    assert _data_files(reopened) == before


def test_worker_killed_after_staging_leaves_only_unreferenced_shards(ray_cluster, tmp_path):
    url = str(tmp_path / "store")
    store = _seed(url)
    task = ray.remote(_stage_then).options(max_retries=0)
    refs = [task.remote(url, t, "die" if t == 2 else "ok") for t in range(4)]
    with pytest.raises(RoundFailedError) as info:
        commit_round(store, refs, meta={"step": 1})
    assert set(info.value.failures) == {2}
    assert isinstance(info.value.failures[2], ray.exceptions.WorkerCrashedError)
    reopened = Store.open(url)
    assert reopened.head == 1
    assert reopened.snapshot().to_arrow().to_pylist() == _rows(-1, 3)
    orphans = _data_files(reopened) - _referenced(reopened)
    assert len(orphans) == 1  # the dead worker's shard: never referenced, left for gc
    assert orphans.isdisjoint(_referenced(reopened))


def test_retried_task_does_not_duplicate_rows(ray_cluster, tmp_path):
    url = str(tmp_path / "store")
    store = _seed(url)
    marker = str(tmp_path / "died-once")
    task = ray.remote(_stage_then).options(max_retries=1)
    refs = [task.remote(url, t, "die_once" if t == 1 else "ok", marker) for t in range(3)]
    version = commit_round(store, refs, meta={"step": 1})
    assert os.path.exists(marker)  # task 1 really died once and was retried
    assert version == 2
    rows = store.snapshot(version).to_arrow().to_pylist()
    assert rows == _rows(-1, 3) + _rows(0) + _rows(1) + _rows(2)
    orphans = _data_files(store) - _referenced(store)
    assert len(orphans) == 1  # the first attempt's shard, committed by no version


def _assert_same(ds, store: Store, version: int) -> None:
    expected = store.snapshot(version).to_arrow()
    blocks = [ray.get(ref) for ref in ds.to_arrow_refs()]
    got = pa.concat_tables(blocks) if blocks else expected.schema.empty_table()
    assert got.num_rows == expected.num_rows
    assert got.select(expected.column_names).to_pylist() == expected.to_pylist()


def test_to_ray_dataset_reads_exactly_a_version_and_write_ray_dataset(ray_cluster, tmp_path):
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(2):
        # Small shards: each version spans several files whose order matters.
        store.append(_rows(step, 40), meta={"step": step}, shard_bytes=256)
    scored = [{**row, "score": 0.5} for row in _rows(2, 10)]
    store.append(scored, meta={"step": 2}, allow_new_columns=True)
    assert len(store.snapshot(1).shards) > 2
    context = ray.data.DataContext.get_current()
    flag = getattr(context, "use_datasource_v2", None)
    _assert_same(to_ray_dataset(url, 1), store, 1)  # an older version after later appends
    assert getattr(context, "use_datasource_v2", None) == flag  # the caller's context is kept
    # Shards written before "score" existed are read with nulls there, as the store does.
    _assert_same(to_ray_dataset(store), store, 3)

    source = ray.data.from_items(scored, override_num_blocks=3)
    source.context.execution_options.preserve_order = True
    version = write_ray_dataset(store, source, meta={"step": 3})
    assert store.snapshot(version).to_arrow().to_pylist()[-10:] == scored
    assert len(store.commit_record(version).add) == 3  # one staged part per block

    store.storage.delete(store.snapshot(1).shards[0].path)
    with pytest.raises(MissingShardError, match="version 1"):
        to_ray_dataset(store, 1)


def test_round_and_dataset_on_s3(ray_cluster):
    url = s3_url()
    store = _seed(url)
    version = write_round(url, range(3), _generate, meta={"step": 1})
    store.refresh()
    expected = _rows(-1, 3) + [r for t in range(3) for r in _rows(t)]
    assert store.snapshot(version).to_arrow().to_pylist() == expected
    assert _data_files(store) == _referenced(store)
    _assert_same(to_ray_dataset(url, version), store, version)


def test_unreachable_stores_and_missing_ray_raise_typed_errors(monkeypatch):
    store = Store.open("memory://dynstate-tests/ray-refused", create=True)
    with pytest.raises(InvalidDataError, match=r"memory://.*Ray workers"):
        write_round(store, range(2), _generate)
    assert store.refresh() == 0
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(MissingDependencyError, match=r"dynstate\[ray\]"):
        to_ray_dataset(store)


def test_round_that_cannot_be_sent_to_ray_leaves_nothing(ray_cluster, tmp_path):
    store = _seed(str(tmp_path / "store"))
    before = _data_files(store)
    items = [0, 1, threading.Lock()]  # parts 0 and 1 are submitted (and stage) before 2 fails
    with pytest.raises(InvalidDataError, match=r"part 2 .* must pickle"):
        write_round(store, items, _generate)
    assert Store.open(str(tmp_path / "store")).head == 1
    assert _data_files(store) == before
