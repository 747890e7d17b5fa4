"""Local disks (and ``file://``): exclusive create by ``link()``, fsync of files and folders."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from .. import paths
from .base import ShardSink, Storage, write_all


class LocalStorage(Storage):
    """A store root in a local directory. Records appear by ``link()`` of a complete,
    fsynced temporary file, so no partial record is ever visible under its final name."""

    local = True
    # The kernel stamps files by its coarse clock (a few ms); ext4, xfs, btrfs keep ns.
    clock_resolution_s = 0.01

    def _dir(self, rel: str) -> str:
        directory = os.path.dirname(self.path(rel))
        os.makedirs(directory, exist_ok=True)
        return directory

    def _create(self, rel: str, data: bytes, durable: bool = True) -> None:
        directory = self._dir(rel)
        tmp = os.path.join(directory, paths.tmp_name())
        if durable:
            _write_fsync(tmp, data)
        else:
            with open(tmp, "xb") as f:
                f.write(data)
        try:
            # link() fails if the name exists: the exclusive create, with no partial file ever
            # visible under the final name.
            os.link(tmp, self.path(rel))
        finally:
            os.unlink(tmp)
        if durable:
            _fsync_dir(directory)

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

    def _put(self, rel: str, data: bytes, durable: bool) -> None:
        directory = self._dir(rel)
        tmp = os.path.join(directory, paths.tmp_name())
        if durable:
            _write_fsync(tmp, data)
        else:
            with open(tmp, "xb") as f:
                f.write(data)
        os.replace(tmp, self.path(rel))

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
    def new_shard(self, rel: str) -> Iterator[ShardSink]:
        """Streamed to disk under ``O_EXCL`` and fsynced; a failure removes the partial file."""
        self._call("write", rel, lambda: self._dir(rel))
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
        self._call("sync", rel_dir, lambda: _fsync_dir(self.path(rel_dir)))


def _write_fsync(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
