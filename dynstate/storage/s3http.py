"""A read-only S3 client on the standard library: GET (whole or ranged), HEAD and
ListObjectsV2, signed with AWS Signature Version 4 over ``http.client``.

Why it exists: a command that only reads a store (``dynstate ls``, ``info``, ``show``, a
row page of ``dynstate serve``, a loader's reads) paid, through s3fs, for importing
aiobotocore, aiohttp and botocore (~0.65 s on the development machine) and for building a
botocore client (loading and decoding the S3 service model, ~0.1 s) before its first
request, and 3-4 ms of client CPU per request after it; a fresh ``dynstate ls --limit 20``
on S3 took 5 times as long as Delta's ``history(20)``. This client needs ``http.client``,
``hmac`` and ``xml.etree`` and costs a request a few hundred microseconds.

It serves only configurations it understands completely, so that it never reads with
credentials, an endpoint or a region other than those s3fs would have used:
:func:`config_of` returns ``None`` — and the store reads through s3fs as before — for
anything else: credentials from a profile, SSO, a role or instance metadata (only explicit
options and the ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``
variables are used, and not when ``AWS_PROFILE`` names a profile); an AWS endpoint whose
region is not named in the options or the environment; proxies, a custom CA bundle,
``anon``, or any storage option, ``client_kwargs`` or ``config_kwargs`` key beyond the
few below. ``DYNSTATE_S3_CLIENT=s3fs`` turns it off. Writes always go through s3fs.

Failures raise what s3fs raises, so the one client-error table
(:mod:`dynstate.storage.errors`) and the retry rules (:mod:`dynstate.storage.retry`) apply
unchanged: ``FileNotFoundError`` for a missing key or bucket (its cause an
:class:`S3ResponseError` carrying S3's code), ``PermissionError`` for a refusal,
:class:`S3ResponseError` (botocore's ``ClientError`` shape: ``.response["Error"]["Code"]``
and the HTTP status) for other replies, builtin ``ConnectionError`` / ``TimeoutError`` for
transport failures and bodies cut short. Transient ones are retried here as botocore's
standard mode would (``retries.max_attempts`` + 1 attempts in all), under the store's own
retries.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import logging
import os
import ssl
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote, unquote_plus, urlsplit

from .retry import backoff, is_transient

log = logging.getLogger("dynstate")

#: Storage options this client understands (s3fs's names); any other goes to s3fs.
KNOWN_OPTIONS = frozenset(
    {
        "key",
        "secret",
        "token",
        "endpoint_url",
        "client_kwargs",
        "config_kwargs",
        "use_listings_cache",
        "listings_expiry_time",
        "skip_instance_cache",
    }
)
_CLIENT_KWARGS = frozenset(
    {
        "endpoint_url",
        "region_name",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
    }
)
_CONFIG_KWARGS = frozenset({"retries", "connect_timeout", "read_timeout", "region_name"})
# What would make botocore connect, trust or authenticate differently from this client.
_FOREIGN_ENV = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_USE_FIPS_ENDPOINT",
    "AWS_USE_DUALSTACK_ENDPOINT",
    "AWS_S3_US_EAST_1_REGIONAL_ENDPOINT",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
)
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
#: botocore's defaults (seconds, attempts in all)
DEFAULT_CONNECT_TIMEOUT_S = 60.0
DEFAULT_READ_TIMEOUT_S = 60.0
DEFAULT_ATTEMPTS = 3
# Idle keep-alive connections kept per host: more than the read pool's threads
# (objectstore.max_parallel_reads) and a server's request threads use at once.
_IDLE_PER_HOST = 32


class S3ResponseError(Exception):
    """An S3 error reply, in the shape of botocore's ``ClientError`` (``response``)."""

    def __init__(self, status: int, code: str, message: str, operation: str, path: str):
        self.response = {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status},
        }
        self.status = status
        self.code = code
        super().__init__(
            f"An error occurred ({code}) when calling the {operation} operation on {path}: "
            f"{message or http.client.responses.get(status, 'error')} (HTTP {status})"
        )


