"""Resume equivalence: batches before a stop + batches after restoring a fresh loader from the
saved state equal the uninterrupted run — in process (hypothesis) and across SIGKILL."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from dynstate import (
    StateMismatchError,
    Store,
    VersionCollectedError,
    VersionedDataset,
    VersionedSampler,
    find_sampler_state,
)

sys.path.insert(0, str(Path(__file__).parent))
import resume_harness as h

HARNESS = str(Path(__file__).parent / "resume_harness.py")


def _mem_url() -> str:
    return f"memory://resume/{uuid.uuid4().hex}"


def _check_resume(cfg: h.Config, stop: int, tmp: Path, ckpt_every: int = 1) -> None:
    """Stop after step ``stop``; the last checkpoint may be older, so the resumed run must
    roll back the rounds committed after it."""
    ref_cfg = dataclasses.replace(
        cfg,
        url=_mem_url() if cfg.url.startswith("memory") else str(tmp / f"ref-{uuid.uuid4().hex}"),
    )
    reference = h.train(ref_cfg)
    ckpt = tmp / uuid.uuid4().hex
    ckpt.mkdir()
    cfg = dataclasses.replace(cfg, ckpt_every=ckpt_every)
    last_ckpt = stop - stop % ckpt_every
    first = h.train(
        dataclasses.replace(cfg, salt_after=last_ckpt), ckpt_dir=str(ckpt), stop_after=stop
    )
    second = h.train(cfg, ckpt_dir=str(ckpt), resume=True)
    assert {s: first[s] for s in range(last_ckpt + 1)} == {
        s: reference[s] for s in range(last_ckpt + 1)
    }
    # the abandoned rounds (other rows) must not reach the resumed run
    assert {**{s: first[s] for s in range(last_ckpt + 1)}, **second} == reference
    assert h.head_ids(cfg.url) == h.head_ids(ref_cfg.url)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    batch_size=st.integers(1, 6),
    seed=st.integers(0, 2**32),
    mode=st.sampled_from(["epoch", "mix"]),
    growth=st.integers(0, 5),
    initial=st.integers(1, 12),
    stop=st.integers(0, 10),
    share=st.sampled_from([0.25, 0.5, 1.0]),
    ckpt_every=st.integers(1, 3),
)
def test_resume_equals_uninterrupted_in_process(
    tmp_path_factory, batch_size, seed, mode, growth, initial, stop, share, ckpt_every
):
    cfg = h.Config(
        url=_mem_url(),
        steps=12,
        batch_size=batch_size,
        seed=seed,
        mode=mode,
        growth=growth,
        initial_rows=initial,
        fresh_share=share,
    )
    _check_resume(cfg, stop, tmp_path_factory.mktemp("ck"), ckpt_every)


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    batch_size=st.integers(2, 4),
    seed=st.integers(0, 1000),
    mode=st.sampled_from(["epoch", "mix"]),
    stop=st.integers(1, 8),
)
def test_resume_equals_uninterrupted_with_workers(tmp_path_factory, batch_size, seed, mode, stop):
    tmp = tmp_path_factory.mktemp("w")
    cfg = h.Config(
        url=str(tmp / "store"), steps=10, batch_size=batch_size, seed=seed, mode=mode, num_workers=2
    )
    _check_resume(cfg, stop, tmp)


# -- SIGKILL at random steps and phases ------------------------------------------------------


def _run_killed(cfg: h.Config, tmp: Path, rng: random.Random) -> dict[int, list[int]]:
    """Run the loop in a subprocess, SIGKILL it at a random instant, resume in fresh processes
    until it completes; returns every (step -> ids) any process logged, checking that a
    step logged twice was the same batch both times."""
    ckpt, log = tmp / "ckpt", tmp / "batches.jsonl"
    ckpt.mkdir(exist_ok=True)
    args = [
        sys.executable,
        HARNESS,
        "--config",
        json.dumps(dataclasses.asdict(cfg)),
        "--ckpt-dir",
        str(ckpt),
        "--log",
        str(log),
    ]
    proc = subprocess.Popen(args)
    kill_at = rng.randint(1, cfg.steps - 2)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        lines = log.read_text().splitlines() if log.exists() else []
        if len(lines) >= kill_at:
            time.sleep(rng.uniform(0, 0.05))  # land in any phase: fetch, commit, checkpoint
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    subprocess.run([*args, "--resume"], check=True, timeout=300)
    seen: dict[int, list[int]] = {}
    for line in log.read_text().splitlines():
        if not line.strip():
            continue  # a line torn by the kill
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec["step"] in seen:
            assert seen[rec["step"]] == rec["ids"], f"step {rec['step']} differs after resume"
        seen[rec["step"]] = rec["ids"]
    return seen


KILL_CASES = [
    ("local", "epoch", 0),
    ("local", "mix", 0),
    ("local", "epoch", 2),
    ("local", "mix", 2),
    ("s3", "epoch", 0),
    ("s3", "mix", 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("backend,mode,workers", KILL_CASES)
def test_sigkill_then_resume_is_exact(tmp_path, request, backend, mode, workers):
    trials = 4 if backend == "local" else 2
    rng = random.Random(f"{backend}-{mode}-{workers}")
    for trial in range(trials):
        tmp = tmp_path / f"t{trial}"
        tmp.mkdir()
        if backend == "s3":
            request.getfixturevalue("s3_endpoint")
            from conftest import s3_url

            url, ref_url = s3_url(), s3_url()
        else:
            url, ref_url = str(tmp / "store"), str(tmp / "ref")
        cfg = h.Config(
            url=url, steps=9, batch_size=3, seed=trial, mode=mode, num_workers=workers, ckpt_every=2
        )
        reference = h.train(dataclasses.replace(cfg, url=ref_url))
        seen = _run_killed(cfg, tmp, rng)
        assert seen == reference
        assert h.head_ids(url) == h.head_ids(ref_url)


@pytest.mark.slow
def test_sigkill_then_resume_is_exact_without_sampler_batch_size(tmp_path):
    """Issue 19.10 across a real SIGKILL: a sampler built without batch_size and taught the
    loader's batches by check_loader, one worker, snapshot every 3 steps, a store growing
    every step."""
    rng = random.Random("readme-sampler")
    for trial in range(3):
        tmp = tmp_path / f"t{trial}"
        tmp.mkdir()
        cfg = h.Config(
            url=str(tmp / "store"),
            steps=12,
            batch_size=8,
            seed=trial,
            num_workers=1,
            prefetch_factor=1,
            snapshot_every=3,
            initial_rows=37,
            round_size=2,
            ckpt_every=2,
            sampler_batch_size=False,
        )
        reference = h.train(dataclasses.replace(cfg, url=str(tmp / "ref")))
        seen = _run_killed(cfg, tmp, rng)
        assert seen == reference
        assert h.head_ids(cfg.url) == h.head_ids(str(tmp / "ref"))


# -- workers see new rows ------------------------------------------------------------------


class InMemoryGrowingDataset(Dataset):
    """The old design: rows appended to a list in the main process."""

    def __init__(self, rows):
        self.rows = list(rows)

    def append(self, rows):
        self.rows.extend(rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class _ListSampler(torch.utils.data.Sampler):
    """Visits every row the main process's dataset has when an epoch starts."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return iter(range(len(self.dataset)))

    def __len__(self):
        return len(self.dataset)


