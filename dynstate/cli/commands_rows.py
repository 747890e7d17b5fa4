"""Row-reading commands: `head`, and the row reading and printing `diff --rows` and `stats`
share with it."""

from __future__ import annotations

from typing import Any

import click

from ..records.codec import dumps
from ..text import preview_order, python_rows
from . import render as r
from .options import Count, Finite, json_option, open_store, store_command, version_arg


def _columns(snap: Any, columns: str | None, url: str) -> list[str]:
    names = [f.name for f in snap.schema or []]
    wanted = [c.strip() for c in columns.split(",") if c.strip()] if columns else names
    if columns is not None and not wanted:
        raise click.BadParameter(
            f"{columns!r} names no column; columns of version {snap.version}: {', '.join(names)}",
            param_hint="--columns",
        )
    unknown = [c for c in wanted if c not in names]
    if unknown:
        raise click.BadParameter(
            f"no column {', '.join(unknown)} in version {snap.version} of {url}; "
            f"columns: {', '.join(names)}",
            param_hint="--columns",
        )
    return wanted


def _read_rows(snap: Any, start: int, stop: int, wanted: list[str]) -> list[dict[str, Any]]:
    """Rows ``start`` to ``stop`` (exclusive) of ``snap``, reading only the shards they are
    in."""
    import bisect

    out: list[dict[str, Any]] = []
    if start >= stop:
        return out
    first = bisect.bisect_right(snap.offsets, start) - 1
    for i in range(first, len(snap.shards)):
        lo = snap.offsets[i]
        if lo >= stop:
            break
        table = snap.read_shard(i).select(wanted)
        begin = max(start - lo, 0)
        out.extend(python_rows(table.slice(begin, min(stop, snap.offsets[i + 1]) - lo - begin)))
        del table
    return out


def read_rows_at(snap: Any, numbers: Any, wanted: list[str]) -> list[dict[str, Any]]:
    """Rows ``numbers`` (in any order) of ``snap``, reading each shard they are in once."""
    import pyarrow as pa

    by_shard: dict[int, list[tuple[int, int]]] = {}
    for pos, row in enumerate(numbers):
        shard, local = snap.locate(int(row))
        by_shard.setdefault(shard, []).append((pos, local))
    out: list[dict[str, Any]] = [{} for _ in numbers]
    for shard, where in sorted(by_shard.items()):
        table = snap.read_shard(shard).select(wanted)
        taken = table.take(pa.array([local for _, local in where], pa.int64()))
        for (pos, _), row in zip(where, python_rows(taken), strict=True):
            out[pos] = row
        del table
    return out


