"""Hostile resumes of dynstate.trl through TRL's real ``GRPOTrainer.train()`` with the
example's tiny model: a finished run started again, a checkpoint that transformers cannot load,
a checkpoint folder written again by a run resumed from an older one and killed while saving,
a run saved with ``save_only_model``, and a hand-edited ``dynstate_state.pt``. Each resume
either continues exactly or is refused with a :class:`~dynstate.DynstateError`, leaving the
store as it was (SPEC §3.5, §3.6, §3.9, §3.15)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
# as tests/test_trl.py: TRL's trainer module imported at collection, in the main thread
import trl.trainer.grpo_trainer  # noqa: F401

# pytest puts tests/ on sys.path (no package): the tiny-model helpers of test_trl.py
from test_trl import _example, _trainer

from dynstate import DynstateError, Store

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

STEPS = 4  # checkpoints at steps 2 and 4


class _Crash(Exception):
    pass


@pytest.fixture(scope="module")
def example() -> Any:
    return _example()


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """One thread, as the example: the same arithmetic in every run of a test."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(example: Any, base: Path, **config: Any) -> Any:
    """A trainer of a 4-step run over ``base/store`` saving into ``base/out``, with the
    example's generator (the store grows every step)."""
    return _trainer(
        example,
        Store.open(str(base / "store")),
        base / "out",
        generator=example.HardestVariations(seed=0),
        config={"max_steps": STEPS, **config},
    )


def _start(example: Any, base: Path, **config: Any) -> None:
    store = Store.open(str(base / "store"), create=True)
    store.append(example.first_tasks(0, count=16))
    _run(example, base, **config).train()


def _outcomes(base: Path) -> list[tuple[int, int, float]]:
    """The (step, row, score) outcome records at the store's head."""
    table = Store.open(str(base / "store")).outcome_records()
    return list(
        zip(
            table.column("step").to_pylist(),
            table.column("row").to_pylist(),
            table.column("score").to_pylist(),
            strict=True,
        )
    )


@pytest.fixture(scope="module")
def finished(example: Any, tmp_path_factory: Any) -> Path:
    """A finished 4-step run: its store, and checkpoint-2 and checkpoint-4 in ``out``."""
    base = tmp_path_factory.mktemp("hostile") / "run"
    _start(example, base)
    assert (base / "out" / "checkpoint-2" / "dynstate_state.pt").is_file()
    assert (base / "out" / "checkpoint-4" / "dynstate_state.pt").is_file()
    return base


def _copy(finished: Path, tmp_path: Path) -> Path:
    """A copy of the finished run (the same store id: its checkpoints resume it)."""
    base = tmp_path / "run"
    shutil.copytree(finished, base)
    return base


def test_a_finished_run_started_again_trains_no_step_past_max_steps(
    example: Any, finished: Path, tmp_path: Path
) -> None:
    """The same command run again after the run finished (a job restarted, the README's "run
    the same command again") resumes from checkpoint-``max_steps`` and trains nothing more: the
    store gains no round of a step past ``max_steps`` and no checkpoint past it is saved."""
    base = _copy(finished, tmp_path)
    before = _outcomes(base)
    trainer = _run(example, base)
    trainer.train(resume_from_checkpoint=True)
    assert sorted({step for step, _, _ in _outcomes(base)}) == list(range(1, STEPS + 1))
    assert _outcomes(base) == before
    assert sorted(p.name for p in (base / "out").glob("checkpoint-*")) == [
        "checkpoint-2",
        "checkpoint-4",
    ]


