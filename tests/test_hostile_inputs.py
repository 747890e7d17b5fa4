"""Hostile or odd inputs of issue 19 (point 7) that gave raw Python errors: store files nested
200,000 deep or holding a 5,000-digit integer, records with values of the wrong JSON type or a
`created` that is not a time, a lease naming pid 10**30, `fixed_shape_tensor` columns, a
timestamp past year 9999 in `dynstate head`, and a first round whose column is all None.

Each damaged file raises CorruptStoreError naming the file and what to do, and leaves every
file of the store byte-identical; advisory files (the head hint, a lease) are judged without
failing the reader or gc.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from dynstate import CorruptStoreError, SchemaMismatchError, Store, VersionedDataset
from dynstate.cli import cli
from dynstate.log.leases import LEASE_DIR, host_id, lease_path
from dynstate.maintenance.gc import collect_garbage
from dynstate.maintenance.verify import verify_store
from dynstate.records import manifest as m

ROWS = [{"id": 0, "text": "a"}, {"id": 1, "text": "b"}, {"id": 2, "text": "c"}]
RECORD = m.log_path(1)
DEEP = b"[" * 200_000 + b"]" * 200_000
HUGE_INT = b'{"format": 1, "version": ' + b"7" * 5000 + b"}"


def run(*args: str, code: int = 0):
    result = CliRunner().invoke(cli, list(args), env={"COLUMNS": "200"}, catch_exceptions=False)
    assert result.exit_code == code, (result.stdout, result.stderr)
    return result


@pytest.fixture(params=["memory", "local"])
def url(request, tmp_path) -> str:
    if request.param == "memory":
        return f"memory://dynstate-hostile/{uuid.uuid4().hex}"
    return str(tmp_path / "store")


def filled(url: str) -> Store:
    store = Store.open(url, create=True)
    store.append(ROWS[:2], meta={"step": 0})
    store.append(ROWS[2:], meta={"step": 1})
    store.tag("t", 1)
    return store


def files(url: str) -> dict[str, str]:
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {
        path[len(root) :]: hashlib.sha256(fs.cat_file(path)).hexdigest()
        for path in sorted(fs.find(root))
    }


def write(url: str, rel: str, data: bytes) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/{rel}", data)


def read(url: str, rel: str) -> bytes:
    fs, root = fsspec.core.url_to_fs(url)
    return fs.cat_file(f"{root}/{rel}")


def tamper(url: str, rel: str, **fields) -> None:
    """Rewrite a record with ``fields`` changed and a valid checksum (what an attacker or a
    buggy tool that knows the format would write)."""
    body = m.decode(read(url, rel), rel)
    write(url, rel, m.encode({**body, **fields}))


def check_refused(exc: BaseException, rel: str, *fragments: str) -> None:
    message = str(exc)
    assert "\n" not in message, message
    assert rel in message, f"{rel!r} not named in {message!r}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# -- store files nested 200k deep, or holding a 5000-digit integer --------------------------


def _open_store(url: str) -> None:
    Store.open(url)


def _read_version_1(url: str) -> None:
    Store.open(url).snapshot(1).to_arrow()


def _read_tag(url: str) -> None:
    Store.open(url).snapshot("t").to_arrow()


READERS = {
    m.STORE_FILE: _open_store,
    RECORD: _read_version_1,
    m.tag_path("t"): _read_tag,
    m.GC_FILE: _open_store,
}


@pytest.mark.parametrize("payload", [DEEP, HUGE_INT], ids=["nested-200k", "5000-digits"])
@pytest.mark.parametrize("rel", list(READERS), ids=lambda rel: rel.rsplit("/", 1)[-1])
def test_a_hostile_store_file_is_a_corrupt_store_error(url, rel, payload) -> None:
    filled(url)
    write(url, rel, payload)
    before = files(url)
    with pytest.raises(CorruptStoreError) as info:
        READERS[rel](url)
    check_refused(info.value, rel, "damaged", "restore it")
    assert "nests deeper than 64 levels" in str(info.value) or "5,000 digits" in str(info.value)
    assert files(url) == before


@pytest.mark.parametrize("payload", [DEEP, HUGE_INT], ids=["nested-200k", "5000-digits"])
def test_cli_names_the_hostile_file(tmp_path, payload) -> None:
    url = str(tmp_path / "store")
    filled(url)
    write(url, m.STORE_FILE, payload)
    before = files(url)
    err = run("ls", url, code=1).stderr
    assert err.startswith(f"error: {url}/{m.STORE_FILE} ") and "damaged" in err
    err = run("tags", url, code=1).stderr
    assert err.startswith("error: ") and m.STORE_FILE in err
    assert files(url) == before


@pytest.mark.parametrize(
    "payload",
    [DEEP, HUGE_INT, b'{"version": Infinity}', b'{"version": 1e999}'],
    ids=["nested-200k", "5000-digits", "infinity", "1e999"],
)
def test_a_hostile_head_hint_is_ignored(url, payload, caplog) -> None:
    filled(url)
    write(url, m.HEAD_HINT, payload)
    with caplog.at_level(logging.WARNING, logger="dynstate"):
        store = Store.open(url)
    assert store.head == 2  # the hint is advisory: the head is found without it
    assert store.snapshot().to_arrow().to_pylist() == ROWS
    assert "ignoring unreadable head hint" in caplog.text


@pytest.mark.parametrize("payload", [DEEP, HUGE_INT], ids=["nested-200k", "5000-digits"])
def test_a_hostile_chunk_is_a_corrupt_store_error(payload) -> None:
    digest = m.sha256(payload)  # content-addressed: the damage must pass the address check
    with pytest.raises(CorruptStoreError) as info:
        m.decode_chunk(digest, payload, m.chunk_path(digest))
    check_refused(info.value, m.chunk_path(digest), "damaged")


# -- records with values of the wrong JSON type ------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_rows": 2.5}, "num_rows 2.5"),
        ({"num_bytes": True}, "num_bytes True"),
        ({"version": "1"}, "version '1'"),
        ({"parent": 10**30}, "parent 1000000000000000000000000000000"),
        ({"meta": [1, 2]}, "meta [1, 2]"),
        ({"schema": 7}, "schema 7"),
        ({"store_id": {"x": 1}}, "store_id {'x': 1}"),
        ({"created": "yesterday"}, "created 'yesterday'"),
        ({"created": 17}, "created 17"),
        ({"add": {"path": "x"}}, "add {'path': 'x'}"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_a_record_of_wrong_types_is_a_corrupt_store_error(url, fields, named) -> None:
    filled(url)
    tamper(url, RECORD, **fields)
    before = files(url)
    with pytest.raises(CorruptStoreError) as info:
        _read_version_1(url)
    check_refused(info.value, RECORD, named, "damaged", "dynstate verify")
    assert files(url) == before


def test_gc_older_than_with_a_created_that_is_no_time(tmp_path) -> None:
    """gc --older-than parses every record's `created` (a raw ValueError before)."""
    url = str(tmp_path / "store")
    filled(url)
    tamper(url, RECORD, created="not a time")
    before = files(url)
    with pytest.raises(CorruptStoreError) as info:
        collect_garbage(Store.open(url), older_than_s=3600, grace_s=0, dry_run=False)
    check_refused(info.value, RECORD, "created 'not a time'", "ISO 8601")
    err = run("gc", url, "--older-than", "1h", "--grace", "0", "--yes", code=1).stderr
    assert err.startswith("error: ") and RECORD in err
    assert files(url) == before


