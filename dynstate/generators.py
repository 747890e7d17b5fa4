"""Generators: what writes a new round of tasks between training steps, for every trainer
integration (verl, TRL) — one home for the interfaces and for how a trainer calls them.

Two interfaces are accepted, chosen by the class a generator derives from:

* the old one, :class:`AbstractDataGenerator` (verl's experimental ``DynamicGenDataset``
  interface, unchanged): ``__init__(config)`` and ``generate(dataset)`` returning new rows;
  ``dataset.dataframe`` is a ``datasets.Dataset`` of the current rows. Any object with such a
  ``generate(dataset)`` is called this way.
* dynstate's richer one, :class:`DynstateGenerator`: ``generate(batch, step, dataset)`` also
  receives the step's scored batch (a verl ``DataProto`` under verl, a
  :class:`dynstate.trl.StepBatch` under TRL) and the step; a row's ``_dynstate_source`` (a list
  of store row numbers) records the rows it was derived from.

Both can read what the policy solves so far (``dataset.outcome_stats()``, and with
``pending=True`` the step's own scores counted too) and may keep state: ``state_dict()``
returning plain JSON types and ``load_state_dict(state)``. The integration commits the state
with the generator's round and, on resume, loads the state of the checkpointed version. A
generator must draw its randomness from its own state, never from the global generators the
trainer owns, so that a resumed run writes the same rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import pyarrow as pa

from .errors import InvalidDataError, StateMismatchError
from .records.rounds import to_table

__all__ = [
    "SOURCE_COLUMN",
    "SOURCE_TYPE",
    "AbstractDataGenerator",
    "DynstateGenerator",
    "check_generator",
    "check_state_owner",
    "generator_name",
    "load_state",
    "round_table",
    "run_generator",
    "state_of",
]

# The column a generated row names its source rows in (a list of store row numbers).
SOURCE_COLUMN = "_dynstate_source"
SOURCE_TYPE = pa.list_(pa.int64())


class AbstractDataGenerator(ABC):
    """verl's old generator interface (``verl.experimental.dynamic_dataset``), unchanged."""

    def __init__(self, config: Any = None):
        self.config = config

    @abstractmethod
    def generate(self, dataset: Any) -> Any:
        """Return new rows (a ``datasets.Dataset``) given the train dataset."""


class DynstateGenerator(ABC):
    """dynstate's generator interface: sees the step's scored batch and records lineage.

    ``name`` is written into each round's commit meta (``dynstate ls`` shows it)."""

    name: str = ""

    def __init__(self, config: Any = None):
        self.config = config

    @abstractmethod
    def generate(self, batch: Any, step: int, dataset: Any) -> Any:
        """Return the new rows for ``step``: a list of dicts, a ``datasets.Dataset``, a pandas
        DataFrame or a pyarrow Table, with the store's columns and optionally
        ``_dynstate_source``. ``dataset.outcome_stats()`` gives the per-row statistics of the
        earlier steps (``pending=True``: and of this one)."""


def check_generator(generator: Any, where: str) -> None:
    """Refuse, before any step, what cannot be called as a generator: a class instead of an
    instance, or an object without a ``generate`` method (``where``: who was given it)."""
    if generator is None:
        return
    if isinstance(generator, type) or not callable(getattr(generator, "generate", None)):
        raise InvalidDataError(
            f"{where}: generator must be an object with a generate() method (an instance of "
            f"a DynstateGenerator or AbstractDataGenerator subclass), not {generator!r}"
        )


def generator_name(generator: Any) -> str:
    """What a round's commit meta records as its generator."""
    return getattr(generator, "name", "") or type(generator).__name__


def run_generator(generator: Any, batch: Any, step: int, dataset: Any) -> Any:
    """Call either interface; returns whatever rows the generator made."""
    if isinstance(generator, DynstateGenerator):
        return generator.generate(batch, step, dataset)
    return generator.generate(dataset)


def state_of(generator: Any) -> Any:
    """The generator's ``state_dict()`` (committed with its round), or None without one."""
    method = getattr(generator, "state_dict", None)
    return method() if callable(method) else None


# how many records back a resume looks for the round that committed the generator state it
# loads (a stateful generator commits it with every round: the first record has it)
OWNER_LOOKBACK = 256


def state_owner(store: Any, version: int) -> str | None:
    """The generator (its commit meta's ``generator``) that committed the generator state
    ``version``'s lineage holds, or None where that is not known: no state, a record without
    the name (a compaction carries the state), or none within :data:`OWNER_LOOKBACK` records."""
    for i, v in enumerate(store.lineage(version, ahead=16)):
        if i >= OWNER_LOOKBACK:
            return None
        record = store.commit_record(v)
        if record.generator_state is not None:
            name = (record.meta or {}).get("generator")
            return name if isinstance(name, str) else None
    return None


def check_state_owner(generator: Any, store: Any, version: int, resuming: str) -> None:
    """Refuse, before a resume changes anything, to give ``generator``'s ``load_state_dict``
    the state another generator committed (its own rows would follow from a state it never
    wrote). ``resuming``: what is being resumed, for the message."""
    if generator is None or not callable(getattr(generator, "load_state_dict", None)):
        return
    owner = state_owner(store, version)
    mine = generator_name(generator)
    if owner is not None and owner != mine:
        raise StateMismatchError(
            f"{resuming}: the generator state of version {version} of {store.display_url} was "
            f"committed by generator {owner!r}, and this run's generator is {mine!r}, whose "
            f"load_state_dict would get {owner!r}'s state; resume with {owner!r}, or give your "
            f"generator name = {owner!r} if it reads that state — nothing was changed"
        )


def load_state(generator: Any, state: Any) -> bool:
    """Give ``state`` to the generator's ``load_state_dict``; False when it has none (or
    there is no state to give)."""
    method = getattr(generator, "load_state_dict", None)
    if not callable(method) or state is None:
        return False
    method(state)
    return True


def round_table(
    rows: Any, generator: Any, schema: pa.Schema | None, url: str
) -> tuple[pa.Table | list[Any], bool]:
    """What ``generator`` returned, as the round a trainer appends, and whether the round
    brings the lineage column new to the store (append it with ``allow_new_columns``, which
    this allows for that column alone). The lineage column is optional in a round: an
    old-interface generator cannot know lineage (its rows come from ``dataset.dataframe``,
    which leaves the column out), so the column is dropped from its rows; a round without it
    in a store that has it gets nulls there."""
    if rows is None or (isinstance(rows, list) and not rows):
        return [], False
    table = to_table(rows, url)
    if table.num_rows == 0:
        return [], False
    names = set(table.column_names)
    if SOURCE_COLUMN in names and not isinstance(generator, DynstateGenerator):
        table, names = table.drop_columns([SOURCE_COLUMN]), names - {SOURCE_COLUMN}
    stored = set() if schema is None else set(schema.names)
    if SOURCE_COLUMN in names:
        i = table.column_names.index(SOURCE_COLUMN)
        table = table.set_column(i, SOURCE_COLUMN, table.column(SOURCE_COLUMN).cast(SOURCE_TYPE))
    elif SOURCE_COLUMN in stored:
        table = table.append_column(SOURCE_COLUMN, pa.nulls(table.num_rows, SOURCE_TYPE))
        names.add(SOURCE_COLUMN)
    new_source = schema is not None and names - stored == {SOURCE_COLUMN}
    return table, new_source
