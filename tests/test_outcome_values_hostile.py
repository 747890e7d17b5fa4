"""Outcome values and the credit each row gets, under hostile but plausible inputs (an outside
audit). The oracle everywhere: the records the test itself passed in, and a plain left fold of
``Store.outcome_records()`` written below from the definitions of docs/api.md ("Outcomes and
generator state") and docs/outcomes.md. A test whose docstring starts "DEFECT." fails against
the code it was written for and says what the docs expect; "Guard." tests pin what held up."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

from dynstate import (
    CommitConflictError,
    InvalidDataError,
    Learnability,
    PassRateBand,
    SchemaMismatchError,
    Store,
    VersionCollectedError,
    collect_garbage,
    compact,
    rollback,
    verify_store,
    version_at_step,
)

Record = tuple[int, int, float]

# -- the oracle --------------------------------------------------------------------------------


def fold(records: list[Record], num_rows: int, above: float = 0.5, half: float = 10.0) -> dict:
    """docs/api.md, ``outcome_stats``: per row ``attempts``; ``successes`` (records with
    ``score > success_above``); ``mean_score``; ``ewma_score`` weighing each record
    ``2 ** ((step - last_step) / half_life)`` relative to the row's latest step;
    ``first_step`` / ``last_step``; the last four None for rows never trained. Folded record
    by record, in lineage order, as plainly as it can be written."""
    att = [0] * num_rows
    won = [0] * num_rows
    total = [0.0] * num_rows
    first: list[int | None] = [None] * num_rows
    last: list[int | None] = [None] * num_rows
    num = [0.0] * num_rows
    den = [0.0] * num_rows
    for row, step, score in records:
        att[row] += 1
        won[row] += score > above
        total[row] += score
        first[row] = step if first[row] is None else min(first[row], step)
        prev = last[row]
        if prev is None or step > prev:
            scale = 0.0 if prev is None else 2.0 ** ((prev - step) / half)
            num[row] = num[row] * scale + score
            den[row] = den[row] * scale + 1.0
            last[row] = step
        else:
            weight = 2.0 ** ((step - prev) / half)
            num[row] += score * weight
            den[row] += weight
    return {
        "row": list(range(num_rows)),
        "attempts": att,
        "successes": won,
        "mean_score": [total[r] / att[r] if att[r] else None for r in range(num_rows)],
        "ewma_score": [num[r] / den[r] if att[r] else None for r in range(num_rows)],
        "first_step": first,
        "last_step": last,
    }


def assert_stats(stats: pa.Table | dict, expected: dict, where: str) -> None:
    got = stats.to_pydict() if isinstance(stats, pa.Table) else stats
    assert got["row"] == expected["row"], where
    for name in ("attempts", "successes", "first_step", "last_step"):
        bad = [r for r, (a, b) in enumerate(zip(got[name], expected[name], strict=True)) if a != b]
        assert not bad, (
            f"{where}: {name} of rows {bad[:5]}: {[got[name][r] for r in bad[:5]]} != "
            f"{[expected[name][r] for r in bad[:5]]} (the fold of the raw records)"
        )
    for name in ("mean_score", "ewma_score"):
        for r, (a, b) in enumerate(zip(got[name], expected[name], strict=True)):
            ok = (a is None and b is None) or (
                a is not None and b is not None and math.isclose(a, b, rel_tol=1e-12)
            )
            assert ok, f"{where}: {name} of row {r} is {a!r}, the fold of the records {b!r}"


def records_of(store: Store, version: Any = None) -> list[Record]:
    t = store.outcome_records(version)
    return list(
        zip(t["row"].to_pylist(), t["step"].to_pylist(), t["score"].to_pylist(), strict=True)
    )


def new_store(path: Path, rows: int) -> Store:
    store = Store.open(str(path), create=True)
    store.append([{"x": i} for i in range(rows)])
    return store


# -- every documented input form records exactly what was passed -------------------------------

ROWS = [3, 0, 49, 3, 17]  # unsorted, one row twice (a GRPO group), the last row of 50
STEPS = [7, 7, 2, 9, 7]  # several steps in one commit, out of order
SCORES = [0.1, 0.3, 1.0, -0.0, 0.5]  # 0.5 sits exactly on the default threshold


def _as(values: list[float], dtype: Any) -> list[float]:
    """The float64 values of ``values`` held in ``dtype`` (what the store must keep)."""
    if isinstance(dtype, torch.dtype):
        return [float(v) for v in torch.tensor(values, dtype=dtype).tolist()]
    return [float(v) for v in np.asarray(values, dtype=dtype).tolist()]


def _forms() -> list[tuple[str, Any, list[float]]]:
    forms: list[tuple[str, Any, list[float]]] = []
    plain = [{"row": r, "step": s, "score": x} for r, s, x in zip(ROWS, STEPS, SCORES, strict=True)]
    forms.append(("list of dicts", plain, SCORES))
    forms.append(("tuple of dicts", tuple(plain), SCORES))
    ints = [1, 0, 3, 0, 2]
    forms.append(
        (
            "list of dicts, int scores",
            [{"row": r, "step": s, "score": x} for r, s, x in zip(ROWS, STEPS, ints, strict=True)],
            [float(x) for x in ints],
        )
    )
    forms.append(
        (
            "list of dicts of numpy scalars",
            [
                {"row": np.int32(r), "step": np.uint8(s), "score": np.float16(x)}
                for r, s, x in zip(ROWS, STEPS, SCORES, strict=True)
            ],
            _as(SCORES, np.float16),
        )
    )
    forms.append(
        (
            "list of dicts of 0-d tensors",
            [
                {"row": torch.tensor(r), "step": torch.tensor(s), "score": torch.tensor(x)}
                for r, s, x in zip(ROWS, STEPS, SCORES, strict=True)
            ],
            _as(SCORES, torch.float32),
        )
    )
    for rd in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
        forms.append(
            (
                f"numpy rows {np.dtype(rd).name}",
                {
                    "row": np.array(ROWS, rd),
                    "step": np.array(STEPS, rd),
                    "score": np.array(SCORES),
                },
                SCORES,
            )
        )
    for sd in (np.float16, np.float32, np.float64):
        forms.append(
            (
                f"numpy scores {np.dtype(sd).name}",
                {"row": np.array(ROWS), "step": np.array(STEPS), "score": np.array(SCORES, sd)},
                _as(SCORES, sd),
            )
        )
    for sd in (np.int8, np.uint8, np.int64, np.uint64):
        forms.append(
            (
                f"numpy int scores {np.dtype(sd).name}",
                {"row": np.array(ROWS), "step": np.array(STEPS), "score": np.array(ints, sd)},
                [float(x) for x in ints],
            )
        )
    for td in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        forms.append(
            (
                f"torch scores {td}",
                {
                    "row": torch.tensor(ROWS, dtype=torch.int32),
                    "step": torch.tensor(STEPS, dtype=torch.uint8),
                    "score": torch.tensor(SCORES, dtype=td),
                },
                _as(SCORES, td),
            )
        )
    forms.append(
        (
            "torch int64 scores",
            {"row": torch.tensor(ROWS), "step": torch.tensor(STEPS), "score": torch.tensor(ints)},
            [float(x) for x in ints],
        )
    )
    forms.append(
        (
            "dict of lists of numpy scalars",
            {
                "row": [np.int64(r) for r in ROWS],
                "step": [np.uint16(s) for s in STEPS],
                "score": [np.float32(x) for x in SCORES],
            },
            _as(SCORES, np.float32),
        )
    )
    table = pa.table(
        {
            "row": pa.array(ROWS, pa.uint32()),
            "step": pa.array(STEPS, pa.int16()),
            "score": pa.array(np.array(SCORES, np.float16)),
        }
    )
    forms.append(("pyarrow table, float16 scores", table, _as(SCORES, np.float16)))
    wide = pa.table({"row": [0] * 3 + ROWS, "step": [1] * 3 + STEPS, "score": [9.0] * 3 + SCORES})
    forms.append(("pyarrow table slice", wide.slice(3), SCORES))
    chunked = pa.concat_tables([wide.slice(0, 5), wide.slice(5)]).slice(3)
    forms.append(("pyarrow chunked slice", chunked, SCORES))
    forms.append(
        (
            "pyarrow record batch",
            pa.RecordBatch.from_pydict(table.to_pydict()),
            _as(SCORES, np.float16),
        )
    )
    frame = pd.DataFrame({"row": ROWS, "step": STEPS, "score": np.array(SCORES, np.float32)})
    forms.append(("pandas frame", frame, _as(SCORES, np.float32)))
    forms.append(
        ("pandas frame, row as named index", frame.set_index("row"), _as(SCORES, np.float32))
    )
    return forms


FORMS = _forms()


@pytest.mark.parametrize("name", [f[0] for f in FORMS])
def test_every_outcome_input_form_records_exactly_the_values_passed(tmp_path, name):
    """Guard. docs/api.md: outcomes are "a pyarrow.Table, a list of dicts or a dict of columns"
    (numpy arrays and torch tensors as columns, numpy scalars and 0-d tensors as values;
    pandas frames as rounds are), the score "stored as float64". Every form records each
    record against the row it names — unsorted, repeated, the last row — at its step, with
    the float64 value of the score as given (float16, bfloat16 and float32 widened exactly),
    and ``pending=`` in the same form gives the statistics the commit then has."""
    _, data, scores = next(f for f in FORMS if f[0] == name)
    store = new_store(tmp_path / "s", 50)
    expected = list(zip(ROWS, STEPS, scores, strict=True))
    pending = store.outcome_stats(pending=data).to_pydict()
    store.append([], outcomes=data)
    got = records_of(store)
    assert got == expected
    assert [math.copysign(1.0, x) for _, _, x in got] == [
        math.copysign(1.0, x) for x in scores
    ]  # -0.0 stays -0.0
    truth = fold(expected, 50)
    assert_stats(store.outcome_stats(), truth, name)
    assert_stats(pending, truth, f"{name}: pending=")


# -- values at the bounds ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "score",
    [-0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1e250, -1e250, 2**53, -(2**53), 0.5],
)
def test_extreme_but_valid_scores_are_kept_exactly(tmp_path, score):
    """Guard. docs/api.md: a score is a "finite int or float, stored as float64"; format.md
    bounds it by ``|score| <= 1e250``; an int up to 2**53 is held exactly. Subnormals,
    -0.0, the bound itself and 2**53 are kept bit for bit and counted by the fold's rules
    (a score equal to ``success_above`` is no success: "records with score > success_above")."""
    store = new_store(tmp_path / "s", 4)
    records = [(1, 3, score), (1, 4, 0.25), (2, 4, score)]
    store.append([], outcomes=[{"row": r, "step": s, "score": x} for r, s, x in records])
    got = records_of(store)
    assert got == [(r, s, float(x)) for r, s, x in records]
    assert math.copysign(1.0, got[0][2]) == math.copysign(1.0, score)
    for above in (float(score), 0.0, -0.0, 0.5, -1e250, 1e250):
        for half in (10.0, 0.5):
            stats = store.outcome_stats(success_above=above, half_life=half)
            assert_stats(stats, fold(got, 4, above, half), f"above={above} half={half}")


BAD_SCORES = [
    ("NaN", float("nan")),
    ("inf", float("inf")),
    ("-inf", float("-inf")),
    ("past the bound", 1.0000001e250),
    ("int past 2**53", 2**53 + 1),
    ("None", None),
    ("bool", True),
    ("string", "1.0"),
    ("numpy NaN", np.float32("nan")),
]


@pytest.mark.parametrize("name", [b[0] for b in BAD_SCORES])
def test_invalid_scores_are_refused_with_nothing_written(tmp_path, name):
    """Guard. docs/api.md: ``score`` is a finite int or float (ints past 2**53 refused), and
    "Both are checked before anything is written; a refusal is an InvalidDataError and the
    store is unchanged" — in every form, so no record is silently turned into another
    value (a bool into 1.0, NaN into a null, 2**53 + 1 into 2**53)."""
    value = dict(BAD_SCORES)[name]
    store = new_store(tmp_path / "s", 4)
    store.append([], outcomes=[{"row": 0, "step": 1, "score": 0.5}])
    head = store.head
    forms = [
        [{"row": 1, "step": 2, "score": 0.5}, {"row": 2, "step": 2, "score": value}],
        {"row": [1, 2], "step": [2, 2], "score": [0.5, value]},
    ]
    if not isinstance(value, (str, type(None))):
        # an array of the value's own type (numpy would round 2**53 + 1 in a float array)
        forms.append(
            {"row": np.array([1, 2]), "step": np.array([2, 2]), "score": np.array([value] * 2)}
        )
    for form in forms:
        with pytest.raises(InvalidDataError):
            store.append([{"x": 9}], outcomes=form)
        with pytest.raises(InvalidDataError):
            store.outcome_stats(pending=form)
    assert store.refresh() == head
    assert records_of(store) == [(0, 1, 0.5)]
    store.append([], outcomes=[{"row": 1, "step": 2, "score": 1.0}])  # step 2 still free
    assert records_of(store) == [(0, 1, 0.5), (1, 2, 1.0)]


BAD_ROWS_STEPS = [
    ("row -1", {"row": [0, -1], "step": [5, 5]}),
    ("row == rows", {"row": [0, 10], "step": [5, 5]}),
    ("row 2**53", {"row": [2**53], "step": [5]}),
    ("row float", {"row": [1.0], "step": [5]}),
    ("row bool", {"row": [True], "step": [5]}),
    ("row numpy float", {"row": np.array([1.0]), "step": np.array([5])}),
    ("row torch float", {"row": torch.tensor([1.0]), "step": torch.tensor([5])}),
    ("row None", {"row": [None], "step": [5]}),
    ("step -1", {"row": [0], "step": [-1]}),
    ("step 2**53", {"row": [0], "step": [2**53]}),
    ("step float", {"row": [0], "step": [5.0]}),
    ("step committed before", {"row": [0, 1], "step": [5, 3]}),
    ("step inside a committed range", {"row": [0], "step": [11]}),
    ("row of the same commit", {"row": [10], "step": [5]}),
]


@pytest.mark.parametrize("name", [b[0] for b in BAD_ROWS_STEPS])
def test_rows_and_steps_outside_the_contract_are_refused(tmp_path, name):
    """Guard. docs/api.md: ``row`` is "a row of the version the round is appended to" (rows
    the same commit adds are refused), ``step`` an int >= 0 below 2**53, and "A step that
    already has outcomes in the lineage is refused" — for one step of a commit's range too.
    Refused before anything is written: the head and the records stay as they were."""
    columns = dict(dict(BAD_ROWS_STEPS)[name])
    columns["score"] = [1.0] * len(columns["row"])
    store = new_store(tmp_path / "s", 10)
    store.append(
        [], outcomes={"row": [1, 2, 3, 2], "step": [3, 10, 12, 11], "score": [0.0, 1.0, 0.5, 0.5]}
    )
    before = records_of(store)
    head = store.head
    with pytest.raises(InvalidDataError):
        store.append([{"x": 99}], outcomes=columns)
    with pytest.raises(InvalidDataError):
        store.outcome_stats(pending=columns)
    assert store.refresh() == head
    assert records_of(store) == before
    # the edges themselves are fine: the last row, step 2**53 - 1, a step between two ranges
    store.append([], outcomes={"row": [9, 0], "step": [2**53 - 1, 4], "score": [1.0, 0.0]})
    assert records_of(store) == [*before, (9, 2**53 - 1, 1.0), (0, 4, 0.0)]


def test_a_refused_round_records_no_outcomes_and_leaves_their_step_free(tmp_path):
    """Guard. docs/api.md: "one version holds the round, its outcomes and the state: a crash
    never leaves one without the other"; a refusal of the round (schema), the meta or the
    state writes nothing. The step stays free and, committed afterwards, counts once."""
    store = new_store(tmp_path / "s", 6)
    scored = [{"row": 2, "step": 4, "score": 1.0}, {"row": 2, "step": 4, "score": 0.0}]
    with pytest.raises(SchemaMismatchError):
        store.append([{"x": "text"}], outcomes=scored)
    with pytest.raises(InvalidDataError):
        store.append([{"x": 1}], outcomes=scored, generator_state={"t": (1, 2)})
    with pytest.raises(InvalidDataError):
        store.append([{"x": 1}], outcomes=scored, meta={"bad": float("nan")})
    assert records_of(store) == []
    part = store.stage([{"x": 7}])
    with pytest.raises(InvalidDataError):
        store.commit_staged([part], outcomes=[{"row": 6, "step": 4, "score": 1.0}])  # its own row
    store.commit_staged([part], outcomes=scored)
    with pytest.raises(InvalidDataError):
        store.append([], outcomes=scored)  # counted once: step 4 is taken now
    assert records_of(store) == [(2, 4, 1.0), (2, 4, 0.0)]
    assert store.snapshot().num_rows == 7
    assert_stats(store.outcome_stats(), fold(records_of(store), 7), "after the refusals")


# -- many steps, checkpoints, resets, compaction, gc and a fresh process -----------------------

VALUES = [-0.0, 0.0, 5e-324, 0.25, 0.5, 0.75, 1.0, -1.0, 1e250]


def _round(rng: np.random.Generator, num_rows: int, steps: list[int], scores: list[float]) -> dict:
    n = 2 * len(steps) + 2
    return {
        "row": rng.integers(0, num_rows, n),  # numpy int64 column, repeats
        "step": [steps[i % len(steps)] for i in range(n)],
        "score": [scores[int(i)] for i in rng.integers(0, len(scores), n)],
    }


def _history(tmp_path: Path) -> tuple[Store, dict[int, list[Record]], dict[int, int]]:
    """A store of 240 commits (outcome checkpoints at 100 and 200 written on the way), one new
    row per commit, two steps per commit out of order, scores from nine values (-0.0, a
    subnormal, the threshold, 1e250) and past commit 150 continuous ones; a rollback at
    commit 170 to step 120 re-records the dropped steps with other scores. Returns the store,
    the records of every version's lineage (from what was passed in) and rows per version."""
    rng = np.random.default_rng(7)
    store = new_store(tmp_path / "s", 20)
    lineage: dict[int, list[Record]] = {1: []}
    rows = {1: 20}
    head = 1
    step = 0
    for k in range(240):
        if k == 170:
            head = rollback(store, step=120)
            lineage[head] = list(lineage[store.commit_record(head).target])
            rows[head] = store.snapshot(head).num_rows
            step = 121
        step += 1
        scores = VALUES if k < 150 else [round(float(x), 6) for x in rng.random(9)]
        data = _round(rng, rows[head], [step + 1000, step], scores)
        # the outcomes' steps are 1000 apart: the meta step is the smaller one
        version = store.append([{"x": 1000 + k}], meta={"step": step}, outcomes=data)
        passed = list(zip(data["row"].tolist(), data["step"], data["score"], strict=True))
        lineage[version] = lineage[head] + passed
        rows[version] = rows[head] + 1
        head = version
    return store, lineage, rows


