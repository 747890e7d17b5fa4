"""``python -m dynstate.verl.main_ppo`` — verl's ``main_ppo`` with dynstate's trainers.

Same Hydra config and overrides as ``python -m verl.trainer.main_ppo``, and like it, it honours
``trainer.use_v1`` (true by default in verl 0.9):

- ``use_v1=true``: verl's ``TaskRunnerV1`` with ``trainer.v1.trainer_mode=dynstate``
  (:class:`~dynstate.verl.v1.DynstatePPOTrainer`, verl's ``sync`` trainer with dynstate's
  sampler, round commits and resume; with ``algorithm.filter_groups.enable=true``, dynstate's
  group filtering). ``sync`` — verl's default — is run as ``dynstate``, ``colocate_async`` as
  ``dynstate_colocate_async`` (:mod:`dynstate.verl.v1_async`); ``separate_async`` and
  ``sync_refill_failed_groups`` are refused here, before Ray starts
  (:func:`dynstate.verl.v1.check_config`).
- ``use_v1=false``: verl's legacy ``TaskRunner`` with ``RayPPOTrainer`` replaced by
  :func:`~dynstate.verl.trainer.dynstate_trainer_class` inside the Ray actor. verl 0.9.1's
  legacy trainer has no group-filtering path: ``algorithm.filter_groups.enable=true`` is
  refused there rather than silently ignored.

verl's trainer registry lives in the process that runs the trainer (the TaskRunner actor), and
``TaskRunnerV1.run`` looks the mode up before it loads anything of the user's: the runner below
imports :mod:`dynstate.verl.v1` there first, which registers the mode. Needs GPUs, like verl.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import hydra
import verl

from ..errors import DynstateError, InvalidDataError

CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def _log_level() -> None:
    logging.getLogger("dynstate").setLevel(os.getenv("DYNSTATE_LOGGING_LEVEL", "INFO"))


def _task_runner_class() -> Any:
    import ray
    from verl.trainer import main_ppo_v0

    base = main_ppo_v0.TaskRunner.__ray_metadata__.modified_class

    class DynstateTaskRunner(base):  # type: ignore[misc, valid-type]
        def run(self, config: Any) -> Any:
            # Runs inside the Ray actor: point verl's TaskRunner at the mixed-in trainer.
            from .trainer import dynstate_trainer_class

            _log_level()
            main_ppo_v0.RayPPOTrainer = dynstate_trainer_class()
            return super().run(config)

    return ray.remote(DynstateTaskRunner)


def _task_runner_v1_class() -> Any:
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1

    base = TaskRunnerV1.__ray_metadata__.modified_class

    class DynstateTaskRunnerV1(base):  # type: ignore[misc, valid-type]
        def run(self, config: Any) -> Any:
            # Runs inside the Ray actor, before verl's get_trainer_cls: register the modes here.
            from . import v1, v1_async  # noqa: F401  - v1_async registers the async trainers

            _log_level()
            v1.check_config(config)
            return super().run(config)

    return ray.remote(DynstateTaskRunnerV1)


def select_v1_trainer(config: Any) -> None:
    """Point ``trainer.v1.trainer_mode`` at dynstate's trainer (``sync`` becomes ``dynstate``)
    or raise :class:`~dynstate.InvalidDataError` naming the supported modes."""
    from omegaconf import open_dict

    from . import v1, v1_async  # noqa: F401  - v1_async registers the async trainers

    with open_dict(config):
        mode = config.trainer.v1.get("trainer_mode", "sync")
        if mode in v1.SUPPORTED_MODES:
            config.trainer.v1.trainer_mode = v1.TRAINER_MODE
        elif mode in v1.ASYNC_TRAINERS:
            config.trainer.v1.trainer_mode = v1.ASYNC_TRAINERS[mode]
    v1.check_config(config)


def check(config: Any) -> None:
    """Everything checked before Ray starts: every ``data.dynstate`` setting, the selection
    policy built as the train set builds it, and mix mode's ``lag`` against
    ``data.dataloader_num_workers`` (:func:`~dynstate.verl.settings.check_settings`, with the
    trainer's messages); then verl's own config checks and, for ``trainer.use_v1=true``, the
    V1 modes (:func:`select_v1_trainer`)."""
    from .settings import check_settings

    check_settings(config)  # first: it needs none of verl's checks, and fails in seconds

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate_config(
        config=config,
        use_reference_policy=need_reference_policy(config),
        use_critic=need_critic(config),
    )
    if config.trainer.get("use_v1", True):
        select_v1_trainer(config)
    else:
        filter_groups = config.algorithm.get("filter_groups", None)
        if filter_groups is not None and filter_groups.get("enable", False):
            raise InvalidDataError(
                "algorithm.filter_groups.enable=true does nothing in verl 0.9.1's legacy trainer "
                "(trainer.use_v1=false has no group-filtering path): the run would train "
                "unfiltered batches; use trainer.use_v1=true (dynstate filters there, see "
                "docs/verl.md, 'Dynamic sampling (DAPO)'), or turn the filter off"
            )


def _launch(config: Any) -> None:
    from verl.trainer.main_ppo import run_ppo

    if config.trainer.get("use_v1", True):
        run_ppo(config, task_runner_class=_task_runner_v1_class())
    else:
        run_ppo(config, task_runner_class=_task_runner_class())


def run(config: Any) -> None:
    """What ``main`` does once Hydra has composed ``config``: :func:`check`, then verl's
    ``run_ppo`` (Ray, the TaskRunner actor) with dynstate's trainer."""
    check(config)
    _launch(config)


@hydra.main(config_path=CONFIG_DIR, config_name="ppo_trainer", version_base=None)
def main(config: Any) -> None:
    try:
        check(config)
    except DynstateError as exc:
        # A setting refused before Ray started: the key and what to do are the whole story,
        # so one line instead of Hydra's traceback.
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    _launch(config)


if __name__ == "__main__":
    main()