def _two_epochs_with_growth(dataset, sampler, append):
    loader = DataLoader(
        dataset,
        batch_size=4,
        sampler=sampler,
        num_workers=2,
        persistent_workers=True,
        collate_fn=lambda rows: [r["id"] for r in rows],
    )
    first = [i for batch in loader for i in batch]
    append([{"id": 1000 + k} for k in range(5)])
    second = [i for batch in loader for i in batch]
    return first, second


def test_workers_see_rows_appended_after_they_started(tmp_path):
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(8)])
    ds = VersionedDataset(url)
    first, second = _two_epochs_with_growth(ds, VersionedSampler(ds, shuffle=False), store.append)
    assert first == list(range(8))
    assert second == list(range(8)) + [1000 + k for k in range(5)]


@pytest.mark.xfail(
    strict=True,
    reason="the bug of the old in-memory design: workers keep "
    "their own copy and never see appended rows",
)
def test_plain_in_memory_dataset_loses_rows_in_workers():
    ds = InMemoryGrowingDataset([{"id": i} for i in range(8)])
    _first, second = _two_epochs_with_growth(ds, _ListSampler(ds), ds.append)
    assert second == list(range(8)) + [1000 + k for k in range(5)]


# -- state safety ----------------------------------------------------------------------------


def test_state_is_plain_and_loads_weights_only(tmp_path):
    url = str(tmp_path / "s")
    Store.open(url, create=True).append([{"id": i} for i in range(20)])
    ds = VersionedDataset(url)
    sampler = VersionedSampler(ds, seed=3)
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(ds, batch_size=4, sampler=sampler)
    it = iter(loader)
    next(it)
    torch.save(loader.state_dict(), tmp_path / "data.pt")
    state = find_sampler_state(torch.load(tmp_path / "data.pt", weights_only=True))
    assert state["store_id"] == ds.store_id and state["position"] == 4 and state["version"] == 1


