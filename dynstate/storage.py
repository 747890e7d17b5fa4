"""The only module that talks to fsspec.

:class:`Storage` resolves a URL to a filesystem and a root, offers the handful of operations
a store needs (read, exclusive create, overwrite, list, delete), and translates every
filesystem or botocore failure into a :mod:`dynstate.errors` type. Two built-in exceptions pass
through on purpose because callers act on them: ``FileNotFoundError`` (object missing) and
``FileExistsError`` (an exclusive create lost the race).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import fsspec

from .errors import (
    ConcurrencyUnsupportedError,
    CorruptStoreError,
    MissingDependencyError,
    StorageError,
)

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
    """A store root on some filesystem; all paths given to methods are relative to it.

    Remote operations are retried on transient failures (see :func:`is_transient`) with
    exponential backoff and full jitter, on top of the retries botocore and s3fs do
    themselves; permanent ones (missing object, lost exclusive create, denied) never are.
    """

    retry_attempts = 5  # our own attempts per operation, each one already retried below us
    retry_base_s = 0.1
    retry_cap_s = 5.0

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.display_url = redact(url)
        self.storage_options = _with_defaults(url, dict(storage_options or {}))
        self._pid = os.getpid()
        self._fs, root = self._connect()
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.local = _is_local(self._fs)
        self.memory = "memory" in _protocols(self._fs)
        # s3fs sends a HEAD before every GET to split large objects into parallel ranges, and
        # on a missing key that HEAD is followed by a LIST; one plain GET is a third the cost.
        self._read_kwargs = {"max_concurrency": 1} if "s3" in _protocols(self._fs) else {}
        self._exclusive_ok: bool | None = True if (self.local or self.memory) else None

    def _connect(self) -> tuple[fsspec.AbstractFileSystem, str]:
        try:
            return fsspec.core.url_to_fs(self.url, **self.storage_options)
        except ImportError as exc:
            scheme = self.url.split("://", 1)[0]
            extra = _EXTRAS.get(scheme, scheme)
            raise MissingDependencyError(
                f"cannot open {self.display_url}: the {scheme}:// filesystem is not installed; "
                f"pip install 'dynstate[{extra}]'"
            ) from exc
        except (ValueError, TypeError) as exc:
            raise StorageError(f"cannot open {self.display_url}: {exc}") from exc

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The filesystem, rebuilt after a fork: async fsspec filesystems (s3fs) hold an event
        loop thread and sockets that do not survive into a forked DataLoader worker."""
        if self._pid != os.getpid():
            self._fs = self._connect()[0]
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for spawned workers and Ray tasks: they reconnect from the URL and options.
        state = dict(self.__dict__)
        state["_fs"] = None
        state["_pid"] = -1
        return state

    # -- plumbing --------------------------------------------------------------------------

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if self.root else rel

    def _call(self, what: str, rel: str, fn: Callable[[], T], *, retry_corrupt: bool = False) -> T:
        """Run one filesystem operation with retries, translating its failures at this single
        boundary. ``fn`` must be safe to repeat: every caller's operation is idempotent or, for
        exclusive creates, resolved by :meth:`create` reading back."""
        attempts = 1 if (self.local or self.memory) else max(1, self.retry_attempts)
        for attempt in range(attempts):
            try:
                return fn()
            except Exception as exc:
                again = is_transient(exc) or (retry_corrupt and isinstance(exc, CorruptStoreError))
                if attempt + 1 < attempts and again:
                    delay = random.uniform(0, min(self.retry_cap_s, self.retry_base_s * 2**attempt))
                    log.debug(
                        "transient failure to %s %s/%s (attempt %d of %d), retrying in %.2fs: %r",
                        what,
                        self.display_url,
                        rel,
                        attempt + 1,
                        attempts,
                        delay,
                        exc,
                    )
                    time.sleep(delay)
                    continue
                err = self._translate(what, rel, exc, attempt + 1)
                if err is exc:
                    raise
                raise err from exc
        raise AssertionError("unreachable")  # the loop always returns or raises

    def _translate(self, what: str, rel: str, exc: Exception, attempts: int) -> Exception:
        if isinstance(exc, (FileNotFoundError, FileExistsError, CorruptStoreError)):
            return exc
        if isinstance(exc, StorageError):
            return exc
        where = f"{self.display_url}/{rel}"
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        text = self.scrub(str(exc))  # botocore's messages may quote a credential
        if isinstance(exc, PermissionError):
            return StorageError(
                f"permission denied to {what} {where}; check the credentials and permissions "
                "for this location"
            )
        if isinstance(exc, (OSError, RuntimeError, ValueError)):
            return StorageError(
                f"could not {what} {where}{tries}: {text}; check that the location is reachable "
                "and retry"
            )
        if _is_client_library_error(exc):  # botocore / aiohttp errors s3fs did not translate
            return StorageError(f"could not {what} {where}{tries}: {text}; retry later")
        return exc

    def scrub(self, text: str) -> str:
        """``text`` with any credential of this location replaced by ``***``."""
        parts = urlsplit(self.url) if "://" in self.url else None
        secrets = [parts.password, parts.username] if parts else []
        secrets += [
            str(v)
            for k, v in self.storage_options.items()
            if any(word in k.lower() for word in ("secret", "key", "token", "password"))
            and isinstance(v, str)
        ]
        for secret in secrets:
            if secret and len(secret) >= 4:
                text = text.replace(secret, "***")
        return text

    # -- reads -----------------------------------------------------------------------------

    def read(self, rel: str, *, check: Callable[[bytes], None] | None = None) -> bytes:
        """The object's bytes; ``FileNotFoundError`` if it does not exist. ``check`` verifies
        them (raising :class:`CorruptStoreError`); a remote read that fails it is fetched again
        in case the body was cut short in transit, and the error stands only if it persists."""

        def fetch() -> bytes:
            data = self.fs.cat_file(self.path(rel), **self._read_kwargs)
            if check is not None:
                check(data)
            return data

        return self._call("read", rel, fetch, retry_corrupt=check is not None)

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
                "list",
                rel_dir,
                # refresh: other processes write here, a cached listing would hide their files
                lambda: self.fs.ls(self.path(rel_dir), detail=False, refresh=True),
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
            try:
                self._call(
                    "create", rel, lambda: self.fs.pipe_file(self.path(rel), data, mode="create")
                )
            except FileExistsError:
                # An earlier attempt (ours, or botocore's own retry) may have landed with its
                # reply lost; the retry then meets our own object. Only identical bytes are ours
                # (records carry unique shard names and timestamps), anything else lost a race.
                if self.try_read(rel) != bytes(data):
                    raise
                log.info(
                    "create of %s/%s: an earlier attempt landed though its reply was lost",
                    self.display_url,
                    rel,
                )

    def create_if_absent(self, rel: str, data: bytes) -> bool:
        """Exclusive create for content-addressed or deterministic files: an existing object
        already holds the same content, so losing the race is success. True if we wrote."""
        try:
            self.create(rel, data)
        except FileExistsError:
            return False
        return True

    def put(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        """Write ``rel``, replacing any previous content (only for hints, never for data).
        ``durable=False`` skips the fsync where a lost or torn write is harmless."""
        if self.local:
            self._call("write", rel, lambda: self._local_put(rel, data, durable))
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
            try:
                self.create(probe, b"1")
                try:
                    self.create(probe, b"2")
                    ok = False  # the header was ignored: the second create replaced the first
                except FileExistsError:
                    ok = True
            except StorageError as exc:
                if is_transient(exc):
                    raise  # unreachable or overloaded, which says nothing about the header
                log.info("%s rejects conditional writes: %s", self.display_url, exc)
                ok = False
            finally:
                try:
                    self.delete(probe)
                except StorageError as exc:
                    log.warning("could not remove probe %s/%s: %s", self.display_url, probe, exc)
            self._exclusive_ok = ok
            log.debug("exclusive create on %s: %s", self.display_url, ok)
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

    def _local_put(self, rel: str, data: bytes, durable: bool = True) -> None:
        directory = self._local_dir(rel)
        tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
        if durable:
            _write_fsync(tmp, data)
        else:
            with open(tmp, "xb") as f:
                f.write(data)
        os.replace(tmp, self.path(rel))

    def _memory_create(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        if self.fs.exists(path):
            raise FileExistsError(path)
        self.fs.pipe_file(path, data)

    @contextmanager
    def new_shard(self, rel: str) -> Iterator[ShardSink]:
        """A sink for a new immutable data file under a fresh unique name (never overwrites);
        it hashes what passes through. Local files are streamed to disk and fsynced; remote
        ones are uploaded in one exclusive create when the block ends. A failure inside the
        block removes the partial file."""
        if not self.local:
            sink = ShardSink(None)
            yield sink
            self.create(rel, sink.getvalue())
            return
        self._call("write", rel, lambda: self._local_dir(rel))
        fd = self._call(
            "create",
            rel,
            lambda: os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644),
        )
        try:
            sink = ShardSink(fd)
            yield sink
            self._call("sync", rel, lambda: os.fsync(fd))
        except BaseException:
            os.close(fd)
            fd = -1
            self.delete(rel)
            raise
        finally:
            if fd >= 0:
                os.close(fd)

    def sync_dir(self, rel_dir: str) -> None:
        if self.local:
            self._call("sync", rel_dir, lambda: _fsync_dir(self.path(rel_dir)))


_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def is_safe_name(name: str) -> bool:
    return bool(_SAFE_NAME.match(name)) and ".." not in name


class ShardSink:
    """A write-only file object for pyarrow that hashes (SHA-256) and counts what it is
    given, writing it to ``fd`` — or keeping it in memory when ``fd`` is None."""

    def __init__(self, fd: int | None):
        self._fd = fd
        self._hash = hashlib.sha256()
        self._buffer: list[bytes] | None = [] if fd is None else None
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._hash.update(view)
        if self._buffer is not None:
            self._buffer.append(bytes(view))
        else:
            assert self._fd is not None
            _write_all(self._fd, view)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def getvalue(self) -> bytes:
        return b"".join(self._buffer or [])


def _write_all(fd: int, data: Any) -> None:
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


# -- retry policy ------------------------------------------------------------------------------

_THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded"}
)
_TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE}
    | ({errno.EREMOTEIO} if hasattr(errno, "EREMOTEIO") else set())
)
_CLIENT_LIBRARIES = ("botocore", "aiobotocore", "aiohttp", "urllib3")


