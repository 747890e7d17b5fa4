"""verl's real V1 trainer loop on CPU: stand-ins only where verl talks to GPU workers and the
rollout engine.

verl's own code here: the composed ``ppo_trainer`` Hydra config, ``TaskRunnerV1.run`` (run in
this process: it is the driver), TransferQueue (``tq.init``: its controller and storage unit are
Ray actors of a local cluster), the dynstate trainer (``trainer.v1.trainer_mode=dynstate``:
verl's ``PPOTrainerSync`` with dynstate's overrides) and its whole ``fit()``/``step()`` loop,
the ``ReplayBuffer``, dataset factory, collate_fn, StatefulDataLoader, GRPO advantages,
``_save_checkpoint`` / ``_load_checkpoint``, validation, ``AgentLoopManagerTQ`` /
``AgentLoopWorkerTQ`` / ``SingleTurnAgentLoop`` (chat template, tokenisation, postprocess,
TransferQueue records) and ``RewardLoopManager`` / ``RewardLoopWorker`` (Ray actors) with
verl's default rule-based reward (``default_compute_score``, ``openai/gsm8k``): no reward
model, rewards streamed from the agent loop.

What stands in:

* the LLM server's client: a word-level "policy" answering ``What is a + b ?`` with
  ``#### a+b``, wrong when ``a + b`` is divisible by 3;
* the actor worker group (``compute_log_prob`` writes zero log-probs into TransferQueue,
  ``update_actor`` checks the advantages are there; checkpoints are small files), the LLM
  server manager and the checkpoint engine (weight sync): ``_setup``'s GPU part.

``python verl_v1_standins.py '<json spec>'`` runs one driver; ``spec["kill"] = [step, instant]``
SIGKILLs it at ``rollout`` (prompts of that step in flight), ``saved`` (right after the
checkpoint of that step is written), ``validation`` (inside validation after that step),
``committed`` (right after the round of that step is committed), ``refill`` (group filtering:
the step's second generation batch drawn, its first scored). ``spec["policy"] = "dapo"`` makes
the stand-in policy's answers differ between a prompt's responses for some prompts (so that
group filtering keeps some groups and filters others); ``"dapo_fail"`` also fails one session
of every prompt whose ``a + b`` is a multiple of 7 (an async buffer evicts such a group as
failed). ``spec["async"]`` (``"colocate"`` or ``"separate"``) runs verl's async trainer of that
name with dynstate (:mod:`dynstate.verl.v1_async`). Every trained batch is logged
to ``spec["log"]`` (one JSON line per step, fsynced); the Ray processes the driver started are
listed in ``spec["pids"]`` so that whoever kills it can end them.

One file because it is one driver: run as a script, and verl loads its generators by path.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INSTANTS = ("rollout", "saved", "validation", "committed", "refill")
AGENT_LOOP = "dynstate_sessions"  # spec["policy"] = "dapo": the stand-in agent loop's name
STANDIN_MODE = "dynstate_cpu_standins"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = ["<unk>", "<pad>", "<eos>", "What", "is", "+", "?", "<|user|>", "<|assistant|>", "####"]
WORDS += [str(i) for i in range(3000)] + ["and", "The", "answer"]


# -- files: tokenizer/model folder and data ----------------------------------------------------


def make_model_dir(folder: str) -> str:
    """A word-level tokenizer and a tiny model config, saved like a HF model folder (no
    weights: nothing loads a model)."""
    import verl_common

    return verl_common.make_model_dir(folder, WORDS, CHAT_TEMPLATE, "WhitespaceSplit")


def make_task(a: int, b: int, index: int, split: str = "train") -> dict[str, Any]:
    """A row as verl's GSM8K preprocessing writes it, scored by verl's default reward."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"What is {a} + {b} ?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index},
    }


def write_data(folder: str, n_train: int, n_val: int) -> tuple[str, str]:
    import verl_common

    return verl_common.write_data(folder, n_train, n_val, make_task)


def standin_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any
) -> dict[str, float]:
    """A custom reward function (``reward.custom_reward_function``) with a
    ``reward_extra_info`` key: ``acc`` is 1.0 for the right answer after ``####``."""
    answer = solution_str.split("####")[-1].split()[0] if "####" in solution_str else ""
    acc = 1.0 if answer.strip() == str(ground_truth).strip() else 0.0
    return {"score": acc, "acc": acc}


