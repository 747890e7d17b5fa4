"""Every bad input of issue 13 and SPEC §3.9, as a table: each raises its exact typed error,
with a one-line message that names the store (and version, where there is one) and says what
to do, and leaves every file of the store byte-identical.

Errors: a round that is malformed on its own (duplicate or empty column names, nulls in a
non-nullable field, types or nesting dynstate cannot store, meta JSON cannot hold) raises
InvalidDataError; a round that does not fit the store's schema raises SchemaMismatchError;
damaged store files raise CorruptStoreError; sampler states and checkpoints that cannot be
resumed from raise StateMismatchError.

"Byte-identical" is checked by hashing every file (and listing every directory) under the
store root before and after the failing call, on memory://, a local directory and, where
the backend matters, the loopback S3 server.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
import pandas as pd
import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner
from conftest import s3_url

from dynstate import (
    CorruptStoreError,
    DynstateError,
    InvalidDataError,
    SchemaMismatchError,
    StateMismatchError,
    Store,
    VersionedDataset,
    VersionedSampler,
    VersionNotFoundError,
)
from dynstate.cli import cli
from dynstate.loading.checkpoint import describe_checkpoint
from dynstate.records import manifest as m

ROWS = [{"id": 0, "text": "a"}, {"id": 1, "text": "b"}, {"id": 2, "text": "c"}]


# -- the store and its files ----------------------------------------------------------------


def files(url: str) -> dict[str, str | None]:
    """Every file under the store root with the sha256 of its bytes, and every directory
    (None): what "left as it was" means."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    if not fs.exists(root):
        return {}
    found = fs.find(root, withdirs=True, detail=True)
    return {
        path[len(root) :]: (
            hashlib.sha256(fs.cat_file(path)).hexdigest() if info["type"] == "file" else None
        )
        for path, info in sorted(found.items())
    }


