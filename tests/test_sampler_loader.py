"""The sampler under torchdata's real StatefulDataLoader: its step stays the loader's step and
its length the loader's length, whatever drop_last, batch size, epoch length, num_workers,
prefetch_factor and snapshot interval; mix mode cannot hang on a partial last batch; and a
resume in the middle of any of these runs continues exactly as the uninterrupted run."""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from pathlib import Path

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from dynstate import (
    InvalidDataError,
    StateMismatchError,
    Store,
    VersionedDataset,
    VersionedSampler,
    decode_index,
)

sys.path.insert(0, str(Path(__file__).parent))
import resume_harness as h


def _check_run(cfg: h.Config, stop: int, ckpt_every: int, tmp: Path) -> dict[int, list[int]]:
    """Uninterrupted run vs. a run stopped after ``stop`` (last checkpoint possibly older, its
    later rounds salted so that a leak shows) and resumed in a fresh loader."""
    epochs: list[tuple[int, int, int, int]] = []
    ref_cfg = dataclasses.replace(cfg, url=str(tmp / f"ref-{uuid.uuid4().hex}"))
    reference = h.train(ref_cfg, epochs=epochs)
    assert len(reference) == cfg.steps
    assert len(epochs) >= 2, "the run must cross epoch boundaries"
    for n_loader, n_sampler, batches, indices in epochs:
        assert (n_loader, n_sampler) == (batches, indices), (cfg, epochs)
    ckpt = tmp / uuid.uuid4().hex
    ckpt.mkdir()
    run = dataclasses.replace(cfg, ckpt_every=ckpt_every, url=str(tmp / f"run-{uuid.uuid4().hex}"))
    last = stop - stop % ckpt_every
    first = h.train(dataclasses.replace(run, salt_after=last), ckpt_dir=str(ckpt), stop_after=stop)
    second = h.train(run, ckpt_dir=str(ckpt), resume=True)
    assert {s: first[s] for s in range(last + 1)} == {s: reference[s] for s in range(last + 1)}
    assert {**{s: first[s] for s in range(last + 1)}, **second} == reference
    assert h.head_ids(run.url) == h.head_ids(ref_cfg.url)
    return reference


def _round_of(row_id: int) -> int | None:
    return row_id // 100_000 - 1 if row_id >= 100_000 else None


