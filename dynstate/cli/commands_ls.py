"""Listing commands: ls (a store's versions under its summary) and info (the summary
alone). Each opens the store, calls one or two library functions and renders the result."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from . import render as r
from .commands_read import _op
from .options import Count, json_option, open_store, store_command

if TYPE_CHECKING:
    from ..store import Store

DEFAULT_TERMINAL_LIMIT = 20


def _added(row: dict[str, Any]) -> str:
    """Rows a version added; a round that added none because its generator failed (an
    ``error`` in its meta) says so instead of 0."""
    if row.get("error") and not row["rows_added"]:
        return "failed"
    return f"{row['rows_added']:,}"


def _ls_op(row: dict[str, Any], store: Store) -> str:
    """The op column: a round that added no rows says what it was instead of ``append`` with
    0 added: ``outcomes`` when it recorded outcomes only (a step that generated nothing but
    was scored), ``empty`` when it recorded nothing but its step."""
    if row["op"] != "append" or row["rows_added"] or row.get("error"):
        return _op(row)
    # Read already: version_rows fetched the records shown, and the log keeps them.
    return "outcomes" if store.commit_record(row["version"]).outcomes else "empty"


def _status(row: dict[str, Any]) -> str:
    """ "head", "abandoned" and the version's tags, in one column: ``head, tag best``."""
    return ", ".join([*([row["status"]] if row["status"] else []),
                      *(f"tag {t}" for t in row["tags"])])  # fmt: skip


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
    for the head; with --all, versions a reset left behind are listed as "abandoned". A round
    that added no rows shows op "outcomes" (it recorded outcomes only) or "empty". Only the
    records shown are read, so a long history costs nothing extra.

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
            _ls_op(row, store),
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


COMMANDS = [ls_cmd, info_cmd]
