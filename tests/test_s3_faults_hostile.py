"""Hostile S3 fault cases (tests/s3_faults.py's proxy) for write paths beyond the commit of a
plain round: (guards) a DynamicSampling step and a staged round
whose commit record lands late. After each case the bucket is read with boto3 directly (the
ORACLE): commit records as JSON, every file they name listed, versions gap-free."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import S3_BUCKET, s3_url
from s3_faults import FaultProxy

from dynstate import (
    CommitConflictError,
    DynamicSampling,
    InvalidDataError,
    StorageError,
    Store,
    VersionedDataset,
    VersionedSampler,
    consumption_records,
)
from dynstate.maintenance.gc import collect_garbage
from dynstate.maintenance.verify import verify_store

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytestmark = pytest.mark.s3


@pytest.fixture
def proxy(s3_endpoint):
    with FaultProxy(s3_endpoint, seed=7) as p:
        yield p


def _store(proxy: FaultProxy, url: str, create: bool = False) -> Store:
    options = {"endpoint_url": proxy.url, "config_kwargs": {"retries": {"max_attempts": 1}}}
    store = Store.open(url, create=create, storage_options=options)
    store.storage.retry_base_s = 0.001
    return store


def _oracle(endpoint: str, url: str) -> tuple[dict[int, dict], set[str], dict[str, int]]:
    """The bucket as boto3 sees it: commit records by version, every key (relative to the
    store), and the rows of every data file (read with pyarrow). Checks versions gap-free and
    every file a record names present."""
    prefix = url.split(f"s3://{S3_BUCKET}/", 1)[1] + "/"
    s3 = boto3.client("s3", endpoint_url=endpoint)
    keys: set[str] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET, Prefix=prefix):
        keys |= {o["Key"][len(prefix) :] for o in page.get("Contents", [])}

    def get(key: str) -> bytes:
        return s3.get_object(Bucket=S3_BUCKET, Key=prefix + key)["Body"].read()

    records = {
        int(k.rsplit("/", 1)[1][:-5]): json.loads(get(k))
        for k in keys
        if k.startswith("_dynstate/log/") and k.endswith(".json")
    }
    floor = min(records)
    assert sorted(records) == list(range(floor, max(records) + 1)), sorted(records)
    rows = {}
    for version, record in records.items():
        for ref in [*record.get("add", []), *((record.get("outcomes") or {}).get("add", []))]:
            assert ref["path"] in keys, f"version {version} names missing {ref['path']}"
            rows[ref["path"]] = pq.read_table(pa.BufferReader(get(ref["path"]))).num_rows
            assert rows[ref["path"]] == ref["rows"]
    return records, keys, rows


# -- a tag PUT that lands after its client gave up --------------------------------------------


def test_a_tag_put_that_lands_after_gc_names_a_kept_version(proxy, s3_endpoint):
    """Every PUT of the tag's file is held, so ``tag`` fails with its outcome unknown; gc
    then runs with keep=1 and grace 0, and only then the held PUT lands. Before tag intents
    the late tag named a collected version (SPEC §3.10: a tag of a collected version is
    refused whatever request lands after its client gave up). Now the intent the tagger
    wrote before its create keeps the version: the tag reads, verify passes, and once the
    intent is old (past INTENT_S by the storage's clock) gc may collect what no tag names."""
    url = s3_url()
    direct = {"endpoint_url": s3_endpoint}
    writer = Store.open(url, create=True, storage_options=direct)
    for i in range(4):
        writer.append([{"id": i}])
    store = _store(proxy, url)
    proxy.hold(method="PUT", path_contains="/_dynstate/tags/")
    with pytest.raises(StorageError):
        store.tag("keep", 1)
    proxy.stop_holding()
    gc_store = Store.open(url, storage_options=direct)
    collect_garbage(gc_store, keep=1, grace_s=0, dry_run=False)
    assert gc_store.floor <= 1, "gc collected the version a tag was being created for"
    assert proxy.release() == 200  # the late PUT lands now
    fresh = Store.open(url, storage_options=direct)
    assert fresh.tags() == {"keep": 1}
    assert fresh.snapshot("keep").to_arrow().column("id").to_pylist() == [0]
    assert verify_store(fresh, all_versions=True).ok
    records, keys, _ = _oracle(s3_endpoint, url)
    assert min(records) <= 1 and any(k.startswith("_dynstate/tag-intents/") for k in keys)


def test_dynamic_sampling_step_whose_record_lands_late_is_committed_once(proxy, s3_endpoint):
    """Guard: every PUT of step 1's record is held; append raises StorageError (unsettled);
    the held PUT then lands. A retry of the same step is refused (InvalidDataError), the next
    step commits, and the oracle finds each step's record, outcomes and round exactly once."""
    from test_consumption import round_rows, score

    url = s3_url()
    direct = {"endpoint_url": s3_endpoint}
    Store.open(url, create=True, storage_options=direct).append([{"id": i} for i in range(40)])
    store = _store(proxy, url)
    dataset = VersionedDataset(url, storage_options=direct)
    dyn = DynamicSampling(
        dataset, VersionedSampler(dataset, seed=0), gen_batch_size=4, train_groups=3
    )
    dyn.resume(None)

    def commit(step: int, batch) -> int:
        return store.append(
            round_rows(step),
            meta={"step": step},
            outcomes=batch.outcomes(),
            rows_version=batch.rows_version,
            consumption=batch.record,
        )

    assert commit(0, dyn.next_batch(0, score)) == 2
    batch = dyn.next_batch(1, score)
    proxy.hold(method="PUT", path_contains="/_dynstate/log/")
    with pytest.raises(StorageError, match="may still reach the store"):
        commit(1, batch)
    proxy.stop_holding()
    assert proxy.release(0) == 200
    with pytest.raises(InvalidDataError, match="already holds the consumption record of step 1"):
        commit(1, batch)
    assert commit(2, dyn.next_batch(2, score)) == 4
    records, _, _ = _oracle(s3_endpoint, url)
    assert [records[v]["meta"].get("step") for v in sorted(records)] == [None, None, 0, 1, 2]
    for v in (2, 3, 4):
        assert records[v]["consumption"]["step"] == v - 2
        assert records[v]["outcomes"]["steps"] == [[v - 2, v - 2]]
    reader = Store.open(url, storage_options=direct)
    assert [c["step"] for c in consumption_records(reader)] == [0, 1, 2]


def test_staged_round_whose_record_lands_late_is_committed_once(proxy, s3_endpoint):
    """Guard: commit_staged's record PUTs are held (StorageError), the held PUT lands, and a
    second commit_staged of the same part is refused naming the version that holds it."""
    url = s3_url()
    store = _store(proxy, url, create=True)
    store.append([{"r": 0}])
    part = store.stage([{"r": 1}, {"r": 2}])
    proxy.hold(method="PUT", path_contains="/_dynstate/log/")
    with pytest.raises(StorageError, match="may still reach the store"):
        store.commit_staged([part])
    proxy.stop_holding()
    assert proxy.release(0) == 200
    with pytest.raises(CommitConflictError, match="already committed as version 2"):
        store.commit_staged([part])
    records, _, rows = _oracle(s3_endpoint, url)
    assert sorted(records) == [0, 1, 2] and sum(rows.values()) == 3
    reader = Store.open(url, storage_options={"endpoint_url": s3_endpoint})
    assert reader.snapshot().to_arrow().column("r").to_pylist() == [0, 1, 2]
