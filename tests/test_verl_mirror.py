"""Checkpoints mirrored next to an S3 store come back on a fresh machine, byte for byte, and
`dynstate inspect` reads the fetched data.pt."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import verl  # noqa: F401 - no importorskip: a broken install must fail these tests
from conftest import s3_url

from dynstate import StorageError, Store
from dynstate.loading.checkpoint import describe_checkpoint
from dynstate.verl.mirror import TRACKER, latest_step, pull, push

sys.path.insert(0, str(Path(__file__).parent))
import resume_harness as h


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_checkpoint_mirror_round_trip_on_s3(s3_endpoint, tmp_path):
    cfg = h.Config(url=s3_url(), steps=5, batch_size=3, ckpt_every=2)
    local = tmp_path / "checkpoints"
    step_dir = local / "global_step_4"
    step_dir.mkdir(parents=True)
    h.train(cfg, ckpt_dir=str(step_dir))  # its last checkpoint is step 4
    os.replace(step_dir / "latest.pt", step_dir / "data.pt")
    (step_dir / "actor").mkdir()
    (step_dir / "actor" / "model.bin").write_bytes(os.urandom(4096))
    (local / TRACKER).write_text("4")

    mirror_url = s3_url()
    assert latest_step(mirror_url) is None
    push(str(local), 4, mirror_url)
    assert latest_step(mirror_url) == 4

    fresh = tmp_path / "fresh-machine"
    assert pull(str(fresh), mirror_url) == 4
    assert _files(fresh / "global_step_4") == _files(step_dir)
    assert (fresh / TRACKER).read_text() == "4"
    info = describe_checkpoint(str(fresh / "global_step_4"))
    assert info["store_id"] == Store.open(cfg.url).store_id

    with pytest.raises(StorageError, match="not overwriting"):
        pull(str(fresh), mirror_url)
    assert pull(str(tmp_path / "empty"), s3_url()) is None


def test_a_pulled_checkpoint_is_durable_before_the_tracker_names_it(
    s3_endpoint, tmp_path, monkeypatch
):
    """Every file and folder of the fetched copy is fsynced before it is renamed into place,
    and the tracker is written by a fsynced temporary file and a rename after that: a power cut
    never leaves a local tracker naming a torn copy. A copy cut short by an earlier pull is
    removed, not merged into."""
    local = tmp_path / "checkpoints"
    step_dir = local / "global_step_3"
    (step_dir / "actor").mkdir(parents=True)
    (step_dir / "data.pt").write_bytes(os.urandom(512))
    (step_dir / "actor" / "model.bin").write_bytes(os.urandom(4096))
    mirror_url = s3_url()
    push(str(local), 3, mirror_url)

    fresh = tmp_path / "fresh-machine"
    stale = fresh / "global_step_3.partial"
    stale.mkdir(parents=True)
    (stale / "half-written.bin").write_bytes(b"x")
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def replace(src, dst) -> None:
        real_replace(src, dst)
        events.append(("replace", str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    assert pull(str(fresh), mirror_url) == 3
    monkeypatch.undo()

    assert _files(fresh / "global_step_3") == _files(step_dir)
    target, tracker = str(fresh / "global_step_3"), str(fresh / TRACKER)
    placed = events.index(("replace", target))
    synced = {p for kind, p in events[:placed] if kind == "fsync"}
    partial = str(stale)
    wanted = {partial, f"{partial}/actor", f"{partial}/data.pt", f"{partial}/actor/model.bin"}
    assert wanted <= synced, sorted(wanted - synced)
    named = events.index(("replace", tracker))
    assert placed < events.index(("fsync", tracker + ".tmp")) < named
    assert ("fsync", str(fresh)) in events[named:]
    assert (fresh / TRACKER).read_text() == "3"
