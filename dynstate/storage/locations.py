"""Places outside a store that dynstate writes to or reads from: an export's OUT, a folder of
verl checkpoints mirrored next to a store. :func:`open_location` builds the filesystem the way
a store's is built (:mod:`.connect`: checked options, the extra to install), and every call
on it goes through :meth:`Location.call`, which translates failures by the one client-error
table (:mod:`.errors`) into :mod:`dynstate.errors` types naming the URL, with the location's
credentials scrubbed. A missing object is a :class:`~dynstate.errors.StoreNotFoundError`
(also a ``FileNotFoundError``), an existing one a :class:`~dynstate.errors.StoreExistsError`.

Paths given to a location's methods are the filesystem's own (``bucket/key`` on S3, absolute
paths on a local disk): an export looks at OUT's neighbours and the folders above it too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import IO, Any, TypeVar

from ..errors import DynstateError, StoreExistsError, StoreNotFoundError
from .connect import check_options, connect, protocol_of
from .credentials import Scrubber, guard_loggers, redact, secrets_of
from .errors import text_of, translate

log = logging.getLogger("dynstate")
T = TypeVar("T")


class Location:
    """A URL's filesystem and path, with translated failures. Create with
    :func:`open_location`."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.display_url = redact(url)
        self.storage_options = dict(storage_options or {})
        self._scrubber = Scrubber()
        self._scrubber.add(secrets_of(url, self.storage_options))
        if protocol_of(url) not in ("file", "local", "memory"):
            # The client libraries log request headers at DEBUG level; keep our secrets out.
            guard_loggers(self._scrubber.secrets)
        check_options(url, self.storage_options, self.display_url)
        self.fs, path = connect(url, self.storage_options, self.display_url, self.scrub)
        #: whether the filesystem is the local disk (paths are absolute there)
        self.local = "file" in self.protocols
        self.path = os.path.abspath(path) if self.local else path.rstrip("/") or path

    @property
    def protocols(self) -> tuple[str, ...]:
        protocol = self.fs.protocol
        return tuple(protocol) if isinstance(protocol, (tuple, list)) else (str(protocol),)

    def scrub(self, text: str) -> str:
        """``text`` without this location's credentials (or any the process knows)."""
        return self._scrubber.scrub(text)

    def show(self, path: str) -> str:
        """``path`` of this filesystem as a printable URL (the location's own URL for its
        own path)."""
        if path.rstrip("/") == self.path.rstrip("/"):
            return self.display_url
        if self.local or "://" not in self.url:
            return path
        return redact(f"{self.url.split('://', 1)[0]}://{path}")

    def error(self, what: str, path: str, exc: BaseException) -> BaseException:
        """What the failure ``exc`` of the operation ``what`` on ``path`` means (the client-error
        table; a missing object is StoreNotFoundError, an existing one StoreExistsError)."""
        shown = self.show(path)
        err = translate(exc, what=what, url=self.display_url, path=shown, scrub=self.scrub,
                        keep=(FileNotFoundError, FileExistsError))  # fmt: skip
        if err is not exc or isinstance(exc, DynstateError):
            return err
        if isinstance(exc, FileNotFoundError):
            return StoreNotFoundError(self.scrub(f"nothing at {shown}; check the URL"))
        if isinstance(exc, FileExistsError):
            return StoreExistsError(self.scrub(f"{shown} exists already; choose another path"))
        return err

    def _raise(self, what: str, path: str, exc: BaseException) -> None:
        err: BaseException | None = self.error(what, path, exc)
        try:
            if err is exc:
                raise exc
            # a message that quoted a credential must not come back through the cause
            text = text_of(exc)
            raise err from None if self.scrub(text) != text else exc  # type: ignore[misc]
        finally:
            err = None  # no cycle through this frame (see Storage._call)

    def call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a call on :attr:`fs`, or a library writing through it) translating its
        failures; ``what`` and ``path`` name it in the message."""
        try:
            return fn()
        except Exception as exc:
            self._raise(what, path, exc)
            raise  # unreachable: _raise always raises

    # -- the calls export and the mirror make ------------------------------------------------

    def exists(self, path: str) -> bool:
        return bool(self.call("check", path, lambda: self.fs.exists(path)))

    def isdir(self, path: str) -> bool:
        return bool(self.call("check", path, lambda: self.fs.isdir(path)))

    def size(self, path: str) -> int:
        return int(self.call("stat", path, lambda: self.fs.size(path)) or 0)

    def names(self, path: str) -> set[str]:
        """Names (not paths) of what lies directly in the folder ``path``."""
        entries = self.call("list", path, lambda: self.fs.ls(path, detail=False))
        return {str(p).rstrip("/").rsplit("/", 1)[-1] for p in entries}

    def find(self, path: str) -> dict[str, dict[str, Any]]:
        """Every file under ``path`` with its details (``size``...)."""
        return dict(self.call("list", path, lambda: self.fs.find(path, detail=True)))

    def makedirs(self, path: str) -> None:
        self.call("create", path, lambda: self.fs.makedirs(path, exist_ok=True))

    def remove(self, path: str) -> None:
        """Remove the file or folder ``path`` if there is one."""

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                if self.fs.exists(path):
                    self.fs.rm(path, recursive=self.fs.isdir(path))

        self.call("remove", path, rm)

    def move(self, source: str, target: str, *, recursive: bool = False) -> None:
        self.call(
            "move into place", target, lambda: self.fs.mv(source, target, recursive=recursive)
        )

    @contextlib.contextmanager
    def open(self, path: str, mode: str = "rb", *, name: str | None = None) -> Iterator[IO[bytes]]:
        """A file of the location; failures while opening, in the block and at the close
        (which uploads, on object stores) are translated, naming ``name`` (default:
        ``path``; a temporary file is named by what it becomes); a dynstate error raised in
        the block passes unchanged."""
        what, shown = ("read" if "r" in mode else "write"), name or path
        handle = self.call(what, shown, lambda: self.fs.open(path, mode))
        try:
            yield handle
        except Exception as exc:
            with contextlib.suppress(Exception):
                handle.close()
            self._raise(what, shown, exc)
        else:
            self.call(what, shown, handle.close)

    def read(self, path: str) -> bytes:
        """The file's bytes; StoreNotFoundError (a FileNotFoundError) if there is none."""
        return bytes(self.call("read", path, lambda: self.fs.cat_file(path)))

    def write(self, path: str, data: bytes) -> None:
        self.call("write", path, lambda: self.fs.pipe_file(path, data))

    def upload(self, local_dir: str, path: str) -> None:
        """Copy the local folder ``local_dir`` to ``path``, recursively."""
        self.call("upload to", path, lambda: self.fs.put(local_dir, path, recursive=True))

    def download(self, path: str, local_dir: str) -> None:
        """Copy the folder ``path`` into the local folder ``local_dir``, recursively."""
        self.call(
            "download",
            path,
            lambda: self.fs.get(path.rstrip("/") + "/", local_dir + "/", recursive=True),
        )


def open_location(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Location:
    """The :class:`Location` of ``url`` (a path or any fsspec URL)."""
    return Location(os.fspath(url), storage_options)
