"""Hostile inputs to the staging path (``Store.stage`` / ``commit_staged`` / ``discard`` and
``dynstate.ray.commit_round``), ``to_ray_dataset`` and ``export``.

A ``Staged`` part travels between processes (Ray pickles it from a task to the driver), so
every field of it is input the committing process must check: SPEC §3.9 ("tampered manifests
(checksums), paths escaping the store root ... each raises a typed error ... and leaves the
store as it was"), §3.10 ("never anything outside the store root") and docs/ray.md ("nothing
wrong is ever committed"). Each test below but the marked guards FAILS on the current code;
its comment says what is wrong and what is expected.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynstate import DynstateError, Store, export
from dynstate.ray import commit_round


def _store(tmp_path, name: str = "store") -> tuple[str, Store]:
    url = str(tmp_path / name)
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(3)])
    return url, store


def _over_the_wire(part):
    """What a Ray driver holds: the part pickled by its task and unpickled here."""
    return pickle.loads(pickle.dumps(part))


def _listing(root: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if "/_dynstate/leases/" in path:
                continue  # lease bookkeeping may legitimately change on a refusal
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def _head_ids(url: str) -> list[int]:
    return Store.open(url).snapshot().to_arrow().column("id").to_pylist()


# -- a part's rows must land at most once ------------------------------------------------------


def test_a_committed_part_replayed_without_its_lease_duplicates_its_rows(tmp_path) -> None:
    """DEFECT: a part whose ``lease`` is None (what ``Staged.__setstate__`` gives a pickle of a
    dynstate before leases, or a part edited on the wire) is checked only for its files
    existing (``Writer._check_unleased``). A part that was already committed passes that check,
    so committing it again — directly or through ``commit_round`` — lists its shards a second
    time: its rows appear twice in the head. Expected (SPEC §3.2 "each land exactly once",
    api.md ``CommitConflictError``: "staged parts committed by another call"): a typed error,
    and the store unchanged. Fix: ``dynstate/writes.py:Writer._check_parts`` — refuse a shard
    that the parent's lineage already lists (or refuse unleased parts with shards)."""
    url, store = _store(tmp_path)
    part = store.stage([{"id": 10}, {"id": 11}])
    assert store.commit_staged([part]) == 2
    replay = dataclasses.replace(_over_the_wire(part), lease=None)
    with pytest.raises(DynstateError):
        store.commit_staged([replay])
    with pytest.raises(DynstateError):
        commit_round(url, [replay])  # the Ray driver's path: same hole
    assert Store.open(url).head == 2
    assert _head_ids(url) == [0, 1, 2, 10, 11]


def test_a_part_naming_an_already_committed_shard_duplicates_rows(tmp_path) -> None:
    """DEFECT: ``commit_staged`` never checks that a part's shard paths belong to the part's
    own lease (shard names are ``data/<lease>-<uuid>.parquet``, docs/format.md) nor that they
    are not already in the lineage. A part edited to also list a shard committed in version 1
    is committed: version 1's rows appear twice at the head. Expected: a typed error (the shard
    is not this part's), store unchanged. Fix: ``dynstate/writes.py:Writer._check_parts``
    (``paths.lease_of(shard.path) == part.lease``)."""
    url, store = _store(tmp_path)
    committed = store.snapshot().shards[0]
    part = _over_the_wire(store.stage([{"id": 10}]))
    forged = dataclasses.replace(part, shards=(*part.shards, committed))
    with pytest.raises(DynstateError):
        store.commit_staged([forged])
    assert Store.open(url).head == 1
    assert _head_ids(url) == [0, 1, 2]


# -- paths outside the store root ------------------------------------------------------------


def _escaping(store: Store, rel: str):
    part = _over_the_wire(store.stage([{"id": 10}]))
    return dataclasses.replace(part, shards=(part.shards[0]._replace(path=rel),))


def test_a_part_naming_a_shard_outside_the_store_is_committed(tmp_path) -> None:
    """DEFECT: a part whose shard path is ``../outside.parquet`` is committed; the new head's
    record names a file outside the store, so every read of the head now raises
    ``UnsafePathError`` — the store was broken by a commit that should have been refused.
    Expected (SPEC §3.9, ray.md "nothing wrong is ever committed"): ``commit_staged`` raises a
    typed error (``UnsafePathError``) and the head stays at version 1. Fix:
    ``dynstate/writes.py:Writer._check_parts`` — ``paths.is_shard_reference`` on every path,
    as ``ShardRef.checked`` does on read."""
    url, store = _store(tmp_path)
    (tmp_path / "outside.parquet").write_bytes(b"not yours")
    with pytest.raises(DynstateError):
        store.commit_staged([_escaping(store, "../outside.parquet")])
    assert Store.open(url).head == 1
    assert _head_ids(url) == [0, 1, 2]