@dataclass(frozen=True)
class S3Config:
    """Where and as whom to read: everything a signed request needs."""

    scheme: str  # "http" or "https"
    host: str  # host[:port] of the endpoint
    path_style: bool  # /bucket/key, or the bucket in the host name (AWS's own endpoints)
    region: str
    key: str
    secret: str
    token: str | None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    attempts: int = DEFAULT_ATTEMPTS
    ca_bundle: str | None = None  # AWS_CA_BUNDLE; None: certifi's, as botocore's default

    def __repr__(self) -> str:  # never the secret
        return f"S3Config({self.scheme}://{self.host}, region={self.region})"


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def config_of(url: str, options: dict[str, Any], env: Any = None) -> S3Config | None:
    """The client configuration for ``url`` with storage ``options``, or None where s3fs
    must serve it (see the module's docstring)."""
    env = os.environ if env is None else env
    if env.get("DYNSTATE_S3_CLIENT", "").lower() == "s3fs":
        return None
    if root_of(url) is None:
        return None
    if not set(options) <= KNOWN_OPTIONS or any(env.get(name) for name in _FOREIGN_ENV):
        return None
    client = options.get("client_kwargs") or {}
    config = options.get("config_kwargs") or {}
    if not isinstance(client, dict) or not isinstance(config, dict):
        return None
    if not set(client) <= _CLIENT_KWARGS or not set(config) <= _CONFIG_KWARGS:
        return None
    # Credentials: explicit options, else the environment (botocore's order); never a
    # profile, a role or instance metadata.
    key = _str(options.get("key")) or _str(client.get("aws_access_key_id"))
    secret = _str(options.get("secret")) or _str(client.get("aws_secret_access_key"))
    token = _str(options.get("token")) or _str(client.get("aws_session_token"))
    if key is None and secret is None and token is None:
        key, secret = _str(env.get("AWS_ACCESS_KEY_ID")), _str(env.get("AWS_SECRET_ACCESS_KEY"))
        token = _str(env.get("AWS_SESSION_TOKEN"))
    if key is None or secret is None:
        return None  # none, or a partial pair: s3fs finds others or reports it
    endpoint = (
        _str(options.get("endpoint_url"))
        or _str(client.get("endpoint_url"))
        or _str(env.get("AWS_ENDPOINT_URL_S3"))
        or _str(env.get("AWS_ENDPOINT_URL"))
    )
    region = (
        _str(client.get("region_name"))
        or _str(config.get("region_name"))
        or _str(env.get("AWS_REGION"))
        or _str(env.get("AWS_DEFAULT_REGION"))
    )
    if region is None:
        if endpoint is None or os.path.exists(_config_file(env)):
            return None  # the region is the config file's, or for s3fs to discover
        region = "us-east-1"  # botocore's for an endpoint of one's own
    if endpoint is None:
        scheme, host, path_style = "https", f"s3.{region}.amazonaws.com", False
    else:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
            return None
        scheme, host, path_style = parts.scheme, parts.netloc, True
    try:
        retries = config.get("retries") or {}
        attempts = int(retries.get("max_attempts", DEFAULT_ATTEMPTS - 1)) + 1
        connect = float(config.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT_S))
        read = float(config.get("read_timeout", DEFAULT_READ_TIMEOUT_S))
    except (TypeError, ValueError, AttributeError):
        return None  # s3fs reports the bad configuration
    if not isinstance(retries, dict) or attempts < 1 or connect <= 0 or read <= 0:
        return None
    ca_bundle = _str(env.get("AWS_CA_BUNDLE"))
    return S3Config(
        scheme, host, path_style, region, key, secret, token, connect, read, attempts, ca_bundle
    )