# -- generators --------------------------------------------------------------------------------

INPUT_COLUMNS = ("raw_prompt", "dynstate_row", "data_source", "reward_model", "extra_info")


def _generator_classes() -> tuple[type, type]:
    from dynstate.verl import AbstractDataGenerator, DynstateGenerator

    class FailedVariations(DynstateGenerator):
        """New tasks from the prompts the policy failed; needs the step's inputs and scores."""

        name = "failed-variations"

        def generate(self, batch: Any, step: int, dataset: Any) -> list[dict[str, Any]]:
            missing = [k for k in INPUT_COLUMNS if k not in batch.non_tensor_batch]
            missing += [k for k in ("responses", "token_level_scores") if k not in batch.batch]
            if missing:
                raise KeyError(f"the scored batch lacks {missing}")
            scores = batch.batch["token_level_scores"].sum(dim=-1).tolist()
            out: list[dict[str, Any]] = []
            seen: set[int] = set()
            for score, messages, row, truth in zip(
                scores,
                batch.non_tensor_batch["raw_prompt"],
                batch.non_tensor_batch["dynstate_row"],
                batch.non_tensor_batch["reward_model"],
                strict=True,
            ):
                if score >= 0.5 or int(row) in seen or len(out) >= 3:
                    continue
                seen.add(int(row))
                words = messages[-1]["content"].split()
                a, b = int(words[2]), int(words[4])
                assert int(truth["ground_truth"]) == a + b
                task = make_task(a + step, b + 1, index=100_000 * step + len(out))
                task["_dynstate_source"] = [int(row)]
                out.append(task)
            return out

    class OldInterface(AbstractDataGenerator):
        """verl's old interface: sees only the dataset."""

        def generate(self, dataset: Any) -> Any:
            import datasets

            n = len(dataset.dataframe)
            return datasets.Dataset.from_list([make_task(n, 7, index=n)])

    return FailedVariations, OldInterface


def _session_agent_loop() -> type:
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    class SessionAgentLoop(SingleTurnAgentLoop):
        """verl's single-turn agent loop that tells the stand-in LLM which of the prompt's
        ``rollout.n`` sessions asks (a real LLM samples; the stand-in answers by session)."""

        async def run(self, sampling_params: dict, **kwargs: Any) -> Any:
            params = {**sampling_params, "standin_session": int(kwargs.get("session_id", 0))}
            return await super().run(params, **kwargs)

    return SessionAgentLoop


def __getattr__(name: str) -> Any:
    # generators are loaded by verl's load_extern_object from this file, lazily; the agent loop
    # by hydra's instantiate in verl's agent-loop worker
    if name == "SessionAgentLoop":
        return _session_agent_loop()
    if name in ("FailedVariations", "OldInterface"):
        failed, old = _generator_classes()
        return {"FailedVariations": failed, "OldInterface": old}[name]
    raise AttributeError(name)


# -- config ------------------------------------------------------------------------------------


