"""Per-process thread pools (dynstate.threads): one pool per process, reused across calls,
and a fresh one in a forked child even if the parent's lock was held at the fork."""

from __future__ import annotations

import multiprocessing
import os
import threading

from dynstate.threads import ProcessPool


def test_a_pool_is_started_once_and_knows_its_own_threads() -> None:
    pool = ProcessPool("dynstate-test-pool")
    assert not pool.started
    first = pool.executor(2)
    assert pool.executor(2) is first and pool.started
    assert not pool.owns_current_thread()
    assert first.submit(pool.owns_current_thread).result() is True


def _child(pool: ProcessPool, parent_executor_id: int) -> None:
    ok = not pool.started and id(pool.executor(1)) != parent_executor_id
    ok = ok and pool.executor(1).submit(lambda: 41 + 1).result(timeout=10) == 42
    os._exit(0 if ok else 3)


def test_a_forked_child_starts_its_own_pool_while_the_parents_lock_is_held() -> None:
    pool = ProcessPool("dynstate-test-fork")
    executor = pool.executor(1)
    assert executor.submit(lambda: 1).result() == 1
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with pool._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    try:
        child = multiprocessing.get_context("fork").Process(
            target=_child, args=(pool, id(executor))
        )
        child.start()
        child.join(60)
        if child.exitcode is None:
            child.kill()
            child.join()
    finally:
        release.set()
        holder.join()
    assert child.exitcode == 0, "the child hung on the parent's lock or reused its pool"