def test_discard_of_a_tampered_part_deletes_a_file_outside_the_store(tmp_path) -> None:
    """DEFECT (data loss outside the store): ``Store.discard`` removes every path a part lists,
    unchecked (``Writer._discard`` -> ``Storage.delete``). A part whose shard path is
    ``../victim.parquet`` makes it delete ``victim.parquet`` next to the store. Expected (SPEC
    §3.9/§3.10: nothing outside the store root is ever touched): a typed error, the file kept.
    Fix: ``dynstate/writes.py:Writer._discard`` / ``_remove`` (and ideally the storage's
    ``delete``) — refuse paths that are not ``paths.is_shard_reference``."""
    _url, store = _store(tmp_path)
    victim = tmp_path / "victim.parquet"
    victim.write_bytes(b"precious")
    try:
        store.discard([_escaping(store, "../victim.parquet")])
    except DynstateError:
        pass  # a refusal is fine; deleting the file is not
    assert victim.exists(), "discard deleted a file outside the store root"


def test_a_refused_commit_of_a_tampered_part_deletes_a_file_outside_the_store(tmp_path) -> None:
    """DEFECT (data loss outside the store): a commit refused for any reason (here bad meta)
    cleans up by removing the part's listed paths (``Writer._resolve_failed_commit`` ->
    ``_discard``), so a part listing ``../victim.parquet`` deletes that file. Expected: the
    refusal names the problem and nothing outside the store is touched. Fix:
    ``dynstate/writes.py:Writer._check_parts`` (refuse before anything) and ``_discard``."""
    url, store = _store(tmp_path)
    victim = tmp_path / "victim.parquet"
    victim.write_bytes(b"precious")
    with pytest.raises(DynstateError):
        store.commit_staged([_escaping(store, "../victim.parquet")], meta={"x": object()})
    assert victim.exists(), "a refused commit deleted a file outside the store root"
    assert Store.open(url).head == 1


@pytest.mark.parametrize("action", ["commit_staged", "discard"])
def test_a_tampered_lease_id_writes_and_deletes_files_outside_the_store(tmp_path, action) -> None:
    """DEFECT: a part's ``lease`` is used unchecked to build ``_dynstate/leases/<lease>.json``,
    ``<lease>.outcome.json`` and holder files. With lease ``../../../victim`` (and a file
    ``victim.json`` beside the store), ``commit_staged`` *succeeds* — it adopts and claims the
    "lease" ``victim.json``, creates ``victim.<holder>.json`` and ``victim.outcome.json`` beside
    the store, commits, then "ends the lease" by deleting ``victim.json``; ``discard`` likewise
    creates ``victim.outcome.json`` and deletes ``victim.json``. Expected (SPEC §3.9/§3.10): a
    lease that is not a lease id (32 hex, as ``paths.match_lease`` demands) is refused with a
    typed error, the head unchanged, nothing outside the store root created or removed. Fix:
    ``dynstate/writes.py:Writer._check_parts`` and ``_discard`` (and ``paths.lease_path`` /
    ``claim_path`` / ``holder_path`` in ``dynstate/paths.py`` refusing a non-id)."""
    url, store = _store(tmp_path)
    victim = tmp_path / "victim.json"
    victim.write_text("precious")
    before = sorted(os.listdir(tmp_path))
    part = _over_the_wire(store.stage([{"id": 10}]))
    forged = dataclasses.replace(part, lease="../../../victim")
    refused = None
    try:
        getattr(store, action)([forged])
    except DynstateError as exc:
        refused = exc
    assert victim.exists(), "a tampered lease id deleted a file outside the store root"
    assert sorted(os.listdir(tmp_path)) == before, "files were created outside the store root"
    assert Store.open(url).head == 1
    assert refused is not None, "a part with a lease that is no lease id was accepted"


# -- fields a commit trusts --------------------------------------------------------------------


# -- empty parts -------------------------------------------------------------------------------


def test_an_empty_part_staged_before_a_new_column_does_not_sink_the_round(tmp_path) -> None:
    """DEFECT (lesser): a part with no rows carries the schema of the head it was staged at.
    If another writer adds a column (``allow_new_columns``) before the other parts are staged,
    ``commit_staged([empty, part])`` is refused with "staged parts ... have different schemas;
    stage every part of a round with the same columns" — though the empty part has no shard to
    mean anything under either schema — and the refusal removes the non-empty part's shards
    (the Ray task's work is lost). Expected: parts without shards take no part in the schema
    check (a Ray task that generated nothing must not fail the round). Fix:
    ``dynstate/writes.py:Writer.commit_staged`` (``prepare``: collect schemas only from parts
    with shards)."""
    url, store = _store(tmp_path)
    empty = _over_the_wire(store.stage([]))
    other = Store.open(url)
    other.append([{"id": 3, "x": "new"}], allow_new_columns=True)
    part = _over_the_wire(store.stage([{"id": 4, "x": "r"}]))
    assert store.commit_staged([empty, part]) == 3
    assert _head_ids(url) == [0, 1, 2, 3, 4]


