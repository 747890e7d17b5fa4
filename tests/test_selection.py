"""Selection policies in VersionedSampler: drawn frequencies follow the policy's weights, a
band never yields a row outside it, bad policies get typed errors, and a run with a policy
over a store that grows and gets outcomes every step resumes exactly under torchdata's real
StatefulDataLoader (workers, prefetch, drop_last, ranks, another world size)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from dynstate import (
    InvalidDataError,
    StateMismatchError,
    Store,
    UnsupportedFormatError,
    VersionedDataset,
    VersionedSampler,
    rollback,
)
from dynstate.loading.selection import (
    DifficultyPools,
    FunctionPolicy,
    Learnability,
    PassRateBand,
    as_policy,
    pass_rates,
)

# -- a store with known pass rates -----------------------------------------------------------


def _store_with_rates(url: str, attempts: list[int], successes: list[int]) -> Store:
    """One row per entry, each tried ``attempts[i]`` times with ``successes[i]`` passes."""
    store = Store.open(url, create=True)
    n = len(attempts)
    store.append([{"id": i} for i in range(n)])
    records = []
    for row, (a, s) in enumerate(zip(attempts, successes, strict=True)):
        records += [{"row": row, "step": 0, "score": 1.0 if k < s else 0.0} for k in range(a)]
    store.append([], meta={"step": 0}, outcomes=records or None)
    return store


def _draw_counts(store: Store, select: Any, steps: int, batch: int) -> np.ndarray:
    ds = VersionedDataset(store)
    sampler = VersionedSampler(ds, batch_size=batch, select=select, seed=7)
    counts = np.zeros(store.snapshot().num_rows, np.int64)
    it = iter(sampler)
    for _ in range(steps * batch):
        try:
            idx = next(it)
        except StopIteration:
            it = iter(sampler)
            idx = next(it)
        counts[idx & ((1 << 40) - 1)] += 1
    return counts


def _chi_square_ok(counts: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """(chi-square statistic, its 99.9 % quantile) of ``counts`` against ``weights``; the
    quantile by Wilson-Hilferty (within 1 % of the exact one for these degrees of freedom)."""
    p = weights / weights.sum()
    keep = p > 0
    expected = counts.sum() * p[keep]
    chi = float(((counts[keep] - expected) ** 2 / expected).sum())
    k = int(keep.sum()) - 1
    return chi, k * (1 - 2 / (9 * k) + 3.0902 * (2 / (9 * k)) ** 0.5) ** 3


RATES = [(0, 0), (4, 0), (4, 1), (4, 2), (4, 3), (4, 4), (10, 5), (10, 1), (0, 0), (10, 9)]


def test_learnability_frequencies_follow_weights(tmp_path):
    attempts, successes = zip(*RATES, strict=True)
    store = _store_with_rates(str(tmp_path / "s"), list(attempts), list(successes))
    policy = Learnability(floor=0.02, neutral=0.3)
    counts = _draw_counts(store, policy, steps=2000, batch=10)
    weights = policy.weights(store.outcome_stats())
    expected = np.array(
        [0.3, 0.02, 0.1875, 0.25, 0.1875, 0.02, 0.25, 0.09, 0.3, 0.09]
    )  # p(1-p) by hand, floor and neutral
    np.testing.assert_allclose(weights, expected)
    chi, bound = _chi_square_ok(counts, weights)
    assert chi < bound, (chi, bound, counts)
    # and a plain tolerance: every row within 10 % of its expected frequency (20,000 draws)
    freq = counts / counts.sum()
    np.testing.assert_allclose(freq, weights / weights.sum(), rtol=0.10)


def test_band_never_yields_a_row_outside_it(tmp_path):
    attempts, successes = zip(*RATES, strict=True)
    store = _store_with_rates(str(tmp_path / "s"), list(attempts), list(successes))
    rate, tried = pass_rates(store.outcome_stats())
    for untried in (True, False):
        band = PassRateBand(0.25, 0.75, untried=untried)
        counts = _draw_counts(store, band, steps=300, batch=8)
        inside = (tried & (rate >= 0.25) & (rate <= 0.75)) | (~tried & untried)
        assert counts[~inside].sum() == 0, counts
        assert (counts[inside] > 0).all(), counts  # every eligible row is drawn
        chi, bound = _chi_square_ok(counts, inside.astype(float))
        assert chi < bound  # uniform over the band


def test_pools_share_of_every_step(tmp_path):
    attempts, successes = zip(*RATES, strict=True)
    store = _store_with_rates(str(tmp_path / "s"), list(attempts), list(successes))
    pools = DifficultyPools(
        [0.2, 0.8], ["hard", "medium", "easy"], [0.5, 0.25, 0.25], unseen="medium"
    )
    pool = pools.pool_of(store.outcome_stats())
    # rates: -, 0, .25, .5, .75, 1, .5, .1, -, .9 -> hard {1, 7}, easy {5, 9}, medium the rest
    assert pool.tolist() == [1, 0, 1, 1, 1, 2, 1, 0, 1, 2]
    ds = VersionedDataset(store)
    sampler = VersionedSampler(ds, batch_size=8, select=pools, seed=3)
    loader = StatefulDataLoader(ds, batch_size=8, sampler=sampler)
    plan = pools.plan(store.outcome_stats(), 0, "t")
    sizes = []
    for _ in range(3):  # epochs of one full step of 8 and a partial one of 2
        for batch in loader:
            in_pool = np.bincount(pool[batch["id"].numpy()], minlength=3)
            sizes.append(len(batch["id"]))
            # each step holds each pool's share as closely as whole slots allow: its exact
            # share rounded down or up
            exact = np.array([0.5, 0.25, 0.25]) * len(batch["id"])
            assert np.all((in_pool == np.floor(exact)) | (in_pool == np.ceil(exact))), in_pool
            assert in_pool.sum() == len(batch["id"])
    assert sizes == [8, 2] * 3 and plan.counts(8) == [4, 2, 2]
    # the slots left after rounding down go by systematic sampling of the fractions at the
    # step's first uniform: 2 slots over fractions 1, .5, .5
    assert [plan.counts(2, u) for u in (0.0, 0.49, 0.5, 0.99)] == [[1, 1, 0]] * 2 + [[1, 0, 1]] * 2
    # an empty pool gives its share to the others
    empty = DifficultyPools([0.01, 0.02], ["a", "b", "c"], [0.5, 0.5, 0.0], unseen="a")
    plan = empty.plan(store.outcome_stats(), 0, "t")
    assert len(plan.strata) == 1 and plan.counts(8) == [8]


def test_pools_meet_their_shares_over_the_steps(tmp_path):
    """0.5 / 0.3 / 0.2 at 8 slots: every step holds 4, 2 or 3, 1 or 2 slots (the exact shares
    4, 2.4, 1.6 rounded down or up), and over the steps the pools get 0.3 and 0.2 of the slots.
    Largest remainder per step gave 4/2/2 at every step: the 0.3 pool got 0.25 forever."""
    attempts, successes = zip(*RATES, strict=True)
    store = _store_with_rates(str(tmp_path / "s"), list(attempts), list(successes))
    pools = DifficultyPools(
        [0.2, 0.8], ["hard", "medium", "easy"], [0.5, 0.3, 0.2], unseen="medium"
    )
    pool = pools.pool_of(store.outcome_stats())
    plan = pools.plan(store.outcome_stats(), 0, "t")
    assert [plan.counts(8, u) for u in (0.0, 0.39, 0.4, 0.99)] == [[4, 3, 1]] * 2 + [[4, 2, 2]] * 2
    ds = VersionedDataset(store)
    steps = 400
    sampler = VersionedSampler(ds, batch_size=8, select=pools, seed=11, drop_last=True)
    loader = StatefulDataLoader(ds, batch_size=8, sampler=sampler, drop_last=True)
    seen = []
    for _ in range(steps):  # one full step per epoch (10 rows, drop_last)
        for batch in loader:
            seen.append(np.bincount(pool[batch["id"].numpy()], minlength=3))
    per_step = np.array(seen)
    assert set(map(tuple, per_step.tolist())) == {(4, 3, 1), (4, 2, 2)}
    share = per_step.sum(0) / (8 * steps)
    # binomial: the 0.3 pool's extra slot comes with probability 0.4 per step (sd 0.003 of
    # its share over 400 steps); 0.25, the rule before, is 16 sd away
    assert abs(share[1] - 0.3) < 0.015 and abs(share[2] - 0.2) < 0.015, share


def _pure(stats: pa.Table, step: int) -> np.ndarray:
    return np.arange(stats.num_rows, dtype=np.float64)  # row i weighs i


def test_user_function_frequencies_and_identity(tmp_path):
    store = _store_with_rates(str(tmp_path / "s"), [1] * 6, [0] * 6)
    counts = _draw_counts(store, _pure, steps=1500, batch=6)
    assert counts[0] == 0
    chi, bound = _chi_square_ok(counts, np.arange(6, dtype=float))
    assert chi < bound
    policy = as_policy(_pure)
    assert policy.identity() == {
        "policy": "function",
        "params": {"name": f"{__name__}._pure", "params": {}, "uses_step": True},
    }


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights, match",
    [
        (lambda n: -np.ones(n), "negative"),
        (lambda n: np.full(n, np.nan), "NaN"),
        (lambda n: np.zeros(n), "weight 0"),
        (lambda n: np.ones(n + 1), "weights for a statistics table of"),
        (lambda n: np.ones((n, 1)), "shape"),
        (lambda n: ["a"] * n, "floats"),
    ],
)
def test_bad_weights_are_refused(tmp_path, weights, match):
    store = _store_with_rates(str(tmp_path / "s"), [1] * 4, [1] * 4)
    policy = FunctionPolicy(lambda stats, step: weights(stats.num_rows), name="bad")
    sampler = VersionedSampler(VersionedDataset(store), batch_size=2, select=policy)
    with pytest.raises(InvalidDataError, match=match):
        next(iter(sampler))


def test_impure_policy_is_refused(tmp_path):
    store = _store_with_rates(str(tmp_path / "s"), [1] * 4, [1] * 4)
    rng = np.random.default_rng()
    policy = FunctionPolicy(lambda stats, step: rng.random(stats.num_rows), name="noisy")
    sampler = VersionedSampler(VersionedDataset(store), batch_size=2, select=policy)
    with pytest.raises(InvalidDataError, match="pure function"):
        next(iter(sampler))


def test_bad_policies_are_refused():
    with pytest.raises(InvalidDataError, match=r"lo=0\.9 > hi=0\.1"):
        PassRateBand(0.9, 0.1)
    with pytest.raises(InvalidDataError, match="lo"):
        PassRateBand(-0.1, 0.5)
    with pytest.raises(InvalidDataError, match="floor=0 and neutral=0"):
        Learnability(floor=0, neutral=0)
    with pytest.raises(InvalidDataError, match="increase strictly"):
        DifficultyPools([0.8, 0.2], ["a", "b", "c"], [1, 1, 1], unseen="a")
    with pytest.raises(InvalidDataError, match="names no pool"):
        DifficultyPools([0.5], ["a", "b"], [1, 1], unseen="z")
    with pytest.raises(InvalidDataError, match="one share"):
        DifficultyPools([0.5], ["a", "b"], [0, 0], unseen="a")
    with pytest.raises(InvalidDataError, match="no stable name"):
        as_policy(lambda stats, step: None)
    with pytest.raises(InvalidDataError, match="unknown selection policy"):
        as_policy({"policy": "nope"})
    with pytest.raises(InvalidDataError, match="plain types"):
        FunctionPolicy(_pure, params={"x": object()})
    assert as_policy({"policy": "band", "lo": 0.1, "hi": 0.9}).identity() == {
        "policy": "band",
        "params": {"lo": 0.1, "hi": 0.9, "untried": True},
    }


def test_empty_band_and_unknown_batch_size(tmp_path):
    store = _store_with_rates(str(tmp_path / "s"), [2] * 4, [2] * 4)  # all solved
    band = PassRateBand(0.0, 0.5, untried=False)
    with pytest.raises(InvalidDataError, match="every one of the 4 rows weight 0"):
        next(iter(VersionedSampler(VersionedDataset(store), batch_size=2, select=band)))
    with pytest.raises(InvalidDataError, match="pass batch_size"):
        next(iter(VersionedSampler(VersionedDataset(store), select=Learnability())))


def test_resume_with_another_policy_is_refused(tmp_path):
    store = _store_with_rates(str(tmp_path / "s"), [2] * 4, [1] * 4)
    ds = VersionedDataset(store)
    sampler = VersionedSampler(ds, batch_size=2, select=PassRateBand(0.1, 0.9))
    it = iter(sampler)
    next(it), next(it)  # the whole first step: a state at its end
    state = sampler.state_dict()
    assert state["format"] == 3
    assert state["select"] == {"policy": "band", "params": {"lo": 0.1, "hi": 0.9, "untried": True}}
    for other in (None, PassRateBand(0.2, 0.9), Learnability()):
        fresh = VersionedSampler(ds, batch_size=2, select=other)
        with pytest.raises(StateMismatchError, match="select="):
            fresh.load_state_dict(state)
        assert fresh.pos.version is None  # left as it was
    plain = VersionedSampler(ds, batch_size=2)
    it = iter(plain)
    next(it), next(it)
    assert plain.state_dict()["format"] == 2 and "select" not in plain.state_dict()
    with pytest.raises(StateMismatchError, match="select="):
        VersionedSampler(ds, batch_size=2, select=Learnability()).load_state_dict(
            plain.state_dict()
        )
    with pytest.raises(StateMismatchError, match="select"):
        VersionedSampler(ds, batch_size=2, select=PassRateBand(0.1, 0.9)).load_state_dict(
            {**state, "select": {"policy": "band", "params": {"lo": float("nan")}}}
        )
    with pytest.raises(UnsupportedFormatError):
        sampler.load_state_dict({**state, "format": 5})


# -- resume equivalence over a growing store with outcomes every step ------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    url: str
    mode: str = "epoch"
    policy: str = "learnability"
    batch: int = 3
    workers: int = 0
    prefetch: int = 1
    drop_last: bool = False
    ranks: int = 1
    steps: int = 12
    rows: int = 10
    seed: int = 5

    @property
    def lag(self) -> int:
        return self.workers * self.prefetch + 1


def _policy(name: str) -> Any:
    return {
        "learnability": Learnability(floor=0.05),
        "band": PassRateBand(0.2, 0.8),
        "pools": DifficultyPools(
            [0.34, 0.67], ["hard", "mid", "easy"], [0.5, 0.3, 0.2], unseen="mid"
        ),
        "function": FunctionPolicy(_by_step, name="by_step"),
    }[name]


def _by_step(stats: pa.Table, step: int) -> np.ndarray:
    # A curriculum that moves with the step: later steps favour rows tried more often.
    attempts = stats.column("attempts").to_numpy().astype(np.float64)
    return 1.0 + attempts * (step % 3)


def _score(row: int, step: int) -> float:
    return float((row * 7 + step * 3) % 5 >= 2)


def _loaders(run: Run, store: Store, ranks: int) -> list[tuple[VersionedSampler, Any]]:
    out = []
    for rank in range(ranks):
        ds = VersionedDataset(store)
        sampler = VersionedSampler(
            ds,
            mode=run.mode,
            batch_size=run.batch,
            drop_last=run.drop_last,
            lag=run.lag,
            fresh_share=0.34,
            seed=run.seed,
            num_replicas=ranks,
            rank=rank,
            select=_policy(run.policy),
            wait_timeout=30,
        )
        kwargs: dict[str, Any] = {}
        if run.workers:
            kwargs = {"num_workers": run.workers, "prefetch_factor": run.prefetch}
        loader = StatefulDataLoader(
            ds, batch_size=run.batch, sampler=sampler, drop_last=run.drop_last, **kwargs
        )
        sampler.check_loader(loader)
        out.append((sampler, loader))
    return out


def _train(
    run: Run,
    *,
    start: int = 0,
    stop: int | None = None,
    ckpt_at: int | None = None,
    states: list[Any] | None = None,
    sampler_state: dict[str, Any] | None = None,
    ranks: int | None = None,
) -> tuple[dict[int, list[list[int]]], list[Any] | None]:
    """Steps ``start ..`` of a run: each step every rank takes a batch, then one round
    commits two new rows and the outcomes of every row the step trained on. Returns the
    batches per step (ids per rank) and the loader states taken after step ``ckpt_at``."""
    ranks = run.ranks if ranks is None else ranks
    store = Store.open(run.url, create=start == 0)
    if start == 0:
        store.append([{"id": i} for i in range(run.rows)])
    pairs = _loaders(run, store, ranks)
    for i, (sampler, loader) in enumerate(pairs):
        if states is not None:
            loader.load_state_dict(states[i])
        elif sampler_state is not None:
            sampler.load_state_dict(sampler_state)
    iters = [iter(loader) for _, loader in pairs]
    out: dict[int, list[list[int]]] = {}
    saved = None
    step = start
    end = run.steps if stop is None else stop
    empty = 0
    while step < end:
        batches = []
        for it in iters:
            try:
                batches.append(next(it)["id"].tolist())
            except StopIteration:
                batches.append(None)
        if any(b is None for b in batches):
            assert all(b is None for b in batches), batches  # every rank ends an epoch together
            empty += 1
            assert empty < 3, f"epochs of no steps at step {step}: {[s.pos for s, _ in pairs]}"
            iters = [iter(loader) for _, loader in pairs]
            continue
        empty = 0
        out[step] = batches
        n = store.snapshot().num_rows
        trained = [row for b in batches for row in b]
        store.append(
            [{"id": n + k} for k in range(2)],
            meta={"step": step},
            outcomes=[{"row": r, "step": step, "score": _score(r, step)} for r in trained],
        )
        if step == ckpt_at:
            saved = [loader.state_dict() for _, loader in pairs]
        step += 1
    return out, saved


def _check_resume(run: Run, tmp: Path, ckpt_at: int, overrun: int = 2) -> None:
    ref = dataclasses.replace(run, url=str(tmp / "ref"))
    reference, _ = _train(ref)
    assert len(reference) == run.steps
    first, states = _train(run, stop=min(run.steps, ckpt_at + 1 + overrun), ckpt_at=ckpt_at)
    assert states is not None
    # the crashed run committed rounds past its checkpoint: roll them back, as a resume does
    rollback(Store.open(run.url), step=ckpt_at)
    second, _ = _train(run, start=ckpt_at + 1, states=states)
    assert {s: b for s, b in first.items() if s <= ckpt_at} == {
        s: b for s, b in reference.items() if s <= ckpt_at
    }
    assert second == {s: b for s, b in reference.items() if s > ckpt_at}
    head = lambda url: Store.open(url).snapshot().to_arrow().column("id").to_pylist()  # noqa: E731
    assert head(run.url) == head(ref.url)
    assert Store.open(run.url).outcome_stats().equals(Store.open(ref.url).outcome_stats())


CASES = [
    # mode, policy, workers, prefetch, drop_last, ranks, batch
    ("epoch", "learnability", 0, 1, False, 1, 3),
    ("epoch", "band", 2, 1, True, 1, 4),
    ("epoch", "pools", 2, 2, False, 2, 2),
    ("epoch", "function", 0, 1, True, 2, 3),
    ("mix", "learnability", 2, 2, False, 1, 3),
    ("mix", "band", 0, 1, True, 2, 2),
    ("mix", "pools", 2, 1, True, 1, 4),
    ("mix", "function", 2, 1, False, 2, 3),
]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("case", range(len(CASES)))
def test_resume_equivalence(tmp_path, case):
    mode, policy, workers, prefetch, drop_last, ranks, batch = CASES[case]
    run = Run(
        url=str(tmp_path / "run"),
        mode=mode,
        policy=policy,
        workers=workers,
        prefetch=prefetch,
        drop_last=drop_last,
        ranks=ranks,
        batch=batch,
        steps=12,
    )
    _check_resume(run, tmp_path, ckpt_at=5)


def test_ranks_take_disjoint_shares_of_one_draw(tmp_path):
    """Two ranks together draw what one rank with their joint batch draws: rank r takes
    every second slot of the step's draw."""
    two, _ = _train(Run(url=str(tmp_path / "two"), ranks=2, batch=3, drop_last=True))
    one, _ = _train(Run(url=str(tmp_path / "one"), ranks=1, batch=6, drop_last=True))
    assert two.keys() == one.keys()
    for step, (r0, r1) in two.items():
        joint = one[step][0]
        assert r0 == joint[0::2] and r1 == joint[1::2], step


