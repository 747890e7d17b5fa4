"""The GRPOConfig settings dynstate.trl once refused (issue 43.1), through TRL's real
``GRPOTrainer.train()`` with the example's tiny model: loader workers
(``dataloader_num_workers=2``), ``num_iterations=2`` and ``steps_per_generation`` twice
``gradient_accumulation_steps``. Each is run uninterrupted, then run again, SIGKILLed at a
random step after its first checkpoint and resumed with ``train(resume_from_checkpoint=...)``:
every round's rows, rewards and the weights after it equal the uninterrupted run's, and both
runs' rows are checked against an oracle that reads the store's log and Parquet shards whole
with pyarrow (not through dynstate): the prompts GRPOTrainer scored are the rows' prompts, the
outcomes are recorded once per generation, and in epoch mode every epoch is a permutation of
the version pinned by the round of the step before it.

This file is also the training script the tests launch (``python tests/test_trl_settings.py
--store ... --out ... --trace ...``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "trl" / "train.py"
GROUP = 4  # num_generations
PER_DEVICE = 8  # responses per micro-step: 2 prompts x 4


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("trl_example_train", TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the training script -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--spg", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--first", type=int, default=6)
    parser.add_argument("--save-total-limit", type=int, default=None)
    parser.add_argument("--die-in-save", type=int, default=None,
                        help="SIGKILL this process while it saves this step's checkpoint, "
                             "after transformers' files and before dynstate's state")  # fmt: skip
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # the same arithmetic in every run, killed or not
    from transformers import TrainerCallback, set_seed
    from trl import GRPOConfig

    import dynstate
    from dynstate.trl import DynstateGRPOTrainer, last_checkpoint
    from dynstate.trl import loader as trl_loader

    if args.die_in_save is not None:
        state_of_checkpoint = trl_loader.checkpoint_state

        def dying(*a: Any, **kw: Any) -> Any:
            if a[2] == args.die_in_save:  # the global step
                os.kill(os.getpid(), signal.SIGKILL)
            return state_of_checkpoint(*a, **kw)

        trl_loader.checkpoint_state = dying

    example = _example()
    store = dynstate.Store.open(args.store, create=True)
    if store.snapshot().num_rows == 0:
        store.append(example.first_tasks(0, count=args.first))
    # the newest checkpoint saved whole: a kill while saving leaves a newer folder that
    # transformers' get_last_checkpoint would pick (and that no resume can use)
    checkpoint = last_checkpoint(args.out)
    if checkpoint is None:
        dynstate.rollback(store, step=0)

    seen: list[dict[str, Any]] = []

    def reward(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
        # what GRPOTrainer handed the reward function, for the oracle
        seen.append({"prompts": list(prompts), "rows": list(kw["dynstate_row"]),
                     "versions": list(kw["dynstate_version"])})  # fmt: skip
        return example.reward(completions, kw["answer"])  # type: ignore[no-any-return]

    set_seed(0)
    tokenizer = example.build_tokenizer()
    model = example.build_model(tokenizer)
    config = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=args.ga,
        steps_per_generation=args.spg,
        num_iterations=args.iterations,
        num_generations=GROUP,
        max_completion_length=2,
        temperature=1.0,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        beta=0.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        report_to="none",
        seed=0,
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        dataloader_num_workers=args.workers,
    )

    class Trace(TrainerCallback):
        def on_step_end(self, _args: Any, state: Any, control: Any, **_: Any) -> Any:
            done = trainer.dynstate_round
            if done is None or done.global_step != state.global_step:
                return control  # inside a generation: its round comes after its last step
            weights = sum(float(p.detach().double().sum()) for p in model.parameters())
            record = {"step": done.step, "global_step": done.global_step, "rows": done.rows,
                      "rewards": done.rewards, "version": done.version, "weights": weights,
                      "seen": list(seen)}  # fmt: skip
            seen.clear()
            with open(args.trace, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
            return control

    trainer = DynstateGRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        processing_class=tokenizer,
        train_dataset=dynstate.VersionedDataset(store),
        generator=example.HardestVariations(seed=0),
        mode="epoch",
    )
    trainer.add_callback(Trace())
    trainer.train(resume_from_checkpoint=checkpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())


# -- the tests ---------------------------------------------------------------------------------

import pytest  # noqa: E402

pytest.importorskip("trl")

pytestmark = [
    pytest.mark.slow,  # three launches of ~8 s of imports each per setting
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]


def _env() -> dict[str, str]:
    # faulthandler: a run that dies of a signal says where (the stderr tail alone did not)
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
    }


def _launch(base: Path, options: list[str]) -> list[str]:
    return [sys.executable, __file__, "--store", str(base / "store"), "--out",
            str(base / "out"), "--trace", str(base / "trace.jsonl"), *options]  # fmt: skip


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _by_step(path: Path) -> dict[int, dict[str, Any]]:
    """Each round's last line: a resumed run appends the rounds it trains again."""
    return {r["step"]: r for r in _lines(path)}


