"""dynstate.trl in 2 processes through TRL's real ``GRPOTrainer.train()`` under ``torchrun``
(gloo on the CPU) with the example's tiny model (issue 43.1): the README's 2-process command run
as written, killed with SIGKILL at a random step after a checkpoint and rerun, trains every
step on the rows, and with the rewards, of the uninterrupted run, and so does it with 2 loader
workers per process (mix and epoch mode); a checkpoint resumed at
another process count continues the sampler's stream of positions exactly (the oracle: the
stream of an uninterrupted 1-process run); group filtering in 2 processes is refused by name.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from dynstate import Store

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "examples" / "trl" / "README.md"
TRAIN = ROOT / "examples" / "trl" / "train.py"
BIN = Path(sys.executable).parent

pytestmark = [
    pytest.mark.slow,  # each launch is ~15 s of imports and process-group set-up on 2 cores
    pytest.mark.skipif(not (BIN / "torchrun").exists(), reason="torchrun not installed"),
]


def readme_ranks_commands() -> list[str]:
    """The commands of the README's "In 2 processes" block."""
    text = README.read_text()
    section = text[text.index("## In 2 processes") :]
    found = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0]
    return [
        line.strip()
        for line in found.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def _argv(command: str, scratch: Path) -> list[str]:
    argv = shlex.split(command.replace("/tmp/trl-2", str(scratch)))
    if argv[0] == "python":
        argv[0] = sys.executable
    local = BIN / argv[0]
    return [str(local) if local.exists() else argv[0], *argv[1:]]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _torchrun(*options: str) -> list[str]:
    return [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(_port()),
            str(TRAIN), *options]  # fmt: skip


def _python(*options: str) -> list[str]:
    return [sys.executable, str(TRAIN), *options]


def _port() -> int:
    """A free rendezvous port per launch: other tests may run torchrun at the same time."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def _trace(path: Path) -> dict[int, dict[str, Any]]:
    """Each step's last line (a resumed run appends the steps it trains again)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record
    return by_step


def test_readme_two_process_command_resumes_exactly_after_sigkill(tmp_path) -> None:
    train, again = readme_ranks_commands()
    assert train == again and train.startswith("torchrun --nproc-per-node 2 ")
    assert "--steps 30" in train

    clean = tmp_path / "clean"
    argv = _argv(train, clean)
    argv[1:1] = ["--master-port", str(_port())]  # the README's command, on a free port
    _run(argv)
    oracle = _trace(clean / "trace.jsonl")
    assert sorted(oracle) == list(range(1, 31))
    for record in oracle.values():
        # both processes' prompts, 4 each, and their 8 responses each
        assert len(record["rows"]) == 8 and len(record["rewards"]) == 64
    clean_store = Store.open(str(clean / "store"))
    assert clean_store.commit_record(clean_store.refresh()).meta.get("step") == 30

    run = tmp_path / "killed"
    killed_at = _kill_and_rerun(_argv(train, run), run, first=11, steps=30)
    _check_resumed(run, oracle, clean_store, killed_at)


def _check_resumed(run: Path, oracle: dict[int, dict[str, Any]], clean: Store, at: int) -> None:
    """Every step of the killed and rerun ``run`` equals the uninterrupted run's, rows and
    rewards (both processes'), and so do their stores and outcomes."""
    trace = run / "trace.jsonl"
    resumed = _trace(trace)
    assert sorted(resumed) == sorted(oracle)
    assert [s for s in oracle if resumed[s] != oracle[s]] == [], f"killed after {at}"
    assert len(trace.read_text().splitlines()) > len(oracle)  # steps after the checkpoint twice
    store = Store.open(str(run / "store"))
    assert store.snapshot().to_arrow().equals(clean.snapshot().to_arrow())
    # the outcomes rank 0 committed are every process's, as the trace holds them
    stats = store.outcome_stats()
    assert sum(stats.column("attempts").to_pylist()) == 64 * len(oracle)


# the example's script, each process's GRPOConfig and trainer given what its options do not set
WRAPPER = """\
import json, os, runpy, sys
from trl import GRPOConfig
from dynstate.trl import DynstateGRPOTrainer
post, init = GRPOConfig.__post_init__, DynstateGRPOTrainer.__init__
def config(self):
    self.dataloader_num_workers = int(os.environ["DYNSTATE_TEST_WORKERS"])
    post(self)
def trainer(self, *a, **kw):
    init(self, *a, **{**kw, **json.loads(os.environ["DYNSTATE_TEST_TRAINER"])})
    with open(os.environ["DYNSTATE_TEST_SEEN"], "a") as f:  # what each process's loader runs
        f.write(json.dumps([self.accelerator.process_index, self._loader.num_workers]) + "\\n")
GRPOConfig.__post_init__, DynstateGRPOTrainer.__init__ = config, trainer
sys.argv[0] = os.environ["DYNSTATE_TEST_TRAIN"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _wrapped(
    argv: list[str], run: Path, workers: int, trainer: dict[str, Any], monkeypatch: Any
) -> list[str]:
    """``argv`` (a torchrun command of the example) with its script run through
    :data:`WRAPPER`: ``dataloader_num_workers=workers`` (the example sets 0) and the trainer's
    ``trainer`` keywords, passed on in the environment (read by :func:`_env`)."""
    run.mkdir(parents=True, exist_ok=True)
    wrapper = run / "wrapped_train.py"
    wrapper.write_text(WRAPPER)
    at = next(i for i, a in enumerate(argv) if a.endswith("train.py"))
    monkeypatch.setenv("DYNSTATE_TEST_WORKERS", str(workers))
    monkeypatch.setenv("DYNSTATE_TEST_TRAINER", json.dumps(trainer))
    monkeypatch.setenv("DYNSTATE_TEST_TRAIN", str(ROOT / argv[at]))
    monkeypatch.setenv("DYNSTATE_TEST_SEEN", str(run / "seen.jsonl"))
    return [*argv[:at], str(wrapper), *argv[at + 1 :]]


# mix mode's lag must cover what the workers prefetch: num_workers * prefetch_factor + 1
LOADER_WORKERS: dict[str, dict[str, Any]] = {
    "mix": {"mode": "mix", "lag": 5},
    "epoch": {"mode": "epoch"},
}


@pytest.mark.parametrize("mode", sorted(LOADER_WORKERS))
def test_loader_workers_in_two_processes_resume_exactly_after_sigkill(
    tmp_path, monkeypatch, mode: str
) -> None:
    """The README's 2-process command with 2 loader workers per process, SIGKILLed at a random
    step after a checkpoint and rerun: every step's rows and rewards equal those of the
    uninterrupted run without workers (the sampler draws in the trainer's process, the workers
    read rows only and the loader's generator is its own: workers change no row)."""
    train, _ = readme_ranks_commands()
    command = train.replace("--steps 30", "--steps 20")
    trainer = LOADER_WORKERS[mode]
    clean = tmp_path / "clean"
    argv = _wrapped(_argv(command, clean), clean, 0, trainer, monkeypatch)
    argv[1:1] = ["--master-port", str(_port())]
    _run(argv)
    oracle = _trace(clean / "trace.jsonl")
    assert sorted(oracle) == list(range(1, 21))
    run = tmp_path / "killed"
    argv = _wrapped(_argv(command, run), run, 2, trainer, monkeypatch)
    killed_at = _kill_and_rerun(argv, run, first=11, steps=20)
    _check_resumed(run, oracle, Store.open(str(clean / "store")), killed_at)
    # each process of both launches ran its loader with 2 workers, of the oracle's with none
    seen = [json.loads(line) for line in (run / "seen.jsonl").read_text().splitlines()]
    assert sorted(seen) == [[0, 2], [0, 2], [1, 2], [1, 2]], seen
    seen = [json.loads(line) for line in (clean / "seen.jsonl").read_text().splitlines()]
    assert sorted(seen) == [[0, 0], [1, 0]], seen


def _start_and_kill(argv: list[str], trace: Path, kill_after: int) -> None:
    """Launch ``argv`` (a torchrun command without its port) on a free port, and SIGKILL the
    launcher and its workers once ``trace`` has ``kill_after`` steps. The launch's output goes
    to a log beside the trace, quoted if the run ends before it could be killed. A free port
    can be taken by another process (Ray's, in a parallel test) before torchrun binds it: a
    launch that failed on its port, having trained nothing, is started again on another."""
    log = trace.parent.parent / f"{trace.parent.name}-launch.log"
    for attempt in range(3):
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [argv[0], "--master-port", str(_port()), *argv[1:]], cwd=ROOT, env=_env(),
                start_new_session=True, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 300
        while not (trace.exists() and len(trace.read_text().splitlines()) >= kill_after):
            if proc.poll() is not None:
                break
            assert time.monotonic() < deadline, "no step traced in 300 s"
            time.sleep(0.02)
        else:
            _kill_tree(proc)
            return
        text = log.read_text(errors="replace")
        port_taken = "address already in use" in text.lower() or "EADDRINUSE" in text
        if not (port_taken and not trace.exists() and attempt < 2):
            raise AssertionError(f"the run ended before it could be killed:\n{text[-6000:]}")


def _kill_and_rerun(argv: list[str], run: Path, first: int, steps: int) -> int:
    """Launch ``argv`` (a torchrun command) on a free port, SIGKILL the launcher and its workers
    once the trace has a random step in ``first..steps-2`` (after a checkpoint), rerun it to the
    end; the step it was killed after."""
    kill_after = random.Random().randint(first, steps - 2)
    trace = run / "trace.jsonl"
    _start_and_kill(argv, trace, kill_after)
    killed_at = len(trace.read_text().splitlines())
    assert killed_at < steps, killed_at
    _run([argv[0], "--master-port", str(_port()), *argv[1:]])
    return killed_at


# -- another process count ---------------------------------------------------------------------

STREAM = ["--generator", "none", "--select", "uniform", "--save-steps", "3"]


def _positions(trace: dict[int, dict[str, Any]], steps: range, world: int) -> list[int]:
    """The sampler positions the steps consumed, in order: rank r took every world-th position
    of a step's share from the r-th on, and a step's rows are rank 0's, then rank 1's."""
    out: list[int] = []
    for s in steps:
        rows = trace[s]["rows"]
        per = len(rows) // world
        shares = [rows[r * per : (r + 1) * per] for r in range(world)]
        out += [shares[r][i] for i in range(per) for r in range(world)]
    return out


def test_resume_at_another_process_count_continues_the_stream(tmp_path) -> None:
    # the oracle: one process, 9 steps of 4 prompts (36 of the epoch's 48 positions)
    one = tmp_path / "one"
    _run(_python("--store", str(one / "store"), "--out", str(one / "out"), "--steps", "9",
                 "--trace", str(one / "trace.jsonl"), *STREAM))  # fmt: skip
    stream = _positions(_trace(one / "trace.jsonl"), range(1, 10), 1)
    assert len(stream) == 36

    # 2 processes for 3 steps (24 positions), then 1 process from that checkpoint: 3 steps more
    down = tmp_path / "down"
    opts = ["--store", str(down / "store"), "--out", str(down / "out"),
            "--trace", str(down / "trace.jsonl"), *STREAM]  # fmt: skip
    _run(_torchrun(*opts, "--steps", "3"))
    _run(_python(*opts, "--steps", "6"))
    got = _trace(down / "trace.jsonl")
    assert sorted(got) == list(range(1, 7))
    assert [len(got[s]["rows"]) for s in range(1, 7)] == [8, 8, 8, 4, 4, 4]
    assert _positions(got, range(1, 4), 2) + _positions(got, range(4, 7), 1) == stream

    # 1 process for 3 steps (12 positions), then 2 processes from that checkpoint: 3 steps more
    up = tmp_path / "up"
    opts = ["--store", str(up / "store"), "--out", str(up / "out"),
            "--trace", str(up / "trace.jsonl"), *STREAM]  # fmt: skip
    _run(_python(*opts, "--steps", "3"))
    _run(_torchrun(*opts, "--steps", "6"))
    got = _trace(up / "trace.jsonl")
    assert [len(got[s]["rows"]) for s in range(1, 7)] == [4, 4, 4, 8, 8, 8]
    assert _positions(got, range(1, 4), 1) + _positions(got, range(4, 7), 2) == stream
    # the first three steps are the 1-process oracle's, rewards included (same run so far)
    oracle = _trace(one / "trace.jsonl")
    assert [got[s] for s in range(1, 4)] == [oracle[s] for s in range(1, 4)]


FILTER_STEPS = 12


def _kill_tree(proc: Any) -> None:
    """The launcher and its workers, by id: torchrun starts each worker in a session of its
    own, so a killed launcher (or process group) would leave them training."""
    import psutil

    workers = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    for worker in workers:
        try:
            worker.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(workers, timeout=60)


def _outcomes_from_files(store: Path) -> Counter[tuple[int, int, float]]:
    """The oracle: every outcome record in the store's Parquet files, read with pyarrow (an
    uninterrupted run abandons no version, so every file is live)."""
    import pyarrow.parquet as pq

    out: Counter[tuple[int, int, float]] = Counter()
    for path in (store / "data").glob("*.parquet"):
        table = pq.read_table(path)
        if table.column_names == ["row", "step", "score"]:
            out.update(zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True))
    return out


def test_filter_groups_in_two_processes_resume_exactly_after_sigkill(tmp_path) -> None:
    """The README's 2-process command with --filter-groups (12 steps, the exact reward,
    checkpoints every 4), SIGKILLed at a random step after the first checkpoint and rerun:
    every step's rows and rewards (both ranks') equal the uninterrupted run's, the store's
    consumption records and outcomes too; the exactly-once equation holds on them. A resume
    of its checkpoint in one process is refused by name, the store unchanged."""
    from test_trl_filter import _check_records_against_trace, _consumed, whole_checkpoint

    from dynstate import consumption_records

    train, _ = readme_ranks_commands()
    command = train.replace("--steps 30", f"--steps {FILTER_STEPS}")
    command += " --filter-groups --reward exact --save-steps 4"

    def launch(base: Path) -> list[str]:
        argv = _argv(command, base)
        argv[1:1] = ["--master-port", str(_port())]
        return argv

    clean = tmp_path / "clean"
    _run(launch(clean))
    oracle = _trace(clean / "trace.jsonl")
    assert sorted(oracle) == list(range(1, FILTER_STEPS + 1))
    clean_store = Store.open(str(clean / "store"))
    _check_records_against_trace(clean_store, oracle, ranks=2)
    # both ranks trained their 4 groups each step, their rewards in the trace
    assert all(len(oracle[s]["rows"]) == 8 for s in oracle)
    # the outcomes rank 0 committed are every rank's scored groups, as the files hold them
    files = _outcomes_from_files(clean / "store")
    records = consumption_records(clean_store)
    per_step = Counter(step for _, step, _ in files.elements())
    assert per_step == Counter({r["step"]: 8 * len(r["drawn"]) for r in records})
    for r in records:  # the groups drawn at a step and trained at once: their scores are there
        step = oracle[r["step"]]
        carried = len(r["carried_in"])
        for k, row in enumerate(step["rows"]):
            if row in r["carried_in"]:
                continue
            for score in step["rewards"][k * 8 : (k + 1) * 8]:
                assert files[(row, r["step"], score)] > 0, (r["step"], row, carried)

    run = tmp_path / "killed"
    kill_after = random.Random().randint(5, FILTER_STEPS - 1)  # after the checkpoint of step 4
    trace = run / "trace.jsonl"
    _start_and_kill(_argv(command, run), trace, kill_after)
    killed_at = len(trace.read_text().splitlines())
    assert killed_at < FILTER_STEPS, killed_at
    checkpoint = whole_checkpoint(run / "out", killed_at, every=4)
    _run(launch(run))
    resumed = _trace(trace)
    assert sorted(resumed) == sorted(oracle)
    assert [s for s in oracle if resumed[s] != oracle[s]] == [], f"killed after {killed_at}"
    steps = [json.loads(line)["step"] for line in trace.read_text().splitlines()]
    assert steps == [*range(1, killed_at + 1), *range(checkpoint + 1, FILTER_STEPS + 1)]
    store = Store.open(str(run / "store"))
    _check_records_against_trace(store, resumed, ranks=2)
    mine = [_consumed(r) for r in consumption_records(store)]
    assert mine == [_consumed(r) for r in records]
    assert store.snapshot().to_arrow().equals(clean_store.snapshot().to_arrow())
    live = store.outcome_records()
    got = Counter(zip(*(live.column(c).to_pylist() for c in ("row", "step", "score")), strict=True))
    assert got == files

    # its last checkpoint in one process: refused by name before anything changes
    head = store.refresh()
    opts = _argv(command, run)[4:]  # the example's options, without the launcher's
    done = subprocess.run(
        _python(*opts), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode != 0
    assert "StateMismatchError" in done.stderr, done.stderr[-3000:]
    assert "saved with filter_groups by 2 process(es), and this run has 1" in done.stderr
    assert store.refresh() == head


@pytest.mark.skipif(not (BIN / "accelerate").exists(), reason="accelerate not installed")
def test_accelerate_launch_trains_the_same_steps_as_torchrun(tmp_path) -> None:
    """The README's ``accelerate launch --multi_gpu --num_processes 2`` form of the command
    (on a machine without a GPU) starts the same two processes as torchrun: every step's rows
    and rewards equal torchrun's."""
    assert "accelerate launch --multi_gpu --num_processes 2 examples/trl/train.py" in (
        README.read_text()
    )

    def opts(run: Path) -> list[str]:
        return ["--store", str(run / "store"), "--out", str(run / "out"), "--steps", "6",
                "--trace", str(run / "trace.jsonl")]  # fmt: skip

    _run(_torchrun(*opts(tmp_path / "torchrun")))
    launch = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
              "--main_process_port", str(_port())]  # fmt: skip
    _run([*launch, str(TRAIN), *opts(tmp_path / "accelerate")])
    torchrun, accelerate = (
        _trace(tmp_path / n / "trace.jsonl") for n in ("torchrun", "accelerate")
    )
    assert sorted(accelerate) == list(range(1, 7))
    assert all(len(record["rows"]) == 8 for record in accelerate.values())  # 2 processes x 4
    assert accelerate == torchrun
