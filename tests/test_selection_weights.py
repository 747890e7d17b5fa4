"""Selection weights refreshed round by round draw bit for bit what weights built in one go
at the same version draw, and a refresh re-weighs only the rows a round touched or added."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dynstate import InvalidDataError, Store, VersionedDataset, VersionedSampler
from dynstate.loading.selection import DifficultyPools, Learnability, PassRateBand, Selector
from dynstate.loading.weights import BLOCK, CumulativeWeights, Plan, step_rng


def _same(a: CumulativeWeights, b: CumulativeWeights) -> None:
    """Equal bit for bit: weights, every block's sums, the sum over blocks, the total."""
    blocks = -(-a.num_rows // BLOCK)
    assert a.num_rows == b.num_rows
    assert a.weights.tobytes() == b.weights.tobytes()
    assert a._local[:blocks].tobytes() == b._local[:blocks].tobytes()
    assert a._top.tobytes() == b._top.tobytes() and a.total == b.total


def _probe(cw: CumulativeWeights, rng: np.random.Generator) -> np.ndarray:
    """Points to find: random ones, the ends, and every block boundary (where rounding bites)."""
    return np.concatenate([rng.random(2000) * cw.total, [0.0, cw.total], cw._top, cw._top[:-1]])


def test_refreshed_weights_equal_built_ones_bit_for_bit():
    rng = np.random.default_rng(3)
    n = 5 * BLOCK + 17  # a partial last block
    weights = rng.random(n) * (rng.random(n) < 0.7)  # some zeros
    live = CumulativeWeights.of(weights)
    for _ in range(25):
        # a round: a few rows re-weighed (some to 0, some across blocks), a few rows added
        rows = rng.choice(n, size=int(rng.integers(1, 40)), replace=False)
        values = rng.random(len(rows)) * (rng.random(len(rows)) < 0.8)
        added = int(rng.integers(0, 300))
        weights = np.concatenate([weights, rng.random(added)])
        weights[rows] = values
        n += added
        touched = np.concatenate([rows, np.arange(n - added, n)])
        live.set(touched, weights[touched], n)
        built = CumulativeWeights.of(weights)
        _same(live, built)
        u = _probe(built, rng)
        found = live.find(u.copy())
        assert (found == built.find(u.copy())).all()
        assert (weights[found] > 0).all()  # a row of weight 0 is never drawn


def test_find_follows_the_weights():
    weights = np.zeros(3 * BLOCK)
    weights[[5, BLOCK + 1, 3 * BLOCK - 1]] = [1.0, 2.0, 1.0]
    cw = CumulativeWeights.of(weights)
    found = cw.find(step_rng(0, 0, 0).random(40_000) * cw.total)
    counts = np.bincount(found, minlength=len(weights))
    assert set(np.flatnonzero(counts)) == {5, BLOCK + 1, 3 * BLOCK - 1}
    np.testing.assert_allclose(
        counts[[5, BLOCK + 1, 3 * BLOCK - 1]] / 40_000, [0.25, 0.5, 0.25], atol=0.01
    )
    # a point that rounds to the total lands on the last row of positive weight
    assert cw.find(np.array([cw.total, 0.0])).tolist() == [3 * BLOCK - 1, 5]


def _stats(attempts: np.ndarray, successes: np.ndarray) -> pa.Table:
    return pa.table({"row": np.arange(len(attempts)), "attempts": attempts, "successes": successes})


POLICIES = [
    Learnability(floor=0.02),
    PassRateBand(0.2, 0.8, untried=True),
    DifficultyPools([0.3, 0.7], ["hard", "mid", "easy"], [0.5, 0.3, 0.2], unseen="mid"),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_selector_refresh_draws_what_a_build_draws(policy):
    rng = np.random.default_rng(11)
    n = 4 * BLOCK + 5
    attempts = rng.integers(0, 5, n)
    successes = np.minimum(attempts, rng.integers(0, 5, n))
    selector = Selector(policy)
    for version in range(12):
        # no copy: the round below changes these buffers in place, as a store may change
        # the arrays behind a table it handed out; the selector keeps its own
        table = _stats(attempts, successes)
        plan = selector.plan(version, lambda t=table: t, 0, "t")
        built = policy.plan(table, 0, "t")
        for a, b in zip(plan.all_strata, built.all_strata, strict=True):
            _same(a.weights, b.weights)
        for step in range(5):
            got = plan.draw(step_rng(7, 0, step * 100 + version), 64)
            assert got.tolist() == built.draw(step_rng(7, 0, step * 100 + version), 64).tolist()
        # the next round: 30 rows trained (a few twice), 20 rows added
        trained = rng.integers(0, n, 30)
        np.add.at(attempts, trained, 1)
        np.add.at(successes, trained, rng.integers(0, 2, 30))
        attempts = np.concatenate([attempts, np.zeros(20, np.int64)])
        successes = np.concatenate([successes, np.zeros(20, np.int64)])
        n += 20
    # one build, then only the rows each round touched or added were re-weighed
    assert selector.rebuilds == 1
    assert selector.reweighed <= 11 * (30 + 20)


def test_refresh_refused_leaves_no_half_plan():
    band = PassRateBand(0.0, 0.5, untried=False)
    selector = Selector(band)
    attempts, successes = np.array([2, 2, 2]), np.array([0, 2, 2])
    selector.plan(0, lambda: _stats(attempts, successes), 0, "t")
    solved = np.array([2, 2, 2])  # the one row in the band got solved: nothing to draw
    with pytest.raises(InvalidDataError, match="every one of the 3 rows weight 0"):
        selector.plan(1, lambda: _stats(attempts, solved), 0, "t")
    # asked again, it builds afresh (and refuses again) rather than drawing a stale plan
    with pytest.raises(InvalidDataError):
        selector.plan(1, lambda: _stats(attempts, solved), 0, "t")
    assert isinstance(selector.plan(2, lambda: _stats(attempts, successes), 0, "t"), Plan)


def test_mix_mode_refreshes_per_round_and_resumes_to_the_same_draws(tmp_path):
    """A mix-mode sampler over a store with outcomes every step builds its weights once and
    refreshes them per round; a sampler resumed from its state at any step (building them
    at that step's version) draws the same step."""
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"id": i} for i in range(3 * BLOCK)])
    ds = VersionedDataset(store)
    kw = dict(mode="mix", batch_size=8, lag=1, seed=4, select=Learnability(floor=0.05))
    sampler = VersionedSampler(ds, **kw)
    it = iter(sampler)
    for step in range(8):
        state = sampler.state_dict()
        batch = [next(it) & ((1 << 40) - 1) for _ in range(8)]
        resumed = VersionedSampler(VersionedDataset(store), **kw)
        resumed.load_state_dict(state)
        again = [i & ((1 << 40) - 1) for _, i in zip(range(8), iter(resumed), strict=False)]
        assert again == batch, step
        outcomes = [{"row": r, "step": step, "score": float((r + step) % 3 == 0)} for r in batch]
        store.append([{"id": 10_000 + step}], meta={"step": step}, outcomes=outcomes)
    selector = sampler._selector
    assert selector.rebuilds == 1 and 0 < selector.reweighed <= 8 * (8 + 1)
