"""The read-only S3 client (dynstate/storage/s3http.py): its signatures equal botocore's for
the same request, it reads, ranges, heads and lists the loopback S3 server as s3fs does, its
failures are those s3fs raises (so the client-error table applies), transient ones are
retried through the fault proxy, and it serves only configurations it fully understands."""

from __future__ import annotations

import datetime as dt
import os
import uuid

import pytest
from s3_faults import FaultProxy

from dynstate.errors import StoreNotFoundError
from dynstate.storage import open_storage
from dynstate.storage.retry import is_transient
from dynstate.storage.s3http import S3Config, S3Reader, S3ResponseError, config_of, root_of

pytestmark = pytest.mark.s3

ENV = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG+bPx"}


def _config(**changes) -> S3Config:
    base = dict(
        scheme="http",
        host="127.0.0.1:9000",
        path_style=True,
        region="eu-west-1",
        key="AKIDEXAMPLE",
        secret="wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
        token=None,
    )
    return S3Config(**{**base, **changes})


# -- signatures --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "query", "token", "path_style"),
    [
        ("bucket/_dynstate/log/00000000000000000001.json", {}, None, True),
        ("bucket/a key with spaces/ünïcode+plus=eq~tilde.json", {}, None, True),
        (
            "bucket",
            {"list-type": "2", "prefix": "run 1/_dynstate/", "delimiter": "/", "max-keys": "9"},
            None,
            True,
        ),
        ("bucket/x/y.parquet", {}, "FQoGZXIvYXdzEJr//////////wEaDOb+session=token", True),
        ("my-bucket/x/y.parquet", {"continuation-token": "1/abc+def=="}, None, False),
    ],
)
def test_signatures_equal_botocores(monkeypatch, path, query, token, path_style):
    """The Authorization header equals botocore's S3 SigV4 signer's for the same request at
    the same instant (path- and virtual-host style, a session token, keys and queries with
    characters that need encoding)."""
    import botocore.auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    config = _config(
        token=token, path_style=path_style, host="s3.eu-west-1.amazonaws.com", scheme="https"
    )
    reader = S3Reader(config)
    bucket, _, key = path.partition("/")
    host, uri = reader._address(bucket, key)
    now = dt.datetime(2026, 12, 2, 1, 2, 3, tzinfo=dt.timezone.utc)
    ours = reader.signed_headers("GET", host, uri, query, now)

    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: now.replace(tzinfo=None))
    from dynstate.storage.s3http import _query_string

    url = f"https://{host}{uri}" + ("?" + _query_string(query) if query else "")
    request = AWSRequest(method="GET", url=url, headers={})
    request.context["payload_signing_enabled"] = True
    signer = botocore.auth.S3SigV4Auth(
        Credentials(config.key, config.secret, token), "s3", config.region
    )
    signer.add_auth(request)
    assert ours["authorization"] == request.headers["Authorization"]
    assert ours["x-amz-date"] == request.headers["X-Amz-Date"]
    if token:
        assert ours["x-amz-security-token"] == request.headers["X-Amz-Security-Token"]


# -- against the loopback server -----------------------------------------------------------


@pytest.fixture
def put(s3_server):
    """Write objects with boto3 (not through the code under test); yields a writer."""
    import boto3

    env = s3_server.env()
    client = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    prefix = uuid.uuid4().hex

    def write(name: str, data: bytes) -> str:
        from conftest import S3_BUCKET

        client.put_object(Bucket=S3_BUCKET, Key=f"{prefix}/{name}", Body=data)
        return f"{S3_BUCKET}/{prefix}/{name}"

    write.prefix = prefix  # type: ignore[attr-defined]
    return write


def _reader(endpoint: str, **config) -> S3Reader:
    options = {"endpoint_url": endpoint, "config_kwargs": config} if config else {}
    found = config_of("s3://b/p", {"endpoint_url": endpoint, **options})
    assert found is not None
    return S3Reader(found)


def test_reads_ranges_heads_and_lists(s3_endpoint, put):
    data = bytes(range(256)) * 40
    path = put("dir/a b+c.bin", data)
    put("dir/sub/x.json", b"{}")
    put("dir/z.json", b"[]")
    reader = _reader(s3_endpoint)
    assert reader.get(path) == data
    assert reader.get(path, 10, 20) == data[10:20]
    assert reader.get(path, 10_000, 20_000) == data[10_000:]  # past the end: a slice's answer
    assert reader.get(path, 20_000, 30_000) == b""
    assert reader.get(path, 5, 5) == b""
    info = reader.info(path)
    assert info["size"] == len(data)
    assert abs(info["mtime"] - dt.datetime.now(dt.timezone.utc).timestamp()) < 3600
    folder = path.rsplit("/", 1)[0]
    assert sorted(reader.ls(folder)) == sorted([path, f"{folder}/sub", f"{folder}/z.json"])
    assert reader.ls(folder + "/nothing-here") == []


