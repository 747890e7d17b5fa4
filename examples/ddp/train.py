"""Data-parallel training over a dynstate store that grows while it trains.

Every rank runs its own loader over its share of each step; rank 0 generates one round per
step from the step's batches and commits it with the outcome of every row the ranks trained
(``--select learnability`` draws each step's rows by them); every ``--ckpt-every`` steps
rank 0 writes one checkpoint, which restores every rank at any world size::

    torchrun --nproc-per-node 2 examples/ddp/train.py --store /tmp/ddp/store --ckpt /tmp/ddp/ckpt \
        --select learnability
    # kill it at any moment (kill -9), then resume with three ranks:
    torchrun --nproc-per-node 3 examples/ddp/train.py --store /tmp/ddp/store --ckpt /tmp/ddp/ckpt \
        --select learnability

Rank 0 prints one line per start: fresh or resumed (from which checkpoint step and world
size), the first step it runs, the world size and the store version it starts from.

Options are named so that none is a prefix of one of torchrun's own (``--log`` would be taken
as an abbreviation of ``--log-dir``/``--logs-specs`` and refused as ambiguous): torchrun parses
every option on its command line, the script's included.

CPU only (gloo). The "model" is a one-weight linear layer: DDP's gradient all-reduce keeps
the ranks in lockstep, as in a real run. See docs/ddp.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchdata.stateful_dataloader import StatefulDataLoader

import dynstate


def generate(step: int, rows: list[int]) -> list[dict]:
    """A deterministic stand-in for a generator: new tasks from the step (an LLM proposer
    would read the step's batch, gathered from every rank)."""
    return [{"id": 100_000 * (step + 1) + k, "text": f"task {step}-{k}"} for k in range(step % 3)]


def score(task_id: int) -> float:
    """A deterministic stand-in for a reward: a task is solved unless its id is divisible by
    3 (so every task's pass rate is 0 or 1 once tried, and a learnability policy favours the
    tasks never tried)."""
    return float(task_id % 3 != 0)


def commit_round(
    store: dynstate.Store, step: int, rows: list[dict], outcomes: list[dict] | None = None
) -> int:
    """Commit the round of ``step`` once: if the head's lineage already holds it (a restarted
    writer, a rank that retries), return that version instead of committing it twice."""
    for version in dynstate.lineage(store):
        recorded = store.commit_record(version).meta.get("step")
        if recorded == step:
            return version
        if recorded is not None and recorded < step:
            break
    return store.append(rows, meta={"step": step, "generator": "ddp-example"}, outcomes=outcomes)


def save_checkpoint(path: str, state: dict) -> None:
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)  # a crash never leaves half a checkpoint


