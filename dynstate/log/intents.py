"""Intents: a writer about to create a file that names a version (a tag, a reset's or a
compaction's record reusing that version's shards) first says so, so that gc keeps the version.

The writer writes an intent naming the version (``_dynstate/tag-intents/<id>.json``), then
reads the gc floor, then creates its file. A gc that publishes its floor reads the intents
afterwards (with the tags: :func:`dynstate.maintenance.retention.tags_from`) and lowers the
floor to any version one names. So either gc sees the intent (and keeps the version) or the
writer sees the new floor (and refuses the collected version before sending anything): there
is no interleaving in which neither sees the other.

The intent is removed once the create has an outcome. When it has none (a request failed with
its outcome unknown: on an object store it may still land after its client gave up) the intent
stays, and gc keeps the version while the intent is younger than :data:`INTENT_S` by the
storage's clock, then removes it. A writer paused longer than :data:`RENEW_S` after writing
its intent writes it again and reads the floor again before its create (:meth:`Intent.renew`):
gc honours an intent by the age the storage stamped on it, so a writer paused past
:data:`INTENT_S` would otherwise create a file naming a version gc no longer kept for it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .. import paths
from ..errors import CorruptStoreError, DynstateError
from ..records import manifest as m
from ..storage import Storage

log = logging.getLogger("dynstate")

#: How long gc honours an intent: longer than any request of the create it announces can be
#: late (gc's own BUSY_S for files a live writer may still use).
INTENT_S = 3600.0
#: A writer whose intent is older than this (by its own clocks) writes it again and reads the
#: floor again before its create: far below INTENT_S, far above what a create normally takes.
RENEW_S = 300.0


class Intent:
    """One writer's intent to name ``version`` in a file it is about to create."""

    def __init__(self, storage: Storage, version: int, what: dict[str, Any]) -> None:
        self.storage = storage
        self.version = version
        self.rel = paths.tag_intent_path(paths.new_id())
        self._body = {"format": m.FORMAT, "version": version, **what}
        self._written: tuple[float, float] | None = None

    def write(self) -> None:
        """Write (or write again) the intent; before the floor is read."""
        body = {**self._body, "created": m.utc_now()}
        if self._written is None:
            # Fails before anything else is sent; if it lands late it only keeps the version
            # longer.
            self.storage.create(self.rel, m.encode(body))
        else:
            self.storage.put(self.rel, m.encode(body))
        self._written = (time.monotonic(), time.time())

    def renew(self) -> bool:
        """Write the intent again if it was written over :data:`RENEW_S` ago, by the larger of
        this process's monotonic and wall clocks (the first stops while a machine sleeps);
        True if it did: the caller must read the floor again before its create."""
        if self._written is None:
            return False
        mono, wall = self._written
        if max(time.monotonic() - mono, time.time() - wall) <= RENEW_S:
            return False
        log.info(
            "intent for version %d of %s is %.0f s old; written again",
            self.version,
            self.storage.display_url,
            max(time.monotonic() - mono, time.time() - wall),
        )
        self.write()
        return True

    def settle(self, settled: bool, what: str) -> None:
        """Remove the intent once the create has an outcome (``settled``); otherwise leave it,
        saying so: gc keeps the version for :data:`INTENT_S`."""
        if not settled:
            log.warning(
                "%s of %s: its create may still land; gc keeps version %d for %.0f s",
                what,
                self.storage.display_url,
                self.version,
                INTENT_S,
            )
            return
        try:
            self.storage.delete(self.rel)
        except DynstateError as exc:  # gc removes it within INTENT_S
            log.warning("could not remove %s of %s: %s", self.rel, self.storage.display_url, exc)


def pending(storage: Storage) -> dict[str, int]:
    """Versions intents name (those younger than :data:`INTENT_S` by the storage's clock; all
    of them where it keeps no times), by intent file. An intent removed while this reads (its
    writer's create had its outcome) is skipped: it keeps nothing any more."""
    out: dict[str, int] = {}
    now: float | None = None
    asked = False  # the storage's clock is read once (on an object store, a probe write)
    for file_name in sorted(storage.list(paths.TAG_INTENT_DIR)):
        rel = f"{paths.TAG_INTENT_DIR}/{file_name}"
        if paths.match_tag_intent(rel) is None:
            continue
        raw = storage.try_read(rel)
        if raw is None:
            continue  # removed while we listed
        try:
            version = m.decode(raw, f"{storage.display_url}/{rel}").get("version")
        except CorruptStoreError as exc:
            log.warning("ignoring damaged intent %s: %s", rel, exc)
            continue
        if type(version) is not int or version < 0:
            continue
        if not asked:
            now, asked = storage.now(), True
        try:
            modified = storage.modified(rel)
        except FileNotFoundError:
            continue  # removed between the read and the stat
        if now is not None and modified is not None and now - modified > INTENT_S:
            continue  # no request is that late: gc removes it
        out[rel] = version
    return out
