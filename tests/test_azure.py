"""az:// stores on obstore (dynstate/storage/s3obstore.py) against Azurite, Azure's blob
emulator, on loopback (tests/emulators.py): reads against an oracle that reads the shards whole
with pyarrow through obstore, the exclusive create and a race of two writers, a writer
SIGKILLed mid-commit, and failures as dynstate's typed errors."""

from __future__ import annotations

import io
import os
import random
import signal
import sys
import threading
import uuid
from pathlib import Path

import emulators
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from emulators import AZURE_CONTAINER, AZURE_KEY, azure_env

from dynstate import Store
from dynstate.errors import InvalidDataError, StoreNotFoundError
from dynstate.storage import open_storage

pytest.importorskip("obstore")

from dynstate.storage.s3obstore import ObstoreStorage

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import soak_store

azurite = emulators.azurite  # the session's emulator, a fixture

pytestmark = pytest.mark.azure


@pytest.fixture
def az(azurite, monkeypatch) -> str:
    """A fresh az:// store URL; the emulator's account in the environment (as obstore reads
    it), so that the store opens with no options, here and in child processes."""
    for name, value in azure_env(azurite).items():
        monkeypatch.setenv(name, value)
    return f"az://{AZURE_CONTAINER}/{uuid.uuid4().hex}"


def _oracle(url: str, snapshot) -> pa.Table:
    """The snapshot's rows read independently: each shard whole through a store of obstore's
    own, parsed by pyarrow."""
    import obstore
    from obstore.store import AzureStore

    prefix = url.split("://", 1)[1].split("/", 1)[1]
    store = AzureStore(AZURE_CONTAINER, client_options={"allow_http": True})
    tables = [
        pq.read_table(io.BytesIO(bytes(obstore.get(store, f"{prefix}/{s.path}").bytes())))
        for s in snapshot.shards
    ]
    return pa.concat_tables(tables) if tables else pa.table({})


def _expected(rounds: int) -> list[dict]:
    return [row for k in range(rounds) for row in soak_store.round_rows(k)]


def test_append_and_read_match_the_oracle(az):
    store = Store.open(az, create=True)
    assert isinstance(store.storage, ObstoreStorage) and store.storage.served
    for k in range(4):
        store.append(soak_store.round_rows(k), meta={"round": k}, shard_bytes=512)
    fresh = Store.open(az)
    assert fresh.head == 4
    for version in range(1, 5):
        snap = fresh.snapshot(version)
        got = snap.to_arrow() if snap.num_rows else pa.table({})
        oracle = _oracle(az, snap)
        assert got.to_pylist() == oracle.to_pylist() == _expected(version)
        rng = random.Random(version)
        for row in rng.sample(range(snap.num_rows), min(5, snap.num_rows)):
            shard, offset = snap.locate(row)
            assert (
                snap.read_shard(shard).slice(offset, 1).to_pylist()
                == oracle.take([row]).to_pylist()
            )
    assert len(fresh.snapshot().shards) > 4  # rounds span several 512-byte shards


def test_storage_reads_ranges_listings_and_errors(az):
    storage = open_storage(az)
    assert isinstance(storage, ObstoreStorage)
    storage.retry_base_s = 0.001
    blobs = {"a/x.bin": random.Random(3).randbytes(1000), "a/b/z.bin": b"", "c.json": b"{}"}
    for rel, data in blobs.items():
        storage.create(rel, data)
    for rel, data in blobs.items():
        assert storage.read(rel) == data and storage.size(rel) == len(data)
        assert storage.exists(rel) and storage.modified(rel) is not None
    ranges = [("a/x.bin", 900, 1000), ("a/x.bin", 5, 5), ("c.json", 1, 40), ("c.json", 2, 9)]
    assert storage.read_ranges(ranges) == [blobs[r][s:e] for r, s, e in ranges]
    assert storage.list("") == ["a", "c.json"]
    assert storage.list("a") == ["b", "x.bin"]
    assert storage.list("missing") == []
    assert storage.exists("") and not storage.exists("nope")
    assert storage.read_many(["c.json", "nope"]) == [b"{}", None]
    storage.put("c.json", b"[]")
    assert storage.read("c.json") == b"[]"
    storage.delete("c.json")
    storage.delete("c.json")  # a missing object: nothing to do
    assert not storage.exists("c.json")
    with pytest.raises(FileNotFoundError, match="nope"):  # what callers act on, as on S3
        storage.read("nope")

    missing = open_storage(f"az://no-such-container/{uuid.uuid4().hex}")
    missing.retry_base_s = 0.001
    with pytest.raises(StoreNotFoundError) as info:
        missing.list("")
    # Azure's settings named, not S3's
    assert "AZURE_STORAGE_ENDPOINT" in str(info.value) and "AWS" not in str(info.value)
    with pytest.raises(StoreNotFoundError, match="bucket"):
        missing.check_exclusive_create()


