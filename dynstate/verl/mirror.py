"""Mirroring verl checkpoints next to the store, so a run resumes on a fresh machine.

verl writes ``global_step_N/`` folders and ``latest_checkpointed_iteration.txt`` under
``trainer.default_local_dir``. :func:`push` copies one step's folder to a mirror URL (any
fsspec URL: ``s3://bucket/runs/run1-checkpoints``) and then the tracker file, so the mirror
never names a step whose upload did not finish. :func:`pull` brings the step the mirror's
tracker names back into an empty local folder.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from ..errors import CorruptStoreError, StorageError, StoreNotFoundError
from ..loading.checkpoint import sync_checkpoint, write_durably
from ..storage import Location, open_location, redact

log = logging.getLogger("dynstate")

TRACKER = "latest_checkpointed_iteration.txt"


def _mirror(url: str, storage_options: dict[str, Any] | None) -> tuple[Location, str]:
    where = open_location(url, storage_options)
    return where, where.path.rstrip("/")


def push(
    local_root: str, step: int, url: str, storage_options: dict[str, Any] | None = None
) -> None:
    """Copy ``local_root/global_step_<step>`` to ``url``, then point the mirror's tracker at it.
    A failure leaves the local checkpoint intact and the mirror's tracker where it was."""
    folder = os.path.join(local_root, f"global_step_{step}")
    if not os.path.isdir(folder):
        raise StoreNotFoundError(f"no checkpoint folder {folder} to mirror to {redact(url)}")
    where, root = _mirror(url, storage_options)
    where.upload(folder, f"{root}/global_step_{step}")
    where.write(f"{root}/{TRACKER}", str(step).encode())
    log.info("mirrored global_step_%d to %s", step, redact(url))


def latest_step(url: str, storage_options: dict[str, Any] | None = None) -> int | None:
    """The step the mirror's tracker names, or None if the mirror holds no checkpoint."""
    where, root = _mirror(url, storage_options)
    tracker = f"{root}/{TRACKER}"
    try:
        text = where.read(tracker)
    except FileNotFoundError:
        return None
    try:
        return int(text.decode().strip())
    except (UnicodeDecodeError, ValueError):
        raise CorruptStoreError(
            f"the tracker {where.show(tracker)} of the checkpoint mirror does not hold a step "
            f"number ({text[:40]!r}); write the step of a complete global_step_N folder there, "
            "or remove it"
        ) from None


def pull(local_root: str, url: str, storage_options: dict[str, Any] | None = None) -> int | None:
    """Bring the mirror's latest ``global_step_N`` into ``local_root`` and write the local
    tracker; returns N, or None when the mirror is empty. Never overwrites a local step."""
    step = latest_step(url, storage_options)
    if step is None:
        return None
    target = os.path.join(local_root, f"global_step_{step}")
    if os.path.exists(target):
        raise StorageError(
            f"{target} already exists; not overwriting it with the copy from {redact(url)}"
        )
    where, root = _mirror(url, storage_options)
    os.makedirs(local_root, exist_ok=True)
    partial = f"{target}.partial"
    if os.path.exists(partial):  # an earlier pull's, cut short: only this function writes it
        log.warning("removing %s, left by an interrupted fetch from %s", partial, redact(url))
        shutil.rmtree(partial)
    where.download(f"{root}/global_step_{step}", partial)
    # durable before the tracker names it: after a power cut the local tracker never names a
    # torn copy (the mirror would no longer be asked, the local folder not being empty)
    sync_checkpoint(partial)
    os.replace(partial, target)
    write_durably(os.path.join(local_root, TRACKER), str(step).encode())
    log.info("fetched global_step_%d from %s", step, redact(url))
    return step


def push_saved(trainer: Any, step: int, settings: Any) -> None:
    """After verl saved ``global_step_<step>`` under ``trainer.default_local_dir`` (verl's
    ``trainer`` config): mirror it, when ``settings`` (the dataset's ``data.dynstate``) name a
    ``checkpoint_mirror``."""
    if settings.checkpoint_mirror:
        root = str(trainer.default_local_dir)
        push(root, step, settings.checkpoint_mirror, settings.storage_options)


def pull_missing(trainer: Any, settings: Any) -> None:
    """Before verl loads its latest checkpoint: on a fresh machine (no local tracker), with a
    ``checkpoint_mirror`` set and resuming on, bring the mirror's latest checkpoint back."""
    root = str(trainer.default_local_dir)
    url = settings.checkpoint_mirror
    if url and trainer.resume_mode != "disable" and not os.path.exists(os.path.join(root, TRACKER)):
        pull(root, url, settings.storage_options)
