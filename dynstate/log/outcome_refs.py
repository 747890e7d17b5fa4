"""What gc and verify need to know about outcomes: the outcome files, chunks and aggregates
that kept versions name (:class:`References`), and the problems with them (:func:`verify`).
Everything is read through :class:`dynstate.log.outcomes.Outcomes`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .. import paths
from ..errors import DynstateError
from ..records import manifest as m
from ..records.manifest import Commit, ShardRef
from ..records.outcomes import Ranges
from .outcomes import OUTCOME_DIR, AggregateRef, Lineage, outcomes_of

if TYPE_CHECKING:
    from .commits import Log


class References:
    """Outcome files, chunks and aggregates kept versions need (gc): the floor's complete
    list, what every kept record names, and what outcome checkpoints from the floor on name."""

    def __init__(self, log_: Log, floor: int) -> None:
        self.log = log_
        self.data: set[str] = set()
        self.chunks: set[str] = set()
        self.aggregates: set[str] = set()
        outcomes = outcomes_of(log_)
        lineage = outcomes.lineage(floor)
        self.data.update(f.path for f in outcomes.files(lineage))
        if lineage.aggregate is not None:
            self.aggregates.add(lineage.aggregate.path)
        for name in log_.storage.list(OUTCOME_DIR):
            rel = f"{OUTCOME_DIR}/{name}"
            number = paths.match_outcome_checkpoint(rel)
            if number is None or number < floor:
                continue
            raw = log_.storage.try_read(rel)
            if raw is None:
                continue
            obj = m.decode(raw, log_.where(rel))
            self.chunks.update(m.ShardList.from_json(obj.get("files"), rel).chunks)
            if obj.get("aggregate") is not None:
                self.aggregates.add(AggregateRef.from_json(obj["aggregate"], rel).path)

    def add_record(self, record: Commit, full: bool) -> None:
        """Add what ``record`` names; ``full``: expand a base list (versions above the floor)."""
        field = record.outcomes
        if field is None:
            return
        where = self.log.where(m.log_path(record.version))
        for entry in field.get("add", []):
            self.data.add(ShardRef.from_json(entry, where).path)
        if "base" in field:
            shard_list = m.ShardList.from_json(field["base"], where)
            self.chunks.update(shard_list.chunks)
            if full:
                self.data.update(f.path for f in self.log.expand(shard_list, where))
            if field.get("aggregate") is not None:
                self.aggregates.add(AggregateRef.from_json(field["aggregate"], where).path)

    def needs(self, rel: str) -> bool:
        if rel in self.data or rel in self.aggregates:
            return True
        return paths.match_chunk(rel) in self.chunks


def verify(log_: Log, versions: Iterable[int], all_versions: bool) -> list[str]:
    """Problems with the outcomes of ``versions`` (their files read back against their
    checksums) and with every outcome checkpoint and aggregate from the floor on."""
    problems: list[str] = []
    outcomes = outcomes_of(log_)
    files: dict[str, tuple[ShardRef, int]] = {}
    # Files whose adding record was read: the bounds that record's writer checked, exactly
    # (rows of the version it was appended to, the steps it lists), not only the lineage's.
    added: dict[str, tuple[int, str, Ranges]] = {}
    aggregates: dict[str, AggregateRef] = {}
    for version in versions:
        add: list[ShardRef]
        try:
            if all_versions:
                record = log_.commit_record(version)
                if record.base is not None or record.op != "append":
                    add, base = [], outcomes._base_of(record)
                else:
                    add, steps, _ = outcomes._add_of(record)
                    base = Lineage(version)
                    parent = f"version {record.parent} (it was appended to)"
                    for ref in add:
                        added[ref.path] = (record.num_rows - record.rows_added, parent, steps)
                named = [*outcomes.files(base), *add]
                if version == log_.floor:
                    named.extend(outcomes.lineage_files(version))
                agg = base.aggregate
            else:
                lineage = outcomes.lineage(version)
                named, agg = outcomes.files(lineage), lineage.aggregate
        except DynstateError as exc:
            problems.append(f"outcomes of version {version}: {exc}")
            continue
        for ref in named:
            files.setdefault(ref.path, (ref, version))
        if agg is not None:
            aggregates[agg.path] = agg
    for name in sorted(log_.storage.list(OUTCOME_DIR)):
        number = paths.match_outcome_checkpoint(f"{OUTCOME_DIR}/{name}")
        if number is None or number < log_.floor:
            continue
        try:
            found = outcomes.read_checkpoint(number)
        except DynstateError as exc:
            problems.append(str(exc))
            continue
        if found is not None and found.aggregate is not None:
            aggregates[found.aggregate.path] = found.aggregate
    for ref, version in files.values():
        outcomes._files.pop(ref.path, None)  # read the bytes again, not this handle's copy
        try:
            table = outcomes.read_file(ref, version, cache=False)
            if ref.path in added:
                rows, parent, steps = added[ref.path]
                where = f"{log_.display_url} (version {version})"
                bounds = tuple((a, b) for a, b in steps)
                outcomes._check_file(
                    table, ref.path, version, where, rows=(rows, parent), steps=bounds
                )
        except DynstateError as exc:
            problems.append(str(exc))
    for agg_ref in aggregates.values():
        try:
            outcomes.read_aggregate(agg_ref)
        except FileNotFoundError:
            problems.append(f"outcome aggregate {log_.where(agg_ref.path)} is missing")
        except DynstateError as exc:
            problems.append(str(exc))
    return problems
