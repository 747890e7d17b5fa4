"""Finite arithmetic and typed errors at the edges of selection (issue 40.4 and 40.5): policy
weights whose total overflows, scores past the bound that keeps sums finite, a sampler state
whose ``select`` nests 50,000 deep, and a policy function of the wrong signature."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from dynstate import (
    InvalidDataError,
    Learnability,
    StateMismatchError,
    Store,
    VersionedDataset,
    VersionedSampler,
    find_sampler_state,
)
from dynstate.records.outcomes import MAX_SCORE

ROWS = 20


# module-level policies: a dict config names them as f"{__name__}:<name>"
def overflowing(stats: pa.Table, step: int) -> np.ndarray:
    weights = np.zeros(stats.num_rows)
    weights[:3] = [1e308, 1e308, 1.0]
    return weights


def one_arg(stats: pa.Table) -> np.ndarray:
    return np.ones(stats.num_rows)


def three_args(stats: pa.Table, step: int, extra: int) -> np.ndarray:
    return np.ones(stats.num_rows)


@pytest.fixture()
def ds(tmp_path) -> VersionedDataset:
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"i": i} for i in range(ROWS)])
    return VersionedDataset(store)


def draw(ds: VersionedDataset, select: Any, n: int = 8) -> list[int]:
    sampler = VersionedSampler(ds, seed=1, batch_size=4, select=select)
    it = iter(sampler)
    return [next(it) for _ in range(n)]


# -- weights -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "select",
    [
        overflowing,
        {"policy": "function", "function": f"{__name__}:overflowing"},
        Learnability(neutral=1e308),  # every row untried: 20 x 1e308
    ],
    ids=["function", "config", "learnability"],
)
def test_weights_whose_total_overflows_are_refused(ds: VersionedDataset, select: Any) -> None:
    with pytest.raises(InvalidDataError, match=r"overflows float64.*scale them down"):
        draw(ds, select)


def large(stats: pa.Table, step: int) -> np.ndarray:
    weights = np.zeros(stats.num_rows)
    weights[:2] = 1e307
    return weights


def test_large_finite_weights_still_draw(ds: VersionedDataset) -> None:
    """Weights that sum to a finite number, however large, draw every row that weighs:
    here rows 0 and 1 (1e307 each), never the others."""
    drawn = draw(ds, large, ROWS)  # an epoch: ROWS slots
    assert {i & (2**40 - 1) for i in drawn} == {0, 1}  # a sampler index: row in 40 bits


def test_negative_and_nan_weights_are_refused(ds: VersionedDataset) -> None:
    with pytest.raises(InvalidDataError, match="negative"):
        draw(ds, negative)
    with pytest.raises(InvalidDataError, match="NaN"):
        draw(ds, nan)


def negative(stats: pa.Table, step: int) -> np.ndarray:
    return -np.ones(stats.num_rows)


def nan(stats: pa.Table, step: int) -> np.ndarray:
    return np.full(stats.num_rows, np.nan)


# -- scores --------------------------------------------------------------------------------


@pytest.mark.parametrize("score", [1e308, -1e308, MAX_SCORE * 1.0000001, 2.0**1000])
def test_scores_past_the_bound_are_refused_and_nothing_is_written(tmp_path, score: float) -> None:
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"i": i} for i in range(4)])
    head = store.head
    bad = [{"row": 0, "step": 1, "score": 0.5}, {"row": 1, "step": 1, "score": score}]
    with pytest.raises(InvalidDataError, match=r"'score'.*\|score\| <= 1e\+250"):
        store.append([], outcomes=bad)
    with pytest.raises(InvalidDataError, match=r"'score'.*\|score\| <= 1e\+250"):
        store.outcome_stats(pending=bad)
    assert Store.open(str(tmp_path / "s")).head == head
    assert store.outcome_records().num_rows == 0


def test_scores_at_the_bound_keep_every_statistic_finite(tmp_path) -> None:
    """The bound itself is accepted, and many outcomes of it on one row (the 1e308 of the
    attack overflowed with two) leave sums, means and EWMAs finite."""
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"i": i} for i in range(2)])
    for step in range(3):
        store.append(
            [], outcomes=[{"row": 0, "step": step, "score": MAX_SCORE} for _ in range(1000)]
        )
    store.append([], outcomes=[{"row": 1, "step": 9, "score": -MAX_SCORE}] * 1000)
    stats = store.outcome_stats()
    for name in ("mean_score", "ewma_score"):
        values = stats.column(name).to_pylist()
        assert all(math.isfinite(v) for v in values), (name, values)
    # (3,000 sequential additions round: equal up to that)
    assert stats.column("mean_score").to_pylist() == pytest.approx([MAX_SCORE, -MAX_SCORE])


# -- deep select states ----------------------------------------------------------------------


def nested(depth: int, leaf: Any, as_list: bool) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value] if as_list else {"a": value}
    return value


@pytest.mark.parametrize("where", ["params", "select"])
@pytest.mark.parametrize("as_list", [False, True])
def test_a_select_nested_50000_deep_is_a_typed_error(
    ds: VersionedDataset, where: str, as_list: bool
) -> None:
    select = {"policy": "band", "lo": 0.0, "hi": 1.0}
    sampler = VersionedSampler(ds, seed=1, batch_size=4, select=select)
    next(iter(sampler))
    state = sampler.state_dict()
    before = copy.deepcopy(state)
    deep = nested(50_000, {}, as_list)
    state["select"] = {"policy": "band", "params": deep} if where == "params" else deep
    with pytest.raises(StateMismatchError, match=r"select=.*at most 8 levels deep"):
        sampler.load_state_dict(state)
    assert sampler.state_dict() == before  # the sampler as it was


def test_find_sampler_state_in_a_50000_deep_loader_state() -> None:
    assert find_sampler_state(nested(50_000, {}, as_list=False)) is None
    assert find_sampler_state(nested(50_000, [], as_list=True)) is None
    found = {"kind": "dynstate.VersionedSampler"}
    assert find_sampler_state(nested(5, found, as_list=False)) is found


# -- function signatures ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["one_arg", "three_args"])
def test_a_config_naming_a_function_of_the_wrong_signature(ds: VersionedDataset, name: str) -> None:
    config = {"policy": "function", "function": f"{__name__}:{name}"}
    with pytest.raises(InvalidDataError, match=rf"{name}\(stats.*fn\(stats, step\)"):
        VersionedSampler(ds, seed=1, batch_size=4, select=config)
    with pytest.raises(InvalidDataError, match=r"fn\(stats, step\)"):
        VersionedSampler(ds, seed=1, batch_size=4, select=globals()[name])


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"function": f"{__name__}:overflowing", "bogus": 1}, "unknown key.*'bogus'"),
        ({"function": ":overflowing"}, "cannot import"),
        ({"function": f"{__name__}:MAX_SCORE"}, "must be callable"),
    ],
)
def test_bad_function_configs_are_typed(ds: VersionedDataset, config: dict, message: str) -> None:
    with pytest.raises(InvalidDataError, match=message):
        VersionedSampler(ds, seed=1, batch_size=4, select={"policy": "function", **config})
