"""dynstate.trl through TRL's real ``GRPOTrainer.train()`` with the example's tiny model
(issue 43): the README's commands run as written, the run learns, a run killed with SIGKILL
and rerun with the same command trains every step on the rows, and with the rewards, of the
uninterrupted run (the exactness oracle); bad inputs refused at start-up with nothing changed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
# TRL's trainer module imports wandb, whose pydantic Settings class has its docstrings read with
# ast.parse. On CPython 3.11, ast.parse in a process whose other threads run can fail with
# "SystemError: AST constructor recursion depth mismatch" (its recursion counter is shared
# state; python/cpython#106905), which left wandb half-imported for every later test of the
# worker (seen once, in a full run on 3.11.7). Imported here, at collection, in the main
# thread, before any test has started a thread.
import trl.trainer.grpo_trainer  # noqa: F401

import dynstate
from dynstate import (
    CheckpointNotFoundError,
    InvalidDataError,
    StateMismatchError,
    Store,
)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "examples" / "trl" / "README.md"
TRAIN = ROOT / "examples" / "trl" / "train.py"

pytestmark = pytest.mark.filterwarnings(
    # transformers / trl on CPU: not ours to fix
    "ignore::UserWarning",
    "ignore::FutureWarning",
)


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("trl_example_train", TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_commands(block: int = 0) -> list[str]:
    """The commands of the README's ``block``-th bash block (0: the run, its rerun and ls;
    1: the same run with --filter-groups, tests/test_trl_filter.py)."""
    commands = []
    found = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)[block]
    for line in re.sub(r"\\\n\s*", "", found).splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


def _argv(command: str, scratch: Path) -> list[str]:
    argv = shlex.split(command.replace("/tmp/trl", str(scratch)))
    if argv[0] == "python":
        argv[0] = sys.executable
    local = Path(sys.executable).parent / argv[0]
    return [str(local) if local.exists() else argv[0], *argv[1:]]


def _env() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}


def _trace(path: Path) -> dict[int, dict[str, Any]]:
    """Each step's last line (a resumed run appends the steps it trains again)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record
    return by_step


def _mean(record: dict[str, Any]) -> float:
    return sum(record["rewards"]) / len(record["rewards"])


