"""Ages are judged by the storage's clock, and a part taken over is kept while its taker
lives (issue 19, points 3 and 6).

gc runs in a process whose wall clock is shifted by hours (``time.time`` and
``datetime.now`` monkeypatched before dynstate is imported, ``tools/soak_chaos.py``), writers
are paused with SIGSTOP or killed with SIGKILL at the instants named, on a local disk and on
the loopback S3 server. Every acknowledged version must read back."""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from dynstate import Store, VersionCollectedError
from dynstate.log.leases import LEASE_DIR, outcome_path
from dynstate.maintenance.gc import TOMBSTONE_S, collect_garbage
from dynstate.maintenance.verify import verify_store
from dynstate.records import manifest as m

TOOLS = str(Path(__file__).resolve().parent.parent / "tools")
HOUR = 3600.0

SKEWED_GC = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from soak_chaos import shift_clock
    shift_clock(float(sys.argv[3]))
    from dynstate import Store
    from dynstate.maintenance.gc import collect_garbage
    options = json.loads(sys.argv[4])
    ahead_s = options.pop("ahead_s", None)
    store = Store.open(sys.argv[2])
    clock = None if ahead_s is None else (lambda: store.storage.now() + ahead_s)
    result = collect_garbage(store, **options, dry_run=False, clock=clock)
    print(json.dumps(result.to_json()))
    """
)


def skewed_gc(url: str, skew_s: float, **options: object) -> dict:
    """A deleting ``collect_garbage(store, **options)`` in a process whose clock is ``skew_s``
    off (the host's: ``time.time``). ``ahead_s`` runs gc's reading of the storage's clock
    that much ahead instead, as if that time had passed with nobody renewing a lease."""
    proc = subprocess.run(
        [sys.executable, "-c", SKEWED_GC, TOOLS, url, str(skew_s), json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def ahead(url: str, seconds: float) -> Callable[[], float]:
    """The storage's clock run ``seconds`` ahead: gc judges every age as it will be then, had
    nobody renewed a lease meanwhile (instead of sleeping that long)."""
    storage = Store.open(url).storage

    def now() -> float:
        reading = storage.now()
        assert reading is not None, f"{url} keeps no modification times"
        return reading + seconds

    return now


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 60
    while not stopped(pid):
        assert time.monotonic() < deadline, "the writer never paused"
        time.sleep(0.01)


def readable(url: str, version: int, rows: list[dict]) -> None:
    store = Store.open(url)
    table = store.snapshot(version).to_arrow().to_pylist()
    assert table[len(table) - len(rows) :] == rows
    report = verify_store(store, all_versions=True)
    assert report.ok, report.problems


def test_the_storage_clock_is_the_storages_and_leaves_no_probe(store_url: str) -> None:
    store = Store.open(store_url, create=True)
    before = time.time()
    now = store.storage.now()
    # Same machine here, so the storage's clock and ours agree up to its stamps' resolution.
    assert now is not None
    assert before - 1 - store.storage.clock_resolution_s <= now <= time.time() + 1
    assert store.storage.list("_dynstate/probe") == []


def test_gc_ahead_keeps_a_live_lease(durable_url: str) -> None:
    """The old gc compared the lease file's time (the storage's clock) with its own: 2 h
    ahead, every live lease looked expired and the writer's commit was refused."""
    Store.open(durable_url, create=True)
    writer = Store.open(durable_url, lease_ttl_s=2.0)
    part = writer.stage([{"id": i} for i in range(10)])
    result = skewed_gc(durable_url, 2 * HOUR, grace_s=0)
    assert result["kept_leased"] == len(part.shards) and result["removed"] == []
    assert not writer.storage.exists(outcome_path(part.lease))
    assert writer.commit_staged([part]) == 1
    readable(durable_url, 1, [{"id": i} for i in range(10)])


