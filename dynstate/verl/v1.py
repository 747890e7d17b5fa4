"""dynstate for verl's V1 trainer (``trainer.use_v1=true``, verl 0.9's default).

verl's V1 trainers are picked by name (``trainer.v1.trainer_mode``) from a registry filled by
``@register_trainer``. Importing this module registers :class:`DynstatePPOTrainer` under
``trainer.v1.trainer_mode=dynstate``: verl's ``sync`` trainer (its own ``fit``/``step``) with
four overrides, everything else verl's code:

- ``_init_dataloader``: after verl's, the train loader is rebuilt with the dataset's
  :class:`~dynstate.VersionedSampler` (verl hard-codes ``create_rl_sampler``);
- ``step``: after verl's, the step's scored batch is read back from TransferQueue (every
  trajectory that is not padding, all its fields) and kept;
- ``_save_checkpoint`` and ``on_step_end``: commit the round of the step from that batch
  (:meth:`DynstateRLDataset.commit_round`, idempotent per step, with the step's outcomes and
  the generator's state in the same commit) *before* verl writes ``global_step_N`` — so a
  checkpoint never exists without its round — and on steps without a checkpoint, before the
  next step draws rows; the round's ``dynstate/*`` figures go into the step's ``metrics``,
  which verl logs after ``on_step_end``;
- ``_load_checkpoint``: after verl's, :meth:`DynstateRLDataset.resume` rolls the store back to
  the checkpoint's step and loads the loader state.

Only the ``sync`` mode is supported: in verl's async modes the trajectories that make up a step
depend on rollout timing, so no run — interrupted or not — can be reproduced, and DAPO group
filtering (``algorithm.filter_groups``) or ``trainer.v1.sampler.sync_refill_failed_groups``
make the number of rows a step consumes depend on timing too. Both are refused at start-up.
``python -m dynstate.verl.main_ppo`` registers and selects this trainer. See docs/verl.md.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from tensordict import TensorDict
from torchdata.stateful_dataloader import StatefulDataLoader
from verl import DataProto
from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

from ..errors import InvalidDataError, VersionCollectedError
from . import mirror
from .dataset import DynstateRLDataset
from .trainer import checkpoint_dir

log = logging.getLogger("dynstate")

TRAINER_MODE = "dynstate"
"""The ``trainer.v1.trainer_mode`` value this module registers."""

# verl's own mode names, and what dynstate makes of them.
SUPPORTED_MODES = ("sync",)
ASYNC_MODES = ("colocate_async", "separate_async")


def check_config(config: Any) -> None:
    """Refuse, before anything starts, the V1 settings under which a dynstate run cannot
    resume exactly (see the module docstring). ``config`` is verl's full trainer config."""
    mode = str(config.trainer.v1.get("trainer_mode", "sync"))
    registered_cls = TRAINER_REGISTRY.get(mode)
    ours = isinstance(registered_cls, type) and issubclass(registered_cls, DynstatePPOTrainer)
    if not ours and mode not in SUPPORTED_MODES:
        why = (
            "in verl's async modes the trajectories of a step depend on rollout timing, so a "
            "resumed run cannot repeat the interrupted one"
            if mode in ASYNC_MODES
            else "it is not dynstate's trainer, so nothing installs the sampler or commits rounds"
        )
        raise InvalidDataError(
            f"trainer.v1.trainer_mode={mode} is not supported with a dynstate dataset: {why}; "
            f"supported: {', '.join(SUPPORTED_MODES)} (`python -m dynstate.verl.main_ppo` runs "
            "it as dynstate's trainer), or trainer.use_v1=false for verl's legacy trainer"
        )
    train_batch_size = config.data.get("train_batch_size")
    gen_batch_size = config.data.get("gen_batch_size", None)
    if gen_batch_size not in (None, train_batch_size):
        raise InvalidDataError(
            f"data.gen_batch_size={gen_batch_size} is not supported with a dynstate dataset in "
            f"verl's V1 trainer: a step would take {train_batch_size} rows in several loader "
            "batches, and dynstate's sampler counts a loader batch as a step; unset it (or set "
            f"it to data.train_batch_size={train_batch_size})"
        )
    filter_groups = config.algorithm.get("filter_groups", None)
    if filter_groups is not None and filter_groups.get("enable", False):
        raise InvalidDataError(
            "algorithm.filter_groups.enable=true (DAPO) is not supported with a dynstate dataset "
            "in verl's V1 trainer: it pulls rows one at a time until enough groups pass the "
            "filter and discards the surplus, so the rows a step consumes depend on rollout "
            "timing and a resume cannot repeat them; turn the filter off"
        )
    sampler = config.trainer.v1.get("sampler", {}) or {}
    if sampler.get("sync_refill_failed_groups", False):
        raise InvalidDataError(
            "trainer.v1.sampler.sync_refill_failed_groups=true is not supported with a dynstate "
            "dataset: refilled rows make the rows a step consumes depend on which rollouts "
            "failed, so a resume cannot repeat them; set it to false"
        )
    custom = sampler.get("custom_sampler", None) or {}
    if custom.get("path") and custom.get("name"):
        raise InvalidDataError(
            f"trainer.v1.sampler.custom_sampler ({custom.get('name')}) is not supported with a "
            "dynstate dataset: the dynstate trainer relies on verl's sync ReplayBuffer taking "
            "exactly train_batch_size rows per step; remove the custom sampler"
        )


