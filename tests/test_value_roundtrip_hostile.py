"""The values of rows across rounds, against two oracles: the version's Parquet shards read
whole with plain ``pyarrow.parquet.read_table`` (conformed to the version's schema), and the
rows as they were given (converted here, plainly). Every read path is held to them:
``Snapshot.to_arrow`` / ``read_shard``, ``VersionedDataset`` items and ``__getitems__`` in
each ``batch_format`` (unsorted, repeated indices), a ``StatefulDataLoader`` with 0 and 2
workers, ``dynstate head --jsonl``; after ``compact`` and ``collect_garbage`` too.

Tests whose docstring starts with DEFECT failed on the code as audited (each says what was
wrong and what the docs lead a user to expect; all fixed since); those starting with Guard
held up. The refusals the fixes rely on are guarded at the end of the file.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import os
import re
import subprocess
import sys
import uuid
import zoneinfo
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from dynstate import (
    InvalidDataError,
    SchemaMismatchError,
    Store,
    VersionedDataset,
    VersionedSampler,
    collect_garbage,
    compact,
)
from dynstate.records.rounds import conform

D = decimal.Decimal
PARIS = zoneinfo.ZoneInfo("Europe/Paris")


def _store(tmp_path) -> tuple[Store, str]:
    root = str(tmp_path / "store")
    return Store.open(root, create=True), root


def _oracle(store: Store, root: str, version: int | None = None) -> pa.Table:
    """The version's rows as its Parquet shards hold them, read whole with pyarrow (no
    dynstate read path), each conformed to the version's schema, concatenated in order."""
    snap = store.snapshot(version)
    assert snap.schema is not None
    tables = [conform(pq.read_table(os.path.join(root, s.path)), snap.schema) for s in snap.shards]
    return pa.concat_tables(tables) if tables else snap.schema.empty_table()


def _stored(store: Store, root: str, version: int | None = None) -> list[dict[str, Any]]:
    return _oracle(store, root, version).to_pylist()


def _diff(a: Any, b: Any, at: str = "$") -> str | None:
    """Where ``a`` and ``b`` differ (None: nowhere): floats by bits that matter (NaN equals
    NaN, -0.0 is not 0.0), scalars also by type (1 is not 1.0 nor True)."""
    if isinstance(a, float) or isinstance(b, float):
        if type(a) is not type(b):
            return f"{at}: {a!r} vs {b!r}"
        if math.isnan(a) and math.isnan(b):
            return None
        if a == b and math.copysign(1.0, a) == math.copysign(1.0, b):
            return None
        return f"{at}: {a!r} vs {b!r}"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{at}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            found = _diff(a[key], b[key], f"{at}.{key}")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{at}: {len(a)} items vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _diff(x, y, f"{at}[{i}]")
            if found:
                return found
        return None
    if type(a) is not type(b) or a != b:
        return f"{at}: {a!r} ({type(a).__name__}) vs {b!r} ({type(b).__name__})"
    return None


def _assert_same(got: Any, want: Any, what: str) -> None:
    found = _diff(got, want)
    assert found is None, f"{what}: {found}"


