"""dynstate for verl's V1 trainer (``trainer.use_v1=true``, verl 0.9's default).

verl's V1 trainers are picked by name (``trainer.v1.trainer_mode``) from a registry filled by
``@register_trainer``. Importing this module registers :class:`DynstatePPOTrainer` under
``trainer.v1.trainer_mode=dynstate``: verl's ``sync`` trainer (its own ``fit``/``step``) with
these overrides (the round per step in :class:`dynstate.verl.v1_rounds.StepRounds`, shared
with the async modes), everything else verl's code:

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

``colocate_async`` and ``separate_async`` run as :mod:`dynstate.verl.v1_async`'s trainers
(``trainer.v1.trainer_mode=dynstate_colocate_async`` / ``dynstate_separate_async``: exactly
once, every row drawn trained, filtered, dropped or in flight; docs/verl.md, "Async modes").
``trainer.v1.sampler.sync_refill_failed_groups`` is refused too (verl's refill of failed groups
fetches rows at the poll that finds them).

DAPO group filtering (``algorithm.filter_groups.enable=true``) is dynstate's here, not verl's
ReplayBuffer's: each step runs :class:`~dynstate.DynamicSampling` — generation batches of
``data.gen_batch_size`` rows drawn by dynstate's sampler, each generated and scored by verl's own
rollout and streamed reward (``_submit_batch_to_rollout``, the agent loop) and waited for in
full, each group's ``algorithm.filter_groups.metric`` read from TransferQueue in session order,
filtered by zero variance, refilled up to ``max_num_gen_batches``; the carried groups first, then
the accepted ones in draw order, are the batch verl's buffer hands ``_step_once``. The surplus is
carried (``data.dynstate.surplus``, default ``carry``) or dropped; the consumption record goes in
the step's round, and the carry's trajectories into ``global_step_N/dynstate_carry.pt`` before
verl writes its tracker file. A resume checks both before the rollback and puts the carry back
into TransferQueue. See docs/verl.md, "Dynamic sampling (DAPO)".
``python -m dynstate.verl.main_ppo`` registers and selects this trainer. See docs/verl.md.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

from ..errors import (
    CheckpointNotFoundError,
    InvalidDataError,
    StateMismatchError,
    VersionCollectedError,
)
from ..loading.checkpoint import save_durably
from ..loading.consumption import DynamicSampling, FilterRule, StepBatch, group_std
from .dataset import DynstateRLDataset
from .settings import Settings, uses_dynstate
from .trainer import checkpoint_dir
from .v1_rounds import StepRounds, loader_over, trajectory_order, trajectory_outcomes

log = logging.getLogger("dynstate")

TRAINER_MODE = "dynstate"
"""The ``trainer.v1.trainer_mode`` value this module registers."""

# verl's own mode names, and the dynstate trainer each runs as
SUPPORTED_MODES = ("sync",)
# verl's async modes -> dynstate's trainers for them (dynstate.verl.v1_async registers them)
ASYNC_TRAINERS = {
    "colocate_async": "dynstate_colocate_async",
    "separate_async": "dynstate_separate_async",
}


def check_config(config: Any) -> None:
    """Refuse, before anything starts, the V1 settings under which a dynstate run cannot
    resume exactly (see the module docstring). ``config`` is verl's full trainer config."""
    mode = str(config.trainer.v1.get("trainer_mode", "sync"))
    registered_cls = TRAINER_REGISTRY.get(mode)
    # dynstate.verl.v1_async's trainers (and subclasses) name the verl mode they run
    if getattr(registered_cls, "VERL_MODE", None) in ASYNC_TRAINERS:
        check_async_config(config, mode)
        return
    ours = isinstance(registered_cls, type) and issubclass(registered_cls, DynstatePPOTrainer)
    if not ours and mode not in SUPPORTED_MODES:
        if mode in ASYNC_TRAINERS:
            why = (
                f"verl's own {mode} trainer does not record the rows it draws, evicts and "
                f"keeps in flight; run it as trainer.v1.trainer_mode={ASYNC_TRAINERS[mode]} "
                "(`python -m dynstate.verl.main_ppo` does so)"
            )
        else:
            why = "it is not dynstate's trainer, so nothing installs the sampler or commits rounds"
        supported = [*SUPPORTED_MODES, *ASYNC_TRAINERS]
        raise InvalidDataError(
            f"trainer.v1.trainer_mode={mode} is not supported with a dynstate dataset: {why}; "
            f"supported: {', '.join(supported)} (`python -m dynstate.verl.main_ppo` runs "
            "them as dynstate's trainers), or trainer.use_v1=false for verl's legacy trainer"
        )
    train_batch_size = config.data.get("train_batch_size")
    gen_batch_size = config.data.get("gen_batch_size", None)
    filtering = filter_settings(config)
    if filtering is None and gen_batch_size not in (None, train_batch_size):
        raise InvalidDataError(
            f"data.gen_batch_size={gen_batch_size} is not supported with a dynstate dataset in "
            f"verl's V1 trainer: a step would take {train_batch_size} rows in several loader "
            "batches, and dynstate's sampler counts a loader batch as a step; unset it (or set "
            f"it to data.train_batch_size={train_batch_size}); it sets the generation batch of "
            "group filtering (algorithm.filter_groups.enable=true)"
        )
    sampler = config.trainer.v1.get("sampler", {}) or {}
    if sampler.get("sync_refill_failed_groups", False):
        raise InvalidDataError(
            "trainer.v1.sampler.sync_refill_failed_groups=true is not supported with a dynstate "
            "dataset: verl refills a failed group (one with no finished trajectory) with rows "
            "fetched at the poll that finds it, so the rows a step consumes depend on which "
            "rollouts failed and when, and a failed group has no scores for dynstate's filter "
            "to record; set it to false (a group whose every session fails then stops the step "
            "with an error naming its row)"
        )
    custom = sampler.get("custom_sampler", None) or {}
    if custom.get("path") and custom.get("name"):
        raise InvalidDataError(
            f"trainer.v1.sampler.custom_sampler ({custom.get('name')}) is not supported with a "
            "dynstate dataset: the dynstate trainer relies on verl's sync ReplayBuffer taking "
            "exactly train_batch_size rows per step; remove the custom sampler"
        )


