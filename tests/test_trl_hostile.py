"""Hostile but plausible use of dynstate.trl through TRL's real ``GRPOTrainer.train()`` with
the example's tiny model (an outside audit): generators that return what the interfaces
document, a callback passed to the constructor, a store reset by another process while a
mix-mode run trains; and one guard, every generation's outcomes against what the reward
function saw and the store's shards read with pyarrow, across an epoch rollover with
generations spanning two optimizer steps.

Each test but the guard exposes a defect; its docstring says what is wrong and what is
expected, citing docs/trl.md, docs/index.md or SPEC (/work/shared/SPEC.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("trl")
# as tests/test_trl.py: TRL's trainer module imported at collection, in the main thread
import trl.trainer.grpo_trainer  # noqa: F401

# pytest puts tests/ on sys.path (no package): the tiny-model helpers of test_trl.py and the
# pyarrow oracle of test_trl_settings.py
from test_trl import _example, _trainer
from test_trl_settings import Oracle

from dynstate import Store

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

GROUP = 8  # num_generations in test_trl's config


@pytest.fixture(scope="module")
def example() -> Any:
    return _example()


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _store(example: Any, path: Path, rows: list[dict[str, Any]] | None = None) -> Store:
    store = Store.open(str(path), create=True)
    store.append(rows if rows is not None else example.first_tasks(0, count=16))
    return store


# -- defects -----------------------------------------------------------------------------------


def test_an_old_interface_generator_returning_rows_of_its_dataframe_commits_them(
    example: Any, tmp_path: Path
) -> None:
    """DEFECT. docs/trl.md: ``generator`` may be "an object with ``generate(dataset)`` (verl's
    old ``AbstractDataGenerator`` interface: ``dataset.dataframe`` is a ``datasets.Dataset`` of
    the current rows) ... returns the step's new rows". A generator that re-queues two of those
    rows (``dataset.dataframe.select([0, 1])``) over the example's store makes ``train()`` die
    after step 1's optimizer step with ``SchemaMismatchError: missing columns:
    _dynstate_source``: ``RoundView.dataframe`` drops the reserved lineage column and
    ``_write_round`` hands the rows to ``store.append`` as they are, never filling it. The verl
    integration, with the same generator class (``test_one_generator_class_serves_both_trainers``),
    fills it with nulls ("rows they return have no lineage (``_dynstate_source`` null)",
    docs/verl.md; ``_round_table`` / ``_with_source`` in dynstate/verl/dataset.py). Any
    old-interface generator writing plain task dicts fails the same way.
    Expected: step 1's round commits the 2 rows, their ``_dynstate_source`` null."""

    class Requeue:
        def generate(self, dataset: Any) -> Any:
            return dataset.dataframe.select([0, 1])

    store = _store(example, tmp_path / "store")
    trainer = _trainer(
        example,
        store,
        tmp_path / "out",
        generator=Requeue(),
        config={"max_steps": 1, "save_strategy": "no"},
    )
    trainer.train()
    assert trainer.dynstate_round is not None and trainer.dynstate_round.added == 2
    table = store.snapshot().to_arrow()
    assert table.num_rows == 18
    assert table.column("prompt").to_pylist()[16:] == table.column("prompt").to_pylist()[:2]
    assert table.column("_dynstate_source").to_pylist()[16:] == [None, None]


