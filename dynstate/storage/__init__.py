"""The only package that talks to fsspec: one class per backend behind one interface.

``open_storage(url, options)`` picks the backend: :class:`LocalStorage` for paths and
``file://``, :class:`MemoryStorage` for ``memory://``, obstore's backend (:mod:`.s3obstore`)
for ``s3://``, ``gs://`` and ``az://`` (an ``s3://`` store whose configuration only s3fs
reads goes through s3fs from there), :class:`ObjectStorage` (fsspec) for everything else.
``open_location(url, options)`` opens a place outside any store (an export's OUT, a
checkpoint mirror). Errors are translated (the client-error table in :mod:`.errors`) and
credentials scrubbed (:mod:`.credentials`) here; :mod:`.preflight` holds the quick checks an
interactive command asks for before it opens a store.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidDataError
from .base import DeferredSync, ShardSink, Storage, is_safe_name
from .connect import check_protocol
from .credentials import redact
from .errors import is_client_error, translate
from .local import LocalStorage
from .locations import Location, open_location
from .memory import MemoryStorage
from .retry import is_transient

__all__ = [
    "DeferredSync",
    "LocalStorage",
    "Location",
    "MemoryStorage",
    "ObjectStorage",
    "ShardSink",
    "Storage",
    "check_protocol",
    "is_client_error",
    "is_safe_name",
    "is_transient",
    "open_location",
    "open_storage",
    "redact",
    "translate",
]


_ALIASES = {"gcs": "gs", "abfs": "az", "abfss": "az"}


def open_storage(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Storage:
    """The backend for ``url`` (a URL string or a local path, ``pathlib.Path`` included)."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():
        raise InvalidDataError(
            f"a store URL must be a non-empty string or a path, not {url!r}; pass e.g. "
            "'runs/run1' or 's3://bucket/runs/run1'"
        )
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    if scheme in ("file", "local"):
        return LocalStorage(url, storage_options)
    if scheme == "memory":
        return MemoryStorage(url, storage_options)
    if scheme in _ALIASES:
        # fsspec's names for the services obstore serves here (gcsfs and adlfs are no
        # dependency): the extra they would ask for is installed, under the other name
        raise InvalidDataError(
            f"{redact(url)}: write {redact(_ALIASES[scheme] + '://' + url.split('://', 1)[1])}"
            f" — dynstate opens {scheme}:// stores as {_ALIASES[scheme]}:// "
            "(docs/object-stores.md)"
        )
    if scheme in ("s3", "s3a", "gs", "az"):
        from .s3obstore import ObstoreStorage  # docs/object-stores.md

        return ObstoreStorage(url, storage_options)
    from .objectstore import ObjectStorage  # fsspec's other schemes

    return ObjectStorage(url, storage_options)


def __getattr__(name: str) -> Any:
    if name == "ObjectStorage":
        from .objectstore import ObjectStorage

        return ObjectStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
