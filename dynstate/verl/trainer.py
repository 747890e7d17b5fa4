"""The one way into verl's trainer that dynstate needs: its own train sampler, and a resume
that also restores the store.

verl 0.9 builds the train sampler with ``create_rl_sampler`` (RandomSampler or
SequentialSampler, no config hook) unless the trainer is given ``train_sampler``. The mixin
below passes :meth:`DynstateRLDataset.make_sampler` whenever the train dataset is a dynstate
one, and after verl's ``_load_checkpoint`` calls :meth:`DynstateRLDataset.resume`. Everything
else is verl's code, unchanged.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from . import mirror
from .dataset import DynstateRLDataset

log = logging.getLogger("dynstate")


def checkpoint_dir(trainer_config: Any, global_steps: int) -> str | None:
    """The ``global_step_N`` folder verl's ``_load_checkpoint`` resumed from (None: fresh)."""
    if global_steps <= 0:
        return None
    if trainer_config.get("resume_mode") == "resume_path":
        folder = str(trainer_config.resume_from_path)
    else:
        folder = os.path.join(str(trainer_config.default_local_dir), f"global_step_{global_steps}")
    return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)


class DynstateTrainerMixin:
    """Mix into ``RayPPOTrainer`` (``class T(DynstateTrainerMixin, RayPPOTrainer)``)."""

    config: Any
    train_dataset: Any
    train_dataloader: Any
    global_steps: int

    def _create_dataloader(self, train_dataset, val_dataset, collate_fn, train_sampler):  # type: ignore[no-untyped-def]
        if train_dataset is None:
            from verl.trainer.ppo.utils import create_rl_dataset

            train_dataset = create_rl_dataset(
                self.config.data.train_files,
                self.config.data,
                self.tokenizer,  # type: ignore[attr-defined]
                self.processor,  # type: ignore[attr-defined]
                max_samples=self.config.data.get("train_max_samples", -1),
            )
        if isinstance(train_dataset, DynstateRLDataset) and not train_dataset.fixed:
            if train_sampler is not None:
                log.info("replacing train_sampler %s with dynstate's", type(train_sampler).__name__)
            train_sampler = train_dataset.make_sampler()
        super()._create_dataloader(train_dataset, val_dataset, collate_fn, train_sampler)  # type: ignore[misc]

    def _mirror(self) -> str | None:
        dataset = self.train_dataset
        if isinstance(dataset, DynstateRLDataset) and not dataset.fixed:
            return dataset.settings.checkpoint_mirror
        return None

    def _save_checkpoint(self):  # type: ignore[no-untyped-def]
        result = super()._save_checkpoint()  # type: ignore[misc]
        if url := self._mirror():
            root = str(self.config.trainer.default_local_dir)
            mirror.push(root, self.global_steps, url, self.train_dataset.settings.storage_options)
        return result

    def _load_checkpoint(self):  # type: ignore[no-untyped-def]
        root = str(self.config.trainer.default_local_dir)
        url = self._mirror()
        if url and not os.path.exists(os.path.join(root, mirror.TRACKER)):
            # a fresh machine: bring the latest checkpoint next to the store back first
            mirror.pull(root, url, self.train_dataset.settings.storage_options)
        result = super()._load_checkpoint()  # type: ignore[misc]
        if isinstance(self.train_dataset, DynstateRLDataset):
            folder = checkpoint_dir(self.config.trainer, self.global_steps)
            self.train_dataset.resume(folder, self.train_dataloader, self.global_steps)
        return result


def dynstate_trainer_class() -> type:
    """``RayPPOTrainer`` with :class:`DynstateTrainerMixin` mixed in."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    return type("DynstatePPOTrainer", (DynstateTrainerMixin, RayPPOTrainer), {})
