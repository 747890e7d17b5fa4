"""Checking and upkeep: verify, gc, tag, reset, compact. Destructive work is planned first and
done only with --yes (or a yes typed on a terminal)."""

from __future__ import annotations

import re
from typing import Any

import click

from . import render as r
from .errors import Failure
from .options import (
    Count,
    Duration,
    Size,
    confirm,
    json_option,
    open_store,
    store_command,
    version_arg,
    yes_option,
)

PLAN_LINES = 20


@click.command("verify")
@click.argument("url")
@click.option("--all", "all_versions", is_flag=True, help="Check the shards of every kept version.")
@json_option
@store_command
def verify_cmd(url: str, all_versions: bool, as_json: bool, storage_options) -> None:
    """Check every commit record, schema, checkpoint and chunk, and the size and checksum of
    every shard of the head (of every kept version with --all). Names every problem found and
    exits 1 if there is any.

    \b
    Example:
      dynstate verify s3://bucket/runs/run1 --all
    """
    from ..maintenance.verify import verify_store

    store = open_store(url, storage_options)
    with r.bars() as add:
        records = add("checking records", "records")
        report = verify_store(
            store,
            all_versions=all_versions,
            records_progress=records,
            progress=add("verifying shards", "shards"),
        )
    if as_json:
        r.print_json(report.to_json())
    else:
        for problem in report.problems:
            r.echo(f"problem: {problem}")
        if report.ok:
            r.echo(
                f"ok: {store.display_url}: {r.count(len(report.versions_checked), 'version')}, "
                f"{r.count(report.shards_checked, 'shard')}, "
                f"{r.human_size(report.bytes_checked)} verified"
            )
    if not report.ok:
        raise Failure(f"{len(report.problems)} problem(s) in {store.display_url}")


FOREIGN_LINES = 5


def _flags(text: str) -> str:
    """The library's rule names (``keep 5``, ``older than 7d``) as the command's flags."""
    text = re.sub(r"\bkeep (\d+)", r"--keep \1", text)
    text = re.sub(r"\bolder than (\d)", r"--older-than \1", text)
    return text.replace("(keep or older than)", "(--keep or --older-than)")


def _span(start: int, end: int) -> str:
    return f"version {start}" if start == end else f"versions {start}-{end}"


def _explain_lines(result: Any, store: Any) -> list[str]:
    """Why the floor is where it is, why each kept range is kept (and how many versions in it
    a reset abandoned: gc keeps them too), and the files gc leaves alone because dynstate
    never writes such names."""
    from ..history import lineage

    # gc has just read these records: the walk costs no request.
    line = set(lineage(store, result.head, result.floor_after))
    lines = []
    retention = result.retention
    pins = result.pinned_by
    if retention is not None:
        tags = [p for p in pins if p["kind"] == "tag"]
        rule = _flags(retention.to_json(result.floor_after)["rule"])
        floor = f"floor: version {result.floor_after}"
        if tags:
            names = ", ".join(str(p["name"]) for p in tags)
            floor += f", held by tag {names} ({rule} alone would keep from version "
            floor += f"{retention.asked})"
        elif pins and pins[0]["kind"] in ("keep", "older_than"):
            floor += f", set by {rule}"
        elif pins and pins[0]["kind"] == "earlier floor":
            floor += f" (unchanged: {rule} collects nothing more)"
        else:
            floor += f" (unchanged: {rule})"
        lines.append(floor)
    for kept in result.kept:
        span = _span(int(kept["from"]), int(kept["to"]))
        low, high = int(kept["from"]), int(kept["to"])
        abandoned = sum(1 for v in range(low, high + 1) if v not in line)
        note = f"; {abandoned:,} of them abandoned by a reset" if abandoned else ""
        lines.append(f"kept: {span}: {_flags(str(kept['reason']))}{note}")
    foreign = result.foreign
    if foreign:
        shown = ", ".join(foreign[:FOREIGN_LINES])
        more = f" and {len(foreign) - FOREIGN_LINES:,} more (--json lists all)"
        lines.append(
            f"left alone: {r.count(len(foreign), 'file')} dynstate never writes: {shown}"
            + (more if len(foreign) > FOREIGN_LINES else "")
        )
    return lines


def _young(result: Any) -> str:
    """What gc left because it is younger than the grace period, saying apart the outcome
    files of the versions this run collected: they are not a killed writer's leftovers."""
    outcomes = getattr(result, "kept_young_outcomes", 0)
    if not outcomes:
        return f"{r.count(result.kept_young, 'orphan')} younger than the grace period kept"
    others = result.kept_young - outcomes
    text = (
        f"kept until older than the grace period: {r.count(outcomes, 'outcome file')} of "
        f"the collected versions (rounds a reset or rollback abandoned; a later gc removes "
        f"{'it' if outcomes == 1 else 'them'})"
    )
    return text + (f" and {r.count(others, 'orphan')}" if others else "")


