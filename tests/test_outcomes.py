"""Outcomes as data state (issue 21): outcomes and a generator state committed with their
round in one record; per-row statistics at any version that follow the lineage through time
travel, tags, reset/rollback, compaction and gc; bad input refused with nothing changed; the
format an older dynstate refuses."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynstate import (
    ChecksumMismatchError,
    InvalidDataError,
    MissingShardError,
    Store,
    UnsupportedFormatError,
    collect_garbage,
    compact,
    rollback,
    verify_store,
)
from dynstate.log import outcomes as outcome_log
from dynstate.records import manifest as m
from dynstate.records.outcomes import DEFAULT_HALF_LIFE, DEFAULT_SUCCESS_ABOVE

ROOT = Path(__file__).resolve().parents[1]


def rows(k: int, n: int = 4) -> list[dict[str, Any]]:
    return [{"step": k, "i": i, "text": f"round {k} row {i}"} for i in range(n)]


def outcomes_for(step: int, num_rows: int, rng: random.Random, n: int = 6) -> list[dict]:
    return [
        {
            "row": rng.randrange(num_rows),
            "step": step,
            "score": rng.choice([0.0, 1.0, 0.25, 0.75, -1.0]),
            "length": rng.randrange(1, 500),
        }
        for _ in range(n)
    ]


def reference(records: list[dict], num_rows: int, above: float, half: float) -> list[dict]:
    """The statistics computed the slow, obvious way, from the raw records."""
    by_row: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for r in records:
        by_row[r["row"]].append((r["step"], r["score"]))
    out = []
    for row in range(num_rows):
        xs = by_row.get(row, [])
        if not xs:
            out.append(
                {
                    "row": row,
                    "attempts": 0,
                    "successes": 0,
                    "mean_score": None,
                    "ewma_score": None,
                    "first_step": None,
                    "last_step": None,
                }
            )
            continue
        last = max(s for s, _ in xs)
        weights = [2 ** ((s - last) / half) for s, _ in xs]
        out.append(
            {
                "row": row,
                "attempts": len(xs),
                "successes": sum(x > above for _, x in xs),
                "mean_score": sum(x for _, x in xs) / len(xs),
                "ewma_score": sum(w * x for w, (_, x) in zip(weights, xs, strict=True))
                / sum(weights),
                "first_step": min(s for s, _ in xs),
                "last_step": last,
            }
        )
    return out


def assert_stats(table: pa.Table, expected: list[dict]) -> None:
    got = table.to_pylist()
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        for key in ("row", "attempts", "successes", "first_step", "last_step"):
            assert g[key] == e[key], (key, g, e)
        for key in ("mean_score", "ewma_score"):
            if e[key] is None:
                assert g[key] is None, (key, g, e)
            else:
                assert g[key] == pytest.approx(e[key], rel=1e-9, abs=1e-12), (key, g, e)


def files(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {p: fs.cat_file(p) for p in fs.find(root)}


# -- 1. one commit ----------------------------------------------------------------------------


def test_round_and_outcomes_in_one_record(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    store.append(rows(0, 5), meta={"step": 0})
    outcomes = [
        {"row": 0, "step": 1, "score": 1.0, "length": 12},
        {"row": 0, "step": 1, "score": 0.0, "length": 30},
        {"row": 3, "step": 1, "score": 0.5, "length": 7},
    ]
    v = store.append(rows(1, 2), meta={"step": 1}, outcomes=outcomes, generator_state={"n": 1})
    record = store.commit_record(v)
    # the round's shards and its outcome file are named by the same record
    assert record.rows_added == 2
    assert [f["rows"] for f in record.outcomes["add"]] == [3]
    assert record.outcomes["steps"] == [[1, 1]]
    assert record.generator_state == {"n": 1}
    fresh = Store.open(store_url)
    assert fresh.outcome_records(v).to_pylist() == [
        {"row": 0, "step": 1, "score": 1.0, "length": 12},
        {"row": 0, "step": 1, "score": 0.0, "length": 30},
        {"row": 3, "step": 1, "score": 0.5, "length": 7},
    ]
    assert fresh.outcome_records(v - 1).num_rows == 0
    stats = fresh.outcome_stats(v)
    assert stats.num_rows == 7  # one row per store row of the version
    assert_stats(stats, reference(outcomes, 7, DEFAULT_SUCCESS_ABOVE, DEFAULT_HALF_LIFE))
    assert fresh.generator_state(v) == {"n": 1}
    assert fresh.generator_state(v - 1) is None


def test_outcome_files_are_lz4_and_older_snappy_files_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append(rows(0, 4))
    first = [{"row": 0, "step": 1, "score": 1.0}, {"row": 2, "step": 1, "score": 0.25}]
    monkeypatch.setattr(outcome_log, "OUTCOME_COMPRESSION", "snappy")  # as written before
    store.append([], outcomes=first)
    monkeypatch.undo()
    second = [{"row": 2, "step": 2, "score": 0.75}]
    v = store.append([], outcomes=second)
    codecs = []
    for version in (v - 1, v):
        (entry,) = store.commit_record(version).outcomes["add"]
        meta = pq.read_metadata(tmp_path / "s" / entry["path"])
        codecs.append({meta.row_group(0).column(c).compression for c in range(meta.num_columns)})
    assert codecs == [{"SNAPPY"}, {"LZ4"}]
    fresh = Store.open(str(tmp_path / "s"))
    assert fresh.outcome_records(v).to_pylist() == first + second
    assert_stats(
        fresh.outcome_stats(v),
        reference(first + second, 4, DEFAULT_SUCCESS_ABOVE, DEFAULT_HALF_LIFE),
    )


def test_input_forms_empty_rounds_and_commit_staged(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s", create=True)
    store.append(rows(0, 3))
    as_columns = {"row": [0, 1], "step": [1, 1], "score": [1, 0]}  # int scores become floats
    as_table = pa.table({"row": [2], "step": [2], "score": [0.5], "ok": [True]})
    v1 = store.append([], outcomes=as_columns)  # an empty round with outcomes
    v2 = store.commit_staged([store.stage([])], outcomes=as_table, generator_state=[1, "a"])
    staged = store.stage(rows(3, 1))
    v3 = store.commit_staged([staged], outcomes=[{"row": 1, "step": 3, "score": 0.25}])
    assert (v1, v2, v3) == (2, 3, 4)
    records = store.outcome_records()
    assert records.column("score").type == pa.float64()
    assert records.to_pylist() == [
        {"row": 0, "step": 1, "score": 1.0, "ok": None},
        {"row": 1, "step": 1, "score": 0.0, "ok": None},
        {"row": 2, "step": 2, "score": 0.5, "ok": True},
        {"row": 1, "step": 3, "score": 0.25, "ok": None},
    ]
    assert store.snapshot().num_rows == 4
    assert store.generator_state() == [1, "a"]  # the latest in the lineage
    # an empty outcome table commits the round alone (format 1, nothing to record)
    v = store.append(rows(4, 1), outcomes={"row": [], "step": [], "score": []})
    assert store.commit_record(v).outcomes is None
    assert store.commit_record(v).to_json()["format"] == 1


# -- 2. generator state ----------------------------------------------------------------------


def test_generator_state_follows_the_lineage(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s", create=True)
    states = {}
    for k in range(1, 130):
        state = {"k": k, "pool": [k, k + 1], "nested": {"x": k / 3}} if k % 3 == 0 else None
        v = store.append(rows(k, 1), meta={"step": k}, generator_state=state)
        states[v] = state if state is not None else states.get(v - 1)
    fresh = Store.open(tmp_path / "s")
    for v in (1, 3, 4, 99, 100, 101, 128, 129):
        assert fresh.generator_state(v) == states.get(v), v
    store.tag("t", 50)
    assert fresh.generator_state("t") == states[50]
    # a rollback brings back the state of the checkpointed version
    rollback(fresh, version=50)
    assert fresh.generator_state() == states[50]
    assert Store.open(tmp_path / "s").generator_state() == states[50]
    # the returned value is a copy
    got = fresh.generator_state()
    got["k"] = -1
    assert fresh.generator_state() == states[50]


# -- 3. statistics -----------------------------------------------------------------------------


def build(url: str, steps: int, seed: int = 0) -> tuple[Store, dict[int, list[dict]]]:
    """A store whose version v (v >= 2) committed step v-1's outcomes with round v-1."""
    rng = random.Random(seed)
    store = Store.open(url, create=True)
    store.append(rows(0, 8), meta={"step": 0})
    by_version: dict[int, list[dict]] = {1: []}
    for step in range(1, steps + 1):
        head = store.snapshot()
        outcomes = outcomes_for(step, head.num_rows, rng)
        v = store.append(rows(step, 2), meta={"step": step}, outcomes=outcomes)
        by_version[v] = outcomes
    # the outcome checkpoints are written in the background: the tests read them
    outcome_log.outcomes_of(store.log).flush()
    return store, by_version


