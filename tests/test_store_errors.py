"""Every store-level bad input of SPEC §3.9 raises its typed error and changes nothing.

"Changes nothing" is checked by listing every file under the store root with its bytes before
and after the failing call.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator

import fsspec
import pandas as pd
import pyarrow as pa
import pytest
from conftest import s3_url
from fsspec.implementations.memory import MemoryFileSystem

from dynstate import (
    ChecksumMismatchError,
    ConcurrencyUnsupportedError,
    CorruptStoreError,
    DynstateError,
    InvalidDataError,
    MissingShardError,
    SchemaMismatchError,
    StorageError,
    Store,
    StoreExistsError,
    StoreNotFoundError,
    UnsafePathError,
    UnsupportedFormatError,
)
from dynstate.records import manifest as m


def listing(store_or_url: Store | str) -> dict[str, bytes]:
    """Every file under the store root (hidden temporaries included) with its content."""
    if isinstance(store_or_url, Store):
        fs, root = store_or_url.storage.fs, store_or_url.storage.root
    else:
        fs, root = fsspec.core.url_to_fs(store_or_url)
    if not fs.exists(root):
        return {}
    return {p[len(root) :]: fs.cat_file(p) for p in sorted(fs.find(root))}


@pytest.fixture
def store(store_url: str) -> Store:
    store = Store.open(store_url, create=True)
    store.append([{"id": 0, "text": "a"}, {"id": 1, "text": "b"}], meta={"step": 0})
    store.append([{"id": 2, "text": "c"}], meta={"step": 1})
    return store


@pytest.fixture(params=["memory", "local"])
def quick_store(request: pytest.FixtureRequest, tmp_path) -> Store:
    """The fixture store where the backend does not matter (the input is refused before any
    I/O), to keep the many parametrized cases off the slower S3 server."""
    url = "memory://dynstate-errors/" + uuid.uuid4().hex if request.param == "memory" else ""
    store = Store.open(url or str(tmp_path / "store"), create=True)
    store.append([{"id": 0, "text": "a"}, {"id": 1, "text": "b"}], meta={"step": 0})
    store.append([{"id": 2, "text": "c"}], meta={"step": 1})
    return store


def fresh(store: Store) -> Store:
    """The same store opened anew, with no cached records or schemas."""
    return Store.open(store.url)


def rewrite(store: Store, rel: str, data: bytes) -> None:
    # Straight to the filesystem: this is an outside actor damaging the store.
    store.storage.fs.pipe_file(store.storage.path(rel), data)


def first_shard(store: Store, version: int = 1) -> str:
    return store.commit_record(version).add[0].path


# -- input the store must refuse -------------------------------------------------------------


@pytest.mark.parametrize(
    ("round_", "named"),
    [
        ([{"id": "zero", "text": "a"}], ["id (int64 -> string)"]),
        ([{"id": 5}], ["missing columns: text"]),
        ([{"id": 5, "text": "x", "extra": 1}], ["unexpected columns: extra"]),
        ([{"ident": 5, "text": "x"}], ["missing columns: id", "unexpected columns: ident"]),
        (pd.DataFrame({"id": [1.5], "text": ["x"]}), ["id (int64 -> double)"]),
    ],
)
def test_schema_mismatch_names_columns(quick_store: Store, round_, named: list[str]) -> None:
    store = quick_store
    before = listing(store)
    with pytest.raises(SchemaMismatchError) as info:
        store.append(round_)
    for text in named:
        assert text in str(info.value)
    assert store.display_url in str(info.value)
    assert listing(store) == before
    assert fresh(store).head == 2


@pytest.mark.parametrize(
    ("round_", "meta"),
    [
        ([{"id": 1, "text": "a"}, {"id": "two", "text": "b"}], None),  # mixed types in a column
        ([{"id": 2**70, "text": "a"}], None),  # no Arrow integer holds it
        ([{"id": 1, "text": object()}], None),
        (pd.DataFrame({"id": [1, 2], "text": ["a", 3]}), None),
        ([{"id": 1, "text": "a"}, "not a dict"], None),
        ({"id": [1], "text": ["a"]}, None),  # a dict of columns is not an accepted type
        (42, None),
        ([{"id": 3, "text": "a"}], {"bad": {1, 2}}),  # meta must be JSON
        ([{"id": 3, "text": "a"}], {"nan": math.nan}),
        ([{"id": 3, "text": "a"}], ["not", "a", "dict"]),
    ],
)
def test_values_arrow_cannot_hold(quick_store: Store, round_, meta) -> None:
    store = quick_store
    before = listing(store)
    with pytest.raises(InvalidDataError, match=store.display_url):
        store.append(round_, meta=meta)
    assert listing(store) == before


def without_tombstones(files: dict[str, bytes]) -> dict[str, bytes]:
    """A discarded lease's outcome stays as a tombstone (gc removes it after a week), so that
    another process holding the part cannot commit it after all."""
    return {k: v for k, v in files.items() if not k.endswith(".outcome.json")}


def test_bad_meta_after_stage_keeps_the_part_for_a_fixed_commit(store: Store) -> None:
    """The refusal changes nothing: the part stays staged (a discard then leaves the store as
    before it), and the same part commits with a fixed meta."""
    before = listing(store)
    part = store.stage([{"id": 9, "text": "z"}])
    staged = listing(store)
    with pytest.raises(InvalidDataError):
        store.commit_staged([part], meta={"x": object()})
    assert listing(store).keys() == staged.keys()  # (a lease renewal may rewrite its file)
    other = store.stage([{"id": 10, "text": "y"}])
    store.discard([other])
    version = store.commit_staged([part], meta={"x": 1})
    assert store.snapshot(version).to_arrow().to_pylist()[-1] == {"id": 9, "text": "z"}
    assert before.keys() <= listing(store).keys()


def test_staged_parts_with_different_schemas(store: Store) -> None:
    """Parts whose schemas no one version can hold (a new column typed one way in one part,
    another way in the other) are refused, the store as it was. (A new nullable column that
    only one part brings makes one round: see test_small_fixes.)"""
    before = listing(store)
    a = store.stage([{"id": 9, "text": "z", "more": "one"}], allow_new_columns=True)
    b = store.stage([{"id": 9, "text": "z", "more": 1.0}], allow_new_columns=True)
    with pytest.raises(SchemaMismatchError, match="more"):
        store.commit_staged([a, b])
    assert without_tombstones(listing(store)) == before


# -- damaged stores: reading raises and repairs/removes nothing -------------------------------


def check_read_fails(store: Store, version: int, error: type[DynstateError], text: str) -> None:
    before = listing(store)
    with pytest.raises(error, match=text) as info:
        fresh(store).snapshot(version).to_arrow()
    assert store.display_url in str(info.value)
    assert listing(store) == before


def test_truncated_shard(store: Store) -> None:
    rel = first_shard(store)
    data = store.storage.read(rel)
    rewrite(store, rel, data[: len(data) // 2])
    check_read_fails(store, 1, ChecksumMismatchError, "truncated")
    check_read_fails(store, 2, ChecksumMismatchError, "truncated")  # later versions use it


def test_missing_shard(store: Store) -> None:
    store.storage.fs.rm_file(store.storage.path(first_shard(store)))
    check_read_fails(store, 2, MissingShardError, "missing")
    with pytest.raises(FileNotFoundError):  # ordinary except clauses still work
        fresh(store).snapshot(1).to_arrow()


def test_flipped_byte_in_shard(store: Store) -> None:
    rel = first_shard(store)
    data = bytearray(store.storage.read(rel))
    data[len(data) // 2] ^= 0x01
    rewrite(store, rel, bytes(data))
    check_read_fails(store, 1, ChecksumMismatchError, "checksum")


def test_tampered_commit_record(store: Store) -> None:
    rel = m.log_path(1)
    obj = json.loads(store.storage.read(rel))
    obj["num_rows"] = 1000  # checksum left as it was
    rewrite(store, rel, json.dumps(obj).encode())
    check_read_fails(store, 1, ChecksumMismatchError, "checksum")
    check_read_fails(store, 2, ChecksumMismatchError, "checksum")  # replays through record 1


def test_tampered_head_record_fails_its_reads_not_the_open(store: Store) -> None:
    rel = m.log_path(2)
    obj = json.loads(store.storage.read(rel))
    obj["meta"] = {"step": 99}
    rewrite(store, rel, json.dumps(obj).encode())
    before = listing(store)
    # The store opens (its head is found past the damaged record), so older versions read
    # and a reset can leave the damage behind; the damaged version itself never reads.
    opened = fresh(store)
    assert opened.head == 2 and opened.snapshot(1).num_rows == store.snapshot(1).num_rows
    for read in (opened.snapshot, lambda: opened.append([{"id": 5}])):
        with pytest.raises(ChecksumMismatchError, match=rel):
            read()
    assert listing(store) == before


def test_record_pointing_outside_root_s3(s3_endpoint: str) -> None:
    store = Store.open(s3_url(), create=True)
    store.append([{"id": 0}])
    rel = m.log_path(1)
    obj = m.decode(store.storage.read(rel), rel)
    obj["add"][0]["path"] = "../x.parquet"
    rewrite(store, rel, m.encode(obj))
    check_read_fails(store, 1, UnsafePathError, "outside")


def test_unparseable_record(store: Store) -> None:
    rewrite(store, m.log_path(1), b'{"format": 1, "vers')
    check_read_fails(store, 1, CorruptStoreError, "not valid JSON")


@pytest.mark.parametrize(
    "path",
    [
        "../x.parquet",
        "data/../../x.parquet",
        "/etc/passwd.parquet",
        "data/sub/x.parquet",
        "s3://other-bucket/x.parquet",
        "data/.hidden.parquet",
    ],
)
def test_record_pointing_outside_root(quick_store: Store, path: str) -> None:
    store = quick_store
    rel = m.log_path(1)
    obj = m.decode(store.storage.read(rel), rel)
    obj["add"][0]["path"] = path
    rewrite(store, rel, m.encode(obj))  # a valid checksum: only the path check can catch it
    check_read_fails(store, 1, UnsafePathError, "outside")
    check_read_fails(store, 2, UnsafePathError, "outside")


def test_unknown_format_of_store_file(store: Store) -> None:
    obj = m.decode(store.storage.read(m.STORE_FILE), m.STORE_FILE)
    obj["format"] = m.READ_FORMAT + 1
    rewrite(store, m.STORE_FILE, m.encode(obj))
    before = listing(store)
    for create in (False, True):
        with pytest.raises(UnsupportedFormatError, match="upgrade dynstate"):
            Store.open(store.url, create=create)
    assert listing(store) == before


def test_unknown_format_of_record(store: Store) -> None:
    rel = m.log_path(1)
    obj = m.decode(store.storage.read(rel), rel)
    obj["format"] = m.READ_FORMAT + 1
    rewrite(store, rel, m.encode(obj))
    check_read_fails(store, 1, UnsupportedFormatError, "upgrade dynstate")
    # The same at the head: opening refuses rather than guessing, and creates nothing.
    obj = m.decode(store.storage.read(m.log_path(2)), rel)
    obj["format"] = m.READ_FORMAT + 1
    rewrite(store, m.log_path(2), m.encode(obj))
    before = listing(store)
    for create in (False, True):
        with pytest.raises(UnsupportedFormatError):
            Store.open(store.url, create=create)
    assert listing(store) == before


def test_non_store_url(store_url: str) -> None:
    before = listing(store_url)
    with pytest.raises(StoreNotFoundError, match="create=True") as info:
        Store.open(store_url)
    assert isinstance(info.value, FileNotFoundError)
    assert listing(store_url) == before == {}


def test_create_on_foreign_directory(store_url: str) -> None:
    fs, root = fsspec.core.url_to_fs(store_url)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/train.parquet", b"somebody else's data")
    before = listing(store_url)
    with pytest.raises(StoreExistsError, match=r"train\.parquet"):
        Store.open(store_url, create=True)
    assert listing(store_url) == before
    with pytest.raises(StoreNotFoundError):
        Store.open(store_url)


# -- backends that cannot create exclusively ---------------------------------------------------


class NoExclusiveFS(MemoryFileSystem):
    """An object store that ignores If-None-Match: a create silently overwrites."""

    protocol = ("noexcl",)
    store: dict = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("noexcl://"))

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        super().pipe_file(path, value, mode="overwrite", **kwargs)


class FailingWriteFS(MemoryFileSystem):
    """A conforming object store whose data writes fail from the Nth on (a lost link), so
    that retries of transient errors run out too."""

    protocol = ("flaky",)
    store: dict = {}
    pseudo_dirs = [""]
    fail_at: int | None = None
    data_writes = 0

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("flaky://"))

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        if "/data/" in path:
            FailingWriteFS.data_writes += 1
            fail_at = FailingWriteFS.fail_at
            if fail_at is not None and FailingWriteFS.data_writes >= fail_at:
                raise ConnectionResetError("connection reset by peer")
        super().pipe_file(path, value, mode=mode, **kwargs)


@pytest.fixture
def test_protocols() -> Iterator[None]:
    fsspec.register_implementation("noexcl", NoExclusiveFS, clobber=True)
    fsspec.register_implementation("flaky", FailingWriteFS, clobber=True)
    yield
    NoExclusiveFS.store.clear()
    FailingWriteFS.store.clear()


def test_backend_without_exclusive_create(test_protocols: None) -> None:
    url = "noexcl://bucket/store"
    with pytest.raises(ConcurrencyUnsupportedError, match="single_writer=True"):
        Store.open(url, create=True)
    assert listing(url) == {}
    writer = Store.open(url, create=True, single_writer=True)
    assert writer.append([{"id": 1}]) == 1
    assert writer.append([{"id": 2}]) == 2
    # Readers need no promise; a writer without it is refused before it writes anything.
    other = Store.open(url)
    assert other.snapshot().to_arrow().column("id").to_pylist() == [1, 2]
    before = listing(url)
    with pytest.raises(ConcurrencyUnsupportedError, match="If-None-Match"):
        other.append([{"id": 3}])
    with pytest.raises(ConcurrencyUnsupportedError):
        other.tag("t", 1)
    with pytest.raises(ConcurrencyUnsupportedError):
        other.reset(1)
    assert listing(url) == before
    assert Store.open(url, single_writer=True).append([{"id": 3}]) == 3


def test_failed_shard_write_leaves_nothing(test_protocols: None) -> None:
    url = "flaky://bucket/store"
    store = Store.open(url, create=True)
    store.append(pa.table({"id": list(range(10))}))
    before = listing(url)
    FailingWriteFS.data_writes = 0
    FailingWriteFS.fail_at = 3
    try:
        with pytest.raises(StorageError, match="connection reset"):
            store.append(pa.table({"id": list(range(1000))}), shard_bytes=512)
    finally:
        FailingWriteFS.fail_at = None
    assert FailingWriteFS.data_writes >= 3
    assert listing(url) == before
    assert store.append([{"id": 10}]) == 2
    assert Store.open(url).snapshot().num_rows == 11


# -- interrupted commits and storage-level bad input -------------------------------------------


@pytest.mark.parametrize("landed", [True, False])
def test_interrupt_during_the_commit_write_is_resolved_by_reading_back(
    store: Store, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    """Ctrl-C while the record is being written: if it landed, the version stands (the
    interrupt still goes through); if not, the round's shards are removed, as for any
    failed commit. Nothing is guessed."""
    before = listing(store)
    real = type(store.storage)._create

    def interrupted(self, rel: str, data: bytes, durable: bool = True) -> None:
        if rel.startswith(f"{m.META_DIR}/log/"):
            if landed:
                real(self, rel, data, durable)
            raise KeyboardInterrupt
        real(self, rel, data, durable)

    monkeypatch.setattr(type(store.storage), "_create", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.append([{"id": 3, "text": "d"}], meta={"step": 2})
    monkeypatch.undo()
    again = fresh(store)
    if landed:
        assert again.head == 3
        assert again.snapshot().to_arrow().column("id").to_pylist() == [0, 1, 2, 3]
        assert not again.storage.list(f"{m.META_DIR}/leases")
    elif not store.storage.late_requests:
        assert again.head == 2
        assert listing(store) == before
    else:
        # On S3 the interrupted PUT may still reach the server later (here the settling create
        # is interrupted too): the shards are kept, never deleted under a record that may land.
        assert again.head == 2
        added = set(listing(store)) - set(before)
        assert any("/data/" in p for p in added), added


def test_gc_file_without_floor_is_a_typed_error(store: Store) -> None:
    rewrite(store, m.GC_FILE, m.encode({"format": m.FORMAT}))
    before = listing(store)
    with pytest.raises(CorruptStoreError, match=r"gc\.json has no valid floor"):
        Store.open(store.url)
    with pytest.raises(CorruptStoreError, match=r"gc\.json"):
        store.refresh()
    assert listing(store) == before


@pytest.mark.parametrize("groups", ["kept", "dropped"])
def test_shard_row_count_differs_from_its_record(tmp_path, groups: str) -> None:
    """F2: a self-consistent record (checksum valid) whose shard entry says 5 rows for a
    3-row file: reads raise CorruptStoreError naming the shard and version. With its row
    groups recorded, the entry no longer adds up and is refused when the record is read
    (naming the record); without (a store written before row groups), when the shard is."""
    import hashlib
    import json

    from dynstate import CorruptStoreError, VersionedDataset

    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    for i in range(3):
        store.append([{"id": i * 10 + j} for j in range(3)])
    path = tmp_path / "s" / m.log_path(2)
    obj = json.loads(path.read_text())
    obj["add"][0]["rows"] = 5
    obj["num_rows"] += 2
    assert "groups" in obj["add"][0]
    if groups == "dropped":
        del obj["add"][0]["groups"]
    obj.pop("checksum")
    obj["checksum"] = hashlib.sha256(m._canonical(obj)).hexdigest()
    path.write_text(json.dumps(obj))
    shard = obj["add"][0]["path"]
    if groups == "kept":
        with pytest.raises(CorruptStoreError, match="malformed row group entry") as info:
            Store.open(url).snapshot().to_arrow()
        assert m.log_path(2) in str(info.value) and "reset to a version" in str(info.value)
        return
    with pytest.raises(CorruptStoreError, match="version 3") as info:
        Store.open(url).snapshot().to_arrow()
    assert shard in str(info.value) and "5" in str(info.value)
    with pytest.raises(CorruptStoreError, match=shard):
        VersionedDataset(url)[3]


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:1/x", "ftp://no-such-host.invalid/x"])
def test_filesystem_that_connects_in_its_constructor(url: str) -> None:
    """F5: ftp:// connects when the filesystem is built; socket errors become StorageError."""
    from dynstate import StorageError

    with pytest.raises(StorageError, match="could not reach") as info:
        Store.open(url)
    assert url in str(info.value)
