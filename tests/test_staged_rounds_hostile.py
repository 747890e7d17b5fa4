"""Hostile rounds written by several workers: Ray tasks or plain processes stage parts
(``Store.stage``), a driver commits them (``Store.commit_staged`` / ``dynstate.ray``).

Every round is checked against an oracle: the rows each worker meant to write, read back with
plain pyarrow from the committed version's shard files and counted as a multiset. What must
hold (docs/ray.md, docs/api.md "staged parts", docs/format.md "Leases"): a round lands exactly
once or not at all, never a discarded part, the store stays usable, and every failure is a
typed ``DynstateError`` that says what to do.

The tests named ``test_defect_*`` each failed on the code before its fix (each docstring
tells the defect as found); the
``test_guard_*`` tests keep what held up.
"""

from __future__ import annotations

import collections
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pyarrow.parquet as pq
import pytest

from dynstate import (
    CommitConflictError,
    DynstateError,
    InvalidDataError,
    LeaseExpiredError,
    RoundFailedError,
    Store,
)
from dynstate.maintenance.gc import collect_garbage

# -- the oracle --------------------------------------------------------------------------------


def _rows(task: int, n: int = 4) -> list[dict]:
    return [{"task": task, "i": i} for i in range(n)]


def _seed(url: str) -> Store:
    store = Store.open(url, create=True)
    store.append(_rows(-1, 2), meta={"step": 0})
    return store


def _stored(url: str, version: int | None = None) -> collections.Counter:
    """The rows of a version as a multiset, read with plain pyarrow from its shard files."""
    store = Store.open(url)
    snap = store.snapshot(version)
    out: collections.Counter = collections.Counter()
    for shard in snap.shards:
        table = pq.read_table(os.path.join(url, shard.path))
        tasks, items = table.column("task").to_pylist(), table.column("i").to_pylist()
        out.update(zip(tasks, items, strict=True))
    return out


def _expected(*tasks: int) -> collections.Counter:
    out = collections.Counter((r["task"], r["i"]) for r in _rows(-1, 2))
    for t in tasks:
        out.update((r["task"], r["i"]) for r in _rows(t))
    return out


def _data_files(url: str) -> set[str]:
    return {f"data/{n}" for n in os.listdir(os.path.join(url, "data")) if n.endswith(".parquet")}


def _referenced(url: str) -> set[str]:
    store = Store.open(url)
    return {s.path for c in store.versions() for s in store.snapshot(c.version).shards}


def _stagers_gone(url: str) -> bool:
    """Whether some part was staged and the process that staged it has exited."""
    import json

    from dynstate.log.leases import process_gone

    folder = os.path.join(url, "_dynstate", "leases")
    for name in os.listdir(folder):
        if len(name) == len("0" * 32 + ".json"):  # a stager's lease file
            with open(os.path.join(folder, name)) as f:
                if process_gone(json.load(f)["pid"]):
                    return True
    return False


