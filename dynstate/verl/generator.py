"""Generators: what writes a new round of tasks after each training step.

Two interfaces are accepted, chosen by the class a generator derives from:

* verl's old one, :class:`AbstractDataGenerator` — ``__init__(config)`` receives the
  ``data.datagen`` config and ``generate(dataset) -> datasets.Dataset`` receives the train
  dataset (``dataset.dataframe`` is a ``datasets.Dataset`` of the current rows, as it was in
  verl's experimental ``DynamicGenDataset``). Classes written for it run unchanged; a file that
  still imports it from ``verl.experimental.dynamic_dataset.dynamicgen_dataset`` (removed in
  verl 0.9) gets this class under that name.
* dynstate's richer one, :class:`DynstateGenerator` — ``generate(batch, step, dataset)``
  receives the step's ``DataProto`` (with ``token_level_scores`` and the ``dynstate_row`` of each
  prompt) and the global step, and returns rows; a row's ``_dynstate_source`` (a list of store
  row numbers) records the rows it was derived from.

Both interfaces can read what the policy solves so far: ``dataset.outcome_stats()`` (the
per-row statistics of the version the round is appended to, every earlier step's outcomes;
the step's own scores are in ``batch``, and ``dataset.outcome_stats(pending=True)`` counts
them too). A generator of either interface may keep state:
``state_dict()`` returning plain JSON types, and ``load_state_dict(state)``. The integration
commits the state with the generator's round and, on resume, loads the state of the
checkpointed version. Classes without these methods run unchanged.
"""

from __future__ import annotations

import logging
import sys
import types
from abc import ABC, abstractmethod
from typing import Any

from ..errors import InvalidDataError

log = logging.getLogger("dynstate")

SOURCE_COLUMN = "_dynstate_source"
ROW_KEY = "dynstate_row"
# the version an item was read from: with a selection policy, the one whose statistics drew it
VERSION_KEY = "dynstate_version"
_OLD_MODULE = "verl.experimental.dynamic_dataset.dynamicgen_dataset"


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
        ``_dynstate_source`` (list of source row numbers, from ``batch``'s ``dynstate_row``).
        ``dataset.outcome_stats()`` gives the per-row statistics of the earlier steps
        (``pending=True``: and of this one)."""

    # Optional (both interfaces): ``state_dict() -> plain JSON types`` and
    # ``load_state_dict(state)``; see :func:`state_of` and :func:`load_state`.


def _install_old_module_alias() -> None:
    """Let generator files that import verl's removed module keep working."""
    if _OLD_MODULE in sys.modules:
        return
    try:
        __import__(_OLD_MODULE)
        return
    except ImportError:
        pass
    parent = "verl.experimental.dynamic_dataset"
    if parent not in sys.modules:
        pkg = types.ModuleType(parent)
        pkg.__path__ = []  # a namespace-like package: submodules come from sys.modules
        sys.modules[parent] = pkg
    module = types.ModuleType(_OLD_MODULE)
    module.AbstractDataGenerator = AbstractDataGenerator  # type: ignore[attr-defined]
    sys.modules[_OLD_MODULE] = module
    sys.modules[parent].dynamicgen_dataset = module  # type: ignore[attr-defined]


def load_generator(datagen_config: Any) -> AbstractDataGenerator | DynstateGenerator | None:
    """Instantiate the class named by ``data.datagen.path`` / ``name`` (None if unset)."""
    if datagen_config is None or not datagen_config.get("path"):
        return None
    from verl.utils.import_utils import load_extern_object

    path, name = datagen_config.get("path"), datagen_config.get("name")
    if not name:
        raise InvalidDataError(
            f"data.datagen.path is {path!r} but data.datagen.name is not set; name the "
            "generator class defined in that file"
        )
    _install_old_module_alias()
    cls = load_extern_object(path, name)
    if not isinstance(cls, type) or not callable(getattr(cls, "generate", None)):
        raise InvalidDataError(
            f"data.datagen {name!r} in {path} is not a generator class; define a class with a "
            "generate() method (AbstractDataGenerator or DynstateGenerator)"
        )
    return cls(datagen_config)


def generator_name(generator: Any) -> str:
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


def load_state(generator: Any, state: Any) -> bool:
    """Give ``state`` to the generator's ``load_state_dict``; False when it has none."""
    method = getattr(generator, "load_state_dict", None)
    if not callable(method):
        return False
    method(state)
    return True