def _with_defaults(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """S3 options with dynstate's defaults where the caller set none: botocore's standard
    retry mode (5xx, throttling, connection errors) and no listing cache (other writers)."""
    if url.split("://", 1)[0] not in ("s3", "s3a"):
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"max_attempts": 5, "mode": "standard"})
    options["config_kwargs"] = config
    options.setdefault("use_listings_cache", False)
    return options


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _is_client_library_error(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] in _CLIENT_LIBRARIES


def is_transient(exc: BaseException) -> bool:
    """Whether a failed remote operation may succeed if repeated: 5xx and throttling replies,
    dropped or reset connections, timeouts, bodies cut short. Never a missing object, a lost
    exclusive create, a denied request or any other 4xx."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, CorruptStoreError)):
        return False
    for link in _chain(exc):
        response = getattr(link, "response", None)
        if isinstance(response, dict) and "Error" in response:
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            code = response["Error"].get("Code", "")
            # 501: the backend does not implement the request (e.g. a conditional header).
            return (status >= 500 and status != 501) or status == 429 or code in _THROTTLE_CODES
    for link in _chain(exc):
        if isinstance(link, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
            return True
        if _is_client_library_error(link):
            # What is left of botocore/aiohttp/urllib3 errors without a reply is transport:
            # closed connections, short bodies, unparsable (cut) replies, timeouts. Credential
            # and parameter errors are the exceptions.
            name = type(link).__name__
            return not any(s in name for s in ("Credential", "ParamValidation", "Unknown"))
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS
