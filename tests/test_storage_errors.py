"""Every client-library error the storage package can meet comes out as a DynstateError that
names the URL, says what to do and holds no secret (the client-error table in
dynstate/storage/errors.py), through both boundaries: a store's (``Storage._call``) and a
location's outside any store (export targets, checkpoint mirrors).

The classes are not a hand list: every exception class of botocore.exceptions, aiohttp,
urllib3.exceptions, s3fs and fsspec is walked, built with arguments that quote a secret, and
raised by a real fsspec filesystem under the boundary; a class the table has no row for fails
the test. The real cases run against the loopback S3 server (wrong credentials, a missing
bucket, an unreachable endpoint, a secret with ``/`` in the endpoint URL).
"""

from __future__ import annotations

import inspect
import socket
import string
import traceback
import types
import uuid
from typing import Any, ClassVar

import fsspec
import pytest
from conftest import s3_url
from fsspec.implementations.memory import MemoryFileSystem

from dynstate import DynstateError, StorageError, Store, StoreNotFoundError
from dynstate.storage import errors as table
from dynstate.storage import open_location, open_storage

# A secret of the shape AWS secret keys have: '/' and '+' in it.
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYSECRET/KEY"
MODULES = ("botocore.exceptions", "aiohttp", "urllib3.exceptions", "s3fs", "s3fs.errors",
           "fsspec", "fsspec.exceptions", "obstore.exceptions")  # fmt: skip
LIBRARIES = table.CLIENT_LIBRARIES


def client_exception_classes() -> list[type[BaseException]]:
    """Every exception class the client libraries' public modules hold (their own and those
    they re-export), whatever the installed versions add."""
    import importlib

    found: dict[str, type[BaseException]] = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            # the libraries' own classes, not the stdlib's they re-export (http.client's)
            if issubclass(cls, BaseException) and cls.__module__.split(".")[0] in LIBRARIES:
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[k] for k in sorted(found)]


CLASSES = client_exception_classes()


def _arguments() -> dict[str, Any]:
    info = types.SimpleNamespace(
        real_url=f"http://127.0.0.1:9/{SECRET}", url=f"http://127.0.0.1:9/{SECRET}",
        method="GET", headers={},
    )  # fmt: skip
    key = types.SimpleNamespace(host="127.0.0.1", port=9, ssl=True, is_ssl=False)
    return {
        "connection_key": key, "os_error": OSError(111, f"refused {SECRET}"),
        "certificate_error": ValueError(f"certificate {SECRET}"), "request_info": info,
        "history": (), "expected": b"a", "got": b"b", "host": "127.0.0.1", "port": 9,
        "code": 1, "status": 500, "pool": None, "limit": 10, "actual_size": 20,
        "error": OSError(f"error {SECRET}"), "original_error": OSError(f"error {SECRET}"),
        "retries": 1, "partial": 1, "expected_bytes": 2, "actual_bytes": 1,
        "exception": OSError(f"error {SECRET}"), "reason": OSError(f"reason {SECRET}"),
        "response": types.SimpleNamespace(tell=lambda: 0, length_remaining=1), "length": b"x",
    }  # fmt: skip


def build(cls: type[BaseException]) -> BaseException:
    """An instance of ``cls`` whose text quotes the secret wherever its constructor lets it."""
    from botocore.exceptions import ClientError

    if issubclass(cls, ClientError):
        response = {"Error": {"Code": "SomeRefusal", "Message": f"refused {SECRET}"},
                    "ResponseMetadata": {"HTTPStatusCode": 400}}  # fmt: skip
        return cls(response, "GetObject")  # type: ignore[call-arg]
    kwargs: dict[str, Any] = {}
    template = getattr(cls, "fmt", None)
    if isinstance(template, str):  # botocore's: keyword fields of a message template
        kwargs = {f: f"{f} {SECRET}" for _, f, _, _ in string.Formatter().parse(template) if f}
    known = _arguments()
    args: list[Any] = []
    try:
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        parameters = []
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in kwargs:
            continue
        if p.default is not p.empty and p.name not in ("message", "url", "line", "hdr"):
            continue
        value = known.get(p.name, f"{p.name} {SECRET}")
        if p.kind is p.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[p.name] = value
    if not args and not kwargs and template is None:
        args = [f"message {SECRET}"]
    try:
        return cls(*args, **kwargs)
    except Exception as exc:
        raise AssertionError(f"teach build() to make a {cls.__qualname__}: {exc!r}") from exc