def test_store_json_with_a_store_id_of_the_wrong_type(url) -> None:
    filled(url)
    for bad in ({"a": 1}, 12, "", None):
        tamper(url, m.STORE_FILE, store_id=bad)
        before = files(url)
        with pytest.raises(CorruptStoreError) as info:
            Store.open(url)
        check_refused(info.value, m.STORE_FILE, "store_id")
        assert files(url) == before


# -- leases: a damaged lease is judged by its age, never blocks gc ------------------------------


def _lease_of(store: Store) -> str:
    names = store.storage.list(LEASE_DIR)
    (name,) = [n for n in names if n.endswith(".json") and "outcome" not in n]
    return name[: -len(".json")]


@pytest.mark.parametrize(
    "damage",
    ["pid-1e30", "ttl-1e400", "nested-200k", "5000-digits"],
)
def test_a_damaged_lease_does_not_block_gc(url, damage) -> None:
    store = filled(url)
    part = store.stage([{"id": 3, "text": "d"}])
    lease = _lease_of(store)
    body = m.decode(store.storage.read(lease_path(lease)), lease)
    raw = {
        "pid-1e30": m.encode({**body, "host": host_id(), "pid": 10**30}),
        "ttl-1e400": m.encode({**body, "ttl_s": 10**400}),
        "nested-200k": DEEP,
        "5000-digits": HUGE_INT,
    }[damage]
    store.storage.put(lease_path(lease), raw)
    result = collect_garbage(Store.open(url), grace_s=0, dry_run=False)
    # A fresh lease file, readable or not, protects its shards: judged by its age.
    assert all(store.storage.exists(s.path) for s in part.shards), result
    assert store.commit_staged([part]) == 3
    assert [r["id"] for r in Store.open(url).snapshot().to_arrow().to_pylist()] == [0, 1, 2, 3]