THRESHOLDS = [0.5, -0.0, 0.0, 5e-324, 0.25, 0.75, 1.0, -1.0, 1e250, 0.3]


def test_stats_over_hundreds_of_steps_equal_a_plain_fold_of_the_records(tmp_path):
    """Guard. docs/api.md ``outcome_stats``: the statistics of a version are those of its
    lineage's records ("after reset/rollback to N the statistics are N's exactly"), at any
    ``success_above`` — exactly on a score value too — and ``half_life``; docs/outcomes.md
    "Cost": past 100 and 200 commits they come from the stored aggregates plus the files
    since, and from the score histogram at other thresholds (continuous scores past 16
    values: from the records). Checked at versions before, on and after both checkpoints,
    on the abandoned branch and after the rollback, against the records passed in."""
    store, lineage, rows = _history(tmp_path)
    assert (tmp_path / "s" / "_dynstate" / "outcomes" / f"{100:020d}.json").exists()
    assert (tmp_path / "s" / "_dynstate" / "outcomes" / f"{200:020d}.json").exists()
    reset = next(v for v in lineage if store.commit_record(v).op == "reset")
    for v in (2, 99, 100, 101, 121, 150, reset - 1, reset, reset + 1, 199, 200, 201, store.head):
        assert records_of(store, v) == lineage[v], f"version {v}"
        for above in THRESHOLDS:
            for half in (10.0, 3.0):
                stats = store.outcome_stats(v, success_above=above, half_life=half)
                assert_stats(stats, fold(lineage[v], rows[v], above, half), f"v{v} {above} {half}")
    # pending at the head: what the commit then gives
    pending = {
        "row": [0, rows[store.head] - 1, 0],
        "step": [5000, 4999, 5000],
        "score": [0.5, 1.0, 0.0],
    }
    before = store.outcome_stats(success_above=0.0, half_life=2.0, pending=pending).to_pydict()
    store.append([], outcomes=pending)
    passed = list(zip(pending["row"], pending["step"], pending["score"], strict=True))
    truth = fold(lineage[store.head - 1] + passed, rows[store.head - 1], 0.0, 2.0)
    assert_stats(before, truth, "pending")
    assert_stats(store.outcome_stats(success_above=0.0, half_life=2.0), truth, "committed")


