"""Data-parallel ranks in one process (issue 15): every rank's VersionedSampler under its own
StatefulDataLoader, in lockstep as DDP keeps them, over a store that grows each step."""

from __future__ import annotations

from collections import Counter

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from dynstate import Store, VersionedDataset, VersionedSampler


def _ids(rows):
    return [r["id"] for r in rows]


class Ranks:
    """``world`` ranks, each with its own dataset, sampler and loader, stepped together."""

    def __init__(
        self, url, world, *, batch=3, mode="epoch", drop_last=False, state=None, **settings
    ):
        self.samplers, self.loaders, self.iters = [], [], []
        for rank in range(world):
            ds = VersionedDataset(url)
            sampler = VersionedSampler(
                ds,
                mode=mode,
                batch_size=batch,
                **{"seed": 7, "fresh_share": 0.5, "lag": 1, **settings},
                num_replicas=world,
                rank=rank,
                drop_last=drop_last,
                wait_timeout=30,
            )
            if state is not None:
                sampler.load_state_dict(state)
            loader = StatefulDataLoader(
                ds, batch_size=batch, sampler=sampler, collate_fn=_ids, drop_last=drop_last
            )
            sampler.check_loader(loader)
            self.samplers.append(sampler)
            self.loaders.append(loader)
            self.iters.append(iter(loader))

    def step(self):
        """One step on every rank: (epoch, version, [batch of each rank])."""
        batches, wrapped = [], []
        for rank, loader in enumerate(self.loaders):
            try:
                batches.append(next(self.iters[rank]))
                wrapped.append(False)
            except StopIteration:
                self.iters[rank] = iter(loader)
                batches.append(next(self.iters[rank]))
                wrapped.append(True)
        assert len(set(wrapped)) == 1, "ranks must end their epochs at the same step"
        states = [s.state_dict() for s in self.samplers]
        assert all(st == states[0] for st in states), "the state is the same on every rank"
        versions = {s.version for s in self.samplers}
        assert len(versions) == 1, f"ranks pinned different versions: {versions}"
        return self.samplers[0].epoch, versions.pop(), batches


def _grow(store, step):
    store.append([{"id": 1000 * (step + 1) + k} for k in range(step % 4)], meta={"step": step})


def _rows(store, version):
    return _ids(store.snapshot(version).to_arrow().to_pylist())


@pytest.mark.parametrize("world,drop_last", [(2, False), (3, False), (3, True)])
def test_shares_are_disjoint_and_complete_while_others_commit(tmp_path, world, drop_last):
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(22)])
    ranks = Ranks(url, world, drop_last=drop_last)
    epochs: dict[tuple[int, int], list[list[int]]] = {}
    for step in range(16):
        epoch, version, batches = ranks.step()
        epochs.setdefault((epoch, version), []).extend(batches)
        _grow(store, step)
        if step % 3 == 1:  # another process commits rows mid-run, with no step
            store.append([{"id": 900_000 + step}])
    assert len(epochs) >= 3
    for (_epoch, version), batches in list(epochs.items())[:-1]:  # complete epochs
        rows = _rows(store, version)
        got = Counter(i for b in batches for i in b)
        per_rank = ranks.samplers[0]._share(len(rows))
        assert sum(got.values()) == per_rank * world
        if drop_last:
            assert max(got.values()) == 1 and len(got) == len(rows) // (3 * world) * 3 * world
        else:
            assert set(got) == set(rows)  # complete
            assert sum(got.values()) - len(rows) == -len(rows) % world  # only the padding twice


def _run(url, world, steps, *, mode, state=None, start=0):
    store = Store.open(url)
    ranks = Ranks(url, world, mode=mode, state=state)
    out = []
    for step in range(start, start + steps):
        out.append(ranks.step())
        _grow(store, step)
    return ranks, out


@pytest.mark.parametrize("mode", ["epoch", "mix"])
@pytest.mark.parametrize("before,after", [(2, 3), (4, 2), (3, 3)])
def test_one_state_resumes_at_another_world_size(tmp_path, mode, before, after):
    """The rest of the epoch after a resume with another number of ranks holds the same rows
    as the uninterrupted run's rest: none repeated, none skipped (epoch mode); mix mode keeps
    the base rows unrepeated and the fresh rows in order, without gaps or repeats."""
    stop = 3
    urls = [str(tmp_path / name) for name in ("ref", "run")]
    for url in urls:
        Store.open(url, create=True).append([{"id": i} for i in range(60)])
    _ref_ranks, ref = _run(urls[0], before, 12, mode=mode)
    run_ranks, first = _run(urls[1], before, stop, mode=mode)
    state = run_ranks.samplers[-1].state_dict()
    assert state["position"] == stop * 3 * before
    del run_ranks
    _, second = _run(urls[1], after, 12, mode=mode, state=state, start=stop)
    assert first == ref[:stop]

    def epoch0(out):
        return [i for epoch, _v, batches in out if epoch == 0 for b in batches for i in b]

    ref_rest, got_rest = epoch0(ref[stop:]), epoch0(second)
    before_rows = set(epoch0(ref[:stop]))
    if mode == "epoch":
        assert set(ref_rest) == set(got_rest) == set(range(60)) - before_rows
        assert len(got_rest) - len(set(got_rest)) < after  # padding only
    else:
        base = [i for i in got_rest if i < 60]
        fresh = [i for i in got_rest if i >= 1000]
        assert len(set(base)) == len(base) and not set(base) & before_rows
        done = [i for i in epoch0(first) if i >= 1000]
        ordered = _ids(Store.open(urls[1]).snapshot().to_arrow().to_pylist())[60:]
        # oldest first, each once: a prefix of the rows committed after the epoch's version
        assert len(set(done + fresh)) == len(done + fresh)
        assert set(done + fresh) == set(ordered[: len(done) + len(fresh)])
        assert fresh, "fresh rows were drawn after the resume"
        assert len(got_rest) + len(epoch0(first)) >= 60  # every slot of the epoch was served


def test_set_epoch_is_accepted(tmp_path):
    url = str(tmp_path / "s")
    Store.open(url, create=True).append([{"id": i} for i in range(8)])
    sampler = VersionedSampler(VersionedDataset(url), num_replicas=2, rank=1)
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(5)
    assert len(first) == len(sampler) == 4 and len(list(sampler)) == 4