def test_cli_gc_with_a_lease_naming_pid_10_to_the_30(tmp_path) -> None:
    """A lease of pid 10**30 on this host made every gc fail with OverflowError."""
    url = str(tmp_path / "store")
    store = filled(url)
    part = store.stage([{"id": 3, "text": "d"}])
    lease = _lease_of(store)
    body = m.decode(store.storage.read(lease_path(lease)), lease)
    store.storage.put(lease_path(lease), m.encode({**body, "host": host_id(), "pid": 10**30}))
    run("gc", url, "--grace", "0", "--yes")
    assert store.commit_staged([part]) == 3


# -- fixed_shape_tensor columns ----------------------------------------------------------------


def _tensors(n: int, shape=(2, 2)) -> pa.Array:
    values = np.arange(n * int(np.prod(shape)), dtype=np.float32).reshape(n, *shape)
    return pa.FixedShapeTensorArray.from_numpy_ndarray(values)


def test_fixed_shape_tensor_columns_are_stored_and_read_back(url) -> None:
    """Refused with a raw NotImplementedError before (an empty table of the type)."""
    store = Store.open(url, create=True)
    first = pa.table({"x": _tensors(3), "id": [0, 1, 2]})
    store.append(first)
    store.append(pa.table({"x": _tensors(2), "id": [3, 4]}))
    snap = Store.open(url).snapshot()
    table = snap.to_arrow()
    assert table.schema.field("x").type == first.schema.field("x").type
    assert table.column("x").chunk(0).to_numpy_ndarray().shape == (3, 2, 2)
    assert table.slice(0, 3).equals(first)
    assert VersionedDataset(url)[4] == {"x": [4.0, 5.0, 6.0, 7.0], "id": 4}
    assert verify_store(Store.open(url)).problems == []
    # Another shape is another type: a schema mismatch naming the column, nothing written.
    before = files(url)
    with pytest.raises(SchemaMismatchError, match="changed types: x"):
        store.append(pa.table({"x": _tensors(1, (3, 2)), "id": [5]}))
    assert files(url) == before


# -- dynstate head of a timestamp past year 9999 ----------------------------------------------


