"""Leases: how a writer protects the files it staged but has not committed yet.

A writer creates ``_dynstate/leases/<id>.json`` before it writes a shard and names every
shard of that lease ``data/<id>-<uuid>.parquet``. While the writer lives, a heartbeat thread
rewrites the lease file every ``ttl_s / 4`` seconds. The lease ends in exactly one of two
ways, decided by an exclusive create of ``_dynstate/leases/<id>.outcome.json``:

* the committer creates it with outcome ``commit`` (and a nonce of its own) before it
  publishes the record that names the shards;
* gc creates it with outcome ``expired`` when the lease file was not rewritten for ``ttl_s``
  (or names a process of this machine that no longer exists), and only then removes the
  lease's shards.

Exclusive create lets only one of them win, so gc never removes shards a commit is about to
name, and a commit never names shards gc removes. See docs/format.md, "Leases". This module
is the writer's side (acquire, renew, adopt, claim, end); :mod:`dynstate.log.survey` is gc's
(which leases still protect their files).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time

from .. import paths
from ..errors import CommitConflictError, DynstateError, InvalidDataError, LeaseExpiredError
from ..records import manifest as m
from ..storage import Storage

log = logging.getLogger("dynstate")

LEASE_DIR = paths.LEASE_DIR
DEFAULT_TTL_S = 120.0
# A heartbeat stops renewing a lease nobody committed or discarded after this long.
MAX_LIFETIME_S = 7 * 86400.0

# The names of a lease's files (made and matched in dynstate.paths).
lease_path = paths.lease_path
outcome_path = paths.claim_path
holder_path = paths.holder_path
shard_path = paths.shard_path
lease_of = paths.lease_of

_HOLDER: tuple[int, str] | None = None


def process_holder() -> str:
    """This process's holder id (32 hex), new in every process (also after a fork): the
    holder part of :func:`dynstate.paths.holder_path`."""
    global _HOLDER
    if _HOLDER is None or _HOLDER[0] != os.getpid():
        _HOLDER = (os.getpid(), paths.new_id())
    return _HOLDER[1]


def host_id() -> str:
    """This machine (and pid namespace), to tell whether a lease's process can be checked."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        parts.append("?")
    return ":".join(parts)


