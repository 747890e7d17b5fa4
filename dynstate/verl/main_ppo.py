"""``python -m dynstate.verl.main_ppo`` — verl's ``main_ppo`` with dynstate's trainer.

Same Hydra config and overrides as ``python -m verl.trainer.main_ppo``; it runs verl's legacy
``RayPPOTrainer`` (the trainer that calls ``on_batch_end``; ``trainer.use_v1`` is ignored) with
:class:`~dynstate.verl.trainer.DynstateTrainerMixin` mixed in. Needs GPUs, like verl.
"""

from __future__ import annotations

import os
from typing import Any

import hydra
import verl

CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def _task_runner_class() -> Any:
    import ray
    from verl.trainer import main_ppo_v0

    base = main_ppo_v0.TaskRunner.__ray_metadata__.modified_class

    class DynstateTaskRunner(base):  # type: ignore[misc, valid-type]
        def run(self, config: Any) -> Any:
            # Runs inside the Ray actor: point verl's TaskRunner at the mixed-in trainer.
            from .trainer import dynstate_trainer_class

            main_ppo_v0.RayPPOTrainer = dynstate_trainer_class()
            return super().run(config)

    return ray.remote(DynstateTaskRunner)


@hydra.main(config_path=CONFIG_DIR, config_name="ppo_trainer", version_base=None)
def main(config: Any) -> None:
    from verl.trainer.main_ppo import run_ppo
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    run_ppo(config, task_runner_class=_task_runner_class())


if __name__ == "__main__":
    main()