def compose_config(spec: dict) -> Any:
    """verl's own ``ppo_trainer`` config, composed by Hydra, with the run's overrides."""
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    batch = spec.get("batch_size", 4)
    separate = spec.get("async") == "separate"
    overrides = [
        f"trainer.v1.trainer_mode={spec.get('trainer_mode', STANDIN_MODE)}",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.logger=[console]",
        "trainer.project_name=dynstate",
        "trainer.experiment_name=v1-cpu",
        f"trainer.default_local_dir={spec['ckpt']}",
        f"trainer.save_freq={spec.get('save_freq', 2)}",
        f"trainer.test_freq={spec.get('test_freq', 3)}",
        f"trainer.total_training_steps={spec.get('steps', 6)}",
        "trainer.total_epochs=1000",
        f"trainer.resume_mode={spec.get('resume_mode', 'auto')}",
        "trainer.val_before_train=false",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"actor_rollout_ref.model.path={spec['model']}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        # separate_async: two mini-batches per step, one parameter sync (Decoupled PPO)
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch // 2 if separate else batch}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.prompt_length=32",
        "actor_rollout_ref.rollout.response_length=8",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        f"data.train_files={spec['train']}",
        f"data.val_files={spec['val']}",
        f"data.train_batch_size={batch}",
        f"data.val_batch_size={spec.get('val_batch_size', 4)}",
        "data.max_prompt_length=24",
        "data.max_response_length=8",
        "data.filter_overlong_prompts=true",
        "data.filter_overlong_prompts_workers=1",
        "data.shuffle=true",
        "data.seed=7",
        f"data.dataloader_num_workers={spec.get('num_workers', 0)}",
        "data.custom_cls.path=pkg://dynstate.verl",
        "data.custom_cls.name=DynstateRLDataset",
    ]
    if separate:
        # verl's separate_async checks: train_batch_size = parameter_sync_step * mini-batch,
        # standalone rollout GPUs, a weight-sync backend other than naive (the stand-ins sync
        # nothing)
        overrides += [
            "trainer.v1.separate_async.parameter_sync_step=2",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
            "actor_rollout_ref.hybrid_engine=false",
        ]
    if spec.get("policy") in ("dapo", "dapo_fail"):
        path = os.path.join(os.path.dirname(spec["ckpt"]), "standin_agent_loops.yaml")
        with open(path, "w") as f:
            f.write(f"- name: {AGENT_LOOP}\n  _target_: verl_v1_standins.SessionAgentLoop\n")
        overrides += [
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}",
            f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_LOOP}",
        ]
    overrides += spec.get("overrides", [])
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    datagen = spec.get("datagen", {"path": os.path.abspath(__file__), "name": "FailedVariations"})
    with open_dict(config):
        config.data.dynstate = OmegaConf.create(
            {"url": spec["store"], "storage_options": spec.get("storage_options", {})}
        )
        config.data.dynstate.update(spec.get("dynstate", {}))
        config.data.datagen = OmegaConf.create(datagen)
    return config


# -- stand-ins ---------------------------------------------------------------------------------


def session_of(sampling_params: dict) -> int:
    return int(sampling_params.get("standin_session", 0))


class StandInLLM:
    """The LLM server's client, as verl's agent loop awaits it (``generate(prompt_ids=...)``).
    Pickled into the agent-loop worker actor."""

    def __init__(self, model_dir: str, policy: str = "plain"):
        self.model_dir = model_dir
        self.policy = policy
        self._tok = None

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
            if self.policy == "dapo_fail" and (a + b) % 7 == 0 and session_of(sampling_params):
                # a rollout session that fails (never session 0, the only one validation runs):
                # verl's agent loop tags the group `failure`, the async buffer evicts it
                raise RuntimeError(f"stand-in rollout failure for {a} + {b}")
            if self.policy in ("dapo", "dapo_fail"):
                # by a + b mod 3: every response wrong, every one right, or only session 0
                # right (the one group of three whose rewards differ)
                session = session_of(sampling_params)
                right = {0: False, 1: True}.get((a + b) % 3, session == 0)
                answer = str(a + b) if right else str(a + b + 1)
        ids = self._tok.convert_tokens_to_ids(["The", "answer", "is", "####", answer, "<eos>"])
        return TokenOutput(
            token_ids=ids,
            log_probs=[-0.5] * len(ids),
            stop_reason="completed",
            extra_fields={"min_global_steps": 0, "max_global_steps": 0},
        )