def _wait_for(cond, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# -- Ray -----------------------------------------------------------------------------------------

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from dynstate.ray import commit_round, write_round  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()


def _slow_first(spec: tuple[int, str]) -> list[dict]:
    """Task 0 waits until the test releases it (a long generation); the others return at once."""
    item, release = spec
    if item == 0:
        deadline = time.monotonic() + 90
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
    return _rows(item)


def _stage_slow_first(url: str, item: int, release: str):
    """A task of one's own (docs/ray.md, "Your own tasks and actors"): generate, then stage."""
    return Store.open(url).stage(_slow_first((item, release)))


def _run_in_thread(fn, *args, **kwargs):
    box: dict = {}

    def body():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # reported by the test
            box["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, box


def test_defect_a_part_parked_behind_a_slow_task_is_lost_to_gc(ray_cluster, tmp_path):
    """DEFECT (lost round). ``commit_round`` fetches the parts with ``ray.get`` one by one in
    task-index order (dynstate/ray.py, ``commit_round``'s loop), so a part whose task finished
    early sits unread in Ray's object store — its lease renewed by nobody once its worker
    exited — for as long as any earlier task still runs. A worker exits after its task with
    ``max_calls=1``, Ray's default for GPU tasks (an LLM proposer), set here explicitly on CPU.
    A gc in that gap, at any grace period (the survey ends a lease whose process is gone
    before any grace is looked at), expires the part's lease and the whole round fails with
    ``LeaseExpiredError``: every worker's generation is lost. docs/format.md ("Windows that
    remain") promises the opposite: "``dynstate.ray`` unpickle[s] results as they arrive, so
    the gap is milliseconds". ``write_round`` has the same loop (through ``commit_round``).
    Expected: the round commits, every worker's rows exactly once. Fix: fetch with
    ``ray.wait(pending, num_returns=1)`` as parts complete (unpickling them, and so taking
    their leases over, at once), keep them by index, then commit in index order."""
    url = str(tmp_path / "store")
    store = _seed(url)
    release = str(tmp_path / "release")
    task = ray.remote(max_calls=1)(_stage_slow_first)
    refs = [task.remote(url, item, release) for item in range(2)]
    thread, box = _run_in_thread(commit_round, store, refs, meta={"step": 1})
    try:
        # Part 1 is staged and its worker process exited; part 0 still generates.
        _wait_for(lambda: _stagers_gone(url), what="part 1 to be staged and its worker to exit")
        time.sleep(1.0)  # time enough for a driver that fetches parts as they arrive
        collect_garbage(Store.open(url), dry_run=False)  # the default grace period (an hour)
    finally:
        open(release, "w").close()
        thread.join(120)
    assert "error" not in box, f"round lost: {box.get('error')!r}"
    assert _stored(url, box["value"]) == _expected(0, 1)


def test_defect_write_round_ignores_the_stores_lease_ttl(ray_cluster, tmp_path):
    """DEFECT (lost round). ``write_round(store, ...)`` sends the workers a ``_Target`` of URL,
    storage options and ``single_writer`` only (dynstate/ray.py, ``_Target`` / ``_target``):
    the store's ``lease_ttl_s`` is dropped, so every part is staged (and, through its pickled
    keeper, taken over by the driver) under the default 120 s, whatever the driver opened the
    store with. A driver that chose ``Store.open(url, lease_ttl_s=3600)`` so that staged parts
    survive stalls of up to an hour (a worker on a partitioned node, a paused process) loses
    the round to a gc after two minutes. Here gc's clock runs 10 minutes ahead (the seam
    ``collect_garbage(clock=)`` documents): with the store's ttl the part stays protected.
    Fix: carry ``lease_ttl_s`` in ``_Target`` and open the worker's store with it."""
    url = str(tmp_path / "store")
    _seed(url)
    store = Store.open(url, lease_ttl_s=3600)
    release = str(tmp_path / "release")
    thread, box = _run_in_thread(
        write_round, store, [(0, release), (1, release)], _slow_first, meta={"step": 1}
    )
    try:
        _wait_for(lambda: len(_data_files(url)) > 1, what="part 1 to be staged")
        gc_store = Store.open(url)
        later = lambda: gc_store.storage.now() + 600  # noqa: E731
        collect_garbage(gc_store, grace_s=0, dry_run=False, clock=later)
    finally:
        open(release, "w").close()
        thread.join(120)
    assert "error" not in box, f"round lost: {box.get('error')!r}"
    assert _stored(url, box["value"]) == _expected(0, 1)


def _die_once(url: str, task: int, marker: str):
    """Stage, then (first attempt only) get SIGKILLed before returning the part."""
    part = Store.open(url).stage(_rows(task))
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return part


def test_guard_retried_and_recommitted_rounds_land_exactly_once(ray_cluster, tmp_path):
    """A task SIGKILLed after staging is retried (``max_retries``): the round holds each
    worker's rows exactly once, the dead attempt's shard is collected by gc at once (its
    process is gone), and committing the same refs again is refused naming the version."""
    url = str(tmp_path / "store")
    store = _seed(url)
    marker = str(tmp_path / "died")
    task = ray.remote(_die_once).options(max_retries=1)
    refs = [task.remote(url, t, marker if t == 1 else str(tmp_path)) for t in range(3)]
    version = commit_round(store, refs, meta={"step": 1})
    assert os.path.exists(marker) and version == 2
    assert _stored(url, version) == _expected(0, 1, 2)
    assert len(_data_files(url) - _referenced(url)) == 1  # the killed attempt's shard
    collect_garbage(Store.open(url), grace_s=0, dry_run=False)
    assert _data_files(url) == _referenced(url)
    with pytest.raises(CommitConflictError, match="already committed as version 2"):
        commit_round(store, refs, meta={"step": 1})
    assert Store.open(url).head == 2 and _stored(url) == _expected(0, 1, 2)


def _fail_item(item: int) -> list[dict]:
    if item == 1:
        raise ValueError("generator broke")
    return _rows(item)


def test_guard_parts_of_a_failed_round_cannot_be_committed_later(ray_cluster, tmp_path):
    """A round with a failed task is discarded whole; committing its good parts afterwards is
    refused with ``LeaseExpiredError`` ("stage the round again"), never half a round."""
    url = str(tmp_path / "store")
    store = _seed(url)
    task = ray.remote(_fail_item)
    good = ray.remote(_stage_slow_first)
    refs = [good.remote(url, 2, ""), task.remote(1)]
    with pytest.raises(RoundFailedError):
        commit_round(store, refs, meta={"step": 1})
    with pytest.raises(LeaseExpiredError, match="stage the round again"):
        store.commit_staged([ray.get(refs[0])], meta={"step": 1})
    assert Store.open(url).head == 1 and _stored(url) == _expected()
    assert _data_files(url) == _referenced(url)


NAN = float("nan")


# -- plain processes -----------------------------------------------------------------------------


def _parts(url: str, tasks=(0, 1)) -> list:
    """Parts staged by separate handles, as a driver holds them (pickled over the wire)."""
    return [pickle.loads(pickle.dumps(Store.open(url).stage(_rows(t)))) for t in tasks]


@pytest.mark.parametrize(
    "refused",
    [
        {"meta": {"step": 1}, "outcomes": {"row": [0, 1], "step": [1, 1], "score": [1.0, NAN]}},
        {"meta": {"step": 1.0}},
    ],
    ids=["nan-reward", "float-step"],
)
def test_defect_a_refused_commit_destroys_the_round_it_refused(tmp_path, refused):
    """DEFECT (lost round, misleading error). ``commit_staged`` checks ``meta`` and
    ``outcomes`` inside its commit protocol (``prepare`` in dynstate/writes.py,
    ``Writer.commit_staged``; ``Writer._commit`` runs it inside the ``try``), and every failure
    there goes to ``_resolve_failed_commit``, which discards the parts (claims their leases
    ``discarded`` and deletes their shards). So a refusal of the round's *bookkeeping* — a NaN
    reward among the outcomes, a step passed as a float — deletes what N workers generated,
    while the ``InvalidDataError`` only says how to fix the outcomes. Doing what it says and
    committing again fails with ``LeaseExpiredError`` "stage the round again": the round is
    lost. docs/api.md: "a refusal is an ``InvalidDataError`` and the store is unchanged"; the
    other refusals (``_check_parts``: a part given twice, of another store) leave the parts
    the caller's. Expected: the corrected commit lands, the round's rows exactly once. Fix:
    check ``meta`` and outcomes/generator state before ``_commit``'s ``try`` (as
    ``_check_parts`` is), or have ``_resolve_failed_commit`` keep the parts for a refusal
    raised before the claim."""
    url = str(tmp_path / "store")
    _seed(url)
    parts = _parts(url)
    driver = Store.open(url)
    with pytest.raises(InvalidDataError):
        driver.commit_staged(parts, **refused)
    assert driver.refresh() == 1
    fixed = {"row": [0, 1], "step": [1, 1], "score": [1.0, 0.0]}
    version = driver.commit_staged(parts, meta={"step": 1}, outcomes=fixed)
    assert _stored(url, version) == _expected(0, 1)


def test_defect_recommitting_a_committed_part_after_a_week_says_stage_it_again(tmp_path):
    """DEFECT (an error that says to duplicate the round). A committed part's lease outcome
    (``commit``) stays a week as a tombstone; gc then removes it with the lease's files
    (dynstate/maintenance/gc.py, ``_lease_files``). A driver that commits the same part again
    after that (parts kept with a checkpoint and replayed on a resume) gets
    ``LeaseExpiredError``: "nothing was committed — ... stage the round again"
    (dynstate/log/leases.py, ``Leases._lost`` with no outcome, raised from ``adopt``), and the
    failed attempt even writes a ``discarded`` tombstone over the committed lease
    (``_resolve_failed_commit`` -> ``_discard`` -> ``claim`` -> ``_give_up``), so the next
    attempt says flatly "were discarded ... nothing was committed". Both are false: version 2
    holds the part; staging it again duplicates its rows. Expected: ``CommitConflictError``
    naming the version (what ``_claimed_elsewhere`` says within the week). Fix: when a lease
    has no files left, look for the part's shards in the lineage (as ``_claimed_elsewhere``
    does) before calling it expired, and never claim ``discarded`` a lease that has ended."""
    url = str(tmp_path / "store")
    _seed(url)
    parts = _parts(url)
    saved = pickle.dumps(parts)
    driver = Store.open(url)
    assert driver.commit_staged(parts, meta={"step": 1}) == 2
    week_on = lambda: driver.storage.now() + 8 * 86400  # noqa: E731
    collect_garbage(Store.open(url), grace_s=0, dry_run=False, clock=week_on)
    for _attempt in range(2):
        with pytest.raises(CommitConflictError, match="already committed as version 2"):
            Store.open(url).commit_staged(pickle.loads(saved), meta={"step": 2})
    assert Store.open(url).head == 2 and _stored(url) == _expected(0, 1)


def test_defect_commit_round_refused_keeps_its_good_parts_leased(tmp_path):
    """DEFECT (leak gc cannot remove). ``commit_round`` discards the other parts when a task
    fails or returns no ``Staged``, but not when ``commit_staged`` refuses the gathered parts
    before its claim (``_check_parts``: here a part staged for another store, the task opened
    the wrong URL): dynstate/ray.py, ``commit_round`` calls ``store.commit_staged(staged)``
    with no handler. The driver unpickled every part, which took their leases over
    (``Staged.__setstate__`` -> ``keep_alive``), and its heartbeat renews them for up to a
    week (``MAX_LIFETIME_S``) — the caller of ``commit_round`` never held the ``Staged``
    values, so nothing can discard them, and gc at grace 0 keeps their shards as a live
    writer's. docs/ray.md: "If any task raises ... it deletes the shards of the tasks that did
    succeed". Expected: the refusal is typed and the good parts are gone (discarded by
    ``commit_round``, or at least left to gc). Fix: wrap the ``commit_staged`` call in
    ``commit_round`` and ``store.discard`` the parts on a refusal (``InvalidDataError`` /
    ``StateMismatchError`` before anything was claimed)."""
    url = str(tmp_path / "store")
    _seed(url)
    other = str(tmp_path / "other")
    _seed(other)
    good = _parts(url, (0,))
    foreign = _parts(other, (1,))
    with pytest.raises(DynstateError):
        commit_round(Store.open(url), [*good, *foreign], meta={"step": 1})
    assert Store.open(url).head == 1
    collect_garbage(Store.open(url), grace_s=0, dry_run=False)
    assert _data_files(url) == _referenced(url), "the refused round's part is still leased"


_KILLED_COMMIT = textwrap.dedent(
    """
    import os, pickle, signal, sys
    import dynstate.log as log_module
    import dynstate.log.leases as leases_module
    from dynstate import Store

    url, saved, where = sys.argv[1:]
    with open(saved, "rb") as f:
        parts = pickle.load(f)
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "after_record":
        leases_module.Leases.end = die  # the record exists; the process dies before returning
    else:
        log_module.Log.commit = die  # claimed, then dead before the record
    Store.open(url).commit_staged(parts, meta={"step": 1})
    """
)


def _killed_commit(url: str, parts: list, where: str, tmp_path) -> None:
    saved = str(tmp_path / "parts.pkl")
    with open(saved, "wb") as f:
        pickle.dump(parts, f)
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_COMMIT, url, saved, where], timeout=60, check=False
    )
    assert proc.returncode == -signal.SIGKILL