def test_world_size_change(tmp_path):
    """Saved at 2 ranks, resumed at 3: each step the 3 ranks take disjoint thirds of the
    draw a single rank with their joint batch makes from the same state and store."""
    run = Run(url=str(tmp_path / "run"), ranks=2, batch=2, drop_last=True, steps=14, rows=24)
    _, states = _train(run, stop=6, ckpt_at=5)
    assert states is not None
    from dynstate import find_sampler_state

    state = find_sampler_state(states[0])
    assert state == find_sampler_state(states[1])  # one state for the whole job
    shutil.copytree(run.url, tmp_path / "copy")
    three, _ = _train(run, start=6, sampler_state=state, ranks=3)
    one_run = dataclasses.replace(run, url=str(tmp_path / "copy"), batch=6)
    one, _ = _train(one_run, start=6, sampler_state={**state, "batch_size": 6}, ranks=1)
    assert three.keys() == one.keys() and len(three) == 8
    for step, batches in three.items():
        joint = one[step][0]
        assert batches == [joint[0::3], joint[1::3], joint[2::3]], step
    assert Store.open(run.url).outcome_stats().equals(Store.open(one_run.url).outcome_stats())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    mode=st.sampled_from(["epoch", "mix"]),
    policy=st.sampled_from(["learnability", "band", "pools", "function"]),
    workers=st.sampled_from([0, 2]),
    prefetch=st.sampled_from([1, 2]),
    drop_last=st.booleans(),
    ranks=st.sampled_from([1, 2]),
    batch=st.integers(1, 4),
    ckpt_at=st.integers(0, 9),
    seed=st.integers(0, 2**31),
)
def test_resume_equivalence_property(
    tmp_path_factory, mode, policy, workers, prefetch, drop_last, ranks, batch, ckpt_at, seed
):
    tmp = tmp_path_factory.mktemp("prop")
    run = Run(
        url=str(tmp / "run"),
        mode=mode,
        policy=policy,
        workers=workers,
        prefetch=prefetch,
        drop_last=drop_last,
        ranks=ranks,
        batch=batch,
        steps=11,
        seed=seed,
    )
    _check_resume(run, tmp, ckpt_at=ckpt_at)


def test_a_step_is_drawn_without_replaying_earlier_steps(tmp_path):
    """A state at step 10,000 draws its step from the key and one version's statistics:
    the first batch is exactly the plan's draw for (seed, epoch, 10,000), nothing replayed."""
    from dynstate.loading.selection import step_rng

    attempts, successes = zip(*RATES, strict=True)
    store = _store_with_rates(str(tmp_path / "s"), list(attempts), list(successes))
    ds = VersionedDataset(store)
    policy = Learnability()
    sampler = VersionedSampler(ds, batch_size=4, select=policy, seed=11)
    it = iter(sampler)
    for _ in range(4):  # the whole first step: a state at its end
        next(it)
    state = {**sampler.state_dict(), "step": 10_000}
    resumed = VersionedSampler(ds, batch_size=4, select=Learnability(), seed=11)
    resumed.load_state_dict(state)
    got = [i & ((1 << 40) - 1) for _, i in zip(range(4), iter(resumed), strict=False)]
    plan = policy.plan(store.outcome_stats(state["version"]), 10_000, "t")
    assert got == plan.draw(step_rng(11, state["epoch"], 10_000), 4).tolist()
    assert resumed.pos.step == 10_001
