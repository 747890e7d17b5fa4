"""How an ``s3://`` store's configuration is read (dynstate/storage/s3config.py): which
configurations obstore serves and which go to s3fs, what it takes from the options and the
environment, roots as s3fs's; and what S3 tells a client that obstore's backend
(dynstate/storage/s3obstore.py) acts on, against a loopback server answering as S3 would: a
bucket in another region, a host clock hours off, idle connections the server closed,
threads reading at once, and TLS verified against the trust store or ``AWS_CA_BUNDLE``."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from pathlib import Path

import pytest

from dynstate.errors import StorageError
from dynstate.storage import open_storage
from dynstate.storage.retry import is_transient
from dynstate.storage.s3config import DEFAULT_ATTEMPTS, OBSTORE_ONLY_ENV, config_of, root_of

pytest.importorskip("obstore")

from dynstate.storage.s3obstore import ObstoreStorage

PATH_STYLE = {"s3": {"addressing_style": "path"}}
VIRTUAL_STYLE = {"s3": {"addressing_style": "virtual"}}
ENV = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG+bPx"}


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
        ({"endpoint_url": "http://h:1", "config_kwargs": {"s3": {}}}, ENV, True),
        # path-style is what obstore sends to an endpoint of one's own (MinIO's docs ask for it)
        ({"endpoint_url": "http://h:1", "config_kwargs": PATH_STYLE}, ENV, True),
        ({"config_kwargs": PATH_STYLE}, {**ENV, "AWS_REGION": "eu-west-1"}, False),
        ({"endpoint_url": "http://h:1", "config_kwargs": VIRTUAL_STYLE}, ENV, False),
        (
            {"endpoint_url": "http://h:1", "config_kwargs": {"s3": {"use_accelerate_endpoint": 1}}},
            ENV,
            False,
        ),
        ({"endpoint_url": "http://h:1", "config_kwargs": {"s3": "path"}}, ENV, False),
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


def test_variables_only_obstore_reads_send_the_store_to_s3fs(tmp_path, monkeypatch):
    """obstore reads every ``AWS_*`` variable of its own configuration from the environment
    (botocore reads none of these), so any that changes where or how it connects sends the
    store to s3fs: with AWS_ENDPOINT set, say, obstore would connect there and s3fs to AWS."""
    import obstore

    base = {**ENV, "AWS_REGION": "eu-west-1", "AWS_CONFIG_FILE": str(tmp_path / "none")}
    assert config_of("s3://bucket/run", {}, base) is not None
    for name in OBSTORE_ONLY_ENV:
        assert config_of("s3://bucket/run", {}, {**base, name: "x"}) is None, name
    for name, value in {**base, "AWS_ENDPOINT": "http://127.0.0.1:1"}.items():
        monkeypatch.setenv(name, value)
    assert not open_storage("s3://bucket/run").served
    # The variables obstore's S3 configuration documents (its type stubs), less those
    # dynstate always passes, those only credential sources read, and unused ones, are
    # exactly the listed ones: a new one in a later obstore fails here.
    stubs = Path(obstore.__file__).parent / "_store" / "_aws.pyi"
    documented = set(re.findall(r"`(AWS_[A-Z0-9_]+)`", stubs.read_text()))
    passed = {
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
        "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_BUCKET",
        "AWS_BUCKET_NAME", "AWS_DISABLE_BULK_DELETE",
    }  # fmt: skip
    credential_sources = {
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_IMDSV1_FALLBACK", "AWS_METADATA_ENDPOINT",
        "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME", "AWS_STS_ENDPOINT", "AWS_WEB_IDENTITY_TOKEN_FILE",
    }  # fmt: skip
    unused = {"AWS_COPY_IF_NOT_EXISTS", "AWS_DISABLE_TAGGING"}  # dynstate never copies or tags
    assert documented - passed - credential_sources - unused == set(OBSTORE_ONLY_ENV)


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


@pytest.mark.parametrize(
    ("text", "region"),
    [
        ("[default]\nregion = eu-north-1\noutput = json\n", "eu-north-1"),
        ("[profile default]\nregion = eu-north-1\n", "eu-north-1"),
        ("[profile other]\nendpoint_url = http://elsewhere:1\n", "us-east-1"),
        ("[default]\nregion = eu-north-1\nendpoint_url = http://elsewhere:1\n", None),
        ("[default]\ns3 =\n  addressing_style = virtual\n", None),
        ("[default]\nca_bundle = /ca.pem\n", None),
        ("[default]\nrole_arn = arn:aws:iam::1:role/r\n", None),
        ("region = eu-north-1\n", None),  # no section: botocore cannot read it either
    ],
)
def test_the_aws_config_file_is_read_as_botocore_would(tmp_path, text, region):
    """The default profile's region is the store's where no option or variable names one
    (botocore's order); a default profile that says anything else about connecting (an
    endpoint, an addressing style, a CA bundle, a role) sends the store to s3fs, which
    follows it."""
    (tmp_path / "config").write_text(text)
    env = {**ENV, "AWS_CONFIG_FILE": str(tmp_path / "config")}
    found = config_of("s3://b/r", {"endpoint_url": "http://h:1"}, env)
    assert (found.region if found else None) == region
    if region is not None:  # a region named in the environment wins over the file's
        found = config_of("s3://b/r", {}, {**env, "AWS_DEFAULT_REGION": "ap-south-1"})
        assert found is not None and found.region == "ap-south-1"
        assert found.host == "s3.ap-south-1.amazonaws.com"


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


def test_a_process_on_obstore_never_imports_s3fs(s3_endpoint, tmp_path):
    """A store opened, listed, read and written through obstore imports neither s3fs nor
    its libraries (nor fsspec)."""
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
assert store.snapshot().to_arrow().num_rows == 4
heavy = sorted(m for m in sys.modules if m.split(".")[0] in libraries)
assert not heavy, heavy
assert "obstore" in sys.modules
print("ok")
"""
    from dynstate import Store

    Store.open(url, create=True).append([{"x": 1}, {"x": 2}, {"x": 3}])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# -- what S3 tells a client: a bucket's region, its clock; idle connections it closed ------


