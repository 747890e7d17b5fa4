"""Local disks (and ``file://``): exclusive create by ``link()``, fsync of files and folders.

The operations a commit makes (reads of small files, existence checks, removals, creates)
call ``os`` directly rather than through fsspec's local filesystem, whose path handling costs
a commit's dozen calls tens of microseconds each; they raise the same builtins, and
:meth:`Storage._call` translates failures as before. Folders are created on the first miss
(``FileNotFoundError`` from the create), not checked before every write.

Reads (stat, listing) use ``os`` too, and the root is worked out the way fsspec's local
filesystem would (:func:`fsspec_local_path`), so a process that only reads a local store
never imports fsspec; :attr:`Storage.fs` is still there, built on first use.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

from .. import paths
from .base import DeferredSync, ShardSink, Storage, write_all

T = TypeVar("T")

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def fsspec_local_path(url: str) -> str | None:
    """The path ``fsspec.core.url_to_fs(url)`` gives a local ``url`` (a path, ``file://``,
    ``local://``), worked out without importing fsspec: the prefix stripped, the path made
    absolute the way fsspec's ``make_path_posix`` does (``~`` expanded, no ``..`` resolved),
    trailing slashes dropped. None where only fsspec can tell: chained URLs (``::``), the
    ``file:``/``local:`` prefixes without ``//``, other platforms than POSIX."""
    if os.sep != "/" or "::" in url:
        return None
    if url.startswith(("file://", "local://")):
        path = url.split("://", 1)[1]
    elif "://" in url or url.startswith(("file:", "local:", "data:")):
        return None
    else:
        path = url
    if path.startswith("/"):
        pass
    elif path.startswith("~"):
        path = os.path.expanduser(path)
    else:
        if path.startswith("./"):
            path = path[2:]
        elif path == ".":
            path = ""
        path = f"{os.getcwd()}/{path}"
    return path.rstrip("/") or "/"


class LocalStorage(Storage):
    """A store root in a local directory. Records appear by ``link()`` of a complete,
    fsynced temporary file, so no partial record is ever visible under its final name."""

    reads_in_place = True
    late_requests = False  # a rename either happened or not when the call returns
    # The kernel stamps files by its coarse clock (a few ms); ext4, xfs, btrfs keep ns.
    clock_resolution_s = 0.01

    def _locate(self) -> str:
        root = fsspec_local_path(self.url)
        return super()._locate() if root is None else root

    def _in_folder(self, rel: str, fn: Callable[[str], T]) -> T:
        """``fn(folder)`` for the folder of ``rel``, creating the folder (and any above it)
        only if ``fn`` finds it missing: one ``makedirs`` per new folder, not per write."""
        directory = os.path.dirname(self.path(rel))
        try:
            return fn(directory)
        except FileNotFoundError:
            os.makedirs(directory, exist_ok=True)
            return fn(directory)

    def _create(self, rel: str, data: bytes, durable: bool = True) -> None:
        def create(directory: str) -> None:
            tmp = os.path.join(directory, paths.tmp_name())
            _write_new(tmp, data, durable)
            try:
                self._await_ready()  # what must be durable before this name (a record's shards)
                # link() fails if the name exists: the exclusive create, with no partial file
                # ever visible under the final name.
                os.link(tmp, self.path(rel))
            finally:
                os.unlink(tmp)
            if durable:
                _fsync_dir(directory)

        self._in_folder(rel, create)

    def _cat(self, rel: str) -> bytes:
        with open(self.path(rel), "rb", buffering=0) as f:
            return f.readall()

    def exists(self, rel: str) -> bool:
        return self._call("check", rel, lambda: os.path.exists(self.path(rel)))

    def delete(self, rel: str) -> None:
        try:
            self._call("delete", rel, lambda: os.remove(self.path(rel)))
        except FileNotFoundError:
            pass

    def _cat_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        # pread on one descriptor per file: fsspec opens the file again for every range.
        out: list[bytes] = []
        fds: dict[str, int] = {}
        try:
            for rel, start, end in ranges:
                fd = fds.get(rel)
                if fd is None:
                    fd = fds[rel] = os.open(self.path(rel), os.O_RDONLY)
                out.append(os.pread(fd, end - start, start))
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def size(self, rel: str) -> int:
        return self._call("stat", rel, lambda: os.stat(self.path(rel)).st_size)

    def modified(self, rel: str) -> float | None:
        return self._call("stat", rel, lambda: os.stat(self.path(rel)).st_mtime)

    def list(self, rel_dir: str) -> list[str]:
        path = self.path(rel_dir)

        def names() -> list[str]:
            try:
                with os.scandir(path) as entries:
                    return [entry.name for entry in entries]
            except NotADirectoryError:
                # fsspec's ls of a file (which this replaces) lists the file itself; below a
                # file, its stat raised NotADirectoryError, as this one does
                os.stat(path)
                return [os.path.basename(path.rstrip("/"))]

        try:
            return sorted(self._call("list", rel_dir, names))
        except FileNotFoundError:
            return []

    def _put(self, rel: str, data: bytes, durable: bool) -> None:
        def put(directory: str) -> None:
            tmp = os.path.join(directory, paths.tmp_name())
            _write_new(tmp, data, durable)
            os.replace(tmp, self.path(rel))

        self._in_folder(rel, put)

    def overwrite(self, rel: str, data: bytes) -> None:
        # In place: renaming a new file over the old one makes ext4 (auto_da_alloc) start
        # writing the new file's data at the rename, ~0.2 ms of a 3 ms commit here.
        self._call("write", rel, lambda: self._overwrite(rel, data))

    def _overwrite(self, rel: str, data: bytes) -> None:
        try:
            # No O_CREAT (the first write creates it whole) and no following a link: only a
            # regular file of this one name is written into.
            fd = os.open(self.path(rel), os.O_WRONLY | os.O_NOFOLLOW)
        except OSError:
            self._put(rel, data, False)
            return
        try:
            info = os.fstat(fd)
            regular = stat.S_ISREG(info.st_mode) and info.st_nlink == 1
            if regular and os.pwrite(fd, data, 0) == len(data):
                if info.st_size > len(data):
                    os.ftruncate(fd, len(data))
                return
        finally:
            os.close(fd)
        self._put(rel, data, False)  # a hard link, or a short write: a new file instead

    def contained(self, rel: str) -> bool:
        path = self.path(rel)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return True  # removed meanwhile: deleting it again is a no-op
        # A link, or a folder (or fifo...) under a name the grammar accepts, is not a file
        # dynstate wrote: gc must neither follow nor remove it.
        if not stat.S_ISREG(mode):
            return False
        root = os.path.realpath(self.root or ".")
        real = os.path.realpath(path)
        return os.path.commonpath([root, real]) == root

    @contextmanager
    def new_shard(self, rel: str, *, deferred: DeferredSync | None = None) -> Iterator[ShardSink]:
        """Streamed to disk under ``O_EXCL`` and fsynced (by ``deferred`` if given, which
        then owns the descriptor); a failure removes the partial file. A large shard's bytes
        are hashed and written on a thread of the sink's: the block's end waits for them (and
        raises their error) before the file is synced or named anywhere."""
        fd = self._call(
            "create",
            rel,
            lambda: self._in_folder(rel, lambda _: os.open(self.path(rel), _NEW_FILE, 0o644)),
        )
        sink = ShardSink(fd)
        try:
            yield sink
            sink.finish()
            if deferred is not None:
                deferred.add(rel, fd)
                fd = -1
            else:
                self._call("sync", rel, lambda: os.fsync(fd))
        except BaseException:
            sink.abort()  # its thread writes to fd no more before fd is closed
            os.close(fd)
            fd = -1
            self.delete(rel)
            raise
        finally:
            if fd >= 0:
                os.close(fd)

    def sync_dir(self, rel_dir: str) -> None:
        self._call("sync", rel_dir, lambda: _fsync_dir(self.path(rel_dir)))


def _write_new(path: str, data: bytes, durable: bool) -> None:
    """Write ``data`` to a new file ``path`` (fsynced if ``durable``)."""
    fd = os.open(path, _NEW_FILE, 0o644)
    try:
        write_all(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