def bucket_files(bucket: str) -> dict[str, str]:
    """Every object of ``bucket``: a refused URL must not write anywhere in it."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
    return {p: hashlib.sha256(fs.cat_file(p)).hexdigest() for p in sorted(fs.find(bucket))}


@pytest.fixture
def own_bucket(s3_endpoint: str) -> str:
    """A new, empty bucket on the loopback server. Not the session's shared bucket: reading
    every object of that one, which the S3 tests before have filled, took ~2 minutes a test."""
    name = f"bad-inputs-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir(name)
    return name


def make_url(backend: str, tmp_path) -> str:
    if backend == "memory":
        return f"memory://dynstate-bad-inputs/{uuid.uuid4().hex}"
    if backend == "local":
        return str(tmp_path / "store")
    return s3_url()


def filled(url: str) -> Store:
    """A store with two versions of {id: int64, text: string}."""
    store = Store.open(url, create=True)
    store.append(ROWS[:2], meta={"step": 0})
    store.append(ROWS[2:], meta={"step": 1})
    return store


def check_message(exc: BaseException, *fragments: str) -> str:
    message = str(exc)
    assert message, f"{type(exc).__name__} without a message"
    assert "\n" not in message, f"message is not one line: {message!r}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def check_unchanged(url: str, before: dict[str, str | None], head: int) -> None:
    # A discarded part's lease outcome stays as a tombstone (gc removes it after a week) so
    # that no other holder of the part can commit it.
    def kept(listing: dict[str, str | None]) -> dict[str, str | None]:
        return {k: v for k, v in listing.items() if "/_dynstate/leases" not in k}

    assert kept(files(url)) == kept(before)
    reopened = Store.open(url)
    assert reopened.head == head
    if head:
        assert reopened.snapshot().to_arrow().to_pylist() == ROWS


# -- rounds: Store.append and Store.stage ---------------------------------------------------


def table(columns: list[pa.Array], names: list[str]) -> pa.Table:
    return pa.Table.from_arrays(columns, names=names)


def required(name: str, t: pa.DataType) -> pa.Field:
    return pa.field(name, t, nullable=False)


def deep_value(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def deep_list(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@dataclasses.dataclass(frozen=True)
class RoundCase:
    id: str
    data: Callable[[], Any]
    error: type[DynstateError]
    fragments: tuple[str, ...]
    first: bool = False  # the first round of an empty store (nothing fixes the schema yet)
    s3: bool = False  # also on S3


ROUND_CASES = [
    RoundCase(
        "duplicate-columns-first-round",
        lambda: table([pa.array([1]), pa.array([2])], ["a", "a"]),
        InvalidDataError,
        ("duplicate column names: 'a'", "own name"),
        first=True,
        s3=True,
    ),
    RoundCase(
        "duplicate-columns-record-batch",
        lambda: pa.RecordBatch.from_arrays([pa.array([1]), pa.array(["x"])], names=["id", "id"]),
        InvalidDataError,
        ("duplicate column names: 'id'",),
        first=True,
    ),
    RoundCase(
        "duplicate-columns-later-round",
        lambda: table([pa.array([3]), pa.array(["d"]), pa.array(["e"])], ["id", "text", "text"]),
        InvalidDataError,
        ("duplicate column names: 'text'",),
    ),
    RoundCase(
        "duplicate-columns-pandas",
        lambda: pd.DataFrame([[3, "d", "e"]], columns=["id", "text", "text"]),
        InvalidDataError,
        ("duplicate column names: 'text'",),
    ),
    RoundCase(
        "duplicate-columns-pandas-int-and-str-name",
        lambda: pd.DataFrame([[1, 2]], columns=[0, "0"]),
        InvalidDataError,
        ("duplicate column names: '0'",),
        first=True,
    ),
    RoundCase(
        "duplicate-struct-fields",
        lambda: pa.table(
            {"s": pa.StructArray.from_arrays([pa.array([1]), pa.array([2])], names=["a", "a"])}
        ),
        InvalidDataError,
        ("column 's'", "duplicate field names ('a')"),
        first=True,
    ),
    RoundCase(
        "empty-column-name",
        lambda: pa.table({"": [1]}),
        InvalidDataError,
        ("empty name", "name every column"),
        first=True,
    ),
    RoundCase(
        "non-str-column-name",
        lambda: [{1: 2}],
        InvalidDataError,
        ("Arrow cannot hold",),
        first=True,
    ),
    RoundCase(
        "nulls-in-non-nullable-first-round",
        lambda: pa.table({"a": pa.array([1, None])}, schema=pa.schema([required("a", pa.int64())])),
        InvalidDataError,
        ("column a", "non-nullable", "fill them"),
        first=True,
        s3=True,
    ),
    RoundCase(
        "nulls-in-non-nullable-struct-child",
        lambda: pa.table(
            {
                "s": pa.StructArray.from_arrays(
                    [pa.array([1, None])], fields=[required("x", pa.int64())]
                )
            }
        ),
        InvalidDataError,
        ("column s.x", "non-nullable"),
        first=True,
    ),
    RoundCase(
        "nulls-in-non-nullable-list-item",
        lambda: pa.table({"l": pa.array([[1, None]], type=pa.list_(required("x", pa.int64())))}),
        InvalidDataError,
        ("column l[]", "non-nullable"),
        first=True,
    ),
    RoundCase(
        "nulls-in-non-nullable-map-item",
        lambda: pa.table(
            {"m": pa.array([[("k", None)]], type=pa.map_(pa.string(), required("v", pa.int64())))}
        ),
        InvalidDataError,
        ("column m[]", "non-nullable"),
        first=True,
    ),
    RoundCase(
        "sparse-union-column",
        lambda: pa.table(
            {
                "u": pa.UnionArray.from_sparse(
                    pa.array([0, 1], type=pa.int8()), [pa.array([1, 2]), pa.array(["a", "b"])]
                )
            }
        ),
        InvalidDataError,
        ("column 'u'", "union types are not supported", "dynstate stores str"),
        first=True,
        s3=True,
    ),
    RoundCase(
        "dense-union-column",
        lambda: pa.table(
            {
                "u": pa.UnionArray.from_dense(
                    pa.array([0, 1], type=pa.int8()),
                    pa.array([0, 0], type=pa.int32()),
                    [pa.array([1]), pa.array(["a"])],
                )
            }
        ),
        InvalidDataError,
        ("union types are not supported",),
        first=True,
    ),
    RoundCase(
        "union-inside-list",
        lambda: pa.table(
            {
                "l": pa.ListArray.from_arrays(
                    pa.array([0, 1], type=pa.int32()),
                    pa.UnionArray.from_sparse(pa.array([0], type=pa.int8()), [pa.array([1])]),
                )
            }
        ),
        InvalidDataError,
        ("column 'l'", "union types are not supported"),
        first=True,
    ),
    RoundCase(
        "interval-column",
        lambda: pa.table(
            {"t": pa.array([pa.MonthDayNano([1, 2, 3])], type=pa.month_day_nano_interval())}
        ),
        InvalidDataError,
        ("column 't'", "interval types are not supported"),
        first=True,
    ),
    RoundCase(
        "run-end-encoded-column",
        lambda: pa.table({"t": pa.RunEndEncodedArray.from_arrays([2], [1])}),
        InvalidDataError,
        ("run-end encoded",),
        first=True,
    ),
    RoundCase(
        "struct-without-fields",
        lambda: pa.table({"t": pa.array([{}], type=pa.struct([]))}),
        InvalidDataError,
        ("struct without fields",),
        first=True,
    ),
    RoundCase(
        "value-nested-5000-deep",
        lambda: [{"id": 3, "text": "d", "deep": deep_value(5000)}],
        InvalidDataError,
        ("nests column 'deep' deeper than 32 levels", "row 0"),
    ),
    RoundCase(
        "list-nested-5000-deep-pandas",
        lambda: pd.DataFrame({"deep": [deep_list(5000)]}),
        InvalidDataError,
        ("nests column 'deep' deeper than 32 levels",),
        first=True,
    ),
    RoundCase(
        # Written fine, but Parquet readers refuse a schema this deep: every read would fail.
        "arrow-type-nested-40-deep",
        lambda: pa.table({"deep": pa.array([deep_value(40)])}),
        InvalidDataError,
        ("column 'deep'", "deeper than 32 levels"),
        first=True,
    ),
    RoundCase(
        "mixed-types-in-a-column",
        lambda: [{"id": 3, "text": "d"}, {"id": "four", "text": "e"}],
        InvalidDataError,
        ("Arrow cannot hold",),
    ),
    RoundCase(
        "int-too-large-for-arrow",
        lambda: [{"id": 2**70, "text": "d"}],
        InvalidDataError,
        ("Arrow cannot hold",),
    ),
    RoundCase(
        "lone-surrogate-in-a-string",
        lambda: [{"id": 3, "text": "\ud800"}],
        InvalidDataError,
        ("Arrow cannot hold",),
    ),
    RoundCase(
        "python-object-value",
        lambda: [{"id": 3, "text": object()}],
        InvalidDataError,
        ("Arrow cannot hold",),
    ),
    RoundCase(
        "not-a-round-type",
        lambda: {"id": [3], "text": ["d"]},
        InvalidDataError,
        ("pass a pyarrow Table",),
    ),
    RoundCase(
        "list-of-non-dicts",
        lambda: [{"id": 3, "text": "d"}, "not a dict"],
        InvalidDataError,
        ("must hold dicts",),
    ),
    RoundCase(
        "rows-without-columns",
        lambda: [{}, {}],
        InvalidDataError,
        ("the 2 rows", "no columns"),
        first=True,
    ),
    RoundCase(
        "frame-without-columns",
        lambda: pd.DataFrame(index=[1, 2, 3]),
        InvalidDataError,
        ("the 3 rows", "no columns"),
    ),
    RoundCase(
        "index-name-clashes-with-a-column",
        lambda: pd.DataFrame({"id": [3], "text": ["d"]}).set_index("id").assign(id=4),
        InvalidDataError,
        ("duplicate column names: 'id'",),
    ),
    RoundCase(
        "pandas-series",
        lambda: pd.Series([3]),
        InvalidDataError,
        ("cannot append a Series",),
    ),
    RoundCase(
        "datasets-dict",
        lambda: __import__("datasets").DatasetDict(
            {"train": __import__("datasets").Dataset.from_list(ROWS)}
        ),
        InvalidDataError,
        ("cannot append a DatasetDict",),
    ),
    RoundCase(
        "column-type-changed",
        lambda: [{"id": "three", "text": "d"}],
        SchemaMismatchError,
        ("id (int64 -> string)", "at version 2"),
    ),
    RoundCase(
        "new-column-not-allowed",
        lambda: [{"id": 3, "text": "d", "extra": 1}],
        SchemaMismatchError,
        ("unexpected columns: extra", "allow_new_columns=True", "at version 2"),
    ),
]


def _round_params() -> list[Any]:
    params = []
    for case in ROUND_CASES:
        for backend in ("memory", "local", "s3"):
            if backend == "s3" and not case.s3:
                continue
            marks = [pytest.mark.s3] if backend == "s3" else []
            params.append(pytest.param(case, backend, id=f"{case.id}-{backend}", marks=marks))
    return params


@pytest.mark.parametrize("via", ["append", "stage"])
@pytest.mark.parametrize(("case", "backend"), _round_params())
def test_bad_round(case: RoundCase, backend: str, via: str, tmp_path, request) -> None:
    if backend == "s3":
        request.getfixturevalue("s3_endpoint")
    url = make_url(backend, tmp_path)
    store = Store.open(url, create=True) if case.first else filled(url)
    head = store.head
    before = files(url)
    data = case.data()
    with pytest.raises(case.error) as info:
        if via == "append":
            store.append(data, meta={"step": 9})
        else:
            store.stage(data)
    assert type(info.value) is case.error
    check_message(info.value, store.display_url, *case.fragments)
    check_unchanged(url, before, head)


# None is the writer's default (docs/api.md), not a bad value.
@pytest.mark.parametrize("shard_bytes", ["64MB", 0, -5, 2.5, True])
def test_bad_shard_bytes(shard_bytes: Any, tmp_path) -> None:
    url = str(tmp_path / "store")
    store = filled(url)
    before = files(url)
    with pytest.raises(InvalidDataError) as info:
        store.append([{"id": 3, "text": "d"}, {"id": 4, "text": "e"}], shard_bytes=shard_bytes)
    check_message(info.value, store.display_url, "shard_bytes")
    check_unchanged(url, before, 2)


def test_non_nullable_store_column_refuses_nulls(tmp_path) -> None:
    """A later round that has the column, but with nulls in it, against a first round that
    declared the column non-nullable (a raw ValueError from the cast before)."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    schema = pa.schema([required("id", pa.int64()), pa.field("text", pa.string())])
    store.append(pa.Table.from_pylist(ROWS, schema=schema))
    before = files(url)
    for via in (store.append, store.stage):
        with pytest.raises(InvalidDataError) as info:
            via([{"id": 3, "text": "d"}, {"id": None, "text": "e"}])
        check_message(info.value, store.display_url, "column id", "at version 1", "non-nullable")
    assert files(url) == before
    assert Store.open(url).snapshot().to_arrow().to_pylist() == ROWS


