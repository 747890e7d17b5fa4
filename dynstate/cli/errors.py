"""Failures as one line in command-line terms. The library's messages speak Python ("pass
force=True", "the endpoint_url storage option"); here they name flags. What a client
library's error means is the storage package's to say (its client-error table): a straggler
that reaches the CLI untranslated is handed to it, never matched here."""

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
        re.compile(r", or pass create=True to make a new store there"),
        # No command creates a store: the run that writes one does, on its first write.
        " (a store is created by the run that first writes to it; no dynstate command creates one)",
    ),
    (re.compile(r"pass --steps"), "pass a larger --steps"),
    (
        re.compile(r"the storage options (\w+)=\.\.\. and (\w+)=\.\.\."),
        r"--storage-option \1=... --storage-option \2=...",
    ),
    (re.compile(r"the (\w+) storage option"), r"--storage-option \1"),
    (re.compile(r"the storage option (\w+=)"), r"--storage-option \1"),
)


class Failure(click.ClickException):
    """A command that ran and found a problem (``verify``): ``error: <message>``, exit 1."""

    def show(self, file: Any = None) -> None:
        from .render import clean

        click.echo(f"error: {clean(self.message)}", err=True)


def one_line(exc: BaseException, url: str | None = None, secrets: Iterable[str] = ()) -> str:
    """The message printed after ``error: ``, without credentials (the package's one
    scrubber, with the command's own ``secrets`` besides those the process knows)."""
    from ..errors import DynstateError
    from ..storage import is_client_error, translate
    from ..storage.credentials import scrub

    known = list(secrets)
    if not isinstance(exc, DynstateError) and is_client_error(exc):
        place = url or "the store"
        exc = translate(exc, what="access", url=place, scrub=lambda t: scrub(t, known))
    text = str(exc) or type(exc).__name__
    if not isinstance(exc, DynstateError):
        text = f"{type(exc).__name__}: {text}"
    for pattern, replacement in _PHRASES:
        text = pattern.sub(replacement, text)
    text = " ".join(text.split())  # one line, whatever the backend's message looked like
    return scrub(text, known)