def test_listing_follows_continuation_tokens(s3_endpoint, put, monkeypatch):
    paths = sorted(put(f"many/{i:03d}", b"x") for i in range(7))
    reader = _reader(s3_endpoint)
    pages: list[dict] = []
    request = reader._request

    def small_pages(operation, method, path, query=None, extra=None, ok=(200,)):
        if operation == "ListObjectsV2":
            query = {**query, "max-keys": "3"}
            pages.append(query)
        return request(operation, method, path, query=query, extra=extra, ok=ok)

    monkeypatch.setattr(reader, "_request", small_pages)
    assert sorted(reader.ls(paths[0].rsplit("/", 1)[0])) == paths
    assert len(pages) == 3 and "continuation-token" in pages[-1]


def test_missing_key_and_bucket_raise_what_s3fs_raises(s3_endpoint, put):
    reader = _reader(s3_endpoint)
    path = put("here", b"1")
    for call in (lambda: reader.get(path + "-not"), lambda: reader.info(path + "-not")):
        with pytest.raises(FileNotFoundError) as caught:
            call()
        assert isinstance(caught.value.__cause__, S3ResponseError)
        assert not is_transient(caught.value)
    with pytest.raises(FileNotFoundError) as caught:
        reader.get(f"no-such-bucket-{uuid.uuid4().hex[:8]}/key")
    assert caught.value.__cause__.code == "NoSuchBucket"


def test_a_store_in_a_missing_bucket_is_store_not_found(s3_endpoint):
    storage = open_storage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run")
    assert storage._reader is not None  # the environment's keys and endpoint: this client
    with pytest.raises(StoreNotFoundError, match="bucket"):
        storage.read("_dynstate/store.json")


@pytest.mark.parametrize("kind", ["drop_request", "drop_response", "500", "503", "truncate"])
def test_transient_faults_are_retried(s3_endpoint, put, kind):
    data = os.urandom(5000)
    path = put("faulty", data)
    with FaultProxy(s3_endpoint) as proxy:
        reader = _reader(proxy.url)
        proxy.force(kind, method="GET")
        proxy.force(kind, method="GET")
        assert reader.get(path) == data
        assert proxy.faults[kind] == 2
        proxy.force(kind, method="GET")
        one = _reader(proxy.url, retries={"max_attempts": 0})  # one attempt in all
        with pytest.raises(Exception) as caught:
            one.get(path)
        assert is_transient(caught.value), repr(caught.value)


def test_a_reader_reads_after_fork(s3_endpoint, put):
    """A forked child (a DataLoader worker) opens its own connection, never its parent's."""
    path = put("forked", b"parent and child")
    reader = _reader(s3_endpoint)
    assert reader.get(path) == b"parent and child"
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if reader.get(path) == b"parent and child" else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert reader.get(path) == b"parent and child"  # the parent's connection still works


# -- which configurations it serves -----------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "env", "served"),
    [
        ({}, ENV, False),  # an AWS endpoint with no region named: s3fs discovers it
        ({}, {**ENV, "AWS_REGION": "eu-west-1"}, True),
        ({"endpoint_url": "http://127.0.0.1:1"}, ENV, True),
        ({"endpoint_url": "http://127.0.0.1:1"}, {}, False),  # no keys: s3fs's chain
        ({"endpoint_url": "http://h:1", "key": "a", "secret": "b"}, {}, True),
        ({"endpoint_url": "http://h:1", "key": "a"}, {}, False),  # a partial pair
        ({"endpoint_url": "http://h:1"}, {**ENV, "AWS_PROFILE": "work"}, False),
        ({"endpoint_url": "http://h:1"}, {**ENV, "HTTPS_PROXY": "http://proxy:3128"}, False),
        ({"endpoint_url": "http://h:1"}, {**ENV, "DYNSTATE_S3_CLIENT": "s3fs"}, False),
        ({"endpoint_url": "http://h:1", "anon": True}, ENV, False),
        ({"endpoint_url": "http://h:1", "requester_pays": True}, ENV, False),
        ({"endpoint_url": "http://h:1", "client_kwargs": {"verify": False}}, ENV, False),
        ({"endpoint_url": "http://h:1", "config_kwargs": {"s3": {}}}, ENV, False),
        ({"endpoint_url": "http://h:1/path"}, ENV, False),
        ({"endpoint_url": "ftp://h:1"}, ENV, False),
        (
            {"client_kwargs": {"endpoint_url": "https://minio:9000", "region_name": "x"}},
            ENV,
            True,
        ),
    ],
)
def test_serves_only_configurations_it_knows(tmp_path, options, env, served):
    env = {**env, "AWS_CONFIG_FILE": str(tmp_path / "none")}
    assert (config_of("s3://bucket/run", options, env) is not None) is served


