"""VersionedDataset reads: batches equal the same rows read one by one and Arrow's own rows,
in order, across shards and versions; bad indices raise typed errors; the cache stays
bounded; the columnar batch formats hold the same values."""

from __future__ import annotations

import datetime as dt
import pickle
import random
import uuid

import numpy as np
import pyarrow as pa
import pytest

from dynstate import (
    DynstateError,
    InvalidDataError,
    RowOutOfRangeError,
    Store,
    VersionedDataset,
    decode_index,
    encode_index,
)


def _round(start: int, n: int) -> pa.Table:
    """Rows with every kind of column the read paths treat apart: null-free ints and floats
    (numpy), ints with nulls, strings, bools, lists, structs, timestamps (Arrow)."""
    ids = list(range(start, start + n))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "small": pa.array([i % 100 for i in ids], pa.int8()),
            "u": pa.array([i * 3 for i in ids], pa.uint32()),
            "score": pa.array([i / 7 for i in ids], pa.float64()),
            "half": pa.array([i / 4 for i in ids], pa.float32()),
            "maybe": pa.array([None if i % 3 == 0 else i for i in ids], pa.int64()),
            "prompt": pa.array([f"task {i} " + "é" * (i % 5) for i in ids], pa.string()),
            "flag": pa.array([i % 2 == 0 for i in ids], pa.bool_()),
            "tags": pa.array([[f"t{i % 4}"] * (i % 3) for i in ids], pa.list_(pa.string())),
            "meta": pa.array(
                [{"k": i, "s": str(i)} for i in ids],
                pa.struct([("k", pa.int64()), ("s", pa.string())]),
            ),
            "at": pa.array(
                [dt.datetime(2026, 1, 1) + dt.timedelta(seconds=i) for i in ids],
                pa.timestamp("us"),
            ),
        }
    )


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> str:
    """Five rounds of 300 rows, each split into ~3 shards: 15ish shards of ~100 rows."""
    path = str(tmp_path_factory.mktemp("ds") / "store")
    store = Store.open(path, create=True)
    for k in range(5):
        store.append(_round(k * 300, 300), shard_bytes=4096)
    return path


@pytest.fixture(scope="module")
def expected(store_path) -> list[dict]:
    return Store.open(store_path).snapshot().to_arrow().to_pylist()


def test_the_fixture_spans_many_shards(store_path):
    snap = Store.open(store_path).snapshot()
    assert len(snap.shards) >= 10
    assert snap.num_rows == 1500


@pytest.mark.parametrize("size", [1, 3, 7, 64, 600])
def test_batches_equal_arrow_rows_in_order(store_path, expected, size):
    """Random batches (rows across every shard boundary, duplicates included) equal Arrow's
    rows at those indices, in the batch's order, and the same rows read one by one."""
    ds = VersionedDataset(store_path)
    rng = random.Random(size)
    offsets = ds.snapshot().offsets
    boundary = [o for o in offsets[1:-1]] + [o - 1 for o in offsets[1:-1]]
    for trial in range(5):
        indices = [rng.randrange(1500) for _ in range(size)]
        if trial == 1:
            indices = [rng.choice(boundary) for _ in range(size)]
        if trial == 2 and size > 1:
            indices[-1] = indices[0]  # a duplicate
        got = ds.__getitems__(indices)
        assert got == [expected[i] for i in indices]
        assert got == [ds[i] for i in indices]
        tagged = [encode_index(ds.version, i) for i in indices]
        assert ds.__getitems__(tagged) == got


def test_values_keep_their_python_types(store_path, expected):
    ds = VersionedDataset(store_path)
    for row in (ds[4], ds.__getitems__([4, 5, 6, 7, 8, 9, 10, 11, 400])[0]):
        assert row == expected[4]
        assert [type(v) for v in row.values()] == [type(v) for v in expected[4].values()]
    assert type(ds[3]["maybe"]) is type(None)
    assert isinstance(ds[5]["at"], dt.datetime)


def test_duplicates_are_distinct_dicts(store_path):
    ds = VersionedDataset(store_path)
    a, b = ds.__getitems__([7, 7])
    assert a == b and a is not b
    a["id"] = -1
    assert b["id"] == 7 and ds[7]["id"] == 7


