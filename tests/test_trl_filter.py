"""Group filtering with carry-over under TRL (issue 43.2, on issue 42's consumption records):
``DynstateGRPOTrainer(filter_groups=...)`` through TRL's real ``GRPOTrainer.train()`` with the
example's tiny model. The example run with ``--filter-groups`` is SIGKILLed at a random step
and rerun with the same command: every step's rows and rewards equal the uninterrupted run's.
The consumption records in the store are checked against the trace (the groups each step
trained, in order, with the carried groups' scores) and against the exactly-once equation
folded in plain Python; the outcomes against the records. Bad inputs are refused with a typed
error, the store unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

import dynstate
from dynstate import (
    CheckpointNotFoundError,
    InvalidDataError,
    StateMismatchError,
    Store,
    consumption_records,
)

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "trl" / "train.py"
README = ROOT / "examples" / "trl" / "README.md"
GROUP = 8  # the example's num_generations
STEPS = 12

pytestmark = pytest.mark.filterwarnings(
    # transformers / trl on CPU: not ours to fix
    "ignore::UserWarning",
    "ignore::FutureWarning",
)


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("trl_example_train_filter", TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _command(base: Path) -> list[str]:
    """The README's --filter-groups command, shortened to STEPS steps (checkpoints every 4)
    with the exact-match reward, under which many groups all agree early on."""
    return [
        sys.executable, str(TRAIN), "--store", str(base / "store"), "--out", str(base / "out"),
        "--steps", str(STEPS), "--trace", str(base / "trace.jsonl"), "--filter-groups",
        "--reward", "exact", "--save-steps", "4",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _trace(path: Path) -> dict[int, dict[str, Any]]:
    """Each step's last line (a resumed run appends the steps it trains again)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record
    return by_step


def _consumed(record: dict[str, Any]) -> dict[str, Any]:
    """What a record says was consumed, without the version numbers (a resumed run's
    rollback commits versions the uninterrupted run does not have)."""
    keep = ("step", "settings", "carried_in", "drawn", "gen_batches", "trained", "filtered")
    return {k: record[k] for k in (*keep, "dropped", "carry")}


def _check_records_against_trace(
    store: Store, trace: dict[int, dict[str, Any]], ranks: int = 1
) -> None:
    records = consumption_records(store)
    assert [r["step"] for r in records] == sorted(trace)
    carry_scores: list[list[float]] = []
    previous: list[int] = []
    split = [0] * ranks  # how many groups of the carry are each rank's (rank by rank)
    for r in records:
        step = trace[r["step"]]
        # the groups trained are the trace's, in training order (rank by rank, each rank's
        # carry first)
        assert r["trained"] == step["rows"]
        assert len(step["rewards"]) == GROUP * len(step["rows"])
        assert r["carried_in"] == previous
        per = len(r["trained"]) // ranks
        if ranks == 1 or per * ranks == len(r["trained"]) == 4 * ranks:  # every rank full
            start = 0
            for rank in range(ranks):
                theirs = previous[start : start + split[rank]]
                trained = r["trained"][rank * per : (rank + 1) * per] if ranks > 1 else r["trained"]
                assert trained[: len(theirs)] == theirs[: len(trained)]
                # a carried group is trained with the scores it was accepted with
                first = 0 if ranks == 1 else rank * per
                for k in range(min(len(theirs), len(trained))):
                    at = (first + k) * GROUP
                    assert step["rewards"][at : at + GROUP] == carry_scores[start + k]
                start += split[rank]
        else:  # a rank ran out of generation batches: its carry is still trained first
            assert not Counter(previous) - Counter(r["trained"])
        for _, spread in r["filtered"]:
            assert spread == 0.0  # zero variance: each filtered group's scores all agree
        previous = [row for row, _ in r["carry"]]
        carry_scores = [scores for _, scores in r["carry"]]
        split = r["sampler"].get("carry_by_rank", [len(previous)])
        assert sum(split) == len(previous) and len(split) == ranks
        # lockstep: each sampler step draws 6 rows per rank, every one scored
        assert len(r["drawn"]) == 6 * ranks * r["gen_batches"]
    # the exactly-once equation over the run, folded in plain Python: every row drawn is
    # trained, filtered, dropped, or still carried after the last step
    drawn = Counter(row for r in records for row in r["drawn"])
    out = Counter(row for r in records for row in r["trained"])
    out += Counter(row for r in records for row, _ in r["filtered"])
    out += Counter(row for r in records for row, _ in r["dropped"])
    assert drawn == out + Counter(row for row, _ in records[-1]["carry"])
    # this run filtered and carried: the test can tell a loop that does neither
    assert sum(len(r["filtered"]) for r in records) > 0
    assert sum(len(r["carry"]) for r in records) > 0
    # the outcomes: every group scored at a step, once, at that step (its 8 responses)
    outcomes = store.outcome_records()
    for r in records:
        scored = Counter(r["drawn"])
        got = Counter(
            row
            for row, s in zip(
                outcomes.column("row").to_pylist(), outcomes.column("step").to_pylist(), strict=True
            )
            if s == r["step"]
        )
        assert got == Counter({row: GROUP * n for row, n in scored.items()}), r["step"]


