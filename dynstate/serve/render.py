"""How ``dynstate serve`` writes things: the Jinja environment of its templates (filters for
bytes, counts and cells, the query-string helper), JSON documents, and the library's advice
reworded for a browser."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

import jinja2
from starlette.requests import Request

from .._version import __version__
from ..records import codec
from ..text import chat_text
from .chart import COLORS
from .lineage import SOURCE_COLUMN
from .rows import filter_param, filter_params

__all__ = ["dumps", "environment", "filter_qs", "qs", "web_terms"]


# The library's advice names Python arguments and CLI commands; a page names pages.
_WEB_TERMS = (
    (
        re.compile(r"pass version=None for the latest"),
        "the versions page (/versions) lists them",
    ),
    (
        re.compile(r"`dynstate ls` lists versions and tags"),
        "the versions page (/versions) lists versions, and the store page (/) the tags",
    ),
    (
        re.compile(r"\(dynstate serve URL --checkpoint PATH\)"),
        "(start dynstate serve with --checkpoint PATH to show one)",
    ),
)


def web_terms(message: str) -> str:
    """``message`` with the advice the library gives in API and CLI terms put in the web
    view's."""
    for pattern, replacement in _WEB_TERMS:
        message = pattern.sub(replacement, message)
    return message


def dumps(data: Any) -> str:
    """A JSON document as ``/api`` returns it."""
    return codec.dumps(data, ensure_ascii=False, default=str, indent=1)


def _fmt_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _fmt_int(n: Any) -> str:
    if n is None:
        return ""
    return f"{n:,}" if isinstance(n, int) and not isinstance(n, bool) else str(n)


def _cell(value: Any, limit: int = 160) -> str:
    """A value in a table cell: text as is, chat messages by their content (as the CLI
    shows them), anything else as JSON; cut at ``limit`` characters."""
    chat = chat_text(value)
    if chat is not None:
        text = chat
    elif isinstance(value, str):
        text = value
    else:
        text = codec.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _messages(value: Any) -> list[dict[str, str]] | None:
    """A chat-format value (what :func:`chat_text` accepts) as its messages, each with its
    role and its content as text, for the row page to show as the CLI does; None otherwise."""
    if chat_text(value) is None:
        return None
    return [
        {
            "role": str(m.get("role") or ""),
            "content": m["content"]
            if isinstance(m["content"], str)
            else codec.dumps(m["content"], ensure_ascii=False, default=str),
        }
        for m in value
    ]


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) and not (
        isinstance(value, str) and len(value) > 80
    )


def environment(templates: str) -> jinja2.Environment:
    """The templates of ``templates`` (a folder) with the filters and globals pages use."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates),
        autoescape=jinja2.select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(bytes=_fmt_bytes, num=_fmt_int, cell=_cell, messages=_messages)
    env.globals.update(
        version=__version__,
        colors=COLORS,
        scalar=_scalar,
        source_column=SOURCE_COLUMN,
        qs=qs,
        filter_qs=filter_qs,
        filter_param=filter_param,
    )
    return env


def qs(request: Request, changes: Mapping[str, Any] | None = None) -> str:
    """The current query string with the parameters in ``changes`` replaced (None removes
    one, a list repeats it). A mapping, not keywords, so that any column name can be a key."""
    changes = changes or {}
    items = [(k, v) for k, v in request.query_params.multi_items() if k not in changes]
    for key, value in changes.items():
        if value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            items.append((key, str(v)))
    return "?" + urlencode(items) if items else "?"


def filter_qs(request: Request, column: str, value: Any) -> str:
    """The current query string, from its first page, with ``column`` filtered by ``value``
    alone (None: not filtered), under the parameter no page parameter can be
    (:func:`~dynstate.serve.rows.filter_param`)."""
    changes: dict[str, Any] = {"offset": None, **dict.fromkeys(filter_params(column))}
    changes[filter_param(column)] = value
    return qs(request, changes)
