"""Retention rules of gc: the floor a rule (``keep`` the newest N versions, or those
``older_than`` a duration by the storage's clock) asks for, the tags that hold it lower, and
the reason for every kept range — the plan that :func:`dynstate.maintenance.gc.collect_garbage`
then carries out. Reads only; nothing here deletes.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

from ..errors import InvalidDataError
from ..log.survey import Clock
from ..records.codec import whole
from ..store import Store

log = logging.getLogger("dynstate")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds in ``"90"``, ``"30s"``, ``"15m"``, ``"2h"``, ``"7d"`` or ``"1w"``."""
    match = _DURATION.match(text)
    if match is None:
        raise InvalidDataError(
            f"cannot read duration {text!r}; write a number with an optional unit s, m, h, d "
            "or w, e.g. 30m or 7d"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True)
class Retention:
    """A retention rule's plan: the floor the rule alone asks for, the tags that may hold it
    lower, and so the floor, with the reason for every kept range.

    Retention is a floor: every version from it to the head is kept, abandoned ones too, and
    the floor never passes a tagged version (docs/format.md, "Retention", says why tags pin
    the range above them rather than only the tagged version, as Lance does)."""

    keep: int | None
    older_than_s: float | None
    floor_before: int
    asked: int  # the floor the rule alone gives
    floor: int  # after tags
    tags: dict[str, int]  # the tags at or above floor_before
    note: str | None = None  # why the rule could not be applied, where it could not

    def _rule(self) -> str:
        if self.keep is not None:
            return f"keep {self.keep}"
        if self.older_than_s is not None:
            return f"older than {_duration(self.older_than_s)}"
        return "no retention rule"

    def _asked_reason(self) -> str:
        if self.keep is not None:
            plural = "" if self.keep == 1 else "s"
            return f"keep {self.keep}: the newest {self.keep:,} version{plural}"
        if self.older_than_s is not None:
            age = _duration(self.older_than_s)
            return f"older than {age}: committed within the last {age}"
        return "no retention rule (keep or older than): every version is kept"

    def pinned_by(self, floor: int) -> list[dict[str, object]]:
        """What sets the floor: the tags on it when they hold it below what the rule asks
        (``{"kind": "tag", "name", "version"}``), else the rule itself or the earlier floor."""
        if floor < self.asked:
            on = sorted(name for name, v in self.tags.items() if v == floor)
            if on:
                return [{"kind": "tag", "name": name, "version": floor} for name in on]
        if self.keep is None and self.older_than_s is None:
            return [{"kind": "no rule", "version": floor}]
        if floor > self.floor_before and floor == self.asked:
            kind = "keep" if self.keep is not None else "older_than"
            return [{"kind": kind, "version": floor}]
        return [{"kind": "earlier floor", "version": floor}]

    def kept(self, floor: int, head: int) -> list[dict[str, object]]:
        """Kept ranges, oldest first, each ``{"from", "to", "reason"}``."""
        out: list[dict[str, object]] = []
        start = max(floor, min(self.asked, head))
        if floor < start:
            pins = self.pinned_by(floor)
            names = ", ".join(str(p["name"]) for p in pins if p["kind"] == "tag")
            tagged = [f"{n} ({v})" for n, v in sorted(self.tags.items(), key=lambda kv: kv[1])
                      if floor <= v < start]  # fmt: skip
            reason = (
                f"tag {names} names version {floor}: the floor never passes a tagged version"
                if names
                else "a tag created while gc ran holds the floor here"
            )
            if len(tagged) > len(pins):
                reason += f" (tags in this range: {', '.join(tagged)})"
            out.append({"from": floor, "to": start - 1, "reason": reason})
        reason = self._asked_reason()
        if self.note:
            reason = f"{reason}; {self.note}"
        elif self.asked <= floor == self.floor_before and self._rule() != "no retention rule":
            reason += " (every kept version already falls within it)"
        out.append({"from": start, "to": head, "reason": reason})
        return out

    def to_json(self, floor: int) -> dict[str, object]:
        return {
            "rule": self._rule(),
            "keep": self.keep,
            "older_than_s": self.older_than_s,
            "asked_floor": self.asked,
            "floor": floor,
            "tags": dict(sorted(self.tags.items())),
            "note": self.note,
        }


