"""The shard sink's writer thread (issue 23): past ``PIPELINE_AFTER`` bytes a local shard is
hashed and written on a thread of its own. It must write the bytes, digests and row groups
the inline path writes; an error on that thread (a full disk) must raise from the append,
which then leaves the store as it was; and no thread may outlive the shard it wrote."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dynstate import Store
from dynstate.records import manifest as m
from dynstate.records.rowgroups import write_shard
from dynstate.storage import base

WRITER = "dynstate-shard-writer"


def _large_table(rows: int = 400_000) -> pa.Table:
    """~12 MiB of Arrow data that Parquet cannot shrink much: several writer batches."""
    rng = np.random.default_rng(7)
    ids = np.arange(rows, dtype=np.int64)
    return pa.table({
        "id": ids,
        "reward": rng.random(rows),
        "label": pa.array(np.array(["a", "b", "c"])[rng.integers(0, 3, rows)]),
        "prompt": pa.array([f"task-{i}" for i in range(rows)]),
    })  # fmt: skip


def _writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WRITER]


def _count_writers(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    started: list[object] = []
    original = base._ShardWriter

    class Counted(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object) -> None:
            started.append(self)
            super().__init__(*args)

    monkeypatch.setattr(base, "_ShardWriter", Counted)
    return started


def _write(path: Path, table: pa.Table, pipeline_after: int) -> tuple[str, object, int]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        sink = base.ShardSink(fd, pipeline_after=pipeline_after)
        groups = write_shard(table, sink)
        sink.finish()
        return sink.sha256, groups, sink.size
    finally:
        os.close(fd)


def test_the_writer_thread_writes_what_the_inline_path_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A small bound on the bytes in flight, so that the encoder also waits for the thread.
    monkeypatch.setattr(base, "_IN_FLIGHT_BYTES", 1 << 20)
    started = _count_writers(monkeypatch)
    table = _large_table()
    inline = _write(tmp_path / "inline.parquet", table, pipeline_after=1 << 62)
    assert started == []
    piped = _write(tmp_path / "piped.parquet", table, pipeline_after=base.PIPELINE_AFTER)
    assert len(started) == 1  # the large shard did go through the thread
    data = (tmp_path / "piped.parquet").read_bytes()
    assert len(data) > 4 * base._BATCH_BYTES
    assert data == (tmp_path / "inline.parquet").read_bytes()
    assert piped == inline
    assert piped[0] == hashlib.sha256(data).hexdigest() and piped[2] == len(data)
    assert _writers() == []


def test_a_large_append_through_the_thread_is_what_it_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = _count_writers(monkeypatch)
    store = Store.open(str(tmp_path / "s"), create=True)
    table = _large_table()
    version = store.append(table)
    assert started  # the round's shard was large enough for the thread
    assert _writers() == []
    (shard,) = store.log.commit_record(version).add
    data = (tmp_path / "s" / shard.path).read_bytes()
    assert (shard.bytes, shard.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert shard.groups is not None
    assert Store.open(str(tmp_path / "s")).snapshot().to_arrow().equals(table)


def test_a_small_round_starts_no_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = _count_writers(monkeypatch)
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"a": i, "b": f"row {i}"} for i in range(64)])
    assert started == []


def _full_disk_on_the_writer(monkeypatch: pytest.MonkeyPatch, after: int) -> list[OSError]:
    """The writer thread's ``after``-th writev and every later one fail with ENOSPC."""
    raised: list[OSError] = []
    writev = os.writev
    calls = 0

    def full(fd: int, buffers: object) -> int:
        nonlocal calls
        if threading.current_thread().name == WRITER:
            calls += 1
            if calls >= after:
                exc = OSError(errno.ENOSPC, "No space left on device (injected)")
                raised.append(exc)
                raise exc
        return writev(fd, buffers)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "writev", full)
    return raised


@pytest.mark.parametrize("after", [1, 3, 10**6])
def test_a_write_error_on_the_thread_raises_from_append_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: int
) -> None:
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"id": -1, "reward": 0.0, "label": "x", "prompt": "first"}])
    data_dir = tmp_path / "s" / m.DATA_DIR
    before = sorted(p.name for p in data_dir.iterdir())
    table = _large_table()
    if after == 10**6:
        # the last batch fails: the error can only come from the sink's finish()
        monkeypatch.setattr(base, "_IN_FLIGHT_BYTES", 1 << 40)
        monkeypatch.setattr(base, "_BATCH_BYTES", 1 << 40)
        after = 1
    raised = _full_disk_on_the_writer(monkeypatch, after)
    with pytest.raises(OSError) as info:
        store.append(table)
    assert raised and info.value is raised[0]  # the thread's own error, as an inline write's
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert _writers() == []
    fresh = Store.open(str(tmp_path / "s"))
    assert fresh.head == 1
    assert sorted(p.name for p in data_dir.iterdir()) == before  # the partial shard removed
    assert list((tmp_path / "s" / m.META_DIR / "leases").iterdir()) == []
    assert [p for p in (tmp_path / "s").rglob(".tmp-*")] == []
    assert store.append(table.slice(0, 5)) == 2
    assert fresh.snapshot(2).num_rows == 6


def test_an_error_the_sink_meets_raises_from_finish(tmp_path: Path, monkeypatch) -> None:
    raised = _full_disk_on_the_writer(monkeypatch, 1)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        sink = base.ShardSink(fd, pipeline_after=1)
        with pytest.raises(OSError) as info:
            sink.write(b"x")  # inline; starts the thread
            sink.write(b"y" * 100)  # queued on finish: only the thread sees it fail
            sink.finish()
        assert info.value is raised[0]
        with pytest.raises(RuntimeError):
            sink.sha256  # noqa: B018 - the digest of bytes never written is not known
        sink.abort()
    finally:
        os.close(fd)
    assert _writers() == []


def test_writev_all_resumes_after_short_writes(tmp_path: Path, monkeypatch) -> None:
    writev = os.writev

    def short(fd: int, buffers: list[memoryview]) -> int:
        assert len(buffers) <= base._IOV_MAX
        return writev(fd, [memoryview(b"".join(buffers))[:5]])  # at most 5 bytes a call

    monkeypatch.setattr(os, "writev", short)
    monkeypatch.setattr(base, "_IOV_MAX", 3)
    parts = [b"abc", b"", b"defghij", b"k", b"lmnopqrstu", b"vw"]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        base.writev_all(fd, [memoryview(p) for p in parts])
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"".join(parts)
