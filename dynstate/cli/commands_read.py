"""Reading commands: ls, info, show, diff, tags (`head` is in commands_rows). Each opens
the store, calls one or two library functions and renders the result."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from . import render as r
from .commands_rows import _columns, _print_rows, _read_rows, head_cmd
from .options import Count, json_option, open_store, store_command, version_arg

if TYPE_CHECKING:
    from ..store import Store

DEFAULT_TERMINAL_LIMIT = 20
LINEAGE_LIMIT = 1000  # records `show` reads to describe a lineage: bounded, however long


def _op(row: dict[str, Any]) -> str:
    """A reset shows its target (``reset→12``) and, for a rollback to a training step, the
    step (``reset→12 (step 7)``); other ops as they are."""
    reset = row["op"] == "reset" and row.get("target") is not None
    if not reset:
        return row["op"]
    step = row.get("rollback_step")
    return f"reset→{row['target']}" + (f" (step {step})" if step is not None else "")


def _added(row: dict[str, Any]) -> str:
    """Rows a version added; a round that added none because its generator failed (an
    ``error`` in its meta) says so instead of 0."""
    if row.get("error") and not row["rows_added"]:
        return "failed"
    return f"{row['rows_added']:,}"


def _status(row: dict[str, Any]) -> str:
    """ "head", "abandoned" and the version's tags, in one column: ``head, tag best``."""
    return ", ".join([*([row["status"]] if row["status"] else []),
                      *(f"tag {t}" for t in row["tags"])])  # fmt: skip


def _meta(info: dict[str, Any]) -> dict[str, Any]:
    meta = info.get("meta")
    return meta if isinstance(meta, dict) else {}


def _rows_line(info: dict[str, Any]) -> str:
    error = _meta(info).get("error")
    if error and not info["rows_added"] and info["op"] == "append":
        why = " ".join(str(error).split())[:200]
        return f"{info['rows']:,} (none added: the round failed: {why})"
    return f"{info['rows']:,} ({info['rows_added']:+,} in this version)"


def _show_status(status: str | None) -> str:
    if status == "unknown":
        return f"not determined (more than {LINEAGE_LIMIT:,} versions below the head)"
    return status or "in the head's lineage"


def _tag_list(names: list[str], most: int = 4) -> str:
    more = len(names) - most
    return ", ".join(names[:most]) + (f" (+{more} more)" if more > 0 else "")


@click.command("ls")
@click.argument("url")
@click.option("--all", "show_all", is_flag=True, help="Also list abandoned versions.")
@click.option(
    "--limit",
    type=Count(0),
    help=f"Show the newest N versions (default on a terminal: {DEFAULT_TERMINAL_LIMIT}; "
    "piped: all). 0 shows all.",
)
@click.option("--reverse", is_flag=True, help="Oldest first.")
@json_option
@store_command
def ls_cmd(url, show_all: bool, limit: int | None, reverse: bool, as_json: bool, storage_options):
    """List a store's versions, newest first, under a summary of the store. Status is "head"
    for the head; with --all, versions a reset left behind are listed as "abandoned". Only
    the records shown are read, so a long history costs nothing extra.

    \b
    Example:
      dynstate ls ./runs/run1 --all --limit 50
    """
    if limit is None and sys.stdout.isatty():
        limit = DEFAULT_TERMINAL_LIMIT
    limit = limit or None
    store = open_store(url, storage_options)
    info, rows = _summary_and_rows(store, show_all, limit, reverse)
    if as_json:
        r.print_json(rows)
        return
    oldest_shown = min((row["version"] for row in rows), default=info["head"])
    older = oldest_shown - info["oldest"]  # kept versions below the ones shown
    hidden = 0 if show_all else (info["head"] - oldest_shown + 1) - len(rows)
    for line in _summary_lines(info):
        r.echo(line)
    r.echo()
    columns = [
        r.Column("version", right=True),
        r.Column("op"),
        r.Column("added", right=True),
        r.Column("rows", right=True),
        r.Column("shards", right=True, drop=1),
        r.Column("size", right=True, drop=2),
        r.Column("step", right=True, optional=True),
        r.Column("generator", flexible=True, optional=True, drop=3),
        r.Column("created (UTC)"),
        # Never cut: "abandoned" and tag names are what a reader looks for.
        r.Column("status", optional=True),
    ]
    cells = [
        [
            str(row["version"]),
            _op(row),
            _added(row),
            f"{row['total_rows']:,}",
            f"{row['shards']:,}",
            r.human_size(row["bytes"]),
            r.cell(row["step"]),
            r.cell(row["generator"]),
            r.utc(row["created"]),
            _status(row),
        ]
        for row in rows
    ]
    lines, dropped = r.fit_table(columns, cells, r.width())
    for line in lines:
        r.echo(line)
    notes = []
    if dropped:
        notes.append(f"{', '.join(dropped)} left out to fit {r.width()} columns: --json has all")
    if older > 0:
        notes.append(
            f"{r.count(older, 'older version')} not shown: --limit N shows more, --limit 0 all"
        )
    if hidden > 0:
        notes.append(f"{r.count(hidden, 'abandoned version')} hidden: --all shows them")
    for note in notes:
        r.echo(f"({note})")