def test_accepted_types_read_back(tmp_path) -> None:
    """What the checks let through stores and reads back, twice over (the second round is
    conformed to the schema read from the store), through the store and the dataset."""
    arrays = {
        "map": pa.array([[("k", 1)]], type=pa.map_(pa.string(), pa.int64())),
        # Arrow's schema format drops the names of map fields; the round is relabelled
        "map_named": pa.array(
            [[("k", 1)]],
            type=pa.map_(pa.field("key", pa.string(), False), pa.field("n", pa.int8())),
        ),
        "dictionary": pa.array(["x"]).dictionary_encode(),
        "uuid": pa.array([uuid.UUID(int=7).bytes], type=pa.uuid()),
        "time": pa.array([1], type=pa.time32("s")),
        "duration": pa.array([1], type=pa.duration("s")),
        "half": pa.array([1.5], type=pa.float16()),
        "decimal": pa.array([1], type=pa.decimal256(40, 2)),
        "fixed_list": pa.array([[1, 2]], type=pa.list_(pa.int64(), 2)),
        "large_string": pa.array(["y"], type=pa.large_string()),
        "timestamp_tz": pa.array([1], type=pa.timestamp("ns", tz="UTC")),
        "nested_31": pa.array([deep_value(31)]),
        "nan": pa.array([math.nan]),
        "nulls": pa.nulls(1),
    }
    for name, array in arrays.items():
        url = str(tmp_path / name)
        store = Store.open(url, create=True)
        round_ = pa.table({name: array})
        assert store.append(round_) == 1
        assert store.append(round_) == 2
        rows = Store.open(url).snapshot().to_arrow().to_pylist()
        assert len(rows) == 2 and repr(rows[0]) == repr(rows[1]), name  # repr: nan != nan
        dataset = VersionedDataset(url)
        assert repr(dataset[1]) == repr(dataset[0]), name


