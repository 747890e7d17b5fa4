"""Consumption records read back from the log: the record of step N (what a resume continues
from) and every record of a lineage (what an audit or a view folds). The records live in
the commit records of the rounds (:mod:`dynstate.records.consumption`), so reading them is
reading the log: no file of their own, nothing for gc to keep apart.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptStoreError, InvalidDataError
from ..records.consumption import check_record
from .commits import Log
from .steps import own_step, round_of

__all__ = ["Consumption", "check_new_record", "lineage_records", "record_of_step"]


def _checked(log: Log, version: int, record: dict[str, Any]) -> dict[str, Any]:
    """A stored record checked as a commit checks it: a damaged one names its file."""
    try:
        return check_record(record, log.display_url)
    except Exception as exc:
        raise CorruptStoreError(
            f"the consumption record in version {version} of {log.display_url} is not as "
            f"committed ({exc}); run `dynstate verify`, and resume from an earlier checkpoint"
        ) from exc


def record_of_step(log: Log, head: int, step: int) -> tuple[int, dict[str, Any]] | None:
    """(version, record) of the round of ``step`` on ``head``'s lineage, when that round
    recorded its consumption; None otherwise. Walks back from ``head`` only as far as the
    round of ``step`` (:func:`round_of`): the same storage work at step 10,000 as at 10."""
    version = round_of(log, head, step)
    if version is None:
        return None
    record = log.commit_record(version)
    if record.consumption is None or own_step(record) != step or record.op != "append":
        return None
    return version, _checked(log, version, record.consumption)


def check_new_record(log: Log, head: int, record: dict[str, Any]) -> None:
    """Refuse (:class:`InvalidDataError`) a consumption ``record`` (checked alone already) on
    top of ``head`` unless it is the ledger's next: no record of its step or a later one on
    ``head``'s lineage (its rows would count twice), no round of a later step (a resume, which
    walks back by step, would not find it), and, after a record of an earlier step, that of
    the step just before, whose carry is what this one carries in (a step whose record was
    never committed would leave its rows in none). Walks back as :func:`round_of` does, only
    as far as the newest round before ``step``."""
    url, step = log.display_url, record["step"]
    before: tuple[int, dict[str, Any]] | None = None
    newest: int | None = None  # the lineage's newest step: met before any record or cut
    for version in log.lineage(head):
        found = log.commit_record(version)
        own = own_step(found)
        if newest is None and own is not None:
            newest = own
            if newest > step:
                raise InvalidDataError(
                    f"consumption for {url}: step {step} is older than step {newest}, the "
                    f"newest step of the lineage of version {head}; a step's record is "
                    "committed with its round, in step order (roll back to before that step "
                    "to run it again); nothing was committed"
                )
        if found.consumption is not None and found.op == "append":
            theirs = found.consumption.get("step")
            if isinstance(theirs, int) and theirs >= step:
                raise InvalidDataError(
                    f"consumption for {url}: version {version} already holds the consumption "
                    f"record of step {theirs}, so step {step}'s rows would count twice; each "
                    "step's record is committed once (roll back to before that step to run it "
                    "again); nothing was committed"
                )
            before = version, _checked(log, version, found.consumption)
            break
        if own is not None and own < step:
            break  # the round of an earlier step without a record: the ledger starts here
    if before is None:
        return
    version, previous = before
    if previous["step"] != step - 1:
        raise InvalidDataError(
            f"consumption for {url}: the newest record on the lineage of version {head} is "
            f"step {previous['step']}'s (version {version}), so step {step - 1} committed none "
            f"and the rows it drew would be in no record; commit each step's round with its "
            f"record, in order (roll back to step {previous['step']} and run the steps after "
            "it again); nothing was committed"
        )
    if record["format"] == previous["format"] == 1:
        carried = sorted(row for row, _ in previous["carry"])
        if sorted(record["carried_in"]) != carried:
            raise InvalidDataError(
                f"consumption for {url}: step {step} carries in rows "
                f"{sorted(record['carried_in'])[:8]}, but step {previous['step']} (version "
                f"{version}) carried out {carried[:8]}; pass the record DynamicSampling."
                "next_batch returned for the step after the one committed (StepBatch.record), "
                "unchanged; nothing was committed"
            )


def lineage_records(
    log: Log, head: int, limit: int | None = None
) -> list[tuple[int, dict[str, Any]]]:
    """(version, record) of every round of ``head``'s lineage that recorded its consumption,
    oldest first, down to the gc floor (O(lineage): for audits and views, not for resume).
    ``limit``: the newest that many only, walking back no further than the oldest of them."""
    out: list[tuple[int, dict[str, Any]]] = []
    for version in log.lineage(head):
        if limit is not None and len(out) >= limit:
            break
        record = log.commit_record(version)
        if record.consumption is not None and record.op == "append":
            out.append((version, _checked(log, version, record.consumption)))
    return out[::-1]


class Consumption:
    """The consumption records of one store (``Store.consumption``): the functions above,
    bound to its log, so that a caller above the store never reaches into its log."""

    def __init__(self, log: Log) -> None:
        self._log = log

    def of_step(self, head: int, step: int) -> tuple[int, dict[str, Any]] | None:
        """:func:`record_of_step`."""
        return record_of_step(self._log, head, step)

    def lineage(self, head: int, limit: int | None = None) -> list[tuple[int, dict[str, Any]]]:
        """:func:`lineage_records`."""
        return lineage_records(self._log, head, limit)