def test_a_dynstate_generator_recording_lineage_over_a_plain_dataset_commits(
    example: Any, tmp_path: Path
) -> None:
    """DEFECT. docs/trl.md's setup fills the store with "the datasets.Dataset you trained on"
    (``store.append(dataset)``: ``prompt`` and ``answer``, no lineage column), and a
    ``DynstateGenerator``'s rows record their source in the reserved column
    ``_dynstate_source`` (dynstate/trl/generator.py: "a row's ``_dynstate_source`` (list of
    store row numbers) records what it came from"; DynstateGenerator.generate: "with the
    store's columns and optionally ``_dynstate_source``"; docs/index.md: lineage "is a reserved
    column"). Over such a store ``train()`` dies after step 1's optimizer step with
    ``SchemaMismatchError: unexpected columns: _dynstate_source``: the TRL integration neither
    creates the reserved column nor lets a round add it (verl's ``_with_source`` always
    stores it). Expected: step 1's round commits the row with ``_dynstate_source == [its
    source row]`` (earlier rows null)."""
    from dynstate.trl import DynstateGenerator

    class Lineage(DynstateGenerator):
        name = "lineage"

        def generate(self, batch: Any, step: int, dataset: Any) -> Any:
            return [{"prompt": "4+4=", "answer": "8", "_dynstate_source": [batch.rows[0]]}]

    plain = [{"prompt": r["prompt"], "answer": r["answer"]} for r in example.first_tasks(0, 16)]
    store = _store(example, tmp_path / "store", plain)
    trainer = _trainer(
        example,
        store,
        tmp_path / "out",
        generator=Lineage(),
        config={"max_steps": 1, "save_strategy": "no"},
    )
    trainer.train()
    source = trainer.dynstate_round.rows[0]
    table = store.snapshot().to_arrow()
    assert table.num_rows == 17
    assert table.column("_dynstate_source").to_pylist()[16] == [source]


