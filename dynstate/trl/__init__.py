"""dynstate for TRL: a store as ``GRPOTrainer``'s training set, growing while it trains, with
rounds, outcomes, selection and exact resume. See docs/trl.md.

The only package of dynstate that imports trl. A user's ``GRPOTrainer`` script changes in a
few lines::

    from dynstate.trl import DynstateGRPOTrainer, last_checkpoint  # was: ... GRPOTrainer
    trainer = DynstateGRPOTrainer(
        model=model, reward_funcs=[reward], args=GRPOConfig(...), processing_class=tokenizer,
        train_dataset=dynstate.VersionedDataset(store),   # was: a datasets.Dataset
        generator=MyGenerator(), select=dynstate.Learnability(),
        filter_groups=True,   # optional: DAPO's group filtering with carry-over
    )
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))  # rolls back first
"""

from __future__ import annotations

from ..errors import MissingDependencyError

try:
    import trl  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(
        "dynstate.trl needs trl; install it with `pip install 'dynstate[trl]'`"
    ) from exc

from .generator import DynstateGenerator, RoundView, StepBatch
from .loader import STATE_FILE, last_checkpoint, read_checkpoint_state
from .trainer import DynstateGRPOTrainer, FilterGroups, Round

__all__ = [
    "STATE_FILE",
    "DynstateGRPOTrainer",
    "DynstateGenerator",
    "FilterGroups",
    "Round",
    "RoundView",
    "StepBatch",
    "last_checkpoint",
    "read_checkpoint_state",
]