class RaisingFS(MemoryFileSystem):
    """A real fsspec filesystem whose reads fail with the exception the test sets."""

    protocol = "dynstate-raising"
    to_raise: ClassVar[BaseException | None] = None

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> bytes:
        assert RaisingFS.to_raise is not None
        raise RaisingFS.to_raise


@pytest.fixture(scope="module")
def raising() -> None:
    # The protocol is this module's own; fsspec offers no public way to unregister it.
    fsspec.register_implementation(RaisingFS.protocol, RaisingFS, clobber=True)


def check_clean(err: BaseException, url: str) -> None:
    """A dynstate error naming ``url``, with no secret in it, its message or its traceback."""
    assert isinstance(err, DynstateError), f"{type(err).__name__}: {err}"
    assert url in str(err), str(err)
    shown = "".join(traceback.format_exception(err))
    assert SECRET not in shown and SECRET.split("/")[0] not in shown, shown


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_client_error_class_is_mapped(raising: None, cls: type[BaseException]) -> None:
    exc = build(cls)
    row, _ = table.row_of(exc)
    assert row is not table.OTHER, f"{cls.__qualname__} has no row in storage/errors.py"

    url = f"{RaisingFS.protocol}://bucket/{uuid.uuid4().hex}"
    options = {"secret": SECRET}
    storage = open_storage(url, options)
    storage.retry_attempts = 1  # the mapping is under test here, not the retries
    RaisingFS.to_raise = exc
    with pytest.raises(Exception) as info:
        storage.read("_dynstate/store.json")
    check_clean(info.value, storage.display_url)
    assert isinstance(info.value, row.error)

    where = open_location(url, options)
    with pytest.raises(Exception) as info:
        where.read(f"{where.path}/tracker.txt")
    check_clean(info.value, url)
    assert isinstance(info.value, row.error)


def _client_error(code: str, status: int) -> BaseException:
    from botocore.exceptions import ClientError

    response = {"Error": {"Code": code, "Message": f"no {SECRET}"},
                "ResponseMetadata": {"HTTPStatusCode": status}}  # fmt: skip
    return ClientError(response, "GetObject")  # type: ignore[arg-type]


