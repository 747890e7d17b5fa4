"""Outcomes, consumption records and rollback under hostile but plausible call sequences
(an outside audit). Each test below pins a defect of the code it was written against: it
says what is wrong and what the contract (SPEC.md, docs/) expects instead. The last tests are
guards for what held up (statistics against an oracle folded from the raw outcome files)."""

from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynstate import (
    DynamicSampling,
    DynstateError,
    InvalidDataError,
    StateMismatchError,
    Store,
    VersionedDataset,
    VersionedSampler,
    consumption_records,
    rollback,
)
from dynstate.history.story import consumption_series

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_stats_oracle import assert_identical, oracle

GROUP = 4


def score(items: list[dict[str, Any]], step: int) -> list[list[float]]:
    """A deterministic fake policy: a group's scores are a pure function of row and step;
    about a third of the groups agree (filtered by zero variance)."""
    out = []
    for item in items:
        r = item["id"]
        if (r * 7 + step) % 3 == 0:
            out.append([float((r + step) % 2)] * GROUP)
        else:
            out.append(
                [float((r * 31 + step * 17 + k * 13) % 5 >= 2 + (k == 0)) for k in range(GROUP)]
            )
    return out


def build(url: str, seed: int = 0) -> DynamicSampling:
    dataset = VersionedDataset(url)
    sampler = VersionedSampler(dataset, seed=seed)
    return DynamicSampling(dataset, sampler, gen_batch_size=4, train_groups=3, max_gen_batches=4)


def run_steps(url: str, steps: int) -> tuple[Store, dict[int, dict[str, Any]]]:
    """A fresh store of 40 rows and ``steps`` dynamic-sampling steps, each committed with its
    outcomes and consumption record; returns the store and each step's record."""
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(40)])
    dyn = build(url)
    dyn.resume(None)
    records = {}
    for step in range(steps):
        batch = dyn.next_batch(step, score)
        records[step] = batch.record
        store.append(
            [{"id": 1000 + step}],
            meta={"step": step},
            outcomes=batch.outcomes(),
            rows_version=batch.rows_version,
            consumption=batch.record,
        )
    return store, records


# -- 1. a refused resume changes the store ------------------------------------------------------


def test_a_resume_refused_for_its_sampler_state_rolls_nothing_back(tmp_path):
    # DEFECT: DynamicSampling.resume(N) rolls the store back (a reset commit) *before* it loads
    # the record's sampler state; a sampler built with another seed (or shuffle, or any other
    # sampler setting the state pins) is then refused with StateMismatchError — after the
    # rounds of the steps after N were already abandoned. A user who resumed from the wrong
    # (older) checkpoint and is told "construct the sampler with the same settings" has lost
    # the head: resuming from the right, later checkpoint now finds no record of its step.
    # EXPECTED (docs/dynamic-sampling.md, "What is refused": "the store is left as it was";
    # DynamicSampling.resume: "Nothing changes when it refuses"; SPEC §3.9): the refusal
    # leaves the head where it was — check the sampler state before rolling back.
    url = str(tmp_path / "store")
    store, _ = run_steps(url, 4)
    head = store.refresh()
    wrong = build(url, seed=1)
    with pytest.raises(StateMismatchError):
        wrong.resume(1)
    assert store.refresh() == head, "a refused resume committed a reset (rolled the store back)"
    # the right checkpoint (step 3) can still be resumed from
    assert build(url).resume(3) == 4


# -- 2. the exactly-once ledger accepts a step twice -------------------------------------------


@pytest.mark.parametrize("again", [3, 1], ids=["same-step", "older-step"])
def test_a_steps_consumption_record_is_committed_once(tmp_path, again):
    # DEFECT: Store.append(consumption=...) checks one record alone (shape, equation, meta
    # step, rows) but never against the lineage: a record for a step whose round already
    # recorded its consumption is accepted (a retried append, a stale process). Then
    #  * same step: consumption_records() lists step 3 twice, so every row it drew and
    #    trained counts twice in the ledger (consumption_series totals too);
    #  * older step (step 1's record again after step 3): the head's lineage now "ends" at
    #    step 1 — round_of walks back from the head and stops at it — so resume(3), the
    #    latest checkpoint, fails with "holds no consumption record for step 3" although
    #    step 3's record is on the lineage.
    # EXPECTED (SPEC §3.15 "never ... repeated"; docs/dynamic-sampling.md: the carry of step
    # N is the carried_in of N + 1, so over a run drawn = trained + filtered + dropped +
    # last carry; outcomes already refuse a step the lineage has): a consumption record of
    # a step the lineage already holds a record for (or of a step below its latest) is
    # refused before anything is written, as outcomes of such a step are.
    url = str(tmp_path / "store")
    store, records = run_steps(url, 4)
    head = store.refresh()
    try:
        store.append([], meta={"step": again}, consumption=records[again])
    except DynstateError:
        pass  # refused: the fix
    else:
        steps = [r["step"] for r in consumption_records(store)]
        assert steps == [0, 1, 2, 3], f"the ledger holds steps {steps}: a step counted twice"
    assert store.refresh() == head
    trained = Counter(row for r in consumption_records(store) for row in r["trained"])
    assert max(trained.values()) == 1, "a row trained twice in the ledger"
    assert build(url).resume(3) == 4


