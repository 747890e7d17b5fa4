"""Outcomes: what the policy scored on the rows it trained on, as data state. Pure: no I/O.

A round may be committed with the outcomes of one or more training steps (per sample: the
store row, the step, a score and optional numeric fields) and with its generator's state.
This module decides what such input may be (:func:`check_outcomes`,
:func:`check_generator_state`), the Arrow schema outcome files have, the step sets a lineage
holds (as sorted ranges). The per-row aggregate from which statistics are computed, and the
rules of a success, a pass rate and its band, are :mod:`dynstate.records.aggregate`. Reading
and writing the files is :mod:`dynstate.log.outcomes`.

Statistics of a row (over every outcome of the version's lineage that names it):

* ``attempts`` — how many outcomes; ``successes`` — how many with ``score > success_above``;
* ``mean_score`` — their mean; ``first_step`` / ``last_step`` — the steps it was trained at;
* ``ewma_score`` — the mean weighted by ``2 ** ((step - last_step) / half_life)``: an outcome
  ``half_life`` steps older than the row's latest weighs half as much (outcomes of one step
  weigh alike). The weights are relative to the row's own latest step, so the value does not
  depend on when it is asked for, and two partial aggregates merge exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import InvalidDataError
from .codec import whole
from .inputs import plain_json, to_arrow

# The parameters the stored aggregates are built with: statistics with this half-life are
# incremental (at any threshold while the aggregate keeps its score histogram); with another
# half-life they are computed from every outcome record of the lineage.
DEFAULT_SUCCESS_ABOVE = 0.5
DEFAULT_HALF_LIFE = 10.0

REQUIRED = ("row", "step", "score")
# Bounds on one commit's outcomes and state: both are read back with the version.
MAX_OUTCOMES = 2**24
MAX_EXTRA_COLUMNS = 32
MAX_STEP = 2**53  # steps and rows must survive a round trip through JSON and float64
MAX_STATE_BYTES = 2**20
MAX_STATE_DEPTH = 32
# |score| at most this, checked when written (and by readers of outcome files): a row's
# sum of scores, its EWMA numerator and any mean of them stay finite over up to 2**63
# outcomes (1e250 * 2**63 ~ 9e268, far below float64's 1.8e308, with room for sums over
# rows), so no statistic overflows to inf. Real scores are rewards, many orders smaller.
MAX_SCORE = 1e250


# Arrow's fixed-width numeric types by name (DataType.to_pandas_dtype imports pandas too).
_NUMPY_TYPES = {
    str(t): np.dtype(d)
    for t, d in [
        (pa.int8(), np.int8),
        (pa.int16(), np.int16),
        (pa.int32(), np.int32),
        (pa.int64(), np.int64),
        (pa.uint8(), np.uint8),
        (pa.uint16(), np.uint16),
        (pa.uint32(), np.uint32),
        (pa.uint64(), np.uint64),
        (pa.float32(), np.float32),
        (pa.float64(), np.float64),
    ]
}


def as_numpy(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A column as numpy without pandas: pyarrow's ``to_numpy`` imports it at its first call
    (0.25 s of a fresh process's statistics). A fixed-width column without nulls is viewed
    in place (read-only, as ``to_numpy`` gives it); anything else goes through ``to_numpy``."""
    if isinstance(column, pa.ChunkedArray):
        # one chunk (the usual case) is converted as it is: combining copies it first
        column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    dtype = _NUMPY_TYPES.get(str(column.type))
    if dtype is not None and column.null_count == 0:
        values = column.buffers()[1]
        if values is not None:
            out = np.frombuffer(
                values, dtype, count=len(column), offset=column.offset * dtype.itemsize
            )
            out.flags.writeable = False  # Arrow's memory: read-only, as to_numpy gives it
            return out
    return column.to_numpy(zero_copy_only=False)


