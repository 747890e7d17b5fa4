"""What every command shares: the store URL and ``--storage-option``, ``--json``, parameter
types that turn bad input into usage errors (exit 2), opening a store with timeouts fit for an
interactive command, and the confirmation of destructive commands."""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from ..store import Store

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
    """``KEY=VALUE`` pairs as storage options: VALUE is JSON where it parses as JSON (with the
    store's bounds on nesting and number size), else the string itself. Bad shapes are usage
    errors (exit 2), checked by the storage package."""
    from ..errors import CorruptStoreError, InvalidDataError
    from ..records.manifest import load_json
    from ..storage.preflight import check_options

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(
                f"expected KEY=VALUE, got {pair!r}", param_hint="--storage-option"
            )
        try:
            out[key] = load_json(value, f"--storage-option {key}")
        except CorruptStoreError as exc:
            if not isinstance(exc.__cause__, (json.JSONDecodeError, UnicodeDecodeError)):
                # JSON, but nested or sized past what any option needs
                raise click.BadParameter(
                    f"the value of {key} is JSON too deeply nested or with too long a number; "
                    "pass a plain value or a small JSON object",
                    param_hint="--storage-option",
                ) from None
            out[key] = value  # not JSON: the string as written
    try:
        check_options(out)
    except InvalidDataError as exc:
        raise click.BadParameter(str(exc), param_hint="--storage-option") from None
    return out


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


class Finite(click.FloatRange):
    """A float in [min, max] (open below with ``min_open``); NaN and infinities are usage
    errors (exit 2) naming the flag, never passed to the library."""

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        import math

        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


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

    @staticmethod
    def _bytes(match: re.Match[str]) -> float:
        power = " kmgt".index(match.group(2).lower() or " ")
        return float(match.group(1)) * (1024 if match.group(3) else 1000) ** power

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        match = self._re.match(str(value))
        if match is None or float(match.group(1)) <= 0 or self._bytes(match) < 1:
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
    from ..storage.preflight import fail_fast

    return fail_fast(url, options)


def open_store(url: str, storage_options: dict[str, Any]) -> Store:
    """``Store.open`` with the CLI's timeouts, after the storage package's quick reachability
    check; a missing bucket is told apart from a prefix that holds no store."""
    from ..errors import StoreNotFoundError
    from ..storage import redact
    from ..storage.errors import S3, service_of
    from ..storage.preflight import endpoint_of, missing_bucket, preflight
    from ..store import Store

    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta["dynstate.url"] = redact(url)  # for errors raised below the store
    remember_secrets(url, storage_options)
    options = cli_storage_options(url, storage_options)
    preflight(url, options)
    try:
        return Store.open(url, storage_options=options)
    except StoreNotFoundError:
        bucket = missing_bucket(url, options)
        if bucket is not None:
            service = service_of(url)
            where = (endpoint_of(options) or "AWS S3") if service is S3 else service.name
            raise StoreNotFoundError(
                f"bucket {bucket!r} does not exist at {where} ({redact(url)}); check the bucket "
                f"name and the endpoint ({service.endpoint})"
            ) from None
        raise


def confirm(question: str, yes: bool) -> bool:
    """True with ``--yes``; on a terminal, ask; otherwise False (the caller says to pass
    --yes). Never deletes on a script's behalf by default."""
    if yes:
        return True
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return False
    return click.confirm(question, default=False)
