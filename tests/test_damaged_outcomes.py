"""An outcome file that matches its checksum but breaks the writer's bounds — a row the
version does not have (10**6, -5), a step no commit record lists (2**62), a score that is not
finite — is a CorruptStoreError naming the file wherever it is read: the library's
statistics and records, ``dynstate stats`` and ``dynstate verify`` (the installed console
script), and serve's pages (a page with the typed message, never a raw error)."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pytest
from test_cli import console_script

from dynstate import CorruptStoreError, Store
from dynstate.log.outcomes import encode_outcome_file
from dynstate.maintenance.verify import verify_store
from dynstate.records import codec
from dynstate.records import manifest as m
from dynstate.records.rowgroups import read_parquet

ROWS = 10


def _build(url: str) -> Store:
    """Ten rows; step 0 scores rows 0-4 (version 2), step 1 rows 5-9 (version 3)."""
    store = Store.open(url, create=True)
    store.append([{"i": i} for i in range(ROWS)])
    for step in (0, 1):
        rows = range(5 * step, 5 * step + 5)
        outcomes = [{"row": r, "step": step, "score": r / ROWS, "len": 1.5} for r in rows]
        store.append([], outcomes=outcomes)
    return store


def _rewrite(store: Store, rel: str, data: bytes) -> None:
    path = store.storage.path(rel)
    os.chmod(path, 0o644)  # committed files are read-only
    with open(path, "wb") as fh:
        fh.write(data)


def _tamper(store: Store, change: Callable[[dict[str, list]], None]) -> str:
    """Change the outcome file of version 3 and give its record the new size and checksum,
    the record a valid checksum too: only the reader's bounds can tell. Returns its path."""
    obj = json.loads(store.storage.read(m.log_path(3)))
    entry = obj["outcomes"]["add"][0]
    columns = read_parquet(store.storage.read(entry["path"])).to_pydict()
    change(columns)
    table = pa.table(
        {
            "row": pa.array(columns["row"], pa.int64()),
            "step": pa.array(columns["step"], pa.int64()),
            "score": pa.array(columns["score"], pa.float64()),
            "len": pa.array(columns["len"], pa.float64()),
        }
    )
    data = encode_outcome_file(table).to_pybytes()
    _rewrite(store, entry["path"], data)
    entry.update(bytes=len(data), sha256=codec.sha256(data))
    _rewrite(store, m.log_path(3), codec.encode(obj))
    return str(entry["path"])


def _set(column: str, value: float) -> Callable[[dict[str, list]], None]:
    def change(columns: dict[str, list]) -> None:
        columns[column][2] = value

    return change


DAMAGE = {
    "row 10**6": (_set("row", 10**6), "names row 1000000, but version 3 has 10 rows"),
    "row -5": (_set("row", -5), "names row -5"),
    "row = num_rows": (_set("row", ROWS), "names row 10, but version 3 has 10 rows"),
    "step 2**62": (_set("step", 2**62), f"names step {2**62}"),
    "step of another commit": (_set("step", 7), "names step 7"),
    "score NaN": (_set("score", float("nan")), "holds score nan"),
    "score inf": (_set("score", float("inf")), "holds score inf"),
    "score 1e300": (_set("score", 1e300), "holds score 1e+300, beyond |score| <= 1e+250"),
    "field -inf": (_set("len", float("-inf")), "NaN or infinity in 'len'"),
}


@pytest.fixture(params=sorted(DAMAGE))
def damaged(request, tmp_path) -> tuple[str, str, str]:
    """(url, the tampered file's path, what the error says)."""
    url = str(tmp_path / "store")
    change, says = DAMAGE[request.param]
    path = _tamper(_build(url), change)
    return url, path, says


def test_the_library_names_the_file(damaged) -> None:
    url, path, says = damaged
    for read in (
        lambda s: s.outcome_stats(),
        lambda s: s.outcome_stats(half_life=3.0),  # another aggregate, folded from the files
        lambda s: s.outcome_records(),
    ):
        with pytest.raises(CorruptStoreError) as info:
            read(Store.open(url))
        assert path in str(info.value) and says in str(info.value)
        assert "damaged" in str(info.value)
    # The version before the damaged file is untouched, reads, and a reset to it is the way
    # out (a reset carries the outcome list, it reads no file).
    assert Store.open(url).outcome_stats(2).column("attempts").to_pylist()[:5] == [1] * 5
    store = Store.open(url)
    assert store.reset(2) == 4
    assert store.outcome_stats().column("attempts").to_pylist() == [1] * 5 + [0] * 5


