"""Garbage collection (`dynstate gc`, dynstate.maintenance.gc): after SIGKILLed writers it removes
exactly the orphans; retention never touches the head, tagged versions or shards a kept
version still lists; an interrupted gc is finished by the next one."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import fsspec
import pytest
from click.testing import CliRunner

from dynstate import InvalidDataError, Store, VersionCollectedError
from dynstate.cli import cli
from dynstate.maintenance.gc import collect_garbage, parse_duration
from dynstate.records import manifest as m

WRITER = textwrap.dedent(
    """
    import sys
    from dynstate import Store
    url, mode, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = Store.open(url, create=True)
    if mode == "stage":
        store.stage([{"id": -1, "text": "never committed"}] * 50)
        print("ready", flush=True)
        sys.stdin.read()  # wait to be killed with the round staged but not committed
    print("ready", flush=True)
    i = 0
    while True:
        rows = [{"id": seed * 10**6 + i * 100 + j, "text": "x" * 200} for j in range(60)]
        store.append(rows, meta={"step": i}, shard_bytes=2000)  # several shards per round
        i += 1
    """
)


def gc(*args: str, code: int = 0) -> dict:
    result = CliRunner().invoke(cli, ["gc", *args, "--json", "--yes"], catch_exceptions=False)
    assert result.exit_code == code, (result.stdout, result.stderr)
    return json.loads(result.stdout) if code == 0 else {}


def all_files(url: str) -> set[str]:
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {p[len(root.rstrip("/")) + 1 :] for p in fs.find(root)}


def live_files(url: str) -> set[str]:
    """Every file some kept version needs, computed the slow, obvious way: each version's
    materialized shard list, and the metadata that names them."""
    store = Store.open(url)
    versions = store.versions()
    floor = versions[0].version
    live = {m.STORE_FILE, m.HEAD_HINT, m.GC_FILE}
    live |= {m.tag_path(name) for name in store.tags()}
    fs, root = fsspec.core.url_to_fs(url)
    for record in versions:
        live.add(m.log_path(record.version))
        live |= {s.path for s in store.snapshot(record.version).shards}
        if record.schema is not None:
            live.add(m.schema_path(record.schema))
        if record.base is not None:
            live |= {m.chunk_path(c) for c in record.base.chunks}
    for rel in [f for f in all_files(url) if f.startswith(f"{m.META_DIR}/checkpoints/")]:
        version = int(rel.rsplit("/", 1)[1].split(".")[0])
        if version >= floor:
            live.add(rel)
            obj = json.loads(fs.cat_file(f"{root}/{rel}"))
            live |= {m.chunk_path(c) for c in obj["shards"]["chunks"]}
    return live


def kill_writers(url: str, rng: random.Random, rounds: int = 3) -> None:
    modes = ["stage"] + ["append"] * rounds
    for seed, mode in enumerate(modes):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, url, mode, str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout.readline().strip() == "ready"
            if mode == "append":
                # Let it commit a few rounds, then kill it at a random instant.
                target = Store.open(url).head + rng.randint(1, 3)
                while Store.open(url).head < target:
                    time.sleep(0.02)
                time.sleep(rng.uniform(0, 0.05))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            proc.stdin.close()


def leftovers(url: str) -> set[str]:
    """Files gc rightly leaves although no version needs them: tombstones of ended leases
    (kept a week) and temporary files a live writer could be using (kept an hour)."""
    return {
        f
        for f in all_files(url) - live_files(url)
        if f.endswith(".outcome.json") or f.rsplit("/", 1)[-1].startswith(".tmp-")
    }


def test_gc_after_killed_writers_removes_exactly_the_orphans(durable_url: str) -> None:
    rng = random.Random(7)
    store = Store.open(durable_url, create=True)
    store.append([{"id": 0, "text": "seed"}])
    store.tag("pinned", 1)
    kill_writers(durable_url, rng)
    before = all_files(durable_url)
    orphans = {f for f in before - live_files(durable_url) if f.startswith("data/")}
    assert orphans  # at least the staged, uncommitted round
    contents = {r.version: Store.open(durable_url).snapshot(r.version).to_arrow()
                for r in Store.open(durable_url).versions()}  # fmt: skip

    young = gc(durable_url)  # default grace period: the shards are all too young to go
    assert not [r for r in young["removed"] if r["path"].startswith("data/")]
    assert young["kept_young"] >= len(orphans) and young["kept_leased"] == 0
    # The killed writers' leases ended (their processes are gone): only lease files went.
    assert all(r["path"].startswith("_dynstate/leases/") for r in young["removed"])
    before = all_files(durable_url)

    dry = gc(durable_url, "--grace", "0", "--dry-run")
    assert {r["path"] for r in dry["removed"] if r["path"].startswith("data/")} == orphans
    assert all_files(durable_url) == before

    done = gc(durable_url, "--grace", "0")
    assert {r["path"] for r in done["removed"]} - leftovers(durable_url) >= orphans
    assert {r["path"] for r in done["removed"] if r["path"].startswith("data/")} == orphans
    assert all(r["reason"] == "orphan" for r in done["removed"])
    assert all_files(durable_url) - leftovers(durable_url) == live_files(durable_url) - {m.GC_FILE}
    assert done["versions_collected"] == []
    reopened = Store.open(durable_url)
    for version, table in contents.items():
        assert reopened.snapshot(version).to_arrow().equals(table)
    assert gc(durable_url, "--grace", "0")["removed"] == []  # nothing left to do
    verify = CliRunner().invoke(cli, ["verify", durable_url, "--all"])
    assert verify.exit_code == 0, verify.stdout

    # Retention after the crashes: the tagged version and everything it needs survive.
    kept = gc(durable_url, "--grace", "0", "--keep", "1")
    assert kept["floor_after"] == 1  # the tag pins version 1
    kept = Store.open(durable_url)
    assert kept.snapshot("pinned").to_arrow().equals(contents[1])
    assert kept.snapshot().to_arrow().equals(contents[max(contents)])


def build_with_reset(url: str) -> Store:
    """1-5 appends, 6 a reset to 2 (its base lists the shards of 1 and 2), 7 an append."""
    store = Store.open(url, create=True)
    for step in range(5):
        store.append([{"id": step * 10 + j, "text": f"s{step}"} for j in range(4)])
    store.reset(2)
    store.append([{"id": 99, "text": "after reset"}])
    return store


def test_keep_collects_old_versions_but_not_shards_a_reset_still_lists(durable_url) -> None:
    store = build_with_reset(durable_url)
    contents = {v: store.snapshot(v).to_arrow() for v in (6, 7)}
    only_old = {s.path for v in (3, 4, 5) for s in store.commit_record(v).add}
    result = gc(durable_url, "--grace", "0", "--keep", "2")
    assert result["versions_collected"] == [0, 1, 2, 3, 4, 5]
    assert result["floor_after"] == 6
    removed = {r["path"] for r in result["removed"]}
    assert {p for p in removed if p.startswith("data/")} == only_old
    assert {m.log_path(v) for v in range(6)} <= removed
    assert all(r["reason"] == "collected" for r in result["removed"])
    assert all_files(durable_url) - leftovers(durable_url) <= live_files(durable_url)
    again = Store.open(durable_url)
    for version, table in contents.items():
        assert again.snapshot(version).to_arrow().equals(table)
    assert [r.version for r in again.versions()] == [6, 7]
    with pytest.raises(VersionCollectedError, match="oldest kept is 6"):
        again.snapshot(3)
    ls = CliRunner().invoke(cli, ["ls", durable_url, "--all", "--json"])
    assert sorted(r["version"] for r in json.loads(ls.stdout)) == [6, 7]
    assert again.append([{"id": 100, "text": "more"}]) == 8  # writing goes on after gc


def test_floor_is_an_append_and_tags_pin_versions(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(6):
        store.append([{"id": step}])
    store.tag("ckpt", 3)
    result = gc(url, "--grace", "0", "--keep", "1")
    assert result["floor_after"] == 3 and result["versions_collected"] == [0, 1, 2]
    again = Store.open(url)
    # Versions 3-6 are appends: 3 is read from the checkpoint gc wrote for it.
    assert again.snapshot("ckpt").to_arrow().column("id").to_pylist() == [0, 1, 2]
    assert again.snapshot().to_arrow().column("id").to_pylist() == list(range(6))
    assert m.checkpoint_path(3) in all_files(url)
    assert CliRunner().invoke(cli, ["verify", url, "--all"]).exit_code == 0
    # Dropping the tag lets the next gc go up to the head, never past it.
    again.untag("ckpt")
    assert gc(url, "--grace", "0", "--older-than", "0s")["floor_after"] == 6
    assert Store.open(url).snapshot().to_arrow().column("id").to_pylist() == list(range(6))


def test_interrupted_gc_is_finished_by_the_next(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(5):
        store.append([{"id": step}])
    # A gc that died right after publishing its floor: records below it are still there.
    store.log.publish_floor(3)
    assert m.log_path(1) in all_files(url)
    assert Store.open(url).snapshot().to_arrow().column("id").to_pylist() == list(range(5))
    result = gc(url, "--grace", "0")
    assert {m.log_path(v) for v in range(3)} <= {r["path"] for r in result["removed"]}
    assert all_files(url) - leftovers(url) <= live_files(url)


def test_memory_store_and_library_result(tmp_path) -> None:
    store = build_with_reset(f"memory://gc-tests/{os.getpid()}-{random.random()}")
    result = collect_garbage(store, keep=1, grace_s=0, dry_run=False)
    assert result.versions_collected == list(range(7))
    assert result.bytes_freed == sum(r.bytes for r in result.removed) > 0
    assert store.snapshot().num_rows == 9


def test_bad_arguments(tmp_path) -> None:
    url = str(tmp_path / "store")
    build_with_reset(url)
    before = all_files(url)
    assert "cannot read duration" in CliRunner().invoke(cli, ["gc", url, "--grace", "soon"]).stderr
    both = CliRunner().invoke(cli, ["gc", url, "--keep", "1", "--older-than", "1d"])
    assert both.exit_code == 2
    assert CliRunner().invoke(cli, ["gc", url, "--keep", "0"]).exit_code == 2
    assert all_files(url) == before
    assert parse_duration("90") == 90 and parse_duration("2h") == 7200
    assert parse_duration("1.5d") == 1.5 * 86400
    with pytest.raises(InvalidDataError, match="7d"):
        parse_duration("-1h")


def store_contents(url: str) -> dict[str, bytes]:
    """Every file of the store with its bytes, read the plain way: os.walk for a local store,
    the storage's own listing (fsspec) for any other."""
    if "://" not in url:
        out = {}
        for folder, _, names in os.walk(url):
            for name in names:
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, url).replace(os.sep, "/")] = f.read()
        return out
    fs, root = fsspec.core.url_to_fs(url)
    return {rel: fs.cat_file(f"{root.rstrip('/')}/{rel}") for rel in all_files(url)}