class StandInActorGroup:
    """The actor/rollout worker group: no model, data through TransferQueue as verl's
    workers do; checkpoints are small files."""

    def __init__(self) -> None:
        self._dispatch_info: dict[str, list[int]] = {}

    def _query_dispatch_info(self, role: str) -> list[int]:
        return [0]  # one data-parallel rank

    def compute_log_prob(self, batch: Any) -> Any:
        import torch
        import transfer_queue as tq
        from tensordict import TensorDict

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id)
        seqs = data["input_ids"]
        zeros = [torch.zeros(int(n)) for n in seqs.offsets().diff().tolist()]
        fields = TensorDict(
            {
                "log_probs": torch.nested.as_nested_tensor(zeros, layout=torch.jagged),
                "entropy": torch.nested.as_nested_tensor(zeros, layout=torch.jagged),
            },
            batch_size=len(batch),
        )
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
        return batch

    def update_actor(self, batch: Any) -> dict:
        import transfer_queue as tq

        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["advantages"]
        )
        assert "advantages" in data, "update_actor got a batch without advantages"
        return {"metrics": {"mfu": 0.0, "pg_loss": 0.0}}

    # separate_async keeps pi_old on the CPU for Decoupled PPO (one slot per mini-batch)
    def save_model_to_cpu(self, slot: int) -> None:
        pass

    def restore_model_from_cpu(self, slot: int) -> None:
        pass

    def clear_cpu_model(self, slot: int) -> None:
        pass

    def save_checkpoint(self, local_path: str, remote_path: Any, step: int, **_: Any) -> None:
        os.makedirs(local_path, exist_ok=True)
        with open(os.path.join(local_path, "weights.txt"), "w") as f:
            f.write(str(step))

    def load_checkpoint(self, local_path: str, **_: Any) -> None:
        with open(os.path.join(local_path, "weights.txt")) as f:
            step = int(local_path.rstrip("/").split("global_step_")[-1].split("/")[0])
            assert int(f.read()) == step


class StandInCheckpointEngine:
    def update_weights(self, step: int | None = None) -> dict:
        return {}

    def sleep_replicas(self) -> None:
        pass

    # colocate_async: abort unfinished requests at the end of sampling, resume after the step
    def abort_replicas(self, reject_request: bool = False) -> None:
        pass

    def resume_generation_replicas(self) -> None:
        pass


class StandInLLMServers:
    def __init__(self, client: StandInLLM):
        self.client = client

    def get_client(self, **_: Any) -> StandInLLM:
        return self.client

    def get_replicas(self) -> list:
        return []


class StandInResourcePools:
    def get_n_gpus(self) -> int:
        return 1


