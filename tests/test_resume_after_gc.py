"""Resume after gc (issue 13): ``lineage``, ``version_at_step`` and ``rollback(step=N)`` work
for every step gc kept — with ``keep``, ``older_than`` and tags — and a collected step raises
:class:`VersionCollectedError` naming the oldest kept version. The rounds carry verl's meta
(``step``, ``generator``, ``rows``) and the resume is verl's: ``rollback(step=N)``."""

from __future__ import annotations

import time

import pytest

from dynstate import Store, VersionCollectedError, lineage, rollback, version_at_step
from dynstate.maintenance.gc import collect_garbage


def verl_round(store: Store, step: int) -> int:
    rows = [{"prompt": f"s{step}-{i}", "step": step} for i in range(4)]
    return store.append(rows, meta={"step": step, "generator": "gen", "rows": len(rows)})


def build(url: str, steps: range, *, pause_after: int | None = None) -> tuple[Store, dict]:
    """An import (no step), then one round per step; returns the version of each step and,
    with ``pause_after``, under ``"pause"`` the storage's clock read after that step's round
    (a moment past its stamp, so that rounds before and after it stamp apart)."""
    store = Store.open(url, create=True)
    store.append([{"prompt": f"seed-{i}", "step": -1} for i in range(8)], meta={"import": True})
    at = {}
    for step in steps:
        at[step] = verl_round(store, step)
        if step == pause_after:
            time.sleep(store.storage.clock_resolution_s + 0.05)
            at["pause"] = store.storage.now()
    return store, at


def rows_of(store: Store, version: int | None = None) -> list[str]:
    return store.snapshot(version).to_arrow().column("prompt").to_pylist()


def check_kept_steps(store: Store, at: dict[int, int], expected: dict[int, list[str]]) -> None:
    """Every step whose round gc kept resolves and rolls back exactly; older ones are refused
    with the oldest kept version named."""
    floor = store.log.read_floor()
    kept = [s for s, v in at.items() if v >= floor]
    assert kept, "the test must keep some steps"
    assert lineage(store) == list(range(store.head, floor - 1, -1))
    for step in kept:
        assert version_at_step(store, step) == at[step]
    for step in [s for s in at if s not in kept]:
        with pytest.raises(VersionCollectedError, match=f"oldest kept is {floor}"):
            version_at_step(store, step)
    # verl's resume: roll back to the checkpoint's step, continue from there.
    step = kept[len(kept) // 2]
    head = rollback(store, step=step, meta={"verl_resume_step": step})
    assert head == store.head and rows_of(store) == expected[step]
    assert version_at_step(store, step) == head  # the reset stands for that step now
    assert lineage(store)[:2] == [head, at[step]]
    verl_round(store, step + 1)
    assert rows_of(store)[: len(expected[step])] == expected[step]


def expected_rows(store: Store, at: dict[int, int]) -> dict[int, list[str]]:
    return {step: rows_of(store, v) for step, v in at.items()}


def test_resume_after_gc_keep_n(durable_url: str) -> None:
    store, at = build(durable_url, range(1, 11))
    expected = expected_rows(store, at)
    result = collect_garbage(store, keep=4, grace_s=0, dry_run=False)
    assert result.floor_after == at[7]
    check_kept_steps(Store.open(durable_url), at, expected)


def test_resume_after_gc_older_than(tmp_path) -> None:
    url = str(tmp_path / "store")
    store, at = build(url, range(1, 9), pause_after=4)
    pause = at.pop("pause")
    expected = expected_rows(store, at)
    # gc a second after the pause began, by the storage's clock (not sleeping that second).
    result = collect_garbage(store, older_than_s=1.0, grace_s=0, dry_run=False,
                             clock=lambda: pause + 1.0)  # fmt: skip
    assert result.floor_after == at[5]  # the rounds after the pause are recent
    check_kept_steps(Store.open(url), at, expected)


def test_a_tag_really_pins_the_checkpoint(tmp_path) -> None:
    """The checkpoint of step 3 is tagged: gc --keep 1 keeps it and everything after it,
    so resuming from it still works; nothing older is kept."""
    url = str(tmp_path / "store")
    store, at = build(url, range(1, 9))
    expected = expected_rows(store, at)
    store.tag("ckpt-3", at[3])
    assert collect_garbage(store, keep=1, grace_s=0, dry_run=False).floor_after == at[3]
    again = Store.open(url)
    assert rows_of(again, "ckpt-3") == expected[3]
    check_kept_steps(again, at, expected)


def test_resume_across_an_earlier_rollback_after_gc(tmp_path) -> None:
    """A run that already resumed once (a reset in its lineage) and then had its older
    versions collected, the reset's target among them: the steps after the reset still
    resolve, the reset stands for its step, and older steps are refused."""
    url = str(tmp_path / "store")
    store, at = build(url, range(1, 8))
    rollback(store, step=4)  # a crash after step 7, resumed from the checkpoint of step 4
    at_reset = store.head
    for step in range(5, 9):
        at[step] = verl_round(store, step)
    expected = {s: rows_of(store, v) for s, v in at.items() if v > at_reset or s <= 4}
    collect_garbage(store, keep=5, grace_s=0, dry_run=False)  # the floor is the reset itself
    again = Store.open(url)
    assert again.log.floor == at_reset
    assert lineage(again)[-1] == at_reset
    assert version_at_step(again, 4) == at_reset  # recorded on the reset by rollback
    for step in range(5, 9):
        assert version_at_step(again, step) == at[step]
    with pytest.raises(VersionCollectedError, match=f"oldest kept is {at_reset}"):
        version_at_step(again, 3)
    assert rollback(again, step=6) == again.head
    assert rows_of(again) == expected[6]


def test_rollback_to_a_collected_step_changes_nothing(tmp_path) -> None:
    url = str(tmp_path / "store")
    store, at = build(url, range(1, 6))
    collect_garbage(store, keep=2, grace_s=0, dry_run=False)
    head = store.refresh()
    with pytest.raises(VersionCollectedError, match=f"oldest kept is {at[4]}"):
        rollback(store, step=2)
    with pytest.raises(VersionCollectedError):
        rollback(store, step=-1)  # the import went with the collected versions
    assert store.refresh() == head
