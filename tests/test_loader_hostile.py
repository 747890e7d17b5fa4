"""Hostile but plausible use of the loading API (VersionedDataset indices, VersionedSampler under
torchdata's StatefulDataLoader, sampler settings and loader states). Each test pins a defect
found by an outside audit: it fails on the code it was written against, and says what is wrong
and what is expected. Reference for rows: the version's shards read whole with pyarrow, then
``take`` (SPEC §3.16); for errors: one ``DynstateError`` hierarchy (SPEC §3.9)."""

from __future__ import annotations

import copy

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from dynstate import (
    DynstateError,
    InvalidDataError,
    Store,
    VersionedDataset,
    VersionedSampler,
    load_loader_state,
)


def _ids(rows: list[dict]) -> list[int]:
    return [row["id"] for row in rows]


def _store(tmp_path, n: int = 10, rounds: int = 1) -> str:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for k in range(rounds):
        store.append([{"id": k * n + i} for i in range(n)], shard_bytes=200)
    return url


def _oracle(url: str) -> pa.Table:
    """The head's shards read whole with pyarrow, in manifest order."""
    store = Store.open(url)
    snap = store.snapshot()
    root = url.rstrip("/")
    return pa.concat_tables([pq.read_table(f"{root}/{shard.path}") for shard in snap.shards])


# -- indices ---------------------------------------------------------------------------------


def test_guard_numpy_and_torch_int_indices_equal_the_oracle(tmp_path):
    """Guard: the integer index types a user passes (numpy ints of any width, torch tensors,
    duplicates, unsorted) read exactly the oracle's rows."""
    url = _store(tmp_path, n=10, rounds=3)
    oracle = _oracle(url)
    ds = VersionedDataset(url)
    want = [29, 3, 3, 0, 17, 11]
    expected = oracle.take(want).to_pylist()
    for indices in (
        want,
        np.array(want, dtype=np.uint8),
        np.array(want, dtype=np.int8),
        np.array(want, dtype=np.uint64),
        torch.tensor(want),
        [np.int16(i) for i in want],
    ):
        assert ds.__getitems__(indices) == expected
        assert ds.read_batch(indices, "arrow").to_pylist() == expected
    assert [ds[np.uint8(i)] for i in want] == expected


# What is wrong: a float, a string or a boolean mask given as an index is silently coerced
# (np.asarray(..., dtype=int64) truncates 1.7 to 1 and parses "12" as 12; int() does the same
# for one index), and a nested list is flattened, so the dataset returns rows nobody asked for,
# and a batch with more rows than indices. The oracle (pyarrow take) refuses every one of
# these, Python's list refuses floats and strings, and numpy/torch read a bool array as a mask.
# Expected: InvalidDataError naming the index ("a dataset index must be an int"), as for "x".
NOT_INDICES = {
    "float": [1.7],
    "float-tensor": torch.tensor([3.5, 1.0]),
    "float-array": np.array([2.9]),
    "str-list": ["1", "2"],
    "str": "7",
    "nested": [[0, 1], [2, 3]],
    "bool-array": np.array([True, False, True]),
    "bool-tensor": torch.tensor([True, False]),
}


@pytest.mark.parametrize("indices", list(NOT_INDICES.values()), ids=list(NOT_INDICES))
def test_non_integer_batch_indices_are_refused_not_coerced(tmp_path, indices):
    ds = VersionedDataset(_store(tmp_path))
    for read in (ds.__getitems__, lambda i: ds.read_batch(i, "arrow")):
        with pytest.raises(InvalidDataError):
            read(indices)


@pytest.mark.parametrize(
    "index",
    [1.7, np.float64(2.9), "3", torch.tensor(4.6)],
    ids=["float", "np-float", "str", "float-tensor"],
)
def test_non_integer_single_index_is_refused_not_truncated(tmp_path, index):
    # What is wrong: ds[1.7] returns row 1 and ds["3"] row 3 (decode_index calls int()).
    # Expected: InvalidDataError, as ds["x"] already raises (tests/test_dataset.py).
    ds = VersionedDataset(_store(tmp_path))
    with pytest.raises(InvalidDataError):
        ds[index]


def test_bad_indices_raise_dynstate_errors_not_builtins(tmp_path):
    # What is wrong: ds[float("inf")] escapes as a bare OverflowError (decode_index catches
    # TypeError/ValueError only), and read_batch(5) / __getitems__(np.int64(5)) as a bare
    # TypeError from len(indices) deep in read_batch. Expected: DynstateError subclasses
    # (InvalidDataError) that say an index must be an int / indices a sequence (SPEC §3.9).
    ds = VersionedDataset(_store(tmp_path))
    for call in (
        lambda: ds[float("inf")],
        lambda: ds.read_batch(5),
        lambda: ds.__getitems__(np.int64(5)),
    ):
        with pytest.raises(DynstateError):
            call()