def test_head_shows_timestamps_past_year_9999(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    far = 2**62  # microseconds: year 146,140
    store.append(
        pa.table(
            {
                "t": pa.array([far, 0], pa.timestamp("us")),
                "d": pa.array([2**30, 0], pa.date32()),
                "l": pa.array([[far], []], pa.list_(pa.timestamp("us"))),
                "id": [0, 1],
            }
        )
    )
    out = run("head", url).stdout
    assert f"<value out of range: {far}>" in out and "1970-01-01" in out
    rows = json.loads(run("head", url, "--json").stdout)
    assert rows[0] == {
        "t": f"<value out of range: {far}>",
        "d": f"<value out of range: {2**30}>",
        "l": [f"<value out of range: {far}>"],
        "id": 0,
    }
    # the other values of the column stay values (as in a window without the far one)
    assert rows[1]["id"] == 1 and rows[1]["t"].startswith("1970-01-01T00:00:00"), rows[1]
    lines = run("head", url, "--jsonl").stdout.splitlines()
    assert json.loads(lines[0])["t"] == f"<value out of range: {far}>"


# -- a first round whose column is all None ------------------------------------------------


@pytest.mark.parametrize(
    ("empty", "later", "kind"),
    [
        (None, 5, pa.int64()),
        ([], [1, 2], pa.list_(pa.int64())),
        (None, [1, 2], pa.list_(pa.int64())),
        ({"a": None}, {"a": "x"}, pa.struct([("a", pa.string())])),
        ([None], [1.5], pa.list_(pa.float64())),
    ],
    ids=["none-int", "empty-list", "none-list", "struct-null-field", "list-of-none"],
)
def test_an_all_null_first_round_does_not_freeze_the_type(url, empty, later, kind) -> None:
    store = Store.open(url, create=True)
    store.append([{"id": 0, "c": empty}, {"id": 1, "c": None}])
    assert store.append([{"id": 2, "c": later}]) == 2
    store.append([{"id": 3, "c": None}])
    reopened = Store.open(url)
    snap = reopened.snapshot()
    assert snap.schema.field("c").type == kind
    assert snap.to_arrow().column("c").type == kind
    expected_first = [empty, None] if empty != [None] else [[None], None]
    assert snap.to_arrow().column("c").to_pylist() == [*expected_first, later, None]
    # Version 1 keeps the schema it was committed with.
    assert reopened.snapshot(1).to_arrow().column("c").to_pylist() == expected_first
    assert VersionedDataset(url)[2]["c"] == later
    assert verify_store(reopened).problems == []
    # Once concrete, the type holds: another type is a mismatch naming the column.
    with pytest.raises(SchemaMismatchError, match="c"):
        store.append([{"id": 4, "c": "text"}])


def test_reserved_source_column_accepts_nulls_in_the_first_round(url) -> None:
    store = Store.open(url, create=True)
    store.append([{"id": 0, "_dynstate_source": None}])
    assert store.snapshot().schema.field("_dynstate_source").type == pa.list_(pa.int64())
    store.append([{"id": 1, "_dynstate_source": [0]}])
    column = Store.open(url).snapshot().to_arrow().column("_dynstate_source")
    assert column.to_pylist() == [None, [0]]


def test_a_promoted_column_survives_compaction(tmp_path) -> None:
    from dynstate.maintenance.compact import compact

    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"id": 0, "c": None}])
    store.append([{"id": 1, "c": 7}])
    compact(store)
    snap = Store.open(url).snapshot()
    assert snap.to_arrow().to_pylist() == [{"id": 0, "c": None}, {"id": 1, "c": 7}]
    assert verify_store(Store.open(url)).problems == []