def test_whole_dataset_in_one_batch_and_by_iteration(store_path, expected):
    ds = VersionedDataset(store_path)
    assert ds.__getitems__(list(range(1500))) == expected
    assert ds.__getitems__(list(range(1499, -1, -1))) == expected[::-1]
    assert list(ds) == expected  # the sequence protocol stops at the first IndexError


def test_empty_batch(store_path):
    ds = VersionedDataset(store_path)
    assert ds.__getitems__([]) == []
    columns = ds.read_batch([], "columns")
    assert list(columns) == ds.snapshot().schema.names
    assert all(v == [] for v in columns.values())
    batch = ds.read_batch([], "arrow")
    assert batch.num_rows == 0
    assert batch.schema.equals(ds.snapshot().schema, check_metadata=False)


def test_out_of_range_and_bad_indices_raise_typed_errors(store_path):
    ds = VersionedDataset(store_path)
    old = ds.store.snapshot(1)
    bad = [
        lambda: ds[1500],
        lambda: ds[-1],
        lambda: ds.__getitems__([0, 1500]),
        lambda: ds.__getitems__([3, -2]),
        lambda: ds[encode_index(1, old.num_rows)],
        lambda: ds.__getitems__([encode_index(1, 0), encode_index(1, old.num_rows)]),
        lambda: decode_index(-5),
    ]
    for call in bad:
        with pytest.raises(RowOutOfRangeError) as info:
            call()
        assert isinstance(info.value, IndexError) and isinstance(info.value, DynstateError)
        assert "\n" not in str(info.value)
    with pytest.raises(RowOutOfRangeError, match=r"version 1 of .*\(300 rows\)"):
        ds[encode_index(1, 300)]
    with pytest.raises(InvalidDataError):
        ds.__getitems__(["x"])
    with pytest.raises(InvalidDataError):
        ds["x"]
    with pytest.raises(InvalidDataError):
        ds.read_batch([0], "pandas")
    with pytest.raises(InvalidDataError):
        VersionedDataset(store_path, batch_format="nope")


def test_mixed_versions_and_schemas_in_one_batch(tmp_path):
    """A batch holding rows of an older version (fewer columns) and of a newer one (a column
    added since): each row is read from its own version, as the sampler's indices say."""
    store = Store.open(str(tmp_path / "s"), create=True)
    v1 = store.append([{"id": i, "text": f"r{i}"} for i in range(50)], shard_bytes=512)
    v2 = store.append(
        [{"id": i, "text": f"r{i}", "extra": i * 2} for i in range(50, 90)],
        allow_new_columns=True,
        shard_bytes=512,
    )
    ds = VersionedDataset(store, version=v1)
    rng = random.Random(0)
    indices = []
    for _ in range(120):
        if rng.random() < 0.5:
            indices.append(encode_index(v1, rng.randrange(50)))
        else:
            indices.append(encode_index(v2, rng.randrange(90)))
    indices += [7, 7]  # plain rows of the pinned version
    got = ds.__getitems__(indices)
    assert got == [ds[i] for i in indices]
    for index, row in zip(indices, got, strict=True):
        version, r = decode_index(index)
        if version == v2:
            assert row == {"id": r, "text": f"r{r}", "extra": r * 2 if r >= 50 else None}
        else:
            assert row == {"id": r, "text": f"r{r}"}
    columns = ds.read_batch(indices, "columns")
    assert list(columns) == ["id", "text", "extra"]
    assert columns["id"] == [row["id"] for row in got]
    assert columns["extra"] == [row.get("extra") for row in got]
    batch = ds.read_batch(indices, "arrow")
    assert batch.column("id").to_pylist() == columns["id"]
    assert batch.column("extra").to_pylist() == columns["extra"]
    assert ds.version == v1  # tagged indices never move the pinned version


def test_plain_index_past_the_pinned_version_follows_the_head(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"x": i} for i in range(5)])
    ds = VersionedDataset(str(tmp_path / "s"))
    store.append([{"x": i} for i in range(5, 9)])
    assert ds.__getitems__([8, 0]) == [{"x": 8}, {"x": 0}]
    assert ds.version == store.head
    with pytest.raises(RowOutOfRangeError):
        ds[9]


