"""Real data-parallel ranks (issue 15): examples/ddp/train.py launched as 2 and 3 gloo
processes over local and loopback-S3 stores, rank 0 committing a round every step; SIGKILLed
at a random step and resumed at the same or another world size from its one checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from dynstate import DynstateError, Store

EXAMPLE = str(Path(__file__).parents[1] / "examples" / "ddp" / "train.py")
BATCH, STEPS, INITIAL, LAG = 2, 10, 21, 3

sys.path.insert(0, str(Path(__file__).parent))
from test_ranks import Ranks  # noqa: E402


def _example():
    spec = importlib.util.spec_from_file_location("ddp_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(url: str, world: int, mode: str) -> list[dict]:
    """The uninterrupted run of the example, its ranks stepped together in this process."""
    example = _example()
    store = Store.open(url, create=True)
    store.append([{"id": i, "text": f"seed {i}"} for i in range(INITIAL)], meta={"import": True})
    ranks = Ranks(url, world, batch=BATCH, mode=mode, seed=0, lag=LAG, fresh_share=0.25)
    lines = []
    for step in range(STEPS):
        epoch, version, batches = ranks.step()
        for rank, ids in enumerate(batches):
            lines.append(dict(step=step, rank=rank, ids=ids, epoch=epoch, version=version))
        example.commit_round(store, step, example.generate(step, batches[0]))
    return lines


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, url: str, folder: Path, *extra: str, ckpt: Path | None = None):
    port = _free_port()
    ckpt = ckpt or folder / "ckpt"
    args = [EXAMPLE, "--store", url, "--ckpt", str(ckpt), "--batch-log", str(folder / "log")]
    args += ["--steps", str(STEPS), "--batch-size", str(BATCH), "--initial-rows", str(INITIAL)]
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, *args, *extra], env=env))
    return procs


def _wait(procs: list[subprocess.Popen], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            assert p.wait(max(1, deadline - time.monotonic())) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _lines(folder: Path) -> list[dict]:
    out = []
    for path in sorted((folder / "log").glob("*.jsonl")) if (folder / "log").exists() else []:
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # torn by the kill
    return out


def _by_step(lines: list[dict]) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for line in lines:
        steps.setdefault(line["step"], []).append(line)
    return steps


def _check_steps(lines: list[dict], url: str, mode: str = "epoch", resumed: bool = False) -> None:
    """Per step: every rank pinned the same version, and the ranks' shares are disjoint; per
    complete epoch: the shares cover the pinned version's rows."""
    epochs: dict[tuple[int, int], Counter] = {}
    for step, ranks in _by_step(lines).items():
        assert len({(r["epoch"], r["version"]) for r in ranks}) == 1, (step, ranks)
        ids = [i for r in sorted(ranks, key=lambda r: r["rank"]) for i in r["ids"]]
        epochs.setdefault((ranks[0]["epoch"], ranks[0]["version"]), Counter()).update(ids)
    store = Store.open(url)
    complete = sorted(epochs)[1 if resumed else 0 : -1]  # a resumed log starts mid-epoch
    for key in complete:
        rows = store.snapshot(key[1]).to_arrow().column("id").to_pylist()
        got = epochs[key]
        if mode == "mix":  # fresh rows took some slots: nothing twice but the padding
            assert sum(got.values()) - len(got) < 3
            continue
        assert set(got) == set(rows)
        assert sum(got.values()) - len(rows) < 3  # only the padding of the last step twice


def _head(url: str) -> int:
    try:
        return Store.open(url).refresh()
    except DynstateError:  # not created yet
        return -1


def _s3_url(request: pytest.FixtureRequest) -> str:
    request.getfixturevalue("s3_endpoint")
    from conftest import s3_url

    return s3_url()


@pytest.mark.slow
def test_ranks_agree_while_another_process_commits(tmp_path):
    """3 ranks over a store another writer appends to all the time: one version per step on
    every rank, shares disjoint and complete."""
    url = str(tmp_path / "store")
    # Steps long enough (10 x 0.15 s) that the writer's rounds land while the run is under
    # way however long the ranks take to start on a loaded machine.
    procs = _launch(3, url, tmp_path, "--step-time", "0.15")
    stop = threading.Event()

    def writer():
        while not stop.is_set() and _head(url) < 1:
            time.sleep(0.01)  # until the run has imported its rows
        store, k = Store.open(url), 0
        while not stop.is_set():
            store.append([{"id": 900_000 + k, "text": "from another process"}])
            k += 1
            time.sleep(0.03)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        _wait(procs)
    finally:
        stop.set()
        thread.join()
    lines = _lines(tmp_path)
    assert len(_by_step(lines)) == STEPS
    assert any(i >= 900_000 for line in lines for i in line["ids"])  # the writer's rows came
    _check_steps(lines, url)


