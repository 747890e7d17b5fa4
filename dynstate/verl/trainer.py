"""The way into verl's legacy ``RayPPOTrainer`` (``trainer.use_v1=false``) that dynstate needs.

verl 0.9 builds the train sampler with ``create_rl_sampler`` (RandomSampler or
SequentialSampler, no config hook) unless the trainer is given ``train_sampler``; its
``_get_gen_batch`` moves the dataset's columns out of the batch that is later scored; it writes
``global_step_N`` before it calls ``on_batch_end`` for step N, and never calls it after the
last step. :class:`DynstateTrainerMixin` overrides these methods, everything else is verl's:

* ``_create_dataloader``: the train loader gets :meth:`DynstateRLDataset.make_sampler`;
* ``_get_gen_batch``: the input columns (``raw_prompt``, ``dynstate_row``, …) stay on the
  training batch too, so the scored batch a generator receives carries them;
* ``_update_actor``: after verl's, commits the step's round from the scored batch (verl calls
  it after reward and advantages, right before ``_save_checkpoint``), with the step's outcomes
  and the generator's state in the same commit — so a checkpoint never names a step whose
  round is missing (``on_batch_end`` then finds the round and commits nothing) — and adds
  ``dynstate/*`` figures to the actor's metrics, which verl's tracker logs with the step;
* ``_save_checkpoint``: checks that round is committed before verl writes the checkpoint;
  then mirrors the folder if configured;
* ``_load_checkpoint``: after verl's own, :meth:`DynstateRLDataset.resume` restores the store
  version and the exact sampler position;
* ``fit``: after verl's loop, the last step's round (committed already if it was checkpointed).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import InvalidDataError, StateMismatchError
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


def growing(dataset: Any) -> DynstateRLDataset | None:
    """``dataset`` if it is a store-backed (train) DynstateRLDataset, else None."""
    if isinstance(dataset, DynstateRLDataset) and not dataset.fixed:
        return dataset
    return None


class DynstateTrainerMixin:
    """Mix into ``RayPPOTrainer``: ``class T(DynstateTrainerMixin, RayPPOTrainer)``."""

    config: Any
    train_dataset: Any
    train_dataloader: Any
    global_steps: int
    _dynstate_scored: tuple[int, Any] | None = None
    _dynstate_validating: bool = False

    def _create_dataloader(self, train_dataset, val_dataset, collate_fn, train_sampler):
        if train_dataset is None:
            from verl.trainer.ppo.utils import create_rl_dataset

            train_dataset = create_rl_dataset(
                self.config.data.train_files,
                self.config.data,
                self.tokenizer,  # type: ignore[attr-defined]
                self.processor,  # type: ignore[attr-defined]
                max_samples=self.config.data.get("train_max_samples", -1),
            )
        if growing(val_dataset) is not None and val_dataset is not train_dataset:
            raise InvalidDataError(
                "the validation dataset is a growing DynstateRLDataset; build the train set "
                "first from the same data config (as verl's TaskRunner does), or pass a plain "
                "RLHFDataset as val_dataset"
            )
        dataset = growing(train_dataset)
        if dataset is not None:
            replaced = type(train_sampler).__name__ if train_sampler is not None else "none"
            data = self.config.data
            # verl's train loader: this batch, drop_last=True (RayPPOTrainer._create_dataloader)
            batch = data.get("gen_batch_size", None) or data.train_batch_size
            train_sampler = dataset.make_sampler(batch_size=int(batch), drop_last=True)
        super()._create_dataloader(train_dataset, val_dataset, collate_fn, train_sampler)  # type: ignore[misc]
        if dataset is not None:
            # the loader verl built counts steps as the sampler does; mix mode's lag covers
            # its prefetch (else a clear error now instead of a hang at step 1)
            dataset.check_loader(train_sampler, self.train_dataloader)
            log.info(
                "dynstate train sampler installed (mode %s, replacing %s; legacy trainer)",
                train_sampler.mode,
                replaced,
            )

    # -- the scored batch carries the inputs -------------------------------------------------

    def _get_gen_batch(self, batch):
        gen_batch = super()._get_gen_batch(batch)  # type: ignore[misc]
        if not self._dynstate_validating and growing(self.train_dataset) is not None:
            # verl moved the dataset's columns into gen_batch; the agent loop hands them back
            # only with a colocated reward model. Keep them on the batch as well: verl's own
            # repeat() and union() then carry them to the scored batch.
            for key, value in gen_batch.non_tensor_batch.items():
                batch.non_tensor_batch.setdefault(key, value)
        return gen_batch

    def _validate(self, *args, **kwargs):
        self._dynstate_validating = True
        try:
            return super()._validate(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._dynstate_validating = False

    # -- no lost round -----------------------------------------------------------------------

    def _update_actor(self, batch):
        # verl calls this with the step's batch after reward and advantages, and writes the
        # checkpoint right after: the round is committed here, on every step, so the figures
        # below reach the step's metrics (verl reduces the actor's metrics after the
        # checkpoint, and logs before on_batch_end)
        self._dynstate_scored = (self.global_steps, batch)
        output = super()._update_actor(batch)  # type: ignore[misc]
        if (dataset := growing(self.train_dataset)) is not None:
            dataset.commit_round(batch, self.global_steps)
            metrics = getattr(output, "meta_info", {}).get("metrics")
            if isinstance(metrics, dict):
                metrics.update({k: [v] for k, v in dataset.last_metrics.items()})
        return output

    def _save_checkpoint(self):
        if (dataset := growing(self.train_dataset)) is not None:
            scored = self._dynstate_scored
            if scored is None or scored[0] != self.global_steps:
                raise StateMismatchError(
                    f"saving global_step_{self.global_steps} before its batch was scored; "
                    f"dynstate commits the round of step {self.global_steps} from that batch "
                    "before the checkpoint — call _save_checkpoint from fit() only"
                )
            dataset.commit_round(scored[1], self.global_steps)
        result = super()._save_checkpoint()  # type: ignore[misc]
        if dataset is not None:
            mirror.push_saved(self.config.trainer, self.global_steps, dataset.live_settings)
        return result

    def fit(self):
        result = super().fit()  # type: ignore[misc]
        # verl calls on_batch_end after every step but the last; without checkpoints
        # (save_freq <= 0) nothing else commits the last step's round. Idempotent otherwise.
        if (dataset := growing(self.train_dataset)) is not None and self._dynstate_scored:
            step, batch = self._dynstate_scored
            dataset.commit_round(batch, step)
        return result

    def _load_checkpoint(self):
        dataset = growing(self.train_dataset)
        if dataset is not None:
            # a fresh machine: bring the latest checkpoint next to the store back first
            mirror.pull_missing(self.config.trainer, dataset.live_settings)
        result = super()._load_checkpoint()  # type: ignore[misc]
        if dataset is not None:
            folder = checkpoint_dir(self.config.trainer, self.global_steps)
            dataset.resume(folder, self.train_dataloader, self.global_steps)
        return result


def dynstate_trainer_class() -> type:
    """verl's legacy ``RayPPOTrainer`` with :class:`DynstateTrainerMixin` mixed in."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    return type("DynstatePPOTrainer", (DynstateTrainerMixin, RayPPOTrainer), {})
