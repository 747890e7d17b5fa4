"""One committed round per step of a verl V1 trainer, for every mode dynstate runs
(:mod:`dynstate.verl.v1`'s ``sync``, :mod:`dynstate.verl.v1_async`'s two async modes).

:class:`StepRounds` is mixed in before verl's trainer class. After verl's ``step`` it reads the
step's scored trajectories back from TransferQueue (:func:`scored_batch`, in prompt order); its
``_save_checkpoint`` and ``on_step_end`` commit the step's round from them
(:meth:`DynstateRLDataset.commit_round`, idempotent per step) *before* verl writes
``global_step_N`` — so a checkpoint never exists without its round — and, on steps without a
checkpoint, before the next step draws rows. ``_load_checkpoint`` brings a mirrored checkpoint
back first and resumes the dataset after verl's load. What differs between the modes is behind
four hooks: the prompt order (:meth:`StepRounds._order_of`), the step's consumption record
(``_consumption``, ``_committed``), what must be on disk before verl's files
(``_before_checkpoint``) and the resume (``_resume``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from tensordict import TensorDict
from torchdata.stateful_dataloader import StatefulDataLoader
from verl import DataProto
from verl.trainer.ppo.v1.trainer_base import PPOTrainer

from . import mirror
from .dataset import DynstateRLDataset


def trajectory_order(key: str, prompt_order: dict[str, int]) -> tuple[int, int, int]:
    # keys are {uid}_{session}_{index} (agent_loop_tq); uids come in loader order
    uid, _, rest = key.partition("_")
    session, _, index = rest.partition("_")
    return (
        prompt_order.get(uid, len(prompt_order)),
        int(session) if session.isdigit() else 0,
        int(index) if index.isdigit() else 0,
    )


def trajectory_outcomes(
    groups: list[tuple[int, list[str]]], step: int, partition_id: str
) -> dict[str, np.ndarray]:
    """The outcome records of scored groups still in TransferQueue, each ``(row, its
    trajectory keys)``: one per response, ``score`` its ``rm_scores`` summed and
    ``response_length`` its ``response_mask`` summed — what
    :func:`~dynstate.verl.outcomes.batch_outcomes` makes of the same trajectories in a trained
    batch. For the groups a step scores and does not train (filtered, dropped, carried), read
    before they leave the queue."""
    keys = [k for _, ks in groups for k in ks]
    rows = [row for row, ks in groups for _ in ks]
    scores = np.zeros(len(keys), dtype=np.float64)
    lengths = np.zeros(len(keys), dtype=np.float64)
    if keys:
        data = tq.kv_batch_get(
            keys=keys, partition_id=partition_id, select_fields=["rm_scores", "response_mask"]
        )
        for i, (score, mask) in enumerate(
            zip(list(data["rm_scores"]), list(data["response_mask"]), strict=True)
        ):
            scores[i] = float(score.sum().double().item())  # as batch_outcomes sums
            lengths[i] = float(mask.sum().double().item())
    return {
        "row": np.asarray(rows, dtype=np.int64),
        "step": np.full(len(keys), int(step), dtype=np.int64),
        "score": scores,
        "response_length": lengths,
    }


def _to_numpy_objects(values: Any) -> np.ndarray:
    items = list(values.tolist() if hasattr(values, "tolist") else values)
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def scored_batch(keys: list[str], partition_id: str, pad_token_id: int) -> DataProto:
    """The trajectories ``keys`` of a step, read from TransferQueue as one ``DataProto``:
    tensors right-padded (``pad_token_id`` for token ids, 0 elsewhere), ``rm_scores`` also as
    ``token_level_scores``, every non-tensor field (``raw_prompt``, ``dynstate_row``, the
    dataset's columns, ``uid`` …) as an object array — what the legacy trainer's batch holds
    after reward."""
    data = tq.kv_batch_get(keys=keys, partition_id=partition_id)
    tensors: dict[str, torch.Tensor] = {}
    non_tensors: dict[str, np.ndarray] = {}
    for name in list(data.keys()):
        value = data.get(name)
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                pad = pad_token_id if name in ("prompts", "responses", "input_ids") else 0
                value = value.to_padded_tensor(padding=pad)
            tensors[name] = value
        else:
            non_tensors[name] = _to_numpy_objects(value)
    if "rm_scores" in tensors:
        tensors["token_level_scores"] = tensors["rm_scores"]
    return DataProto(
        batch=TensorDict(tensors, batch_size=len(keys)) if tensors else None,
        non_tensor_batch=non_tensors,
        meta_info={},
    )


def loader_over(
    dataset: DynstateRLDataset, old: Any, sampler: Any, *, batch_size: int, drop_last: bool
) -> StatefulDataLoader:
    """verl's train loader ``old`` rebuilt over dynstate's ``sampler`` (verl hard-codes
    ``create_rl_sampler``): the same dataset, workers and collate function, checked against
    the dataset."""
    kwargs: dict[str, Any] = {}
    if old.num_workers > 0:
        kwargs["prefetch_factor"] = old.prefetch_factor
    loader = StatefulDataLoader(
        dataset=old.dataset,
        batch_size=batch_size,
        num_workers=old.num_workers,
        drop_last=drop_last,
        collate_fn=old.collate_fn,
        sampler=sampler,
        **kwargs,
    )
    dataset.check_loader(sampler, loader)
    return loader


class StepRounds(PPOTrainer):
    """What every dynstate V1 trainer adds to verl's (mixed in before verl's class): the step's
    scored batch read back after verl's step, and its round committed before the step's
    checkpoint and before the next step draws."""

    train_dataloader: Any

    def __init__(self, config: Any) -> None:
        self._scored: tuple[int, DataProto] | None = None
        self._step_metrics: dict | None = None
        super().__init__(config)

    @property
    def dynstate_dataset(self) -> DynstateRLDataset | None:
        dataset = getattr(self, "train_dataset", None)
        if isinstance(dataset, DynstateRLDataset) and not dataset.fixed:
            return dataset
        return None

    # -- the hooks of a mode ---------------------------------------------------------------------

    def _order_of(self, keys: list[str]) -> dict[str, int]:
        """Each prompt uid's place in the step's batch (its trajectories sort by it)."""
        raise NotImplementedError

    def _consumption(self, step: int) -> dict | None:
        """The consumption record that goes in ``step``'s round, if the mode keeps one."""
        return None

    def _outcomes(self, step: int, batch: DataProto) -> dict[str, Any] | None:
        """The step's outcome records when the mode scored groups it did not train (group
        filtering); None: the trained ``batch``'s
        (:func:`~dynstate.verl.outcomes.batch_outcomes`)."""
        return None

    def _committed(self, record: dict | None) -> None:
        """Called once ``record``'s round is durable."""

    def _before_checkpoint(self) -> None:
        """What must be on disk before verl writes the checkpoint's tracker file."""

    def _resume(self, dataset: DynstateRLDataset) -> None:
        """After verl's ``_load_checkpoint``: the dataset back at ``self.global_steps``."""
        raise NotImplementedError

    # -- one round per step ----------------------------------------------------------------------

    def step(self, metrics: dict, timing_raw: dict) -> Any:
        self._step_metrics = metrics  # verl logs this very dict after on_step_end
        batch = super().step(metrics, timing_raw)
        if self.dynstate_dataset is not None:
            keys = [
                key
                for key, tag in zip(batch.keys, batch.tags, strict=True)
                if not tag.get("is_padding", False)
            ]
            order = self._order_of(keys)
            keys.sort(key=lambda k: trajectory_order(k, order))
            pad = self.tokenizer.pad_token_id
            scored = scored_batch(keys, batch.partition_id, 0 if pad is None else int(pad))
            self._scored = (self.global_steps, scored)
        return batch

    def commit_step_round(self) -> int | None:
        """Commit the round of the current step, with its consumption record, if it is not
        yet; returns its version."""
        dataset = self.dynstate_dataset
        if dataset is None or self._scored is None:
            return None
        step, batch = self._scored
        if step != self.global_steps:
            return None
        record = self._consumption(step)
        outcomes = self._outcomes(step, batch)
        version = dataset.commit_round(batch, step, consumption=record, outcomes=outcomes)
        self._scored = None
        self._committed(record)
        if self._step_metrics is not None:
            self._step_metrics.update(dataset.last_metrics)
        return version

    def _save_checkpoint(self) -> Any:
        # the round first: a checkpoint never exists without it (and an async checkpoint's
        # transfer_queue/ is its record's in_flight)
        self.commit_step_round()
        self._before_checkpoint()
        result = super()._save_checkpoint()
        dataset = self.dynstate_dataset
        if dataset is not None:
            mirror.push_saved(self.config.trainer, self.global_steps, dataset.live_settings)
        return result

    def on_step_end(self) -> Any:
        self.commit_step_round()
        return super().on_step_end()

    def _load_checkpoint(self) -> Any:
        dataset = self.dynstate_dataset
        if dataset is not None:
            # a fresh machine: bring the latest checkpoint next to the store back first
            mirror.pull_missing(self.config.trainer, dataset.live_settings)
        result = super()._load_checkpoint()
        if dataset is not None:
            self._resume(dataset)
        return result
