"""Hostile cases for the object-store backends (dynstate/storage/: obstore for S3, GCS and
Azure; s3fs where obstore does not serve), met as a plausible user or an unlucky network
would meet them, on the loopback emulators the suite already starts: moto (``s3_server``,
with tests/s3_faults.py's proxy in front where a network fault is needed), fake-gcs-server
and Azurite (tests/emulators.py).

Each test names what must hold (SPEC §3.2, §3.9, §3.11; docs/object-stores.md). Those
before the guards each failed on the code before its fix; their docstrings tell the defect
as it was found."""

from __future__ import annotations

import json
import uuid

import boto3
import emulators
import pytest
from conftest import S3_BUCKET, s3_url
from s3_faults import FaultProxy

from dynstate import Store
from dynstate.errors import DynstateError, InvalidDataError
from dynstate.storage import open_storage

pytest.importorskip("obstore")

fake_gcs = emulators.fake_gcs  # the session's emulators, fixtures
azurite = emulators.azurite


@pytest.fixture
def proxy(s3_endpoint):
    with FaultProxy(s3_endpoint, seed=11) as p:
        yield p


def _boto(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint)


# -- a transient failure met while a lost exclusive create is being handled ------------------


@pytest.mark.s3
def test_a_transient_read_failure_inside_a_lost_create_handler_is_retried(proxy):
    """A read that meets a dropped connection is retried (docs: "dynstate retries whatever
    transient failure still comes through, 5 attempts"), also when the caller is handling a
    lost exclusive create at the time, as the commit loop does (it refreshes the head inside
    ``except FileExistsError``). Here the read's ConnectionError carries the 412 as its
    implicit ``__context__``, the error table walks the context, reads S3's
    ``PreconditionFailed`` there, and the read is neither retried nor reported as a
    connection failure."""
    storage = open_storage(s3_url(), {"endpoint_url": proxy.url})
    storage.retry_base_s = 0.001
    storage.create("taken.json", b"first")
    storage.put("wanted.json", b"payload")
    try:
        storage.create("taken.json", b"second")
    except FileExistsError:
        # more drops than obstore's own retries absorb (5 retries, 6 attempts): the
        # failure reaches dynstate's retry loop, whose next attempt finds the network well
        for _ in range(6):
            proxy.force("drop_request", method="GET", path_contains="wanted.json")
        assert storage.read("wanted.json") == b"payload"
    else:
        raise AssertionError("the second exclusive create did not fail")


@pytest.mark.s3
def test_a_writer_that_lost_a_race_rebases_through_a_flaky_refresh(proxy):
    """SPEC §3.2: a loser of a commit race rebases and retries. Writer B (through the
    proxy) stages its round; meanwhile writer A (straight to the server) commits versions
    1-3, and the head hint lags at 1 as a slow writer's late hint write leaves it (hints are
    advisory). B's record create loses version 1; while B re-reads the head inside the
    commit loop's ``except FileExistsError``, the GETs of records 3 and 4 meet dropped
    connections, more than obstore's own retries absorb: a transient failure dynstate
    retries. B's append fails instead with "the service answered PreconditionFailed ...
    check the URL, the permissions" (the 412 of the lost race, read off the context)."""
    url = s3_url()
    Store.open(url, create=True)
    a = Store.open(url)  # straight to the server, never through the proxy
    b = Store.open(url, storage_options={"endpoint_url": proxy.url})
    b.storage.retry_base_s = 0.001

    def race(kind, method, path):
        if kind != "delay":
            return
        for k in range(3):
            a.append([{"w": f"a{k}"}])
        stale = json.loads(a.storage.read("_dynstate/_head_hint.json"))
        stale["version"] = 1
        a.storage.put("_dynstate/_head_hint.json", json.dumps(stale).encode())

    proxy.delay_s = 0.0
    proxy.on_fault = race  # called under the proxy's lock: A must not go through it
    for name in ("00000000000000000003.json", "00000000000000000004.json"):
        for _ in range(6):  # read by B only after A's commits: in the lost race's handler
            proxy.force("drop_request", method="GET", path_contains=f"log/{name}")
    # B's shard upload comes after its refresh and before its record: A commits there.
    proxy.force("delay", method="PUT", path_contains="/data/")
    assert b.append([{"w": "b"}]) == 4
    rows = Store.open(url).snapshot().to_arrow().to_pylist()
    assert rows == [{"w": "a0"}, {"w": "a1"}, {"w": "a2"}, {"w": "b"}]


# -- URLs whose path is not one plain prefix ----------------------------------------------


