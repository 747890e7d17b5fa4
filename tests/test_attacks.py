"""An attacker's review of the file-name grammar, gc, ranged row-group reads and selection
state: tampered records whose checksums are valid again, names the grammar accepts that are
not files dynstate wrote, and sampler states whose selection part was changed. Each test is
one finding (fixed) or one attack that held.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from typing import Any, ClassVar

import fsspec
import numpy as np
import pyarrow as pa
import pytest
from conftest import s3_url
from fsspec.implementations.memory import MemoryFileSystem
from test_clock_skew import ahead

from dynstate import (
    ChecksumMismatchError,
    CommitConflictError,
    CorruptStoreError,
    Learnability,
    Store,
    VersionedDataset,
    VersionedSampler,
)
from dynstate.errors import DynstateError, StateMismatchError
from dynstate.maintenance.gc import TOMBSTONE_S, collect_garbage
from dynstate.maintenance.verify import verify_store
from dynstate.records import codec
from dynstate.records import manifest as m
from dynstate.records.rowgroups import ROW_GROUP_ROWS
from dynstate.storage import open_storage
from dynstate.storage.credentials import scrub

# Twelve row groups locally (256 each, the last 88; 23 of 128 on object stores): a batch of
# one row reads one of them by range (the cache reads a shard whole once a quarter of its
# groups were asked for).
ROWS = 11 * ROW_GROUP_ROWS + 88


def _store(url: str) -> tuple[Store, str]:
    store = Store.open(url, create=True)
    store.append(pa.table({"id": pa.array(np.arange(ROWS), pa.int64())}))
    return store, url


def _dataset(url: str) -> VersionedDataset:
    return VersionedDataset(url, cache_dir=None)  # nothing cached across the tampering


def _rewrite(store: Store, rel: str, data: bytes) -> None:
    if store.storage.reads_in_place:
        path = store.storage.path(rel)
        os.chmod(path, 0o644)
        with open(path, "wb") as fh:
            fh.write(data)
    else:
        store.storage.put(rel, data)


def _rewrite_record(store: Store, version: int, change) -> None:
    """Change a commit record and give it a valid checksum again: what someone who can write
    the store can do; only what the record itself cannot vouch for is left to the reader."""
    obj = json.loads(store.storage.read(m.log_path(version)))
    change(obj)
    _rewrite(store, m.log_path(version), codec.encode(obj))


# -- ranged reads of a tampered record --------------------------------------------------------


def test_a_record_whose_group_rows_disagree_with_the_footer_is_refused(durable_url):
    store, url = _store(durable_url)

    def move_rows(obj):
        rows = obj["add"][0]["groups"]["rows"]
        rows[0], rows[1] = rows[0] - 56, rows[1] + 56  # same sum, other boundaries

    _rewrite_record(store, 1, move_rows)
    ds = _dataset(url)
    # the whole-shard path ignores the group counts and reads row 210 right ...
    assert Store.open(url).snapshot().to_arrow()["id"][210].as_py() == 210
    # ... a ranged read must not answer another row for it
    try:
        got = ds.read_batch([210])
    except CorruptStoreError as exc:
        assert store.snapshot().shards[0].path in str(exc)
    else:
        assert got == [{"id": 210}], "ranged read returned another row than the one asked"


@pytest.mark.parametrize("shift", [40, -40])
def test_shifted_segments_rehashed_never_decode_unverified_bytes(durable_url, shift):
    """Held: segment boundaries moved and every segment's SHA-256 recomputed for the bytes now
    inside it (hashes valid for other bytes). Only verified bytes enter the decode buffer, so a
    read gives the true row or a CorruptStoreError naming the shard, never another row."""
    store, url = _store(durable_url)
    shard = store.snapshot().shards[0]
    data = store.storage.read(shard.path)

    def shift_bounds(obj):
        groups = obj["add"][0]["groups"]
        sizes = list(groups["bytes"])
        sizes[0] += shift
        sizes[1] -= shift
        bounds = np.cumsum([0, *sizes]).tolist()
        groups["bytes"] = sizes
        groups["sha256"] = "".join(
            hashlib.sha256(data[bounds[i] : bounds[i + 1]]).hexdigest() for i in range(len(sizes))
        )

    _rewrite_record(store, 1, shift_bounds)
    for rows in ([300], [0], [0, 300], [ROWS - 1]):
        ds = _dataset(url)
        try:
            got = ds.read_batch(rows)
        except CorruptStoreError as exc:
            assert shard.path in str(exc)
        else:
            assert got == [{"id": r} for r in rows]


@pytest.mark.usefixtures("decode_what_this_process_wrote")  # a decode must find the byte
@pytest.mark.parametrize("segment", [0, 1, 2, "footer"])
def test_a_flipped_byte_anywhere_is_a_checksum_error_naming_the_shard(durable_url, segment):
    """Held, locally and on S3: one byte flipped in any row group or in the footer is a
    ChecksumMismatchError naming the shard, for a ranged read of any row of the shard."""
    store, url = _store(durable_url)
    shard = store.snapshot().shards[0]
    assert shard.groups is not None
    seg = len(shard.groups.rows) if segment == "footer" else segment
    data = bytearray(store.storage.read(shard.path))
    data[sum(shard.groups.bytes[:seg]) + shard.groups.bytes[seg] // 2] ^= 0x01
    _rewrite(store, shard.path, bytes(data))
    row = 0 if segment == "footer" else sum(shard.groups.rows[:seg])
    with pytest.raises(ChecksumMismatchError, match=shard.path):
        _dataset(url).read_batch([row])
    with pytest.raises(ChecksumMismatchError, match=shard.path):
        _dataset(url).read_batch(list(range(ROWS)))  # every group: the whole-shard path


def test_a_record_naming_another_shards_checksum_never_serves_its_rows(tmp_path):
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append(pa.table({"id": pa.array(np.arange(ROWS), pa.int64())}))
    store.append(pa.table({"id": pa.array(np.arange(ROWS, 2 * ROWS), pa.int64())}))
    first = store.snapshot().shards[0]

    def borrow(obj):
        obj["add"][0]["sha256"] = first.sha256  # the second round's shard "is" the first's

    _rewrite_record(store, 2, borrow)
    ds = _dataset(url)
    assert ds.read_batch([300]) == [{"id": 300}]  # the first shard's group 1, cached
    try:
        got = ds.read_batch([ROWS + 300])
    except (ChecksumMismatchError, CorruptStoreError):
        return
    assert got == [{"id": ROWS + 300}], "another shard's cached rows were served"


# -- gc and names the grammar accepts -------------------------------------------------------


def test_gc_leaves_a_directory_named_like_a_shard_and_finishes(tmp_path):
    """A name paths.match_shard accepts is not enough: a folder under that name is nobody's
    shard. gc reports it as foreign, deletes nothing in it and still collects real orphans
    (it used to stop with 'Is a directory' halfway through its plan)."""
    store, url = _store(str(tmp_path / "s"))
    folder = tmp_path / "s" / m.DATA_DIR / f"{uuid.uuid4().hex}.parquet"
    folder.mkdir()
    (folder / "precious").write_text("not dynstate's")
    os.utime(folder, (1, 1))
    orphan = tmp_path / "s" / m.DATA_DIR / f"{uuid.uuid4().hex}.parquet"
    orphan.write_bytes(b"an interrupted writer's shard")
    os.utime(orphan, (1, 1))
    result = collect_garbage(store, grace_s=0, dry_run=False)
    assert (folder / "precious").read_text() == "not dynstate's"
    assert f"{m.DATA_DIR}/{folder.name}" in result.foreign
    assert f"{m.DATA_DIR}/{orphan.name}" in [r.path for r in result.removed]
    assert not orphan.exists()
    assert Store.open(url).snapshot().num_rows == ROWS


@pytest.mark.s3
def test_gc_on_s3_leaves_objects_under_a_prefix_named_like_a_shard(s3_endpoint):
    """Held: on S3 a 'folder' named like a shard is a prefix of foreign objects; gc at grace
    0 (which judges no age) removes no object under it."""
    url = s3_url()
    store, _ = _store(url)
    fs, root = fsspec.core.url_to_fs(url)
    foreign = f"{root}/{m.DATA_DIR}/{uuid.uuid4().hex}.parquet/precious"
    fs.pipe_file(foreign, b"not dynstate's")
    collect_garbage(store, grace_s=0, dry_run=False)
    fs.invalidate_cache()
    assert fs.cat_file(foreign) == b"not dynstate's"
    assert Store.open(url).snapshot().num_rows == ROWS


def test_two_gcs_with_different_retention_never_leave_a_floor_below_what_they_deleted(tmp_path):
    """Two gc runs at once (cron on two hosts): B (keep 2) publishes floor 9, then A (keep 6,
    planned before B published) publishes floor 5 over it, then B deletes below 9 — the
    floor gc.json names would then lack its checkpoint and the head would not open. The
    interleaving is forced by holding each run at its publish (threads, one handle each);
    a run that finds the floor moved by another gc deletes nothing and says so."""
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    for i in range(10):
        store.append([{"id": i}])
    a, b = Store.open(url), Store.open(url)
    b_published, a_published = threading.Event(), threading.Event()
    publish_a, publish_b = a.log.publish_floor, b.log.publish_floor

    def hold_a(floor, **kwargs):
        assert b_published.wait(60)
        try:
            publish_a(floor, **kwargs)
        finally:
            a_published.set()

    def hold_b(floor, **kwargs):
        publish_b(floor, **kwargs)
        b_published.set()
        assert a_published.wait(60)

    a.log.publish_floor, b.log.publish_floor = hold_a, hold_b  # pause points, not stand-ins
    outcomes: dict[str, object] = {}

    def run(name, handle, keep):
        try:
            outcomes[name] = collect_garbage(
                handle, keep=keep, grace_s=0, dry_run=False
            ).floor_after
        except DynstateError as exc:
            outcomes[name] = exc
        finally:
            b_published.set()
            a_published.set()

    other = threading.Thread(target=run, args=("b", b, 2))
    other.start()
    run("a", a, 6)
    other.join(60)
    refused = [v for v in outcomes.values() if isinstance(v, CommitConflictError)]
    assert all(isinstance(v, (int, CommitConflictError)) for v in outcomes.values()), outcomes
    for exc in refused:
        assert url in str(exc) and "nothing was deleted" in str(exc)
    after = Store.open(url)
    assert after.snapshot().to_arrow()["id"].to_pylist() == list(range(10))
    assert verify_store(after, all_versions=True).ok


# -- sampler states with a tampered selection part ---------------------------------------------


def test_a_tampered_selection_part_is_refused_naming_the_version(tmp_path):
    """The policy a state was saved with is checked against the sampler's, and the refusal
    names the store and the version the state pins (what to resume from) and changes nothing;
    the sampler draws with its own policy, so a state cannot steer it."""
    _, url = _store(str(tmp_path / "s"))
    ds = VersionedDataset(url)
    sampler = VersionedSampler(ds, seed=3, batch_size=4, select=Learnability())
    it = iter(sampler)
    for _ in range(4):
        next(it)
    state = sampler.state_dict()
    before = json.dumps(state, sort_keys=True)
    for tampered in (
        {"policy": "learnability", "params": {**state["select"]["params"], "extra": 1}},
        {"policy": "band", "params": state["select"]["params"]},
        None,
    ):
        fresh = VersionedSampler(VersionedDataset(url), seed=3, batch_size=4,
                                 select=Learnability())  # fmt: skip
        reference = fresh.state_dict()
        with pytest.raises(StateMismatchError, match=rf"version {state['version']}") as err:
            fresh.load_state_dict({**state, "select": tampered})
        assert url in str(err.value)
        assert fresh.state_dict() == reference  # left as it was
    assert json.dumps(state, sort_keys=True) == before


# -- a writer paused past gc's tombstone ---------------------------------------------------------

WOKEN = """
import sys
from dynstate import CommitConflictError, LeaseExpiredError, Store
store = Store.open(sys.argv[1], lease_ttl_s=0.5)
part = store.stage([{"id": i} for i in range(10)])
leases = store.log.leases
real_claim = leases.claim


