"""Integer bounds that do not depend on the writer's interpreter. A process with Python's int
string limit lifted (``PYTHONINTMAXSTRDIGITS=0``) is refused, with a typed error and nothing
written, what every default reader would refuse (an integer past 4,300 digits in ``meta`` or
a generator state). A store such a writer damaged before this check existed stays
recoverable: it opens, older versions read, ``dynstate reset`` to one of them commits, and
``dynstate verify`` names the record. A reader whose limit is lower than the default still
reads every integer the bound lets through."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import s3_url
from test_cli import console_script

from dynstate import (
    CorruptStoreError,
    FunctionPolicy,
    InvalidDataError,
    StateMismatchError,
    Store,
    VersionedDataset,
    VersionedSampler,
)
from dynstate.maintenance.verify import verify_store
from dynstate.records import codec
from dynstate.records import manifest as m

BIG = 10**5000  # 5,001 digits: past every default reader's bound

# What a dynstate without the writer's check did, in a process without Python's int limit:
# the checks this test is about are taken out, the record written through the real commit.
OLD_WRITER = """
import sys
import dynstate.records.codec, dynstate.records.inputs
dynstate.records.codec._longest_int = lambda text: 0
dynstate.records.inputs.check_int = lambda value, what: None  # the one plain-value check
import json  # an old release read its own input back with json.loads, no bound
dynstate.records.inputs.load_json = lambda text, where: json.loads(text)
from dynstate import Store
store = Store.open(sys.argv[1])
where = sys.argv[2]
kwargs = {"meta": {"seed": 10**5000}} if where == "meta" else {"generator_state": [10**5000]}
print(store.append([{"i": 99}], **kwargs))
"""


def _run(code: str, *args: str, limit: str = "0") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONINTMAXSTRDIGITS": limit}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )


def _dynstate(*args: str) -> subprocess.CompletedProcess[str]:
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}  # the loopback S3
    return subprocess.run(
        [console_script(), *args],
        capture_output=True,
        text=True,
        env={"COLUMNS": "100", "PATH": "/usr/bin:/bin", **aws},
        timeout=120,
    )


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _store(url: str) -> Store:
    store = Store.open(url, create=True)
    store.append([{"i": 0}, {"i": 1}])
    store.append([{"i": 2}], outcomes=[{"row": 0, "step": 0, "score": 1.0}], generator_state=[7])
    return store


NEW_WRITER = """
import sys
from dynstate import DynstateError, Store
store = Store.open(sys.argv[1])
calls = {
    "meta": lambda: store.append([{"i": 9}], meta={"n": [10**5000]}),
    "negative meta": lambda: store.append([{"i": 9}], meta={"n": -(10**4300)}),
    "generator_state": lambda: store.append([{"i": 9}], generator_state={"n": 10**5000}),
    "reset meta": lambda: store.reset(1, meta={"n": 10**5000}),
    "outcome field": lambda: store.append(
        [], outcomes=[{"row": 0, "step": 5, "score": 1.0, "n": 10**5000}]
    ),
    "outcome field 2**63": lambda: store.append(
        [], outcomes=[{"row": 0, "step": 5, "score": 1.0, "n": 2**63}]
    ),
}
for name, call in calls.items():
    try:
        call()
    except DynstateError as exc:
        print(name, type(exc).__name__, exc)
    else:
        print(name, "committed")