_FRESH = """
import json, sys, dynstate
store = dynstate.Store.open(sys.argv[1])
out = {}
for v in json.loads(sys.argv[2]):
    for above in json.loads(sys.argv[3]):
        for half in (10.0, 3.0):
            out[f"{v} {above!r} {half!r}"] = store.outcome_stats(
                v, success_above=above, half_life=half).to_pydict()
    t = store.outcome_records(v)
    out[f"{v} records"] = [t["row"].to_pylist(), t["step"].to_pylist(), t["score"].to_pylist()]
print(json.dumps(out))
"""


def _fresh(path: Path, versions: list[int], thresholds: list[float]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _FRESH, str(path), json.dumps(versions), json.dumps(thresholds)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_compaction_gc_and_a_fresh_process_keep_every_rows_statistics(tmp_path):
    """Guard. docs/api.md: "compaction never changes them; gc keeps what kept versions need";
    docs/format.md "gc": the floor's complete outcome list is kept and the floor gets an
    outcome checkpoint. After a compaction and a gc to a floor that is no multiple of 100,
    the head's and the floor's statistics and records are the fold of the records passed in,
    in this process and in a fresh one; a ``rows_version`` gc collected is refused with
    VersionCollectedError, not taken for a row of the head."""
    store, lineage, rows = _history(tmp_path)
    head = store.head
    before = {a: store.outcome_stats(success_above=a).to_pydict() for a in THRESHOLDS}
    compacted = compact(store, target_bytes=1 << 20)
    assert compacted == head + 1
    lineage[compacted], rows[compacted] = lineage[head], rows[head]
    for above in THRESHOLDS:
        assert store.outcome_stats(success_above=above).to_pydict() == before[above]
    version = store.append([], outcomes={"row": [4, 4], "step": [7000, 7001], "score": [1.0, 0.5]})
    lineage[version] = lineage[compacted] + [(4, 7000, 1.0), (4, 7001, 0.5)]
    rows[version] = rows[compacted]
    result = collect_garbage(store, keep=37, grace_s=0, dry_run=False)
    floor = result.floor_after
    assert floor % 100 != 0 and floor > 150, floor
    with pytest.raises(VersionCollectedError):
        store.append([], outcomes=[{"row": 0, "step": 9000, "score": 1.0}], rows_version=floor - 5)
    keep = [floor, floor + 1, store.head]
    for v in keep:
        assert records_of(store, v) == lineage[v]
        for above in THRESHOLDS:
            assert_stats(
                store.outcome_stats(v, success_above=above),
                fold(lineage[v], rows[v], above),
                f"v{v}",
            )
    fresh = _fresh(tmp_path / "s", keep, THRESHOLDS)
    for v in keep:
        assert [tuple(x) for x in zip(*fresh[f"{v} records"], strict=True)] == lineage[v]
        for above in THRESHOLDS:
            for half in (10.0, 3.0):
                key = f"{v} {above!r} {half!r}"
                assert_stats(fresh[key], fold(lineage[v], rows[v], above, half), f"fresh {key}")


# -- outcomes bind to the rows they were scored on --------------------------------------------


def _reset_under(tmp_path: Path) -> tuple[Store, Store]:
    """docs/outcomes.md's sequence: writer W reads the head, version 2 (40 rows); another
    handle X resets to version 1 (30 rows) and appends 10 other rows, so row 35 of the head
    (version 4) is not the row 35 W scored."""
    url = str(tmp_path / "s")
    writer = Store.open(url, create=True)
    writer.append([{"x": i} for i in range(30)])
    writer.append([{"x": 100 + i} for i in range(10)])
    writer.refresh()  # W looks at version 2 and reads its rows
    other = Store.open(url)
    other.reset(1)
    other.append([{"x": 200 + i} for i in range(10)])
    return writer, other


SCORED = [{"row": 35, "step": 1, "score": 1.0}, {"row": 3, "step": 1, "score": 0.0}]


def test_outcomes_of_rows_read_before_a_reset_are_never_credited_to_the_new_rows(tmp_path):
    """Guard. docs/outcomes.md "Outcomes bind to the rows they were scored on": W's outcomes,
    by default and with ``rows_version=2``, are refused with CommitConflictError (also for
    ``pending=``, and again after W commits rows only); an older ``rows_version`` on the
    lineage is accepted with its rows bounded by that version's row count; one past the
    head is refused; a compaction since keeps the rows where they were; and W's own reset
    rebinds W's default to the new head ("the handle chose the rows it goes on with")."""
    writer, other = _reset_under(tmp_path)
    for kwargs in ({}, {"rows_version": 2}):
        with pytest.raises(CommitConflictError):
            writer.append([], outcomes=SCORED, **kwargs)
        with pytest.raises(CommitConflictError):
            writer.outcome_stats(pending=SCORED, **kwargs)
    writer.append([{"x": 300}])  # a later commit of rows only launders nothing
    with pytest.raises(CommitConflictError):
        writer.append([], outcomes=SCORED)
    with pytest.raises(CommitConflictError):
        writer.append([], outcomes=SCORED, rows_version=writer.head + 7)  # no such version yet
    with pytest.raises(InvalidDataError):
        writer.append([], outcomes=SCORED, rows_version=1)  # row 35 is no row of version 1
    assert records_of(writer, writer.refresh()) == []
    compact(other)
    v = writer.append([], outcomes=[{"row": 29, "step": 1, "score": 1.0}], rows_version=1)
    assert records_of(writer, v) == [(29, 1, 1.0)]
    writer.reset(2)  # W goes back to the rows it read: its default binds there again
    v = writer.append([], outcomes=SCORED)
    assert records_of(writer, v) == [(35, 1, 1.0), (3, 1, 0.0)]
    assert writer.snapshot(v).to_arrow().column("x")[35].as_py() == 105


_LOOKS_THAT_ARE_NOT = {
    # a tag of the version W read its rows at: not a read of the head, and a write
    "tag of an older version": lambda store: store.tag("scored-at", 1),
    # a gc dry run plans and deletes nothing: maintenance, not a read of the head
    "collect_garbage dry run": lambda store: collect_garbage(store),
    # added with the fix: every read dynstate makes for itself, none of them the user's
    "tag of the head": lambda store: store.tag("latest"),
    "compact": lambda store: compact(store),
    "versions": lambda store: store.versions(),
    "version_at_step": lambda store: version_at_step(store, 1),
    "rollback to the head": lambda store: rollback(store, version=store.latest()),
    "verify_store": lambda store: verify_store(store),
    "resolve the head": lambda store: store.resolve(None),
    "generator_state of the head": lambda store: store.generator_state(),
    "outcome_records of the head": lambda store: store.outcome_records(),
}


@pytest.mark.parametrize("call", list(_LOOKS_THAT_ARE_NOT))
def test_a_call_that_is_no_read_of_the_head_does_not_rebind_outcomes_after_a_reset(tmp_path, call):
    """DEFECT. docs/outcomes.md:60-66 (and api.md ``rows_version``): the default
    ``rows_version=None`` is "the head this Store handle last *looked* at — Store.open,
    refresh(), or a read of the head (snapshot(), outcome_stats() without pending, a dataset
    moving to the head)"; "A write's own refresh ... does not count, so refused outcomes are
    refused again". But ``Store.tag(name, 1)`` (tagging an *older* version) and
    ``collect_garbage(store)`` (a dry run, which changes nothing) call ``Store.refresh()``
    (dynstate/store.py:286 in ``tag``, dynstate/maintenance/gc.py:216), which sets the
    handle's ``log.seen`` to the head (dynstate/store.py:200): W's outcomes of row 35 of
    version 2 — refused a moment before — are then committed on X's lineage and credited
    to X's row 35, a different row. Expected: still CommitConflictError (these calls refresh
    without counting as a look, as append's own refresh does)."""
    writer, _ = _reset_under(tmp_path)
    with pytest.raises(CommitConflictError):
        writer.append([], outcomes=SCORED)
    _LOOKS_THAT_ARE_NOT[call](writer)
    try:
        version = writer.append([], outcomes=SCORED)
    except CommitConflictError:
        return
    credited = writer.snapshot(version).to_arrow().column("x")[35].as_py()
    pytest.fail(
        f"after {call}, W's score of row 35 of version 2 (x=105) was committed as version "
        f"{version} and credited to row 35 of that lineage (x={credited})"
    )


def test_rows_version_of_a_numpy_integer_is_taken_as_the_version_it_names(tmp_path):
    """DEFECT (minor). docs/api.md: ``rows_version`` is "an int: a snapshot's version, the
    version a sampler pinned"; everywhere else the same API takes numpy integers for a
    version or a row (``Store.resolve``/``outcome_stats(version)``: "numpy's integers too",
    VersionedDataset indices, ``rollback(step=)``), and outcome rows and steps are taken as
    numpy integers. ``rows_version=np.int64(1)`` — the max of a batch's per-item versions —
    is refused with InvalidDataError (dynstate/records/outcomes.py ``check_rows_version``:
    ``isinstance(value, int)``), so a valid round cannot be committed. Expected: accepted as
    version 1 (a bool still refused)."""
    store = new_store(tmp_path / "s", 5)
    store.append([{"x": 9}])
    assert store.outcome_stats(np.int64(1)).num_rows == 5
    with pytest.raises(InvalidDataError):
        store.append([], outcomes=[{"row": 0, "step": 1, "score": 1.0}], rows_version=True)
    v = store.append([], outcomes=[{"row": 4, "step": 1, "score": 1.0}], rows_version=np.int64(1))
    assert records_of(store, v) == [(4, 1, 1.0)]
    # the statistics' parameters as numpy numbers, as the version is
    plain = store.outcome_stats(success_above=0.5, half_life=10)
    assert store.outcome_stats(success_above=np.float32(0.5), half_life=np.int64(10)) == plain
    with pytest.raises(InvalidDataError):
        store.outcome_stats(success_above=np.bool_(True))


# -- extra fields across steps -----------------------------------------------------------------

EXTRA_PAIRS = [
    # name, the field at step 1, at step 2, what outcome_records reads (None: refused)
    ("bool, then int", True, 1, [1.0, 1.0]),
    ("bool, then float", True, 0.5, [1.0, 0.5]),
    ("int past 2**53, then float", 2**53 + 1, 0.5, None),
    ("all null, then int past 2**53", None, 2**60 + 1, None),
    ("all null, then int", None, 7, [None, 7]),
    ("bool, then bool", False, True, [False, True]),
    ("int, then null, then int", 3, None, [3, None]),
]


@pytest.mark.parametrize("name", [p[0] for p in EXTRA_PAIRS])
def test_extra_fields_read_back_as_recorded_whatever_other_steps_held(tmp_path, name):
    """DEFECT (fixed). docs/api.md: outcomes take "up to 32 extra numeric or bool columns
    (nulls allowed there)", and ``outcome_records`` is "every outcome record of the version's
    lineage ... (extra columns a commit lacks are null)"; docs/format.md: an outcome file's
    extra columns are "int64, finite float64 or bool". Each commit below was accepted, but one
    field that is a bool at one step and an int or float at another (``correct=True`` /
    ``correct=1``), or an int past 2**53 at one step and a float (or all null) at another,
    made ``outcome_records`` of every later version raise a raw pyarrow ArrowTypeError /
    ArrowInvalid (dynstate/log/outcomes.py, ``pa.concat_tables(...,
    promote_options="permissive")`` over files whose extra columns have per-commit types);
    serve's row page (``OutcomeViews.row_steps``) failed the same way. A field that was null
    in every record of one step came back as float (7 -> 7.0) at every other step.
    Now (docs/format.md, "Outcomes"): a field reads as its type where every commit agrees
    (all-null commits taking it), as float64 where they differ, its ints bounded by 2**53 at
    commit so that the float is exact; the statistics never change."""
    _, first, second, want = next(p for p in EXTRA_PAIRS if p[0] == name)
    store = new_store(tmp_path / "s", 4)
    try:
        store.append([], outcomes=[{"row": 0, "step": 1, "score": 1.0, "field": first}])
        store.append([], outcomes=[{"row": 1, "step": 2, "score": 0.0, "field": second}])
    except InvalidDataError as exc:
        assert want is None and "2**53" in str(exc), exc
        return
    assert want is not None
    got = store.outcome_records().to_pylist()
    assert [r["field"] for r in got] == want
    assert [type(r["field"]) for r in got] == [type(w) for w in want]
    assert_stats(store.outcome_stats(), fold([(0, 1, 1.0), (1, 2, 0.0)], 4), name)


# -- the selection policies see the same credit -------------------------------------------------


def test_learnability_and_band_weights_follow_the_folded_pass_rates(tmp_path):
    """Guard. docs/selection.md: ``Learnability`` weighs ``max(p * (1 - p), floor)`` and
    ``neutral`` for rows never tried, ``PassRateBand(lo, hi)`` takes rows with
    ``lo <= pass_rate <= hi``, ``pass_rate = successes / attempts``, a success a score above
    0.5: over statistics with scores exactly 0.5 (no success), -0.0 and GRPO groups, both
    equal the rule applied to the fold of the raw records."""
    store = new_store(tmp_path / "s", 8)
    records = [
        (0, 1, 0.5), (0, 1, 0.5), (0, 2, 1.0),  # 1/3
        (1, 1, 1.0), (1, 2, 0.75),  # 1
        (2, 1, -0.0), (2, 3, 0.0),  # 0
        (3, 2, 0.5000001), (3, 3, 0.5),  # 1/2
        (5, 3, 1e250), (5, 3, -1e250), (5, 3, 5e-324), (5, 4, 0.6),  # 2/4
    ]  # fmt: skip
    for step in sorted({s for _, s, _ in records}):
        store.append(
            [], outcomes=[{"row": r, "step": s, "score": x} for r, s, x in records if s == step]
        )
    stats = store.outcome_stats()
    truth = fold(records, 8)
    assert_stats(stats, truth, "policies' statistics")
    rates = [
        w / a if a else None for w, a in zip(truth["successes"], truth["attempts"], strict=True)
    ]
    assert rates[:6] == [1 / 3, 1.0, 0.0, 0.5, None, 0.5]
    weights = Learnability(floor=0.01, neutral=0.25).weights(stats).tolist()
    assert weights == [0.25 if p is None else max(p * (1 - p), 0.01) for p in rates]
    band = PassRateBand(1 / 3, 0.5, untried=False).eligible(stats).tolist()
    assert band == [p is not None and 1 / 3 <= p <= 0.5 for p in rates]


_HUNDRED = """
import sys, dynstate
store = dynstate.Store.open(sys.argv[1], create=True)
store.append([{"x": i} for i in range(30)])
for k in range(99):  # the 100th commit is the last thing this process does
    store.append([], outcomes={"row": [k % 30, (k * 7) % 30, 29], "step": [k, k, k],
                               "score": [(k % 5) / 4, 0.5, -0.0]})
"""


def test_a_process_ending_right_after_its_100th_commit_leaves_a_checkpoint_equal_to_the_fold(
    tmp_path,
):
    """Guard. docs/outcomes.md "Recording cost": the outcome checkpoint after the 100th commit
    is written in the background and "a normal interpreter exit (the thread is not a daemon)"
    waits for it, "so a script that ends right after its 100th commit still leaves the
    checkpoint"; its statistics, read in another fresh process at every threshold, are the
    fold of the records passed in."""
    path = tmp_path / "s"
    done = subprocess.run(
        [sys.executable, "-c", _HUNDRED, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (path / "_dynstate" / "outcomes" / f"{100:020d}.json").exists()
    records = [
        (r, k, s)
        for k in range(99)
        for r, s in zip([k % 30, (k * 7) % 30, 29], [(k % 5) / 4, 0.5, -0.0], strict=True)
    ]
    thresholds = [0.5, 0.25, 0.0, -0.0, 0.75, 1.0]
    fresh = _fresh(path, [100], thresholds)
    assert [tuple(x) for x in zip(*fresh["100 records"], strict=True)] == records
    for above in thresholds:
        for half in (10.0, 3.0):
            key = f"100 {above!r} {half!r}"
            assert_stats(fresh[key], fold(records, 30, above, half), key)
