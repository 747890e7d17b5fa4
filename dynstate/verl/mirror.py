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
from typing import Any

import fsspec

from ..errors import StorageError, StoreNotFoundError
from ..storage import redact

log = logging.getLogger("dynstate")

TRACKER = "latest_checkpointed_iteration.txt"


def _fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs, root.rstrip("/")


def push(
    local_root: str, step: int, url: str, storage_options: dict[str, Any] | None = None
) -> None:
    """Copy ``local_root/global_step_<step>`` to ``url``, then point the mirror's tracker at it."""
    folder = os.path.join(local_root, f"global_step_{step}")
    if not os.path.isdir(folder):
        raise StoreNotFoundError(f"no checkpoint folder {folder} to mirror to {redact(url)}")
    fs, root = _fs(url, storage_options)
    try:
        fs.put(folder, f"{root}/global_step_{step}", recursive=True)
        fs.pipe_file(f"{root}/{TRACKER}", str(step).encode())
    except OSError as exc:
        raise StorageError(
            f"could not mirror global_step_{step} to {redact(url)}: {exc}; the local "
            "checkpoint is intact — check the mirror's credentials and retry"
        ) from exc
    log.info("mirrored global_step_%d to %s", step, redact(url))


def latest_step(url: str, storage_options: dict[str, Any] | None = None) -> int | None:
    """The step the mirror's tracker names, or None if the mirror holds no checkpoint."""
    fs, root = _fs(url, storage_options)
    try:
        return int(fs.cat_file(f"{root}/{TRACKER}").decode().strip())
    except FileNotFoundError:
        return None


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
    fs, root = _fs(url, storage_options)
    os.makedirs(local_root, exist_ok=True)
    partial = f"{target}.partial"
    fs.get(f"{root}/global_step_{step}/", partial + "/", recursive=True)
    os.replace(partial, target)
    with open(os.path.join(local_root, TRACKER), "w") as fh:
        fh.write(str(step))
    log.info("fetched global_step_%d from %s", step, redact(url))
    return step
