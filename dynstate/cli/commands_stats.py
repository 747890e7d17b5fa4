"""`dynstate stats`: the per-row outcome statistics of a version — a pass-rate histogram, the
rows never trained, the hardest and easiest rows. The numbers come from
:meth:`dynstate.Store.outcome_stats` and :func:`dynstate.records.aggregate.summarize`; this
module only renders them. `dynstate steps`: what each step consumed, from
:func:`dynstate.history.story.consumption_series`."""

from __future__ import annotations

from typing import Any

import click

from . import render as r
from .commands_rows import preview_column, read_rows_at
from .options import Count, Finite, json_option, open_store, store_command, version_arg

BAR_WIDTH = 40


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


@click.command("stats")
@click.argument("url")
@click.argument("version", required=False)
@click.option(
    "--top",
    type=Count(0),
    default=10,
    show_default=True,
    help="How many hardest and easiest rows to list.",
)
@click.option(
    "--bins",
    type=click.IntRange(1, 100),
    default=10,
    show_default=True,
    help="Bands of the pass-rate histogram.",
)
@click.option(
    "--success-above",
    "--threshold",
    "success_above",
    type=Finite(),
    default=None,
    help="A success is a score above this (default 0.5: incremental).",
)
@click.option(
    "--column",
    "preview",
    default=None,
    help="The column the hardest and easiest rows are previewed by (default: the first text "
    "column).",
)
@click.option(
    "--half-life",
    type=Finite(0, min_open=True),
    default=None,
    help="EWMA half-life in steps (default 10: incremental).",
)
@json_option
@store_command
def stats_cmd(
    url: str,
    version: str | None,
    top: int,
    bins: int,
    success_above: float | None,
    half_life: float | None,
    preview: str | None,
    as_json: bool,
    storage_options: dict[str, Any],
) -> None:
    """Outcome statistics of a version (default: the head): how many rows were trained, the
    pass rates (successes / attempts) as a histogram, the rows never trained, and the
    hardest and easiest rows. Only the outcomes of the version's lineage count. With
    --json, the same as one object; the hardest/easiest entries name each row's attempts,
    successes, pass rate, mean and EWMA score, last step and a preview (its --column value,
    as `head` shows it). To list rows by a statistic, see `dynstate head --sort`.

    \b
    Example:
      dynstate stats ./runs/run1
      dynstate stats ./runs/run1 step40 --top 5 --threshold 0.9 --json
    """
    from ..records.aggregate import summarize
    from ..records.outcomes import DEFAULT_HALF_LIFE, DEFAULT_SUCCESS_ABOVE

    store = open_store(url, storage_options)
    number = store.resolve(version_arg(version))
    above = DEFAULT_SUCCESS_ABOVE if success_above is None else success_above
    half = DEFAULT_HALF_LIFE if half_life is None else half_life
    table = store.outcome_stats(number, success_above=above, half_life=half)
    summary = summarize(table, bins=bins, top=top)
    snap = store.snapshot(number)
    column = _preview_column(snap, preview, store.display_url)
    listed = [e["row"] for e in (*summary["hardest"], *summary["easiest"])]
    texts: dict[int, str] = {}
    if column is not None and listed:
        values = read_rows_at(snap, listed, [column])
        texts = {row: r.preview(v[column]) for row, v in zip(listed, values, strict=True)}
    for entry in (*summary["hardest"], *summary["easiest"]):
        entry["preview"] = texts.get(entry["row"])
    out = {
        "url": store.display_url,
        "version": number,
        "success_above": above,
        "half_life": half,
        "preview_column": column,
        **summary,
    }
    if as_json:
        r.print_json(out)
        return
    r.echo(f"{store.display_url} version {number}")
    for line in r.fields(
        [
            ("rows", f"{out['rows']:,}"),
            ("trained", f"{out['trained']:,} ({out['never_trained']:,} never trained)"),
            ("outcomes", f"{out['records']:,} (a success is a score above {above:g})"),
            ("pass rate", _rate(out["pass_rate"])),
        ]
    ):
        r.echo(line)
    if not out["trained"]:
        r.echo("no outcomes recorded in this version's lineage")
        return
    r.echo()
    r.echo("pass rate of trained rows:")
    most = max(b["rows"] for b in out["histogram"]) or 1
    for band in out["histogram"]:
        closing = "]" if band["high"] >= 1 else ")"
        label = f"[{band['low']:.0%}, {band['high']:.0%}{closing}"
        bar = "#" * round(BAR_WIDTH * band["rows"] / most)
        r.echo(f"  {label:>12} {band['rows']:>9,} {bar}".rstrip())
    for title, entries in (("hardest", out["hardest"]), ("easiest", out["easiest"])):
        if not entries:
            continue
        r.echo()
        r.echo(f"{title} rows:")
        cols = [
            r.Column("row", right=True),
            r.Column("attempts", right=True),
            r.Column("successes", right=True),
            r.Column("pass rate", right=True),
            r.Column("mean score", right=True),
            r.Column(f"ewma ({half:g})", right=True),
            r.Column("last step", right=True),
        ]
        if column is not None:
            cols.append(r.Column(column, flexible=True))
        cells = [
            [
                str(e["row"]),
                f"{e['attempts']:,}",
                f"{e['successes']:,}",
                _rate(e["pass_rate"]),
                _score(e["mean_score"]),
                _score(e["ewma_score"]),
                r.cell(e["last_step"]),
                *([e["preview"]] if column is not None else []),
            ]
            for e in entries
        ]
        for line in r.table(cols, cells, r.width()):
            r.echo(line)