def _same(record: dict[str, Any]) -> dict[str, Any]:
    """What a resumed run repeats exactly: all but version numbers (a resumed store holds
    the abandoned rounds and the rollback's commit too; the oracle checks its versions)."""
    seen = [{k: v for k, v in call.items() if k != "versions"} for call in record["seen"]]
    return {**{k: v for k, v in record.items() if k != "version"}, "seen": seen}


# -- the oracle: the store read without dynstate ----------------------------------------------


class Oracle:
    """A store's history read from its log records and Parquet shards with json and pyarrow."""

    def __init__(self, root: Path):
        self.root = root
        self.records: dict[int, dict[str, Any]] = {}
        for path in sorted((root / "_dynstate" / "log").glob("*.json")):
            record = json.loads(path.read_text())
            self.records[int(record["version"])] = record
        self.head = max(self.records)

    def _files(self, version: int, key: str) -> list[str]:
        """The Parquet files of ``version``'s rows (``key="add"``) or outcomes, in order,
        following appends to their parent and resets to their target."""
        record = self.records[version]
        if record["op"] == "create":
            return []
        if record["op"] == "reset":
            return self._files(int(record["target"]), key)
        assert record["op"] == "append", record["op"]
        own = record["add"] if key == "add" else (record.get("outcomes") or {}).get("add", [])
        return self._files(int(record["parent"]), key) + [e["path"] for e in own]

    def _read(self, files: list[str]) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        tables = [pq.read_table(self.root / f) for f in files]
        return pa.concat_tables(tables, promote_options="default") if tables else None

    def prompts(self, version: int) -> list[str]:
        table = self._read(self._files(version, "add"))
        rows = table.column("prompt").to_pylist()
        assert len(rows) == self.records[version]["num_rows"]
        return rows

    def outcomes(self, version: int) -> list[tuple[int, int, float]]:
        table = self._read(self._files(version, "outcomes"))
        return list(
            zip(
                table.column("step").to_pylist(),
                table.column("row").to_pylist(),
                table.column("score").to_pylist(),
                strict=True,
            )
        )

    def lineage(self) -> list[int]:
        """The head's versions, oldest first, as content: a reset stands for its target."""
        out, v = [], self.head
        while v is not None:
            out.append(v)
            record = self.records[v]
            v = int(record["target"]) if record["op"] == "reset" else record["parent"]
        return out[::-1]

    def round_version(self, step: int) -> int:
        """The version of the round of ``step`` (meta ``step``) on the head's lineage."""
        for v in self.lineage():
            if (self.records[v].get("meta") or {}).get("step") == step:
                return v
        raise AssertionError(f"no round of step {step}")


def check_against_oracle(root: Path, trace: dict[int, dict[str, Any]], prompts: int) -> None:
    """Every round of ``trace`` against the store read whole: the prompts GRPOTrainer scored are
    the prompts of the rows dynstate names, one outcome per response per generation (not per
    optimizer step), and each epoch a permutation of the version pinned by the round of the
    step before its first step (the first epoch: the first tasks' version)."""
    oracle = Oracle(root)
    head_prompts = oracle.prompts(oracle.head)
    outcomes = oracle.outcomes(oracle.head)
    steps = sorted(trace)
    assert steps == list(range(1, len(steps) + 1))
    assert sorted({s for s, _, _ in outcomes}) == steps  # once per round, every round
    first_version = min(v for v in oracle.lineage() if oracle.records[v]["num_rows"] > 0)
    pinned, epoch_rows, epoch_left = first_version, [], 0
    for step in steps:
        record = trace[step]
        rows, rewards = record["rows"], record["rewards"]
        assert len(rows) == prompts and len(rewards) == prompts * GROUP
        seen_rows = [r for call in record["seen"] for r in call["rows"]]
        seen_prompts = [p for call in record["seen"] for p in call["prompts"]]
        seen_versions = {v for call in record["seen"] for v in call["versions"]}
        assert len(record["seen"]) == 1  # one generation (one reward call) per round
        assert seen_rows == [r for r in rows for _ in range(GROUP)]
        assert seen_prompts == [head_prompts[r] for r in seen_rows]
        mine = [(r, s) for st, r, s in outcomes if st == step]
        assert mine == list(zip(seen_rows, rewards, strict=True))
        # epoch mode without selection: each epoch a permutation of its pinned version
        if epoch_left == 0:
            if step > 1:
                pinned = oracle.round_version(step - 1)
            size = oracle.records[pinned]["num_rows"]
            epoch_rows, epoch_left = [], size // prompts
            epoch_size = size
            assert oracle.prompts(pinned) == head_prompts[:size]  # the store only grows
        assert seen_versions == {pinned}, (step, seen_versions, pinned)
        assert all(0 <= r < epoch_size for r in rows)
        epoch_rows += rows
        assert len(set(epoch_rows)) == len(epoch_rows), (step, epoch_rows)
        epoch_left -= 1


