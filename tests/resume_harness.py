"""A training loop that grows its data while it trains, used by the resume tests both in
process and as a subprocess killed with SIGKILL (``python tests/resume_harness.py ...``).

Per step: fetch the batch, log its row ids, commit the step's round (meta step), and every
``ckpt_every`` steps save a checkpoint {loader state, step, head} atomically — the generic
recommended sequence: commit, then checkpoint. Resume: load the latest checkpoint, roll the
store back to its head, load the loader state, continue at the next step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from dynstate import Store, VersionedDataset, VersionedSampler, rollback


@dataclass
class Config:
    url: str
    steps: int = 12
    batch_size: int = 4
    seed: int = 0
    mode: str = "epoch"
    num_workers: int = 0
    initial_rows: int = 10
    growth: int = 3  # rows per round vary in 0..growth
    round_size: int | None = None  # rows per round, fixed (instead of growth)
    ckpt_every: int = 2
    fresh_share: float = 0.5
    drop_last: bool = False  # the loader's, passed to the sampler too
    prefetch_factor: int = 2  # with workers
    snapshot_every: int = 1  # StatefulDataLoader's snapshot_every_n_steps
    lag: int | None = None  # mix mode; None: the smallest the loader allows
    num_replicas: int = 1  # ranks, simulated in one process by rank_batches()
    # False: VersionedSampler(ds, seed=...) without batch_size, taught by check_loader(loader)
    sampler_batch_size: bool = True
    # rounds of steps after this one get other rows, as a non-deterministic generator would:
    # a crashed run's abandoned rounds then differ from the resumed run's
    salt_after: int | None = None


def round_rows(step: int, cfg: Config) -> list[dict]:
    # deterministic generator: the rows of a round depend only on the step
    n = (step * 7 + cfg.seed) % (cfg.growth + 1) if cfg.round_size is None else cfg.round_size
    salt = 50_000 if cfg.salt_after is not None and step > cfg.salt_after else 0
    return [{"id": 100_000 * (step + 1) + salt + k, "text": f"task {step}-{k}"} for k in range(n)]


def init_store(cfg: Config) -> Store:
    store = Store.open(cfg.url, create=True)
    if store.head == 0:
        store.append([{"id": i, "text": f"seed {i}"} for i in range(cfg.initial_rows)])
    return store


def _collate(rows: list[dict]) -> list[int]:
    return [row["id"] for row in rows]


def make_loader(cfg: Config, rank: int = 0) -> tuple[VersionedSampler, StatefulDataLoader]:
    dataset = VersionedDataset(cfg.url)
    extra: dict = {"snapshot_every_n_steps": cfg.snapshot_every}
    depth = 0
    if cfg.num_workers:
        extra.update(prefetch_factor=cfg.prefetch_factor, persistent_workers=True)
        depth = cfg.num_workers * cfg.prefetch_factor
    sampler = VersionedSampler(
        dataset,
        seed=cfg.seed,
        mode=cfg.mode,
        batch_size=cfg.batch_size if cfg.sampler_batch_size else None,
        fresh_share=cfg.fresh_share,
        lag=cfg.lag if cfg.lag is not None else depth + 1,
        drop_last=cfg.drop_last if cfg.sampler_batch_size else False,
        num_replicas=cfg.num_replicas,
        rank=rank,
        wait_timeout=60.0,
    )
    loader = StatefulDataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        collate_fn=_collate,
        drop_last=cfg.drop_last,
        **extra,
    )
    # With batch_size given, check_loader compares; without, it is how the sampler learns the
    # loader's batches (nothing else teaches it).
    return sampler, sampler.check_loader(loader)


def _save(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def latest_checkpoint(ckpt_dir: str) -> dict | None:
    path = os.path.join(ckpt_dir, "latest.pt")
    if not os.path.exists(path):
        return None
    return torch.load(path, weights_only=True)


def train(
    cfg: Config,
    *,
    ckpt_dir: str | None = None,
    stop_after: int | None = None,
    resume: bool = False,
    log=None,
    epochs: list[tuple[int, int, int, int]] | None = None,
) -> dict[int, list[int]]:
    """Run steps until cfg.steps; returns {step: row ids}. ``stop_after`` returns right after
    that step's checkpoint/commit (an orderly stop, for in-process tests). ``epochs`` collects
    (len(loader), len(sampler), batches, indices) of every complete pass over the loader."""
    store = init_store(cfg)
    sampler, loader = make_loader(cfg)
    step = 0
    if resume and ckpt_dir:
        ckpt = latest_checkpoint(ckpt_dir)
        if ckpt is None:
            # killed before its first checkpoint: start again from before any round
            rollback(store, step=-1)
        else:
            rollback(store, version=ckpt["head"])
            loader.load_state_dict(ckpt["loader"])
            step = ckpt["step"] + 1
    batches: dict[int, list[int]] = {}
    while step < cfg.steps:
        lengths, seen = (len(loader), len(sampler)), [0, 0]
        for ids in loader:
            seen[0] += 1
            seen[1] += len(ids)
            batches[step] = ids
            if log is not None:
                log.write(json.dumps({"step": step, "ids": ids}) + "\n")
                log.flush()
            store.append(round_rows(step, cfg), meta={"step": step})
            if ckpt_dir and step % cfg.ckpt_every == 0:
                state = {"loader": loader.state_dict(), "step": step, "head": store.head}
                _save(os.path.join(ckpt_dir, "latest.pt"), state)
            if step == stop_after:
                return batches
            step += 1
            if step >= cfg.steps:
                break
        else:
            if epochs is not None:
                epochs.append((*lengths, *seen))
    return batches


def head_ids(url: str) -> list[int]:
    return Store.open(url).snapshot().to_arrow().column("id").to_pylist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="Config as JSON")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    cfg = Config(**json.loads(args.config))
    with open(args.log, "a") as log:
        train(cfg, ckpt_dir=args.ckpt_dir, resume=args.resume, log=log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
