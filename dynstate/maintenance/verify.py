"""Verify a store end to end: every kept commit record, schema, checkpoint and chunk, and the
bytes of every shard of the head (or of every kept version). Problems are collected, not
raised, so one run names all of them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from .. import paths
from ..errors import DynstateError, VersionCollectedError
from ..log.outcome_refs import verify as verify_outcomes
from ..records.manifest import Commit, ShardRef
from ..store import Store

log = logging.getLogger("dynstate")

#: How many times a check that found problems while gc moved the floor is run again.
ATTEMPTS = 3


@dataclass
class VerifyReport:
    url: str
    head: int
    floor: int
    versions_checked: list[int] = field(default_factory=list)
    shards_checked: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, object]:
        return {
            "url": self.url,
            "ok": self.ok,
            "head": self.head,
            "floor": self.floor,
            "versions_checked": self.versions_checked,
            "shards_checked": self.shards_checked,
            "bytes_checked": self.bytes_checked,
            "problems": self.problems,
        }


def verify_store(
    store: Store,
    *,
    all_versions: bool = False,
    progress: Callable[[int, int], None] | None = None,
    records_progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check ``store``; ``progress(done, total)`` is called per shard read, and
    ``records_progress(done, total)`` per commit record read before that. A gc that runs
    meanwhile removes what verify set out to read: a check that found problems while the
    floor moved is run again from the new floor (at most :data:`ATTEMPTS` times), so only
    what is missing above the floor as it stands is reported."""
    for attempt in range(1, ATTEMPTS + 1):
        report = _verify(store, all_versions, progress, records_progress)
        if report.ok or attempt == ATTEMPTS:
            return report
        floor = store.log.read_floor()
        if floor == report.floor:
            return report
        log.info(
            "gc moved the floor of %s from %d to %d while verify ran; checking again",
            store.display_url,
            report.floor,
            floor,
        )
    raise AssertionError("unreachable")


def _verify(
    store: Store,
    all_versions: bool,
    progress: Callable[[int, int], None] | None,
    records_progress: Callable[[int, int], None] | None,
) -> VerifyReport:
    head = store.latest()
    floor = store.floor
    report = VerifyReport(store.display_url, head, floor)
    hinted = store.log.hinted_head()
    if hinted is not None and hinted > head and not _committed_since(store, hinted):
        # the head is found by probing record names, so removed newest records would make
        # the store read as an older head, silently; the hint remembers the newer one
        report.problems.append(
            f"the head hint of {store.display_url} ({paths.HEAD_HINT}) names version {hinted}, "
            f"but the log ends at version {head}: the commit records of versions "
            f"{head + 1}-{hinted} were removed; restore them from a backup (until then the "
            f"store reads as of version {head})"
        )
    records = _check_records(store, floor, head, report, records_progress)
    _check_schemas(store, records, report)
    _check_checkpoints(store, floor, report)
    for name, version in sorted(_read_tags(store, report).items()):
        if version < floor or version > head:
            report.problems.append(
                f"tag {name!r} of {store.display_url} names version {version}, which is not "
                f"kept (versions {floor}-{head}); remove it with `dynstate tag --delete`"
            )
    shards: dict[str, tuple[ShardRef, int]] = {}
    if all_versions:
        # The union of what every readable record names covers every kept version's shards
        # (a version's list is the floor's or a base's, plus the rounds since) without
        # materializing each version, and still reaches past a damaged record.
        if floor in records:
            _collect(store, floor, shards, report)
        for version, record in sorted(records.items()):
            report.versions_checked.append(version)
            added: set[str] = set()
            for shard in record.add:
                if shard.path in added:
                    _duplicate(store, shard.path, version, report)
                added.add(shard.path)
                shards.setdefault(shard.path, (shard, version))
            if record.base is not None and version != floor:
                _collect(store, version, shards, report)
    if head in records:
        _collect(store, head, shards, report)
        if not all_versions:
            report.versions_checked.append(head)
    for done, (shard, version) in enumerate(shards.values(), 1):
        _check_shard(store, shard, version, report)
        if progress is not None:
            progress(done, len(shards))
    checked = sorted(records) if all_versions else [v for v in (head,) if v in records]
    report.problems.extend(verify_outcomes(store.log, checked, all_versions))
    return report


def _committed_since(store: Store, version: int) -> bool:
    """Whether ``version``'s record is there now: a writer committed it (and moved the hint)
    after this check found the head, which is no damage."""
    try:
        return store.log.record(version) is not None
    except DynstateError:
        return True  # there, damaged: the records' own check names it


def _read_tags(store: Store, report: VerifyReport) -> dict[str, int]:
    """Every readable tag; each damaged tag file is a problem of its own, and the rest of the
    store is still checked."""
    try:
        tags, damaged = store.check_tags()
    except DynstateError as exc:
        report.problems.append(f"the tags of {store.display_url} cannot be listed: {exc}")
        return {}
    for name, error in sorted(damaged.items()):
        report.problems.append(
            f"tag file {store.display_url}/{paths.tag_path(name)}: {error}; remove it with "
            "`dynstate tag --delete` or restore it"
        )
    return tags