@pytest.mark.parametrize("fmt", ["columns", "arrow"])
def test_columnar_formats_hold_the_same_rows(store_path, expected, fmt):
    ds = VersionedDataset(store_path, batch_format=fmt)
    rng = random.Random(3)
    indices = [rng.randrange(1500) for _ in range(200)] + [0, 0]
    batch = ds.__getitems__(indices)
    if fmt == "arrow":
        assert isinstance(batch, pa.RecordBatch)
        assert batch.schema.equals(ds.snapshot().schema, check_metadata=False)
        batch = batch.to_pydict()
    assert list(batch) == list(expected[0])
    for name, values in batch.items():
        assert values == [expected[i][name] for i in indices]
    assert ds[5] == expected[5]  # one row stays a dict


def test_column_selection(store_path, expected):
    ds = VersionedDataset(store_path, columns=["prompt", "id"])
    indices = [5, 900, 3, 1400, 5, 77, 78, 79, 80, 81, 82, 83, 84, 85]
    want = [{"prompt": expected[i]["prompt"], "id": i} for i in indices]
    assert ds.__getitems__(indices) == want
    assert ds[900] == want[1]
    assert ds.read_batch(indices, "columns") == {
        "prompt": [w["prompt"] for w in want],
        "id": indices,
    }
    assert ds.read_batch(indices, "arrow").to_pylist() == want
    with pytest.raises(InvalidDataError, match="nope"):
        VersionedDataset(store_path, columns=["nope"])[0]


def test_cache_stays_bounded_and_reads_stay_right(store_path, expected):
    one_shard = VersionedDataset(store_path).cache
    ds = VersionedDataset(store_path, cache_bytes=20_000)
    rng = random.Random(5)
    largest = 0
    for _ in range(30):
        indices = [rng.randrange(1500) for _ in range(50)]
        assert ds.__getitems__(indices) == [expected[i] for i in indices]
        largest = max(largest, ds.cache.nbytes)
    assert ds.cache.misses > len(ds.snapshot().shards)  # evictions happened
    shard_bytes = max(
        one_shard.shard(ds.store, s, ds.snapshot().schema, None, ds.version).nbytes
        for s in ds.snapshot().shards
    )
    assert largest <= 20_000 + shard_bytes


def test_blocks_of_cached_shards_read_the_same_rows(store_path, expected):
    """Once a run of shards is decoded, the cache joins it into one block (one take per
    column for the whole run) and drops the shards; reads through blocks, single rows and
    batches, stay exactly Arrow's rows."""
    ds = VersionedDataset(store_path)
    assert ds.__getitems__(list(range(1500))) == expected  # decodes every shard
    rng = random.Random(9)
    indices = [rng.randrange(1500) for _ in range(300)]
    assert ds.__getitems__(indices) == [expected[i] for i in indices]
    keys = set(ds.cache._shards)
    view = ds._view(ds.version)
    formed = [b for b, key in enumerate(view.block_keys) if key in keys]
    assert formed, keys
    assert not any(part in keys for b in formed for part in view.parts(b))  # parts dropped
    assert [ds[i] for i in indices[:50]] == [expected[i] for i in indices[:50]]
    assert ds.read_batch(indices, "arrow").to_pylist() == [expected[i] for i in indices]
    assert ds.cache.nbytes == sum(e.nbytes for e in ds.cache._shards.values())