def _rich(n: int, off: int) -> pa.Table:
    """A round of every kind of column format.md says a round may hold, with the values at
    the edges (int64/uint64 limits, NaN, -0.0, infinities, nulls at every depth)."""
    ns = pa.array([1_600_000_000_123_456_789 + (i + off) * 1_000_000_007 for i in range(n)])
    return pa.table(
        {
            "i": pa.array(range(off, off + n), pa.int64()),
            "big": pa.array([2**63 - 1 - i if i % 2 else -(2**63) + i for i in range(n)]),
            "u64": pa.array([2**64 - 1 - i for i in range(n)], pa.uint64()),
            "f": pa.array(
                [[math.nan, -0.0, math.inf, -math.inf, 1.5, None][i % 6] for i in range(n)]
            ),
            "fnn": pa.array([[math.nan, -0.0, math.inf, 5e-324][i % 4] for i in range(n)]),
            "f32": pa.array([[-0.0, 0.5, math.nan, None][i % 4] for i in range(n)], pa.float32()),
            "b": pa.array([[True, False, None][i % 3] for i in range(n)]),
            "bin": pa.array([[b"\x00\xff", b"", None][i % 3] for i in range(n)]),
            "lbin": pa.array([[b"\x01", None][i % 2] for i in range(n)], pa.large_binary()),
            "fsb": pa.array([bytes([i % 256] * 4) for i in range(n)], pa.binary(4)),
            "s": pa.array(
                [["日本", "", None, "a\x00b"][i % 4] for i in range(n)], pa.large_string()
            ),
            "ts_s": pc.divide(ns, 10**9).cast(pa.int64()).cast(pa.timestamp("s")),
            "ts_ms": pc.divide(ns, 10**6).cast(pa.int64()).cast(pa.timestamp("ms", "Europe/Paris")),
            "ts_us": pc.divide(ns, 10**3).cast(pa.int64()).cast(pa.timestamp("us", "UTC")),
            "ts_ns": ns.cast(pa.timestamp("ns")),
            "d32": pa.array([dt.date(2020, 1, 1) + dt.timedelta(days=i + off) for i in range(n)]),
            "d64": pa.array([86_400_000 * (i + off) for i in range(n)], pa.date64()),
            "t64": pa.array([i * 1000 for i in range(n)], pa.time64("ns")),
            "dur": pa.array([i * 1001 - 5 for i in range(n)], pa.duration("ns")),
            "dec": pa.array([D(f"{i}.{i % 100:02d}") for i in range(n)], pa.decimal128(20, 2)),
            "dec256": pa.array([D("1e40") + i for i in range(n)], pa.decimal256(50, 0)),
            "lst": pa.array([[[1, 2], [], None, [None]][i % 4] for i in range(n)]),
            "llst": pa.array(
                [[["x"], [], None][i % 3] for i in range(n)], pa.large_list(pa.string())
            ),
            "fsl": pa.array([[i, -0.0] for i in range(n)], pa.list_(pa.float32(), 2)),
            "st": pa.array(
                [[{"a": 1, "b": "x"}, None, {"a": None, "b": None}][i % 3] for i in range(n)],
                pa.struct([("a", pa.int64()), ("b", pa.string())]),
            ),
            "msgs": pa.array(
                [[[{"role": "user", "content": str(i)}], []][i % 2] for i in range(n)]
            ),
            "mp": pa.array(
                [[[("k", 1)], [], None][i % 3] for i in range(n)], pa.map_(pa.string(), pa.int64())
            ),
            "cat": pa.array(
                [["x", "y", None, f"v{off}"][i % 4] for i in range(n)]
            ).dictionary_encode(),
            "uuid": pa.ExtensionArray.from_storage(
                pa.uuid(), pa.array([uuid.UUID(int=i + off).bytes for i in range(n)], pa.binary(16))
            ),
            "json": pa.array([['{"a": 1}', None, "[]"][i % 3] for i in range(n)], pa.json_()),
            "b8": pa.ExtensionArray.from_storage(
                pa.bool8(), pa.array([[1, 0, None][i % 3] for i in range(n)], pa.int8())
            ),
            "ten": pa.ExtensionArray.from_storage(
                pa.fixed_shape_tensor(pa.int32(), [2, 2]),
                pa.array([[i, -i, 0, 1] for i in range(n)], pa.list_(pa.int32(), 4)),
            ),
        }
    )


def _check_every_read(store: Store, root: str, want: list[dict[str, Any]], idx: list[int]) -> None:
    """Every in-process read path of the head against ``want`` (the oracle's rows)."""
    snap = store.snapshot()
    _assert_same(snap.to_arrow().to_pylist(), want, "Snapshot.to_arrow")
    by_shard = [row for i in range(len(snap.shards)) for row in snap.read_shard(i).to_pylist()]
    _assert_same(by_shard, want, "Snapshot.read_shard")
    taken = [want[i] for i in idx]
    ds = VersionedDataset(root)
    _assert_same(ds.__getitems__(idx), taken, "__getitems__")
    _assert_same([ds[i] for i in idx], taken, "ds[i]")
    columns = ds.read_batch(idx, "columns")
    _assert_same([{k: columns[k][p] for k in columns} for p in range(len(idx))], taken, "columns")
    _assert_same(ds.read_batch(idx, "arrow").to_pylist(), taken, "arrow")
    assert ds.read_batch(idx, "arrow").schema.equals(snap.schema)


# -- DEFECTS -------------------------------------------------------------------------------


def _float32(values: list[float]) -> pa.Table:
    return pa.table({"x": pa.array(values, pa.float32())})


def _float16(values: list[float]) -> pa.Table:
    return pa.table({"x": pa.array(np.array(values, dtype=np.float16), pa.float16())})


def _datasets_float32() -> Any:
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"x": datasets.Value("float32")})
    return datasets.Dataset.from_dict({"x": [0.5]}, features=features)