# mode, loader drop_last, batch size, num_workers, prefetch_factor, snapshot_every_n_steps:
# every listed value of each setting, in epoch and mix mode, both with and without drop_last.
SWEEP = [
    ("epoch", False, 3, 0, 1, 1),
    ("epoch", True, 4, 0, 1, 3),
    ("epoch", False, 4, 1, 4, 3),
    ("epoch", True, 3, 1, 1, 1),
    ("epoch", False, 3, 3, 1, 3),
    ("epoch", True, 4, 3, 4, 1),
    ("mix", False, 4, 0, 1, 3),
    ("mix", True, 3, 0, 1, 1),
    ("mix", False, 3, 1, 1, 3),
    ("mix", True, 4, 1, 4, 1),
    ("mix", False, 4, 3, 1, 1),
    ("mix", True, 3, 3, 1, 3),
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on 2 cores
@pytest.mark.parametrize("case", range(len(SWEEP)))
def test_loader_sweep_resumes_exactly(tmp_path, case):
    mode, drop_last, batch, workers, prefetch, snap = SWEEP[case]
    lag = workers * prefetch + 1
    steps = max(14, lag + 9) if mode == "mix" else 14  # mix: fresh rows drawn after the resume
    cfg = h.Config(
        url="",
        steps=steps,
        batch_size=batch,
        seed=case,
        mode=mode,
        num_workers=workers,
        prefetch_factor=prefetch,
        snapshot_every=snap,
        drop_last=drop_last,
        initial_rows=12 if batch == 4 else 10,  # an epoch the batch divides, and one it doesn't
        fresh_share=0.5,
    )
    stop = lag + 2 + case % 3 if mode == "mix" else 4 + case % 5
    reference = _check_run(cfg, stop, 2 + case % 2, tmp_path)
    if mode == "mix":
        # fresh rows really were drawn after the resume point, within a few steps of their round
        fresh = [
            (t, r)
            for t in range(stop, steps)
            for r in map(_round_of, reference[t])
            if r is not None and t - r <= lag + 2
        ]
        assert fresh, reference


@pytest.mark.parametrize("prefetch", [1, 4])
def test_epoch_mode_resume_from_a_snapshot_before_the_epoch_began(tmp_path, prefetch):
    """Issue 12's case: 37 rows, +2 per step, batch 8, one worker, snapshot every 3 steps,
    resumed after step 7 from the checkpoint of step 6, whose loader snapshot predates the
    epoch: the resumed epoch must pin the version the uninterrupted one pinned."""
    cfg = h.Config(
        url="",
        steps=12,
        batch_size=8,
        num_workers=1,
        prefetch_factor=prefetch,
        snapshot_every=3,
        initial_rows=37,
        round_size=2,
    )
    _check_run(cfg, 7, 2, tmp_path)


def test_mix_mode_with_drop_last_crosses_epochs_without_waiting(tmp_path):
    """Issue 12: 37 rows, batch 8, lag 1, no workers, drop_last=True used to wait at the
    second epoch for the round of a step the loader had dropped."""
    cfg = h.Config(
        url=str(tmp_path / "s"),
        steps=14,
        batch_size=8,
        mode="mix",
        drop_last=True,
        initial_rows=37,
        round_size=2,
        lag=1,
    )
    epochs: list[tuple[int, int, int, int]] = []
    batches = h.train(cfg, epochs=epochs)
    assert len(batches) == 14 and all(len(ids) == 8 for ids in batches.values())
    assert epochs[0][:3] == (4, 32, 4)  # 37 rows: 4 whole batches, the partial one dropped
    assert all((n_loader, n_sampler) == (b, i) for n_loader, n_sampler, b, i in epochs)


def test_mix_mode_len_counts_what_it_yields(tmp_path):
    """len(sampler) used to report the base rows only (16) while 28 indices came."""
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"id": i} for i in range(16)])
    ds = VersionedDataset(store)
    sampler = VersionedSampler(ds, mode="mix", batch_size=4, fresh_share=0.5, lag=1)
    got, step, lengths = [], 0, set()
    for index in sampler:
        got.append(index)
        if len(got) < 16:  # after the last index the epoch is over: len() tells the next one's
            lengths.add(len(sampler))
        if len(got) % 4 == 0:
            store.append([{"id": 100 + 10 * step + k} for k in range(3)], meta={"step": step})
            step += 1
    assert len(got) == 16 and lengths == {16}
    assert sum(1 for i in got if ds[i]["id"] >= 100) > 0


def _loader(sampler: VersionedSampler, **kwargs) -> StatefulDataLoader:
    return StatefulDataLoader(sampler.dataset, sampler=sampler, **kwargs)


def test_check_loader_refuses_a_lag_within_the_prefetch_depth(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"id": i} for i in range(8)])
    ds = VersionedDataset(store)
    sampler = VersionedSampler(ds, mode="mix", batch_size=2, lag=4)
    with pytest.raises(InvalidDataError, match="num_workers=2 and prefetch_factor=2"):
        sampler.check_loader(_loader(sampler, batch_size=2, num_workers=2, prefetch_factor=2))
    ok = _loader(sampler, batch_size=2, num_workers=1, prefetch_factor=3)
    assert sampler.check_loader(ok) is ok
    with pytest.raises(InvalidDataError, match="drop_last=True"):
        sampler.check_loader(_loader(sampler, batch_size=2, drop_last=True))
    with pytest.raises(InvalidDataError, match="batch_size is 3"):
        sampler.check_loader(_loader(sampler, batch_size=3))
    other = VersionedSampler(ds, mode="mix", batch_size=2)
    with pytest.raises(InvalidDataError, match="does not draw"):
        sampler.check_loader(_loader(other, batch_size=2))