def test_named_pandas_index_is_kept(tmp_path) -> None:
    """``preserve_index=False`` dropped a named index (``set_index("id")``) in silence."""
    store = filled(str(tmp_path / "store"))
    store.append(pd.DataFrame({"id": [3], "text": ["d"]}).set_index("id"))
    assert store.snapshot().to_arrow().to_pylist()[-1] == {"id": 3, "text": "d"}
    # an unnamed index (a filtered frame's) is only row labels
    store.append(pd.DataFrame({"id": [4, 5], "text": ["e", "f"]}).iloc[1:])
    assert store.snapshot().to_arrow().to_pylist()[-1] == {"id": 5, "text": "f"}


def test_keys_missing_from_the_first_row_are_kept(tmp_path) -> None:
    """pyarrow's from_pylist takes the columns from the first row and drops later keys
    silently; a round's columns are the keys of all its rows."""
    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"id": 0}, {"id": 1, "text": "b"}])
    assert store.snapshot().to_arrow().to_pylist() == [
        {"id": 0, "text": None},
        {"id": 1, "text": "b"},
    ]
    before = files(store.url)
    with pytest.raises(SchemaMismatchError, match="unexpected columns: extra"):
        store.append([{"id": 2, "text": "c"}, {"id": 3, "text": "d", "extra": 1.5}])
    assert files(store.url) == before


