"""dynstate.ray held to a plain oracle, on one local Ray cluster for the module.

Reads: the rows of ``to_ray_dataset(store, v)`` (blocks of ``ds.to_arrow_refs()``, in order)
must equal, in values, types and order, the version's shard files (``store.snapshot(v).shards``)
read whole with ``pyarrow.parquet.read_table``, each conformed by column name to the version's
schema (a column an older shard lacks is nulls of the version's type), concatenated in manifest
order. Writes: the committed rows must be the rows given, in task / block order. Refusals must be
``DynstateError`` s that name the store and leave every file of it as it was (lease files apart:
docs/format.md, "Leases", says gc removes them).

Tests whose docstring begins "DEFECT (fixed)" each failed on the code before its fix (the
docstring tells the defect as found); the others guard what held up."""

from __future__ import annotations

import datetime
import decimal
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from conftest import s3_url  # noqa: E402
from test_ray import ray_cluster  # noqa: E402,F401  (the module's one Ray instance)

import dynstate  # noqa: E402
from dynstate import (  # noqa: E402
    ChecksumMismatchError,
    DynstateError,
    InvalidDataError,
    MissingShardError,
    RoundFailedError,
    SchemaMismatchError,
    StateMismatchError,
    Store,
    VersionNotFoundError,
)
from dynstate.ray import (  # noqa: E402
    commit_round,
    to_ray_dataset,
    write_ray_dataset,
    write_round,
)

UTC = datetime.timezone.utc