def from_numpy(values: np.ndarray, mask: np.ndarray | None = None) -> pa.Array:
    """A 1-D numeric array as Arrow, nulls where ``mask`` is True, without pandas (``pa.array``
    of an ndarray imports it at its first call): the values' memory is shared, not copied."""
    values = np.ascontiguousarray(values)
    kind = pa.from_numpy_dtype(values.dtype)
    if str(kind) not in _NUMPY_TYPES or values.ndim != 1:
        return pa.array(values, mask=mask)
    validity, nulls = None, 0
    if mask is not None and (nulls := int(np.count_nonzero(mask))):
        validity = pa.py_buffer(np.packbits(~np.asarray(mask, bool), bitorder="little"))
    return pa.Array.from_buffers(kind, len(values), [validity, pa.py_buffer(values)], nulls)


# -- input -----------------------------------------------------------------------------------


def check_outcomes(data: Any, url: str, num_rows: int, version: int) -> pa.Table:
    """``data`` as the table an outcome file holds — ``row`` and ``step`` int64, ``score``
    float64, then the extra numeric columns in the caller's order — or InvalidDataError.
    Rows must exist in ``version`` (``num_rows`` rows)."""
    table = to_arrow(data, url, outcomes=True)
    names = table.column_names
    if len(set(names)) != len(names) or any(not n for n in names):
        raise InvalidDataError(f"outcomes for {url}: column names must be unique and non-empty")
    missing = [n for n in REQUIRED if n not in names]
    if missing:
        raise InvalidDataError(
            f"outcomes for {url} lack column(s) {', '.join(missing)}; each sample needs its "
            "store row, the training step and a score"
        )
    if table.num_rows == 0:  # nothing to record (empty lists have no type to check)
        return pa.table(
            {n: pa.array([], pa.float64() if n == "score" else pa.int64()) for n in REQUIRED}
        )
    extras = [n for n in names if n not in REQUIRED]
    if len(extras) > MAX_EXTRA_COLUMNS:
        raise InvalidDataError(
            f"outcomes for {url} have {len(extras)} extra columns, over the limit of "
            f"{MAX_EXTRA_COLUMNS}; keep per-sample details in the round's rows"
        )
    if table.num_rows > MAX_OUTCOMES:
        raise InvalidDataError(
            f"outcomes for {url} hold {table.num_rows:,} records, over the limit of "
            f"{MAX_OUTCOMES:,} per commit; commit them with several rounds"
        )
    columns: dict[str, pa.Array | pa.ChunkedArray] = {}
    top = 0
    for name in ("row", "step"):
        col = table.column(name)
        if not pa.types.is_integer(col.type):
            raise InvalidDataError(
                f"outcomes for {url}: column {name!r} must hold integers, not {col.type}"
            )
        if col.null_count:
            raise InvalidDataError(f"outcomes for {url}: column {name!r} holds nulls")
        # One pass in numpy (no nulls: a view), not an Arrow kernel per bound: a commit
        # checks its outcomes on the caller's thread, before anything is written.
        values = as_numpy(col)
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= MAX_STEP:
            raise InvalidDataError(
                f"outcomes for {url}: column {name!r} holds values outside 0..2**53"
            )
        columns[name] = col if col.type == pa.int64() else pa.array(values.astype(np.int64))
        if name == "row":
            top = high
    if top >= num_rows:  # (the table is not empty: returned above)
        raise InvalidDataError(
            f"outcomes for {url} name row {top}, but version {version} has {num_rows} "
            "rows; outcomes may name only rows of the version the round is appended to "
            "(the round's own new rows have not been trained on yet)"
        )
    columns["score"] = _numeric(table.column("score"), "score", url, nulls=False)
    scores = as_numpy(columns["score"])
    if not (np.abs(scores) <= MAX_SCORE).all():
        worst = int(np.argmax(np.abs(scores)))
        raise InvalidDataError(
            f"outcomes for {url}: column 'score' holds {float(scores[worst])!r} (record {worst}), "
            f"beyond the bound |score| <= {MAX_SCORE:g} that keeps sums and means of scores "
            "finite; rescale the scores"
        )
    for name in extras:
        columns[name] = _numeric(table.column(name), name, url, nulls=True)
    return pa.table(columns)


def _uint(col: pa.ChunkedArray, name: str, url: str) -> pa.ChunkedArray:
    import pyarrow.compute as pc  # here, not at the top: see _numeric

    if len(col) and pc.max(col).as_py() >= MAX_STEP:
        raise InvalidDataError(f"outcomes for {url}: column {name!r} holds values over 2**53")
    return col.cast(pa.int64())