def _datasets_sequence_float32() -> Any:
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"x": datasets.Sequence(datasets.Value("float32"))})
    return datasets.Dataset.from_dict({"x": [[0.5], []]}, features=features)


@pytest.mark.parametrize(
    ("first", "later"),
    [
        (lambda: _float32([0.5]), [{"x": 0.1}]),
        (lambda: _float32([0.5]), [{"x": 1e300}]),
        (_datasets_float32, [{"x": 0.1}]),
        (_datasets_sequence_float32, [{"x": [0.1, 2.0]}]),
        (lambda: _float16([0.5]), [{"x": 0.1}]),
        (lambda: _float16([0.5]), [{"x": 2049}]),
    ],
    ids=[
        "float64-into-float32",
        "float64-overflows-float32",
        "datasets-float32-then-python-floats",
        "datasets-sequence-float32-then-python-floats",
        "float64-into-float16",
        "int-into-float16",
    ],
)
def test_a_round_into_a_narrower_float_column_keeps_its_values_or_is_refused(
    tmp_path, first, later
) -> None:
    """DEFECT. docs/format.md ("A later round's column fits ..."): "an int into a wider int
    or a float, a float into a wider float ... The round is then cast to the stored type with
    a safe cast, which refuses a value it would change". A store whose column is float32 (a
    ``datasets`` ``Value("float32")`` or ``Sequence(float32)`` first round, a numpy float32
    frame) or float16 takes a later round of Python floats and changes them in silence:
    0.1 is stored as 0.10000000149011612 (float16: 0.0999755859375), 1e300 as ``inf``, and
    the int 2049 into float16 as 2048.0. Cause: records/rounds.py ``same_type`` (line 207)
    accepts any float into any float, and any int into any float (line 206); Arrow's safe
    cast checks neither float64 -> float32/float16 nor int -> float16. Expected: the round
    refused (SchemaMismatchError), or stored with exactly the values given."""
    store, root = _store(tmp_path)
    store.append(first())
    try:
        version = store.append(later)
    except SchemaMismatchError:
        return
    got = [row["x"] for row in _stored(store, root, version)[-len(later) :]]
    assert got == [row["x"] for row in later]


@pytest.mark.parametrize(
    "rounds",
    [
        [[D("123.45")], [D("1.50"), D("-7.25")]],
        [[D("123.45")], [D("7.5"), D("0")]],
        [[None], [D("1.5")], [D("-2.5"), None]],
    ],
    ids=["narrower-precision", "smaller-scale", "after-a-null-first-round"],
)
def test_a_decimal_round_the_stored_decimal_holds_exactly_appends(tmp_path, rounds) -> None:
    """DEFECT. docs/format.md: "A later round's column fits the stored column when every
    value it can hold becomes the same value of the stored type", and decimals are a stored
    type. Python ``Decimal`` values get their precision and scale from the values of the
    round (``Decimal("123.45")``: decimal128(5, 2); ``Decimal("1.50")``: (3, 2);
    ``Decimal("7.5")``: (2, 1)), so a later round whose every value fits the stored decimal
    exactly is refused: ``SchemaMismatchError ... changed types: x (decimal128(5, 2) ->
    decimal128(3, 2))``. Every round of prices or scores kept as Decimal is an artifact of its
    first round's values. Cause: records/rounds.py ``same_type`` (lines 184-207) has no rule
    for decimals (only equal types). Expected: a decimal whose integer digits and scale fit
    the stored one's appends (the safe cast refuses one that would lose digits)."""
    store, root = _store(tmp_path)
    for values in rounds:
        version = store.append([{"x": v} for v in values])
    got = [row["x"] for row in _stored(store, root, version)]
    assert got == [v for values in rounds for v in values]


