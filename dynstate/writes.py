"""Writing rounds: validating a round, staging its shards under a lease, committing staged
parts as one version (resolving a commit of unknown outcome by reading back), and commits of a
complete shard list (resets). :class:`dynstate.Store` delegates its write methods here.

One file past 400 lines because it is the one commit protocol (DESIGN: rounds, resets and
compactions commit through it): the lease claim, the exclusive create and the resolution of
a failed or unknown-outcome commit are shared by every path, and a split would put the
protocol's halves in different modules."""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pyarrow as pa

from . import fresh
from .decoded import keep_decoded
from .errors import (
    CommitConflictError,
    DynstateError,
    InvalidDataError,
    LeaseExpiredError,
    MissingShardError,
    RowOutOfRangeError,
    SchemaMismatchError,
    StateMismatchError,
    StorageError,
    VersionCollectedError,
)
from .log import Log, shard_path
from .log.consumption import check_new_record
from .log.leases import host_id, process_gone
from .log.outcomes import Pending, outcomes_of
from .paths import is_id, match_shard
from .records import manifest as m
from .records.consumption import check_record, indices_of
from .records.manifest import Commit, ShardRef
from .records.outcomes import as_numpy, check_rows_version
from .records.rounds import check_meta, conform_round, merge_parts, to_table
from .records.rowgroups import group_rows, write_shard
from .snapshot import Staged
from .storage import DeferredSync
from .threads import ProcessPool

log = logging.getLogger("dynstate")

DEFAULT_SHARD_BYTES = 64 * 2**20