def root_of(url: str) -> str | None:
    """``bucket/prefix`` of an ``s3://`` URL, as s3fs's ``url_to_fs`` gives it; None for a
    URL whose form s3fs would read otherwise (a query, a fragment, an empty segment)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("s3", "s3a"):
        return None
    root = rest.rstrip("/")
    if not root or any(c in root for c in "?#") or "" in root.split("/"):
        return None
    return root


def _config_file(env: Any) -> str:
    return env.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")


def _dns_bucket(bucket: str) -> bool:
    """Whether ``bucket`` may go in the host name (no dots: they break the certificate)."""
    return (
        3 <= len(bucket) <= 63
        and bucket.replace("-", "").isalnum()
        and bucket.islower()
        and bucket[0].isalnum()
        and bucket[-1].isalnum()
    )


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path.lstrip("/").partition("/")
    return bucket, key


def _query_string(query: dict[str, str]) -> str:
    return "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items())
    )


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


class S3Reader:
    """GETs, HEADs and listings of one endpoint; safe to share between threads and across a
    fork (a child opens its own connections). Keep-alive connections are shared by every
    thread through an idle pool: one request holds a connection at a time, and a thread
    that lives for one request (``dynstate serve``'s) takes a warm one instead of opening,
    and on HTTPS handshaking, its own."""

    def __init__(self, config: S3Config) -> None:
        self.config = config
        # (pid, host -> idle connections); replaced whole in a forked child, without a lock
        # a fork could leave held (list pop and append are atomic).
        self._idle: tuple[int, dict[str, list[http.client.HTTPConnection]]] = (os.getpid(), {})
        self._signing_keys: dict[tuple[str, str], bytes] = {}
        self._tls_context: ssl.SSLContext | None = None
        # What S3 told us: a bucket's region when it is not the configured one (botocore
        # follows the same redirects), and how far this host's clock is from S3's.
        self._regions: dict[str, str] = {}
        self._skew_s = 0.0

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled with its storage for spawned workers: connections do not travel.
        return (S3Reader, (self.config,))

    # -- signing ---------------------------------------------------------------------------

    def _signing_key(self, day: str, region: str) -> bytes:
        found = self._signing_keys.get((day, region))
        if found is None:
            k = _hmac(f"AWS4{self.config.secret}".encode(), day)
            for part in (region, "s3", "aws4_request"):
                k = _hmac(k, part)
            found = self._signing_keys[(day, region)] = k
        return found

    def signed_headers(
        self,
        method: str,
        host: str,
        uri: str,
        query: dict[str, str],
        now: datetime,
        region: str | None = None,
    ) -> dict[str, str]:
        """The headers of a request signed with SigV4 at ``now`` (UTC) for ``region`` (the
        configured one by default); ``uri`` already percent-encoded as sent (S3 does not
        encode it twice)."""
        region = region or self.config.region
        stamp = now.strftime("%Y%m%dT%H%M%SZ")
        day = stamp[:8]
        headers = {"host": host, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": stamp}
        if self.config.token:
            headers["x-amz-security-token"] = self.config.token
        names = sorted(headers)
        canonical = "\n".join(
            [
                method,
                uri,
                _query_string(query),
                "".join(f"{n}:{headers[n].strip()}\n" for n in names),
                ";".join(names),
                _EMPTY_SHA256,
            ]
        )
        scope = f"{day}/{region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        key = self._signing_key(day, region)
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.config.key}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )
        return headers

    # -- requests --------------------------------------------------------------------------

    def _address(self, bucket: str, key: str) -> tuple[str, str]:
        """(host, percent-encoded path) of an object (or of the bucket, for ``key=""``)."""
        host = self.config.host
        if not self.config.path_style:  # AWS's own endpoint: the bucket's region's
            host = f"s3.{self._regions.get(bucket, self.config.region)}.amazonaws.com"
        if self.config.path_style or not _dns_bucket(bucket):
            return host, "/" + quote(bucket + ("/" + key if key else ""), safe="/~")
        return f"{bucket}.{host}", "/" + quote(key, safe="/~")

    def _pool(self) -> dict[str, list[http.client.HTTPConnection]]:
        pid, pool = self._idle
        if pid != os.getpid():  # a forked child never uses its parent's sockets
            pool = {}
            self._idle = (os.getpid(), pool)
        return pool

    def _checkout(self, host: str) -> http.client.HTTPConnection:
        """An idle connection to ``host``, this caller's alone until :meth:`_checkin`, or a
        new one (not yet connected)."""
        idle = self._pool().get(host)
        while idle:
            try:
                return idle.pop()
            except IndexError:  # another thread took the last one
                break
        return self._new(host)

    def _new(self, host: str) -> http.client.HTTPConnection:
        timeout = self.config.connect_timeout
        if self.config.scheme == "https":
            return http.client.HTTPSConnection(host, timeout=timeout, context=self._tls())
        return http.client.HTTPConnection(host, timeout=timeout)

    def _checkin(self, host: str, conn: http.client.HTTPConnection) -> None:
        idle = self._pool().setdefault(host, [])
        if conn.sock is not None and len(idle) < _IDLE_PER_HOST:
            idle.append(conn)
        else:
            conn.close()

    def _tls(self) -> ssl.SSLContext:
        if self._tls_context is None:
            cafile = self.config.ca_bundle
            if cafile is None:
                try:
                    import certifi  # botocore's default trust store

                    cafile = certifi.where()
                except ImportError:
                    cafile = None
            self._tls_context = ssl.create_default_context(cafile=cafile)
        return self._tls_context

    def _once(
        self,
        method: str,
        host: str,
        uri: str,
        query: dict[str, str],
        extra: dict[str, str],
        region: str,
    ) -> tuple[int, http.client.HTTPResponse, bytes]:
        now = datetime.fromtimestamp(time.time() + self._skew_s, timezone.utc)
        headers = self.signed_headers(method, host, uri, query, now, region)
        headers.update(extra)
        target = uri + ("?" + _query_string(query) if query else "")
        conn = self._checkout(host)
        try:
            reused = conn.sock is not None
            try:
                if not reused:
                    conn.connect()
                    conn.sock.settimeout(self.config.read_timeout)
                conn.request(method, target, headers=headers)
                response = conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                if not reused:
                    raise
                # A kept-alive connection the server closed while idle: no request reached
                # it on that connection (and reads repeat safely). A new one, not an attempt
                # (nor another idle one: the server may have closed those as well).
                conn.close()
                conn = self._new(host)
                conn.connect()
                conn.sock.settimeout(self.config.read_timeout)
                conn.request(method, target, headers=headers)
                response = conn.getresponse()
            body = response.read()
        except http.client.IncompleteRead as exc:
            conn.close()
            raise ConnectionError(
                f"the reply was cut short ({len(exc.partial)} bytes of "
                f"{len(exc.partial) + (exc.expected or 0)})"
            ) from None
        except http.client.HTTPException as exc:
            conn.close()  # a reply that is not HTTP: the connection is unusable
            raise ConnectionError(f"unreadable reply: {type(exc).__name__}: {exc}") from None
        except BaseException:  # a timeout, a reset, an interrupt mid-reply: never reused
            conn.close()
            raise
        if response.will_close:
            conn.close()
        else:
            self._checkin(host, conn)
        return response.status, response, body

    def _request(
        self,
        operation: str,
        method: str,
        path: str,
        query: dict[str, str] | None = None,
        extra: dict[str, str] | None = None,
        ok: tuple[int, ...] = (200,),
    ) -> tuple[http.client.HTTPResponse, bytes]:
        bucket, key = _split(path)
        attempts, attempt, corrected = self.config.attempts, 0, False
        while True:
            region = self._regions.get(bucket, self.config.region)
            host, uri = self._address(bucket, key)
            try:
                status, response, body = self._once(
                    method, host, uri, query or {}, extra or {}, region
                )
                if status in ok:
                    return response, body
                if not corrected and self._corrected(bucket, region, status, response, body):
                    corrected = True  # once: S3 named the region or its clock; ask again
                    continue
                raise _error(status, body, operation, path)
            except Exception as exc:
                attempt += 1
                if attempt < attempts and is_transient(exc):
                    time.sleep(backoff(attempt - 1, 0.05, 2.0))
                    continue
                raise

    def _corrected(self, bucket: str, region: str, status: int, response: Any, body: bytes) -> bool:
        """Learn from a refusal what botocore learns from it: the bucket's region (a 301 or
        400 naming another, as S3 does for a request signed for the wrong region) or S3's
        clock (``RequestTimeTooSkewed``: this host's clock is over 15 minutes off). True
        when the request is worth sending again."""
        told = response.getheader("x-amz-bucket-region")
        code, fields = _error_fields(body)
        told = told or fields.get("Region")
        if status in (301, 307, 400) and told and told != region:
            log.info("bucket %s is in region %s, not %s: reading it there", bucket, told, region)
            self._regions[bucket] = told
            return True
        server = fields.get("ServerTime")
        if code == "RequestTimeTooSkewed" and server:
            try:
                stamp = datetime.fromisoformat(server.replace("Z", "+00:00")).timestamp()
            except ValueError:
                return False
            self._skew_s = stamp - time.time()
            log.warning(
                "this host's clock is %.0f s off S3's (RequestTimeTooSkewed); signing by "
                "S3's clock (fix the host's time: s3fs and other clients will fail)",
                -self._skew_s,
            )
            return True
        return False

    # -- the operations ----------------------------------------------------------------------

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or ``[start, end)`` of them."""
        if start is None and end is None:
            return self._request("GetObject", "GET", path)[1]
        first = start or 0
        if end is not None and end <= first:
            return b""
        spec = f"bytes={first}-{end - 1}" if end is not None else f"bytes={first}-"
        try:
            response, body = self._request(
                "GetObject", "GET", path, extra={"range": spec}, ok=(200, 206)
            )
        except S3ResponseError as exc:
            if exc.status == 416:  # the range starts past the end, as a slice would
                return b""
            raise
        if response.status == 200:  # the server sent it whole
            return body[first:end]
        return body

    def info(self, path: str) -> dict[str, Any]:
        """``{"size", "mtime"}`` of an object (``mtime`` a POSIX timestamp, or None)."""
        response, _ = self._request("HeadObject", "HEAD", path)
        stamp = response.getheader("Last-Modified")
        mtime = parsedate_to_datetime(stamp).timestamp() if stamp else None
        return {"size": int(response.getheader("Content-Length") or 0), "mtime": mtime}

    def ls(self, path: str) -> list[str]:
        """Paths (``bucket/key``) of the objects and folders directly under ``path``, as
        s3fs's ``ls(detail=False)`` gives them; [] for an empty or missing folder."""
        bucket, key = _split(path.rstrip("/"))
        prefix = key + "/" if key else ""
        found: list[str] = []
        query = {"list-type": "2", "prefix": prefix, "delimiter": "/", "encoding-type": "url"}
        while True:
            _, body = self._request("ListObjectsV2", "GET", bucket, query=query)
            root = ET.fromstring(body)
            for item in root.iter(f"{_NS}Contents"):
                name = _unquote_text(item.findtext(f"{_NS}Key"))
                if name != prefix:  # a folder's own marker object
                    found.append(f"{bucket}/{name}")
            for item in root.iter(f"{_NS}CommonPrefixes"):
                found.append(f"{bucket}/{_unquote_text(item.findtext(f'{_NS}Prefix')).rstrip('/')}")
            token = root.findtext(f"{_NS}NextContinuationToken")
            if root.findtext(f"{_NS}IsTruncated") != "true" or not token:
                return found
            query = {**query, "continuation-token": token}


def _unquote_text(text: str | None) -> str:
    return unquote_plus(text or "")  # encoding-type=url, decoded as botocore does


def _error_fields(body: bytes) -> tuple[str | None, dict[str, str]]:
    """(Code, the other fields) of an S3 error body; (None, {}) if it is none."""
    if not body:
        return None, {}
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return None, {}
    fields = {child.tag: (child.text or "") for child in root}
    return fields.get("Code") or None, fields


def _error(status: int, body: bytes, operation: str, path: str) -> Exception:
    code, fields = _error_fields(body)
    message = fields.get("Message", "")
    if code is None:
        code = str(status)  # a HEAD's reply has no body: botocore reports the status
        if body and not fields:
            message = body[:200].decode("utf-8", "replace")
    reply = S3ResponseError(status, code, message, operation, path)
    if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound"):
        missing = FileNotFoundError(2, f"{path} not found ({code})", path)
        missing.__cause__ = reply
        return missing
    if status == 403:
        denied = PermissionError(13, f"{path}: access denied ({code})", path)
        denied.__cause__ = reply
        return denied
    return reply
