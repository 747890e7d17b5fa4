"""dynstate for verl's V1 async trainers (``colocate_async``, ``separate_async``): every row
drawn is trained, recorded as filtered or dropped (with its reason) or listed in flight, exactly
once across kills and resumes.

An asynchronous step's batch depends on which rollouts finish first, so an async run does not
promise batch equality with another run; it promises *exactly once* (issue 42.4). Each step's
round carries a format-2 consumption record (docs/format.md, "Consumption"):

- ``carried_in``: the previous step's ``in_flight``;
- ``drawn``: every row verl's loader handed out since the previous round (a step's prompts,
  the warm-up window, the refills after evictions), in draw order;
- ``trained``: the groups the step trained, one per prompt, in batch order;
- ``filtered`` (``algorithm.filter_groups``, spread 0: every response scored alike) and
  ``dropped`` (``stale``: older than ``trainer.v1.sampler.max_off_policy_threshold``;
  ``failed``: a rollout session failed), read by :class:`RecordingBuffer` from the prompt entry
  of each group verl's ``ReplayBufferAsync`` evicts, before it deletes it;
- ``in_flight``: the ``dynstate_row`` of every prompt entry in TransferQueue when the round
  commits (pending, running, or finished and not yet trained);
- ``sampler``: the loader's position, which must be ``data.pt``'s.

The record's check is the step's equation ``carried_in + drawn = trained + filtered + dropped +
in_flight``; chained over a lineage, the rows drawn are the rows trained plus dropped plus the
last step's in flight. The round commits before verl writes ``data.pt`` and
``transfer_queue/`` (``_save_checkpoint``), and nothing in the driver changes the prompt entries
in between, so a checkpoint's TransferQueue holds exactly its record's ``in_flight``. A resume
checks that, the record's settings and ``data.pt``'s position before anything changes, then
rolls the store back to the checkpoint's step; verl re-issues the restored prompts that were
pending or running, and they are the next step's ``carried_in``, not new draws. Orphan
trajectories (a trained batch's, saved before verl clears them) are deleted.

The two modes differ in where rollouts run (``colocate_async`` pauses its replicas while a step
trains; ``separate_async``'s standalone replicas never stop), not in how prompts enter and leave
TransferQueue: in both, only the driver submits, samples and evicts prompt entries, so the same
recording holds (:class:`AsyncRounds`, mixed into each of verl's classes).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from typing import Any

import transfer_queue as tq
from verl.trainer.ppo.v1 import register_trainer
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

from ..errors import CheckpointNotFoundError, InvalidDataError, StateMismatchError
from ..loading.state import find_sampler_state
from ..records.consumption import ASYNC_FORMAT
from .dataset import DynstateRLDataset
from .outcomes import batch_outcomes, join_outcomes
from .trainer import checkpoint_dir
from .v1 import ASYNC_TRAINERS, _imported_rows, check_async_config
from .v1_rounds import StepRounds, loader_over, trajectory_order, trajectory_outcomes

log = logging.getLogger("dynstate")

#: the ``trainer.v1.trainer_mode`` values this module registers, for verl's two async modes
COLOCATE_MODE = ASYNC_TRAINERS["colocate_async"]
SEPARATE_MODE = ASYNC_TRAINERS["separate_async"]
ROW_FIELD = "dynstate_row"
PARTITION = "train"


def async_settings(config: Any, mode: str) -> dict[str, Any]:
    """What decides which rows an async step evicts (a resume with others is refused)."""
    sampler = config.trainer.v1.sampler
    filter_groups = config.algorithm.get("filter_groups", None) or {}
    metric = filter_groups.get("metric", None) if filter_groups.get("enable", False) else None
    threshold = sampler.get("max_off_policy_threshold", None)
    return {
        "trainer_mode": mode,
        "train_batch_size": int(config.data.train_batch_size),
        "max_off_policy_threshold": None if threshold is None else int(threshold),
        "max_off_policy_strategy": str(sampler.get("max_off_policy_strategy", "drop")),
        "filter_metric": None if metric is None else str(metric),
    }


SETTING_KEYS = {
    "trainer_mode": "trainer.v1.trainer_mode",
    "train_batch_size": "data.train_batch_size",
    "max_off_policy_threshold": "trainer.v1.sampler.max_off_policy_threshold",
    "max_off_policy_strategy": "trainer.v1.sampler.max_off_policy_strategy",
    "filter_metric": "algorithm.filter_groups.metric",
}


def _rows_of(uids: list[str]) -> dict[str, int]:
    """The ``dynstate_row`` of the prompt entries ``uids`` (async modes store each prompt's
    fields with its entry, for re-issue after a resume)."""
    if not uids:
        return {}
    data = tq.kv_batch_get(keys=uids, partition_id=PARTITION, select_fields=[ROW_FIELD])
    values = data[ROW_FIELD]
    rows = values.tolist() if hasattr(values, "tolist") else list(values)
    return {uid: int(row) for uid, row in zip(uids, rows, strict=True)}


def _prompt_entries() -> dict[str, dict]:
    items = tq.kv_list(PARTITION).get(PARTITION, {}) or {}
    return {k: tag for k, tag in items.items() if tag.get("is_prompt", False)}


class RecordingBuffer(ReplayBufferAsync):
    """verl's ``ReplayBufferAsync`` that tells :attr:`on_evicted` the uids it is about to evict
    (stale, filtered, failed) while their prompt entries, rows and trajectories still exist,
    with the trajectory keys of each evicted group that finished (its responses scored)."""

    on_evicted: Any = None

    def _evict_terminal_groups(
        self, global_steps: int, partition_id: str, eviction_reasons: Any
    ) -> Any:
        stale, filtered, failed, _counts = eviction_reasons
        evicted = stale | filtered | failed
        if partition_id == PARTITION and self.on_evicted is not None and evicted:
            finished = (stale | filtered) & set(self.finished_keys[partition_id]) - set(failed)
            scored: dict[str, list[str]] = {uid: [] for uid in finished}
            for key, tag in self.partitions[partition_id].items():
                uid = key.split("_")[0]
                if uid in scored and key != uid and not tag.get("is_prompt", False):
                    scored[uid].append(key)
            for uid, keys in scored.items():
                keys.sort(key=lambda k: trajectory_order(k, {uid: 0}))
            self.on_evicted(set(stale), set(filtered), set(failed), scored)
        return super()._evict_terminal_groups(global_steps, partition_id, eviction_reasons)


class _Consumed:
    """What the step under way consumed, built up as verl draws, trains and evicts."""

    def __init__(self, carried_in: list[int]) -> None:
        self.carried_in = list(carried_in)
        self.drawn: list[int] = []
        self.trained: list[int] = []
        self.filtered: list[list[Any]] = []
        self.dropped: list[list[Any]] = []
        self.scored: list[dict[str, Any]] = []  # the outcomes of evicted groups that finished

    def evicted(
        self,
        stale: set[str],
        filtered: set[str],
        failed: set[str],
        scored: dict[str, list[str]],
    ) -> None:
        rows = _rows_of(sorted(stale | filtered | failed))
        for uid in sorted(rows, key=lambda u: rows[u]):
            if uid in failed:
                self.dropped.append([rows[uid], "failed"])
            elif uid in stale:
                self.dropped.append([rows[uid], "stale"])
            else:  # verl's DAPO rule: every response's metric the same
                self.filtered.append([rows[uid], 0.0])
        # a filtered or stale group's responses were scored: outcomes, as a trained group's
        # (a row filtered every time counts as tried); a failed group's were not all scored
        groups = [(rows[uid], scored[uid]) for uid in sorted(scored, key=lambda u: rows[u])]
        if groups:
            self.scored.append(trajectory_outcomes(groups, 0, PARTITION))  # step: at commit


class AsyncRounds(StepRounds):
    """What dynstate adds to a verl V1 async trainer (mixed in before verl's class): one
    committed round per step with its consumption record, durable before the step's
    checkpoint, and a resume that loses and repeats no drawn row."""

    VERL_MODE = ""  # verl's mode name, which verl keys its async behaviour on
    train_dataloader: Any

    def __init__(self, config: Any) -> None:
        check_async_config(config, self.VERL_MODE)
        self._settings = async_settings(config, self.VERL_MODE)
        self._consumed = _Consumed([])
        super().__init__(config)

    # verl keys its async behaviour (TransferQueue checkpoints, re-issue of in-flight prompts,
    # prompt fields stored with their entries) on the mode's name
    def _build_replay_buffer(self) -> Any:
        self.trainer_mode = self.VERL_MODE
        mode_config = self.config.trainer.v1.get(self.VERL_MODE, {}) or {}
        self.parameter_sync_step = mode_config.get("parameter_sync_step", 1)
        sampler = self.config.trainer.v1.sampler
        buffer = RecordingBuffer(
            trainer_mode=self.VERL_MODE,
            trainer_config=mode_config,
            max_off_policy_threshold=sampler.max_off_policy_threshold,
            max_off_policy_strategy=sampler.max_off_policy_strategy,
            sampler_kwargs=sampler.sampler_kwargs,
            refill_fn=self._add_prompts_to_generate,
            filter_groups_metric=self._resolve_filter_groups_metric(),
        )
        buffer.on_evicted = self._evicted
        return buffer

    def _evicted(
        self, stale: set[str], filtered: set[str], failed: set[str], scored: dict[str, list[str]]
    ) -> None:
        self._consumed.evicted(stale, filtered, failed, scored)

    # -- the sampler ---------------------------------------------------------------------------

    def _init_dataloader(self) -> None:
        super()._init_dataloader()  # forces data.gen_batch_size=1: one row per loader batch
        dataset = self.dynstate_dataset
        if dataset is None:
            raise InvalidDataError(
                f"trainer.v1.trainer_mode={ASYNC_TRAINERS[self.VERL_MODE]} needs a "
                "DynstateRLDataset train set (data.custom_cls and data.dynstate.url); without one "
                f"run verl's {self.VERL_MODE}"
            )
        old = self.train_dataloader
        sampler = dataset.make_sampler(batch_size=1, drop_last=True)
        # An async step draws a varying number of rows; an epoch pins the version of the round
        # of the last step that ended before the draw (never a round not yet committed).
        sampler.round_clock = lambda _sampler_step: max(0, int(self.global_steps) - 1)
        self.train_dataloader = loader_over(dataset, old, sampler, batch_size=1, drop_last=True)
        self.train_dataloader_it = None
        train_batch_size = int(self.config.data.train_batch_size)
        base = _imported_rows(dataset)
        self.steps_per_epoch = max(1, base // train_batch_size)
        if self.config.trainer.total_training_steps is None:
            self.total_training_steps = self.steps_per_epoch * self.config.trainer.total_epochs
        log.info("dynstate train sampler installed (%s, one row per loader batch)", self.VERL_MODE)

    # -- what a step consumed ------------------------------------------------------------------

    def _next_train_batch(self, num_prompts: int | None = None) -> Any:
        batch = super()._next_train_batch(num_prompts)
        values = batch[ROW_FIELD]
        rows = values.tolist() if hasattr(values, "tolist") else list(values)
        self._consumed.drawn += [int(r) for r in rows]
        return batch

    def _order_of(self, keys: list[str]) -> dict[str, int]:
        order: dict[str, int] = {}
        for key in keys:
            order.setdefault(key.split("_")[0], len(order))
        return order

    def step(self, metrics: dict, timing_raw: dict) -> Any:
        batch = super().step(metrics, timing_raw)
        assert self._scored is not None  # the dataset is dynstate's (_init_dataloader)
        scored = self._scored[1]
        seen: set[str] = set()
        for uid, row in zip(
            scored.non_tensor_batch["uid"], scored.non_tensor_batch[ROW_FIELD], strict=True
        ):
            if uid not in seen:
                seen.add(uid)
                self._consumed.trained.append(int(row))
        return batch

    def _consumption(self, step: int) -> dict[str, Any]:
        """The step's consumption record, with the prompt entries now in TransferQueue as its
        ``in_flight`` and the loader's position as its ``sampler``."""
        entries = _prompt_entries()
        rows = _rows_of(sorted(entries))
        in_flight = sorted(rows.values())
        c = self._consumed
        position = find_sampler_state(self.train_dataloader.state_dict())
        assert position is not None  # the loader draws from the dataset's sampler
        named = [*c.carried_in, *c.drawn, *c.trained, *in_flight]
        dataset = self.dynstate_dataset
        assert dataset is not None
        return {
            "format": ASYNC_FORMAT,
            "step": step,
            "rows_version": dataset.store.latest() if named else None,
            "settings": dict(self._settings),
            "carried_in": list(c.carried_in),
            "drawn": list(c.drawn),
            "gen_batches": len(c.drawn),
            "trained": list(c.trained),
            "filtered": list(c.filtered),
            "dropped": list(c.dropped),
            "carry": [],
            "in_flight": in_flight,
            "sampler": json.loads(json.dumps(position)),
        }

    # -- one round per step ----------------------------------------------------------------------

    def _outcomes(self, step: int, batch: Any) -> dict[str, Any] | None:
        """The trained groups' outcomes and those of the groups the step evicted after
        scoring them (filtered, stale), each once, at the step whose record names it."""
        if not self._consumed.scored:
            return None
        trained = batch_outcomes(batch, step)
        return join_outcomes([*([trained] if trained else []), *self._consumed.scored], step)

    def _committed(self, record: dict | None) -> None:
        assert record is not None
        self._consumed = _Consumed(record["in_flight"])

    # -- resume ----------------------------------------------------------------------------------

    def _resume(self, dataset: DynstateRLDataset) -> None:
        step = int(self.global_steps)
        if step <= 0:
            dataset.resume_async(None, self.train_dataloader, 0)
            self._consumed = _Consumed([])
            return
        folder = checkpoint_dir(self.config.trainer, step)
        assert folder is not None
        record = self._checked_record(dataset, folder, step)
        dataset.resume_async(folder, self.train_dataloader, step, record["sampler"])
        self._clear_orphans()
        self._consumed = _Consumed(record["in_flight"])
        log.info(
            "step %d: %d rows in flight restored from %s", step, len(record["in_flight"]), folder
        )

    def _checked_record(self, dataset: DynstateRLDataset, folder: str, step: int) -> dict:
        """The consumption record of ``step``, checked against this run's settings and the
        checkpoint's TransferQueue before anything changes."""
        url = dataset.store.display_url
        record = dataset.consumption_of(step)
        if record is None or record.get("format") != ASYNC_FORMAT:
            raise StateMismatchError(
                f"{url} holds no asynchronous consumption record for step {step}: its "
                f"checkpoint was not written by trainer.v1.trainer_mode={self.VERL_MODE} with "
                "dynstate, or its round was lost; resume with the checkpoint's trainer mode — "
                "nothing was changed"
            )
        theirs, ours = record["settings"], self._settings
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        if differ:
            said = ", ".join(
                f"{SETTING_KEYS.get(k, k)}: {theirs.get(k)!r} -> {ours.get(k)!r}" for k in differ
            )
            raise StateMismatchError(
                f"the settings differ from those step {step} of {url} was run with ({said}); "
                "resume with the checkpoint's settings — nothing was changed"
            )
        meta_path = os.path.join(folder, "transfer_queue", "metadata.json")
        if not os.path.exists(meta_path):
            raise CheckpointNotFoundError(
                f"{meta_path} is missing: step {step} of {url} has "
                f"{len(record['in_flight'])} rows in flight, which the checkpoint's "
                "transfer_queue/ holds; restore the checkpoint folder"
            )
        with open(meta_path) as f:
            if not json.load(f).get("storage_saved", False):
                raise StateMismatchError(
                    f"{meta_path} says its TransferQueue storage was not saved (a backend "
                    "without storage checkpoints), so the finished groups in flight at step "
                    f"{step} of {url} have no responses; use TransferQueue's SimpleStorage"
                )
        restored = sorted(_rows_of(sorted(_prompt_entries())).values())
        if Counter(restored) != Counter(record["in_flight"]):
            raise StateMismatchError(
                f"the TransferQueue checkpoint in {folder} holds the prompts of rows "
                f"{restored[:16]}, but the consumption record of step {step} of {url} lists "
                f"rows {sorted(record['in_flight'])[:16]} in flight; the checkpoint folder and "
                "the store disagree — nothing was changed"
            )
        return record

    @staticmethod
    def _clear_orphans() -> None:
        """Trajectories whose prompt entry is gone (a trained batch, saved in the checkpoint
        before verl cleared it): never sampled again, so deleted."""
        items = tq.kv_list(PARTITION).get(PARTITION, {}) or {}
        prompts = {k for k, tag in items.items() if tag.get("is_prompt", False)}
        orphans = [k for k in items if k not in prompts and k.split("_")[0] not in prompts]
        if orphans:
            tq.kv_clear(keys=orphans, partition_id=PARTITION)
            log.info("cleared %d trajectories of trained groups from the checkpoint", len(orphans))


@register_trainer(COLOCATE_MODE)
class DynstateColocateAsync(AsyncRounds, PPOTrainerColocateAsync):
    """verl's ``colocate_async`` trainer with a dynstate train set (:class:`AsyncRounds`)."""

    VERL_MODE = "colocate_async"


@register_trainer(SEPARATE_MODE)
class DynstateSeparateAsync(AsyncRounds, PPOTrainerSeparateAsync):
    """verl's ``separate_async`` trainer with a dynstate train set (:class:`AsyncRounds`)."""

    VERL_MODE = "separate_async"
