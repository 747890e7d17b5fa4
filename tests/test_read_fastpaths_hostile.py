"""Hostile reads of :class:`~dynstate.VersionedDataset` held against the plain oracle (SPEC
§3.16: every read path returns the rows asked, equal to the version's shards read whole with
pyarrow, then ``take``) — or a typed :class:`~dynstate.DynstateError`, never another row and
never a bare pyarrow or Python error.

The first tests each held a defect, fixed since (each failed on the code before). The last one
is a seeded fuzz over schema changes (null-typed columns made concrete later, list<null>,
struct<null>, time zones, decimals, float16, uint64, maps, fixed-size binary, dictionaries),
rounds of row-group-boundary sizes, empty rounds, compactions and resets, that held up: it
guards those paths."""

from __future__ import annotations

import datetime
import decimal
import os
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynstate import (
    DynstateError,
    InvalidDataError,
    SchemaMismatchError,
    Store,
    VersionedDataset,
    compact,
    fresh,
)
from dynstate import decoded as decoded_module
from dynstate.loading.dataset import encode_index

# -- the oracle ------------------------------------------------------------------------------


def _oracle(url: str, version: int) -> pa.Table:
    """The version's shards read whole with pyarrow (bytes through fsspec), in manifest
    order, shaped like the version's schema (older shards lack later columns: null)."""
    store = Store.open(url)
    snap = store.snapshot(version)
    assert snap.schema is not None
    parts = []
    for shard in snap.shards:
        with fsspec.open(f"{url.rstrip('/')}/{shard.path}", "rb") as f:
            parts.append(pq.read_table(pa.BufferReader(f.read())))
    columns = []
    n = sum(p.num_rows for p in parts)
    for field in snap.schema:
        chunks = []
        for p in parts:
            if field.name in p.column_names:
                c = p.column(field.name)
                chunks += (c if c.type == field.type else c.cast(field.type)).chunks
            else:
                chunks.append(pa.nulls(p.num_rows, field.type))
        columns.append(pa.chunked_array(chunks, field.type))
    table = pa.Table.from_arrays(columns, schema=snap.schema)
    assert table.num_rows == n == snap.num_rows
    return table


def _take(url: str, version: int, rows: list[int]) -> pa.Table:
    return _oracle(url, version).take(pa.array(rows, pa.int64()))