PAUSE_AFTER_CLAIM = textwrap.dedent(
    """
    import json, os, signal, sys
    from dynstate import Store
    from dynstate.log.leases import Leases

    claim = Leases.claim

    def claim_then_pause(self, leases, nonce, outcome="commit", **kwargs):
        claim(self, leases, nonce, outcome, **kwargs)
        if outcome == "commit":
            print("claimed", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)  # paused between its claim and its record

    Leases.claim = claim_then_pause
    store = Store.open(sys.argv[1], lease_ttl_s=0.5)
    version = store.append([{"id": i, "text": "x" * 50} for i in range(20)], shard_bytes=300)
    print(json.dumps({"version": version}), flush=True)
    """
)


@pytest.mark.parametrize("grace_s", [0.0, 3600.0])
def test_gc_ahead_never_removes_a_paused_committers_shards(durable_url: str, grace_s) -> None:
    """An appender paused (SIGSTOP) between its claim and its record, past its lease; gc's
    clock is 2 h ahead. The old gc saw the claim as over an hour old and removed the round's
    shards; the record then landed and the acknowledged version was unreadable."""
    store = Store.open(durable_url, create=True)
    store.append([{"id": -1, "text": ""}])
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSE_AFTER_CLAIM, durable_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "claimed"
        wait_stopped(proc.pid)
        # 5 s on by the storage's clock: past its 0.5 s lease, which it no longer renews.
        result = skewed_gc(durable_url, 2 * HOUR, grace_s=grace_s, ahead_s=5.0)
        assert not [r for r in result["removed"] if r["path"].startswith("data/")]
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    version = json.loads(out.splitlines()[-1])["version"]
    assert version == 2
    readable(durable_url, 2, [{"id": i, "text": "x" * 50} for i in range(20)])


