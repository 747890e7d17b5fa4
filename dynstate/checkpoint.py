"""What a training checkpoint refers to: store, version, position and the next batch's rows.

Reads a verl ``global_step_N`` directory, a ``data.pt`` file or any ``torch.save``d dict that
holds a StatefulDataLoader state with a :class:`~dynstate.VersionedSampler` inside.
"""

from __future__ import annotations

import os
from typing import Any

from .dataset import VersionedDataset, decode_index
from .errors import StateMismatchError, StoreNotFoundError
from .sampler import VersionedSampler, find_sampler_state


def load_checkpoint_state(path: str) -> tuple[str, dict[str, Any]]:
    """(file read, sampler state) of the checkpoint at ``path``."""
    import torch

    file = path
    if os.path.isdir(path):
        candidates = [os.path.join(path, name) for name in ("data.pt", "latest.pt")]
        found = [c for c in candidates if os.path.isfile(c)]
        if not found:
            raise StoreNotFoundError(
                f"{path} holds no data.pt; pass a verl global_step_N directory or a data.pt file"
            )
        file = found[0]
    if not os.path.isfile(file):
        raise StoreNotFoundError(f"no checkpoint at {path}; pass a directory or a .pt file")
    try:
        obj = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises a zoo of types for bad files
        raise StateMismatchError(
            f"{file} could not be loaded with torch.load(weights_only=True): {exc}"
        ) from exc
    state = find_sampler_state(obj)
    if state is None:
        raise StateMismatchError(
            f"{file} holds no dynstate sampler state; was the run's train sampler a "
            "dynstate.VersionedSampler?"
        )
    return file, state


def describe_checkpoint(
    path: str,
    *,
    store_url: str | None = None,
    storage_options: dict[str, Any] | None = None,
    rows: int | None = None,
) -> dict[str, Any]:
    """Where the checkpoint at ``path`` is in its store, and the rows of its next batch.
    ``store_url`` overrides the (redacted) URL recorded in the state."""
    file, state = load_checkpoint_state(path)
    url = store_url or state["store_url"]
    info: dict[str, Any] = {
        "checkpoint": file,
        "store_url": state["store_url"],
        "store_id": state["store_id"],
        **{k: state[k] for k in ("mode", "epoch", "version", "position", "base_rows", "step")},
        "seed": state["seed"],
    }
    dataset = VersionedDataset(url, storage_options=storage_options)
    sampler = VersionedSampler(
        dataset,
        shuffle=state["shuffle"],
        seed=state["seed"],
        mode=state["mode"],
        batch_size=state["batch_size"],
        fresh_share=state["fresh_share"],
        lag=state["lag"],
        wait_timeout=5.0,
    )
    sampler.load_state_dict(state)  # checks the store id, and that the version still exists
    info["head"] = dataset.store.head
    n = rows or state["batch_size"] or 8
    indices = []
    try:
        for index in sampler:
            indices.append(index)
            if len(indices) == n:
                break
    except TimeoutError as exc:
        info["next_error"] = str(exc)
    info["next_version"] = sampler.version
    info["next_epoch"] = sampler.epoch
    info["next_indices"] = [decode_index(i)[1] for i in indices]
    info["next_rows"] = dataset.__getitems__(indices) if indices else []
    return info
