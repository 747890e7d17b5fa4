"""What every command shares: the store URL and ``--storage-option``, ``--json``, parameter
types that turn bad input into usage errors (exit 2), opening a store with timeouts fit for an
interactive command, and the confirmation of destructive commands."""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import click

if TYPE_CHECKING:
    from ..store import Store

# Interactive commands must fail fast on an unreachable endpoint: a few seconds per connect,
# few botocore attempts (the store's own retries come on top).
CLI_S3_CONFIG = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2}}
PREFLIGHT_TIMEOUT_S = 5.0

json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print JSON (stable keys, see docs/cli.md)."
)
yes_option = click.option(
    "--yes", "-y", "yes", is_flag=True, help="Do it without asking (needed when not on a terminal)."
)


def store_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adds ``--storage-option`` (repeatable); the command receives ``storage_options``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, storage_option: tuple[str, ...], **kwargs: Any) -> Any:
        options = parse_storage_options(storage_option)
        remember_secrets("", options)
        return fn(*args, storage_options=options, **kwargs)

    return click.option(
        "--storage-option",
        "storage_option",
        multiple=True,
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable); VALUE is parsed as JSON where it can be. "
        "Endpoint and credentials otherwise come from the standard AWS environment.",
    )(wrapper)


def remember_secrets(url: str, options: dict[str, Any]) -> None:
    """Note the credentials of ``url`` and ``options`` on the command's context: everything
    the command prints (output and errors) goes through the one scrubber with them."""
    from ..storage.credentials import secrets_of

    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        known = ctx.meta.setdefault("dynstate.secrets", [])
        known.extend(s for s in secrets_of(url, options) if s not in known)


def secrets() -> list[str]:
    """The credentials :func:`remember_secrets` noted for the running command."""
    ctx = click.get_current_context(silent=True)
    return list(ctx.meta.get("dynstate.secrets", ())) if ctx is not None else []


def parse_storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(
                f"expected KEY=VALUE, got {pair!r}", param_hint="--storage-option"
            )
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    for key, example in _STRUCTURED_OPTIONS.items():
        if key in out and not isinstance(out[key], dict):
            raise click.BadParameter(
                f"{key} must be a JSON object, e.g. {key}={example}", param_hint="--storage-option"
            )
    if not isinstance(out.get("config_kwargs", {}).get("retries", {}), dict):
        example = _STRUCTURED_OPTIONS["config_kwargs"]
        raise click.BadParameter(
            f'the "retries" of config_kwargs must be a JSON object, e.g. config_kwargs={example}',
            param_hint="--storage-option",
        )
    if "config_kwargs" in out:
        _check_botocore_config(out["config_kwargs"])
    return out


# Options s3fs takes as dicts (anything else fails deep inside it with a raw AttributeError).
_STRUCTURED_OPTIONS = {
    "client_kwargs": '{"region_name": "eu-west-1"}',
    "config_kwargs": '{"retries": {"max_attempts": 5}}',
    "s3_additional_kwargs": '{"ServerSideEncryption": "AES256"}',
}


def _check_botocore_config(config: dict[str, Any]) -> None:
    """config_kwargs become a botocore ``Config``: build one now, so that a bad value is a
    usage error naming the option instead of a raw error from inside the first request."""
    try:
        from botocore.config import Config
    except ImportError:
        return  # no s3 extra: opening an s3:// URL says what to install
    try:
        Config(**config)
    except Exception as exc:
        raise click.BadParameter(
            f"config_kwargs is not a valid botocore Config ({' '.join(str(exc).split())}); e.g. "
            f"config_kwargs={_STRUCTURED_OPTIONS['config_kwargs']}",
            param_hint="--storage-option",
        ) from None


def version_arg(value: str | None) -> int | str | None:
    """A VERSION argument: a number, a tag name, or ``head``/absent for the head."""
    return None if value in (None, "head") else value


class Count(click.IntRange):
    """A whole number of at least ``min_value``; one larger than anything a machine can hold
    (``--limit 99999999999999999999999``) means "all" and is clamped to ``sys.maxsize``, so
    no overflow error from below ever reaches the user."""

    def __init__(self, min_value: int = 0) -> None:
        super().__init__(min=min_value)

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        return min(super().convert(value, param, ctx), sys.maxsize)


class Duration(click.ParamType):
    """``90``, ``30s``, ``15m``, ``2h``, ``7d``, ``1w`` -> seconds; anything else is a usage
    error (exit 2)."""

    name = "DURATION"
    _re = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
    _units = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        match = self._re.match(str(value))
        if match is None:
            self.fail(
                f"cannot read duration {value!r}; write e.g. 90, 30s, 15m, 2h, 7d or 1w", param, ctx
            )
        return float(match.group(1)) * self._units[match.group(2)]


class Size(click.ParamType):
    """``1000``, ``64MB`` (10^6), ``64MiB`` (2^20) -> bytes; anything else is a usage error."""

    name = "SIZE"
    _re = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        match = self._re.match(str(value))
        if match is None or float(match.group(1)) <= 0:
            self.fail(
                f"cannot read size {value!r}; write e.g. 128MiB, 100MB or 1048576", param, ctx
            )
        power = " kmgt".index(match.group(2).lower() or " ")
        size = float(match.group(1)) * (1024 if match.group(3) else 1000) ** power
        # Larger than anything (even float infinity for 400 digits) means "no limit".
        return int(size) if size < sys.maxsize else sys.maxsize