def check_async_config(config: Any, mode: str) -> None:
    """Refuse what the async trainer cannot account for, naming the key."""
    dynstate = config.data.get("dynstate", None) or {}
    if str(dynstate.get("mode", "epoch")) == "mix":
        raise InvalidDataError(
            f"data.dynstate.mode=mix is not supported with trainer.v1.trainer_mode={mode}: mix "
            "mode's lag counts loader batches, and an async trainer's loader hands out one row "
            "per batch, ahead of training by its warm-up window and refills; use mode=epoch"
        )
    sampler = config.trainer.v1.get("sampler", {}) or {}
    custom = sampler.get("custom_sampler", None) or {}
    if custom.get("path") and custom.get("name"):
        raise InvalidDataError(
            f"trainer.v1.sampler.custom_sampler ({custom.get('name')}) is not supported with a "
            f"dynstate dataset and trainer.v1.trainer_mode={mode}: dynstate's buffer records "
            "every group verl evicts; remove the custom sampler"
        )
    if sampler.get("sync_refill_failed_groups", False):
        raise InvalidDataError(
            "trainer.v1.sampler.sync_refill_failed_groups is a sync-mode setting; unset it with "
            f"trainer.v1.trainer_mode={mode}"
        )
    skip = config.get("skip", {}) or {}
    if (skip.get("rollout_tq", {}) or {}).get("enable", False):
        raise InvalidDataError(
            f"skip.rollout_tq.enable=true is not supported with a dynstate dataset and "
            f"trainer.v1.trainer_mode={mode}: it trains another run's cached trajectories for "
            "the rows drawn; set it to false"
        )


# DynamicSampling's settings and the verl keys that set them (a resume names these)
FILTER_KEYS = {
    "gen_batch_size": "data.gen_batch_size",
    "train_groups": "data.train_batch_size",
    "rule": "algorithm.filter_groups.metric",
    "max_gen_batches": "algorithm.filter_groups.max_num_gen_batches",
    "surplus": "data.dynstate.surplus",
    "max_carry": "data.dynstate.max_carry",
}
CARRY_FILE = "dynstate_carry.pt"  # global_step_N/: the carried groups' trajectories
REWARD_METRIC = "reward"  # verl's: the trajectory's rm_scores summed; else reward_extra_info