# -- export ------------------------------------------------------------------------------------


def test_datasets_export_of_a_column_datasets_cannot_hold_is_not_a_storage_error(tmp_path):
    """DEFECT (lesser): a ``map<string, int64>`` column (Arrow holds it, the store takes it,
    Parquet export round-trips it) cannot be held by ``datasets``. ``export(fmt="datasets")``
    then raises ``StorageError``: "could not write OUT: ...; check that the location is
    reachable and retry" — a storage failure that retrying will never fix. Expected (api.md:
    ``InvalidDataError`` for "input Arrow cannot hold, or a wrong argument";
    ``StorageError`` only when "the filesystem or object store failed"): an
    ``InvalidDataError`` naming the column and suggesting ``--format parquet``, nothing left at
    OUT. Fix: ``dynstate/maintenance/export.py:_write_datasets`` (check
    ``datasets.Features.from_arrow_schema`` before writing; do not route the conversion
    through ``where.call``)."""
    from dynstate import InvalidDataError

    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append(pa.table({"m": pa.array([[("k", 1)], None], pa.map_(pa.string(), pa.int64()))}))
    out = tmp_path / "out.ds"
    with pytest.raises(InvalidDataError):
        export(store.snapshot(), str(out), fmt="datasets")
    assert not out.exists()
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


def _oracle(store: Store, version) -> pa.Table:
    """The version's shards read whole with pyarrow, in manifest order, put under the
    version's schema (columns a shard predates are nulls)."""
    snap = store.snapshot(version)
    schema = snap.schema
    tables = []
    for shard in snap.shards:
        t = pq.read_table(os.path.join(store.url.removeprefix("file://"), shard.path))
        cols = [
            t.column(f.name).cast(f.type)
            if f.name in t.column_names
            else pa.nulls(t.num_rows, f.type)
            for f in schema
        ]
        tables.append(pa.table(cols, schema=schema))
    return pa.concat_tables(tables) if tables else schema.empty_table()


def test_guard_cli_export_of_a_tag_equals_the_oracle_and_a_refusal_changes_nothing(tmp_path):
    """GUARD (holds today): `dynstate export URL TAG OUT` through the installed console script
    writes the tagged version's rows in order (a column added later is null in older rows);
    an export into the store is refused with exit 1 and leaves every store file as it was."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append(pa.table({"id": [1, 2], "f": [float("nan"), 2.5]}), shard_bytes=8)
    store.append(pa.table({"id": [3], "f": [None], "tz": pa.array([5], pa.timestamp("ns", "UTC"))}),
                 allow_new_columns=True)  # fmt: skip
    store.tag("t", 2)
    store.append(pa.table({"id": [4], "f": [1.0], "tz": pa.array([6], pa.timestamp("ns", "UTC"))}))
    exe = os.path.join(os.path.dirname(sys.executable), "dynstate")
    out = tmp_path / "out.parquet"
    done = subprocess.run([exe, "export", url, "t", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got, want = pq.read_table(out), _oracle(store, "t")
    assert got.schema.equals(want.schema)
    assert got.column("id").to_pylist() == [1, 2, 3]
    assert got.column("tz").equals(want.column("tz"))
    assert got.column("f").to_pylist()[1:] == [2.5, None]
    before = _listing(url)
    refused = subprocess.run(
        [exe, "export", url, os.path.join(url, "data", "x.parquet"), "--overwrite", "--yes"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1 and "inside the store" in refused.stderr
    assert _listing(url) == before


def test_guard_to_ray_dataset_equals_the_oracle(tmp_path) -> None:
    """GUARD (holds today): ``to_ray_dataset`` gives exactly the oracle's rows and schema for
    the head (many shards, a column added later read as nulls), a tag, and a 0-row version."""
    ray = pytest.importorskip("ray")
    from dynstate.ray import to_ray_dataset

    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append(pa.table({"id": pa.array([], pa.int64())}))  # version 1: 0 rows
    store.append(pa.table({"id": list(range(40))}), shard_bytes=64)
    store.tag("t", 2)
    store.append(
        pa.table({"id": [99], "d": pa.array(["q"]).dictionary_encode()}), allow_new_columns=True
    )
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        for version in (None, "t"):
            blocks = ray.get(to_ray_dataset(url, version).to_arrow_refs())
            got = pa.concat_tables(blocks)
            want = _oracle(store, store.resolve(version))
            assert got.equals(want), version
        assert to_ray_dataset(url, 1).count() == 0
    finally:
        if started:
            ray.shutdown()
