"""verl's ``data.pt`` (a torchdata ``StatefulDataLoader`` state): read, checked against the
store and the checkpoint it lies in, and carried to another worker count.

:func:`checked_resume_state` does every check a resume makes before it changes anything.
:func:`read_loader_state` loads it with ``weights_only=True`` and checks that the dynstate
sampler state inside belongs to the store; :func:`check_checkpoint_step` that it is the state
of its own ``global_step_N`` folder; :func:`sampler_of` finds the sampler a resume loads it
into. A missing ``data.pt`` is a :class:`CheckpointNotFoundError`, anything else that does not
fit a :class:`StateMismatchError`; both change nothing.

Another worker count: torchdata's state has one shape without workers (``_num_yielded`` at the
top) and another with them (``_snapshot`` holding the main process's sampler state and one
entry per worker), and refuses to load one shape into the other (``AssertionError: State
doesn't contain key '_snapshot'``), or a snapshot of 2 workers into 4. The position itself is
not tied to workers: it is the dynstate sampler's state inside, taken when the last trained
batch's indices were drawn, and the dataset keeps no per-worker state. :func:`for_workers`
therefore rewrites the state into the shape of the new worker count, carrying the sampler state
and torchdata's counters over unchanged, so that the resumed loader continues with exactly the
batches the old one would have produced. What it cannot carry (a snapshot older than the last
batch, worker state of a stateful dataset, a layout of another torchdata version) is refused,
naming both worker counts, before anything is changed.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointNotFoundError, StateMismatchError
from ..loading.checkpoint import carry_loader_state, read_checkpoint_file, saved_workers
from ..loading.sampler import VersionedSampler
from ..loading.state import check_state, find_sampler_state
from ..store import Store


def for_workers(state: dict[str, Any], num_workers: int, path: str, url: str) -> dict[str, Any]:
    """``state`` (written by a loader with any worker count) in the shape a ``StatefulDataLoader``
    with ``num_workers`` workers loads (:func:`dynstate.loading.checkpoint.carry_loader_state`).
    Raises :class:`StateMismatchError` naming both counts, in verl's setting, when it cannot be
    carried over exactly; changes nothing."""
    saved = saved_workers(state)

    def refuse(why: str) -> StateMismatchError:
        if saved == num_workers:  # the state itself is damaged
            return StateMismatchError(
                f"{path} cannot be loaded: {why}; resume {url} from an earlier checkpoint"
            )
        was = "an unknown number of" if saved is None else str(saved)
        return StateMismatchError(
            f"{path} was written by a train loader with {was} worker(s) "
            f"(data.dataloader_num_workers), this run has {num_workers}, and {why}; resume "
            f"{url} with data.dataloader_num_workers={saved if saved is not None else 'as before'}"
        )

    return carry_loader_state(state, num_workers, refuse)


def read_loader_state(path: str, store: Store) -> dict[str, Any]:
    """Load a verl ``data.pt`` safely and check that it belongs to ``store``."""
    if not os.path.exists(path):
        raise CheckpointNotFoundError(
            f"no dataloader state at {path}; cannot resume {store.display_url} exactly — "
            "resume from a checkpoint written with DynstateRLDataset (its global_step_N "
            "folder holds data.pt), or restore the file"
        )
    state, sampler_state = read_checkpoint_file(path)
    check_state(sampler_state, store.store_id, store.display_url)
    return state


def check_checkpoint_step(state: dict[str, Any], step: int, path: str, url: str) -> None:
    """``data.pt`` of ``global_step_<step>`` holds the position after ``step`` batches: the
    sampler (numbering verl's steps from 1) is at step ``step + 1``. Another step's ``data.pt``
    (copied, or a folder renamed) would train from the wrong place."""
    saved = state.get("step")
    if state.get("format") == 1 or state.get("batch_size") is None or saved == step + 1:
        return  # format 1 counted no steps in epoch mode; without batch_size none are counted
    after = saved - 1 if isinstance(saved, int) else saved
    raise StateMismatchError(
        f"{path} holds the train loader's position after step {after}, not after step {step} "
        f"(its folder's step); it was copied from another checkpoint of {url} — resume from "
        f"global_step_{after} itself, or restore this folder's own data.pt"
    )


def sampler_of(loader: Any) -> VersionedSampler:
    """The dynstate sampler ``loader`` draws from (directly or through its batch sampler)."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, VersionedSampler):
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if not isinstance(sampler, VersionedSampler):
        raise StateMismatchError(
            "the train loader does not draw from dynstate's sampler, so a dynstate checkpoint "
            "cannot be resumed with it; run `python -m dynstate.verl.main_ppo` (see docs/verl.md)"
        )
    return sampler


def checked_resume_state(
    checkpoint_dir: str, loader: Any, step: int, store: Store, round_version: int | None
) -> dict[str, Any]:
    """The loader state of ``checkpoint_dir`` (``global_step_<step>``), checked in full and
    loaded into ``loader``'s dynstate sampler, in the shape ``loader``'s worker count loads:
    ``data.pt`` belongs to ``store`` and to this very checkpoint, the round of ``step`` is
    on the head's lineage (``round_version``), and the sampler state matches this run's
    settings. Raises before anything is changed; nothing is committed here."""
    path = os.path.join(checkpoint_dir, "data.pt")
    state = read_loader_state(path, store)
    sampler_state = find_sampler_state(state)
    assert sampler_state is not None  # read_loader_state refuses a state without one
    check_checkpoint_step(sampler_state, step, path, store.display_url)
    if round_version is None:
        raise StateMismatchError(
            f"{checkpoint_dir} is a checkpoint of step {step}, but {store.display_url} "
            f"holds no round of step {step} on its head's lineage; it was not written "
            "by dynstate's trainer integration (which commits the round first) — resume "
            "from a checkpoint written with DynstateTrainerMixin"
        )
    sampler = sampler_of(loader)
    try:
        # the loader's own sampler checks the state against this run's settings (and the
        # versions it pins) and refuses, unchanged, what does not match
        sampler.load_state_dict(sampler_state)
    except StateMismatchError as exc:
        raise StateMismatchError(
            f"cannot resume from {path}: {exc}. In verl's config these are data.seed, "
            "data.shuffle, data.train_batch_size and data.dynstate.mode / .lag / "
            ".fresh_share / .select: set them as they were when the checkpoint was written"
        ) from exc
    return for_workers(state, int(loader.num_workers or 0), path, store.display_url)
