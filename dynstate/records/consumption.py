"""What a training step consumed, as a record (pure, no I/O): the rows it drew, the groups it
trained, filtered out or dropped (with the reason) and the accepted groups it carries to the
next step with their scores, plus the sampler position after its draws and the settings that
produced it. The record is stored in the commit record of the step's round
(docs/format.md, "Consumption"); :mod:`dynstate.loading.consumption` makes it,
:mod:`dynstate.log.consumption` finds it again.

Rows are plain row numbers of the record's ``rows_version``, the newest version the step's rows
were drawn from: row ``r`` of a version is row ``r`` of every later version of its lineage
(SPEC §3.4), so rows drawn in an epoch that pinned an older version keep their numbers.

The check is also the exactly-once equation of one step: the groups carried in plus the rows
drawn are, as a multiset, the groups trained plus filtered plus dropped plus carried out (plus,
in a format-2 record, the rows still in flight).

Format 2 (asynchronous trainers, :mod:`dynstate.verl.v1_async`) adds ``in_flight``: rows drawn
and submitted for generation but neither trained nor dropped when the step's round committed,
which have no scores yet (a group carried with scores stays in ``carry``). A format-1 record is
byte for byte what it was; a dynstate that knows only format 1 refuses a format-2 record by its
format number.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections import Counter
from typing import Any

from ..errors import InvalidDataError
from . import codec
from .outcomes import check_generator_state

CONSUMPTION_FORMAT = 1
ASYNC_FORMAT = 2  # format 1 plus in_flight
FORMATS = (CONSUMPTION_FORMAT, ASYNC_FORMAT)
# The record lives in the commit record, which every lineage walk may read: 1 MiB of JSON is
# ~40,000 drawn rows or a carry of 2,048 groups of 16 scores, far beyond a step's batch.
MAX_RECORD_BYTES = 2**20
MAX_GROUPS = 2**16  # per list of one step
MAX_SCORES = 4096  # responses per group
# Why a row drawn was not trained and not carried (filtered rows have their own list).
DROP_REASONS = ("surplus", "stale", "failed")
KEYS = (
    "format",
    "step",
    "rows_version",
    "settings",
    "carried_in",
    "drawn",
    "gen_batches",
    "trained",
    "filtered",
    "dropped",
    "carry",
    "sampler",
)
ASYNC_KEYS = (*KEYS, "in_flight")


def _bad(url: str, why: str) -> InvalidDataError:
    return InvalidDataError(
        f"consumption for {url}: {why}; nothing was committed — pass the record "
        "DynamicSampling.next_batch returned (StepBatch.record), unchanged"
    )


def _index(value: Any, url: str, where: str) -> int:
    if type(value) is not int or not 0 <= value <= codec.MAX_COUNT:
        raise _bad(url, f"{where} holds {value!r}, not a row number (an int >= 0)")
    return value


def _indices(value: Any, url: str, where: str) -> list[int]:
    if type(value) is not list:
        raise _bad(url, f"{where} must be a list, not {type(value).__name__}")
    if len(value) > MAX_GROUPS:
        raise _bad(url, f"{where} lists {len(value):,} groups, over the limit of {MAX_GROUPS:,}")
    # the common case in one pass (a step's lists run to thousands); any bad entry is then
    # found again one by one, for the message that names it
    if all(type(v) is int for v in value) and (
        not value or (min(value) >= 0 and max(value) <= codec.MAX_COUNT)
    ):
        return list(value)
    return [_index(v, url, f"{where}[{i}]") for i, v in enumerate(value)]


def check_scores(value: Any, url: str, where: str) -> list[float]:
    """A group's scores as stored: a non-empty list of finite numbers (bools refused)."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise InvalidDataError(
            f"{where} for {url} must be a list of a group's scores, not {type(value).__name__}"
        )
    if not 0 < len(value) <= MAX_SCORES:
        raise InvalidDataError(
            f"{where} for {url} holds {len(value)} scores; a group has 1 to {MAX_SCORES}"
        )
    if type(value) is list and all(type(s) is float and s - s == 0.0 for s in value):
        return list(value)  # finite floats already (inf - inf and nan - nan are nan)
    out = []
    for s in value:
        number = _score(s)
        if number is None or not math.isfinite(number):
            raise InvalidDataError(
                f"{where} for {url} holds {s!r}, not a finite number (a Python or numpy int "
                "or float, or a one-element tensor; not a bool)"
            )
        out.append(number)
    return out


# The dtypes a score may have, as numpy and torch name them (torch's without "torch.").
_NUMERIC = re.compile(
    r"u?int(8|16|32|64)|float(16|32|64)|bfloat16|half|float|double|long|int|short"
)


def _score(s: Any) -> float | None:
    """``s`` as a float if it is one number as a reward function returns it: a Python or
    numpy int or float, or a 0-d or one-element array or tensor of an integer or float dtype;
    else None (a bool, text, a complex number, an int past float's range)."""
    if isinstance(s, bool):
        return None  # True is not a score: a pass/fail reward is 1.0 / 0.0
    dtype = getattr(s, "dtype", None)
    if dtype is None:
        if not isinstance(s, numbers.Real):
            return None
        try:
            return float(s)
        except (OverflowError, TypeError, ValueError):
            return None
    if not _NUMERIC.fullmatch(str(dtype).removeprefix("torch.")):
        return None  # bool, str, bytes, complex, object: not a reward
    if tuple(getattr(s, "shape", ())) not in ((), (1,)):
        return None
    try:
        return float(s.item() if hasattr(s, "item") else s)
    except (OverflowError, TypeError, ValueError):
        return None


