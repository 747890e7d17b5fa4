"""The local backend's direct-``os`` commit path (issue 23.2): exclusive creates still refuse
an existing name and leave no temporary file, folders appear on the first write into them, a
record is linked only after its shards and ``data/`` are fsynced (the shards' sync overlaps the
record's own write, never its link), a failed shard sync commits nothing, and the schema file
is rewritten only when the parent does not name it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from dynstate import StorageError, Store
from dynstate.records import manifest as m
from dynstate.storage import DeferredSync, open_storage


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".tmp-")]


def test_create_refuses_an_existing_name_and_keeps_its_bytes(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "root"))
    storage.create("_dynstate/log/00000000000000000001.json", b"first")
    with pytest.raises(FileExistsError):
        storage.create("_dynstate/log/00000000000000000001.json", b"second")
    with pytest.raises(FileExistsError):
        storage.create("_dynstate/log/00000000000000000001.json", b"third", durable=False)
    assert storage.read("_dynstate/log/00000000000000000001.json") == b"first"
    assert _tmp_files(tmp_path) == []


def test_folders_are_made_on_the_first_write_into_them(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "root"))
    storage.create("a/b/c.json", b"1")
    storage.put("d/e/f.json", b"2", durable=False)
    storage.put("d/e/f.json", b"3")
    with storage.new_shard("data/g/h.parquet") as sink:
        sink.write(b"4")
    assert storage.read("a/b/c.json") == b"1"
    assert storage.read("d/e/f.json") == b"3"
    assert storage.read("data/g/h.parquet") == b"4"
    assert storage.exists("a/b/c.json") and not storage.exists("a/b/x.json")
    storage.delete("a/b/c.json")
    storage.delete("a/b/c.json")  # a missing file is no error
    assert not storage.exists("a/b/c.json")
    with pytest.raises(FileNotFoundError):
        storage.read("a/b/c.json")
    assert _tmp_files(tmp_path) == []


def test_a_create_whose_ready_fails_creates_nothing(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "root"))

    def not_ready() -> None:
        raise StorageError("the shards could not be synced")

    with pytest.raises(StorageError):
        storage.create("log/1.json", b"record", ready=not_ready)
    assert not storage.exists("log/1.json")
    assert _tmp_files(tmp_path) == []


def test_deferred_sync_closes_each_descriptor_once(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "root"))
    deferred = storage.deferred_sync("data")
    for name in ("a", "b"):
        with storage.new_shard(f"data/{name}.parquet", deferred=deferred) as sink:
            sink.write(b"x" * 10)
    assert deferred.pending
    fds = [fd for _, fd in deferred._fds]
    deferred.run()
    assert not deferred.pending
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed by run
    deferred.close()  # nothing left: no second close
    assert storage.read("data/a.parquet") == b"x" * 10


def _events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every fsync (the path of its descriptor) and link (the new name), in order, from any
    thread."""
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    fsync, link = os.fsync, os.link

    def traced_fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        fsync(fd)
        with lock:
            events.append(("fsync", path))

    def traced_link(src: str, dst: str, *args: object, **kwargs: object) -> None:
        with lock:
            events.append(("link-start", dst))
        link(src, dst, *args, **kwargs)  # type: ignore[arg-type]
        with lock:
            events.append(("link", dst))

    monkeypatch.setattr(os, "fsync", traced_fsync)
    monkeypatch.setattr(os, "link", traced_link)
    return events


def test_record_is_linked_only_after_its_shard_and_data_folder_are_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"a": 1}])
    root = str((tmp_path / "s").resolve())
    for _ in range(5):  # the sync runs on another thread: any interleaving must keep the order
        events = _events(monkeypatch)
        version = store.append([{"a": 2}] * 64)
        record = f"{root}/{m.META_DIR}/log/{version:020d}.json"
        (shard,) = [s.path for s in store.log.commit_record(version).add]
        order = [e for e in events]
        start = order.index(("link-start", record))
        assert order.index(("fsync", f"{root}/{shard}")) < start
        assert order.index(("fsync", f"{root}/data")) < start
        assert ("fsync", f"{root}/{m.META_DIR}/log") in order[start:]
        # the record's own bytes were synced (under their temporary name) before the link
        assert any(k == "fsync" and "/log/.tmp-" in p for k, p in order[:start])
        monkeypatch.undo()
    assert Store.open(str(tmp_path / "s")).snapshot().num_rows == 1 + 5 * 64