def whole_checkpoint(out: Path, killed_at: int, every: int) -> int:
    """The step of the newest checkpoint a run killed after ``killed_at`` trace lines saved
    whole (with dynstate's state, written last): the one of the last multiple of ``every``,
    or, when the kill came while that one was saved (its step's trace line is written just
    before), the one before it."""
    whole = [
        int(path.name.removeprefix("checkpoint-"))
        for path in out.glob("checkpoint-*")
        if (path / "dynstate_state.pt").is_file()
    ]
    found = max(whole)
    last = every * (killed_at // every)
    assert found == last or (killed_at == last and found == last - every), (found, killed_at)
    return found


def test_filter_groups_example_resumes_exactly_after_sigkill(tmp_path) -> None:
    clean = tmp_path / "clean"
    subprocess.run(_command(clean), check=True, env=_env(), capture_output=True, timeout=600)
    oracle = _trace(clean / "trace.jsonl")
    assert sorted(oracle) == list(range(1, STEPS + 1))
    clean_store = Store.open(str(clean / "store"))
    _check_records_against_trace(clean_store, oracle)

    # killed at a random step past the first checkpoint (step 4), then the same command again
    seed = random.randrange(2**32)
    kill_after = random.Random(seed).randint(5, STEPS - 1)
    print(f"kill after step {kill_after} (seed {seed})")
    run = tmp_path / "killed"
    proc = subprocess.Popen(
        _command(run), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    trace = run / "trace.jsonl"
    deadline = time.monotonic() + 300
    while not (trace.exists() and len(trace.read_text().splitlines()) >= kill_after):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(trace.read_text().splitlines())
    assert killed_at < STEPS, "killed too late to test a resume"
    checkpoint = whole_checkpoint(run / "out", killed_at, every=4)
    subprocess.run(_command(run), check=True, env=_env(), capture_output=True, timeout=600)
    resumed = _trace(trace)
    assert sorted(resumed) == sorted(oracle)
    assert [s for s in oracle if resumed[s] != oracle[s]] == []
    steps = [json.loads(line)["step"] for line in trace.read_text().splitlines()]
    assert steps == [*range(1, killed_at + 1), *range(checkpoint + 1, STEPS + 1)]

    store = Store.open(str(run / "store"))
    _check_records_against_trace(store, resumed)
    mine = [_consumed(r) for r in consumption_records(store)]
    assert mine == [_consumed(r) for r in consumption_records(clean_store)]
    assert store.snapshot().to_arrow().equals(clean_store.snapshot().to_arrow())


@pytest.mark.slow
def test_readme_filter_command_as_written_learns(tmp_path) -> None:
    """examples/trl/README.md's --filter-groups command, run as written (in a temporary
    folder): 150 steps that learn, filter and carry, every record matching the trace."""
    import shlex

    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    (command,) = [line.strip() for line in blocks[1].splitlines() if line.strip()]
    assert "--filter-groups" in command and "--steps 150" in command
    argv = shlex.split(command.replace("/tmp/trl-filter", str(tmp_path)))
    assert argv[0] == "python"
    subprocess.run(
        [sys.executable, *argv[1:]], check=True, env=_env(), capture_output=True, timeout=600
    )
    trace = _trace(tmp_path / "trace.jsonl")
    assert sorted(trace) == list(range(1, 151))
    means = [sum(trace[s]["rewards"]) / len(trace[s]["rewards"]) for s in range(1, 151)]
    first, last = sum(means[:30]) / 30, sum(means[-30:]) / 30
    assert last > first + 0.1, (first, last)
    _check_records_against_trace(Store.open(str(tmp_path / "store")), trace)


# -- in process: settings, bad inputs ----------------------------------------------------------


def test_a_checkpoint_killed_while_saved_is_not_resumed_from(tmp_path, caplog) -> None:
    """A kill between the Trainer's files of checkpoint-N and dynstate's state leaves a folder
    no resume can use: the example (and train(resume_from_checkpoint=True)) resume from the
    newest one saved whole."""
    from dynstate.trl import last_checkpoint

    out = tmp_path / "out"
    assert last_checkpoint(str(out)) is None
    for step in (4, 8, 12):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert last_checkpoint(str(out)) is None
    for step in (4, 8):
        (out / f"checkpoint-{step}" / "dynstate_state.pt").write_bytes(b"")
    assert last_checkpoint(str(out)) == str(out / "checkpoint-8")
    assert "checkpoint-12 was not saved whole" in caplog.text


@pytest.fixture(scope="module")
def example() -> Any:
    return _example()


def _trainer(example: Any, store: Any, out: Path, **over: Any) -> Any:
    from transformers import set_seed
    from trl import GRPOConfig

    from dynstate.trl import DynstateGRPOTrainer, FilterGroups

    settings: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": 2,
        "per_device_train_batch_size": 16,
        "num_generations": GROUP,
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
    settings.update(over.pop("config", {}))
    set_seed(0)
    tokenizer = example.build_tokenizer()
    return DynstateGRPOTrainer(
        model=example.build_model(tokenizer),
        reward_funcs=[example.exact],
        args=GRPOConfig(**settings),
        processing_class=tokenizer,
        train_dataset=store,
        filter_groups=over.pop("filter_groups", FilterGroups(gen_prompts=3)),
        **over,
    )


def _new_store(example: Any, path: Path) -> Store:
    store = Store.open(str(path), create=True)
    store.append(example.first_tasks(0, count=16))
    return store


@pytest.fixture(scope="module")
def trained(example, tmp_path_factory) -> tuple[Store, Path]:
    """A store and the checkpoint-2 of a 2-step filtering run over it."""
    base = tmp_path_factory.mktemp("trlfilter")
    store = _new_store(example, base / "store")
    trainer = _trainer(example, store, base / "out")
    trainer.train()
    checkpoint = base / "out" / "checkpoint-2"
    assert (checkpoint / "dynstate_state.pt").is_file()
    assert (checkpoint / "dynstate_carry.pt").is_file()
    assert trainer.dynstate_round.consumption["step"] == 2
    return store, checkpoint


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"surplus": "drop"}, "surplus"),
        ({"max_gen_batches": 3}, "max_gen_batches"),
        ({"rule": dynstate.StdThreshold(0.2)}, "rule"),
        ({"gen_prompts": 4}, "gen_batch_size"),
    ],
)
def test_resume_with_other_filter_settings_is_refused_unchanged(
    example, trained, tmp_path, settings, named
) -> None:
    from dynstate.trl import FilterGroups

    store, checkpoint = trained
    head = store.refresh()
    trainer = _trainer(
        example,
        store,
        tmp_path / "out",
        filter_groups=FilterGroups(**{"gen_prompts": 3, **settings}),
    )
    with pytest.raises(StateMismatchError, match=re.escape(named)):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert store.refresh() == head