def test_first_step_numbers_steps_as_the_trainer_does(tmp_path):
    """A trainer whose first step is step 1 (verl's global_steps) commits the round of the
    step the sampler counts: with first_step=1, lag 1 draws the round of the step before."""
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"id": i} for i in range(12)])
    ds = VersionedDataset(store)
    sampler = VersionedSampler(ds, mode="mix", batch_size=4, lag=1, first_step=1, wait_timeout=5)
    loader = sampler.check_loader(StatefulDataLoader(ds, batch_size=4, sampler=sampler))
    rounds_seen = []
    for step, batch in enumerate(loader, start=1):
        rounds_seen.append(sorted(int(i) for i in batch["id"] if i >= 100))
        store.append([{"id": 100 * step}], meta={"step": step})
    assert rounds_seen == [[], [100], [200]]
    assert sampler.state_dict()["step"] == 4


# Issue 19.10: the loader sweep with and without batch_size given to the sampler, on a store
# that grows every step. sampler batch_size given, mode, loader drop_last, num_workers,
# prefetch_factor, snapshot_every_n_steps: each value of each with and without batch_size.
GROWING = [
    (False, "epoch", False, 0, 1, 1),
    (False, "epoch", True, 0, 1, 3),
    (False, "epoch", False, 1, 1, 3),  # the README's sampler, the loader
    (False, "epoch", True, 1, 2, 1),
    (False, "epoch", True, 2, 1, 3),
    (False, "epoch", False, 2, 2, 1),
    (False, "epoch", True, 1, 1, 3),
    (False, "epoch", False, 2, 2, 3),
    (True, "epoch", True, 0, 1, 3),
    (True, "epoch", False, 1, 1, 3),
    (True, "epoch", True, 2, 2, 1),
    (True, "epoch", False, 2, 1, 3),
    (True, "mix", False, 2, 1, 3),
    (True, "mix", True, 1, 2, 1),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(GROWING)))
def test_loader_sweep_with_and_without_sampler_batch_size(tmp_path, case):
    given, mode, drop_last, workers, prefetch, snap = GROWING[case]
    lag = workers * prefetch + 1
    cfg = h.Config(
        url="",
        steps=max(13, lag + 9) if mode == "mix" else 13,
        batch_size=5,
        seed=40 + case,
        mode=mode,
        num_workers=workers,
        prefetch_factor=prefetch,
        snapshot_every=snap,
        drop_last=drop_last,
        initial_rows=17,  # 3 batches and a partial one; +2 rows every step
        round_size=2,
        sampler_batch_size=given,
    )
    if mode == "mix":
        stop, every = lag + 2 + case % 3, 2 + case % 2
    else:
        # The last checkpoint in the first steps of the second epoch (it starts at step 4, at 3
        # with drop_last), where the loader's snapshot may predate the epoch's pin.
        every = (3 if drop_last else 4) + case % 2
        stop = every + 1 + case % 2
    _check_run(cfg, stop, every, tmp_path)


def test_readme_sampler_resumes_exactly_from_a_snapshot_before_the_epoch(tmp_path):
    """Issue 19.10 as reported: 37 rows +2 per step, batch 8, one worker, prefetch 1,
    snapshot every 3 steps, state of step 6 resumed after step 7, and the sampler built
    without batch_size: check_loader teaches it the loader's batches."""
    cfg = h.Config(
        url="",
        steps=12,
        batch_size=8,
        seed=3,
        num_workers=1,
        prefetch_factor=1,
        snapshot_every=3,
        initial_rows=37,
        round_size=2,
        sampler_batch_size=False,
    )
    _check_run(cfg, 7, 2, tmp_path)


def _grown(tmp_path, rows: int = 12) -> tuple[Store, VersionedDataset]:
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"id": i} for i in range(rows)])
    return store, VersionedDataset(store)