def test_guard_a_driver_killed_after_its_record_is_not_committed_twice(tmp_path):
    """The driver dies between the record and ``commit_staged``'s return: the round landed
    once; committing (or discarding) the parts again is refused naming the version."""
    url = str(tmp_path / "store")
    _seed(url)
    parts = _parts(url)
    _killed_commit(url, parts, "after_record", tmp_path)
    assert Store.open(url).head == 2 and _stored(url) == _expected(0, 1)
    with pytest.raises(CommitConflictError, match="already committed as version 2"):
        Store.open(url).commit_staged(parts, meta={"step": 1})
    with pytest.raises(CommitConflictError):
        Store.open(url).discard(parts)
    collect_garbage(Store.open(url), grace_s=0, dry_run=False)
    assert Store.open(url).head == 2 and _stored(url) == _expected(0, 1)
    assert _data_files(url) == _referenced(url)


def test_guard_a_driver_killed_after_its_claim_loses_the_round_cleanly(tmp_path):
    """The driver dies between its claim and its record: nothing landed; committing the parts
    again is a ``LeaseExpiredError`` saying the round was NOT stored; a fresh round commits."""
    url = str(tmp_path / "store")
    _seed(url)
    parts = _parts(url)
    _killed_commit(url, parts, "before_record", tmp_path)
    with pytest.raises(LeaseExpiredError, match=r"NOT stored.*stage the round again"):
        Store.open(url).commit_staged(parts, meta={"step": 1})
    assert Store.open(url).head == 1 and _stored(url) == _expected()
    version = Store.open(url).commit_staged(_parts(url, (2, 3)), meta={"step": 1})
    assert _stored(url, version) == _expected(2, 3)


