"""How a stored value reads as one line of text, for both surfaces (the `dynstate` commands and
`dynstate serve`): chat messages by their content, and the columns a row's preview looks in
first. Pure and light (the standard library only): the CLI imports it at start-up."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["PREVIEW_NAMES", "chat_text", "preview_order"]

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
