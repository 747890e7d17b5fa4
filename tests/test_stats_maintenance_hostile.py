"""Outcome statistics, outcome records and generator state under maintenance (an outside
audit): compaction, gc (keep 1, grace 0) with and without tags, resets to old versions,
tags and time travel, crossing the 100-version outcome checkpoint several times, fresh and
long-lived handles, and ``dynstate stats --json``. The oracle is a model of what each
version committed (its lineage's records in order, kept by this test, not by dynstate),
folded by ``test_stats_oracle.oracle``; records are also read back from the outcome files
with plain pyarrow. The first test pins a defect; the last is a guard for what held up."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynstate import Store
from dynstate.maintenance.compact import compact
from dynstate.maintenance.gc import collect_garbage
from dynstate.records.aggregate import summarize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_stats_oracle import assert_identical, oracle

DYNSTATE = str(Path(sys.executable).with_name("dynstate"))
Record = tuple[int, int, float]


def as_table(records: list[Record]) -> pa.Table:
    return pa.table(
        {
            "row": pa.array([r for r, _, _ in records], pa.int64()),
            "step": pa.array([s for _, s, _ in records], pa.int64()),
            "score": pa.array([x for _, _, x in records], pa.float64()),
        }
    )


# -- 1. a handle that has not looked since a gc -------------------------------------------------


@pytest.mark.parametrize(
    "call", ["outcome_stats", "outcome_stats_at_tag", "outcome_records", "generator_state"]
)
def test_a_handle_opened_before_gc_reads_the_outcomes_of_a_kept_version(tmp_path, call):
    # DEFECT: Outcomes.lineage (dynstate/log/outcomes.py) walks back from the version asked
    # and stops at `self.log.floor` — the floor as of this handle's last refresh — but,
    # unlike Store.shard_list (which reads the floor again and walks over when its walk
    # fails), never re-reads it. A handle opened (or refreshed) before another process's gc
    # (`dynstate gc --keep 1 --grace 0`, cron) asks for a version gc KEPT — the floor itself,
    # or a tag on it — by number or tag (serve, an evaluator, a generator's
    # `outcome_stats(v, pending=...)`): its walk passes the real floor, reads the collected
    # record below it, and outcome_stats / outcome_records / generator_state raise
    # VersionCollectedError naming a version nobody asked for ("version 29 ... was removed
    # by garbage collection (oldest kept is 30)"). snapshot(v) on the same kind of handle
    # reads fine. (A second call on the same handle works: the failed read refreshed the
    # floor.)
    # EXPECTED (SPEC §3.12: "rollback, time travel, tags, compaction and gc treat them as they
    # treat rows"; docs/format.md: gc keeps the floor's complete outcome list and writes its
    # outcome checkpoint): the kept version's statistics, records and state, as for its
    # rows — re-read the floor and walk again when the walk meets a collected record (as
    # Store.shard_list does), or stop the walk at the floor read after resolving.
    url = str(tmp_path / "store")
    writer = Store.open(url, create=True)
    writer.append([{"x": i} for i in range(7)])
    rng = random.Random(5)
    records: list[Record] = []
    state = None
    for k in range(29):  # versions 2..30; steps far apart and out of order, rows repeated
        step = rng.choice([k * 1000 + 17, 10**9 + k, 10**15 - k])
        out = [(rng.choice([6, 2, 2, 0, 5]), step, rng.choice([0.0, 1.0, 0.25])) for _ in range(3)]
        state = {"k": k}
        writer.append(
            [],
            outcomes=[{"row": r, "step": s, "score": x} for r, s, x in out],
            generator_state=state,
        )
        records += out
    head = writer.refresh()
    writer.tag("eval", head)
    stale = Store.open(url)  # an evaluator's handle, opened before the gc
    rows_stale = Store.open(url)
    result = collect_garbage(Store.open(url), keep=1, grace_s=0, dry_run=False)
    assert result.floor_after == head  # the version asked for is kept: it is the floor
    assert rows_stale.snapshot(head).num_rows == 7  # its rows read fine on such a handle
    if call == "outcome_stats":
        assert_identical(stale.outcome_stats(head), oracle(as_table(records), 7, 0.5, 10.0), call)
    elif call == "outcome_stats_at_tag":
        assert_identical(stale.outcome_stats("eval"), oracle(as_table(records), 7, 0.5, 10.0), call)
    elif call == "outcome_records":
        got = stale.outcome_records(head).select(["row", "step", "score"]).to_pylist()
        assert [(g["row"], g["step"], g["score"]) for g in got] == records
    else:
        assert stale.generator_state(head) == state


# -- guard: what held up ------------------------------------------------------------------------


def _raw_records(url: str, store: Store, version: int) -> list[Record]:
    """The lineage's records read with plain pyarrow from the files its records name."""
    out: list[Record] = []
    for ref in store.outcome_log.lineage_files(version):
        t = pq.read_table(str(Path(url) / ref.path)).select(["row", "step", "score"]).to_pydict()
        out += list(zip(t["row"], t["step"], t["score"], strict=True))
    return out