@pytest.fixture(scope="module")
def cluster(ray_cluster):  # noqa: F811
    """test_ray's cluster; this module's helpers run in Ray workers too (pickled by value)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


# -- the oracle -------------------------------------------------------------------------------


def _s3_fs() -> pafs.S3FileSystem:
    scheme, host = os.environ["AWS_ENDPOINT_URL"].split("://", 1)
    return pafs.S3FileSystem(
        access_key=os.environ["AWS_ACCESS_KEY_ID"],
        secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        endpoint_override=host,
        scheme=scheme,
    )


def _read_whole(store: Store, rel: str) -> pa.Table:
    """One shard file, read whole by pyarrow and nothing else."""
    if store.url.startswith("s3://"):
        with _s3_fs().open_input_file(f"{store.url[5:].rstrip('/')}/{rel}") as f:
            return pq.read_table(f)
    with open(os.path.join(store.url, rel), "rb") as f:
        return pq.read_table(f)


def oracle(store: Store, version=None) -> pa.Table:
    snap = store.snapshot(version)
    schema = snap.schema
    tables = []
    for shard in snap.shards:
        table = _read_whole(store, shard.path)
        assert table.num_rows == shard.rows
        columns = []
        for field in schema:
            if field.name not in table.column_names:
                columns.append(pa.nulls(table.num_rows, field.type))
                continue
            column = table.column(field.name)
            columns.append(column if column.type.equals(field.type) else column.cast(field.type))
        tables.append(pa.Table.from_arrays(columns, schema=schema))
    if tables:
        return pa.concat_tables(tables)
    return schema.empty_table() if schema is not None else pa.table({})


def _collect(ds, schema: pa.Schema) -> pa.Table:
    blocks = [ray.get(ref) for ref in ds.to_arrow_refs()]  # in the dataset's order
    blocks = [b for b in blocks if b.num_columns or b.num_rows]
    return pa.concat_tables(blocks) if blocks else schema.empty_table()


def _assert_oracle(store: Store, version=None, **read_args) -> pa.Table:
    expected = oracle(store, version)
    got = _collect(to_ray_dataset(store, version, **read_args), expected.schema)
    assert got.schema == expected.schema, f"\n{got.schema}\n!=\n{expected.schema}"
    assert got.num_rows == expected.num_rows
    assert got.to_pylist() == expected.to_pylist()
    assert got.equals(expected)
    return got


def _files(store: Store) -> dict[str, bytes]:
    """Every file of a local store and its bytes, lease files apart (gc removes those)."""
    out = {}
    for folder, _, names in os.walk(store.url):
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, store.url)
            if rel.startswith(os.path.join("_dynstate", "leases") + os.sep):
                continue
            with open(path, "rb") as f:
                out[rel] = f.read()
    return out


def _seeded(path, rows=None) -> Store:
    store = Store.open(str(path), create=True)
    store.append(rows if rows is not None else [{"a": -1, "b": "seed"}], meta={"step": 0})
    return store


# -- helpers that run in Ray workers ------------------------------------------------------------


def _one(i: int) -> list[dict]:
    return [{"a": i, "b": f"r{i}"}]


def _kinds(i: int):
    """Four kinds of input, columns in different orders, finishing in reverse order."""
    time.sleep(0.15 * (3 - i))
    if i == 0:
        return pd.DataFrame({"a": [10, 11], "b": ["p0", "p1"]})
    if i == 1:
        return pa.table({"b": ["q0"], "a": pa.array([12], pa.int32())})
    if i == 2:
        return []  # a task that generated nothing
    return [{"b": "r0", "a": 13}, {"a": 14, "b": None}]


def _flaky(arg):
    i, marker = arg
    if i == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("first attempt fails")
    return _one(i)


def _killed_once(arg):
    i, marker = arg
    if i == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return _one(i)


def _killed(i: int):
    if i == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _one(i)


def _stage(url: str, rows):
    return Store.open(url).stage(rows)


# ============================================================================================
# Reads: to_ray_dataset against the plain oracle
# ============================================================================================


def test_columns_null_first_then_typed_read_as_the_oracle(cluster, tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append(
        [
            {
                "k": 0,
                "x": None,
                "s": {"p": None, "q": 1},
                "l": [],
                "ls": [{"a": 1, "b": None}],
                "ts": None,
                "dec": None,
                "cat": None,
                "m": None,
            }
        ]
    )
    store.append(
        pa.table(
            {
                "k": [1, 2],
                "x": [5, None],
                "s": [{"p": "z", "q": 2}, None],
                "l": [[1, 2], []],
                "ls": [[{"a": 2, "b": "bb"}], None],
                "ts": pa.array(
                    [datetime.datetime(2024, 5, 1, 1, 2, 3, tzinfo=UTC), None],
                    pa.timestamp("us", tz="Asia/Tokyo"),
                ),
                "dec": pa.array([decimal.Decimal("1.25"), None], pa.decimal128(6, 2)),
                "cat": pa.array(["u", None]).dictionary_encode(),
                "m": pa.array([[("k", 1)], None], pa.map_(pa.string(), pa.int64())),
            }
        )
    )
    schema = store.snapshot().schema
    assert schema.field("x").type == pa.int64()
    assert pa.types.is_dictionary(schema.field("cat").type)
    _assert_oracle(store)
    _assert_oracle(store, 1)  # the version where everything was still null


def test_many_types_read_as_the_oracle(cluster, tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    table = pa.table(
        {
            "u64": pa.array([2**64 - 1, 0], pa.uint64()),
            "tz": pa.array([datetime.datetime(2024, 1, 1), None], pa.timestamp("s", tz="UTC")),
            "d128": pa.array([decimal.Decimal("123.45"), None], pa.decimal128(10, 2)),
            "d256": pa.array([decimal.Decimal("1.5"), None], pa.decimal256(40, 3)),
            "big": pa.array(["x" * 1000, None], pa.large_string()),
            "f32": pa.array([0.1, 1.5], pa.float32()),
            "f16": pa.array([np.float16(1.5), None], pa.float16()),
            "d64": pa.array([datetime.date(2020, 1, 1), None], pa.date64()),
            "nest": pa.array([[{"a": [1, 2], "b": {"c": "x"}}], None]),
            "fsl": pa.array([[1, 2], None], pa.list_(pa.int32(), 2)),
            "ll": pa.array([[1], []], pa.large_list(pa.int64())),
            "bin": pa.array([b"\x00\xff", None], pa.large_binary()),
            "cat": pd.Categorical(["lo", "hi"]),
            "tensor": pa.FixedShapeTensorArray.from_numpy_ndarray(
                np.arange(8, dtype=np.float32).reshape(2, 2, 2)
            ),
            "a.b": [1, 2],
            "x y": ["p", "q"],
        }
    )
    store.append(table)
    store.append(table.slice(1))
    third = table.slice(0, 1)
    third = third.set_column(5, "f32", pa.array([0.5], pa.float64()))  # into float32, exact
    third = third.set_column(13, "tensor", pa.nulls(1))  # a null column into the tensor
    store.append(third.select(list(reversed(third.column_names))))
    cat = store.snapshot().schema.field("cat").type
    assert pa.types.is_dictionary(cat) and cat.index_type == pa.int32()
    _assert_oracle(store)


def test_non_nullable_fields_and_added_columns_read_as_the_oracle(cluster, tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    schema = pa.schema(
        [
            pa.field("a", pa.int64(), nullable=False),
            pa.field("s", pa.struct([pa.field("p", pa.string(), nullable=False)])),
        ]
    )
    store.append(pa.table({"a": [1], "s": [{"p": "x"}]}, schema=schema), shard_bytes=64)
    store.append([{"a": 2, "s": {"p": "y"}, "n": None}], allow_new_columns=True)
    store.append([{"a": 3, "s": {"p": "z"}, "n": 4, "t": ["w"]}], allow_new_columns=True)
    store.tag("two", 2)
    for version in (1, 2, "two", 3, None):
        _assert_oracle(store, version)


def test_lineage_column_read_as_the_oracle(cluster, tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"q": "a", "_dynstate_source": None}, {"q": "b", "_dynstate_source": None}])
    store.append([{"q": "c", "_dynstate_source": [0, 1]}, {"q": "d", "_dynstate_source": None}])
    assert store.snapshot().schema.field("_dynstate_source").type == pa.list_(pa.int64())
    _assert_oracle(store)


def test_empty_versions_and_empty_rounds_read_as_the_oracle(cluster, tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    got = _assert_oracle(store, 0)  # no schema yet
    assert got.num_rows == 0
    store.append(pa.table({"a": pa.array([], pa.int64()), "b": pa.array([], pa.string())}))
    store.append([])  # an empty round
    _assert_oracle(store, 1)
    _assert_oracle(store, 2)
    store.append([{"a": 1, "b": "x"}])
    store.append([])
    store.append([{"a": 2, "b": None}])
    _assert_oracle(store)


def test_versions_after_compact_reset_and_tag_read_as_the_oracle(cluster, tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"a": 1, "b": None}], shard_bytes=64)
    store.append([{"a": i, "b": f"x{i}"} for i in range(2, 6)], shard_bytes=64)
    store.append([{"a": 6, "b": "y", "c": 1.25}], allow_new_columns=True)
    store.tag("before-compact", 3)
    assert len(store.snapshot(3).shards) > 2
    dynstate.compact(store)
    store.refresh()
    assert len(store.snapshot().shards) < len(store.snapshot(3).shards)
    _assert_oracle(store)  # compacted
    _assert_oracle(store, "before-compact")
    store.reset(1)  # the schema of version 1 comes back: b is null again, no c
    got = _assert_oracle(store)
    assert got.schema.names == ["a", "b"] and got.schema.field("b").type == pa.null()
    store.append([{"a": 9, "b": 7}])  # b takes another type on this lineage
    assert store.snapshot().schema.field("b").type == pa.int64()
    _assert_oracle(store)
    _assert_oracle(store, 3)  # a version of the abandoned lineage, still listed


def test_many_small_shards_come_in_version_order(cluster, tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    for step in range(3):
        rows = [{"step": step, "i": i, "text": f"{step}-{i}" * 5} for i in range(60)]
        store.append(rows, shard_bytes=200)
    assert len(store.snapshot().shards) >= 12
    got = _assert_oracle(store)
    assert [(r["step"], r["i"]) for r in got.to_pylist()] == [
        (s, i) for s in range(3) for i in range(60)
    ]
    rows = to_ray_dataset(store).take_all()
    assert rows == got.to_pylist()


def test_read_args_that_hold(cluster, tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"a": 1, "b": "x"}, {"a": 2, "b": "y"}])
    store.append([{"a": 3, "b": "z", "c": 1.0}], allow_new_columns=True)
    _assert_oracle(store, override_num_blocks=1)
    expected = oracle(store)
    ds = to_ray_dataset(store, filter=pc.field("c").is_null())
    assert _collect(ds, expected.schema).to_pylist() == expected.slice(0, 2).to_pylist()
    ds = to_ray_dataset(store, filter=pc.field("c") > 0)
    assert _collect(ds, expected.schema).to_pylist() == expected.slice(2).to_pylist()


def test_read_refusals_are_typed_and_change_nothing(cluster, tmp_path):
    store = _seeded(tmp_path / "s")
    store.append([{"a": 1, "b": "x"}])
    before = _files(store)
    url = store.display_url
    with pytest.raises(VersionNotFoundError, match="version 9") as info:
        to_ray_dataset(store, 9)
    assert url in str(info.value)
    with pytest.raises(VersionNotFoundError, match="no-such-tag"):
        to_ray_dataset(store, "no-such-tag")
    with pytest.raises(DynstateError):
        to_ray_dataset(store, True)
    with pytest.raises(DynstateError, match="no dynstate store"):
        to_ray_dataset(str(tmp_path / "nothing-here"))
    assert _files(store) == before
    shard = store.snapshot(2).shards[-1]
    path = os.path.join(store.url, shard.path)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:-5])  # truncated
    with pytest.raises(ChecksumMismatchError, match="version 2") as info:
        to_ray_dataset(store, 2)
    assert url in str(info.value)
    _assert_oracle(store, 1)  # versions without the shard still read
    os.remove(path)
    with pytest.raises(MissingShardError, match="version 2"):
        to_ray_dataset(store)


def test_s3_store_read_and_round_as_the_oracle(cluster):
    url = s3_url()
    store = Store.open(url, create=True)
    store.append([{"a": 0, "b": None, "s": {"p": None}}], shard_bytes=64)
    store.append([{"a": 1, "b": "x", "s": {"p": 2}}], shard_bytes=64)
    version = write_round(url, range(4), _kinds_s3, meta={"step": 2}, allow_new_columns=False)
    store.refresh()
    expected_rows = [
        {"a": 0, "b": None, "s": {"p": None}},
        {"a": 1, "b": "x", "s": {"p": 2}},
        {"a": 20, "b": "p", "s": {"p": 3}},
        {"a": 21, "b": None, "s": None},
        {"a": 22, "b": "q", "s": {"p": None}},
    ]
    assert oracle(store, version).to_pylist() == expected_rows
    _assert_oracle(store, version)
    _assert_oracle(store, 1)


def _kinds_s3(i: int):
    time.sleep(0.1 * (3 - i))
    if i == 0:
        return [{"a": 20, "b": "p", "s": {"p": 3}}]
    if i == 1:
        return pd.DataFrame({"s": [None], "a": [21], "b": [None]})
    if i == 2:
        return []
    return pa.table({"b": ["q"], "a": [22], "s": [{"p": None}]})


def test_collected_versions_are_refused_as_collected(cluster, tmp_path):
    store = _seeded(tmp_path / "s")
    store.append([{"a": 1, "b": "x"}])
    dynstate.compact(store)
    store.append([{"a": 2, "b": "y"}])
    dynstate.collect_garbage(
        store, keep=1, grace_s=0, dry_run=False, clock=lambda: store.storage.now() + 7200
    )
    for version in (1, 2, 3):
        with pytest.raises(dynstate.VersionCollectedError, match=f"version {version}"):
            to_ray_dataset(store.url, version)
    _assert_oracle(store)


# -- read defects ---------------------------------------------------------------------------


def test_columns_read_arg_keeps_a_column_older_shards_lack(cluster, tmp_path):
    """DEFECT (fixed): ``to_ray_dataset(store, columns=["a", "c"])`` (a read argument it forwards to
    ``ray.data.read_parquet``) drops column ``c`` entirely when the version's first shard was
    written before ``c`` was added: Ray's v1 Parquet reader, which to_ray_dataset forces,
    prunes the projection to the first file's columns. The docs promise that such shards read
    as nulls there."""
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"a": 1, "b": "x"}])
    store.append([{"a": 2, "b": "y", "c": 1.5}], allow_new_columns=True)
    expected = oracle(store).select(["a", "c"])
    got = _collect(to_ray_dataset(store, columns=["a", "c"]), expected.schema)
    assert got.schema.names == ["a", "c"]
    assert got.to_pylist() == [{"a": 1, "c": None}, {"a": 2, "c": 1.5}]


def test_columns_read_arg_with_an_unknown_name_is_refused(cluster, tmp_path):
    """DEFECT (fixed): ``to_ray_dataset(store, columns=["nope"])`` returns one row per store row
    with a column ``__bsp_stub`` (Ray's placeholder) instead of refusing the name the version
    does not have with a DynstateError."""
    store = _seeded(tmp_path / "s")
    with pytest.raises(DynstateError, match="nope"):
        to_ray_dataset(store, columns=["nope"]).take_all()


def test_store_path_with_a_question_mark_reads_its_rows(cluster, tmp_path):
    """DEFECT (fixed): a store under a directory whose name holds ``?`` (a legal POSIX name) reads
    as an empty dataset: Ray's file-extension filter cuts each path at the ``?`` (it takes the
    rest for a URL query), finds no ``.parquet`` and drops every shard — silently, after the size
    check passed."""
    store = _seeded(tmp_path / "runs?id=1")
    store.append([{"a": 1, "b": "x"}])
    got = _assert_oracle(store)
    assert got.num_rows == 2


def test_collected_version_through_a_handle_opened_before_gc(cluster, tmp_path):
    """DEFECT (fixed): a Store handle that read version 1's shard list before a gc collected it gets
    ``MissingShardError`` ("is missing; restore it, or reset the store ...") from
    ``to_ray_dataset(handle, 1)``, where the same handle's ``snapshot(1).to_arrow()`` raises
    ``VersionCollectedError`` naming the oldest kept version (docs/api.md: raised when "the
    version was removed by gc"): the size check does not consult the gc floor."""
    store = _seeded(tmp_path / "s")
    store.append([{"a": 1, "b": "x"}])
    dynstate.compact(store)
    store.append([{"a": 2, "b": "y"}])
    handle = Store.open(store.url)
    assert len(handle.snapshot(1).shards) == 1  # the handle knows version 1's shards
    dynstate.collect_garbage(
        store, keep=1, grace_s=0, dry_run=False, clock=lambda: store.storage.now() + 7200
    )
    with pytest.raises(dynstate.VersionCollectedError, match="version 1"):
        to_ray_dataset(handle, 1)
    with pytest.raises(dynstate.VersionCollectedError, match="version 1"):
        handle.snapshot(1).to_arrow()


# ============================================================================================
# Writes: rows as given, in task / block order; refusals change nothing
# ============================================================================================


def test_round_of_mixed_inputs_lands_in_task_order(cluster, tmp_path):
    store = _seeded(tmp_path / "s")
    version = write_round(store, range(4), _kinds, meta={"step": 1})
    assert version == 2 and store.commit_record(2).meta == {"step": 1}
    expected = [
        {"a": -1, "b": "seed"},
        {"a": 10, "b": "p0"},
        {"a": 11, "b": "p1"},
        {"a": 12, "b": "q0"},
        {"a": 13, "b": "r0"},
        {"a": 14, "b": None},
    ]
    got = oracle(store, 2)
    assert got.to_pylist() == expected
    assert got.schema.field("a").type == pa.int64()
    _assert_oracle(store, 2)


def test_write_ray_dataset_keeps_block_order_and_fits_blocks_to_the_store(cluster, tmp_path):
    store = _seeded(tmp_path / "s")
    blocks = [
        pa.table({"a": [1, 2], "b": ["x", "y"]}),
        pa.table({"a": pa.array([], pa.int64()), "b": pa.array([], pa.string())}),
        pa.table({"b": pa.nulls(2), "a": [3, 4]}),  # other column order, b all None
        pa.table({"a": pa.array([5], pa.int16()), "b": pa.array(["z"]).dictionary_encode()}),
    ]
    ds = ray.data.from_arrow(blocks)
    ds.context.execution_options.preserve_order = True
    given = ds.take_all()
    version = write_ray_dataset(store, ds, meta={"step": 1})
    got = oracle(store, version)
    assert got.schema == store.snapshot(1).schema  # the store's schema holds
    assert got.to_pylist() == [{"a": -1, "b": "seed"}, *given]
    _assert_oracle(store, version)


def test_lineage_column_none_in_one_part_and_rows_in_another(cluster, tmp_path):
    store = _seeded(tmp_path / "s", [{"q": "root", "_dynstate_source": None}])
    parts = [[{"q": "a", "_dynstate_source": None}], [{"q": "b", "_dynstate_source": [0]}]]
    version = write_round(store, parts)
    assert oracle(store, version).to_pylist() == [
        {"q": "root", "_dynstate_source": None},
        {"q": "a", "_dynstate_source": None},
        {"q": "b", "_dynstate_source": [0]},
    ]


def test_retried_tasks_land_exactly_once(cluster, tmp_path):
    store = _seeded(tmp_path / "s")
    marker = str(tmp_path / "raised")
    items = [(i, marker) for i in range(3)]
    version = write_round(store, items, _flaky, max_retries=1, retry_exceptions=True)
    assert os.path.exists(marker)
    assert oracle(store, version).to_pylist()[1:] == _one(0) + _one(1) + _one(2)
    marker = str(tmp_path / "killed")
    items = [(i, marker) for i in range(3)]
    version = write_round(store, items, _killed_once, max_retries=1)
    assert os.path.exists(marker)
    assert oracle(store, version).to_pylist()[4:] == _one(0) + _one(1) + _one(2)
    assert store.snapshot(version).num_rows == 7


def test_killed_task_leaves_every_file_as_it_was(cluster, tmp_path):
    store = _seeded(tmp_path / "s")
    before = _files(store)
    with pytest.raises(RoundFailedError) as info:
        write_round(store, range(3), _killed, meta={"step": 1})
    assert set(info.value.failures) == {1}
    assert isinstance(info.value.failures[1], ray.exceptions.WorkerCrashedError)
    assert store.display_url in str(info.value) and "version 1" in str(info.value)
    assert _files(store) == before
    assert Store.open(store.url).head == 1


def test_new_columns_need_allow_new_columns_and_refusals_change_nothing(cluster, tmp_path):
    store = _seeded(tmp_path / "s")
    before = _files(store)
    wide = [[{"a": i, "b": "w", "c": i / 2}] for i in range(2)]
    with pytest.raises(RoundFailedError, match="unexpected columns: c") as info:
        write_round(store, wide)
    assert store.display_url in str(info.value) and "version 1" in str(info.value)
    assert _files(store) == before
    with pytest.raises(RoundFailedError, match="unexpected columns: c"):
        write_ray_dataset(store, ray.data.from_items([r for p in wide for r in p]))
    assert _files(store) == before
    version = write_round(store, wide, allow_new_columns=True)
    assert oracle(store, version).to_pylist() == [
        {"a": -1, "b": "seed", "c": None},
        {"a": 0, "b": "w", "c": 0.0},
        {"a": 1, "b": "w", "c": 0.5},
    ]
    _assert_oracle(store, version)


def test_commit_round_refusals_are_typed_and_change_nothing(cluster, tmp_path):
    store = _seeded(tmp_path / "s")
    other = _seeded(tmp_path / "other")
    url = store.url
    before = _files(store)

    parts = [ray.remote(_stage).remote(url, _one(i)) for i in range(2)]
    with pytest.raises(InvalidDataError, match="meta"):
        commit_round(store, parts, meta={"x": float("nan")})
    assert _files(store) == before

    parts = [ray.remote(_stage).remote(url, _one(0)), ray.remote(_stage).remote(other.url, [])]
    parts.append(ray.remote(_stage).remote(other.url, _one(1)))
    with pytest.raises(StateMismatchError, match="store"):
        commit_round(store, parts)
    assert _files(store) == before

    parts = [ray.remote(_stage).remote(url, _one(0)), ray.put(5)]
    with pytest.raises(RoundFailedError, match=r"not a dynstate\.Staged") as info:
        commit_round(store, parts)
    assert set(info.value.failures) == {1}
    assert _files(store) == before

    # another writer changes the schema between the stage and the commit
    parts = [ray.remote(_stage).remote(url, _one(i)) for i in range(2)]
    staged = ray.get(parts)
    store.append([{"a": 7, "b": "x", "c": 1}], allow_new_columns=True)
    middle = _files(store)
    with pytest.raises(SchemaMismatchError, match="changed at version 2"):
        commit_round(store, parts)
    ours = {s.path for p in staged for s in p.shards}
    assert set(middle) - set(_files(store)) == ours  # the round's shards were removed
    assert {k: v for k, v in middle.items() if k not in ours} == _files(store)
    assert Store.open(url).head == 2


def test_rounds_with_nothing_in_them(cluster, tmp_path):
    store = _seeded(tmp_path / "s")
    assert write_round(store, [], meta={"step": 1}) == 2
    assert write_ray_dataset(store, ray.data.from_items([])) == 3
    assert write_round(store, [[], []]) == 4
    assert oracle(store).to_pylist() == [{"a": -1, "b": "seed"}]
    _assert_oracle(store)


def test_round_rebases_over_another_writers_commit(cluster, tmp_path):
    store = _seeded(tmp_path / "s")
    parts = [ray.remote(_stage).remote(store.url, _one(i)) for i in range(2)]
    ray.wait(parts, num_returns=2)
    Store.open(store.url).append([{"a": 50, "b": "other writer"}])
    version = commit_round(store, parts, meta={"step": 2})
    assert version == 3
    assert oracle(store, 3).to_pylist() == [
        {"a": -1, "b": "seed"},
        {"a": 50, "b": "other writer"},
        *_one(0),
        *_one(1),
    ]


# -- write defects --------------------------------------------------------------------------


def test_commit_round_refuses_a_part_given_twice(cluster, tmp_path):
    """DEFECT (fixed): ``commit_round(store, [r0, r1, r0])`` commits r1's rows then r0's, once each:
    the parts are keyed by ObjectRef in a dict, so the repeated ref replaces the first
    index. The round is committed in another order than the one given, with a part missing,
    where a part given twice must be refused (docs/format.md: "commit_staged refuses a part,
    or a shard, given twice")."""
    store = _seeded(tmp_path / "s")
    r0 = ray.remote(_stage).remote(store.url, _one(0))
    r1 = ray.remote(_stage).remote(store.url, _one(1))
    try:
        version = commit_round(store, [r0, r1, r0])
    except DynstateError:
        assert Store.open(store.url).head == 1
        return
    rows = oracle(store, version).to_pylist()[1:]
    pytest.fail(f"a part given twice was committed as {rows}, not refused")


def test_write_ray_dataset_block_of_nulls_then_typed_block(cluster, tmp_path):
    """DEFECT (fixed): a Ray Dataset whose first block has a column all None and whose second has
    strings there is refused on a new store (SchemaMismatchError "staged parts ... have
    different schemas (changed types: b (null -> string))"), though Store.append of the same
    rows commits them: each block is staged on its own, and commit_staged demands identical
    schemas of the parts."""
    store = Store.open(str(tmp_path / "s"), create=True)
    rows = [{"a": 1, "b": None}, {"a": 2, "b": None}, {"a": 3, "b": "z"}, {"a": 4, "b": "w"}]
    ds = ray.data.from_items(rows, override_num_blocks=2)
    ds.context.execution_options.preserve_order = True
    version = write_ray_dataset(store, ds)
    got = oracle(store, version)
    assert got.to_pylist() == rows
    assert got.schema.field("b").type in (pa.string(), pa.large_string())


def test_write_round_null_column_store_parts_null_and_typed(cluster, tmp_path):
    """DEFECT (fixed): on a store whose column ``b`` has held only None so far, a round whose task 0
    still has None there and whose task 1 brings strings is refused (SchemaMismatchError,
    "null -> string"); Store.append of the same rows gives ``b`` its type, as the schema
    policy says (docs/format.md)."""
    store = _seeded(tmp_path / "s", [{"a": 0, "b": None}])
    parts = [[{"a": 1, "b": None}], [{"a": 2, "b": "t"}]]
    version = write_round(store, parts)
    got = oracle(store, version)
    assert got.to_pylist() == [{"a": 0, "b": None}, {"a": 1, "b": None}, {"a": 2, "b": "t"}]
    assert got.schema.field("b").type in (pa.string(), pa.large_string())


def test_first_round_parts_with_columns_in_another_order(cluster, tmp_path):
    """DEFECT (fixed): the first round of a new store, written by two tasks whose rows list the same
    columns in another order, is refused ("column order differs (a, b vs b, a)"); the schema
    policy says column order does not matter (rounds are reordered)."""
    store = Store.open(str(tmp_path / "s"), create=True)
    parts = [[{"a": 1, "b": "x"}], [{"b": "y", "a": 2}]]
    version = write_round(store, parts)
    assert oracle(store, version).to_pylist() == [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]


def test_first_round_parts_from_pandas_and_arrow(cluster, tmp_path):
    """DEFECT (fixed): the first round of a new store, one task returning a pandas DataFrame
    (strings as ``large_string``) and one an Arrow table (``string``), is refused ("changed
    types: b (large_string -> string)"); docs/format.md: string / large_string count as the same
    type "so pandas, datasets and plain Python rounds mix"."""
    store = Store.open(str(tmp_path / "s"), create=True)
    parts = [pd.DataFrame({"a": [1], "b": ["x"]}), pa.table({"a": [2], "b": ["y"]})]
    version = write_round(store, parts)
    got = oracle(store, version)
    assert got.to_pylist() == [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]


def test_first_round_blocks_categorical_and_strings(cluster, tmp_path):
    """DEFECT (fixed): a Ray Dataset of a pandas Categorical block and a plain-string block is
    refused on a new store ("changed types: b (dictionary<...> -> large_string)"); the schema
    policy fits "a dictionary by its values", and on a store that has a schema the same blocks
    land."""
    store = Store.open(str(tmp_path / "s"), create=True)
    frames = [
        pd.DataFrame({"a": [1], "b": pd.Categorical(["x"])}),
        pd.DataFrame({"a": [2], "b": ["y"]}),
    ]
    ds = ray.data.from_pandas(frames)
    ds.context.execution_options.preserve_order = True
    version = write_ray_dataset(store, ds)
    assert oracle(store, version).to_pylist() == [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]


def test_new_column_brought_by_some_parts_only(cluster, tmp_path):
    """DEFECT (fixed): with ``allow_new_columns=True``, a round where task 0 brings a new nullable
    column ``c`` and task 1 does not is refused ("staged parts ... have different schemas
    (missing columns: c)"); Store.append of the same rows adds ``c`` with None for the rows
    that lack it."""
    store = _seeded(tmp_path / "s")
    parts = [[{"a": 1, "b": "x", "c": 1.5}], [{"a": 2, "b": "y"}]]
    version = write_round(store, parts, allow_new_columns=True)
    assert oracle(store, version).to_pylist() == [
        {"a": -1, "b": "seed", "c": None},
        {"a": 1, "b": "x", "c": 1.5},
        {"a": 2, "b": "y", "c": None},
    ]


def test_relative_store_path_reaches_the_workers(cluster, tmp_path, monkeypatch):
    """DEFECT (fixed): ``write_round("store", ...)`` with a relative local path, opened in the
    driver's working directory, sends the workers the relative path as given; Ray workers keep
    the directory they started in, so every task fails with StoreNotFoundError ("no dynstate
    store at store") and the round is never written. docs/ray.md: "a local path works on one
    machine"."""
    monkeypatch.chdir(tmp_path)
    store = _seeded("store")
    version = write_round(store, range(2), _one)
    assert oracle(Store.open(str(tmp_path / "store")), version).to_pylist()[1:] == (
        _one(0) + _one(1)
    )


def test_numpy_column_of_a_ray_dataset_stays_readable(cluster, tmp_path):
    """DEFECT (fixed): write_ray_dataset of a Ray Dataset with a numpy column stores Ray's own
    extension type (``ray.data.arrow_tensor_v2``, not one of the canonical extension types
    docs/format.md lists). A process without Ray sees that column as ``large_list<float>`` and
    may append a round of any list length there; every process with Ray then fails to read the
    version's rows with a bare ``TypeError: buffer is too small for requested array``."""
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    ds = ray.data.from_items([{"a": 1, "t": np.zeros((2, 2), np.float32)}])
    try:
        write_ray_dataset(store, ds)
    except DynstateError:
        return  # refusing a type a plain reader cannot give back is a fix
    code = textwrap.dedent(
        f"""
        import sys
        from dynstate import DynstateError, Store
        store = Store.open({url!r})
        try:
            store.append([{{"a": 2, "t": [1.0]}}])
        except DynstateError:
            print("refused", "ray" in sys.modules)
        else:
            print("appended", "ray" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out[1] == "False"  # the appending process had no Ray
    if out[0] == "refused":
        return
    store.refresh()
    try:
        rows = to_ray_dataset(store).take_all()
    except Exception as exc:  # what a reader with Ray gets now
        pytest.fail(f"the version reads with {type(exc).__name__}: {exc}")
    assert len(rows) == 2
