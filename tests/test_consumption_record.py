"""The consumption record's checks (``dynstate.records.consumption.check_record``) keep
refusing every bad entry now that well-formed lists take a one-pass path: each mutation of a
real step's record is refused with ``InvalidDataError``, and a well-formed record comes back
equal to its JSON copy (ints given as row numbers, ints given as scores as floats)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from test_consumption import CFG, build, score

from dynstate import Store
from dynstate.errors import InvalidDataError
from dynstate.records.consumption import check_record


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict[str, Any]:
    url = str(tmp_path_factory.mktemp("rec") / "s")
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(CFG["rows"])])
    dyn = build(url, {**CFG, "max_gen_batches": 5})
    dyn.resume(None)
    for step in range(4):
        batch = dyn.next_batch(step, score)
        if batch.record["carry"] and batch.record["filtered"]:
            return batch.record
        store.append([], meta={"step": step}, outcomes=batch.outcomes(),
                     rows_version=batch.rows_version, consumption=batch.record)  # fmt: skip
    pytest.fail("no step both filtered and carried: the mutations below need both")


def test_a_well_formed_record_comes_back_as_its_json_copy(record) -> None:
    checked = check_record(record, "u", record["step"])
    assert checked == json.loads(json.dumps(record))
    ints = copy.deepcopy(record)
    ints["carry"][0][1] = [int(s) for s in ints["carry"][0][1]]
    assert check_record(ints, "u")["carry"][0][1] == [float(s) for s in ints["carry"][0][1]]


BAD_ROWS = [-1, True, 2**70, "3", 1.0, None]
BAD_SCORES = [float("inf"), float("-inf"), float("nan"), True, "1", None]


@pytest.mark.parametrize("where", ["drawn", "trained", "carried_in"])
@pytest.mark.parametrize("bad", BAD_ROWS, ids=repr)
def test_a_bad_row_number_anywhere_in_a_list_is_refused(record, where, bad) -> None:
    rec = copy.deepcopy(record)
    if not rec[where]:
        rec[where] = [bad]
    else:
        rec[where][len(rec[where]) // 2] = bad
    with pytest.raises(InvalidDataError):
        check_record(rec, "u")


@pytest.mark.parametrize("bad", BAD_SCORES, ids=repr)
def test_a_bad_carried_score_is_refused(record, bad) -> None:
    rec = copy.deepcopy(record)
    scores = rec["carry"][-1][1]
    scores[len(scores) // 2] = bad
    with pytest.raises(InvalidDataError):
        check_record(rec, "u")


def test_the_equation_is_a_multiset_compare(record) -> None:
    rec = copy.deepcopy(record)
    rec["drawn"] = rec["drawn"][::-1]  # order does not matter
    check_record(rec, "u")
    rec["trained"] = rec["trained"] + [rec["trained"][0]]  # one row twice: refused
    with pytest.raises(InvalidDataError, match="exactly once"):
        check_record(rec, "u")
    rec = copy.deepcopy(record)
    rec["drawn"] = [*rec["drawn"][:-1], rec["drawn"][0]]  # same length, another multiset
    if sorted(rec["drawn"]) != sorted(record["drawn"]):
        with pytest.raises(InvalidDataError, match="exactly once"):
            check_record(rec, "u")


def _async(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as an asynchronous trainer writes it (format 2): its carry in flight instead
    (rows without scores), a stale and a failed drop out of the trained rows."""
    rec = copy.deepcopy(record)
    rec["format"] = 2
    rec["in_flight"] = [row for row, _ in rec["carry"]]
    rec["carry"] = []
    rec["dropped"] = [[rec["trained"][0], "stale"], [rec["trained"][1], "failed"]]
    rec["trained"] = rec["trained"][2:]
    return rec


def test_a_format_2_record_counts_its_rows_in_flight(record) -> None:
    rec = _async(record)
    assert check_record(rec, "u", rec["step"]) == json.loads(json.dumps(rec))
    lost = copy.deepcopy(rec)
    lost["in_flight"] = lost["in_flight"][1:]  # a row in flight forgotten
    with pytest.raises(InvalidDataError, match="in_flight"):
        check_record(lost, "u")
    twice = copy.deepcopy(rec)
    twice["in_flight"] = [*twice["in_flight"], twice["trained"][0]]  # trained and in flight
    with pytest.raises(InvalidDataError, match="exactly once"):
        check_record(twice, "u")


def test_in_flight_belongs_to_format_2_only(record) -> None:
    rec = _async(record)
    rec["format"] = 1  # an old record shape cannot name rows in flight
    with pytest.raises(InvalidDataError, match="unknown \\['in_flight'\\]"):
        check_record(rec, "u")
    rec = _async(record)
    del rec["in_flight"]
    with pytest.raises(InvalidDataError, match="missing \\['in_flight'\\]"):
        check_record(rec, "u")
    for form in (0, 3, "2", True):
        rec = _async(record)
        rec["format"] = form
        with pytest.raises(InvalidDataError, match="format"):
            check_record(rec, "u")
    rec = _async(record)
    rec["dropped"][0][1] = "late"
    with pytest.raises(InvalidDataError, match="late"):
        check_record(rec, "u")