def test_readme_commands_learn_and_resume_exactly_after_sigkill(tmp_path) -> None:
    commands = readme_commands()
    train, again, ls = commands
    assert train == again and "--steps 150" in train and ls.startswith("dynstate ls")

    # the uninterrupted run, as written: the oracle, and the learning check
    clean = tmp_path / "clean"
    started = time.monotonic()
    subprocess.run(_argv(train, clean), check=True, env=_env(), capture_output=True, timeout=600)
    took = time.monotonic() - started
    oracle = _trace(clean / "trace.jsonl")
    assert sorted(oracle) == list(range(1, 151))
    fifth = [_mean(oracle[s]) for s in range(1, 31)], [_mean(oracle[s]) for s in range(121, 151)]
    first, last = (sum(x) / len(x) for x in fifth)
    assert last > first + 0.1, (first, last)
    for record in oracle.values():
        assert len(record["rewards"]) == 8 * len(record["rows"]) == 32
    print(f"uninterrupted: {took:.1f} s, mean reward {first:.3f} -> {last:.3f}")

    # the same command, killed mid-run after a checkpoint, then run again as written
    run = tmp_path / "killed"
    proc = subprocess.Popen(
        _argv(train, run), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    trace = run / "trace.jsonl"
    deadline = time.monotonic() + 300
    while not (trace.exists() and len(trace.read_text().splitlines()) >= 65):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(trace.read_text().splitlines())
    assert killed_at < 150
    store = Store.open(str(run / "store"))
    head_before = store.refresh()
    subprocess.run(_argv(again, run), check=True, env=_env(), capture_output=True, timeout=600)
    resumed = _trace(run / "trace.jsonl")
    assert sorted(resumed) == sorted(oracle)
    assert [s for s in oracle if resumed[s] != oracle[s]] == []
    # the steps after the checkpoint were trained twice, and the rounds the killed run
    # committed after the checkpoint were rolled back (not reused)
    steps = [json.loads(line)["step"] for line in trace.read_text().splitlines()]
    assert len(steps) > 150
    store.refresh()
    assert store.commit_record(store.head).meta.get("step") == 150
    assert any(
        (store.commit_record(v).meta or {}).get("rollback_from") == head_before
        for v in range(head_before + 1, store.head + 1)
    )
    # the final head holds the same rows as the uninterrupted run's
    clean_store = Store.open(str(clean / "store"))
    assert store.snapshot().to_arrow().equals(clean_store.snapshot().to_arrow())

    out = subprocess.run(
        _argv(ls, run), check=True, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert "abandoned" in out.stdout or "reset" in out.stdout, out.stdout


# -- bad input, in process ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def example() -> Any:
    return _example()


def _config(example: Any, out: Path, **over: Any) -> Any:
    from trl import GRPOConfig

    settings: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": 2,
        "per_device_train_batch_size": 16,
        "num_generations": 8,
        "max_completion_length": 2,
        "learning_rate": 1e-3,
        "beta": 0.0,
        "save_strategy": "steps",
        "save_steps": 2,
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,
        "disable_tqdm": True,
        "logging_steps": 1,
    }
    settings.update(over)
    return GRPOConfig(**settings)


def _trainer(example: Any, store: Any, out: Path, **over: Any) -> Any:
    from transformers import set_seed

    from dynstate.trl import DynstateGRPOTrainer

    set_seed(0)  # the same initial weights in every run of a test
    tokenizer = example.build_tokenizer()
    select = over.pop("select", None)
    return DynstateGRPOTrainer(
        model=example.build_model(tokenizer),
        reward_funcs=[example.reward],
        args=_config(example, out, **over.pop("config", {})),
        processing_class=tokenizer,
        train_dataset=store,
        select=select,
        **over,
    )


def _new_store(example: Any, path: Path) -> Store:
    store = Store.open(str(path), create=True)
    store.append(example.first_tasks(0, count=16))
    return store


@pytest.fixture(scope="module")
def trained(example, tmp_path_factory) -> tuple[Store, Path]:
    """A store and the checkpoint-2 of a 2-step run over it."""
    base = tmp_path_factory.mktemp("trl")
    store = _new_store(example, base / "store")
    trainer = _trainer(example, dynstate.VersionedDataset(store), base / "out")
    trainer.train()
    checkpoint = base / "out" / "checkpoint-2"
    assert (checkpoint / "dynstate_state.pt").is_file()
    return store, checkpoint


@pytest.mark.parametrize(
    ("config", "setting"),
    [
        # a generation that ends inside an optimizer step, or several in one
        ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, "steps_per_generation=3"),
        ({"steps_per_generation": 1, "gradient_accumulation_steps": 2}, "steps_per_generation=1"),
        # a generation of 2 optimizer steps: checkpoints (and the last step) at its end only
        ({"num_iterations": 2, "max_steps": 3}, "max_steps=3"),
        ({"num_iterations": 2, "save_steps": 1}, "save_steps=1"),
        (
            {"steps_per_generation": 2, "save_strategy": "best", "metric_for_best_model": "loss"},
            "save_strategy='best'",
        ),
        ({"max_steps": -1}, "max_steps=-1"),
    ],
)
def test_settings_it_cannot_make_exact_are_refused_at_start(
    example, tmp_path, config, setting
) -> None:
    store = _new_store(example, tmp_path / "store")
    with pytest.raises(InvalidDataError, match=re.escape(setting)):
        _trainer(example, store, tmp_path / "out", config=config)
    assert store.refresh() == 1


def test_train_dataset_that_is_not_the_store_is_refused(example, tmp_path) -> None:
    import datasets

    rows = datasets.Dataset.from_list(example.first_tasks(0, count=4))
    with pytest.raises(InvalidDataError, match="VersionedDataset"):
        _trainer(example, rows, tmp_path / "out")


def test_checkpoint_without_dynstate_state_is_refused_unchanged(example, trained, tmp_path) -> None:
    import shutil

    store, checkpoint = trained
    copy = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, copy)
    (copy / "dynstate_state.pt").unlink()
    head = store.refresh()
    trainer = _trainer(example, store, tmp_path / "out")
    with pytest.raises(CheckpointNotFoundError, match=r"dynstate_state\.pt"):
        trainer.train(resume_from_checkpoint=str(copy))
    assert store.refresh() == head


