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

gc only ever deletes names dynstate writes (``data/<hex>.parquet``, ``_dynstate/log/<n>.json``
...), never follows a symlink out of the store root, and orders its steps so that a crash at
any point leaves a readable store: the floor's checkpoint, then ``gc.json``, then data, then
metadata. A rerun finishes whatever an interrupted one left.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import manifest as m
from ..errors import CorruptStoreError, InvalidDataError, StorageError
from ..log import LEASE_DIR, LeaseState, lease_of, survey
from ..log import outcomes as outcome_log
from ..store import Store

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

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_VERSION_FILE = re.compile(r"^(\d{20})\.json$")
_HASH_FILE = re.compile(r"^([0-9a-f]{64})\.json$")
_SHARD_FILE = re.compile(r"^[0-9a-f]{32}(-[0-9a-f]{32})?\.parquet$")
_TMP_FILE = re.compile(r"^\.tmp-[0-9a-f]{32}$")
_PROBE_FILE = re.compile(r"^[0-9a-f]{32}$")
_META_SUBDIRS = (
    "log",
    "checkpoints",
    "chunks",
    "schemas",
    "tags",
    "probe",
    "leases",
    "outcomes",
    "aggregates",
)


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
    store: Store, *, keep: int | None = None, older_than_s: float | None = None
) -> Retention:
    """:func:`retention_floor` with its reasons: the floor the rule alone asks for and the
    tags that hold it lower."""
    floor_before = store.log.floor
    asked = _asked_floor(store, keep=keep, older_than_s=older_than_s)
    tags = _tags_from(store, floor_before)
    floor = max(floor_before, min([asked, *tags.values()]))
    return Retention(keep, older_than_s, floor_before, asked, floor, tags)


def _asked_floor(
    store: Store, *, keep: int | None = None, older_than_s: float | None = None
) -> int:
    """The floor the retention rule alone asks for (tags not considered)."""
    head = store.refresh()
    floor = store.log.floor
    if keep is None and older_than_s is None:
        return floor
    if keep is not None and older_than_s is not None:
        raise InvalidDataError(
            f"gc of {store.display_url}: give either keep or older_than, not both"
        )
    candidate = head
    if keep is not None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidDataError(
                f"gc of {store.display_url}: keep must be at least 1 (the head), not {keep!r}"
            )
        candidate = head - keep + 1
    else:
        # A version's age is its record's, by the storage's clock (the time the storage
        # stamped on the record, against a probe it stamped just now): the ``created`` a
        # writer wrote in it is its host's clock, which may be hours off.
        now = store.storage.now()
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


def _tags_from(store: Store, floor: int) -> dict[str, int]:
    """Tags naming versions from ``floor`` on (a tag below it names a collected version)."""
    out = {}
    for name, version in store.tags().items():
        if version < floor:
            log.warning("tag %r of %s names collected version %d", name, store.display_url, version)
        else:
            out[name] = version
    return out


def _tagged(store: Store, floor: int) -> list[int]:
    """Versions tags name, from ``floor`` on."""
    return list(_tags_from(store, floor).values())


def _created(store: Store, version: int) -> float:
    """When the storage stamped the record of ``version`` (records never change after their
    create), plus the stamps' resolution (an age is never overestimated); +inf (recent:
    kept) where it has no stamp."""
    try:
        stamped = store.storage.modified(m.log_path(version))
    except FileNotFoundError:
        stamped = None  # collected by a gc meanwhile: the floor says what is kept
    return float("inf") if stamped is None else stamped + store.storage.clock_resolution_s


