"""``memory://``: fsspec's in-process filesystem, for tests and examples."""

from __future__ import annotations

import threading

from .base import Storage

# fsspec's memory filesystem is one dict per process, so its exclusive create needs one lock
# per process too.
_LOCK = threading.Lock()


class MemoryStorage(Storage):
    """A store root in fsspec's process-wide memory filesystem. Exclusive create is a
    check-and-write under a lock; nothing survives the process."""

    shared_across_processes = False  # the memory filesystem is this process's
    late_requests = False
    clock_resolution_s = 0.0  # microseconds, from this process's own clock

    def _create(self, rel: str, data: bytes, durable: bool = True) -> None:
        self._await_ready()
        path = self.path(rel)
        with _LOCK:
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)