def _imported_rows(dataset: DynstateRLDataset) -> int:
    """Rows of the store as of the end of step 0 (the train files' import, and whatever was
    committed before the first round): what the first epoch pinned, asked of the one step
    query, so resets, rollbacks to step 0 and gc cuts are read as everywhere else."""
    store = dataset.store
    head = store.refresh()
    try:
        version = store.steps.version_at(head, 0)
    except VersionCollectedError:
        # gc took the import: the oldest kept version of the lineage is the nearest count (it
        # sets verl's epoch count, and the run's length only without total_training_steps;
        # the sampler's position comes from its own state)
        version = store.steps.after(head)[0][0]
        log.warning(
            "the import of %s was collected by gc; counting verl's epochs by version %d",
            store.display_url,
            version,
        )
    return store.snapshot(version).num_rows


def _trajectory_order(key: str, prompt_order: dict[str, int]) -> tuple[int, int, int]:
    # keys are {uid}_{session}_{index} (agent_loop_tq); uids come in loader order
    uid, _, rest = key.partition("_")
    session, _, index = rest.partition("_")
    return (
        prompt_order.get(uid, len(prompt_order)),
        int(session) if session.isdigit() else 0,
        int(index) if index.isdigit() else 0,
    )


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


@register_trainer(TRAINER_MODE)
class DynstatePPOTrainer(PPOTrainerSync):
    """verl's V1 ``sync`` trainer with a dynstate train set: one committed round per step,
    durable before the step's checkpoint, and an exact resume."""

    train_dataloader: Any

    def __init__(self, config: Any) -> None:
        check_config(config)
        self._scored: tuple[int, DataProto] | None = None
        self._step_metrics: dict | None = None
        self._prompt_order: dict[str, int] = {}
        super().__init__(config)

    # verl keys its sync behaviour (ReplayBuffer, no TransferQueue checkpoint, no re-issue of
    # in-flight prompts, free gen_batch_size) on the mode's name; this trainer *is* sync.
    def _build_replay_buffer(self) -> Any:
        self.trainer_mode = "sync"
        self.parameter_sync_step = self.config.trainer.v1.get("sync", {}).get(
            "parameter_sync_step", 1
        )
        return super()._build_replay_buffer()

    @property
    def dynstate_dataset(self) -> DynstateRLDataset | None:
        dataset = getattr(self, "train_dataset", None)
        if isinstance(dataset, DynstateRLDataset) and not dataset.fixed:
            return dataset
        return None

    # -- the sampler ---------------------------------------------------------------------------

    def _init_dataloader(self) -> None:
        super()._init_dataloader()
        dataset = self.dynstate_dataset
        if dataset is None:
            log.warning(
                "trainer.v1.trainer_mode=%s without a DynstateRLDataset train set: training as "
                "verl's sync trainer",
                TRAINER_MODE,
            )
            return
        old = self.train_dataloader
        train_batch_size = int(self.config.data.train_batch_size)
        # check_config keeps gen_batch_size at train_batch_size: one loader batch is one
        # training step, which is what the sampler counts (mix mode's lag, epoch pinning)
        sampler = dataset.make_sampler(batch_size=old.batch_size, drop_last=old.drop_last)
        kwargs: dict[str, Any] = {}
        if old.num_workers > 0:
            kwargs["prefetch_factor"] = old.prefetch_factor
        self.train_dataloader = StatefulDataLoader(
            dataset=old.dataset,
            batch_size=old.batch_size,
            num_workers=old.num_workers,
            drop_last=old.drop_last,
            collate_fn=old.collate_fn,
            sampler=sampler,
            **kwargs,
        )
        dataset.check_loader(sampler, self.train_dataloader)
        self.train_dataloader_it = None
        # verl derives the epoch length from len(dataset), which grows as rounds commit; take
        # the imported rows instead, so a resumed run counts epochs (and, without
        # trainer.total_training_steps, its length) exactly as the first start did.
        base = _imported_rows(dataset)
        if base != len(dataset):
            self.steps_per_epoch = max(1, base // train_batch_size)
            if self.config.trainer.total_training_steps is None:
                self.total_training_steps = self.steps_per_epoch * self.config.trainer.total_epochs
                self._set_optim_steps(self.total_training_steps * self.parameter_sync_step)
        log.info(
            "dynstate train sampler installed (mode %s, %d steps per epoch of the import)",
            sampler.mode,
            self.steps_per_epoch,
        )

    def _set_optim_steps(self, steps: int) -> None:
        from omegaconf import OmegaConf, open_dict

        with open_dict(self.config):
            if OmegaConf.select(self.config, "actor_rollout_ref.actor.optim"):
                self.config.actor_rollout_ref.actor.optim.total_training_steps = steps
            if OmegaConf.select(self.config, "critic.optim"):
                self.config.critic.optim.total_training_steps = steps

    # -- one round per step ----------------------------------------------------------------------

    def _next_train_batch(self, num_prompts: int | None = None) -> Any:
        batch = super()._next_train_batch(num_prompts)
        for uid in list(batch["uid"]):
            self._prompt_order.setdefault(str(uid), len(self._prompt_order))
        return batch

    def step(self, metrics: dict, timing_raw: dict) -> Any:
        self._prompt_order = {}
        self._step_metrics = metrics  # verl logs this very dict after on_step_end
        batch = super().step(metrics, timing_raw)
        if self.dynstate_dataset is not None:
            keys = [
                key
                for key, tag in zip(batch.keys, batch.tags, strict=True)
                if not tag.get("is_padding", False)
            ]
            keys.sort(key=lambda k: _trajectory_order(k, self._prompt_order))
            pad = self.tokenizer.pad_token_id
            scored = scored_batch(keys, batch.partition_id, 0 if pad is None else int(pad))
            self._scored = (self.global_steps, scored)
        return batch

    def commit_step_round(self) -> int | None:
        """Commit the round of the current step if it is not yet; returns its version."""
        dataset = self.dynstate_dataset
        if dataset is None or self._scored is None:
            return None
        step, batch = self._scored
        if step != self.global_steps:
            return None
        version = dataset.commit_round(batch, step)
        self._scored = None
        if self._step_metrics is not None:
            self._step_metrics.update(dataset.last_metrics)
        return version

    def _save_checkpoint(self) -> Any:
        self.commit_step_round()  # the round first: a checkpoint never exists without it
        result = super()._save_checkpoint()
        dataset = self.dynstate_dataset
        if dataset is not None and dataset.live_settings.checkpoint_mirror:
            mirror.push(
                str(self.config.trainer.default_local_dir),
                self.global_steps,
                dataset.live_settings.checkpoint_mirror,
                dataset.live_settings.storage_options,
            )
        return result

    def on_step_end(self) -> Any:
        self.commit_step_round()
        return super().on_step_end()

    # -- resume ----------------------------------------------------------------------------------

    def _load_checkpoint(self) -> Any:
        dataset = self.dynstate_dataset
        root = str(self.config.trainer.default_local_dir)
        url = dataset.live_settings.checkpoint_mirror if dataset is not None else None
        if (
            dataset is not None
            and url
            and self.config.trainer.resume_mode != "disable"
            and not os.path.exists(os.path.join(root, mirror.TRACKER))
        ):
            mirror.pull(root, url, dataset.live_settings.storage_options)
        result = super()._load_checkpoint()
        if dataset is not None:
            folder = checkpoint_dir(self.config.trainer, self.global_steps)
            dataset.resume(folder, self.train_dataloader, self.global_steps)
        return result


def registered() -> type:
    """The class registered under ``trainer.v1.trainer_mode=dynstate``."""
    return TRAINER_REGISTRY[TRAINER_MODE]