def _die(spec_kill: tuple | None, step: int, instant: str) -> None:
    if spec_kill == (step, instant):
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def _traced_files(path: str) -> Iterator[None]:
    """Appends to ``path`` a JSON line per fsync (the file or folder it names), rename and
    file opened for writing inside the block: the order a checkpoint's files become durable."""
    real_fsync, real_replace, real_open = os.fsync, os.replace, builtins.open
    events: list[list[str]] = []

    def fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(["fsync", os.readlink(f"/proc/self/fd/{fd}")])

    def replace(src: Any, dst: Any, **kw: Any) -> None:
        real_replace(src, dst, **kw)
        events.append(["replace", os.path.abspath(str(dst))])

    def open_(file: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
            events.append(["open", os.path.abspath(str(file))])
        return real_open(file, mode, *args, **kw)

    os.fsync, os.replace, builtins.open = fsync, replace, open_
    try:
        yield
    finally:
        os.fsync, os.replace, builtins.open = real_fsync, real_replace, real_open
        with real_open(path, "a") as f:
            f.write(json.dumps(events) + "\n")


def register_standin_trainer(spec: dict) -> type:
    """dynstate's V1 trainer with only ``_setup``'s GPU part replaced by stand-ins, plus the
    kill instants and the batch log (wrappers that call the real methods)."""
    from verl.experimental.reward_loop import RewardLoopManager
    from verl.trainer.ppo.v1 import register_trainer
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from dynstate.verl.v1 import DynstatePPOTrainer
    from dynstate.verl.v1_async import DynstateColocateAsync, DynstateSeparateAsync

    if STANDIN_MODE in TRAINER_REGISTRY:
        return TRAINER_REGISTRY[STANDIN_MODE]
    kill = tuple(spec["kill"]) if spec.get("kill") else None
    log_path = spec.get("log")
    bases = {"colocate": DynstateColocateAsync, "separate": DynstateSeparateAsync}
    base: type = bases[spec["async"]] if spec.get("async") else DynstatePPOTrainer

    class CPUTrainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            # verl polls the queue every 2 s; a stand-in rollout answers at once
            self.replay_buffer.poll_interval = 0.05

        def _setup(self) -> None:
            # verl's _setup up to the worker groups, then stand-ins for what needs GPUs
            self._init_tokenizer()
            self._init_dataloader()
            self._init_dump_executor()
            self.resource_pool_manager = StandInResourcePools()
            self.ref_in_actor = False
            self.actor_rollout_wg = StandInActorGroup()
            self.reward_loop_manager = RewardLoopManager(config=self.config, rm_resource_pool=None)
            self.teacher_model_manager = None
            self.distillation_config = None
            self.llm_server_manager = StandInLLMServers(
                StandInLLM(self.config.actor_rollout_ref.model.path, spec.get("policy", "plain"))
            )
            self.checkpoint_manager = StandInCheckpointEngine()
            if spec.get("async") == "separate":
                # separate_async's own _setup part: standalone rollout replicas (here the same
                # stand-in client, never paused) with their own weight sync; no replicas on the
                # training GPUs (actor_rollout_ref.hybrid_engine=false)
                from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode

                self.standalone_server_manager = self.llm_server_manager
                self.standalone_checkpoint_manager = StandInCheckpointEngine()
                self.current_mode = HybridEngineMode.TRAINER
            self.checkpoint_manager.sleep_replicas()
            self._load_checkpoint()

        def on_sample_begin(self) -> None:
            _die(kill, self.global_steps, "rollout")  # this step's prompts are in flight
            super().on_sample_begin()

        def step(self, metrics: dict, timing_raw: dict) -> Any:
            batch = super().step(metrics, timing_raw)
            if log_path and self._scored is not None:
                scored = self._scored[1]
                entry = {
                    "step": self.global_steps,
                    "rows": [int(r) for r in scored.non_tensor_batch["dynstate_row"]],
                    "prompts": [m[-1]["content"] for m in scored.non_tensor_batch["raw_prompt"]],
                    "scores": scored.batch["token_level_scores"].sum(-1).tolist(),
                    "version": self.train_dataloader.sampler.version,
                }
                filtered = getattr(self, "_step_batch", None)
                if filtered is not None:
                    # what group filtering consumed (version numbers left out: resets renumber)
                    entry["consumption"] = {
                        k: v
                        for k, v in filtered.record.items()
                        if k not in ("rows_version", "sampler")
                    }
                with open(log_path, "a") as f:
                    f.write(json.dumps(entry) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            return batch

        def _score_gen_batch(self, items: list, step: int) -> Any:
            calls = self._gen_calls = getattr(self, "_gen_calls", {})
            calls[step] = calls.get(step, 0) + 1
            if calls[step] == 2:
                _die(kill, step, "refill")  # the first generation batch scored, the second drawn
            return super()._score_gen_batch(items, step)

        def commit_step_round(self) -> int | None:
            pending = self._scored is not None
            version = super().commit_step_round()
            if pending and version is not None:
                _die(kill, self.global_steps, "committed")
            return version

        def _save_checkpoint(self) -> Any:
            if spec.get("trace"):
                with _traced_files(spec["trace"]):
                    result = super()._save_checkpoint()
            else:
                result = super()._save_checkpoint()
            _die(kill, self.global_steps, "saved")
            return result

        def _maybe_log_val_generations(self, inputs: Any, outputs: Any, scores: Any) -> None:
            _die(kill, self.global_steps, "validation")  # inside _validate, after its rollouts
            super()._maybe_log_val_generations(inputs, outputs, scores)

    register_trainer(STANDIN_MODE)(CPUTrainer)
    return CPUTrainer


# -- what a test compares ---------------------------------------------------------------------


def read_log(path: str) -> dict[int, dict]:
    """The batch each step trained, the last one logged for a step (a killed run's steps
    that were trained again after the resume are superseded)."""
    out: dict[int, dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    entry = json.loads(line)
                    entry.pop("version", None)  # resets renumber versions, not content
                    out[entry["step"]] = entry
    return out


def plain_rows(url: str, version: int) -> Any:
    """Version ``version`` the plain way: its shards read whole with pyarrow, concatenated."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import dynstate

    snap = dynstate.Store.open(url).snapshot(version)
    assert snap.schema is not None
    parts = [pq.read_table(os.path.join(url, s.path)) for s in snap.shards]
    table = pa.concat_tables(parts, promote_options="default").select(snap.schema.names)
    assert table.num_rows == snap.num_rows
    return table


def audit_exactly_once(url: str, log: dict[int, dict], steps: int) -> list[dict]:
    """The head's lineage holds one format-2 consumption record per step, chained (a step's
    carried_in is the step before's in_flight), and over the run every row drawn is trained,
    filtered, dropped or still in flight, exactly once; each epoch's draws are a permutation of
    its pinned version's rows (the last one a prefix without repeats); every trained prompt is
    its row's, read the plain way; the outcomes are every scored group's (audit_outcomes)."""
    from collections import Counter

    import pyarrow as pa

    import dynstate
    from dynstate.loading.consumption import consumption_records

    records = consumption_records(dynstate.Store.open(url))
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    carried: list[int] = []
    for r in records:
        assert r["format"] == 2 and r["carry"] == []
        assert Counter(r["carried_in"]) == Counter(carried), f"step {r['step']} lost its carry"
        carried = r["in_flight"]
    drawn = [i for r in records for i in r["drawn"]]
    gone = [i for r in records for i in r["trained"]]
    gone += [i for r in records for i, _ in r["filtered"]]
    gone += [i for r in records for i, _ in r["dropped"]]
    assert Counter(drawn) == Counter(gone) + Counter(records[-1]["in_flight"])
    assert {reason for r in records for _, reason in r["dropped"]} <= {"stale", "failed"}
    assert any(r["filtered"] for r in records) and all(len(r["trained"]) == 4 for r in records)
    # epochs: each record's sampler state names the epoch under way and the version it pinned
    pinned: dict[int, int] = {}
    for r in records:
        pinned.setdefault(int(r["sampler"]["epoch"]), int(r["sampler"]["version"]))
    assert sorted(pinned) == list(range(len(pinned))) and len(pinned) >= 2
    start = 0
    for epoch in sorted(pinned):
        n = dynstate.Store.open(url).snapshot(pinned[epoch]).num_rows
        part = drawn[start : start + n]
        if epoch < max(pinned):
            assert sorted(part) == list(range(n)), f"epoch {epoch} drew {part}"
        else:
            assert len(set(part)) == len(part) and max(part) < n
        start += n
    # the rows trained are the rows asked for, and each step's log is its record's
    table = plain_rows(url, dynstate.Store.open(url).head)
    for r in records:
        entry = log[r["step"]]
        assert entry["rows"][::2] == r["trained"]  # two responses per prompt, in group order
        want = table.take(pa.array(entry["rows"])).column("prompt").to_pylist()
        assert [m[-1]["content"] for m in want] == entry["prompts"]
    audit_outcomes(url, records, log)
    return records


def dapo_reward(prompt: str, session: int) -> float:
    """The reward of the stand-in's ``dapo`` policy's answer in rollout session ``session`` to
    ``prompt`` (``What is a + b ?``), worked out from the prompt alone: by ``a + b`` mod 3 every
    session wrong, every one right, or only session 0 right; right scores 1.0 (verl's GSM8K
    reward and ``standin_score``'s ``acc`` alike), wrong 0.0."""
    words = prompt.split()
    a, b = int(words[2]), int(words[4])
    right = {0: False, 1: True}.get((a + b) % 3, session == 0)
    return 1.0 if right else 0.0


def audit_outcomes(url: str, records: list[dict], log: dict[int, dict]) -> None:
    """Every step's outcome records are the responses of every group it scored, each group
    once, at the step that scored it: with dynstate's group filtering (format 1) the rows it
    drew (trained, filtered, dropped or carried; a carried-in group was credited at the step
    before); in an async mode (format 2) the rows it trained, filtered or dropped as stale
    (a failed group's sessions were not all scored). The scores are worked out from the rows'
    prompts, read the plain way (:func:`dapo_reward`, itself held to the logged trained
    batches), not taken from the store."""
    from collections import Counter

    import dynstate

    store = dynstate.Store.open(url)
    prompts = [m[-1]["content"] for m in plain_rows(url, store.head).column("prompt").to_pylist()]

    def expected(rows: list[int]) -> Counter:
        return Counter((r, dapo_reward(prompts[r], s)) for r in rows for s in (0, 1))

    got_by_step: dict[int, Counter] = {}
    for rec in store.outcome_records().to_pylist():
        assert rec["response_length"] > 0, rec
        got_by_step.setdefault(rec["step"], Counter())[(rec["row"], rec["score"])] += 1
    for r in records:
        step = r["step"]
        entry = log[step]
        # the oracle holds for the batches verl trained and logged
        trained = Counter(zip(entry["rows"], entry["scores"], strict=True))
        assert trained == expected(entry["rows"][::2]), f"step {step}: oracle disagrees"
        if r["format"] == 2:
            credited = r["trained"] + [row for row, _ in r["filtered"]]
            credited += [row for row, why in r["dropped"] if why == "stale"]
        else:
            credited = list(r["drawn"])
        want = expected(credited)
        assert got_by_step.get(step, Counter()) == want, (
            f"step {step}: outcomes {sorted(got_by_step.get(step, Counter()).items())} "
            f"!= {sorted(want.items())}"
        )
    assert set(got_by_step) <= {r["step"] for r in records}, sorted(got_by_step)


def store_summary(url: str, storage_options: dict | None = None) -> dict:
    """The head's rows and the rounds on its lineage (step, rows, generator), oldest first."""
    from dynstate.rewind import lineage
    from dynstate.store import Store

    store = Store.open(url, storage_options=storage_options or {})
    rounds = []
    for v in reversed(lineage(store)):
        meta = store.commit_record(v).meta
        if "step" in meta and "rollback_from" not in meta:
            rounds.append((meta["step"], meta.get("rows"), meta.get("generator")))
    return {"rows": store.snapshot().to_arrow().to_pylist(), "rounds": rounds}


# -- running drivers ---------------------------------------------------------------------------


def end_leftovers(proc: Any, pids_file: str | None) -> None:
    """A SIGKILLed driver leaves its Ray cluster (GCS, raylet, workers) behind: end the
    processes it recorded, then its own session's process group, by id."""
    pids: list[int] = []
    if pids_file and os.path.exists(pids_file):
        with open(pids_file) as f:
            pids = [p for p in json.load(f) if p != proc.pid]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # started with start_new_session: its own group
    except (ProcessLookupError, PermissionError):
        pass


def run_driver(spec: dict, kill: tuple[int, str] | None = None, timeout: float = 900) -> int:
    """One driver process (``python verl_v1_standins.py spec``); returns its exit status,
    ``-SIGKILL`` when it killed itself at ``kill``. Raises with the driver's output on any
    other ending."""
    code, out = _driver(spec, kill, timeout)
    expected = -signal.SIGKILL if kill else 0
    if code != expected:
        raise AssertionError(f"driver (kill={kill}) exited with {code}:\n{out[-6000:]}")
    return code


def run_failing_driver(spec: dict, timeout: float = 900) -> str:
    """A driver that must fail (exit 1, not killed); returns its output."""
    code, out = _driver(spec, None, timeout)
    if code != 1:
        raise AssertionError(f"driver exited with {code}, expected a failure:\n{out[-6000:]}")
    return out


def _driver(spec: dict, kill: tuple[int, str] | None, timeout: float) -> tuple[int, str]:
    import subprocess

    spec = {**spec, "kill": list(kill) if kill else None}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), json.dumps(spec)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        end_leftovers(proc, spec.get("pids"))
    text = out.decode(errors="replace") if out else ""
    if spec.get("output"):  # kept for the caller, e.g. to read verl's console tracker
        with open(spec["output"], "a") as f:
            f.write(text)
    return proc.returncode, text


# -- the driver --------------------------------------------------------------------------------


def _record_ray_pids(path: str) -> None:
    import ray

    node = ray._private.worker._global_node
    pids = [os.getpid()]
    for infos in node.all_processes.values():
        pids += [info.process.pid for info in infos]
    with open(path, "w") as f:
        json.dump(pids, f)
        f.flush()
        os.fsync(f.fileno())


def run(spec: dict) -> None:
    """One driver: a local Ray cluster, then verl's ``TaskRunnerV1.run`` in this process."""
    import logging

    import ray

    logging.basicConfig(level=logging.INFO)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (HERE, ROOT, os.environ.get("PYTHONPATH")) if p
    )
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=bool(spec.get("ray_logs", False)),
        runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}},
    )
    if spec.get("pids"):
        _record_ray_pids(spec["pids"])
    try:
        from verl.trainer.main_ppo import TaskRunnerV1

        register_standin_trainer(spec)
        config = compose_config(spec)
        TaskRunnerV1.__ray_metadata__.modified_class().run(config)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.path[:0] = [HERE, ROOT]
    run(json.loads(sys.argv[1]))
