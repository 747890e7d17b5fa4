"""Sampler state validation: the plain, versioned dict that :class:`VersionedSampler`
checkpoints, checked in full (keys, types, ranges, format) before anything uses it, and found
wherever torchdata nested it inside a StatefulDataLoader state."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import InvalidDataError, StateMismatchError, UnsupportedFormatError
from ..records.codec import MAX_COUNT, int_fits
from ..records.inputs import check_plain

STATE_FORMAT = 4  # written only when asked for within a step (see within_step); else 2 or 3
SELECT_FORMAT = 3  # written by a sampler with a selection policy
WITHIN_FORMAT = 4  # holds ``within_step``: this rank's indices of the step at the position
# already handed out, when the state is asked for between two of them
STATE_KIND = "dynstate.VersionedSampler"
MODES = ("epoch", "mix")
_MAX_ROWS = 2**40  # rows of one version; an index carries its row in 40 bits

__all__ = ["Position", "check_state", "find_sampler_state"]


# Values of a state quoted in messages: a few levels and items of them, never the whole
# (a select nested 50,000 deep would overflow repr's recursion; a huge list, the message).
class _Quote(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int past this process's int string limit raises ValueError
        if x.bit_length() > 2000:
            return f"<an int of {x.bit_length():,} bits>"
        return super().repr_int(x, level)


_QUOTE = _Quote()
_QUOTE.maxlevel, _QUOTE.maxdict, _QUOTE.maxlist = 3, 4, 4
_QUOTE.maxstring = _QUOTE.maxother = 60

# The range of every int field of a state (seed: any int every reader of the store parses,
# dynstate.records.codec.int_fits). The sampler's constructor (check_settings) and check_state apply
# the same table, so every state a sampler writes loads, whatever the writing process's
# settings, and nothing larger reaches the sampler's arithmetic or a JSON view of a state.
_RANGES: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("batch_size", "lag", "num_replicas"), (1, _MAX_ROWS - 1)),
    **dict.fromkeys(("version", "fresh_version"), (0, MAX_COUNT)),
    **dict.fromkeys(
        ("epoch", "base_rows", "position", "base_next", "step", "fresh_next"), (0, _MAX_ROWS - 1)
    ),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


_INT = "int"
_FIELDS: dict[str, tuple[str, bool]] = {  # key: (type, may be None)
    "store_id": ("str", False),
    "store_url": ("str", False),
    "mode": ("str", False),
    "shuffle": ("bool", False),
    "seed": (_INT, False),
    "batch_size": (_INT, True),
    "fresh_share": ("float", False),
    "lag": (_INT, False),
    "epoch": (_INT, False),
    "version": (_INT, True),
    "base_rows": (_INT, False),
    "position": (_INT, False),
    "step": (_INT, False),
    "fresh_next": (_INT, False),
    "fresh_version": (_INT, True),
}
_FIELDS_2: dict[str, tuple[str, bool]] = {
    "drop_last": ("bool", False),
    "num_replicas": (_INT, False),
    "base_next": (_INT, False),
}


# How deep a selection policy's identity (the state's ``select``) may nest.
MAX_SELECT_DEPTH = 8


def _plain(value: Any) -> bool:
    """Whether ``value`` is plain data (what a policy's identity may hold), by the one rule
    of :func:`dynstate.records.inputs.check_plain`."""
    try:
        check_plain(value, "select", "select", depth=MAX_SELECT_DEPTH)
    except InvalidDataError:
        return False
    return True


def _type_ok(value: Any, kind: str) -> bool:
    # Exact plain types: a state is loaded with torch.load(weights_only=True) and compared and
    # counted with Python's ints; np.int64(0) would pass a check and overflow later.
    if kind == _INT:
        return type(value) is int
    if kind == "bool":
        return type(value) is bool
    if kind == "float":
        return type(value) in (int, float)
    return type(value) is str


def _type_name(value: Any) -> str:
    module = type(value).__module__.split(".")[0]
    return type(value).__name__ if module == "builtins" else f"{module}.{type(value).__name__}"


def check_state(state: Any, store_id: str, url: str) -> dict[str, Any]:
    """Validate a sampler state dict in full (keys, types, ranges, format) against the store it
    is loaded into; returns it in the current format. Raises :class:`StateMismatchError`
    (:class:`UnsupportedFormatError` for a newer format) and changes nothing."""
    if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
        raise StateMismatchError(
            f"not a dynstate sampler state (for {url}); pass the dict VersionedSampler."
            "state_dict() returned, or use dynstate.find_sampler_state(loader_state)"
        )
    fmt = state.get("format")
    if type(fmt) is not int or fmt < 1:
        raise StateMismatchError(
            f"sampler state for {url} has format={_QUOTE.repr(fmt)} ({_type_name(fmt)}), not "
            "a valid format number (a plain int >= 1); it was not written by VersionedSampler"
        )
    if fmt > STATE_FORMAT:
        raise UnsupportedFormatError(
            f"sampler state format {fmt} is newer than this dynstate supports "
            f"({STATE_FORMAT}); upgrade dynstate to resume {url}"
        )
    fields = dict(_FIELDS, **(_FIELDS_2 if fmt >= 2 else {}))
    missing = sorted(k for k in fields if k not in state)
    if missing:
        raise StateMismatchError(
            f"sampler state for {url} lacks {', '.join(missing)}; it is damaged or was not "
            "written by VersionedSampler.state_dict()"
        )
    for key, (kind, nullable) in fields.items():
        value = state[key]
        if not (value is None and nullable) and not _type_ok(value, kind):
            raise StateMismatchError(
                f"sampler state for {url} has {key}={_QUOTE.repr(value)} "
                f"({_type_name(value)}); expected a plain {kind}"
                f"{' or None' if nullable else ''} — pass the dict "
                "VersionedSampler.state_dict() returned, with plain Python values "
                "(numpy values: .item())"
            )
    if state["store_id"] != store_id:
        raise StateMismatchError(
            f"this state belongs to store {state['store_id']} ({state['store_url']}), not to "
            f"{url} (store {store_id}); resume with the store the checkpoint was written for"
        )
    out = {k: state[k] for k in fields}
    out["format"] = fmt
    out["select"] = None  # formats 1 and 2: no selection policy
    if fmt >= SELECT_FORMAT:
        if "select" not in state:
            raise StateMismatchError(
                f"sampler state for {url} (format {fmt}) lacks select; it is damaged or was "
                "not written by VersionedSampler.state_dict()"
            )
        select = state["select"]
        if select is not None and not (
            _plain(select)
            and isinstance(select, dict)
            and isinstance(select.get("policy"), str)
            and isinstance(select.get("params"), dict)
        ):
            raise StateMismatchError(
                f"sampler state for {url} has select={_QUOTE.repr(select)}; expected None or "
                '{"policy": str, "params": dict} of plain types at most 8 levels deep, as '
                "VersionedSampler.state_dict() writes it"
            )
        out["select"] = select
    out["within_step"] = 0
    if fmt >= WITHIN_FORMAT:
        within = state.get("within_step")
        if type(within) is not int or not 0 <= within < _MAX_ROWS:
            raise StateMismatchError(
                f"sampler state for {url} (format {fmt}) has within_step="
                f"{_QUOTE.repr(within)}; expected a plain int in [0, 2**40), as "
                "VersionedSampler.state_dict() writes it"
            )
        if within and (state["version"] is None or state["batch_size"] is None):
            raise StateMismatchError(
                f"sampler state for {url} is inconsistent: within_step={within} without a "
                "pinned version and a batch_size"
            )
        out["within_step"] = within
    if fmt == 1:
        # Format 1 counted only base rows in ``position``; slots include the fresh ones drawn.
        fresh_drawn = state["fresh_next"] - state["base_rows"] if state["mode"] == "mix" else 0
        out.update(
            drop_last=False,
            num_replicas=1,
            base_next=state["position"],
            position=min(state["base_rows"], state["position"] + max(0, fresh_drawn)),
        )
    if state["mode"] == "epoch":
        out["base_next"] = out["position"]  # one counter in epoch mode: keep them in step
    _check_ranges(out, url)
    return out


def _out_of_range(key: str, value: Any) -> str | None:
    """What is wrong with an int field's ``value`` (not None) of a state, or None."""
    if key == "seed":
        if int_fits(value):
            return None
        return f"seed={_QUOTE.repr(value)} is past the integers a store's readers parse"
    low, high = _RANGES[key]
    if low <= value <= high:
        return None
    return f"{key}={_QUOTE.repr(value)} is out of range [{low}, {high}]"


def check_settings(values: dict[str, Any], select: Any) -> None:
    """InvalidDataError unless the settings a :class:`VersionedSampler` writes into its state
    (``values``: seed, batch_size, lag, num_replicas — None where unset — and its policy's
    identity ``select``) lie within the bounds :func:`check_state` applies when the state is
    loaded: a sampler refuses at construction what no resume could accept."""
    for key, value in values.items():
        problem = None if value is None else _out_of_range(key, value)
        if problem is not None:
            raise InvalidDataError(f"{problem}; a sampler state must load in any process")
    if select is not None and not _plain(select):
        raise InvalidDataError(
            f"the selection policy's identity {_QUOTE.repr(select)} is not plain data of "
            "at most 8 levels with integers every reader parses; it goes into the sampler "
            "state — give the policy plainer params"
        )


def _check_ranges(s: dict[str, Any], url: str) -> None:
    def bad(what: str) -> StateMismatchError:
        return StateMismatchError(f"sampler state for {url} is inconsistent: {what}")

    # First the bounds of every int field (messages below print the values)
    for key in ("seed", *_RANGES):
        problem = None if s[key] is None else _out_of_range(key, s[key])
        if problem is not None:
            raise bad(problem)
    if s["mode"] not in MODES:
        raise bad(f"mode={s['mode']!r} is not one of {MODES}")
    if s["batch_size"] is not None and s["batch_size"] < 1:
        raise bad(f"batch_size={s['batch_size']} is below 1")
    if s["num_replicas"] < 1:
        raise bad(f"num_replicas={s['num_replicas']} is below 1")
    if not 0.0 < s["fresh_share"] <= 1.0 or s["lag"] < 1:
        raise bad(f"fresh_share={s['fresh_share']} / lag={s['lag']} out of range")
    for key in ("epoch", "base_rows", "position", "base_next", "step", "fresh_next"):
        if not 0 <= s[key] < _MAX_ROWS:
            raise bad(f"{key}={s[key]} is out of range [0, 2**40)")
    if s["version"] is None:
        if s["position"] or s["base_rows"] or s["fresh_version"] is not None:
            raise bad("no version is pinned, yet a position/base_rows/fresh_version is set")
        return
    if s["version"] < 0 or s["position"] > s["base_rows"] or s["base_next"] > s["position"]:
        raise bad(
            f"position={s['position']} / base_next={s['base_next']} do not fit version "
            f"{s['version']} of {s['base_rows']} rows"
        )
    if s["fresh_version"] is None or s["fresh_version"] < s["version"]:
        raise bad(f"fresh_version={s['fresh_version']} is older than version={s['version']}")
    if s["fresh_next"] < s["base_rows"]:
        raise bad(f"fresh_next={s['fresh_next']} is below base_rows={s['base_rows']}")


def find_sampler_state(loader_state: Any) -> dict[str, Any] | None:
    """The VersionedSampler state inside a StatefulDataLoader state dict (e.g. verl's
    ``data.pt``), wherever torchdata nested it; None if there is none. Looked for at most
    32 levels down (torchdata nests it a few): a deeper, damaged state is not followed down
    to Python's recursion limit."""
    return _find_state(loader_state, 32)


def _find_state(value: Any, depth: int) -> dict[str, Any] | None:
    if depth < 0:
        return None
    if isinstance(value, dict):
        if value.get("kind") == STATE_KIND:
            return value
        children: Any = value.values()
    elif isinstance(value, (list, tuple)):
        children = value
    else:
        return None
    for child in children:
        found = _find_state(child, depth - 1)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class Position:
    """Where a sampler is, as one immutable value — the same on every rank: which epoch, over
    which pinned version (and its row count), how far in, which step comes next and, in mix
    mode, the next fresh row and the newest version read for fresh rows. Its plain-types form
    is the position part of the sampler state (:meth:`state`, :meth:`from_state`)."""

    epoch: int = 0
    version: int | None = None
    base_rows: int = 0
    slot: int = 0  # slots of the epoch handed out, all ranks together (state key "position")
    base_next: int = 0  # next position of the epoch's permutation (mix mode: <= slot)
    step: int = 0  # the next step's number
    fresh_next: int = 0
    fresh_version: int | None = None

    def started(self, version: int, rows: int, *, next_epoch: bool) -> Position:
        """The position at the start of an epoch pinning ``version`` of ``rows`` rows."""
        epoch = self.epoch + 1 if next_epoch else self.epoch
        return replace(
            self,
            epoch=epoch,
            version=version,
            base_rows=rows,
            slot=0,
            base_next=0,
            fresh_next=rows,
            fresh_version=version,
        )

    def state(self, mode: str) -> dict[str, Any]:
        """The position's keys of the sampler state, plain types."""
        return {
            "epoch": self.epoch,
            "version": self.version,
            "base_rows": self.base_rows,
            "position": self.slot,
            "base_next": self.slot if mode == "epoch" else self.base_next,
            "step": self.step,
            "fresh_next": self.fresh_next,
            "fresh_version": self.fresh_version,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Position:
        """The position of a state :func:`check_state` accepted."""
        return cls(
            epoch=state["epoch"],
            version=state["version"],
            base_rows=state["base_rows"],
            slot=state["position"],
            base_next=state["base_next"],
            step=state["step"],
            fresh_next=state["fresh_next"],
            fresh_version=state["fresh_version"],
        )