def _duration(seconds: float) -> str:
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def retention_floor(
    store: Store, *, keep: int | None = None, older_than_s: float | None = None
) -> int:
    """The floor a retention rule asks for: never above the head or a tagged version."""
    return retention_plan(store, keep=keep, older_than_s=older_than_s).floor


def retention_plan(
    store: Store,
    *,
    keep: int | None = None,
    older_than_s: float | None = None,
    clock: Clock | None = None,
) -> Retention:
    """:func:`retention_floor` with its reasons: the floor the rule alone asks for and the
    tags that hold it lower. ``clock`` stands in for the storage's clock (see
    :func:`dynstate.maintenance.gc.collect_garbage`)."""
    floor_before = store.floor
    asked = _asked_floor(store, keep=keep, older_than_s=older_than_s, clock=clock)
    tags = tags_from(store, floor_before)
    floor = max(floor_before, min([asked, *tags.values()]))
    return Retention(keep, older_than_s, floor_before, asked, floor, tags)


def _asked_floor(
    store: Store,
    *,
    keep: int | None = None,
    older_than_s: float | None = None,
    clock: Clock | None = None,
) -> int:
    """The floor the retention rule alone asks for (tags not considered)."""
    head = store.latest()
    floor = store.floor
    if keep is None and older_than_s is None:
        return floor
    if keep is not None and older_than_s is not None:
        raise InvalidDataError(
            f"gc of {store.display_url}: give either keep or older_than, not both"
        )
    candidate = head
    if keep is not None:
        number = whole(keep)
        if number is None or number < 1:
            raise InvalidDataError(
                f"gc of {store.display_url}: keep must be a whole number of versions, at least "
                f"1 (the head), not {keep!r}"
            )
        candidate = head - number + 1
    else:
        age = older_than_s
        if (
            isinstance(age, bool)
            or not isinstance(age, (int, float))
            or not math.isfinite(age)
            or age < 0
        ):
            raise InvalidDataError(
                f"gc of {store.display_url}: older_than_s must be a finite number of seconds "
                f">= 0, not {age!r} (the CLI's --older-than takes '7d', '12h', '30m')"
            )
        # A version's age is its record's, by the storage's clock (the time the storage
        # stamped on the record, against a probe it stamped just now): the ``created`` a
        # writer wrote in it is its host's clock, which may be hours off.
        now = clock() if clock is not None else store.storage.now()
        if now is None:
            log.warning(
                "gc of %s: the storage keeps no modification times, so no version is "
                "older than %gs by its clock; none collected",
                store.display_url,
                older_than_s,
            )
            return floor
        cutoff = now - float(older_than_s or 0)
        # Walk down from the head while versions are recent; only that run is loaded.
        while candidate - 1 >= floor and _created(store, candidate - 1) >= cutoff:
            candidate -= 1
    return max(floor, candidate)


def tags_from(store: Store, floor: int) -> dict[str, int]:
    """Tags naming versions from ``floor`` on (a tag below it names a collected version), and
    the versions tags are being created for (by intent file: their creates may still land)."""
    out = {}
    for name, version in store.tags().items():
        if version < floor:
            log.warning("tag %r of %s names collected version %d", name, store.display_url, version)
        else:
            out[name] = version
    for intent, version in store.pending_tags().items():
        if version >= floor:
            out[intent] = version
    return out


def tagged(store: Store, floor: int) -> list[int]:
    """Versions tags name, from ``floor`` on."""
    return list(tags_from(store, floor).values())


def _created(store: Store, version: int) -> float:
    """When the storage stamped the record of ``version`` (:meth:`Log.record_time`); +inf
    (recent: kept) where it has no stamp or the record went meanwhile (collected by a gc:
    the floor says what is kept)."""
    stamped = store.log.record_time(version)
    return float("inf") if stamped is None else stamped
