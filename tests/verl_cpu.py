"""verl's real ``RayPPOTrainer.fit()`` on CPU: stand-ins only where verl talks to GPU workers.

What is verl's own code here: the ``ppo_trainer`` Hydra config (composed through
examples/verl/arith.yaml, so the example's config is the one tested), ``validate_config``,
the trainer (``dynstate_trainer_class()``: dynstate's mixin over ``RayPPOTrainer``) and its whole
``fit()`` loop, dataset factory, collate_fn, StatefulDataLoader, ``_get_gen_batch``, GRPO
advantages, ``_save_checkpoint`` / ``_load_checkpoint``, validation, verl's
``AgentLoopManager`` / ``AgentLoopWorker`` / ``SingleTurnAgentLoop`` (chat template,
tokenisation, padding, postprocess) and verl's ``RewardLoopWorker`` with the ``naive`` reward
manager calling the example's rule-based ``custom_reward_function`` (examples/verl/arith_reward.py;
verl's default reward path: no reward model, rewards streamed from the agent loop).

What stands in:

* the LLM server (``LLMServerManager``'s client): a word-level "policy" that answers
  ``What is a + b?`` right unless ``a + b`` is divisible by 3;
* the actor worker group (``update_actor`` / ``save_checkpoint`` / ``load_checkpoint``: no
  model; the checkpoint is a small file) and the checkpoint engine (weight sync);
* Ray's actor transport: agent-loop and reward-loop workers are verl's classes, each in its own
  thread with its own event loop (as a Ray async actor has), called through ``.remote()`` with
  every argument and result pickled, as Ray would. No Ray cluster is started, so a SIGKILLed
  driver leaves no processes behind.

``python verl_cpu.py '<json spec>'`` runs one driver; ``spec["kill"] = [step, instant]``
SIGKILLs it at ``rollout`` (inside generation of that step), ``saved`` (right after the
checkpoint of that step is written), ``validation`` (inside validation after that step),
``committed`` (right after the round of that step is committed). Every trained batch is logged
to ``spec["log"]`` (one JSON line, fsynced), with the store version each row came from.

One file because it is one driver: the zygote forks children that run the stand-ins, and verl
loads classes of this file by path.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import sys
import threading
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INSTANTS = ("rollout", "saved", "validation", "committed")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
WORDS = ["<unk>", "<pad>", "<eos>", "What", "is", "+", "?", "user", "assistant", ":"]
WORDS += [str(i) for i in range(3000)] + ["and", "also", "then", "more", "The", "answer"]


# -- files: tokenizer/model folder and data ----------------------------------------------------


def make_model_dir(folder: str) -> str:
    """A word-level tokenizer and a tiny model config, saved like a HF model folder (no
    weights: nothing here loads a model). verl's HFModelConfig, RewardLoopWorker and the agent
    loop read it with ``from_pretrained``, offline."""
    import verl_common

    return verl_common.make_model_dir(folder, WORDS, CHAT_TEMPLATE, "Whitespace")


def write_data(folder: str, n_train: int, n_val: int) -> tuple[str, str]:
    """Arithmetic tasks as verl's preprocessing writes them; a few are overlong (verl's filter
    drops them on import)."""
    import verl_common

    sys.path.insert(0, os.path.join(ROOT, "examples", "verl"))
    from arith_generator import make_task

    return verl_common.write_data(folder, n_train, n_val, make_task)


# -- config ------------------------------------------------------------------------------------


def compose_config(spec: dict) -> Any:
    """examples/verl/arith.yaml (verl's own ``ppo_trainer`` config plus the example's settings:
    dynstate dataset, example generator and reward), composed by Hydra, with the run's
    overrides."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    config_dir = os.path.join(ROOT, "examples", "verl")
    model = spec["model"]
    overrides = [
        "trainer.use_v1=false",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.logger=[console]",
        "trainer.project_name=dynstate",
        "trainer.experiment_name=cpu",
        f"trainer.default_local_dir={spec['ckpt']}",
        f"trainer.save_freq={spec.get('save_freq', 2)}",
        f"trainer.test_freq={spec.get('test_freq', 3)}",
        f"trainer.total_training_steps={spec.get('steps', 7)}",
        "trainer.total_epochs=1000",
        f"trainer.resume_mode={spec.get('resume_mode', 'auto')}",
        "trainer.val_before_train=false",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "algorithm.rollout_correction.bypass_mode=true",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.strategy=fsdp",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={spec.get('batch_size', 4)}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.prompt_length=32",
        "actor_rollout_ref.rollout.response_length=8",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={config_dir}/arith_reward.py",
        "reward.custom_reward_function.name=compute_score",
        f"data.train_files={spec['train']}",
        f"data.val_files={spec.get('val_files', spec['val'])}",
        f"data.train_batch_size={spec.get('batch_size', 4)}",
        "data.max_prompt_length=24",
        "data.max_response_length=8",
        "data.filter_overlong_prompts=true",
        "data.filter_overlong_prompts_workers=1",
        f"data.shuffle={str(spec.get('shuffle', True)).lower()}",
        f"data.seed={spec.get('seed', 7)}",
        f"data.dataloader_num_workers={spec.get('num_workers', 0)}",
        *spec.get("overrides", []),
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="arith", overrides=overrides)
    datagen = spec.get(
        "datagen",
        {
            "path": os.path.join(ROOT, "examples/verl/arith_generator.py"),
            "name": "ArithVariations",
            "variations": 1,
            "max_new": 3,
        },
    )
    with open_dict(config):
        config.data.dynstate = OmegaConf.create(
            {"url": spec["store"], "storage_options": spec.get("storage_options", {})}
        )
        config.data.dynstate.update(spec.get("dynstate", {}))
        config.data.datagen = OmegaConf.create(datagen)
    return config