@pytest.mark.parametrize(
    "rounds",
    [
        [[{"s": {"a": 1, "b": None}}], [{"s": {"b": "x", "a": 2}}]],
        [[{"s": {"a": 1, "b": None}}], [{"s": {"b": "x"}}]],
        [
            [{"m": [{"role": "user", "content": "2+2", "name": None}]}],
            [{"m": [{"content": "4", "role": "assistant", "name": "bot"}]}],
        ],
        [[{"m": []}], [{"m": [{"a": 1, "b": None}]}], [{"m": [{"b": "z"}]}]],
    ],
    ids=["keys-reordered", "a-subset", "chat-name-in-another-order", "list-of-structs-subset"],
)
def test_a_struct_field_null_so_far_takes_its_type_from_keys_in_any_order(tmp_path, rounds) -> None:
    """DEFECT. docs/format.md: a column every row so far left empty "has a type with null in
    it: ... ``struct<a: null>``. Such a type is not fixed: the first later round that brings
    values there gives the column their type", and "struct fields [fit] by name in any order
    and any subset". Together they fail: a struct stored as ``struct<a: int64, b: null>``
    refuses a later round ``{"b": "x", "a": 2}`` or ``{"b": "x"}`` (``changed types: s
    (struct<a: int64, b: null> -> struct<b: string, a: int64>)``), and chat messages whose
    ``name`` was None so far refuse messages built with their keys in another order. Cause:
    records/columns.py ``promote`` (line 309) makes a struct's null field concrete only when
    the round's fields are the stored ones in the same order; ``same_type`` (records/rounds.py)
    then compares ``string`` with ``null`` and refuses. Expected: the null fields take the
    round's types, fields matched by name, and the rows read back as given."""
    store, root = _store(tmp_path)
    for rows in rounds:
        version = store.append(rows)
    schema = store.snapshot(version).schema
    want = [row for rows in rounds for row in pa.Table.from_pylist(rows, schema=schema).to_pylist()]
    assert _stored(store, root, version) == want


def _categorical(values: list[Any]) -> Any:
    pd = pytest.importorskip("pandas")
    return pd.DataFrame({"x": pd.Categorical(values)})


@pytest.mark.parametrize(
    ("first", "values"),
    [
        (lambda: _categorical([3, 1, 3]), [3, 1, 3]),
        (lambda: _categorical([0.5, 1.5, 0.5]), [0.5, 1.5, 0.5]),
        (lambda: pa.table({"x": pa.array([True, False, True]).dictionary_encode()}), None),
    ],
    ids=["pandas-categorical-of-ints", "pandas-categorical-of-floats", "arrow-dictionary-of-bools"],
)
def test_a_dictionary_column_of_numbers_is_readable_or_refused(tmp_path, first, values) -> None:
    """DEFECT. docs/format.md: a top-level dictionary column ("a pandas ``Categorical``,
    Arrow's ``dictionary_encode``") is stored, and "What a round may hold is checked before
    any shard is written, so that no commit can make later reads fail". A categorical of
    difficulty levels ``pd.Categorical([3, 1, 3])`` (ints, floats, bools) is committed, and
    then every read of that version and of every later one fails with a bare
    ``pyarrow.ArrowNotImplementedError: Unsupported cast from int64 to dictionary``:
    ``Snapshot.to_arrow``, ``VersionedDataset`` items and batches, compaction. The shard holds
    the right values (Parquet gives a dictionary of numbers back as plain int64), but the
    reader conforms it to the schema's ``dictionary<int64>``, a cast Arrow lacks; a later
    round of plain ints is refused with the same message. Cause: records/columns.py
    ``_parquet_roundtrip`` (line 248) checks that Parquet reads the schema back, not that it
    reads back the same type; records/rounds.py ``_column`` (line 224) then casts. Expected:
    the round refused up front (InvalidDataError naming the column), or stored so that it
    reads back (e.g. its values' type), every read path giving the values given."""
    store, root = _store(tmp_path)
    data = first()
    want = values if values is not None else data.column("x").to_pylist()
    try:
        store.append(data)
    except InvalidDataError:
        return
    assert [row["x"] for row in _stored(store, root)] == want
    assert store.snapshot().to_arrow().column("x").to_pylist() == want
    assert [row["x"] for row in VersionedDataset(root).__getitems__([2, 0, 1])] == [
        want[2],
        want[0],
        want[1],
    ]