# -- the sampler under StatefulDataLoader ----------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("size", [3, 6])
def test_loader_batching_other_than_the_sampler_resumes_exactly(tmp_path, size, workers):
    # Was wrong: VersionedSampler(batch_size=4) under a StatefulDataLoader(batch_size=3), with no
    # check_loader call, moved its position a whole step (4 slots) before the loader's batch of
    # 3 was complete, so the state saved after the first batch said 4 rows were consumed and
    # the resumed run skipped row 3 (SPEC §3.5 / §3.15: nothing skipped across a resume). A
    # state asked for within a step now holds the step's start and how many of its indices
    # were handed out (format 4), and the resume hands out the rest.
    url = _store(tmp_path, n=10)

    def make():
        ds = VersionedDataset(url)
        sampler = VersionedSampler(ds, shuffle=False, batch_size=4)
        return StatefulDataLoader(
            ds, sampler=sampler, batch_size=size, collate_fn=_ids, num_workers=workers
        )

    # the oracle: unshuffled, the rows in order, in the loader's batches
    ids = _oracle(url).column("id").to_pylist()
    assert list(make()) == [ids[k : k + size] for k in range(0, len(ids), size)]
    for cut in range(1, -(-len(ids) // size)):
        loader = make()
        it = iter(loader)
        first = [next(it) for _ in range(cut)]
        state = loader.state_dict()
        del it
        resumed = make()
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert first + rest == list(make()), (cut, first, rest)


@pytest.mark.parametrize("mode", ["epoch", "mix", "select"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_state_taken_at_any_index_resumes_exactly(tmp_path, mode, replicas):
    """A sampler iterated by hand and saved after every index (within a step or at its end),
    through torch.save / torch.load(weights_only=True), continues with exactly the indices
    the uninterrupted sampler hands out next; unshuffled epoch mode equals the oracle's rows
    in order, dealt to the ranks as DistributedSampler deals them."""
    import io

    from dynstate import Learnability

    url = _store(tmp_path, n=11)
    if mode == "mix":  # a round per step, committed up front: mix mode waits for none
        store = Store.open(url)
        for step in range(12):
            store.append([{"id": 100 + step}], meta={"step": step})

    def make(rank: int) -> VersionedSampler:
        extra: dict = {"mode": "mix", "lag": 1, "wait_timeout": 5.0} if mode == "mix" else {}
        if mode == "select":
            extra = {"select": Learnability()}
        return VersionedSampler(
            VersionedDataset(url),
            shuffle=False,
            batch_size=3,
            num_replicas=replicas,
            rank=rank,
            drop_last=False,
            **extra,
        )

    for rank in range(replicas):
        whole = list(make(rank))
        if mode == "epoch":
            ids = _oracle(url).column("id").to_pylist()
            step = 3 * replicas
            padded = ids + ids[: (-len(ids)) % replicas]  # every rank as many
            want = [
                i for k in range(0, len(padded), step) for i in padded[k : k + step][rank::replicas]
            ]
            assert [i & ((1 << 40) - 1) for i in whole] == want
        for cut in range(1, len(whole)):
            sampler = make(rank)
            it = iter(sampler)
            first = [next(it) for _ in range(cut)]
            buf = io.BytesIO()
            torch.save(sampler.state_dict(), buf)
            buf.seek(0)
            resumed = make(rank)
            resumed.load_state_dict(torch.load(buf, weights_only=True))
            assert first + list(resumed) == whole, (rank, cut)


def test_a_state_taken_within_a_step_is_refused_at_another_number_of_ranks(tmp_path):
    """Within a step each rank has handed out its own share; another world size deals the step
    otherwise, so such a state is refused (a state at a step's end loads at any world size)."""
    from dynstate import StateMismatchError

    url = _store(tmp_path, n=12)
    sampler = VersionedSampler(VersionedDataset(url), batch_size=3, num_replicas=2, rank=0)
    it = iter(sampler)
    next(it)
    state = sampler.state_dict()
    assert state["format"] == 4 and state["within_step"] == 1
    with pytest.raises(StateMismatchError, match="num_replicas"):
        VersionedSampler(VersionedDataset(url), batch_size=3).load_state_dict(state)
    next(it), next(it)  # the step's end: any world size
    VersionedSampler(VersionedDataset(url), batch_size=3).load_state_dict(sampler.state_dict())


def test_state_saved_with_another_drop_last_is_refused_without_batch_size(tmp_path):
    # What is wrong: a sampler built without batch_size (a plain DistributedSampler-like use over
    # 2 ranks) loads a state saved with drop_last=True although it has drop_last=False: the
    # check of drop_last in load_state_dict runs only when batch_size was given, so the resumed
    # ranks get row 10 and padding the uninterrupted run never had. With batch_size given the
    # same change is refused. Expected: StateMismatchError naming drop_last ("construct the
    # sampler with the same settings"), as for seed, shuffle and mode.
    url = _store(tmp_path, n=11)
    saved = VersionedSampler(
        VersionedDataset(url), shuffle=False, num_replicas=2, rank=0, drop_last=True
    )
    it = iter(saved)
    next(it), next(it)
    state = saved.state_dict()
    assert state["drop_last"] is True
    other = VersionedSampler(
        VersionedDataset(url), shuffle=False, num_replicas=2, rank=0, drop_last=False
    )
    with pytest.raises(DynstateError, match="drop_last"):
        other.load_state_dict(state)


@pytest.mark.parametrize("timeout", [float("nan"), "soon"], ids=["nan", "str"])
def test_wait_timeout_is_checked_at_construction(tmp_path, timeout):
    # What is wrong: VersionedSampler accepts any wait_timeout. "soon" fails only at mix mode's
    # first wait, as a bare TypeError from time arithmetic in dynstate.log.steps.wait_round; NaN
    # makes the deadline NaN, so `clock() > deadline` is never true and a missing round is
    # waited for forever instead of raising RoundTimeoutError. Expected: InvalidDataError at
    # construction ("wait_timeout must be a number of seconds >= 0"), like the other settings.
    ds = VersionedDataset(_store(tmp_path))
    with pytest.raises(InvalidDataError):
        VersionedSampler(ds, mode="mix", batch_size=2, wait_timeout=timeout)


def test_guard_mix_mode_wait_timeout_still_times_out(tmp_path):
    """Guard: a finite wait_timeout ends a wait for a round that never comes with the typed
    RoundTimeoutError (the sampler must not hang)."""
    from dynstate.errors import RoundTimeoutError

    ds = VersionedDataset(_store(tmp_path, n=12))
    sampler = VersionedSampler(ds, mode="mix", batch_size=2, wait_timeout=0.05)
    it = iter(sampler)
    with pytest.raises(RoundTimeoutError):
        for _ in range(6):
            next(it)


@pytest.mark.parametrize("workers", [0, 2])
def test_load_loader_state_refuses_a_truncated_state_with_a_typed_error(tmp_path, workers):
    # What is wrong: load_loader_state validates a loader state only when it must carry it to
    # another worker count; a damaged state (a key missing) loaded into a loader with the same
    # num_workers reaches torchdata and fails with a bare KeyError ('_sampler_iter_state',
    # '_steps_since_snapshot', ...), while the same damage with another worker count gives
    # StateMismatchError. Expected (docs/api.md load_loader_state, SPEC §3.9): StateMismatchError
    # saying the state is damaged, whatever the worker counts; the loader left unchanged.
    url = _store(tmp_path, n=10)

    def make():
        ds = VersionedDataset(url)
        sampler = VersionedSampler(ds, batch_size=3, seed=3)
        kw = {"prefetch_factor": 2} if workers else {}
        return StatefulDataLoader(
            ds, sampler=sampler, batch_size=3, collate_fn=_ids, num_workers=workers, **kw
        )

    loader = make()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    key = "_sampler_iter_state" if workers == 0 else "_steps_since_snapshot"
    damaged = copy.deepcopy(state)
    del damaged[key]
    fresh = make()
    with pytest.raises(DynstateError):
        load_loader_state(fresh, damaged)
        list(fresh)  # torchdata restores lazily, at the next iter()


@pytest.mark.parametrize("seed", [2**64, 2**64 + 7, -(2**63) - 1, 10**30])
def test_a_seed_beyond_64_bits_is_refused(tmp_path, seed) -> None:
    """Was wrong: the permutation keys on ``seed & (2**64 - 1)``, so ``seed=2**64 + 7`` drew
    exactly the rows of ``seed=7``: two runs a user seeded differently trained the same
    order. Seeds outside torch's ``manual_seed`` range are refused now, naming it."""
    ds = VersionedDataset(_store(tmp_path))
    with pytest.raises(InvalidDataError, match="-2\\*\\*63 to 2\\*\\*64 - 1"):
        VersionedSampler(ds, seed=seed)


def test_seeds_at_the_ends_of_the_range_are_taken(tmp_path) -> None:
    ds = VersionedDataset(_store(tmp_path, n=64))
    orders = []
    for seed in (-(2**63), 2**64 - 1, 0):
        sampler = VersionedSampler(ds, seed=seed)
        orders.append([int(i) for i in sampler])
    assert all(sorted(o) == sorted(orders[0]) for o in orders)
    assert len({tuple(o) for o in orders}) == 3