def claim(*args, **kwargs):
    # The pause point: inside commit_staged, its lease taken as its own, just before the
    # claim (the parent SIGSTOPs the process here).
    print("claiming", flush=True)
    sys.stdin.readline()
    return real_claim(*args, **kwargs)


leases.claim = claim
try:
    print("committed", store.commit_staged([part], meta={"step": 1}), flush=True)
except (LeaseExpiredError, CommitConflictError) as exc:
    print("refused", type(exc).__name__, exc, flush=True)
"""


def test_a_stager_paused_past_its_tombstone_cannot_commit_removed_shards(tmp_path):
    """A real process stages a round and is SIGSTOPped; gc expires its lease and removes its
    shards; a week later (the tombstone's age set back by the storage's own stamps, which is
    all gc judges by) gc removes the tombstone. The process resumes straight into its commit
    : the commit must be
    refused, never a version naming the removed shards (docs/format.md listed this window).
    The pause is inside ``commit_staged``, right before its claim, where the heartbeat cannot
    forget the lease first."""
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"id": -1}])
    proc = subprocess.Popen(
        [sys.executable, "-c", WOKEN, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "claiming"
        os.kill(proc.pid, signal.SIGSTOP)
        # gc's clock 5 s on: past the paused stager's 0.5 s lease, without sleeping for it
        first = collect_garbage(store, grace_s=0, dry_run=False, clock=ahead(url, 5.0))
        assert any(r.path.startswith(m.DATA_DIR + "/") for r in first.removed)
        leases = tmp_path / "s" / m.META_DIR / "leases"
        tombstones = list(leases.glob("*.outcome.json"))
        assert len(tombstones) == 1
        week_ago = time.time() - TOMBSTONE_S - 3600
        os.utime(tombstones[0], (week_ago, week_ago))
        collect_garbage(store, grace_s=0, dry_run=False)
        assert list(leases.iterdir()) == []  # the tombstone went too
        proc.stdin.write("go\n")
        proc.stdin.flush()
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # (the refused commit gives its lease up through a second, discarding claim: "claiming")
    assert "refused LeaseExpiredError" in out and "committed 2" not in out, out
    assert "stage the round again" in out
    after = Store.open(url)
    assert after.head == 1
    assert verify_store(after, all_versions=True).ok


# -- secrets quoted by repr or JSON ------------------------------------------------------------

# A password may hold anything: a backslash and a quote are escaped by repr() and JSON, so the
# text an error carries holds the secret in a form that is not the one given.
ODD_SECRET = "wJalr\\XUtnFEMI/K7MD'ENG+bPx\"RfiCY-é"


class _RaisingFS(MemoryFileSystem):
    """A real fsspec filesystem whose reads fail quoting the secret (as OSError's filename
    and an exception's tuple of args do: by repr)."""

    protocol = "dynstate-attack-raising"
    to_raise: ClassVar[BaseException | None] = None

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> bytes:
        assert _RaisingFS.to_raise is not None
        raise _RaisingFS.to_raise


def _forms_of(secret: str) -> list[str]:
    return [secret, repr(secret)[1:-1], ascii(secret)[1:-1], json.dumps(secret)[1:-1],
            json.dumps(secret, ensure_ascii=False)[1:-1]]  # fmt: skip


@pytest.mark.parametrize(
    "exc",
    [
        OSError(5, "access denied", ODD_SECRET),
        RuntimeError("signing failed", ODD_SECRET),
        KeyError(ODD_SECRET),
        ValueError(json.dumps({"secret": ODD_SECRET})),
    ],
    ids=["oserror-filename", "args-tuple", "keyerror", "json"],
)
def test_a_secret_quoted_by_repr_or_json_is_scrubbed(exc):
    fsspec.register_implementation(_RaisingFS.protocol, _RaisingFS, clobber=True)
    url = f"{_RaisingFS.protocol}://bucket/{uuid.uuid4().hex}"
    storage = open_storage(url, {"secret": ODD_SECRET})
    storage.retry_attempts = 1
    _RaisingFS.to_raise = exc
    with pytest.raises(DynstateError) as info:
        storage.read("_dynstate/store.json")
    shown = "".join(traceback.format_exception(info.value))
    for form in _forms_of(ODD_SECRET):
        assert form not in shown, (form, shown)
    # and what a retry logs: the repr of the exception, and the repr of a message quoting it
    for text in (repr(exc), repr(str(exc)), str(exc)):
        clean = scrub(text, [ODD_SECRET])
        assert not any(form in clean for form in _forms_of(ODD_SECRET)), clean
