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

What cannot be made exact is refused at construction, naming the setting: more than one
process, loader workers, ``steps_per_generation`` other than ``gradient_accumulation_steps``,
``num_iterations > 1``, ``max_steps`` unset. See docs/trl.md.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOTrainer

from .. import rollback, version_at_step
from ..errors import InvalidDataError, StateMismatchError
from ..loading.dataset import VersionedDataset
from ..loading.sampler import VersionedSampler
from ..loading.selection import pass_rates
from ..store import Store
from . import loader as loader_mod
from .generator import RoundView, StepBatch, generator_name, load_state, run_generator, state_of

log = logging.getLogger("dynstate")

METRIC_PREFIX = "dynstate/"
FIRST_STEP = 1  # TRL's global_step after the first optimizer step


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


class DynstateGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` over a dynstate store. ``train_dataset`` is a
    :class:`~dynstate.VersionedDataset` (or a :class:`~dynstate.Store`); the other arguments
    are ``GRPOTrainer``'s, plus:

    * ``generator``: writes a round between steps (interfaces in :mod:`dynstate.trl.generator`);
    * ``select``: a selection policy of :class:`~dynstate.VersionedSampler` (``Learnability()``…);
    * ``mode``, ``fresh_share``, ``lag``: the sampler's (``"mix"`` trains new rows within
      ``lag`` steps; ``"epoch"`` at the next epoch);
    * ``sampler_seed``: the sampler's seed (default ``args.seed``).
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
        # GRPOTrainer type-checks train_dataset as a datasets.Dataset and reads no row of it
        # when get_train_dataloader is ours: a one-row placeholder passes the check; the store
        # takes its place right after.
        import datasets

        placeholder = datasets.Dataset.from_dict({"prompt": [""]})
        super().__init__(model=model, reward_funcs=reward_funcs, args=args,
                         train_dataset=placeholder, **kwargs)  # fmt: skip
        self._check_settings(store)
        self.train_dataset = train_dataset
        self._rows: VersionedDataset = train_dataset
        self.dynstate_store = store
        self.dynstate_generator = generator
        self.dynstate_round: Round | None = None
        self._sampler_args = {
            "select": select,
            "mode": mode,
            "fresh_share": fresh_share,
            "lag": lag,
            "seed": self.args.seed if sampler_seed is None else sampler_seed,
        }
        config: Any = self.args
        self._group: int = int(self.num_generations or 1)
        self._prompts_per_batch = int(config.generation_batch_size) // self._group
        self._loader: Any = None
        self._batches: loader_mod.EndlessBatches | None = None
        self._scored: dict[str, Any] | None = None
        self._rewards_per_func: torch.Tensor | None = None
        # The Trainer would skip the batches a checkpoint trained by replaying the loader; the
        # loader's own state resumes it instead.
        self.args.ignore_data_skip = True
        self._make_loader()  # refuses bad sampler settings here, at start-up
        self.add_callback(_RoundCallback(self))

    # -- start-up checks ---------------------------------------------------------------------

    def _check_settings(self, store: Store) -> None:
        a: Any = self.args  # a GRPOConfig
        url = store.display_url

        def refuse(setting: str, why: str) -> InvalidDataError:
            return InvalidDataError(f"DynstateGRPOTrainer over {url}: {setting} {why}")

        if self.accelerator.num_processes > 1:
            raise refuse(
                f"runs in {self.accelerator.num_processes} processes",
                "but this integration is single-process for now (its rounds, outcomes and "
                "resume are exact in one process only); launch one process",
            )
        if a.dataloader_num_workers:
            raise refuse(
                f"dataloader_num_workers={a.dataloader_num_workers}",
                "is not supported yet (the loader's resume is exact without workers); set 0",
            )
        if a.steps_per_generation != a.gradient_accumulation_steps:
            raise refuse(
                f"steps_per_generation={a.steps_per_generation}",
                f"differs from gradient_accumulation_steps={a.gradient_accumulation_steps}: "
                "a generation would span optimizer steps, and a checkpoint between them could "
                "not resume its buffered completions; leave steps_per_generation unset",
            )
        if a.num_iterations != 1:
            raise refuse(
                f"num_iterations={a.num_iterations}",
                "reuses one generation over several optimizer steps, which a checkpoint "
                "between them cannot resume exactly; set num_iterations=1",
            )
        if a.max_steps is None or a.max_steps <= 0:
            raise refuse(
                f"max_steps={a.max_steps}",
                "is unset: a growing store has no fixed epoch length, so the run is measured "
                "in steps; set max_steps",
            )
        rows, per_step = (
            store.snapshot().num_rows,
            int(a.generation_batch_size) // int(a.num_generations),
        )
        if rows < per_step:
            raise refuse(
                f"has {rows} rows",
                f"but each step trains {per_step} prompts (generation_batch_size / "
                "num_generations); append at least that many tasks before training",
            )

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
            num_replicas=1,
            rank=0,
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
            num_workers=0,
            # its own generator: torch's global one is the Trainer's (restored on resume)
            generator=torch.Generator().manual_seed(int(s["seed"]) % 2**63),
        )
        sampler.check_loader(loader)
        self._sampler, self._loader = sampler, loader
        self._batches = loader_mod.EndlessBatches(
            loader, self.args.gradient_accumulation_steps, store.display_url
        )

    # -- the Trainer's hooks -----------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        return self._batches

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        store = self.dynstate_store
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise StateMismatchError(
                    f"resume_from_checkpoint=True but {self.args.output_dir} holds no "
                    f"checkpoint-N folder; start {store.display_url} afresh instead"
                )
        if resume_from_checkpoint:
            self._resume(str(resume_from_checkpoint))
        else:
            head = store.refresh()
            start = version_at_step(store, FIRST_STEP - 1)
            if start != head:
                raise StateMismatchError(
                    f"{store.display_url} already holds rounds of steps >= {FIRST_STEP} "
                    f"(version {head}; before them: {start}): a fresh run would record its "
                    "steps again. Resume with train(resume_from_checkpoint=...), or roll the "
                    f"store back first: dynstate.rollback(store, step={FIRST_STEP - 1})"
                )
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)

    def _resume(self, checkpoint: str) -> None:
        """Every check first, then the rollback and the loads (nothing changes on a refusal)."""
        store = self.dynstate_store
        state = loader_mod.read_checkpoint_state(checkpoint, store)
        step, version = state["step"], state["version"]
        store.refresh()
        target = version_at_step(store, step)
        if target != version and not self._same_content(target, version):
            raise StateMismatchError(
                f"{checkpoint} was saved at version {version} of {store.display_url} (the "
                f"round of step {step}), but the head's lineage has version {target} for that "
                "step: the store was reset or rewritten since; restore it to the checkpoint's "
                f"history (dynstate reset {version}) to resume"
            )
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
        self._loader.load_state_dict(state["loader"])
        head = rollback(store, version=target, meta={"trainer": "trl"})
        load_state(self.dynstate_generator, store.generator_state(head))
        log.info("resuming %s at step %d from version %d", store.display_url, step, head)

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
        return out

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if getattr(self.model, "training", False) and self._rewards_per_func is not None:
            weights = self.reward_weights.to(self._rewards_per_func.device).unsqueeze(0)
            scores = (self._rewards_per_func * weights).nansum(dim=1).double().cpu().tolist()
            self._scored = {
                "rows": [int(x[loader_mod.ROW_KEY]) for x in inputs],
                "versions": [int(x[loader_mod.VERSION_KEY]) for x in inputs],
                "scores": scores,
                "prompts": [x.get("prompt") for x in inputs],
            }
        self._rewards_per_func = None
        return out

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if not self.args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        last = self.dynstate_round
        if last is None or last.step != self.state.global_step:
            raise InvalidDataError(
                f"checkpoint of step {self.state.global_step} of {self.dynstate_store.display_url}"
                " without that step's round; the dynstate round callback did not run"
            )
        state = loader_mod.checkpoint_state(
            self._loader, self.dynstate_store, self.state.global_step, last.version
        )
        tmp = os.path.join(folder, loader_mod.STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(folder, loader_mod.STATE_FILE))

    # -- the round of a step -----------------------------------------------------------------

    def _commit_round(self, step: int) -> None:
        store, scored = self.dynstate_store, self._scored
        self._scored = None
        if scored is None:
            raise InvalidDataError(
                f"step {step} of {store.display_url} trained without scored prompts from the "
                "dynstate loader; was get_train_dataloader or _generate_and_score_completions "
                "overridden?"
            )
        rows_version = max(scored["versions"])
        outcomes = {
            "row": scored["rows"],
            "step": [step] * len(scored["rows"]),
            "score": scored["scores"],
        }
        generator, added_rows = self.dynstate_generator, None
        meta: dict[str, Any] = {"step": step, "trainer": "trl"}
        gen_state = None
        if generator is not None:
            store.refresh()
            view = RoundView(store, outcomes, rows_version)
            batch = StepBatch(
                step=step,
                rows=scored["rows"],
                scores=scored["scores"],
                rows_version=rows_version,
                prompts=scored["prompts"],
                completions=[],
            )
            added_rows = run_generator(generator, batch, step, view)
            gen_state = state_of(generator)
            meta["generator"] = generator_name(generator)
        rows = [] if added_rows is None else added_rows
        before = store.snapshot(store.refresh()).num_rows
        version = store.append(
            rows,
            meta=meta,
            outcomes=outcomes,
            generator_state=gen_state,
            rows_version=rows_version,
        )
        stats = store.outcome_stats(version)
        added = max(0, stats.num_rows - before)
        group = self.num_generations
        self.dynstate_round = Round(
            step=step,
            rows=scored["rows"][::group],
            rewards=scored["scores"],
            rows_version=rows_version,
            version=version,
            added=added,
        )
        _, tried = pass_rates(stats)
        metrics = self._metrics["train"]
        for key, value in {
            "version": version,
            "rows_total": stats.num_rows,
            "rows_added": added,
            "rows_trained": int(tried.sum()),
            "rows_version": rows_version,
        }.items():
            metrics[f"{METRIC_PREFIX}{key}"].append(float(value))


class _RoundCallback(TrainerCallback):
    """Commits the step's round right after its optimizer step, before the Trainer logs or
    saves the checkpoint of that step (both come after ``on_step_end``)."""

    def __init__(self, trainer: DynstateGRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.trainer._commit_round(int(state.global_step))
        return control
