"""From a URL and storage options to an fsspec filesystem: the one place a filesystem is
built, for stores (:class:`~dynstate.storage.base.Storage`) and for locations outside them
(:class:`~dynstate.storage.locations.Location`) alike. Option names the filesystem does not
take are refused before it is built, a missing extra says which one to install, and a
filesystem that connects in its constructor has its failures translated here.

fsspec is imported only when a filesystem is built or its class inspected: a local store
reads with ``os`` and checks its options against :data:`LOCAL_OPTIONS`, so a command that
only reads a local store never pays fsspec's import (~0.1 s)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import DynstateError, InvalidDataError, MissingDependencyError, StorageError
from .credentials import redact

if TYPE_CHECKING:
    import fsspec

_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}
# Backends whose every option is known here (s3fs's leftovers go to aiobotocore's session).
_CHECKED_PROTOCOLS = frozenset({"file", "local", "memory", "s3", "s3a"})
# Options every fsspec filesystem takes (AbstractFileSystem's own), whatever its signature.
_COMMON_OPTIONS = frozenset(
    {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache", "loop"}
)
#: What fsspec's LocalFileSystem takes (file://, local://, plain paths), written out so that
#: checking a local store's options imports no fsspec; a test holds it to the class.
LOCAL_OPTIONS = _COMMON_OPTIONS | {"auto_mkdir"}


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def check_protocol(url: str, shown: str) -> None:
    """Refuse a URL whose protocol no installed filesystem serves, without building one: a
    setting kept for later (a checkpoint mirror) is checked when it is given, not at its first
    use, steps into a run."""
    protocol = protocol_of(url)
    if protocol in ("file", "local", "memory"):
        return
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        extra = _EXTRAS.get(protocol, protocol)
        raise MissingDependencyError(
            f"cannot open {shown}: the {protocol}:// filesystem is not installed; "
            f"pip install 'dynstate[{extra}]'"
        ) from None
    except ValueError:
        raise InvalidDataError(
            f"cannot open {shown}: no filesystem serves {protocol}://; use a local path or a "
            "URL such as s3://bucket/path, gs://bucket/path or az://container/path"
        ) from None


def _option_sinks(protocol: str) -> list[type]:
    """Classes the filesystem hands unknown options on to (their names are valid too)."""
    if protocol not in ("s3", "s3a"):
        return []
    try:  # s3fs passes options it does not know to aiobotocore's session (profile=...)
        from aiobotocore.session import AioSession
    except ImportError:
        return []
    return [AioSession]


def check_options(url: str, options: dict[str, Any], shown: str) -> None:
    """Refuse option names the filesystem does not take, before it is built: fsspec
    filesystems accept any keyword and fail much later (s3fs: a raw ``TypeError`` from
    aiobotocore on the first request). ``shown`` is the URL as messages print it."""
    if not options:
        return
    protocol = protocol_of(url)
    if protocol not in _CHECKED_PROTOCOLS:
        return  # where options flow on to libraries we do not know, we cannot tell
    known = LOCAL_OPTIONS if protocol in ("file", "local") else known_options(protocol)
    if known is None:
        return  # connect reports it
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidDataError(
            f"unknown storage option {', '.join(map(repr, unknown))} for "
            f"{shown}; {protocol}:// takes {', '.join(sorted(known))}"
        )


def known_options(protocol: str) -> frozenset[str] | None:
    """The option names the ``protocol``'s filesystem class takes, read off its constructors
    (and those it hands options on to); None if fsspec has no such filesystem here."""
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return None
    known = set(_COMMON_OPTIONS)
    for klass in [*cls.__mro__, *_option_sinks(protocol)]:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        known |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    known.discard("self")
    return frozenset(known)


def connect(
    url: str, options: dict[str, Any], shown: str, scrub: Callable[[str], str]
) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) of ``url``; ``shown`` and ``scrub`` keep credentials out
    of the messages."""
    import ftplib  # here, with fsspec: a command that builds no filesystem needs neither

    import fsspec.core

    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError:
        scheme = url.split("://", 1)[0]
        extra = _EXTRAS.get(scheme, scheme)
        raise MissingDependencyError(
            f"cannot open {shown}: the {scheme}:// filesystem is not installed; "
            f"pip install 'dynstate[{extra}]'"
        ) from None
    except (ValueError, TypeError) as exc:
        raise StorageError(
            f"cannot open {shown}: {scrub(str(exc))}; check the URL and storage options"
        ) from None
    except DynstateError:
        raise
    except (OSError, EOFError, ftplib.Error) as exc:
        # Filesystems that connect in their constructor (ftp://, sftp://, smb://) fail
        # here with socket and protocol errors.
        raise StorageError(
            f"could not reach {shown}: {type(exc).__name__}: "
            f"{scrub(str(exc))}; check the URL and that the host is reachable"
        ) from None


# Options s3fs takes as dicts (anything else fails deep inside it with a raw AttributeError).
STRUCTURED_OPTIONS = {
    "client_kwargs": '{"region_name": "eu-west-1"}',
    "config_kwargs": '{"retries": {"max_attempts": 5}}',
    "s3_additional_kwargs": '{"ServerSideEncryption": "AES256"}',
}


def check_shapes(options: dict[str, Any]) -> None:
    """Refuse (InvalidDataError) S3 options of the wrong shape, naming the option: those s3fs
    takes as dicts, and an endpoint that is no ``http(s)://`` URL (each would fail deep
    inside a client, as a failure to retry). Imports nothing."""
    for key, example in STRUCTURED_OPTIONS.items():
        if key in options and not isinstance(options[key], dict):
            raise InvalidDataError(f"{key} must be a JSON object, e.g. {key}={example}")
    config = options.get("config_kwargs")
    if config is not None and not isinstance(config.get("retries", {}), dict):
        raise InvalidDataError(
            'the "retries" of config_kwargs must be a JSON object, e.g. '
            f"config_kwargs={STRUCTURED_OPTIONS['config_kwargs']}"
        )
    client = options.get("client_kwargs") or {}
    for where, value in (("endpoint_url", options.get("endpoint_url")),
                         ("client_kwargs.endpoint_url", client.get("endpoint_url"))):  # fmt: skip
        if value is not None and (
            not isinstance(value, str) or not value.lower().startswith(("http://", "https://"))
        ):
            raise InvalidDataError(
                f"{where} must be an http:// or https:// URL, not {redact(str(value))!r}; e.g. "
                f"{where}=http://127.0.0.1:9000"
            )
