"""dynstate.trl in 2 processes through TRL's real ``GRPOTrainer.train()`` under ``torchrun``
(gloo on the CPU) with the example's tiny model (issue 43.1): the README's 2-process command run
as written, killed with SIGKILL at a random step after a checkpoint and rerun, trains every
step on the rows, and with the rewards, of the uninterrupted run; a checkpoint resumed at
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
    kill_after = random.Random().randint(11, 28)  # after the checkpoint of step 10
    argv = _argv(train, run)
    argv[1:1] = ["--master-port", str(_port())]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    trace = run / "trace.jsonl"
    deadline = time.monotonic() + 300
    while not (trace.exists() and len(trace.read_text().splitlines()) >= kill_after):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # the launcher and both workers, by id: torchrun starts each worker in a session of its
    # own, so a killed launcher (or process group) would leave them training
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
    killed_at = len(trace.read_text().splitlines())
    assert killed_at < 30, killed_at
    argv = _argv(again, run)
    argv[1:1] = ["--master-port", str(_port())]
    _run(argv)
    resumed = _trace(trace)
    assert sorted(resumed) == sorted(oracle)
    assert [s for s in oracle if resumed[s] != oracle[s]] == [], f"killed after {killed_at}"
    assert len(trace.read_text().splitlines()) > 30  # the steps after the checkpoint twice
    store = Store.open(str(run / "store"))
    assert store.snapshot().to_arrow().equals(clean_store.snapshot().to_arrow())
    # the outcomes rank 0 committed are every process's, as the trace holds them
    stats = store.outcome_stats()
    attempts = sum(stats.column("attempts").to_pylist())
    assert attempts == 30 * 64


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


def test_filter_groups_in_two_processes_is_refused(tmp_path) -> None:
    done = subprocess.run(
        _torchrun("--store", str(tmp_path / "store"), "--out", str(tmp_path / "out"),
                  "--steps", "2", "--filter-groups"),
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode != 0
    assert "InvalidDataError" in done.stderr
    assert "runs filter_groups in 2 processes" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("checkpoint-*"))
