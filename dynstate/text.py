"""How a stored value reads as one line of text, for both surfaces (the `dynstate` commands and
`dynstate serve`): chat messages by their content, and the columns a row's preview looks in
first. Pure and light (the standard library only; pyarrow's values are handled when given): the
CLI imports it at start-up."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["PREVIEW_NAMES", "chat_text", "preview_order", "python_rows"]

# Columns that hold what a row asks, in the order a preview prefers them: verl's rows begin
# with ``data_source`` (the same short name on every row), and their prompt comes second.
PREVIEW_NAMES = ("prompt", "question", "problem", "query", "instruction", "messages", "text")


def preview_order(names: Sequence[str]) -> list[str]:
    """``names`` with the usual prompt columns (:data:`PREVIEW_NAMES`) first, in that order,
    then the others as they were: the order a row's preview looks for its text in."""
    known = [n for n in PREVIEW_NAMES if n in names]
    return known + [n for n in names if n not in known]


def chat_text(value: Any, *, task_first: bool = False) -> str | None:
    """A chat-format value (a list of ``{"role", "content"}`` messages, as verl's prompts
    are) as its content, ``user: ... | assistant: ...``; None for anything else.
    ``task_first``: system messages last — a one-line cell cut to the terminal's width then
    shows the task, not the system prompt every row shares."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(m, dict) and "content" in m for m in value):
        return None
    if task_first:
        value = sorted(value, key=lambda m: m.get("role") == "system")  # stable
    parts = []
    for message in value:
        content = message["content"]
        if not isinstance(content, str):
            content = json.dumps(content, default=str, ensure_ascii=False)
        role = message.get("role")
        parts.append(f"{role}: {content}" if role else content)
    return " | ".join(parts)


def python_rows(table: Any) -> list[dict[str, Any]]:
    """A pyarrow Table's rows as dicts, for both surfaces. A value Python cannot hold (a
    timestamp or date past year 9999, a duration past 999,999,999 days) is shown as Arrow
    prints it, in text; every other value of its column stays a Python value, so a row reads
    the same whatever window it is shown in."""
    try:
        return list(table.to_pylist())
    except (OverflowError, ValueError):
        pass
    columns: dict[str, list[Any]] = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        try:
            columns[name] = column.to_pylist()
        except (OverflowError, ValueError):
            columns[name] = _each(column)
    names = list(columns)
    return [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def _each(column: Any) -> list[Any]:
    """The values of a column some of whose values Python cannot hold: those in text, the
    others as Python values."""
    text = _as_text(column)
    out: list[Any] = []
    for i, scalar in enumerate(column):
        try:
            out.append(scalar.as_py())
        except (OverflowError, ValueError):
            out.append(text[i])
    return out


def _as_text(column: Any) -> list[Any]:
    import pyarrow as pa

    try:
        return column.cast(_text_type(column.type)).to_pylist()
    except (pa.ArrowException, NotImplementedError, OverflowError, ValueError):
        return [f"<{column.type} value>" if v.is_valid else None for v in column]


def _text_type(t: Any) -> Any:
    """``t`` with every time-like type (the ones Python's datetime bounds) replaced by string."""
    import pyarrow as pa

    if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_duration(t):
        return pa.string()
    if isinstance(t, pa.BaseExtensionType):
        return _text_type(t.storage_type)
    if pa.types.is_dictionary(t):
        return _text_type(t.value_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return pa.list_(_text_type(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_text_type(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(_text_type(t.key_type), _text_type(t.item_type))
    return t
