"""dynstate for verl 0.9: dynamic data generation that checkpoints and resumes exactly.

The only package of dynstate that imports verl. ``data.custom_cls.path: pkg://dynstate.verl``
with ``name: DynstateRLDataset``; run with ``python -m dynstate.verl.main_ppo`` (or mix
:class:`DynstateTrainerMixin` into your own ``RayPPOTrainer``; for verl's V1 trainer, import
:mod:`dynstate.verl.v1` where ``TaskRunnerV1`` runs and set ``trainer.v1.trainer_mode=dynstate``
— not imported here, as it needs TransferQueue). See docs/verl.md.
"""

from __future__ import annotations

from ..errors import MissingDependencyError

try:
    import verl  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(
        "dynstate.verl needs verl; install it with `pip install 'dynstate[verl]'`"
    ) from exc

from .dataset import DynstateRLDataset
from .generator import SOURCE_COLUMN, AbstractDataGenerator, DynstateGenerator
from .loader_state import read_loader_state
from .settings import Settings
from .trainer import DynstateTrainerMixin, dynstate_trainer_class

__all__ = [
    "SOURCE_COLUMN",
    "AbstractDataGenerator",
    "DynstateGenerator",
    "DynstateRLDataset",
    "DynstateTrainerMixin",
    "Settings",
    "dynstate_trainer_class",
    "read_loader_state",
]