def test_a_folder_killed_while_saved_is_refused_naming_the_whole_one(
    example, trained, tmp_path
) -> None:
    """transformers' get_last_checkpoint picks the newest folder, even one a kill left without
    dynstate's state: the refusal names the newest checkpoint saved whole, and changes nothing."""
    import shutil

    from transformers.trainer_utils import get_last_checkpoint

    from dynstate.trl import last_checkpoint

    store, checkpoint = trained
    out = tmp_path / "out"
    shutil.copytree(checkpoint, out / "checkpoint-2")
    shutil.copytree(checkpoint, out / "checkpoint-4")
    (out / "checkpoint-4" / "dynstate_state.pt").unlink()
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-4")
    assert last_checkpoint(str(out)) == str(out / "checkpoint-2")
    head = store.refresh()
    trainer = _trainer(example, store, out)
    with pytest.raises(CheckpointNotFoundError) as raised:
        trainer.train(resume_from_checkpoint=get_last_checkpoint(str(out)))
    message = str(raised.value)
    assert "killed while saving" in message
    assert f"resume from {out / 'checkpoint-2'}," in message
    assert "dynstate.trl.last_checkpoint(output_dir)" in message
    assert store.refresh() == head


def test_a_checkpoint_is_durable_before_dynstate_marks_it_whole(
    example, tmp_path, monkeypatch
) -> None:
    """Through TRL's ``train()``: every file and folder of the checkpoint transformers wrote
    is fsynced before ``dynstate_state.pt`` appears under its name (itself fsynced, then its
    folder), and all of it before ``save_total_limit`` deletes the older checkpoint: after a
    power cut, a checkpoint marked whole is whole, and the one deleted is not needed."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        events.append(("replace", str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store = _new_store(example, tmp_path / "store")
    out = tmp_path / "out"
    config = {"max_steps": 4, "save_total_limit": 1}
    trainer = _trainer(example, dynstate.VersionedDataset(store), out, config=config)
    trainer.train()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    checkpoint = out / "checkpoint-4"
    marked = events.index(("replace", str(checkpoint / "dynstate_state.pt")))
    synced = {path for kind, path in events[:marked] if kind == "fsync"}
    files = {str(p) for p in checkpoint.rglob("*") if p.name != "dynstate_state.pt"}
    assert files <= synced, sorted(files - synced)
    assert str(out) in synced  # the checkpoint's own entry in the run's folder
    after = [path for kind, path in events[marked:] if kind == "fsync"]
    assert str(checkpoint) in after  # the rename made durable
    assert not (out / "checkpoint-2").exists()


def test_checkpoint_of_another_store_is_refused_unchanged(example, trained, tmp_path) -> None:
    _, checkpoint = trained
    other = _new_store(example, tmp_path / "other")
    trainer = _trainer(example, other, tmp_path / "out")
    with pytest.raises(StateMismatchError, match="belongs to the store"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert other.refresh() == 1


def test_checkpoint_with_another_selection_is_refused_unchanged(example, trained, tmp_path) -> None:
    store, checkpoint = trained
    head = store.refresh()
    trainer = _trainer(example, store, tmp_path / "out", select=dynstate.Learnability())
    with pytest.raises(StateMismatchError, match="select"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert store.refresh() == head


def test_fresh_run_on_a_store_with_rounds_is_refused(example, trained, tmp_path) -> None:
    store, _ = trained
    head = store.refresh()
    trainer = _trainer(example, store, tmp_path / "out")
    with pytest.raises(StateMismatchError, match="rollback"):
        trainer.train()
    assert store.refresh() == head


def test_rounds_carry_outcomes_per_response(trained) -> None:
    store, _ = trained
    records = store.outcome_records()
    assert sorted(set(records.column("step").to_pylist())) == [1, 2]
    assert records.num_rows == 2 * 16  # two steps, 2 prompts x 8 responses
    assert store.commit_record(store.head).meta["step"] == 2


class _Crash(Exception):
    pass


def _rounds_run(
    example: Any, base: Path, *, crash_after: int | None, resume: bool, ga: int
) -> list[Any]:
    """Rounds of a 4-step run with gradient accumulation ``ga`` (checkpoints every 2 steps), the
    example's generator and selection; ``crash_after``: raise once that step is committed."""
    from transformers import TrainerCallback

    from dynstate.trl import last_checkpoint

    store = Store.open(str(base / "store"), create=True)
    if store.head == 0:
        store.append(example.first_tasks(0, count=16))
    rounds: list[Any] = []

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            rounds.append(trainer.dynstate_round)
            if crash_after is not None and state.global_step == crash_after:
                raise _Crash
            return control

    trainer = _trainer(
        example,
        store,
        base / "out",
        select=dynstate.Learnability(),
        mode="mix",
        generator=example.HardestVariations(seed=0),
        config={
            "max_steps": 4,
            "gradient_accumulation_steps": ga,
            "per_device_train_batch_size": 16 // ga,
        },
    )
    trainer.add_callback(Record())
    try:
        trainer.train(resume_from_checkpoint=last_checkpoint(str(base / "out")) if resume else None)
    except _Crash:
        pass
    return rounds


