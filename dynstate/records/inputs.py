"""What user input may be, before anything is written: the one plain-value validator (a
round's ``meta``, a generator's state, a selection policy's identity in the sampler state)
and the one converter of rounds and outcomes to Arrow (:func:`to_arrow`). Pure: no I/O.

Plain values are what JSON and ``torch.load(weights_only=True)`` give back unchanged: dicts
with str keys, lists, str, int (within the bound every reader of a store applies,
:func:`dynstate.records.codec.check_int`), finite floats, bool and None, nested at most a
given depth — checked by a walk with a budget, so a value nested 10,000 deep is refused
with a message, not a RecursionError.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from ..errors import DynstateError, InvalidDataError
from .codec import check_int, dumps, load_json
from .columns import check_names, check_row_depth


def check_plain(
    value: Any, label: str, root: str, *, depth: int, tuples: bool = False, exact: bool = False
) -> Any:
    """``value`` as plain types (a copy: subclasses become the plain type, tuples lists
    where ``tuples``, else they are refused since they would come back lists), or
    InvalidDataError starting with ``label`` and naming where in the value (``root`` and
    the keys and indices to it). At most ``depth`` dicts and lists nest. ``exact``: a
    subclass is refused too (a ``numpy.float64``, an ``IntEnum``, an ``OrderedDict``), since
    it would come back the plain type (a generator's state: a resumed run must hold what the
    uninterrupted one held)."""

    def walk(value: Any, where: str, budget: int) -> Any:
        at = where if len(where) <= 60 else where[:57] + "..."
        if exact and type(value) not in _EXACT and isinstance(value, _PLAIN):
            plain = next(t for t in _PLAIN if isinstance(value, t)).__name__
            kind = f"{type(value).__module__.split('.')[0]}.{type(value).__name__}"
            raise InvalidDataError(
                f"{label} holds a {kind} at {at}, which would come back a plain {plain}; "
                f"convert it ({plain}(value)) so that a resumed run holds what this one does"
            )
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return _utf8(str.__str__(value), f"{label} at {at}")
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
                key = _utf8(str.__str__(key), f"{label} at {at}")
                out[key] = walk(item, f"{where}[{key!r}]", budget - 1)
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


# bool before int: a bool is an int; its own type is plain.
_PLAIN: tuple[type, ...] = (bool, str, int, float, dict, list)
_EXACT = frozenset((*_PLAIN, type(None)))


def _utf8(text: str, what: str) -> str:
    """``text``, or InvalidDataError if UTF-8 cannot encode it (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidDataError(
            f"{what} holds a str with a lone surrogate ({exc.object[exc.start : exc.end]!r}): "
            "surrogates not allowed in UTF-8 JSON; decode text with errors='replace'"
        ) from None
    return text


def plain_json(
    value: Any,
    label: str,
    root: str,
    *,
    depth: int,
    max_bytes: int,
    advice: str,
    tuples: bool = False,
    exact: bool = False,
) -> Any:
    """:func:`check_plain` of ``value``, then a round trip through
    JSON of at most ``max_bytes`` bytes (``advice``: what to do instead), as stored."""
    plain = check_plain(value, label, root, depth=depth, tuples=tuples, exact=exact)
    try:
        # keys sorted, as the canonical record every other handle reads
        text = dumps(plain, allow_nan=False, ensure_ascii=False, sort_keys=True)
        size = len(text.encode())
    except (TypeError, ValueError, OverflowError) as exc:
        # the last line under the walk (which refuses NaN, big ints and lone surrogates)
        raise InvalidDataError(
            f"{label} must be JSON-serializable (str, numbers, lists, dicts): {exc}"
        ) from exc
    if size > max_bytes:
        raise InvalidDataError(
            f"{label} is {size:,} bytes of JSON, over the limit of {max_bytes:,}; {advice}"
        )
    return load_json(text, label)  # as a reader parses it: whatever this process's int limit


# -- user input to Arrow ---------------------------------------------------------------------


def to_arrow(data: Any, url: str, *, outcomes: bool = False) -> pa.Table:
    """User input as an Arrow table, or InvalidDataError: the one converter of a round
    (a pyarrow Table or RecordBatch, a list of dicts, a pandas DataFrame or a
    datasets.Dataset) and of outcomes (``outcomes=True``: also a dict of columns, and every
    value a number — Python, numpy or 0-d torch — with 1-D numpy arrays and torch tensors
    as columns, such as ``{"row": batch["_dynstate_row"], "score": scores}``). A round's
    values are checked by :func:`dynstate.records.columns.check_table` after; outcomes' by
    :func:`dynstate.records.outcomes.check_outcomes`."""
    what = f"outcomes for {url}" if outcomes else f"this round for {url}"
    try:
        if isinstance(data, pa.Table):
            return data
        if isinstance(data, pa.RecordBatch):
            return pa.Table.from_batches([data])
        if outcomes and isinstance(data, Mapping):
            return _from_columns(data, what)
        if isinstance(data, list) or (
            outcomes and isinstance(data, Sequence) and not isinstance(data, (str, bytes))
        ):
            return _from_rows(data, url, what, outcomes)
        module = type(data).__module__.split(".")[0]
        kind = type(data).__name__
        if module == "pandas" and kind == "DataFrame":
            return _from_frame(data, url, what)
        if module == "datasets" and kind == "Dataset":
            if getattr(data, "_indices", None) is not None:
                data = data.flatten_indices()
            return pa.table(data.data.table)
    except (
        pa.ArrowInvalid,
        pa.ArrowTypeError,
        pa.ArrowNotImplementedError,
        OverflowError,
        TypeError,
        ValueError,
    ) as exc:
        if isinstance(exc, DynstateError):
            raise
        raise InvalidDataError(
            f"cannot store {what}: Arrow cannot hold its values ({exc}); make each column one "
            "type (str, int, float, bool, lists or dicts of those)"
        ) from exc
    if outcomes:
        raise InvalidDataError(
            f"outcomes for {url} must be a pyarrow Table, a list of dicts or a dict of columns "
            f"with row, step and score, not {type(data).__name__}"
        )
    raise InvalidDataError(
        f"cannot append a {type(data).__name__} to {url}; pass a pyarrow Table, a list of "
        "dicts, a pandas DataFrame or a datasets.Dataset"
    )


def _from_rows(data: Sequence[Any], url: str, what: str, numbers: bool) -> pa.Table:
    if not all(isinstance(row, Mapping if numbers else dict) for row in data):
        raise InvalidDataError(
            f"{what} given as a list must hold dicts"
            + (" ({'row': 3, 'step': 7, 'score': 1.0}), one per sample" if numbers else "")
        )
    if numbers and not data:  # a step that trained on nothing
        return pa.table({n: pa.array([], pa.int64()) for n in ("row", "step", "score")})
    # Every key of every row, in order of appearance: a key a row lacks is a null there
    # (pa.Table.from_pylist would take the first row's keys and drop later ones in silence).
    names: dict[Any, None] = {}
    for i, row in enumerate(data):
        if not numbers:
            check_row_depth(row, url, i)
        names.update(dict.fromkeys(row))
    if numbers and not all(isinstance(k, str) for k in names):
        raise InvalidDataError(f"{what}: field names must be str")
    if numbers:
        table = pa.table({n: _numbers([row.get(n) for row in data], n, what) for n in names})
    else:
        table = pa.Table.from_pydict({n: _column(n, [row.get(n) for row in data], what)
                                      for n in names})  # fmt: skip
    _check_has_columns(len(data), table, what)
    return table


def _column(name: Any, values: list[Any], what: str) -> pa.Array:
    """One column of rows, converted alone so that a refusal names it."""
    try:
        try:
            return pa.array(values)
        except OverflowError:
            # ints past int64 that uint64 holds (a 64-bit hash): Arrow infers int64 only
            if all(v is None or (type(v) is int and 0 <= v < 2**64) for v in values):
                return pa.array(values, type=pa.uint64())
            raise
    except OverflowError as exc:
        raise InvalidDataError(
            f"cannot store {what}: column {name!r} holds an int Arrow cannot hold ({exc}); "
            "ints run from -2**63 to 2**64 - 1: store larger ones as str"
        ) from None
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as exc:
        raise InvalidDataError(
            f"cannot store {what}: column {name!r} mixes values Arrow cannot hold as one type "
            f"({exc}); make the column one type (str, int, float, bool, lists or dicts of "
            "those)"
        ) from None


def _from_columns(data: Mapping[Any, Any], what: str) -> pa.Table:
    if not all(isinstance(k, str) for k in data):
        raise InvalidDataError(f"{what}: column names must be str")
    columns = {name: _numbers(values, name, what) for name, values in data.items()}
    if len({len(c) for c in columns.values()}) > 1:
        raise InvalidDataError(
            f"{what}: columns have different lengths "
            + ", ".join(f"{k}={len(v)}" for k, v in columns.items())
        )
    return pa.table(columns)


def _from_frame(data: Any, url: str, what: str) -> pa.Table:
    named = [str(name) for name in data.index.names if name is not None]
    if named:
        # A named index (set_index("id")) is data; preserve_index=False would drop it.
        check_names(named + [str(name) for name in data.columns], url)
        data = data.reset_index()
    check_names([str(name) for name in data.columns], url)
    for pos, name in enumerate(data.columns):
        column = data.iloc[:, pos]
        if column.dtype == object:
            for i, value in enumerate(column):
                check_row_depth({name: value}, url, i)
    table = pa.Table.from_pandas(data, preserve_index=False)
    _check_has_columns(len(data), table, what)
    return table


def _check_has_columns(rows: int, table: pa.Table, what: str) -> None:
    # Arrow counts no rows in a table without columns: the rows would vanish in silence.
    if rows and table.num_columns == 0:
        raise InvalidDataError(
            f"the {rows} rows of {what} have no columns (empty dicts, or a frame without "
            "columns); give the rows their values, or append an empty round"
        )


_REQUIRED = ("row", "step", "score")  # outcomes' columns, where a bool is not a number


def _numbers(values: Any, name: str, what: str) -> pa.Array | pa.ChunkedArray:
    """One outcome column: Arrow as it is; a 1-D numpy array or torch tensor (on any device)
    by its values; else a list of numbers, numpy scalars and 0-d tensors among them."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values
    ndim = getattr(values, "ndim", None)
    if isinstance(ndim, int) and hasattr(values, "tolist"):  # numpy and torch
        if ndim != 1:
            raise InvalidDataError(
                f"{what}: column {name!r} has {ndim} dimensions; an outcome column holds one "
                "number per sample (flatten it, or give one column per number)"
            )
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidDataError(f"{what}: column {name!r} must be a list of numbers")
    values = [_scalar(v) for v in values]
    for v in values:
        if v is None or (isinstance(v, bool) and name not in _REQUIRED):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidDataError(
                f"{what}: column {name!r} holds {v!r} ({type(v).__name__}); outcome fields "
                "must be numbers"
            )
    try:
        return pa.array(values)
    except (pa.ArrowException, OverflowError) as exc:
        raise InvalidDataError(f"{what}: column {name!r}: {exc}") from exc


def _scalar(value: Any) -> Any:
    """A numpy scalar or a 0-d numpy array or torch tensor as its Python number."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value
