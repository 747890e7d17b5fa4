"""DynstateGRPOTrainer: TRL's ``GRPOTrainer`` training on a dynstate store.

Each optimizer step ``s`` (TRL's ``global_step``, from 1): the loader draws the step's prompts
from the store (:mod:`dynstate.trl.loader`); GRPO generates and scores them; after the
optimizer step the generator (if any) writes new rows, and one version is committed holding
the round, the step's outcomes (one record per response: ``row``, ``step``, ``score``, the
reward functions' weighted sum) and the generator's state, bound to the version the prompts
were read at (``rows_version``). The checkpoint the Trainer then saves holds the loader's
position (``checkpoint-N/dynstate_state.pt``). ``train(resume_from_checkpoint=...)`` checks
that state, rolls the store back to the round of step N (rounds a killed run committed after
its checkpoint are abandoned, as under verl) and loads the generator's state of that version.

With ``filter_groups`` (:class:`FilterGroups`) a step's prompts come from a
:class:`~dynstate.DynamicSampling` instead: generation batches are drawn, generated and scored
through GRPOTrainer's own ``_generate_and_score_completions`` until the step's groups are
accepted; the round commits the step's consumption record too, and the carried groups'
completions go into ``checkpoint-N/dynstate_carry.pt``.

In several processes (``torchrun``, ``accelerate launch``) each process draws its share of a
step from one sampler position (``num_replicas``/``rank``), the step's rows are gathered in the
order GRPOTrainer gathers the rewards, rank 0 alone runs the generator, commits the round and
saves ``dynstate_state.pt`` (the same position on every rank), and broadcasts what it committed
before any rank draws again. With ``filter_groups`` the processes are ``DynamicSampling``'s
ranks: they draw generation batches in lockstep, each scores the prompts dealt to it alone,
and rank 0 commits the one record of every rank's groups and saves every rank's carry.

A generation may serve several optimizer steps (``steps_per_generation * num_iterations`` a
multiple ``k`` of ``gradient_accumulation_steps``): dynstate's step is then one generation, its
round committed after the generation's last optimizer step (TRL's ``global_step`` ``k * s``),
and checkpoints land only there, so that no checkpoint holds GRPO's buffered completions.

What cannot be made exact is refused at construction, naming the setting: a generation that
ends inside an optimizer step or several generations in one, ``save_steps``/``max_steps`` not a
multiple of ``k``, ``save_strategy="best"`` with ``k > 1``, ``max_steps`` unset,
``filter_groups`` with loader workers or with ``k > 1``, a process's responses not whole
groups; with filtering also a ``num_generations`` that does not split over
``steps_per_generation``. See docs/trl.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from trl import GRPOTrainer

from .. import rollback, version_at_step
from ..errors import InvalidDataError, StateMismatchError
from ..generators import check_generator, check_state_owner, round_table
from ..loading.checkpoint import load_loader_state, save_durably, sync_checkpoint, sync_folder
from ..loading.consumption import DynamicSampling
from ..loading.dataset import VersionedDataset
from ..loading.sampler import VersionedSampler
from ..loading.selection import pass_rates
from ..records.rounds import SELECT_META
from ..store import Store
from . import loader as loader_mod
from .generator import RoundView, StepBatch, generator_name, load_state, run_generator, state_of

log = logging.getLogger("dynstate")

METRIC_PREFIX = "dynstate/"
FIRST_STEP = 1  # TRL's global_step after the first optimizer step


@dataclass(frozen=True)
class FilterGroups:
    """Group filtering with carry-over (DAPO's dynamic sampling), the setting
    ``DynstateGRPOTrainer(filter_groups=...)`` (``True``: these defaults). Each step draws
    generation batches of ``gen_prompts`` prompts (default: the step's prompts,
    ``generation_batch_size / num_generations``), generates and scores each prompt's group,
    keeps the groups ``rule`` accepts (``"zero_variance"``, :class:`~dynstate.StdThreshold`,
    a :class:`~dynstate.FilterRule`), and draws again until the step's prompts are filled or
    ``max_gen_batches`` batches were drawn; accepted groups beyond the batch are carried to the
    next step with their completions (``surplus="carry"``) or dropped (``"drop"``).
    ``max_carry`` bounds the carry (default: ``gen_prompts`` + the step's prompts). These are
    :class:`~dynstate.DynamicSampling`'s settings; a resume must use the checkpoint's."""

    rule: Any = "zero_variance"
    gen_prompts: int | None = None
    max_gen_batches: int | None = 10
    surplus: str = "carry"
    max_carry: int | None = None


# What GRPOTrainer's generation returns per response, and how a group's rows are padded when
# groups from several generation batches (and the carry) are put together: the prompt on the
# left, the completion on the right, as GRPOTrainer pads them.
_LEFT = {"prompt_ids", "prompt_mask"}


def _pad_value(key: str, pad_id: int) -> float:
    if key in ("prompt_ids", "completion_ids"):
        return pad_id
    return 1 if key == "tool_mask" else 0


@dataclass(frozen=True)
class Round:
    """What the step just trained and committed (``trainer.dynstate_round``): the store rows of
    its prompts in the order the loader drew them, one reward per response (group after group,
    in that order), and the version committed."""

    step: int
    rows: list[int]
    rewards: list[float]
    rows_version: int
    version: int
    added: int
    consumption: dict[str, Any] | None = None
    # TRL's global_step the round was committed after: ``step`` times the optimizer steps
    # per generation (the same number unless one generation spans several optimizer steps)
    global_step: int = 0


class DynstateGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` over a dynstate store. ``train_dataset`` is a
    :class:`~dynstate.VersionedDataset` (or a :class:`~dynstate.Store`); the other arguments
    are ``GRPOTrainer``'s, plus:

    * ``generator``: writes a round between steps (interfaces in :mod:`dynstate.trl.generator`);
    * ``select``: a selection policy of :class:`~dynstate.VersionedSampler` (``Learnability()``…);
    * ``mode``, ``fresh_share``, ``lag``: the sampler's (``"mix"`` trains new rows within
      ``lag`` steps — with ``filter_groups``, ``lag`` generation batches; ``"epoch"`` at the
      next epoch);
    * ``sampler_seed``: the sampler's seed (default ``args.seed``);
    * ``filter_groups``: group filtering with carry-over, ``True`` or a :class:`FilterGroups`
      (each step's consumption is committed with its round; docs/trl.md).
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        args: Any = None,
        train_dataset: Any = None,
        *,
        generator: Any = None,
        select: Any = None,
        mode: str = "epoch",
        fresh_share: float = 0.25,
        lag: int = 1,
        sampler_seed: int | None = None,
        filter_groups: bool | FilterGroups | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(train_dataset, Store):
            train_dataset = VersionedDataset(train_dataset)
        if not isinstance(train_dataset, VersionedDataset):
            raise InvalidDataError(
                "DynstateGRPOTrainer trains on a dynstate store: pass "
                "train_dataset=dynstate.VersionedDataset(store) (or the Store), not "
                f"{type(train_dataset).__name__}; append a datasets.Dataset to the store first "
                "with store.append(dataset)"
            )
        if kwargs.get("eval_dataset") is not None:
            log.info("eval_dataset is evaluated by GRPOTrainer as usual; dynstate records nothing")
        store = train_dataset.store
        check_generator(generator, f"DynstateGRPOTrainer over {store.display_url}")
        if sampler_seed is not None and type(sampler_seed) is not int:
            raise InvalidDataError(
                f"DynstateGRPOTrainer over {store.display_url}: sampler_seed must be an int (or "
                f"None for args.seed), not {sampler_seed!r}"
            )
        # GRPOTrainer type-checks train_dataset as a datasets.Dataset and reads no row of it
        # when get_train_dataloader is ours: a one-row placeholder passes the check; the store
        # takes its place right after.
        import datasets

        placeholder = datasets.Dataset.from_dict({"prompt": [""]})
        super().__init__(model=model, reward_funcs=reward_funcs, args=args,
                         train_dataset=placeholder, **kwargs)  # fmt: skip
        self._filter = _filter_settings(filter_groups, store.display_url)
        self._check_settings(store)
        self.train_dataset = train_dataset
        self._rows: VersionedDataset = train_dataset
        self.dynstate_store = store
        self.dynstate_generator = generator
        self.dynstate_round: Round | None = None
        # a resume's changes, made once transformers has loaded the checkpoint
        self._after_load: Callable[[], None] | None = None
        self._sampler_args = {
            "select": select,
            "mode": mode,
            "fresh_share": fresh_share,
            "lag": lag,
            "seed": self.args.seed if sampler_seed is None else sampler_seed,
        }
        config: Any = self.args
        self._group: int = int(self.num_generations or 1)
        # the prompts of one process's generation batch (GRPOTrainer's generation_batch_size
        # counts every process's); each process draws its share from the one sampler position
        self._world = int(self.accelerator.num_processes)
        self._rank = int(self.accelerator.process_index)
        self._prompts_per_batch = int(config.generation_batch_size) // self._group // self._world
        # micro-steps one generation serves, and optimizer steps per dynstate step (one
        # generation; _check_settings made it whole)
        self._micro_per_gen = int(config.steps_per_generation) * int(config.num_iterations)
        self._per_round = self._micro_per_gen // int(config.gradient_accumulation_steps)
        self._loader: Any = None
        self._batches: loader_mod.EndlessBatches | None = None
        self._scored: dict[str, Any] | None = None
        self._rewards_per_func: torch.Tensor | None = None
        # The Trainer would skip the batches a checkpoint trained by replaying the loader; the
        # loader's own state resumes it instead.
        self.args.ignore_data_skip = True
        self._dyn: DynamicSampling | None = None
        # each scored group's completions as GRPOTrainer's tensors, by the id of its item
        # (held too, so that the id is not reused while the entry lives)
        self._parts: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._step_scored: list[tuple[int, list[float], Any, list[Any]]] = []
        self._completions: list[Any] = []  # the last reward call's, this process's
        if self._filter is None:
            self._make_loader()  # refuses bad sampler settings here, at start-up
        else:
            self._make_filter(store)
        # First, so that the callbacks a user passed see the round of the step that ended
        # (dynstate_round) in on_step_end, as those added after construction do.
        self.callback_handler.callbacks.insert(0, _RoundCallback(self))

    # -- start-up checks ---------------------------------------------------------------------

    def _check_settings(self, store: Store) -> None:
        a: Any = self.args  # a GRPOConfig
        url = store.display_url

        def refuse(setting: str, why: str) -> InvalidDataError:
            return InvalidDataError(f"DynstateGRPOTrainer over {url}: {setting} {why}")

        local = int(a.per_device_train_batch_size) * int(a.steps_per_generation)
        if self.accelerator.num_processes > 1 and local % int(a.num_generations or 1):
            raise refuse(
                f"runs in {self.accelerator.num_processes} processes with "
                f"per_device_train_batch_size={a.per_device_train_batch_size} x "
                f"steps_per_generation={a.steps_per_generation} = {local} responses per process",
                f"not a multiple of num_generations={a.num_generations}: each process draws "
                "whole groups from the store; use a multiple",
            )
        if a.dataloader_num_workers and self._filter is not None:
            raise refuse(
                f"runs filter_groups with dataloader_num_workers={a.dataloader_num_workers}",
                "but group filtering draws its generation batches in the trainer's process "
                "(DynamicSampling refuses workers: an epoch starting mid-step would pin its "
                "version by timing); set dataloader_num_workers=0",
            )
        # A generation (one loader batch) serves steps_per_generation * num_iterations
        # micro-steps; dynstate's step is one generation, so it must end at an optimizer step.
        spg, iters, ga = (
            int(a.steps_per_generation),
            int(a.num_iterations),
            int(a.gradient_accumulation_steps),
        )
        micro = spg * iters
        named = (
            f"steps_per_generation={spg} x num_iterations={iters} = {micro} micro-steps per "
            f"generation with gradient_accumulation_steps={ga}"
        )
        if micro < ga:
            raise refuse(
                named,
                "would train several generations in one optimizer step, which this integration "
                "does not do yet (one generation is one dynstate step); make steps_per_generation "
                "x num_iterations a multiple of gradient_accumulation_steps",
            )
        if micro % ga:
            raise refuse(
                named,
                "would end a generation inside an optimizer step, and a checkpoint there could "
                "not resume the buffered completions; make steps_per_generation x "
                "num_iterations a multiple of gradient_accumulation_steps",
            )
        per = micro // ga  # optimizer steps per generation (per dynstate step)
        if per > 1:
            self._check_generation_steps(a, per, named, refuse)
        if a.max_steps is None or a.max_steps <= 0:
            raise refuse(
                f"max_steps={a.max_steps}",
                "is unset: a growing store has no fixed epoch length, so the run is measured "
                "in steps; set max_steps",
            )
        rows, per_step = (
            store.snapshot(store.resolve(None)).num_rows,
            int(a.generation_batch_size) // int(a.num_generations),
        )
        if rows < per_step:
            raise refuse(
                f"has {rows} rows",
                f"but each step trains {per_step} prompts (generation_batch_size / "
                "num_generations); append at least that many tasks before training",
            )

    def _check_generation_steps(self, a: Any, per: int, named: str, refuse: Any) -> None:
        """A generation spans ``per`` optimizer steps: a checkpoint inside it would have to
        hold GRPO's buffered completions (made by weights the checkpoint no longer has), so
        checkpoints land only where a generation ends, and so does the run."""
        import math

        why = (
            f"{named} spans {per} optimizer steps per generation, and a checkpoint inside a "
            "generation cannot resume GRPO's buffered completions exactly"
        )
        if self._filter is not None:
            raise refuse(
                f"runs filter_groups with {named}",
                f"({per} optimizer steps per generation), which is not supported yet: a "
                "filtering step is one optimizer step; train without filter_groups, or with "
                "steps_per_generation x num_iterations = gradient_accumulation_steps",
            )
        steps = a.max_steps
        if isinstance(steps, int) and steps > 0 and steps % per:
            raise refuse(f"max_steps={steps}", f"is not a multiple of {per}: {why} (the Trainer "
                         f"saves the last step); use a multiple of {per}")  # fmt: skip
        strategy = str(getattr(a.save_strategy, "value", a.save_strategy))
        if strategy == "best":
            raise refuse(
                "save_strategy='best'",
                f"saves at whatever step a metric improves: {why}; use save_strategy='steps' "
                f"with save_steps a multiple of {per}",
            )
        if strategy == "steps":
            save = a.save_steps
            every = math.ceil(steps * save) if save < 1 else int(save)
            if every % per:
                raise refuse(f"save_steps={save}", f"(every {every} steps) is not a multiple of "
                             f"{per}: {why}; use a multiple of {per}")  # fmt: skip

    def _make_loader(self) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        store, items = self.dynstate_store, loader_mod.Items(self._rows)
        s = self._sampler_args
        sampler = VersionedSampler(
            self._rows,
            seed=s["seed"],
            mode=s["mode"],
            batch_size=self._prompts_per_batch,
            fresh_share=s["fresh_share"],
            lag=s["lag"],
            # each process takes every world-th position of a step's share: the sampler's
            # position (and so its state) stays the same on every process
            num_replicas=self._world,
            rank=self._rank,
            first_step=FIRST_STEP,
            # every step a whole generation batch: GRPO's groups and the step count stay whole
            drop_last=True,
            select=s["select"],
        )
        loader = StatefulDataLoader(
            items,
            batch_size=self._prompts_per_batch,
            drop_last=True,
            sampler=sampler,
            collate_fn=loader_mod.RepeatCollate(self._group),
            # workers read rows only: the sampler draws in this process, and an epoch's
            # iterator never prefetches past its end, so the next epoch pins its version when
            # the Trainer asks for its first batch, after the round of the step before
            num_workers=int(self.args.dataloader_num_workers),
            prefetch_factor=self.args.dataloader_prefetch_factor
            if self.args.dataloader_num_workers
            else None,
            persistent_workers=bool(self.args.dataloader_persistent_workers)
            and bool(self.args.dataloader_num_workers),
            # its own generator: torch's global one is the Trainer's (restored on resume)
            generator=torch.Generator().manual_seed(int(s["seed"]) % 2**63),
        )
        sampler.check_loader(loader)
        self._sampler, self._loader = sampler, loader
        self._batches = loader_mod.EndlessBatches(loader, self._micro_per_gen, store.display_url)

    def _make_filter(self, store: Store) -> None:
        """The ``DynamicSampling`` of ``filter_groups``, refusing what it cannot make exact."""
        f, s, a = self._filter, self._sampler_args, self.args
        config: Any = a  # a GRPOConfig
        assert f is not None
        url = store.display_url
        spg = int(config.steps_per_generation)
        if f.max_gen_batches is not None and self._group % spg:
            raise InvalidDataError(
                f"DynstateGRPOTrainer over {url}: filter_groups with max_gen_batches="
                f"{f.max_gen_batches} and num_generations={self._group} not a multiple of "
                f"steps_per_generation={spg}: a step that runs out of generation batches trains "
                "fewer groups, whose responses must split evenly over the micro-batches; use "
                "such a num_generations, or max_gen_batches=None"
            )
        gen = self._prompts_per_batch if f.gen_prompts is None else f.gen_prompts
        rows = store.snapshot(store.resolve(None)).num_rows
        if isinstance(gen, int) and not isinstance(gen, bool) and 0 < rows < gen:
            raise InvalidDataError(
                f"DynstateGRPOTrainer over {url} has {rows} rows but filter_groups draws "
                f"gen_prompts={gen} per generation batch; append at least that many tasks"
            )
        rows_ds = loader_mod.TrlRows(
            store,
            cache_bytes=self._rows.cache_bytes,
            cache_dir=self._rows.cache_dir,
            columns=self._rows.columns,
        )
        sampler = VersionedSampler(
            rows_ds,
            seed=s["seed"],
            # mix mode's lag counts generation batches here (docs/dynamic-sampling.md)
            mode=s["mode"],
            fresh_share=s["fresh_share"],
            lag=s["lag"],
            batch_size=gen if type(gen) is int and gen > 0 else None,
            # several processes draw in lockstep from one position, each sampler step's rows
            # dealt to the ranks that still need groups (docs/dynamic-sampling.md)
            num_replicas=self._world,
            rank=self._rank,
            drop_last=True,  # every generation batch whole
            select=s["select"],
        )
        max_carry = f.max_carry
        if max_carry is None and f.surplus == "carry" and self._world > 1 and isinstance(gen, int):
            # a rank dealt every share of a step's last sampler step may carry up to
            # world * gen - 1 groups, which DynamicSampling's default does not allow
            max_carry = max(gen + self._prompts_per_batch, self._world * gen - 1)
        try:
            self._dyn = DynamicSampling(
                rows_ds,
                sampler,
                gen_batch_size=gen,
                train_groups=self._prompts_per_batch,
                rule=f.rule,
                max_gen_batches=f.max_gen_batches,
                surplus=f.surplus,
                max_carry=max_carry,
            )
        except InvalidDataError as exc:
            raise InvalidDataError(
                f"DynstateGRPOTrainer(filter_groups=...) over {url}: {exc} (FilterGroups' "
                "gen_prompts is DynamicSampling's gen_batch_size)"
            ) from exc
        self._sampler = sampler
        self._loader = self._dyn._loader
        self._batches = None

    # -- the Trainer's hooks -----------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        inner = loader_mod.Ticks() if self._dyn is not None else self._batches
        return _UntilMaxSteps(self, inner)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        store = self.dynstate_store
        if resume_from_checkpoint is True:
            resume_from_checkpoint = loader_mod.last_checkpoint(str(self.args.output_dir))
            if resume_from_checkpoint is None:
                raise StateMismatchError(
                    f"resume_from_checkpoint=True but {self.args.output_dir} holds no "
                    f"whole checkpoint-N folder; start {store.display_url} afresh instead"
                )
        self._after_load = None  # a resume that transformers refused before its start
        if resume_from_checkpoint:
            self._resume(str(resume_from_checkpoint))
        else:
            head = store.latest()
            start = version_at_step(store, FIRST_STEP - 1)
            if start != head:
                raise StateMismatchError(
                    f"{store.display_url} already holds rounds of steps >= {FIRST_STEP} "
                    f"(version {head}; before them: {start}): a fresh run would record its "
                    "steps again. Resume with train(resume_from_checkpoint=...), or roll the "
                    f"store back first: dynstate.rollback(store, step={FIRST_STEP - 1})"
                )
            if self._dyn is not None:
                self._dyn.resume(None, first_step=FIRST_STEP)  # the head is step 0's already
            # every rank checks the head before rank 0 commits step 1's round
            self._barrier()
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)

    def _resume(self, checkpoint: str) -> None:
        """Every check and the sampler's load now; the rollback once transformers has loaded
        the checkpoint (:meth:`_finish_resume`): nothing in the store changes on a refusal,
        dynstate's or transformers'."""
        store = self.dynstate_store
        state = loader_mod.read_checkpoint_state(checkpoint, store)
        step, version = state["step"], state["version"]
        store.latest()
        per = int(state.get("steps_per_round", 1))
        if per != self._per_round:
            raise StateMismatchError(
                f"{checkpoint} was saved with {per} optimizer step(s) per generation "
                "(steps_per_generation x num_iterations / gradient_accumulation_steps), this "
                f"trainer runs {self._per_round}: its steps of {store.display_url} would count "
                "otherwise; set those three as the run that saved it did — nothing was changed"
            )
        if step % per:
            raise StateMismatchError(
                f"{checkpoint} is a checkpoint of step {step}, inside a generation of {per} "
                f"optimizer steps: it cannot resume {store.display_url} exactly; resume from a "
                f"checkpoint whose step is a multiple of {per}"
            )
        target = version_at_step(store, step // per)
        if target != version and not self._same_content(target, version):
            raise StateMismatchError(
                f"{checkpoint} was saved at version {version} of {store.display_url} (the "
                f"round of step {step}), but the head's lineage has version {target} for that "
                "step: the store was reset, rewritten or appended to since; restore it to the "
                f"checkpoint's history (dynstate reset {store.display_url} {version}) to resume"
            )
        resuming = f"cannot resume from {checkpoint}"
        check_state_owner(self.dynstate_generator, store, target, resuming)
        if self._dyn is not None or "filter_groups" in state:
            self._resume_filtered(checkpoint, state, target)
            return
        sampler_state = loader_mod.find_sampler_state(state["loader"])
        try:
            self._sampler.load_state_dict(sampler_state)  # type: ignore[arg-type]
        except StateMismatchError as exc:
            raise StateMismatchError(
                f"cannot resume from {checkpoint}: {exc}. The sampler settings are "
                "DynstateGRPOTrainer's select, mode, fresh_share, lag and sampler_seed (or "
                "args.seed), and the batch shape per_device_train_batch_size, "
                "gradient_accumulation_steps and num_generations: set them as before"
            ) from exc
        # saved with another dataloader_num_workers: carried into this loader's shape
        load_loader_state(self._loader, state["loader"])
        self._after_load = functools.partial(self._roll_back, step, target)

    def _roll_back(self, step: int, target: int) -> None:
        """The store back to the checkpoint's round, and the generator's state of it; run once
        transformers has loaded the checkpoint (``on_train_begin``), so that a checkpoint it
        cannot load is refused with the store as it was."""
        store = self.dynstate_store
        # the state of the checkpoint's round (the rollback's, which copies it), loaded before
        # the rollback commit: a generator that refuses it leaves the store as it was
        load_state(self.dynstate_generator, store.generator_state(target))
        # every rank has checked the store before rank 0 rolls it back, and sees the rollback
        # before it draws: one writer, as for the rounds
        self._barrier()
        if self._rank == 0:
            rollback(store, version=target, meta={"trainer": "trl"})
        self._barrier()
        head = store.latest()
        log.info("resuming %s at step %d from version %d", store.display_url, step, head)

    def _finish_resume(self) -> None:
        """What a resume changes (the store's rollback, the carry), once transformers has
        loaded the checkpoint: called from ``on_train_begin``."""
        todo, self._after_load = self._after_load, None
        if todo is not None:
            todo()

    def _resume_filtered(self, checkpoint: str, state: dict[str, Any], target: int) -> None:
        """Resume under ``filter_groups``: the checkpoint's settings, the store's consumption
        record of its step and the carried completions in the checkpoint checked now, then,
        once transformers has loaded the checkpoint, :meth:`_resume_carry`."""
        store, dyn, step = self.dynstate_store, self._dyn, state["step"]
        url = store.display_url
        theirs = state.get("filter_groups")
        ours = None if dyn is None else dyn.settings()
        if theirs is None or ours is None:
            said = "without" if theirs is None else "with"
            now = "with" if theirs is None else "without"
            raise StateMismatchError(
                f"{checkpoint} was saved {said} filter_groups, and this trainer runs {now}: the "
                f"steps after it would consume {url}'s rows differently; set filter_groups as "
                "the run that saved it did — nothing was changed"
            )
        assert dyn is not None
        saved_by = int(state.get("processes", 1))
        if saved_by != self._world:
            raise StateMismatchError(
                f"{checkpoint} was saved with filter_groups by {saved_by} process(es), and this "
                f"run has {self._world}: resuming at another number of processes cannot be "
                "exact under group filtering (each process's carried groups, and its completions, "
                "are its own, the default max_carry depends on the processes, and every step "
                "after would filter other groups than either run); resume with "
                f"{saved_by} process(es) — nothing was changed"
            )
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        if differ:
            said = ", ".join(f"{k}: {theirs.get(k)!r} -> {ours.get(k)!r}" for k in differ)
            raise StateMismatchError(
                f"the filter_groups settings differ from those {checkpoint} was saved with "
                f"({said}); resume {url} with the checkpoint's settings — nothing was changed"
            )
        found = store.consumption.of_step(store.latest(), step)
        if found is None:
            raise StateMismatchError(
                f"{url} holds no consumption record of step {step} on its head's lineage, which "
                f"{checkpoint} needs to resume filter_groups; restore the store's history"
            )
        record = found[1]
        tensors = loader_mod.read_carry(checkpoint, step, record, url)
        try:  # the selection policy and seed, checked before the rollback
            dyn.sampler.load_state_dict(record["sampler"])
        except StateMismatchError as exc:
            raise StateMismatchError(
                f"cannot resume from {checkpoint}: {exc}. The sampler settings are "
                "DynstateGRPOTrainer's select and sampler_seed (or args.seed): set them as before"
            ) from exc
        # this rank's share of the carry, as DynamicSampling deals it (by position: a row may
        # be carried twice)
        positions: list[Any] = list(range(len(tensors)))
        mine: list[Any] = dyn.rank_carry({"carry": positions, "sampler": record["sampler"]})
        self._after_load = functools.partial(self._resume_carry, step, target, tensors, mine)

    def _resume_carry(self, step: int, target: int, tensors: list[Any], mine: list[Any]) -> None:
        """:meth:`DynamicSampling.resume` (the rollback, the sampler's position and the carry)
        and the carried completions, once transformers has loaded the checkpoint."""
        store, dyn, url = self.dynstate_store, self._dyn, self.dynstate_store.display_url
        assert dyn is not None
        # before the rollback commit (as in _roll_back): a refusal leaves the store as it was
        load_state(self.dynstate_generator, store.generator_state(target))
        dyn.resume(step, first_step=FIRST_STEP)
        device = self.accelerator.device
        self._parts = {
            id(g.item): (g.item, {k: v.to(device) for k, v in tensors[i].items()})
            for g, i in zip(dyn.carry, mine, strict=True)
        }
        log.info(
            "resuming %s at step %d (version %d) with %d carried groups",
            url, step, target, len(dyn.carry),
        )  # fmt: skip

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        device = self.args.device
        if checkpoint is None or self._world == 1 or device.type != "cpu":
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        # transformers loads the optimizer with map_location=args.device, which several CPU
        # processes (gloo) number "cpu:N": torch.load cannot restore that location and every
        # resume would fail. The same tensors, mapped to "cpu", for the time of the load.
        load = torch.load

        def on_cpu(*args: Any, **kwargs: Any) -> Any:
            where = kwargs.get("map_location")
            if isinstance(where, torch.device) and where.type == "cpu":
                kwargs["map_location"] = "cpu"
            return load(*args, **kwargs)

        torch.load = on_cpu
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        finally:
            torch.load = load

    def _barrier(self) -> None:
        if self._world > 1:
            self.accelerator.wait_for_everyone()

    def _same_content(self, a: int, b: int) -> bool:
        """Whether version ``a`` holds version ``b``'s rows and nothing more: ``b`` on ``a``'s
        lineage with as many rows (a rollback's reset commit stands for its target)."""
        store = self.dynstate_store
        if store.snapshot(a).num_rows != store.snapshot(b).num_rows:
            return False
        for v in store.lineage(a):
            if v == b:
                return True
            if v < b:
                return False
        return False

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        out = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func = out
        self._completions = list(completions)  # what the rewards scored, for the generator
        return out

    def _generate_and_score_completions(self, inputs):
        if self._dyn is not None and getattr(self.model, "training", False):
            return self._filtered_generation()
        out = super()._generate_and_score_completions(inputs)
        if getattr(self.model, "training", False) and self._rewards_per_func is not None:
            weights = self.reward_weights.to(self._rewards_per_func.device).unsqueeze(0)
            # GRPOTrainer gathers the rewards of every process (rank 0's responses first);
            # the rows, versions and prompts are gathered in the same order
            scores = (self._rewards_per_func * weights).nansum(dim=1).double().cpu().tolist()
            completions = self._completions
            if len(completions) != len(inputs):
                completions = [None] * len(inputs)  # a reward override that passed other lists
            local = [
                (int(x[loader_mod.ROW_KEY]), int(x[loader_mod.VERSION_KEY]), x.get("prompt"), c)
                for x, c in zip(inputs, completions, strict=True)
            ]
            every = local if self._world == 1 else gather_object(local)
            if len(every) != len(scores):
                raise InvalidDataError(
                    f"{self.dynstate_store.display_url}: {len(every)} responses gathered from "
                    f"{self._world} processes but {len(scores)} rewards; the processes' batches "
                    "differ in size"
                )
            self._scored = {
                "rows": [r for r, _, _, _ in every],
                "versions": [v for _, v, _, _ in every],
                "scores": scores,
                "prompts": [p for _, _, p, _ in every],
                "completions": [c for _, _, _, c in every],
            }
        self._rewards_per_func = None
        return out

    # -- group filtering ---------------------------------------------------------------------

    def _weighted_scores(self) -> list[float]:
        """One score per response: the reward functions' weighted sum, as TRL's ``reward``."""
        rewards = self._rewards_per_func
        self._rewards_per_func = None
        if rewards is None:
            raise InvalidDataError(
                f"GRPOTrainer scored no rewards for {self.dynstate_store.display_url}; was "
                "_calculate_rewards overridden?"
            )
        weights = self.reward_weights.to(rewards.device).unsqueeze(0)
        scores: list[float] = (rewards * weights).nansum(dim=1).double().cpu().tolist()
        return scores

    def _score_groups(self, items: list[dict[str, Any]], step: int) -> list[list[float]]:
        """``DynamicSampling``'s ``score``: one generation batch through GRPOTrainer's own
        generation and reward functions, its completions kept per group for training."""
        group = self._group
        inputs = [item for item in items for _ in range(group)]
        if self._world == 1:
            out = super()._generate_and_score_completions(inputs)
        else:
            with _alone(self):
                out = super()._generate_and_score_completions(inputs)
        scores = self._weighted_scores()
        completions = self._completions
        if len(completions) != len(inputs):
            completions = [None] * len(inputs)
        size = len(inputs)
        for key, value in out.items():
            if key == "num_items_in_batch":
                continue
            if not (isinstance(value, torch.Tensor) and value.ndim in (1, 2)
                    and value.shape[0] == size):  # fmt: skip
                raise InvalidDataError(
                    f"filter_groups over {self.dynstate_store.display_url} cannot split "
                    f"GRPOTrainer's {key!r} by group (multimodal or tool inputs are not "
                    "supported with filter_groups yet); train without filter_groups"
                )
        per_item = []
        for k, item in enumerate(items):
            part = {key: v[k * group : (k + 1) * group] for key, v in out.items()
                    if key != "num_items_in_batch"}  # fmt: skip
            self._parts[id(item)] = (item, part)
            per_item.append(scores[k * group : (k + 1) * group])
            done = completions[k * group : (k + 1) * group]
            self._step_scored.append((int(item[loader_mod.ROW_KEY]), per_item[-1], item, done))
        return per_item

    def _filtered_generation(self) -> dict[str, Any]:
        """Step ``global_step + 1``'s batch: carried groups first, then the groups accepted from
        as many generation batches as the step needed (docs/trl.md, "Group filtering")."""
        dyn, store = self._dyn, self.dynstate_store
        assert dyn is not None
        step = int(self.state.global_step) + 1
        self._step_scored = []
        batch = dyn.next_batch(step, self._score_groups)
        record = batch.record
        if not batch.groups:
            raise InvalidDataError(
                f"step {step} of {store.display_url} drew max_gen_batches="
                f"{record['settings']['max_gen_batches']} generation batches and filtered out "
                "every group: nothing to train. Raise FilterGroups.max_gen_batches, or use a "
                "looser rule (StdThreshold, FilterRule)"
            )
        if self._world > 1:
            # every rank must train some group, or the others wait in the backward pass for
            # ever: all refuse together, on what every rank knows
            counts = gather_object([len(batch.groups)])
            if 0 in counts:
                raise InvalidDataError(
                    f"step {step} of {store.display_url}: rank {counts.index(0)} of "
                    f"{self._world} drew max_gen_batches={record['settings']['max_gen_batches']}"
                    " generation batches and filtered out every group dealt to it: nothing to "
                    "train on that rank. Raise FilterGroups.max_gen_batches, or use a looser "
                    "rule (StdThreshold, FilterRule)"
                )
        parts = []
        for g in batch.groups:
            held = self._parts.get(id(g.item))
            if held is None or held[0] is not g.item:
                raise InvalidDataError(
                    f"step {step} of {store.display_url}: the completions of row {g.row} are "
                    "missing; DynamicSampling's groups must come from this trainer"
                )
            parts.append(held[1])
        # keep only the carry's completions: the rest are trained now, or filtered or dropped
        self._parts = {id(g.item): self._parts[id(g.item)] for g in dyn.carry}
        scored = [(row, scores, item.get("prompt"), done)
                  for row, scores, item, done in self._step_scored]  # fmt: skip
        self._step_scored = []
        if self._world > 1:
            # rank 0 commits every rank's outcomes; each rank scored only the rows dealt to it
            scored = gather_object(scored)
        trained = batch.groups if batch.everyone is None else batch.everyone
        self._scored = {
            "filter": record,
            # every rank's groups, rank by rank, as the record lists them
            "trained_rows": [g.row for g in trained],
            "trained_scores": [s for g in trained for s in g.scores],
            # outcomes: every group scored at this step (trained, filtered, carried or
            # dropped), once, at the step that generated it
            "rows": [r for r, scores, _, _ in scored for _ in scores],
            "scores": [s for _, scores, _, _ in scored for s in scores],
            "prompts": [prompt for _, scores, prompt, _ in scored for _ in scores],
            "completions": [c for _, _, _, done in scored for c in done],
            "versions": [int(record["rows_version"])],
        }
        return self._assemble(parts)

    def _assemble(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """The groups' tensors as one GRPOTrainer batch, padded as GRPOTrainer pads them."""
        pad_id = int(self._tokenizer.pad_token_id)
        out: dict[str, Any] = {}
        for key in parts[0]:
            values = [p[key] for p in parts]
            if values[0].ndim == 2:
                width = max(v.shape[1] for v in values)
                fill = _pad_value(key, pad_id)
                padded = []
                for v in values:
                    extra = v.new_full((v.shape[0], width - v.shape[1]), fill)
                    padded.append(torch.cat([extra, v] if key in _LEFT else [v, extra], dim=1))
                values = padded
            out[key] = torch.cat(values, dim=0)
        mask = out["completion_mask"]
        if "tool_mask" in out:
            mask = mask * out["tool_mask"]
        # GRPOTrainer's count is every process's (the loss divides it by the processes)
        out["num_items_in_batch"] = self.accelerator.gather(mask.sum().reshape(1)).sum()
        return out

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        step = int(self.state.global_step)
        if step % self._per_round:
            # the settings are checked at start-up; only a callback's should_save gets here
            raise InvalidDataError(
                f"a checkpoint of step {step} of {self.dynstate_store.display_url} was asked "
                f"for inside a generation of {self._per_round} optimizer steps "
                "(steps_per_generation x num_iterations / gradient_accumulation_steps): it "
                "could not resume GRPO's buffered completions; save at steps that are "
                f"multiples of {self._per_round}"
            )
        # transformers ends its _save_checkpoint by deleting older checkpoints
        # (save_total_limit) and pushing this one to the Hub: both before dynstate's state is
        # written, so a kill in between could leave no checkpoint saved whole. Both wait for it.
        self._unmark(trial, step)
        limit, push = self.args.save_total_limit, self.args.push_to_hub
        self.args.save_total_limit, self.args.push_to_hub = None, False
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit, self.args.push_to_hub = limit, push
        dyn = self._dyn
        carry: list[Any] = []
        if dyn is not None:
            # the carry's completions, every rank's in the record's order (rank by rank)
            carry = [(g.row, g.scores, self._parts[id(g.item)][1]) for g in dyn.carry]
            if self._world > 1:
                carry = gather_object([(r, s, {k: v.cpu() for k, v in p.items()})
                                       for r, s, p in carry])  # fmt: skip
        # dynstate_state.pt marks the checkpoint whole (loader.last_checkpoint): every rank's files
        # (rng_state_N.pth) are written before rank 0 writes it
        self._barrier()
        if not self.args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        last = self.dynstate_round
        if last is None or last.global_step != self.state.global_step:
            raise InvalidDataError(
                f"checkpoint of step {self.state.global_step} of {self.dynstate_store.display_url}"
                " without that step's round; the dynstate round callback did not run"
            )
        state = loader_mod.checkpoint_state(
            self._loader,
            self.dynstate_store,
            self.state.global_step,
            last.version,
            filter_settings=None if dyn is None else dyn.settings(),
            steps_per_round=self._per_round,
            processes=None if dyn is None else self._world,
            model_only=bool(self.args.save_only_model),
        )
        if dyn is not None:
            loader_mod.save_carry(folder, self.state.global_step, carry)
        # The marker last, durably, over a checkpoint made durable first.
        sync_checkpoint(folder)
        save_durably(state, os.path.join(folder, loader_mod.STATE_FILE))
        if push:
            self._push_from_checkpoint(folder)
        self._rotate_after_save(self._get_output_dir(trial=trial))

    def _unmark(self, trial: Any, step: int) -> None:
        """A ``checkpoint-N`` folder saved a second time (a run resumed from an earlier
        checkpoint reaches step N again) loses its old dynstate files, durably, before
        transformers writes into it: a kill in between must not leave the new weights marked
        whole by the abandoned branch's state."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        if self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{step}"
            )
            removed = False
            for name in (loader_mod.STATE_FILE, loader_mod.CARRY_FILE):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, name))
                    removed = True
            if removed:
                sync_folder(folder)
        self._barrier()  # no rank writes its files into the folder before

    def _rotate_after_save(self, run_dir: str) -> None:
        """transformers' own deletion of older checkpoints, run once this one is whole."""
        try:
            from transformers.trainer_utils import rotate_checkpoints
        except ImportError:  # transformers 4: a Trainer method
            self._rotate_checkpoints(use_mtime=False, output_dir=run_dir)  # type: ignore[attr-defined]
            return
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    # -- the round of a step -----------------------------------------------------------------

    def _commit_round(self, global_step: int) -> None:
        if global_step % self._per_round:
            return  # the generation goes on: its round is committed after its last step
        step = global_step // self._per_round
        store, scored = self.dynstate_store, self._scored
        self._scored = None
        if scored is None:
            raise InvalidDataError(
                f"step {step} of {store.display_url} trained without scored prompts from the "
                "dynstate loader; was get_train_dataloader or _generate_and_score_completions "
                "overridden?"
            )
        record = scored.get("filter")
        rows_version = max(scored["versions"])
        if self._world == 1:
            written = self._write_round(step, scored, rows_version)
        else:
            written = self._write_on_rank0(step, scored, rows_version)
        version, added = written["version"], written["added"]
        group = self.num_generations
        self.dynstate_round = Round(
            step=step,
            rows=scored["rows"][::group] if record is None else scored["trained_rows"],
            rewards=scored["scores"] if record is None else scored["trained_scores"],
            rows_version=rows_version,
            version=version,
            added=added,
            consumption=record,
            global_step=global_step,
        )
        metrics = self._metrics["train"]
        for key, value in {
            "version": version,
            "rows_total": written["rows_total"],
            "rows_added": added,
            "rows_trained": written["rows_trained"],
            "rows_version": rows_version,
        }.items():
            metrics[f"{METRIC_PREFIX}{key}"].append(float(value))
        if record is not None:
            for key, value in {
                "carried_in": len(record["carried_in"]),
                "drawn": len(record["drawn"]),
                "trained": len(record["trained"]),
                "filtered": len(record["filtered"]),
                "dropped": len(record["dropped"]),
                "carried": len(record["carry"]),
                "gen_batches": record["gen_batches"],
            }.items():
                metrics[f"{METRIC_PREFIX}filter/{key}"].append(float(value))

    def _write_on_rank0(self, step: int, scored: dict[str, Any], rows_version: int) -> Any:
        """Several processes: rank 0 alone runs the generator and commits the round (every
        process's outcomes are in ``scored``, gathered), then tells every rank what it wrote;
        the broadcast is also what makes the other ranks wait for the round before their next
        draw. A failure on rank 0 is told too, so that no rank waits forever."""
        import torch.distributed as dist

        box: list[Any] = [None]
        failure: BaseException | None = None
        if self._rank == 0:
            try:
                box = [("ok", self._write_round(step, scored, rows_version))]
            except BaseException as exc:  # told to the other ranks, then raised here
                failure = exc
                box = [("error", f"{type(exc).__name__}: {exc}")]
        dist.broadcast_object_list(box, src=0)
        if failure is not None:
            raise failure
        kind, value = box[0]
        if kind != "ok":
            raise InvalidDataError(
                f"rank 0 failed to commit the round of step {step} of "
                f"{self.dynstate_store.display_url}: {value}"
            )
        return value

    def _write_round(self, step: int, scored: dict[str, Any], rows_version: int) -> Any:
        """Run the generator and commit the step's round, outcomes and generator state."""
        store = self.dynstate_store
        record = scored.get("filter")
        outcomes = {
            "row": scored["rows"],
            "step": [step] * len(scored["rows"]),
            "score": scored["scores"],
        }
        generator, added_rows = self.dynstate_generator, None
        meta: dict[str, Any] = {"step": step, "trainer": "trl"}
        if self._sampler.select is not None:  # the policy in force, for the step's story
            meta[SELECT_META] = self._sampler.select.identity()
        gen_state = None
        if generator is not None:
            store.latest()
            view = RoundView(store, outcomes, rows_version)
            batch = StepBatch(
                step=step,
                rows=scored["rows"],
                scores=scored["scores"],
                rows_version=rows_version,
                prompts=scored["prompts"],
                completions=scored["completions"],
            )
            added_rows = run_generator(generator, batch, step, view)
            gen_state = state_of(generator)
            meta["generator"] = generator_name(generator)
        head = store.snapshot(store.latest())
        before = head.num_rows
        rows, new_source = round_table(added_rows, generator, head.schema, store.display_url)
        version = store.append(
            rows,
            allow_new_columns=new_source,  # the lineage column alone (round_table)
            meta=meta,
            outcomes=outcomes,
            generator_state=gen_state,
            rows_version=rows_version,
            consumption=record,
        )
        stats = store.outcome_stats(version)
        _, tried = pass_rates(stats)
        return {
            "version": int(version),
            "added": max(0, stats.num_rows - before),
            "rows_total": int(stats.num_rows),
            "rows_trained": int(tried.sum()),
        }


class _LocalAccelerator:
    """The trainer's accelerator as one process alone sees it: what it gathers is its own,
    and it is process 0 of 1."""

    process_index = 0
    num_processes = 1

    def __init__(self, accelerator: Any):
        self._inner = accelerator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def gather(self, value: Any) -> Any:
        return value

    gather_for_metrics = gather


@contextlib.contextmanager
def _alone(trainer: Any) -> Iterator[None]:
    """GRPOTrainer's generation and scoring with no collective. Under filter_groups in several
    processes a rank scores as many generation batches as the shares dealt to it (none, one or
    several per sampler step: docs/dynamic-sampling.md), so the ranks would not meet in
    GRPOTrainer's gathers. A group's advantages need only its own rewards (whole groups per
    process, checked at start-up), so each rank generates and scores its groups alone; the
    step's counts and outcomes are gathered afterwards, where every rank is."""
    from trl.trainer import grpo_trainer

    functions = grpo_trainer.gather, grpo_trainer.gather_object
    accelerator = trainer.accelerator
    grpo_trainer.gather = lambda value: value
    grpo_trainer.gather_object = lambda value: value
    trainer.accelerator = _LocalAccelerator(accelerator)
    try:
        yield
    finally:
        grpo_trainer.gather, grpo_trainer.gather_object = functions
        trainer.accelerator = accelerator


def _filter_settings(value: Any, url: str) -> FilterGroups | None:
    if value is None or value is False:
        return None
    if value is True:
        return FilterGroups()
    if isinstance(value, FilterGroups):
        return value
    raise InvalidDataError(
        f"DynstateGRPOTrainer over {url}: filter_groups must be True, False/None or a "
        f"dynstate.trl.FilterGroups(...), not {value!r}"
    )


class _UntilMaxSteps:
    """The train loader, empty once the run has reached ``max_steps``. dynstate's loader has no
    length, so transformers gives it endless epochs and stops at ``max_steps`` only after a
    step: a finished run started again (a scheduler's restart, ``resume_from_checkpoint=True``)
    would train, commit and save one step more each time."""

    def __init__(self, trainer: Any, inner: Any):
        self.trainer, self.inner = trainer, inner

    def __iter__(self) -> Any:
        state = self.trainer.state
        if state.max_steps and state.global_step >= state.max_steps:
            return iter(())
        return iter(self.inner)

    def __getattr__(self, name: str) -> Any:  # what transformers asks of a loader
        return getattr(self.inner, name)


class _RoundCallback(TrainerCallback):
    """Commits the step's round right after its optimizer step, before the Trainer logs or
    saves the checkpoint of that step (both come after ``on_step_end``)."""

    def __init__(self, trainer: DynstateGRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        # after transformers loaded the checkpoint's model, optimizer and scheduler
        self.trainer._finish_resume()
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.trainer._commit_round(int(state.global_step))
        return control