def test_resume_of_a_filtering_checkpoint_without_filtering_is_refused(
    example, trained, tmp_path
) -> None:
    store, checkpoint = trained
    head = store.refresh()
    trainer = _trainer(example, store, tmp_path / "out", filter_groups=None)
    with pytest.raises(StateMismatchError, match="saved with filter_groups"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert store.refresh() == head


def test_resume_of_a_plain_checkpoint_with_filtering_is_refused(example, tmp_path) -> None:
    store = _new_store(example, tmp_path / "store")
    _trainer(example, store, tmp_path / "out", filter_groups=None).train()
    head = store.refresh()
    trainer = _trainer(example, store, tmp_path / "out2")
    with pytest.raises(StateMismatchError, match="saved without filter_groups"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert store.refresh() == head


def test_checkpoint_without_its_carry_is_refused_unchanged(example, trained, tmp_path) -> None:
    store, checkpoint = trained
    copy = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, copy)
    (copy / "dynstate_carry.pt").unlink()
    head = store.refresh()
    trainer = _trainer(example, store, tmp_path / "out")
    with pytest.raises(CheckpointNotFoundError, match=r"dynstate_carry\.pt"):
        trainer.train(resume_from_checkpoint=str(copy))
    assert store.refresh() == head


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"filter_groups": "yes"}, "filter_groups"),
        (
            {
                "config": {
                    "gradient_accumulation_steps": 3,
                    "per_device_train_batch_size": 8,
                    "num_generations": 4,
                }
            },
            "steps_per_generation=3",
        ),
    ],
)
def test_filter_settings_it_cannot_make_exact_are_refused_at_start(
    example, tmp_path, over, named
) -> None:
    store = _new_store(example, tmp_path / "store")
    with pytest.raises(InvalidDataError, match=re.escape(named)):
        _trainer(example, store, tmp_path / "out", **over)
    assert store.refresh() == 1


