"""The lease survey: gc's side of the leases (:mod:`dynstate.log.leases` is the writer's).

For each lease in the store, decide whether the files staged under it must stay: a lease is
live while its writer or a holder renews it within its ttl (judged by the storage's clock), a
commit claim is honoured while its committer may still publish, and a lease neither renewed
nor claimed is ended by an exclusive create of its outcome file (``expired``) before gc
removes anything it protects. See docs/format.md, "Leases".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from .. import paths
from ..errors import DynstateError
from ..records import manifest as m
from ..storage import Storage
from .leases import DEFAULT_TTL_S, LEASE_DIR, host_id, process_gone, read_outcome

log = logging.getLogger("dynstate")

_MAX_PID = 2**31 - 1  # pid_t; os.kill overflows past it

# A reading of the storage's clock (:meth:`Storage.now`: a POSIX timestamp, or None where the
# backend keeps no times). gc reads it once and hands the reading to :func:`survey` as ``now``;
# :func:`dynstate.maintenance.gc.collect_garbage` takes another in its place (``clock=``), the
# seam through which tests let time pass without sleeping.
Clock = Callable[[], "float | None"]


@dataclass
class LeaseState:
    lease: str
    protected: bool  # its shards must stay
    outcome: str | None  # "commit", "expired", "discarded" or None (undecided)
    files: list[str]  # the lease's own files, removable once its shards are dealt with


def survey(
    storage: Storage, *, claim: bool, now: float | None, stale_claim_s: float
) -> dict[str, LeaseState]:
    """Decide, for each lease in the store, whether its shards must stay. A lease neither
    renewed within its ttl nor committed is ended as ``expired`` (when ``claim``; a dry run
    only reports). A commit claim whose lease went stale is kept for ``stale_claim_s``
    unless its process is known to be gone.

    ``now`` is the storage's clock (:meth:`Storage.now`), read before the survey: every age
    here is ``now`` minus a modification time the storage stamped, never a host's clock
    against the storage's (None: the backend keeps no times, and no lease is judged stale).
    A ``now`` ahead of the storage's clock judges the leases as they will be then, if nobody
    renews them meanwhile (tests do so instead of sleeping)."""
    here = host_id()
    names = storage.list(LEASE_DIR)
    owners = {f"{LEASE_DIR}/{n}": paths.lease_file_of(f"{LEASE_DIR}/{n}") for n in names}
    out: dict[str, LeaseState] = {}
    for lease in sorted({owner for owner in owners.values() if owner is not None}):
        files = [rel for rel, owner in owners.items() if owner == lease]
        holders = _holders(names, lease)
        protected, outcome = _protected(storage, lease, here, claim, now, stale_claim_s, holders)
        out[lease] = LeaseState(lease, protected, outcome, files)
    return out


def _holders(names: list[str], lease: str) -> list[str]:
    """The holder files (:func:`dynstate.paths.holder_path`) of ``lease`` among the names of
    LEASE_DIR."""
    out = []
    for name in names:
        holder = paths.match_holder(f"{LEASE_DIR}/{name}")
        if holder is not None and holder.lease == lease:
            out.append(f"{LEASE_DIR}/{name}")
    return out


def _fresh(
    storage: Storage, lease: str, here: str, now: float | None, holders: list[str]
) -> tuple[bool, bool, bool]:
    """(whether a holder of the lease renewed it within its ttl, whether every holder is known
    to be gone — a process of this machine that no longer exists —, whether a holder that
    stopped renewing is a process of this machine that still exists: paused, not dead).
    The stager's lease file is read
    first; only if it is not live are the holder files listed again and read — listed after
    that read, so a process that took the lease over before the stager died or stopped is
    seen. ``holders`` (from the survey's listing) stand in where the lease file is gone, and
    an adopter refuses a lease whose file is gone."""
    first = _holder_state(storage, lease, paths.lease_path(lease), here, now)
    if first == "alive":
        return True, False, False
    states = [first]
    if first != "absent":
        holders = _holders(storage.list(LEASE_DIR), lease)
    for rel in holders:
        state = _holder_state(storage, lease, rel, here, now)
        if state == "alive":
            return True, False, False
        states.append(state)
    present = [s for s in states if s != "absent"]
    gone = bool(present) and all(s == "gone" for s in present)
    return False, gone, "paused-here" in states


def _holder_state(storage: Storage, lease: str, rel: str, here: str, now: float | None) -> str:
    """One holder file: ``alive`` (renewed within its ttl by the storage's clock), ``stale``,
    ``paused-here`` (stale, but its process of this machine exists), ``gone`` (its process of
    this machine no longer exists) or ``absent``."""
    local = False
    raw = storage.try_read(rel)
    if raw is None:
        return "absent"
    try:
        modified = storage.modified(rel)
    except FileNotFoundError:
        return "absent"
    try:
        body = m.decode(raw, rel)
        ttl = float(body.get("ttl_s", DEFAULT_TTL_S))
        pid = body.get("pid")
        # What no writer wrote (a pid past pid_t, 10**30, a bool; a ttl past a float) makes
        # the lease damaged, not a reason for gc to fail: it is judged by age like an
        # unreadable one.
        if type(pid) is not int or not 0 < pid <= _MAX_PID:
            raise ValueError(f"lease {lease} names pid {pid!r}")
        local = body.get("host") == here
        if local and process_gone(pid):
            return "gone"
    except (DynstateError, TypeError, ValueError, OverflowError):
        ttl = DEFAULT_TTL_S  # unreadable: judge by age alone
    if modified is None or now is None:
        return "alive"  # no clock to judge by: keep
    # Both times are the storage's; never judge closer than its stamps' resolution.
    if now - modified < ttl + storage.clock_resolution_s:
        return "alive"
    return "paused-here" if local else "stale"


def _claimant(outcome: dict, here: str) -> str | None:
    """A commit claim's committer, as :func:`_fresh` judges holders: ``gone`` or
    ``paused-here`` (its process of this machine exists: it may still publish), ``elsewhere``
    (another machine's: judged by the claim's age); None for a claim that names no process
    (an older writer's), judged by its lease's holders."""
    host, pid = outcome.get("host"), outcome.get("pid")
    if not isinstance(host, str) or type(pid) is not int or not 0 < pid <= _MAX_PID:
        return None
    if host != here:
        return "elsewhere"
    return "gone" if process_gone(pid) else "paused-here"


def _protected(
    storage: Storage,
    lease: str,
    here: str,
    claim: bool,
    now: float | None,
    stale_claim_s: float,
    holders: list[str],
) -> tuple[bool, str | None]:
    """(whether the lease's shards must stay, its outcome)."""
    for _ in range(3):
        outcome = read_outcome(storage, lease)
        kind = outcome.get("outcome") if outcome is not None else None
        if kind in ("expired", "discarded"):
            return False, str(kind)  # ended: no holder to read
        alive, gone, paused_here = _fresh(storage, lease, here, now, holders)
        if outcome is None:
            if alive:
                return True, None
            if not claim:
                return False, None
            body = m.encode({"format": m.FORMAT, "outcome": "expired", "by": "gc"})
            try:
                storage.create(paths.claim_path(lease), body)
                log.info("gc: lease %s of %s expired", lease, storage.display_url)
                return False, "expired"
            except FileExistsError:
                continue  # a commit claimed it just now: decide again
        if kind == "commit":
            if alive:
                return True, "commit"  # the commit is in flight
            # An unsettled claim's record may still land (a late PUT) after its process exited.
            unsettled = outcome.get("unsettled") is not None
            claimant = _claimant(outcome, here)
            if claimant is not None:
                # The claim names its committer: judge it alone. A holder that is not the
                # committer (the stager, whose heartbeat stopped when it saw the claim) says
                # nothing about whether the record can still land.
                gone, paused_here = claimant == "gone", claimant == "paused-here"
            if (gone and not unsettled) or not storage.exists(paths.lease_path(lease)):
                # The committer is gone, or published and cleaned up (lease file first).
                return False, "commit"
            if paused_here:
                # A holder of this machine stopped renewing, but its process exists: a
                # committer paused (SIGSTOP, a debugger, swapped out) between its claim and
                # its record keeps its shards for as long as it lives, whatever the pause.
                return True, "commit"
            try:
                claimed = storage.modified(paths.claim_path(lease))
            except FileNotFoundError:
                continue
            # The committer stopped renewing after it claimed: keep its shards while it
            # could still publish (both times the storage's, see _holder_state).
            if claimed is None or now is None:
                return True, "commit"
            return now - claimed < stale_claim_s + storage.clock_resolution_s, "commit"
        return True, None  # unreadable outcome: keep, verify reports it
    return True, None