def test_staged_parts_of_an_old_null_schema_after_promotion(tmp_path) -> None:
    """A part staged while the column was still null, committed after another writer made
    the column int64: refused with the typed error that names the schema change."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"id": 0, "c": None}])
    part = store.stage([{"id": 1, "c": None}])
    Store.open(url).append([{"id": 2, "c": 3}])
    with pytest.raises(SchemaMismatchError, match=r"schema of .* changed at version 2"):
        store.commit_staged([part])
    assert Store.open(url).head == 2


# -- sampler states with values that are not plain Python types -------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("epoch", np.int64(0)),
        ("position", np.int32(0)),
        ("seed", np.uint64(1)),
        ("fresh_share", np.float64(0.25)),
        ("shuffle", np.bool_(True)),
        ("format", np.int64(2)),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else v,
)
def test_a_sampler_state_of_numpy_values_is_refused(tmp_path, key, value) -> None:
    """np.int64(0) passed the check and overflowed later (a numpy int counts modulo 2**64)."""
    from dynstate import StateMismatchError, VersionedSampler

    url = str(tmp_path / "store")
    filled(url)
    sampler = VersionedSampler(VersionedDataset(url), seed=1)
    list(sampler)
    good = sampler.state_dict()
    assert all(type(v) in (int, float, str, bool, type(None)) for v in good.values())
    fresh = VersionedSampler(VersionedDataset(url), seed=1)
    before = fresh.state_dict()
    with pytest.raises(StateMismatchError) as info:
        fresh.load_state_dict({**good, key: value})
    message = str(info.value)
    assert f"{key}=" in message and "numpy." in message and "plain" in message, message
    assert fresh.state_dict() == before
    fresh.load_state_dict(good)  # the same state with plain values loads


def test_numpy_settings_give_a_plain_state(tmp_path) -> None:
    from dynstate import VersionedSampler

    url = str(tmp_path / "store")
    filled(url)
    sampler = VersionedSampler(
        VersionedDataset(url), seed=np.int64(3), batch_size=np.int64(2), mode="mix",
        lag=np.int64(2), fresh_share=np.float64(0.5),
    )  # fmt: skip
    list(sampler)
    state = sampler.state_dict()
    assert all(type(v) in (int, float, str, bool, type(None)) for v in state.values()), state
    VersionedSampler(
        VersionedDataset(url), seed=3, batch_size=2, mode="mix", lag=2, fresh_share=0.5
    ).load_state_dict(state)


# -- export / plot never write into another store ----------------------------------------------


@pytest.fixture
def two_stores(tmp_path) -> tuple[str, str]:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    filled(a)
    filled(b)
    return a, b


def _shard(url: str) -> str:
    return os.path.join(url, "data", sorted(os.listdir(os.path.join(url, "data")))[0])


@pytest.mark.parametrize("command", ["export", "plot"])
@pytest.mark.parametrize(
    ("target", "where"),
    [
        (lambda b: os.path.join(b, m.STORE_FILE), "lies inside"),
        (_shard, "lies inside"),
        (lambda b: os.path.join(b, RECORD), "lies inside"),
        (lambda b: os.path.join(b, "new.png"), "lies inside"),
        (lambda b: os.path.join(b, "data", "sub", "x.png"), "lies inside"),
    ],
    ids=["store.json", "shard", "record", "new-file", "new-folder"],
)
def test_export_and_plot_never_write_into_another_store(two_stores, command, target, where):
    a, b = two_stores
    before_a, before_b = files(a), files(b)
    out = target(b)
    for extra in ((), ("--overwrite", "--yes")):
        err = run(command, a, out, *extra, code=1).stderr
        assert err.startswith(f"error: cannot {command} to {out}: it {where} the dynstate store "
                              f"at {b}"), err  # fmt: skip
        assert "choose an OUT outside every store" in err
    assert files(a) == before_a and files(b) == before_b
    assert not os.path.exists(os.path.join(b, "data", "sub"))
    assert Store.open(b).snapshot().to_arrow().to_pylist() == ROWS


def test_export_onto_another_store_root_is_refused(two_stores) -> None:
    import dynstate

    a, b = two_stores
    before = files(b)
    for fmt in ("parquet", "datasets"):
        err = run("export", a, b, "--format", fmt, "--overwrite", "--yes", code=1).stderr
        assert err.startswith(f"error: cannot export to {b}: it is the dynstate store at {b}")
        with pytest.raises(dynstate.InvalidDataError, match="it is the dynstate store"):
            dynstate.export(Store.open(a).snapshot(), b, fmt=fmt, overwrite=True)
    assert files(b) == before


def test_overwrite_of_a_datasets_export_that_holds_a_store_is_refused(two_stores, tmp_path):
    """A datasets export directory may be replaced, unless a store was put inside it."""
    a, _ = two_stores
    out = tmp_path / "export"
    run("export", a, str(out), "--format", "datasets")
    inner = str(out / "inner")
    filled(inner)
    before = files(str(out))
    err = run("export", a, str(out), "--format", "datasets", "--overwrite", "--yes", code=1)
    assert err.stderr.startswith(
        f"error: cannot replace {out}: it contains the dynstate store at {inner}"
    ), err.stderr
    assert files(str(out)) == before


@pytest.mark.parametrize(
    "column",
    [
        pa.array([2**62], pa.timestamp("s")),
        pa.array([[2**62]], pa.list_(pa.timestamp("s", tz="UTC"))),
        pa.array([{"a": -(2**62)}], pa.struct([("a", pa.timestamp("s"))])),
    ],
    ids=["timestamp", "list", "struct"],
)
def test_a_seconds_timestamp_parquet_cannot_store_is_refused_before_writing(url, column):
    """Parquet keeps timestamp[s] as milliseconds: the writer failed with a bare ArrowInvalid
    after the round's lease was taken."""
    from dynstate import InvalidDataError

    store = Store.open(url, create=True)
    before = files(url)
    with pytest.raises(InvalidDataError, match=r"column 't' of this round .* timestamp\[s\]"):
        store.append(pa.table({"id": [9], "t": column}))
    assert files(url) == before
    assert Store.open(url).head == 0


