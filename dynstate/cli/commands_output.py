"""Commands that write or look outside the store: export, plot, inspect, and serve (the web
viewer, an optional extra)."""

from __future__ import annotations

import os
from typing import Any

import click

from . import render as r
from .errors import Failure
from .options import (
    Count,
    cli_storage_options,
    confirm,
    json_option,
    open_store,
    store_command,
    version_arg,
    yes_option,
)


def _consent_to_replace(
    out: str, replaced: str | None, overwrite: bool, yes: bool, as_json: bool
) -> None:
    """docs/cli.md's rule for an existing OUT, shared by every command that writes one: refused
    without --overwrite; with it, what is replaced is shown and replaced only with --yes (or a
    yes typed on a terminal)."""
    from ..errors import StoreExistsError

    if replaced is None:
        return
    if not overwrite:
        raise StoreExistsError(
            f"{out} exists; choose another path or pass --overwrite to replace it"
        )
    click.echo(r.clean(f"would replace {out} ({replaced})"), err=as_json)
    if not confirm(f"replace {out}?", yes):
        raise Failure(f"{out} not replaced: pass --yes (with --overwrite) to replace it")


@click.command("export")
@click.argument("url")
@click.argument("args", nargs=-1, required=True, metavar="[VERSION] OUT")
@click.option("--format", "fmt", type=click.Choice(["parquet", "datasets"]), default="parquet",
              show_default=True,
              help="One Parquet file, or a Hugging Face datasets directory.")  # fmt: skip
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace OUT if it exists (a file or a datasets export; shown first, done with --yes).",
)
@yes_option
@json_option
@store_command
def export_cmd(
    url: str,
    args: tuple[str, ...],
    fmt: str,
    overwrite: bool,
    yes: bool,
    as_json: bool,
    storage_options: dict[str, Any],
) -> None:
    """Write a version's rows (default: the head), in order, to one Parquet file or to a
    Hugging Face `datasets` directory (load it with datasets.load_from_disk). OUT is a path or
    any fsspec URL (s3://bucket/rows.parquet); --storage-option applies to it too. OUT appears
    only when complete, and is never the store or inside or around it. Replacing an existing
    OUT needs --overwrite, and like every deleting command shows what it replaces and does it
    only with --yes (or a yes typed on a terminal).

    \b
    Example:
      dynstate export s3://bucket/runs/run1 42 s3://bucket/exports/rows.parquet
    """
    from ..maintenance.export import export, replace_plan

    if len(args) > 2:
        raise click.UsageError("expected URL [VERSION] OUT")
    version, out = (None, args[0]) if len(args) == 1 else args
    store = open_store(url, storage_options)
    snap = store.snapshot(version_arg(version))
    out_options = cli_storage_options(out, storage_options)
    # Checked before anything is written: an OUT overlapping the store is refused, and an
    # existing OUT is replaced only after its plan is shown and confirmed.
    replaced = replace_plan(snap, out, storage_options=out_options)
    _consent_to_replace(out, replaced, overwrite, yes, as_json)
    with r.progress("exporting", "shards") as update:
        export(
            snap,
            out,
            fmt=fmt,
            overwrite=overwrite,
            progress=update,
            storage_options=out_options,
        )
    info = {"url": store.display_url, "version": snap.version, "rows": snap.num_rows,
            "shards": len(snap.shards), "out": out, "format": fmt,
            "replaced": replaced}  # fmt: skip
    if as_json:
        r.print_json(info)
    else:
        r.echo(
            f"exported version {snap.version} of {store.display_url} "
            f"({r.count(snap.num_rows, 'row')}) to {out}"
            + (f", replacing {replaced}" if replaced else "")
        )


@click.command("plot")
@click.argument("url")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace OUT if it exists (shown first, done with --yes).",
)
@yes_option
@json_option
@store_command
def plot_cmd(
    url: str, out: str, overwrite: bool, yes: bool, as_json: bool, storage_options
) -> None:
    """Plot rows added per round and total rows over training steps (the head's lineage) to a
    PNG, marking resets, rollbacks (with the checkpoint the run resumed from) and compactions.
    Needs matplotlib (pip install 'dynstate[plot]'). OUT is never the store or inside it;
    replacing an existing OUT needs --overwrite and, as for export, --yes (or a yes typed on a
    terminal).

    \b
    Example:
      dynstate plot ./runs/run1 growth.png
    """
    from ..maintenance.export import output_plan
    from ..maintenance.plot import growth_points, plot_growth

    store = open_store(url, storage_options)
    _consent_to_replace(out, output_plan(store, out, action="plot to"), overwrite, yes, as_json)
    count = plot_growth(store, out, overwrite=overwrite)
    if as_json:
        label, points = growth_points(store)
        r.print_json({"url": store.display_url, "out": out, "x": label, "points": points})
    else:
        events = [p for p in growth_points(store)[1] if p["event"]]
        marked = f"; marked: {', '.join(p['label'] for p in events)}" if events else ""
        r.echo(f"wrote {out} ({r.count(count, 'version')} of {store.display_url}{marked})")