# -- meta -----------------------------------------------------------------------------------


META_CASES = [
    pytest.param(
        deep_value(5000), ("nests deeper than 32 levels", "flatten it"), id="dict-5000-deep"
    ),
    pytest.param({"x": deep_list(5000)}, ("nests deeper than 32 levels",), id="list-5000-deep"),
    pytest.param(deep_value(40), ("nests deeper than 32 levels",), id="dict-40-deep"),
    pytest.param({"x": "y" * (2**20 + 1)}, ("over the limit of 1,048,576",), id="over-1MiB"),
    pytest.param({1: "x"}, ("key 1 of type int", "meta keys must be str"), id="int-key"),
    pytest.param({"a": {(1, 2): "x"}}, ("of type tuple", "must be str"), id="nested-tuple-key"),
    pytest.param({"x": math.nan}, ("holds nan", "JSON cannot hold"), id="nan"),
    pytest.param({"x": [math.inf]}, ("holds inf",), id="inf-in-list"),
    pytest.param({"x": "\ud800"}, ("surrogates not allowed",), id="lone-surrogate"),
    pytest.param({"x": b"bytes"}, ("JSON-serializable",), id="bytes"),
    pytest.param({"x": {1, 2}}, ("JSON-serializable",), id="set"),
    pytest.param({"x": torch.tensor(1.0)}, ("JSON-serializable",), id="tensor"),
    pytest.param(["not", "a", "dict"], ("must be a dict",), id="list"),
]


@pytest.mark.parametrize("via", ["append", "commit_staged"])
@pytest.mark.parametrize("backend", ["memory", "local"])
@pytest.mark.parametrize(("meta", "fragments"), META_CASES)
def test_bad_meta(meta: Any, fragments: tuple[str, ...], backend: str, via: str, tmp_path) -> None:
    url = make_url(backend, tmp_path)
    store = filled(url)
    before = files(url)
    part = store.stage([{"id": 3, "text": "d"}]) if via == "commit_staged" else None
    with pytest.raises(InvalidDataError) as info:
        if part is None:
            store.append([{"id": 3, "text": "d"}], meta=meta)
        else:
            store.commit_staged([part], meta=meta)
    assert type(info.value) is InvalidDataError
    check_message(info.value, store.display_url, *fragments)
    if part is not None:
        store.discard([part])  # the refusal left it staged, for a fixed commit (below)
    check_unchanged(url, before, 2)