def _storage_now(store: Store, dry_run: bool) -> float | None:
    """The storage's clock (see :meth:`Storage.now`), read before anything is judged by it,
    so every age gc computes is at most the true one. A dry run on a location it may not
    write to plans by this host's clock instead, saying so; it deletes nothing."""
    try:
        return store.storage.now()
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
    dry_run: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> GcResult:
    """Remove orphans older than ``grace_s`` that no live writer's lease protects and, with
    ``keep`` (newest versions to keep) or ``older_than_s``, the versions the rule lets go.
    ``dry_run`` only reports. ``progress(done, total)`` is called as files are removed."""
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or grace_s < 0:
        raise InvalidDataError(
            f"gc of {store.display_url}: the grace period must be a number of seconds >= 0"
        )
    floor_before = store.log.read_floor()
    plan = retention_plan(store, keep=keep, older_than_s=older_than_s)
    floor = plan.floor
    # Order matters. Files are listed first; a lease existed before any of its shards was
    # written, so the survey that follows sees every listed shard's lease (or its end); and
    # records are read after that, so a commit that ended its lease before the survey is seen.
    files, foreign = _list_files(store)
    # Every age below (lease ttl, stale claims, grace, BUSY_S, tombstones) is this reading of
    # the storage's clock minus a time the storage stamped: no host clock enters, so a skew
    # of any size between gc's host and the writers' (or the storage) changes nothing.
    now = _storage_now(store, dry_run)
    leases = survey(store.storage, claim=not dry_run, now=now, stale_claim_s=STALE_CLAIM_S)
    if floor > floor_before and not dry_run:
        floor = _publish_floor(store, floor, floor_before)
    head = store.refresh()
    refs = _References(store, floor)
    refs.add_versions(floor, head)
    collected = _references_below(store, floor_before, floor)
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
            continue
        result.removed.append(Removal(rel, _size(store, rel), reason))
    result.removed += _lease_files(store, leases, now)
    if dry_run:
        return result
    # Commits that landed since the references were read may name a kept version's files.
    latest = store.refresh()
    if latest > head:
        refs.add_versions(head + 1, latest)
        result.removed = [r for r in result.removed if not refs.needs(r.path)]
    # Data before metadata: an interrupted run leaves records the floor already hides.
    result.removed.sort(key=lambda r: (r.path.startswith(m.META_DIR), r.path.startswith(LEASE_DIR)))
    # Schemas and chunks are judged again at the last moment, against a clock reading taken
    # now: one a committer rewrote since the plan has a stamp past it and stays.
    rewritable = any(_rewritten_by_commits(r.path) for r in result.removed)
    now = _storage_now(store, dry_run) if rewritable else now
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


def _publish_floor(store: Store, floor: int, floor_before: int) -> int:
    """Publish ``floor``, then read the tags again: a tag created meanwhile (whose tagger did
    not see the new floor yet) lowers it again, before anything is deleted."""
    while True:
        store.log.publish_floor(floor, previous=floor_before)
        lowest = min([floor, *_tagged(store, floor_before)])
        if lowest >= floor:
            return floor
        log.info("gc of %s: a new tag pins version %d; floor lowered", store.display_url, lowest)
        floor = lowest


class _References:
    """Shards, chunks and schemas that kept versions need. The shard set equals the union of
    every kept version's materialized list: a version's list is the floor's, or the latest
    base record's, followed by the rounds appended since."""

    def __init__(self, store: Store, floor: int) -> None:
        self.store = store
        self.floor = floor
        self.shards = {s.path for s in store.log.materialize(floor)}
        self.outcomes = outcome_log.References(store.log, floor)
        self.chunks: set[str] = set()
        self.schemas: set[str] = set()
        for name in store.storage.list(f"{m.META_DIR}/checkpoints"):
            match = _VERSION_FILE.match(name)
            if match is None or int(match.group(1)) < floor:
                continue
            rel = f"{m.META_DIR}/checkpoints/{name}"
            raw = store.storage.try_read(rel)
            if raw is not None:
                obj = m.decode(raw, f"{store.display_url}/{rel}")
                self.chunks.update(m.ShardList.from_json(obj.get("shards"), rel).chunks)

    def add_versions(self, start: int, end: int) -> None:
        for version in range(start, end + 1):
            record = self.store.commit_record(version)
            if record.schema is not None:
                self.schemas.add(record.schema)
            self.shards.update(s.path for s in record.add)
            self.outcomes.add_record(record, full=version > self.floor)
            if record.base is not None:
                self.chunks.update(record.base.chunks)
                if version > self.floor:
                    self.shards.update(s.path for s in self.store.log.materialize(version))

    def needs(self, rel: str) -> bool:
        if self.outcomes.needs(rel):
            return True
        directory, name = rel.rsplit("/", 1)
        if directory == m.DATA_DIR:
            return rel in self.shards
        match = _HASH_FILE.match(name)
        if match and directory == f"{m.META_DIR}/chunks":
            return match.group(1) in self.chunks
        if match and directory == f"{m.META_DIR}/schemas":
            return match.group(1) in self.schemas
        return False


