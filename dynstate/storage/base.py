"""The storage interface every backend implements.

:class:`Storage` is a store root on some filesystem; all paths given to its methods are
relative to that root. Its public methods (read, exclusive create, overwrite, list, delete,
stat) are the same on every backend: they run the backend's primitives (``_cat``,
``_create``, ``_put``, ...) through :meth:`Storage._call`, the one place where failures are
retried and translated into :mod:`dynstate.errors` types by the client-error table
(:mod:`.errors`; the filesystem itself is built by :mod:`.connect`). Two built-in exceptions
pass through on purpose because callers act on them: ``FileNotFoundError`` (object missing)
and ``FileExistsError`` (an exclusive create lost the race).

One file, at about 490 lines, because it is one concept: the interface every backend fills
in and the boundary all of it runs through (the shard sink and the deferred sync of new shards
are that interface's write side).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from .. import paths
from ..errors import (
    ConcurrencyUnsupportedError,
    CorruptStoreError,
    StorageError,
    StoreNotFoundError,
)
from .connect import check_options, connect
from .credentials import Scrubber, redact, secrets_of
from .errors import CREDENTIALS, DENIED, NO_BUCKET, REFUSED, SKEWED, row_of, text_of, translate
from .retry import backoff, is_transient

if TYPE_CHECKING:
    import fsspec

log = logging.getLogger("dynstate")
T = TypeVar("T")

# Probe objects: the conditional-write check and the storage's clock (see Storage.now).
PROBE_DIR = paths.PROBE_DIR

# The ``ready`` of the create this thread runs (Storage.create), for the backend's _create:
# beside its arguments rather than among them, so the primitive tests wrap keeps its shape.
_READY = threading.local()


class Storage:
    """A store root on one backend. Create one with :func:`dynstate.storage.open_storage`."""

    # Capabilities other layers read: they never branch on the backend's type.
    #: A shard is a file this process reads by path where it lies (a local disk): nothing to
    #: cache or prefetch, a footer is one cheap read, and small row groups cost no requests.
    reads_in_place: ClassVar[bool] = False
    #: Other processes (loader workers, Ray tasks) reach the same store by its URL.
    shared_across_processes: ClassVar[bool] = True
    #: A request that failed or timed out may still take effect later (a remote store's
    #: retried or late request), so a commit that failed must be looked for again.
    late_requests: ClassVar[bool] = True
    #: the granularity of the storage's modification times: every age judged by its clock
    #: (:meth:`now` minus :meth:`modified`) allows this much (S3 stamps whole seconds)
    clock_resolution_s: ClassVar[float] = 1.0
    retry_attempts = 1  # our own attempts per operation (remote backends retry)
    retry_base_s = 0.1
    retry_cap_s = 5.0

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.display_url = redact(url)
        self.storage_options = self._with_defaults(dict(storage_options or {}))
        self._scrubber = Scrubber()
        self._scrubber.add(secrets_of(url, self.storage_options))
        self._check_options()
        self._pid = os.getpid()
        self._fs: fsspec.AbstractFileSystem | None = None
        root = self._locate()
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self._exclusive_ok: bool | None = True

    # -- connecting ------------------------------------------------------------------------

    def _with_defaults(self, options: dict[str, Any]) -> dict[str, Any]:
        return options

    def _check_options(self) -> None:
        check_options(self.url, self.storage_options, self.display_url)

    def _connect(self) -> tuple[fsspec.AbstractFileSystem, str]:
        return connect(self.url, self.storage_options, self.display_url, self.scrub)

    def _locate(self) -> str:
        """The root's path in the filesystem, as fsspec gives it. Here by building the
        filesystem (which also reports a bad URL or option now, not at the first call);
        a backend that can tell without fsspec leaves :attr:`fs` to its first use."""
        self._fs, root = self._connect()
        return root

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The filesystem, built on first use and rebuilt after a fork: async fsspec
        filesystems (s3fs) hold an event loop thread and sockets that do not survive into a
        forked DataLoader worker."""
        if self._fs is None or self._pid != os.getpid():
            self._fs = self._connect()[0]
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for spawned workers and Ray tasks: they reconnect from the URL and options.
        state = dict(self.__dict__)
        state["_fs"] = None
        state["_pid"] = -1
        return state

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if self.root else rel

    def scrub(self, text: str) -> str:
        """``text`` with any credential of this location replaced by ``***``."""
        return self._scrubber.scrub(text)

    # -- the one boundary ------------------------------------------------------------------

    def _call(self, what: str, rel: str, fn: Callable[[], T], *, retry_corrupt: bool = False) -> T:
        """Run one filesystem operation with retries, translating its failures at this single
        boundary. ``fn`` must be safe to repeat: every caller's operation is idempotent or, for
        exclusive creates, resolved by :meth:`create` reading back."""
        attempts = max(1, self.retry_attempts)
        for attempt in range(attempts):
            try:
                return fn()
            except Exception as exc:
                again = is_transient(exc) or (retry_corrupt and isinstance(exc, CorruptStoreError))
                if attempt + 1 < attempts and again:
                    delay = backoff(attempt, self.retry_base_s, self.retry_cap_s)
                    log.debug(
                        "transient failure to %s %s/%s (attempt %d of %d), retrying in %.2fs: %s",
                        what,
                        self.display_url,
                        rel,
                        attempt + 1,
                        attempts,
                        delay,
                        self.scrub(repr(exc)),
                    )
                    time.sleep(delay)
                    continue
                err: BaseException | None = self._translate(what, rel, exc, attempt + 1)
                try:
                    if err is exc:
                        raise
                    raise err from None if self._is_secret_bearing(exc) else exc  # type: ignore[misc]
                finally:
                    # This frame is in the error's traceback: holding the error here would
                    # make a cycle that only the cyclic collector frees (at teardown, maybe).
                    err = None
        raise AssertionError("unreachable")  # the loop always returns or raises

    def _is_secret_bearing(self, exc: BaseException) -> bool:
        text = text_of(exc)
        return self.scrub(text) != text

    def _translate(self, what: str, rel: str, exc: Exception, attempts: int) -> BaseException:
        """The one client-error table (:mod:`.errors`); the builtins callers act on pass."""
        return translate(
            exc,
            what=what,
            url=self.display_url,
            path=f"{self.display_url}/{rel}" if rel else self.display_url,
            scrub=self.scrub,
            attempts=attempts,
            keep=(FileNotFoundError, FileExistsError),
        )

    # -- backend primitives (overridden per backend) ---------------------------------------

    def _cat(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def _cat_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        # fsspec's async backends (s3fs) fetch the ranges concurrently.
        return self.fs.cat_ranges(
            [self.path(rel) for rel, _, _ in ranges],
            [start for _, start, _ in ranges],
            [end for _, _, end in ranges],
            on_error="raise",
        )

    def _create(self, rel: str, data: bytes, durable: bool = True) -> None:
        """The exclusive create; calls :meth:`_await_ready` before the name can appear."""
        raise NotImplementedError

    @staticmethod
    def _await_ready() -> None:
        """Call the ``ready`` of the :meth:`create` this thread runs, if it has one."""
        ready = getattr(_READY, "fn", None)
        if ready is not None:
            ready()

    def _put(self, rel: str, data: bytes, durable: bool) -> None:
        self.fs.pipe_file(self.path(rel), data)

    def _landed(self, rel: str, data: bytes) -> bool:
        """After a create met an existing object: was it an earlier attempt of ours whose
        reply was lost? Only backends that retry can tell (and need to)."""
        return False

    # -- reads -----------------------------------------------------------------------------

    def read(self, rel: str, *, check: Callable[[bytes], None] | None = None) -> bytes:
        """The object's bytes; ``FileNotFoundError`` if it does not exist. ``check`` verifies
        them (raising :class:`CorruptStoreError`); a remote read that fails it is fetched again
        in case the body was cut short in transit, and the error stands only if it persists."""

        def fetch() -> bytes:
            data = self._cat(rel)
            if check is not None:
                check(data)
            return data

        return self._call("read", rel, fetch, retry_corrupt=check is not None)

    def read_ranges(
        self,
        ranges: Sequence[tuple[str, int, int]],
        *,
        check: Callable[[list[bytes]], None] | None = None,
    ) -> list[bytes]:
        """The bytes ``[start, end)`` of each ``(rel, start, end)``, in order (ranged GETs on
        object stores, issued together); ``FileNotFoundError`` if a file does not exist.
        ``check`` verifies them, and a failure is fetched again as in :meth:`read`."""

        def fetch() -> list[bytes]:
            data = self._cat_ranges(ranges)
            if check is not None:
                check(data)
            return data

        rel = ranges[0][0] if ranges else ""
        return self._call("read", rel, fetch, retry_corrupt=check is not None)

    def try_read(self, rel: str) -> bytes | None:
        try:
            return self.read(rel)
        except FileNotFoundError:
            return None

    #: Whether :meth:`read_many` issues its reads together (object stores), so that reading
    #: a few more files than needed costs no time.
    concurrent_reads: ClassVar[bool] = False

    def read_many(self, rels: Sequence[str]) -> list[bytes | None]:
        """:meth:`try_read` of each of ``rels``, in order (None for a missing file). One after
        another here, where a read costs no round trip; object stores issue them together."""
        return [self.try_read(rel) for rel in rels]

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

    def now(self) -> float | None:
        """The storage's own clock, as a POSIX timestamp: the modification time of a probe
        object written just now, or None where the backend keeps no times.

        The storage stamps every object it stores by this one clock (the kernel's clock of the
        machine that owns a local disk, the server's on S3), so an age taken as ``now() -
        modified(rel)`` is the difference of two readings of the same clock: no host's clock
        enters it, and a skew between hosts of any size changes nothing. A probe left behind
        by a crash has a name gc removes (``_dynstate/probe/<32 hex>``)."""
        probe = paths.probe_path()
        self.put(probe, b"clock", durable=False)
        try:
            return self.modified(probe)
        finally:
            try:
                self.delete(probe)
            except StorageError as exc:
                log.warning("could not remove probe %s/%s: %s", self.display_url, probe, exc)

    def contained(self, rel: str) -> bool:
        """Whether ``rel`` really is a file inside the root (no symlink leads it elsewhere);
        gc deletes nothing else. Object stores have no links."""
        return True

    # -- writes ----------------------------------------------------------------------------

    def create(
        self,
        rel: str,
        data: bytes,
        *,
        durable: bool = True,
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Create ``rel`` holding ``data`` only if it does not exist yet, atomically: readers
        see the whole object or nothing. Raises ``FileExistsError`` when it exists.
        ``durable=False`` skips the fsyncs where a crash of the machine loses nothing (leases:
        the writer dies with it). ``ready`` is called before the name can appear (and may
        raise, then nothing is created): a record waits there for its shards to be durable,
        so that writing and syncing its own bytes overlaps their sync (local disks)."""
        previous = getattr(_READY, "fn", None)
        _READY.fn = ready
        try:
            self._call("create", rel, lambda: self._create(rel, data, durable))
        except FileExistsError as exc:
            exists = exc
        else:
            return
        finally:
            _READY.fn = previous
        # Outside the handler: an error of the read-back must not carry the refusal as its
        # context (the error table reads S3's code along that chain: a reset connection
        # would read as "PreconditionFailed", permanent, and go unretried).
        if not self._landed(rel, data):
            raise exists
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
        """Write ``rel``, replacing any previous content (hints, leases, tags moved with
        force; never data). ``durable=False`` skips the fsync where a lost write is harmless."""
        self._call("write", rel, lambda: self._put(rel, data, durable))

    def swap(self, rel: str, data: bytes, expected: bytes) -> bool:
        """Write ``data`` at ``rel`` only while it holds ``expected`` (a tag moved with force,
        and moved back): True if ``rel`` holds ``data`` now, False if it holds something
        else (another writer moved it). Object stores served by obstore make the write
        conditional on the version read (``If-Match``), so a request of this call that lands
        after a later write, or a retry of it, changes nothing; here (local files, memory,
        fsspec) a read, a comparison and a write, as no request of these arrives late."""

        def attempt() -> bool:
            current = self._cat(rel)
            if current == data:
                return True
            if current != expected:
                return False
            self._put(rel, data, True)
            return True

        return self._call("write", rel, attempt)

    def overwrite(self, rel: str, data: bytes) -> None:
        """Replace the content of an advisory file (the head hint) as cheaply as the backend
        allows, not durably: a reader may meet the old bytes, the new ones or, locally, a
        mix of both, so only a file whose readers check and ignore what they cannot use may
        be written this way, and its writers keep its size fixed."""
        self.put(rel, data, durable=False)

    def delete(self, rel: str) -> None:
        try:
            self._call("delete", rel, lambda: self.fs.rm_file(self.path(rel)))
        except FileNotFoundError:
            pass

    @contextmanager
    def new_shard(self, rel: str, *, deferred: DeferredSync | None = None) -> Iterator[ShardSink]:
        """A sink for a new immutable data file under a fresh unique name (never overwrites);
        it hashes what passes through. This default buffers and uploads in one exclusive
        create when the block ends; local disks stream instead. ``deferred``: the file's
        fsync is left to :meth:`DeferredSync.run` (local disks; elsewhere the create is the
        durable point and there is nothing to defer)."""
        sink = ShardSink(None)
        yield sink
        self.create(rel, sink.getvalue())

    def deferred_sync(self, rel_dir: str) -> DeferredSync:
        """A :class:`DeferredSync` of new files under ``rel_dir``."""
        return DeferredSync(self, rel_dir)

    def sync_dir(self, rel_dir: str) -> None:
        """Make the names created under ``rel_dir`` durable (local disks); a no-op elsewhere."""

    # -- conditional writes ----------------------------------------------------------------

    def check_exclusive_create(self) -> bool:
        """Whether the backend really refuses a second exclusive create of the same key.
        Some S3-compatible stores ignore ``If-None-Match``; find out once, by trying."""
        if self._exclusive_ok is None:
            probe = paths.probe_path()
            created = False
            try:
                self.create(probe, b"1")
                created = True
                try:
                    self.create(probe, b"2")
                    ok = False  # the header was ignored: the second create replaced the first
                except FileExistsError:
                    ok = True
            except FileNotFoundError:
                raise StoreNotFoundError(
                    f"cannot write to {self.display_url}: the bucket (or folder above it) does "
                    "not exist; create the bucket first, or check the URL"
                ) from None
            except StorageError as exc:
                if is_transient(exc) or row_of(exc)[0] in _NOT_ABOUT_THE_HEADER:
                    # unreachable or overloaded, writes refused (read-only or no credentials,
                    # a missing bucket, a skewed clock): nothing about the header, and
                    # single_writer=True would not help
                    raise
                log.info("%s rejects conditional writes: %s", self.display_url, exc)
                ok = False
            except FileExistsError:
                # a fresh random name taken: the backend maps names otherwise than written
                # (never delete what it names then: another object may be there)
                raise StorageError(
                    f"cannot write to {self.display_url}: a new file {probe} already exists "
                    "there, so the location does not keep the names written; check the URL"
                ) from None
            finally:
                try:
                    if created:  # only ours: a create that failed names nothing of ours
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


# Failures of the exclusive-create probe that say nothing about the conditional header.
_NOT_ABOUT_THE_HEADER = (CREDENTIALS, DENIED, NO_BUCKET, REFUSED, SKEWED)

is_safe_name = paths.is_safe_name  # the name grammar lives in dynstate.paths


class DeferredSync:
    """Files written under one folder whose fsync is deferred: :meth:`run` (on another
    thread, while the commit record is written) fsyncs each file on the descriptor it was
    written through, kept open so that a write-back error is reported to it, then the
    folder; :meth:`close` closes them unsynced (a failed write: nothing will name them).
    Each descriptor is closed exactly once, by whichever comes first."""

    def __init__(self, storage: Storage, rel_dir: str) -> None:
        self.storage = storage
        self.rel_dir = rel_dir
        self._fds: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    @property
    def pending(self) -> bool:
        return bool(self._fds)

    def add(self, rel: str, fd: int) -> None:
        with self._lock:
            self._fds.append((rel, fd))

    def _take(self) -> list[tuple[str, int]]:
        with self._lock:
            fds, self._fds = self._fds, []
        return fds

    def run(self) -> None:
        fds = self._take()
        try:
            for rel, fd in fds:
                self.storage._call("sync", rel, functools.partial(os.fsync, fd))
        finally:
            for _, fd in fds:
                os.close(fd)
        self.storage.sync_dir(self.rel_dir)

    def close(self) -> None:
        for _, fd in self._take():
            os.close(fd)


# A shard sink hashes and writes inline until this many bytes have passed through it, then
# hands both to a thread of its own (the shard's writer), so that pyarrow's encoder, on the
# caller's thread, no longer waits for them: hashlib and os.write release the GIL, and a
# 64 MiB shard's whole-file SHA-256 and writes (~0.08 s of a 0.2 s write_shard here) then
# overlap its encoding. Below it (a 64-row round's few KiB, an outcome file) a thread's start
# and join would cost more than they overlap; 1 MiB inline costs under 1 ms.
# Why this hash moves rather than rowgroups' per-row-group one (which costs the same per
# byte): moving that one left the writes inline and made the 99 MB round's two shards no
# faster (median 0.433 s against 0.438 s here, min 0.419 against 0.371, 7 rounds, load
# <= 1), and it would make each cut's digest wait for a thread. The overlap needs a free
# core: on 2 busy cores (load 4-6) the append was 13 % slower with it (median of rounds).
PIPELINE_AFTER = 1 << 20
# Bytes handed to the writer thread at a time (one lock round trip and one writev per
# batch rather than per pyarrow write: ~2,000 of those a 64 MiB shard), and the most that
# may wait for it: the encoder blocks beyond that, so a slow disk bounds memory, not time.
_BATCH_BYTES = 1 << 20
_IN_FLIGHT_BYTES = 8 << 20
_IOV_MAX = 1024  # POSIX's minimum is 16; Linux and macOS allow 1024 buffers per writev


class ShardSink:
    """A write-only file object for pyarrow that hashes (SHA-256) and counts what it is
    given, writing it to ``fd`` — or keeping it in memory when ``fd`` is None.

    Past ``pipeline_after`` bytes (default :data:`PIPELINE_AFTER`) a descriptor's hashing
    and writing move to a writer thread; :meth:`finish` waits for it and raises the error it
    met (the same ``OSError`` an inline write raises; a later :meth:`write` raises it too),
    and :meth:`abort` stops it. The file's owner calls one of them before anything reads
    :attr:`sha256` or touches the descriptor again."""

    def __init__(self, fd: int | None, *, pipeline_after: int | None = None):
        self._fd = fd
        self._hash = hashlib.sha256()
        self._buffer: list[bytes] | None = [] if fd is None else None
        self._pipeline_after = PIPELINE_AFTER if pipeline_after is None else pipeline_after
        self._writer: _ShardWriter | None = None
        self._batch: list[memoryview] = []
        self._batch_bytes = 0
        self._aborted = self._sealed = False
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        if self._sealed:
            # A pyarrow writer left open by a failed write closes when it is collected and
            # writes its footer then: never into a descriptor closed (and maybe reused) since.
            raise ValueError("write to a shard sink after finish() or abort()")
        view = memoryview(data)
        n = view.nbytes
        if self._writer is not None:
            # Queued, not written yet: only an immutable object may be held (pyarrow passes
            # a fresh bytes each call); anything else is copied now.
            self._batch.append(view if isinstance(view.obj, bytes) else memoryview(bytes(view)))
            self._batch_bytes += n
            if self._batch_bytes >= _BATCH_BYTES:
                self._hand_off()
        else:
            self._hash.update(view)
            if self._buffer is not None:
                self._buffer.append(bytes(view))
            else:
                assert self._fd is not None
                write_all(self._fd, view)
                if self.size + n >= self._pipeline_after:
                    self._writer = _ShardWriter(self._fd, self._hash)
        self.size += n
        return n

    def _hand_off(self) -> None:
        assert self._writer is not None
        batch, nbytes = self._batch, self._batch_bytes
        self._batch, self._batch_bytes = [], 0
        self._writer.put(batch, nbytes)

    def finish(self) -> None:
        """Wait until every byte given is written and hashed; raise the writer's error."""
        self._sealed = True
        if self._writer is None:
            return
        if self._batch:
            self._hand_off()
        self._writer.join(raise_error=True)  # on error the sink stays unfinished: abort()
        self._writer = None

    def abort(self) -> None:
        """Stop the writer thread (after the write it is in) and drop what it has not
        written: the file is being removed."""
        writer, self._writer = self._writer, None
        self._batch, self._batch_bytes = [], 0
        self._aborted = self._sealed = True
        if writer is not None:
            writer.join(raise_error=False)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    @property
    def sha256(self) -> str:
        if self._writer is not None or self._aborted:
            # a programming error, not the store's: a digest of bytes not (all) written
            raise RuntimeError("ShardSink.sha256 read before finish() or after abort()")
        return self._hash.hexdigest()

    def getvalue(self) -> bytes:
        return b"".join(self._buffer or [])


class _ShardWriter:
    """The thread that hashes and writes a large shard's bytes, in the order given, while
    the caller's thread encodes the next ones (see :data:`PIPELINE_AFTER`). Its first error
    stops it and is kept for :meth:`put` and :meth:`join` to raise on the caller's thread."""

    def __init__(self, fd: int, hash: Any) -> None:
        self._fd = fd
        self._hash = hash
        self._queue: collections.deque[tuple[list[memoryview], int]] = collections.deque()
        self._queued = 0  # bytes given and not yet written, the batch being written included
        self._closing = False
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dynstate-shard-writer", daemon=True)
        self._thread.start()

    def put(self, batch: list[memoryview], nbytes: int) -> None:
        with self._cond:
            while self._queued >= _IN_FLIGHT_BYTES and self.error is None:
                self._cond.wait()
            if self.error is not None:
                raise self.error
            self._queue.append((batch, nbytes))
            self._queued += nbytes
            self._cond.notify_all()

    def join(self, *, raise_error: bool) -> None:
        with self._cond:
            self._closing = True
            if not raise_error:
                self._queue.clear()
            self._cond.notify_all()
        self._thread.join()
        if raise_error and self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, nbytes = self._queue.popleft()
            try:
                for view in batch:
                    self._hash.update(view)
                writev_all(self._fd, batch)
            except BaseException as exc:
                with self._cond:
                    self.error = exc
                    self._queue.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._queued -= nbytes
                self._cond.notify_all()


def write_all(fd: int, data: Any) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def writev_all(fd: int, views: Sequence[memoryview]) -> None:
    """Write ``views`` to ``fd`` in order, a system call per up to :data:`_IOV_MAX` of them
    (resuming after a short write); byte for byte what :func:`write_all` of each writes."""
    pending = [v for v in views if v.nbytes]
    first = 0
    while first < len(pending):
        written = os.writev(fd, pending[first : first + _IOV_MAX])
        while written and written >= pending[first].nbytes:
            written -= pending[first].nbytes
            first += 1
        if written:
            pending[first] = pending[first][written:]
