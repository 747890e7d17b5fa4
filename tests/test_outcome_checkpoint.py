"""The outcome checkpoint after every 100th commit is written in the background (issue 21,
recording cost): the commit returns before it, it lands and is used afterwards, a failure is
logged and never raised, a gc floor's is still written before ``gc.json`` names the floor, a
normal exit waits for it and a SIGKILL while it is written leaves a store whose statistics
equal the fold of every record."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_outcomes import assert_stats, counted_reads, reference

from dynstate import Store, collect_garbage, verify_store
from dynstate.log import outcomes as outcome_log
from dynstate.log.outcomes import Outcomes, outcomes_of

ROWS = 8


def step_outcomes(step: int) -> list[dict[str, Any]]:
    rng = random.Random(step)
    return [
        {"row": rng.randrange(ROWS), "step": step, "score": rng.choice([0.0, 1.0, 0.5])}
        for _ in range(5)
    ]


def build_to_99(url: str) -> tuple[Store, list[dict[str, Any]]]:
    """Versions 0 (create), 1 (8 rows) and 2-99 (an empty round with outcomes each)."""
    store = Store.open(url, create=True)
    store.append([{"i": i} for i in range(ROWS)])
    records: list[dict[str, Any]] = []
    for step in range(2, 100):
        store.append([], outcomes=step_outcomes(step))
        records += step_outcomes(step)
    assert store.head == 99
    return store, records


def slow_put_aggregate(outcomes: Outcomes, gate: threading.Event) -> list[float]:
    """Make this handle's aggregate write wait for ``gate`` (at most 30 s)."""
    original = outcomes._put_aggregate
    started: list[float] = []

    def waiting(*args: Any, **kwargs: Any) -> Any:
        started.append(time.monotonic())
        gate.wait(30)
        return original(*args, **kwargs)

    outcomes._put_aggregate = waiting  # type: ignore[method-assign]
    return started


def committed_100_checkpoint_held(
    url: str,
) -> tuple[Store, list[dict[str, Any]], Outcomes, threading.Event]:
    """Versions up to 100 committed, 100's outcome checkpoint held in flight until the
    returned gate is set."""
    store, records = build_to_99(url)
    outcomes = outcomes_of(store.log)
    gate = threading.Event()
    slow_put_aggregate(outcomes, gate)
    assert store.append([], outcomes=step_outcomes(100)) == 100
    return store, records + step_outcomes(100), outcomes, gate


def test_the_commit_returns_before_its_outcome_checkpoint_then_reads_use_it(
    store_url: str,
) -> None:
    url = store_url
    store, records = build_to_99(url)
    outcomes = outcomes_of(store.log)
    gate = threading.Event()
    started = slow_put_aggregate(outcomes, gate)
    rel = outcome_log.checkpoint_path(100)
    t0 = time.monotonic()
    assert store.append([], outcomes=step_outcomes(100)) == 100
    took = time.monotonic() - t0
    records += step_outcomes(100)
    try:
        # a synchronous write would have waited the gate's 30 s
        assert took < 10, took
        assert not store.storage.exists(rel)
        # the shard checkpoint (other upkeep) is there; the outcome one is on its way
        assert store.storage.exists(f"_dynstate/checkpoints/{100:020d}.json")
        # the writing handle commits and reads meanwhile, with the right statistics
        assert store.append([], outcomes=step_outcomes(101)) == 101
        records += step_outcomes(101)
        assert_stats(store.outcome_stats(), reference(records, ROWS, 0.5, 10.0))
    finally:
        gate.set()
    outcomes.flush()
    assert started and store.storage.exists(rel)
    checkpoint = json.loads(store.storage.read(rel))
    assert checkpoint["aggregate"]["files"] == 99
    assert store.storage.exists(checkpoint["aggregate"]["path"])
    # used afterwards: a fresh handle reads the aggregate and the files since it, no more
    for step in range(102, 112):
        store.append([], outcomes=step_outcomes(step))
        records += step_outcomes(step)
    fresh = Store.open(url)
    reads = counted_reads(fresh)
    assert_stats(fresh.outcome_stats(), reference(records, ROWS, 0.5, 10.0))
    assert len([r for r in reads if r.startswith("data/")]) == 11  # versions 101-111
    assert sum(r.startswith(outcome_log.AGGREGATE_DIR) for r in reads) == 1