def test_a_block_too_big_for_the_cache_is_never_formed(store_path, expected, monkeypatch):
    """Planned runs rest on an estimate of decoded sizes; when the decoded shards of a run
    hold more than a quarter of the cache, the cache declines the block for good and reads
    stay per shard."""
    import dynstate.loading.view as view_module

    # Estimate decoded shards at 0 bytes: runs are planned by count alone, up to 8 shards.
    monkeypatch.setattr(view_module, "_DECODED_PER_PARQUET_BYTE", 0)
    whole = sum(
        VersionedDataset(store_path).cache.shard(Store.open(store_path), s, None, None, 0).nbytes
        for s in Store.open(store_path).snapshot().shards
    )
    ds = VersionedDataset(store_path, cache_bytes=int(1.5 * whole))  # holds every shard
    assert ds.__getitems__(list(range(1500))) == expected
    assert ds.__getitems__(list(range(0, 1500, 3))) == expected[::3]
    view = ds._view(ds.version)
    assert 0 in view.too_big  # [0, 8) holds over 2/5 of the rows, over 1/4 of the cache
    assert all(view.block_keys[b] not in ds.cache._shards for b in view.too_big)
    assert ds.cache.nbytes <= 1.5 * whole
    assert [ds[i] for i in (0, 777, 1499)] == [expected[0], expected[777], expected[1499]]


def test_growing_store_reads_each_version_through_blocks(tmp_path):
    """Versions that share their first shards share their blocks; rows of every version,
    read in one batch as the sampler's indices name them, stay right while rounds land."""
    store = Store.open(str(tmp_path / "s"), create=True)
    ds = VersionedDataset(store)
    rng = random.Random(4)
    versions = []
    for k in range(9):
        versions.append(store.append(_round(k * 40, 40), shard_bytes=2048))
        truth = {v: store.snapshot(v).to_arrow().to_pylist() for v in versions}
        indices = []
        for _ in range(200):
            v = rng.choice(versions)
            indices.append(encode_index(v, rng.randrange(len(truth[v]))))
        want = [truth[decode_index(i)[0]][decode_index(i)[1]] for i in indices]
        assert ds.__getitems__(indices) == want
        assert ds.__getitems__(indices) == want  # second pass: through blocks
        assert [ds[i] for i in indices[:20]] == want[:20]
    assert any(k[0] == "block" for k in ds.cache._shards)


def test_pickles_without_rows(store_path, expected):
    ds = VersionedDataset(store_path, batch_format="columns")
    ds.__getitems__(list(range(0, 1500, 7)))  # warm: the cache must not travel
    blob = pickle.dumps(ds)
    assert len(blob) < 2000
    copy = pickle.loads(blob)
    assert copy.__getitems__([3, 1499])["id"] == [3, 1499]
    assert copy[10] == expected[10]


def test_memory_store_batches(expected):
    url = f"memory://dynstate-tests/{uuid.uuid4().hex}"
    store = Store.open(url, create=True)
    store.append(_round(0, 300), shard_bytes=4096)
    ds = VersionedDataset(url)
    assert ds.__getitems__([299, 0, 150]) == [expected[299], expected[0], expected[150]]


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates with a UserWarning.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("fmt", ["rows", "columns"])
def test_loader_with_workers_sees_every_row_once(store_path, fmt):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from dynstate import VersionedSampler

    ds = VersionedDataset(store_path, batch_format=fmt)
    loader = StatefulDataLoader(
        ds,
        batch_size=64,
        sampler=VersionedSampler(ds, seed=1),
        num_workers=2,
        collate_fn=lambda batch: batch,
    )
    ids = []
    for batch in loader:
        ids += [row["id"] for row in batch] if fmt == "rows" else batch["id"]
    assert sorted(ids) == list(range(1500))


# -- row numbers in batch items (lineage from the plain API, issue 24) --------------------------


def test_row_column_gives_each_item_its_row_number(store_path, expected):
    ds = VersionedDataset(store_path, row_column="_dynstate_row")
    assert ds[7] == {**expected[7], "_dynstate_row": 7}
    picks = [1499, 0, 0, 640, 301]  # across shards and blocks, a duplicate
    assert ds.__getitems__(picks) == [{**expected[i], "_dynstate_row": i} for i in picks]
    columns = ds.read_batch(picks, "columns")
    assert columns["_dynstate_row"] == picks and columns["id"] == [expected[i]["id"] for i in picks]
    batch = ds.read_batch(picks, "arrow")
    assert batch.schema.field("_dynstate_row").type == pa.int64()
    assert batch.column("_dynstate_row").to_pylist() == picks
    assert ds.read_batch([], "arrow").column("_dynstate_row").to_pylist() == []
    assert VersionedDataset(store_path, columns=["id"], row_column="row")[5] == {"id": 5, "row": 5}
    assert "_dynstate_row" not in VersionedDataset(store_path)[0]  # off by default
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[3]["_dynstate_row"] == 3