def test_check_loader_teaches_the_loader_batch_size_and_drop_last(tmp_path):
    store, ds = _grown(tmp_path, 10)
    sampler = VersionedSampler(ds, seed=1)
    loader = StatefulDataLoader(ds, batch_size=4, drop_last=True, sampler=sampler)
    assert len(loader) == 2 and sampler.batch_size is None  # len(loader) teaches nothing
    assert sampler.check_loader(loader) is loader
    assert len(loader) == 2 and len(sampler) == 8  # 10 rows, 2 steps
    batches = []
    for step, batch in enumerate(loader):
        batches.append(batch["id"].tolist())
        store.append([{"id": 100 + step}], meta={"step": step})
    state = sampler.state_dict()
    assert (state["batch_size"], state["drop_last"], state["step"]) == (4, True, 2)
    assert [len(b) for b in batches] == [4, 4]
    # the next epoch pins the round of step 1: 12 rows
    assert len([i for b in loader for i in b["id"].tolist()]) == 12


def test_a_loader_is_never_guessed_from(tmp_path):
    """Issue 41.2: no batch_size and no check_loader: drawing through a batching loader
    teaches the sampler nothing (it used to read the loader out of its caller's stack
    frames), so once rounds carry steps the next epoch is refused, naming batch_size."""
    store, ds = _grown(tmp_path, 8)
    sampler = VersionedSampler(ds, seed=1)
    loader = StatefulDataLoader(ds, batch_size=4, sampler=sampler)
    for step, _batch in enumerate(loader):
        store.append([{"id": 100 + step}], meta={"step": step})
    assert sampler.batch_size is None and sampler.step == 0
    with pytest.raises(InvalidDataError, match="pass batch_size"):
        next(iter(loader))


def test_check_loader_refuses_a_loader_that_batches_otherwise(tmp_path):
    """Issue 24.7: a mix-mode sampler whose drop_last differs from its loader's used to wait
    the whole wait_timeout at the end of the epoch; check_loader refuses it at once, and
    leaves the sampler as it was."""
    _store, ds = _grown(tmp_path)
    sampler = VersionedSampler(ds, mode="mix", batch_size=4, lag=1, wait_timeout=600)
    loader = StatefulDataLoader(ds, batch_size=4, drop_last=True, sampler=sampler)
    with pytest.raises(InvalidDataError, match=r"drop_last=True.*drop_last=False"):
        sampler.check_loader(loader)
    other = VersionedSampler(ds, batch_size=4)
    with pytest.raises(InvalidDataError, match=r"batch_size is 3.*steps of 4"):
        other.check_loader(StatefulDataLoader(ds, batch_size=3, sampler=other))
    assert (other.batch_size, other.drop_last, sampler.drop_last) == (4, False, False)
    with pytest.raises(InvalidDataError, match="does not draw from this VersionedSampler"):
        other.check_loader(loader)


def test_resumed_loader_with_another_batch_size_is_refused(tmp_path):
    store, ds = _grown(tmp_path)
    sampler = VersionedSampler(ds)
    loader = sampler.check_loader(StatefulDataLoader(ds, batch_size=4, sampler=sampler))
    it = iter(loader)
    next(it)
    state = sampler.state_dict()
    assert state["batch_size"] == 4
    again = VersionedSampler(VersionedDataset(store))
    again.load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"batch_size=4.*batches 3"):
        again.check_loader(StatefulDataLoader(ds, batch_size=3, sampler=again))


def test_epoch_without_known_steps_is_refused_once_rounds_carry_steps(tmp_path):
    """Iterated directly, the sampler cannot know the loader's steps: the second epoch cannot
    name the round it should pin, and says so instead of pinning the head of the moment."""
    store, ds = _grown(tmp_path, 4)
    sampler = VersionedSampler(ds, shuffle=False)
    assert [decode_index(i)[1] for i in sampler] == list(range(4))
    store.append([{"id": 10}])  # no step: the head, as it always was
    assert len(list(sampler)) == 5
    store.append([{"id": 11}], meta={"step": 0})
    with pytest.raises(InvalidDataError, match="pass batch_size"):
        list(sampler)


