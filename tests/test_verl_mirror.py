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
