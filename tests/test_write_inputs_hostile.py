"""The write side against an oracle: what ``Store.append`` (and ``allow_new_columns``,
``Store.reset``, the generator round path ``dynstate.generators.round_table`` and verl's
``_round_table``) stores, read back with plain ``pyarrow.parquet.read_table`` over the
version's shards, compared with the input as the user meant it (pyarrow's own conversion of
the same data, ``datasets.Dataset.to_list()``, ``pandas.DataFrame.to_dict("records")``).

Tests marked DEFECT each failed on the code before its fix (their docstrings tell the defect
as found); the others guard what held up.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynstate import DynstateError, InvalidDataError, SchemaMismatchError, Store, VersionedDataset
from dynstate.generators import DynstateGenerator, round_table


def _store(tmp_path) -> tuple[Store, str]:
    root = str(tmp_path / "store")
    return Store.open(root, create=True), root


def _stored(store: Store, root: str, version: int | None = None) -> list[dict[str, Any]]:
    """The version's rows as its Parquet shards hold them (no dynstate read path); a column
    an older shard lacks is None there, as the version's schema says."""
    snap = store.snapshot(version)
    names = snap.schema.names if snap.schema is not None else []
    rows: list[dict[str, Any]] = []
    for shard in snap.shards:
        for row in pq.read_table(os.path.join(root, shard.path)).to_pylist():
            rows.append({name: row.get(name) for name in names})
    return rows


class _Lineage(DynstateGenerator):
    name = "lineage"

    def generate(self, batch: Any, step: int, dataset: Any) -> Any:
        return []


# -- DEFECTS -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "later"),
    [
        ([{"id": 0, "c": [1, 2]}], [{"id": 1, "c": []}]),
        ([{"id": 0, "c": [1, 2]}], [{"id": 1, "c": []}, {"id": 2, "c": None}]),
        ([{"id": 0, "c": [1, 2]}], [{"id": 1, "c": [None]}]),
        ([{"id": 0, "c": {"x": 1}}], [{"id": 1, "c": {"x": None}}]),
        ([{"id": 0, "c": [{"role": "user", "content": "hi"}]}], [{"id": 1, "c": []}]),
    ],
    ids=["empty-list", "empty-list-and-none", "list-of-none", "struct-field-none", "no-messages"],
)
def test_a_later_round_with_only_empty_values_appends(tmp_path, first, later) -> None:
    """DEFECT. A later round whose rows hold only ``[]`` (or ``[None]``, or a dict whose
    values are all None) in a typed column is refused with SchemaMismatchError
    ``changed types: c (list<item: int64> -> list<item: null>)``: Arrow infers ``list<null>``
    from rows with no values, and ``same_type`` (records/rounds.py) lets only a top-level
    ``null`` fit a stored type, not a null nested in a list or struct. The store can hold
    these rows (pyarrow converts them against the stored schema; its cast of ``list<null>``
    to ``list<int64>`` works), and the first round may already hold ``[]`` (docs/format.md:
    a ``list<null>`` column is promoted by a later round) — so a step that produced no
    messages, or no sources, is refused only when every row of the round has none."""
    store, root = _store(tmp_path)
    store.append(first)
    schema = store.snapshot().schema
    version = store.append(later)
    want = pa.Table.from_pylist(later, schema=schema).to_pylist()
    assert _stored(store, root, version) == first + want


@pytest.mark.parametrize(
    "later",
    [
        [{"m": [{"content": "4", "role": "assistant"}]}],
        [{"m": [{"content": "4"}]}],
    ],
    ids=["keys-in-another-order", "a-key-left-out"],
)
def test_chat_messages_whose_keys_differ_in_order_or_subset_append(tmp_path, later) -> None:
    """DEFECT. Chat messages are dicts: a later round building them as ``{"content": ...,
    "role": ...}`` (another order than the first round's ``{"role", "content"}``), or
    leaving out a key, is refused (``changed types: m (list<struct<role, content>> ->
    list<struct<content, role>>)``), while the same difference at the top level of a row is
    accepted (conform_round reorders columns by name). ``same_type`` compares struct fields
    by position (pa.DataType equality); pyarrow casts such a struct to the stored one by
    name, the missing key as null, losing nothing. Expected: the messages stored by key."""
    store, root = _store(tmp_path)
    first = [{"m": [{"role": "user", "content": "2+2"}]}]
    store.append(first)
    schema = store.snapshot().schema
    version = store.append(later)
    assert (
        _stored(store, root, version)
        == first + pa.Table.from_pylist(later, schema=schema).to_pylist()
    )