def _summary_and_rows(
    store: Store, show_all: bool, limit: int | None, reverse: bool
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``ls``'s header and rows, from the head and floor that opening found (no second probe).
    The header's reads — the oldest kept version's record, then the tag listing, three
    requests one after another on S3 — need nothing from the rows' records, so they run on a
    thread while those are fetched. Where the floor is among the newest ``limit`` versions
    (or every version is listed) the walk reads it anyway, and the header then waits for the
    rows, so that no object is read twice. The rows get their tags once both are done."""
    from concurrent.futures import ThreadPoolExecutor

    from ..history import summary, version_rows

    def rows_with(tags: dict[str, int]) -> list[dict[str, Any]]:
        return version_rows(store, include_abandoned=show_all, limit=limit,
                            newest_first=not reverse, refresh=False, tags=tags)  # fmt: skip

    if limit is None or store.floor > store.head - limit:
        info = summary(store, refresh=False)
        return info, rows_with(info["tags"])
    with ThreadPoolExecutor(1, thread_name_prefix="dynstate-ls") as pool:
        header = pool.submit(summary, store, refresh=False)
        rows = rows_with({})
        info = header.result()
    # Records are read once per handle: labelling the rows with the tags reads nothing more.
    return info, rows_with(info["tags"]) if info["tags"] else rows


def _summary_lines(info: dict[str, Any]) -> list[str]:
    tags = list(info["tags"])
    return r.fields(
        [
            ("store", info["url"]),
            (
                "head",
                f"version {info['head']}: {r.count(info['rows'], 'row')}, "
                f"{r.count(info['shards'], 'shard')}, {r.human_size(info['bytes'])}",
            ),
            (
                "versions",
                f"{info['versions']:,} kept ({info['oldest']}-{info['head']})"
                + (f", tags: {_tag_list(tags)}" if tags else ", no tags"),
            ),
            (
                "commits",
                f"first {r.utc(info['first_commit'])} UTC, last {r.utc(info['last_commit'])} UTC",
            ),
        ]
    )


@click.command("info")
@click.argument("url")
@json_option
@store_command
def info_cmd(url: str, as_json: bool, storage_options) -> None:
    """Summarize a store: head, kept versions, rows, shards, size, tags, first and last
    commit. Reads a handful of objects, however long the history (the header of `ls`).

    \b
    Example:
      dynstate info s3://bucket/runs/run1 --json
    """
    from ..history import summary

    store = open_store(url, storage_options)
    info = summary(store, refresh=False)  # opening found the head
    if as_json:
        r.print_json(info)
        return
    for line in _summary_lines(info):
        r.echo(line)


@click.command("show")
@click.argument("url")
@click.argument("version", required=False)
@click.option("--max-shards", default=20, show_default=True, type=Count(0),
              help="Shards to list (--json lists all).")  # fmt: skip
@json_option
@store_command
def show_cmd(url, version, max_shards: int, as_json: bool, storage_options) -> None:
    """Show one version (default: the head): op, parent, reset target, created, status, rows,
    shards, size, tags, lineage, meta, schema and shard list.

    \b
    Example:
      dynstate show ./runs/run1 ckpt --json
    """
    from ..history import describe

    store = open_store(url, storage_options)
    info = describe(store, version_arg(version), lineage_limit=LINEAGE_LIMIT, refresh=False)
    if as_json:
        r.print_json(info)
        return
    pairs = [
        ("version", str(info["version"])),
        ("op", _op({**info, "rollback_step": _meta(info).get("rollback_step")})),
        ("parent", r.cell(info["parent"])),
        ("created", f"{r.utc(info['created'])} UTC"),
        ("status", _show_status(info["status"])),
        ("rows", _rows_line(info)),
        ("shards", f"{info['shards']:,}"),
        ("size", f"{r.human_size(info['bytes'])} ({info['bytes']:,} bytes)"),
        ("tags", ", ".join(info["tags"]) or "none"),
        ("lineage", info["lineage"]),
        ("meta", json.dumps(info["meta"], sort_keys=True, ensure_ascii=False)),
    ]
    for line in r.fields(pairs):
        r.echo(line.rstrip())
    r.echo()
    r.echo("schema:")
    schema_cells = [
        [c["name"], c["type"], "yes" if c["nullable"] else "no"] for c in info["schema"]
    ]
    schema_cols = [r.Column("column", flexible=True), r.Column("type", flexible=True)]
    for line in r.table([*schema_cols, r.Column("nullable")], schema_cells, r.width()):
        r.echo(f"  {line}")
    r.echo()
    r.echo("shards:")
    shard_list = info["shard_list"]
    shard_cells = [
        [str(i), s["path"], f"{s['rows']:,}", r.human_size(s["bytes"]), s["sha256"][:12]]
        for i, s in enumerate(shard_list[:max_shards])
    ]
    shard_cols = [
        r.Column("#", right=True),
        r.Column("path"),
        r.Column("rows", right=True),
        r.Column("size", right=True),
        r.Column("sha256"),
    ]
    for line in r.table(shard_cols, shard_cells, r.width()):
        r.echo(f"  {line}")
    if len(shard_list) > max_shards:
        r.echo(
            f"  ({len(shard_list) - max_shards:,} more shards: --max-shards N, --json lists all)"
        )


@click.command("diff")
@click.argument("url")
@click.argument("v1")
@click.argument("v2")
@click.option("--shards", "with_shards", is_flag=True, help="Also list shard files added/removed.")
@click.option("--rows", "with_rows", is_flag=True, help="Also show the rows V2 adds, as head does.")
@click.option("-n", "rows", default=10, show_default=True, type=Count(0),
              help="Added rows to show with --rows.")  # fmt: skip
@click.option("--columns", help="Comma-separated columns to show with --rows.")
@json_option
@store_command
def diff_cmd(url: str, v1: str, v2: str, with_shards: bool, with_rows: bool, rows: int,
             columns: str | None, as_json: bool, storage_options):  # fmt: skip
    """Compare two versions by rows and lineage: rows V2 adds and removes against V1, the rows
    both start with, and schema changes. A compaction or a reset to the same content changes
    no row. With --rows, the first N rows V2 adds, as `head` shows them (--json: under
    "added_preview", each with its row number).

    \b
    Example:
      dynstate diff ./runs/run1 ckpt head --rows -n 5
    """
    from ..history import diff, ranges

    store = open_store(url, storage_options)
    info = diff(store, version_arg(v1), version_arg(v2), shards=with_shards)
    preview: list[dict[str, Any]] = []
    numbers = range(0)
    wanted: list[str] = []
    if with_rows:
        snap = store.snapshot(info["to"])
        wanted = _columns(snap, columns, store.display_url)
        # V2's rows are the rows both start with, then the rounds only V2 carries.
        start = snap.num_rows - info["added_rows"]
        numbers = range(start, min(snap.num_rows, start + rows))
        preview = _read_rows(snap, numbers.start, numbers.stop, wanted)
        info["added_preview"] = [
            {"row": n, "values": row} for n, row in zip(numbers, preview, strict=True)
        ]
    if as_json:
        r.print_json(info)
        return
    a, b = info["from"], info["to"]
    (rows_a, rows_b), (shards_a, shards_b) = info["rows"], info["shards"]
    if info["same_rows"]:
        verdict = "same rows"
    elif info["extends"]:
        verdict = f"version {b} extends version {a}"
    else:
        verdict = f"version {b} does not contain all rows of version {a}"
    added_from = f" (versions {ranges(info['added_versions'])})" if info["added_versions"] else ""
    removed_from = (
        f" (versions {ranges(info['removed_versions'])})" if info["removed_versions"] else ""
    )
    common = info["common_version"]
    pairs = [
        ("rows", f"{rows_a:,} -> {rows_b:,}: {verdict}"),
        ("added", f"{r.count(info['added_rows'], 'row')}{added_from}"),
        ("removed", f"{r.count(info['removed_rows'], 'row')}{removed_from}"),
        (
            "shared",
            f"the first {r.count(info['shared_rows'], 'row')} (both lineages meet at "
            f"version {common})"
            if common is not None
            else "unknown: the lineages meet only below the gc floor",
        ),
        ("schema", info["schema_change"] or "unchanged"),
        ("shards", f"{shards_a:,} -> {shards_b:,}"),
    ]
    r.echo(f"{store.display_url}: version {a} -> {b}")
    for line in r.fields(pairs):
        r.echo(line)
    if with_shards:
        for s in info["shards_added"]:
            r.echo(f"+ {s['path']} ({r.count(s['rows'], 'row')})")
        for s in info["shards_removed"]:
            r.echo(f"- {s['path']} ({r.count(s['rows'], 'row')})")
    if with_rows:
        r.echo()
        if not preview:
            r.echo(f"version {b} adds no rows to version {a}")
            return
        shown = "" if len(preview) == info["added_rows"] else f"the first {len(preview):,} of "
        r.echo(f"rows version {b} adds ({shown}{r.count(info['added_rows'], 'row')}):")
        _print_rows(preview, numbers, wanted)


@click.command("tags")
@click.argument("url")
@json_option
@store_command
def tags_cmd(url: str, as_json: bool, storage_options) -> None:
    """List the tags of a store and the versions they name (gc keeps tagged versions).

    \b
    Example:
      dynstate tags ./runs/run1
    """
    store = open_store(url, storage_options)
    tags = sorted(store.tags().items(), key=lambda kv: (kv[1], kv[0]))
    store.commit_records(v for _, v in tags)  # read together, not one round trip per tag
    out: list[dict[str, Any]] = []
    for name, version in tags:
        record = store.commit_record(version)
        out.append(
            {
                "name": name,
                "version": version,
                "op": record.op,
                "rows": record.num_rows,
                "step": record.meta.get("step"),
                "created": record.created,
            }
        )
    if as_json:
        r.print_json(out)
        return
    if not out:
        r.echo(f"{store.display_url}: no tags (dynstate tag URL NAME VERSION adds one)")
        return
    cols = [
        r.Column("tag", flexible=True),
        r.Column("version", right=True),
        r.Column("op"),
        r.Column("rows", right=True),
        r.Column("step", right=True),
        r.Column("created (UTC)"),
    ]
    cells = [
        [
            t["name"],
            str(t["version"]),
            t["op"],
            f"{t['rows']:,}",
            r.cell(t["step"]),
            r.utc(t["created"]),
        ]
        for t in out
    ]
    for line in r.table(cols, cells, r.width()):
        r.echo(line)


COMMANDS = [ls_cmd, info_cmd, show_cmd, head_cmd, diff_cmd, tags_cmd]
