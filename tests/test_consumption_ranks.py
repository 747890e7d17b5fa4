"""Dynamic sampling over several ranks (issue 42.2): each rank a real process in a gloo
process group over one local store, filtering its own groups; the ranks draw in lockstep and
deal each sampler step's rows to the ranks that need groups, and rank 0 commits the step's
one record. Killed with SIGKILL at random instants and resumed at 2, 1 and 3 ranks (elastic
resume), no row drawn before a crash is lost or drawn twice: the store's records are checked
against a plain-Python oracle — the sampler's stream folded from the epoch permutation, the
filter recomputed from the pure fake policy — and the exactly-once equation (drawn == trained
+ carried-then-trained + filtered + dropped).

Run as a script (``python tests/test_consumption_ranks.py CONFIG URL CKPT LOGDIR RANK WORLD
PGFILE``) it is one rank of the loop the tests drive."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dynstate import (
    DynamicSampling,
    Store,
    VersionedDataset,
    VersionedSampler,
    consumption_records,
)
from dynstate.loading.permutation import FeistelPermutation

GROUP = 4

CFG: dict[str, Any] = {
    "rows": 40,
    "steps": 10,
    "seed": 5,
    "gen_batch_size": 4,
    "train_groups": 5,
    "max_gen_batches": 3,
    "max_carry": 16,  # >= 3 ranks * 4 - 1, and >= 2 ranks' carries dealt to one rank
    "surplus": "carry",
    "ckpt_every": 2,
}


def scores_of(row_id: int, step: int) -> list[float]:
    """The fake policy, a pure function of the row and the step: about 40 % of the groups all
    agree (filtered by zero variance)."""
    if (row_id * 7 + step * 3) % 5 < 2:
        return [float(row_id % 2)] * GROUP
    return [float((row_id * 31 + step * 17 + k * 13) % 5 >= 2 + (k == 0)) for k in range(GROUP)]


def run(cfg: dict[str, Any], url: str, ckpt: Path, logdir: Path, rank: int, world: int) -> None:
    """One rank of the loop: resume from the checkpoint's step, then per step draw and score
    (logging what this rank scored and trained), rank 0 commits the step's round with every
    rank's outcomes and consumption, and every ``ckpt_every`` steps writes the checkpoint —
    only the step — atomically."""
    dataset = VersionedDataset(url)
    mix: dict[str, Any] = {}
    if cfg.get("mode") == "mix":
        mix = {"mode": "mix", "lag": cfg["lag"], "fresh_share": 0.5, "wait_timeout": 60.0}
    sampler = VersionedSampler(
        dataset,
        seed=cfg["seed"],
        batch_size=cfg["gen_batch_size"],
        drop_last=True,
        num_replicas=world,
        rank=rank,
        **mix,
    )
    dyn = DynamicSampling(
        dataset,
        sampler,
        gen_batch_size=cfg["gen_batch_size"],
        train_groups=cfg["train_groups"],
        max_gen_batches=cfg["max_gen_batches"],
        surplus=cfg["surplus"],
        max_carry=cfg["max_carry"],
        num_workers=cfg.get("num_workers", 0),
    )
    start = dyn.resume(json.loads(ckpt.read_text())["step"] if ckpt.exists() else None)
    store = dataset.store
    for step in range(start, cfg["steps"]):
        scored: list[int] = []

        def score(items: list[dict[str, Any]], at: int, scored: list[int] = scored) -> Any:
            scored.extend(item["id"] for item in items)
            return [scores_of(item["id"], at) for item in items]

        batch = dyn.next_batch(step, score)
        entry = {
            "step": step,
            "world": world,
            "scored": scored,
            "trained": [g.item["id"] for g in batch.groups],
        }
        with open(logdir / f"log.{rank}.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
        if world > 1:
            # every rank's line is written before rank 0 commits: a kill between the commit
            # and another rank's write would leave a record the audit finds no witness for
            import torch.distributed as dist

            dist.barrier()
        if rank == 0:
            fresh = [{"id": 1000 * (step + 1) + k} for k in range(step % 3)] if mix else []
            store.append(
                fresh,
                meta={"step": step},
                outcomes=batch.outcomes(),
                rows_version=batch.rows_version,
                consumption=batch.record,
            )
            if (step + 1) % cfg["ckpt_every"] == 0:
                tmp = ckpt.with_suffix(".tmp")
                tmp.write_text(json.dumps({"step": step}))
                os.replace(tmp, ckpt)


def main(argv: list[str]) -> None:
    cfg, url, ckpt, logdir = json.loads(argv[0]), argv[1], Path(argv[2]), Path(argv[3])
    rank, world, pgfile = int(argv[4]), int(argv[5]), argv[6]
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{pgfile}", rank=rank, world_size=world)
    run(cfg, url, ckpt, logdir, rank, world)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


# -- driving ranks as processes ------------------------------------------------------------------


def _create(url: str, cfg: dict[str, Any]) -> None:
    Store.open(url, create=True).append([{"id": i} for i in range(cfg["rows"])])


def _launch(cfg: dict[str, Any], url: str, tmp: Path, world: int, tag: str) -> list[Any]:
    pgfile = tmp / f"pg.{tag}"
    args = [json.dumps(cfg), url, str(tmp / "ckpt.json"), str(tmp)]
    return [
        subprocess.Popen([sys.executable, __file__, *args, str(r), str(world), str(pgfile)])
        for r in range(world)
    ]


def _wait(procs: list[Any], timeout: float = 300) -> None:
    for p in procs:
        assert p.wait(timeout=timeout) == 0


def _kill(procs: list[Any], tmp: Path, rng: random.Random, steps: int) -> None:
    """SIGKILL one rank at a random instant once rank 0 logged a random number of steps past
    where it started, then the others (a surviving rank would wait on the dead one)."""
    log = tmp / "log.0.jsonl"
    before = len(log.read_text().splitlines()) if log.exists() else 0
    kill_at = before + rng.randint(1, 3)
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if (len(log.read_text().splitlines()) if log.exists() else 0) >= kill_at:
            time.sleep(rng.uniform(0, 0.1))  # any phase: draw, deal, commit, checkpoint
            break
        time.sleep(0.005)
    victim = rng.randrange(len(procs))
    for p in [procs[victim], *procs[:victim], *procs[victim + 1 :]]:
        p.send_signal(signal.SIGKILL)
        p.wait()


# -- the oracle ----------------------------------------------------------------------------------


def _stream(cfg: dict[str, Any], records: list[dict[str, Any]]) -> list[list[int]]:
    """Plain Python: the rows each step must have drawn — ``gen_batches`` sampler steps of
    ``num_replicas * gen_batch_size`` positions each, in the order of the epoch's
    permutation, an epoch ending (drop_last) when fewer positions than a sampler step are
    left — whatever the number of ranks was at each step."""
    n, size = cfg["rows"], cfg["gen_batch_size"]
    epoch, pos = 0, 0
    out = []
    for rec in records:
        world = rec["sampler"]["num_replicas"]
        rows: list[int] = []
        for _ in range(rec["gen_batches"]):
            if n - pos < world * size:
                epoch, pos = epoch + 1, 0
            perm = FeistelPermutation(n, cfg["seed"], epoch)
            rows += [int(r) for r in perm(np.arange(pos, pos + world * size))]
            pos += world * size
        out.append(rows)
        assert (rec["sampler"]["epoch"], rec["sampler"]["position"]) == (epoch, pos), rec["step"]
    return out


def audit(url: str, cfg: dict[str, Any]) -> dict[str, Counter[int]]:
    """Every step's record against the oracle, and the exactly-once equation over the run."""
    records = consumption_records(Store.open(url))
    assert [r["step"] for r in records] == list(range(cfg["steps"]))
    for rec, expected in zip(records, _stream(cfg, records), strict=True):
        step, world = rec["step"], rec["sampler"]["num_replicas"]
        # drawn: exactly the sampler's stream, each row once (no row lost, none drawn twice)
        assert Counter(rec["drawn"]) == Counter(expected), step
        # filtered: exactly the drawn groups whose scores all agree
        flat = [r for r in rec["drawn"] if len(set(scores_of(r, step))) == 1]
        assert Counter(r for r, _ in rec["filtered"]) == Counter(flat), step
        assert all(spread == 0.0 for _, spread in rec["filtered"])
        accepted = Counter(rec["carried_in"]) + Counter(rec["drawn"]) - Counter(flat)
        out = Counter(rec["trained"]) + Counter(r for r, _ in rec["dropped"])
        assert accepted == out + Counter(r for r, _ in rec["carry"]), step
        counts = rec["sampler"].get("carry_by_rank", [len(rec["carry"])])
        assert len(counts) == world and sum(counts) == len(rec["carry"])
        # carried groups keep the scores they were accepted with
        for _, scores in rec["carry"]:
            assert len(set(scores)) > 1
        if rec["gen_batches"] < cfg["max_gen_batches"]:
            assert len(rec["trained"]) == world * cfg["train_groups"], step
    for before, after in itertools.pairwise(records):
        assert Counter(after["carried_in"]) == Counter(r for r, _ in before["carry"])
    total = {
        "drawn": Counter(r for rec in records for r in rec["drawn"]),
        "trained": Counter(r for rec in records for r in rec["trained"]),
        "filtered": Counter(r for rec in records for r, _ in rec["filtered"]),
        "dropped": Counter(r for rec in records for r, _ in rec["dropped"]),
        "carry": Counter(r for r, _ in records[-1]["carry"]),
    }
    assert (
        total["drawn"] == total["trained"] + total["filtered"] + total["dropped"] + total["carry"]
    )
    assert total["filtered"] and total["trained"] and any(rec["carry"] for rec in records)
    # the rows the loops scored and trained are those the records say, step by step
    logged: dict[int, dict[str, Counter[int]]] = {}
    for path in sorted(Path(url).parent.glob("log.*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # torn by the kill
            logged.setdefault(entry["step"], {})[f"{path.name}:{entry['world']}"] = entry
    for rec in records:
        world = rec["sampler"]["num_replicas"]
        last = [e for k, e in logged[rec["step"]].items() if k.endswith(f":{world}")]
        assert Counter(r for e in last for r in e["trained"]) == Counter(rec["trained"])
    return total


@pytest.mark.parametrize("surplus", ["carry", "drop"])
def test_two_ranks_uninterrupted_hold_the_oracle(tmp_path: Path, surplus: str) -> None:
    cfg = {**CFG, "surplus": surplus, "steps": 6}
    url = str(tmp_path / "store")
    _create(url, cfg)
    _wait(_launch(cfg, url, tmp_path, 2, "a"))
    total = audit(url, cfg) if surplus == "carry" else None
    records = consumption_records(Store.open(url))
    if surplus == "drop":
        assert all(not r["carry"] for r in records) and any(r["dropped"] for r in records)
    else:
        assert total is not None and not total["dropped"]
    # one round per step, with every rank's scored groups as outcomes (trained, filtered,
    # carried, dropped), each at the step that scored it
    got = Store.open(url).outcome_records().select(["row", "step", "score"]).to_pylist()
    want = Counter((r, rec["step"], s) for rec in records for r in rec["drawn"]
                   for s in scores_of(r, rec["step"]))  # fmt: skip
    assert Counter((o["row"], o["step"], o["score"]) for o in got) == want
    # rows were dealt across ranks: some step scored a share of another rank
    assert any(r["gen_batches"] > 1 for r in records)


def _comparable(url: str) -> list[dict[str, Any]]:
    out = []
    for rec in consumption_records(Store.open(url)):
        out.append({k: rec[k] for k in ("step", "drawn", "trained", "filtered", "carry")})
        out[-1]["where"] = {k: rec["sampler"].get(k) for k in ("epoch", "position")}
        out[-1]["by_rank"] = rec["sampler"].get("carry_by_rank")
    return out


@pytest.mark.slow
def test_sigkill_then_elastic_resume_is_exactly_once(tmp_path: Path) -> None:
    """Two ranks killed and resumed at two (the steps after the checkpoint equal the
    uninterrupted run's), killed again and resumed at one, killed again and run to the end
    at three: the oracle holds over the whole chain."""
    ref = tmp_path / "ref"
    ref.mkdir()
    _create(str(ref / "store"), CFG)
    _wait(_launch(CFG, str(ref / "store"), ref, 2, "r"))
    audit(str(ref / "store"), CFG)
    expected = _comparable(str(ref / "store"))
    rng = random.Random(7)
    for trial in range(2):
        tmp = tmp_path / f"t{trial}"
        tmp.mkdir()
        url = str(tmp / "store")
        _create(url, CFG)
        _kill(_launch(CFG, url, tmp, 2, "1"), tmp, rng, CFG["steps"])
        _kill(_launch(CFG, url, tmp, 2, "2"), tmp, rng, CFG["steps"])
        ckpt = tmp / "ckpt.json"
        done = json.loads(ckpt.read_text())["step"] if ckpt.exists() else -1
        if done < CFG["steps"] - 1:
            # same number of ranks so far: what is committed equals the uninterrupted run
            assert _comparable(url)[: done + 1] == expected[: done + 1]
        _kill(_launch(CFG, url, tmp, 1, "3"), tmp, rng, CFG["steps"])
        _wait(_launch(CFG, url, tmp, 3, "4"))
        total = audit(url, CFG)
        assert total["drawn"]


@pytest.mark.slow
def test_resume_at_two_ranks_equals_uninterrupted(tmp_path: Path) -> None:
    """Stopped cleanly after a checkpoint and resumed at the same number of ranks, each rank
    gets its own carry back: every step equals the uninterrupted run's."""
    ref = tmp_path / "ref"
    ref.mkdir()
    _create(str(ref / "store"), CFG)
    _wait(_launch(CFG, str(ref / "store"), ref, 2, "r"))
    url = str(tmp_path / "store")
    _create(url, CFG)
    _wait(_launch({**CFG, "steps": 5}, url, tmp_path, 2, "a"))  # commits past its checkpoint
    _wait(_launch(CFG, url, tmp_path, 2, "b"))
    assert _comparable(url) == _comparable(str(ref / "store"))
    audit(url, CFG)


@pytest.mark.slow
def test_mix_mode_two_ranks_sigkill_then_resume_exactly_once(tmp_path: Path) -> None:
    """Mix mode over two ranks, rank 0 committing a round of new rows each step: killed and
    resumed at two ranks, every committed step equals the uninterrupted run's; killed again
    and run to the end at one rank, the exactly-once equation holds over the whole chain and
    the rows committed during an epoch were drawn in it."""
    cfg = {**CFG, "mode": "mix", "lag": 2, "steps": 12}
    ref = tmp_path / "ref"
    ref.mkdir()
    _create(str(ref / "store"), cfg)
    _wait(_launch(cfg, str(ref / "store"), ref, 2, "r"))
    expected = _comparable(str(ref / "store"))
    tmp = tmp_path / "t"
    tmp.mkdir()
    url = str(tmp / "store")
    _create(url, cfg)
    rng = random.Random(3)
    _kill(_launch(cfg, url, tmp, 2, "1"), tmp, rng, cfg["steps"])
    _kill(_launch(cfg, url, tmp, 2, "2"), tmp, rng, cfg["steps"])
    ckpt = tmp / "ckpt.json"
    done = json.loads(ckpt.read_text())["step"] if ckpt.exists() else -1
    assert _comparable(url)[: done + 1] == expected[: done + 1]
    _wait(_launch(cfg, url, tmp, 1, "3"))
    records = consumption_records(Store.open(url))
    assert [r["step"] for r in records] == list(range(cfg["steps"]))
    ids = Store.open(url).snapshot().to_arrow().column("id").to_pylist()
    total = {
        "drawn": Counter(ids[r] for rec in records for r in rec["drawn"]),
        "trained": Counter(ids[r] for rec in records for r in rec["trained"]),
        "filtered": Counter(ids[r] for rec in records for r, _ in rec["filtered"]),
        "carry": Counter(ids[r] for r, _ in records[-1]["carry"]),
    }
    assert total["drawn"] == total["trained"] + total["filtered"] + total["carry"]
    for before, after in itertools.pairwise(records):
        assert Counter(after["carried_in"]) == Counter(r for r, _ in before["carry"])
    fresh = [i for i in total["drawn"] if i >= 1000]
    assert fresh, "no row committed during the run was drawn"
    # each fresh row drawn at most once per epoch: no repeat within the sampler's stream
    # (row ids over 1000 are drawn as fresh rows at most once, then as base rows once per epoch)
    epochs = {r["sampler"]["epoch"] for r in records}
    assert all(total["drawn"][i] <= len(epochs) + 1 for i in fresh)


if __name__ == "__main__":
    main(sys.argv[1:])