def _categorical(values: list[str]) -> Any:
    pd = pytest.importorskip("pandas")
    return pd.DataFrame({"label": pd.Categorical(values)})


@pytest.mark.parametrize(
    ("first", "later", "want"),
    [
        ([{"difficulty": 0.5}], [{"difficulty": 2}], [0.5, 2.0]),
        ([{"difficulty": np.int32(3)}], [{"difficulty": 4}], [3, 4]),
        (lambda: _categorical(["a", "b"]), [{"label": "c"}], ["a", "b", "c"]),
    ],
    ids=["int-into-float", "int-into-numpy-int32", "str-into-categorical"],
)
def test_a_later_round_the_store_holds_exactly_is_not_refused(tmp_path, first, later, want):
    """DEFECT. Types that are an artifact of how the first round was built freeze the
    column: ``2`` into a column that holds ``0.5``; a plain int into a column a numpy int32
    scalar made ``int32``; a pandas categorical (stored as ``dictionary<large_string,
    int8>``) then a round with plain strings. Each was a SchemaMismatchError although the
    store's type holds every value exactly and conform_round's cast is a safe cast (it raises
    on a value it would change: 2.5 into int32, 2**53+1 into float64); ``same_type``
    (records/rounds.py) accepted only equal types. (The categorical's index width: the next
    test.)"""
    store, root = _store(tmp_path)
    store.append(first() if callable(first) else first)
    version = store.append(later() if callable(later) else later)
    column = next(iter(_stored(store, root, version)[0]))
    assert [row[column] for row in _stored(store, root, version)] == want


@pytest.mark.parametrize(
    "first",
    [
        lambda: _categorical(["easy", "hard"]),
        lambda: pa.table(
            {
                "label": pa.array(["easy", "hard"])
                .dictionary_encode()
                .cast(pa.dictionary(pa.uint8(), pa.string()))
            }
        ),
    ],
    ids=["pandas-categorical", "arrow-uint8-indices"],
)
def test_a_categorical_first_round_takes_later_rounds_of_many_categories(tmp_path, first):
    """DEFECT (left in an earlier audit). A pandas ``Categorical`` of two values comes as
    ``dictionary<large_string, int8>``; the first round fixed that index width, and every later
    round with more than 128 distinct labels (300 generated task sources, a categorical or
    plain strings) was refused: ``SchemaMismatchError ... Integer value 128 not in range:
    -128 to 127``. Expected: dictionary columns are stored with 32-bit indices, and the rounds
    read back, the shards read whole with pyarrow, are the rows given, in order."""
    store, root = _store(tmp_path)
    store.append(first())
    many = [f"source-{i}" for i in range(300)]
    v2 = store.append(_categorical(many))
    v3 = store.append([{"label": f"plain-{i}"} for i in range(200)])
    want = ["easy", "hard", *many, *(f"plain-{i}" for i in range(200))]
    assert [row["label"] for row in _stored(store, root, v3)] == want
    assert store.snapshot(v3).to_arrow().column("label").to_pylist() == want
    assert pa.types.is_dictionary(store.snapshot(v2).schema.field("label").type)
    assert store.snapshot(v2).schema.field("label").type.index_type == pa.int32()


def test_a_store_with_narrow_dictionary_indices_says_what_to_do() -> None:
    """A store whose first round an earlier release wrote with int8 dictionary indices (its
    schema given here to the check every append runs) refuses a round of more labels than
    int8 indexes with a message naming the column and what to do."""
    from dynstate.records.rounds import conform_round

    narrow = pa.dictionary(pa.int8(), pa.string())

    with pytest.raises(SchemaMismatchError) as info:
        conform_round(
            pa.table({"label": pa.array([f"v{i}" for i in range(300)]).dictionary_encode()}),
            pa.schema([pa.field("label", narrow)]),
            False,
            "mem://store",
            1,
        )
    said = str(info.value)
    assert "label (int8 indices)" in said and "at most 128 distinct values" in said, said
    assert "split the round" in said