@pytest.mark.s3
def test_bad_meta_after_stage_on_s3(s3_endpoint: str) -> None:
    """A round refused at commit for its meta keeps its staged parts: the same parts commit
    once the meta is fixed, stored once; before that the store is as it was."""
    url = s3_url()
    store = filled(url)
    part = store.stage([{"id": 3, "text": "d"}])
    before = files(url)
    with pytest.raises(InvalidDataError) as info:
        store.commit_staged([part], meta=deep_value(5000))
    check_message(info.value, store.display_url)
    assert files(url) == before and Store.open(url).head == 2
    version = store.commit_staged([part], meta={"step": 3})
    assert Store.open(url).snapshot(version).to_arrow().to_pylist() == [
        *ROWS,
        {"id": 3, "text": "d"},
    ]


def test_meta_within_limits_round_trips(tmp_path) -> None:
    meta = {"step": 3, "deep": deep_value(30), "big": 2**80, "text": "é" * 1000, "l": [1.5, None]}
    store = filled(str(tmp_path / "store"))
    version = store.append([{"id": 3, "text": "d"}], meta=meta)
    assert Store.open(store.url).commit_record(version).meta == meta


# -- storage: options, URLs, damaged files ---------------------------------------------------


@pytest.mark.parametrize(
    "backend",
    ["memory", "local", pytest.param("s3", marks=pytest.mark.s3)],
)
def test_unknown_storage_option(backend: str, tmp_path, request) -> None:
    if backend == "s3":
        request.getfixturevalue("s3_endpoint")
    url = make_url(backend, tmp_path)
    store = filled(url)
    before = files(url)
    with pytest.raises(InvalidDataError) as info:
        Store.open(url, storage_options={"no_such_option": 1})
    check_message(info.value, store.display_url, "unknown storage option 'no_such_option'")
    check_unchanged(url, before, 2)


SECRET_URLS = [
    # the secret part of each, which must appear nowhere
    pytest.param("s3://AKIDEXAMPLE:Zq9/Xw7@{bucket}/store", ("Zq9", "Xw7"), id="slash-in-secret"),
    pytest.param("s3://AKIDEXAMPLE:Zq9Xw7@{bucket}/store", ("Zq9Xw7",), id="plain-secret"),
    pytest.param("s3://AKIDEXAMPLE:Zq9%2FXw7@{bucket}/store", ("Zq9", "Xw7"), id="quoted-secret"),
]


@pytest.mark.s3
@pytest.mark.parametrize(("template", "secrets"), SECRET_URLS)
def test_credentials_in_url(
    template: str, secrets: tuple[str, ...], own_bucket: str, caplog
) -> None:
    url = template.format(bucket=own_bucket)
    before = bucket_files(own_bucket)
    caplog.set_level(logging.DEBUG)  # botocore logs request headers at DEBUG
    with pytest.raises(InvalidDataError) as info:
        Store.open(url, create=True)
    message = check_message(info.value, "credentials in the URL")
    result = CliRunner().invoke(cli, ["-vv", "ls", url])
    assert result.exit_code == 1
    assert "error:" in result.output
    for secret in secrets:
        assert secret not in message
        assert secret not in caplog.text
        assert secret not in result.output
    assert bucket_files(own_bucket) == before


@pytest.mark.s3
def test_secret_in_storage_options_stays_out_of_errors_and_logs(own_bucket: str, caplog) -> None:
    """Credentials passed the right way (storage options) appear in no message and no log line
    at DEBUG (botocore logs request headers there), on success and on failure."""
    secret = "Zq9Xw7SecretValue"
    options = {"key": "AKIDEXAMPLE", "secret": secret}
    caplog.set_level(logging.DEBUG)
    store = Store.open(f"s3://{own_bucket}/store", create=True, storage_options=options)
    store.append(ROWS)
    before = bucket_files(own_bucket)
    with pytest.raises(InvalidDataError) as info:
        store.append([{"id": "x"}, {"id": 1}])
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/store"
    with pytest.raises(DynstateError) as other:
        Store.open(missing, storage_options=options)
    result = CliRunner().invoke(cli, ["-vv", "ls", missing, "--storage-option", f"secret={secret}"])
    assert result.exit_code == 1
    for text in (str(info.value), str(other.value), caplog.text, result.output):
        assert secret not in text
    assert bucket_files(own_bucket) == before


@pytest.mark.s3
def test_create_in_missing_bucket(own_bucket: str) -> None:
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/store"
    before = bucket_files(own_bucket)
    with pytest.raises(DynstateError) as info:
        Store.open(url, create=True)
    check_message(info.value, url, "bucket")
    assert bucket_files(own_bucket) == before
    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
    assert not fs.exists(url.removeprefix("s3://").split("/")[0])  # no bucket made either