def test_old_state_without_counted_steps_takes_them_up(tmp_path):
    """A state written without batch_size (steps never counted) loads; check_loader teaches
    the sampler the loader's batches and it counts on after the newest round."""
    store, ds = _grown(tmp_path, 8)
    old = VersionedSampler(ds)
    it = iter(old)
    for _ in range(4):
        next(it)
    state = old.state_dict()
    assert state["batch_size"] is None and state["step"] == 0
    for step in range(2):
        store.append([{"id": 100 + step}], meta={"step": step})
    sampler = VersionedSampler(VersionedDataset(store))
    sampler.load_state_dict(state)
    assert sampler.step == 2 and sampler.position == 4
    loader = sampler.check_loader(StatefulDataLoader(ds, batch_size=4, sampler=sampler))
    assert (sampler.batch_size, sampler.step) == (4, 2)
    assert len(next(iter(loader))["id"]) == 4
    assert (sampler.batch_size, sampler.step) == (4, 3)


@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("stop", [0, 1])
def test_resume_from_a_snapshot_taken_before_the_first_epoch_pinned(tmp_path, given, stop):
    """Found by the SIGKILL case: with snapshot_every_n_steps=3 the checkpoint of step 1 holds
    the snapshot torchdata took when the first iterator was made; the resumed run must not pin
    the head it finds (which holds rounds 0 and 1) for the first epoch."""
    cfg = h.Config(
        url="",
        steps=12,
        batch_size=8,
        seed=5,
        num_workers=1,
        prefetch_factor=1,
        snapshot_every=3,
        initial_rows=37,
        round_size=2,
        sampler_batch_size=given,
    )
    _check_run(cfg, stop, 1, tmp_path)


def test_inspect_of_a_state_without_counted_steps_says_why_it_cannot_draw(tmp_path):
    """`dynstate inspect` draws the next batch of a checkpoint; a state that counted no steps,
    at an epoch's end with rounds after it, reports the refusal instead of failing."""
    import torch

    from dynstate.loading.checkpoint import describe_checkpoint

    store, ds = _grown(tmp_path, 4)
    sampler = VersionedSampler(ds)
    list(sampler)  # iterated directly: no loader's steps known
    store.append([{"id": 10}], meta={"step": 0})
    torch.save({"loader": sampler.state_dict()}, tmp_path / "data.pt")
    info = describe_checkpoint(str(tmp_path / "data.pt"))
    assert "pass batch_size" in info["next_error"] and info["next_indices"] == []


@pytest.mark.parametrize("mode", ["mix", "epoch"])
def test_a_reset_by_another_process_stops_the_run_at_once(tmp_path, mode):
    """Another handle resets the store under a running sampler: the rows at the numbers its
    position counts are other rows now. A mix-mode sampler used to wait its whole
    wait_timeout for a round that never came; an epoch-mode one pinned the reset's rows for its
    next epoch. Both refuse at once, naming the version they read, and draw nothing."""
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(8)])
    ds = VersionedDataset(store)
    sampler = VersionedSampler(ds, mode=mode, batch_size=4, lag=1, wait_timeout=600, seed=1)
    loader = sampler.check_loader(StatefulDataLoader(ds, batch_size=4, sampler=sampler))
    other, batches = Store.open(url), []

    def epochs():
        while True:
            yield from loader

    started = time.monotonic()
    with pytest.raises(StateMismatchError, match=r"no longer descends from version \d+") as err:
        for step, batch in zip(range(6), epochs(), strict=False):
            batches.append(sorted(int(i) for i in batch["id"]))
            store.append([{"id": 100 + step}], meta={"step": step})
            if step == 2:
                other.reset(0)  # the import alone: rows 8.. are gone
                store.append([{"id": 900 + k} for k in range(4)])  # other rows at those numbers
    assert time.monotonic() - started < 60
    assert "dynstate reset" in str(err.value) and url in str(err.value)
    assert all(i < 900 for batch in batches for i in batch)
    assert len(batches) == (3 if mode == "mix" else 5)  # epoch: at the next epoch's pin
