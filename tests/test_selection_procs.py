"""Selection resumes exactly in real processes: a loader run with a learnability policy in
mix mode (two loader workers, prefetch 2, outcomes committed every step) SIGKILLed at a
random step and resumed; and the same under torchrun with two gloo ranks, killed and
resumed. Both resumed streams equal the uninterrupted run's, step by step and rank by rank,
and so do the final store and its statistics.

This file is also the training script the tests start (``python tests/test_selection_procs.py
--store ... --ckpt ... --batch-log ...``, under torchrun for the ranks): per step each rank
takes its batch, rank 0 commits the step's round with the outcomes of every row the step
trained on (gathered from all ranks) and, every 2 steps, a checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from dynstate import Learnability, Store, VersionedDataset, VersionedSampler, rollback

HERE = Path(__file__).resolve()
INITIAL, STEPS, CKPT_EVERY = 24, 14, 2


def _score(row: int, step: int) -> float:
    return float((row * 7 + step * 3) % 5 >= 2)


def commit_round(store: Store, step: int, trained: list[int]) -> int:
    """The round of ``step``: ``step % 3`` new rows (id = row number) and one outcome per
    row trained, in row order (so the statistics do not depend on the ranks' order)."""
    n = store.snapshot().num_rows
    outcomes = [{"row": r, "step": step, "score": _score(r, step)} for r in sorted(trained)]
    rows = [{"id": n + k} for k in range(step % 3)]
    return store.append(rows, meta={"step": step}, outcomes=outcomes)


def _collate(rows: list[dict]) -> list[int]:
    return [row["id"] for row in rows]


def make_loader(
    url: str,
    batch: int,
    workers: int,
    prefetch: int,
    lag: int,
    rank: int | None = None,
    world: int | None = None,
    drop_last: bool = False,
) -> StatefulDataLoader:
    ds = VersionedDataset(url)
    sampler = VersionedSampler(
        ds,
        mode="mix",
        batch_size=batch,
        lag=lag,
        drop_last=drop_last,
        fresh_share=0.25,
        seed=3,
        num_replicas=world,
        rank=rank,
        select=Learnability(floor=0.05),
        wait_timeout=60,
    )
    extra: dict[str, Any] = {"num_workers": workers}
    if workers:
        extra["prefetch_factor"] = prefetch
    loader = StatefulDataLoader(
        ds, batch_size=batch, sampler=sampler, collate_fn=_collate, drop_last=drop_last, **extra
    )
    sampler.check_loader(loader)
    return loader


def init_store(url: str) -> Store:
    store = Store.open(url, create=True)
    if store.head == 0:
        store.append([{"id": i} for i in range(INITIAL)])
    return store


def _batches(loader: StatefulDataLoader):
    while True:  # epochs follow each other; the sampler numbers them itself
        yield from loader


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--batch-log", required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--lag", type=int, default=1)
    ap.add_argument("--drop-last", action="store_true")
    args = ap.parse_args(argv)
    dist = None
    rank, world = 0, 1
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    store = init_store(args.store) if rank == 0 else None
    if dist is not None:
        dist.barrier()  # the store exists before other ranks open it
    path = os.path.join(args.ckpt, "latest.pt")
    ckpt = torch.load(path, weights_only=True) if os.path.exists(path) else None
    if rank == 0:
        assert store is not None
        rollback(store, version=ckpt["head"] if ckpt else 1)  # before any loader iterates
    if dist is not None:
        dist.barrier()
    loader = make_loader(
        args.store, args.batch, args.workers, args.prefetch, args.lag, drop_last=args.drop_last
    )
    step = 0
    if ckpt is not None:
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"] + 1
    os.makedirs(args.batch_log, exist_ok=True)
    with open(os.path.join(args.batch_log, f"rank{rank}.jsonl"), "a") as log:
        batches = _batches(loader)
        while step < STEPS:
            ids = next(batches)
            log.write(json.dumps({"step": step, "rank": rank, "ids": ids}) + "\n")
            log.flush()
            every = [ids]
            if dist is not None:
                every = [None] * world
                dist.all_gather_object(every, ids)
            if rank == 0:
                assert store is not None
                head = commit_round(store, step, [r for b in every for r in b])
                if step % CKPT_EVERY == 0:
                    tmp = f"{path}.tmp"
                    torch.save({"loader": loader.state_dict(), "step": step, "head": head}, tmp)
                    os.replace(tmp, path)
            step += 1
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()
    return 0


# -- the tests -------------------------------------------------------------------------------