@pytest.mark.parametrize("ga", [1, 2])
def test_gradient_accumulation_resumes_exactly(example, tmp_path, ga) -> None:
    """gradient_accumulation_steps 1 and 2 (steps_per_generation follows it): each step one
    generation of 2 prompts x 8; a run stopped after the round of step 3 and resumed from
    checkpoint-2 trains steps 3 and 4 as the uninterrupted run did, with step 3's first round
    rolled back."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the example: the same arithmetic in every run
    try:
        _check_gradient_accumulation(example, tmp_path, ga)
    finally:
        torch.set_num_threads(threads)


def _check_gradient_accumulation(example: Any, tmp_path: Path, ga: int) -> None:
    clean = _rounds_run(example, tmp_path / "clean", crash_after=None, resume=False, ga=ga)
    assert [r.step for r in clean] == [1, 2, 3, 4]
    assert all(len(r.rows) == 2 and len(r.rewards) == 16 for r in clean)
    first = _rounds_run(example, tmp_path / "run", crash_after=3, resume=False, ga=ga)
    assert [r.step for r in first] == [1, 2, 3]
    assert [(r.rows, r.rewards) for r in first] == [(r.rows, r.rewards) for r in clean[:3]]
    again = _rounds_run(example, tmp_path / "run", crash_after=None, resume=True, ga=ga)
    assert [r.step for r in again] == [3, 4]
    for mine, theirs in zip(again, clean[2:], strict=True):
        assert (mine.rows, mine.rewards, mine.added) == (theirs.rows, theirs.rewards, theirs.added)
    a = Store.open(str(tmp_path / "clean" / "store")).snapshot().to_arrow()
    b = Store.open(str(tmp_path / "run" / "store")).snapshot().to_arrow()
    assert a.equals(b)
    # each round names the policy in force, so that its story (dynstate show) can
    from dynstate.history.story import step_story

    store = Store.open(str(tmp_path / "run" / "store"))
    story = step_story(store, store.head)
    assert story["step"] == 4
    assert story["policy"] == dynstate.Learnability().identity()
    assert story["outcomes"]["records"] == len(clean[-1].rewards)


def test_one_generator_class_serves_both_trainers():
    """A generator written against dynstate.verl's interface is the same class TRL's
    integration dispatches on (one home: dynstate.generators), so it runs under either."""
    import dynstate.generators as g
    import dynstate.trl as trl_side
    import dynstate.verl as verl_side

    assert verl_side.DynstateGenerator is trl_side.DynstateGenerator is g.DynstateGenerator
    assert verl_side.AbstractDataGenerator is g.AbstractDataGenerator

    class Variations(verl_side.DynstateGenerator):
        def generate(self, batch, step, dataset):
            return [{"step": step, "rows": list(batch)}]

    assert g.run_generator(Variations(), [3, 4], 7, None) == [{"step": 7, "rows": [3, 4]}]