def test_row_column_is_the_row_of_the_sampler_s_version(tmp_path):
    """A sampler index carries its version; the row number is the row in that version, the
    same in every later version of its lineage."""
    from dynstate import VersionedSampler

    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"q": f"seed {i}"} for i in range(6)])
    ds = VersionedDataset(store, row_column="_dynstate_row")
    indices = list(VersionedSampler(ds, seed=0))
    store.append([{"q": "later"}])
    items = ds.__getitems__(indices)
    head = store.snapshot().to_arrow().to_pylist()
    assert sorted(i["_dynstate_row"] for i in items) == list(range(6))
    assert all(head[i["_dynstate_row"]]["q"] == i["q"] for i in items)


def test_row_column_that_names_a_column_is_refused(store_path):
    with pytest.raises(InvalidDataError, match=r"row_column='id' is a column of version 5"):
        VersionedDataset(store_path, row_column="id")
    with pytest.raises(InvalidDataError, match="row_column must be a column name"):
        VersionedDataset(store_path, row_column="")


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_row_column_in_loader_workers_round_trips_as_lineage(tmp_path):
    """The documented recipe: batch items carry their row, a generator writes the rows it
    derived from as `_dynstate_source` (None in the import: the column stays list<int64>)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from dynstate import VersionedSampler

    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"q": f"seed {i}", "_dynstate_source": None} for i in range(8)])
    ds = VersionedDataset(store, row_column="_dynstate_row")
    loader = StatefulDataLoader(
        ds, batch_size=4, sampler=VersionedSampler(ds, seed=2), num_workers=1,
        collate_fn=lambda rows: rows,
    )  # fmt: skip
    for batch in loader:
        rows = [{"q": f"variant of {r['q']}", "_dynstate_source": [r["_dynstate_row"]]}
                for r in batch]  # fmt: skip
        store.append(rows, meta={"generator": "variants"})
    table = store.snapshot().to_arrow()
    assert table.schema.field("_dynstate_source").type == pa.list_(pa.int64())
    out = table.to_pylist()
    for row in out[8:]:
        (source,) = row["_dynstate_source"]
        assert row["q"] == f"variant of {out[source]['q']}"


def test_a_huge_row_number_is_out_of_range_not_a_missing_version(tmp_path):
    """Indices past 2**40 carry a version (VersionedSampler's); one that names a version the
    store never had is a row number out of range, said as such, for one index and a batch."""
    from dynstate.errors import VersionNotFoundError

    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"x": 1}, {"x": 2}])
    ds = VersionedDataset(str(tmp_path / "s"))
    huge = 2**45
    for read in (lambda: ds[huge], lambda: ds.__getitems__([0, huge])):
        with pytest.raises(RowOutOfRangeError, match=f"index {huge} is out of range") as caught:
            read()
        assert not isinstance(caught.value, VersionNotFoundError)
        assert "len(dataset)" in str(caught.value)
    assert ds[encode_index(1, 1)]["x"] == 2  # a sampler's index still reads its version


NUMERIC = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint32(), pa.uint64()]


@pytest.mark.parametrize("t", [*NUMERIC, pa.float32(), pa.float64()], ids=str)
def test_numeric_columns_read_through_numpy_give_arrows_values(t) -> None:
    """The zero-copy numpy view a decoded shard reads numeric columns through (built from the
    data buffer, not ``to_numpy``) gives Arrow's values, sliced arrays and empty ones too."""
    from dynstate.loading.cache import _numpy_view

    big = np.iinfo(t.to_pandas_dtype()).max if pa.types.is_integer(t) else 1.5e38
    values = [0, 1, 7, big, 3, 2, 100]
    array = pa.array(values, t)
    for part in (array, array.slice(2), array.slice(3, 2), array.slice(7)):
        view = _numpy_view(part)
        assert view is not None and view.tolist() == part.to_pylist()
        assert not view.flags.writeable
    assert _numpy_view(pa.array([1, None], t)) is None  # nulls: read through Arrow