@pytest.mark.parametrize("version", [-5, 10**30, 2.0, True, "1"], ids=repr)
def test_a_tag_naming_no_count_is_a_corrupt_store_error(url, version) -> None:
    filled(url)
    tamper(url, m.tag_path("t"), version=version)
    before = files(url)
    with pytest.raises(CorruptStoreError) as info:
        _read_tag(url)
    check_refused(info.value, m.tag_path("t"), "names no version", "restore it")
    assert files(url) == before


@pytest.mark.parametrize(
    ("rel", "fields", "says"),
    [
        (RECORD, {"base": {"chunks": [], "tail": 7}}, "shard list tail 7, not a list"),
        ("schema", {"arrow": 5}, "does not hold a readable Arrow schema"),
        ("schema", {"arrow": None}, "does not hold a readable Arrow schema"),
    ],
    ids=["shard-list-tail", "schema-arrow-int", "schema-arrow-null"],
)
def test_a_shard_list_or_schema_of_wrong_types_is_a_corrupt_store_error(url, rel, fields, says):
    store = filled(url)
    if rel == "schema":
        rel = m.schema_path(store.commit_record(1).schema)
    tamper(url, rel, **fields)
    before = files(url)
    with pytest.raises(CorruptStoreError) as info:
        _read_version_1(url)
    check_refused(info.value, rel, says)
    assert files(url) == before


# -- through the installed console script ------------------------------------------------------


def _console_script() -> str:
    import shutil
    import sys

    path = shutil.which("dynstate") or os.path.join(os.path.dirname(sys.executable), "dynstate")
    assert os.path.exists(path), "the dynstate console script is not installed"
    return path


def test_console_script_reports_hostile_files_in_one_line(tmp_path) -> None:
    """The installed `dynstate`: a 200k-deep record, a lease of pid 10**30 and a timestamp past
    year 9999 give one `error:` line (or the output), never a traceback."""
    import subprocess

    url = str(tmp_path / "store")
    store = filled(url)
    store.stage([{"id": 3, "text": "d"}])
    lease = _lease_of(store)
    body = m.decode(store.storage.read(lease_path(lease)), lease)
    store.storage.put(lease_path(lease), m.encode({**body, "host": host_id(), "pid": 10**30}))
    far = Store.open(str(tmp_path / "far"), create=True)
    far.append(pa.table({"t": pa.array([2**62], pa.timestamp("us"))}))

    def dynstate(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([_console_script(), *args], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "COLUMNS": "200"})  # fmt: skip

    done = dynstate("gc", url, "--grace", "0", "--yes")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    done = dynstate("head", str(tmp_path / "far"))
    assert done.returncode == 0 and f"<value out of range: {2**62}>" in done.stdout, done.stderr
    write(url, RECORD, DEEP)
    done = dynstate("show", url, "1")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.startswith(f"error: {url}/{RECORD} nests deeper than 64 levels")
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1
