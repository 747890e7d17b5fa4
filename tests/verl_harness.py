"""Subprocess harness for tests/test_verl.py: verl's data path of ``RayPPOTrainer.fit``, step
by step, with verl's real dataset factory, collate_fn, DataProto, StatefulDataLoader and
checkpoint files, and no GPU, Ray actors or model.

Importing verl takes tens of seconds on a small machine, so the test starts this file once as
a *zygote* (``python verl_harness.py serve``): it imports everything, then forks a fresh child
per request (a JSON line on stdin) and answers with the child's exit status. Children never
share run state: each one is a new process that reads only the store and checkpoint folder.
A child kills itself with SIGKILL at ``kill: [step, phase]``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
import uuid

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import verl
from omegaconf import OmegaConf
from torchdata.stateful_dataloader import StatefulDataLoader
from verl import DataProto
from verl.trainer.ppo.utils import create_rl_dataset
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl.utils.dataset.rl_dataset import collate_fn

import dynstate
from dynstate.verl import DynstateRLDataset
from dynstate.verl.trainer import checkpoint_dir

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PHASES = ("fetched", "saved", "committed")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer():
    """A word-level tokenizer built here (no download), wrapped as HF fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "What", "is", "+", "?", "<|user|>", "<|assistant|>", "pad"]
    words += [str(i) for i in range(2000)] + ["and", "also", "then", "more"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def write_data(folder: str, n_train: int, n_val: int) -> tuple[str, str]:
    """Arithmetic tasks as verl's preprocessing writes them; a few are overlong."""
    import pandas as pd

    sys.path.insert(0, os.path.join(ROOT, "examples", "verl"))
    from arith_generator import make_task

    rng = np.random.default_rng(0)
    rows = []
    for i in range(n_train):
        a, b = (int(x) for x in rng.integers(1, 60, size=2))
        task = make_task(a, b, index=i)
        if i % 7 == 3:  # overlong: filtered out by verl's filter on import
            task["prompt"][0]["content"] += " and" * 40
        rows.append(task)
    val = [make_task(i, i + 1, index=i, split="test") for i in range(n_val)]
    train_path, val_path = (
        os.path.join(folder, "train.parquet"),
        os.path.join(folder, "val.parquet"),
    )
    pd.DataFrame(rows).to_parquet(train_path)
    pd.DataFrame(val).to_parquet(val_path)
    return train_path, val_path


def make_config(spec: dict) -> OmegaConf:
    """verl's own data config (legacy_data.yaml) with the test's overrides."""
    base = OmegaConf.load(
        os.path.join(os.path.dirname(verl.__file__), "trainer/config/data/legacy_data.yaml")
    )
    data = OmegaConf.merge(
        base,
        {
            "train_files": spec["train"],
            "val_files": spec["val"],
            "max_prompt_length": spec.get("max_prompt_length", 24),
            "filter_overlong_prompts": True,
            "filter_overlong_prompts_workers": 1,
            "train_batch_size": spec.get("batch_size", 4),
            "shuffle": True,
            "seed": 7,
            "dataloader_num_workers": spec.get("num_workers", 0),
            "custom_cls": {"path": "pkg://dynstate.verl", "name": "DynstateRLDataset"},
            "dynstate": {"url": spec["store"], **spec.get("dynstate", {})},
            "datagen": spec.get(
                "datagen",
                {
                    "path": os.path.join(ROOT, "examples/verl/arith_generator.py"),
                    "name": "ArithVariations",
                    "variations": 1,
                    "max_new": 2,
                },
            ),
        },
    )
    trainer = {
        "default_local_dir": spec["ckpt"],
        "resume_mode": "auto",
        "save_freq": spec.get("save_freq", 2),
        "total_training_steps": spec.get("steps", 9),
        "total_epochs": 1000,  # the run ends at total_training_steps (see docs/verl.md)
    }
    return OmegaConf.create({"data": data, "trainer": trainer})


def fake_scores(batch: DataProto) -> torch.Tensor:
    """The 'policy' fails every task whose answer is divisible by 3."""
    truths = [int(rm["ground_truth"]) for rm in batch.non_tensor_batch["reward_model"]]
    return torch.tensor([[0.0 if t % 3 == 0 else 1.0] for t in truths])


def run(spec: dict) -> None:
    kill = tuple(spec["kill"]) if spec.get("kill") else None

    def maybe_die(step: int, phase: str) -> None:
        if kill == (step, phase):
            os.kill(os.getpid(), signal.SIGKILL)

    config = make_config(spec)
    tokenizer = make_tokenizer()
    log = open(spec["log"], "a")  # noqa: SIM115 - kept open for the whole run; fsynced per line

    def record(entry: dict) -> None:
        log.write(json.dumps(entry) + "\n")
        log.flush()
        os.fsync(log.fileno())

    # RayPPOTrainer._create_dataloader, with DynstateTrainerMixin's train_sampler.
    data = config.data
    train = create_rl_dataset(
        data.train_files, data, tokenizer, None, max_samples=data.get("train_max_samples", -1)
    )
    val = create_rl_dataset(
        data.val_files, data, tokenizer, None, max_samples=data.get("val_max_samples", -1)
    )
    assert isinstance(train, DynstateRLDataset) and not train.fixed and val.fixed
    loader = StatefulDataLoader(
        dataset=train,
        batch_size=data.get("gen_batch_size", None) or data.train_batch_size,
        num_workers=data["dataloader_num_workers"],
        drop_last=True,
        collate_fn=collate_fn,
        sampler=train.make_sampler(),
    )
    # RayPPOTrainer._load_checkpoint (resume_mode auto), data part, then the mixin's resume.
    global_steps, skipped = 0, False
    folder = find_latest_ckpt_path(config.trainer.default_local_dir)
    if folder is not None:
        global_steps = int(folder.split("global_step_")[-1])
        path = os.path.join(folder, "data.pt")
        steps_per_epoch = len(loader)
        skipped = steps_per_epoch > 0 and global_steps % steps_per_epoch == 0
        if os.path.exists(path) and not skipped:
            loader.load_state_dict(torch.load(path, weights_only=False))
    train.resume(checkpoint_dir(config.trainer, global_steps), loader, global_steps)
    record({"event": "start", "resumed_from": global_steps, "verl_skipped_restore": skipped})

    # RayPPOTrainer.fit, data path only.
    current_epoch = global_steps // len(loader)
    global_steps += 1
    total = config.trainer.total_training_steps
    for _epoch in range(current_epoch, config.trainer.total_epochs):
        first = True
        for batch_dict in loader:
            batch = DataProto.from_single_dict(batch_dict)
            batch.non_tensor_batch["uid"] = np.array(
                [str(uuid.uuid4()) for _ in range(len(batch.batch))], dtype=object
            )
            record(
                {
                    "event": "batch",
                    "step": global_steps,
                    "new_pass": first,
                    "rows": [int(r) for r in batch.non_tensor_batch["dynstate_row"]],
                    "index": [int(i) for i in batch.non_tensor_batch["index"]],
                    "prompts": [m[-1]["content"] for m in batch.non_tensor_batch["raw_prompt"]],
                }
            )
            first = False
            maybe_die(global_steps, "fetched")
            batch.batch["token_level_scores"] = fake_scores(batch)
            is_last_step = global_steps >= total
            if config.trainer.save_freq > 0 and (
                is_last_step or global_steps % config.trainer.save_freq == 0
            ):
                save_checkpoint(config, loader, global_steps)
                maybe_die(global_steps, "saved")
            global_steps += 1
            if is_last_step:
                record({"event": "done"})
                return
            train.on_batch_end(batch=batch)
            maybe_die(global_steps - 1, "committed")


def save_checkpoint(config, loader, global_steps: int) -> None:
    """RayPPOTrainer._save_checkpoint, dataloader part."""
    folder = os.path.join(config.trainer.default_local_dir, f"global_step_{global_steps}")
    os.makedirs(folder, exist_ok=True)
    torch.save(loader.state_dict(), os.path.join(folder, "data.pt"))
    with open(
        os.path.join(config.trainer.default_local_dir, "latest_checkpointed_iteration.txt"), "w"
    ) as f:
        f.write(str(global_steps))


def data_files(spec: dict) -> None:
    write_data(spec["folder"], spec.get("n_train", 16), spec.get("n_val", 4))


def items(spec: dict) -> None:
    """Items of DynstateRLDataset vs verl's RLHFDataset on the same files and config."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    config = make_config(spec)
    tokenizer = make_tokenizer()
    ours = create_rl_dataset(config.data.train_files, config.data, tokenizer, None)
    theirs = RLHFDataset(config.data.train_files, tokenizer, config.data, None)
    same, problems = 0, []
    for i in range(len(theirs)):
        a, b = dict(ours[i]), dict(theirs[i])
        if a.pop("dynstate_row") != i:
            problems.append(f"row {i}: wrong dynstate_row")
        ta, tb = a.pop("dummy_tensor"), b.pop("dummy_tensor")
        if not torch.equal(ta, tb) or ta.dtype != tb.dtype:
            problems.append(f"row {i}: dummy_tensor differs")
        if a != b:
            problems.append(f"row {i}: {a!r} != {b!r}")
        same += 1
    with open(spec["result"], "w") as f:
        json.dump(
            {"ours": len(ours), "theirs": len(theirs), "compared": same, "problems": problems}, f
        )


def mismatch(spec: dict) -> None:
    """Resume a store with a data.pt written for another store: must be refused, store kept."""
    config = make_config(spec)
    data = config.data
    train = create_rl_dataset(data.train_files, data, make_tokenizer(), None)
    loader = StatefulDataLoader(
        dataset=train,
        batch_size=4,
        drop_last=True,
        collate_fn=collate_fn,
        sampler=train.make_sampler(),
    )
    head = train.store.refresh()
    try:
        train.resume(spec["foreign"], loader, 3)
    except dynstate.StateMismatchError as exc:
        result = {
            "error": type(exc).__name__,
            "message": str(exc),
            "head_before": head,
            "head_after": train.store.refresh(),
        }
    else:
        result = {"error": None}
    with open(spec["result"], "w") as f:
        json.dump(result, f)


def child(spec: dict) -> int:
    out = os.open(spec["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    try:
        {"run": run, "mismatch": mismatch, "data": data_files, "items": items}[spec["cmd"]](spec)
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def serve() -> None:
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