def test_a_consumption_record_with_meta_step_none_is_refused(tmp_path):
    # DEFECT: Writer._check_consumption only asks that meta has the key "step"; with
    # meta={"step": None} it passes None on to check_record, whose "step is not None" test
    # then skips the comparison with the record's own step. A round of no step (own_step is
    # None) carrying step 3's record is committed; round_of never finds it, so the record is
    # dead weight for resume, and a record whose step no round owns is in the ledger.
    # EXPECTED (docs/dynamic-sampling.md, "What is refused": "a record that breaks the
    # equation, a step other than meta["step"], no meta["step"] -> InvalidDataError"):
    # refused, store unchanged.
    url = str(tmp_path / "store")
    store, records = run_steps(url, 2)
    head = store.refresh()
    record = {**records[1], "step": 2}  # a well-formed record of the next step
    record["carried_in"] = [row for row, _ in records[1]["carry"]]
    record["drawn"] = []
    record["trained"] = list(record["carried_in"])
    record["filtered"], record["dropped"], record["carry"] = [], [], []
    with pytest.raises(InvalidDataError):
        store.append([], meta={"step": None}, consumption=record)
    assert store.refresh() == head


# -- 3. rollback keeps outcomes of the step it rolled back to before ----------------------------


def test_rollback_to_before_a_step_lets_its_outcomes_be_recorded_again(tmp_path):
    # DEFECT: a round whose meta has no int "step" belongs, for rollback, to the step before
    # it — even when it holds outcomes of a later step. The crashed run below committed step
    # 3's outcomes in such a round; rollback(step=2) keeps it (nothing is committed: the head
    # "is" step 2), so the crashed run's score of step 3 still counts in outcome_stats, and
    # the resumed run's step 3 is refused with "already have outcomes ... (roll back to before
    # that step to record them again)" — advice that the rollback it names cannot follow.
    # EXPECTED (docs/api.md: "A step that already has outcomes in the lineage is refused;
    # after a rollback to before it, it may be recorded again"; SPEC §3.6/§3.12: rounds after
    # the checkpoint do not leak into the resumed run, outcomes are treated as rows): either
    # the append of outcomes of step 3 in a round that is not step 3's (or later) is refused
    # up front, or rollback(step=2) drops it, so the resumed run records step 3 and only its
    # scores count.
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"x": i} for i in range(10)])
    for step in range(3):
        store.append([], meta={"step": step}, outcomes=[{"row": step, "step": step, "score": 1.0}])
    head = store.refresh()
    try:
        store.append([], meta={"note": "no step"}, outcomes=[{"row": 5, "step": 3, "score": 0.0}])
    except InvalidDataError:
        assert store.refresh() == head  # refused up front: the fix
        return
    rollback(store, step=2)
    store.append([], meta={"step": 3}, outcomes=[{"row": 5, "step": 3, "score": 1.0}])
    row5 = store.outcome_stats().to_pylist()[5]
    assert (row5["attempts"], row5["mean_score"]) == (1, 1.0)


# -- 4. a view's flag ---------------------------------------------------------------------------


def test_consumption_series_is_complete_when_the_limit_equals_the_records(tmp_path):
    # DEFECT (minor): consumption_series(limit=n) says complete=False whenever it found n
    # records, although a lineage holding exactly n counted every one (lineage_records
    # stops walking at n, so it cannot tell). EXPECTED (its docstring: "complete says
    # whether every record is counted"): True here — look one record further (limit + 1).
    url = str(tmp_path / "store")
    store, _ = run_steps(url, 3)
    series = consumption_series(store, store.head, limit=3)
    assert len(series["steps"]) == 3
    assert series["complete"] is True


# -- guards: what held up -----------------------------------------------------------------------


def _raw_records(url: str, store: Store, version: int) -> pa.Table:
    """The lineage's outcome records read with pyarrow from the files the commit records
    name (not through dynstate's reader), in lineage order."""
    refs = store.outcome_log.lineage_files(version)
    tables = [
        pq.read_table(str(Path(url) / ref.path)).select(["row", "step", "score"]) for ref in refs
    ]
    if not tables:
        return pa.table({"row": pa.array([], pa.int64()), "step": pa.array([], pa.int64()),
                         "score": pa.array([], pa.float64())})  # fmt: skip
    return pa.concat_tables(tables)


def test_stats_after_rollback_and_across_the_aggregate_boundary_equal_the_raw_fold(tmp_path):
    # GUARD: unsorted, repeated rows; steps out of order and far apart; a rollback in the
    # middle; 130 commits (an outcome checkpoint at 100): every handle's statistics equal
    # the documented fold of the raw files, bit for bit, and the abandoned step's scores
    # count nowhere.
    url = str(tmp_path / "store")
    rng = random.Random(7)
    store = Store.open(url, create=True)
    store.append([{"x": i} for i in range(30)])
    steps = list(range(0, 400, 3))
    rng.shuffle(steps)
    for k, step in enumerate(steps[:130]):
        recs = [
            {"row": rng.randrange(30), "step": step, "score": rng.choice([0.0, 1.0, 0.25, 2.5])}
            for _ in range(rng.randint(1, 9))
        ]
        store.append([], meta={"step": k}, outcomes=recs)
        if k == 60:
            store.append([], meta={"step": 61}, outcomes=[{"row": 0, "step": 10**9, "score": 9.0}])
            rollback(store, step=60)
    head = store.refresh()
    raw = _raw_records(url, store, head)
    assert 10**9 not in raw.column("step").to_pylist()
    for above, half in ((0.5, 10.0), (0.1, 10.0), (0.5, 2.0)):
        want = oracle(raw, 30, above, half)
        assert_identical(store.outcome_stats(success_above=above, half_life=half), want, "same")
        fresh = Store.open(url)
        assert_identical(fresh.outcome_stats(success_above=above, half_life=half), want, "fresh")
    assert np.array_equal(
        store.outcome_records().select(["row", "step", "score"]).to_pandas().values,
        raw.to_pandas().values,
    )
