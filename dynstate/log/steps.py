"""The one answer to "which version is the round of step N" (and the wait for it).

A round is the commit a training step made: its record carries ``meta["step"]``. A rollback's
reset stands for the step it rolled back to (``meta["rollback_step"]``), so a step stays
resolvable after gc collected the version it pointed at. Every reader — the sampler pinning an
epoch or drawing fresh rows, :func:`dynstate.rollback`, both verl trainers — asks here, so gc
cuts, rollbacks, empty rounds (a round of no rows is a round) and the initial import are
treated one way everywhere.

Two readings of one walk over the head's lineage, oldest first, down to the gc floor:

* :func:`round_version` — the version *of the round* of step ``N``: the first version whose
  step is ``N``, else the newest version with a step below ``N`` (versions without a step are
  skipped: a commit of another process or a compaction joins later, whenever it lands). It is
  an answer only once a round of step ``N`` or later is on the lineage; until then ``None``
  (:func:`wait_round` polls for it). The sampler pins by it, so the answer never depends on
  when it was asked.
* :func:`version_at_step` — the store *as of the end* of step ``N``: the newest version whose
  step, or the step of the newest round before it (a version without a step — the import, a
  compaction, a reset — belongs to the step before it), is at most ``N``; an append without
  a step that records outcomes of a step past ``N`` is not (:func:`outcome_step`: those
  outcomes are step ``N + 1``'s or later, and a rollback to ``N`` must drop them). Rollback
  uses it.

Steps along a lineage are expected to grow; both readings stop at the first version whose step
exceeds ``N``, so a lineage whose steps go back answers by its prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..errors import RoundTimeoutError, StateMismatchError, VersionCollectedError
from ..records.manifest import Commit
from .commits import Log

__all__ = [
    "Steps",
    "latest_step",
    "outcome_step",
    "own_step",
    "require_held",
    "round_of",
    "round_version",
    "steps_after",
    "version_at_step",
    "wait_round",
]


def own_step(record: Commit) -> int | None:
    """The step ``record``'s version belongs to by its own record: ``meta["step"]``, or for a
    rollback's reset the step it rolled back to; None for any other version (an int only:
    ``True`` or ``"3"`` is no step)."""
    step = record.meta.get("step")
    if step is None and record.op == "reset":
        step = record.meta.get("rollback_step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def outcome_step(record: Commit) -> int | None:
    """The newest step of the outcomes an append recorded (its outcome field's step ranges;
    a reset's or a compaction's field lists its whole lineage's, so only appends count), or
    None."""
    if record.op != "append" or not record.outcomes:
        return None
    ranges = record.outcomes.get("steps") or []
    return max((int(last) for _, last in ranges), default=None)


def steps_after(log: Log, head: int, after: int = -1) -> list[tuple[int, int | None]]:
    """``(version, own step)`` of the versions of ``head``'s lineage newer than ``after``,
    oldest first, down to the gc floor."""
    out = []
    for version in log.lineage(head):
        if version <= after:
            break
        out.append((version, own_step(log.commit_record(version))))
    return out[::-1]


def latest_step(log: Log, version: int) -> int | None:
    """The step of the newest version of ``version``'s lineage that has one (None if none is
    kept)."""
    for v in log.lineage(version):
        step = own_step(log.commit_record(v))
        if step is not None:
            return step
    return None


def round_version(log: Log, head: int, step: int, after: int) -> int | None:
    """The version of the round of ``step`` on ``head``'s lineage, never older than ``after``
    (a version the caller already holds: ``after`` itself when no newer one qualifies); None
    while no round of ``step`` or later is on the lineage."""
    best, ready = after, False
    for version, own in steps_after(log, head, after):
        if own is None:
            continue
        if own > step:
            ready = True
            break
        best = version
        if own == step:
            # One round per step: later commits of the same step (a rollback's reset to it)
            # hold the same rows, and waiting for them would make the answer timing's.
            ready = True
            break
    if not ready:
        held = latest_step(log, after) if after >= 0 else None
        ready = held is not None and held >= step
    return best if ready else None


def require_held(log: Log, held: int, head: int) -> None:
    """Refuse to go on from ``held``, a version a running sampler has read, to ``head`` unless
    ``head`` descends from it. Another process's reset or rollback puts other rows at the
    numbers the sampler's position counts, and its run's next round would never come: without
    this a mix-mode run waited its whole ``wait_timeout`` for it, and an epoch-mode one went on
    over the other rows. Nothing can tell below the gc floor: then it goes on."""
    if held >= 0 and log.on_lineage(held, head) is False:
        raise StateMismatchError(
            f"the head of {log.display_url} (version {head}) no longer descends from version "
            f"{held}, which this sampler has read: another process reset the store or rolled "
            "it back, and the rows at the numbers its position counts are not the ones it "
            "counted. Stop this run and resume it from a checkpoint (a resume rolls the store "
            f"back to the checkpoint's step), or restore the store first: dynstate reset "
            f"{log.display_url} {held}"
        )


def round_of(log: Log, head: int, step: int) -> int | None:
    """The version on ``head``'s lineage whose round is exactly ``step`` (the first, as
    :func:`round_version` answers), or None. Walks back from the head only as far as the
    newest round before ``step``: O(1) in the history for a caller at the head."""
    found = None
    for version in log.lineage(head):
        own = own_step(log.commit_record(version))
        if own is None or own > step:
            if own is not None:
                found = None  # a later step on the way: step's round must lie below it
            continue
        if own < step:
            break
        found = version
    return found


def version_at_step(log: Log, head: int, step: int) -> int:
    """The newest version of ``head``'s lineage as of the end of ``step`` (see the module
    docstring). When gc collected what ``step`` needs, :class:`VersionCollectedError` names
    the oldest kept version."""
    chain = steps_after(log, head)
    cut = log.lineage_cut(chain[0][0])
    effective: int | None = None
    best: int | None = None
    for version, own in chain:
        if own is None:
            late = outcome_step(log.commit_record(version))
            if late is not None and late > step:
                break
        else:
            if own > step:
                break
            effective = own
        # Below a gc cut the step of a version without one is unknown until a version with a
        # step is seen; on an uncut lineage the versions before any round precede every step.
        if effective is not None or not cut:
            best = version
    if best is None:
        first = next((own for _, own in chain if own is not None), None)
        raise VersionCollectedError(
            f"step {step} of {log.display_url} is older than what gc kept: the oldest kept "
            f"version of the head's lineage is {chain[0][0]} (oldest kept is {log.floor}, "
            f"first kept step {first}); resume from a later checkpoint, or tag the version "
            "a checkpoint's sampler state pins so that gc keeps it"
        )
    return best


def wait_round(
    log: Log,
    step: int,
    after: int,
    *,
    timeout: float,
    advice: str,
    poll: float = 0.01,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """:func:`round_version` of the head, polled until the round of ``step`` is committed;
    after ``timeout`` seconds :class:`RoundTimeoutError` (also a ``TimeoutError``) says so,
    ending with ``advice``; :class:`StateMismatchError` at once when the head no longer
    descends from ``after`` (:func:`require_held`)."""
    deadline = clock() + timeout
    while True:
        head = log.refresh()
        require_held(log, after, head)
        found = round_version(log, head, step, after)
        if found is not None:
            return found
        if clock() > deadline:
            raise RoundTimeoutError(
                f"the round of step {step} did not appear in {log.display_url} within "
                f"{timeout}s; {advice}"
            )
        time.sleep(poll)


class Steps:
    """The step queries of one store (``Store.steps``): the functions above, bound to its log,
    so that a caller above the store asks the store and never reaches into its log."""

    def __init__(self, log: Log) -> None:
        self._log = log

    def after(self, head: int, after: int = -1) -> list[tuple[int, int | None]]:
        """:func:`steps_after`."""
        return steps_after(self._log, head, after)

    def latest(self, version: int) -> int | None:
        """:func:`latest_step`."""
        return latest_step(self._log, version)

    def round_version(self, head: int, step: int, after: int) -> int | None:
        """:func:`round_version`."""
        return round_version(self._log, head, step, after)

    def round_of(self, head: int, step: int) -> int | None:
        """:func:`round_of`."""
        return round_of(self._log, head, step)

    def version_at(self, head: int, step: int) -> int:
        """:func:`version_at_step`."""
        return version_at_step(self._log, head, step)

    def require_held(self, held: int, head: int) -> None:
        """:func:`require_held`."""
        require_held(self._log, held, head)

    def wait_round(self, step: int, after: int, *, timeout: float, advice: str) -> int:
        """:func:`wait_round`."""
        return wait_round(self._log, step, after, timeout=timeout, advice=advice)