def start_line(
    args: argparse.Namespace, ckpt: dict | None, path: str, world: int, head: int, before: int
) -> str:
    """What this start does, in one line: a user who killed the run sees where it resumed."""
    where = f"store version {head}"
    # Read what the rollback did from its own commit record, not from head != before: another
    # writer may have committed between the two reads, and then the head moved with no reset.
    record = dynstate.Store.open(args.store).commit_record(head)
    dropped_to = record.meta.get("rollback_from") if head != before else None
    if dropped_to is not None and record.target is not None:  # the killed run's later rounds
        back = record.target
        dropped = (
            f"version {dropped_to}"
            if back + 1 == dropped_to
            else f"versions {back + 1}-{dropped_to}"
        )
        where += f" (rolled back to version {back}, dropping {dropped})"
    where += f", {args.store}"
    if ckpt is None:
        return f"ddp example: fresh start at step 0 of {args.steps}, world size {world}, {where}"
    written = f"world size {ckpt['world']}" if "world" in ckpt else "an earlier run"
    return (
        f"ddp example: resumed at step {ckpt['step'] + 1} of {args.steps} from {path} "
        f"(step {ckpt['step']}, written at {written}), world size {world}, {where}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store URL (a path, s3://...)")
    parser.add_argument("--ckpt", required=True, help="checkpoint folder")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--mode", choices=["epoch", "mix"], default="epoch")
    parser.add_argument("--initial-rows", type=int, default=40)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument(
        "--lag", type=int, default=3, help="mix mode: > num_workers * 2 (the prefetch depth)"
    )
    parser.add_argument("--ckpt-every", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drop-last", action="store_true")
    parser.add_argument(
        "--select",
        choices=["learnability"],
        help="draw each step's rows by a policy over the recorded outcomes (docs/selection.md)",
    )
    parser.add_argument(
        "--batch-log", metavar="DIR", help="folder for one JSON line per rank and step (tests)"
    )
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds of 'training'")
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.ckpt, exist_ok=True)
    ckpt_path = os.path.join(args.ckpt, "latest.pt")
    if rank == 0:
        store = dynstate.Store.open(args.store, create=True)
        if store.head == 0:
            initial = [{"id": i, "text": f"seed {i}"} for i in range(args.initial_rows)]
            store.append(initial, meta={"import": True})
    dist.barrier()
    store = dynstate.Store.open(args.store)

    # Resume: one checkpoint for every rank, whatever the world size that wrote it.
    ckpt = torch.load(ckpt_path, weights_only=True) if os.path.exists(ckpt_path) else None
    if rank == 0:
        # rounds the killed run committed after its checkpoint are generated again
        before = store.refresh()
        if ckpt is None:
            head = dynstate.rollback(store, step=-1)
        else:
            head = dynstate.rollback(store, version=ckpt["head"])
        print(start_line(args, ckpt, ckpt_path, world, head, before), flush=True)
    dist.barrier()

    # the row numbers: rank 0 records every trained row's outcome with the step's round
    dataset = dynstate.VersionedDataset(args.store, row_column="_dynstate_row")
    sampler = dynstate.VersionedSampler(  # num_replicas and rank come from torch.distributed
        dataset,
        seed=args.seed,
        mode=args.mode,
        batch_size=args.batch_size,
        lag=args.lag,
        drop_last=args.drop_last,
        select={"policy": args.select} if args.select else None,
    )
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    step = 0
    if ckpt is not None:
        sampler.load_state_dict(ckpt["sampler"])
        model.module.load_state_dict(ckpt["model"])
        step = ckpt["step"] + 1
    loader = sampler.check_loader(
        StatefulDataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=sampler,
            drop_last=args.drop_last,
            num_workers=args.num_workers,
            prefetch_factor=2 if args.num_workers else None,
            collate_fn=lambda rows: ([r["id"] for r in rows], [r["_dynstate_row"] for r in rows]),
        )
    )
    log = None
    if args.batch_log:
        os.makedirs(args.batch_log, exist_ok=True)
        name = f"rank{rank}-of{world}-pid{os.getpid()}.jsonl"
        log = open(os.path.join(args.batch_log, name), "a")  # noqa: SIM115

    while step < args.steps:
        for ids, rows in loader:
            x = torch.tensor(ids, dtype=torch.float32).unsqueeze(1) / 1e6
            loss = model(x).pow(2).mean()
            loss.backward()  # the all-reduce: every rank is at this step
            optimizer.step()
            optimizer.zero_grad()
            trained: list[list[tuple[int, int]]] = [[] for _ in range(world)]
            dist.all_gather_object(trained, list(zip(rows, ids, strict=True)))
            time.sleep(args.step_time)
            if log is not None:
                line = {"step": step, "rank": rank, "world": world, "ids": ids}
                line.update(epoch=sampler.epoch, version=sampler.version)
                log.write(json.dumps(line) + "\n")
                log.flush()
            if rank == 0:
                outcomes = [
                    {"row": row, "step": step, "score": score(task)}
                    for share in trained
                    for row, task in share
                ]
                commit_round(store, step, generate(step, ids), outcomes)
                if step % args.ckpt_every == 0:
                    state = dynstate.find_sampler_state(loader.state_dict())
                    save_checkpoint(
                        ckpt_path,
                        {
                            "sampler": state,
                            "model": model.module.state_dict(),
                            "step": step,
                            "head": store.head,
                            "world": world,
                        },
                    )
            step += 1
            if step >= args.steps:
                break
    dist.barrier()
    # DDP holds the process group: drop it first, so that destroy_process_group stops gloo's
    # threads while the interpreter is whole. Left to the interpreter's exit, a rank can abort
    # ("terminate called without an active exception": 4 of 9 runs at 3 ranks on a loaded
    # 2-core machine, 0 of 30 with this).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