def process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs here (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class Leases:
    """The leases one store handle holds, and the heartbeat that renews them."""

    def __init__(self, storage: Storage, ttl_s: float = DEFAULT_TTL_S) -> None:
        if not ttl_s > 0:
            raise InvalidDataError(
                f"the lease ttl for {storage.display_url} must be a positive number of "
                f"seconds, not {ttl_s!r}"
            )
        self.storage = storage
        self.ttl_s = float(ttl_s)
        self._active: dict[str, float] = {}  # lease id -> monotonic time acquired
        self._adopted: set[str] = set()  # of those, leases taken over: renewed as a holder
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @functools.cached_property
    def _host(self) -> str:
        # On first use (a lease or a claim written): a handle that only reads never pays it.
        return host_id()

    def __getstate__(self) -> dict[str, object]:
        # A pickled handle (Ray task, spawned worker) holds no leases of its own.
        return {"storage": self.storage, "ttl_s": self.ttl_s}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["storage"], state["ttl_s"])  # type: ignore[misc]

    def _body(self, lease: str) -> bytes:
        return m.encode(
            {
                "format": m.FORMAT,
                "lease": lease,
                "ttl_s": self.ttl_s,
                "host": self._host,
                "pid": os.getpid(),
                "renewed": m.utc_now(),
            }
        )

    def acquire(self) -> str:
        """A new lease, written before any file it protects."""
        lease = paths.new_id()
        # No fsync: after a crash of the machine the writer is gone too, and so is the lease.
        self.storage.create(lease_path(lease), self._body(lease), durable=False)
        with self._lock:
            self._active[lease] = time.monotonic()
        self._ensure_heartbeat()
        return lease

    def adopt(self, leases: set[str]) -> None:
        """Renew ``leases`` (staged by another handle or process) from now on. A lease that
        has ended — its files committed, discarded or collected — cannot be taken over.

        The taker renews a holder file of its own (:func:`holder_path`), not the stager's
        lease file: were both to rewrite one file, a stager that died right after its own
        renewal would leave the file naming a dead process while the taker lives, and gc
        would end the lease under the taker. gc keeps a lease while any holder is live."""
        for lease in leases:
            with self._lock:
                if lease in self._active:
                    continue  # ours, renewed by the heartbeat
            holder = holder_path(lease, process_holder())
            # Our holder file first, then the outcome: a gc that surveys after the write sees
            # a live holder, and one that ended the lease before it is seen here. The outcome
            # outlives the lease file (a tombstone), so a lease that ended is never renewed
            # back into existence by a late taker.
            self.storage.put(holder, self._body(lease), durable=False)
            outcome = read_outcome(self.storage, lease)
            if outcome is not None or not self.storage.exists(lease_path(lease)):
                self.storage.delete(holder)
                raise self._lost(lease, outcome)
            with self._lock:
                self._active[lease] = time.monotonic()
                self._adopted.add(lease)
        self._ensure_heartbeat()

    def renew(self, lease: str) -> None:
        with self._lock:
            adopted = lease in self._adopted
        rel = holder_path(lease, process_holder()) if adopted else lease_path(lease)
        self.storage.put(rel, self._body(lease), durable=False)

    def forget(self, leases: set[str]) -> None:
        with self._lock:
            for lease in leases:
                self._active.pop(lease, None)
                self._adopted.discard(lease)

    def take(self, leases: set[str], nonce: str, *, head: int) -> None:
        """What a commit does to own its parts before its record: renew their leases from now
        on (:meth:`adopt`: staged by another handle or process), then win each for the commit
        (:meth:`claim`), or raise as :meth:`claim` does."""
        self.adopt(leases)
        self.claim(leases, nonce, head=head)

    def claim(
        self, leases: set[str], nonce: str, outcome: str = "commit", *, head: int | None = None
    ) -> None:
        """Win every lease for a commit (outcome ``commit``) or a discard (``discarded``), or
        raise: gc expired one of them or a discard won it (:class:`LeaseExpiredError`), or a
        commit holds it (:class:`CommitConflictError`). On failure the leases this call won
        are given up (outcome ``discarded``, by ``nonce``): the round cannot be committed.
        The claim names its process and the committer's ``head``, so that a later caller can
        tell a dead claimant (whose record never landed) from a live one."""
        body = self._claim_body(outcome, nonce, head)
        won: list[str] = []
        try:
            for lease in sorted(leases):
                try:
                    # Not fsynced: the record created after it is, and it keeps the shards.
                    self.storage.create(outcome_path(lease), body, durable=False)
                except FileExistsError:
                    found = read_outcome(self.storage, lease)
                    if found is None or found.get("by") != nonce:
                        raise self._lost(lease, found) from None
                    if found.get("outcome") != outcome:
                        self.storage.put(outcome_path(lease), body)  # ours: we decide again
                won.append(lease)
                # Winning the outcome proves gc left the shards alone only while gc's own
                # outcome (a tombstone) still stands. A writer paused past TOMBSTONE_S wins
                # against nothing; the lease file, which gc removes with the shards and no
                # writer creates again, tells.
                if not self.storage.exists(lease_path(lease)):
                    raise self._lost(lease, None)
        except BaseException:
            self._give_up(won, nonce)
            raise

    def _claim_body(self, outcome: str, nonce: str | None, head: int | None, **extra) -> bytes:
        body: dict[str, object] = {"format": m.FORMAT, "outcome": outcome, "by": nonce}
        body.update(host=self._host, pid=os.getpid(), **extra)
        if head is not None:
            body["head"] = head
        return m.encode(body)

    def keep_unsettled(self, leases: set[str], nonce: str, version: int) -> None:
        """A commit whose record may still land later (its create's outcome is unknown on an
        object store): keep the leases claimed, marked ``unsettled``, so that gc keeps their
        shards for its stale-claim period even after this process exits; the lease files stay."""
        self.forget(leases)
        body = self._claim_body("commit", nonce, None, unsettled=version)
        for lease in leases:
            try:
                self.storage.put(outcome_path(lease), body)
            except DynstateError as exc:
                log.warning("could not mark lease %s unsettled: %s", lease, exc)

    def _lost(self, lease: str, outcome: dict[str, object] | None) -> DynstateError:
        kind = outcome.get("outcome") if outcome is not None else None
        where = f"lease {lease} of staged files in {self.storage.display_url}"
        if kind == "commit":
            err = CommitConflictError(
                f"the staged parts of {where} were already committed (or are being committed) "
                "by another call; commit each staged part once"
            )
            # The caller (the writer) can read the log and say which of the two it is.
            err.claim, err.lease = outcome, lease  # type: ignore[attr-defined]
            return err
        if kind == "discarded":
            return LeaseExpiredError(
                f"the staged parts of {where} were discarded (or a failed commit gave them up); "
                "nothing was committed — stage the round again"
            )
        return LeaseExpiredError(
            f"the {where} has ended: its lease was not renewed for {self.ttl_s:g} s, or the "
            "process holding it exited, and a gc expired it (or its files were committed or "
            "discarded and the record of that is gone); nothing was committed — keep the "
            "staging process alive until the commit, and stage the round again"
        )

    def _give_up(self, leases: list[str], nonce: str | None = None) -> None:
        body = self._claim_body("discarded", nonce, None)
        self.forget(set(leases))
        for lease in leases:
            try:
                self.storage.put(outcome_path(lease), body)
                self.storage.delete(lease_path(lease))
            except DynstateError as exc:
                log.warning("could not give up lease %s: %s (gc will)", lease, exc)

    def end(self, leases: set[str], *, committed: bool, tombstone: bool = True) -> None:
        """Finish leases after their commit landed (``committed``) or after their owner removed
        their shards: the lease file goes; the outcome stays behind as a tombstone (gc removes
        it after TOMBSTONE_S), so that nobody can claim the lease again — a second commit of
        the same parts, or a discard of committed ones, fails on it. Without ``tombstone``
        (parts that never left this call, as in ``append``) the outcome goes too."""
        self.forget(leases)
        for lease in leases:
            try:
                self.storage.delete(lease_path(lease))
                if not tombstone:
                    outcome = read_outcome(self.storage, lease)
                    if outcome is None or outcome.get("outcome") != "expired":
                        self.storage.delete(outcome_path(lease))  # gc's tombstone stays
            except DynstateError as exc:
                log.warning("could not end lease %s: %s (gc will)", lease, exc)

    def ended(self, lease: str) -> bool:
        """Whether ``lease`` has ended (its lease file is gone): committed, discarded or
        collected. Its files are then no longer the caller's to remove."""
        with self._lock:
            if lease in self._active:
                return False
        return not self.storage.exists(lease_path(lease))

    # -- heartbeat -------------------------------------------------------------------------

    def _ensure_heartbeat(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            # The thread holds these leases (not the store handle): staged files stay protected
            # while the process lives, also after the handle that staged them is dropped (a
            # Ray task returns its Staged parts and ends; the driver commits them later).
            self._thread = threading.Thread(
                target=_heartbeat,
                args=(self, self.ttl_s / 4),
                name="dynstate-lease-heartbeat",
                daemon=True,
            )
            self._thread.start()

    def _tick(self) -> bool:
        """Renew every active lease; False once none is left."""
        with self._lock:
            active = dict(self._active)
        now = time.monotonic()
        for lease, since in active.items():
            try:
                # The outcome first: once it exists the lease is decided, and renewing
                # would recreate a lease file its decider removed.
                if (
                    self.storage.exists(outcome_path(lease))
                    or not self.storage.exists(lease_path(lease))
                    or now - since > MAX_LIFETIME_S
                ):
                    self.forget({lease})  # committed, discarded or expired elsewhere
                    continue
                self.renew(lease)
            except DynstateError as exc:
                log.warning("could not renew lease %s: %s", lease, exc)
        with self._lock:
            return bool(self._active)


def _heartbeat(leases: Leases, interval_s: float) -> None:
    while True:
        leases._wake.wait(interval_s)
        if not leases._tick():
            return


_RECEIVED: dict[str, Leases] = {}
_RECEIVED_LOCK = threading.Lock()


def keep_alive(storage: Storage, ttl_s: float, lease: str) -> None:
    """Renew ``lease`` from this process on (a :class:`Staged` part was unpickled here). A
    lease that ended is left alone: committing the part then says why."""
    with _RECEIVED_LOCK:
        leases = _RECEIVED.get(storage.display_url)
        if leases is None:
            leases = _RECEIVED[storage.display_url] = Leases(storage, ttl_s)
    try:
        leases.adopt({lease})
    except DynstateError as exc:
        log.debug("not renewing lease %s of %s: %s", lease, storage.display_url, exc)


def read_outcome(storage: Storage, lease: str) -> dict[str, object] | None:
    raw = storage.try_read(outcome_path(lease))
    if raw is None:
        return None
    try:
        return m.decode(raw, f"{storage.display_url}/{outcome_path(lease)}")
    except DynstateError:
        return {"outcome": "unreadable"}