def test_defect_a_dead_committers_round_is_never_collected_while_its_stager_lives(tmp_path):
    """DEFECT (leak, and an error that promises what gc does not do; failed on the code before
    its fix). After the previous
    test's kill between claim and record, commit_staged says "gc removes its files". It does
    not while the process that *staged* the parts lives: gc's survey
    (dynstate/log/survey.py, ``_protected``, kind ``commit``) keeps a claimed lease "while any
    holder is a process of this machine that still exists" (``paused_here``, from
    ``_fresh``), meant for a committer paused between claim and record — but the stager's
    lease file counts as a holder too, and the stager stopped renewing on purpose (its
    heartbeat saw the outcome, ``Leases._tick``). A long-lived stager (a generator service, a
    Ray worker) keeps the dead round's shards forever; here gc's clock runs two hours ahead,
    past ``STALE_CLAIM_S``. Expected: the unreferenced shards are removed. Fix: judge a
    ``commit`` claim by its claimant — the ``pid``/``host`` the claim names (and holder files
    written after it) — not by every holder: a stager whose heartbeat saw the outcome is no
    committer. (Fixed so: ``survey._claimant``.)"""
    url = str(tmp_path / "store")
    _seed(url)
    parts = _parts(url)  # staged by this process, which lives on
    _killed_commit(url, parts, "before_record", tmp_path)
    store = Store.open(url)
    two_hours_on = lambda: store.storage.now() + 7200  # noqa: E731
    collect_garbage(store, grace_s=0, dry_run=False, clock=two_hours_on)
    assert _data_files(url) == _referenced(url), "the dead committer's shards are kept"


