"""The one "round of step N" query (dynstate/log/steps.py) against a brute-force walk of the
commit records, over random histories: rounds with and without steps, empty rounds, several
rounds of one step, rollbacks (resets with ``rollback_step``), plain resets and gc cuts."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynstate import (
    DynstateError,
    RoundTimeoutError,
    Store,
    VersionCollectedError,
    collect_garbage,
    rollback,
)
from dynstate.log import steps

# -- brute force: the definitions, read straight off the records -------------------------------


def _own(store: Store, v: int) -> int | None:
    meta = store.commit_record(v).meta
    step = meta.get("step")
    if step is None and store.commit_record(v).op == "reset":
        step = meta.get("rollback_step")
    return step if type(step) is int else None


def _lineage(store: Store, head: int) -> tuple[list[int], bool]:
    """Oldest first, down to the floor; and whether the floor cut it."""
    floor, chain, v = store.log.floor, [], head
    while v is not None and v >= floor:
        chain.append(v)
        record = store.commit_record(v)
        v = record.target if record.op == "reset" else record.parent
    return chain[::-1], v is not None


def _prefix(pairs: list[tuple[int, int | None]], step: int) -> list[tuple[int, int | None]]:
    cut = next((i for i, (_, s) in enumerate(pairs) if s is not None and s > step), len(pairs))
    return pairs[:cut]


def brute_version_at_step(store: Store, head: int, step: int) -> int | None:
    chain, cut = _lineage(store, head)
    pairs = [(v, _own(store, v)) for v in chain]
    prefix = _prefix(pairs, step)
    ok = [
        v
        for i, (v, _) in enumerate(prefix)
        if not cut or any(s is not None for _, s in prefix[: i + 1])
    ]
    return max(ok) if ok else None


def brute_latest_step(store: Store, version: int) -> int | None:
    chain, _ = _lineage(store, version)
    stepped = [_own(store, v) for v in chain if _own(store, v) is not None]
    return stepped[-1] if stepped else None


def brute_round_version(store: Store, head: int, step: int, after: int) -> int | None:
    chain, _ = _lineage(store, head)
    pairs = [(v, _own(store, v)) for v in chain if v > after]
    held = brute_latest_step(store, after) if after >= 0 else None
    ready = any(s is not None and s >= step for _, s in pairs) or (
        held is not None and held >= step
    )
    if not ready:
        return None
    prefix = [(v, s) for v, s in _prefix(pairs, step) if s is not None]
    exact = [v for v, s in prefix if s == step]
    if exact:
        return exact[0]
    return prefix[-1][0] if prefix else after


def brute_round_of(store: Store, head: int, step: int) -> int | None:
    chain, _ = _lineage(store, head)
    pairs = [(v, _own(store, v)) for v in chain]
    exact = [v for v, s in _prefix(pairs, step) if s == step]
    return exact[0] if exact else None


# -- random histories --------------------------------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("round"), st.integers(0, 3)),  # rows (0: an empty round)
        st.tuples(st.just("again"), st.integers(0, 2)),  # another round of the last step
        st.tuples(st.just("plain"), st.integers(1, 2)),  # an append without a step
        st.tuples(st.just("rollback"), st.integers(-1, 12)),
        st.tuples(st.just("reset"), st.integers(0, 40)),
        st.tuples(st.just("gc"), st.integers(1, 6)),
    ),
    min_size=1,
    max_size=14,
)


def _build(ops: list[tuple[str, int]]) -> Store:
    store = Store.open(f"memory://steps/{uuid.uuid4().hex}", create=True)
    store.append([{"id": -1}], meta={"import": True})
    step = 0  # the next step's number, as a trainer counts
    for op, arg in ops:
        if op == "round":
            store.append([{"id": step * 10 + k} for k in range(arg)], meta={"step": step})
            step += 1
        elif op == "again" and step > 0:
            store.append([{"id": 1000 + k} for k in range(arg)], meta={"step": step - 1})
        elif op == "plain":
            store.append([{"id": 5000 + k} for k in range(arg)])
        elif op == "rollback" and arg < step:
            try:
                rollback(store, step=arg)
            except VersionCollectedError:
                continue
            step = arg + 1
        elif op == "reset":
            target = store.log.floor + arg % (store.refresh() - store.log.floor + 1)
            try:
                store.reset(target)
            except DynstateError:
                continue
            # a trainer resuming there counts on after the newest round it holds
            last = brute_latest_step(store, store.refresh())
            step = max(step, -1 if last is None else last) + (0 if last is None else 1)
        elif op == "gc":
            collect_garbage(store, keep=arg, grace_s=0, dry_run=False)
    store.refresh()
    return store


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS, data=st.data())
def test_step_query_equals_the_brute_force_walk(ops, data):
    store = _build(ops)
    log, head = store.log, store.refresh()
    kept = list(range(log.floor, head + 1))
    for n in range(-1, 14):
        want = brute_version_at_step(store, head, n)
        if want is None:
            with pytest.raises(VersionCollectedError, match=f"step {n} of"):
                steps.version_at_step(log, head, n)
        else:
            assert steps.version_at_step(log, head, n) == want, (n, ops)
        assert steps.round_of(log, head, n) == brute_round_of(store, head, n), (n, ops)
        after = data.draw(st.sampled_from([*kept, -1]))
        got = steps.round_version(log, head, n, after)
        assert got == brute_round_version(store, head, n, after), (n, after, ops)
    for v in kept:
        assert steps.latest_step(log, v) == brute_latest_step(store, v)


def test_rollback_answers_by_the_same_query(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"id": 0}])
    for step in range(5):
        store.append([{"id": step + 1}] if step != 2 else [], meta={"step": step})  # 2: empty
    head = store.refresh()
    assert steps.version_at_step(store.log, head, 2) == 4
    assert rollback(store, step=2) == 7
    assert steps.round_of(store.log, store.head, 2) == 4  # the round, not the reset to it
    assert steps.version_at_step(store.log, store.head, 2) == 7  # the reset stands for step 2
    assert steps.round_of(store.log, store.head, 3) is None  # abandoned with the rollback


def test_wait_round_waits_for_the_commit_and_times_out_typed(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    base = store.append([{"id": 0}])
    writer = Store.open(str(tmp_path / "s"))

    def commit_later() -> None:
        time.sleep(0.3)
        writer.append([{"id": 1}], meta={"step": 0})

    thread = threading.Thread(target=commit_later)
    thread.start()
    got = steps.wait_round(store.log, 0, base, timeout=30, advice="commit it")
    thread.join()
    assert got == base + 1
    with pytest.raises(RoundTimeoutError, match=r"round of step 1 did not appear.*commit it"):
        steps.wait_round(store.log, 1, got, timeout=0.05, advice="commit it")
    assert issubclass(RoundTimeoutError, TimeoutError)
    assert issubclass(RoundTimeoutError, DynstateError)