@pytest.mark.parametrize(
    "column",
    [
        pa.array([f"task {i}" for i in range(10)], pa.string_view()),
        pa.array([bytes([i]) for i in range(10)], pa.binary_view()),
    ],
    ids=["string_view", "binary_view"],
)
def test_a_view_typed_round_reads_back_in_batches(tmp_path, column) -> None:
    """DEFECT. docs/format.md: "32- vs 64-bit offset variants of the same type (``string`` /
    ``large_string``, ``list`` / ``large_list``, views) count as the same type", and "no
    commit can make later reads fail". A first round whose text column is Arrow's
    ``string_view`` (or ``binary_view``) is committed with that type; ``ds[i]``,
    ``Snapshot.to_arrow`` and batches of up to 6 rows read it, but a batch of 7 rows or more
    (any DataLoader batch) and every ``batch_format="arrow"`` batch fail with a bare
    ``ArrowNotImplementedError: Function 'array_take' has no kernel matching input types
    (string_view, int64)``. Cause: loading/batch.py ``_take`` (line 67) and ``arrow_batch``
    (line 256) call Arrow's take, which this pyarrow lacks for view types, and the write
    side stores the view type as given (records/rounds.py ``to_table``). Expected: the view
    column stored as its plain type (``string``/``binary``: the same values), or refused up
    front; every read path giving the values given."""
    store, root = _store(tmp_path)
    store.append(pa.table({"x": column}))
    want = column.to_pylist()
    idx = [9, 0, 3, 3, 8, 1, 9, 2]
    ds = VersionedDataset(root)
    assert [row["x"] for row in ds.__getitems__(idx)] == [want[i] for i in idx]
    assert ds.read_batch(idx, "arrow").column("x").to_pylist() == [want[i] for i in idx]


def _pandas_ns() -> Any:
    pd = pytest.importorskip("pandas")
    # epoch nanoseconds, as time.time_ns() gives them: pandas keeps them datetime64[ns]
    return pd.DataFrame({"t": pd.to_datetime([1_577_836_800_000_000_000])})


@pytest.mark.parametrize(
    ("first", "later"),
    [
        (_pandas_ns, [{"t": dt.datetime(2021, 1, 1, 12, 30, 0, 250000)}]),
        (
            lambda: pa.table({"t": pa.array([0], pa.timestamp("ms"))}),
            [{"t": dt.datetime(2021, 1, 1, 12, 30, 0, 250000)}],
        ),
        (
            lambda: pa.table({"t": pa.array([1_000], pa.duration("ns"))}),
            [{"t": dt.timedelta(seconds=90)}],
        ),
    ],
    ids=[
        "pandas-ns-then-python-datetimes",
        "ms-then-python-datetimes",
        "duration-ns-then-timedelta",
    ],
)
def test_a_timestamp_round_of_another_unit_appends(tmp_path, first, later) -> None:
    """DEFECT. docs/format.md: rounds from "pandas, datasets and plain Python ... mix", a type
    is "no artifact of how the first round was built" (``same_type``'s docstring), and a later
    round fits "when every value it can hold becomes the same value of the stored type" under
    a safe cast "which refuses a value it would change". A store whose first round had
    ``datetime64[ns]`` timestamps (pandas from epoch nanoseconds), or Arrow ``timestamp[ms]``,
    refuses every later round of Python ``datetime`` values (``timestamp[us]``):
    ``changed types: t (timestamp[ns] -> timestamp[us])``, although each value is exactly a
    value of the stored unit (Arrow's safe cast refuses one that is not: sub-unit digits, or
    out of the range); durations likewise. Cause: records/rounds.py ``same_type`` (lines
    184-207) has no rule for timestamps or durations of another unit (same tz). Expected: the
    round cast to the stored unit with the safe cast, the values read back equal."""
    store, root = _store(tmp_path)
    store.append(first())
    version = store.append(later)
    got = [row["t"] for row in _stored(store, root, version)[-len(later) :]]
    assert got == [row["t"] for row in later]


def test_a_uint64_column_takes_python_ints_past_int64(tmp_path) -> None:
    """DEFECT. A store whose hash column ``h`` is uint64 (a first round from numpy/pandas
    hashes) refuses a later list-of-dicts round whose hash is 2**63 or more with
    ``InvalidDataError: column 'h' holds an int Arrow cannot hold ...; ints run from -2**63 to
    2**64 - 1`` — the message says the value is in range, and the store's column holds it.
    Cause: records/inputs.py ``_column`` (line 203) converts each column with a bare
    ``pa.array(values)``, which infers int64 and overflows, before the stored type is
    consulted. (A fresh store refusing 2**64 - 1 from a list of dicts is pinned by
    tests/test_write_inputs_hostile.py; here the column is already uint64.) Expected: Python
    ints up to 2**64 - 1 append into a uint64 column (the column converted against the stored
    column's type), read back exactly."""
    pd = pytest.importorskip("pandas")
    store, root = _store(tmp_path)
    store.append(pd.DataFrame({"h": np.array([2**64 - 1], dtype=np.uint64)}))
    version = store.append([{"h": 2**63}, {"h": 7}])
    assert [row["h"] for row in _stored(store, root, version)] == [2**64 - 1, 2**63, 7]


# -- what held up ------------------------------------------------------------------------------