@click.command("inspect")
@click.argument("path")
@click.option("--store", "store_url", help="Store URL, if not the one recorded in the state.")
@click.option(
    "--open-store",
    is_flag=True,
    help="Open the store the checkpoint records even when it is not on this machine (s3://, "
    "http(s)://, any remote fsspec URL).",
)
@click.option("-n", "rows", type=Count(1), help="Rows of the next batch to show.")
@json_option
@store_command
def inspect_cmd(
    path: str, store_url, open_store: bool, rows: int | None, as_json: bool, storage_options
) -> None:
    """Show what a checkpoint refers to: its training step, the store and its head, the
    sampler's own counters (epoch, position, pinned version) and the rows the next step sees.
    PATH is a verl global_step_N directory or a data.pt file. Nothing is written.

    A checkpoint may come from anywhere: a store it records that is not on this machine is
    named but not opened (it would be read with your credentials) unless --open-store is
    given or --store names the store.

    \b
    Example:
      dynstate inspect checkpoints/global_step_40
      dynstate inspect checkpoints/global_step_40 --open-store
    """
    from ..loading.checkpoint import describe_checkpoint, is_local_url, load_checkpoint_state

    url = store_url
    if url is None and open_store:
        recorded = load_checkpoint_state(path)[1].get("store_url")
        url_to_open = recorded if isinstance(recorded, str) else None
    else:
        url_to_open = url
    options = (
        storage_options
        if url_to_open is None or is_local_url(url_to_open)
        else cli_storage_options(url_to_open, storage_options)
    )
    info = describe_checkpoint(
        path, store_url=url, storage_options=options, rows=rows, open_remote=open_store
    )
    if as_json:
        r.print_json(info)
        return
    if not info["opened"]:
        _inspect_unopened(info)
        return
    pairs = [
        ("checkpoint", info["checkpoint"]),
        ("training step", _step_line(info)),
        ("store", f"{info['store_url']} (id {info['store_id']})"),
        ("store head", f"version {info['head']}"),
        (
            "sampler",
            f"mode {info['mode']}, seed {info['seed']}, pinned version {info['version']}, "
            f"base rows {info['base_rows']:,}",
        ),
        (
            "sampler counters",
            f"epoch {info['epoch']}, position {info['position']:,}, "
            f"batches handed out {info['step']:,}",
        ),
        ("selection", _policy_line(info)),
        (
            "next batch",
            f"epoch {info['next_epoch']}, version {info['next_version']}, "
            f"rows {info['next_indices']}",
        ),
    ]
    for line in r.fields(pairs):
        r.echo(line)
    if "next_error" in info:
        r.echo(f"note: {info['next_error']}")
    if info["next_rows"]:
        columns = list(info["next_rows"][0])
        cols = [r.Column("row", right=True), *(r.Column(c, flexible=True) for c in columns)]
        cells = [
            [str(index), *(r.cell(row[c]) for c in columns)]
            for index, row in zip(info["next_indices"], info["next_rows"], strict=True)
        ]
        r.echo()
        for line in r.table(cols, cells, r.width()):
            r.echo(line)


def _step_line(info: dict[str, Any]) -> str:
    step = info.get("training_step")
    folder = os.path.basename(os.path.dirname(info["checkpoint"]))
    if step is None:
        return "unknown (not in a global_step_N folder)"
    return f"{step} (folder {folder})"


def _policy_line(info: dict[str, Any]) -> str:
    select = info.get("select")
    if select is None:
        return "none (every row drawn uniformly)"
    params = ", ".join(f"{k}={v!r}" for k, v in select["params"].items())
    return f"{select['policy']} ({params})" if params else select["policy"]


def _inspect_unopened(info: dict[str, Any]) -> None:
    """What the checkpoint itself says, when its store was not opened."""
    pairs = [
        ("checkpoint", info["checkpoint"]),
        ("training step", _step_line(info)),
        ("store", f"{info['store_url']} (id {info['store_id']}), recorded; not opened"),
        (
            "sampler",
            f"mode {info['mode']}, seed {info['seed']}, pinned version {info['version']}, "
            f"base rows {info['base_rows']:,}",
        ),
        (
            "sampler counters",
            f"epoch {info['epoch']}, position {info['position']:,}, "
            f"batches handed out {info['step']:,}",
        ),
        ("selection", _policy_line(info)),
    ]
    for line in r.fields(pairs):
        r.echo(line)
    r.echo(
        f"note: {info['not_opened']}; pass --open-store to open it, or --store URL to name "
        "the store yourself"
    )


COMMANDS = [export_cmd, plot_cmd, inspect_cmd]
