"""The statistics of a version are bit-identical whichever handle computes them (issue 40.4):
a long-lived handle's ``outcome_stats(pending=...)`` before a commit, the same handle after
it, a fresh handle at the committed version (from a stored aggregate plus the files since,
or from every file) and an oracle that folds the raw records (``outcome_records()``) one by
one in plain Python, by the recurrence documented in :mod:`dynstate.records.aggregate`.
Compared as int64 bit patterns, not approximately."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynstate import Store
from dynstate.errors import CorruptStoreError
from dynstate.history.outcomes import OutcomeViews
from dynstate.log.outcomes import outcomes_of
from dynstate.records.aggregate import Aggregate
from dynstate.records.manifest import CHECKPOINT_INTERVAL
from dynstate.records.outcomes import MAX_SCORE

ROWS = 6
FLOATS = ("mean_score", "ewma_score")
INTS = ("attempts", "successes", "first_step", "last_step")


def oracle(records: pa.Table, num_rows: int, success_above: float, half_life: float) -> dict:
    """The documented fold, record by record in ``outcome_records()`` order, in Python
    floats (IEEE double, each operation rounded alone); only the weights use np.exp2."""
    total = [0.0] * num_rows
    num = [0.0] * num_rows
    den = [0.0] * num_rows
    last = [-1] * num_rows
    first = [-1] * num_rows
    attempts = [0] * num_rows
    successes = [0] * num_rows
    columns = records.select(["row", "step", "score"]).to_pydict()
    for row, step, score in zip(columns["row"], columns["step"], columns["score"], strict=True):
        total[row] = total[row] + score
        attempts[row] += 1
        successes[row] += score > success_above
        first[row] = step if first[row] < 0 else min(first[row], step)
        if step > last[row]:
            scale = float(np.exp2((last[row] - step) / half_life))
            num[row] = num[row] * scale + score
            den[row] = den[row] * scale + 1.0
            last[row] = step
        else:
            weight = float(np.exp2((step - last[row]) / half_life))
            num[row] = num[row] + score * weight
            den[row] = den[row] + weight
    trained = [a > 0 for a in attempts]
    return {
        "attempts": attempts,
        "successes": successes,
        "first_step": [f if t else None for f, t in zip(first, trained, strict=True)],
        "last_step": [x if t else None for x, t in zip(last, trained, strict=True)],
        "mean_score": [s / a if a else None for s, a in zip(total, attempts, strict=True)],
        "ewma_score": [n / d if t else None for n, d, t in zip(num, den, trained, strict=True)],
    }


def bits(values: list[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], np.float64).view(np.int64)


def assert_identical(got: pa.Table, want: dict, what: str) -> None:
    for name in INTS:
        assert got.column(name).to_pylist() == want[name], (what, name)
    for name in FLOATS:
        a, b = bits(got.column(name).to_pylist()), bits(want[name])
        assert np.array_equal(a, b), (what, name, got.column(name).to_pylist(), want[name])


def as_dict(table: pa.Table) -> dict:
    return {name: table.column(name).to_pylist() for name in (*INTS, *FLOATS)}


# Scores whose sums round: wide magnitudes and signs, repeated values, the bound itself.
scores = st.one_of(
    st.sampled_from([0.0, 1.0, 0.5, 0.1, 1 / 3, -0.7, MAX_SCORE, -MAX_SCORE, 1e-300]),
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
)


@st.composite
def histories(draw: Any) -> list[list[dict[str, Any]]]:
    """Commits of outcomes: each a few steps new to the lineage (in any order, not
    ascending across commits), rows unsorted and repeated."""
    unused = list(range(40))
    commits = []
    for _ in range(draw(st.integers(1, 12))):
        if not unused:
            break
        n_steps = draw(st.integers(1, min(3, len(unused))))
        steps = []
        for _ in range(n_steps):
            steps.append(unused.pop(draw(st.integers(0, len(unused) - 1))))
        records = draw(
            st.lists(
                st.tuples(st.integers(0, ROWS - 1), st.sampled_from(steps), scores),
                min_size=1,
                max_size=20,
            )
        )
        commits.append([{"row": r, "step": s, "score": x} for r, s, x in records])
    return commits


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    commits=histories(),
    half_life=st.sampled_from([10.0, 3.0, 0.7]),
    success_above=st.sampled_from([0.5, 0.0]),
)
def test_pending_committed_fresh_and_oracle_agree_bit_for_bit(
    commits: list[list[dict[str, Any]]], half_life: float, success_above: float
) -> None:
    url = f"memory://stats-oracle-{uuid.uuid4().hex}"
    trainer = Store.open(url, create=True)
    trainer.append([{"i": i} for i in range(ROWS)])
    params = {"half_life": half_life, "success_above": success_above}
    for outcomes in commits:
        before = trainer.head
        trainer.outcome_stats(before, **params)  # the long-lived handle caches the base
        pending = trainer.outcome_stats(before, pending=outcomes, **params)
        trainer.append([], outcomes=outcomes)
        version = trainer.head
        records = Store.open(url).outcome_records(version)
        want = oracle(records, ROWS, success_above, half_life)
        assert_identical(pending, want, "pending")
        assert_identical(trainer.outcome_stats(version, **params), want, "long-lived")
        assert_identical(Store.open(url).outcome_stats(version, **params), want, "fresh")


@pytest.mark.parametrize(
    ("num_rows", "form"),
    [(ROWS, "dense"), (4 * ROWS, "sparse")],  # every row trained / a quarter of them
)
def test_stored_aggregate_plus_files_equals_the_fold_of_every_record(
    num_rows: int, form: str
) -> None:
    """Past a checkpoint (a stored aggregate over the first 100 commits' files), a fresh
    handle reads that aggregate and folds the files after it; a handle that never saw the
    checkpoint folds them all, the long-lived one continues its own cache: all equal the
    oracle, bit for bit. In both stored forms: every row (at least half trained) or the
    trained rows only; and with rows appended after the checkpoint."""
    url = f"memory://stats-oracle-{uuid.uuid4().hex}"
    trainer = Store.open(url, create=True)
    trainer.append([{"i": i} for i in range(num_rows)])
    rng = np.random.default_rng(7)
    order = rng.permutation(CHECKPOINT_INTERVAL + 20)  # steps out of order across commits
    for k, step in enumerate(order.tolist()):
        outcomes = [
            {"row": int(r), "step": step, "score": float(x)}
            for r, x in zip(rng.integers(0, ROWS, 7), rng.normal(size=7) * 1e3, strict=True)
        ]
        # rows appended after the checkpoint: the stored aggregate is narrower than the head
        rows = [{"i": num_rows + k}] if k > CHECKPOINT_INTERVAL else []
        trainer.append(rows, outcomes=outcomes)
        trainer.outcome_stats()
    outcomes_of(trainer.log).flush()
    version = trainer.head
    fresh = Store.open(url)
    stored = outcomes_of(fresh.log).lineage(version).aggregate
    assert stored is not None  # the checkpoint
    written = pq.read_table(pa.BufferReader(fresh.log.storage.read(stored.path)))
    assert written.num_rows == (num_rows if form == "dense" else ROWS), form
    want = oracle(fresh.outcome_records(version), fresh.snapshot(version).num_rows, 0.5, 10.0)
    assert_identical(fresh.outcome_stats(version), want, "stored aggregate + files")
    assert_identical(trainer.outcome_stats(version), want, "long-lived")
    # another half-life: no stored aggregate, every file folded in one pass
    want3 = oracle(fresh.outcome_records(version), fresh.snapshot(version).num_rows, 0.5, 3.0)
    assert_identical(Store.open(url).outcome_stats(version, half_life=3.0), want3, "all files")


def test_both_stored_forms_read_back_as_the_aggregate_written() -> None:
    """The dense and the sparse form (and the sparse form as stores before the dense one
    wrote it: zstd, no delta coding) give back the same arrays; a ``row`` column that is
    not every row in order, or names a row out of range, is the sparse form or an error."""
    rng = np.random.default_rng(3)
    n = 50
    for trained in (0, 3, n // 2 - 1, n // 2 + 1, n):  # the last one dense
        agg = Aggregate.empty(n, 0.5, 10.0)
        rows = rng.permutation(n)[:trained]
        if trained:
            agg.fold(
                pa.table(
                    {
                        "row": np.repeat(rows, 3),
                        "step": np.tile(np.arange(3), trained),
                        "score": rng.integers(0, 2, 3 * trained).astype(np.float64),
                    }
                )
            )
        table = agg.to_table()
        assert table.num_rows == (n if 2 * trained >= n else trained)
        for compression in ("lz4", "zstd"):
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink, compression=compression)
            back = Aggregate.from_table(pq.read_table(pa.BufferReader(sink.getvalue())), "x")
            for name in Aggregate._SUMS:
                assert np.array_equal(getattr(back, name), getattr(agg, name)), name
                assert getattr(back, name).flags.writeable, name  # a fold writes into it
            assert np.array_equal(back.values, agg.values)
            assert np.array_equal(back.counts, agg.counts)
    # every row, out of order: read as the sparse form, row by row
    table = agg.to_table()
    shuffled = table.take(pa.array(rng.permutation(table.num_rows)))
    back = Aggregate.from_table(shuffled, "x")
    for name in Aggregate._SUMS:
        assert np.array_equal(getattr(back, name), getattr(agg, name)), name
    assert np.array_equal(back.counts, agg.counts)
    bad = table.set_column(0, "row", pa.array(np.arange(1, n + 1, dtype=np.int64)))
    with pytest.raises(CorruptStoreError, match="row out of range"):
        Aggregate.from_table(bad, "x")


def test_row_history_ends_at_the_rows_mean_score() -> None:
    """A row's history (steps committed in order) ends at the mean ``outcome_stats`` gives,
    bit for bit: both add the row's scores one by one in the same order."""
    url = f"memory://stats-oracle-{uuid.uuid4().hex}"
    store = Store.open(url, create=True)
    store.append([{"i": i} for i in range(2)])
    rng = np.random.default_rng(3)
    for step in range(30):
        store.append(
            [],
            outcomes=[{"row": 0, "step": step, "score": float(x)} for x in rng.random(12) / 7],
        )
    history = OutcomeViews(store).row_history(store.head, 0)
    assert history is not None
    mean = store.outcome_stats().column("mean_score")[0].as_py()
    assert history["steps"][-1]["mean_score"] == mean
    assert history["mean_score"] == mean