def test_a_failed_shard_sync_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"a": 1}])

    def failing_run(self: DeferredSync) -> None:
        self.close()
        raise StorageError("sync of data/ failed (injected)")

    monkeypatch.setattr(DeferredSync, "run", failing_run)
    with pytest.raises(StorageError, match="injected"):
        store.append([{"a": 2}])
    monkeypatch.undo()
    fresh = Store.open(str(tmp_path / "s"))
    assert fresh.head == 1
    assert len(list((tmp_path / "s" / "data").iterdir())) == 1  # the new shard was removed
    assert list((tmp_path / "s" / m.META_DIR / "leases").iterdir()) == []
    assert _tmp_files(tmp_path) == []
    assert store.append([{"a": 3}]) == 2
    assert fresh.snapshot(2).to_arrow().column("a").to_pylist() == [1, 3]


def test_schema_file_is_rewritten_only_when_the_parent_does_not_name_it(tmp_path: Path):
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append(pa.table({"a": [1]}))
    fp = store.log.commit_record(1).schema
    schema_file = tmp_path / "s" / m.META_DIR / "schemas" / f"{fp}.json"
    inode = schema_file.stat().st_ino
    store.append(pa.table({"a": [2]}))
    assert schema_file.stat().st_ino == inode  # the parent names it: not written again
    store.reset(0)  # the head names no schema now
    store.append(pa.table({"a": [3]}))
    assert store.log.commit_record(store.head).schema == fp
    assert schema_file.stat().st_ino != inode  # written again before the record named it
    store.append(pa.table({"a": [4], "b": ["x"]}), allow_new_columns=True)
    new_fp = store.log.commit_record(store.head).schema
    assert new_fp != fp
    assert (tmp_path / "s" / m.META_DIR / "schemas" / f"{new_fp}.json").exists()
    assert Store.open(str(tmp_path / "s")).snapshot().to_arrow().column("a").to_pylist() == [3, 4]


def _hint(root: Path) -> Path:
    return root / m.HEAD_HINT


def test_the_head_hint_is_rewritten_in_place_at_a_fixed_width(tmp_path: Path) -> None:
    """No rename per commit (ext4 starts writing a file renamed over another at the rename):
    the hint keeps its inode, and a shorter version number leaves no tail of a longer one."""
    root = tmp_path / "s"
    store = Store.open(str(root), create=True)
    store.append([{"id": 0}])
    inode = os.stat(_hint(root)).st_ino
    for i in range(1, 4):
        store.append([{"id": i}])
    assert os.stat(_hint(root)).st_ino == inode
    assert _hint(root).read_bytes().decode().strip() == '{"version": 4}'
    # An older, longer hint (as a dynstate before this one left it) is cut to the new one.
    _hint(root).write_bytes(b'{"version": 4}' + b" " * 100)
    store.append([{"id": 4}])
    assert _hint(root).read_bytes().decode().rstrip() == '{"version": 5}'
    assert len(_hint(root).read_bytes()) == 40
    assert Store.open(str(root)).head == 5


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_linked_head_hint_is_replaced_never_written_through(tmp_path: Path, link: str) -> None:
    root = tmp_path / "s"
    store = Store.open(str(root), create=True)
    store.append([{"id": 0}])
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not the store's")
    _hint(root).unlink()
    if link == "symlink":
        _hint(root).symlink_to(outside)
    else:
        os.link(outside, _hint(root))
    store.append([{"id": 1}])
    assert outside.read_bytes() == b"not the store's"
    assert not _hint(root).is_symlink()
    assert _hint(root).read_bytes().decode().strip() == '{"version": 2}'
    assert Store.open(str(root)).head == 2


def test_a_head_hint_overwritten_on_memory_and_naming_no_version_is_ignored(tmp_path) -> None:
    """A hint mixed from an old and a new write names some version or none: either way the
    head is found."""
    root = tmp_path / "s"
    store = Store.open(str(root), create=True)
    for i in range(3):
        store.append([{"id": i}])
    for torn in (b'{"version": 9}', b'{"version": 1}', b'{"vers', b'{"version": 19}'):
        _hint(root).write_bytes(torn.ljust(40))
        assert Store.open(str(root)).head == 3
    memory = Store.open("memory://hint-overwrite", create=True)
    memory.append([{"id": 0}])
    memory.storage.overwrite(m.HEAD_HINT, b'{"version": 7}'.ljust(40))
    assert Store.open("memory://hint-overwrite").head == 1