def _gc_lines(result: Any, verb: str, store: Any) -> list[str]:
    lines = [
        f"{verb} {removal.path} ({removal.reason}, {r.human_size(removal.bytes)})"
        for removal in result.removed[:PLAN_LINES]
    ]
    if len(result.removed) > PLAN_LINES:
        lines.append(f"... and {len(result.removed) - PLAN_LINES:,} more files (--json lists all)")
    collected = result.versions_collected
    span = _span(collected[0], collected[-1]) if collected else "no versions"
    lines.append(
        f"{result.url}: {verb} {r.count(len(result.removed), 'file')} "
        f"({r.human_size(result.bytes_freed)}), {span} collected; "
        + _young(result)
        + (
            f", {r.count(result.kept_leased, 'file')} of live writers kept"
            if getattr(result, "kept_leased", 0)
            else ""
        )
    )
    return lines + _explain_lines(result, store)


@click.command("gc")
@click.argument("url")
@click.option("--keep", type=Count(1), help="Keep the newest N versions.")
@click.option("--older-than", type=Duration(), help="Collect versions older than this (7d, 12h).")
@click.option(
    "--grace", type=Duration(), default="1h", show_default=True,
    help="Leave unreferenced files younger than this.",
)  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Only show the plan, never ask.")
@yes_option
@json_option
@store_command
def gc_cmd(url, keep, older_than, grace: float, dry_run: bool, yes: bool, as_json, storage_options):
    """Remove files no kept version needs (left by killed writers) once older than the grace
    period and, with --keep or --older-than, the versions beyond that rule. The head, tagged
    versions and every file a kept version needs are never removed.

    Shows the plan first and removes only with --yes, or after a yes typed on a terminal.

    \b
    Example:
      dynstate gc s3://bucket/runs/run1 --keep 50
      dynstate gc s3://bucket/runs/run1 --keep 50 --yes
    """
    from ..maintenance.gc import collect_garbage

    if keep is not None and older_than is not None:
        raise click.UsageError("give either --keep or --older-than, not both")
    store = open_store(url, storage_options)
    rule = {"keep": keep, "older_than_s": older_than, "grace_s": grace}
    with r.progress("planning gc: reading the store") as update:
        update(0, None)
        plan = collect_garbage(store, dry_run=True, **rule)
    nothing = not plan.removed and not plan.versions_collected
    # Ask only a person at a terminal; scripts (and --json) need --yes.
    ask = not (yes or dry_run or nothing or as_json) and _interactive()
    if ask:
        for line in _gc_lines(plan, "would remove", store):
            r.echo(line)
    go = not dry_run and (yes or (ask and confirm(f"remove {_files(plan)}?", yes=False)))
    if not go:
        if as_json:
            r.print_json({**plan.to_json(), "deleted": False})
            return
        if nothing:
            r.echo(f"{store.display_url}: nothing to remove")
            for line in _explain_lines(plan, store):
                r.echo(line)
        elif not ask:
            for line in _gc_lines(plan, "would remove", store):
                r.echo(line)
        if not (nothing or dry_run):
            click.echo("nothing removed: pass --yes to remove these files", err=True)
        return
    with r.progress("removing files", "files") as update:
        result = collect_garbage(store, dry_run=False, progress=update, **rule)
    if as_json:
        r.print_json({**result.to_json(), "deleted": True})
        return
    for line in _gc_lines(result, "removed", store):
        r.echo(line)


def _interactive() -> bool:
    import sys

    return sys.stdin.isatty() and sys.stdout.isatty()


def _files(plan: Any) -> str:
    return f"{r.count(len(plan.removed), 'file')} ({r.human_size(plan.bytes_freed)})"