def test_the_configuration_it_takes(tmp_path):
    env = {**ENV, "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SESSION_TOKEN": "tok"}
    found = config_of(
        "s3://bucket/run",
        {
            "endpoint_url": "https://minio.example:9000",
            "config_kwargs": {
                "connect_timeout": 5,
                "read_timeout": 30,
                "retries": {"max_attempts": 2},
            },
        },
        env,
    )
    assert found is not None
    assert (found.scheme, found.host, found.path_style, found.region) == (
        "https",
        "minio.example:9000",
        True,
        "us-east-1",
    )
    assert (found.key, found.token, found.attempts) == ("AKIDEXAMPLE", "tok", 3)
    assert (found.connect_timeout, found.read_timeout) == (5.0, 30.0)
    assert ENV["AWS_SECRET_ACCESS_KEY"] not in repr(found)
    bundle_env = {**env, "AWS_CA_BUNDLE": "/ca.pem"}
    bundle = config_of("s3://b/r", {"endpoint_url": "https://h"}, bundle_env)
    assert bundle is not None and bundle.ca_bundle == "/ca.pem"
    # explicit options win over the environment, as in botocore
    found = config_of("s3://b/r", {"endpoint_url": "http://h:1", "key": "k", "secret": "s"}, env)
    assert found is not None and (found.key, found.secret, found.token) == ("k", "s", None)
    # a region in the config file: botocore would use it, so s3fs serves
    (tmp_path / "config").write_text("[default]\nregion = eu-north-1\n")
    with_file = {**env, "AWS_CONFIG_FILE": str(tmp_path / "config")}
    assert config_of("s3://b/r", {"endpoint_url": "http://h:1"}, with_file) is None


@pytest.mark.parametrize(
    "url",
    ["s3://bucket", "s3://bucket/", "s3://bucket/run", "s3://bucket/a/b/c/", "s3a://bucket/run"],
)
def test_roots_equal_s3fss(url):
    import fsspec

    assert root_of(url) == fsspec.core.url_to_fs(url)[1].rstrip("/")


@pytest.mark.parametrize("url", ["s3://bucket//run", "s3://bucket/run?versionId=1", "s3://"])
def test_unusual_urls_go_to_s3fs(url):
    assert root_of(url) is None and config_of(url, {"endpoint_url": "http://h:1"}, ENV) is None


def test_a_reading_process_never_imports_s3fs(s3_endpoint, tmp_path):
    """A store opened, listed and read through this client imports neither s3fs nor its
    libraries; its first write builds s3fs's filesystem then."""
    import subprocess
    import sys

    from conftest import s3_url

    url = s3_url()
    script = f"""
import sys
import pyarrow as pa
from dynstate import Store
store = Store.open({url!r})
assert store.head == 1 and store.snapshot().to_arrow().num_rows == 3, store.head
libraries = ("s3fs", "aiobotocore", "botocore", "aiohttp", "fsspec")
heavy = sorted(m for m in sys.modules if m.split(".")[0] in libraries)
assert not heavy, heavy
store.append(pa.table({{"x": [4]}}))
assert "s3fs" in sys.modules
print("ok")
"""
    from dynstate import Store

    Store.open(url, create=True).append([{"x": 1}, {"x": 2}, {"x": 3}])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# -- what S3 tells a client: a bucket's region, its clock; idle connections it closed ------


class _FakeS3:
    """A loopback HTTP server answering GETs as S3 would in one situation: ``region`` (the
    bucket is in eu-west-1 and a request signed for another region gets S3's 400
    AuthorizationHeaderMalformed naming it), ``skew`` (S3's clock is two hours ahead and a
    request more than 15 minutes off gets 403 RequestTimeTooSkewed with its ServerTime), or
    ``close`` (every reply is followed by closing the connection, without saying so)."""

    def __init__(self, mode: str, tls: tuple[str, str] | None = None) -> None:
        import ssl
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        fake = self
        self.mode = mode
        self.requests: list[str] = []
        self.connections = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:  # once per connection accepted
                fake.connections += 1
                super().setup()

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                auth = self.headers.get("authorization", "")
                region = auth.split("Credential=", 1)[1].split("/")[2]
                stamp = dt.datetime.strptime(self.headers["x-amz-date"], "%Y%m%dT%H%M%SZ")
                stamp = stamp.replace(tzinfo=dt.timezone.utc)
                fake.requests.append(region)
                server_now = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2)
                if fake.mode == "region" and region != "eu-west-1":
                    return self._reply(
                        400,
                        b"<Error><Code>AuthorizationHeaderMalformed</Code><Message>the region"
                        b" is wrong</Message><Region>eu-west-1</Region></Error>",
                        {"x-amz-bucket-region": "eu-west-1"},
                    )
                if fake.mode == "skew" and abs((stamp - server_now).total_seconds()) > 900:
                    when = server_now.strftime("%Y-%m-%dT%H:%M:%SZ").encode()
                    return self._reply(
                        403,
                        b"<Error><Code>RequestTimeTooSkewed</Code><Message>too far</Message>"
                        b"<ServerTime>" + when + b"</ServerTime></Error>",
                    )
                self._reply(200, b"the body")
                if fake.mode == "close":
                    self.close_connection = True  # and no "Connection: close" said

            def _reply(self, status: int, body: bytes, headers: dict | None = None) -> None:
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_s3(request):
    fake = _FakeS3(request.param)
    yield fake
    fake.close()