def _finished(done: subprocess.CompletedProcess[bytes], what: str) -> None:
    assert done.returncode == 0, f"{what} exited {done.returncode}: {done.stderr.decode()[-3000:]}"


def _run_and_kill(base: Path, options: list[str], rounds: int, first_kill: int) -> int:
    """Start the run, SIGKILL it once it has traced a random round >= ``first_kill`` (after its
    first checkpoint), return that round."""
    at = random.randint(first_kill, rounds - 1)
    base.mkdir(parents=True, exist_ok=True)
    # stderr to a file, not a pipe nobody reads while the run lasts (a full pipe stalls it)
    log = base / "stderr.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            _launch(base, options), env=_env(), stdout=subprocess.DEVNULL, stderr=err
        )
    trace, deadline = base / "trace.jsonl", time.monotonic() + 400
    while len(_lines(trace)) < at:
        if proc.poll() is not None:
            tail = log.read_bytes().decode(errors="replace")[-3000:]
            raise AssertionError(f"the run exited {proc.returncode} before round {at}: {tail}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no round {at} in 400 s: {log.read_text()[-3000:]}")
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return at


SETTINGS = {
    # (options, optimizer steps per round, prompts per round)
    "workers": (["--workers", "2", "--steps", "10"], 1, 2),
    "num_iterations": (["--iterations", "2", "--steps", "12", "--save-steps", "4"], 2, 2),
    "steps_per_generation": (["--spg", "2", "--steps", "12", "--save-steps", "2"], 2, 4),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_setting_resumes_exactly_after_sigkill(tmp_path: Path, name: str) -> None:
    options, per, prompts = SETTINGS[name]
    steps = int(options[options.index("--steps") + 1])
    save = int(options[options.index("--save-steps") + 1]) if "--save-steps" in options else 2
    rounds = steps // per
    clean = tmp_path / "clean"
    done = subprocess.run(_launch(clean, options), env=_env(), capture_output=True, timeout=600)
    _finished(done, "the uninterrupted run")
    oracle = _by_step(clean / "trace.jsonl")
    assert sorted(oracle) == list(range(1, rounds + 1))
    assert [oracle[s]["global_step"] for s in sorted(oracle)] == [
        s * per for s in range(1, rounds + 1)
    ]
    check_against_oracle(clean / "store", oracle, prompts)

    run = tmp_path / "killed"
    at = _run_and_kill(run, options, rounds, save // per + 1)
    done = subprocess.run(_launch(run, options), env=_env(), capture_output=True, timeout=600)
    _finished(done, f"the run resumed after a kill at round {at}")
    resumed = _by_step(run / "trace.jsonl")
    differ = [s for s in oracle if s not in resumed or _same(resumed[s]) != _same(oracle[s])]
    assert differ == [], (name, at, differ)
    assert len(_lines(run / "trace.jsonl")) > rounds or at == rounds  # some rounds trained twice
    check_against_oracle(run / "store", resumed, prompts)
    import dynstate

    a = dynstate.Store.open(str(clean / "store")).snapshot().to_arrow()
    b = dynstate.Store.open(str(run / "store")).snapshot().to_arrow()
    assert a.equals(b)


def test_a_kill_while_saving_keeps_a_whole_checkpoint_under_save_total_limit(
    tmp_path: Path,
) -> None:
    """transformers deletes the checkpoints past ``save_total_limit`` as it saves a new one; it
    must not do so before dynstate's state makes the new one whole. A run killed at that point
    (after transformers' files of checkpoint-4, before dynstate's state) with
    ``save_total_limit=1`` still has checkpoint-2 to resume from, and the resumed run finishes,
    checked against the oracle, with only its last checkpoint left."""
    from dynstate.trl import last_checkpoint

    options = ["--steps", "6", "--save-steps", "2", "--save-total-limit", "1"]
    done = subprocess.run(
        _launch(tmp_path, [*options, "--die-in-save", "4"]), env=_env(), capture_output=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-3000:]
    out = tmp_path / "out"
    assert (out / "checkpoint-4" / "trainer_state.json").exists()  # transformers' files...
    assert not (out / "checkpoint-4" / "dynstate_state.pt").exists()  # ...not dynstate's
    assert last_checkpoint(str(out)) == str(out / "checkpoint-2")

    done = subprocess.run(_launch(tmp_path, options), env=_env(), capture_output=True, timeout=600)
    _finished(done, "the run resumed from checkpoint-2")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-6"
    ]
    assert last_checkpoint(str(out)) == str(out / "checkpoint-6")
    trace = _by_step(tmp_path / "trace.jsonl")
    assert sorted(trace) == list(range(1, 7))
    check_against_oracle(tmp_path / "store", trace, 2)
