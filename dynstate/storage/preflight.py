"""Checks an interactive program (the CLI, ``dynstate serve``) asks for before it opens a
store, so that a mistyped endpoint or option fails within seconds and in one line, instead
of after minutes of retries or with a raw error from deep inside a client library:

* :func:`check_options` — the storage options s3fs takes as dicts are dicts, and
  ``config_kwargs`` makes a valid botocore ``Config``;
* :func:`fail_fast` — short connect timeouts and few botocore retries where the user set none;
* :func:`preflight` — the S3 endpoint (explicit, or AWS's regional host) accepts connections;
* :func:`missing_bucket` — after "no store here": is it the bucket that is missing?

A library user keeps the store's patient defaults: none of this runs inside ``Store.open``.
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlsplit

from ..errors import DynstateError, InvalidDataError, StorageError, StoreNotFoundError
from .credentials import redact, split_userinfo

#: What an interactive command waits for: a few seconds per connect, few botocore attempts
#: (the store's own retries come on top).
FAIL_FAST_S3_CONFIG: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 30,
    "retries": {"max_attempts": 2},
}
PREFLIGHT_TIMEOUT_S = 5.0

_S3 = ("s3", "s3a")


def _is_s3(url: str) -> bool:
    return url.split("://", 1)[0].lower() in _S3 if "://" in url else False


def check_options(options: dict[str, Any]) -> None:
    """:func:`check_shapes`, and refuse a ``config_kwargs`` botocore cannot make a
    ``Config`` of (InvalidDataError naming the option)."""
    if not options:
        return
    from .connect import STRUCTURED_OPTIONS, check_shapes

    check_shapes(options)
    config = options.get("config_kwargs")
    if config is None:
        return
    try:
        from botocore.config import Config
    except ImportError:
        return  # no s3 extra: opening an s3:// URL says what to install
    try:
        Config(**config)
    except Exception as exc:
        raise InvalidDataError(
            f"config_kwargs is not a valid botocore Config ({' '.join(str(exc).split())}); e.g. "
            f"config_kwargs={STRUCTURED_OPTIONS['config_kwargs']}"
        ) from None


def fail_fast(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with short connect timeouts and few botocore retries for ``s3://`` where
    the user set none; other URLs' options unchanged."""
    if not _is_s3(url):
        return options
    out = dict(options)
    config = dict(out.get("config_kwargs") or {})
    for key, value in FAIL_FAST_S3_CONFIG.items():
        config.setdefault(key, value)
    out["config_kwargs"] = config
    return out


def endpoint_of(options: dict[str, Any]) -> str | None:
    """The S3 endpoint a store will use, where it is set explicitly (options or environment)."""
    client = options.get("client_kwargs") or {}
    for value in (
        options.get("endpoint_url"),
        client.get("endpoint_url") if isinstance(client, dict) else None,
        os.environ.get("AWS_ENDPOINT_URL_S3"),
        os.environ.get("AWS_ENDPOINT_URL"),
    ):
        if value:
            return str(value)
    return None


def _connects(host: str, port: int) -> str | None:
    """None if ``host:port`` accepts a connection within the preflight timeout, else why not."""
    try:
        socket.create_connection((host, port), timeout=PREFLIGHT_TIMEOUT_S).close()
    except OSError as exc:
        return "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
    return None


def preflight(url: str, options: dict[str, Any]) -> None:
    """For an ``s3://`` URL: fail within seconds, in one line, when the explicitly set S3
    endpoint is malformed or does not accept connections (InvalidDataError, StorageError);
    with no endpoint set, when AWS's regional host cannot be reached. Other URLs pass."""
    if not _is_s3(url):
        return
    # The URL's own mistakes first (credentials in it, a query, a '..' segment), offline and
    # by the checks Store.open makes: an unreachable endpoint must not hide them.
    from . import open_storage

    open_storage(url, options)
    where = url.partition("://")[2].split("?", 1)[0].split("#", 1)[0].rstrip("/")
    if not where or "" in where.split("/"):
        raise InvalidDataError(
            f"{redact(url)} is not a store URL; write s3://bucket/prefix, with a bucket and "
            "no empty path segment"
        )
    endpoint = endpoint_of(options)
    if endpoint is None:
        _check_aws_reachable(options)
        return
    shown = redact(endpoint)
    if split_userinfo(endpoint)[1] is not None:
        # botocore refuses to sign such a request, on every attempt: not worth a retry.
        raise InvalidDataError(
            f"the S3 endpoint {shown!r} has credentials in it; pass them as AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY (or the storage options key=... and secret=...) "
            "and the endpoint as http(s)://host:port"
        )
    try:
        parts = urlsplit(endpoint)
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise InvalidDataError(
            f"the S3 endpoint {shown!r} is not a valid URL ({exc}); fix AWS_ENDPOINT_URL or "
            "the storage option endpoint_url=http://host:port"
        ) from None
    if parts.scheme not in ("http", "https") or not host:
        raise InvalidDataError(
            f"the S3 endpoint {shown!r} is not an http(s) URL; fix AWS_ENDPOINT_URL or "
            "the storage option endpoint_url=http://host:port"
        )
    port = port or (443 if parts.scheme == "https" else 80)
    reason = _connects(host, port)
    if reason is not None:
        raise StorageError(
            f"cannot reach the S3 endpoint {parts.scheme}://{host}:{port} ({reason}); check "
            "that it is up, and AWS_ENDPOINT_URL or the endpoint_url storage option"
        )


def _check_aws_reachable(options: dict[str, Any]) -> None:
    """With no endpoint set, the store is on AWS S3. Behind a proxy the direct connection
    proves nothing, so the check is left to botocore there."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY")):
        return
    client = options.get("client_kwargs") or {}
    region = (
        (client.get("region_name") if isinstance(client, dict) else None)
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
    )
    host = f"s3.{region}.amazonaws.com" if region else "s3.amazonaws.com"
    reason = _connects(host, 443)
    if reason is not None:
        raise StorageError(
            f"cannot reach AWS S3 at https://{host} ({reason}); check the network and the "
            "region (AWS_REGION), or set AWS_ENDPOINT_URL or the endpoint_url storage option "
            "for another S3 service"
        )


def missing_bucket(url: str, options: dict[str, Any]) -> str | None:
    """The bucket of an object-store URL if it does not exist (one request), else None —
    also when it cannot tell: the caller keeps its own error then."""
    from . import open_storage
    from .errors import NO_BUCKET, row_of

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("s3", "s3a", "gs"):
        return None
    bucket = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    try:
        storage = open_storage(f"{scheme}://{bucket}", options)
        if scheme.lower() in _S3:
            return bucket if _s3_says_no_such_bucket(storage.fs, bucket) else None
        storage.list("")  # an empty bucket lists nothing; a missing one is refused
    except StoreNotFoundError as exc:
        return bucket if row_of(exc)[0] is NO_BUCKET else None
    except (DynstateError, OSError):
        return None
    return None


def _s3_says_no_such_bucket(fs: Any, bucket: str) -> bool:
    """True only when the endpoint itself answers S3's NoSuchBucket. A bare 404 (whatever HTTP
    server happens to listen at a mistyped endpoint), a refused connection or a timeout is not
    evidence of a missing bucket."""
    from .errors import NO_BUCKET, row_of

    try:
        fs.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1)
    except Exception as exc:
        return row_of(exc)[0] is NO_BUCKET
    return False