def test_rich_rounds_read_back_alike_on_every_path_through_compaction_and_gc(tmp_path) -> None:
    """Guard. Four rounds of every column kind (extension types, dictionaries whose values
    differ per round, timestamps of each unit and tz, decimals, maps, nulls at each depth,
    int64/uint64 limits, NaN, -0.0, infinities), written in many small shards: the shards
    read whole with pyarrow are the rows given, and every read path gives them, with
    unsorted and repeated indices; a compaction keeps them, and so does gc of the old
    version's files."""
    store, root = _store(tmp_path)
    rounds = [_rich(9, 100 * k) for k in range(4)]
    for k, table in enumerate(rounds):
        store.append(table, shard_bytes=1 if k % 2 else 2**20)
    schema = store.snapshot().schema
    given = pa.concat_tables([t.cast(schema) for t in rounds]).to_pylist()
    want = _stored(store, root)
    _assert_same(want, given, "shards vs rows given")
    assert len(store.snapshot().shards) > 10
    idx = [35, 0, 3, 3, 17, 1, 35, 20, 9, 9, 18, 27]
    _check_every_read(store, root, want, idx)
    compact(store, target_bytes=10**8)
    assert len(store.snapshot().shards) == 1
    _assert_same(_stored(store, root), given, "compacted shards")
    _check_every_read(store, root, want, idx)
    collect_garbage(store, keep=1, grace_s=0, dry_run=False)
    _check_every_read(store, root, want, idx)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_loader_gives_the_stored_rows(tmp_path, workers) -> None:
    """Guard. A torchdata ``StatefulDataLoader`` over a ``VersionedDataset`` (rows tagged with
    ``row_column``) with a ``VersionedSampler``, 0 or 2 workers (which map decoded files the
    commit wrote): every item is the oracle's row of that number, each row drawn once."""
    loader_mod = pytest.importorskip("torchdata.stateful_dataloader")
    store, root = _store(tmp_path)
    store.append(_rich(300, 0))
    store.append(_rich(40, 1000), shard_bytes=1)
    want = _stored(store, root)
    dataset = VersionedDataset(root, row_column="_dynstate_row")
    sampler = VersionedSampler(dataset, seed=0, batch_size=16)
    loader = loader_mod.StatefulDataLoader(
        dataset, batch_size=16, sampler=sampler, num_workers=workers, collate_fn=list
    )
    seen = []
    for batch in loader:
        for item in batch:
            row = item.pop("_dynstate_row")
            seen.append(row)
            _assert_same(item, want[row], f"row {row}")
    assert sorted(seen) == list(range(len(want)))