def test_a_checkpoint_transformers_cannot_load_leaves_the_store_as_it_was(
    example: Any, finished: Path, tmp_path: Path
) -> None:
    """A checkpoint whose model file is cut short (a partial copy) passes dynstate's checks
    but not transformers' load: the refused resume leaves the store as it was, so the newest
    checkpoint still resumes (no rollback before the checkpoint has been loaded)."""
    base = _copy(finished, tmp_path)
    model = base / "out" / "checkpoint-2" / "model.safetensors"
    data = model.read_bytes()
    model.write_bytes(data[: len(data) // 2])
    store = Store.open(str(base / "store"))
    head = store.refresh()
    from safetensors import SafetensorError

    with pytest.raises((SafetensorError, DynstateError)):  # transformers' load, or a check
        _run(example, base).train(resume_from_checkpoint=str(model.parent))
    assert store.refresh() == head


def test_a_folder_saved_again_and_killed_while_saving_is_not_taken_as_whole(
    example: Any, finished: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    """A run resumed from checkpoint-2 saves checkpoint-4 again into the folder the first
    run left; killed after transformers' files and before dynstate's state, the folder holds
    new weights beside the first run's ``dynstate_state.pt`` (of rounds the resume abandoned).
    It is not a checkpoint saved whole: ``last_checkpoint`` names checkpoint-2, and
    ``train(resume_from_checkpoint=True)`` resumes from it and finishes the run."""
    from dynstate.trl import last_checkpoint
    from dynstate.trl import loader as trl_loader

    base = _copy(finished, tmp_path)
    out = base / "out"
    real = trl_loader.checkpoint_state

    def dying(*args: Any, **kwargs: Any) -> Any:
        if args[2] == STEPS:  # the global step: killed while saving checkpoint-4
            raise _Crash
        return real(*args, **kwargs)

    monkeypatch.setattr(trl_loader, "checkpoint_state", dying)
    with pytest.raises(_Crash):
        _run(example, base).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    monkeypatch.setattr(trl_loader, "checkpoint_state", real)
    assert last_checkpoint(str(out)) == str(out / "checkpoint-2")
    _run(example, base).train(resume_from_checkpoint=True)
    assert sorted({step for step, _, _ in _outcomes(base)}) == list(range(1, STEPS + 1))


def test_a_save_only_model_checkpoint_resumes_exactly_or_is_refused_unchanged(
    example: Any, tmp_path: Path
) -> None:
    """``save_only_model=True`` checkpoints hold no optimizer, scheduler or RNG state: a
    resume from one either trains the steps after it as the uninterrupted run did (the same
    rows and rewards) or is refused with a DynstateError before anything changes."""
    base = tmp_path / "run"
    _start(example, base, save_only_model=True)  # the uninterrupted run
    clean = [r for r in _outcomes(base) if r[0] > 2]
    store = Store.open(str(base / "store"))
    head = store.refresh()
    trainer = _run(example, base, save_only_model=True)
    try:
        trainer.train(resume_from_checkpoint=str(base / "out" / "checkpoint-2"))
    except DynstateError:
        assert store.refresh() == head
        return
    assert [r for r in _outcomes(base) if r[0] > 2] == clean


def test_a_hand_edited_steps_per_round_is_refused_as_a_dynstate_error(
    example: Any, finished: Path, tmp_path: Path
) -> None:
    """A ``dynstate_state.pt`` whose ``steps_per_round`` was edited to a value that is no
    number is refused with a DynstateError naming the file, the store unchanged."""
    import torch

    base = _copy(finished, tmp_path)
    path = base / "out" / "checkpoint-2" / "dynstate_state.pt"
    state = torch.load(path, weights_only=True)
    state["steps_per_round"] = None
    torch.save(state, path)
    store = Store.open(str(base / "store"))
    head = store.refresh()
    with pytest.raises(DynstateError, match="dynstate_state"):
        _run(example, base).train(resume_from_checkpoint=str(path.parent))
    assert store.refresh() == head


def test_a_refusal_for_rows_appended_after_the_checkpoint_advises_a_command_that_runs(
    example: Any, finished: Path, tmp_path: Path
) -> None:
    """Rows another writer appended after the checkpoint's round (no step of their own) make
    the resume refuse, the store unchanged; the advice is a command that runs as written:
    ``dynstate reset URL VERSION``, naming the store."""
    from dynstate import StateMismatchError

    base = _copy(finished, tmp_path)
    store = Store.open(str(base / "store"))
    store.append([example.task(1, 1)])
    head = store.refresh()
    checkpoint = base / "out" / "checkpoint-4"
    with pytest.raises(StateMismatchError) as raised:
        _run(example, base).train(resume_from_checkpoint=str(checkpoint))
    assert store.refresh() == head
    version = head - 1  # the round of step 4, the version the checkpoint saw
    assert f"dynstate reset {store.display_url} {version}" in str(raised.value)
