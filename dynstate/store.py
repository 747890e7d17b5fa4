"""Store: an append-only, versioned collection of Parquet shards — the facade users call.

Record formats live in :mod:`dynstate.records.manifest`, the commit log (head, commits, floor,
lineage, leases) in :mod:`dynstate.log`, the filesystem in :mod:`dynstate.storage`.

One file, under 500 lines, because it is the facade users read first: every method is a
few lines over the log, the writer or the outcomes, and most of its length is their docs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import paths
from .errors import (
    CorruptStoreError,
    DynstateError,
    InvalidDataError,
    MissingShardError,
    StorageError,
    StoreExistsError,
    StoreNotFoundError,
    VersionNotFoundError,
)
from .log import DEFAULT_TTL_S, Log, Tags
from .log.commits import ROOT_FILES
from .log.steps import Steps
from .records import manifest as m
from .records.codec import whole
from .records.manifest import Commit, ShardRef
from .storage import Storage, open_storage

if TYPE_CHECKING:
    import pyarrow as pa

    from .log.consumption import Consumption
    from .log.outcomes import Outcomes
    from .snapshot import Contents, Snapshot, Staged
    from .writes import DEFAULT_SHARD_BYTES, Writer  # noqa: F401 (re-exported by __getattr__)

# pyarrow (with numpy) is imported by the methods that read or write rows, outcomes or
# schemas, and by the modules they import, not here: opening a store and reading its records
# (`dynstate ls`, `info`, `show`, `tags`) never needs it, and its import costs 0.2-0.4 s of a
# command that otherwise takes tens of milliseconds (tests/test_startup.py holds this).

log = logging.getLogger("dynstate")


def __getattr__(name: str) -> object:
    # ``from dynstate.store import DEFAULT_SHARD_BYTES`` (dynstate.ray) without importing the
    # write path when the store module loads; the value's one home is dynstate.writes.
    if name == "DEFAULT_SHARD_BYTES":
        from .writes import DEFAULT_SHARD_BYTES

        return DEFAULT_SHARD_BYTES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# A finite ttl whose quarter a heartbeat can wait (threading.TIMEOUT_MAX): ~31 years.
MAX_LEASE_TTL_S = 1e9


class Store:
    """A versioned store at an fsspec URL. Open with :meth:`Store.open`.

    >>> store = Store.open("memory://doc/store", create=True)
    >>> store.append([{"prompt": "1+1", "answer": "2"}], meta={"step": 0})
    1
    >>> store.snapshot().num_rows
    1
    """

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
        self.lease_ttl_s = lease_ttl_s  # what another process passes to open (a Ray task)
        self.log = Log(storage, store_id, single_writer=single_writer, lease_ttl_s=lease_ttl_s)
        #: the step queries (which version is the round of step N, ...): :mod:`.log.steps`
        self.steps = Steps(self.log)
        self._tags = Tags(self.log)
        self._writer: Writer | None = None
        self._snapshots: dict[int, Contents] = {}

    @classmethod
    def open(
        cls,
        url: str | os.PathLike[str],
        *,
        create: bool = False,
        storage_options: dict[str, Any] | None = None,
        single_writer: bool = False,
        lease_ttl_s: float = DEFAULT_TTL_S,
    ) -> Store:
        """Open the store at ``url`` (a local path, ``file://``, ``s3://bucket/prefix``,
        ``memory://``). With ``create=True`` an empty store is made if none exists there.
        ``single_writer=True`` allows writing to backends without conditional writes, on the
        promise that only one process ever writes. ``lease_ttl_s``: how long staged files stay
        protected from gc after this process stops renewing their lease (it renews every
        quarter of that while it lives)."""
        if (
            isinstance(lease_ttl_s, bool)
            or not isinstance(lease_ttl_s, (int, float))
            or not (0 < lease_ttl_s <= MAX_LEASE_TTL_S)
        ):
            raise InvalidDataError(
                f"lease_ttl_s must be a positive number of seconds up to {MAX_LEASE_TTL_S:g}, "
                f"not {lease_ttl_s!r}"
            )
        storage = open_storage(url, storage_options)
        # The files the first refresh reads come in the same round trip as store.json.
        try:
            raw, *first = storage.read_many((paths.STORE_FILE, *ROOT_FILES))
        except StorageError as exc:
            if not isinstance(exc.__cause__, NotADirectoryError):
                raise
            raise StoreNotFoundError(
                f"no dynstate store at {storage.display_url}: it is a file, not a folder; "
                "check the URL"
            ) from None
        if raw is None:
            if not create:
                rest = str(url).partition("://")[2]
                hidden = (
                    " (its query string or fragment, not shown, was read as part of the path: "
                    "remove it)"
                    if any(c in rest for c in "?#")
                    else ""
                )
                raise StoreNotFoundError(
                    f"no dynstate store at {storage.display_url}{hidden}; check the URL, or pass "
                    "create=True to make a new store there"
                )
            raw = cls._create(storage, single_writer)
            first = storage.read_many(ROOT_FILES)
        store_id = m.store_identity(raw, f"{storage.display_url}/{paths.STORE_FILE}")
        store = cls(storage, store_id, single_writer=single_writer, lease_ttl_s=lease_ttl_s)
        store.log.seen = store.log.refresh(read=(first[0], first[1]))
        return store

    @staticmethod
    def _create(storage: Storage, single_writer: bool) -> bytes:
        foreign = [n for n in storage.list("") if n != paths.META_DIR]
        if foreign:
            raise StoreExistsError(
                f"{storage.display_url} already holds files ({', '.join(foreign[:3])}) but no "
                "dynstate store; choose an empty location for a new store"
            )
        return Log.create_store(storage, single_writer=single_writer)

    # -- identity and versions ---------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def display_url(self) -> str:
        return self.storage.display_url

    @property
    def storage_options(self) -> dict[str, Any]:
        """The options the storage was opened with (credentials, endpoint): what another
        process (a DataLoader worker, a Ray task) passes to :meth:`open` to reach this store."""
        return self.storage.storage_options

    @property
    def reads_in_place(self) -> bool:
        """True where this process reads a shard by path where it lies (a local disk):
        nothing to cache on disk or prefetch (:attr:`dynstate.storage.Storage.reads_in_place`)."""
        return self.storage.reads_in_place

    def shard_file(self, shard: ShardRef) -> str | None:
        """The path of ``shard``'s file where this process reads it in place (a local store),
        else None (an object store)."""
        return self.storage.path(shard.path) if self.storage.reads_in_place else None

    @property
    def head(self) -> int:
        """The latest committed version number (as of the last refresh or own commit)."""
        return self.log.head

    def __repr__(self) -> str:
        return f"Store({self.display_url!r}, head={self.head})"

    def refresh(self) -> int:
        """Look for versions committed by other processes (and a new gc floor); the head.
        Outcomes this handle commits without ``rows_version`` bind to the head seen here
        (:meth:`append`)."""
        return self._looked_at(self.log.refresh())

    def latest(self) -> int:
        """The head now: :meth:`refresh` for a caller's own use (maintenance, a trainer
        integration, a check), which is not a look that outcomes committed without
        ``rows_version`` bind to."""
        return self.log.refresh()

    def _looked_at(self, head: int) -> int:
        """Record that this handle's user read ``head`` (the head): the version outcomes
        committed without ``rows_version`` bind to (docs/outcomes.md). Only a user's read
        counts — :meth:`refresh`, :meth:`snapshot` or :meth:`outcome_stats` of the head, a
        dataset moving to the head — never what dynstate reads for itself (maintenance, a
        trainer integration, a write's own refresh), which would launder refused outcomes."""
        self.log.seen = head
        return head

    @property
    def writer(self) -> Writer:
        """The write path of this handle (:class:`dynstate.writes.Writer`): the one commit
        protocol, which maintenance (compaction) commits through."""
        if self._writer is None:
            from .writes import Writer

            self._writer = Writer(self.log)
        return self._writer

    @property
    def floor(self) -> int:
        """The gc floor as of the last refresh: versions below it were collected."""
        return self.log.floor

    def lineage(self, version: int, *, ahead: int = 0) -> Iterator[int]:
        """The versions whose content makes up ``version``, newest first, down to the gc floor
        (a reset's predecessor is its target; abandoned versions are never on the way).
        ``ahead``: how many the caller takes at most, so that their records are fetched
        together (:meth:`dynstate.log.Log.lineage`)."""
        return self.log.lineage(self.log.check_version(version), ahead=ahead)

    def commit_record(self, version: int) -> Commit:
        """The commit record of ``version``."""
        return self.log.commit_record(version)

    def commit_records(self, versions: Iterable[int]) -> dict[int, Commit | None]:
        """The commit records of ``versions`` read together (one round trip on an object
        store), None for any without a readable file: a read-ahead, after which
        :meth:`commit_record` returns each at once or raises its typed error."""
        return self.log.records(versions, strict=False)

    def versions(self, *, start: int = 0) -> list[Commit]:
        """Commit records of every kept version from ``start`` on, oldest first."""
        head = self.log.refresh()
        return [self.commit_record(v) for v in range(max(start, self.log.floor), head + 1)]

    def resolve(self, version: int | str | None = None) -> int:
        """A version number from a number, a tag name or None (the head, re-read; not a look
        that outcomes' default ``rows_version`` binds to: :meth:`refresh`, :meth:`snapshot`
        and :meth:`outcome_stats` of the head are)."""
        if version is None:
            return self.log.refresh()
        if not isinstance(version, str):
            number = whole(version)  # numpy's integers too; never a bool
            if number is None:
                raise VersionNotFoundError(
                    f"version must be an int, a tag name or None, not {version!r} "
                    f"({self.display_url})"
                )
            version = number
        if isinstance(version, str):
            if not (version.isascii() and version.isdigit()):
                return self._tags.version(version)
            digits = version.lstrip("0") or "0"
            if len(digits) > 20:  # past any head, and past int()'s digit limit at 4,300
                self.log.refresh()
                raise VersionNotFoundError(
                    self.log.not_found(f"{digits[:20]}... ({len(digits)} digits)")
                )
            version = int(digits)
        self.log.check_version(version)
        return version

    # -- tags --------------------------------------------------------------------------------

    def tags(self) -> dict[str, int]:
        """All tags and the versions they name."""
        return self._tags.all()

    def tag(self, name: str, version: int | str | None = None, *, force: bool = False) -> None:
        """Name a version. Tags are never moved unless ``force=True``; gc never collects a
        tagged version. Tagging a version gc collected (seen from any handle, however old)
        raises :class:`VersionCollectedError`."""
        if (
            not isinstance(name, str)
            or not paths.is_safe_name(name)
            or name.isdigit()
            or name == "head"
        ):
            raise InvalidDataError(
                f"invalid tag name {name!r} for {self.display_url}: use letters, digits, '.', "
                "'_' and '-', starting with a letter or digit, not only digits, and not 'head' "
                "(which the dynstate commands read as the latest version)"
            )
        self.log.refresh()  # a stale handle must see the current gc floor
        target = self.resolve(version)
        self.commit_record(target)  # a version whose record is damaged or gone is no target
        self.log.require_writable()
        self._tags.create(name, target, force=force)

    def untag(self, name: str) -> None:
        self._tags.remove(name)

    def pending_tags(self) -> dict[str, int]:
        """The versions tags, resets and compactions are about to name (their intents), which
        gc keeps as it keeps tagged ones (see :mod:`dynstate.log.intents`), by intent file."""
        return self._tags.pending()

    def check_tags(self) -> tuple[dict[str, int], dict[str, DynstateError]]:
        """Every readable tag with its version, and the error of each damaged tag file by
        name (:meth:`tags` raises on the first instead). Raises only if tags cannot be listed."""
        return self._tags.read_all()

    # -- reading -----------------------------------------------------------------------------

    def snapshot(self, version: int | str | None = None) -> Snapshot:
        """An immutable view of ``version`` (a number, a tag, or None for the head). Made
        from its commit record: its shard list and schema are read when first needed
        (:class:`dynstate.Snapshot`), so counting rows reads no shard list."""
        number = self.resolve(version)
        if version is None:
            self._looked_at(number)
        from .snapshot import Contents, Snapshot

        contents = self._snapshots.get(number)
        if contents is None:
            contents = Contents(self.commit_record(number))
            if len(self._snapshots) > 64:
                self._snapshots.pop(next(iter(self._snapshots)))
            # The cache keeps what snapshots are made of, not a snapshot: a snapshot points
            # at its store (see Contents).
            self._snapshots[number] = contents
        return Snapshot(self, contents)

    def shard_list(self, version: int) -> list[ShardRef]:
        """The ordered shard list of a kept ``version`` (what its snapshot's shards are).
        A gc since this handle last read the floor may have collected records on the way
        from an older floor: then the floor is read again and the walk starts over from
        it, or, if ``version`` itself is below it now, :class:`VersionCollectedError`."""
        return self.log.walk_kept(self.log.check_version(version), self.log.materialize)

    def schema_of(self, record: Commit) -> pa.Schema | None:
        return self.log.schema(record.schema, record.version)

    def read_shard(
        self, shard: ShardRef, schema: pa.Schema | None = None, *, version: int | None = None
    ) -> pa.Table:
        """Read one shard, verified against its recorded size and checksum."""
        from .records.rounds import conform
        from .records.rowgroups import read_parquet

        table = read_parquet(self.read_shard_bytes(shard, version=version))
        return conform(table, schema) if schema is not None else table

    def read_shard_bytes(self, shard: ShardRef, *, version: int | None = None) -> bytes:
        from .snapshot import verify_shard_bytes

        at = f" (version {version})" if version is not None else ""
        where = f"{self.display_url}{at}"
        try:
            # Verified inside the read, so a body cut short in transit is fetched again.
            data = self.storage.read(
                shard.path, check=lambda d: verify_shard_bytes(d, shard, where)
            )
        except FileNotFoundError:
            data = None
        if data is None:
            # gc.json read outside the handler: its errors must not carry "no such key" as
            # their context (storage's error table reads S3's code along that chain).
            if version is not None and version < self.log.read_floor():
                raise self.log.collected(version)  # a handle older than the gc
            raise MissingShardError(
                f"shard {shard.path} of {self.display_url}{at} is missing; restore it, or reset "
                "the store to a version that does not use it"
            )
        _check_rows(data, shard, where)
        return data

    # -- writing -----------------------------------------------------------------------------

    def append(
        self,
        data: Any,
        *,
        meta: dict[str, Any] | None = None,
        allow_new_columns: bool = False,
        shard_bytes: int | None = None,
        outcomes: Any = None,
        generator_state: Any = None,
        rows_version: int | None = None,
        consumption: dict[str, Any] | None = None,
    ) -> int:
        """Commit ``data`` (a pyarrow Table, a list of dicts, a pandas DataFrame or a
        ``datasets.Dataset``) as one new version; returns its number. An empty round is a
        valid commit. ``allow_new_columns`` lets a round add nullable columns; ``shard_bytes``
        cuts the round into shards of about that size (None: 64 MiB).

        ``outcomes``: what the policy scored on rows it trained on — a pyarrow Table, a list
        of dicts or a dict of columns with ``row`` (a row of the current head), ``step``,
        ``score`` and optional numeric columns — committed in the same version as the round
        (one record: never one without the other). ``generator_state``: plain JSON types, the
        generator's state after this round (:meth:`generator_state` reads it back). Both are
        checked before anything is written (:class:`InvalidDataError`).

        ``rows_version``: the version the outcomes' rows were read at (a snapshot's or a
        sampler's version); None means the head this handle last looked at (:meth:`open`,
        :meth:`refresh`, a read of the head), moved on by its own commits while no reset
        came between — right for a writer that reads and commits through this handle. The
        outcomes are refused (:class:`CommitConflictError`, naming both versions, nothing
        written) if that version is not on the lineage of the version they would be
        committed on — a reset since the rows were read — also when another writer commits
        meanwhile (docs/outcomes.md, "Outcomes bind to the rows they were scored on").

        ``consumption``: what the round's step drew, trained, filtered, dropped and carried
        (``StepBatch.record`` of :class:`dynstate.DynamicSampling`), stored in the same record;
        ``meta["step"]`` must be its step. Checked before anything is written: its shape and
        bounds, each row exactly once, its rows bound like the outcomes'
        (docs/dynamic-sampling.md)."""
        return self.writer.append(
            data,
            meta=meta,
            allow_new_columns=allow_new_columns,
            shard_bytes=_shard_bytes(shard_bytes),
            outcomes=outcomes,
            generator_state=generator_state,
            rows_version=rows_version,
            consumption=consumption,
        )

    def stage(
        self,
        data: Any,
        *,
        allow_new_columns: bool = False,
        shard_bytes: int | None = None,
    ) -> Staged:
        """Validate ``data`` against the head's schema and write its shards, without
        committing. Several staged parts (from other processes too: a :class:`Staged` pickles)
        become one version with :meth:`commit_staged`. The shards are protected from gc by a
        lease this process renews while it lives, and that any process unpickling the part
        renews from then on; uncommitted ones are removed by gc after. Window: if this process
        exits before a receiver unpickles the part, a gc in that gap ends the lease and the
        commit raises :class:`LeaseExpiredError` (docs/format.md, "Leases")."""
        return self.writer.stage(
            data, allow_new_columns=allow_new_columns, shard_bytes=_shard_bytes(shard_bytes)
        )

    def commit_staged(
        self,
        parts: Sequence[Staged],
        *,
        meta: dict[str, Any] | None = None,
        outcomes: Any = None,
        generator_state: Any = None,
        rows_version: int | None = None,
    ) -> int:
        """Commit staged parts, in the given order, as one new version; returns its number.
        Staged files gc collected (their writer died or stalled past the lease) make this
        raise :class:`LeaseExpiredError`. A commit whose outcome is unknown (a lost reply, an
        interrupt during the write) is resolved by reading the record back; when nothing was
        committed the parts' shards are removed. ``outcomes``, ``generator_state`` and
        ``rows_version`` as for :meth:`append`, in the same record."""
        from .snapshot import Staged  # a cycle at import time: snapshot imports records

        if isinstance(parts, Staged) or not isinstance(parts, Sequence):
            raise InvalidDataError(
                f"commit_staged of {self.display_url} takes a list of staged parts (what "
                f"Store.stage returned), not {type(parts).__name__}; pass [part]"
            )
        return self.writer.commit_staged(
            parts,
            meta=meta,
            outcomes=outcomes,
            generator_state=generator_state,
            rows_version=rows_version,
        )

    # -- outcomes ----------------------------------------------------------------------------

    @property
    def consumption(self) -> Consumption:
        """What each step drew, trained, filtered and carried
        (:class:`dynstate.log.consumption.Consumption`). Imported on use: its checks import
        numpy and pyarrow, which a read-only command never needs."""
        from .log.consumption import Consumption

        return Consumption(self.log)

    @property
    def outcome_log(self) -> Outcomes:
        """The store's outcome files and aggregates along its lineages
        (:class:`dynstate.log.outcomes.Outcomes`): what the outcome views above the store
        read, so that they never reach into its log."""
        from .log.outcomes import outcomes_of

        return outcomes_of(self.log)

    def outcome_stats(
        self,
        version: int | str | None = None,
        *,
        success_above: float | None = None,
        half_life: float | None = None,
        pending: Any = None,
        rows_version: int | None = None,
    ) -> pa.Table:
        """Per-row statistics of ``version``'s outcomes (a number, a tag, None for the head):
        one row per store row — ``row``, ``attempts``, ``successes`` (scores above
        ``success_above``), ``mean_score``, ``ewma_score`` (weights halve every ``half_life``
        steps back from the row's latest), ``first_step``, ``last_step`` (null for rows never
        trained). Only outcomes of the version's lineage count: after a reset or rollback to
        N these are N's. ``pending``: outcomes of a step in progress (any form ``append``
        takes), counted as if committed on top of ``version`` — nothing is written; their
        rows bind as a commit's do (:meth:`append`): ``rows_version``, the version they were
        read at, must be on ``version``'s lineage (else :class:`CommitConflictError`); None
        means ``version`` when one is named, else the head this handle saw last. Bounded
        (an aggregate plus the outcome files since) for the default ``half_life`` at any
        ``success_above`` while scores take at most 16 distinct values; another half-life reads
        every outcome record of the lineage (docs/outcomes.md, "Cost"). None for either
        means its default, ``DEFAULT_SUCCESS_ABOVE`` (0.5) and ``DEFAULT_HALF_LIFE`` (10.0)
        of :mod:`dynstate.records.outcomes`."""
        from .log.outcomes import outcomes_of
        from .records.outcomes import (
            DEFAULT_HALF_LIFE,
            DEFAULT_SUCCESS_ABOVE,
            check_outcomes,
            check_rows_version,
            check_stats_params,
        )

        above, half = check_stats_params(
            DEFAULT_SUCCESS_ABOVE if success_above is None else success_above,
            DEFAULT_HALF_LIFE if half_life is None else half_life,
            self.display_url,
        )
        seen = self.log.seen
        if pending is not None and version is None:
            # The head, refreshed without counting as a look: outcomes refused here are
            # refused again when asked again (as append's default, see Log.seen).
            number = self.log.refresh()
        else:
            number = self.resolve(version)
            if version is None:
                self._looked_at(number)
        if pending is not None:
            if rows_version is not None:
                read_at = check_rows_version(rows_version, self.display_url)
            else:
                read_at = min(seen, number) if version is None and seen is not None else number
            if read_at != number:
                self.log.require_on_lineage(read_at, number, "pending outcomes")
                if rows_version is not None:
                    # their rows must be rows of the version they were read at
                    at = self.log.commit_record(read_at)
                    pending = check_outcomes(pending, self.display_url, at.num_rows, read_at)
        return outcomes_of(self.log).stats(number, above, half, pending)

    def outcome_records(self, version: int | str | None = None) -> pa.Table:
        """Every outcome record of ``version``'s lineage (``row``, ``step``, ``score`` and the
        extra columns), oldest commit first."""
        from .log.outcomes import outcomes_of

        return outcomes_of(self.log).records(self.resolve(version))

    def generator_state(self, version: int | str | None = None) -> Any:
        """The generator state committed last in ``version``'s lineage, or None."""
        from .log.outcomes import outcomes_of

        return outcomes_of(self.log).generator_state(self.resolve(version))

    def discard(self, parts: Sequence[Staged]) -> None:
        """Remove the shards of staged parts that will not be committed."""
        self.writer.discard(parts)

    def commit_base(
        self,
        shards: list[ShardRef],
        *,
        op: str,
        schema: pa.Schema | None,
        meta: dict[str, Any] | None = None,
        target: int | None = None,
        expected_parent: int | None = None,
    ) -> int:
        """Commit a version whose complete shard list is ``shards`` (a reset). ``target``,
        the version the shards come from, must not be collected when the record is created.
        With ``expected_parent``, fail instead of rebasing if someone committed meanwhile."""
        return self.writer.commit_base(
            shards,
            op=op,
            schema=schema,
            meta=meta,
            target=target,
            expected_parent=expected_parent,
        )

    def reset(self, version: int | str, *, meta: dict[str, Any] | None = None) -> int:
        """Make ``version``'s content the new head, as a new version. Versions committed
        after it stay listed and readable (as abandoned) until garbage collection. A version
        gc collected — as seen from any handle — raises :class:`VersionCollectedError`."""
        self.log.refresh()  # a stale handle must see the current gc floor
        snap = self.snapshot(version)
        new = self.commit_base(
            list(snap.shards), op="reset", schema=snap.schema, meta=meta, target=snap.version
        )
        # The handle that resets has chosen the rows it goes on with (a rollback on resume
        # reads its next batches there): outcomes it commits from now on bind to the new head.
        self.log.seen = new
        return new


def _shard_bytes(value: int | None) -> int:
    """The size rounds are cut into shards at: ``value``, or None for the writer's default
    (``DEFAULT_SHARD_BYTES``, 64 MiB), looked up where it is defined."""
    if value is not None:
        return value
    from .writes import DEFAULT_SHARD_BYTES

    return DEFAULT_SHARD_BYTES


def _check_rows(data: bytes, shard: ShardRef, where: str) -> None:
    """The record's row count must be the file's (from the Parquet footer, no data read):
    offsets into a snapshot are computed from the record, so a mismatch would misplace rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(pa.BufferReader(data)).metadata.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise CorruptStoreError(
            f"shard {shard.path} of {where} is not a readable Parquet file ({exc}); restore it "
            "or reset to a version without it"
        ) from None
    if rows != shard.rows:
        raise CorruptStoreError(
            f"shard {shard.path} of {where} holds {rows} rows but its commit record says "
            f"{shard.rows}; the record is wrong — reset to a version without it"
        )
