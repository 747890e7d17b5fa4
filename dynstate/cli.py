"""`dynstate`: inspect and maintain stores offline. Each command opens the store, calls one or
two library functions and renders the result — human tables by default, ``--json`` for scripts.
Errors from the library are reported in one place (:class:`_Group`) as ``error: <message>``."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .errors import DynstateError
from .export import export
from .gc import DEFAULT_GRACE_S, collect_garbage, parse_duration
from .history import describe, diff, version_rows
from .store import Store

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


class CliError(click.ClickException):
    """A failure outside the store (an output file that exists, a bad argument value)."""

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.message}", err=True)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DynstateError as exc:
            click.echo(f"error: {_scrub(str(exc))}", err=True)
            ctx.exit(1)


_USERINFO = re.compile(r"[^\s/@'\"]+:[^\s/@'\"]+@")


def _scrub(message: str) -> str:
    """Credentials written into a URL (``s3://key:secret@bucket``) may come back inside a
    backend's own error text; never print them."""
    return _USERINFO.sub("***@", message)


def store_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Options every command shares; the command receives ``storage_options`` as a dict."""

    @functools.wraps(fn)
    def wrapper(*args: Any, storage_option: tuple[str, ...], **kwargs: Any) -> Any:
        return fn(*args, storage_options=_parse_storage_options(storage_option), **kwargs)

    return click.option(
        "--storage-option",
        "storage_option",
        multiple=True,
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable); VALUE is parsed as JSON where it can be. "
        "Endpoint and credentials otherwise come from the standard AWS environment.",
    )(wrapper)


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def _parse_storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(
                f"expected KEY=VALUE, got {pair!r}", param_hint="--storage-option"
            )
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _open(url: str, storage_options: dict[str, Any]) -> Store:
    return Store.open(url, storage_options=storage_options)


def _console() -> Console:
    # Piped output is for reading later, not for an 80-column default: keep rows whole.
    piped = not click.get_text_stream("stdout").isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, soft_wrap=False, width=200 if piped else None)


def _print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str, ensure_ascii=False))


@contextmanager
def _progress(description: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr (stdout stays clean for --json); ``update(done, total)``."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    console = Console(stderr=True)
    with Progress(
        *columns,
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task(description, total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total)


def _version(value: str | None) -> int | str | None:
    return None if value in (None, "head") else value


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="Log more (repeat for debug).")
@click.version_option(package_name="dynstate")
def cli(verbose: int) -> None:
    """Inspect and maintain dynstate stores: versioned Parquet shards on local disk or S3.

    Exit codes: 0 success, 1 a failed command or a problem found (error on stderr),
    2 a usage error.

    \b
    Example:
      dynstate ls s3://bucket/runs/run1
    """
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("dynstate").setLevel(level)


# -- listing ---------------------------------------------------------------------------------


@cli.command("ls")
@click.argument("url")
@click.option("--all", "show_all", is_flag=True, help="Also list abandoned versions.")
@click.option("--limit", type=click.IntRange(min=1), help="Only the newest N versions.")
@json_option
@store_command
def ls_cmd(url: str, show_all: bool, limit: int | None, as_json: bool, storage_options) -> None:
    """List a store's versions, oldest first. Status is "head" for the head; with --all,
    versions a reset left behind are listed as "abandoned".

    \b
    Example:
      dynstate ls ./runs/run1 --all --limit 20
    """
    store = _open(url, storage_options)
    rows = version_rows(store, include_abandoned=show_all, limit=limit)
    head = store.head
    if as_json:
        _print_json(rows)
        return
    console = _console()
    console.print(f"{store.display_url}  head {head}  ({len(rows)} versions shown)", markup=False)
    table = Table(box=box.SIMPLE_HEAD)
    headers = ["version", "op", "rows added", "total rows", "shards", "bytes", "step"]
    for header in [*headers, "generator", "created", "tags", "status"]:
        numeric = header in headers and header not in ("op", "step")
        table.add_column(header, justify="right" if numeric else "left")
    for row in rows:
        table.add_row(
            *(str(row[k]) for k in ("version", "op", "rows_added", "total_rows", "shards")),
            *(_cell(row[k]) for k in ("bytes", "step", "generator")),
            row["created"][:19].replace("T", " "),
            ",".join(row["tags"]),
            row["status"] or "",
        )
    console.print(table)


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


@cli.command("show")
@click.argument("url")
@click.argument("version", required=False)
@click.option("--max-shards", default=20, show_default=True, help="Shards listed in the table.")
@json_option
@store_command
def show_cmd(
    url: str, version: str | None, max_shards: int, as_json: bool, storage_options
) -> None:
    """Show one version's record (default: the head): schema, shards, meta and lineage.
    VERSION is a number or a tag.

    \b
    Example:
      dynstate show s3://bucket/runs/run1 12
    """
    store = _open(url, storage_options)
    info = describe(store, _version(version))
    if as_json:
        _print_json(info)
        return
    console = _console()
    fields = ["version", "op", "parent", "target", "created", "status"]
    for key in [*fields, "rows", "rows_added", "shards", "bytes", "tags", "lineage"]:
        value = info[key]
        if value is not None and value != []:
            text = ", ".join(value) if key == "tags" else str(value)
            console.print(f"{key + ':':<12}{text}", markup=False)
    console.print(f"{'meta:':<12}{json.dumps(info['meta'], sort_keys=True)}", markup=False)
    schema = Table("column", "type", "nullable", box=box.SIMPLE_HEAD, title="schema")
    for col in info["schema"]:
        schema.add_row(col["name"], col["type"], "yes" if col["nullable"] else "no")
    console.print(schema)
    shards = Table("#", "path", "rows", "bytes", "sha256", box=box.SIMPLE_HEAD, title="shards")
    for i, shard in enumerate(info["shard_list"][:max_shards]):
        shards.add_row(
            str(i), shard["path"], str(shard["rows"]), str(shard["bytes"]), shard["sha256"][:12]
        )
    console.print(shards)
    if len(info["shard_list"]) > max_shards:
        console.print(
            f"... and {len(info['shard_list']) - max_shards} more shards (--json lists all)"
        )


@cli.command("head")
@click.argument("url")
@click.argument("version", required=False)
@click.option("-n", "rows", default=10, show_default=True, type=click.IntRange(min=0))
@click.option("--columns", help="Comma-separated columns to show.")
@click.option("--jsonl", is_flag=True, help="One JSON object per row.")
@store_command
def head_cmd(url, version, rows: int, columns: str | None, jsonl: bool, storage_options) -> None:
    """Print the first N rows of a version (default: the head).

    \b
    Example:
      dynstate head ./runs/run1 7 -n 5 --columns prompt,answer --jsonl
    """
    store = _open(url, storage_options)
    snap = store.snapshot(_version(version))
    names = [f.name for f in snap.schema or []]
    wanted = [c.strip() for c in columns.split(",") if c.strip()] if columns else names
    unknown = [c for c in wanted if c not in names]
    if unknown:
        raise click.BadParameter(
            f"no column {', '.join(unknown)} in version {snap.version} of {store.display_url}; "
            f"columns: {', '.join(names)}",
            param_hint="--columns",
        )
    out: list[dict[str, Any]] = []
    for i in range(len(snap.shards)):
        if len(out) >= rows:
            break
        table = snap.read_shard(i).select(wanted)
        out.extend(table.slice(0, rows - len(out)).to_pylist())
    if jsonl:
        for row in out:
            click.echo(json.dumps(row, default=str, ensure_ascii=False))
        return
    table = Table(*wanted, box=box.SIMPLE_HEAD)
    for row in out:
        table.add_row(*(_cell(row[c]) for c in wanted))
    _console().print(table)


@cli.command("diff")
@click.argument("url")
@click.argument("v1")
@click.argument("v2")
@json_option
@store_command
def diff_cmd(url: str, v1: str, v2: str, as_json: bool, storage_options) -> None:
    """Compare two versions: rows, shards added and removed, schema changes, and how many
    leading rows they share.

    \b
    Example:
      dynstate diff ./runs/run1 3 head
    """
    store = _open(url, storage_options)
    info = diff(store, _version(v1), _version(v2))
    if as_json:
        _print_json(info)
        return
    (a, b), (ra, rb), (sa, sb) = (info["from"], info["to"]), info["rows"], info["shards"]
    lines = [
        f"{store.display_url}: version {a} -> {b}",
        f"rows:   {ra} -> {rb} ({rb - ra:+d})",
        f"shards: {sa} -> {sb} (+{len(info['added'])} added, -{len(info['removed'])} removed)",
        f"shared leading rows: {info['shared_prefix_rows']}"
        + (f" (version {b} extends version {a})" if info["extends"] else ""),
        f"schema: {info['schema_change'] or 'unchanged'}",
    ]
    lines += [f"+ {s['path']} ({s['rows']} rows)" for s in info["added"]]
    lines += [f"- {s['path']} ({s['rows']} rows)" for s in info["removed"]]
    for line in lines:
        click.echo(line)


# -- checking and upkeep ---------------------------------------------------------------------


@cli.command("verify")
@click.argument("url")
@click.option("--all", "all_versions", is_flag=True, help="Check the shards of every kept version.")
@json_option
@store_command
def verify_cmd(url: str, all_versions: bool, as_json: bool, storage_options) -> None:
    """Check every commit record, schema, checkpoint and chunk, and the checksum of every shard
    of the head (all kept versions with --all). Exits 1 naming every problem found.

    \b
    Example:
      dynstate verify s3://bucket/runs/run1 --all
    """
    from .verify import verify_store

    store = _open(url, storage_options)
    with _progress("verifying shards") as update:
        report = verify_store(store, all_versions=all_versions, progress=update)
    if as_json:
        _print_json(report.to_json())
    else:
        for problem in report.problems:
            click.echo(f"problem: {problem}")
        if report.ok:
            click.echo(
                f"ok: {store.display_url}: {len(report.versions_checked)} versions, "
                f"{report.shards_checked} shards, {report.bytes_checked} bytes verified"
            )
    if not report.ok:
        raise CliError(f"{len(report.problems)} problem(s) in {store.display_url}")


@cli.command("gc")
@click.argument("url")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option("--keep", type=click.IntRange(min=1), help="Keep the newest N versions.")
@click.option("--older-than", help="Collect versions older than this (e.g. 7d, 12h).")
@click.option("--grace", default="1h", show_default=True, help="Leave orphans younger than this.")
@json_option
@store_command
def gc_cmd(url, dry_run: bool, keep, older_than, grace: str, as_json: bool, storage_options):
    """Remove files no kept version refers to (left by killed writers) once older than the
    grace period, and with --keep or --older-than the versions beyond that rule. The head,
    tagged versions and every file a kept version needs are never removed.

    \b
    Example:
      dynstate gc s3://bucket/runs/run1 --keep 50 --dry-run
    """
    if keep is not None and older_than is not None:
        raise click.UsageError("give either --keep or --older-than, not both")
    older_s = parse_duration(older_than) if older_than is not None else None
    grace_s = parse_duration(grace) if grace is not None else DEFAULT_GRACE_S
    store = _open(url, storage_options)
    with _progress("removing files") as update:
        result = collect_garbage(
            store,
            keep=keep,
            older_than_s=older_s,
            grace_s=grace_s,
            dry_run=dry_run,
            progress=update,
        )
    if as_json:
        _print_json(result.to_json())
        return
    verb = "would remove" if dry_run else "removed"
    for removal in result.removed[:50]:
        click.echo(f"{verb} {removal.path} ({removal.reason}, {removal.bytes} bytes)")
    if len(result.removed) > 50:
        click.echo(f"... and {len(result.removed) - 50} more (--json lists all)")
    collected = result.versions_collected
    span = f"versions {collected[0]}-{collected[-1]}" if collected else "no versions"
    click.echo(
        f"{store.display_url}: {verb} {len(result.removed)} files ({result.bytes_freed} bytes), "
        f"{span} collected; {result.kept_young} orphans younger than the grace period kept"
    )


@cli.command("tag")
@click.argument("url")
@click.argument("name")
@click.argument("version")
@click.option("--force", is_flag=True, help="Move the tag if it names another version.")
@store_command
def tag_cmd(url: str, name: str, version: str, force: bool, storage_options) -> None:
    """Name a version. Tagged versions are never garbage-collected.

    \b
    Example:
      dynstate tag ./runs/run1 step-1000 42
    """
    store = _open(url, storage_options)
    store.tag(name, _version(version), force=force)
    click.echo(f"tagged version {store.resolve(name)} of {store.display_url} as {name}")


@cli.command("reset")
@click.argument("url")
@click.argument("version")
@store_command
def reset_cmd(url: str, version: str, storage_options) -> None:
    """Make a past version's content the head again, as a new version. The versions after it
    stay readable, listed as abandoned by `ls --all`, until gc collects them.

    \b
    Example:
      dynstate reset ./runs/run1 40
    """
    store = _open(url, storage_options)
    target = store.resolve(_version(version))
    new = store.reset(target)
    click.echo(f"reset {store.display_url} to version {target}: new head is version {new}")


@cli.command("compact")
@click.argument("url")
@click.option("--target-size", help="Target shard size, e.g. 128MiB (default 128MiB).")
@store_command
def compact_cmd(url: str, target_size: str | None, storage_options) -> None:
    """Merge small shards of the head into target-size shards, as a new version with the same
    rows in the same order. Old shards stay until gc.

    \b
    Example:
      dynstate compact s3://bucket/runs/run1 --target-size 256MiB
    """
    from .compact import compact

    store = _open(url, storage_options)
    before = store.snapshot()
    kwargs = {} if target_size is None else {"target_bytes": parse_size(target_size)}
    new = compact(store, **kwargs)
    if new == before.version:
        click.echo(f"{store.display_url}: nothing to compact at version {new}")
        return
    after = store.snapshot(new)
    click.echo(
        f"compacted {store.display_url}: version {new} has {len(after.shards)} shards "
        f"(version {before.version} had {len(before.shards)}), {after.num_rows} rows"
    )


def parse_size(text: str) -> int:
    """Bytes in ``"1000"``, ``"64MB"`` (10^6) or ``"64MiB"`` (2^20)."""
    match = _SIZE.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise CliError(f"cannot read size {text!r}; write e.g. 128MiB, 100MB or 1048576")
    power = " kmgt".index(match.group(2).lower() or " ")
    return int(float(match.group(1)) * (1024 if match.group(3) else 1000) ** power)


# -- output ----------------------------------------------------------------------------------


@cli.command("export")
@click.argument("url")
@click.argument("args", nargs=-1, required=True, metavar="[VERSION] OUT")
@click.option("--format", "fmt", type=click.Choice(["parquet", "datasets"]), default="parquet")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@store_command
def export_cmd(url: str, args: tuple[str, ...], fmt: str, overwrite: bool, storage_options):
    """Write a version's rows (default: the head), in order, to one Parquet file or to a
    Hugging Face `datasets` directory (load it with datasets.load_from_disk).

    \b
    Example:
      dynstate export s3://bucket/runs/run1 42 rows.parquet
    """
    if len(args) > 2:
        raise click.UsageError("expected URL [VERSION] OUT")
    version, out = (None, args[0]) if len(args) == 1 else args
    store = _open(url, storage_options)
    snap = store.snapshot(_version(version))
    with _progress("exporting shards") as update:
        export(snap, out, fmt=fmt, overwrite=overwrite, progress=update)
    click.echo(
        f"exported version {snap.version} of {store.display_url} ({snap.num_rows} rows) to {out}"
    )


@cli.command("plot")
@click.argument("url")
@click.argument("out", type=click.Path(dir_okay=False))
@store_command
def plot_cmd(url: str, out: str, storage_options) -> None:
    """Plot rows added per round and total rows over training steps (the head's lineage) to a
    PNG. Needs matplotlib (pip install 'dynstate[plot]').

    \b
    Example:
      dynstate plot ./runs/run1 growth.png
    """
    from .plot import plot_growth

    store = _open(url, storage_options)
    points = plot_growth(store, out)
    click.echo(f"wrote {out} ({points} versions of {store.display_url})")


@cli.command("inspect")
@click.argument("path")
@click.option("--store", "store_url", help="Store URL, if not the one recorded in the state.")
@click.option("-n", "rows", type=int, help="Rows of the next batch to show (default: batch size).")
@json_option
@store_command
def inspect_cmd(
    path: str, store_url: str | None, rows: int | None, as_json: bool, storage_options
) -> None:
    """Show what a checkpoint refers to: store URL and id, version, epoch, position, and the
    rows the next step sees. PATH is a verl global_step_N directory or a data.pt file.

    \b
    Example:
      dynstate inspect checkpoints/global_step_40
    """
    from .checkpoint import describe_checkpoint

    info = describe_checkpoint(
        path, store_url=store_url, storage_options=storage_options, rows=rows
    )
    if as_json:
        _print_json(info)
        return
    console = _console()
    for key in (
        "checkpoint",
        "store_url",
        "store_id",
        "head",
        "mode",
        "seed",
        "epoch",
        "version",
        "base_rows",
        "position",
        "step",
    ):
        console.print(f"{key + ':':<12}{info[key]}", markup=False)
    console.print(
        f"next batch: epoch {info['next_epoch']}, version {info['next_version']}, "
        f"rows {info['next_indices']}",
        markup=False,
    )
    if "next_error" in info:
        console.print(f"note: {info['next_error']}", markup=False)
    if info["next_rows"]:
        columns = list(info["next_rows"][0])
        table = Table("row", *columns, box=box.SIMPLE_HEAD)
        for index, row in zip(info["next_indices"], info["next_rows"], strict=True):
            table.add_row(str(index), *(str(row[c])[:60] for c in columns))
        console.print(table)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="dynstate")


@cli.command("demo")
@click.option("--dir", "out_dir", default="demo-out", show_default=True, help="Output directory.")
@click.option("--s3", is_flag=True, help="Use a loopback S3 server (needs dynstate[test]).")
@click.option("--steps", default=60, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=0))
@click.option("--mode", default="epoch", show_default=True, type=click.Choice(["epoch", "mix"]))
@click.option("--step-time", default=0.4, show_default=True, help="Simulated seconds per step.")
def demo_cmd(out_dir: str, s3: bool, steps: int, seed: int, workers: int, mode, step_time):
    """Run a dynamic-datagen training run, SIGKILL it, resume it from its last checkpoint and
    check that it continues exactly as an uninterrupted run; then list the store and plot it.

    \b
    Example:
      dynstate demo --dir demo-out --steps 40
    """
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig(steps=steps, seed=seed, workers=workers, mode=mode, step_time=step_time)
    try:
        ok = run_demo(out_dir, s3=s3, cfg=cfg)
    except RuntimeError as exc:  # a training process failed: its log tail is in the message
        raise CliError(str(exc)) from exc
    if not ok:
        raise SystemExit(1)
