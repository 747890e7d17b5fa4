"""Reading commands about one version and the tags: show, diff, tags (`head` is in
commands_rows, the listing — ls, info — in commands_ls). Each opens the store, calls one or
two library functions and renders the result."""

from __future__ import annotations

from typing import Any

import click

from ..records.codec import dumps
from . import render as r
from .commands_rows import _columns, _print_rows, _read_rows, head_cmd
from .options import Count, json_option, open_store, store_command, version_arg

LINEAGE_LIMIT = 1000  # records `show` reads to describe a lineage: bounded, however long
STATE_CHARS = 200  # of a generator state's JSON, on one line of `show`


def _op(row: dict[str, Any]) -> str:
    """A reset shows its target (``reset→12``) and, for a rollback to a training step, the
    step (``reset→12 (step 7)``); other ops as they are."""
    reset = row["op"] == "reset" and row.get("target") is not None
    if not reset:
        return row["op"]
    step = row.get("rollback_step")
    return f"reset→{row['target']}" + (f" (step {step})" if step is not None else "")


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


@click.command("show")
@click.argument("url")
@click.argument("version", required=False)
@click.option("--max-shards", default=20, show_default=True, type=Count(0),
              help="Shards to list (--json lists all).")  # fmt: skip
@click.option("--drawn", default=20, show_default=True, type=Count(0),
              help="Rows of the step's outcomes to list, and entries of each consumption "
              "list (--json too).")  # fmt: skip
@json_option
@store_command
def show_cmd(url, version, max_shards: int, drawn: int, as_json: bool, storage_options) -> None:
    """Show one version (default: the head): op, parent, reset target, created, status, rows,
    shards, size, tags, lineage, meta, schema and shard list; then the story of its step
    (--json: under "step_story"): the outcomes the round committed (records, pass rate, the
    rows drawn with their scores), the generator state it committed, and what the step drew,
    trained, filtered and carried, with the selection policy, where the round recorded it.

    \b
    Example:
      dynstate show ./runs/run1 ckpt --json
    """
    from ..history import describe
    from ..history.story import step_story

    store = open_store(url, storage_options)
    info = describe(store, version_arg(version), lineage_limit=LINEAGE_LIMIT, refresh=False)
    info["step_story"] = step_story(store, info["version"], rows=drawn)
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
        ("meta", dumps(info["meta"], sort_keys=True, ensure_ascii=False)),
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
    r.echo()
    _print_story(info["step_story"])


def _rate(value: float) -> str:
    return f"{value:.0%}"


def _spread(spread: dict[str, Any]) -> str:
    """The policy's weights over the version's rows, in one line."""
    if "error" in spread:
        return f"not computed: {spread['error']}"
    return (
        f"{spread['eligible']:,} of {r.count(spread['rows'], 'row')} drawable; effective rows "
        f"{spread['effective_rows']:,.1f}; a row's share of a step from {spread['min_share']:.3g} "
        f"to {spread['max_share']:.3g} (by this version's statistics)"
    )


def _print_story(story: dict[str, Any]) -> None:
    """The step's story under ``show``'s version: its outcomes and their rows, the generator
    state, and the consumption record with the policy."""
    step, out = story["step"], story["outcomes"]
    r.echo(f"step: {'none (not a round of a training step)' if step is None else step}")
    pairs: list[tuple[str, str]] = []
    if out is None:
        pairs.append(("outcomes", "none committed in this version"))
    else:
        from ..history import ranges

        steps = f"step{'' if len(out['steps']) == 1 else 's'} {ranges(out['steps'])}"
        pairs += [
            (
                "outcomes",
                f"{r.count(out['records'], 'record')} of {r.count(out['rows'], 'row')} ({steps})",
            ),
            (
                "pass rate",
                f"{_rate(out['pass_rate'])} ({out['successes']:,} of "
                f"{out['records']:,} scores above {out['success_above']:g}); mean score "
                f"{out['mean_score']:.3g}",
            ),
        ]
    state = story["generator_state"]
    text = dumps(state, sort_keys=True, ensure_ascii=False)
    if len(text) > STATE_CHARS:
        text = f"{text[:STATE_CHARS]}… ({len(text):,} characters: --json shows it whole)"
    pairs.append(("generator", "no state committed" if state is None else text))
    used = story["consumption"]
    if used is not None:
        names = ("drawn", "trained", "filtered", "dropped", "carried_in", "carry", "in_flight")
        counts = [f"{name.replace('_', ' ')} {used[name]['count']:,}" for name in names]
        pairs.append(("consumed", ", ".join(counts)))
        for name, what in (("filtered", "spread"), ("dropped", "reason")):
            listed = used[name]
            if listed["count"]:
                text = ", ".join(
                    f"row {row} ({what} {value:g})" if what == "spread" else f"row {row} ({value})"
                    for row, value in listed["rows"]
                )
                more = f", {listed['more']:,} more" if listed["more"] else ""
                pairs.append((name, text + more))
    policy = story["policy"]
    if policy is not None:
        params = dumps(policy.get("params"), sort_keys=True, ensure_ascii=False)
        pairs.append(("policy", f"{policy.get('policy')} {params}"))
        pairs.append(("weights", _spread(story["weights"])))
    for line in r.fields(pairs):
        r.echo(f"  {line.rstrip()}")
    if out is None or not out["drawn"]:
        return
    r.echo()
    r.echo(f"rows scored ({len(out['drawn']):,} of {out['rows']:,}, in the order scored):")
    cols = [
        r.Column("row", right=True),
        r.Column("attempts", right=True),
        r.Column("successes", right=True),
        r.Column("pass rate", right=True),
        r.Column("scores", flexible=True),
    ]
    cells = [
        [
            str(d["row"]),
            f"{d['attempts']:,}",
            f"{d['successes']:,}",
            _rate(d["pass_rate"]),
            " ".join(f"{x:.3g}" for x in d["scores"])
            + (" …" if d["attempts"] > len(d["scores"]) else ""),
        ]
        for d in out["drawn"]
    ]
    for line in r.table(cols, cells, r.width()):
        r.echo(f"  {line}")
    if out["drawn_more"]:
        r.echo(f"  ({r.count(out['drawn_more'], 'more row')}: --drawn N lists more)")


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
    from ..history import diff

    if columns is not None and not with_rows:
        raise click.UsageError("--columns chooses the columns --rows shows; add --rows")
    source = click.get_current_context().get_parameter_source("rows")
    if source is click.core.ParameterSource.COMMANDLINE and not with_rows:
        raise click.UsageError("-n counts the rows --rows shows; add --rows")
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
        info["added_preview"] = [  # strict JSON, as head --json gives the rows
            {"row": n, "values": r.json_row(row)} for n, row in zip(numbers, preview, strict=True)
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
    added_from = f" ({r.versions_text(info['added_versions'])})" if info["added_versions"] else ""
    removed_from = (
        f" ({r.versions_text(info['removed_versions'])})" if info["removed_versions"] else ""
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
    from ..history import readable_tags

    tags = sorted(readable_tags(store).items(), key=lambda kv: (kv[1], kv[0]))
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


COMMANDS = [show_cmd, head_cmd, diff_cmd, tags_cmd]