@pytest.mark.parametrize(
    ("rows", "column"),
    [
        ([{"id": 0, "seed_hash": 2**64}], "seed_hash"),
        ([{"id": 0, "seed_hash": 2**63}, {"id": 1, "seed_hash": -1}], "seed_hash"),
        ([{"id": 0, "is_hard": True}, {"id": 1, "is_hard": 2}], "is_hard"),
        ([{"id": 0, "answer": 42}, {"id": 1, "answer": "42"}], "answer"),
    ],
    ids=["int-beyond-uint64", "uint64-and-negative", "bool-and-int", "int-and-str"],
)
def test_a_value_arrow_cannot_convert_is_refused_naming_its_column(tmp_path, rows, column):
    """DEFECT. docs/format.md: "each refusal is an InvalidDataError naming the column". A
    list-of-dicts round with an int past uint64 (a 64-bit hash of 2**64-1 is stored as
    uint64 now), or a column mixing bool and int or int and str, is refused with ``cannot
    store this round for ...: Arrow cannot hold its values (Python int too large to convert
    to C long); make each column one type ...`` — no
    column named (a wide row leaves the user to bisect), and for the overflow the advice is
    wrong (the column is one type). Cause: records/inputs.py ``_from_rows`` converts all
    columns in one ``pa.Table.from_pydict`` call, and ``to_arrow``'s handler wraps the bare
    Arrow message."""
    store, _ = _store(tmp_path)
    with pytest.raises(InvalidDataError) as info:
        store.append(rows)
    assert column in str(info.value)
    assert store.head == 0


@pytest.mark.parametrize(
    "source",
    [np.array([0], dtype=np.int32), np.array([0], dtype=np.uint32)],
    ids=["int32", "uint32"],
)
def test_the_lineage_column_is_stored_as_list_int64(tmp_path, source) -> None:
    """DEFECT. docs/index.md, docs/api.md: ``_dynstate_source`` is ``list<int64>``. Given by
    the user as numpy int32 row numbers (``allow_new_columns=True``, as the README's loop
    does for a store without it), it is stored as ``list<int32>``; from then on every round
    of the generator path (``round_table`` casts the column to ``list<int64>``: TRL's and
    verl's generator rounds) is refused with SchemaMismatchError ``_dynstate_source
    (list<int32> -> list<int64>)``. Cause: records/columns.py ``_reserved_types`` gives the
    reserved type only to a null column. Expected: integer row numbers stored as
    ``list<int64>`` (values exact), so the generator rounds append."""
    store, root = _store(tmp_path)
    store.append([{"p": "a"}])
    store.append([{"p": "b", "_dynstate_source": source}], allow_new_columns=True)
    assert store.snapshot().schema.field("_dynstate_source").type == pa.list_(pa.int64())
    table, new = round_table(
        [{"p": "c", "_dynstate_source": [1]}], _Lineage(), store.snapshot().schema, root
    )
    version = store.append(table, allow_new_columns=new)
    assert _stored(store, root, version) == [
        {"p": "a", "_dynstate_source": None},
        {"p": "b", "_dynstate_source": [0]},
        {"p": "c", "_dynstate_source": [1]},
    ]


@pytest.mark.parametrize(
    "source",
    ["3", 3, [1.5], ["a"], {"row": 1}, ["3"]],
    ids=["str", "int", "fraction", "text-in-list", "dict", "digits-in-list"],
)
def test_round_table_refuses_a_lineage_that_is_no_row_numbers_with_a_typed_error(
    tmp_path, source
) -> None:
    """DEFECT. A DynstateGenerator's ``_dynstate_source`` that is not a list of ints
    reaches an unchecked ``cast(list<int64>)`` in generators.py ``round_table``: a str or an
    int (one row number, not in a list), a dict, a fraction or text raise bare pyarrow
    errors (ArrowNotImplementedError ``Unsupported cast from string to list``, ArrowInvalid
    ``Float value 1.500000 was truncated``) out of the trainer's step, and ``["3"]`` is
    parsed into row 3 in silence. Expected: InvalidDataError naming ``_dynstate_source`` and
    its type (a list of row numbers, ints)."""
    with pytest.raises(InvalidDataError, match="_dynstate_source"):
        round_table([{"p": "x", "_dynstate_source": source}], _Lineage(), None, str(tmp_path))


def test_verl_round_keeps_the_lineage_of_rows_after_the_first(tmp_path) -> None:
    """DEFECT. verl's generator round (dynstate/verl/dataset.py ``_round_table``) turns a
    list of dicts into rows with ``datasets.Dataset.from_list``, which takes the FIRST row's
    keys: a generator returning a fresh task (no source) first and a derived one second has
    the second row's ``_dynstate_source`` dropped, and ``round_table`` then fills it with
    null — the lineage is lost in silence (any other key absent from row 0 is dropped
    likewise, and the round refused as ``missing columns``). dynstate's own converter
    (records/inputs.py ``_from_rows``) keeps every key for exactly this reason."""
    from dynstate.verl.dataset import DynstateRLDataset

    store, root = _store(tmp_path)
    store.append([{"p": "a", "_dynstate_source": None}])
    fake = SimpleNamespace(
        store=store, data_generator=_Lineage(), maybe_filter_out_long_prompts=lambda rows: rows
    )
    table, new = DynstateRLDataset._round_table(
        fake, [{"p": "b"}, {"p": "c", "_dynstate_source": [0]}]
    )
    version = store.append(table, allow_new_columns=new)
    assert _stored(store, root, version)[1:] == [
        {"p": "b", "_dynstate_source": None},
        {"p": "c", "_dynstate_source": [0]},
    ]