def write_gc_file(url: str, obj: dict[str, Any]) -> None:
    # An outside actor (a hand edit, another tool): a well-formed record, checksum and all.
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/{m.GC_FILE}", m.encode(obj))


@pytest.mark.parametrize(
    "gc_obj",
    [
        pytest.param({"format": 1}, id="no-floor"),
        pytest.param({"format": 1, "floor": "3"}, id="str-floor"),
        pytest.param({"format": 1, "floor": -1}, id="negative-floor"),
    ],
)
@pytest.mark.parametrize("backend", ["memory", "local", pytest.param("s3", marks=pytest.mark.s3)])
def test_gc_file_without_floor(gc_obj: dict[str, Any], backend: str, tmp_path, request) -> None:
    if backend == "s3":
        request.getfixturevalue("s3_endpoint")
    url = make_url(backend, tmp_path)
    store = filled(url)
    write_gc_file(url, gc_obj)
    before = files(url)
    for action in (lambda: Store.open(url), store.versions, store.refresh):
        with pytest.raises(CorruptStoreError) as info:
            action()
        check_message(info.value, store.display_url, "gc.json", "floor")
    for command in (["ls", url], ["verify", url]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 1, result.output
        assert "gc.json" in result.output and "Traceback" not in result.output
    assert files(url) == before


# -- sampler state ---------------------------------------------------------------------------


def _drop(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda s: {k: v for k, v in s.items() if k != key}


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda s: {**s, key: value}


def _case(mutate: Any, fragments: tuple[str, ...], id: str) -> Any:
    return pytest.param(mutate, fragments, StateMismatchError, id=id)


SAMPLER_CASES = [
    _case(_set("position", -1), ("position=-1",), id="negative-position"),
    _case(_set("position", "2"), ("position='2'",), id="str-position"),
    _case(_set("position", 2.0), ("position=2.0",), id="float-position"),
    _case(_set("position", 10**9), ("position",), id="position-past-the-version"),
    _case(_set("position", 2**62), ("position",), id="huge-position"),
    _case(_set("epoch", -1), ("epoch=-1",), id="negative-epoch"),
    _case(_set("epoch", True), ("epoch=True",), id="bool-epoch"),
    pytest.param(
        lambda s: {**s, "version": 99, "fresh_version": 99},
        ("version 99", "latest is 2"),
        VersionNotFoundError,
        id="version-past-the-head",
    ),
    _case(_set("seed", None), ("seed=None",), id="none-seed"),
    _case(_set("mode", "shuffle"), ("mode='shuffle'",), id="unknown-mode"),
    _case(_set("store_id", "0" * 32), ("belongs to store",), id="other-store"),
    _case(_set("kind", "other"), ("not a dynstate sampler state",), id="wrong-kind"),
    _case(_set("format", None), ("format",), id="no-format"),
    *[
        _case(_drop(key), (f"lacks {key}",), id=f"missing-{key}")
        for key in ("position", "epoch", "version", "seed", "store_id", "base_rows", "step")
    ],
]


@pytest.mark.parametrize(("mutate", "fragments", "error"), SAMPLER_CASES)
@pytest.mark.parametrize("backend", ["memory", "local"])
def test_bad_sampler_state(
    mutate, fragments: tuple[str, ...], error: type[DynstateError], backend: str, tmp_path
) -> None:
    url = make_url(backend, tmp_path)
    store = filled(url)
    sampler = VersionedSampler(VersionedDataset(url), batch_size=1, shuffle=False)
    it = iter(sampler)
    next(it)
    good = sampler.state_dict()
    assert good["version"] == 2 and good["position"] == 1
    before = files(url)
    with pytest.raises(error) as info:
        sampler.load_state_dict(mutate(dict(good)))
    assert type(info.value) is error
    check_message(info.value, store.display_url, *fragments)
    assert sampler.state_dict() == good  # checked in full before anything changed
    check_unchanged(url, before, 2)


# -- checkpoints: dynstate inspect -----------------------------------------------------------


def sampler_state(url: str) -> dict[str, Any]:
    sampler = VersionedSampler(VersionedDataset(url), batch_size=2)
    next(iter(sampler))
    return sampler.state_dict()


class NotPlain:
    pass


def _checkpoint_files(state: dict[str, Any]) -> dict[str, Callable[[str], None]]:
    def save(obj: Any) -> Callable[[str], None]:
        return lambda path: torch.save(obj, path)

    def raw(data: bytes) -> Callable[[str], None]:
        def write(path: str) -> None:
            with open(path, "wb") as f:
                f.write(data)

        return write

    def truncated(path: str) -> None:
        torch.save({"dataloader": state}, path)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])

    no_url = {k: v for k, v in state.items() if k != "store_url"}
    return {
        "no-store-url": save({"dataloader": {"sampler": no_url}}),
        "store-url-not-str": save({**state, "store_url": 5}),
        "not-a-dict": save([1, 2, 3]),
        "no-sampler-state": save({"step": 3}),
        "pickled-object": save({"x": NotPlain()}),
        "truncated": truncated,
        "empty": raw(b""),
        "text": raw(b"hello"),
        "missing-seed": save({k: v for k, v in state.items() if k != "seed"}),
        "negative-position": save({**state, "position": -1}),
    }