def test_gc_is_a_dry_run_unless_asked_and_deletes_what_it_planned(durable_url: str) -> None:
    # Garbage of every kind gc removes: a killed writer's staged round (orphan shards and its
    # lease, which only a deleting gc ends) and, with keep=2, collected versions.
    build_with_reset(durable_url)
    kill_writers(durable_url, random.Random(3), rounds=0)
    head = Store.open(durable_url).head
    before = store_contents(durable_url)

    plan = collect_garbage(Store.open(durable_url), keep=2, grace_s=0)  # the default
    again = collect_garbage(Store.open(durable_url), keep=2, grace_s=0, dry_run=True)
    assert plan.dry_run and again.dry_run
    assert store_contents(durable_url) == before  # not a byte written, moved or removed
    assert Store.open(durable_url).versions()[0].version == 0  # the floor did not move
    planned = sorted(r.path for r in plan.removed)
    assert planned == sorted(r.path for r in again.removed)
    assert len(set(planned)) == len(planned)
    assert {p for p in planned if p.startswith("data/")}  # orphan and collected shards
    assert {m.log_path(v) for v in range(head - 1)} <= set(planned)
    assert plan.versions_collected == list(range(head - 1))

    done = collect_garbage(Store.open(durable_url), keep=2, grace_s=0, dry_run=False)
    assert not done.dry_run
    after = store_contents(durable_url)
    # What the listing lost is exactly the plan, and exactly what the deleting call reports.
    assert sorted(set(before) - set(after)) == planned == sorted(r.path for r in done.removed)
    assert done.versions_collected == plan.versions_collected
    assert plan.bytes_freed == done.bytes_freed == sum(len(before[p]) for p in planned)
    # What it added is the bookkeeping of a deleting run only: the floor, the floor's
    # checkpoint and the killed writer's lease ended as "expired" (a tombstone).
    added = set(after) - set(before)
    assert m.GC_FILE in added
    assert {f for f in added if f.endswith(".outcome.json")}
    assert all(
        f in (m.GC_FILE, m.checkpoint_path(head - 1)) or f.endswith(".outcome.json") for f in added
    )
    assert [r.version for r in Store.open(durable_url).versions()] == [head - 1, head]


