"""Thread pools kept one per process: started on first use, not per call (a thread's start
costs a small read or commit more than its work), and afresh in a forked child — a DataLoader
worker has none of its parent's threads, and a lock one of them held at the fork would stay
held there."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_POOLS: list[ProcessPool] = []


class ProcessPool:
    """This process's pool of threads named ``prefix``: :meth:`executor` starts it with
    ``workers`` threads the first time it is asked for in this process."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._pool: tuple[int, ThreadPoolExecutor] | None = None
        _POOLS.append(self)

    def executor(self, workers: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pool[0] != os.getpid():
                self._pool = (
                    os.getpid(),
                    ThreadPoolExecutor(workers, thread_name_prefix=self.prefix),
                )
            return self._pool[1]

    @property
    def started(self) -> bool:
        """Whether this process has started the pool."""
        return self._pool is not None and self._pool[0] == os.getpid()

    def owns_current_thread(self) -> bool:
        """Whether the caller runs on one of the pool's threads (then work it waits for must
        not queue behind it)."""
        return threading.current_thread().name.startswith(self.prefix)


def _after_fork_in_child() -> None:
    for pool in _POOLS:
        pool._lock = threading.Lock()
        pool._pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