@click.command("tag")
@click.argument("url")
@click.argument("name")
@click.argument("version", required=False)
@click.option("--force", is_flag=True, help="Move the tag if it names another version.")
@click.option("--delete", is_flag=True, help="Remove the tag NAME (the version stays).")
@json_option
@store_command
def tag_cmd(url, name: str, version, force: bool, delete: bool, as_json: bool, storage_options):
    """Name a version (default: the head), or remove a name with --delete. Tagged versions are
    never garbage-collected; `dynstate tags URL` lists the tags.

    \b
    Example:
      dynstate tag ./runs/run1 step-1000 42
      dynstate tag ./runs/run1 step-1000 --delete
    """
    if delete and (version is not None or force):
        raise click.UsageError("--delete takes only the tag NAME")
    store = open_store(url, storage_options)
    if delete:
        from ..errors import CorruptStoreError

        target: int | None
        try:
            target = store.resolve(name)  # a missing tag fails here, naming the store
        except CorruptStoreError:
            target = None  # a damaged tag: deleting it is how it is repaired
        store.untag(name)
        out = {"url": store.display_url, "tag": name, "version": target, "deleted": True}
        named = "damaged" if target is None else f"version {target}"
        text = f"removed tag {name} ({named}) from {store.display_url}"
    else:
        before = store.check_tags()[0].get(name)  # other tags' damage is not this command's
        store.tag(name, version_arg(version), force=force)
        target = store.resolve(name)
        out = {"url": store.display_url, "tag": name, "version": target, "deleted": False,
               "previous": before}  # fmt: skip
        if before == target:
            text = f"tag {name} already names version {target} of {store.display_url}"
        elif before is not None:
            text = f"moved tag {name} of {store.display_url} from version {before} to {target}"
        else:
            text = f"tagged version {target} of {store.display_url} as {name}"
    if as_json:
        r.print_json(out)
    else:
        r.echo(text)


def _content_of(store, version: int, limit: int = 1000) -> int | None:
    """The version whose content (rows, outcomes, generator state, step records) ``version``
    is by construction: following resets to their target and compactions to their parent
    (a compaction changes files, never content). None if a record cannot be read, or past
    ``limit`` such steps. Equal rows alone are not enough: a round of outcomes or of a
    generator state only adds no rows, and a reset must take it off the head."""
    from ..errors import DynstateError

    for _ in range(limit):
        try:
            record = store.commit_record(version)
        except DynstateError:
            return None  # a head record that cannot be read: the reset is the way out
        if record.op == "reset" and record.target is not None:
            version = record.target
        elif record.op == "compact" and record.parent is not None:
            version = record.parent
        else:
            return version
    return None


@click.command("reset")
@click.argument("url")
@click.argument("version")
@json_option
@store_command
def reset_cmd(url: str, version: str, as_json: bool, storage_options) -> None:
    """Make a past version's rows the head again, as a new version. The versions after it stay
    readable, listed as abandoned by `ls --all`, until gc collects them. If the head already
    has that version's content (they are the same version, or resets or compactions of one),
    nothing is committed.

    \b
    Example:
      dynstate reset ./runs/run1 40
    """
    store = open_store(url, storage_options)
    head = store.refresh()
    target = store.resolve(version_arg(version))
    content = _content_of(store, head)
    same = content is not None and content == _content_of(store, target)
    if same:
        out = {"url": store.display_url, "target": target, "head": head, "committed": None}
        text = (
            f"{store.display_url}: nothing to do, the head (version {head}) already has the "
            f"rows of version {target}; nothing committed"
        )
    else:
        new = store.reset(target)
        out = {"url": store.display_url, "target": target, "head": new, "committed": new}
        text = (
            f"reset {store.display_url} to version {target}: new head is version {new} "
            f"({r.count(store.commit_record(new).num_rows, 'row')}); "
            f"{_span(target + 1, new - 1)} {'is' if new - 1 == target + 1 else 'are'} "
            "abandoned until gc"
            if new - 1 > target
            else f"reset {store.display_url} to version {target}: new head is version {new}"
        )
    if as_json:
        r.print_json(out)
    else:
        r.echo(text)


@click.command("compact")
@click.argument("url")
@click.option("--target-size", type=Size(), help="Target shard size, e.g. 128MiB (default).")
@json_option
@store_command
def compact_cmd(url: str, target_size: int | None, as_json: bool, storage_options) -> None:
    """Merge small shards of the head into shards of about the target size, as a new version
    with the same rows in the same order. Old shards stay until gc.

    \b
    Example:
      dynstate compact s3://bucket/runs/run1 --target-size 256MiB
    """
    from ..maintenance.compact import compact

    store = open_store(url, storage_options)
    before = store.snapshot()
    kwargs: dict[str, Any] = {} if target_size is None else {"target_bytes": target_size}
    with r.progress("compacting shards", "shards read") as update:
        new = compact(store, progress=update, **kwargs)
    after = store.snapshot(new)
    out = {
        "url": store.display_url,
        "from": before.version,
        "version": new,
        "committed": new != before.version,
        "shards": [len(before.shards), len(after.shards)],
        "rows": after.num_rows,
    }
    if as_json:
        r.print_json(out)
    elif new == before.version:
        r.echo(f"{store.display_url}: nothing to compact at version {new}; nothing committed")
    else:
        r.echo(
            f"compacted {store.display_url}: version {new} has "
            f"{r.count(len(after.shards), 'shard')} (version {before.version} had "
            f"{len(before.shards):,}), same {r.count(after.num_rows, 'row')}"
        )


COMMANDS = [verify_cmd, gc_cmd, tag_cmd, reset_cmd, compact_cmd]
