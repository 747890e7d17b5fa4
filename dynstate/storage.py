"""The only module that talks to fsspec.

:class:`Storage` resolves a URL to a filesystem and a root, offers the handful of operations
a store needs (read, exclusive create, overwrite, list, delete), and translates every
filesystem or botocore failure into a :mod:`dynstate.errors` type. Two built-in exceptions pass
through on purpose because callers act on them: ``FileNotFoundError`` (object missing) and
``FileExistsError`` (an exclusive create lost the race).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import fsspec

from .errors import ConcurrencyUnsupportedError, MissingDependencyError, StorageError

log = logging.getLogger("dynstate")
T = TypeVar("T")

_MEMORY_LOCK = threading.Lock()
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}


def redact(url: str) -> str:
    """``url`` without credentials or query string, safe to log and print."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    if parts.username or parts.password:
        netloc = "***@" + netloc
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in _protocols(fs) or "local" in _protocols(fs)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


class Storage:
    """A store root on some filesystem; all paths given to methods are relative to it."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.display_url = redact(url)
        self.storage_options = dict(storage_options or {})
        try:
            fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        except ImportError as exc:
            scheme = url.split("://", 1)[0]
            extra = _EXTRAS.get(scheme, scheme)
            raise MissingDependencyError(
                f"cannot open {self.display_url}: the {scheme}:// filesystem is not installed; "
                f"pip install 'dynstate[{extra}]'"
            ) from exc
        except (ValueError, TypeError) as exc:
            raise StorageError(f"cannot open {self.display_url}: {exc}") from exc
        self.fs: fsspec.AbstractFileSystem = fs
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.local = _is_local(fs)
        self.memory = "memory" in _protocols(fs)
        self._exclusive_ok: bool | None = True if (self.local or self.memory) else None

    # -- plumbing --------------------------------------------------------------------------

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if self.root else rel

    def _call(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        """Run one filesystem operation, translating its failures at this single boundary."""
        try:
            return fn()
        except (FileNotFoundError, FileExistsError):
            raise
        except PermissionError as exc:
            raise StorageError(
                f"permission denied to {what} {self.display_url}/{rel}; check the credentials "
                "and permissions for this location"
            ) from exc
        except (OSError, RuntimeError, ValueError) as exc:
            raise StorageError(
                f"could not {what} {self.display_url}/{rel}: {exc}; check that the location is "
                "reachable and retry"
            ) from exc
        except Exception as exc:  # botocore / aiohttp errors that s3fs did not translate
            if type(exc).__module__.split(".")[0] in ("botocore", "aiohttp", "aiobotocore"):
                raise StorageError(
                    f"could not {what} {self.display_url}/{rel}: {exc}; retry later"
                ) from exc
            raise

    # -- reads -----------------------------------------------------------------------------

    def read(self, rel: str) -> bytes:
        """The object's bytes; ``FileNotFoundError`` if it does not exist."""
        return self._call("read", rel, lambda: self.fs.cat_file(self.path(rel)))

    def try_read(self, rel: str) -> bytes | None:
        try:
            return self.read(rel)
        except FileNotFoundError:
            return None

    def exists(self, rel: str) -> bool:
        return self._call("check", rel, lambda: self.fs.exists(self.path(rel)))

    def size(self, rel: str) -> int:
        return int(self._call("stat", rel, lambda: self.fs.size(self.path(rel))))

    def list(self, rel_dir: str) -> list[str]:
        """Names (not paths) of the objects directly under ``rel_dir``; [] if none."""
        try:
            entries = self._call(
                "list", rel_dir, lambda: self.fs.ls(self.path(rel_dir), detail=False)
            )
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def modified(self, rel: str) -> float | None:
        """Last-modified time as a POSIX timestamp, or None where the backend has none."""
        info = self._call("stat", rel, lambda: self.fs.info(self.path(rel)))
        for key in ("mtime", "LastModified", "created"):
            value = info.get(key)
            if value is None:
                continue
            return value.timestamp() if hasattr(value, "timestamp") else float(value)
        return None

    # -- writes ----------------------------------------------------------------------------

    def create(self, rel: str, data: bytes) -> None:
        """Create ``rel`` holding ``data`` only if it does not exist yet, atomically: readers
        see the whole object or nothing. Raises ``FileExistsError`` when it exists."""
        if self.local:
            self._call("create", rel, lambda: self._local_create(rel, data))
        elif self.memory:
            with _MEMORY_LOCK:
                self._call("create", rel, lambda: self._memory_create(rel, data))
        else:
            self._call(
                "create", rel, lambda: self.fs.pipe_file(self.path(rel), data, mode="create")
            )

    def create_if_absent(self, rel: str, data: bytes) -> bool:
        """Exclusive create for content-addressed or deterministic files: an existing object
        already holds the same content, so losing the race is success. True if we wrote."""
        try:
            self.create(rel, data)
        except FileExistsError:
            return False
        return True

    def put(self, rel: str, data: bytes) -> None:
        """Write ``rel``, replacing any previous content (only for hints, never for data)."""
        if self.local:
            self._call("write", rel, lambda: self._local_put(rel, data))
        else:
            self._call("write", rel, lambda: self.fs.pipe_file(self.path(rel), data))

    def delete(self, rel: str) -> None:
        try:
            self._call("delete", rel, lambda: self.fs.rm_file(self.path(rel)))
        except FileNotFoundError:
            pass

    def check_exclusive_create(self) -> bool:
        """Whether the backend really refuses a second exclusive create of the same key.
        Some S3-compatible stores ignore ``If-None-Match``; find out once, by trying."""
        if self._exclusive_ok is None:
            probe = f"_dynstate/probe/{uuid.uuid4().hex}"
            self.create(probe, b"1")
            try:
                self.create(probe, b"2")
                self._exclusive_ok = False
            except FileExistsError:
                self._exclusive_ok = True
            except StorageError:
                self._exclusive_ok = False
            finally:
                self.delete(probe)
            log.debug("exclusive create on %s: %s", self.display_url, self._exclusive_ok)
        return self._exclusive_ok

    def require_exclusive_create(self, single_writer: bool) -> None:
        if single_writer or self.check_exclusive_create():
            return
        raise ConcurrencyUnsupportedError(
            f"{self.display_url} does not support conditional writes (If-None-Match), so "
            "concurrent writers could overwrite each other's commits; use a backend that "
            "supports them, or open with single_writer=True if only one process ever writes"
        )

    # -- local-disk specifics ------------------------------------------------------------------

    def _local_dir(self, rel: str) -> str:
        directory = os.path.dirname(self.path(rel))
        os.makedirs(directory, exist_ok=True)
        return directory

    def _local_create(self, rel: str, data: bytes) -> None:
        directory = self._local_dir(rel)
        final = self.path(rel)
        tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
        _write_fsync(tmp, data)
        try:
            # link() fails if the name exists: the exclusive create, with no partial file ever
            # visible under the final name.
            os.link(tmp, final)
        finally:
            os.unlink(tmp)
        _fsync_dir(directory)

    def _local_put(self, rel: str, data: bytes) -> None:
        directory = self._local_dir(rel)
        tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
        _write_fsync(tmp, data)
        os.replace(tmp, self.path(rel))

    def _memory_create(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        if self.fs.exists(path):
            raise FileExistsError(path)
        self.fs.pipe_file(path, data)

    def write_shard(self, rel: str, data: bytes) -> None:
        """Write a new immutable data file under a fresh unique name (never overwrites)."""
        if self.local:

            def write() -> None:
                self._local_dir(rel)
                fd = os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    _write_all(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)

            self._call("write", rel, write)
        else:
            self.create(rel, data)

    def sync_dir(self, rel_dir: str) -> None:
        if self.local:
            self._call("sync", rel_dir, lambda: _fsync_dir(self.path(rel_dir)))


_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def is_safe_name(name: str) -> bool:
    return bool(_SAFE_NAME.match(name)) and ".." not in name


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _write_fsync(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
