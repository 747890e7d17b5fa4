"""Keeping credentials out of every message, log line, CLI output and served page: the one
scrubber of the package (the CLI and ``dynstate serve`` call :func:`scrub` too).

A store URL may carry credentials (``s3://KEY:SECRET@bucket/prefix``) and storage options or
the environment hold keys and tokens. :func:`redact` gives the form of a URL that is safe to
print; :func:`scrub` removes credentials from any text; :class:`Scrubber` is the same rules
with a set of known secrets, as a logging filter; :func:`guard_loggers` installs one on the
loggers of the S3 client libraries, whose debug output quotes request headers
(``Authorization: ... Credential=AKID/...``, ``X-Amz-Security-Token``).

The rules, whatever characters a secret holds (AWS secret keys hold ``/`` and ``+``, session
tokens ``=`` as well, passwords anything):

* the userinfo of every URL in the text (``scheme://user:pass@host``), found the way
  :func:`split_userinfo` finds it, so a password with ``/`` or ``@`` is hidden whole;
* the values of query parameters that carry signatures or tokens (``X-Amz-Signature``,
  ``X-Amz-Credential``, ``X-Amz-Security-Token``, ``Signature``, ``sig``, ``token``...);
* signed-request fragments in headers (``Credential=``, ``Signature=``, the security token)
  and ``name: value`` pairs of AWS credential fields (``aws_secret_access_key`` ...);
* every known secret value of at least :data:`MIN_SECRET` characters, as written,
  URL-encoded and escaped as ``repr()``, ``ascii()`` and JSON write it: the AWS, Google and
  Azure environment variables (those obstore reads), the secrets of every object-store
  location opened in this process and those the caller names. Shorter values are hidden
  only where the rules above find them: replacing a short word everywhere would blank ordinary text
  (the loopback test server's key is ``testing``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Iterable
from urllib.parse import quote, quote_plus

_CLIENT_LOGGERS = ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp")
_ENV_SECRETS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    # what obstore reads for gs:// and az:// stores
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "GOOGLE_BEARER_TOKEN",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_MASTER_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_TOKEN",
    "AZURE_STORAGE_CLIENT_SECRET",
    "AZURE_CLIENT_SECRET",
)
_SECRET_WORDS = ("secret", "key", "token", "password", "credential")
#: Known secret values shorter than this are not replaced wherever they occur (see above).
MIN_SECRET = 8
# Signed-request fragments botocore logs at DEBUG level, whatever the key, and the AWS
# credential fields as configuration files, reprs and JSON write them.
_SIGNATURE = re.compile(
    r"(Credential=|Signature=|X-Amz-Security-Token['\"]?[:=]\s*b?['\"]?|"
    r"X-Amz-Credential=|X-Amz-Signature=|"
    r"\b(?:aws_)?(?:secret_access_key|session_token|security_token)['\"]?\s*[:=]\s*b?['\"]?|"
    r"\b(?:SecretAccessKey|SessionToken)['\"]?\s*[:=]\s*['\"]?)[^\s,'\"&}]+",
    re.IGNORECASE,
)
# A URL in running text: scheme, then anything up to white space, a quote or a bracket. The
# scheme's length is bounded so that text like "a.a.a.a…" is scanned in linear time.
_URL = re.compile(r"\b([A-Za-z][A-Za-z0-9+.\-]{0,31}://)([^\s'\"<>()\[\]{}]+)")
# Words one of which every _SIGNATURE match holds: most text (a page of rows) has none, and
# the pattern need not run at all.
_SIGNATURE_WORDS = (
    "credential=",
    "signature=",
    "security-token",
    "secret_access_key",
    "session_token",
    "security_token",
    "secretaccesskey",
    "sessiontoken",
)
# Query parameters whose values are credentials (S3 and GCS presigned URLs, Azure SAS...).
_QUERY_SECRET = re.compile(
    r"([?&;](?:x-amz-(?:signature|credential|security-token)|x-goog-(?:signature|credential)|"
    r"signature|sig|token|access_token|secret|password|api_?key)=)[^&;#\s'\"<>]+",
    re.IGNORECASE,
)


def split_userinfo(url: str) -> tuple[str, str | None, str]:
    """(scheme, userinfo or None, the rest) of ``url``. A password may hold ``/`` or ``@``,
    so the userinfo ends at the last ``@`` whose prefix holds a ``:`` or no ``/``; when in
    doubt more is taken as userinfo (and hidden), never less."""
    if "://" not in url:
        return "", None, url
    scheme, rest = url.split("://", 1)
    # Linear in the text, whatever it holds (a served row may be megabytes of "@"s).
    colon, slash = rest.find(":"), rest.find("/")
    at = len(rest)
    while True:
        at = rest.rfind("@", 0, at)
        if at < 0:
            return scheme, None, rest
        if 0 <= colon < at or not 0 <= slash < at:
            return scheme, rest[:at], rest[at + 1 :]


def redact(url: str) -> str:
    """``url`` without credentials, query string or fragment: safe to log and print."""
    scheme, userinfo, rest = split_userinfo(url)
    if not scheme:
        return url
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    return f"{scheme}://{'***@' if userinfo is not None else ''}{rest}"


def _scrub_url(match: re.Match[str]) -> str:
    scheme, text = match.group(1), match.group(2)
    _, userinfo, rest = split_userinfo(scheme + text)
    if userinfo is not None:
        text = f"***@{rest}"
    return scheme + _QUERY_SECRET.sub(r"\1***", text)


def _forms(secret: str) -> set[str]:
    """A secret as it may appear in text: as is, URL-encoded (``/`` as ``%2F``...), and
    escaped as ``repr()``, ``ascii()`` and JSON write it — an OSError's filename, an
    exception's tuple of args and a KeyError are shown by repr, so a password holding a
    backslash, a quote or a non-ASCII letter would otherwise pass in its escaped form."""
    forms = {secret, quote(secret, safe=""), quote_plus(secret, safe=""), quote(secret)}
    for quoted in (repr(secret), ascii(secret), json.dumps(secret),
                   json.dumps(secret, ensure_ascii=False)):  # fmt: skip
        forms.add(quoted[1:-1])
    # repr() picks the quote the text lacks; inside a repr of another quote character (a
    # tuple, a dict) the other one is escaped instead.
    forms.add(secret.replace("\\", "\\\\").replace("'", "\\'"))
    # The repr of a message that quotes one (a retry's log line of a wrapped OSError).
    return forms | {repr(form)[1:-1] for form in forms}


def _environment_secrets() -> list[str]:
    return [os.environ[name] for name in _ENV_SECRETS if os.environ.get(name)]


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without credentials (see the module's rules): ``secrets`` are values to hide
    besides those this process knows (the AWS environment, opened object-store locations)."""
    known = {*secrets, *_environment_secrets(), *_GUARD.secrets}
    forms = {f for s in known if len(s) >= MIN_SECRET for f in _forms(s)}
    # Longest first, so that a secret containing another is replaced whole.
    for secret in sorted(forms, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, "***")
    if "://" in text:
        text = _URL.sub(_scrub_url, text)
    lower = text.lower()
    if any(word in lower for word in _SIGNATURE_WORDS):
        text = _SIGNATURE.sub(lambda m: m.group(1) + "***", text)
    return text


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
    found += _environment_secrets()
    # Longest first, so that a secret containing another is replaced whole.
    return sorted({s for s in found if s}, key=len, reverse=True)


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

    @property
    def secrets(self) -> list[str]:
        return self._secrets

    def scrub(self, text: str) -> str:
        """:func:`scrub` with this filter's secrets."""
        return scrub(text, self._secrets)

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