def _references_below(store: Store, start: int, floor: int) -> set[str]:
    """Files the versions being collected referred to: removed without waiting out the grace
    period, since they are committed data and not a live writer's work in progress."""
    shards: set[str] = set()
    chunks: set[str] = set()
    schemas: set[str] = set()
    lists: list[m.ShardList] = []
    for version in range(start, floor):
        for rel in (m.log_path(version), m.checkpoint_path(version)):
            raw = store.storage.try_read(rel)
            if raw is None:
                continue
            try:
                obj = m.decode(raw, rel)
                if rel.startswith(f"{m.META_DIR}/log/"):
                    commit = m.Commit.from_json(obj, rel)
                    shards.update(s.path for s in commit.add)
                    if commit.schema is not None:
                        schemas.add(commit.schema)
                    if commit.base is not None:
                        lists.append(commit.base)
                else:
                    lists.append(m.ShardList.from_json(obj.get("shards"), rel))
            except CorruptStoreError as exc:
                log.warning("gc: reading collected %s of %s: %s", rel, store.display_url, exc)
    for shard_list in lists:
        shards.update(s.path for s in shard_list.tail)
        for digest in shard_list.chunks:
            chunks.add(digest)
            raw = store.storage.try_read(m.chunk_path(digest))
            if raw is not None:
                try:
                    shards.update(s.path for s in m.decode_chunk(digest, raw, digest))
                except CorruptStoreError as exc:
                    log.warning("gc: reading chunk %s: %s", digest[:12], exc)
    return shards | {m.chunk_path(c) for c in chunks} | {m.schema_path(s) for s in schemas}


def _ours(directory: str, name: str) -> bool:
    """Whether dynstate writes files of this name in this folder (nothing else is touched)."""
    if directory == m.DATA_DIR:
        return bool(_SHARD_FILE.match(name))
    if _TMP_FILE.match(name):
        return True
    sub = directory[len(m.META_DIR) + 1 :] if directory.startswith(m.META_DIR + "/") else None
    if sub in ("log", "checkpoints", "outcomes"):
        return bool(_VERSION_FILE.match(name))
    if sub == "aggregates":
        return bool(outcome_log.AGGREGATE_FILE.match(name))
    if sub in ("chunks", "schemas"):
        return bool(_HASH_FILE.match(name))
    if sub == "probe":
        return bool(_PROBE_FILE.match(name))
    return False  # tags, leases (handled apart), the store file, anything not ours


def _list_files(store: Store) -> tuple[list[str], list[str]]:
    """(dynstate's own files gc may consider, names it leaves alone) — never through a
    symlink that leads out of the store root."""
    dirs = [m.DATA_DIR, m.META_DIR, *(f"{m.META_DIR}/{sub}" for sub in _META_SUBDIRS)]
    ours, foreign = [], []
    for directory in dirs:
        for name in store.storage.list(directory):
            rel = f"{directory}/{name}"
            if directory == m.META_DIR and not _TMP_FILE.match(name):
                continue  # store.json, gc.json, the hint and the subfolders
            if directory == LEASE_DIR and not _TMP_FILE.match(name):
                continue  # lease files are decided by the lease survey
            if _ours(directory, name) and store.storage.contained(rel):
                ours.append(rel)
            elif directory != f"{m.META_DIR}/tags":
                foreign.append(rel)  # not a name we write, or behind a link out of the root
    return ours, foreign


def _classify(
    rel: str,
    floor: int,
    refs: _References,
    collected: set[str],
    leases: dict[str, LeaseState],
    result: GcResult,
) -> str | None:
    """Why ``rel`` may go ("orphan" / "collected"), or None if it stays."""
    directory, name = rel.rsplit("/", 1)
    if directory in (f"{m.META_DIR}/log", f"{m.META_DIR}/checkpoints", outcome_log.OUTCOME_DIR):
        match = _VERSION_FILE.match(name)
        return "collected" if match and int(match.group(1)) < floor else None
    if refs.needs(rel):
        return None
    lease = lease_of(rel) if directory == m.DATA_DIR else None
    if lease is not None and lease in leases and leases[lease].protected:
        result.kept_leased += 1
        return None
    return "collected" if rel in collected else "orphan"


def _rewritten_by_commits(rel: str) -> bool:
    """Content-addressed metadata that every commit naming it writes again (schemas, chunks)."""
    directory = rel.rsplit("/", 1)[0]
    return directory in (f"{m.META_DIR}/schemas", f"{m.META_DIR}/chunks")


def _min_age(rel: str, grace_s: float) -> float:
    """Staged shards are protected by leases; everything else a live writer may be about to
    use (temporary files, probes, schemas and chunks it just wrote) gets at least BUSY_S."""
    if rel.startswith(m.DATA_DIR + "/"):
        return grace_s
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
            tombstone = rel.endswith(".outcome.json") and state.outcome in (
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