def test_rounds_of_every_input_kind_mix_and_keep_their_values(tmp_path) -> None:
    """Guard. Rounds given as a list of dicts, a pandas frame (nullable Int64, boolean,
    string[pyarrow], ordered and unordered categoricals, tz-aware timestamps with NaT,
    columns in another order), a ``datasets.Dataset`` (ClassLabel, Sequence) and a pyarrow
    table, with a column all None in round 1 typed later and nullable columns added later:
    the shards hold the values as given (converted plainly here), every read path agrees."""
    pd = pytest.importorskip("pandas")
    datasets = pytest.importorskip("datasets")
    store, root = _store(tmp_path)
    r1 = [
        {"id": 0, "n": 5, "ok": True, "txt": "a", "lvl": "easy", "when": None, "late": None},
        {"id": 1, "n": None, "ok": None, "txt": None, "lvl": "hard", "when": None, "late": None},
    ]
    store.append(r1)
    r2 = pd.DataFrame(
        {
            "late": pd.array([3, None], dtype="Int64"),
            "id": [2, 3],
            "n": pd.array([2**62, None], dtype="Int64"),
            "ok": pd.array([False, None], dtype="boolean"),
            "txt": pd.array(["日本", None], dtype="string[pyarrow]"),
            "lvl": pd.Categorical(["mid", "hard"], categories=["mid", "hard"], ordered=True),
            "when": pd.Series(["2020-01-01 10:00", None], dtype="datetime64[us]").dt.tz_localize(
                "Europe/Paris"
            ),
        }
    )
    store.append(r2)
    features = datasets.Features(
        {
            "id": datasets.Value("int64"),
            "n": datasets.ClassLabel(names=["neg", "pos"]),
            "ok": datasets.Value("bool"),
            "txt": datasets.Value("string"),
            "lvl": datasets.Value("string"),
            "late": datasets.Value("int64"),
            "seq": datasets.Sequence(datasets.Value("int64")),
        }
    )
    r3 = datasets.Dataset.from_dict(
        {
            "id": [4, 5],
            "n": [1, 0],
            "ok": [True, False],
            "txt": ["", "x"],
            "lvl": ["easy", None],
            "late": [None, -1],
            "seq": [[1, 2], []],
        },
        features=features,
    ).select([1, 0])
    r3 = r3.add_column("when", [None, None])
    store.append(r3, allow_new_columns=True)
    r4 = pa.table({"id": [6], "seq": [[9]], "extra": [{"k": -0.0}]})
    with pytest.raises(SchemaMismatchError):
        store.append(r4, allow_new_columns=True)  # missing columns are refused
    version = store.append(
        [{"id": 6, "seq": [9], "extra": {"k": -0.0}, "n": 1, "ok": True, "txt": "t",
          "lvl": "mid", "late": 1, "when": dt.datetime(2021, 6, 1, tzinfo=PARIS)}],
        allow_new_columns=True,
    )  # fmt: skip
    when = dt.datetime(2020, 1, 1, 10, tzinfo=dt.timezone(dt.timedelta(hours=1)))
    given = [
        {**r1[0], "seq": None, "extra": None},
        {**r1[1], "seq": None, "extra": None},
        {"id": 2, "n": 2**62, "ok": False, "txt": "日本", "lvl": "mid", "when": when, "late": 3},
        {"id": 3, "n": None, "ok": None, "txt": None, "lvl": "hard", "when": None, "late": None},
        {"id": 5, "n": 0, "ok": False, "txt": "x", "lvl": None, "when": None, "late": -1},
        {"id": 4, "n": 1, "ok": True, "txt": "", "lvl": "easy", "when": None, "late": None},
        {"id": 6, "n": 1, "ok": True, "txt": "t", "lvl": "mid", "late": 1, "seq": [9],
         "when": dt.datetime(2021, 6, 1, tzinfo=PARIS), "extra": {"k": -0.0}},
    ]  # fmt: skip
    given[2:4] = [{**row, "seq": None, "extra": None} for row in given[2:4]]
    given[4:6] = [{**row, "extra": None} for row in given[4:6]]
    given[4]["seq"], given[5]["seq"] = [], [1, 2]
    got = _stored(store, root, version)
    assert [row["id"] for row in got] == [0, 1, 2, 3, 5, 4, 6]
    for row, want in zip(got, given, strict=True):
        assert set(row) == set(want)
        for key, value in want.items():
            if key == "extra" and value is not None:
                assert math.copysign(1.0, row[key]["k"]) == -1.0
            else:
                assert row[key] == value, (row["id"], key, row[key], value)
    _check_every_read(store, root, got, [6, 0, 3, 3, 5, 1, 6, 2, 4])


@pytest.mark.parametrize(
    ("first", "later"),
    [
        ([{"x": 0.5}], [{"x": 2**53 + 1}]),
        ([{"x": 1}], [{"x": 2.5}]),
        (lambda: _float32([0.5]), [{"x": 2**24 + 1}]),
        ([{"x": D("1.25")}], [{"x": D("1.125")}]),
        ([{"x": dt.datetime(2020, 1, 1)}], [{"x": dt.datetime(2020, 1, 1, tzinfo=dt.UTC)}]),
        ([{"x": {"a": 1}}], [{"x": {"a": 1, "b": 2}}]),
    ],
    ids=["int-past-2**53-into-float64", "fraction-into-int", "int-past-2**24-into-float32",
         "decimal-losing-a-digit", "aware-into-naive", "struct-field-the-store-lacks"],
)  # fmt: skip
def test_a_round_whose_values_would_change_is_refused(tmp_path, first, later) -> None:
    """Guard. docs/format.md: the safe cast "refuses a value it would change" — an int past
    2**53 into float64 (or 2**24 into float32), 2.5 into an int column, a Decimal that would
    lose a digit, an aware timestamp into a naive column, a struct field the store lacks:
    SchemaMismatchError, the store unchanged."""
    store, root = _store(tmp_path)
    store.append(first() if callable(first) else first)
    before = _stored(store, root)
    with pytest.raises(SchemaMismatchError):
        store.append(later)
    assert store.head == 1
    _assert_same(_stored(store, root), before, "after a refusal")


