"""Decoded shards on local disk, shared between processes: one uncompressed Arrow IPC file
per shard (and per block of shards a reader joined), written once, memory-mapped by every later
read in any process. The shard cache (:mod:`dynstate.loading.cache`) reads and writes them; a
commit to a local store writes those of its round (:func:`keep_decoded`, from the tables
:mod:`dynstate.fresh` keeps). Derived data only: deleting them is always safe.

What names a file is what makes it safe to map: a shard's content checksums and, on a local
store, ``os.stat`` of the shard file (:func:`decoded_name`), so no file ever answers for bytes
other than those it was decoded from (docs/api.md, "Decoded shards shared between
processes")."""

from __future__ import annotations

import logging
import mmap
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import pyarrow as pa

from .records import manifest as m
from .records.manifest import cache_id

log = logging.getLogger("dynstate")

DEFAULT_DECODED_BYTES = 512 * 2**20  # the shard cache's default size (a commit's bound)


class ShardFiles(Protocol):
    """What the decoded files ask of a store (:class:`dynstate.Store` is one)."""

    @property
    def reads_in_place(self) -> bool: ...

    def shard_file(self, shard: m.ShardRef) -> str | None: ...


def _boot_id() -> str | None:
    """This boot of the machine (Linux), or None where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


# Decoded files are renamed into place without an fsync (a reader's decode would otherwise pay
# one per shard): within one boot the page cache holds every byte written before the rename,
# but after a power loss or a kernel crash a file may come back with its name and zeros, or
# parts of its old blocks, in place of its content. The boot is therefore part of every name:
# a file of an earlier boot answers for nothing (trimmed as the oldest). Where the boot cannot
# be told, each file is fsynced before its rename instead.
_BOOT = _boot_id()
# What a decode gives depends on the code that decodes: part of every name, so that an
# interpreter with another pyarrow, or a dynstate whose decode changed (bump the number), never
# maps a file that an older or newer one wrote; each decodes and writes its own.
_DECODE = f"decode-1;pyarrow-{pa.__version__};boot-{_BOOT}"
# The schema metadata key of a decoded file: the content it was decoded from.
_DECODED_FROM = b"dynstate.decoded_from"
# A writer's temporary file older than this is one whose process died mid-write.
_STALE_TMP_S = 3600.0
# A shard file changed more recently than this is not named for a decoded file yet: the kernel
# stamps change times by a coarse clock (a few ms), so two changes inside one tick look alike.
_RACY_NS = 50_000_000
# A committed shard's table at least this large is written as a decoded file at its commit.
KEEP_DECODED_BYTES = 256 * 1024
# The folder's file count is bounded too: its scan (once a process) stats every file.
MAX_DECODED_FILES = 16384


class Decoded:
    """Decoded shards on local disk: one uncompressed Arrow IPC file per shard, written
    atomically (a temporary file, then a rename) by the first process that decodes the shard
    whole, and memory-mapped by every later read in any process. Processes that map one file
    share its pages through the OS page cache, so a DataLoader's workers hold one copy, not
    one each, and a fresh worker's first batches cost a map (~0.1 ms a shard) instead of a
    decode (~3 ms a 10k-row shard). The folder is kept under ``max_bytes`` (oldest files first
    out); deleting it is always safe.

    It holds derived data only: a shard's bytes are verified against their commit record
    before being decoded into it, and a file that does not open as Arrow, names other content
    or holds another row count is ignored and decoded afresh (a write cut short by a crash
    never has the final name). A file's name (:meth:`name`) is a digest of the shard's content
    checksums and, on a local store, of the shard file's identity and change times as
    ``os.stat`` gives them: a shard damaged or replaced on disk after it was decoded has
    another ctime (which no ``utime`` can set back), so no decoded file answers for it and its
    read verifies the bytes and raises, as without the cache (SPEC §3.9). An object store's
    shard is named by content alone: its objects are not changed in place.

    On by default for local stores, in one folder per user (:func:`default_folder`); for
    object stores under the dataset's ``cache_dir`` with ``DYNSTATE_DECODED_CACHE=1``;
    ``DYNSTATE_DECODED_CACHE=0`` turns it off."""

    def __init__(self, folder: str | None, max_bytes: int):
        self.folder = folder  # None: the default folder for a local store, chosen on first use
        self.max_bytes = max_bytes
        # By shard: its file name, worked out once per process (a stat): a shard changed on
        # disk later reads here as a shard already in memory does (as committed).
        self._names: dict[tuple[str, str], str | None] = {}

    def where(self, store: ShardFiles) -> str | None:
        """The folder, or None while the cache is off."""
        if self.folder is None and store.reads_in_place and _switch() != "0":
            self.folder = default_folder()
        return self.folder

    def path(self, folder: str, name: str) -> str:
        return os.path.join(folder, f"{name}.arrow")

    def name(self, store: ShardFiles, shard: m.ShardRef) -> str | None:
        """The name ``shard``'s decoded file has now, or None (the cache is off, or a local
        shard's file cannot be stat'ed: its read reports why). Taken before the shard's bytes
        are read, so a change to the file between the two fails their verification, and one
        after it changes the name."""
        if self.where(store) is None:
            return None
        key = cache_id(shard)
        if key in self._names:
            return self._names[key]
        name = decoded_name(shard, store.shard_file(shard))
        if name is None:
            return None  # not remembered: a shard changed within the clock tick is asked again
        if len(self._names) > 65536:
            self._names.clear()  # a memo only: forgetting costs a stat
        self._names[key] = name
        return name

    def has(self, store: ShardFiles, shard: m.ShardRef) -> bool:
        name = self.name(store, shard)
        return name is not None and os.path.exists(self.path(self.folder or "", name))

    def read_named(self, folder: str, name: str, rows: int) -> pa.Table | None:
        """The table kept under ``name``, mapped, if it is there, a file of this user's, whole
        and names the content it was asked under; else None."""
        try:
            data = _map_ours(self.path(folder, name))
            if data is None:
                return None
            reader = pa.ipc.open_file(pa.BufferReader(data))
            meta = reader.schema.metadata or {}
            if meta.get(_DECODED_FROM) != name.encode():
                return None
            table = reader.read_all()
        except (OSError, ValueError, pa.ArrowException):
            return None  # absent (the common case), torn or not ours: decode instead
        if table.num_rows != rows:
            return None
        return table.replace_schema_metadata(_strip(table.schema.metadata))

    def write_named(self, folder: str, name: str, table: pa.Table) -> None:
        """Keep ``table`` (decoded from verified bytes) for later reads, readable by this
        user alone, in a folder only this user may write to; a failure only costs them a
        decode."""
        path = self.path(folder, name)
        if os.path.exists(path):
            return
        meta = dict(table.schema.metadata or {})
        meta[_DECODED_FROM] = name.encode()
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if not _ours_alone(folder):
                # Replaced since it was checked (a /tmp cleaner, then someone else): another
                # user could read the rows here, or put a file in their place.
                log.debug("decoded files not written: %s is not this user's alone", folder)
                return
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
            with os.fdopen(os.open(tmp, flags, 0o600), "wb") as sink:
                with pa.ipc.new_file(sink, table.schema.with_metadata(meta)) as writer:
                    writer.write_table(table)
                size = sink.tell()
                if _BOOT is None:  # no boot in the name: durable before it has the name
                    sink.flush()
                    os.fsync(sink.fileno())
            os.replace(tmp, path)
        except (OSError, pa.ArrowException) as exc:
            log.debug("decoded cache write of %s failed: %s", name, exc)
            _unlink(tmp)
            return
        with _FOLDERS_LOCK:
            known = _FOLDERS.get(folder)
            if known is not None:
                known[0] += size
                known[1] += 1
            over = known is None or known[0] > self.max_bytes or known[1] > MAX_DECODED_FILES
        if over:
            self._trim(folder)

    def _trim(self, folder: str) -> None:
        """Scan the folder (its size counts every process's files: once a process, then
        kept up to date with its own writes) and delete the oldest files until it holds at
        most ``max_bytes`` and :data:`MAX_DECODED_FILES`; a reader that mapped one keeps its
        pages."""
        files = []
        now = time.time()
        try:
            with os.scandir(folder) as it:
                for entry in it:
                    try:
                        st = entry.stat()
                    except OSError:
                        continue
                    if entry.name.endswith(".tmp"):
                        if now - st.st_mtime > _STALE_TMP_S or _writer_gone(entry.name):
                            _unlink(entry.path)
                    elif entry.name.endswith(".arrow"):
                        files.append((st.st_mtime, st.st_size, entry.path))
        except OSError:
            return
        files.sort()
        total = sum(size for _, size, _ in files)
        drop = 0
        while len(files) - drop > 1 and (
            total > self.max_bytes or len(files) - drop > MAX_DECODED_FILES
        ):
            _, size, path = files[drop]
            _unlink(path)
            total -= size
            drop += 1
        with _FOLDERS_LOCK:
            _FOLDERS[folder] = [total, len(files) - drop]


def _writer_gone(tmp_name: str) -> bool:
    """Whether the process that named temporary file ``tmp_name`` (``<name>.arrow.<pid>.<thread
    >.tmp``) has exited: it died mid-write (its file is removed at once, not after an hour). A
    pid in use again by another process keeps the file until it is an hour old."""
    parts = tmp_name.split(".")
    try:
        pid = int(parts[-3])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's (EPERM)
    return False


# What this process knows of each folder of decoded files: [bytes, files], from one scan
# and its own writes since (another process's writes are found by its own scans).
_FOLDERS: dict[str, list[int]] = {}
_FOLDERS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    # A lock another thread held at the fork would stay held in the child (a DataLoader
    # worker forked while the parent wrote a decoded file).
    global _FOLDERS_LOCK
    _FOLDERS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def decoded_name(shard: m.ShardRef, path: str | None, *, written: bool = False) -> str | None:
    """The name of ``shard``'s decoded file (:meth:`Decoded.name`): a digest of its content
    checksums, the decoding code's version (:data:`_DECODE`) and, for a shard read in place
    from ``path`` (a local store; None for an object store), of ``os.stat`` of that file.
    None if the file cannot be stat'ed, or changed within the last clock tick (unless this
    process just ``written`` it and holds the very table it committed)."""
    text = _DECODE + "".join(cache_id(shard))
    if path is not None:
        try:
            st = os.stat(path)
        except OSError:
            return None  # not cached: the read raises MissingShardError, naming it
        if not written and time.time_ns() - st.st_ctime_ns < _RACY_NS:
            # Changed within the file system's clock tick: a change made now could keep
            # these very times, so this read decodes.
            return None
        text += f"@{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    return m.sha256(text.encode())


def keep_decoded(
    kept: Sequence[tuple[m.ShardRef, pa.Table]], path_of: Callable[[m.ShardRef], str]
) -> None:
    """After a commit to a local store (``path_of``: where each shard's file lies): write the
    decoded file of each shard whose table the committing process kept (:mod:`dynstate.fresh`,
    exactly what a decode of the file gives) and that is worth it (:data:`KEEP_DECODED_BYTES`),
    so that the first read in another process — a DataLoader worker over the new round — maps
    it instead of decoding. Never raises (the round is committed; a file not written costs a
    decode)."""
    if _switch() == "0":
        return
    folder = default_folder()
    if folder is None:
        return
    decoded = Decoded(folder, DEFAULT_DECODED_BYTES)
    for shard, table in kept:
        if table.get_total_buffer_size() < KEEP_DECODED_BYTES:
            continue  # decoded in ~0.1 ms: not worth a file
        try:
            name = decoded_name(shard, path_of(shard), written=True)
            if name is not None:
                decoded.write_named(folder, name, table)
        except Exception as exc:  # committed: nothing here may raise
            log.debug("decoded file of %s not written: %s", shard.path, exc)


_OFF = frozenset(("0", "false", "off", "no"))
_ON = frozenset(("1", "true", "on", "yes"))
_warned: set[str] = set()


def _switch() -> str | None:
    """``DYNSTATE_DECODED_CACHE`` as "0" (off: ``0``, ``false``, ``off``, ``no``), "1" (on for
    object stores too: ``1``, ``true``, ``on``, ``yes``; any case, spaces around ignored) or
    None (unset or empty: the default). Anything else is the default, said once."""
    raw = os.environ.get("DYNSTATE_DECODED_CACHE")
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _OFF:
        return "0"
    if value in _ON:
        return "1"
    if value and raw not in _warned:
        _warned.add(raw)
        log.warning(
            "DYNSTATE_DECODED_CACHE=%r is neither 0/false/off/no nor 1/true/on/yes; decoded "
            "files keep their default (on for local stores)",
            raw,
        )
    return None


def switched_on() -> bool:
    """``DYNSTATE_DECODED_CACHE=1``: decoded files for object stores too."""
    return _switch() == "1"


# The default folder by temporary directory, once checked (per process).
_default: dict[str, str | None] = {}


def default_folder() -> str | None:
    """The decoded files of local stores: ``$TMPDIR/dynstate-decoded-<uid>``, one folder for
    every store (names are unique to a shard file), bounded as a whole. Used only while it is
    a directory of this user that no one else may write to: another user who could put a file
    in it could make reads return rows no commit wrote. Else None (off, said once)."""
    tmp = tempfile.gettempdir()
    if tmp not in _default:
        _default[tmp] = _checked(os.path.join(tmp, f"dynstate-decoded-{_uid()}"))
    return _default[tmp]


def _uid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else 0  # the owner of the files it makes


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def _map_ours(path: str) -> pa.Buffer | None:
    """The file at ``path`` memory-mapped, if it is a plain file of this user's (checked on the
    open descriptor, so that no file swapped in after a check is read); else None."""
    # O_NONBLOCK: a named pipe at the name would block the open until a writer came
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != _uid() or st.st_size == 0:
            return None
        return pa.py_buffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
    finally:
        os.close(fd)


def _ours_alone(folder: str) -> bool:
    """Whether ``folder`` is a directory of this user's that no one else may write to."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == _uid() and not st.st_mode & 0o022


def _checked(folder: str) -> str | None:
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        log.info("decoded shards are not kept on disk: cannot create %s (%s)", folder, exc)
        return None
    if not _ours_alone(folder):
        log.warning(
            "decoded shards are not kept on disk: %s is not a folder that only this user may "
            "write to; remove it, or set DYNSTATE_DECODED_CACHE=0 to silence this",
            folder,
        )
        return None
    return folder


def _strip(meta: dict[bytes, bytes] | None) -> dict[bytes, bytes] | None:
    if not meta:
        return None
    out = {k: v for k, v in meta.items() if k != _DECODED_FROM}
    return out or None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
