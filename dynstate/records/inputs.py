"""What user input may be, before anything is written: the one plain-value validator (a
round's ``meta``, a generator's state, a selection policy's identity in the sampler state)
and the one converter of rows and outcomes to Arrow. Pure: no I/O.

Plain values are what JSON and ``torch.load(weights_only=True)`` give back unchanged: dicts
with str keys, lists, str, int (within the bound every reader of a store applies,
:func:`dynstate.records.codec.check_int`), finite floats, bool and None, nested at most a
given depth — checked by a walk with a budget, so a value nested 10,000 deep is refused
with a message, not a RecursionError.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import InvalidDataError
from .codec import check_int


def check_plain(value: Any, label: str, root: str, *, depth: int, tuples: bool = False) -> Any:
    """``value`` as plain types (a copy: subclasses become the plain type, tuples lists
    where ``tuples``, else they are refused since they would come back lists), or
    InvalidDataError starting with ``label`` and naming where in the value (``root`` and
    the keys and indices to it). At most ``depth`` dicts and lists nest."""

    def walk(value: Any, where: str, budget: int) -> Any:
        at = where if len(where) <= 60 else where[:57] + "..."
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return str.__str__(value)
        if isinstance(value, int):
            check_int(value, f"{label} at {at}")
            return int.__int__(value)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidDataError(
                    f"{label} holds {value} at {at}, which JSON cannot hold; use None or a string"
                )
            return float.__float__(value)
        nested = isinstance(value, (dict, list)) or (tuples and isinstance(value, tuple))
        if nested and budget == 0:
            raise InvalidDataError(
                f"{label} nests deeper than {depth} levels (at {at}); flatten it"
            )
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    # JSON would turn 1 into "1" silently, and {1: a, "1": b} into one key
                    raise InvalidDataError(
                        f"{label} has a key {key!r} of type {type(key).__name__} at {at}; "
                        f"{root} keys must be str"
                    )
                out[str.__str__(key)] = walk(item, f"{where}[{key!r}]", budget - 1)
            return out
        if nested:
            return [walk(item, f"{where}[{i}]", budget - 1) for i, item in enumerate(value)]
        kind = f"{type(value).__module__.split('.')[0]}.{type(value).__name__}"
        raise InvalidDataError(
            f"{label} holds a {kind} at {at}, which is not JSON-serializable; use plain types "
            "(dict, list, str, int, float, bool, None"
            + (", and tuples" if tuples else "; tuples would come back lists")
            + ") — numpy and torch values: .item() or .tolist()"
        )

    return walk(value, root, depth)


def plain_json(
    value: Any,
    label: str,
    root: str,
    *,
    depth: int,
    max_bytes: int,
    advice: str,
    tuples: bool = False,
) -> Any:
    """:func:`check_plain` of ``value``, then a round trip through
    JSON of at most ``max_bytes`` bytes (``advice``: what to do instead), as stored."""
    plain = check_plain(value, label, root, depth=depth, tuples=tuples)
    try:
        text = json.dumps(plain, allow_nan=False, ensure_ascii=False)
        size = len(text.encode())
    except (TypeError, ValueError, OverflowError) as exc:
        # what the walk lets through and JSON still refuses: a lone surrogate in a str
        raise InvalidDataError(
            f"{label} must be JSON-serializable (str, numbers, lists, dicts): {exc}"
        ) from exc
    if size > max_bytes:
        raise InvalidDataError(
            f"{label} is {size:,} bytes of JSON, over the limit of {max_bytes:,}; {advice}"
        )
    return json.loads(text)