def _named_cases() -> list[tuple[str, Any, type[DynstateError], str]]:
    import aiohttp
    from botocore import exceptions as b

    key = _arguments()["connection_key"]
    return [
        ("no credentials", b.NoCredentialsError(), StorageError, "no S3 credentials found"),
        ("endpoint down", b.EndpointConnectionError(endpoint_url=f"http://x/{SECRET}"),
         StorageError, "cannot reach the endpoint"),
        ("connect timeout", b.ConnectTimeoutError(endpoint_url="http://x"), StorageError,
         "cannot reach the endpoint"),
        ("read timeout", b.ReadTimeoutError(endpoint_url="http://x"), StorageError,
         "cannot reach the endpoint"),
        ("connector", aiohttp.ClientConnectorError(key, OSError(111, "refused")), StorageError,
         "cannot reach the endpoint"),
        ("disconnected", aiohttp.ServerDisconnectedError(), StorageError,
         "cannot reach the endpoint"),
        ("no bucket", _client_error("NoSuchBucket", 404), StoreNotFoundError,
         "the bucket of"),
        ("bad key", _client_error("InvalidAccessKeyId", 403), StorageError,
         "S3 refused the credentials"),
        ("slow down", _client_error("SlowDown", 503), StorageError, "retry later"),
        ("denied", PermissionError(f"denied {SECRET}"), StorageError, "permission denied"),
        ("bad parameter", b.ParamValidationError(report=SECRET), DynstateError,
         "refused the request before sending it"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(len(_named_cases())))
def test_what_each_kind_of_failure_says(raising: None, case: int) -> None:
    _, exc, error, text = _named_cases()[case]
    url = f"{RaisingFS.protocol}://bucket/{uuid.uuid4().hex}"
    storage = open_storage(url, {"secret": SECRET})
    storage.retry_attempts = 1
    RaisingFS.to_raise = exc
    with pytest.raises(error, match=text) as info:
        storage.read("x")
    check_clean(info.value, storage.display_url)


def test_a_missing_object_passes_a_store_and_is_typed_outside_one(raising: None) -> None:
    """A store's callers act on FileNotFoundError (the documented pass-through); a location
    outside a store turns it into StoreNotFoundError, which is a FileNotFoundError too."""
    url = f"{RaisingFS.protocol}://bucket/{uuid.uuid4().hex}"
    RaisingFS.to_raise = FileNotFoundError("bucket/x")
    storage = open_storage(url)
    with pytest.raises(FileNotFoundError) as info:
        storage.read("x")
    assert not isinstance(info.value, DynstateError)
    where = open_location(url)
    with pytest.raises(StoreNotFoundError, match=f"nothing at {url}"):
        where.read(where.path)


# -- against the loopback S3 server ------------------------------------------------------------


@pytest.mark.s3
def test_wrong_credentials_are_refused_by_name(s3_endpoint: str, monkeypatch) -> None:
    """The server checks signatures only while moto's auth is on (off for the rest of the
    suite); an unknown key is refused with InvalidAccessKeyId, reported as refused
    credentials, neither key shown."""
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    options = {"key": "AKIAWRONGWRONGWRONG1", "secret": SECRET}
    url = s3_url()
    with pytest.raises(StorageError, match="S3 refused the credentials") as info:
        Store.open(url, create=True, storage_options=options)
    check_clean(info.value, url)
    assert "AKIAWRONGWRONGWRONG1" not in str(info.value)
    where = open_location(s3_url(), options)
    with pytest.raises(StorageError, match="S3 refused the credentials") as info:
        where.exists(f"{where.path}/tracker.txt")
    check_clean(info.value, where.display_url)


@pytest.mark.s3
def test_missing_bucket(s3_endpoint: str) -> None:
    from dynstate.storage.preflight import missing_bucket

    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    with pytest.raises(StoreNotFoundError) as info:
        Store.open(url, create=True)
    assert url.rsplit("/", 1)[0] in str(info.value)
    assert missing_bucket(url, {}) == url.split("/")[2]
    assert missing_bucket(s3_url(), {}) is None  # the bucket is there, the store is not
    where = open_location(url)
    with pytest.raises(StoreNotFoundError, match="the bucket of s3://no-such-bucket-"):
        where.write(f"{where.path}/tracker.txt", b"1")


@pytest.mark.s3
def test_unreachable_endpoint(s3_endpoint: str) -> None:
    """A port that refuses connections: one clean error naming the URL, through the store,
    a location and the preflight the CLI asks for."""
    from dynstate.storage.preflight import preflight

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening: refuses for as long as held
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        options = {"endpoint_url": endpoint, "secret": SECRET, "key": "testing",
                   "config_kwargs": {"retries": {"max_attempts": 1}}}  # fmt: skip
        url = s3_url()
        storage = open_storage(url, options)
        storage.retry_attempts = 1
        with pytest.raises(StorageError, match="cannot reach the endpoint of") as info:
            storage.read("_dynstate/store.json")
        check_clean(info.value, url)
        where = open_location(url, options)
        with pytest.raises(StorageError, match="cannot reach the endpoint of") as info:
            where.read(f"{where.path}/tracker.txt")
        check_clean(info.value, url)
        with pytest.raises(StorageError, match=f"cannot reach the S3 endpoint {endpoint}"):
            preflight(url, options)


@pytest.mark.s3
def test_a_secret_with_slashes_in_the_endpoint_url_is_not_leaked(s3_endpoint: str) -> None:
    """http://user:SECRET@host: the secret holds '/', and the options name it nowhere (it
    is no option's value): the scrubber finds it as the URL's userinfo, everywhere."""
    from dynstate import InvalidDataError
    from dynstate.storage.preflight import preflight

    endpoint = s3_endpoint.replace("://", f"://AKIDUSER:{SECRET}@")
    options = {"endpoint_url": endpoint, "config_kwargs": {"retries": {"max_attempts": 1}}}
    url = s3_url()
    with pytest.raises(DynstateError) as info:
        storage = open_storage(url, options)
        storage.retry_attempts = 1
        storage.read("_dynstate/store.json")
    check_clean(info.value, url)
    where = open_location(url, options)
    with pytest.raises(DynstateError) as info:
        where.write(f"{where.path}/tracker.txt", b"1")
    check_clean(info.value, url)
    with pytest.raises(InvalidDataError, match="has credentials in it") as info:
        preflight(url, options)
    assert SECRET not in str(info.value) and "***@" in str(info.value)


def test_the_client_error_table_is_the_only_matcher() -> None:
    """No module outside dynstate/storage imports a client library or fsspec, or matches a
    client library's exception by its name."""
    from pathlib import Path

    package = Path(table.__file__).resolve().parent.parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith("storage/"):
            continue
        text = path.read_text()
        for needle in ("import fsspec", "from fsspec", "import s3fs", "from s3fs",
                       "import botocore", "from botocore", "import aiohttp", "from aiohttp",
                       "_call_s3", "NoCredentialsError", "EndpointConnectionError",
                       "ClientConnectorError", "NoSuchBucket"):  # fmt: skip
            if needle in text:
                offenders.append(f"{rel}: {needle}")
    assert offenders == []


@pytest.mark.s3
def test_export_and_the_mirror_report_through_the_table(s3_endpoint: str, tmp_path) -> None:
    """export and the verl checkpoint mirror open their targets through the storage package:
    a missing bucket is the table's StoreNotFoundError naming OUT, never a raw client error."""
    from dynstate import CorruptStoreError
    from dynstate.maintenance.export import export
    from dynstate.verl.mirror import TRACKER, latest_step, push

    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"id": 0}])
    out = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/rows.parquet"
    with pytest.raises(StoreNotFoundError, match="the bucket of s3://no-such-bucket-") as info:
        export(store.snapshot(), out)
    check_clean(info.value, out)

    folder = tmp_path / "checkpoints" / "global_step_3"
    folder.mkdir(parents=True)
    (folder / "data.pt").write_bytes(b"x")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening
        options = {"endpoint_url": f"http://127.0.0.1:{sock.getsockname()[1]}",
                   "key": "testing", "secret": SECRET,
                   "config_kwargs": {"retries": {"max_attempts": 1}}}  # fmt: skip
        mirror = s3_url()
        with pytest.raises(StorageError, match="cannot reach the endpoint of") as info:
            push(str(tmp_path / "checkpoints"), 3, mirror, options)
        check_clean(info.value, mirror)
    mirror = s3_url()
    open_location(mirror).write(f"{mirror[len('s3://') :]}/{TRACKER}", b"not a step")
    with pytest.raises(CorruptStoreError, match="does not hold a step number"):
        latest_step(mirror)


def test_storage_option_values_are_parsed_with_bounds(tmp_path) -> None:
    """VALUE is JSON where it parses (bounded like every store file), else the string; a
    value nested past the bound is a usage error, not a RecursionError."""
    from click.testing import CliRunner

    from dynstate.cli import cli
    from dynstate.cli.options import parse_storage_options

    assert parse_storage_options(("a=1", "b=abc", 'c={"d": [1]}', "e=12abc")) == {
        "a": 1, "b": "abc", "c": {"d": [1]}, "e": "12abc"
    }  # fmt: skip
    url = str(tmp_path / "store")
    Store.open(url, create=True)
    for value in ("[" * 100_000 + "]" * 100_000, "1" * 10_000):
        result = CliRunner().invoke(cli, ["ls", url, "--storage-option", f"x={value}"])
        assert result.exit_code == 2, result.output
        assert "Invalid value for --storage-option: the value of x is JSON" in result.output
        assert "Traceback" not in result.output
