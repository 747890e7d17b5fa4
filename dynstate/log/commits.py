"""The commit log: the only code that writes or walks commit records.

:class:`Log` owns the head probe, the commit loop (exclusive create, rebase on a lost race,
read-back of an attempt whose outcome is unknown), the upkeep after a commit (checkpoints and
the head hint), the gc floor and the one lineage walker, which stops at the floor. Store, gc,
compaction, verify, history and resume use it through these methods only.

One file, near 600 lines, because the commit protocol is one argument: the head probe, the
floor, the create, the stray and read-back checks and the walkers reason about the same
records and the same races, and splitting them would put that argument in two places.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from .. import paths
from ..errors import (
    CommitConflictError,
    CorruptStoreError,
    DynstateError,
    LeaseExpiredError,
    StorageError,
    StoreNotFoundError,
    VersionCollectedError,
    VersionNotFoundError,
)
from ..records import manifest as m
from ..records.codec import whole
from ..records.manifest import Commit, ShardRef
from ..storage import Storage
from .catalog import Catalog, checkpoint_bytes
from .intents import Intent
from .leases import DEFAULT_TTL_S, Leases

if TYPE_CHECKING:
    from .outcomes import Outcomes

_T = TypeVar("_T")

log = logging.getLogger("dynstate")

MAX_COMMIT_ATTEMPTS = 200

# The ``ready`` of the commit this thread runs (see Log.commit), read by Log._publish: beside
# its one argument rather than in it, so the hook tests wrap around _publish keeps its shape.
_COMMITTING = threading.local()

# The head hint's size: '{"version": N}' for any N up to 2**63, padded with spaces.
HINT_BYTES = 40
#: What :meth:`Log.refresh` reads first, in this order: the gc floor and the head hint.
ROOT_FILES = (paths.GC_FILE, paths.HEAD_HINT)


class Log(Catalog):
    """The commit log of one store, with caches of the immutable records it has read."""

    def __init__(
        self,
        storage: Storage,
        store_id: str,
        *,
        single_writer: bool = False,
        lease_ttl_s: float = DEFAULT_TTL_S,
    ):
        self.storage = storage
        self.store_id = store_id
        self.single_writer = single_writer
        self._write_checked = False
        super().__init__(storage)
        self.leases = Leases(storage, lease_ttl_s)
        self._records: dict[int, Commit] = {}
        # ancestor -> the newest version this handle found it on the lineage of: a lineage
        # never changes once committed, so the next walk (a step's commit, one version on)
        # stops there instead of going back to the ancestor (on_lineage)
        self._lineage_of: dict[int, int] = {}
        # The shard lists this handle materialized last, by version (a committed version's
        # list never changes): the next version's walk, one append on, stops at its parent's
        # instead of reading and parsing the checkpoint below again (O(shards) a step).
        self._lists: dict[int, tuple[ShardRef, ...]] = {}
        self._head = 0
        self._floor = 0
        # The head as of the handle user's last look (Store.open, Store.refresh, a read of
        # the head), moved on by the handle's own commits while its lineage holds it, never
        # by a write's own refresh: the version outcomes committed through this handle are
        # taken to be scored on unless they name one (see require_on_lineage). None: no look
        # yet (a Log made without Store.open), and the head is taken then.
        self.seen: int | None = None

    @property
    def head(self) -> int:
        """The head as of the last refresh or own commit."""
        return self._head

    @property
    def floor(self) -> int:
        """The gc floor as of the last refresh: versions below it are collected."""
        return self._floor

    @classmethod
    def create_store(cls, storage: Storage, *, single_writer: bool = False) -> bytes:
        """Make a new store at ``storage``: ``store.json`` (created exclusively: of two
        processes creating one store, one wins) and, by the process that created it, version
        0. Returns the bytes of ``store.json`` (the other process's where it won)."""
        storage.require_exclusive_create(single_writer)
        store_id = uuid.uuid4().hex
        raw = m.encode({"format": m.FORMAT, "store_id": store_id, "created": m.utc_now()})
        try:
            storage.create(paths.STORE_FILE, raw)
        except FileExistsError:
            return storage.read(paths.STORE_FILE)  # another process created it first
        cls(storage, store_id, single_writer=single_writer).create_first()
        log.info("created store %s (id %s)", storage.display_url, store_id)
        return raw

    def create_first(self) -> None:
        """Write version 0 of a new store — an empty base — and its checkpoint, once its
        ``store.json`` exists (by the process that created that file)."""
        empty = m.ShardList((), ())
        root = Commit(self.store_id, 0, None, "create", m.utc_now(), None, 0, 0, 0, base=empty)
        self.storage.create_if_absent(paths.log_path(0), m.encode(root.to_json()))
        self.storage.create_if_absent(paths.checkpoint_path(0), checkpoint_bytes(root, empty))

    # -- the gc floor ----------------------------------------------------------------------

    def read_floor(self) -> int:
        """The floor ``_dynstate/gc.json`` names now (0 before the first gc)."""
        return self._set_floor(self.storage.try_read(paths.GC_FILE))

    def _set_floor(self, raw: bytes | None) -> int:
        """The floor from the bytes of ``gc.json`` (None: no file, floor 0), kept."""
        if raw is None:
            self._floor = 0
            return 0
        obj = m.decode(raw, self.where(paths.GC_FILE))
        floor = obj.get("floor")
        if isinstance(floor, bool) or not isinstance(floor, int) or floor < 0:
            raise CorruptStoreError(
                f"{self.where(paths.GC_FILE)} has no valid floor ({floor!r}); the file is damaged "
                "— restore it, or remove it if no gc collected versions"
            )
        self._floor = floor
        return floor

    def collected(self, version: int) -> VersionCollectedError:
        return VersionCollectedError(
            f"version {version} of {self.display_url} was removed by garbage collection "
            f"(oldest kept is {self._floor}); use a later version"
        )

    def walk_kept(self, version: int, walk: Callable[[int], _T]) -> _T:
        """``walk(version)``, a walk back through a kept version's records. A gc since this
        handle last read the floor may have collected records on the way from the older
        floor: then the floor is read again and the walk starts over from it, or, if
        ``version`` itself is below it now, :class:`VersionCollectedError`."""
        floor = self._floor
        try:
            return walk(version)
        except DynstateError:
            if self.read_floor() == floor and version >= floor:
                raise
        if version < self._floor:
            raise self.collected(version) from None
        return walk(version)

    def publish_floor(self, floor: int, *, previous: int | None = None) -> None:
        """Make ``floor`` readable on its own (its checkpoint and chunks), then name it in
        ``gc.json``: from then on readers refuse older versions and never replay below it.
        ``previous`` is the floor before this gc: a floor just published may be lowered again
        (a tag appeared) while nothing below it is deleted yet, replaying from there."""
        if previous is not None:
            self._floor = min(self._floor, previous)
        record = self.commit_record(floor)
        shard_list = self.put_shard_list(self.materialize(floor))
        self.storage.create_if_absent(
            paths.checkpoint_path(floor), checkpoint_bytes(record, shard_list)
        )
        _outcomes(self).write_checkpoint(record)  # the floor's outcomes stand alone too
        self.storage.put(paths.GC_FILE, m.encode({"format": m.FORMAT, "floor": floor}))
        self._floor = floor

    # -- the head --------------------------------------------------------------------------

    def hinted_head(self) -> int | None:
        """The version the head hint names now (None: no hint, or one that does not read). A
        hint is written only after its version's record is durable, so a hint above the head
        means records were removed."""
        raw = self.storage.try_read(paths.HEAD_HINT)
        if raw is None:
            return None
        try:
            return int(m.load_json(raw, self.where(paths.HEAD_HINT))["version"])
        except (ValueError, KeyError, TypeError, OverflowError, CorruptStoreError):
            return None

    def refresh(self, *, read: tuple[bytes | None, bytes | None] | None = None) -> int:
        """Read the floor and find the head: from the largest of the known head, the floor and
        the hint, gallop and bisect over record names (records are gap-free). No LIST.
        ``read``: the bytes of ``gc.json`` and of the head hint (None: no file) that the
        caller read just now (:meth:`dynstate.store.Store.open` reads them together with
        ``store.json``); otherwise both are read here, together."""
        gc_raw, hint = read if read is not None else self.storage.read_many(ROOT_FILES)
        if gc_raw is None and hint is None and self._head > 0:
            # Neither file, though versions were seen: the hint is lost (it is best effort),
            # or the store is gone, which the cached records would otherwise hide.
            self.require_store()
        self._set_floor(gc_raw)
        start = max(self._head, self._floor)
        if hint is not None:
            try:
                start = max(start, int(m.load_json(hint, self.where(paths.HEAD_HINT))["version"]))
            except (ValueError, KeyError, TypeError, OverflowError, CorruptStoreError):
                log.warning("ignoring unreadable head hint in %s", self.display_url)
        # The start's record and the next name (usually missing: the head) in one round trip;
        # a name found missing by that read is not asked for again in this probe.
        try:
            first = self.records((start, start + 1))
            absent = {v for v, record in first.items() if record is None}
        except CorruptStoreError:
            absent = set()  # a damaged record among them: probed one at a time below

        def exists(version: int) -> bool:
            if version in absent:
                return False
            try:
                return self.record(version) is not None
            except CorruptStoreError:
                # Damaged, but its name is taken: the head is found past it, so the store
                # still opens — older versions read and a reset to one of them can be
                # committed; reading this version names the file (see commit).
                return True

        if not exists(start):
            # Hints are advisory; fall back to the last version known to exist. A gc since the
            # floor was read removes records below its new floor, which it published first:
            # read it again, and call the store damaged only when it did not move.
            floor = self._floor
            while True:
                start = max(self._head, self.read_floor())
                absent.clear()
                if exists(start):
                    break
                if self._floor == floor:
                    raise CorruptStoreError(
                        f"{self.display_url} has no commit record for version {start}; run "
                        "`dynstate verify` to see what is damaged"
                    )
                floor = self._floor
        step = 1
        lo = start
        while exists(lo + step):
            lo += step
            step *= 2
        hi = lo + step  # missing
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if exists(mid):
                lo = mid
            else:
                hi = mid
        self._head = lo
        return lo

    def require_store(self) -> None:
        """:class:`StoreNotFoundError` unless the store's ``store.json`` is there (a store
        deleted while a handle had it open)."""
        if self.storage.try_read(paths.STORE_FILE) is None:
            raise StoreNotFoundError(
                f"no dynstate store at {self.display_url} any more: its {paths.STORE_FILE} is "
                "gone (the store was deleted or moved while open); check the URL"
            )

    # -- records ---------------------------------------------------------------------------

    def record(self, version: int) -> Commit | None:
        """The record of ``version``, or None if there is no such file (or, below the head,
        a file gc's floor disowns: :meth:`_drop_strays`)."""
        cached = self._records.get(version)
        if cached is not None:
            return cached
        found = self._decode_record(version, self.storage.try_read(paths.log_path(version)))
        if found is not None and version < self._head:
            self._drop_strays([version])
            return self._records.get(version)
        return found

    def _drop_strays(self, read: list[int]) -> None:
        """Forget the records just read of versions below the head that lie below the floor
        as read *now*. The name of a collected version is free: a writer paused across the gc
        can create its record there (a stray, :meth:`_stray`), and a handle whose floor was
        read before that gc would take the stray for the version, its rows for the version's
        rows. gc publishes its floor before it removes a record, so a floor read after the
        record shows any stray below it. One small read per batch of records (the head's own
        probe, at or above the head, needs none)."""
        older = [v for v in read if v < self._head and v in self._records]
        if older and min(older) < self.read_floor():
            for v in older:
                if v < self._floor:
                    self._records.pop(v, None)

    def records(self, versions: Iterable[int], *, strict: bool = True) -> dict[int, Commit | None]:
        """The records of ``versions`` (None for a missing file), the ones not read before
        fetched together (:meth:`Storage.read_many`): a listing of n versions on an object
        store costs about one round trip, not n. ``strict=False`` reads ahead for a walk that
        may not need them all: a damaged record (or a failed read) raises nothing here and is
        None, and the walk's own :meth:`record` raises for it if it gets there."""
        wanted = list(dict.fromkeys(versions))
        missing = [v for v in wanted if v not in self._records]
        try:
            raws = self.storage.read_many([paths.log_path(v) for v in missing])
        except DynstateError:
            if strict:
                raise
            raws = [None] * len(missing)
        for version, raw in zip(missing, raws, strict=True):
            try:
                self._decode_record(version, raw)
            except DynstateError:
                if strict:
                    raise
        try:
            self._drop_strays(missing)
        except DynstateError:
            if strict:
                raise
            for v in missing:  # unchecked: not kept, the walk's own read checks each again
                if v < self._head:
                    self._records.pop(v, None)
        return {v: self._records.get(v) for v in wanted}

    def _decode_record(self, version: int, raw: bytes | None) -> Commit | None:
        """The record of ``version`` from its file's bytes (None: no file), checked to be the
        one its name says and cached (records never change once created)."""
        if raw is None:
            return None
        rel = paths.log_path(version)
        commit = m.decode_record(raw, self.where(rel))
        if commit.version != version or commit.store_id != self.store_id:
            raise CorruptStoreError(
                f"{self.where(rel)} claims version {commit.version} of store "
                f"{commit.store_id}; it was copied from elsewhere — remove it"
            )
        self._records[version] = commit
        return commit

    def record_time(self, version: int) -> float | None:
        """When the storage stamped the record of ``version`` (a record never changes after
        its create), plus the stamps' resolution, so that an age taken from it is never
        overestimated: by the storage's clock, never the ``created`` its writer's host wrote.
        None where the file is gone (collected meanwhile) or the backend keeps no times."""
        try:
            stamped = self.storage.modified(paths.log_path(version))
        except FileNotFoundError:
            return None
        return None if stamped is None else stamped + self.storage.clock_resolution_s

    def not_found(self, version: Any) -> str:
        return (
            f"version {version} not found in {self.display_url} (latest is {self._head}); "
            "pass version=None for the latest"
        )

    def check_version(self, version: int) -> int:
        """``version`` as an int (numpy's integers included) if it is kept, or a typed
        error: not a whole number or never committed (:class:`VersionNotFoundError`),
        collected by gc (:class:`VersionCollectedError`)."""
        version = self.version_number(version)
        if version > self._head:
            self.refresh()
        if version < 0 or version > self._head:
            raise VersionNotFoundError(self.not_found(version))
        if version < self._floor:
            raise self.collected(version)
        return version

    def version_number(self, version: object) -> int:
        """``version`` as an int: an int or a numpy integer, never a bool, a float or text."""
        number = whole(version)
        if number is not None:
            return number
        raise VersionNotFoundError(
            f"a version must be a whole number, not {version!r} ({self.display_url})"
        )

    def commit_record(self, version: int) -> Commit:
        """The record of a kept ``version``, or a typed error."""
        self.check_version(version)
        record = self.record(version)
        if record is None:
            if version < self._head:
                if version < self.read_floor():
                    raise self.collected(version)
                where = self.where(paths.log_path(version))
                raise CorruptStoreError(
                    f"the commit record of version {version} ({where}) is missing, though gc "
                    "keeps it: the store is damaged; run `dynstate verify`, and restore the "
                    "record from a backup or reset to a version above it"
                )
            raise VersionNotFoundError(self.not_found(version))
        return record

    # -- lineage ---------------------------------------------------------------------------

    def predecessor(self, record: Commit) -> int | None:
        """The version whose rows ``record``'s version carries on: a reset's target, else
        the parent (appends, compactions)."""
        return record.target if record.op == "reset" else record.parent

    def lineage(self, version: int, *, ahead: int = 0) -> Iterator[int]:
        """Versions whose content makes up ``version``, newest first, down to the gc floor.
        Abandoned versions are never on the way. ``ahead``: a caller that takes at most that
        many versions lets a record not read yet be fetched together with the ones below it
        that the rest of the walk would read if it only appends (:meth:`records`): n versions
        cost about one round trip on an object store, and each reset's jump one more (where
        reads come one after another, records are read as the walk needs them)."""
        v: int | None = version
        taken = 0
        while v is not None and v >= self._floor:
            yield v
            taken += 1
            left = ahead - taken + 1  # v and the ones after it the caller may still take
            if left > 1 and self.storage.concurrent_reads and v not in self._records:
                self.records(range(v, max(self._floor, v - left + 1) - 1, -1), strict=False)
            v = self.predecessor(self.commit_record(v))

    def on_lineage(self, ancestor: int, version: int) -> bool | None:
        """Whether ``ancestor`` is on ``version``'s lineage; None when the walk met the gc
        floor above it (nothing can tell)."""
        if ancestor >= version:
            return ancestor == version
        # Every step of a lineage goes to a lower version (a parent, a reset's target), so
        # the walk stops at the first version at or below the ancestor, or at a version
        # already found to hold it (the walk of a run's next step: one version); the records
        # on the way are read together (one round trip on an object store), each once per
        # handle.
        known = self._lineage_of.get(ancestor)
        if known is None or not ancestor < known <= version or ancestor < self._floor:
            known = ancestor
        for v in self.lineage(version, ahead=version - known + 1):
            if v in (known, ancestor):  # (a reset may jump over ``known``: then the ancestor)
                if len(self._lineage_of) >= 64:  # a run uses a few ancestors at a time
                    self._lineage_of.clear()
                self._lineage_of[ancestor] = max(version, self._lineage_of.get(ancestor, 0))
                return True
            if v < ancestor:
                return False
        return None if ancestor < self._floor else False

    def require_on_lineage(self, read_at: int, version: int, what: str) -> None:
        """Refuse ``what`` (outcomes to be committed on, or counted at, ``version``) whose
        rows were read at ``read_at``, unless ``read_at`` is on ``version``'s lineage: only
        then is row ``i`` of ``read_at`` row ``i`` of ``version`` (appends and compactions keep
        rows; a reset after ``read_at``, followed by appends or not, may put other rows at the
        same numbers). :class:`CommitConflictError` names both versions;
        :class:`VersionCollectedError` when gc removed ``read_at`` (nothing can tell then)."""
        found = self.on_lineage(read_at, version)
        if found:
            return
        if found is None:
            raise VersionCollectedError(
                f"{what} for {self.display_url}: their rows were read at version {read_at}, "
                f"which gc removed (oldest kept is {self._floor}), so nothing can tell whether "
                f"version {version} holds the same rows; nothing was written — read the rows "
                "again and score them at a kept version, or pass the version they were read "
                "at as rows_version="
            )
        if read_at < version:
            why = f"a reset after version {read_at} left it, so row numbers may name other rows"
        else:
            why = "the rows are newer than it"
        raise CommitConflictError(
            f"{what} for {self.display_url}: their rows were read at version {read_at}, which "
            f"is not on the lineage of version {version} ({why}); nothing was written — read "
            f"the rows again at version {version} or later and score them there, or pass the "
            "version they were read at as rows_version="
        )

    def advance_seen(self, record: Commit) -> None:
        """After this handle committed ``record``: rows read at :attr:`seen` are rows of
        ``record``'s version too while its lineage holds ``seen`` (no reset came between),
        so outcomes of them bind there; otherwise ``seen`` stays, and such outcomes are
        refused. A walk only when another writer committed since (usually none)."""
        seen = self.seen
        if seen is None or seen >= record.version:
            return
        try:
            if self.predecessor(record) == seen or self.on_lineage(seen, record.version):
                self.seen = record.version
        except DynstateError as exc:  # the commit stands; seen stays, which only refuses more
            log.debug("lineage of version %d not walked: %s", record.version, exc)

    def lineage_cut(self, oldest: int) -> bool:
        """Whether a lineage ending at ``oldest`` was cut by the floor (its predecessor was
        collected) rather than reaching the store's creation."""
        return self.predecessor(self.commit_record(oldest)) is not None

    # -- shard lists -----------------------------------------------------------------------

    def materialize(self, version: int) -> list[ShardRef]:
        """The ordered shard list of ``version``: from the nearest base (checkpoint, reset or
        compaction record) at or below it, plus the appends since — at most K records — or
        from the nearest list this handle materialized since (:attr:`_lists`)."""
        tails: list[tuple[ShardRef, ...]] = []
        v = version
        lists = self._lists
        if (
            self.storage.concurrent_reads
            and version not in lists
            and version - 1 not in lists
            and self.commit_record(version).base is None
        ):
            # The records back to the checkpoint below, read together: one round trip on an
            # object store rather than up to K - 1. (A reset or compaction record on the way
            # ends the walk early, and the ones below it were read for nothing; where reads
            # come one after another that would cost time, so there they are read as needed.)
            below = max(self._floor, version - version % m.CHECKPOINT_INTERVAL)
            self.records(range(version, below - 1, -1), strict=False)
        while True:
            if v < self._floor:
                raise VersionCollectedError(
                    f"version {version} of {self.display_url} depends on collected metadata; "
                    f"the oldest kept version is {self._floor}"
                )
            known = lists.get(v)
            if known is not None:
                shards = list(known)
                break
            record = self.commit_record(v)
            if record.base is not None:
                shards = self.expand(record.base, self.where(paths.log_path(v)))
                break
            # At the gc floor the checkpoint is the only way back, even for the floor itself.
            if v == self._floor or v % m.CHECKPOINT_INTERVAL == 0:
                found = self.checkpoint(v)
                if found is not None:
                    shards = found
                    break
            tails.append(record.add)
            v -= 1
        for add in reversed(tails):
            shards.extend(add)
        # A memo only: loader threads materialize too, and two that trim it at once may
        # race (a dict changed while iterated, a key gone); no lock, which a pickled or
        # forked handle would carry.
        try:
            while len(lists) >= 4:
                lists.pop(next(iter(lists)), None)
            lists[version] = tuple(shards)
        except (RuntimeError, StopIteration):
            pass
        return shards

    # -- committing ------------------------------------------------------------------------

    def require_writable(self) -> None:
        """Refuse to write where concurrent commits could overwrite each other."""
        if not self._write_checked:
            self.storage.require_exclusive_create(self.single_writer)
            self._write_checked = True

    def commit(
        self,
        make: Callable[[Commit], Commit],
        *,
        sources: Iterable[int] = (),
        attempts: list[Commit] | None = None,
        ready: Callable[[], None] | None = None,
        over_damaged: bool = False,
    ) -> int:
        """Create the next version's record exclusively; on a lost race, rebase (``make`` is
        called with the new parent) and retry. ``sources`` are versions whose shards the
        record reuses (a reset's target, a compaction's base): each attempt re-reads the gc
        floor and refuses sources below it. Every record tried is appended to ``attempts``.
        ``ready`` waits for the files the record names to be durable; the create calls it
        before the record's name appears. ``over_damaged``: ``make`` needs only the parent's
        version (a reset), so a head whose record cannot be read is no obstacle — it is the
        way out of such a store."""
        previous = getattr(_COMMITTING, "ready", None)
        _COMMITTING.ready = ready
        sources = list(sources)
        # Written before the floor is first read: a gc publishing its floor meanwhile keeps
        # the sources (dynstate.log.intents), instead of the record naming collected files.
        intent = Intent(self.storage, min(sources), {"commit": "sources"}) if sources else None
        settled = False
        try:
            if intent is not None:
                intent.write()
            version = self._commit(make, sources, attempts, over_damaged, intent)
            settled = True
            return version
        except DynstateError as exc:
            # refused, or lost every race: nothing in flight; a storage failure may have left
            # a create of unknown outcome that may still land
            settled = not isinstance(exc, StorageError)
            raise
        finally:
            _COMMITTING.ready = previous
            if intent is not None:
                intent.settle(settled, f"the record reusing version {intent.version}'s shards")

    def _commit(
        self,
        make: Callable[[Commit], Commit],
        sources: list[int],
        attempts: list[Commit] | None,
        over_damaged: bool = False,
        intent: Intent | None = None,
    ) -> int:
        for attempt in range(MAX_COMMIT_ATTEMPTS):
            floor = self.read_floor()
            for source in sources:
                if source < floor:
                    raise self.collected(source)
            try:
                parent = self.record(self._head)
            except CorruptStoreError:
                if not over_damaged:
                    raise
                # Only its number is used (see commit): the name is taken, the next is free.
                parent = Commit(self.store_id, self._head, None, "damaged", "", None, 0, 0, 0)
            if parent is None or parent.version + 1 < floor:
                # A head from before a gc: the record names below the floor are free again
                # (gc removed them), and a record created there would be invisible.
                self.refresh()
                continue
            record = make(parent)
            if intent is not None and intent.renew():
                # paused since the intent was written: gc may have stopped honouring it, and
                # the floor is read again, after the intent's new stamp, before the create
                floor = self.read_floor()
                for source in sources:
                    if source < floor:
                        raise self.collected(source)
            if attempts is not None:
                attempts.append(record)
            try:
                self._publish(record)
                lost = False
            except FileExistsError:
                lost = True
            if lost:
                # Another writer's record holds the name: ours can never land there. Out of
                # the handler, so that a failure of what follows is not read as the lost race.
                if attempts is not None:
                    attempts.pop()
                self.refresh()
                time.sleep(random.uniform(0, min(0.05, 0.001 * 2 ** min(attempt, 6))))
                continue
            if self._stray(record, sources):
                continue  # created below a floor a gc published meanwhile: commit above it
            self.confirm(record, sources)
            return record.version
        raise CommitConflictError(
            f"gave up committing to {self.display_url} after {MAX_COMMIT_ATTEMPTS} lost races; "
            "too many concurrent writers — retry, or write rounds from fewer processes"
        )

    def confirm(self, record: Commit, sources: Iterable[int] = ()) -> None:
        """The checks after ``record`` was created — by :meth:`commit`, or found by a read-back
        (:meth:`landed`) after its reply was lost: the schema and chunks it names exist (any a
        gc removed meanwhile are written again); for a record reusing ``sources``' shards (a
        reset, a compaction), no gc passed a source without seeing the record (else it is undone
        and :class:`VersionCollectedError` raised); then the upkeep."""
        self.restore_named(record)
        self.recheck_sources(record, sources)
        self._upkeep(record)
        self.advance_seen(record)

    def _stray(self, record: Commit, sources: list[int]) -> bool:
        """Whether ``record``, just created, lies below the gc floor where no reader looks.

        The floor is read before each attempt, but a writer paused between that read and its
        create can meet a gc that moved the floor past its parent and removed the records there,
        freeing the name: the create then succeeds below the floor. Reading the floor again
        after the create settles it, because gc publishes its floor before it removes a record:
        a record created below the floor is seen here. Such a record was either seen by that gc
        (it existed when gc read the head, so later versions carry its rows, and it was
        collected with the rest — a committed round) or created after gc freed its name (in no
        lineage). Appends tell the two apart by what they add (see :meth:`_carried`): in the
        head's lists, or not. A stray append is committed again above the floor (True); a
        stray reset or compaction raises: its source is below the floor too."""
        floor = self.read_floor()
        if record.version >= floor:
            return False
        if self._carried(record):
            log.info(
                "version %d of %s was collected by a concurrent gc right after its commit; its "
                "rows are in the head",
                record.version,
                self.display_url,
            )
            return False
        self._records.pop(record.version, None)
        try:  # in no lineage and below the floor: gc's anyway, and a stale reader's trap
            self.storage.delete(paths.log_path(record.version))
        except DynstateError as exc:
            log.warning("could not remove stray record %d of %s: %s", record.version,
                        self.display_url, exc)  # fmt: skip
        if sources or record.op != "append":
            raise VersionCollectedError(
                f"the {record.op} of {self.display_url} was created as version "
                f"{record.version}, below the gc floor {floor} that a concurrent gc published "
                f"meanwhile: it is not the head (latest is {self.refresh()}); check the head "
                "and run it again"
            )
        for shard in [*record.add, *_outcomes(self).added(record)]:
            if not self.storage.exists(shard.path):
                raise LeaseExpiredError(
                    f"version {record.version} of {self.display_url} was created below the gc "
                    f"floor {floor} (a gc ran while this writer was paused) and its file "
                    f"{shard.path} is gone; the round was NOT stored — append it again"
                )
        log.warning(
            "version %d of %s was created below the gc floor %d (the writer was paused while "
            "a gc ran); committing the round again above it",
            record.version,
            self.display_url,
            floor,
        )
        self.refresh()
        return True

    def _carried(self, record: Commit) -> bool:
        """Whether the head carries the round of ``record``, an append created below the
        floor: its first shard is in the head's shard list, or (an empty round with outcomes)
        its first outcome file in the head's outcome list. File names are unique, so only a
        version built on ``record`` holds them. An append with neither — an empty round with
        only meta or a generator state — changes no version's rows or outcomes, so nothing can
        tell whether a gc saw it: False, and it is committed again above the floor. The kept
        versions then hold it once either way (a copy a gc saw was collected with the versions
        below the floor); its generator state becomes the head's again."""
        head = self.refresh()
        if record.add:
            first = record.add[0].path
            return any(s.path == first for s in self.materialize(head))
        added = _outcomes(self).added(record)
        if added:
            first = added[0].path
            return any(f.path == first for f in _outcomes(self).lineage_files(head))
        return False

    def recheck_sources(self, record: Commit, sources: Iterable[int]) -> None:
        """After ``record``, reusing ``sources``' shards, was created: a gc that published its
        floor past a source meanwhile may not have seen the record; undo it (a reset to its
        parent, which is always kept) and raise :class:`VersionCollectedError`, rather than
        leave a head whose shards gc may remove."""
        sources = list(sources)
        if not sources:
            return
        floor = self.read_floor()
        if min(sources) >= floor:
            return
        if (record.parent or 0) < floor:
            # A floor past our parent was computed from a head at or after our record: that
            # gc saw the record, and keeps what it names.
            return
        parent = self.commit_record(record.parent or 0)
        shard_list = self.put_shard_list(self.materialize(parent.version))
        carried = _outcomes(self).carry(parent.version)

        def make(head: Commit) -> Commit:
            return Commit(
                self.store_id,
                head.version + 1,
                head.version,
                "reset",
                m.utc_now(),
                parent.schema,
                parent.num_rows,
                parent.num_shards,
                parent.num_bytes,
                base=shard_list,
                target=parent.version,
                meta={"undo": record.version},
                outcomes=carried[0],
                generator_state=carried[1],
            )

        self.commit(make)
        err = self.collected(min(sources))
        # Our record was created and is undone: the caller must not resolve it again.
        err.undone = record.version  # type: ignore[attr-defined]
        raise err

    def restore_named(self, record: Commit) -> None:
        """:meth:`Catalog.restore_named`, and the outcome aggregate the record names."""
        super().restore_named(record)
        _outcomes(self).restore_named(record)

    def _publish(self, record: Commit) -> None:
        raw = m.encode(record.to_json())
        ready = getattr(_COMMITTING, "ready", None)
        self.storage.create(paths.log_path(record.version), raw, ready=ready)
        self._records[record.version] = record
        self._head = max(self._head, record.version)
        log.debug("committed version %d to %s", record.version, self.display_url)

    def _upkeep(self, record: Commit) -> None:
        """Everything after the commit is an optimization; a crash here loses nothing."""
        try:
            if record.version % m.CHECKPOINT_INTERVAL == 0:
                shard_list = self.put_shard_list(self.materialize(record.version))
                self.storage.create_if_absent(
                    paths.checkpoint_path(record.version), checkpoint_bytes(record, shard_list)
                )
                # A gc that listed files before the create may have taken its chunks for
                # unreferenced; a checkpoint naming a missing chunk breaks materialize().
                self.restore_chunks(shard_list, f"the checkpoint of version {record.version}")
                # a cache readers do without: off the commit's path (a floor's is not)
                _outcomes(self).write_checkpoint(record, background=True)
            # No fsync: the hint only ever names a version already durable, and a hint lost
            # or torn (by a power cut, or read while written in place) is ignored by
            # refresh() if it names no version, and at worst makes it probe from lower.
            # Fixed width, so that an overwrite in place leaves no tail of a longer one.
            hint = json.dumps({"version": record.version}).ljust(HINT_BYTES).encode()
            self.storage.overwrite(paths.HEAD_HINT, hint)
        except DynstateError as exc:
            log.warning("post-commit upkeep of %s failed: %s", self.display_url, exc)

    def landed(self, attempts: list[Commit]) -> int | None:
        """The version of whichever of ``attempts`` is committed, read back from the store
        (the record holds exactly our bytes), or None. Raises if the store cannot be read:
        then the caller must assume the commit may have landed."""
        for record in attempts:
            rel = paths.log_path(record.version)
            raw = self.storage.try_read(rel)
            if raw is not None and m.decode(raw, self.where(rel)) == record.to_json():
                if record.version < self.read_floor() and not self._carried(record):
                    continue  # a stray below the floor (see _stray): in no lineage
                self._records[record.version] = record
                self._head = max(self._head, record.version)
                return record.version
        return None

    def settle(self, record: Commit) -> bool | None:
        """For a record whose create failed with its outcome unknown on a backend where a
        request may still arrive later (an object store): create the same bytes again, so
        that the name holds either our record or another's, and a late copy of ours can only
        meet a 412. True: ours is there (committed; a record reusing sources' shards still
        needs :meth:`recheck_sources`); False: another record holds the name (ours never will);
        None: still unknown (the store cannot be reached)."""
        try:
            self._publish(record)  # identical bytes met at the name count as ours
        except FileExistsError:
            return False
        except BaseException:  # unknown again (an interrupt: the caller re-raises its own)
            return None
        try:
            if record.version < self.read_floor() and not self._carried(record):
                return False  # ours, but a stray below the floor (see _stray)
            self.restore_named(record)
        except DynstateError:
            return None
        self._upkeep(record)
        return True


def _outcomes(commits: Log) -> Outcomes:
    """The outcome log of ``commits``, imported on first use: it needs numpy and pyarrow,
    which reading records (``dynstate ls``, ``info``, ``show``) never does."""
    from .outcomes import outcomes_of

    return outcomes_of(commits)
