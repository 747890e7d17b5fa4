"""All terminal output of the `dynstate` command: plain-text tables that fit the terminal,
human sizes and UTC times, JSON, and progress bars on stderr. Commands compute plain data and
hand it here; nothing in this module reads a store.

Kept free of heavy imports: rich is loaded only when a progress bar is actually shown."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import click

from ..records.codec import dumps
from ..text import chat_text

GAP = "  "


def clean(text: str) -> str:
    """``text`` through the package's one scrubber, with the running command's credentials:
    every line the CLI prints goes through here."""
    if not text:
        return text
    from ..storage.credentials import scrub
    from .options import secrets

    return scrub(text, secrets())


def echo(line: str = "") -> None:
    click.echo(clean(line))


def print_json(obj: Any) -> None:
    click.echo(clean(dumps(obj, indent=2, default=str, ensure_ascii=False)))


def json_row(row: Any) -> Any:
    """A row as strict JSON takes it (NaN and infinities as null, bytes as base64 text),
    as ``dynstate serve``'s API gives it."""
    from ..serve.rows import jsonable

    return jsonable(row)


def human_size(n: int | None) -> str:
    """``1536`` as ``"1.5 KiB"``: powers of 1024, one decimal from KiB on."""
    if n is None:
        return ""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def utc(timestamp: str | None) -> str:
    """An ISO 8601 record time (``2026-11-30T00:23:28.123Z``) as ``2026-11-30 00:23:28``; the
    caller says "UTC" once, in a column title or after the time."""
    if not timestamp:
        return ""
    return f"{timestamp[:10]} {timestamp[11:19]}"


def count(n: int, noun: str) -> str:
    """``count(1, "version")`` is ``"1 version"``, ``count(1201, ...)`` ``"1,201 versions"``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def versions_text(versions: Sequence[int]) -> str:
    """``[47]`` as ``"version 47"``, ``[3, 4, 5, 8]`` as ``"versions 3-5, 8"``: singular for
    one version, runs of consecutive versions as ranges (never ``21-21``)."""
    from ..history import ranges

    unique = sorted(set(versions))
    return f"version {unique[0]}" if len(unique) == 1 else f"versions {ranges(unique)}"


def preview(value: Any) -> str:
    """A value as a one-line preview of its row: :func:`cell`, but chat messages lead with
    the task (system messages last), so a preview cut to the terminal's width names the
    task, not the system prompt every row shares."""
    chat = chat_text(value, task_first=True)
    return cell(value) if chat is None else chat.replace("\n", "\\n")


def cell(value: Any) -> str:
    """A value as one table cell: one line, None as empty, chat messages by their content."""
    if value is None:
        return ""
    chat = chat_text(value)
    if chat is not None:
        return chat.replace("\n", "\\n")
    if isinstance(value, (dict, list)):
        text = dumps(value, default=str, ensure_ascii=False)
    else:
        text = str(value)
    return text.replace("\n", "\\n")


def width() -> int | None:
    """Columns available: ``COLUMNS`` if set, the terminal's width on a terminal, else None
    (piped output is not cut; scripts should prefer --json)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


@dataclass(frozen=True)
class Column:
    title: str
    right: bool = False  # numbers align right
    flexible: bool = False  # may be shortened with "…" to fit; numbers and times never are
    optional: bool = False  # left out when every cell is empty
    drop: int | None = None  # left out to fit a narrow terminal, lowest first (None: never)


def table(columns: Sequence[Column], rows: Sequence[Sequence[str]], limit: int | None) -> list[str]:
    """:func:`fit_table`'s lines."""
    return fit_table(columns, rows, limit)[0]


def fit_table(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], limit: int | None
) -> tuple[list[str], list[str]]:
    """(lines, titles of the columns left out) of a table whose columns are as wide as their
    widest cell. When the table is wider than ``limit``, flexible columns (free text) give up
    width, widest first, down to their title's width (at least 6); if that is not enough,
    droppable columns are left out, lowest ``drop`` first, before anything else is cut.
    Optional columns with nothing in them are left out."""
    keep = [i for i, c in enumerate(columns) if not c.optional or any(row[i] for row in rows)]
    dropped: list[str] = []
    while True:
        cols = [columns[i] for i in keep]
        cells = [[row[i] for i in keep] for row in rows]
        widths = _fit(cols, cells, limit)
        over = limit is not None and sum(widths) + len(GAP) * (len(widths) - 1) > limit
        droppable = [i for i in keep if columns[i].drop is not None]
        if not over or not droppable:
            break
        gone = min(droppable, key=lambda i: columns[i].drop or 0)
        keep.remove(gone)
        dropped.append(columns[gone].title)

    def line(values: Sequence[str]) -> str:
        parts = []
        for value, col, w in zip(values, cols, widths, strict=True):
            if len(value) > w:
                value = value[: w - 1] + "…"
            parts.append(value.rjust(w) if col.right else value.ljust(w))
        return GAP.join(parts).rstrip()

    return [line([c.title for c in cols]), *(line(r) for r in cells)], dropped


def _fit(columns: Sequence[Column], rows: Sequence[Sequence[str]], limit: int | None) -> list[int]:
    widths = [max([len(c.title), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    if limit is not None:
        excess = sum(widths) + len(GAP) * (len(widths) - 1) - limit
        while excess > 0:
            candidates = [
                i for i, c in enumerate(columns) if c.flexible and widths[i] > max(6, len(c.title))
            ]
            if not candidates:
                break
            i = max(candidates, key=lambda k: widths[k])
            widths[i] -= 1
            excess -= 1
    return widths


def fields(pairs: Sequence[tuple[str, str]]) -> list[str]:
    """``key: value`` lines with the values aligned."""
    pad = max((len(k) for k, _ in pairs), default=0) + 2
    return [f"{k + ':':<{pad}}{v}" for k, v in pairs]


Update = Callable[[int, "int | None"], None]


def _no_bar(description: str, unit: str = "") -> Update:
    """A bar that shows nothing (stderr is not a terminal)."""

    def update(done: int, total: int | None) -> None:
        pass

    return update


@contextmanager
def bars() -> Iterator[Callable[[str, str], Update]]:
    """Progress bars on stderr, only on a terminal (stdout stays clean for --json); yields
    ``add(description, unit)``, which starts a bar and returns its ``update(done, total)``.
    Each bar counts whatever the library reports (records, shards, files), as ``unit`` says."""
    if not sys.stderr.isatty():
        yield _no_bar
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[unit]}"), TimeElapsedColumn()]  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:

        def add(description: str, unit: str = "") -> Update:
            task = None  # shown from its first update, so a later stage's bar waits its turn

            def update(done: int, total: int | None) -> None:
                nonlocal task
                if task is None:
                    task = progress.add_task(description, total=total, unit=unit)
                progress.update(task, completed=done, total=total)

            return update

        yield add


@contextmanager
def progress(description: str, unit: str = "") -> Iterator[Update]:
    """One progress bar (see :func:`bars`); yields its ``update(done, total)``."""
    with bars() as add:
        yield add(description, unit)