CHECKPOINT_CASES = [
    ("no-store-url", ("records no store URL", "--store URL")),
    ("store-url-not-str", ("records no store URL", "--store URL")),
    ("not-a-dict", ("holds no dynstate sampler state",)),
    ("no-sampler-state", ("holds no dynstate sampler state",)),
    ("pickled-object", ("weights_only=True", "Python objects other than plain types")),
    ("truncated", ("weights_only=True", "damaged")),
    ("empty", ("weights_only=True", "empty or cut short")),
    ("text", ("weights_only=True", "not a torch.save file")),
    ("missing-seed", ("lacks seed",)),
    ("negative-position", ("position=-1",)),
]


@pytest.mark.parametrize(
    ("name", "fragments"), CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES]
)
def test_bad_checkpoint(name: str, fragments: tuple[str, ...], tmp_path) -> None:
    url = str(tmp_path / "store")
    filled(url)
    ckpt = tmp_path / "global_step_3"
    ckpt.mkdir()
    path = str(ckpt / "data.pt")
    _checkpoint_files(sampler_state(url))[name](path)
    before = files(url)
    with pytest.raises(StateMismatchError) as info:
        describe_checkpoint(str(ckpt))
    check_message(info.value, path, *fragments)
    result = CliRunner().invoke(cli, ["inspect", path])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and path in lines[0], result.output
    check_unchanged(url, before, 2)


def test_checkpoint_without_store_url_inspects_with_store_option(tmp_path) -> None:
    """What the error asks for works: naming the store resumes the inspection."""
    url = str(tmp_path / "store")
    store = filled(url)
    state = {k: v for k, v in sampler_state(url).items() if k != "store_url"}
    path = str(tmp_path / "data.pt")
    torch.save({"dataloader": {"sampler": state}}, path)
    info = describe_checkpoint(path, store_url=url)
    assert info["store_id"] == store.store_id and info["version"] == 2
    result = CliRunner().invoke(cli, ["inspect", path, "--store", url, "--json"])
    assert result.exit_code == 0, result.output
    other = Store.open(str(tmp_path / "other"), create=True)
    with pytest.raises(StateMismatchError, match="belongs to store"):
        describe_checkpoint(path, store_url=other.url)


FILE_CASES = ["not-a-dict", "no-sampler-state", "pickled-object", "truncated", "empty", "text"]


@pytest.mark.parametrize("name", FILE_CASES)
def test_one_checkpoint_reader_one_message(name: str, tmp_path) -> None:
    """A bad data.pt gets the same message from `dynstate inspect` (describe_checkpoint) and
    from verl's resume (read_loader_state): one reader, loading.checkpoint.read_checkpoint_file."""
    from dynstate.verl.loader_state import read_loader_state

    url = str(tmp_path / "store")
    store = filled(url)
    path = str(tmp_path / "data.pt")
    _checkpoint_files(sampler_state(url))[name](path)
    with pytest.raises(StateMismatchError) as inspected:
        describe_checkpoint(path)
    with pytest.raises(StateMismatchError) as resumed:
        read_loader_state(path, store)
    assert str(resumed.value) == str(inspected.value)