def _cli_summary(url: str, version: str, *extra: str) -> dict[str, Any]:
    done = subprocess.run(
        [DYNSTATE, "stats", url, version, "--json", "--top", "50", *extra],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_stats_state_and_records_follow_compaction_gc_reset_and_tags(tmp_path):
    # GUARD: 400 operations — appends of unsorted, repeated rows at steps far apart and out
    # of order (some with new rows and a generator state), compactions, resets to old kept
    # versions, tags (also on abandoned versions), gc keep=1 grace=0 from this and another
    # handle, with and without tags — crossing the outcome checkpoint three times. At the
    # head and at old kept versions and tags: the long-lived handle's and a fresh handle's
    # statistics (three parameter sets, the histogram and the record fold paths) equal the
    # model's fold bit for bit; generator_state and outcome_records equal what the version
    # committed; the files read with plain pyarrow hold the same records; and
    # `dynstate stats --json` at the head and a tag equals the summary of the oracle.
    url = str(tmp_path / "store")
    rng = random.Random(11)
    store = Store.open(url, create=True)
    store.append([{"x": i} for i in range(8)])
    # version -> (the records of its lineage in order, its rows, its generator state)
    model: dict[int, tuple[list[Record], int, Any]] = {0: ([], 0, None), 1: ([], 8, None)}
    steps_of: dict[int, set[int]] = {1: set()}
    floor, tags, made = 0, {}, 0
    scores = [0.0, 1.0, 0.25, 0.75, -2.5, 3.0]

    def check(version: int) -> None:
        records, rows, state = model[version]
        fresh = Store.open(url)
        for above, half in ((0.5, 10.0), (0.1, 10.0), (0.5, 3.0)):
            want = oracle(as_table(records), rows, above, half)
            for name, handle in (("long-lived", store), ("fresh", fresh)):
                got = handle.outcome_stats(version, success_above=above, half_life=half)
                assert_identical(got, want, (name, version, above, half))
        assert store.generator_state(version) == state == fresh.generator_state(version)
        got = fresh.outcome_records(version).select(["row", "step", "score"]).to_pylist()
        assert [(g["row"], g["step"], g["score"]) for g in got] == records
        assert _raw_records(url, fresh, version) == records

    for op in range(400):
        head = store.refresh()
        records, rows, state = model[head]
        kept = [v for v in model if v >= max(floor, 1)]
        r = rng.random()
        if r < 0.78 or head < 3:
            steps: list[int] = []
            while len(steps) < rng.randint(1, 2):
                s = rng.choice(
                    [rng.randrange(50), rng.randrange(10**6), 10**12 + rng.randrange(99)]
                )
                if s not in steps_of[head] and s not in steps:
                    steps.append(s)
            out = [
                (rng.randrange(rows), rng.choice(steps), rng.choice(scores))
                for _ in range(rng.randint(1, 6))
            ]
            new_rows = [{"x": 100 + op}] * rng.randint(0, 2)
            new_state = {"op": op} if rng.random() < 0.5 else None
            v = store.append(
                new_rows,
                outcomes=[{"row": a, "step": b, "score": c} for a, b, c in out],
                generator_state=new_state,
            )
            v = store.refresh()
            model[v] = (records + out, rows + len(new_rows), new_state if new_state else state)
            steps_of[v] = steps_of[head] | set(steps)
        elif r < 0.86:
            target = rng.choice(kept)
            v = store.reset(target)
            model[v], steps_of[v] = model[target], steps_of[target]
        elif r < 0.93:
            v = compact(store)
            if v != head:
                model[v], steps_of[v] = model[head], steps_of[head]
        elif r < 0.96:
            made += 1
            tags[f"t{made}"] = rng.choice(kept)
            store.tag(f"t{made}", tags[f"t{made}"])
        else:
            if tags and rng.random() < 0.5:
                del_name = sorted(tags)[0]
                store.untag(del_name)
                del tags[del_name]
            by = Store.open(url) if rng.random() < 0.5 else store
            floor = collect_garbage(by, keep=1, grace_s=0, dry_run=False).floor_after
        if op % 10 == 9:
            head = store.refresh()
            check(head)
            check(rng.choice([v for v in model if v >= max(floor, 1)]))
            for name, v in tags.items():
                assert_identical(
                    Store.open(url).outcome_stats(name),
                    oracle(as_table(model[v][0]), model[v][1], 0.5, 10.0),
                    name,
                )
    head = store.refresh()
    assert head > 3 * 100  # the outcome checkpoint was crossed three times
    for version in [str(head), *sorted(tags)[:1]]:
        number = tags.get(version, int(version) if version.isdigit() else None)
        records, rows, _ = model[number]
        for extra, (above, half) in (
            ((), (0.5, 10.0)),
            (("--threshold", "0.1", "--half-life", "3"), (0.1, 3.0)),
        ):
            got = _cli_summary(url, version, *extra)
            want = oracle(as_table(records), rows, above, half)
            expected = summarize(pa.table({"row": list(range(rows)), **want}), bins=10, top=50)
            for key in ("rows", "trained", "never_trained", "records", "pass_rate", "histogram"):
                assert got[key] == expected[key], (version, key)
            for key in ("hardest", "easiest"):
                assert [
                    {
                        k: e[k]
                        for k in (
                            "row",
                            "attempts",
                            "successes",
                            "pass_rate",
                            "mean_score",
                            "ewma_score",
                            "last_step",
                        )
                    }
                    for e in got[key]
                ] == expected[key]