def _collect(
    store: Store, version: int, shards: dict[str, tuple[ShardRef, int]], report: VerifyReport
) -> None:
    try:
        listed = store.snapshot(version).shards  # a snapshot reads its shard list when asked
    except DynstateError as exc:
        report.problems.append(f"version {version}: {exc}")
        return
    seen: set[str] = set()
    for shard in listed:
        if shard.path in seen:
            _duplicate(store, shard.path, version, report)
        seen.add(shard.path)
        shards.setdefault(shard.path, (shard, version))


def _duplicate(store: Store, path: str, version: int, report: VerifyReport) -> None:
    problem = (
        f"shard {path} of {store.display_url} is listed twice by version {version} (its rows "
        "count twice); reset to a version before it or compact to rewrite it"
    )
    if problem not in report.problems:
        report.problems.append(problem)


def _check_records(
    store: Store,
    floor: int,
    head: int,
    report: VerifyReport,
    progress: Callable[[int, int], None] | None = None,
) -> dict[int, Commit]:
    records: dict[int, Commit] = {}
    if progress is not None:
        progress(0, head - floor + 1)
    for version in range(floor, head + 1):
        try:
            records[version] = store.commit_record(version)
        except VersionCollectedError:
            report.problems.append(
                f"the commit record of version {version} ({store.display_url}/"
                f"{paths.log_path(version)}) is missing; restore it from a backup"
            )
        except DynstateError as exc:
            report.problems.append(f"version {version}: {exc}")
        if progress is not None:
            progress(version - floor + 1, head - floor + 1)
    return records


def _check_schemas(store: Store, records: dict[int, Commit], report: VerifyReport) -> None:
    seen: set[str] = set()
    for record in records.values():
        if record.schema is None or record.schema in seen:
            continue
        seen.add(record.schema)
        try:
            store.log.schema(record.schema, record.version, cached=False)
        except DynstateError as exc:
            report.problems.append(str(exc))


def _check_checkpoints(store: Store, floor: int, report: VerifyReport) -> None:
    """Checkpoints and the chunks they name (a reader may rely on any of them), read from the
    files now, not from the handle's caches."""
    catalog = store.log
    chunks: set[str] = set()
    for version in catalog.checkpoint_versions(floor):
        try:
            shard_list = catalog.read_checkpoint(version)
        except DynstateError as exc:
            report.problems.append(str(exc))
            continue
        if shard_list is not None:  # None: removed since the listing (a gc)
            chunks.update(shard_list.chunks)
    for digest in sorted(chunks):
        try:
            if catalog.read_chunk(digest, cached=False) is None:
                report.problems.append(
                    f"chunk {store.display_url}/{paths.chunk_path(digest)} named by a checkpoint "
                    "is missing"
                )
        except DynstateError as exc:
            report.problems.append(str(exc))


def _check_shard(store: Store, shard: ShardRef, version: int, report: VerifyReport) -> None:
    try:
        data = store.read_shard_bytes(shard, version=version)
    except DynstateError as exc:
        report.problems.append(str(exc))
        return
    report.shards_checked += 1
    report.bytes_checked += len(data)
    try:
        metadata = pq.read_metadata(pa.BufferReader(data))
        rows, stored = metadata.num_rows, metadata.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as exc:
        report.problems.append(
            f"shard {shard.path} of {store.display_url} (version {version}) matches its "
            f"checksum but is not readable Parquet: {exc}"
        )
        return
    if rows != shard.rows:
        report.problems.append(
            f"shard {shard.path} of {store.display_url} (version {version}) holds {rows} rows, "
            f"its record says {shard.rows}"
        )
    _check_shard_schema(store, shard, version, stored, report)


def _check_shard_schema(
    store: Store, shard: ShardRef, version: int, stored: pa.Schema, report: VerifyReport
) -> None:
    """A shard's columns must read as ``version``'s schema says: a read casts each column to
    the schema's type (records/rounds ``conform``), and a cast Arrow lacks would fail every
    read of the version. Columns the shard lacks (added after it was written) read as nulls."""
    try:
        schema = store.snapshot(version).schema
    except DynstateError:
        return  # the record's problem, reported by _check_records / _check_schemas
    if schema is None:
        return
    for want in schema:
        at = stored.get_field_index(want.name)
        if at < 0 or stored.field(at).type == want.type:
            continue
        got = stored.field(at).type
        try:
            pa.array([], got).cast(want.type)
        except (pa.ArrowException, ValueError, TypeError):
            report.problems.append(
                f"shard {shard.path} of {store.display_url} (version {version}) holds column "
                f"{want.name} as {got}, which the version's schema ({want.type}) cannot read"
            )
