"""Tags: names for versions, which gc never collects.

A tagger writes an intent naming the version (:mod:`dynstate.log.intents`), then reads the gc
floor, then creates the tag; the intent is removed once the tag's create has an outcome, and
stays while a create of unknown outcome may still land.
"""

from __future__ import annotations

import logging

from .. import paths
from ..errors import (
    CommitConflictError,
    CorruptStoreError,
    DynstateError,
    StoreExistsError,
    VersionCollectedError,
    VersionNotFoundError,
)
from ..records import manifest as m
from . import intents
from .commits import Log
from .intents import INTENT_S, Intent

log = logging.getLogger("dynstate")

__all__ = ["INTENT_S", "Tags"]


class Tags:
    def __init__(self, commits: Log) -> None:
        self.log = commits
        self.storage = commits.storage

    def _read(self, name: str) -> int:
        raw = self.storage.try_read(paths.tag_path(name)) if paths.is_safe_name(name) else None
        if raw is None:
            raise VersionNotFoundError(
                f"no tag {name!r} in {self.log.display_url}; `dynstate ls` lists versions and tags"
            )
        where = self.log.where(paths.tag_path(name))
        # A reset cannot repair a tag: the way out is dropping it (the version stays) or
        # restoring the file, and each error says so.
        fix = (
            "restore it from a backup, or remove the tag with "
            f"`dynstate tag {self.log.display_url} {name} --delete` (the version stays)"
        )
        try:
            version = m.decode(raw, where).get("version")
        except CorruptStoreError as exc:
            # codec's messages end in "; <advice>" (the advice holds no ';'): keep the finding.
            finding = str(exc).rsplit(";", 1)[0]
            raise type(exc)(f"tag {name!r}: {finding}; the file is damaged — {fix}") from None
        if type(version) is not int or not 0 <= version <= m.MAX_COUNT:
            raise CorruptStoreError(
                f"{where} names no version ({version!r} is not a count from 0 to 2**63 - 1); "
                f"the file is damaged — {fix}"
            )
        return version

    def version(self, name: str) -> int:
        """The kept version ``name`` names."""
        version = self._read(name)
        self.log.check_version(version)
        return version

    def all(self) -> dict[str, int]:
        """Every tag and the version it names (kept or not: a listing never fails on one).
        A damaged tag file raises :class:`CorruptStoreError` naming it."""
        tags, damaged = self.read_all()
        for error in damaged.values():
            raise error
        return tags

    def read_all(self) -> tuple[dict[str, int], dict[str, DynstateError]]:
        """Every readable tag and the version it names, and the error of each damaged tag
        file by tag name (verify reports each, and checks the rest). Raises only if the tags
        cannot be listed."""
        tags: dict[str, int] = {}
        damaged: dict[str, DynstateError] = {}
        for file_name in sorted(self.storage.list(paths.TAG_DIR)):
            name = paths.match_tag(f"{paths.TAG_DIR}/{file_name}")
            if name is None:
                continue
            try:
                tags[name] = self._read(name)
            except VersionNotFoundError:
                continue  # removed while we listed
            except DynstateError as exc:
                damaged[name] = exc
        return tags, damaged

    def create(self, name: str, target: int, *, force: bool) -> None:
        intent = Intent(self.storage, target, {"tag": name})
        intent.write()
        settled = False
        try:
            if target < self.log.read_floor():  # a gc published first: nothing is sent
                raise self.log.collected(target)
            self._create(name, target, force=force)
            settled = True
        except (StoreExistsError, VersionCollectedError, CorruptStoreError, CommitConflictError):
            # refused by us, with no request in flight (a conditional move's late copy can
            # change nothing once the tag was moved)
            settled = True
            raise
        finally:
            intent.settle(settled, f"tag {name}")

    def pending(self) -> dict[str, int]:
        """Versions tags (and resets, compactions) are being created for: see
        :func:`dynstate.log.intents.pending`."""
        return intents.pending(self.storage)

    def _create(self, name: str, target: int, *, force: bool) -> None:
        raw = m.encode({"format": m.FORMAT, "version": target, "created": m.utc_now()})
        rel = paths.tag_path(name)
        previous: bytes | None = None
        try:
            self.storage.create(rel, raw)
        except FileExistsError:
            try:
                current: int | None = self._read(name)
            except CorruptStoreError:
                if not force:
                    raise
                current = None  # a damaged tag is replaced like any other, with force
            if current == target:
                return
            if not force:
                raise StoreExistsError(
                    f"tag {name!r} in {self.log.display_url} already names version {current}; "
                    "pass force=True to move it"
                ) from None
            previous = self.storage.try_read(rel)
            # conditional on what was read (on object stores, its version): a move whose
            # request lands late, after a later move, changes nothing
            try:
                moved = previous is not None and self.storage.swap(rel, raw, previous)
            except FileNotFoundError:
                moved = False  # removed meanwhile
            if not moved:
                raise CommitConflictError(
                    f"tag {name!r} in {self.log.display_url} was moved or removed by another "
                    "writer while this one moved it; look at `dynstate tags` and run again"
                ) from None
        if target >= self.log.read_floor():
            return
        # gc moved its floor past the target while we tagged it: take the tag back.
        try:
            if previous is not None:
                try:
                    self.storage.swap(rel, previous, raw)  # unless another writer moved it since
                except FileNotFoundError:
                    pass  # removed meanwhile: nothing of ours to take back
            else:
                self.storage.delete(rel)
        except DynstateError as exc:
            log.warning("could not take back tag %s of %s: %s", name, self.log.display_url, exc)
        raise self.log.collected(target)

    def remove(self, name: str) -> None:
        """Drop tag ``name``; a damaged tag file is removed too (it is how one is repaired)."""
        try:
            self._read(name)
        except CorruptStoreError:
            log.warning("removing damaged tag %s of %s", name, self.log.display_url)
        self.storage.delete(paths.tag_path(name))