class _Crash(Exception):
    pass


def _rounds_run(
    example: Any, base: Path, *, crash_after: int | None, resume: bool, **sampler: Any
) -> list[Any]:
    """Rounds of a 4-step filtering run with gradient accumulation 2 (checkpoints every 2
    steps), selection (unless ``sampler`` says otherwise) and the example's generator;
    ``crash_after``: raise once that step is committed."""
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
        generator=example.HardestVariations(seed=0),
        config={"max_steps": 4, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 8},
        **{"select": dynstate.Learnability(), **sampler},
    )
    trainer.add_callback(Record())
    try:
        trainer.train(resume_from_checkpoint=last_checkpoint(str(base / "out")) if resume else None)
    except _Crash:
        pass
    return rounds


@pytest.mark.parametrize(
    "sampler",
    [{}, {"mode": "mix", "lag": 1, "fresh_share": 0.5, "select": None}],
    ids=["epoch-select", "mix"],
)
def test_gradient_accumulation_with_filtering_resumes_exactly(example, tmp_path, sampler) -> None:
    """gradient_accumulation_steps 2 (steps_per_generation following it): a run stopped after
    the round of step 3 and resumed from checkpoint-2 trains steps 3 and 4 as the
    uninterrupted run did: the same groups, rewards and consumption. In mix mode the rows the
    generator commits are drawn within the epoch, a lag of one generation batch after the
    step that committed them ended."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the example: the same arithmetic in every run
    try:
        clean = _rounds_run(example, tmp_path / "clean", crash_after=None, resume=False, **sampler)
        assert [r.step for r in clean] == [1, 2, 3, 4]
        assert sum(len(r.consumption["filtered"]) for r in clean) > 0
        if sampler:  # fresh rows were drawn: past the version the epoch pinned
            positions = [r.consumption["sampler"] for r in clean]
            assert any(p["fresh_next"] > p["base_rows"] for p in positions)
        first = _rounds_run(example, tmp_path / "run", crash_after=3, resume=False, **sampler)
        assert [r.step for r in first] == [1, 2, 3]
        again = _rounds_run(example, tmp_path / "run", crash_after=None, resume=True, **sampler)
        assert [r.step for r in again] == [3, 4]
        for mine, theirs in zip(again, clean[2:], strict=True):
            assert (mine.rows, mine.rewards, mine.added) == (
                theirs.rows,
                theirs.rewards,
                theirs.added,
            )
            assert _consumed(mine.consumption) == _consumed(theirs.consumption)
    finally:
        torch.set_num_threads(threads)
