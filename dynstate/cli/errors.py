"""Failures as one line in command-line terms. The library's messages speak Python ("pass
force=True"); here they name flags. Errors that reach the CLI from a client library
(botocore, aiohttp) are recognised by name along the exception chain and explained."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import click

# Library phrasing -> the command line's.
_PHRASES = (
    (re.compile(r"pass force=True"), "pass --force"),
    (re.compile(r"pass overwrite=True \(--overwrite\)|pass overwrite=True"), "pass --overwrite"),
    (re.compile(r"pass version=None for the latest"), "`dynstate ls URL` lists them"),
    (
        re.compile(r"or pass create=True to make a new store there"),
        "or create one with dynstate.Store.open(url, create=True)",
    ),
    (re.compile(r"pass --steps"), "pass a larger --steps"),
)

# (exception class name or S3 error code, message template); {url} is the redacted URL.
_CLIENT_ERRORS = (
    (
        (
            "NoCredentialsError",
            "PartialCredentialsError",
            "CredentialRetrievalError",
            "ProfileNotFound",
        ),
        "no S3 credentials found for {url}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
        "(or AWS_PROFILE), or pass --storage-option key=... --storage-option secret=...",
    ),
    (
        ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden"),
        "S3 refused the credentials for {url}; check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
        "(or AWS_PROFILE) and the bucket's permissions",
    ),
    (
        ("NoSuchBucket",),
        "the bucket of {url} does not exist; check the bucket name and the endpoint",
    ),
    (
        (
            "EndpointConnectionError",
            "ConnectTimeoutError",
            "ConnectionClosedError",
            "ClientConnectorError",
            "ServerTimeoutError",
        ),
        "cannot reach the S3 endpoint of {url}; check that it is up, and AWS_ENDPOINT_URL or "
        "--storage-option endpoint_url",
    ),
)


class Failure(click.ClickException):
    """A command that ran and found a problem (``verify``): ``error: <message>``, exit 1."""

    def show(self, file: Any = None) -> None:
        from .render import clean

        click.echo(f"error: {clean(self.message)}", err=True)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 10:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _client_error(exc: BaseException, url: str) -> str | None:
    for link in _chain(exc):
        names = {type(k).__name__ for k in type(link).__mro__}
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            names.add(str(response.get("Error", {}).get("Code", "")))
        text = str(link)
        for keys, template in _CLIENT_ERRORS:
            if names.intersection(keys) or any(k in text for k in keys):
                return template.format(url=url)
        if "Unable to locate credentials" in text:
            return _CLIENT_ERRORS[0][1].format(url=url)
    return None


def one_line(exc: BaseException, url: str | None = None, secrets: Iterable[str] = ()) -> str:
    """The message printed after ``error: ``, without credentials (the package's one
    scrubber, with the command's own ``secrets`` besides those the process knows)."""
    from ..errors import DynstateError
    from ..storage.credentials import scrub

    known = _client_error(exc, url or "the store")
    text = known or str(exc) or type(exc).__name__
    if not isinstance(exc, DynstateError) and known is None:
        text = f"{type(exc).__name__}: {text}"
    for pattern, replacement in _PHRASES:
        text = pattern.sub(replacement, text)
    text = " ".join(text.split())  # one line, whatever the backend's message looked like
    return scrub(text, secrets)