_PAUSED_DRIVER = textwrap.dedent(
    """
    import pickle, sys
    from dynstate import Store

    url, saved = sys.argv[1:]
    with open(saved, "rb") as f:
        parts = pickle.load(f)  # takes the leases over (ttl of the stager: 0.5 s)
    print("holding", flush=True)
    sys.stdin.readline()
    try:
        print("committed", Store.open(url).commit_staged(parts, meta={"step": 1}), flush=True)
    except Exception as exc:
        print(type(exc).__name__, exc, flush=True)
    """
)

_STAGER = textwrap.dedent(
    """
    import pickle, sys
    from dynstate import Store

    url, saved, tasks = sys.argv[1:]
    store = Store.open(url, lease_ttl_s=0.5)
    rows = lambda t: [{"task": t, "i": i} for i in range(4)]
    parts = [store.stage(rows(int(t))) for t in tasks.split(",")]
    with open(saved, "wb") as f:
        pickle.dump(parts, f)
    """
)


def test_guard_a_driver_paused_past_the_lease_is_refused_and_the_store_stays_usable(tmp_path):
    """The stager exits, the driver that took its parts over is SIGSTOPped past the lease
    ttl, gc expires and removes them: the driver's commit is ``LeaseExpiredError`` ("stage
    the round again"), nothing is committed, and the store takes the next round."""
    url = str(tmp_path / "store")
    _seed(url)
    saved = str(tmp_path / "parts.pkl")
    subprocess.run([sys.executable, "-c", _STAGER, url, saved, "0,1"], check=True, timeout=60)
    driver = subprocess.Popen(
        [sys.executable, "-c", _PAUSED_DRIVER, url, saved],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert driver.stdout.readline().strip() == "holding"
        os.kill(driver.pid, signal.SIGSTOP)
        store = Store.open(url)
        minute_on = lambda: store.storage.now() + 60  # noqa: E731
        removed = collect_garbage(store, grace_s=0, dry_run=False, clock=minute_on).removed
        assert sum(r.path.startswith("data/") for r in removed) == 2
        os.kill(driver.pid, signal.SIGCONT)
        out, _ = driver.communicate("go\n", timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert out.startswith("LeaseExpiredError") and "stage the round again" in out, out
    assert Store.open(url).head == 1 and _stored(url) == _expected()
    version = Store.open(url).commit_staged(_parts(url, (2,)), meta={"step": 1})
    assert _stored(url, version) == _expected(2)


def test_guard_parts_staged_before_a_reset_and_a_compaction_land_once(tmp_path):
    """Parts staged before a reset and a compaction commit on top of the new head, once."""
    from dynstate import compact

    url = str(tmp_path / "store")
    store = _seed(url)
    store.append(_rows(7), meta={"step": 1})
    early = _parts(url, (0,))
    store.reset(1)
    late = _parts(url, (1,))
    compact(store)
    version = Store.open(url).commit_staged([*early, *late], meta={"step": 2})
    assert _stored(url, version) == _expected(0, 1)
    with pytest.raises(CommitConflictError, match="already committed"):
        Store.open(url).commit_staged(early, meta={"step": 3})
