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
from typing import Any

from ..errors import InvalidDataError

# The interfaces and how a trainer calls them live in one home for every integration;
# re-exported here, where verl users have imported them from.
from ..generators import (  # noqa: F401
    SOURCE_COLUMN,
    AbstractDataGenerator,
    DynstateGenerator,
    generator_name,
    load_state,
    run_generator,
    state_of,
)

log = logging.getLogger("dynstate")

ROW_KEY = "dynstate_row"
# the version an item was read from: with a selection policy, the one whose statistics drew it
VERSION_KEY = "dynstate_version"
_OLD_MODULE = "verl.experimental.dynamic_dataset.dynamicgen_dataset"


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
    try:
        cls = load_extern_object(path, name)
    except (AttributeError, ImportError, OSError) as exc:
        raise InvalidDataError(
            f"cannot load data.datagen.name={name!r} from data.datagen.path={path!r}: {exc}; "
            "give the path of a Python file (or an importable module) and a class defined in it"
        ) from exc
    if not isinstance(cls, type) or not callable(getattr(cls, "generate", None)):
        raise InvalidDataError(
            f"data.datagen {name!r} in {path} is not a generator class; define a class with a "
            "generate() method (AbstractDataGenerator or DynstateGenerator)"
        )
    return cls(datagen_config)