def lineage_records(by_version: dict[int, list[dict]], upto: int) -> list[dict]:
    return [r for v in sorted(by_version) if v <= upto for r in by_version[v]]


def test_stats_at_every_version_across_checkpoints(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    store, by_version = build(url, 230)
    # outcome checkpoints with aggregates were written after versions 100 and 200
    assert store.storage.exists(outcome_log.checkpoint_path(100))
    assert store.storage.exists(outcome_log.checkpoint_path(200))
    fresh = Store.open(url)
    for v in (1, 2, 57, 99, 100, 101, 199, 200, 201, 231):
        n = fresh.snapshot(v).num_rows
        expected = reference(lineage_records(by_version, v), n, 0.5, 10.0)
        assert_stats(fresh.outcome_stats(v), expected)
    # caller-chosen parameters (not the aggregates'): the same answer, from the records
    head = fresh.head
    n = fresh.snapshot().num_rows
    for above, half in ((0.0, 1.0), (0.8, 3.5), (-2.0, 1000.0)):
        expected = reference(lineage_records(by_version, head), n, above, half)
        assert_stats(fresh.outcome_stats(success_above=above, half_life=half), expected)
    all_records = lineage_records(by_version, head)
    assert fresh.outcome_records().to_pylist() == all_records


def test_stats_at_the_head_read_only_the_outcomes_since_the_aggregate(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    build(url, 250)
    fresh = Store.open(url)
    reads: list[str] = []
    original = fresh.storage.read

    def counting(rel: str, **kwargs: Any) -> bytes:
        reads.append(rel)
        return original(rel, **kwargs)

    fresh.storage.read = counting  # type: ignore[method-assign]
    fresh.outcome_stats()
    outcome_files = {f.path for f in outcome_log.outcomes_of(fresh.log).lineage_files(fresh.head)}
    read_outcomes = [r for r in reads if r in outcome_files]
    # the aggregate at version 200 covers the first 199 files: only the 51 since are read
    assert len(outcome_files) == 250
    assert len(read_outcomes) == 51
    assert sum(r.startswith(outcome_log.AGGREGATE_DIR) for r in reads) == 1
    # a handle asked again after one more step reads one file more; the handle that
    # committed the step none (it keeps what it wrote)
    reader = Store.open(url)
    reader.outcome_stats()
    reader_reads: list[str] = []
    reader_read = reader.storage.read

    def reader_counting(rel: str, **kwargs: Any) -> bytes:
        reader_reads.append(rel)
        return reader_read(rel, **kwargs)

    reader.storage.read = reader_counting  # type: ignore[method-assign]
    fresh.append([], outcomes=[{"row": 0, "step": 999, "score": 1.0}])
    reads.clear()
    fresh.outcome_stats()
    assert [r for r in reads if r.startswith("data/")] == []
    reader.refresh()
    reader.outcome_stats()
    assert len([r for r in reader_reads if r.startswith("data/")]) == 1
    # another half-life cannot use the aggregate: every file is read (documented)
    reads.clear()
    outcome_log.outcomes_of(fresh.log)._files.clear()
    fresh.outcome_stats(half_life=3.0)
    assert len([r for r in reads if r.startswith("data/")]) == 251


def counted_reads(store: Store) -> list[str]:
    reads: list[str] = []
    original = store.storage.read

    def counting(rel: str, **kwargs: Any) -> bytes:
        reads.append(rel)
        return original(rel, **kwargs)

    store.storage.read = counting  # type: ignore[method-assign]
    return reads


def test_outcome_records_read_each_file_once_per_handle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handle asked for a version's records twice reads its outcome files once; asked
    again after one more step, only the new file (the rest are cached, not re-read through
    the pool)."""
    url = str(tmp_path / "s")
    build(url, 30)
    fresh = Store.open(url)
    reads = counted_reads(fresh)
    pools: list[int] = []
    executor = outcome_log._READS.executor

    def counting_executor(workers: int) -> Any:
        pools.append(workers)
        return executor(workers)

    monkeypatch.setattr(outcome_log._READS, "executor", counting_executor)
    first = fresh.outcome_records()
    assert len([r for r in reads if r.startswith("data/")]) == 30 and len(pools) == 1
    reads.clear()
    assert fresh.outcome_records().equals(first)
    assert [r for r in reads if r.startswith("data/")] == [] and len(pools) == 1
    writer = Store.open(url)
    writer.append([], outcomes=[{"row": 0, "step": 999, "score": 1.0}])
    fresh.refresh()
    records = fresh.outcome_records()
    assert len([r for r in reads if r.startswith("data/")]) == 1
    assert records.num_rows == first.num_rows + 1
    assert records.slice(0, first.num_rows).equals(first)


def test_a_lineage_longer_than_the_cache_keeps_its_newest_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading more outcome files than the cache holds keeps the newest ones, rather than
    evicting, one by one, the files the next read asks for first: asked again, only the
    older files are read."""
    monkeypatch.setattr(outcome_log, "_CACHE_FILES", 10)
    url = str(tmp_path / "s")
    build(url, 30)
    fresh = Store.open(url)
    reads = counted_reads(fresh)
    first = fresh.outcome_records()
    assert len([r for r in reads if r.startswith("data/")]) == 30
    newest = {f.path for f in outcome_log.outcomes_of(fresh.log).lineage_files(fresh.head)[-10:]}
    assert set(outcome_log.outcomes_of(fresh.log)._files) == newest
    reads.clear()
    assert fresh.outcome_records().equals(first)
    again = [r for r in reads if r.startswith("data/")]
    assert len(again) == 20 and not newest & set(again)


def test_any_threshold_reads_only_the_outcomes_since_the_aggregate(tmp_path: Path) -> None:
    """The aggregate's score histogram gives successes above any threshold: a fresh handle
    reads one aggregate and the 51 files since it, whatever the threshold, at 250 steps as
    at 450 (issue 21, item 3)."""
    url = str(tmp_path / "s")
    store, by_version = build(url, 250)
    records = lineage_records(by_version, store.head)
    num_rows = store.snapshot().num_rows
    for threshold in (0.9, 0.0, 0.25, -5.0, 1.0):
        fresh = Store.open(url)
        reads = counted_reads(fresh)
        stats = fresh.outcome_stats(success_above=threshold)
        assert_stats(stats, reference(records, num_rows, threshold, 10.0))
        assert len([r for r in reads if r.startswith("data/")]) == 51, threshold
        assert sum(r.startswith(outcome_log.AGGREGATE_DIR) for r in reads) == 1
    # 200 steps more: the same reads (bounded by the steps since the aggregate, not history)
    for step in range(251, 451):
        store.append([], outcomes=outcomes_for(step, num_rows, random.Random(step)))
        records += outcomes_for(step, num_rows, random.Random(step))
    fresh = Store.open(url)
    reads = counted_reads(fresh)
    stats = fresh.outcome_stats(success_above=0.9)
    assert_stats(stats, reference(records, num_rows, 0.9, 10.0))
    assert len([r for r in reads if r.startswith("data/")]) == 51
    assert sum(r.startswith(outcome_log.AGGREGATE_DIR) for r in reads) == 1


def test_continuous_scores_fall_back_to_every_record_for_other_thresholds(
    tmp_path: Path,
) -> None:
    """Past MAX_SCORE_VALUES distinct scores the aggregates keep no histogram: the default
    threshold stays bounded, another one reads every record (and is still exact)."""
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append(rows(0, 8))
    records = []
    for step in range(1, 131):
        batch = [{"row": i % 8, "step": step, "score": (step * 7 + i) / 1000} for i in range(3)]
        records += batch
        store.append([], outcomes=batch)
    fresh = Store.open(url)
    reads = counted_reads(fresh)
    assert_stats(fresh.outcome_stats(), reference(records, 8, 0.5, 10.0))
    assert len([r for r in reads if r.startswith("data/")]) == 31  # files 100..130
    reads.clear()
    outcome_log.outcomes_of(fresh.log)._files.clear()  # count the reads, not this cache
    assert_stats(fresh.outcome_stats(success_above=0.2), reference(records, 8, 0.2, 10.0))
    assert len([r for r in reads if r.startswith("data/")]) == 130


def test_pending_outcomes_count_as_if_committed_and_write_nothing(tmp_path: Path) -> None:
    """``outcome_stats(pending=...)``: what a generator running in the middle of a step sees
    — the statistics with the step's own outcomes, equal to those after the commit."""
    url = str(tmp_path / "s")
    store, by_version = build(url, 120)
    num_rows = store.snapshot().num_rows
    pending = outcomes_for(121, num_rows, random.Random(5))
    before = files(url)
    for threshold, half in ((0.5, 10.0), (0.9, 10.0), (0.5, 2.0)):
        got = store.outcome_stats(success_above=threshold, half_life=half, pending=pending)
        expected = reference(
            lineage_records(by_version, store.head) + pending, num_rows, threshold, half
        )
        assert_stats(got, expected)
    assert files(url) == before  # nothing written
    # the committed version's own statistics are untouched by the pending ones
    assert_stats(
        store.outcome_stats(),
        reference(lineage_records(by_version, store.head), num_rows, 0.5, 10.0),
    )
    with_pending = store.outcome_stats(pending=pending)
    store.append([], outcomes=pending)
    assert_stats(store.outcome_stats(), with_pending.to_pylist())
    # steps already recorded would count twice; bad records are refused as in append
    with pytest.raises(InvalidDataError, match="count twice"):
        store.outcome_stats(pending=[{"row": 0, "step": 7, "score": 1.0}])
    with pytest.raises(InvalidDataError, match="NaN"):
        store.outcome_stats(pending=[{"row": 0, "step": 500, "score": float("nan")}])
    with pytest.raises(InvalidDataError, match="row"):
        store.outcome_stats(pending=[{"row": 10**6, "step": 500, "score": 1.0}])
    # an old version with pending outcomes of a later step
    early = [{"row": 3, "step": 300, "score": 1.0}, {"row": 105, "step": 300, "score": 0.25}]
    assert_stats(
        store.outcome_stats(50, pending=early),
        reference(lineage_records(by_version, 50) + early, 8 + 2 * 49, 0.5, 10.0),
    )


def test_time_travel_tags_reset_and_rollback_give_exactly_that_versions_stats(
    store_url: str,
) -> None:
    store, by_version = build(store_url, 12, seed=3)
    store.tag("step6", 7)
    at7 = store.outcome_stats(7)
    records7 = store.outcome_records(7)
    expected7 = reference(lineage_records(by_version, 7), store.snapshot(7).num_rows, 0.5, 10.0)
    assert_stats(at7, expected7)
    assert store.outcome_stats("step6").equals(at7)
    # the abandoned run's outcomes do not leak
    new = rollback(store, step=6)
    assert store.commit_record(new).op == "reset"
    assert_stats(store.outcome_stats(), expected7)
    assert store.outcome_records().equals(records7)
    # step 7 may be recorded again in the new lineage (its old outcomes are abandoned)
    again = [{"row": 1, "step": 7, "score": 1.0}]
    v = store.append(rows(7, 2), meta={"step": 7}, outcomes=again)
    n = store.snapshot(v).num_rows
    assert_stats(
        Store.open(store_url).outcome_stats(v),
        reference(lineage_records(by_version, 7) + again, n, 0.5, 10.0),
    )
    assert verify_store(Store.open(store_url), all_versions=True).ok
    # the abandoned versions still read as they were
    assert_stats(
        store.outcome_stats(13),
        reference(lineage_records(by_version, 13), store.snapshot(13).num_rows, 0.5, 10.0),
    )


def test_a_reset_past_rows_added_without_outcomes_has_its_own_row_count(tmp_path: Path) -> None:
    """The handle's cached statistics of a longer version with the same outcome files must
    not answer for the shorter one."""
    store, _ = build(str(tmp_path / "s"), 3)
    store.append(rows(50, 5))  # rows, no outcomes
    longer = store.outcome_stats()
    back = store.reset(4)
    shorter = store.outcome_stats()
    assert shorter.num_rows == store.snapshot(back).num_rows == longer.num_rows - 5
    assert shorter.equals(longer.slice(0, shorter.num_rows))


def test_reset_far_back_and_forward_again_over_checkpoints(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    store, by_version = build(url, 120, seed=5)
    expected = reference(lineage_records(by_version, 40), store.snapshot(40).num_rows, 0.5, 10.0)
    store.reset(40)
    for k in range(90):  # past the next checkpoint (version 200) on the new branch
        store.append(rows(500 + k, 1))
    outcome_log.outcomes_of(store.log).flush()  # 200's checkpoint is written in the background
    fresh = Store.open(url)
    assert fresh.head > 200
    assert fresh.storage.exists(outcome_log.checkpoint_path(200))
    head = fresh.outcome_stats()
    assert_stats(head.slice(0, len(expected)), expected)
    assert head.slice(len(expected)).column("attempts").to_pylist() == [0] * (
        head.num_rows - len(expected)
    )


def test_compaction_never_changes_them(store_url: str) -> None:
    store, _ = build(store_url, 9, seed=1)
    before = store.outcome_stats()
    records = store.outcome_records()
    state_v = store.append([], generator_state={"s": "x"})
    new = compact(store)
    assert store.commit_record(new).op == "compact"
    fresh = Store.open(store_url)
    assert fresh.outcome_stats(new).equals(before)
    assert fresh.outcome_records(new).equals(records)
    assert fresh.generator_state(new) == fresh.generator_state(state_v) == {"s": "x"}
    # the compaction record carries the complete outcome list: it stands alone
    assert "base" in fresh.commit_record(new).outcomes
    assert verify_store(fresh, all_versions=True).ok


def test_gc_keeps_what_kept_versions_need_and_removes_the_rest(durable_url: str) -> None:
    store, by_version = build(durable_url, 15, seed=2)
    abandoned = {f["path"] for v in range(10, 17) for f in store.commit_record(v).outcomes["add"]}
    rollback(store, version=9)
    kept_expected = reference(lineage_records(by_version, 9), store.snapshot(9).num_rows, 0.5, 10)
    records = store.outcome_records()
    for k in range(4):
        store.append(rows(100 + k, 1))
    head_stats = store.outcome_stats()
    result = collect_garbage(store, keep=3, grace_s=0, dry_run=False)
    assert result.floor_after == store.head - 2
    removed = {r.path for r in result.removed}
    # the abandoned branch's outcome files go; the kept lineage's (below the floor) stay
    assert abandoned <= removed
    lineage_files = {f.path for f in outcome_log.outcomes_of(store.log).lineage_files(9)}
    assert len(lineage_files) == 8 and not lineage_files & removed
    fresh = Store.open(durable_url)
    assert fresh.outcome_stats().equals(head_stats)
    assert_stats(fresh.outcome_stats().slice(0, len(kept_expected)), kept_expected)
    assert fresh.outcome_records().equals(records)
    assert fresh.storage.exists(outcome_log.checkpoint_path(result.floor_after))
    assert verify_store(fresh, all_versions=True).ok
    # a second gc finds nothing of theirs to remove
    again = collect_garbage(fresh, keep=3, grace_s=0, dry_run=False)
    assert not [r for r in again.removed if r.path.startswith("data/")]
    assert Store.open(durable_url).outcome_stats().equals(head_stats)


def test_gc_floor_past_an_aggregate_and_a_reset_record(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    store, _ = build(url, 105, seed=8)
    store.reset(104)  # a reset record carrying the complete list and the aggregate of 100
    store.append(rows(999, 1))
    expected = store.outcome_stats()
    collect_garbage(store, keep=1, grace_s=0, dry_run=False)
    fresh = Store.open(url)
    assert fresh.log.floor == fresh.head
    assert fresh.outcome_stats().equals(expected)
    assert verify_store(fresh, all_versions=True).ok


def test_gc_of_an_old_store_keeps_exactly_the_aggregates_kept_versions_name(tmp_path: Path) -> None:
    """With every file older than gc's hour for unreferenced metadata, only what a kept
    version names survives: the aggregates of abandoned checkpoints go, the kept ones stay."""
    import os
    import time

    url = str(tmp_path / "s")
    store, _ = build(url, 205, seed=4)  # aggregates at 100 and 200
    at200 = json.loads(store.storage.read(outcome_log.checkpoint_path(200)))["aggregate"]
    reset = store.reset(150)  # abandons 151-206 and the checkpoint of 200; carries 100's
    store.append(rows(999, 1))
    expected = store.outcome_stats()
    old = time.time() - 3 * 3600
    for path in (tmp_path / "s").rglob("*"):
        os.utime(path, (old, old))
    result = collect_garbage(store, keep=2, grace_s=0, dry_run=False)
    assert result.floor_after == reset
    fresh = Store.open(url)
    kept = {
        f"{outcome_log.AGGREGATE_DIR}/{p.name}"
        for p in (tmp_path / "s" / outcome_log.AGGREGATE_DIR).iterdir()
    }
    floor_checkpoint = json.loads(fresh.storage.read(outcome_log.checkpoint_path(reset)))
    needed = {
        fresh.commit_record(reset).outcomes["aggregate"]["path"],  # the reset carries 100's
        floor_checkpoint["aggregate"]["path"],  # gc wrote the floor's outcome checkpoint
    }
    assert kept == needed and at200["path"] not in kept
    assert fresh.outcome_stats().equals(expected)
    assert verify_store(fresh, all_versions=True).ok


def test_verify_finds_damaged_and_missing_outcome_files(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    store, _ = build(url, 5)
    assert verify_store(store).ok
    victim = store.commit_record(3).outcomes["add"][0]["path"]
    path = tmp_path / "s" / victim
    table = pq.read_table(path)
    pq.write_table(table.set_column(2, "score", pa.array([9.0] * table.num_rows)), path)
    report = verify_store(Store.open(url))
    assert not report.ok and any(victim in p and "checksum" in p for p in report.problems)
    path.unlink()
    report = verify_store(Store.open(url))
    assert any(victim in p and "missing" in p for p in report.problems)
    with pytest.raises(MissingShardError):
        Store.open(url).outcome_stats()


# -- 4. bad input ------------------------------------------------------------------------------


BAD_OUTCOMES = [
    ({"row": [0], "step": [1], "score": [float("nan")]}, "NaN"),
    ({"row": [0], "step": [1], "score": [float("inf")]}, "NaN or infinity"),
    ([{"row": 0, "step": 1, "score": "1.0"}], "must be numbers"),
    ({"row": [0], "step": [1], "score": ["pass"]}, "must be numbers"),
    ([{"row": 0, "step": 1, "score": True}], "must be numbers"),
    ({"row": [0], "step": [1], "score": [None]}, "nulls"),
    ({"row": [0], "step": [1]}, "lack column(s) score"),
    ({"row": [3], "step": [1], "score": [1.0]}, "name row 3"),  # the round's own new row
    ({"row": [99], "step": [1], "score": [1.0]}, "name row 99"),
    ({"row": [-1], "step": [1], "score": [1.0]}, "outside"),
    ({"row": [0.0], "step": [1], "score": [1.0]}, "integers"),
    ({"row": [0], "step": [-4], "score": [1.0]}, "outside"),
    ({"row": [0], "step": [0], "score": [1.0]}, "already have outcomes"),
    ({"row": [0], "step": [1], "score": [1.0], "len": ["x"]}, "must be numbers"),
    ({"row": [0], "step": [1], "score": [1.0], "x": [float("nan")]}, "NaN"),
    ({"row": [0, 1], "step": [1], "score": [1.0]}, "different lengths"),
    ("row,step,score", "must be a pyarrow Table"),
    ([1, 2], "must hold dicts"),
    ({"row": [0], "step": [1], "score": [1.0], **{f"f{i}": [1] for i in range(40)}}, "extra"),
]


@pytest.mark.parametrize("bad,message", BAD_OUTCOMES)
def test_bad_outcomes_are_refused_and_change_nothing(
    tmp_path: Path, bad: Any, message: str
) -> None:
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append(rows(0, 3))
    store.append([], outcomes={"row": [0], "step": [0], "score": [1.0]})
    before = files(url)
    with pytest.raises(InvalidDataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        store.append(rows(1, 2), outcomes=bad)
    with pytest.raises(InvalidDataError):
        store.commit_staged([], outcomes=bad)
    assert files(url) == before
    assert Store.open(url).head == 2


BAD_STATES = [
    ((1, 2), "tuple"),
    ({1: "a"}, "keys must be str"),
    ({"x": float("nan")}, "nan"),
    ({"x": {1, 2}}, "set"),
    ({"x": object()}, "object"),
    ({"x": b"bytes"}, "bytes"),
    ({"x": "y" * (2**20 + 10)}, "over the limit"),
]


@pytest.mark.parametrize("bad,message", BAD_STATES)
def test_bad_generator_state_is_refused_and_changes_nothing(
    tmp_path: Path, bad: Any, message: str
) -> None:
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append(rows(0, 3))
    before = files(url)
    with pytest.raises(InvalidDataError, match=message):
        store.append(rows(1, 2), generator_state=bad)
    assert files(url) == before


def test_a_bad_round_with_good_outcomes_changes_nothing(tmp_path: Path) -> None:
    """The outcome file is written before the round's shards; a round refused after it
    takes the file (and its lease) away again."""
    from dynstate import SchemaMismatchError

    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append(rows(0, 3))
    store.append([], outcomes={"row": [0], "step": [0], "score": [1.0]})
    before = files(url)
    good = {"row": [1], "step": [1], "score": [0.5]}
    with pytest.raises(SchemaMismatchError):
        store.append([{"other": 1}], outcomes=good)
    with pytest.raises(InvalidDataError):
        store.append([{"step": 1, "i": 0, "text": float("nan") + 1j}], outcomes=good)
    assert files(url) == before
    assert store.append(rows(1, 1), outcomes=good) == 3


def test_oversized_outcomes_and_deep_state(tmp_path: Path, monkeypatch) -> None:
    from dynstate.records import outcomes as o

    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append(rows(0, 3))
    before = files(url)
    monkeypatch.setattr(o, "MAX_OUTCOMES", 10)
    with pytest.raises(InvalidDataError, match="over the limit of 10 per commit"):
        store.append([], outcomes={"row": [0] * 11, "step": [1] * 11, "score": [1.0] * 11})
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(InvalidDataError, match="nests deeper"):
        store.append([], generator_state=deep)
    assert files(url) == before


def test_checked_columns_of_every_integer_and_float_type_and_their_bounds() -> None:
    """The checks run in numpy over every input type: narrower and unsigned integers, float32,
    several chunks; each bound and each non-finite value is still refused."""
    from dynstate.records.outcomes import check_outcomes

    def check(**columns: Any) -> pa.Table:
        return check_outcomes(pa.table(columns), "s", 10, 1)

    two_chunks = pa.concat_tables(
        [
            pa.table({"row": pa.array([9], pa.int32()), "step": pa.array([3], pa.uint8())}),
            pa.table({"row": pa.array([0], pa.int32()), "step": pa.array([2], pa.uint8())}),
        ]
    )
    table = check_outcomes(
        two_chunks.append_column("score", pa.chunked_array([[1.5], [2]], pa.float32()))
        .append_column("n", pa.chunked_array([[7], [None]], pa.uint16()))
        .append_column("f", pa.chunked_array([[None], [0.5]], pa.float32())),
        "s",
        10,
        1,
    )
    assert table.schema == pa.schema(
        [
            ("row", pa.int64()),
            ("step", pa.int64()),
            ("score", pa.float64()),
            ("n", pa.int64()),
            ("f", pa.float64()),
        ]
    )
    assert table.to_pydict() == {
        "row": [9, 0],
        "step": [3, 2],
        "score": [1.5, 2.0],
        "n": [7, None],
        "f": [None, 0.5],
    }
    score = pa.array([1.0])
    big = pa.array([2**60], pa.uint64())
    for columns, message in (
        ({"row": big, "step": pa.array([1]), "score": score}, "'row' holds values outside 0..2"),
        ({"row": pa.array([0]), "step": big, "score": score}, "'step' holds values outside 0..2"),
        ({"row": pa.array([0]), "step": pa.array([2**53]), "score": score}, "outside"),
        (
            {"row": pa.array([0, -1], pa.int8()), "step": pa.array([1, 1]), "score": [1.0, 1.0]},
            "outside",
        ),
        ({"row": pa.array([10]), "step": pa.array([1]), "score": score}, "name row 10"),
        (
            {
                "row": pa.array([0]),
                "step": pa.array([1]),
                "score": pa.array([math.inf], pa.float32()),
            },
            "NaN or infinity",
        ),
        (
            {
                "row": pa.array([0, 1]),
                "step": pa.array([1, 1]),
                "score": [1.0, 0.0],
                "f": pa.array([None, math.nan]),
            },
            "'f' holds NaN",
        ),
        (
            {
                "row": pa.array([0, 1]),
                "step": pa.array([1, 1]),
                "score": [1.0, 0.0],
                "f": pa.array([1.0, -math.inf], pa.float32()),
            },
            "'f' holds NaN",
        ),
    ):
        with pytest.raises(InvalidDataError, match=message):
            check(**columns)


def test_step_sets_from_numpy_are_those_of_the_records() -> None:
    from dynstate.records.outcomes import steps_of, to_ranges

    rng = random.Random(3)
    assert steps_of(pa.table({"step": pa.array([], pa.int64())})) == []
    for _ in range(300):
        steps = [rng.randrange(rng.choice([1, 5, 40, 2**53])) for _ in range(rng.randrange(1, 30))]
        assert steps_of(pa.table({"step": pa.array(steps, pa.int64())})) == to_ranges(steps)


def test_commits_during_a_background_checkpoint_walk_one_record_and_use_it_after(
    tmp_path: Path,
) -> None:
    """While this handle writes version 100's outcome checkpoint, a commit's step check walks
    back to the lineage the previous commit walked, not to the checkpoint below (which takes
    the commits ~100 record reads each for as long as the checkpoint takes); steps committed
    meanwhile are refused still, and once the checkpoint lands lineages name its aggregate."""
    import threading

    store, by_version = build(str(tmp_path / "s"), 98)  # versions 2-99: steps 1-98
    outcomes = outcome_log.outcomes_of(store.log)
    gate = threading.Event()
    put_aggregate = outcomes._put_aggregate

    def held(*args: Any, **kwargs: Any) -> Any:
        gate.wait(30)
        return put_aggregate(*args, **kwargs)

    outcomes._put_aggregate = held  # type: ignore[method-assign]
    walked: list[int] = []
    add_of = outcomes._add_of

    def counted(record: m.Commit) -> Any:
        walked.append(record.version)
        return add_of(record)

    outcomes._add_of = counted  # type: ignore[method-assign]
    rng = random.Random(5)
    try:
        for step in range(99, 106):  # versions 100-106
            num_rows = store.snapshot().num_rows
            by_version[step + 1] = outcomes_for(step, num_rows, rng)
            walked.clear()
            store.append(rows(step, 2), meta={"step": step}, outcomes=by_version[step + 1])
            if step > 100:
                assert walked == [step], walked  # the head only: the one before is known
        assert outcomes._checkpoint_in_flight(100)
        head = store.snapshot()
        with pytest.raises(InvalidDataError, match=r"step\(s\) 103 already have outcomes"):
            store.append([], outcomes=outcomes_for(103, head.num_rows, rng))
        assert outcomes.lineage(106).aggregate is None  # the one of version 100 is to come
    finally:
        gate.set()
    outcomes.flush()
    lineage = outcomes.lineage(store.head)
    assert lineage.aggregate is not None and lineage.aggregate.files == 99
    assert lineage.steps == ((1, 105),)
    expected = reference(
        lineage_records(by_version, store.head),
        store.snapshot().num_rows,
        DEFAULT_SUCCESS_ABOVE,
        DEFAULT_HALF_LIFE,
    )
    assert_stats(store.outcome_stats(), expected)


def test_bad_stats_parameters(tmp_path: Path) -> None:
    store, _ = build(str(tmp_path / "s"), 2)
    for kwargs in (
        {"half_life": 0},
        {"half_life": -1},
        {"half_life": float("inf")},
        {"success_above": float("nan")},
        {"success_above": "0.5"},
    ):
        with pytest.raises(InvalidDataError):
            store.outcome_stats(**kwargs)


def test_a_step_committed_by_another_writer_meanwhile_is_refused(tmp_path: Path) -> None:
    """The checks run again against the parent the record is finally built on."""
    url = str(tmp_path / "s")
    a = Store.open(url, create=True)
    a.append(rows(0, 3))
    b = Store.open(url)
    staged = b.stage([])
    a.append([], outcomes={"row": [0], "step": [5], "score": [1.0]})
    with pytest.raises(InvalidDataError, match="step"):
        b.commit_staged([staged], outcomes={"row": [1], "step": [5], "score": [0.0]})
    assert Store.open(url).outcome_records().num_rows == 1


def test_append_refused_at_its_record_removes_the_round_and_outcome_file(
    tmp_path: Path, monkeypatch
) -> None:
    """``append`` writes the round's shards and its outcome file under one lease; when the
    record cannot be built (another writer committed the step meanwhile) both go, and the
    lease with them."""
    from dynstate.writes import Writer

    url = str(tmp_path / "s")
    a = Store.open(url, create=True)
    a.append(rows(0, 3))
    other = Store.open(url)
    written_round = Writer._write_round
    written: list[str] = []

    def then_another_writer(self: Writer, *args: Any, **kwargs: Any) -> Any:
        result = written_round(self, *args, **kwargs)  # (shards, pending, ...)
        shards, pending = result[0], result[1]
        if not written:  # the first writer's round; the other writer's goes through
            written.extend([s.path for s in shards] + [pending.ref.path])
            other.append([], outcomes={"row": [0], "step": [5], "score": [1.0]})
        return result

    monkeypatch.setattr(Writer, "_write_round", then_another_writer)
    with pytest.raises(InvalidDataError, match="step"):
        a.append(rows(1, 2), outcomes={"row": [1], "step": [5], "score": [0.0]})
    monkeypatch.undo()
    assert len(written) == 2 and len({p.split("/")[-1][:32] for p in written}) == 1  # one lease
    fs, root = fsspec.core.url_to_fs(url)
    left = {p[len(root) + 1 :] for p in fs.find(root)}
    assert not any(p in left for p in written)
    assert not [p for p in left if p.startswith("_dynstate/leases/")]
    assert Store.open(url).outcome_records().num_rows == 1
    assert verify_store(Store.open(url), all_versions=True).ok


# -- 5. format -------------------------------------------------------------------------------


def test_formats_only_records_and_stores_with_outcomes_are_format_2(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append(rows(0, 3))
    raw = json.loads(store.storage.read(m.STORE_FILE))
    assert raw["format"] == 1
    assert json.loads(store.storage.read(m.log_path(1)))["format"] == 1
    v = store.append([], outcomes={"row": [0], "step": [0], "score": [1.0]})
    assert json.loads(store.storage.read(m.log_path(v)))["format"] == 2
    raw = json.loads(store.storage.read(m.STORE_FILE))
    assert raw["format"] == 2 and raw["outcomes_since"] == 1
    v = store.append(rows(1, 1))
    assert json.loads(store.storage.read(m.log_path(v)))["format"] == 1
    # a record of a format beyond this dynstate's is refused, not misread
    future = m.encode({**json.loads(store.storage.read(m.log_path(v))), "format": 3})
    store.storage.put(m.log_path(v), future)
    with pytest.raises(UnsupportedFormatError, match="upgrade dynstate"):
        Store.open(url).commit_record(v)


OLD_CODE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import dynstate
    assert dynstate.__file__.startswith(sys.argv[1]), dynstate.__file__
    from dynstate import Store, UnsupportedFormatError
    url, action = sys.argv[2], sys.argv[3]
    if action == "write":
        store = Store.open(url, create=True)
        for k in range(3):
            store.append([{"step": k, "i": 0, "text": f"old {k}"}], meta={"step": k})
        print("ok", store.head)
    else:
        try:
            Store.open(url).snapshot()
        except UnsupportedFormatError as exc:
            print("refused", exc)
        else:
            print("read it")
    """
)


@pytest.fixture(scope="module")
def old_dynstate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dynstate package as it was before outcomes (git history of this repository)."""
    out = tmp_path_factory.mktemp("old")
    try:
        base = subprocess.run(
            [
                "git",
                "log",
                "--format=%H",
                "-1",
                "--diff-filter=A",
                "--",
                "dynstate/outcomes.py",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        archive = subprocess.run(
            ["git", "archive", f"{base}^", "dynstate"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"needs the git history of the repository: {exc}")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    assert not (out / "dynstate" / "outcomes.py").exists()
    return out


def run_old(old: Path, url: str, action: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", OLD_CODE, str(old), url, action],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=old,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_old_stores_gain_outcomes_and_old_dynstate_refuses_them(
    tmp_path: Path, old_dynstate: Path
) -> None:
    url = str(tmp_path / "s")
    assert run_old(old_dynstate, url, "write").split() == ["ok", "3"]
    store = Store.open(url)  # a store written before this change opens and reads
    assert store.snapshot().to_arrow().column("text").to_pylist() == ["old 0", "old 1", "old 2"]
    assert store.outcome_stats().column("attempts").to_pylist() == [0, 0, 0]
    assert store.generator_state() is None
    assert run_old(old_dynstate, url, "read").strip() == "read it"
    # ... and gains outcomes with its next commit
    v = store.append(
        [{"step": 3, "i": 0, "text": "new"}],
        outcomes={"row": [1, 2], "step": [3, 3], "score": [1.0, 0.0]},
        generator_state={"seen": 3},
    )
    fresh = Store.open(url)
    assert fresh.outcome_stats(v).column("attempts").to_pylist() == [0, 1, 1, 0]
    assert fresh.generator_state() == {"seen": 3}
    assert fresh.snapshot().num_rows == 4
    # an older dynstate refuses the store rather than misreading it (or its gc deleting
    # outcome files as orphans)
    out = run_old(old_dynstate, url, "read")
    assert out.startswith("refused") and "format 2" in out and "upgrade dynstate" in out


def test_outcome_checkpoint_and_aggregate_are_checked(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    store, _ = build(url, 101)
    rel = outcome_log.checkpoint_path(100)
    obj = json.loads(store.storage.read(rel))
    assert obj["format"] == 2 and obj["aggregate"]["files"] == 99
    assert math.isclose(obj["aggregate"]["half_life"], DEFAULT_HALF_LIFE)
    agg = obj["aggregate"]["path"]
    store.storage.put(agg, store.storage.read(agg) + b"x")
    fresh = Store.open(url)
    report = verify_store(fresh)
    assert any("checksum" in p and agg in p for p in report.problems)
    # the statistics do not trust it: they fold the records instead
    expected = reference(fresh.outcome_records().to_pylist(), fresh.snapshot().num_rows, 0.5, 10.0)
    assert_stats(fresh.outcome_stats(), expected)
    obj["records"] = 5  # tampered: the checksum no longer matches
    store.storage.put(rel, json.dumps(obj).encode())
    with pytest.raises(ChecksumMismatchError):
        Store.open(url).outcome_stats(100)


# -- 7. dynstate stats -------------------------------------------------------------------------


def test_cli_stats(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from dynstate.cli import cli

    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append(rows(0, 6))
    # rows 0-2 always fail, row 3 half the time, row 4 always passes, row 5 never trained
    outcomes = [
        {"row": r, "step": s, "score": score}
        for s in range(4)
        for r, score in ((0, 0.0), (1, 0.0), (2, 0.0), (3, float(s % 2)), (4, 1.0))
    ]
    store.append([], outcomes=outcomes)
    store.tag("trained", 2)
    runner = CliRunner()
    result = runner.invoke(cli, ["stats", url, "trained", "--json", "--top", "2", "--bins", "4"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["version"] == 2 and out["rows"] == 6
    assert (out["trained"], out["never_trained"], out["records"]) == (5, 1, 20)
    assert out["pass_rate"] == pytest.approx(6 / 20)
    assert [b["rows"] for b in out["histogram"]] == [3, 0, 1, 1]  # 0%, 50%, 100%
    assert [e["row"] for e in out["hardest"]] == [0, 1]
    assert [e["row"] for e in out["easiest"]] == [4, 3]
    assert out["easiest"][1]["pass_rate"] == 0.5
    text = runner.invoke(cli, ["stats", url]).stdout
    assert "1 never trained" in text and "hardest rows:" in text and "[75%, 100%]" not in text
    # version 1 has no outcomes in its lineage
    assert "no outcomes recorded" in runner.invoke(cli, ["stats", url, "1"]).stdout
    bad = runner.invoke(cli, ["stats", url, "--half-life", "0"])
    assert bad.exit_code == 2 and "--half-life" in bad.output  # a usage error, naming the flag
    assert runner.invoke(cli, ["stats", url, "99"]).exit_code == 1
