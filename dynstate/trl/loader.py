"""The train loader dynstate gives ``GRPOTrainer``, and its state in ``checkpoint-N/``.

TRL's own loader is a ``RepeatSampler`` over a fixed ``datasets.Dataset``; the HF Trainer
measures it once (``len(loader)``) and fixes every epoch's batches at the start, which would
cut a growing store's epochs short. This loader instead:

* draws prompts with a :class:`~dynstate.VersionedSampler` (its own seed: torch's global RNG,
  which the Trainer restores from ``rng_state.pth`` and generation draws from, is never
  touched; the ``StatefulDataLoader`` gets its own ``torch.Generator`` for the same reason);
* repeats each prompt ``num_generations`` times in a row, as ``RepeatSampler`` does, so
  TRL's groups are intact;
* hands the Trainer an endless iterable without ``len()``: the Trainer then counts steps by
  ``max_steps`` and never ends an epoch on its own, while the sampler moves from epoch to epoch
  (each pinning the round of the step before it);
* yields each loader batch ``steps_per_generation * num_iterations`` times (as
  ``RepeatSampler``'s ``repeat_count``): GRPO generates from the first of them and reuses its
  buffer for the rest, so one loader batch is one generation, and the sampler's steps are
  dynstate's (one generation: one optimizer step by default, ``k`` when a generation spans
  ``k``);
* may run ``dataloader_num_workers`` workers: they only read rows. The sampler draws in the
  trainer's process, and an epoch's iterator never prefetches past the epoch's end, so the
  next epoch pins its version when the Trainer asks for its first batch, after the round of
  the step before it has been committed: by step, never by timing.

The state in ``checkpoint-N/dynstate_state.pt`` (plain types, ``weights_only`` loadable):
``{"format": 1, "kind": "dynstate.trl", "store_id", "store_url", "step", "version", "loader"}``
(``step`` is TRL's ``global_step``), plus ``"steps_per_round"`` when a generation spans several
optimizer steps.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from ..errors import CheckpointNotFoundError, InvalidDataError, StateMismatchError
from ..loading.checkpoint import save_durably
from ..loading.dataset import VersionedDataset, decode_index
from ..loading.state import check_state, find_sampler_state
from ..store import Store
from .generator import SOURCE_COLUMN

log = logging.getLogger("dynstate")

STATE_FILE = "dynstate_state.pt"
CARRY_FILE = "dynstate_carry.pt"
CARRY_KIND = "dynstate.trl.carry"
STATE_KIND = "dynstate.trl"
STATE_FORMAT = 1
ROW_KEY = "dynstate_row"
VERSION_KEY = "dynstate_version"


class Items:
    """The store's rows as TRL items: each row's columns plus ``dynstate_row`` and
    ``dynstate_version`` (the version the sampler drew it from); ``_dynstate_source`` is
    left out (lineage, not a prompt's input)."""

    def __init__(self, dataset: VersionedDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return trl_item(self.dataset[index], index)


def trl_item(item: dict[str, Any], index: int) -> dict[str, Any]:
    """A row as a TRL item: ``dynstate_row`` and ``dynstate_version`` (the version the
    sampler drew it from) added, ``_dynstate_source`` (lineage, not a prompt's input) left
    out."""
    version, row = decode_index(index)
    item.pop(SOURCE_COLUMN, None)
    item[ROW_KEY] = row
    item[VERSION_KEY] = version
    return item


class TrlRows(VersionedDataset):
    """The store's rows as TRL items (:func:`trl_item`), for ``DynamicSampling``, which reads
    rows through a :class:`VersionedDataset` of its own: the same items GRPOTrainer gets
    without filtering, so reward functions see the same keyword arguments either way."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        return trl_item(super().__getitem__(index), index)

    def __getitems__(self, indices: Any) -> Any:
        items = super().__getitems__(indices)
        return [trl_item(item, i) for item, i in zip(items, indices, strict=True)]


class Ticks:
    """The Trainer's loader under group filtering: one placeholder batch per micro-step, no
    ``len()``. The prompts are drawn inside the generation (``DynamicSampling``, which may
    draw several generation batches per step), not by the Trainer's loop."""

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield [{"prompt": ""}]


class RepeatCollate:
    """Each item ``times`` times in a row (GRPO's group of one prompt's responses)."""

    def __init__(self, times: int):
        self.times = times

    def __call__(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [item for item in items for _ in range(self.times)]


class EndlessBatches:
    """The loader's batches, epoch after epoch, each ``repeat`` times; no ``__len__``."""

    def __init__(self, loader: Any, repeat: int, url: str):
        self.loader = loader
        self.repeat = repeat
        self.url = url

    def __iter__(self) -> Iterator[Any]:
        empty = 0
        while True:
            got = False
            for batch in self.loader:
                got = True
                for _ in range(self.repeat):
                    yield batch
            empty = 0 if got else empty + 1
            if empty >= 2:  # one empty pass may be a finished epoch restored from a checkpoint
                raise InvalidDataError(
                    f"the train loader over {self.url} yields no batches; the store has no "
                    "rows to train on — append the first tasks before training"
                )


def checkpoint_state(
    loader: Any,
    store: Store,
    step: int,
    version: int,
    filter_settings: Any = None,
    steps_per_round: int = 1,
    processes: int | None = None,
    model_only: bool = False,
) -> dict[str, Any]:
    state: dict[str, Any] = {
        "format": STATE_FORMAT,
        "kind": STATE_KIND,
        "store_id": store.store_id,
        "store_url": store.display_url,
        "step": int(step),
        "version": int(version),
        "loader": loader.state_dict(),
    }
    if filter_settings is not None:
        state["filter_groups"] = filter_settings
    if processes is not None:  # filter_groups: each rank's share of the carry is its own
        state["processes"] = int(processes)
    if steps_per_round != 1:  # absent: 1, as every checkpoint saved before it existed
        state["steps_per_round"] = int(steps_per_round)
    if model_only:  # save_only_model: no optimizer, scheduler or RNG state beside it
        state["save_only_model"] = True
    return state


def save_carry(folder: str, step: int, carry: list[tuple[int, Any, dict[str, Any]]]) -> None:
    """``checkpoint-N/dynstate_carry.pt``: the groups step N carries to step N + 1, as
    ``(row, scores, completions)``, in the consumption record's order (every process's,
    rank by rank), the completions as GRPOTrainer's tensors (one dict of ``num_generations``
    rows per group). The store holds the carry's rows and scores (the step's consumption
    record), not its completions: a resume trains them from here, as the uninterrupted run
    does."""

    state = {
        "format": STATE_FORMAT,
        "kind": CARRY_KIND,
        "step": int(step),
        "rows": [int(row) for row, _, _ in carry],
        "scores": [[float(s) for s in scores] for _, scores, _ in carry],
        "tensors": [{k: v.detach().cpu() for k, v in part.items()} for _, _, part in carry],
    }
    save_durably(state, os.path.join(folder, CARRY_FILE))


def read_carry(checkpoint_dir: str, step: int, record: dict[str, Any], url: str) -> list[Any]:
    """The carry tensors of ``checkpoint_dir``, checked against the consumption record of its
    step (the same rows and scores, in order); raises :class:`CheckpointNotFoundError` or
    :class:`StateMismatchError` before anything changes."""
    import torch

    path = os.path.join(checkpoint_dir, CARRY_FILE)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(
            f"no carried completions at {path}: {checkpoint_dir} was saved without "
            f"filter_groups, or the file was removed, so step {step + 1} of {url} cannot train "
            f"the groups step {step} carried; resume with the settings the checkpoint was saved "
            "with, or from another checkpoint"
        )
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:
        raise StateMismatchError(
            f"{path} is not a dynstate carry (torch.load failed: {exc})"
        ) from exc
    if not isinstance(state, dict) or state.get("kind") != CARRY_KIND:
        raise StateMismatchError(f"{path} is not a dynstate.trl carry; it cannot resume {url}")
    want_rows = [int(r) for r, _ in record["carry"]]
    want_scores = [[float(s) for s in scores] for _, scores in record["carry"]]
    tensors = state.get("tensors")
    if (
        state.get("step") != step
        or state.get("rows") != want_rows
        or state.get("scores") != want_scores
        or not isinstance(tensors, list)
        or len(tensors) != len(want_rows)
    ):
        raise StateMismatchError(
            f"{path} carries rows {state.get('rows')!r} after step {state.get('step')!r}, but "
            f"the consumption record of step {step} in {url} carries rows {want_rows}: the "
            "checkpoint and the store disagree (a file copied from another checkpoint, or a "
            "store reset since); resume from this checkpoint's own files"
        )
    return tensors


def last_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` that was saved whole, or None. The
    Trainer creates the folder and writes its files before dynstate writes
    ``dynstate_state.pt``, last, after every rank's files: a run killed while saving leaves a
    newer folder without it, which ``transformers``' ``get_last_checkpoint`` would pick and no
    resume could use. ``train(resume_from_checkpoint=True)`` resumes from this one."""
    if not os.path.isdir(output_dir):
        return None
    whole: dict[int, str] = {}
    for name in os.listdir(output_dir):
        number = name.removeprefix("checkpoint-")
        path = os.path.join(output_dir, name)
        if name.startswith("checkpoint-") and number.isdigit() and os.path.isdir(path):
            if os.path.isfile(os.path.join(path, STATE_FILE)):
                whole[int(number)] = path
            else:
                log.warning("%s was not saved whole (no %s): not resumed from", path,
                            STATE_FILE)  # fmt: skip
    return whole[max(whole)] if whole else None


def read_checkpoint_state(checkpoint_dir: str, store: Store) -> dict[str, Any]:
    """The dynstate state of a TRL ``checkpoint-N`` folder, checked against ``store`` and the
    folder's own step (``trainer_state.json``); raises before anything changes:
    :class:`CheckpointNotFoundError` without the file, :class:`StateMismatchError` for a state
    of another store, another step or a damaged one."""
    import json

    import torch

    path = os.path.join(checkpoint_dir, STATE_FILE)
    url = store.display_url
    if not os.path.isfile(path):
        # transformers' get_last_checkpoint picks the newest folder, saved whole or not
        whole = last_checkpoint(os.path.dirname(os.path.abspath(checkpoint_dir)))
        instead = (
            f"resume from {whole}, the newest one saved whole "
            "(dynstate.trl.last_checkpoint(output_dir) finds it)"
            if whole is not None
            else "resume from one of its checkpoints, or start afresh"
        )
        raise CheckpointNotFoundError(
            f"no dynstate state at {path}, so {checkpoint_dir} cannot resume {url} exactly: "
            "it was not written by dynstate.trl.DynstateGRPOTrainer (which saves it in every "
            f"checkpoint) or the run was killed while saving it; {instead}"
        )
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:
        raise StateMismatchError(
            f"{path} is not a plain dynstate state (torch.load weights_only=True failed: {exc})"
        ) from exc
    if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
        raise StateMismatchError(f"{path} is not a dynstate.trl state; it cannot resume {url}")
    if state.get("format") != STATE_FORMAT:
        raise StateMismatchError(
            f"{path} has format {state.get('format')!r}; this dynstate reads format "
            f"{STATE_FORMAT} — resume with the dynstate that wrote it"
        )
    if state.get("store_id") != store.store_id:
        raise StateMismatchError(
            f"{path} belongs to the store {state.get('store_url')!r} (id "
            f"{state.get('store_id')!r}), not to {url}; pass the store the run trained on"
        )
    sampler_state = find_sampler_state(state.get("loader"))
    if sampler_state is None:
        raise StateMismatchError(f"{path} holds no dynstate sampler state; it cannot resume {url}")
    check_state(sampler_state, store.store_id, url)
    step, version = state.get("step"), state.get("version")
    if not isinstance(step, int) or not isinstance(version, int):
        raise StateMismatchError(f"{path} lacks its step or version; it cannot resume {url}")
    trainer_state = os.path.join(checkpoint_dir, "trainer_state.json")
    try:
        with open(trainer_state) as f:
            global_step = json.load(f).get("global_step")
    except (OSError, ValueError) as exc:
        raise StateMismatchError(f"cannot read {trainer_state}: {exc}") from exc
    if global_step != step:
        raise StateMismatchError(
            f"{path} holds the position after step {step}, but {checkpoint_dir} is a "
            f"checkpoint of step {global_step}; it was copied from another checkpoint of {url} "
            "— resume from that checkpoint itself, or restore this folder's own file"
        )
    for key in ("steps_per_round", "processes"):
        value = state.get(key, 1)
        if type(value) is not int or value < 1:
            raise StateMismatchError(
                f"{path} has {key}={value!r}, not an int >= 1: it is damaged; resume {url} "
                "from another checkpoint"
            )
    if state.get("save_only_model"):
        raise StateMismatchError(
            f"{checkpoint_dir} was saved with save_only_model=True: it holds no optimizer, "
            f"scheduler or RNG state, so it cannot resume {url} exactly; resume from a "
            "checkpoint saved without save_only_model — nothing was changed"
        )
    return state