@pytest.mark.s3
def test_a_version_id_in_an_s3_url_never_deletes_the_object_it_names(s3_server):
    """SPEC §3.9: bad input gets a typed error and leaves the store (and the bucket) as it
    was. An ``s3://`` URL with a query goes to s3fs, which reads ``?versionId=`` as an object
    version: every file of the store maps to the one key before the ``?`` (here a user's
    model file). The conditional-write probe's create meets that object (412), and its
    ``finally`` then DELETEs the probe name, i.e. the user's object; Store.open raises a raw
    FileExistsError naming no URL."""
    s3 = _boto(s3_server.endpoint)
    key = f"{uuid.uuid4().hex}/model.bin"
    s3.put_object(Bucket=S3_BUCKET, Key=key, Body=b"weights the user cares about")
    err: BaseException | None = None
    try:
        Store.open(f"s3://{S3_BUCKET}/{key}?versionId=3", create=True)
    except Exception as exc:
        err = exc
    left = s3.list_objects_v2(Bucket=S3_BUCKET, Prefix=key).get("Contents", [])
    assert [o["Key"] for o in left] == [key], "dynstate deleted an object outside any store"
    body = s3.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read()
    assert body == b"weights the user cares about"
    assert isinstance(err, DynstateError), repr(err)


@pytest.mark.s3
@pytest.mark.parametrize("middle", ["a/../b", "./b", "a/./b"])
def test_dot_segments_in_an_s3_prefix_are_refused_as_invalid(s3_server, middle):
    """A prefix with a ``.`` or ``..`` segment cannot be one store root on obstore (its
    paths refuse them). It should be refused when opened, as an empty segment is
    (InvalidDataError, "not a store URL"); instead every call fails at the first request
    with StorageError "Could not parse path ...; check that the location is reachable and
    retry", advice that cannot help."""
    url = f"{s3_url()}/{middle}"
    with pytest.raises(InvalidDataError):
        Store.open(url, create=True)


@pytest.mark.azure
def test_dot_segments_in_an_az_prefix_are_refused_as_invalid(azurite, monkeypatch):
    """As above, on Azure: ``cloud_root`` refuses a query, a fragment and an empty segment
    with InvalidDataError, but not ``..``, which then fails as a StorageError saying to
    check that the location is reachable and retry."""
    for name, value in emulators.azure_env(azurite).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidDataError):
        Store.open(f"az://{emulators.AZURE_CONTAINER}/{uuid.uuid4().hex}/../b", create=True)


# -- listings that meet keys another tool wrote ---------------------------------------------


@pytest.mark.s3
def test_a_foreign_key_with_an_empty_segment_does_not_break_gc_or_listing(s3_server):
    """A user's script writes a note next to the store with the store URL kept as typed,
    with a trailing slash (``s3://bucket/run/`` + ``/notes.txt``: key ``run//notes.txt``).
    gc must leave files it did not write alone and go on (SPEC §3.10); s3fs lists such a
    key. On obstore the listing of the store's root fails on the reply's ``run//`` common
    prefix (an empty path segment) with InvalidDataError "the client refused the request
    before sending it", so ``gc`` and ``Store.open(create=True)`` beside it fail."""
    from dynstate.maintenance.gc import collect_garbage

    url = s3_url()
    store = Store.open(url, create=True)
    store.append([{"a": 1}])
    prefix = url.split(f"s3://{S3_BUCKET}/", 1)[1]
    _boto(s3_server.endpoint).put_object(
        Bucket=S3_BUCKET, Key=f"{prefix}//notes.txt", Body=b"my notes"
    )
    assert {"_dynstate", "data"} <= set(store.storage.list(""))
    collect_garbage(Store.open(url), grace_s=0, dry_run=False)
    assert Store.open(url).snapshot().to_arrow().to_pylist() == [{"a": 1}]


# -- the CLI's "is it the bucket that is missing?" on gs:// ------------------------------------


@pytest.mark.gcs
def test_the_cli_does_not_call_an_existing_empty_gcs_bucket_missing(fake_gcs):
    """After "no store here" the CLI asks :func:`missing_bucket` whether the bucket exists.
    For gs:// it asks ``storage.exists("")``, which is False for an existing *empty* bucket
    (and a missing bucket raises StoreNotFoundError, which it swallows as "cannot tell"):
    the answer is inverted. ``dynstate ls gs://new-empty-bucket/run`` says "bucket
    'new-empty-bucket' does not exist at AWS S3 ... (AWS_ENDPOINT_URL ...)"."""
    from click.testing import CliRunner

    from dynstate.cli import cli
    from dynstate.storage.preflight import missing_bucket

    bucket = f"empty-{uuid.uuid4().hex[:12]}"
    emulators._json(f"{fake_gcs}/storage/v1/b?project=dynstate", {"name": bucket})
    options = emulators.gcs_options(fake_gcs)
    assert missing_bucket(f"gs://{bucket}/run1", options) is None  # it exists
    # (a missing bucket: GCS answers 404 NoSuchBucket; this emulator answers 500, so the
    # answer here is "cannot tell", None, and the CLI keeps its own error)
    args = ["ls", f"gs://{bucket}/run1", "--storage-option",
            f"service_account_key={json.dumps(options['service_account_key'])}",
            "--storage-option", 'client_options={"allow_http": true}']  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    assert "does not exist at AWS S3" not in result.output, result.output
    assert "no dynstate store" in result.output, result.output


# -- storage options as s3fs users spell them ---------------------------------------------