def _preview_column(snap: Any, name: str | None, url: str) -> str | None:
    names = [f.name for f in snap.schema or []]
    if name is None:
        return preview_column(snap)
    if name not in names:
        raise click.BadParameter(
            f"no column {name} in version {snap.version} of {url}; columns: {', '.join(names)}",
            param_hint="--column",
        )
    return name


@click.command("steps")
@click.argument("url")
@click.argument("version", required=False)
@click.option("--limit", type=Count(1), default=20, show_default=True,
              help="The newest N steps (the lineage is read back no further).")  # fmt: skip
@json_option
@store_command
def steps_cmd(
    url: str, version: str | None, limit: int, as_json: bool, storage_options: dict[str, Any]
) -> None:
    """What each training step of a version's lineage drew, trained, filtered, dropped and
    carried (dynamic sampling's consumption records, in the steps' rounds): the newest
    --limit steps, oldest first, each with its generation batches and the share of the
    groups it drew that the filter took out, then the totals over those steps. A lineage
    without consumption records lists none. `dynstate show V` tells one step's story.

    \b
    Example:
      dynstate steps ./runs/run1 --limit 50
      dynstate steps ./runs/run1 ckpt --json
    """
    from ..history.story import consumption_series

    store = open_store(url, storage_options)
    number = store.resolve(version_arg(version))
    out = {"url": store.display_url, **consumption_series(store, number, limit=limit)}
    if as_json:
        r.print_json(out)
        return
    r.echo(f"{store.display_url} version {number}")
    if not out["steps"]:
        r.echo("no consumption recorded in this version's lineage (rounds committed with "
               "consumption=, as DynamicSampling's loop does, show here)")  # fmt: skip
        return
    names = ("carried_in", "drawn", "trained", "filtered", "dropped", "carry", "in_flight")
    cols = [
        r.Column("step", right=True),
        r.Column("version", right=True),
        r.Column("gen batches", right=True),
        *(r.Column(name.replace("_", " "), right=True) for name in names),
        r.Column("filtered %", right=True),
    ]

    def cells(entry: dict[str, Any], first: str, second: str) -> list[str]:
        return [
            first,
            second,
            f"{entry['gen_batches']:,}",
            *(f"{entry[name]:,}" for name in names),
            _rate(entry["filtered_share"]),
        ]

    rows = [cells(e, str(e["step"]), str(e["version"])) for e in out["steps"]]
    shown = len(out["steps"])
    rows.append(cells(out["totals"], "total", f"{shown:,} step{'' if shown == 1 else 's'}"))
    for line in r.table(cols, rows, r.width()):
        r.echo(line)
    if not out["complete"]:
        r.echo(f"(the newest {shown:,} steps: --limit N reads further back)")


COMMANDS = [stats_cmd, steps_cmd]
