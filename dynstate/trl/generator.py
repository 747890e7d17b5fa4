"""Generators under TRL: what writes a new round of tasks between training steps.

The interfaces are verl's (docs/verl.md), defined once in :mod:`dynstate.generators`, so one
generator class serves both trainers (its ``batch`` is a verl ``DataProto`` there, a
:class:`StepBatch` here):

* the old one: any object with ``generate(dataset)`` returning new rows (a
  ``datasets.Dataset``, a list of dicts, a pandas DataFrame or a pyarrow Table); ``dataset`` is
  a :class:`RoundView` whose ``dataframe`` is a ``datasets.Dataset`` of the current rows, as in
  verl's old ``DynamicGenDataset``;
* the richer one, :class:`DynstateGenerator`: ``generate(batch, step, dataset)`` also gets the
  step's scored prompts (:class:`StepBatch`: each response's store row and score) and the
  step; a row's ``_dynstate_source`` (list of store row numbers) records what it came from.

Either may read what the policy solves so far: ``dataset.outcome_stats()`` (every earlier
step's outcomes) or ``dataset.outcome_stats(pending=True)`` (this step's counted too). Either
may keep state: ``state_dict()`` returning plain JSON types and ``load_state_dict(state)``;
the integration commits the state with the generator's round and, on resume, loads the state
of the checkpointed version. A generator must draw its randomness from its own state (never
from ``random``/``torch``'s global generators, which the trainer owns), so that a resumed run
writes the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets
import pyarrow as pa

from ..generators import (  # noqa: F401  (the one home of the interfaces, re-exported)
    SOURCE_COLUMN,
    AbstractDataGenerator,
    DynstateGenerator,
    generator_name,
    load_state,
    run_generator,
    state_of,
)
from ..store import Store


@dataclass(frozen=True)
class StepBatch:
    """The scored prompts of one step, in the order they were generated: ``rows[i]`` is the
    store row of response ``i`` (a group's ``num_generations`` responses share one),
    ``scores[i]`` its reward (the reward functions' weighted sum, as TRL's ``reward``),
    ``prompts[i]`` and ``completions[i]`` the prompt and the completion the reward functions
    scored (text, or messages for a conversational dataset; None where a ``_calculate_rewards``
    override scored other lists), and ``rows_version`` the version those rows were read at."""

    step: int
    rows: list[int]
    scores: list[float]
    rows_version: int
    prompts: list[Any]
    completions: list[Any]


class RoundView:
    """What a generator sees of the store between a step's scoring and its commit."""

    def __init__(self, store: Store, pending: dict[str, Any], rows_version: int):
        self.store = store
        self._pending = pending
        self._rows_version = rows_version
        self._frame: datasets.Dataset | None = None

    @property
    def version(self) -> int:
        """The version the round will be appended to (the head)."""
        return self.store.head

    @property
    def dataframe(self) -> datasets.Dataset:
        """The current rows as a ``datasets.Dataset`` (verl's old generator interface)."""
        if self._frame is None:
            table = self.store.snapshot(self.store.resolve(None)).to_arrow()
            if SOURCE_COLUMN in table.column_names:
                table = table.drop_columns([SOURCE_COLUMN])
            self._frame = datasets.Dataset(table)
        return self._frame

    def __len__(self) -> int:
        return self.store.snapshot(self.store.resolve(None)).num_rows

    def outcome_stats(self, *, pending: bool = False, **kwargs: Any) -> pa.Table:
        """Per-row statistics at the head; ``pending=True`` counts this step's outcomes too."""
        if pending:
            return self.store.outcome_stats(
                pending=self._pending, rows_version=self._rows_version, **kwargs
            )
        return self.store.outcome_stats(**kwargs)