def test_a_row_number_column_copied_from_a_batch_is_refused(tmp_path) -> None:
    """DEFECT. A generator that copies the rows of its batch (``dict(row, prompt=...)``)
    copies the ``_dynstate_row`` that ``VersionedDataset(row_column="_dynstate_row")`` added.
    append refuses it as an unexpected column "or pass allow_new_columns=True"; following
    that advice stores the row numbers as data, and from then on the documented reader,
    ``VersionedDataset(store, row_column="_dynstate_row")``, is refused at every later
    version (``row_column='_dynstate_row' is a column of version 2``). Expected: the round
    refused up front with an InvalidDataError naming ``_dynstate_row`` (drop it; its value
    belongs in ``_dynstate_source``), nothing committed."""
    store, root = _store(tmp_path)
    store.append([{"p": "a"}, {"p": "b"}])
    batch = [VersionedDataset(store, row_column="_dynstate_row")[i] for i in range(2)]
    copied = [dict(row, p=row["p"] + "!") for row in batch]
    with pytest.raises(InvalidDataError, match="_dynstate_row"):
        store.append(copied, allow_new_columns=True)
    assert store.head == 1
    VersionedDataset(root, row_column="_dynstate_row")


# -- what held up ------------------------------------------------------------------------------


def test_rows_keep_their_order_and_values_across_many_shards(tmp_path) -> None:
    rows = [
        {
            "i": i,
            "t": "x" * (i % 13),
            "l": [i % 5] * (i % 4) if i % 7 else None,
            "m": [{"role": "user", "content": str(i)}] * (i % 3),
            "s": {"a": i, "b": None if i % 2 else "z"},
        }
        for i in range(300)
    ]
    table = pa.Table.from_pylist(rows)
    chunked = pa.concat_tables([table.slice(5, 40), table.slice(100, 150), table.slice(299, 1)])
    for data, want, shard_bytes in ((rows, rows, 1), (chunked, chunked.to_pylist(), 500)):
        store, root = _store(tmp_path / str(shard_bytes))
        version = store.append(data, shard_bytes=shard_bytes)
        assert len(store.snapshot(version).shards) > 10
        assert _stored(store, root, version) == want


def test_values_keys_and_names_as_given(tmp_path) -> None:
    rows = [
        {"é x.y": 1, "f": float("nan"), "z": -0.0, "n": None, "b": b"\x00", "s": "a\x00b"},
        {
            "f": float("inf"),
            "é x.y": 2,
            "z": 0.0,
            "b": None,
            "s": "日本",
        },  # keys reordered, n missing
        {"é x.y": 3, "late": [1], "f": 1.5, "z": 1.0, "b": b"", "s": ""},  # a key new in row 2
    ]
    store, root = _store(tmp_path)
    got = _stored(store, root, store.append(rows))
    assert [r["é x.y"] for r in got] == [1, 2, 3]
    assert math.isnan(got[0]["f"]) and got[1]["f"] == math.inf
    assert math.copysign(1.0, got[0]["z"]) == -1.0
    assert [r["n"] for r in got] == [None] * 3
    assert [r["late"] for r in got] == [None, None, [1]]
    assert [r["b"] for r in got] == [b"\x00", None, b""]
    assert [r["s"] for r in got] == ["a\x00b", "日本", ""]
    # a later round's columns in another order, and None where a typed column is
    version = store.append(
        [{"s": None, "b": b"x", "z": 2.0, "f": None, "n": 5, "late": None, "é x.y": 4}]
    )
    assert _stored(store, root, version)[3] == {
        "é x.y": 4,
        "f": None,
        "z": 2.0,
        "n": 5,
        "b": b"x",
        "s": None,
        "late": None,
    }