def test_a_callback_passed_to_the_constructor_sees_the_round_of_its_step(
    example: Any, tmp_path: Path
) -> None:
    """DEFECT. docs/trl.md: callbacks "stay as [they were]" in a GRPOTrainer script, the round
    is committed "right after the optimizer step (``on_step_end``, before TRL logs or saves the
    step)", and "``trainer.dynstate_round`` holds what the step just committed". A callback
    given the usual way, ``DynstateGRPOTrainer(..., callbacks=[cb])``, runs its
    ``on_step_end`` before ``_RoundCallback`` (added last, by ``add_callback`` in
    ``__init__``): at step 1 it sees ``dynstate_round is None``, at step s the round of step
    s - 1, so a trace written there (as examples/trl/train.py's ``Trace``, which only works
    because the example uses ``add_callback`` after construction) is one step late and misses
    the last step. Expected: the round of step s at step s."""
    from transformers import TrainerCallback

    seen: list[tuple[int, int | None]] = []

    class Trace(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            done = trainer.dynstate_round
            seen.append((state.global_step, None if done is None else done.step))
            return control

    store = _store(example, tmp_path / "store")
    trainer = _trainer(
        example,
        store,
        tmp_path / "out",
        callbacks=[Trace()],
        config={"max_steps": 2, "save_strategy": "no"},
    )
    trainer.train()
    assert seen == [(1, 1), (2, 2)]


def test_guard_outcomes_credit_exactly_the_rows_scored_across_an_epoch_rollover(
    example: Any, tmp_path: Path
) -> None:
    """GUARD (holds). steps_per_generation=2 (a generation spans 2 optimizer steps, docs/trl.md
    "Generations that span optimizer steps"), the example's generator, epoch mode, 16 rows, 4
    prompts per generation, 12 optimizer steps = 6 generations: epoch 1 is generations 1-4
    over the first tasks, epoch 2 pins the round of generation 4 (24 rows). Read from the
    store's log and Parquet shards with json/pyarrow (no dynstate): one reward call per
    generation; the outcomes of step s are exactly the (row, score) pairs the reward function
    saw in call s (scores as TRL's float32 ``reward``); the prompts it saw are the shards'
    prompts of those rows at the version it names; each epoch visits its pinned version's
    rows without repeat."""
    calls: list[list[tuple[int, int, str, float]]] = []

    def reward(
        completions: list[str],
        answer: list[str],
        prompts: list[str],
        dynstate_row: list[int],
        dynstate_version: list[int],
        **_: Any,
    ) -> list[float]:
        scores = example.reward(completions, answer)
        calls.append(list(zip(dynstate_row, dynstate_version, prompts, scores, strict=True)))
        return scores

    store = _store(example, tmp_path / "store")
    trainer = _trainer(
        example,
        store,
        tmp_path / "out",
        generator=example.HardestVariations(seed=0),
        config={"max_steps": 12, "steps_per_generation": 2, "save_strategy": "no"},
    )
    trainer.reward_funcs = [reward]
    trainer.train()
    oracle = Oracle(tmp_path / "store")
    outcomes = oracle.outcomes(oracle.head)
    assert len(calls) == 6
    assert sorted({s for s, _, _ in outcomes}) == list(range(1, 7))
    epoch_rows: list[int] = []
    for step, call in enumerate(calls, start=1):
        mine = [(r, s) for st, r, s in outcomes if st == step]
        assert mine == [(r, float(np.float32(s))) for r, _, _, s in call], step
        versions = {v for _, v, _, _ in call}
        assert len(versions) == 1, step
        (version,) = versions
        at = oracle.prompts(version)
        assert [p for _, _, p, _ in call] == [at[r] for r, _, _, _ in call], step
        rows = [r for r, _, _, _ in call][::GROUP]
        assert len(rows) == 4
        want = 1 if step <= 4 else oracle.round_version(4)  # epoch 1, then epoch 2's pin
        assert version == want, (step, version, want)
        if step == 5:
            epoch_rows = []
        epoch_rows += rows
        assert len(set(epoch_rows)) == len(epoch_rows), (step, epoch_rows)
    assert oracle.records[oracle.round_version(4)]["num_rows"] == 24
    assert all(0 <= r < 24 for r in epoch_rows)


def test_a_reset_by_another_process_stops_a_mix_mode_run_at_once(
    example: Any, tmp_path: Path
) -> None:
    """Another handle (another process, as an operator's ``dynstate reset``) resets the store
    after step 1's round and appends other rows at the numbers the run's sampler counts. The
    mix-mode run waited its whole ``wait_timeout`` (600 s) for the round of step 1 on the new
    head, then raised ``RoundTimeoutError`` with advice that did not fit; it stops at step 2
    with ``StateMismatchError`` naming what happened and what to do, no round of step 2
    committed."""
    import time

    from transformers import TrainerCallback

    from dynstate import StateMismatchError

    store = _store(example, tmp_path / "store")
    url = str(tmp_path / "store")

    class ResetByOther(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if state.global_step == 1:
                other = Store.open(url)
                other.reset(0)
                other.append(example.first_tasks(100, count=16))
            return control

    trainer = _trainer(
        example,
        store,
        tmp_path / "out",
        mode="mix",
        generator=example.HardestVariations(seed=0),
        callbacks=[ResetByOther()],
        config={"max_steps": 3, "save_strategy": "no"},
    )
    started = time.monotonic()
    with pytest.raises(StateMismatchError, match=r"no longer descends from version \d+"):
        trainer.train()
    assert time.monotonic() - started < 300
    assert trainer.dynstate_round is not None and trainer.dynstate_round.step == 1
    records = [store.commit_record(v) for v in range(store.refresh() + 1)]
    assert 2 not in [record.meta.get("step") for record in records]


@pytest.mark.parametrize("filtered", [False, True], ids=["plain", "filter_groups"])
def test_a_dynstate_generator_sees_what_the_rewards_scored(
    example: Any, tmp_path: Path, filtered: bool
) -> None:
    """A ``DynstateGenerator``'s ``StepBatch`` holds, response by response, the row, the prompt,
    the completion and the score the reward function saw at that step (``completions`` was
    always empty: a generator could not build on what the policy wrote). With
    ``filter_groups`` every group scored at the step counts, filtered ones too, each once, as
    the step's outcomes do. Held against the reward function's own record of its calls."""
    from dynstate.trl import DynstateGenerator, FilterGroups

    calls: list[list[tuple[int, str, str, float]]] = []

    def reward(
        completions: list[str], answer: list[str], prompts: list[str], dynstate_row: list[int],
        **_: Any,
    ) -> list[float]:  # fmt: skip
        scores = example.reward(completions, answer)
        calls.append(list(zip(dynstate_row, prompts, completions, scores, strict=True)))
        return scores

    seen: dict[int, list[tuple[int, str, str, float]]] = {}

    class Watch(DynstateGenerator):
        name = "watch"

        def generate(self, batch: Any, step: int, dataset: Any) -> Any:
            seen[step] = list(
                zip(batch.rows, batch.prompts, batch.completions, batch.scores, strict=True)
            )
            return []

    store = _store(example, tmp_path / "store")
    over: dict[str, Any] = {"filter_groups": FilterGroups(gen_prompts=2)} if filtered else {}
    trainer = _trainer(
        example,
        store,
        tmp_path / "out",
        generator=Watch(),
        config={"max_steps": 2, "save_strategy": "no"},
        **over,
    )
    trainer.reward_funcs = [reward]
    trainer.train()
    assert sorted(seen) == [1, 2]
    if not filtered:
        assert len(calls) == 2  # one generation per step
        per_step = {1: calls[0], 2: calls[1]}
    else:
        # a step's generation batches, in order; the boundary is where seen[1] ends
        flat = [x for call in calls for x in call]
        per_step = {1: flat[: len(seen[1])], 2: flat[len(seen[1]) : len(seen[1]) + len(seen[2])]}
        assert len(seen[1]) + len(seen[2]) == len(flat)
    for step in (1, 2):
        want = [(r, p, c, float(np.float32(s))) for r, p, c, s in per_step[step]]
        got = [(r, p, c, float(np.float32(s))) for r, p, c, s in seen[step]]
        assert got == want, step
        assert all(isinstance(c, str) for _, _, c, _ in got)


def test_a_resume_with_another_stateful_generator_is_refused_unchanged(
    example: Any, tmp_path: Path
) -> None:
    """DEFECT (noticed in a closing note). Resuming from a checkpoint with a stateful generator
    of another name handed its ``load_state_dict`` the state the run's generator had committed
    (``{"seed", "count"}`` of ``hardest-variations``) and trained on. Expected: the resume is
    refused with :class:`StateMismatchError` naming both generators, before the rollback (the
    store exactly as it was); a generator that takes the name resumes with the state."""
    import os

    from dynstate.errors import StateMismatchError

    class Other(example.HardestVariations):
        name = "other-variations"

    class SameName(example.HardestVariations):
        name = "hardest-variations"

    store = _store(example, tmp_path / "store")
    first = _trainer(
        example,
        store,
        tmp_path / "out",
        generator=example.HardestVariations(seed=0),
        config={"max_steps": 3},
    )
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "dynstate_state.pt").is_file()

    def files() -> dict[str, int]:
        root = tmp_path / "store"
        return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}

    head, before = store.refresh(), files()
    other = Other(seed=5)
    trainer = _trainer(example, store, tmp_path / "out2", generator=other, config={"max_steps": 3})
    with pytest.raises(StateMismatchError) as caught:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    said = str(caught.value)
    assert "'hardest-variations'" in said and "'other-variations'" in said, said
    assert "nothing was changed" in said and os.fspath(checkpoint) in said
    assert other.seed == 5 and other.count == 0  # it got no state
    assert store.refresh() == head and files() == before

    same = SameName(seed=5)
    trainer = _trainer(example, store, tmp_path / "out3", generator=same, config={"max_steps": 3})
    trainer.train(resume_from_checkpoint=str(checkpoint))
    # the state of checkpoint 2, then step 3's own round: as the first run's step 3
    assert same.state_dict() == first.dynstate_generator.state_dict()