"""


@pytest.mark.parametrize("limit", ["0", "640"])
def test_a_writer_whatever_its_int_limit_is_refused_and_writes_nothing(tmp_path, limit) -> None:
    url = str(tmp_path / "store")
    _store(url)
    before = _files(tmp_path / "store")
    proc = _run(NEW_WRITER, url, limit=limit)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 6, proc.stdout
    for line in lines[:4]:
        assert "InvalidDataError" in line and "4,300 decimal digits" in line, line
    assert "meta['n'][0]" in lines[0] and "generator_state['n']" in lines[2]
    for line in lines[4:]:  # outcome fields are int64 in Parquet
        assert "InvalidDataError" in line and "column 'n'" in line, line
    assert _files(tmp_path / "store") == before  # not a file more, none changed
    assert Store.open(url).head == 2


def test_the_bound_is_the_readers_to_the_digit() -> None:
    largest = 10**codec.MAX_INT_DIGITS - 1  # 4,300 nines: every reader parses it
    assert codec.int_fits(largest) and codec.int_fits(-largest)
    assert not codec.int_fits(largest + 1) and not codec.int_fits(-largest - 1)
    body = {"format": 1, "n": largest}
    assert codec.decode(codec.encode(body), "x") == body
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(InvalidDataError, match="4,301 digits"):
            codec.encode({"format": 1, "n": [largest + 1]})
        text = codec.canonical({"format": 1, "n": largest + 1})
    finally:
        sys.set_int_max_str_digits(limit)
    with pytest.raises(CorruptStoreError, match="x holds an integer of 4,301 digits"):
        codec.load_json(text, "x")


def test_a_reader_with_a_lower_int_limit_reads_what_the_bound_allows(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = _store(url)
    store.append([], meta={"n": 10**4299, "m": -(10**1000)}, generator_state=[10**700])
    probe = (
        "import sys; from dynstate import Store; s = Store.open(sys.argv[1]); "
        "meta = s.commit_record(3).meta; "
        "print(meta['n'] == 10**4299, meta['m'] == -10**1000, s.generator_state(3) == [10**700])"
    )
    proc = _run(probe, url, limit="640")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "True"]


@pytest.mark.parametrize(
    ("where", "backend"), [("meta", "local"), ("generator_state", "local"), ("meta", "s3")]
)
def test_a_store_an_old_writer_damaged_stays_recoverable(request, tmp_path, where, backend):
    if backend == "s3":
        request.getfixturevalue("s3_endpoint")
        url = s3_url()
    else:
        url = str(tmp_path / "store")
    _store(url)
    proc = _run(OLD_WRITER, url, where)  # PYTHONINTMAXSTRDIGITS=0: the old writer's ack
    assert proc.returncode == 0 and proc.stdout.split() == ["3"], proc.stderr
    record = f"{Store.open(url).display_url}/{m.log_path(3)}"
    assert b"0" * 5000 in Store.open(url).storage.read(m.log_path(3))

    store = Store.open(url)  # opens: the damaged head does not hide the versions below it
    assert store.head == 3
    assert store.snapshot(2).to_arrow().column("i").to_pylist() == [0, 1, 2]
    assert store.snapshot(1).num_rows == 2
    assert store.generator_state(2) == [7]
    assert store.outcome_stats(2).column("attempts").to_pylist() == [1, 0, 0]
    for read in (lambda: store.snapshot(), lambda: store.commit_record(3)):
        with pytest.raises(CorruptStoreError, match="holds an integer of 5,001 digits") as info:
            read()
        assert record in str(info.value)
    with pytest.raises(CorruptStoreError, match="5,001 digits"):
        store.append([{"i": 5}])  # a round on top of a head that cannot be read: refused
    assert Store.open(url).head == 3

    report = verify_store(Store.open(url))
    assert len(report.problems) == 1 and record in report.problems[0], report.problems
    proc = _dynstate("verify", url)
    assert proc.returncode == 1 and record in proc.stdout + proc.stderr, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr

    proc = _dynstate("reset", url, "2")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "new head is version 4" in proc.stdout
    store = Store.open(url)
    assert store.head == 4 and store.snapshot().to_arrow().column("i").to_pylist() == [0, 1, 2]
    assert store.generator_state(4) == [7]
    assert store.outcome_stats().column("attempts").to_pylist() == [1, 0, 0]
    assert store.append([{"i": 3}]) == 5
    assert store.snapshot().num_rows == 4
    # The damaged record stays named until gc collects it.
    problems = verify_store(Store.open(url)).problems
    assert len(problems) == 1 and record in problems[0], problems


# -- sampler state ---------------------------------------------------------------------------


def _weights(stats, step):  # a module-level policy: its name goes into the state
    return [1.0] * stats.num_rows


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (
            {"seed": BIG},
            "seed must be an int from -2**63 to 2**64 - 1, not <an int of 16,610 bits>",
        ),
        ({"seed": -BIG}, "not <an int of 16,610 bits>"),
        ({"batch_size": 2**40}, f"batch_size={2**40} is out of range"),
        ({"first_step": 2**40}, f"step={2**40} is out of range"),
        ({"num_replicas": 2**40, "rank": 0}, "num_replicas"),
        ({"mode": "mix", "batch_size": 2, "lag": 2**62}, "lag="),
    ],
)
def test_a_sampler_refuses_settings_its_state_could_not_load(tmp_path, settings, says) -> None:
    url = str(tmp_path / "store")
    _store(url)
    with pytest.raises(InvalidDataError, match=re.escape(says)):
        VersionedSampler(VersionedDataset(url), **settings)


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"k": [BIG]}, "params of policy 'test_bounds._weights' at params['k'][0] is an integer"),
        ({"k": [[[[[[[[[1]]]]]]]]]}, "nests deeper than 6 levels"),  # 8 with the identity's
    ],
)
def test_a_policy_refuses_params_its_state_could_not_load(params, says) -> None:
    """The one plain-value rule (records/inputs.py) at the policy's construction, before any
    sampler writes its identity into a state."""
    with pytest.raises(InvalidDataError, match=re.escape(says)):
        FunctionPolicy(_weights, params=params)


def test_a_sampler_state_past_the_bounds_is_refused_by_name(tmp_path) -> None:
    url = str(tmp_path / "store")
    _store(url)
    sampler = VersionedSampler(VersionedDataset(url), seed=3, batch_size=2)
    list(sampler)
    state = sampler.state_dict()
    VersionedSampler(VersionedDataset(url), seed=3, batch_size=2).load_state_dict(state)
    limit = 10**codec.MAX_INT_DIGITS
    bad = {
        "seed": limit,
        "epoch": BIG,
        "version": 2**63,
        "fresh_version": -1,
        "lag": 0,
        "batch_size": 2**41,
        "num_replicas": BIG,
    }
    for key, value in bad.items():
        with pytest.raises(StateMismatchError, match=f"{key}=") as info:
            VersionedSampler(VersionedDataset(url), seed=3).load_state_dict({**state, key: value})
        assert "out of range" in str(info.value) or "past the integers" in str(info.value)
    policy = FunctionPolicy(_weights, params={"k": 1})
    sampler = VersionedSampler(VersionedDataset(url), seed=3, batch_size=2, select=policy)
    state = sampler.state_dict()
    select = state["select"]
    damaged = {**select, "params": {**select["params"], "params": {"k": BIG}}}
    with pytest.raises(StateMismatchError, match="select="):
        sampler.load_state_dict({**state, "select": damaged})