class _FakeS3:
    """A loopback HTTP server answering GETs and HEADs as S3 would in one situation: ``region`` (the
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

            def do_HEAD(self) -> None:
                if "authorization" not in self.headers:  # the bucket's, asked unsigned
                    fake.requests.append("unsigned")
                    return self._reply(403, b"", {"x-amz-bucket-region": "eu-west-1"}, head=True)
                self.do_GET(head=True)

            def do_GET(self, head: bool = False) -> None:
                auth = self.headers.get("authorization", "")
                region = auth.split("Credential=", 1)[1].split("/")[2]
                stamp = dt.datetime.strptime(self.headers["x-amz-date"], "%Y%m%dT%H%M%SZ")
                stamp = stamp.replace(tzinfo=dt.timezone.utc)
                fake.requests.append(region)
                server_now = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2)
                if fake.mode == "region" and region != "eu-west-1":
                    return self._reply(  # (S3 sends a HEAD's refusal without the body)
                        400,
                        b"<Error><Code>AuthorizationHeaderMalformed</Code><Message>the region"
                        b" is wrong</Message><Region>eu-west-1</Region></Error>",
                        {"x-amz-bucket-region": "eu-west-1"},
                        head=head,
                    )
                if fake.mode == "skew" and abs((stamp - server_now).total_seconds()) > 900:
                    when = server_now.strftime("%Y-%m-%dT%H:%M:%SZ").encode()
                    return self._reply(
                        403,
                        b"<Error><Code>RequestTimeTooSkewed</Code><Message>too far</Message>"
                        b"<ServerTime>" + when + b"</ServerTime></Error>",
                    )
                self._reply(
                    200,
                    b"the body",
                    {"ETag": '"1"', "Last-Modified": "Sun, 06 Dec 2026 08:00:00 GMT"},
                    head=head,
                )
                if fake.mode == "close":
                    self.close_connection = True  # and no "Connection: close" said

            def _reply(
                self, status: int, body: bytes, headers: dict | None = None, head: bool = False
            ) -> None:
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
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


def _fake_storage(url: str, monkeypatch, env: dict | None = None) -> ObstoreStorage:
    """An ``s3://bucket/run`` store on the fake server, one attempt per request (no retry
    of obstore's or the store's hides a second request)."""
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    options = {
        "endpoint_url": url,
        "key": "k",
        "secret": "s",
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 0}},
    }
    storage = open_storage("s3://bucket/run", options)
    assert isinstance(storage, ObstoreStorage) and storage.served
    assert storage._config is not None and storage._config.attempts == 1
    storage.retry_attempts = 1
    return storage


@pytest.mark.parametrize("fake_s3", ["region"], indirect=True)
def test_a_bucket_in_another_region_is_read_there(fake_s3, monkeypatch):
    storage = _fake_storage(fake_s3.url, monkeypatch)
    assert storage.read("key") == b"the body"
    assert storage.read("key") == b"the body"  # remembered: no second refusal
    assert fake_s3.requests == ["us-east-1", "eu-west-1", "eu-west-1"]


@pytest.mark.parametrize("fake_s3", ["region"], indirect=True)
def test_a_refusal_without_a_body_asks_the_bucket_its_region(fake_s3, monkeypatch):
    """A HEAD's refusal has no body to name the region in: an unsigned HEAD of the bucket
    reads it from ``x-amz-bucket-region``."""
    storage = _fake_storage(fake_s3.url, monkeypatch)
    assert storage.size("key") == len(b"the body")
    assert fake_s3.requests == ["us-east-1", "unsigned", "eu-west-1"]


@pytest.mark.parametrize("fake_s3", ["skew"], indirect=True)
def test_a_host_clock_hours_off_is_told_to_fix_it(fake_s3, monkeypatch):
    """Neither obstore nor botocore signs by S3's clock: the refusal is a typed error that
    says what to fix, and is not retried."""
    storage = _fake_storage(fake_s3.url, monkeypatch)
    storage.retry_attempts = 3
    with pytest.raises(StorageError, match="clock") as caught:
        storage.read("key")
    assert "RequestTimeTooSkewed" in str(caught.value) and "s3://bucket/run" in str(caught.value)
    assert len(fake_s3.requests) == 1


@pytest.mark.parametrize("fake_s3", ["close"], indirect=True)
def test_a_connection_the_server_closed_while_idle_is_replaced(fake_s3, monkeypatch):
    """A request sent on a connection the server closed never reached it: the client sends
    it again on a new one (obstore's retry of an idempotent request), and the store's own
    retry is never needed."""
    storage = _fake_storage(fake_s3.url, monkeypatch)
    storage._config = dataclasses.replace(storage._config, attempts=DEFAULT_ATTEMPTS)
    storage._s3 = None
    for _ in range(4):
        assert storage.read("key") == b"the body"  # storage.retry_attempts is 1
    assert len(fake_s3.requests) == 4


@pytest.mark.parametrize("fake_s3", ["plain"], indirect=True)
def test_threads_share_keep_alive_connections(fake_s3, monkeypatch):
    """``dynstate serve`` answers each request on a thread of its own: those threads take
    the connection the last one left instead of each opening (on HTTPS, handshaking) its
    own."""
    import threading

    storage = _fake_storage(fake_s3.url, monkeypatch)
    got: list[bytes] = []
    for _ in range(20):  # one short-lived thread per request, one after the other
        thread = threading.Thread(target=lambda: got.append(storage.read("key")))
        thread.start()
        thread.join()
    assert got == [b"the body"] * 20
    # The client hands a connection back to its pool on its own runtime, so on a busy
    # machine the next request may start first and open another: a bound, not "one". A
    # client without keep-alive opens one per request.
    assert fake_s3.connections <= 20 // 2

    errors: list[BaseException] = []

    def many() -> None:
        try:
            for _ in range(25):
                assert storage.read("key") == b"the body"
        except BaseException as exc:
            errors.append(exc)

    before = fake_s3.connections
    threads = [threading.Thread(target=many) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(fake_s3.requests) == 20 + 6 * 25
    assert fake_s3.connections - before <= 6 * 25 // 4  # six readers, 150 requests


def _untrusted_endpoint(tmp_path) -> tuple[str, str, str]:
    """A certificate for 127.0.0.1 signed by an authority no trust store holds: the
    authority's certificate, the endpoint's and its key (PEM files). (An authority and a
    leaf, because rustls, unlike OpenSSL, refuses an authority's certificate as a server's.)"""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)

    def signed(subject, issuer, public_key, signer, *extensions):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    authority_key, key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    authority = signed(
        "test authority",
        "test authority",
        authority_key.public_key(),
        authority_key,
        (x509.BasicConstraints(ca=True, path_length=None), True),
        (x509.KeyUsage(False, False, False, False, False, True, True, False, False), True),
    )
    leaf = signed(
        "127.0.0.1",
        "test authority",
        key.public_key(),
        authority_key,
        (x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False),
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
    )
    files = tmp_path / "authority.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    files[0].write_bytes(authority.public_bytes(serialization.Encoding.PEM))
    files[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    files[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(files[0]), str(files[1]), str(files[2])


def test_tls_is_verified_against_the_trust_store_or_aws_ca_bundle(tmp_path, monkeypatch):
    """An endpoint whose certificate the trust store does not hold is refused (never read
    unverified, never retried as transient); with AWS_CA_BUNDLE naming it, it is read."""
    authority, cert, key = _untrusted_endpoint(tmp_path)
    fake = _FakeS3("plain", tls=(cert, key))
    try:
        untrusted = _fake_storage(fake.url, monkeypatch)
        untrusted.retry_attempts = 3
        with pytest.raises(StorageError, match="certificate") as caught:
            untrusted.read("key")
        assert not is_transient(caught.value.__cause__ or caught.value)
        assert fake.requests == []  # nothing was sent over the unverified connection
        trusted = _fake_storage(fake.url, monkeypatch, {"AWS_CA_BUNDLE": authority})
        assert trusted.read("key") == b"the body"
        assert len(fake.requests) == 1
    finally:
        fake.close()