TRIALS = [
    ("local", "epoch", 2, 3, 0),
    ("local", "mix", 3, 2, 1),
    ("s3", "epoch", 2, 2, 0),
    ("s3", "mix", 2, 3, 0),
]


@pytest.mark.slow
@pytest.mark.parametrize("backend,mode,before,after,workers_after", TRIALS)
def test_sigkill_and_resume_at_another_world_size(
    tmp_path, request, backend, mode, before, after, workers_after
):
    rng = random.Random(f"{backend}{mode}{before}{after}")
    if backend == "s3":
        url, ref_url = _s3_url(request), _s3_url(request)
    else:
        url, ref_url = str(tmp_path / "store"), str(tmp_path / "ref-store")
    common = ("--mode", mode, "--step-time", "0.05")
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    ref = _reference(ref_url, before, mode)
    _check_steps(ref, ref_url, mode)
    if mode == "mix":
        assert any(i >= 100_000 for line in ref for i in line["ids"]), "no fresh row was drawn"

    ckpt = tmp_path / "ckpt"  # the killed run's checkpoints, for the resumed one
    procs = _launch(before, url, first_dir, *common, ckpt=ckpt)
    kill_at = rng.randint(1, 3)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if sum(1 for line in _lines(first_dir) if line["rank"] == 0) >= kill_at:
            time.sleep(rng.uniform(0, 0.05))
            break
        time.sleep(0.01)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()
    _wait(_launch(after, url, second_dir, *common, "--num-workers", str(workers_after), ckpt=ckpt))

    first, second = _by_step(_lines(first_dir)), _by_step(_lines(second_dir))
    _check_steps(_lines(second_dir), url, mode, resumed=True)
    start = min(second)
    assert sorted(second) == list(range(start, STEPS))
    ref_steps = _by_step(ref)

    def ids(lines: list[dict]) -> list[int]:
        return [i for r in sorted(lines, key=lambda r: r["rank"]) for i in r["ids"]]

    for step in range(start):  # before the checkpoint: the uninterrupted run's batches
        if step in first:
            assert ids(first[step]) == ids(ref_steps[step])
    if before == after:
        assert {s: ids(second[s]) for s in second} == {s: ids(ref_steps[s]) for s in second}
        assert Store.open(url).snapshot().to_arrow().column("id").to_pylist() == (
            Store.open(ref_url).snapshot().to_arrow().column("id").to_pylist()
        )
        return
    # another world size: the rest of the epoch the checkpoint was in, redistributed
    epoch = second[start][0]["epoch"]
    seen = [i for s in range(start) if ref_steps[s][0]["epoch"] == epoch for i in ids(ref_steps[s])]
    ref_rest = [
        i
        for s in ref_steps
        if s >= start and ref_steps[s][0]["epoch"] == epoch
        for i in ids(ref_steps[s])
    ]
    got_rest = [i for s in second if second[s][0]["epoch"] == epoch for i in ids(second[s])]
    if mode == "epoch":
        new = Counter(i for i in got_rest if i not in seen)
        assert set(new) == set(ref_rest) - set(seen)  # none skipped
        assert max(new.values()) == 1  # none repeated
    else:
        base = [i for i in got_rest if i < 100_000]
        again = len(base) - len(set(base)) + len(set(base) & set(seen))
        assert again < after  # base rows once each, but the last step's padding
        fresh = [i for i in seen + got_rest if i >= 100_000]
        rounds = sorted(
            i
            for i in Store.open(url).snapshot().to_arrow().column("id").to_pylist()
            if i >= 100_000
        )
        assert sorted(fresh) == rounds[: len(fresh)]  # oldest first, each once


def test_start_line_when_another_writer_moved_the_head(tmp_path):
    """The start line reads what the rollback did from its commit record: another writer's
    append between the two reads of the head is no rollback (this raised a TypeError in CI)."""
    import argparse

    from dynstate import rollback

    example = _example()
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"id": i, "text": f"seed {i}"} for i in range(4)], meta={"import": True})
    args = argparse.Namespace(store=url, steps=5)
    before = store.refresh()
    store.append([{"id": 99, "text": "another writer"}])  # lands between the two reads
    line = example.start_line(args, None, "ckpt", 2, store.refresh(), before)
    assert line == f"ddp example: fresh start at step 0 of 5, world size 2, store version 2, {url}"

    for step in range(3):
        example.commit_round(store, step, [{"id": 100 + step, "text": f"r{step}"}])
    before = store.refresh()  # 5
    head = rollback(store, step=0)  # drops the rounds of steps 1 and 2: versions 4-5
    line = example.start_line(args, None, "ckpt", 2, head, before)
    assert line.endswith(
        f"store version 6 (rolled back to version 3, dropping versions 4-5), {url}"
    )