def test_a_failed_background_checkpoint_is_logged_never_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "s")
    store, records = build_to_99(url)
    outcomes = outcomes_of(store.log)

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("disk on fire")

    outcomes._put_aggregate = failing  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="dynstate"):
        assert store.append([], outcomes=step_outcomes(100)) == 100
        outcomes.flush()
    records += step_outcomes(100)
    logged = [r for r in caplog.records if r.name == "dynstate" and "disk on fire" in r.message]
    assert logged and "version 100" in logged[0].message
    assert not store.storage.exists(outcome_log.checkpoint_path(100))
    # nothing reaches the next calls: they work, and a fresh handle walks past version 100
    assert store.append([], outcomes=step_outcomes(101)) == 101
    records += step_outcomes(101)
    assert_stats(store.outcome_stats(), reference(records, ROWS, 0.5, 10.0))
    assert_stats(Store.open(url).outcome_stats(), reference(records, ROWS, 0.5, 10.0))


def test_two_checkpoints_of_one_version_are_harmless(tmp_path: Path) -> None:
    """A gc floor at 100 writes 100's outcome checkpoint synchronously while the commit's own
    is still in flight: whichever creates it first wins, the other finds it there."""
    url = str(tmp_path / "s")
    store, records, outcomes, gate = committed_100_checkpoint_held(url)
    rel = outcome_log.checkpoint_path(100)
    other = outcomes_of(Store.open(url).log)
    other.write_checkpoint(store.commit_record(100))  # synchronous, another handle
    assert store.storage.exists(rel)
    first = store.storage.read(rel)
    gate.set()
    outcomes.flush()
    assert store.storage.read(rel) == first
    assert_stats(Store.open(url).outcome_stats(), reference(records, ROWS, 0.5, 10.0))
    assert verify_store(Store.open(url), all_versions=True).ok


def test_a_gc_floor_gets_its_outcome_checkpoint_before_gc_returns(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    store, records = build_to_99(url)
    for step in range(100, 140):
        store.append([], outcomes=step_outcomes(step))
        records += step_outcomes(step)
    outcomes = outcomes_of(store.log)
    outcomes.flush()
    original = outcomes._put_aggregate

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)  # a background write would still be sleeping when gc returns
        return original(*args, **kwargs)

    outcomes._put_aggregate = slow  # type: ignore[method-assign]
    result = collect_garbage(store, keep=5, grace_s=0, dry_run=False)
    floor = result.floor_after
    assert floor % 100 != 0 and floor > 100
    assert store.storage.exists(outcome_log.checkpoint_path(floor))
    fresh = Store.open(url)
    reads = counted_reads(fresh)
    assert_stats(fresh.outcome_stats(), reference(records, ROWS, 0.5, 10.0))
    assert sum(r.startswith(outcome_log.AGGREGATE_DIR) for r in reads) == 1