def _numeric(col: pa.ChunkedArray, name: str, url: str, *, nulls: bool) -> pa.ChunkedArray:
    t = col.type
    if pa.types.is_boolean(t) and name != "score":
        return col
    if pa.types.is_null(t):
        if nulls:
            # kept null: the field's type comes from the commits that give it values (a
            # float64 here read back 7 of another step as 7.0: unify_extras)
            return col
        raise InvalidDataError(f"outcomes for {url}: column {name!r} holds nulls")
    if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        raise InvalidDataError(
            f"outcomes for {url}: column {name!r} must be numeric, not {t}"
            + (" (a score is a float: 1.0 for a pass, 0.0 for a fail)" if name == "score" else "")
        )
    if col.null_count and not nulls:
        raise InvalidDataError(f"outcomes for {url}: column {name!r} holds nulls")
    if pa.types.is_floating(t) and not col.null_count:
        values = as_numpy(col).astype(np.float64, copy=False)
        if not np.isfinite(values).all():
            raise InvalidDataError(
                f"outcomes for {url}: column {name!r} holds NaN or infinity; "
                "scores and fields must be finite numbers"
            )
        return pa.array(values)
    if pa.types.is_floating(t):
        # Imported here: pyarrow.compute costs a fresh process ~40 ms, and a reader of
        # statistics never comes this way.
        import pyarrow.compute as pc

        col = col.cast(pa.float64())
        finite = pc.is_finite(col)
        if not pc.all(pc.fill_null(finite, True)).as_py():
            raise InvalidDataError(
                f"outcomes for {url}: column {name!r} holds NaN or infinity; "
                "scores and fields must be finite numbers"
            )
        return col
    if name == "score":
        try:
            return col.cast(pa.float64())
        except pa.ArrowInvalid:
            raise InvalidDataError(
                f"outcomes for {url}: column 'score' holds an integer beyond 2**53, which a "
                "float64 score cannot hold exactly; pass scores as floats"
            ) from None
    if t == pa.uint64():
        return _uint(col, name, url)
    col = col.cast(pa.int64())
    import pyarrow.compute as pc  # here, not at the top: see above

    bounds = pc.min_max(col).as_py()
    if any(v is not None and abs(v) > MAX_STEP for v in bounds.values()):
        raise InvalidDataError(
            f"outcomes for {url}: column {name!r} holds an integer beyond 2**53; an extra "
            "field's ints must stay exact as floats (commits that give it floats are read "
            "together with them: unify_extras); pass it as a float or a str column elsewhere"
        )
    return col


def unify_extras(tables: list[pa.Table]) -> list[pa.Table]:
    """Outcome files of one lineage whose extra fields agree in type, to be read as one
    table: a field each commit stores with the type its values had (bool, int64, float64, or
    null where a commit held only nulls) is read as that type where every file agrees (nulls
    taking it), and as float64 where they differ (``True`` -> 1.0, ints exact: bounded by
    2**53 at commit); an older store's all-null float64 columns count as null."""
    kinds: dict[str, set[pa.DataType]] = {}
    for table in tables:
        for field in table.schema:
            if field.name in REQUIRED:
                continue
            column = table.column(field.name)
            if pa.types.is_null(field.type) or column.null_count == len(column):
                kinds.setdefault(field.name, set())
            else:
                kinds.setdefault(field.name, set()).add(field.type)
    target = {
        name: next(iter(types)) if len(types) == 1 else pa.float64()
        for name, types in kinds.items()
        if types
    }
    out = []
    for table in tables:
        for i, field in enumerate(table.schema):
            want = target.get(field.name)
            if want is not None and field.type != want:
                table = table.set_column(i, field.name, table.column(i).cast(want))
        out.append(table)
    return out