def cli_storage_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """The user's options, with short connect timeouts and few botocore retries for s3://
    where the user set none (a library user keeps the store's patient defaults)."""
    if url.split("://", 1)[0].lower() not in ("s3", "s3a"):
        return options
    out = dict(options)
    config = dict(out.get("config_kwargs") or {})
    for key, value in CLI_S3_CONFIG.items():
        config.setdefault(key, value)
    out["config_kwargs"] = config
    return out


def s3_endpoint(options: dict[str, Any]) -> str | None:
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


def check_endpoint(url: str, options: dict[str, Any]) -> None:
    """Fail within seconds, in one line, when an explicitly set S3 endpoint is malformed or
    does not accept connections, instead of after minutes of retries."""
    from ..errors import InvalidDataError, StorageError
    from ..storage.credentials import redact, split_userinfo

    if url.split("://", 1)[0].lower() not in ("s3", "s3a"):
        return
    endpoint = s3_endpoint(options)
    if endpoint is None:
        _check_aws_reachable(options)
        return
    shown = redact(endpoint)
    if split_userinfo(endpoint)[1] is not None:
        # botocore refuses to sign such a request, on every attempt: not worth a retry.
        raise InvalidDataError(
            f"the S3 endpoint {shown!r} has credentials in it; pass them as AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY (or --storage-option key=... --storage-option "
            "secret=...) and the endpoint as http(s)://host:port"
        )
    try:
        parts = urlsplit(endpoint)
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise InvalidDataError(
            f"the S3 endpoint {shown!r} is not a valid URL ({exc}); fix AWS_ENDPOINT_URL or "
            "--storage-option endpoint_url=http://host:port"
        ) from None
    if parts.scheme not in ("http", "https") or not host:
        raise InvalidDataError(
            f"the S3 endpoint {shown!r} is not an http(s) URL; fix AWS_ENDPOINT_URL or "
            "--storage-option endpoint_url=http://host:port"
        )
    port = port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=PREFLIGHT_TIMEOUT_S).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise StorageError(
            f"cannot reach the S3 endpoint {parts.scheme}://{host}:{port} ({reason}); check "
            "that it is up, and AWS_ENDPOINT_URL or --storage-option endpoint_url"
        ) from None


def _check_aws_reachable(options: dict[str, Any]) -> None:
    """With no endpoint set, the store is on AWS S3: fail within seconds when its regional host
    cannot be reached, rather than after botocore's connect retries. Behind a proxy the direct
    connection proves nothing, so the check is left to botocore there."""
    from ..errors import StorageError

    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY")):
        return
    client = options.get("client_kwargs") or {}
    region = (
        (client.get("region_name") if isinstance(client, dict) else None)
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
    )
    host = f"s3.{region}.amazonaws.com" if region else "s3.amazonaws.com"
    try:
        socket.create_connection((host, 443), timeout=PREFLIGHT_TIMEOUT_S).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise StorageError(
            f"cannot reach AWS S3 at https://{host} ({reason}); check the network and the "
            "region (AWS_REGION), or set AWS_ENDPOINT_URL / --storage-option endpoint_url for "
            "another S3 service"
        ) from None


def open_store(url: str, storage_options: dict[str, Any]) -> Store:
    """``Store.open`` with the CLI's timeouts, after a quick reachability check of an explicit
    S3 endpoint; a missing bucket is told apart from a prefix that holds no store."""
    from ..errors import StoreNotFoundError
    from ..storage import redact
    from ..store import Store

    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta["dynstate.url"] = redact(url)  # for errors raised below the store
    remember_secrets(url, storage_options)
    options = cli_storage_options(url, storage_options)
    check_endpoint(url, options)
    try:
        return Store.open(url, storage_options=options)
    except StoreNotFoundError:
        bucket = _missing_bucket(url, options)
        if bucket is not None:
            where = s3_endpoint(options) or "AWS S3"
            raise StoreNotFoundError(
                f"bucket {bucket!r} does not exist at {where} ({redact(url)}); check the bucket "
                "name and the endpoint (AWS_ENDPOINT_URL or --storage-option endpoint_url)"
            ) from None
        raise


def _missing_bucket(url: str, options: dict[str, Any]) -> str | None:
    """The bucket of an object-store URL if it does not exist (one HEAD request)."""
    from ..errors import DynstateError
    from ..storage import open_storage

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("s3", "s3a", "gs", "gcs"):
        return None
    bucket = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    try:
        storage = open_storage(f"{scheme}://{bucket}", options)
        if scheme.lower() in ("s3", "s3a"):
            return bucket if _s3_says_no_such_bucket(storage.fs, bucket) else None
        exists = storage.exists("")
    except (DynstateError, OSError):
        return None  # cannot tell: keep the original error
    return None if exists else bucket


def _s3_says_no_such_bucket(fs: Any, bucket: str) -> bool:
    """True only when the endpoint itself answers S3's NoSuchBucket. A bare 404 (whatever HTTP
    server happens to listen at a mistyped endpoint), a refused connection or a timeout is not
    evidence of a missing bucket."""
    from fsspec.asyn import sync

    from .errors import _chain

    try:
        sync(fs.loop, fs._call_s3, "list_objects_v2", Bucket=bucket, MaxKeys=1)
    except Exception as exc:
        return any(
            (getattr(e, "response", None) or {}).get("Error", {}).get("Code") == "NoSuchBucket"
            for e in _chain(exc)
        )
    return False


def confirm(question: str, yes: bool) -> bool:
    """True with ``--yes``; on a terminal, ask; otherwise False (the caller says to pass
    --yes). Never deletes on a script's behalf by default."""
    if yes:
        return True
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return False
    return click.confirm(question, default=False)