def _typed_or(call: Any) -> Any:
    """The call's result, or None where it raised a DynstateError (a typed refusal is a
    right answer); any other exception propagates and fails the test."""
    try:
        return call()
    except DynstateError:
        return None


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Decoded files of local stores in a folder of this test's own."""
    monkeypatch.delenv("DYNSTATE_DECODED_CACHE", raising=False)
    monkeypatch.setattr(decoded_module.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr(decoded_module, "_default", {})
    (tmp_path / "tmp").mkdir()
    return tmp_path / "tmp" / f"dynstate-decoded-{os.geteuid()}"


# -- defects ---------------------------------------------------------------------------------


def _two_shards(url: str) -> Store:
    store = Store.open(url, create=True)
    store.append(
        pa.table({"id": pa.array(range(300), pa.int64()), "t": [f"a{i}" for i in range(300)]})
    )
    store.append(
        pa.table({"id": pa.array(range(300, 600), pa.int64()), "t": [f"b{i}" for i in range(300)]})
    )
    return store


def test_an_arrow_batch_of_no_columns_has_the_rows_or_is_refused(tmp_path: Path) -> None:
    """``columns=[]`` gives the rows' count: "rows" one empty dict per index, "arrow" a batch
    of that many rows and no columns, and ``row_column`` adds the numbers to both. "arrow"
    ended in a bare IndexError (``to_batches()`` of a table of no columns has no batches)."""
    url = str(tmp_path / "store")
    _two_shards(url)
    asked = [5, 400, 5]
    for row_column in (None, "_dynstate_row"):
        ds = VersionedDataset(url, columns=[], row_column=row_column, cache_dir=str(tmp_path))
        assert ds.read_batch(asked) == [
            ({} if row_column is None else {row_column: r}) for r in asked
        ]
        got = _typed_or(lambda ds=ds: ds.read_batch(asked, "arrow"))
        if got is not None:
            assert got.num_rows == len(asked)
            if row_column is not None:
                assert got.column(row_column).to_pylist() == asked


def test_duplicate_or_misgiven_column_names_are_refused(tmp_path: Path) -> None:
    """``columns=["t", "id", "t"]`` was accepted: "rows" and "columns" kept one "t", and every
    "arrow" batch raised a bare ``ArrowInvalid`` (two fields of one name). A name given as a
    string was read as its letters. Both are refused when the dataset is made; a projection
    in another order reads as the oracle's."""
    url = str(tmp_path / "store")
    store = _two_shards(url)
    with pytest.raises(InvalidDataError, match=r"columns names \['t'\] more than once"):
        VersionedDataset(url, columns=["t", "id", "t"], cache_dir=str(tmp_path))
    with pytest.raises(InvalidDataError, match="list of column names"):
        VersionedDataset(url, columns="id", cache_dir=str(tmp_path))
    cols = ["t", "id"]
    ds = VersionedDataset(url, columns=cols, cache_dir=str(tmp_path))
    for asked in ([7, 3], [7, 450, 3]):
        want = _take(url, store.head, asked).select(cols)
        assert ds.read_batch(asked) == want.to_pylist()
        got = ds.read_batch(asked, "arrow")
        assert got.schema.names == cols
        assert [c.to_pylist() for c in got.columns] == [c.to_pylist() for c in want.columns]


def test_arrow_batch_over_versions_whose_column_types_differ(tmp_path: Path) -> None:
    """A column added (int64), a reset to before it, the column added again as a string:
    a batch of sampler indices over both versions reads in "rows" and "columns" (each row its
    own version's value); no Arrow schema holds both, and "arrow" raised a bare
    ``ArrowTypeError: Unable to merge``: now a typed SchemaMismatchError that says what to
    do."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    first = store.append(pa.table({"id": [0, 1]}))
    with_int = store.append(pa.table({"id": [2], "c": [7]}), allow_new_columns=True)
    store.reset(first)
    with_str = store.append(pa.table({"id": [3], "c": ["seven"]}), allow_new_columns=True)
    ds = VersionedDataset(url, cache_dir=str(tmp_path))
    idx = [encode_index(with_int, 2), encode_index(with_str, 2)]
    want = [
        _take(url, with_int, [2]).to_pylist()[0],
        _take(url, with_str, [2]).to_pylist()[0],
    ]
    assert ds.read_batch(idx) == want
    with pytest.raises(SchemaMismatchError, match=r"(?s)cannot be one Arrow schema.*own"):
        ds.read_batch(idx, "arrow")


def test_a_bool_is_not_read_as_row_one(tmp_path: Path) -> None:
    """docs/api.md: "a boolean mask is refused (InvalidDataError), never ... read as rows 0
    and 1". A plain ``True`` (or a torch bool scalar) read row 1, ``False`` row 0, and a
    list holding a bool beside ints read it as row 1 (numpy makes ``[True, 2]`` ints), while
    ``np.True_`` and ``(True,)`` were refused. All are refused."""
    import torch

    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append(pa.table({"id": list(range(10))}))
    ds = VersionedDataset(url, cache_dir=str(tmp_path))
    with pytest.raises(InvalidDataError):
        ds[np.True_]  # refused, as documented
    with pytest.raises(InvalidDataError):
        ds.read_batch((True,))
    for index in (True, False, torch.tensor(True)):
        with pytest.raises(InvalidDataError):
            ds[index]
    for indices in ([True, 2], [np.True_, 4], [torch.tensor(True), 5]):
        with pytest.raises(InvalidDataError):
            ds.read_batch(indices)


def _hidden_children(n: int) -> pa.Table:
    """A struct column whose null rows hold child values (as any StructArray built with a
    mask does), and a list column whose null rows span values: Parquet keeps neither, so a
    decode has null children there and no values under the null lists; and a padding column
    (a round of 6,000 rows is over 256 KiB: its decoded file is written at the commit)."""
    ids = np.arange(n)
    mask = pa.array(ids % 3 == 1)
    s = pa.StructArray.from_arrays([pa.array(ids, pa.int64())], names=["a"], mask=mask)
    offsets = pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32))
    lst = pa.ListArray.from_arrays(offsets, pa.array(np.arange(2 * n), pa.int64()), mask=mask)
    pad = pa.array([f"row {i} " + "x" * 40 for i in ids.tolist()])
    return pa.table({"id": pa.array(ids, pa.int64()), "s": s, "l": lst, "pad": pad})


def _hidden(batch: pa.RecordBatch | pa.Table) -> tuple[list[Any], list[Any]]:
    s = batch.column("s")
    lst = batch.column("l")
    if isinstance(s, pa.ChunkedArray):
        s, lst = s.combine_chunks(), lst.combine_chunks()
    # What a consumer of the Arrow batch reads: the struct's child as stored, and the sum of
    # the list's values buffer over the rows (``.values`` ignores the list's nulls).
    return s.field(0).to_pylist(), lst.values.to_pylist()


def test_a_kept_table_holds_the_decode_under_null_structs(tmp_path: Path, folder: Path) -> None:
    """The writer keeps its round's tables "as a decode of the file gives it"
    (``dynstate/fresh.py``), and the next read takes them instead of decoding; but a struct
    column's null rows keep the writer's child values (the file has nulls there). ``take``
    keeps a struct's children as they are, so an "arrow" batch differs from the oracle's
    decode: ``batch["s"].field("a")`` had 1 and 4 where the file has null (and a sum over it
    another total). A table with a null struct is no longer kept. (The list's values under
    its null rows, which the file lacks too, are dropped by ``take``: that part agreed.)"""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append(_hidden_children(30))
    asked = [0, 1, 2, 4]
    want = _take(url, store.head, asked)
    ds = VersionedDataset(url, cache_dir=str(tmp_path / "cache"))
    got = ds.read_batch(asked, "arrow")
    assert got.to_pylist() == want.to_pylist()  # the rows agree ...
    assert _hidden(got) == _hidden(want)  # ... the Arrow data does not


def test_a_decoded_file_written_at_commit_holds_the_decode_under_null_structs(
    tmp_path: Path, folder: Path
) -> None:
    """The same kept table is written, at the commit to a local store, as the decoded file
    every other process maps (``keep_decoded``, for rounds of 256 KiB and more): another
    process's "arrow" batch gets the writer's hidden child values, not the file's. (Here the
    other process is this one with its kept tables dropped: it maps the file.)"""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append(_hidden_children(6000))
    # not kept, so no decoded file is written from the writer's table at the commit
    assert not folder.is_dir() or not any(f.suffix == ".arrow" for f in folder.iterdir())
    fresh.FRESH.clear()
    time.sleep(0.1)  # past the clock tick within which a changed shard is decoded, not named
    asked = [0, 1, 2, 4, 5999]
    want = _take(url, store.head, asked)
    ds = VersionedDataset(url, cache_dir=str(tmp_path / "cache"))
    got = ds.read_batch(asked, "arrow")
    assert got.to_pylist() == want.to_pylist()
    assert _hidden(got) == _hidden(want)


# -- guards: a seeded fuzz over schema changes, against the oracle ---------------------------

KINDS = ["str", "null", "listnull", "structnull", "ts_tz", "dec", "bin", "lstr", "dict",
         "nested", "f16", "u64", "map", "fsb", "dur"]  # fmt: skip


def _column(kind: str, ids: list[int], concrete: bool) -> pa.Array:
    n = len(ids)
    if kind == "int":
        return pa.array(ids, pa.int64())
    if kind == "str":
        return pa.array([None if i % 7 == 0 else f"s{i}" for i in ids])
    if kind == "null":  # null-typed in the first rounds, strings later
        return pa.array([f"n{i}" for i in ids]) if concrete else pa.nulls(n)
    if kind == "listnull":
        return pa.array([[i, i + 1] for i in ids]) if concrete else pa.array([[] for _ in ids])
    if kind == "structnull":
        return pa.array([{"a": i, "b": f"b{i}" if concrete else None} for i in ids])
    if kind == "ts_tz":
        base = datetime.datetime(2020, 1, 1)
        return pa.array(
            [base + datetime.timedelta(seconds=i) for i in ids], pa.timestamp("us", tz="Asia/Tokyo")
        )
    if kind == "dec":
        return pa.array([decimal.Decimal(i) / 100 for i in ids], pa.decimal128(12, 2))
    if kind == "bin":
        return pa.array([bytes([i % 256]) * (i % 5) for i in ids], pa.binary())
    if kind == "lstr":
        return pa.array([f"L{i}" for i in ids], pa.large_string())
    if kind == "dict":
        return pa.array([("x", "y", "z")[i % 3] for i in ids], pa.string()).dictionary_encode()
    if kind == "nested":
        return pa.array([[{"k": i, "v": [str(i)] * (i % 3)}] * (i % 2) for i in ids])
    if kind == "f16":
        return pa.array(np.array(ids, dtype=np.float16), pa.float16())
    if kind == "u64":
        return pa.array([2**63 + i for i in ids], pa.uint64())
    if kind == "map":
        return pa.array([[("k", i)] for i in ids], pa.map_(pa.string(), pa.int64()))
    if kind == "fsb":
        return pa.array([i.to_bytes(4, "little") for i in ids], pa.binary(4))
    if kind == "dur":
        return pa.array(ids, pa.duration("ms"))
    raise AssertionError(kind)


def _same(a: Any, b: Any) -> bool:
    return repr(a) == repr(b)  # NaN-free data; repr tells -0.0, types and order apart


def _fuzz_store(url: str, rng: random.Random) -> list[int]:
    store = Store.open(url, create=True)
    kinds = ["int", *rng.sample(KINDS, rng.randint(2, 4))]
    late = rng.choice([k for k in KINDS if k not in kinds])
    start, versions = 0, []
    for r in range(rng.randint(3, 5)):
        n = rng.choice([0, 1, 127, 128, 129, 255, 256, 257, 600])
        ids = list(range(start, start + n))
        data = {k: _column(k, ids, r >= 2) for k in kinds}
        if r >= 2:
            data["late"] = _column(late, ids, True)
        table = pa.table(data)
        if rng.random() < 0.3:
            table = table.select(list(reversed(table.column_names)))
        versions.append(
            store.append(table, allow_new_columns=True, shard_bytes=rng.choice([None, 3000]))
        )
        start += n
        op = rng.random()
        if op < 0.2:
            versions.append(compact(store, target_bytes=rng.choice([5000, 50000])))
        elif op < 0.3 and len(versions) > 1:
            target = rng.choice(versions[:-1])
            versions.append(store.reset(target))
            start = store.snapshot(target).num_rows
    return versions


@pytest.mark.parametrize("backend", ["local", "memory"])
@pytest.mark.parametrize("seed", range(10))
def test_seeded_schema_changes_read_as_the_oracle(
    tmp_path: Path, folder: Path, backend: str, seed: int
) -> None:
    rng = random.Random(seed * 7919 + (backend == "memory"))
    url = str(tmp_path / "store") if backend == "local" else f"memory://hostile/{uuid.uuid4().hex}"
    versions = _fuzz_store(url, rng)
    shared = VersionedDataset(url, cache_dir=tempfile.mkdtemp(dir=tmp_path), cache_bytes=200_000)
    for version in versions:
        table = _oracle(url, version)
        if table.num_rows == 0:
            continue
        for ds in (
            VersionedDataset(url, version, cache_dir=tempfile.mkdtemp(dir=tmp_path)),
            shared,
        ):
            ds.pin(version)
            for _ in range(2):
                idx = [rng.randrange(table.num_rows) for _ in range(rng.randint(1, 25))]
                want = table.take(pa.array(idx, pa.int64())).to_pylist()
                assert _same(ds.read_batch(idx), want)
                columns = ds.read_batch(idx, "columns")
                assert _same(columns, {n: [r[n] for r in want] for n in table.schema.names})
                got = ds.read_batch(idx, "arrow")
                assert _same(got.to_pylist(), want)
                assert got.schema.names == table.schema.names
                assert _same([ds[i] for i in idx[:4]], want[:4])
