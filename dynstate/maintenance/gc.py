"""Garbage collection: remove files no kept version needs, and versions beyond a retention rule.

Two kinds of garbage:

* **Orphans** — files no commit record refers to: shards of rounds whose writer died before
  committing (or staged parts never committed), temporary files of interrupted local writes,
  metadata of commits that never happened. A live writer's staged shards look like orphans
  until it commits; they are protected by the writer's *lease* (see
  :mod:`dynstate.log.leases`), which gc honours and ends only when the writer stopped renewing
  it — at any grace period, 0 included. The grace period is a minimum age on top of that.
* **Collected versions** — with a retention rule, the versions below a new *floor* ``f``. The
  floor never passes the head or a tagged version, and every file a kept version lists stays.

gc only ever deletes names a matcher of :mod:`dynstate.paths` accepts (``data/<hex>.parquet``,
``_dynstate/log/<n>.json`` ...: the kinds in :data:`dynstate.paths.COLLECTABLE`, next to the
makers writers name them with), reads what kept and collected versions name through the log
(:class:`dynstate.log.Log`), never decodes a record itself, never follows a symlink out of the
store root, and orders its steps so that a crash at
any point leaves a readable store: the floor's checkpoint, then ``gc.json``, then data, then
metadata. A rerun finishes whatever an interrupted one left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import paths
from ..errors import (
    CommitConflictError,
    DynstateError,
    InvalidDataError,
    StorageError,
    VersionCollectedError,
)
from ..log import LeaseState, survey
from ..log.intents import INTENT_S
from ..log.survey import Clock
from ..store import Store
from .references import References, references_below
from .retention import Retention, parse_duration, retention_floor, retention_plan, tagged

__all__ = [
    "BUSY_S",
    "DEFAULT_GRACE_S",
    "STALE_CLAIM_S",
    "TOMBSTONE_S",
    "Clock",
    "GcResult",
    "Removal",
    "Retention",
    "collect_garbage",
    "gc_floor",
    "parse_duration",
    "retention_floor",
    "retention_plan",
]

log = logging.getLogger("dynstate")

DEFAULT_GRACE_S = 3600.0
# Unreferenced files a live writer touches just before it commits (temporary files, probes,
# schemas and chunks it (re)wrote) are left alone for at least this long, whatever the grace.
BUSY_S = 3600.0
# A commit claim whose writer stopped renewing its lease is honoured this long (unless the
# writer is known to be gone): a writer paused between its claim and its record.
STALE_CLAIM_S = 3600.0
# Ended leases leave their outcome file as a tombstone, so that a writer that wakes up after
# gc removed its files cannot claim the lease again.
TOMBSTONE_S = 7 * 86400.0


@dataclass(frozen=True)
class Removal:
    """One file gc removes (or would remove, in a dry run)."""

    path: str
    bytes: int
    reason: str  # "orphan" or "collected"


@dataclass
class GcResult:
    url: str
    dry_run: bool
    head: int
    floor_before: int
    floor_after: int
    removed: list[Removal] = field(default_factory=list)
    kept_young: int = 0  # orphans left alone because they are younger than the grace period
    # Of those, outcome files that versions collected by this run added (a branch a reset or
    # rollback abandoned): said apart, since they are not a writer's leftovers.
    kept_young_outcomes: int = 0
    kept_leased: int = 0  # staged files of live writers
    foreign: list[str] = field(default_factory=list)  # names dynstate never writes: untouched
    retention: Retention | None = None  # what the rule asked for and what holds the floor

    @property
    def pinned_by(self) -> list[dict[str, object]]:
        """What holds the floor where it is (see :meth:`Retention.pinned_by`)."""
        return self.retention.pinned_by(self.floor_after) if self.retention else []

    @property
    def kept(self) -> list[dict[str, object]]:
        """The kept versions as ranges, each with why it is kept."""
        if self.retention is None:
            return [{"from": self.floor_after, "to": self.head, "reason": "kept"}]
        return self.retention.kept(self.floor_after, self.head)

    @property
    def versions_collected(self) -> list[int]:
        return list(range(self.floor_before, self.floor_after))

    @property
    def bytes_freed(self) -> int:
        return sum(r.bytes for r in self.removed)

    def to_json(self) -> dict[str, object]:
        return {
            "url": self.url,
            "dry_run": self.dry_run,
            "head": self.head,
            "floor_before": self.floor_before,
            "floor_after": self.floor_after,
            "versions_collected": self.versions_collected,
            "files_removed": len(self.removed),
            "bytes_freed": self.bytes_freed,
            "kept_young": self.kept_young,
            "kept_young_outcomes": self.kept_young_outcomes,
            "kept_leased": self.kept_leased,
            "foreign": self.foreign,
            "retention": self.retention.to_json(self.floor_after) if self.retention else None,
            "pinned_by": self.pinned_by,
            "kept": self.kept,
            "removed": [
                {"path": r.path, "bytes": r.bytes, "reason": r.reason} for r in self.removed
            ],
        }


def gc_floor(store: Store) -> int:
    """The oldest version not yet collected (0 if gc never collected any)."""
    return store.log.read_floor()


def _storage_now(store: Store, dry_run: bool, clock: Clock | None) -> float | None:
    """The storage's clock (see :meth:`Storage.now`; ``clock`` where the caller gave one),
    read before anything is judged by it, so every age gc computes is at most the true one.
    A dry run on a location it may not write to plans by this host's clock instead, saying
    so; it deletes nothing."""
    try:
        return clock() if clock is not None else store.storage.now()
    except StorageError as exc:
        if not dry_run:
            raise
        log.warning(
            "gc of %s: could not read the storage's clock (%s); this plan judges ages by "
            "this host's clock, which may differ",
            store.display_url,
            exc,
        )
        return time.time()


def collect_garbage(
    store: Store,
    *,
    keep: int | None = None,
    older_than_s: float | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = True,
    progress: Callable[[int, int], None] | None = None,
    clock: Clock | None = None,
) -> GcResult:
    """Plan, and with ``dry_run=False`` carry out, the removal of orphans older than
    ``grace_s`` that no live writer's lease protects and, with ``keep`` (newest versions to
    keep) or ``older_than_s``, of the versions the rule lets go.

    A dry run unless asked (as delta-rs's ``vacuum``): by default nothing is deleted, no lease
    is ended and the floor does not move; the result lists what a deleting call made now would
    remove (``result.removed``). ``dry_run=False`` deletes, and its ``result.removed`` is what
    it removed. ``progress(done, total)`` is called as files are removed.

    ``clock`` is the seam for time: it replaces the reading of the storage's clock
    (:meth:`Storage.now`, the default) from which every age gc judges is taken — a lease's
    ttl, a stale claim, the grace period, BUSY_S, a tombstone's week, ``older_than_s`` — each
    as that reading minus a time the storage stamped. Tests pass a clock ahead of the
    storage's (``lambda: store.storage.now() + 60``) to see what gc decides once that much
    time has passed with nobody renewing, instead of sleeping. Production passes none."""
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or grace_s < 0:
        raise InvalidDataError(
            f"gc of {store.display_url}: the grace period must be a number of seconds >= 0"
        )
    if not isinstance(dry_run, bool):
        # anything else would read as "not a dry run" where it is falsy (None, 0): a delete
        raise InvalidDataError(
            f"gc of {store.display_url}: dry_run must be True (plan only) or False (delete), "
            f"not {dry_run!r}"
        )
    floor_before = store.log.read_floor()
    plan = retention_plan(store, keep=keep, older_than_s=older_than_s, clock=clock)
    floor = plan.floor
    # Order matters. Files are listed first; a lease existed before any of its shards was
    # written, so the survey that follows sees every listed shard's lease (or its end); and
    # records are read after that, so a commit that ended its lease before the survey is seen.
    files, foreign = _list_files(store)
    # Every age below (lease ttl, stale claims, grace, BUSY_S, tombstones) is this reading of
    # the storage's clock minus a time the storage stamped: no host clock enters, so a skew
    # of any size between gc's host and the writers' (or the storage) changes nothing.
    now = _storage_now(store, dry_run, clock)
    leases = survey(store.storage, claim=not dry_run, now=now, stale_claim_s=STALE_CLAIM_S)
    if floor > floor_before and not dry_run:
        floor = _publish_floor(store, floor, floor_before)
    head = store.latest()
    refs = References(store, floor)
    refs.add_versions(floor, head)
    collected = references_below(store, floor_before, floor)
    outcome_files = _outcome_files_below(store, floor_before, floor)
    result = GcResult(store.display_url, dry_run, head, floor_before, floor, foreign=foreign,
                      retention=plan)  # fmt: skip
    for rel in files:
        reason = _classify(rel, floor, refs, collected, leases, result)
        if reason is None:
            continue
        # A schema or chunk that only collected versions name may be one a live committer
        # is about to name again (every commit rewrites the ones its record names): it waits
        # BUSY_S from its last write like an orphan, never "collected at once".
        young = reason == "orphan" or _rewritten_by_commits(rel)
        if young and not _old_enough(store, rel, now, _min_age(rel, grace_s)):
            result.kept_young += 1
            result.kept_young_outcomes += rel in outcome_files
            continue
        result.removed.append(Removal(rel, _size(store, rel), reason))
    result.removed += _lease_files(store, leases, now)
    if dry_run:
        return result
    # Commits that landed since the references were read may name a kept version's files.
    latest = store.latest()
    if latest > head:
        refs.add_versions(head + 1, latest)
        result.removed = [r for r in result.removed if not refs.needs(r.path)]
    # The floor a concurrent gc published over ours (lower: it planned before we published)
    # names files we would delete: leave them all; that gc, or the next run, collects.
    published = store.log.read_floor()
    if published < floor:
        raise _floor_moved(store, floor, published)
    # Data before metadata: an interrupted run leaves records the floor already hides.
    result.removed.sort(
        key=lambda r: (r.path.startswith(paths.META_DIR), r.path.startswith(paths.LEASE_DIR))
    )
    # Schemas, chunks and aggregates are judged again at the last moment, against a clock
    # reading taken now: one a committer rewrote since the plan has a stamp past it and stays.
    rewritable = any(_rewritten_by_commits(r.path) for r in result.removed)
    now = _storage_now(store, dry_run, clock) if rewritable else now
    kept_late = set()
    for done, removal in enumerate(result.removed, 1):
        if _rewritten_by_commits(removal.path) and not _old_enough(
            store, removal.path, now, _min_age(removal.path, grace_s)
        ):
            kept_late.add(removal.path)
            continue
        store.storage.delete(removal.path)
        if progress is not None:
            progress(done, len(result.removed))
    if kept_late:
        result.removed = [r for r in result.removed if r.path not in kept_late]
        result.kept_young += len(kept_late)
    log.info(
        "gc of %s: removed %d files (%d bytes), floor %d -> %d",
        store.display_url,
        len(result.removed),
        result.bytes_freed,
        floor_before,
        floor,
    )
    return result


def _floor_moved(store: Store, expected: int, found: int) -> CommitConflictError:
    return CommitConflictError(
        f"gc of {store.display_url}: another gc moved the floor to {found} while this one "
        f"worked from {expected}; nothing was deleted — run gc again (one at a time)"
    )


def _publish_floor(store: Store, floor: int, floor_before: int) -> int:
    """Publish ``floor``, then read the tags again: a tag created meanwhile (whose tagger did
    not see the new floor yet) lowers it again, before anything is deleted.

    Another gc may run at once (cron on two hosts) with another rule: were this one to write
    its lower floor over the other's higher one, the other would then delete what that lower
    floor names. So the floor is published only while it is still the one this plan read."""
    expected = floor_before
    while True:
        found = store.log.read_floor()
        if found != expected:
            raise _floor_moved(store, expected, found)
        try:
            store.log.publish_floor(floor, previous=floor_before)
        except VersionCollectedError:
            # another gc published a higher floor after the read above: its record of the
            # new floor is read below that floor (a collected name), and nothing was written
            raise _floor_moved(store, expected, store.log.read_floor()) from None
        expected = floor
        try:
            lowest = min([floor, *tagged(store, floor_before)])
        except BaseException:
            # The floor is out, unconfirmed: a tag or intent made meanwhile may name a version
            # below it. Put the floor this gc found back before the error goes on.
            try:
                store.log.publish_floor(floor_before, previous=floor_before)
            except DynstateError as exc:
                log.warning(
                    "gc of %s: could not put floor %d back (%s); versions from %d on may "
                    "read as collected until the next gc",
                    store.display_url, floor_before, exc, floor_before,
                )  # fmt: skip
            raise
        if lowest >= floor:
            return floor
        log.info("gc of %s: a new tag pins version %d; floor lowered", store.display_url, lowest)
        floor = lowest


def _list_files(store: Store) -> tuple[list[str], list[str]]:
    """(dynstate's own files gc may consider, names it leaves alone) — never through a
    symlink that leads out of the store root. What is ours is what a matcher of
    :data:`dynstate.paths.COLLECTABLE` accepts."""
    ours, foreign = [], []
    for directory in (paths.DATA_DIR, paths.META_DIR, *paths.META_SUBDIRS):
        for name in store.storage.list(directory):
            rel = f"{directory}/{name}"
            match = paths.classify(rel)
            kind = match.kind if match is not None else None
            if directory == paths.META_DIR and kind != "tmp":
                continue  # store.json, gc.json, the hint and the subfolders
            if directory == paths.LEASE_DIR and kind != "tmp":
                continue  # lease files are decided by the lease survey
            if kind in paths.COLLECTABLE and store.storage.contained(rel):
                ours.append(rel)
            elif directory != paths.TAG_DIR:
                foreign.append(rel)  # not a name we write, or behind a link out of the root
    return ours, foreign


def _outcome_files_below(store: Store, start: int, floor: int) -> set[str]:
    """The outcome files versions ``start`` to ``floor - 1`` added, for gc's report only (a
    record that cannot be read adds nothing: the report then counts its files as orphans)."""
    from ..log.outcomes import outcomes_of

    found: set[str] = set()
    outcomes = outcomes_of(store.log)
    for version in range(start, floor):
        try:
            record = store.log.record(version)
            if record is not None:
                found.update(f.path for f in outcomes.added(record))
        except DynstateError:
            continue
    return found


def _classify(
    rel: str,
    floor: int,
    refs: References,
    collected: set[str],
    leases: dict[str, LeaseState],
    result: GcResult,
) -> str | None:
    """Why ``rel`` may go ("orphan" / "collected"), or None if it stays."""
    directory = rel.rsplit("/", 1)[0]
    if directory in _BY_VERSION_DIRS:
        # Judged by their version alone (a temporary file beside them has always stayed).
        match = paths.classify(rel)
        if match is None or match.kind not in paths.BY_VERSION:
            return None
        return "collected" if match.parts < floor else None
    if refs.needs(rel):
        return None
    lease = paths.lease_of(rel)
    if lease is not None and lease in leases and leases[lease].protected:
        result.kept_leased += 1
        return None
    return "collected" if rel in collected else "orphan"


_BY_VERSION_DIRS = (paths.LOG_DIR, paths.CHECKPOINT_DIR, paths.OUTCOME_DIR)


def _rewritten_by_commits(rel: str) -> bool:
    """Content-addressed metadata that every commit or outcome checkpoint naming it writes
    again (schemas, chunks, outcome aggregates)."""
    return rel.rsplit("/", 1)[0] in (paths.SCHEMA_DIR, paths.CHUNK_DIR, paths.AGGREGATE_DIR)


def _min_age(rel: str, grace_s: float) -> float:
    """Staged shards are protected by leases; everything else a live writer may be about to
    use (temporary files, probes, schemas and chunks it just wrote) gets at least BUSY_S."""
    if rel.startswith(paths.DATA_DIR + "/"):
        return grace_s
    if rel.startswith(paths.TAG_INTENT_DIR + "/"):
        return max(grace_s, INTENT_S)  # honoured until then (dynstate.log.intents)
    return max(grace_s, BUSY_S)


def _lease_files(store: Store, leases: dict[str, LeaseState], now: float | None) -> list[Removal]:
    """Lease files of ended leases (removed after their shards). Every outcome (``commit``,
    ``expired``, ``discarded``) stays as a tombstone for TOMBSTONE_S: while it exists nobody
    can claim the lease again."""
    out = []
    for state in leases.values():
        if state.protected:
            continue
        for rel in state.files:
            tombstone = paths.match_claim(rel) is not None and state.outcome in (
                "expired",
                "discarded",
                "commit",
            )
            if tombstone and not _old_enough(store, rel, now, TOMBSTONE_S):
                continue
            out.append(Removal(rel, _size(store, rel), "orphan"))
    return out


def _old_enough(store: Store, rel: str, now: float | None, min_age_s: float) -> bool:
    """Whether ``rel`` is at least ``min_age_s`` old by the storage's clock (``now`` is
    :meth:`Storage.now`), allowing for the resolution of its stamps."""
    if min_age_s <= 0:
        return True
    try:
        modified = store.storage.modified(rel)
    except FileNotFoundError:
        return False
    if modified is None or now is None:
        return False  # no timestamp: it could be a live writer's, so leave it
    return now - modified >= min_age_s + store.storage.clock_resolution_s


def _size(store: Store, rel: str) -> int:
    try:
        return store.storage.size(rel)
    except FileNotFoundError:
        return 0