@pytest.mark.s3
def test_refused_writes_are_not_reported_as_missing_conditional_writes(s3_endpoint):
    """``anon=True`` (or read-only credentials) on a bucket that refuses anonymous writes:
    the conditional-write probe's PUT gets 403. check_exclusive_create takes any
    non-transient StorageError for "the server rejects the header" and raises
    ConcurrencyUnsupportedError ("does not support conditional writes ... open with
    single_writer=True"), advice that cannot help: the store refuses these credentials
    every write. The refusal itself (StorageError "S3 refused the credentials") should
    come through."""
    from dynstate.errors import ConcurrencyUnsupportedError, StorageError

    with pytest.raises(StorageError) as info:
        Store.open(s3_url(), create=True, storage_options={"anon": True})
    assert not isinstance(info.value, ConcurrencyUnsupportedError), str(info.value)
    assert "refused" in str(info.value) or "permission" in str(info.value)


@pytest.mark.s3
@pytest.mark.parametrize(
    "bad",
    [
        {"client_kwargs": "region_name=us-east-1"},
        {"config_kwargs": "retries=3"},
        {"endpoint_url": "127.0.0.1:9000"},
    ],
    ids=["client_kwargs-str", "config_kwargs-str", "endpoint-without-scheme"],
)
def test_malformed_s3fs_options_are_invalid_data_not_retry_later(s3_endpoint, bad):
    """SPEC §3.9 and docs ("an unknown storage option is an InvalidDataError naming it ...
    instead of a TypeError from deep inside aiobotocore"): a storage option of the wrong
    shape is the caller's mistake. It falls to s3fs, fails deep inside botocore, and comes
    out as StorageError "AttributeError: 'str' object has no attribute 'copy'; check the
    location and retry" (or "Invalid endpoint ...; check that the location is reachable and
    retry"). The CLI's preflight refuses the first two; Store.open does not."""
    options = {"endpoint_url": s3_endpoint, **bad}
    with pytest.raises(InvalidDataError):
        Store.open(s3_url(), create=True, storage_options=options)


# -- fsspec's other spellings of the cloud schemes --------------------------------------------


@pytest.mark.parametrize("url", ["gcs://bucket/run1", "abfs://container/run1"])
def test_fsspec_cloud_aliases_do_not_ask_to_install_an_installed_extra(url):
    """``gcs://`` (gcsfs's alias of ``gs://``) and ``abfs://`` (adlfs's Azure scheme) are
    named as Google's and Azure's by the error table (``service_of``) and the extras map,
    but open_storage sends only ``gs``/``az`` to obstore: the rest go to fsspec, which has no
    gcsfs/adlfs, and the error says ``pip install 'dynstate[gcs]'`` -- which is installed
    (it is obstore) and changes nothing. Either serve the alias as its scheme or refuse it
    saying to write gs:// / az://."""
    from dynstate.errors import MissingDependencyError

    try:
        Store.open(url, storage_options={})
    except MissingDependencyError as exc:
        raise AssertionError(f"asks to install what is installed: {exc}") from None
    except InvalidDataError as exc:
        assert "write gs://bucket/run1" in str(exc) or "write az://container/run1" in str(exc)
    else:
        raise AssertionError(f"{url} opened")


# -- guards: what held up, kept because it is easy to break ----------------------------------


@pytest.mark.s3
def test_guard_listing_past_one_page_under_an_odd_prefix(s3_endpoint):
    """ListObjectsV2 answers 1,000 keys a page; obstore follows the continuation token, for
    objects and common prefixes alike, under a prefix with a space, a non-ASCII letter, a
    ``%`` and a ``+``."""
    from concurrent.futures import ThreadPoolExecutor

    storage = open_storage(f"s3://{S3_BUCKET}/{uuid.uuid4().hex} é%2F+x/")
    files = [f"d/{i:05d}.bin" for i in range(1005)]
    dirs = [f"d/sub{i:05d}/y" for i in range(1003)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda rel: storage.put(rel, b"x", durable=False), files + dirs))
    names = storage.list("d")
    assert names == sorted([f.split("/")[1] for f in files] + [d.split("/")[1] for d in dirs])


@pytest.mark.s3
@pytest.mark.parametrize("prefix", ["sp ace/run", "uni/é", "pct/a%2Fb", "plus/a+b", "slash/run/"])
def test_guard_odd_prefixes_read_the_same_on_obstore_and_s3fs(s3_endpoint, monkeypatch, prefix):
    """A store written through obstore under an odd prefix is the same objects s3fs reads
    (a forked DataLoader worker reads through s3fs)."""
    url = f"s3://{S3_BUCKET}/{uuid.uuid4().hex}/{prefix}"
    store = Store.open(url, create=True)
    assert store.storage.served
    store.append([{"a": 1}])
    monkeypatch.setenv("DYNSTATE_S3_CLIENT", "s3fs")
    other = Store.open(url)
    assert not other.storage.served
    assert other.head == 1 and other.snapshot().to_arrow().to_pylist() == [{"a": 1}]