def test_state_from_another_store_is_refused(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for url in (a, b):
        Store.open(url, create=True).append([{"id": 1}])
    sa = VersionedSampler(VersionedDataset(a))
    list(sa)
    sb = VersionedSampler(VersionedDataset(b))
    with pytest.raises(StateMismatchError, match="belongs to store"):
        sb.load_state_dict(sa.state_dict())


def test_state_naming_a_collected_version_is_refused(tmp_path):
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"id": 1}])
    sampler = VersionedSampler(VersionedDataset(url))
    list(sampler)
    state = sampler.state_dict()
    for i in range(3):
        store.append([{"id": 2 + i}])
    from dynstate.maintenance.gc import collect_garbage

    collect_garbage(store, keep=1, grace_s=0, dry_run=False)
    fresh = VersionedSampler(VersionedDataset(url))
    with pytest.raises(VersionCollectedError):
        fresh.load_state_dict(state)


@pytest.mark.parametrize("given", [True, False])
def test_resume_with_different_num_workers(tmp_path, given):
    """The sampler state alone restores the position, whatever the worker count — also for
    a sampler built without batch_size, which takes the batches it counted from the state
    and checks them against the new loader (check_loader)."""
    cfg = h.Config(
        url=str(tmp_path / "s"), steps=8, batch_size=3, num_workers=0, sampler_batch_size=given
    )
    ref = h.train(dataclasses.replace(cfg, url=str(tmp_path / "ref")))
    h.init_store(cfg)
    _sampler, loader = h.make_loader(cfg)
    store = Store.open(cfg.url)
    got = {}
    it = iter(loader)
    for step in range(4):
        got[step] = next(it)
        store.append(h.round_rows(step, cfg), meta={"step": step})
    saved = find_sampler_state(loader.state_dict())
    del it, loader
    sampler2, loader2 = h.make_loader(dataclasses.replace(cfg, num_workers=2, mode="epoch"))
    sampler2.load_state_dict(saved)
    step = 4
    while step < cfg.steps:
        for ids in loader2:
            got[step] = ids
            store.append(h.round_rows(step, cfg), meta={"step": step})
            step += 1
            if step >= cfg.steps:
                break
    assert got == ref
    assert os.path.exists(cfg.url)


def test_sampler_prefetches_the_next_shards_of_a_remote_store(s3_endpoint, tmp_path):
    from conftest import s3_url

    url = s3_url()
    store = Store.open(url, create=True)
    for start in range(0, 2100, 100):
        store.append([{"id": i} for i in range(start, start + 100)])
    ds = VersionedDataset(url, cache_dir=str(tmp_path / "cache"))
    sampler = VersionedSampler(ds, seed=5)
    it = iter(sampler)
    next(it)  # starts the epoch and the prefetch of the block after the first
    snap = store.snapshot()
    import numpy as np

    from dynstate.loading.sampler import FeistelPermutation

    following = FeistelPermutation(snap.num_rows, 5, 0)(np.arange(1024, 2048)).tolist()
    wanted = {snap.shards[snap.locate(i)[0]].sha256 for i in following}
    folder = tmp_path / "cache" / store.store_id
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        have = (
            {p.name.split(".")[0] for p in folder.glob("*.parquet")} if folder.exists() else set()
        )
        if wanted <= have:
            break
        time.sleep(0.05)
    assert wanted <= have
    no_prefetch = VersionedSampler(
        VersionedDataset(url, cache_dir=str(tmp_path / "c2")), seed=5, prefetch=False
    )
    next(iter(no_prefetch))
    time.sleep(0.5)
    assert not (tmp_path / "c2").exists()