def test_verify_names_the_file(damaged) -> None:
    url, path, says = damaged
    problems = verify_store(Store.open(url)).problems
    assert any(path in p and says in p for p in problems), problems
    problems = verify_store(Store.open(url), all_versions=True).problems
    assert any(path in p and says in p for p in problems), problems
    proc = _dynstate("verify", url)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert any(path in line and says in line for line in proc.stdout.splitlines()), proc.stdout


def _dynstate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script(), *args],
        capture_output=True,
        text=True,
        env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )


@pytest.mark.parametrize(
    "command", [["stats"], ["stats", "--json"], ["head", "--sort", "attempts"]]
)
def test_the_cli_prints_one_line(damaged, command: list[str]) -> None:
    url, path, says = damaged
    proc = _dynstate(command[0], url, *command[1:])
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert path in lines[0] and says in lines[0]
    assert "Traceback" not in proc.stderr and "ValueError" not in proc.stderr


@contextmanager
def _served(url: str) -> Iterator[str]:
    from serving import served

    from dynstate.serve.api import StoreView

    with served(StoreView(Store.open(url), url=url), log_level="critical", warm=False) as base:
        yield base


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_serve_answers_with_the_typed_message(tmp_path) -> None:
    url = str(tmp_path / "store")
    path = _tamper(_build(url), _set("row", -5))
    with _served(url) as base:
        for page in ("/api/outcomes", "/api/versions/head/rows/0", "/api/versions/head/rows"):
            status, body = _get(base + page)
            assert status == 422, (page, status, body[:300])
            error = json.loads(body)["error"]
            assert path in error and "names row -5" in error, (page, error)
            assert "could not be built" not in error  # not an unexpected failure
        for page in ("/outcomes", "/versions/head/rows/0"):
            status, body = _get(base + page)
            assert status == 422 and path in body and "names row -5" in body, (page, body[:300])
            assert "Traceback" not in body
        # What does not need the damaged file still answers.
        assert _get(base + "/api/versions/2")[0] == 200


def test_a_file_within_bounds_still_reads(tmp_path) -> None:
    """The checks refuse only what the writer refuses: rows up to the version's last, steps
    of the lineage, any finite score, nulls in an extra field."""
    url = str(tmp_path / "store")
    store = _build(url)
    store.append([], outcomes={"row": [9, 0], "step": [5, 5], "score": [-1e200, 1e200]})
    store.append([], outcomes={"row": [1], "step": [2**53 - 1], "score": [0.0], "x": [None]})
    stats = Store.open(url).outcome_stats()
    assert stats.column("attempts").to_pylist() == [2, 2] + [1] * 7 + [2]
    assert verify_store(Store.open(url), all_versions=True).ok
    assert np.isfinite(Store.open(url).outcome_records().column("score").to_numpy()).all()


def test_verify_of_every_version_holds_a_file_to_the_record_that_added_it(tmp_path) -> None:
    """A row of the round's own new rows (the writer refuses them: not trained on yet) or a
    step another commit lists is within what the lineage allows, so reads take the file;
    ``verify --all`` reads the record that added it and names the file."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"i": i} for i in range(ROWS)])
    store.append([{"i": 10}, {"i": 11}], outcomes=[{"row": 1, "step": 0, "score": 1.0}])
    store.append([], outcomes=[{"row": 2, "step": 1, "score": 0.0}])
    entry = json.loads(store.storage.read(m.log_path(2)))["outcomes"]["add"][0]["path"]
    for column, value, says in (
        ("row", 11, "names row 11, but version 1 (it was appended to) has 10 rows"),
        ("step", 1, "names step 1, which the commit records of version 2"),
    ):
        obj = json.loads(store.storage.read(m.log_path(2)))
        columns = read_parquet(store.storage.read(entry)).to_pydict()
        columns[column][0] = value
        data = encode_outcome_file(pa.table(columns)).to_pybytes()
        _rewrite(store, entry, data)
        obj["outcomes"]["add"][0].update(bytes=len(data), sha256=codec.sha256(data))
        _rewrite(store, m.log_path(2), codec.encode(obj))
        assert Store.open(url).outcome_stats().num_rows == 12  # within the lineage's bounds
        problems = verify_store(Store.open(url), all_versions=True).problems
        assert len(problems) == 1 and entry in problems[0] and says in problems[0], problems
        proc = _dynstate("verify", url, "--all")
        assert proc.returncode == 1 and says in proc.stdout, (proc.stdout, proc.stderr)
        columns[column][0] = {"row": 1, "step": 0}[column]  # the next damage alone
        data = encode_outcome_file(pa.table(columns)).to_pybytes()
        _rewrite(store, entry, data)
        obj["outcomes"]["add"][0].update(bytes=len(data), sha256=codec.sha256(data))
        _rewrite(store, m.log_path(2), codec.encode(obj))
    assert verify_store(Store.open(url), all_versions=True).ok