class Writer:
    """The write path of one store handle, over its commit log."""

    def __init__(self, commits: Log) -> None:
        self.log = commits
        self.storage = commits.storage
        self.store_id = commits.store_id

    @property
    def display_url(self) -> str:
        return self.log.display_url

    def refresh(self) -> int:
        return self.log.refresh()

    def schema_of(self, record: Commit) -> pa.Schema | None:
        return self.log.schema(record.schema, record.version)

    def stage(
        self,
        data: Any,
        *,
        allow_new_columns: bool = False,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> Staged:
        """Validate ``data`` against the head's schema and write its shards, without
        committing. Several staged parts (from other processes too: a :class:`Staged` pickles)
        become one version with :meth:`commit_staged`. The shards are protected from gc by a
        lease this process renews while it lives; uncommitted ones are removed by gc after."""
        self._check_shard_bytes(shard_bytes)
        table = to_table(data, self.display_url)
        self.log.require_writable()
        head = self.log.record(self.refresh())
        assert head is not None
        table, schema = self._conform_round(table, head, allow_new_columns)
        if table.num_rows == 0:
            return Staged((), schema, head.schema, None, self.store_id)
        lease = self.log.leases.acquire()
        try:
            shards = self._write_shards(table, shard_bytes, lease)
        except BaseException:
            self.log.leases.end({lease}, committed=False)
            raise
        staged = Staged(tuple(shards), schema, head.schema, lease, self.store_id)
        return staged.keep_leased(self.storage, self.log.leases.ttl_s)

    def append(
        self,
        data: Any,
        *,
        meta: dict[str, Any] | None = None,
        allow_new_columns: bool = False,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        outcomes: Any = None,
        generator_state: Any = None,
        rows_version: int | None = None,
        consumption: dict[str, Any] | None = None,
    ) -> int:
        """:meth:`Store.append`: check the round, its outcomes and state against one head,
        then write the round's shards and its outcome file under one lease in one pass (the
        two files fsynced at once, one ``data/`` sync for both) and commit them as one
        version. Nothing is written before every check passed. ``rows_version``: the version
        the outcomes' rows were read at (None: the head this handle saw last, see
        :meth:`_check_outcomes`). ``consumption``: what the round's step consumed
        (:mod:`dynstate.records.consumption`), checked here (:meth:`_check_consumption`) and
        stored in the same record."""
        self._check_shard_bytes(shard_bytes)
        meta = check_meta(meta, self.display_url)
        table = to_table(data, self.display_url)
        self.log.require_writable()
        seen = self.log.seen
        head = self.log.record(self.refresh())
        assert head is not None
        table, schema = self._conform_round(table, head, allow_new_columns)
        checked, read_at = None, None
        consumed = self._check_consumption(consumption, meta, head)
        if outcomes is not None or generator_state is not None:
            checked, read_at = self._check_outcomes(
                outcomes, generator_state, head, rows_version, seen
            )
        if checked is not None or consumed is not None:
            outcomes_of(self.log).mark_store()
        has_outcomes = checked is not None and checked.table is not None
        ready: Callable[[], None] | None = None
        written: list[tuple[ShardRef, pa.Table]] = []
        if not table.num_rows and not has_outcomes:
            staged = Staged((), schema, head.schema, None, self.store_id)
        else:
            lease = self.log.leases.acquire()
            try:
                shards, checked, ready = self._write_round(
                    table, shard_bytes, lease, checked, written
                )
            except BaseException:
                self.log.leases.end({lease}, committed=False, tombstone=False)
                raise
            staged = Staged(
                tuple(shards), schema, head.schema, lease if shards else None, self.store_id
            )
        version = self.commit_staged(
            [staged],
            meta=meta,
            private=True,
            checked=checked,
            ready=ready,
            rows_version=read_at,
            consumption=consumed,
        )
        # Committed: this process's next read of the round's shards takes these tables, and
        # on a local store another process's first read maps them (their decoded files).
        kept = fresh.FRESH.keep(written)
        if kept and self.storage.reads_in_place:
            keep_decoded(kept, lambda shard: self.storage.path(shard.path))
        return version

    def _check_consumption(
        self, consumption: Any, meta: dict[str, Any], head: Commit
    ) -> tuple[dict[str, Any], int] | None:
        """The consumption record checked (:func:`check_record`: shape, bounds, the step's
        exactly-once equation, its step equal to ``meta["step"]``) and its rows bound to
        ``head`` as outcomes' are: its ``rows_version`` on ``head``'s lineage, every row
        below that version's row count. Returns (record, head version checked at)."""
        if consumption is None:
            return None
        url = self.display_url
        step = meta.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            # None too: a round with no step is found by no resume (Consumption.of_step)
            raise InvalidDataError(
                f"consumption for {url} is what a step consumed: pass the step's number as "
                f"meta={{'step': N}} with it (not {step!r}); nothing was committed"
            )
        record = check_record(consumption, url, step)
        rows_version = record["rows_version"]
        if rows_version is not None:
            if rows_version > head.version:
                raise InvalidDataError(
                    f"consumption for {url} names rows_version {rows_version}, past the head "
                    f"(version {head.version}); nothing was committed"
                )
            self.log.require_on_lineage(rows_version, head.version, "consumption")
            top = max(indices_of(record), default=-1)
            num_rows = self.log.commit_record(rows_version).num_rows
            if top >= num_rows:
                raise RowOutOfRangeError(
                    f"consumption for {url} names row {top} (a group of step {record['step']}), "
                    f"but version {rows_version} (its rows_version) has {num_rows} rows; "
                    "nothing was committed — a group's row must be a row of the version it "
                    "was drawn from"
                )
        check_new_record(self.log, head.version, record)  # the ledger's next, after its rows
        return record, head.version

    def _check_outcomes(
        self,
        outcomes: Any,
        generator_state: Any,
        head: Commit,
        rows_version: int | None,
        seen: int | None,
    ) -> tuple[Pending | None, int | None]:
        """Outcomes and state checked against ``head`` (:meth:`Outcomes.check`), and the
        version their rows were read at (None: no outcome rows to bind), refused
        (:meth:`Log.require_on_lineage`) unless it is on ``head``'s lineage. ``rows_version``
        names it; None means ``seen`` (:attr:`Log.seen`: the head the handle's user last
        looked at, moved on by its own commits while no reset came between), where a writer
        that reads and commits through one handle read its rows (a reset by another process
        since is caught; a look after the rows were read hides it — pass rows_version). Rows
        named must exist at ``rows_version`` (at ``head`` for the default: a handle older than
        the rows' reader may commit outcomes of rows added since)."""
        if rows_version is None:
            read_at = head.version if seen is None else min(seen, head.version)
        else:
            read_at = check_rows_version(rows_version, self.display_url)
        try:
            checked = outcomes_of(self.log).check(outcomes, generator_state, head)
        except InvalidDataError:
            if outcomes is not None:
                # rows out of range of the head after a reset: the reset is the cause to name
                self.log.require_on_lineage(read_at, head.version, "outcomes")
            raise
        if checked is None or checked.table is None:
            return checked, None
        self.log.require_on_lineage(read_at, head.version, "outcomes")
        if rows_version is not None and read_at != head.version:
            top = int(as_numpy(checked.table.column("row")).max())
            num_rows = self.log.commit_record(read_at).num_rows
            if top >= num_rows:
                raise InvalidDataError(
                    f"outcomes for {self.display_url} name row {top}, but version {read_at} "
                    f"(rows_version, where their rows were read) has {num_rows} rows; nothing "
                    "was committed"
                )
        return checked, read_at

    def _write_round(
        self,
        table: pa.Table,
        shard_bytes: int,
        lease: str,
        pending: Pending | None,
        tables: list[tuple[ShardRef, pa.Table]] | None = None,
    ) -> tuple[list[ShardRef], Pending | None, Callable[[], None]]:
        """The round's shards and its outcome file under ``lease``, then one ``data/`` sync.
        The outcome file is written on a thread while the shards are: their fsyncs overlap
        (a journaling filesystem commits both in one go), so the outcomes add about their
        encoding, not another flush, to the commit. The shards' fsyncs and the ``data/`` sync
        then run on that thread too, and the call returned waits for them (raising their
        error): the record's create calls it after writing and syncing its own bytes and
        before its name appears, so the two flushes overlap and no record ever names a
        shard that is not durable. On failure every file written is removed. ``tables``, if
        given, gets each shard with the table it holds (:meth:`_write_shards`)."""
        outcome_file = None
        shards: list[ShardRef] = []
        deferred = self.storage.deferred_sync(m.DATA_DIR)
        if pending is not None and pending.table is not None:
            unwritten = pending
            outcome_file = _Background(
                lambda: outcomes_of(self.log).write_file(unwritten, lease, deferred=deferred)
            )
        try:
            try:
                if table.num_rows:
                    shards = self._write_shards(
                        table, shard_bytes, lease, sync=False, deferred=deferred, tables=tables
                    )
            finally:
                if outcome_file is not None:
                    pending = outcome_file.result()
            if deferred.pending:
                synced = _Background(deferred.run)

                def ready() -> None:
                    synced.result()

            else:
                deferred.run()  # the outcome file's data/ entry, or nothing to sync
                ready = _nothing
        except BaseException:
            deferred.close()
            done = outcome_file.value if outcome_file is not None else None
            written = [*shards, *([done.ref] if done is not None and done.ref else [])]
            self._remove(ref.path for ref in written)
            raise
        return shards, pending, ready

    def _remove(self, paths: Iterable[str]) -> None:
        """Remove files no record names (what a failed or discarded write left), as far as
        the storage lets us now: gc removes the rest."""
        for path in paths:
            if match_shard(path) is None:  # only names dynstate writes, as gc: never any path
                log.warning("not removing %s: no shard name dynstate writes", path)
                continue
            try:
                self.storage.delete(path)
            except DynstateError as exc:
                log.warning("could not remove %s: %s (gc will)", path, exc)

    def _check_shard_bytes(self, shard_bytes: Any) -> None:
        if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
            raise InvalidDataError(
                f"shard_bytes for {self.display_url} must be a positive int (bytes of Arrow data "
                f"per shard), not {shard_bytes!r}"
            )

    def commit_staged(
        self,
        parts: Sequence[Staged],
        *,
        meta: dict[str, Any] | None = None,
        private: bool = False,
        outcomes: Any = None,
        generator_state: Any = None,
        checked: Pending | None = None,
        ready: Callable[[], None] | None = None,
        rows_version: int | None = None,
        consumption: tuple[dict[str, Any], int] | None = None,
    ) -> int:
        """Commit staged parts, in the given order, as one new version; returns its number.
        ``outcomes`` and ``generator_state`` are committed in the same record (see
        :mod:`dynstate.log.outcomes`); ``checked``: both, validated already (``append``, which
        passes the version their rows were read at as ``rows_version``). The record is
        refused (:class:`CommitConflictError`) on any parent whose lineage lacks the version
        the outcomes' rows were read at (``rows_version``, see :meth:`_check_outcomes`).
        Staged files gc collected (their writer died or stalled past the lease) make this
        raise :class:`LeaseExpiredError`. A commit whose outcome is unknown (a lost reply, an
        interrupt during the write) is resolved by reading the record back; when nothing was
        committed the parts' shards are removed. ``private``: the parts never left this
        call (``append``), so their leases need no tombstone. ``ready``: waits for the parts'
        files to be durable (``append``'s deferred sync), called before the record appears.
        ``consumption``: a record :meth:`_check_consumption` checked, with the head it was
        checked at (``append``)."""
        self._check_parts(parts)
        # The caller's input is checked before the commit protocol starts: a refusal here
        # leaves the parts staged, for the same parts to be committed once the input is fixed
        # (inside it, any failure gives the parts up).
        meta = check_meta(meta, self.display_url)
        if checked is None and (outcomes is not None or generator_state is not None):
            seen = self.log.seen
            head = self.log.record(self.refresh())
            assert head is not None
            checked, rows_version = self._check_outcomes(
                outcomes, generator_state, head, rows_version, seen
            )
        shards = [s for part in parts for s in part.shards]
        pending: Pending | None = None

        def prepare(leases: set[str]) -> Callable[[Commit], Commit]:
            nonlocal pending
            if checked is not None:
                pending = outcomes_of(self.log).write(checked)
                if pending.lease:
                    leases.add(pending.lease)
            # A part without shards writes nothing its schema could mean: it takes no part in
            # the check (a task that generated nothing before another writer added a column
            # must not sink the round), unless no part has shards.
            typed = [p for p in parts if p.schema is not None]
            typed = [p for p in typed if p.shards] or typed
            schemas = {m.schema_fingerprint(p.schema) for p in typed}
            merged = None
            if len(schemas) > 1:
                # parts of one round written apart (Ray tasks, blocks): one schema that reads
                # each part's shards as they are, or a refusal naming the columns
                merged = merge_parts(
                    [p.schema for p in typed if p.schema is not None], self.display_url
                )
            schema = merged if merged is not None else typed[0].schema if typed else None
            validated = typed[0].validated if typed else None
            return lambda parent: self._append_record(
                parent, shards, schema, validated, meta, pending, rows_version, consumption
            )

        def written() -> Sequence[Staged]:
            # the outcome file written before a failure goes (or stays) with the shards
            if pending is not None and pending.ref is not None:
                return _with_outcome_file(parts, pending, self.store_id)
            return parts

        return self._commit(parts, prepare, private=private, ready=ready, written=written)

    def _commit(
        self,
        parts: Sequence[Staged],
        prepare: Callable[[set[str]], Callable[[Commit], Commit]],
        *,
        private: bool,
        what: str = "round",
        sources: Sequence[int] = (),
        ready: Callable[[], None] | None = None,
        over_damaged: bool = False,
        written: Callable[[], Sequence[Staged]] | None = None,
    ) -> int:
        """The one commit protocol of a round (:meth:`commit_staged`), a reset and a
        compaction (:meth:`commit_base`); returns the new version.

        ``prepare(leases)`` runs once the handle may write: the checks and the files that go
        before the record (it may add a lease, the outcome file's), returning ``make``, which
        builds the record on a parent. Then the parts' leases are claimed (the exclusive
        create gc races for: winning it proves gc left the files alone), the record is created
        on the head (rebased by :meth:`Log.commit` when another writer got there first), and
        the leases end, committed. On any failure :meth:`_resolve_failed_commit` reads back
        whether the record landed anyway (a lost reply) and returns that version; otherwise
        the parts' files go (``written()``: the parts with what ``prepare`` wrote), unless the
        outcome is unknown (an object store's late request) or another call owns them."""
        leases = {p.lease for p in parts if p.lease}
        attempts: list[Commit] = []
        nonce = uuid.uuid4().hex
        elsewhere = False  # another call holds the parts' leases (not a refusal before)
        try:
            self.log.require_writable()
            make = prepare(leases)
            try:
                self.log.leases.take(leases, nonce, head=self.log.head)
            except CommitConflictError as exc:
                elsewhere = True
                raise self._claimed_elsewhere(exc, parts) from None
            self._check_unleased(parts)
            version = self.log.commit(
                make, sources=sources, attempts=attempts, ready=ready, over_damaged=over_damaged
            )
        except BaseException as exc:
            if isinstance(exc, LeaseExpiredError) and not attempts:
                # A lease with no record of its end (gc removes a commit's after a week):
                # parts a kept version holds were committed, and giving them up would mark a
                # committed lease discarded, and its advice (stage again) store them twice.
                held = self._committed_in(parts)
                if held is not None:
                    raise CommitConflictError(
                        f"the staged parts of {self.display_url} were already committed as "
                        f"version {held}; commit each staged part once"
                    ) from None
            landed = self._resolve_failed_commit(
                parts if written is None else written(),
                leases,
                attempts,
                exc,
                nonce,
                private=private,
                # a conflict before the claim (outcomes bound to a version another writer
                # abandoned meanwhile) gives the parts up like any failure in the protocol
                # (the caller's own input was checked before it, and leaves them staged)
                claimed=not elsewhere,
                sources=sources,
                what=what,
            )
            if landed is not None and isinstance(exc, Exception):
                return landed  # the reply was lost, the commit was not
            raise
        self.log.leases.end(leases, committed=True, tombstone=not private)
        return version

    def _check_part(self, part: Any, what: str = "commit_staged") -> None:
        """Refuse a part that :meth:`stage` did not make as it is: of another store, or whose
        fields (it crossed processes: Ray pickles it) name files that are not its own — a
        lease that is no lease id, a shard path outside ``data/`` or written under another
        lease (a shard another part committed: its rows would land twice). A commit and a
        discard build file names from them and delete what they name."""
        url = self.display_url
        if not isinstance(part, Staged):
            raise InvalidDataError(
                f"{what} for {url} takes Staged parts (from Store.stage), not {type(part).__name__}"
            )
        if part.store is not None and part.store != self.store_id:
            raise StateMismatchError(
                f"a part was staged for store {part.store}, not {self.store_id} "
                f"({url}); {what} it with the store it was staged in"
            )
        if part.lease is not None and not is_id(part.lease):
            raise InvalidDataError(
                f"a staged part for {url} names lease {part.lease!r}, which is no lease id "
                "(32 hex digits): it was changed after Store.stage made it; nothing was done"
            )
        if not isinstance(part.shards, tuple):
            raise InvalidDataError(f"a staged part for {url} has no tuple of shards")
        for shard in part.shards:
            if not isinstance(shard, ShardRef):
                raise InvalidDataError(f"a staged part for {url} lists {shard!r} as a shard")
            ShardRef.from_json(shard.to_json(), f"a staged part for {url}")  # UnsafePathError
            name = match_shard(shard.path)
            if name is None or name.lease != part.lease:
                raise InvalidDataError(
                    f"a staged part for {url} (lease {part.lease}) lists shard {shard.path}, "
                    "which was not written under its lease: it was changed after Store.stage "
                    "made it; nothing was done"
                )

    def _check_parts(self, parts: Sequence[Staged]) -> None:
        """Refuse, before anything is written, parts :meth:`_check_part` refuses and parts (or
        shards) given twice: each staged shard lands exactly once."""
        seen: set[str] = set()
        for part in parts:
            self._check_part(part)
            for shard in part.shards:
                if shard.path in seen:
                    raise InvalidDataError(
                        f"staged shard {shard.path} of {self.display_url} is given twice "
                        f"(lease {part.lease}); pass each staged part once — nothing was "
                        "committed"
                    )
                seen.add(shard.path)

    def _resolve_failed_commit(
        self,
        parts: Sequence[Staged],
        leases: set[str],
        attempts: list[Commit],
        exc: BaseException,
        nonce: str,
        *,
        private: bool = False,
        claimed: bool = True,
        sources: Sequence[int] = (),
        what: str = "round",
    ) -> int | None:
        """Find out, by reading back, whether a failed commit landed anyway; returns its
        version if so (checked as :meth:`Log.confirm` does). Otherwise the parts' shards are
        removed — unless the store cannot be read, a late request may still create the record
        (object stores: see :meth:`Log.settle`), or another call owns them; then they are
        left (for gc, which keeps them while a record may still name them). ``claimed``:
        whether this call won the parts' leases; ``what`` the commit is, for messages."""
        if not claimed and isinstance(exc, CommitConflictError):
            self.log.leases.forget(leases)  # another call holds these parts: its to decide
            return None
        if getattr(exc, "dead_claim", False):
            self.log.leases.forget(leases)  # a dead committer's claim: gc removes its files
            return None
        if getattr(exc, "undone", None) is not None:
            # Our record was created, then undone by a reset to its parent (a gc passed its
            # source): that version stays, kept above the floor, and names the shards.
            self.log.leases.end(leases, committed=True, tombstone=not private)
            return None
        if isinstance(exc, LeaseExpiredError) and not attempts:
            # The round cannot be committed; parts that ended stay as they are.
            self._discard(parts, nonce, strict=False, private=private)
            return None
        late = bool(attempts) and self.storage.late_requests
        try:
            landed = self.log.landed(attempts)
        except BaseException:
            if late:  # best effort: the store just failed a read
                self.log.leases.keep_unsettled(leases, nonce, attempts[-1].version)
            self.log.leases.forget(leases)
            return None
        settled = False
        if landed is None and late:
            # On an object store a PUT the client gave up on may still reach the server later
            # and create the record: its shards may go only once that provably cannot happen.
            outcome = self.log.settle(attempts[-1])
            if outcome:
                try:
                    self.log.recheck_sources(attempts[-1], sources)
                except VersionCollectedError:
                    # Ours landed, and was undone: a gc passed its source meanwhile.
                    self.log.leases.end(leases, committed=True, tombstone=not private)
                    raise
            if outcome is None:
                self._keep_unsettled(leases, nonce, attempts[-1], exc, what)
                return None  # an interrupt: the shards stay all the same
            if outcome:
                landed, settled = attempts[-1].version, True
        if landed is not None:
            self.log.leases.end(leases, committed=True, tombstone=not private)
            log.info("version %d of %s was committed before %r", landed, self.display_url, exc)
            if not settled:
                self._confirm_landed(next(r for r in attempts if r.version == landed), sources)
            return landed
        self._discard(parts, nonce, strict=False, private=private)
        return None

    def _confirm_landed(self, record: Commit, sources: Sequence[int]) -> None:
        """The checks after a create, for a record found by reading back: it is committed
        whatever they meet, so only an undo (a gc passed its source) is raised."""
        try:
            self.log.confirm(record, sources)
        except VersionCollectedError:
            raise
        except DynstateError as exc:
            log.warning(
                "checks after version %d of %s failed: %s", record.version, self.display_url, exc
            )

    def _keep_unsettled(
        self,
        leases: set[str],
        nonce: str,
        record: Commit,
        exc: BaseException,
        what: str = "round",
    ) -> None:
        """The record's create may still land and nothing can tell now: keep the shards (their
        claim marked unsettled, which gc honours for an hour, longer than S3 accepts a signed
        request) and say so instead of the bare storage error."""
        self.log.leases.keep_unsettled(leases, nonce, record.version)
        if not isinstance(exc, Exception):
            return  # an interrupt stays an interrupt; the log says what happened
        log.warning("commit of version %d of %s is unsettled", record.version, self.display_url)
        if what == "round":
            raise StorageError(
                f"the commit record of version {record.version} of {self.display_url} was sent "
                f"but no reply came ({exc}); the request may still reach the store, so the "
                "round's shards were kept. Once the store is reachable, check version "
                f"{record.version} (`dynstate show`): if it holds this round, the round is "
                "committed; if another round or nothing is there, append it again"
            ) from exc
        kept = ", so its new shards were kept" if leases else ""
        raise StorageError(
            f"the record of the {what} of {self.display_url} (version {record.version}) was "
            f"sent but no reply came ({exc}); the request may still reach the store{kept}. "
            f"Once the store is reachable, check version {record.version} (`dynstate show`): "
            f"if it is this {record.op}, it is committed; if another version or nothing is "
            f"there, run the {what} again"
        ) from exc

    def _committed_in(self, parts: Sequence[Staged]) -> int | None:
        """The kept version whose round added a shard of ``parts``, or None (an error path:
        the records from the floor to the head are read together)."""
        paths = {s.path for p in parts for s in p.shards}
        if not paths:
            return None
        head = self.refresh()
        records = self.log.records(range(self.log.floor, head + 1), strict=False)
        for version, record in sorted(records.items()):
            if (
                record is not None
                and record.op == "append"
                and any(s.path in paths for s in record.add)
            ):
                return version
        return head if self._held_at(head, paths) else None

    def _held_at(self, version: int, paths: set[str]) -> bool:
        """Whether ``version``'s shards include one of ``paths``: the rows of a commit whose
        record gc collected are still in the versions after it (an error path)."""
        try:
            shards = self.log.walk_kept(version, self.log.materialize)
        except DynstateError:
            return False
        return any(s.path in paths for s in shards)

    def _claimed_elsewhere(self, exc: CommitConflictError, parts: Sequence[Staged]) -> Exception:
        """The error for parts whose lease another commit claimed, saying what is true: the
        round is committed (in which version), it was NOT stored (its committer died before
        its record, or the claim is stale: gc removes its files), or it is being committed."""
        claim: dict[str, Any] | None = getattr(exc, "claim", None)
        lease: str | None = getattr(exc, "lease", None)
        if claim is None or lease is None:
            return exc
        paths = {s.path for p in parts if p.lease == lease for s in p.shards}
        head = self.refresh()
        floor = self.log.floor
        since = claim.get("head")
        start = since + 1 if isinstance(since, int) and not isinstance(since, bool) else floor
        for version in range(max(start, floor), head + 1):
            record = self.log.record(version)
            if record is not None and any(s.path in paths for s in record.add):
                return CommitConflictError(
                    f"the staged parts of lease {lease} of {self.display_url} were already "
                    f"committed as version {version}; commit each staged part once"
                )
        if self._held_at(head, paths):
            return CommitConflictError(
                f"the staged parts of lease {lease} of {self.display_url} were already "
                f"committed: version {head} holds their rows (gc collected the version that "
                "added them); commit each staged part once"
            )
        where = f"the staged parts of lease {lease} of {self.display_url}"
        pid, host = claim.get("pid"), claim.get("host")
        unsettled = claim.get("unsettled")
        if unsettled is not None:
            return CommitConflictError(
                f"{where} were claimed by a commit whose record (version {unsettled}) was sent "
                f"but never confirmed, and no version up to {head} holds them: if that request "
                "still lands, the round is stored there; gc keeps the files an hour for it. "
                "Commit each staged part once"
            )
        if host == host_id() and isinstance(pid, int) and 0 < pid < 2**31 and process_gone(pid):
            if start < floor:
                fate = (
                    f"no version from {floor} on holds them (older ones were collected), so the "
                    "round is not in the store now"
                )
            else:
                fate = "no version holds them, so the round was NOT stored"
            err = LeaseExpiredError(
                f"{where} were claimed for a commit by process {pid} of this machine, which "
                f"exited without finishing it: {fate}; gc removes its files — stage the round "
                "again"
            )
            err.dead_claim = True  # type: ignore[attr-defined]
            return err
        owner = f"process {pid} on {host}" if pid is not None else "another call"
        return CommitConflictError(
            f"{where} are claimed for a commit by {owner}, and no version from "
            f"{max(start, floor)} to {head} holds them yet: if that commit is still running, it "
            "will store the round; if its process died before creating its record, the round "
            "was NOT stored and gc removes its files within an hour — then stage the round "
            "again. Commit each staged part once"
        )

    def discard(self, parts: Sequence[Staged]) -> None:
        """Remove the shards of staged parts that will not be committed. Each lease is won
        first, by the same exclusive outcome create a commit and gc race for: a part whose
        lease ended (discarded or collected) is left alone, and a part committed (or being
        committed) by another call raises :class:`CommitConflictError` — its files stay."""
        for part in parts:
            self._check_part(part, "discard")
        self._discard(parts, uuid.uuid4().hex, strict=True)

    def _discard(
        self, parts: Sequence[Staged], nonce: str, *, strict: bool, private: bool = False
    ) -> None:
        committed: list[str] = []
        for part in parts:
            if part.lease:
                try:
                    self.log.leases.claim({part.lease}, nonce, outcome="discarded")
                except CommitConflictError:
                    committed.append(part.lease)
                    continue
                except LeaseExpiredError:
                    log.warning(
                        "not removing staged part of lease %s of %s: its lease ended (discarded "
                        "or collected)",
                        part.lease,
                        self.display_url,
                    )
                    continue
            self._remove(shard.path for shard in part.shards)
            if part.lease:
                self.log.leases.end({part.lease}, committed=False, tombstone=not private)
        if committed:
            message = (
                f"staged parts of lease(s) {', '.join(sorted(committed))} of {self.display_url} "
                "were committed (or are being committed) by another call; their files were left"
            )
            if strict:
                raise CommitConflictError(message)
            log.warning("%s", message)

    def _check_unleased(self, parts: Sequence[Staged]) -> None:
        """Staged parts without a lease (pickled by an older dynstate) are checked one by one;
        leased parts need no check: winning the lease proves gc left them alone."""
        for part in parts:
            if part.lease:
                continue
            for shard in part.shards:
                if not self.storage.exists(shard.path):
                    raise MissingShardError(
                        f"staged shard {shard.path} of {self.display_url} is gone; nothing was "
                        "committed — stage the round again"
                    )

    def _conform_round(
        self, table: pa.Table, head: Commit, allow_new_columns: bool
    ) -> tuple[pa.Table, pa.Schema | None]:
        current = self.schema_of(head)
        if table.num_columns == 0 and table.num_rows == 0:
            # an empty round with no columns fits any schema, also one another writer sets
            # while it commits: it names none (its record takes the parent's)
            return table, None
        if current is None:
            schema = m.normalize_schema(table.schema)
            return table.replace_schema_metadata(None), schema
        return conform_round(table, current, allow_new_columns, self.display_url, head.version)

    def _append_record(
        self,
        parent: Commit,
        shards: list[ShardRef],
        schema: pa.Schema | None,
        validated: str | None,
        meta: dict[str, Any],
        pending: Pending | None = None,
        read_at: int | None = None,
        consumption: tuple[dict[str, Any], int] | None = None,
    ) -> Commit:
        if (
            read_at is not None
            and pending is not None
            and pending.table is not None
            and parent.version != pending.checked_at
        ):
            # Another writer committed after the outcomes were checked: a reset (followed by
            # appends or not) may have put other rows at their numbers, which the row count
            # alone cannot tell (Log.require_on_lineage).
            self.log.require_on_lineage(read_at, parent.version, "outcomes")
        record = None
        if consumption is not None:
            record, checked_at = consumption
            consumed_at = record["rows_version"]
            if parent.version != checked_at:
                # the same rules as the outcomes': a reset since may have moved the rows, and
                # another writer may have committed this step's record meanwhile
                if consumed_at is not None:
                    self.log.require_on_lineage(consumed_at, parent.version, "consumption")
                check_new_record(self.log, parent.version, record)
        fp = m.schema_fingerprint(schema) if schema is not None else parent.schema
        if parent.schema != validated and schema is not None:
            # Another writer changed the schema after we checked: only a round whose written
            # shards still mean the same thing under the new schema may go on.
            parent_schema = self.schema_of(parent)
            if parent_schema is not None and m.schema_fingerprint(parent_schema) != fp:
                raise SchemaMismatchError(
                    f"the schema of {self.display_url} changed at version {parent.version} "
                    "while this round was being written: "
                    + m.describe_schema_diff(parent_schema, schema)
                    + "; convert the round and append again"
                )
        if schema is not None and parent.schema != fp:
            # The schema file is written (or rewritten, refreshing its time for gc) before a
            # record names it, unless the parent names it already: then the head, a kept
            # version, names it, and gc keeps what a kept version names (docs/format.md,
            # "The commit protocol"). Asked per attempt: a lost race rebases onto a parent
            # that may name another schema.
            self.log.put_schema(schema)
        outcomes, state = outcomes_of(self.log).append_fields(pending, parent)
        return Commit(
            store_id=self.store_id,
            version=parent.version + 1,
            parent=parent.version,
            op="append",
            created=m.utc_now(),
            schema=fp,
            num_rows=parent.num_rows + sum(s.rows for s in shards),
            num_shards=parent.num_shards + len(shards),
            num_bytes=parent.num_bytes + sum(s.bytes for s in shards),
            add=tuple(shards),
            meta=meta,
            outcomes=outcomes,
            generator_state=state,
            consumption=record,
        )

    def _write_shards(
        self,
        table: pa.Table,
        shard_bytes: int,
        lease: str,
        *,
        sync: bool = True,
        deferred: DeferredSync | None = None,
        tables: list[tuple[ShardRef, pa.Table]] | None = None,
    ) -> list[ShardRef]:
        """The shards of ``table``, written under ``lease``; ``tables``, if given, gets each
        with the slice of ``table`` it holds."""
        per_shard = max(1, math.ceil(table.num_rows * shard_bytes / max(table.nbytes, 1)))
        written: list[ShardRef] = []
        try:
            for start in range(0, table.num_rows, per_shard):
                part = table.slice(start, per_shard)
                path = shard_path(lease)
                with self.storage.new_shard(path, deferred=deferred) as sink:
                    rows = group_rows(part.num_rows, local=self.storage.reads_in_place)
                    groups = write_shard(part, sink, rows)
                written.append(ShardRef(path, part.num_rows, sink.size, sink.sha256, groups))
                if tables is not None:
                    tables.append((written[-1], part))
            if sync:
                self.storage.sync_dir(m.DATA_DIR)
        except BaseException:
            self._remove(shard.path for shard in written)
            raise
        return written

    def stage_written(
        self,
        write: Callable[[Callable[[], str]], list[ShardRef]],
        schema: pa.Schema | None,
    ) -> tuple[list[ShardRef], Staged]:
        """Stage shards that ``write`` writes itself (compaction streams its rewrite), under a
        new lease like a round's: ``write(new_path)`` calls ``new_path()`` for the name of each
        shard it creates and returns a shard list, which may also name existing shards. Returns
        that list and the part holding only the new shards (for :meth:`commit_base`). If
        ``write`` raises, every file it named is removed and the lease ended."""
        self.log.require_writable()
        lease = self.log.leases.acquire()
        named: set[str] = set()

        def new_path() -> str:
            path = shard_path(lease)
            named.add(path)
            return path

        try:
            listed = list(write(new_path))
            self.storage.sync_dir(m.DATA_DIR)
        except BaseException:
            self._remove(sorted(named))
            self.log.leases.end({lease}, committed=False)
            raise
        new = tuple(s for s in listed if s.path in named)
        staged = Staged(new, schema, None, lease, self.store_id)
        return listed, staged.keep_leased(self.storage, self.log.leases.ttl_s)

    def appended_since(self, base: int, head: int, op: str = "compact") -> list[ShardRef]:
        """The shards added by versions ``base+1 … head``, which must all be appends (else
        :class:`CommitConflictError`: the head is no longer ``base`` plus rounds)."""
        added: list[ShardRef] = []
        for v in range(base + 1, head + 1):
            record = self.log.commit_record(v)
            if record.op != "append":
                raise CommitConflictError(
                    f"cannot {op} version {base} of {self.display_url}: version {v} is a "
                    f"{record.op}, so the head is no longer version {base} plus appends; "
                    f"{op} the head instead (run it again)"
                )
            added.extend(record.add)
        return added

    def commit_base(
        self,
        shards: list[ShardRef],
        *,
        op: str,
        schema: pa.Schema | None,
        meta: dict[str, Any] | None = None,
        target: int | None = None,
        expected_parent: int | None = None,
        staged: Staged | None = None,
        appends_after: int | None = None,
    ) -> int:
        """Commit a version whose complete shard list is ``shards`` (a reset, a compaction),
        through the same protocol as a round (:meth:`commit_staged`). ``target``, the version
        the shards come from, must not be collected when the record is created. With
        ``expected_parent``, fail instead of rebasing if someone committed meanwhile.

        ``staged``: the new shards among ``shards`` (from :meth:`stage_written`): their lease
        is claimed before the record and ended after it; if nothing is committed they are
        removed, and kept while a record of unknown outcome may still land (object stores).

        ``appends_after`` (a compaction of that version): the head may have moved past it by
        appends only (else :class:`CommitConflictError`); their shards follow ``shards``, and
        the record carries the head's schema and outcomes. Otherwise it carries ``target``'s
        outcomes and generator state (a reset brings them back with its rows)."""
        shards = list(shards)
        parts = [staged] if staged is not None and staged.shards else []
        if parts:  # a refusal changes nothing: the part stays the caller's
            self._check_parts(parts)
            listed = {s.path for s in shards}
            if any(s.path not in listed for s in parts[0].shards):
                raise InvalidDataError(
                    f"the staged shards of the {op} of {self.display_url} are not all in its "
                    "shard list; nothing was committed"
                )
        what = {"reset": "reset", "compact": "compaction"}.get(op, op)
        sources = [target] if target is not None else []

        def prepare(leases: set[str]) -> Callable[[Commit], Commit]:
            checked_meta = check_meta(meta, self.display_url)
            if schema is not None:
                self.log.put_schema(schema)
            fp = m.schema_fingerprint(schema) if schema is not None else None
            fixed = self.log.put_shard_list(shards) if appends_after is None else None
            carried: dict[int, tuple[Any, Any]] = {}

            def carry(version: int) -> tuple[Any, Any]:
                # The record stands alone like its shard list: it carries the lineage's
                # outcomes (written once per parent: a lost race rebases onto another).
                if version not in carried:
                    carried[version] = outcomes_of(self.log).carry(version)
                return carried[version]

            def make(parent: Commit) -> Commit:
                if expected_parent is not None and parent.version != expected_parent:
                    raise CommitConflictError(
                        f"{self.display_url} moved from version {expected_parent} to "
                        f"{parent.version} during {op}; run it again"
                    )
                if appends_after is None:
                    listing, shard_list, schema_fp = shards, fixed, fp
                    outcomes, state = carry(target) if target is not None else (None, None)
                else:
                    listing = shards + self.appended_since(appends_after, parent.version, op)
                    if parent.num_rows != sum(s.rows for s in listing):  # pragma: no cover
                        raise CommitConflictError(
                            f"the {what} of {self.display_url} does not match version "
                            f"{parent.version} ({parent.num_rows} rows); run it again"
                        )
                    shard_list = self.log.put_shard_list(listing)
                    # Rounds appended meanwhile may have added nullable columns: the head's
                    # schema is a superset of the base's, and shards read back conform to it.
                    schema_fp = parent.schema
                    self.schema_of(parent)  # cached, so a gc's removal can be repaired
                    outcomes, state = carry(parent.version)
                return Commit(
                    self.store_id,
                    parent.version + 1,
                    parent.version,
                    op,
                    m.utc_now(),
                    schema_fp,
                    sum(s.rows for s in listing),
                    len(listing),
                    sum(s.bytes for s in listing),
                    base=shard_list,
                    target=target,
                    meta=checked_meta,
                    outcomes=outcomes,
                    generator_state=state,
                )

            self.refresh()
            return make

        # Without appends_after, make uses only the parent's number: a reset out of a store
        # whose head record cannot be read is committed over it.
        return self._commit(
            parts,
            prepare,
            private=True,
            what=what,
            sources=sources,
            over_damaged=appends_after is None,
        )


def _nothing() -> None:
    pass


class _Background:
    """One call run on this process's writer thread; :meth:`result` waits for it and
    re-raises its error. ``value`` is its result once it returned (None before, or if it
    failed). One long-lived thread, not one per call: starting a thread costs a commit
    milliseconds on a loaded machine."""

    _threads = ProcessPool("dynstate-write")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self._future = self._threads.executor(1).submit(self._run, fn)

    def _run(self, fn: Callable[[], Any]) -> Any:
        self.value = fn()
        return self.value

    def result(self) -> Any:
        return self._future.result()


def _with_outcome_file(parts: Sequence[Staged], pending: Pending, store_id: str) -> list[Staged]:
    """``parts`` with the written outcome file of ``pending``, which goes (or stays) with the
    round's shards: in the part of its lease when it shares the round's (``append``), so the
    lease is claimed and ended once, else as a part of its own."""
    assert pending.ref is not None
    out = list(parts)
    for i, part in enumerate(out):
        if part.lease is not None and part.lease == pending.lease:
            out[i] = Staged(
                (*part.shards, pending.ref), part.schema, part.validated, part.lease, part.store
            )
            return out
    return [*out, Staged((pending.ref,), None, None, pending.lease, store_id)]
