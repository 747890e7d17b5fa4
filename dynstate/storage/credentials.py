"""Keeping credentials out of every message and log line.

A store URL may carry credentials (``s3://KEY:SECRET@bucket/prefix``) and storage options or
the environment hold keys and tokens. :func:`redact` gives the form of a URL that is safe to
print; :class:`Scrubber` removes known secrets from any text; :func:`guard_loggers` installs
a scrubber on the loggers of the S3 client libraries, whose debug output quotes request
headers (``Authorization: ... Credential=AKID/...``, ``X-Amz-Security-Token``).
"""

from __future__ import annotations

import logging
import os
import re
import threading

_CLIENT_LOGGERS = ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp")
_ENV_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_SECRET_WORDS = ("secret", "key", "token", "password", "credential")
# Signed-request fragments botocore logs at DEBUG level, whatever the key.
_SIGNATURE = re.compile(
    r"(Credential=|Signature=|X-Amz-Security-Token['\"]?[:=]\s*b?['\"]?|"
    r"X-Amz-Credential=|X-Amz-Signature=)[^\s,'\"&]+",
    re.IGNORECASE,
)


def split_userinfo(url: str) -> tuple[str, str | None, str]:
    """(scheme, userinfo or None, the rest) of ``url``. A password may hold ``/`` or ``@``,
    so the userinfo ends at the last ``@`` whose prefix holds a ``:`` or no ``/``; when in
    doubt more is taken as userinfo (and hidden), never less."""
    if "://" not in url:
        return "", None, url
    scheme, rest = url.split("://", 1)
    at = len(rest)
    while True:
        at = rest.rfind("@", 0, at)
        if at < 0:
            return scheme, None, rest
        prefix = rest[:at]
        if ":" in prefix or "/" not in prefix:
            return scheme, prefix, rest[at + 1 :]


def redact(url: str) -> str:
    """``url`` without credentials, query string or fragment: safe to log and print."""
    scheme, userinfo, rest = split_userinfo(url)
    if not scheme:
        return url
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    return f"{scheme}://{'***@' if userinfo is not None else ''}{rest}"


def _secret_values(mapping: dict[str, object], found: list[str]) -> None:
    # A module function, not a closure: a recursive closure is a reference cycle.
    for name, value in mapping.items():
        if isinstance(value, dict):
            _secret_values(value, found)
        elif isinstance(value, str) and any(w in name.lower() for w in _SECRET_WORDS):
            found.append(value)


def secrets_of(url: str, options: dict[str, object]) -> list[str]:
    """Every credential a location may use: the URL's userinfo (and its parts), option values
    whose names say key/secret/token/password (nested ones too), and the AWS environment."""
    found: list[str] = []
    _, userinfo, _ = split_userinfo(url)
    if userinfo:
        found += [userinfo, *userinfo.split(":", 1)]

    _secret_values(options, found)
    found += [os.environ[name] for name in _ENV_SECRETS if os.environ.get(name)]
    # Longest first, so that a secret containing another is replaced whole.
    return sorted({s for s in found if len(s) >= 4}, key=len, reverse=True)


class Scrubber(logging.Filter):
    """Replaces known secrets (and signed-request fragments) with ``***``. As a logging
    filter it rewrites each record's message before any handler formats it."""

    def __init__(self) -> None:
        super().__init__()
        self._secrets: list[str] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, object]:
        return {"secrets": list(self._secrets)}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()  # type: ignore[misc]
        self.add(list(state["secrets"]))  # type: ignore[call-overload]

    def add(self, secrets: list[str]) -> None:
        with self._lock:
            merged = set(self._secrets) | set(secrets)
            self._secrets = sorted(merged, key=len, reverse=True)

    def scrub(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, "***")
        return _SIGNATURE.sub(lambda m: m.group(1) + "***", text)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string is the handler's problem, not a leak
            return True
        clean = self.scrub(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and record.exc_info[1] is not None:
            # Tracebacks are formatted from the exception; keep only its scrubbed text.
            record.exc_text = self.scrub(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


# The client libraries' loggers are process-wide, so their guard is too: one filter object,
# holding the secrets of every object-store location opened in this process.
_GUARD = Scrubber()
_GUARD_LOCK = threading.Lock()


def guard_loggers(secrets: list[str]) -> Scrubber:
    """Add ``secrets`` to the process's log guard and make sure every logger of the S3 client
    libraries (which exist once the libraries are imported) carries it. Returns the guard."""
    _GUARD.add(secrets)
    with _GUARD_LOCK:
        manager = logging.Logger.manager
        names = [n for n in list(manager.loggerDict) if n.split(".")[0] in _CLIENT_LOGGERS]
        for name in {*names, *_CLIENT_LOGGERS}:
            logger = logging.getLogger(name)
            if _GUARD not in logger.filters:
                logger.addFilter(_GUARD)
    return _GUARD
