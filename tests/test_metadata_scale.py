"""Metadata stays small as commits pile up (SPEC §3.8): its total grows linearly with the
number of commits, and opening the head reads metadata proportional to the head's shards, not
to the history."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from dynstate import Store
from dynstate import manifest as m
from dynstate.maintenance.compact import compact
from dynstate.storage import Storage

N = 300  # versions; the store is grown to 3N (+ a partial checkpoint interval) once


def _metadata_bytes(store: Store) -> int:
    fs = store.storage.fs
    return sum(fs.size(p) for p in fs.find(store.storage.path(m.META_DIR)))


def _open_head_cost(url: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, int]:
    """(reads, bytes read, shards) for a fresh process-like handle to open the head."""
    reads = [0, 0]
    real = Storage.read

    def counting_read(self: Storage, rel: str) -> bytes:
        data = real(self, rel)
        reads[0] += 1
        reads[1] += len(data)
        return data

    with monkeypatch.context() as patch:
        patch.setattr(Storage, "read", counting_read)
        snap = Store.open(url).snapshot()
    return reads[0], reads[1], len(snap.shards)


@pytest.fixture(scope="module")
def grown() -> dict[str, Any]:
    """One store grown in small rounds, measured on the way at N, N + 50, 3N, 3N + 50."""
    url = f"memory://metadata-scale/{uuid.uuid4().hex}"
    store = Store.open(url, create=True)
    marks = {N: "meta", N + 50: "open", 3 * N: "meta", 3 * N + 50: "open"}
    out: dict[str, Any] = {"url": url, "meta": {}, "open": {}}
    monkeypatch = pytest.MonkeyPatch()
    try:
        for step in range(1, 3 * N + 51):
            rows = [{"step": step, "prompt": f"task {step}.{j}", "answer": j} for j in range(3)]
            store.append(rows, meta={"step": step, "generator": "test"})
            if marks.get(step) == "meta":
                out["meta"][step] = _metadata_bytes(store)
            elif marks.get(step) == "open":
                out["open"][step] = _open_head_cost(url, monkeypatch)
    finally:
        monkeypatch.undo()
    out["store"] = store
    return out


def test_metadata_bytes_grow_linearly(grown: dict[str, Any]) -> None:
    small, large = grown["meta"][N], grown["meta"][3 * N]
    assert large <= 3.6 * small, f"{N} versions: {small} B, {3 * N} versions: {large} B"


def test_opening_the_head_reads_metadata_proportional_to_its_shards(grown) -> None:
    reads_small, bytes_small, shards_small = grown["open"][N + 50]
    reads_large, bytes_large, shards_large = grown["open"][3 * N + 50]
    # Records read: at most one checkpoint interval of log records, the chunks of the head's
    # shard list and a few fixed files — not one per version of the history.
    bound = m.CHECKPOINT_INTERVAL + shards_large // m.CHUNK_ENTRIES + 20
    assert reads_large <= bound
    assert reads_large <= reads_small + 10
    # Bytes read follow the shard count (the shard list must be read), not the version count.
    assert bytes_large / shards_large <= 1.3 * bytes_small / shards_small


def test_compaction_shrinks_the_head_shard_list(grown, monkeypatch) -> None:
    store: Store = grown["store"]
    before = _open_head_cost(grown["url"], monkeypatch)
    compact(store)
    reads, nbytes, shards = _open_head_cost(grown["url"], monkeypatch)
    assert shards == 1
    assert nbytes < before[1] / 10
    assert reads < before[0]