def test_bad_urls_and_options_are_typed_errors(az):
    with pytest.raises(InvalidDataError, match="not_a_key"):
        open_storage(az, {"not_a_key": "1"})
    with pytest.raises(InvalidDataError, match="client_options"):
        open_storage(az, {"client_options": "allow_http"})
    for bad in ("az://", "az://c//p", "az://c/p?x=1"):
        with pytest.raises(InvalidDataError, match="az://"):
            open_storage(bad)


def test_no_secret_in_a_refusal(az, monkeypatch):
    wrong = "V1JPTkcta2V5LXRoYXQtaXMtbm90LWF6dXJpdGVzLW93bi0wMTIzNDU2Nzg5"
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", wrong)
    storage = open_storage(az)
    storage.retry_base_s = 0.001
    from dynstate.errors import StorageError

    with pytest.raises(StorageError) as info:
        storage.create("x.bin", b"1")
    assert wrong not in str(info.value) and AZURE_KEY not in str(info.value)
    assert storage.display_url in str(info.value)
    assert "Azure Blob Storage refused the credentials" in str(info.value), info.value
    assert "AZURE_STORAGE_ACCOUNT_KEY" in str(info.value) and "AWS" not in str(info.value)


def test_exclusive_create_has_one_winner(az):
    storage = open_storage(az)
    assert storage.check_exclusive_create() is True
    wins: list[int] = []
    lost: list[int] = []
    barrier = threading.Barrier(8)

    def race(i: int) -> None:
        barrier.wait()
        try:
            storage.create("race.json", f"writer {i}".encode())
            wins.append(i)
        except FileExistsError:
            lost.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(lost) == 7
    assert storage.read("race.json") == f"writer {wins[0]}".encode()


def test_two_writers_one_wins_the_other_rebases(az):
    """Two stores opened at the same head both commit version 1: the exclusive create lets
    one win; the other meets the conflict and lands its rows as version 2."""
    first = Store.open(az, create=True)
    second = Store.open(az)
    assert first.head == second.head == 0
    assert first.append([{"w": "first"}]) == 1
    assert second.append([{"w": "second"}]) == 2
    rows = Store.open(az).snapshot().to_arrow().to_pylist()
    assert rows == [{"w": "first"}, {"w": "second"}]


@pytest.mark.parametrize("point", ["before-commit", "after-commit"])
def test_writer_killed_mid_commit(az, point):
    store = Store.open(az, create=True)
    for k in range(2):
        store.append(soak_store.round_rows(k), meta={"round": k}, shard_bytes=512)
    ctx = soak_store._context()
    env = {k: v for k, v in os.environ.items() if k.startswith("AZURE_")}
    proc = ctx.Process(target=soak_store.die_at, args=(az, point, env))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == -signal.SIGKILL
    fresh = Store.open(az)
    # every acknowledged version intact; the killed commit landed whole or not at all
    assert fresh.head == (2 if point == "before-commit" else 3)
    for version in range(1, fresh.head + 1):
        assert fresh.snapshot(version).to_arrow().to_pylist() == _expected(version)
    head = fresh.head
    assert fresh.append(soak_store.round_rows(head)) == head + 1
    assert Store.open(az).snapshot().to_arrow().to_pylist() == _expected(head + 1)


def test_a_forced_tag_move_is_conditional_on_the_version_it_read(az) -> None:
    """A forced tag move writes only over the tag it read (Azure's If-Match): a swap whose
    expected bytes are not there any more changes nothing, and moves land in order."""
    store = Store.open(az, create=True)
    for i in range(3):
        store.append([{"i": i}])
    store.tag("t", 1)
    store.tag("t", 2, force=True)
    store.tag("t", 3, force=True)
    assert Store.open(az).tags() == {"t": 3}
    rel = "_dynstate/tags/t.json"
    current = store.storage.read(rel)
    assert not store.storage.swap(rel, b"{}", b"not what is there")
    assert store.storage.read(rel) == current
    assert Store.open(az).snapshot("t").to_arrow().to_pylist() == [{"i": 0}, {"i": 1}, {"i": 2}]