def test_a_committer_paused_after_its_claim_keeps_its_shards_however_long(
    durable_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same pause, longer than the stale-claim period (shortened here to 1 s, as if the
    writer had been stopped for over an hour): a committer of gc's machine whose process
    exists keeps its shards for as long as it lives."""
    import dynstate.maintenance.gc as gc_module

    store = Store.open(durable_url, create=True)
    store.append([{"id": -1, "text": ""}])
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSE_AFTER_CLAIM, durable_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "claimed"
        wait_stopped(proc.pid)
        monkeypatch.setattr(gc_module, "STALE_CLAIM_S", 1.0)
        # 10 s on by gc's clock: past its lease and past the (shortened) stale-claim period.
        result = collect_garbage(Store.open(durable_url), grace_s=0, dry_run=False,
                                 clock=ahead(durable_url, 10.0))  # fmt: skip
        assert not [r for r in result.removed if r.path.startswith("data/")]
        assert result.kept_leased > 0
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.splitlines()[-1])["version"] == 2
    readable(durable_url, 2, [{"id": i, "text": "x" * 50} for i in range(20)])


def test_gc_ahead_keeps_young_orphans_and_tombstones(durable_url: str) -> None:
    """gc's clock 8 days ahead: an orphan written just now is younger than the grace period
    and the busy time, and a tombstone younger than a week, by the storage's clock."""
    store = Store.open(durable_url, create=True)
    part = store.stage([{"id": 1}])
    assert store.commit_staged([part]) == 1  # leaves its outcome as a tombstone
    orphans = [f"data/{uuid.uuid4().hex}.parquet", f"{m.META_DIR}/schemas/{'e' * 64}.json"]
    for rel in orphans:
        store.storage.put(rel, b"a writer's work in progress")
    result = skewed_gc(durable_url, TOMBSTONE_S + 86400, grace_s=HOUR)
    assert result["removed"] == [] and result["kept_young"] == 2
    assert all(store.storage.exists(rel) for rel in orphans)
    assert store.storage.exists(outcome_path(part.lease))
    # By the storage's clock they are young at grace 0 too, except what only the grace holds.
    result = skewed_gc(durable_url, TOMBSTONE_S + 86400, grace_s=0)
    assert [r["path"] for r in result["removed"]] == orphans[:1]
    assert store.storage.exists(outcome_path(part.lease))
    readable(durable_url, 1, [{"id": 1}])


APPEND_SKEWED = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from soak_chaos import shift_clock
    shift_clock(float(sys.argv[3]))
    from dynstate import Store
    store = Store.open(sys.argv[2])
    print(json.dumps([store.append([{"id": i}]) for i in range(int(sys.argv[4]))]))
    """
)


def append_skewed(url: str, skew_s: float, rounds: int) -> list[int]:
    proc = subprocess.run(
        [sys.executable, "-c", APPEND_SKEWED, TOOLS, url, str(skew_s), str(rounds)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_older_than_judges_versions_by_the_storages_clock(durable_url: str) -> None:
    """A writer whose clock is 2 h behind writes `created` 2 h in the past; the old
    `gc --older-than 1h` collected its versions a moment after they were acknowledged."""
    Store.open(durable_url, create=True)
    behind = append_skewed(durable_url, -2 * HOUR, 3)
    assert behind == [1, 2, 3]
    assert Store.open(durable_url).commit_record(1).created < m.utc_now()[:13]  # 2 h "ago"
    result = collect_garbage(Store.open(durable_url), older_than_s=HOUR, grace_s=0, dry_run=False)
    assert result.floor_after == 0 and result.versions_collected == []
    # And from a gc host 2 h ahead, the same.
    assert skewed_gc(durable_url, 2 * HOUR, older_than_s=HOUR, grace_s=0)["floor_after"] == 0
    # Ages do count, by the storage's clock: after a pause (just past the resolution of its
    # stamps) a writer 2 h ahead appends one more; gc 2 s after the pause began, by the
    # storage's clock, finds only the versions from before it older than 2 s.
    store = Store.open(durable_url)
    time.sleep(store.storage.clock_resolution_s + 0.05)
    pause = store.storage.now()
    assert pause is not None
    assert append_skewed(durable_url, 2 * HOUR, 1) == [4]
    result = collect_garbage(store, older_than_s=2.0, grace_s=0, dry_run=False,
                             clock=lambda: pause + 2.0)  # fmt: skip
    assert result.floor_after == 4
    for version in behind:
        with pytest.raises(VersionCollectedError):
            Store.open(durable_url).snapshot(version)
    readable(durable_url, 4, [{"id": 0}])


STAGE_HAND_OVER_DIE = textwrap.dedent(
    """
    import base64, os, pickle, signal, sys
    from dynstate import Store
    store = Store.open(sys.argv[1], lease_ttl_s=float(sys.argv[2]))
    part = store.stage([{"id": i} for i in range(10)])
    print(base64.b64encode(pickle.dumps(part)).decode(), flush=True)
    sys.stdin.readline()  # the receiver has unpickled it (and so taken the lease over)
    store.log.leases.renew(part.lease)  # the stager's own heartbeat renewal ...
    os.kill(os.getpid(), signal.SIGKILL)  # ... and it dies right after
    """
)


def test_a_part_taken_over_survives_its_stager_dying_after_its_renewal(durable_url: str):
    """The stager hands its part over (this process unpickles it, taking the lease over),
    renews its lease once more and is SIGKILLed. The old lease file then named the dead
    stager, gc on this machine expired the lease at once, and the commit of the live taker
    got LeaseExpiredError. Each holder now renews a file of its own."""
    Store.open(durable_url, create=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", STAGE_HAND_OVER_DIE, durable_url, "2.0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        part = pickle.loads(base64.b64decode(proc.stdout.readline()))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    store = Store.open(durable_url, lease_ttl_s=2.0)
    # At once, and after the stager's lease ran out (2 s) in real time: what keeps the shards
    # is the taker's heartbeat, which renews by the real clock.
    for wait in (0.0, 1.2, 1.2):
        time.sleep(wait)
        result = collect_garbage(store, grace_s=0, dry_run=False)
        assert result.kept_leased == len(part.shards) and result.removed == []
    assert store.commit_staged([part]) == 1
    readable(durable_url, 1, [{"id": i} for i in range(10)])
    # The taker's holder files go with the lease once they are no longer renewed: a minute
    # on by gc's clock.
    collect_garbage(store, grace_s=0, dry_run=False, clock=ahead(durable_url, 60.0))
    names = store.storage.list(LEASE_DIR)
    assert names == [f"{part.lease}.outcome.json"], names


TAKE_OVER_AND_PAUSE = textwrap.dedent(
    """
    import base64, os, pickle, signal, sys
    from dynstate import LeaseExpiredError, Store
    part = pickle.loads(base64.b64decode(sys.stdin.readline()))  # takes the lease over
    print("adopted", flush=True)
    sys.stdin.readline()
    try:
        print("committed", Store.open(sys.argv[1]).commit_staged([part]), flush=True)
    except LeaseExpiredError as exc:
        print("expired", exc, flush=True)
    """
)


def test_a_taker_paused_past_the_lease_is_refused_not_committed_broken(durable_url: str):
    """The other side: the stager exits, the process that took its part over is paused
    (SIGSTOP) past the lease. gc expires the lease (nobody renews it) and the taker's commit
    is refused once it resumes — a lost round, never a version naming removed shards."""
    store = Store.open(durable_url, create=True)
    stager = subprocess.Popen(
        [sys.executable, "-c", STAGE_HAND_OVER_DIE, durable_url, "0.5"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    taker = subprocess.Popen(
        [sys.executable, "-c", TAKE_OVER_AND_PAUSE, durable_url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        taker.stdin.write(stager.stdout.readline())
        taker.stdin.flush()
        assert taker.stdout.readline().strip() == "adopted"
        stager.communicate("go\n", timeout=60)
        os.kill(taker.pid, signal.SIGSTOP)
        wait_stopped(taker.pid)
        # 5 s on by gc's clock: past the 0.5 s lease nobody renews.
        result = collect_garbage(store, grace_s=0, dry_run=False, clock=ahead(durable_url, 5.0))
        assert any(r.path.startswith("data/") for r in result.removed)
        os.kill(taker.pid, signal.SIGCONT)
        out, _ = taker.communicate("go\n", timeout=120)
    finally:
        for proc in (stager, taker):
            if proc.poll() is None:
                proc.kill()
    assert out.startswith("expired") and "stage the round again" in out, out
    assert Store.open(durable_url).head == 0
    assert verify_store(Store.open(durable_url), all_versions=True).ok


@pytest.mark.slow
def test_everything_at_once_loses_no_acknowledged_version(tmp_path: Path) -> None:
    """A 20 s share of tools/soak_chaos.py on a local disk: appenders, stagers handing parts
    to committer processes, a compactor, a resetter, gc at grace 0 with its clock 2 h off,
    random SIGKILLs and SIGSTOPs; rounds commit outcomes and generator states. Every
    acknowledged version reads back, its outcomes too, right after its ack and at the end."""
    sys.path.insert(0, TOOLS)
    import soak_chaos

    summary = soak_chaos.soak(20, seed=19, workdir=tmp_path)
    assert summary["problems"] == [], json.dumps(summary, indent=1)
    assert summary["acknowledged"] >= 20 and summary["sigkills"] >= 3, summary
    assert summary["gc_runs"] >= 3 and summary["acknowledged_by_kind"].get("round"), summary
    assert summary["checked_at_end"] == summary["acknowledged"]
    # Appenders and committers record outcomes and generator states with their rounds: each
    # acknowledged round's outcomes were checked, and the statistics against the raw records.
    assert summary["outcome_files_at_head"] >= 5 and summary["statistics_checked"] >= 1, summary