def _fake_reader(url: str, env: dict | None = None) -> S3Reader:
    options = {
        "endpoint_url": url,
        "key": "k",
        "secret": "s",
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 0}},  # one attempt: no retry hides it
    }
    config = config_of(
        "s3://bucket/run", options, {"AWS_CONFIG_FILE": "/nonexistent", **(env or {})}
    )
    assert config is not None and config.attempts == 1
    return S3Reader(config)


@pytest.mark.parametrize("fake_s3", ["region"], indirect=True)
def test_a_bucket_in_another_region_is_read_there(fake_s3):
    reader = _fake_reader(fake_s3.url)
    assert reader.get("bucket/key") == b"the body"
    assert reader.get("bucket/key") == b"the body"  # remembered: no second refusal
    assert fake_s3.requests == ["us-east-1", "eu-west-1", "eu-west-1"]


@pytest.mark.parametrize("fake_s3", ["skew"], indirect=True)
def test_a_host_clock_hours_off_signs_by_s3s_clock(fake_s3, caplog):
    reader = _fake_reader(fake_s3.url)
    with caplog.at_level("WARNING", logger="dynstate"):
        assert reader.get("bucket/key") == b"the body"
    assert "clock" in caplog.text and "RequestTimeTooSkewed" in caplog.text
    assert reader.get("bucket/key") == b"the body"
    assert len(fake_s3.requests) == 3


@pytest.mark.parametrize("fake_s3", ["close"], indirect=True)
def test_a_connection_the_server_closed_while_idle_is_replaced(fake_s3):
    reader = _fake_reader(fake_s3.url)
    for _ in range(4):  # one attempt each: a stale connection must not cost it
        assert reader.get("bucket/key") == b"the body"
    assert len(fake_s3.requests) == 4


@pytest.mark.parametrize("fake_s3", ["plain"], indirect=True)
def test_threads_share_keep_alive_connections_one_request_at_a_time(fake_s3):
    """``dynstate serve`` answers each request on a thread of its own: those threads take
    the connection the last one left instead of each opening (on HTTPS, handshaking) its
    own; threads reading at once never share one."""
    import threading

    reader = _fake_reader(fake_s3.url)
    got: list[bytes] = []
    for _ in range(8):  # one short-lived thread per request, one after the other
        thread = threading.Thread(target=lambda: got.append(reader.get("bucket/key")))
        thread.start()
        thread.join()
    assert got == [b"the body"] * 8
    assert fake_s3.connections == 1

    errors: list[BaseException] = []

    def many() -> None:
        try:
            for _ in range(25):
                assert reader.get("bucket/key") == b"the body"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=many) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(fake_s3.requests) == 8 + 6 * 25
    assert fake_s3.connections <= 1 + 6  # at most one more per thread reading at once


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 that no trust store holds, and its key (PEM files)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file)


def test_tls_is_verified_against_the_trust_store_or_aws_ca_bundle(tmp_path):
    """An endpoint whose certificate the trust store does not hold is refused (never read
    unverified, never retried as transient); with AWS_CA_BUNDLE naming it, it is read."""
    import ssl

    cert, key = _self_signed(tmp_path)
    fake = _FakeS3("plain", tls=(cert, key))
    try:
        with pytest.raises(ssl.SSLCertVerificationError) as caught:
            _fake_reader(fake.url).get("bucket/key")
        assert not is_transient(caught.value)
        assert fake.requests == []  # nothing was sent over the unverified connection
        trusted = _fake_reader(fake.url, {"AWS_CA_BUNDLE": cert})
        assert trusted.get("bucket/key") == b"the body"
        assert len(fake.requests) == 1
    finally:
        fake.close()
