"""Real processes racing on one store's ledger (outside audit): the same step's outcomes and
consumption record committed at once, outcomes committed while another process rolls back,
compacts and collects, a committer SIGKILLed mid-commit, and one SIGSTOPped past its lease
while gc runs with grace 0. Every check is against an oracle folded from the raw files (the
commit records read as JSON, outcome files read with pyarrow), never from dynstate's own view."""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from dynstate import DynstateError, Store

ROWS = 24


# -- raw oracle -------------------------------------------------------------------------------


class Raw:
    """The store's files read without dynstate: local paths or boto3 against the endpoint."""

    def __init__(self, url: str, endpoint: str | None = None) -> None:
        self.url = url
        if url.startswith("s3://"):
            import boto3

            bucket, _, prefix = url[5:].partition("/")
            self.bucket, self.prefix = bucket, prefix.rstrip("/")
            self.s3 = boto3.client("s3", endpoint_url=endpoint)
        else:
            self.s3 = None

    def read(self, rel: str) -> bytes | None:
        if self.s3 is None:
            p = Path(self.url) / rel
            return p.read_bytes() if p.exists() else None
        try:
            obj = self.s3.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{rel}")
        except self.s3.exceptions.NoSuchKey:
            return None
        return obj["Body"].read()

    def exists(self, rel: str) -> bool:
        if self.s3 is None:
            return (Path(self.url) / rel).exists()
        try:
            self.s3.head_object(Bucket=self.bucket, Key=f"{self.prefix}/{rel}")
            return True
        except Exception:
            return False

    def record(self, v: int) -> dict[str, Any] | None:
        data = self.read(f"_dynstate/log/{v:020d}.json")
        return None if data is None else json.loads(data)

    def records(self) -> dict[int, dict[str, Any]]:
        out, v, misses = {}, 0, 0
        while misses < 3:
            rec = self.record(v)
            if rec is None:
                misses += 1
            else:
                out[v], misses = rec, 0
            v += 1
        return out

    def lineage(self, records: dict[int, dict[str, Any]], head: int) -> list[int]:
        """Versions whose content makes up ``head``, newest first (append: parent; reset:
        its target; compact: parent)."""
        out, v = [], head
        while v is not None and v in records:
            out.append(v)
            rec = records[v]
            v = rec.get("target") if rec.get("op") == "reset" else rec.get("parent")
        return out

    def outcome_files(self, rec: dict[str, Any]) -> list[str]:
        o = rec.get("outcomes") or {}
        return [e["path"] for e in o.get("add", [])]

    def read_outcomes(self, path: str) -> list[dict[str, Any]]:
        data = self.read(path)
        assert data is not None, f"outcome file {path} named by a record is gone"
        return pq.read_table(io.BytesIO(data)).to_pylist()


def oracle_stats(raw: Raw, head: int) -> tuple[dict[int, list[float]], Counter, Counter]:
    """Per-row scores of the head's lineage (append records' own outcome files), the steps
    with outcomes and the steps with consumption records, counted along the lineage."""
    recs = raw.records()
    scores: dict[int, list[float]] = {}
    steps, ledger = Counter(), Counter()
    for v in raw.lineage(recs, head):
        rec = recs[v]
        if rec.get("op") != "append":
            continue  # a reset/compaction carries its source's outcomes: walked through
        for path in raw.outcome_files(rec):
            rows = raw.read_outcomes(path)
            for r in rows:
                scores.setdefault(r["row"], []).append(r["score"])
            steps.update({r["step"] for r in rows})
        if rec.get("consumption") is not None:
            ledger[rec["consumption"]["step"]] += 1
    return scores, steps, ledger


def assert_stats_match(store: Store, scores: dict[int, list[float]]) -> None:
    got = store.outcome_stats().to_pylist()
    by_row = {r["row"]: r for r in got}
    for row, vals in scores.items():
        assert by_row[row]["attempts"] == len(vals), (row, by_row[row], vals)
        assert abs(by_row[row]["mean_score"] - sum(vals) / len(vals)) < 1e-9, (row, vals)
    attempted = {r["row"] for r in got if r["attempts"]}
    assert attempted == set(scores), attempted ^ set(scores)


def record_for(step: int, rows_version: int, rows: list[int]) -> dict[str, Any]:
    return {
        "format": 1,
        "step": step,
        "rows_version": rows_version,
        "settings": {},
        "carried_in": [],
        "drawn": sorted(rows),
        "gen_batches": 1,
        "trained": sorted(rows),
        "filtered": [],
        "dropped": [],
        "carry": [],
        "sampler": {},
    }


def _make_store(url: str) -> Store:
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(ROWS)])
    return store


# -- 1. the same step committed by two processes at once ---------------------------------------