# -- stand-ins ---------------------------------------------------------------------------------


class _Instant:
    """Where the driver SIGKILLs itself: ``(step, instant)`` or nothing."""

    def __init__(self, kill: list | None):
        self.kill = tuple(kill) if kill else None

    def __call__(self, step: int, instant: str) -> None:
        if self.kill == (step, instant):
            os.kill(os.getpid(), signal.SIGKILL)


DIE = _Instant(None)


class StandInLLM:
    """The LLM server's client: verl's agent loop awaits ``generate(prompt_ids=...)``."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._tok = None
        self.step = 0  # set by the trainer before each rollout (not sent through "Ray")

    async def generate(self, *, prompt_ids: list[int], sampling_params: dict, **_: Any) -> Any:
        from transformers import AutoTokenizer
        from verl.workers.rollout.replica import TokenOutput

        if self._tok is None:
            self._tok = AutoTokenizer.from_pretrained(self.model_dir)
        words = self._tok.decode(prompt_ids).split()
        answer = "0"
        if "What" in words:
            i = words.index("What")
            a, b = int(words[i + 2]), int(words[i + 4])
            answer = str(a + b + 1) if (a + b) % 3 == 0 else str(a + b)
        ids = self._tok.convert_tokens_to_ids(["The", "answer", "is", answer, "<eos>"])
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed")


class _Method:
    def __init__(self, actor: InProcessActor, name: str):
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.actor.call(self.name, args, kwargs)


class InProcessActor:
    """A verl worker class run the way a Ray async actor runs it — its own thread and event
    loop, arguments and results serialised — but inside this process."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        error: list[BaseException] = []

        def main() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._obj = cls(*_copy(args), **_copy(kwargs))
            except BaseException as exc:  # reported to the constructing thread
                error.append(exc)
            ready.set()
            if not error:
                self._loop.run_forever()

        self._thread = threading.Thread(target=main, daemon=True, name=f"actor-{cls.__name__}")
        self._thread.start()
        ready.wait()
        if error:
            raise error[0]

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        async def run() -> Any:
            result = getattr(self._obj, name)(*_copy(args), **_copy(kwargs))
            if asyncio.iscoroutine(result):
                result = await result
            return _copy(result)

        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self._loop))