# -- real processes ---------------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from dynstate import Store
    from dynstate.log import outcomes as outcome_log

    url, mode = sys.argv[1], sys.argv[2]
    store = Store.open(url)
    outcomes = outcome_log.outcomes_of(store.log)
    put_aggregate = outcomes._put_aggregate
    create = store.storage.create_if_absent

    lock = threading.Lock()

    def note(what):
        # one write per line, under a lock: the checkpoint thread notes too, and print()'s
        # text and newline are two writes another thread's line can land between
        with lock:
            sys.stdout.write(json.dumps(what) + "\\n")
            sys.stdout.flush()

    def slow_aggregate(*args, **kwargs):
        note({"in": "aggregate"})
        time.sleep(float(os.environ.get("SLOW_S", "60")))
        return put_aggregate(*args, **kwargs)

    def slow_create(rel, data):
        if rel == outcome_log.checkpoint_path(100):
            note({"in": "checkpoint"})
            time.sleep(float(os.environ.get("SLOW_S", "60")))
        return create(rel, data)

    aggregate = outcomes._aggregate

    def slow_fold(*args, **kwargs):
        # the checkpoint thread starts folding (reading the 99 files: this handle has none
        # cached) once the main thread is in the interpreter's shutdown
        if threading.current_thread() is not threading.main_thread():
            note({"in": "fold"})
            time.sleep(float(os.environ.get("SLOW_S", "60")))
        return aggregate(*args, **kwargs)

    if mode == "aggregate":
        outcomes._put_aggregate = slow_aggregate
    elif mode == "exit":
        outcomes._aggregate = slow_fold
    else:
        store.storage.create_if_absent = slow_create
    version = store.append([], outcomes=json.loads(sys.argv[3]))
    note({"version": version})
    if mode != "exit":
        time.sleep(120)  # killed here, the checkpoint thread mid-write
    """
)


def start(url: str, mode: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, url, mode, json.dumps(step_outcomes(100))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def read_lines(proc: subprocess.Popen[str], n: int) -> list[dict[str, Any]]:
    assert proc.stdout is not None
    out = []
    for _ in range(n):
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        out.append(json.loads(line))
    return out


@pytest.mark.parametrize("phase", ["aggregate", "checkpoint"])
def test_sigkill_while_the_checkpoint_is_written_leaves_a_consistent_store(
    tmp_path: Path, phase: str
) -> None:
    """SIGKILL after the commit returned, the checkpoint thread inside the aggregate's write
    (``aggregate``) or between the aggregate and the checkpoint's create (``checkpoint``):
    no checkpoint names a missing aggregate, and the statistics equal the fold of every
    record; the next writer commits on top and its checkpoint at 200 is written."""
    url = str(tmp_path / "s")
    _, records = build_to_99(url)
    proc = start(url, phase)
    try:
        lines = read_lines(proc, 2)
        assert {"version": 100} in lines and {"in": phase} in lines, lines
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    records += step_outcomes(100)
    fresh = Store.open(url)
    assert fresh.head == 100
    assert not fresh.storage.exists(outcome_log.checkpoint_path(100))
    aggregates = list((tmp_path / "s" / outcome_log.AGGREGATE_DIR).glob("*"))
    # the aggregate is written before the checkpoint (and content addressed): an orphan
    assert len(aggregates) == (1 if phase == "checkpoint" else 0), aggregates
    assert_stats(fresh.outcome_stats(), reference(records, ROWS, 0.5, 10.0))
    assert fresh.outcome_records().num_rows == len(records)
    assert verify_store(fresh, all_versions=True).ok
    for step in range(101, 201):
        fresh.append([], outcomes=step_outcomes(step))
        records += step_outcomes(step)
    outcomes_of(fresh.log).flush()
    assert fresh.storage.exists(outcome_log.checkpoint_path(200))
    reader = Store.open(url)
    assert_stats(reader.outcome_stats(), reference(records, ROWS, 0.5, 10.0))


def test_a_normal_exit_waits_for_the_checkpoint(durable_url: str) -> None:
    """On S3 too: the checkpoint thread's reads and writes still run during the
    interpreter's shutdown (s3fs's event loop, the storage's read pools)."""
    url = durable_url
    _, records = build_to_99(url)
    proc = start(url, "exit", SLOW_S="1.5")
    try:
        lines = read_lines(proc, 2)
        assert {"version": 100} in lines and {"in": "fold"} in lines, lines
        assert proc.wait(60) == 0
        assert proc.stderr is not None
        assert "not written" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    fresh = Store.open(url)
    rel = outcome_log.checkpoint_path(100)
    assert fresh.storage.exists(rel)
    assert fresh.storage.exists(json.loads(fresh.storage.read(rel))["aggregate"]["path"])
    records += step_outcomes(100)
    reads = counted_reads(fresh)
    assert_stats(fresh.outcome_stats(), reference(records, ROWS, 0.5, 10.0))
    assert [r for r in reads if r.startswith("data/")] == []  # all 99 files in the aggregate


def test_a_reset_while_the_checkpoint_is_written_names_its_aggregate(tmp_path: Path) -> None:
    """The writing handle reads the outcomes of a later version while version 100's outcome
    checkpoint is still being written: that lineage is not remembered without the aggregate,
    and a reset waits for it, so the reset record names the aggregate (a fresh handle at the
    reset's head then reads it, not every file since version 1)."""
    url = str(tmp_path / "s")
    store, records, outcomes, gate = committed_100_checkpoint_held(url)
    try:
        assert store.append([], outcomes=step_outcomes(101)) == 101
        records += step_outcomes(101)
        # read while the checkpoint of 100 is in flight
        assert_stats(store.outcome_stats(), reference(records, ROWS, 0.5, 10.0))
        assert outcomes.lineage(101).aggregate is None
    finally:
        threading.Timer(0.5, gate.set).start()  # the reset below must wait for it
    store.reset(101)
    head = store.head
    record = store.commit_record(head)
    assert record.outcomes["aggregate"] is not None, record.outcomes
    assert outcomes.lineage(101).aggregate is not None
    fresh = Store.open(url)
    reads = counted_reads(fresh)
    assert_stats(fresh.outcome_stats(), reference(records, ROWS, 0.5, 10.0))
    assert sum(r.startswith(outcome_log.AGGREGATE_DIR) for r in reads) == 1
    assert len([r for r in reads if r.startswith("data/")]) <= 2  # versions 100-101 at most