@dataclass(frozen=True)
class FilterSettings:
    """Group filtering (``algorithm.filter_groups.enable=true``) with a dynstate train set,
    read from verl's config before verl forces ``data.gen_batch_size`` to 1."""

    metric: str
    gen_batch_size: int
    train_groups: int
    max_gen_batches: int | None
    surplus: str
    max_carry: int | None

    def rule(self) -> FilterRule:
        """DAPO's rule (keep a group whose metric is not the same for every response), named
        with the metric so that a resume with another metric is refused."""
        return FilterRule(_varies, name="zero_variance", params={"metric": self.metric})


def _varies(scores: list[float]) -> bool:
    return group_std(scores) > 0.0


def filter_settings(config: Any) -> FilterSettings | None:
    """The group-filtering settings of verl's full ``config``, or None when filtering is off
    or the train set is not dynstate's (verl's own DAPO then runs). Refuses, naming the key,
    what dynstate's filtering cannot run."""
    filter_groups = config.algorithm.get("filter_groups", None)
    if filter_groups is None or not filter_groups.get("enable", False):
        return None
    if not uses_dynstate(config.data):
        return None
    metric = filter_groups.get("metric", None)
    if not metric or not isinstance(metric, str):
        raise InvalidDataError(
            "algorithm.filter_groups.metric must be set with algorithm.filter_groups.enable=true: "
            "'reward' (each response's reward, rm_scores summed) or a key of the reward "
            "function's reward_extra_info such as 'acc'"
        )
    settings = Settings.from_config(config.data)
    train = config.data.get("train_batch_size")
    gen = config.data.get("gen_batch_size", None) or train
    for key, value in (("data.train_batch_size", train), ("data.gen_batch_size", gen)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidDataError(f"{key} must be a positive int, not {value!r}")
    bound = filter_groups.get("max_num_gen_batches", 0)
    if isinstance(bound, bool) or not isinstance(bound, int):
        raise InvalidDataError(
            f"algorithm.filter_groups.max_num_gen_batches must be an int (<= 0: no bound), not "
            f"{bound!r}"
        )
    sync = config.trainer.v1.get("sync", {}) or {}
    if int(sync.get("parameter_sync_step", 1) or 1) != 1:
        raise InvalidDataError(
            f"trainer.v1.sync.parameter_sync_step={sync.get('parameter_sync_step')} is not "
            "supported with algorithm.filter_groups.enable=true and a dynstate dataset: the "
            "step's filtered batch is one sample; set it to 1"
        )
    out = FilterSettings(
        metric=metric,
        gen_batch_size=gen,
        train_groups=train,
        max_gen_batches=bound if bound > 0 else None,
        surplus=settings.surplus,
        max_carry=settings.max_carry,
    )
    _check_max_carry(out)
    return out


def _check_max_carry(f: FilterSettings) -> None:
    if f.surplus == "carry" and f.max_carry is not None and f.max_carry < f.gen_batch_size - 1:
        raise InvalidDataError(
            f"data.dynstate.max_carry={f.max_carry} is below what one step can carry "
            f"(data.gen_batch_size - 1 = {f.gen_batch_size - 1} accepted groups beyond a full "
            "batch); raise it, or set data.dynstate.surplus=drop"
        )


class _Sampling(DynamicSampling):
    """DynamicSampling that remembers the indices of the generation batch it drew last: verl's
    items are built from them (verl's own ``__getitem__`` and ``collate_fn``)."""

    last_drawn: list[int] = []

    def _draw_batch(self) -> list[tuple[int, Any]]:
        pairs = super()._draw_batch()
        self.last_drawn = [index for index, _ in pairs]
        return pairs


class _FilteredBuffer(ReplayBuffer):
    """verl's sync ReplayBuffer whose train sample is the batch dynstate's group filtering
    chose (``prepared``); validation samples as verl's."""

    prepared: KVBatchMeta | None = None

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> Any:
        if partition_id != "train":
            return super().sample(global_steps, partition_id, batch_size)
        batch, self.prepared = self.prepared, None
        if batch is None:
            raise RuntimeError("dynstate's group filtering prepared no batch for this step")
        return batch, {}


def _trajectories(items: dict[str, dict], uid: str) -> list[str]:
    """The trajectory keys of group ``uid`` in TransferQueue's listing ``items``, in session
    order (its prompt entry left out)."""
    keys = [k for k, tag in items.items() if k.split("_")[0] == uid and k != uid]
    keys = [k for k in keys if not items[k].get("is_prompt", False)]
    return sorted(keys, key=lambda k: trajectory_order(k, {uid: 0}))


def _imported_rows(dataset: DynstateRLDataset) -> int:
    """Rows of the store as of the end of step 0 (the train files' import, and whatever was
    committed before the first round): what the first epoch pinned, asked of the one step
    query, so resets, rollbacks to step 0 and gc cuts are read as everywhere else."""
    store = dataset.store
    head = store.latest()
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


@register_trainer(TRAINER_MODE)
class DynstatePPOTrainer(StepRounds, PPOTrainerSync):
    """verl's V1 ``sync`` trainer with a dynstate train set: one committed round per step,
    durable before the step's checkpoint, and an exact resume."""

    train_dataloader: Any

    def __init__(self, config: Any) -> None:
        check_config(config)
        self._prompt_order: dict[str, int] = {}
        # group filtering: read before verl's _init_dataloader forces data.gen_batch_size to 1
        self._filter = filter_settings(config)
        self._dyn: _Sampling | None = None
        self._uids: dict[int, str] = {}  # id(group item) -> its TransferQueue uid
        self._step_uids: list[str] = []  # every uid the step being prepared submitted
        self._step_batch: StepBatch | None = None
        self._step_outcomes: tuple[int, dict[str, Any]] | None = None
        super().__init__(config)

    # verl keys its sync behaviour (ReplayBuffer, no TransferQueue checkpoint, no re-issue of
    # in-flight prompts, free gen_batch_size) on the mode's name; this trainer *is* sync.
    def _build_replay_buffer(self) -> Any:
        self.trainer_mode = "sync"
        self.parameter_sync_step = self.config.trainer.v1.get("sync", {}).get(
            "parameter_sync_step", 1
        )
        if self._filter is None:
            return super()._build_replay_buffer()
        # dynstate filters: verl's buffer without its DAPO (no uuid-ordered surplus, nothing
        # discarded), handing the trainer the batch dynstate chose
        sampler = self.config.trainer.v1.sampler
        train_batch_size = int(self.config.data.train_batch_size)
        return _FilteredBuffer(
            trainer_mode="sync",
            trainer_config=self.config.trainer.v1.get("sync", {}),
            max_off_policy_threshold=sampler.max_off_policy_threshold,
            max_off_policy_strategy=sampler.max_off_policy_strategy,
            sampler_kwargs=sampler.sampler_kwargs,
            refill_fn=self._add_prompts_to_generate,
            train_batch_size=train_batch_size,
            gen_batch_size=train_batch_size,
        )

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
        if self._filter is not None:
            # rows are drawn by DynamicSampling's own loader (generation batches of
            # data.gen_batch_size, in the driver); data.pt saves its position
            self._dyn = self._make_sampling(dataset)
            self.train_dataloader = self._dyn._loader
            sampler = self._dyn.sampler
        else:
            # check_config keeps gen_batch_size at train_batch_size: one loader batch is one
            # training step, which is what the sampler counts (mix mode's lag, epoch pinning)
            sampler = dataset.make_sampler(batch_size=old.batch_size, drop_last=old.drop_last)
            self.train_dataloader = loader_over(
                dataset, old, sampler, batch_size=old.batch_size, drop_last=old.drop_last
            )
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

    # -- group filtering (algorithm.filter_groups) -------------------------------------------------

    def _make_sampling(self, dataset: DynstateRLDataset) -> _Sampling:
        f = self._filter
        assert f is not None
        sampler = dataset.make_sampler(batch_size=f.gen_batch_size, drop_last=True)
        try:
            return _Sampling(
                dataset.rows,
                sampler,
                gen_batch_size=f.gen_batch_size,
                train_groups=f.train_groups,
                rule=f.rule(),
                max_gen_batches=f.max_gen_batches,
                surplus=f.surplus,
                max_carry=f.max_carry,
            )
        except InvalidDataError as exc:
            raise InvalidDataError(
                f"algorithm.filter_groups with data.dynstate: {exc} (data.gen_batch_size is the "
                "generation batch, data.train_batch_size the groups a step trains)"
            ) from exc

    def prepare_step(self) -> dict:
        if self._dyn is None:
            return super().prepare_step()
        step = self.global_steps
        self._step_uids = []
        batch = self._dyn.next_batch(step, self._score_gen_batch)
        url = self._dyn.store.display_url
        if not batch.groups:
            raise InvalidDataError(
                f"step {step} accepted no group in {batch.record['gen_batches']} generation "
                f"batches of {url} (algorithm.filter_groups.max_num_gen_batches="
                f"{self._filter.max_gen_batches if self._filter else None}): every group's "
                f"{self._filter.metric if self._filter else 'metric'} was the same for all its "
                "responses; raise the bound, or check the reward"
            )
        trained = [self._uids[id(g.item)] for g in batch.groups]
        carry = {self._uids[id(g.item)] for g in self._dyn.carry}
        items = tq.kv_list("train").get("train", {}) or {}
        # the step's outcomes: every group it scored (trained, filtered, dropped, carried),
        # read before the filtered and dropped ones leave the queue — as DynamicSampling's
        # outcomes(); a carried group was credited at the step that scored it
        scored = [(g.row, self._uids[id(g.item)]) for g in batch.scored]
        self._step_outcomes = (
            step,
            trajectory_outcomes(
                [(row, _trajectories(items, uid)) for row, uid in scored], step, "train"
            ),
        )
        # filtered and dropped groups leave the queue now; the carry stays for the next step
        # (and its checkpoint), the trained groups until verl clears the step's batch
        gone = [u for u in self._step_uids if u not in carry and u not in set(trained)]
        if gone:
            dead = set(gone)
            tq.kv_clear(keys=[k for k in items if k.split("_")[0] in dead], partition_id="train")
        order = {uid: i for i, uid in enumerate(trained)}
        keys = sorted(
            (k for k in items if k.split("_")[0] in order and not items[k].get("is_prompt")),
            key=lambda k: trajectory_order(k, order),
        )
        assert isinstance(self.replay_buffer, _FilteredBuffer)
        self.replay_buffer.prepared = KVBatchMeta(
            partition_id="train", keys=keys, tags=[items[k] for k in keys]
        )
        self._prompt_order = order
        self._step_batch = batch
        self._uids = {id(g.item): self._uids[id(g.item)] for g in self._dyn.carry}
        return {}

    def _score_gen_batch(self, items: list[Any], step: int) -> list[list[float]]:
        """DynamicSampling's ``score``: one generation batch through verl's own rollout and
        reward (verl's items and collate_fn, ``_submit_batch_to_rollout``, the agent loop and
        its streamed reward), waited for, then each group's metric read from TransferQueue in
        session order."""
        from verl.utils import tensordict_utils as tu
        from verl.utils.dataset.rl_dataset import collate_fn

        assert self._dyn is not None and self._filter is not None
        indices = list(self._dyn.last_drawn)
        batch_dict = collate_fn([self.train_dataset[i] for i in indices])
        uids = [str(uuid.uuid4()) for _ in indices]
        batch_dict["uid"] = np.array(uids, dtype=object)
        batch = tu.get_tensordict(batch_dict)
        tu.assign_non_tensor_data(batch, "global_steps", step)
        self._submit_batch_to_rollout(batch)
        for item, uid in zip(items, uids, strict=True):
            self._uids[id(item)] = uid
        self._step_uids += uids
        keys = self._wait_terminal(uids, step)
        return self._group_scores(uids, keys, indices, step)

    def _wait_terminal(self, uids: list[str], step: int) -> dict[str, list[str]]:
        """Wait until every group of ``uids`` finished (or failed); their trajectory keys in
        session order. The prompt entries leave the queue then, as verl's sampler does."""
        waiting = set(uids)
        while True:
            items = tq.kv_list("train").get("train", {}) or {}
            done = {
                k
                for k, tag in items.items()
                if k in waiting and tag.get("status") in ("finished", "failure")
            }
            if done == waiting:
                break
            time.sleep(self.replay_buffer.poll_interval)
        tq.kv_clear(keys=list(uids), partition_id="train")
        out: dict[str, list[str]] = {u: [] for u in uids}
        for key, tag in items.items():
            uid = key.split("_")[0]
            if uid in out and key != uid and not tag.get("is_prompt", False):
                out[uid].append(key)
        order = {u: 0 for u in uids}
        for uid in out:
            out[uid].sort(key=lambda k: trajectory_order(k, order))
        return out

    def _group_scores(
        self, uids: list[str], keys: dict[str, list[str]], indices: list[int], step: int
    ) -> list[list[float]]:
        from ..loading.dataset import decode_index

        assert self._filter is not None
        metric = self._filter.metric
        flat = [k for u in uids for k in keys[u]]
        url = self._dyn.store.display_url if self._dyn is not None else "the store"
        for uid, index in zip(uids, indices, strict=True):
            if not keys[uid]:
                raise InvalidDataError(
                    f"row {decode_index(index)[1]} of {url} "
                    f"failed in every rollout session at step {step}: a group without responses "
                    "has no scores for algorithm.filter_groups to filter (trainer.v1.sampler."
                    "sync_refill_failed_groups is not supported with data.dynstate); fix the "
                    "rollout and resume"
                )
        field = "rm_scores" if metric == REWARD_METRIC else "extra_fields"
        data = tq.kv_batch_get(keys=flat, partition_id="train", select_fields=[field])
        values = list(data[field])
        by_key: dict[str, float] = {}
        for key, value in zip(flat, values, strict=True):
            if metric == REWARD_METRIC:
                by_key[key] = float(value.sum().item())
                continue
            extra = getattr(value, "data", value)
            info = extra.get("reward_extra_info", {}) if isinstance(extra, dict) else {}
            if metric not in info:
                raise InvalidDataError(
                    f"algorithm.filter_groups.metric={metric} is not in the reward_extra_info "
                    f"of trajectory {key} at step {step} (keys: {sorted(info)}); use 'reward' "
                    "or a key your reward function returns"
                )
            by_key[key] = float(info[metric])
        return [[by_key[k] for k in keys[u]] for u in uids]

    def _outcomes(self, step: int, batch: Any) -> dict[str, Any] | None:
        if self._step_outcomes is not None and self._step_outcomes[0] == step:
            return self._step_outcomes[1]
        return None

    def _save_carry(self, folder: str) -> None:
        """The carried groups' trajectories (every TransferQueue field and tag) into
        ``folder/dynstate_carry.pt``: the consumption record names the carry's rows and
        scores, this file holds the responses the next step trains."""
        assert self._dyn is not None
        carry = list(self._dyn.carry)
        uids = [self._uids[id(g.item)] for g in carry]
        items = tq.kv_list("train").get("train", {}) or {}
        groups: list[dict[str, Any]] = []
        for g, uid in zip(carry, uids, strict=True):
            keys = sorted(
                (k for k in items if k.split("_")[0] == uid and k != uid),
                key=lambda k: trajectory_order(k, {uid: 0}),
            )
            groups.append(
                {"row": g.row, "uid": uid, "keys": keys, "tags": [items[k] for k in keys]}
            )
        flat: list[str] = [k for grp in groups for k in grp["keys"]]
        fields = tq.kv_batch_get(keys=flat, partition_id="train") if flat else None
        os.makedirs(folder, exist_ok=True)
        # durable before verl's tracker file names this checkpoint (a power cut in between
        # must not leave a checkpoint that resumes without its carry)
        state = {"step": self.global_steps, "groups": groups, "fields": fields}
        save_durably(state, os.path.join(folder, CARRY_FILE))

    def _resume_filtered(self, dataset: DynstateRLDataset) -> None:
        """Resume group filtering at ``global_steps``: the consumption record of the step is
        checked against this run's settings (naming verl's keys) and the carry file against
        the record, before anything changes; then the store rolls back, the sampler takes the
        record's position, and the carried trajectories go back into TransferQueue."""
        step = int(self.global_steps)
        # a fresh DynamicSampling: verl just loaded data.pt into the old one's loader
        self._dyn = self._make_sampling(dataset)
        self.train_dataloader = self._dyn._loader
        self.train_dataloader_it = None
        if step <= 0:
            dataset.resume_filtered(self._dyn, 0)
            return
        url = dataset.store.display_url
        record = dataset.consumption_of(step)
        if record is None:
            raise StateMismatchError(
                f"{url} holds no consumption record for step {step}: its checkpoint was saved "
                "without group filtering (algorithm.filter_groups.enable=false), or the round "
                "was lost; resume with the checkpoint's algorithm.filter_groups settings — "
                "nothing was changed"
            )
        theirs, ours = record["settings"], self._dyn.settings()
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        if differ:
            said = ", ".join(
                f"{FILTER_KEYS.get(k, k)}: {theirs.get(k)!r} -> {ours.get(k)!r}" for k in differ
            )
            raise StateMismatchError(
                f"the group-filtering settings differ from those step {step} of {url} was run "
                f"with ({said}); resume with the checkpoint's settings — nothing was changed"
            )
        folder = checkpoint_dir(self.config.trainer, step)
        assert folder is not None  # step > 0
        saved = self._read_carry(folder, step, record, url)
        dataset.resume_filtered(self._dyn, step)
        if saved["groups"]:
            flat = [k for g in saved["groups"] for k in g["keys"]]
            tags = [t for g in saved["groups"] for t in g["tags"]]
            tq.kv_batch_put(keys=flat, partition_id="train", fields=saved["fields"], tags=tags)
        for g, grp in zip(self._dyn.carry, saved["groups"], strict=True):
            self._uids[id(g.item)] = grp["uid"]
        log.info("step %d: %d carried groups restored from %s", step, len(saved["groups"]), folder)

    @staticmethod
    def _read_carry(folder: str, step: int, record: dict, url: str) -> dict:
        path = os.path.join(folder, CARRY_FILE)
        if not os.path.exists(path):
            if not record["carry"]:
                return {"groups": [], "fields": None}
            raise CheckpointNotFoundError(
                f"{path} is missing: step {step} of {url} carries {len(record['carry'])} "
                "groups, whose responses the checkpoint holds; restore the checkpoint folder"
            )
        saved = torch.load(path, weights_only=False)
        rows = [int(r) for r, _ in record["carry"]]
        if saved.get("step") != step or [g["row"] for g in saved["groups"]] != rows:
            raise StateMismatchError(
                f"{path} holds the carry of step {saved.get('step')} (rows "
                f"{[g['row'] for g in saved['groups']]}), but the consumption record of step "
                f"{step} of {url} carries rows {rows}; the checkpoint folder and the store "
                "disagree — nothing was changed"
            )
        return dict(saved)

    # -- one round per step ----------------------------------------------------------------------

    def _next_train_batch(self, num_prompts: int | None = None) -> Any:
        batch = super()._next_train_batch(num_prompts)
        for uid in list(batch["uid"]):
            self._prompt_order.setdefault(str(uid), len(self._prompt_order))
        return batch

    def step(self, metrics: dict, timing_raw: dict) -> Any:
        self._prompt_order = {}
        return super().step(metrics, timing_raw)

    def _order_of(self, keys: list[str]) -> dict[str, int]:
        return self._prompt_order  # the loader's order (_next_train_batch), or the filter's

    def _consumption(self, step: int) -> dict | None:
        if self._step_batch is not None and self._step_batch.step == step:
            return self._step_batch.record
        return None

    def _committed(self, record: dict | None) -> None:
        self._step_batch = None
        self._step_outcomes = None

    def _before_checkpoint(self) -> None:
        if self._dyn is not None:
            # before verl writes its tracker file: a checkpoint never exists without its carry
            folder = os.path.join(
                str(self.config.trainer.default_local_dir), f"global_step_{self.global_steps}"
            )
            self._save_carry(folder)  # where verl's _save_checkpoint writes data.pt

    # -- resume ----------------------------------------------------------------------------------

    def _resume(self, dataset: DynstateRLDataset) -> None:
        if self._filter is not None:
            self._resume_filtered(dataset)
        else:
            folder = checkpoint_dir(self.config.trainer, self.global_steps)
            dataset.resume(folder, self.train_dataloader, self.global_steps)


def registered() -> type:
    """The class registered under ``trainer.v1.trainer_mode=dynstate``."""
    return TRAINER_REGISTRY[TRAINER_MODE]