def test_datasets_inputs_keep_their_selected_rows_in_order(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    base = datasets.Dataset.from_list(
        [{"a": i, "t": str(i), "m": [{"r": "u"}] * (i % 2)} for i in range(8)]
    )
    for i, ds in enumerate(
        (
            base.select([6, 1, 3]),
            base.shuffle(seed=0),
            base.select([5, 4, 0]).select([2, 0]),
            base.select([]),
        )
    ):
        store, root = _store(tmp_path / str(i))
        version = store.append(ds)
        assert _stored(store, root, version) == ds.to_list()


def test_pandas_inputs_keep_their_values(tmp_path) -> None:
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(
        {
            "n": pd.array([1, None, 3], dtype="Int64"),
            "t": pd.to_datetime(["2020-01-01", "2020-06-01", "2021-01-01"]).tz_localize(
                "Europe/Paris"
            ),
            "o": [[1, 2], [], None],
        },
        index=pd.Index([10, 5, 7], name="id"),
    )
    store, root = _store(tmp_path)
    got = _stored(store, root, store.append(frame))
    want = frame.reset_index().to_dict("records")
    assert [r["id"] for r in got] == [10, 5, 7]
    assert [r["n"] for r in got] == [1, None, 3]
    assert [r["t"] for r in got] == [w["t"].to_pydatetime() for w in want]
    assert [r["o"] for r in got] == [[1, 2], [], None]
    # a filtered frame's unnamed index is not data
    version = store.append(frame.reset_index()[lambda d: d.id != 5].set_index("id"))
    assert [r["id"] for r in _stored(store, root, version)] == [10, 5, 7, 10, 7]


def test_reset_brings_back_the_older_schema_for_later_rounds(tmp_path) -> None:
    store, root = _store(tmp_path)
    store.append([{"a": 1, "c": None}])
    store.append([{"a": 2, "c": 5, "b": "x"}], allow_new_columns=True)
    store.reset(1)
    version = store.append([{"a": 3, "c": "text"}])
    assert _stored(store, root, version) == [{"a": 1, "c": None}, {"a": 3, "c": "text"}]


def test_refusals_are_typed_and_leave_the_store_unchanged(tmp_path) -> None:
    store, _ = _store(tmp_path)
    store.append([{"a": 1}])
    for bad in (
        [{"a": 1, "a ": {}}],  # a struct without fields
        [{"a": "x"}],  # another type
        [{}, {}],  # rows without columns
        ({"a": 1},),  # a tuple of rows
        [{"a": 1}, "row"],
    ):
        with pytest.raises(DynstateError):
            store.append(bad)
    assert store.head == 1


def test_a_struct_round_missing_a_required_field_is_refused_typed(tmp_path) -> None:
    """Struct fields fit by name in any order; one left out that the store declares
    non-nullable is refused with SchemaMismatchError (the null check walked the round's
    fields by the store's positions and raised a bare IndexError), nothing committed, and
    the same fields in another order append."""
    from dynstate import SchemaMismatchError

    store, root = _store(tmp_path)
    kind = pa.struct([pa.field("role", pa.string(), nullable=False), ("content", pa.string())])
    store.append(pa.table({"m": pa.array([{"role": "u", "content": "x"}], kind)}))
    with pytest.raises(SchemaMismatchError, match="role"):
        store.append([{"m": {"content": "y"}}])
    assert store.head == 1
    version = store.append([{"m": {"content": "z", "role": "a"}}])
    assert [row["m"] for row in _stored(store, root, version)] == [
        {"role": "u", "content": "x"},
        {"role": "a", "content": "z"},
    ]


def test_a_categorical_of_only_none_takes_its_type_from_later_rounds(tmp_path) -> None:
    """DEFECT (fixed): a pandas ``Categorical`` of only ``None`` (pandas gives it ``float64``
    categories) as the first round fixed the column as ``double``, and every later round of
    labels was refused; one in a later round was refused by a column of labels. Stored as a
    null column now, it takes the type of the first round with values, as an all-``None``
    object column does."""
    pd = pytest.importorskip("pandas")
    store, root = _store(tmp_path)
    store.append(pd.DataFrame({"a": [1, 2], "c": pd.Categorical([None, None])}))
    assert store.snapshot().schema.field("c").type == pa.null()
    store.append(pd.DataFrame({"a": [3, 4], "c": pd.Categorical(["x", "y"])}))
    store.append(pd.DataFrame({"a": [5], "c": pd.Categorical([None])}))
    expected = [
        {"a": 1, "c": None},
        {"a": 2, "c": None},
        {"a": 3, "c": "x"},
        {"a": 4, "c": "y"},
        {"a": 5, "c": None},
    ]
    assert _stored(store, root) == expected
    assert store.snapshot().to_arrow().to_pylist() == expected
    assert VersionedDataset(root).__getitems__([4, 2, 0, 2]) == [expected[i] for i in (4, 2, 0, 2)]