def test_head_jsonl_prints_the_stored_values(tmp_path) -> None:
    """Guard. docs/cli.md: ``head --jsonl`` prints "the values as stored, in strict JSON": NaN
    and infinities null, -0.0 kept, bytes as base64 text, ints past 2**53 exact, decimals and
    times as text; the rows of every round in order."""
    from dynstate.serve.rows import jsonable

    store, root = _store(tmp_path)
    store.append(
        [{"f": math.nan, "z": -0.0, "u": 2**63 - 1, "b": b"\x00\xff", "d": D("1.50"),
          "t": dt.datetime(2020, 1, 1, tzinfo=dt.UTC), "l": [], "m": {"a": None}}]
    )  # fmt: skip
    store.append(
        [{"m": None, "f": math.inf, "z": 0.0, "u": -(2**63), "b": None, "d": D("2.25"),
          "t": None, "l": [1]}]
    )  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "dynstate", "head", root, "--jsonl"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    got = [json.loads(line) for line in out.stdout.splitlines()]
    want = [json.loads(json.dumps(jsonable(row))) for row in _stored(store, root)]
    assert got == want
    assert got[0]["f"] is None and got[1]["f"] is None
    assert math.copysign(1.0, got[0]["z"]) == -1.0
    assert [row["u"] for row in got] == [2**63 - 1, -(2**63)]


# -- what the fixes refuse, and what they keep ------------------------------------------------


def _files(root: str) -> dict[str, int]:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = os.path.getsize(path)
    return out


@pytest.mark.parametrize(
    ("first", "later", "says"),
    [
        (
            pa.table({"x": pa.array([0.5], pa.float32())}),
            [{"x": 0.25}, {"x": 0.1}],
            "column x is stored as float",
        ),
        (
            pa.table({"x": pa.array([[0.5]], pa.list_(pa.float32()))}),
            [{"x": [0.25, 1e300]}],
            "column x is stored as list<item: float>",
        ),
        (pa.table({"x": pa.array([1.0], pa.float16())}), [{"x": 2049}], "halffloat"),
        ([{"x": D("1.5")}], [{"x": D("10.25")}], "column x (decimal128(4, 2) into"),
        (
            pa.table({"t": pa.array([0], pa.timestamp("ms"))}),
            [{"t": dt.datetime(2020, 1, 1, 0, 0, 0, 123456)}],
            "would lose data",
        ),
        (
            pa.table({"t": pa.array([0], pa.timestamp("us", tz="UTC"))}),
            [{"t": dt.datetime(2020, 1, 1)}],
            "changed types",
        ),
    ],
    ids=[
        "float32",
        "list-float32-overflow",
        "int-into-float16",
        "decimal-scale",
        "ms-unit",
        "naive-into-aware",
    ],
)
def test_guard_a_round_whose_values_would_change_is_refused_unchanged(
    tmp_path, first, later, says
) -> None:
    """Guard. Each later round would change a value in the cast to the stored type (a float
    rounded or past float32's range, an int float16 cannot hold, a decimal digit past the
    scale, microseconds into milliseconds) or mixes time zones: SchemaMismatchError naming
    it, and the store's files as they were."""
    store, root = _store(tmp_path)
    store.append(first)
    before = _files(root)
    with pytest.raises(SchemaMismatchError, match=re.escape(says)):
        store.append(later)
    assert store.refresh() == 1 and _files(root) == before


def test_guard_exact_values_go_into_narrower_and_other_unit_columns(tmp_path) -> None:
    """Guard. What fits exactly is stored: halves, NaN, -0.0 and inf into float32; whole
    milliseconds given as datetimes into a timestamp[ms] column; a Decimal of a smaller scale
    into a wider one; read back the plain way, value for value."""
    store, root = _store(tmp_path)
    store.append(
        pa.table(
            {
                "f": pa.array([0.5], pa.float32()),
                "t": pa.array([0], pa.timestamp("ms")),
                "d": pa.array([D("1.25")], pa.decimal128(5, 2)),
            }
        )
    )
    later = [
        {"f": -0.0, "t": dt.datetime(2020, 1, 1, 0, 0, 0, 123000), "d": D("-3.5")},
        {"f": math.inf, "t": dt.datetime(1970, 1, 1), "d": D("999.99")},
        {"f": math.nan, "t": None, "d": None},
    ]
    version = store.append(later)
    got = _stored(store, root, version)[1:]
    assert math.copysign(1.0, got[0]["f"]) == -1.0 and got[0]["f"] == 0.0
    assert got[1]["f"] == math.inf and math.isnan(got[2]["f"])
    assert [g["t"] for g in got] == [row["t"] for row in later]
    assert [g["d"] for g in got] == [row["d"] for row in later]