_HANDLES: dict[int, InProcessActor] = {}


def _copy(value: Any) -> Any:
    """What crossing a Ray actor boundary does to a value: a serialised copy, in which actor
    handles stay references to the same actor."""
    import io

    import cloudpickle

    class Pickler(cloudpickle.CloudPickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, InProcessActor):
                _HANDLES[id(obj)] = obj
                return id(obj)
            return None

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return _HANDLES[pid]

    buf = io.BytesIO()
    Pickler(buf).dump(value)
    buf.seek(0)
    return Unpickler(buf).load()


class StandInActorGroup:
    """The actor/rollout worker group: no model, one data-parallel rank. ``update_actor``
    checks the batch it gets is verl's scored batch; checkpoints are small files. (verl's
    ``old_log_prob`` recomputation needs a model: the config uses verl's bypass mode, the
    rollout's log-probs.)"""

    def __init__(self) -> None:
        self._dispatch_info: dict[str, list[int]] = {}

    def _query_dispatch_info(self, role: str) -> list[int]:
        return [0]

    def update_actor(self, batch_td: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        assert "advantages" in batch_td, "update_actor got a batch without advantages"
        return tu.get_tensordict({}, non_tensor_dict={"metrics": {"mfu": 0.0, "pg_loss": 0.0}})

    def save_checkpoint(self, local_path: str, remote_path: Any, step: int, **_: Any) -> None:
        os.makedirs(local_path, exist_ok=True)
        with open(os.path.join(local_path, "weights.txt"), "w") as f:
            f.write(str(step))

    def load_checkpoint(self, local_path: str, **_: Any) -> None:
        with open(os.path.join(local_path, "weights.txt")) as f:
            assert int(f.read()) == int(
                local_path.rstrip("/").split("global_step_")[-1].split("/")[0]
            )


class StandInCheckpointEngine:
    def update_weights(self, step: int) -> None:
        pass

    def sleep_replicas(self) -> None:
        pass


class StandInLLMServers:
    def __init__(self, client: StandInLLM):
        self.client = client

    def get_client(self) -> StandInLLM:
        return self.client

    def start_profile(self) -> None:
        pass

    def stop_profile(self) -> None:
        pass


class StandInResourcePools:
    def get_n_gpus(self) -> int:
        return 1


def cpu_trainer_class(record: Any) -> type:
    """``dynstate_trainer_class()`` with only ``init_workers`` replaced by stand-ins, plus
    instrumentation around verl's own methods (kill instants, the batch log)."""
    from verl.experimental.agent_loop import AgentLoopManager, AgentLoopWorker
    from verl.experimental.reward_loop import RewardLoopWorker

    from dynstate.verl import dynstate_trainer_class

    class InProcessAgentLoopManager(AgentLoopManager):
        async def _init_agent_loop_workers(self) -> None:
            self.agent_loop_workers = [
                InProcessActor(
                    AgentLoopWorker,
                    self.config,
                    self.llm_client,
                    self.teacher_client,
                    self.reward_loop_worker_handles,
                )
                for _ in range(self.rollout_config.agent.num_workers)
            ]

    class CPUTrainer(dynstate_trainer_class()):  # type: ignore[misc]
        def init_workers(self) -> None:
            # RayPPOTrainer.init_workers, with stand-ins for what needs GPUs. Rule-based reward,
            # no reward model: verl hands the reward-loop workers to the agent loop, which
            # scores every trajectory as it finishes (reward_loop_worker_handles set).
            self.actor_rollout_wg = StandInActorGroup()
            self.resource_pool_manager = StandInResourcePools()
            self.reward_loop_manager = None
            reward_workers = [
                InProcessActor(RewardLoopWorker, self.config, None)
                for _ in range(self.config.reward.num_workers)
            ]
            self.llm_server_manager = StandInLLMServers(
                StandInLLM(self.config.actor_rollout_ref.model.path)
            )
            self.teacher_model_manager = None
            self.distillation_config = None
            self.async_rollout_mode = True
            self.async_rollout_manager = InProcessAgentLoopManager.create(
                config=self.config,
                llm_client=self.llm_server_manager.get_client(),
                teacher_client=None,
                reward_loop_worker_handles=reward_workers,
            )
            self.checkpoint_manager = StandInCheckpointEngine()

        def _load_checkpoint(self) -> Any:
            steps_per_epoch = len(self.train_dataloader)  # what verl's _load_checkpoint sees
            result = super()._load_checkpoint()
            step = self.global_steps
            record(
                {
                    "event": "start",
                    "resumed_from": step,
                    # verl skips restoring data.pt "at an epoch boundary"; resume() must not
                    "verl_skipped_restore": step > 0 and step % steps_per_epoch == 0,
                }
            )
            return result

        def _update_actor(self, batch: Any) -> Any:
            record(
                {
                    "event": "batch",
                    "step": self.global_steps,
                    "rows": [int(r) for r in batch.non_tensor_batch["dynstate_row"]],
                    "prompts": [m[-1]["content"] for m in batch.non_tensor_batch["raw_prompt"]],
                    "scores": batch.batch["token_level_scores"].sum(-1).tolist(),
                    "keys": sorted(batch.non_tensor_batch.keys()),
                }
            )
            return super()._update_actor(batch)

        def _validate(self, merged: bool = False) -> Any:
            DIE(self.global_steps, "validation")
            return super()._validate(merged)

        def _save_checkpoint(self) -> Any:
            result = super()._save_checkpoint()
            DIE(self.global_steps, "saved")
            return result

    return CPUTrainer


# -- the driver --------------------------------------------------------------------------------


def _recorder(path: str) -> Any:
    log_file = open(path, "a")  # noqa: SIM115 - one fsynced line per event, whole run

    def record(entry: dict) -> None:
        log_file.write(json.dumps(entry) + "\n")
        log_file.flush()
        os.fsync(log_file.fileno())

    return record


def _datasets(config: Any, tokenizer: Any) -> tuple[Any, Any]:
    """As verl's TaskRunner (main_ppo_v0) builds them: train, then validation, same config."""
    from verl.trainer.ppo.utils import create_rl_dataset

    data = config.data
    train = create_rl_dataset(
        data.train_files,
        data,
        tokenizer,
        None,
        is_train=True,
        max_samples=data.get("train_max_samples", -1),
    )
    val = create_rl_dataset(
        data.val_files,
        data,
        tokenizer,
        None,
        is_train=False,
        max_samples=data.get("val_max_samples", -1),
    )
    return train, val


def run(spec: dict) -> None:
    global DIE
    DIE = _Instant(spec.get("kill"))
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop import AgentLoopWorker
    from verl.trainer.ppo.ray_trainer import Role
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.dataset.rl_dataset import collate_fn

    from dynstate.verl import DynstateRLDataset

    record = _recorder(spec["log"])
    config = compose_config(spec)
    validate_config(
        config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    train, val = _datasets(config, tokenizer)
    assert isinstance(train, DynstateRLDataset) and not train.fixed
    assert not (isinstance(val, DynstateRLDataset) and not val.fixed)

    commit_round = train.commit_round

    def commit_then_maybe_die(batch: Any, step: int) -> Any:
        version = commit_round(batch, step)
        DIE(step, "committed")
        return version

    train.commit_round = commit_then_maybe_die  # type: ignore[method-assign]

    generate = AgentLoopWorker.generate_sequences

    async def rollout(self: Any, batch: Any) -> Any:
        if not batch.meta_info.get("validate", False):
            DIE(batch.meta_info.get("global_steps", -1), "rollout")
        return await generate(self, batch)

    AgentLoopWorker.generate_sequences = rollout  # type: ignore[method-assign]

    trainer = cpu_trainer_class(record)(
        config=config,
        tokenizer=tokenizer,
        processor=None,
        role_worker_mapping={Role.ActorRollout: object},
        resource_pool_manager=StandInResourcePools(),
        train_dataset=train,
        val_dataset=val,
        collate_fn=collate_fn,
        train_sampler=None,  # verl's TaskRunner passes create_rl_sampler's; the mixin replaces it
    )
    trainer.init_workers()
    trainer.fit()
    import ray

    assert not ray.is_initialized(), "the CPU driver must not start a Ray cluster"
    record({"event": "done", "global_steps": trainer.global_steps})


def items(spec: dict) -> None:
    """Items of DynstateRLDataset vs verl's RLHFDataset on the same files and config."""
    import torch
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    import dynstate

    config = compose_config(spec)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    ours, _ = _datasets(config, tokenizer)
    theirs = RLHFDataset(config.data.train_files, tokenizer, config.data, None)
    problems: list[str] = []
    head = ours.store.refresh()
    try:  # a plain row number is what verl's own samplers give: refused, not trained on
        ours[0]
        problems.append("a plain row number (no dynstate sampler) was not refused")
    except dynstate.StateMismatchError as exc:
        if "dynstate.verl.main_ppo" not in str(exc):
            problems.append(f"refusal does not say what to run: {exc}")
        if "trainer_mode=dynstate" in str(exc):  # verl's own main_ppo rejects that mode
            problems.append(f"refusal suggests a setting that does not work: {exc}")
    for i in range(len(theirs)):
        a, b = dict(ours[dynstate.encode_index(head, i)]), dict(theirs[i])
        if a.pop("dynstate_row") != i:
            problems.append(f"row {i}: wrong dynstate_row")
        if a.pop("dynstate_version") != head:
            problems.append(f"row {i}: wrong dynstate_version")
        ta, tb = a.pop("dummy_tensor"), b.pop("dummy_tensor")
        if not torch.equal(ta, tb) or ta.dtype != tb.dtype:
            problems.append(f"row {i}: dummy_tensor differs")
        if a != b:
            problems.append(f"row {i}: {a!r} != {b!r}")
    with open(spec["result"], "w") as f:
        json.dump({"ours": len(ours), "theirs": len(theirs), "problems": problems}, f)


def refuse(spec: dict) -> None:
    """Resume from ``spec["checkpoint"]`` (step ``spec["step"]``): must be refused with
    StateMismatchError and the store left as it was."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import collate_fn

    import dynstate

    config = compose_config(spec)
    train, _ = _datasets(config, AutoTokenizer.from_pretrained(spec["model"]))
    loader = StatefulDataLoader(
        train, batch_size=4, drop_last=True, collate_fn=collate_fn, sampler=train.make_sampler()
    )
    head = train.store.refresh()
    result: dict[str, Any] = {"error": None}
    try:
        train.resume(spec["checkpoint"], loader, spec["step"])
    except dynstate.StateMismatchError as exc:
        result = {"error": type(exc).__name__, "message": str(exc), "head_before": head}
    result["head_after"] = train.store.refresh()
    with open(spec["result"], "w") as f:
        json.dump(result, f)


def data(spec: dict) -> None:
    make_model_dir(spec["model"])
    write_data(spec["folder"], spec.get("n_train", 24), spec.get("n_val", 4))


COMMANDS = {"run": run, "items": items, "refuse": refuse, "data": data}


def child(spec: dict) -> int:
    import traceback

    out = os.open(spec["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    try:
        COMMANDS[spec.get("cmd", "run")](spec)
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def serve() -> None:
    """A zygote: import verl and its dependencies once, then fork a fresh child per request
    (a JSON line on stdin) and answer with its exit status (-9: SIGKILLed)."""
    import transformers  # noqa: F401
    import verl.trainer.ppo.ray_trainer  # noqa: F401
    from verl.experimental.agent_loop import AgentLoopManager  # noqa: F401
    from verl.experimental.reward_loop import RewardLoopWorker  # noqa: F401

    import dynstate.verl  # noqa: F401

    reply = os.fdopen(os.dup(1), "w")
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(child(spec))
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"pid": pid, "status": code}), file=reply, flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        sys.exit(child(json.loads(sys.argv[1])))
