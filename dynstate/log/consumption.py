"""Consumption records read back from the log: the record of step N (what a resume continues
from) and every record of a lineage (what an audit or a view folds). The records live in
the commit records of the rounds (:mod:`dynstate.records.consumption`), so reading them is
reading the log: no file of their own, nothing for gc to keep apart.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptStoreError
from ..records.consumption import check_record
from .commits import Log
from .steps import own_step, round_of

__all__ = ["Consumption", "lineage_records", "record_of_step"]


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
