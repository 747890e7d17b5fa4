"""The only package that talks to fsspec: one class per backend behind one interface.

``open_storage(url, options)`` picks the backend: :class:`LocalStorage` for paths and
``file://``, :class:`MemoryStorage` for ``memory://``, :class:`ObjectStorage` for everything
else (``s3://``, ``gs://``...). Errors are translated and credentials scrubbed here.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidDataError
from .base import ShardSink, Storage, is_safe_name
from .credentials import redact
from .local import LocalStorage
from .memory import MemoryStorage
from .objectstore import ObjectStorage
from .retry import is_transient

__all__ = [
    "LocalStorage",
    "MemoryStorage",
    "ObjectStorage",
    "ShardSink",
    "Storage",
    "is_safe_name",
    "is_transient",
    "open_storage",
    "redact",
]


def open_storage(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Storage:
    """The backend for ``url`` (a URL string or a local path, ``pathlib.Path`` included)."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise InvalidDataError(
            f"a store URL must be a non-empty string or a path, not {url!r}; pass e.g. "
            "'runs/run1' or 's3://bucket/runs/run1'"
        )
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    if scheme in ("file", "local"):
        return LocalStorage(url, storage_options)
    if scheme == "memory":
        return MemoryStorage(url, storage_options)
    return ObjectStorage(url, storage_options)