def _same_step_racer(url: str, w: int, steps: int, barrier: Any, q: Any, seed: int) -> None:
    rng = random.Random(seed * 100 + w)
    store = Store.open(url)
    for step in range(steps):
        barrier.wait(timeout=60)
        head = store.refresh()
        rows = rng.sample(range(ROWS), 3)
        outcomes = [{"row": r, "step": step, "score": float(w * 100 + r)} for r in rows]
        barrier.wait(timeout=60)  # both built from the same head
        try:
            v = store.append(
                [],
                meta={"step": step, "w": w},
                outcomes=outcomes,
                rows_version=head,
                consumption=record_for(step, head, rows),
            )
            q.put((w, step, "ok", v))
        except DynstateError as exc:
            q.put((w, step, type(exc).__name__, str(exc)[:200]))
        except BaseException as exc:  # untyped: a defect
            q.put((w, step, "UNTYPED " + type(exc).__name__, repr(exc)[:300]))


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_same_step_from_same_head_lands_once_and_ledger_matches_raw_files(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Guard: two processes commit step N's outcomes + consumption built from one head;
    exactly one lands per step, the other gets a typed error, the raw-file fold matches."""
    endpoint = None
    if backend == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        from conftest import s3_url

        url = s3_url()
    else:
        url = str(tmp_path / "store")
    _make_store(url)
    steps = 4 if backend == "local" else 3
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_same_step_racer, args=(url, w, steps, barrier, q, 7)) for w in (0, 1)
    ]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in range(2 * steps)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for step in range(steps):
        got = [r for r in results if r[1] == step]
        oks = [r for r in got if r[2] == "ok"]
        assert len(oks) == 1, got
        loser = next(r for r in got if r[2] != "ok")
        assert not loser[2].startswith("UNTYPED"), loser
    store = Store.open(url)
    raw = Raw(url, endpoint)
    scores, steps_seen, ledger = oracle_stats(raw, store.head)
    assert ledger == Counter({s: 1 for s in range(steps)}), ledger
    assert steps_seen == Counter({s: 1 for s in range(steps)}), steps_seen
    assert_stats_match(store, scores)
    assert [rec["step"] for _, rec in store.consumption.lineage(store.head)] == list(range(steps))


# -- helpers: one commit in a process, optionally SIGSTOPped at a point of the protocol -----


def _one_commit(
    url: str, w: int, step: int, go: Any, q: Any, ttl: float, pause: str, paused: Any = None
) -> None:
    store = Store.open(url, lease_ttl_s=ttl)
    if pause:
        from dynstate.log import leases as leases_mod
        from dynstate.log.commits import Log

        target = leases_mod.Leases if pause == "take" else Log
        name = "take" if pause == "take" else "commit"
        original = getattr(target, name)

        def stopped(self: Any, *a: Any, **k: Any) -> Any:
            paused.set()  # synchronous, unlike a Queue's feeder thread
            os.kill(os.getpid(), signal.SIGSTOP)
            return original(self, *a, **k)

        setattr(target, name, stopped)
    head = store.refresh()
    rows = [w, w + 5, w + 9]
    outcomes = [{"row": r, "step": step, "score": float(w)} for r in rows]
    go.wait(timeout=60)
    try:
        v = store.append(
            [{"id": 500_000 + w}] * 50,
            meta={"step": step, "w": w},
            outcomes=outcomes,
            rows_version=head,
            consumption=record_for(step, head, rows),
        )
        q.put(("ok", w, v))
    except DynstateError as exc:
        q.put(("err", w, type(exc).__name__, str(exc)[:300]))
    except BaseException as exc:
        q.put(("UNTYPED", w, repr(exc)[:300]))


def _files_named_exist(raw: Raw) -> list[tuple[int, str]]:
    missing = []
    for v, rec in raw.records().items():
        for e in rec.get("add", []) or []:
            if not raw.exists(e["path"]):
                missing.append((v, e["path"]))
        for path in raw.outcome_files(rec):
            if not raw.exists(path):
                missing.append((v, path))
    return missing


# -- 4. a writer SIGSTOPped past its lease TTL while gc (grace 0) runs --------------------------


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("pause", ["take", "commit"])
def test_writer_stopped_past_lease_ttl_fails_typed_or_lands_whole(
    tmp_path: Path, pause: str
) -> None:
    """Guard: a writer SIGSTOPped (before its lease claim, or after it before the record)
    for 3x its 0.5 s TTL while gc runs with grace 0 and another writer commits; on SIGCONT
    it fails with a typed error or lands whole: no record ever names a deleted file."""
    from dynstate import collect_garbage

    url = str(tmp_path / "store")
    _make_store(url)
    ctx = mp.get_context("spawn")
    go, q, paused = ctx.Barrier(2), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_one_commit, args=(url, 0, 0, go, q, 0.5, pause, paused))
    p.start()
    go.wait(timeout=60)
    assert paused.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _proc_state(p.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.5)  # three TTLs without renewal
    result = collect_garbage(Store.open(url), grace_s=0, dry_run=False)
    # another writer commits meanwhile, so a resumed commit must rebase
    Store.open(url).append([{"id": 7}])
    os.kill(p.pid, signal.SIGCONT)
    p.join(timeout=30)
    assert p.exitcode == 0
    outcome = q.get(timeout=10)
    assert outcome[0] in ("ok", "err"), (outcome, result.removed)
    raw = Raw(url)
    missing = _files_named_exist(raw)
    assert not missing, (outcome, missing, result.removed)
    store = Store.open(url)
    store.snapshot().to_arrow()
    store.outcome_stats()