def reference(
    url: str, world: int, batch: int, lag: int, drop_last: bool = False
) -> dict[tuple[int, int], list[int]]:
    """The uninterrupted run, its ranks stepped together in this process and without loader
    workers: {(step, rank): ids}."""
    store = init_store(url)
    loaders = [
        make_loader(url, batch, 0, 1, lag, rank=r, world=world, drop_last=drop_last)
        for r in range(world)
    ]
    iters = [_batches(loader) for loader in loaders]
    out = {}
    for step in range(STEPS):
        every = [next(it) for it in iters]
        for rank, ids in enumerate(every):
            out[step, rank] = ids
        commit_round(store, step, [r for b in every for r in b])
    return out


def _logged(folder: Path) -> list[dict]:
    lines = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # torn by the kill
    return lines


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process and everything under it (loader workers, torchrun's ranks)."""
    import psutil

    kids = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    for kid in kids:
        try:
            kid.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(kids, timeout=30)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parents[1]))


def _kill_and_resume(tmp: Path, command: Any, ranks: int, kill_at: int) -> list[dict]:
    """Start ``command()``, SIGKILL it once every rank logged step ``kill_at``, start it
    again to the end; returns every line both runs logged."""
    first = subprocess.Popen(command(), env=_env(), start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and first.poll() is None:
            done = [line for line in _logged(tmp / "log") if line["step"] == kill_at]
            if len(done) >= ranks:
                break
            time.sleep(0.02)
        assert first.poll() is None, "the run ended before it was killed"
        time.sleep(random.Random(kill_at).random() * 0.2)  # somewhere in the next step
    finally:
        _kill(first)
    assert (tmp / "ckpt" / "latest.pt").exists()
    second = subprocess.run(command(), env=_env(), timeout=240)
    assert second.returncode == 0
    return _logged(tmp / "log")


def _check(
    lines: list[dict], ref: dict[tuple[int, int], list[int]], url: str, ref_url: str
) -> None:
    seen: dict[tuple[int, int], list[int]] = {}
    for line in lines:
        key = (line["step"], line["rank"])
        # a step logged twice (before the kill and after the resume) is the same batch
        assert seen.setdefault(key, line["ids"]) == line["ids"], key
        assert line["ids"] == ref[key], key
    assert seen == ref
    head = lambda u: Store.open(u).snapshot().to_arrow().column("id").to_pylist()  # noqa: E731
    assert head(url) == head(ref_url)
    assert Store.open(url).outcome_stats().equals(Store.open(ref_url).outcome_stats())


def _args(tmp: Path, url: str, *extra: str) -> list[str]:
    args = ["--store", url, "--ckpt", str(tmp / "ckpt"), "--batch-log", str(tmp / "log")]
    return [*args, *extra]


@pytest.mark.slow
def test_loader_with_workers_killed_and_resumed(tmp_path):
    kill_at = random.Random().randint(3, STEPS - 3)
    (tmp_path / "ckpt").mkdir()
    url = str(tmp_path / "store")
    args = _args(tmp_path, url, "--workers", "2", "--prefetch", "2", "--lag", "5")
    lines = _kill_and_resume(tmp_path, lambda: [sys.executable, str(HERE), *args], 1, kill_at)
    ref = reference(str(tmp_path / "ref"), 1, 4, 5)
    _check(lines, ref, url, str(tmp_path / "ref"))
    assert len([line for line in lines if line["step"] <= kill_at]) > kill_at, f"kill at {kill_at}"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_ranks_killed_and_resumed(tmp_path):
    """Two gloo ranks under torchrun: each step the ranks take disjoint slots of one draw
    (the reference's), and after a SIGKILL of torchrun and its ranks the resumed ranks go on
    with exactly the reference's batches."""
    kill_at = random.Random().randint(3, STEPS - 3)
    (tmp_path / "ckpt").mkdir()
    url = str(tmp_path / "store")

    def torchrun() -> list[str]:  # a fresh port each start: the killed one may linger
        run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        run += ["--master-addr", "127.0.0.1", "--master-port", str(_port()), str(HERE)]
        return [*run, *_args(tmp_path, url, "--batch", "3", "--drop-last")]

    lines = _kill_and_resume(tmp_path, torchrun, 2, kill_at)
    ref = reference(str(tmp_path / "ref"), 2, 3, 1, drop_last=True)
    _check(lines, ref, url, str(tmp_path / "ref"))
    # the two ranks' batches are the alternate slots of the draw one rank of 6 makes (with
    # drop_last: without, an epoch's last, partial step pads 2 ranks' shares to equal sizes)
    joint = reference(str(tmp_path / "joint"), 1, 6, 1, drop_last=True)
    for step in range(STEPS):
        assert ref[step, 0] == joint[step, 0][0::2] and ref[step, 1] == joint[step, 0][1::2]


if __name__ == "__main__":
    sys.exit(main())