def test_a_gc_that_cannot_read_the_tags_after_publishing_puts_its_floor_back(
    tmp_path, monkeypatch
) -> None:
    """gc publishes its floor, then reads the tags and intents again (a tag made meanwhile
    lowers it). When that read fails, the floor it published was never confirmed: it is put
    back to the one the gc found, before the error goes on, so a tag made meanwhile never
    names a version the floor calls collected."""
    from dynstate import StorageError
    from dynstate.maintenance import gc as gc_module

    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for i in range(6):
        store.append([{"i": i}])
    tagged = gc_module.tagged
    calls = {"n": 0}

    def failing(store_, floor):
        calls["n"] += 1
        if calls["n"] == 1:
            # a tagger that read the floor before it was published creates its tag now
            tagger = Store.open(url)
            tagger.storage.create(f"{m.META_DIR}/tags/late.json", m.encode({
                "format": m.FORMAT, "version": 2, "created": m.utc_now()
            }))  # fmt: skip
            raise StorageError("listing the tags failed")
        return tagged(store_, floor)

    monkeypatch.setattr(gc_module, "tagged", failing)
    with pytest.raises(StorageError, match="listing the tags"):
        collect_garbage(Store.open(url), keep=2, grace_s=0, dry_run=False)
    reader = Store.open(url)
    assert reader.floor == 0
    assert reader.snapshot("late").to_arrow().to_pylist() == [{"i": 0}, {"i": 1}]
    monkeypatch.setattr(gc_module, "tagged", tagged)
    result = collect_garbage(Store.open(url), keep=2, grace_s=0, dry_run=False)
    assert result.floor_after == 2  # the tag holds it
    assert Store.open(url).snapshot("late").to_arrow().to_pylist() == [{"i": 0}, {"i": 1}]
