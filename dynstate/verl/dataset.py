"""DynstateRLDataset: verl's RLHFDataset over a dynstate store, growing one round per step.

Loaded through ``data.custom_cls`` (``path: pkg://dynstate.verl``, ``name: DynstateRLDataset``).
Items are built by verl's own ``RLHFDataset.__getitem__`` from rows read out of the store, so
``raw_prompt``, ``index``, ``tools_kwargs``, ``interaction_kwargs`` and ``dummy_tensor`` are
exactly verl's; two keys are added: ``dynstate_row``, the row's number in the store, which
generators use to record lineage, and ``dynstate_version``, the version the sampler drew it
from (with ``data.dynstate.select``, the one by whose statistics). See docs/verl.md.

One file, as one verl class: verl calls its hooks (``_download``, ``_read_files_and_tokenize``,
``__getitem__``, ``dataframe``) and the trainers its round and resume methods, which share the
store, the generator and the step; what does not need them lives beside it — the
``data.dynstate`` section in ``settings.py``, outcomes and figures in ``outcomes.py``,
``data.pt`` in ``loader_state.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import weakref
from typing import Any

import datasets
import pyarrow as pa
from verl.utils.dataset.rl_dataset import RLHFDataset

from ..errors import InvalidDataError, StateMismatchError
from ..generators import SOURCE_TYPE, check_state_owner, round_table
from ..loading.consumption import DynamicSampling
from ..loading.dataset import VersionedDataset, decode_index
from ..loading.sampler import VersionedSampler
from ..loading.state import find_sampler_state
from ..records.rounds import SELECT_META, to_table
from ..rewind import rollback
from ..store import Store
from . import loader_state
from .generator import (
    ROW_KEY,
    SOURCE_COLUMN,
    VERSION_KEY,
    generator_name,
    load_generator,
    load_state,
    run_generator,
    state_of,
)
from .loader_state import read_loader_state
from .outcomes import (
    SCORE_KEY,
    batch_outcomes,
    batch_rows_version,
    filter_figures,
    round_figures,
    selection_figures,
)
from .settings import Settings, check_lag

log = logging.getLogger("dynstate")

IMPORT_META = "verl_import"

__all__ = ["IMPORT_META", "DynstateRLDataset", "StoreFrame", "read_loader_state"]


class StoreFrame:
    """Stands where RLHFDataset keeps its ``datasets.Dataset``: integer access reads one row
    from the store (at the version its index carries); everything else (``select``,
    columns, ``filter``…) goes to a ``datasets.Dataset`` of the current version, as verl's old
    generators expect from ``dataset.dataframe``."""

    def __init__(self, rows: VersionedDataset):
        self._rows = rows
        self._view: datasets.Dataset | None = None
        self._view_version: int | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int) and not isinstance(key, bool):
            row = self._rows[key]
            row.pop(SOURCE_COLUMN, None)
            return row
        return self.view()[key]

    def view(self) -> datasets.Dataset:
        version = self._rows.version
        if self._view is None or self._view_version != version:
            table = self._rows.snapshot(version).to_arrow()
            if SOURCE_COLUMN in table.column_names:
                table = table.drop_columns([SOURCE_COLUMN])
            self._view, self._view_version = datasets.Dataset(table), version
        return self._view

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.view(), name)


# The growing dataset built from each data config object (by id; the dataset holds the config,
# so the id cannot be reused while the entry is alive).
_GROWING: dict[int, weakref.ref] = {}


def _growing_for(config: Any) -> DynstateRLDataset | None:
    ref = _GROWING.get(id(config))
    dataset = ref() if ref is not None else None
    return dataset if dataset is not None and dataset.config is config else None


def _same_files(a: Any, b: Any) -> bool:
    def norm(x: Any) -> list[str]:
        if x is None:
            return []
        if isinstance(x, str):
            return [x]
        return [str(p) for p in x]

    return norm(a) == norm(b)


class DynstateRLDataset(RLHFDataset):
    """verl's RLHFDataset whose rows live in a dynstate store and grow by one round per step.

    The first one built from a data config with ``data.train_files`` is the train set: it
    serves the store at ``data.dynstate.url`` (importing the files into an empty store first).
    verl builds the validation set with the same class from the same config, after the train
    set: any later one, and any built with other files, is a plain, fixed RLHFDataset — also
    when ``val_files`` names the same files as ``train_files``."""

    def __init__(
        self,
        data_files: Any,
        tokenizer: Any,
        config: Any,
        processor: Any = None,
        max_samples: int = -1,
    ) -> None:
        self.fixed = (
            not _same_files(data_files, config.get("train_files"))
            or _growing_for(config) is not None
        )
        self.settings = None if self.fixed else Settings.from_config(config)
        self._committed: tuple[Any, int, int] | None = None  # (batch, step, version)
        self._pending: dict[str, Any] | None = None  # the outcomes of the step being generated
        self._pending_read_at: int | None = None  # the version their rows were read at
        self.last_metrics: dict[str, float] = {}  # the figures of the last committed round
        self._rows: VersionedDataset | None = None
        self._frame: StoreFrame | None = None
        self._local_frame: datasets.Dataset | None = None
        self.step = 0  # the last step whose round this dataset has seen committed
        self.data_generator = None
        if not self.fixed:
            _GROWING[id(config)] = weakref.ref(self)
        try:
            super().__init__(data_files, tokenizer, config, processor, max_samples)
            if not self.fixed:
                self.data_generator = load_generator(config.get("datagen"))
        except BaseException:
            if not self.fixed:
                _GROWING.pop(id(config), None)
            raise

    @property
    def live_settings(self) -> Settings:
        """The ``data.dynstate`` settings of the train set (a fixed, validation set has none)."""
        if self.settings is None:
            raise InvalidDataError(
                "this DynstateRLDataset reads fixed files (a validation set): it has no store "
                "settings; only the train set (data.train_files) grows"
            )
        return self.settings

    def __getstate__(self) -> dict[str, Any]:
        # What DataLoader workers get: they only read rows, so neither the generator (which may
        # hold a model, or not pickle at all) nor the last committed batch travels with it.
        state = super().__getstate__()
        state["data_generator"] = None
        state["_committed"] = None
        state["_pending"] = None
        if self.settings is not None and self.settings.select is not None:
            # nor the policy (a function loaded from a file does not pickle by reference)
            state["settings"] = dataclasses.replace(self.settings, select=None)
        return state

    # -- where the rows come from ------------------------------------------------------------

    @property
    def dataframe(self) -> Any:
        return self._frame if self._frame is not None else self._local_frame

    @dataframe.setter
    def dataframe(self, value: Any) -> None:
        self._local_frame = value

    @property
    def store(self) -> Store:
        assert self._rows is not None
        return self._rows.store

    @property
    def rows(self) -> VersionedDataset:
        """The store's rows as a :class:`~dynstate.VersionedDataset` (what dynstate's sampler
        and :class:`~dynstate.DynamicSampling` draw from; items are the stored rows, not verl's
        tokenized ones)."""
        assert self._rows is not None
        return self._rows

    def _open_store(self) -> Store:
        assert self.settings is not None
        if self._rows is None:
            store = Store.open(
                self.settings.url, create=True, storage_options=self.settings.storage_options
            )
            self._rows = VersionedDataset(store)
        return self._rows.store

    def _download(self, use_origin_parquet: bool = False) -> None:
        if not self.fixed and self._open_store().refresh() > 0:
            return  # already imported: the train files are not read again
        super()._download(use_origin_parquet)

    def _read_files_and_tokenize(self) -> None:
        if self.fixed:
            super()._read_files_and_tokenize()
            return
        store = self._open_store()
        if store.latest() == 0:
            # verl's own reading, sampling and overlong filtering, then one atomic commit:
            # a crash before it leaves the store empty, so the next start imports again.
            super()._read_files_and_tokenize()
            table = _with_source(to_table(self._local_frame, store.display_url))
            version = store.append(
                table,
                meta={IMPORT_META: True, "files": [str(f) for f in self.original_data_files]},
            )
            log.info(
                "imported %d rows into %s as version %d", table.num_rows, store.display_url, version
            )
            self._local_frame = None
        else:
            log.info(
                "using %s at version %d (train files not re-imported)",
                store.display_url,
                store.head,
            )
        assert self._rows is not None
        self._rows.refresh()
        self._frame = StoreFrame(self._rows)

    def __getitem__(self, item: int) -> dict[str, Any]:
        if not self.fixed:
            version, row = decode_index(item)
            if version is None:
                # Only dynstate's sampler pins versions; any other one (verl's RandomSampler,
                # e.g. under verl's own main_ppo) would train without rounds or exact resume.
                raise StateMismatchError(
                    f"row {row} of {self.store.display_url} was asked for without a version: the "
                    "train loader is not using dynstate's sampler; run `python -m "
                    "dynstate.verl.main_ppo` with the same overrides as verl's main_ppo (it "
                    "installs the sampler for trainer.use_v1=true and false), see docs/verl.md"
                )
        out = super().__getitem__(item)
        if not self.fixed:
            out[ROW_KEY] = row
            # the version the sampler drew it from (with a policy: by whose statistics)
            out[VERSION_KEY] = version
        return out

    def make_sampler(self, **loader: Any) -> VersionedSampler:
        """The train sampler to pass as RayPPOTrainer's ``train_sampler``. ``loader``:
        ``VersionedSampler`` options taken from the loader it will serve (``batch_size``,
        ``drop_last``), where the caller builds that loader itself (verl's V1 trainer)."""
        assert self.settings is not None and self._rows is not None
        s = self.settings
        options: dict[str, Any] = {
            "shuffle": s.shuffle,
            "seed": s.seed,
            "mode": s.mode,
            "batch_size": s.batch_size,
            "fresh_share": s.fresh_share,
            "lag": s.lag,
            "select": s.select,
            # verl numbers steps from 1 (global_steps) and commits round s with meta step s
            "first_step": 1,
        }
        options.update(loader)
        return VersionedSampler(self._rows, **options)

    def check_loader(self, sampler: VersionedSampler, loader: Any) -> None:
        """Check the train ``loader`` verl built around ``sampler`` (at start-up, before any
        step): mix mode's ``lag`` must exceed the loader's prefetch depth, said in the config
        keys a verl user sets; then :meth:`VersionedSampler.check_loader`."""
        workers = int(getattr(loader, "num_workers", 0) or 0)
        factor = int(getattr(loader, "prefetch_factor", None) or 0) if workers else 0
        if sampler.mode == "mix":
            # the check main_ppo made before Ray started, now on the loader verl built
            check_lag(sampler.lag, workers, factor)
        sampler.check_loader(loader)

    # -- one round per step ------------------------------------------------------------------

    def outcome_stats(
        self, version: int | None = None, *, pending: bool = False, **options: Any
    ) -> pa.Table:
        """Per-row statistics (:meth:`Store.outcome_stats`: ``row``, ``attempts``,
        ``successes``, ``mean_score``, ``ewma_score``, ``first_step``, ``last_step``) of
        ``version``, by default the version the dataset reads now. Inside a generator's
        ``generate`` that is the version its round is appended to: every earlier step's
        outcomes, not the current step's (those are in the batch) — unless ``pending=True``,
        which counts the current step's outcomes as if already committed (nothing is written;
        the same figures the next version will have)."""
        assert self._rows is not None
        extra = self._pending if pending and version is None else None
        if extra is not None:
            options.setdefault("rows_version", self._pending_read_at)
        return self.store.outcome_stats(
            self._rows.version if version is None else version, pending=extra, **options
        )

    def round_metrics(self, version: int, added: int, batch: Any = None) -> dict[str, float]:
        """The figures verl's tracker gets for the step whose round is ``version``
        (:func:`~dynstate.verl.outcomes.round_figures`), and with ``data.dynstate.select``
        the policy's (:func:`~dynstate.verl.outcomes.selection_figures`; ``batch``: the
        step's scored batch)."""
        stats = self.store.outcome_stats(version)
        out = round_figures(stats, version, added)
        policy = self.live_settings.select
        if policy is not None:
            out.update(selection_figures(policy, self.store, stats, batch, self.step))
        return out

    def round_of(self, step: int) -> int | None:
        """The version of the head's lineage that holds the round of ``step``, or None."""
        return self.store.steps.round_of(self.store.latest(), step)

    def on_batch_end(self, batch: Any) -> int | None:
        """Generate and commit the round of the step whose ``batch`` just trained; returns the
        version holding it. verl's legacy loop calls this once per step (not after the last
        one), after the checkpoint; when the trainer mixin already committed this very batch
        before the checkpoint, its version is returned and nothing is committed."""
        if self.fixed:
            return None
        if self._committed is not None and self._committed[0] is batch:
            version, self._committed = self._committed[2], None  # the batch is not kept alive
            return version
        return self.commit_round(batch, self.step + 1)

    def commit_round(
        self,
        batch: Any,
        step: int,
        consumption: dict[str, Any] | None = None,
        outcomes: dict[str, Any] | None = None,
    ) -> int | None:
        """Generate and commit the round of training step ``step`` from its scored ``batch``;
        returns the version holding it. The same commit holds the step's outcomes
        (:func:`batch_outcomes`), the generator's ``state_dict()`` if it has one, and with
        group filtering the step's ``consumption`` record (``StepBatch.record`` of
        :class:`~dynstate.DynamicSampling`; the outcomes then bind to its ``rows_version``).
        ``outcomes`` replaces the batch's when the trainer scored groups it did not train
        (group filtering: every group scored at the step, each once; the same columns).
        Idempotent per step: a round already on the head's lineage for ``step`` is returned
        without running the generator again. :attr:`last_metrics` then holds the figures
        verl's tracker gets (:meth:`round_metrics`)."""
        if self.fixed:
            return None
        self.step = step
        existing = self.round_of(step)
        if existing is not None:
            log.info(
                "round of step %d is already version %d; not committing it twice", step, existing
            )
            self._committed = (batch, step, existing)
            self.last_metrics = self.round_metrics(
                existing, int(self.store.commit_record(existing).meta.get("rows", 0)), batch
            )
            if consumption is not None:
                self.last_metrics.update(filter_figures(consumption))
            return existing
        assert self._rows is not None and self.settings is not None
        self._rows.refresh()
        name = generator_name(self.data_generator) if self.data_generator else "none"
        meta: dict[str, Any] = {"step": step, "generator": name}
        if self.live_settings.select is not None:
            meta[SELECT_META] = self.live_settings.select.identity()
        rows = None
        if outcomes is None:
            outcomes = batch_outcomes(batch, step)
        # the version the batch's rows were read at: the outcomes bind to it (a reset since
        # would credit the scores to other rows; the commit refuses it)
        read_at = batch_rows_version(batch, self.store) if outcomes is not None else None
        if consumption is not None:
            # the record's rows and the outcomes' are numbered in one version: the newest the
            # step drew from (filtered rows too), which is on the lineage of every other
            read_at = consumption["rows_version"]
        if self.data_generator is not None:
            self._pending = outcomes  # for outcome_stats(pending=True) inside generate
            self._pending_read_at = read_at
            try:
                rows = run_generator(self.data_generator, batch, step, self)
            except Exception as exc:
                if self.settings.on_generator_error != "skip":
                    log.error("generator %s failed at step %d: %r", name, step, exc)
                    raise
                log.warning(
                    "generator %s failed at step %d, committing an empty round: %r", name, step, exc
                )
                meta["error"] = repr(exc)[:500]
            finally:
                self._pending, self._pending_read_at = None, None
        table, new_source = self._round_table(rows)
        meta["rows"] = table.num_rows
        if outcomes is None:
            log.warning(
                "step %d: the batch has no %s or %s; committing its round without outcomes",
                step,
                ROW_KEY,
                SCORE_KEY,
            )
        state = state_of(self.data_generator) if self.data_generator is not None else None
        version = self.store.append(
            table if table.num_rows else [],
            allow_new_columns=new_source,  # the lineage column alone (round_table)
            meta=meta,
            outcomes=outcomes,
            generator_state=state,
            rows_version=read_at,
            consumption=consumption,
        )
        self._rows.refresh()
        self._committed = (batch, step, version)
        self.last_metrics = self.round_metrics(version, table.num_rows, batch)
        if consumption is not None:
            self.last_metrics.update(filter_figures(consumption))
        log.info("step %d: %s added %d rows as version %d", step, name, table.num_rows, version)
        return version

    def _round_table(self, rows: Any) -> tuple[pa.Table, bool]:
        """The generator's rows as the round to append, and whether it brings the lineage
        column new to the store: verl's own keys dropped, verl's overlong-prompt filter
        applied as to the train files, then the round every trainer builds
        (:func:`dynstate.generators.round_table`: the old interface's lineage dropped, nulls
        only where the store has the column)."""
        url = self.store.display_url
        if rows is None or (isinstance(rows, list) and not rows):
            return pa.table({}), False
        if isinstance(rows, list):
            # dynstate's conversion, not from_list (which keeps the first row's keys only: a
            # later row's lineage would be dropped without a word)
            rows = datasets.Dataset(to_table(rows, url))
        elif not isinstance(rows, datasets.Dataset):
            rows = datasets.Dataset(to_table(rows, url))
        drop = [c for c in (ROW_KEY, VERSION_KEY) if c in rows.column_names]
        if drop:
            rows = rows.remove_columns(drop)
        if len(rows) == 0:
            return pa.table({}), False
        rows = self.maybe_filter_out_long_prompts(rows)  # verl's filter, as for the train files
        schema = self.store.snapshot(self.store.latest()).schema
        table, new_source = round_table(to_table(rows, url), self.data_generator, schema, url)
        return (table, new_source) if isinstance(table, pa.Table) else (pa.table({}), False)

    # -- resume ------------------------------------------------------------------------------

    def resume(self, checkpoint_dir: str | None, loader: Any, step: int) -> None:
        """Bring store, loader and step counter to what ``global_step_<step>`` saw.

        Everything is checked before anything is committed, so a refused resume leaves the
        store exactly as it was (``StateMismatchError``; ``CheckpointNotFoundError`` without
        ``data.pt``): ``data.pt`` must belong to this store and to this very checkpoint (the
        sampler's step count is ``step``'s), its sampler state must match the config
        (``data.seed``, ``data.shuffle``, the batch size, ``data.dynstate.mode`` and
        ``.select``, and in mix mode ``lag`` and ``fresh_share``), the round of
        ``step`` must be on the head's lineage (the trainer integration commits it before it
        writes the checkpoint), and the loader state must load with this run's
        ``data.dataloader_num_workers`` (rewritten for another worker count,
        :mod:`dynstate.verl.loader_state`). The generator's ``load_state_dict`` (if it has one)
        gets the state committed with the checkpoint's lineage. Then rounds of later steps
        are rolled back (a new reset commit; they stay listed) and the loader state is
        loaded — also where verl skips it (``global_steps`` a multiple of the loader length,
        which means nothing for a growing dataset)."""
        if self.fixed:
            return
        store = self.store
        if checkpoint_dir is None or step <= 0:
            step = 0
        state = None
        if checkpoint_dir is not None and step > 0:
            if self.consumption_of(step) is not None:
                raise StateMismatchError(
                    f"the round of step {step} of {store.display_url} holds a consumption "
                    "record: its checkpoint was saved with group filtering "
                    "(algorithm.filter_groups.enable=true), whose next step trains the carried "
                    "groups first and draws from the record's position; resume with the "
                    "checkpoint's algorithm.filter_groups settings — nothing was changed"
                )
            round_version = self.round_of(step)
            state = loader_state.checked_resume_state(
                checkpoint_dir, loader, step, store, round_version
            )
            # loaded before the rollback commit, so a generator that refuses it leaves the
            # store as it was
            self._restore_generator(step, round_version)
        # Rounds of later steps leave the lineage (empty ones too: the resumed run would
        # otherwise take them for its own and skip those steps).
        rollback(store, step=step, meta={"verl_resume_step": step})
        if state is not None:
            loader.load_state_dict(state)

        self.step = step
        self._committed = None
        self._rows.refresh()  # type: ignore[union-attr]

    def _restore_generator(self, step: int, round_version: int | None) -> None:
        """Load into the generator (if it takes a state) the state committed last on the
        lineage of step ``step``'s round (the abandoned rounds' are not on it)."""
        if self.data_generator is None or round_version is None:
            return
        check_state_owner(self.data_generator, self.store, round_version, f"resuming step {step}")
        generator_state = self.store.generator_state(round_version)
        if generator_state is not None and load_state(self.data_generator, generator_state):
            log.info("generator state of step %d (version %d) loaded", step, round_version)

    def resume_async(
        self,
        checkpoint_dir: str | None,
        loader: Any,
        step: int,
        position: dict[str, Any] | None = None,
    ) -> None:
        """:meth:`resume` for verl's async trainers (:mod:`dynstate.verl.v1_async`), whose
        loader hands out one row per batch ahead of training: ``data.pt`` must hold
        ``position``, the sampler state of step ``step``'s consumption record (the caller checks
        the record), instead of "the position after ``step`` batches". Checked before anything
        changes; then the generator's state is loaded, later rounds are rolled back and the
        loader state is loaded. ``step`` 0: a fresh start (rounds a crashed run committed before
        its first checkpoint leave the lineage)."""
        if self.fixed:
            return
        store = self.store
        state = None
        if checkpoint_dir is not None and step > 0:
            path = os.path.join(checkpoint_dir, "data.pt")
            state = loader_state.read_loader_state(path, store)
            saved = find_sampler_state(state)
            if json.loads(json.dumps(saved)) != position:
                raise StateMismatchError(
                    f"{path} does not hold the train loader's position that the consumption "
                    f"record of step {step} of {store.display_url} names; it was copied from "
                    "another checkpoint — restore this folder's own data.pt (nothing was changed)"
                )
            self._restore_generator(step, self.round_of(step))
            state = loader_state.for_workers(
                state, int(loader.num_workers or 0), path, store.display_url
            )
        rollback(store, step=max(step, 0), meta={"verl_resume_step": max(step, 0)})
        if state is not None:
            loader.load_state_dict(state)
        self.step = max(step, 0)
        self._committed = None
        self._rows.refresh()  # type: ignore[union-attr]

    def consumption_of(self, step: int) -> dict[str, Any] | None:
        """The consumption record of ``step``'s round on the head's lineage (group filtering),
        or None."""
        found = self.store.consumption.of_step(self.store.latest(), step)
        return None if found is None else found[1]

    def resume_filtered(self, sampling: DynamicSampling, step: int) -> None:
        """:meth:`resume` under group filtering: the step's loader position and carry are its
        consumption record's, so ``data.pt`` is not read. The generator's state of the
        checkpoint's lineage is loaded, then :meth:`DynamicSampling.resume` checks the record
        against ``sampling``'s settings, rolls later rounds back and restores the sampler's
        position and the carry (``step`` 0: a fresh start; rounds a crashed run committed
        before its first checkpoint are dropped). The caller checks the record first, naming
        verl's keys (:mod:`dynstate.verl.v1`)."""
        if self.fixed:
            return
        if step <= 0:
            sampling.resume(None, first_step=1)
            step = 0
        else:
            self._restore_generator(step, self.round_of(step))
            sampling.resume(step)
        self.step = step
        self._committed = None
        self._rows.refresh()  # type: ignore[union-attr]


def _with_source(table: pa.Table) -> pa.Table:
    if SOURCE_COLUMN in table.column_names:
        i = table.column_names.index(SOURCE_COLUMN)
        return table.set_column(i, SOURCE_COLUMN, table.column(SOURCE_COLUMN).cast(SOURCE_TYPE))
    return table.append_column(SOURCE_COLUMN, pa.nulls(table.num_rows, SOURCE_TYPE))