def check_generator_state(state: Any, url: str, *, exact: bool = False) -> Any:
    """``state`` as stored (a copy through JSON), or InvalidDataError: plain types only —
    dict with str keys, list, str, int, finite float, bool, None — at most 32 levels deep and
    1 MiB of JSON. ``None`` means no state; tuples are refused (they would come back lists),
    and with ``exact`` (a user's generator state) subclasses of the plain types too (a
    ``numpy.float64`` would come back a float)."""
    return plain_json(
        state,
        f"generator_state for {url}",
        "generator_state",
        depth=MAX_STATE_DEPTH,
        max_bytes=MAX_STATE_BYTES,
        advice="keep large state in the round's rows or beside the store",
        exact=exact,
    )


# -- step sets -------------------------------------------------------------------------------

Ranges = list[list[int]]  # sorted, disjoint, non-adjacent [first, last] pairs (inclusive)


def to_ranges(steps: Iterable[int]) -> Ranges:
    out: Ranges = []
    for s in sorted(set(steps)):
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def steps_of(table: pa.Table) -> Ranges:
    """The step set of a checked outcome table (:func:`check_outcomes`), in numpy: a commit
    usually holds one step, whose 2,048 records a Python ``sorted(set(...))`` would cost
    ~50 us; :func:`to_ranges` of the same steps, exactly."""
    if table.num_rows == 0:
        return []
    steps = as_numpy(table.column("step"))
    low, high = int(steps.min()), int(steps.max())
    if low == high:
        return [[low, low]]
    distinct = np.unique(steps)
    # a new range starts wherever a step is not the one before it plus one
    starts = np.flatnonzero(np.diff(distinct) != 1) + 1
    firsts = distinct[np.concatenate(([0], starts))].tolist()
    lasts = distinct[np.concatenate((starts - 1, [len(distinct) - 1]))].tolist()
    return [[a, b] for a, b in zip(firsts, lasts, strict=True)]


def union(*sets: Ranges) -> Ranges:
    pairs = sorted((a, b) for ranges in sets for a, b in ranges)
    out: Ranges = []
    for a, b in pairs:
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap(a: Ranges, b: Ranges) -> list[int]:
    """A few steps in both (for messages), empty if the sets are disjoint."""
    found: list[int] = []
    i = j = 0
    while i < len(a) and j < len(b) and len(found) < 5:
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            found.extend(range(lo, min(hi, lo + 5 - len(found)) + 1))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return found[:5]


def count_steps(ranges: Ranges) -> int:
    return sum(b - a + 1 for a, b in ranges)


def valid_ranges(obj: Any) -> bool:
    """Whether ``obj`` (read from a store file) is a step set as :func:`to_ranges` writes it."""
    if not isinstance(obj, list):
        return False
    previous: int | None = None
    for pair in obj:
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair)):
            return False
        a, b = pair
        if not 0 <= a <= b < MAX_STEP or (previous is not None and a <= previous + 1):
            return False
        previous = b
    return True


def _real(value: Any) -> Any:
    """``value`` as a Python number where it is one (numpy's ints and floats too), else as
    given; bools stay bools (refused by the callers)."""
    if isinstance(value, (np.integer, np.floating)) and not isinstance(value, np.bool_):
        return value.item()
    return value


def check_stats_params(success_above: Any, half_life: Any, url: str) -> tuple[float, float]:
    success_above, half_life = _real(success_above), _real(half_life)
    if isinstance(success_above, bool) or not isinstance(success_above, (int, float)):
        raise InvalidDataError(f"success_above for {url} must be a number, not {success_above!r}")
    if not math.isfinite(success_above):
        raise InvalidDataError(f"success_above for {url} must be finite, not {success_above}")
    if (
        isinstance(half_life, bool)
        or not isinstance(half_life, (int, float))
        or not math.isfinite(half_life)
        or half_life <= 0
    ):
        raise InvalidDataError(
            f"half_life for {url} must be a positive number of steps, not {half_life!r}"
        )
    return float(success_above), float(half_life)


def check_rows_version(value: Any, url: str) -> int:
    """``rows_version=``: the version the outcomes' rows were read at (their row numbers mean
    that version's rows), a version number."""
    number = whole(value)  # numpy's integers too (a batch's max version); never a bool
    if number is None or number < 0:
        raise InvalidDataError(
            f"rows_version for {url} must be the version number the outcomes' rows were read "
            f"at (an int >= 0), not {value!r}"
        )
    return number