def preview_column(snap: Any) -> str | None:
    """The column a row is previewed by (stats' hardest/easiest rows): the first text or chat
    column that is not dynstate's own, a usual prompt column (``prompt``, ``question``, ...)
    before the others, else the first column."""
    import pyarrow as pa

    fields = [f for f in snap.schema or [] if not f.name.startswith("_dynstate")]
    by_name = {f.name: f for f in fields}
    for f in (by_name[n] for n in preview_order(list(by_name))):
        t = f.type
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return str(f.name)
        chat = (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(
            t.value_type
        )
        if chat and t.value_type.get_field_index("content") >= 0:
            return str(f.name)
    return str(fields[0].name) if fields else None


def _print_rows(
    rows: list[dict[str, Any]],
    numbers: Any,
    wanted: list[str],
    stats: list[dict[str, Any]] | None = None,
) -> None:
    """Rows as a table with their row numbers (chat messages shown by their content), and
    their attempts and pass rate when ``stats`` are given."""
    cols = [r.Column("#", right=True)]
    if stats is not None:
        cols += [r.Column("attempts", right=True), r.Column("pass rate", right=True)]
    cols += [r.Column(name, flexible=True) for name in wanted]
    cells = []
    for i, (n, row) in enumerate(zip(numbers, rows, strict=True)):
        first = [f"{n:,}"]
        if stats is not None:
            rate = stats[i]["pass_rate"]
            first += [f"{stats[i]['attempts']:,}", "-" if rate is None else f"{rate:.0%}"]
        cells.append([*first, *(r.cell(row[c]) for c in wanted)])
    for line in r.table(cols, cells, r.width()):
        r.echo(line)


def _check_sort(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from ..history.outcomes import SORT_KEYS

    if value is not None and value.lstrip("-") not in SORT_KEYS:
        raise click.BadParameter(
            f"{value!r} is no statistic; one of {', '.join(SORT_KEYS)} (a leading '-' for "
            "descending)"
        )
    return value


@click.command("head")
@click.argument("url")
@click.argument("version", required=False)
@click.option("-n", "rows", default=10, show_default=True, type=Count(0), help="Rows to show.")
@click.option("--offset", default=0, type=Count(0), help="Skip this many rows first.")
@click.option("--tail", is_flag=True, help="Show the last N rows instead of the first.")
@click.option(
    "--added",
    is_flag=True,
    help="Only the rows this version added (its round); --offset and --tail count within them.",
)
@click.option("--columns", help="Comma-separated columns to show.")
@click.option("--jsonl", is_flag=True, help="One JSON object per row.")
@click.option(
    "--sort",
    metavar="STAT",
    callback=_check_sort,
    help="Order rows by an outcome statistic: pass_rate, attempts, successes, mean_score, "
    "ewma_score, first_step or last_step; a leading '-' for descending.",
)
@click.option("--min-pass-rate", type=Finite(0, 1), help="Only trained rows at least this.")
@click.option("--max-pass-rate", type=Finite(0, 1), help="Only trained rows at most this.")
@click.option("--min-attempts", type=Count(0), help="Only rows with at least this many outcomes.")
@click.option(
    "--max-attempts", type=Count(0), help="Only rows with at most this many (0: never trained)."
)
@json_option
@store_command
def head_cmd(url, version, rows: int, offset: int, tail: bool, added: bool, columns,
             jsonl: bool, sort, min_pass_rate, max_pass_rate, min_attempts, max_attempts,
             as_json: bool, storage_options):  # fmt: skip
    """Print N rows of a version (default: the head), with their row numbers, reading only
    the shards they are in: the first N, from --offset on, the last N (--tail), or those
    the version added (--added: what a round generated).

    With --sort or a --min-/--max- bound the rows are chosen by their outcome statistics
    (as `dynstate stats` computes them: a success is a score above 0.5) and shown with
    their attempts and pass rate; --offset, --tail and -n then count within that order.

    \b
    Example:
      dynstate head ./runs/run1 7 -n 5 --columns prompt,answer --jsonl
      dynstate head ./runs/run1 23 --added --tail -n 3
      dynstate head ./runs/run1 --sort pass_rate --min-attempts 1 -n 5
    """
    if jsonl and as_json:
        raise click.UsageError("give either --json or --jsonl, not both")
    store = open_store(url, storage_options)
    snap = store.snapshot(version_arg(version))
    wanted = _columns(snap, columns, store.display_url)
    lo, hi = 0, snap.num_rows
    if added:
        lo = max(0, hi - max(0, snap.commit.rows_added))
    picks = {
        "sort": sort,
        "min_pass_rate": min_pass_rate,
        "max_pass_rate": max_pass_rate,
        "min_attempts": min_attempts,
        "max_attempts": max_attempts,
    }
    if any(v is not None for v in picks.values()):
        _head_by_stats(store, snap, picks, (lo, hi), (rows, offset, tail), wanted, jsonl, as_json)
        return
    if tail:
        hi = max(lo, hi - offset)
        start = max(lo, hi - rows)
    else:
        start = min(hi, lo + offset)
        hi = min(hi, start + rows)
    numbers = range(start, hi)
    out = _read_rows(snap, start, hi, wanted)
    if jsonl or as_json:
        out = [r.json_row(row) for row in out]
    if jsonl:
        for row in out:
            r.echo(dumps(row, default=str, ensure_ascii=False))
        return
    if as_json:
        r.print_json(out)
        return
    if added and not out:
        what = "added no rows" if lo == snap.num_rows else "has no rows there"
        r.echo(f"version {snap.version} of {store.display_url} ({snap.commit.op}) {what}")
        return
    _print_rows(out, numbers, wanted)


def _head_by_stats(store: Any, snap: Any, picks: dict[str, Any], span: tuple[int, int],
                   window: tuple[int, int, bool], wanted: list[str], jsonl: bool,
                   as_json: bool) -> None:  # fmt: skip
    """`head` with --sort / --min-* / --max-*: the rows dynstate.history.outcomes selects."""
    from ..history.outcomes import NO_OUTCOMES, RowSelection, outcome_records_count, row_stats

    where = f"version {snap.version} of {store.display_url}"
    choice = RowSelection.parse(picks, where)
    if not outcome_records_count(store, snap.version):
        note = f"{NO_OUTCOMES} in the lineage of {where}; nothing to sort or filter by"
        if jsonl or as_json:
            click.echo(note, err=True)
            if as_json:
                r.print_json([])
            return
        r.echo(note)
        return
    stats = store.outcome_stats(snap.version)
    picked = choice.select(stats)
    lo, hi = span
    picked = picked[(picked >= lo) & (picked < hi)]
    n, offset, tail = window
    picked = picked[: max(0, len(picked) - offset)][-n:] if tail else picked[offset : offset + n]
    if n == 0:
        picked = picked[:0]
    out = read_rows_at(snap, picked.tolist(), wanted)
    figures = row_stats(stats, picked)
    if jsonl or as_json:
        out = [r.json_row(row) for row in out]
        rows = [
            {
                "_dynstate_row": f["row"],
                "_dynstate_attempts": f["attempts"],
                "_dynstate_successes": f["successes"],
                "_dynstate_pass_rate": f["pass_rate"],
                **row,
            }
            for f, row in zip(figures, out, strict=True)
        ]
        if jsonl:
            for row in rows:
                r.echo(dumps(row, default=str, ensure_ascii=False))
        else:
            r.print_json(rows)
        return
    if not out:
        r.echo(f"no rows of {where} pass these bounds")
        return
    _print_rows(out, picked.tolist(), wanted, figures)