def _pairs(value: Any, url: str, where: str, second: str) -> list[list[Any]]:
    if type(value) is not list:
        raise _bad(url, f"{where} must be a list, not {type(value).__name__}")
    if len(value) > MAX_GROUPS:
        raise _bad(url, f"{where} lists {len(value):,} groups, over the limit of {MAX_GROUPS:,}")
    out = []
    for i, pair in enumerate(value):
        if type(pair) is not list or len(pair) != 2:
            raise _bad(url, f"{where}[{i}] must be [index, {second}], not {pair!r}")
        out.append([_index(pair[0], url, f"{where}[{i}][0]"), pair[1]])
    return out


def check_record(record: Any, url: str, step: Any = None) -> dict[str, Any]:
    """``record`` as stored (a copy through JSON), or :class:`InvalidDataError`: every key of
    :data:`KEYS`, each of its type and bound, and the step's exactly-once equation.
    ``step``: the round's ``meta["step"]``, which the record's step must equal."""
    if type(record) is not dict:
        raise _bad(url, f"the record must be a dict, not {type(record).__name__}")
    form = record.get("format")
    if type(form) is not int or form not in FORMATS:
        raise _bad(url, f"format {form!r} is not one of {FORMATS}")
    keys = ASYNC_KEYS if form == ASYNC_FORMAT else KEYS
    if set(record) != set(keys):
        missing, extra = set(keys) - set(record), set(record) - set(keys)
        raise _bad(url, f"keys missing {sorted(missing)}, unknown {sorted(extra)}")
    own = record["step"]
    if type(own) is not int or own < 0:
        raise _bad(url, f"step {own!r} is not an int >= 0")
    if step is not None and (type(step) is not int or step != own):
        raise _bad(url, f"the record is of step {own} but the round's meta['step'] is {step!r}")
    rows_version = record["rows_version"]
    if rows_version is not None and (type(rows_version) is not int or rows_version < 0):
        raise _bad(url, f"rows_version {rows_version!r} is not a version (an int >= 0) or None")
    if type(record["gen_batches"]) is not int or record["gen_batches"] < 0:
        raise _bad(url, f"gen_batches {record['gen_batches']!r} is not an int >= 0")
    if type(record["settings"]) is not dict or type(record["sampler"]) is not dict:
        raise _bad(url, "settings and sampler must be dicts of plain types")
    carried_in = _indices(record["carried_in"], url, "carried_in")
    drawn = _indices(record["drawn"], url, "drawn")
    trained = _indices(record["trained"], url, "trained")
    filtered = _pairs(record["filtered"], url, "filtered", "spread")
    for i, (_, spread) in enumerate(filtered):
        if isinstance(spread, bool) or not isinstance(spread, (int, float)):
            raise _bad(url, f"filtered[{i}][1] is {spread!r}, not a number (the group's std)")
        if not math.isfinite(float(spread)):
            raise _bad(url, f"filtered[{i}][1] is {spread!r}, not finite")
    dropped = _pairs(record["dropped"], url, "dropped", "reason")
    for i, (_, reason) in enumerate(dropped):
        if reason not in DROP_REASONS:
            raise _bad(url, f"dropped[{i}][1] is {reason!r}, not one of {DROP_REASONS}")
    in_flight = _indices(record["in_flight"], url, "in_flight") if form == ASYNC_FORMAT else []
    carry = _pairs(record["carry"], url, "carry", "scores")
    for i, pair in enumerate(carry):
        pair[1] = check_scores(pair[1], url, f"consumption carry[{i}][1]")
    bound = record["settings"].get("max_carry")
    if type(bound) is int and len(carry) > bound:
        raise InvalidDataError(
            f"consumption for {url}: step {own} carries {len(carry)} groups, over its "
            f"max_carry={bound}; nothing was committed — raise max_carry or pass surplus='drop'"
        )
    # the equation as sorted lists (a multiset compare); Counters only to name what differs
    into_sorted = sorted([*carried_in, *drawn])
    out_sorted = sorted(
        [
            *trained,
            *(i for i, _ in filtered),
            *(i for i, _ in dropped),
            *(i for i, _ in carry),
            *in_flight,
        ]
    )
    if into_sorted != out_sorted:
        into, out = Counter(into_sorted), Counter(out_sorted)
        lost, unseen = sorted((into - out).elements())[:8], sorted((out - into).elements())[:8]
        raise _bad(
            url,
            "carried_in + drawn must equal trained + filtered + dropped + carry + in_flight "
            f"(each row exactly once); missing from the outcome {lost}, not drawn {unseen}",
        )
    try:
        plain = check_generator_state(
            {"settings": record["settings"], "sampler": record["sampler"]}, url
        )
        text = codec.dumps(record, allow_nan=False)
    except (InvalidDataError, TypeError, ValueError) as exc:
        raise _bad(url, f"settings and sampler must be plain JSON types ({exc})") from exc
    if len(text) > MAX_RECORD_BYTES:
        raise _bad(
            url,
            f"the record is {len(text):,} bytes of JSON, over the limit of {MAX_RECORD_BYTES:,}"
            " (fewer groups per step, or a smaller max_carry)",
        )
    if rows_version is None and indices_of(record):
        raise _bad(url, "rows_version is None but the record names rows")
    out_record = json.loads(text)
    out_record.update(plain)
    return dict(out_record)


def indices_of(record: dict[str, Any]) -> list[int]:
    """Every index a checked record names."""
    return [
        *record["carried_in"],
        *record["drawn"],
        *record["trained"],
        *(i for i, _ in record["filtered"]),
        *(i for i, _ in record["dropped"]),
        *(i for i, _ in record["carry"]),
        *record.get("in_flight", ()),
    ]
