"""Selection policies: which rows a step draws, by how the policy did on them.

A policy maps the per-row statistics table of one version (``Store.outcome_stats``: one row
per store row, ``attempts``, ``successes``, ``mean_score``, ...) and the step to a *plan*: one
or more strata, each a share of the step's slots and a non-negative weight per row. The
sampler draws each stratum's slots with replacement, in proportion to its weights, from a
random stream keyed by ``(seed, epoch, step)`` — so a step's rows are a pure function of the
seed, the step, the batch layout and the statistics of a version the sampler fixes by a rule
on the store's history (see ``docs/resume.md``, "Selection"). Nothing is replayed on resume:
a step's draw needs its key and its version's statistics only.

Built-ins (plain, comparable parameters that go into the sampler state):

* :class:`PassRateBand` — rows with ``lo <= pass_rate <= hi`` (rows never tried: in or out);
* :class:`Learnability` — weights ``p * (1 - p)``, at least ``floor``, ``neutral`` for rows
  never tried;
* :class:`DifficultyPools` — named pools by pass-rate bounds, each a fixed share of every step;
* :class:`FunctionPolicy` — a user's pure function ``fn(stats, step)`` returning weights
  (floats) or eligibility (bools), identified in the state by its name.

``pass_rate`` is ``successes / attempts`` (a success is a score above ``success_above``, 0.5
by default: the statistics are read with the store's defaults, which are incremental).
"""

from __future__ import annotations

import importlib
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import InvalidDataError

__all__ = [
    "DifficultyPools",
    "FunctionPolicy",
    "Learnability",
    "PassRateBand",
    "Plan",
    "Policy",
    "as_policy",
    "check_weights",
    "pass_rates",
    "step_rng",
]

_SALT = 0x5E1EC7  # keeps a selection's stream apart from any other use of the same seed


def pass_rates(stats: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """``(pass_rate, tried)`` per row of a statistics table: ``successes / attempts`` (NaN
    where a row was never tried) and whether it was."""
    attempts = stats.column("attempts").to_numpy(zero_copy_only=False)
    successes = stats.column("successes").to_numpy(zero_copy_only=False)
    tried = attempts > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.divide(successes, attempts, dtype=np.float64)  # NaN where never tried
    return rate, tried


def step_rng(seed: int, epoch: int, step: int) -> np.random.Generator:
    """The random stream of one step's draw: a function of ``(seed, epoch, step)`` only."""
    mask = (1 << 64) - 1
    return np.random.Generator(np.random.PCG64([seed & mask, epoch & mask, step & mask, _SALT]))


def check_weights(values: Any, num_rows: int, where: str) -> np.ndarray:
    """``values`` as float64 weights of ``num_rows`` rows (bools: 1 eligible, 0 not); a
    wrong length, a negative, NaN or infinite weight, or all zero raise
    :class:`InvalidDataError` naming ``where`` (the policy, step and version)."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        if values.null_count:
            raise InvalidDataError(
                f"{where} returned {values.null_count} null weights; return a weight for "
                "every row (0 to leave a row out)"
            )
        values = values.to_numpy(zero_copy_only=False)
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise InvalidDataError(f"{where} returned {type(values).__name__}, not an array") from exc
    if arr.ndim != 1:
        raise InvalidDataError(
            f"{where} returned an array of shape {arr.shape}; return one weight per row "
            f"(a 1-d array of {num_rows})"
        )
    if len(arr) != num_rows:
        raise InvalidDataError(
            f"{where} returned {len(arr)} weights for a statistics table of {num_rows} rows; "
            "return one weight (or bool) per row of the table, in row order"
        )
    if arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.number):
        weights = arr.astype(np.float64, copy=False)
    else:
        raise InvalidDataError(
            f"{where} returned {arr.dtype} values; return floats (weights) or bools (eligibility)"
        )
    # one pass finds NaN and negatives alike (both fail >= 0); the message tells them apart
    bad = ~(weights >= 0)
    if bad.any():
        first = int(np.argmax(bad))
        if np.isnan(weights).any():
            raise InvalidDataError(
                f"{where} returned NaN weights (first at row {int(np.argmax(np.isnan(weights)))}); "
                "give rows never tried a number (e.g. a neutral weight), NaN cannot be drawn"
            )
        raise InvalidDataError(
            f"{where} returned negative weights (row {first}: {weights[first]}); weights "
            "must be >= 0 (0 leaves a row out)"
        )
    if num_rows and weights.max() == np.inf:
        raise InvalidDataError(f"{where} returned infinite weights; return finite numbers")
    if num_rows and not weights.any():
        raise InvalidDataError(
            f"{where} gives every one of the {num_rows} rows weight 0: nothing can be drawn; "
            "widen the band / raise the floor, or include rows never tried"
        )
    return weights


# -- the plan a policy yields ------------------------------------------------------------


@dataclass
class _Stratum:
    share: float
    cdf: np.ndarray
    total: float
    last: int  # the last row of positive weight: a draw rounding up to the total lands here


@dataclass
class Plan:
    """Strata of one step's draw: ``(share, weights)`` pairs. Built once per statistics
    version (and per step for a policy that reads the step); drawing costs
    O(k log n) for k slots over n rows."""

    num_rows: int
    strata: list[_Stratum] = field(default_factory=list)

    @classmethod
    def of(cls, num_rows: int, parts: Sequence[tuple[float, np.ndarray]], where: str) -> Plan:
        strata = []
        for share, weights in parts:
            if share <= 0 or not len(weights):
                continue
            cdf = np.cumsum(weights)
            total = float(cdf[-1])
            if total <= 0:
                continue  # an empty pool's share goes to the others
            # the last row of positive weight: where the cumulative sum first reaches its total
            last = int(np.searchsorted(cdf, total, side="left"))
            strata.append(_Stratum(share, cdf, total, last))
        if num_rows and not strata:
            raise InvalidDataError(
                f"{where} leaves no row that can be drawn (every pool empty or weighted 0); "
                "change the pools' bounds or shares"
            )
        return cls(num_rows, strata)

    def counts(self, count: int) -> list[int]:
        """Slots of each stratum among ``count``: shares by largest remainder (ties to the
        first stratum), so every step gets each share as closely as whole slots allow."""
        total = sum(s.share for s in self.strata)
        exact = [count * s.share / total for s in self.strata]
        out = [math.floor(x) for x in exact]
        order = sorted(range(len(exact)), key=lambda i: (out[i] - exact[i], i))
        for i in order[: count - sum(out)]:
            out[i] += 1
        return out

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` rows, with replacement, each stratum's in proportion to its weights."""
        if count <= 0 or not self.strata:
            return np.zeros(0, np.int64)
        parts = []
        for stratum, n in zip(self.strata, self.counts(count), strict=True):
            u = rng.random(n) * stratum.total
            rows = np.searchsorted(stratum.cdf, u, side="right")
            parts.append(np.minimum(rows, stratum.last))
        rows = np.concatenate(parts)
        if len(parts) > 1:
            rows = rows[rng.permutation(len(rows))]  # every rank's share mixes the pools
        return rows.astype(np.int64)


# -- policies ----------------------------------------------------------------------------


class Policy:
    """A selection policy: ``parts(stats, step)`` returns ``[(share, weights), ...]``.

    ``name`` and ``params()`` (plain types) identify it in the sampler state: a resume with
    another policy, or other parameters, is refused. ``uses_step``: whether the weights depend
    on the step (then they are rebuilt every step, else once per statistics version)."""

    name = "policy"
    uses_step = False

    def params(self) -> dict[str, Any]:
        return {}

    def identity(self) -> dict[str, Any]:
        return {"policy": self.name, "params": self.params()}

    def parts(self, stats: pa.Table, step: int) -> list[tuple[float, np.ndarray]]:
        raise NotImplementedError

    def plan(self, stats: pa.Table, step: int, where: str) -> Plan:
        return Plan.of(stats.num_rows, self.parts(stats, step), where)


def _number(value: Any, name: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise InvalidDataError(f"{name} must be a number, not {value!r}")
    value = float(value)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise InvalidDataError(f"{name} must be in [{lo}, {hi}], not {value!r}")
    return value


class PassRateBand(Policy):
    """Rows whose pass rate lies in ``[lo, hi]`` are eligible, each drawn equally often;
    rows never tried are eligible when ``untried`` (the default) — else they wait until
    something else trains on them, which in this sampler never happens: keep it True unless
    rows get outcomes some other way."""

    name = "band"

    def __init__(self, lo: float = 0.0, hi: float = 1.0, *, untried: bool = True) -> None:
        self.lo = _number(lo, "the band's lo", 0.0, 1.0)
        self.hi = _number(hi, "the band's hi", 0.0, 1.0)
        if self.lo > self.hi:
            raise InvalidDataError(
                f"a pass-rate band with lo={self.lo} > hi={self.hi} holds no row; pass "
                "lo <= hi (e.g. PassRateBand(0.1, 0.9))"
            )
        if not isinstance(untried, bool):
            raise InvalidDataError(f"untried must be True or False, not {untried!r}")
        self.untried = untried

    def params(self) -> dict[str, Any]:
        return {"lo": self.lo, "hi": self.hi, "untried": self.untried}

    def eligible(self, stats: pa.Table) -> np.ndarray:
        rate, tried = pass_rates(stats)
        with np.errstate(invalid="ignore"):
            inside = tried & (rate >= self.lo) & (rate <= self.hi)
        return inside | (~tried if self.untried else False)

    def parts(self, stats: pa.Table, step: int) -> list[tuple[float, np.ndarray]]:
        eligible = self.eligible(stats)
        where = f"the pass-rate band [{self.lo}, {self.hi}] (untried={self.untried})"
        return [(1.0, check_weights(eligible, stats.num_rows, where))]


class Learnability(Policy):
    """Weights ``max(p * (1 - p), floor)`` by pass rate ``p`` (tasks solved half the time
    weigh most), ``neutral`` for rows never tried (0.25 by default: as much as ``p = 0.5``)."""

    name = "learnability"

    def __init__(self, *, floor: float = 0.01, neutral: float = 0.25) -> None:
        self.floor = _number(floor, "learnability's floor", 0.0, 0.25)
        self.neutral = _number(neutral, "learnability's neutral weight", 0.0)
        if self.floor == 0 and self.neutral == 0:
            raise InvalidDataError(
                "learnability with floor=0 and neutral=0 can weigh every row 0; give one of "
                "them a positive value"
            )

    def params(self) -> dict[str, Any]:
        return {"floor": self.floor, "neutral": self.neutral}

    def weights(self, stats: pa.Table) -> np.ndarray:
        rate, tried = pass_rates(stats)
        learn = rate * (1.0 - rate)  # in place from here: this runs over every row
        np.maximum(learn, self.floor, out=learn)  # NaN (never tried) stays NaN
        learn[~tried] = self.neutral
        return learn

    def parts(self, stats: pa.Table, step: int) -> list[tuple[float, np.ndarray]]:
        where = f"learnability (floor={self.floor}, neutral={self.neutral})"
        return [(1.0, check_weights(self.weights(stats), stats.num_rows, where))]


class DifficultyPools(Policy):
    """Named pools by pass rate, each a fixed share of every step.

    ``bounds`` (increasing, inside (0, 1)) cut ``[0, 1]`` into ``len(bounds) + 1`` pools named
    by ``names``, lowest pass rate first: pool ``i`` holds rates in ``[bounds[i-1],
    bounds[i])`` (the last one up to 1 included). ``shares`` (one per pool, >= 0) are each
    pool's share of a step's slots; a pool with no row gives its share to the others in
    proportion. Rows never tried join the pool ``unseen``. Within a pool rows are drawn
    equally often::

        DifficultyPools([0.2, 0.8], ["hard", "medium", "easy"], [0.3, 0.6, 0.1], unseen="medium")
    """

    name = "pools"

    def __init__(
        self,
        bounds: Sequence[float],
        names: Sequence[str],
        shares: Sequence[float],
        *,
        unseen: str,
    ) -> None:
        bounds = [_number(b, "a pool bound", 0.0, 1.0) for b in bounds]
        if any(not 0 < b < 1 for b in bounds) or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise InvalidDataError(
                f"pool bounds {bounds} must increase strictly inside (0, 1), e.g. [0.2, 0.8]"
            )
        names = list(names)
        if len(names) != len(bounds) + 1 or not all(isinstance(n, str) and n for n in names):
            raise InvalidDataError(
                f"{len(bounds)} bounds make {len(bounds) + 1} pools; pass as many names "
                f"(non-empty strings), not {names!r}"
            )
        if len(set(names)) != len(names):
            raise InvalidDataError(f"pool names must differ: {names!r}")
        shares = [_number(s, "a pool share", 0.0) for s in shares]
        if len(shares) != len(names) or not sum(shares) > 0:
            raise InvalidDataError(
                f"pass one share (>= 0) per pool ({len(names)}: {names}), not all 0; got {shares!r}"
            )
        if unseen not in names:
            raise InvalidDataError(f"unseen={unseen!r} names no pool; pick one of {names}")
        self.bounds, self.names, self.shares, self.unseen = bounds, names, shares, unseen

    def params(self) -> dict[str, Any]:
        return {
            "bounds": list(self.bounds),
            "names": list(self.names),
            "shares": list(self.shares),
            "unseen": self.unseen,
        }

    def pool_of(self, stats: pa.Table) -> np.ndarray:
        """The pool number of every row."""
        rate, tried = pass_rates(stats)
        pool = np.searchsorted(np.asarray(self.bounds), np.nan_to_num(rate), side="right")
        return np.where(tried, pool, self.names.index(self.unseen))

    def parts(self, stats: pa.Table, step: int) -> list[tuple[float, np.ndarray]]:
        pool = self.pool_of(stats)
        return [(share, (pool == i).astype(np.float64)) for i, share in enumerate(self.shares)]


class FunctionPolicy(Policy):
    """A user's policy: ``fn(stats, step)`` returns weights (floats) or eligibility (bools),
    one per row of ``stats``, and must be a pure function of them. On its first use the
    sampler calls it twice with the same inputs and refuses differing answers.

    The state records ``name`` (by default ``module.qualname``) and ``params``: a resume with
    another name or params is refused, but the function's body is not checked — rename it (or
    bump ``params``) when you change what it does. ``uses_step=False`` says the weights do not
    depend on the step, so they are built once per statistics version."""

    name = "function"

    def __init__(
        self,
        fn: Callable[[pa.Table, int], Any],
        *,
        name: str | None = None,
        params: dict[str, Any] | None = None,
        uses_step: bool = True,
    ) -> None:
        if not callable(fn):
            raise InvalidDataError(f"a selection policy must be callable, not {fn!r}")
        if name is None:
            qual = getattr(fn, "__qualname__", None)
            if not isinstance(qual, str) or "<lambda>" in qual or "<locals>" in qual:
                raise InvalidDataError(
                    f"{fn!r} has no stable name to record in the sampler state; wrap it as "
                    "FunctionPolicy(fn, name='my_policy') or define it at module level"
                )
            name = f"{fn.__module__}.{qual}"
        if not isinstance(name, str) or not name:
            raise InvalidDataError(f"a policy name must be a non-empty string, not {name!r}")
        self.fn, self.user_name = fn, name
        self.user_params = _plain(params or {}, f"params of policy {name!r}")
        self.uses_step = bool(uses_step)
        self._checked = False

    def params(self) -> dict[str, Any]:
        return {"name": self.user_name, "params": self.user_params, "uses_step": self.uses_step}

    def parts(self, stats: pa.Table, step: int) -> list[tuple[float, np.ndarray]]:
        where = f"selection policy {self.user_name!r} at step {step}"
        weights = check_weights(self.fn(stats, step), stats.num_rows, where)
        if not self._checked:
            again = check_weights(self.fn(stats, step), stats.num_rows, where)
            if not np.array_equal(weights, again):
                raise InvalidDataError(
                    f"{where} returned different weights for the same statistics and step; "
                    "a policy must be a pure function of (stats, step) for runs to resume "
                    "exactly — draw no random numbers and keep no state in it"
                )
            self._checked = True
        return [(1.0, weights)]


def _plain(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidDataError(f"{where} hold {value!r}; use finite numbers")
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, where) for k, v in value.items()}
    raise InvalidDataError(
        f"{where} hold {type(value).__name__}; use plain types (str, int, float, bool, None, "
        "lists, dicts with str keys): they go into the sampler state"
    )


_BUILT_IN: dict[str, Callable[..., Policy]] = {
    "band": PassRateBand,
    "learnability": Learnability,
    "pools": DifficultyPools,
}


def _from_config(config: dict[str, Any]) -> Policy:
    """A policy from plain config: ``{"policy": "band", "lo": 0.1, "hi": 0.9}``,
    ``{"policy": "learnability", "floor": 0.01}``, ``{"policy": "pools", "bounds": [...],
    "names": [...], "shares": [...], "unseen": "..."}`` or ``{"policy": "function",
    "function": "package.module:fn", "params": {...}, "uses_step": True}``."""
    args = dict(config)
    kind = args.pop("policy", None)
    if kind == "function":
        path = args.pop("function", None)
        if not isinstance(path, str) or ":" not in path:
            raise InvalidDataError(
                f"a function policy needs function='package.module:name', not {path!r}"
            )
        module, _, attr = path.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise InvalidDataError(f"cannot import selection policy {path!r}: {exc}") from exc
        return FunctionPolicy(fn, name=path, **args)
    if kind not in _BUILT_IN:
        raise InvalidDataError(
            f"unknown selection policy {kind!r}; pick one of {sorted([*_BUILT_IN, 'function'])}"
        )
    try:
        return _BUILT_IN[kind](**args)
    except TypeError as exc:
        raise InvalidDataError(f"selection policy {kind!r}: {exc}") from None


def as_policy(select: Any) -> Policy | None:
    """What ``VersionedSampler(select=...)`` accepts: None, a :class:`Policy`, a plain dict
    config (see :func:`_from_config`) or a module-level function ``fn(stats, step)``."""
    if select is None or isinstance(select, Policy):
        return select
    if isinstance(select, dict):
        return _from_config(select)
    if callable(select):
        return FunctionPolicy(select)
    raise InvalidDataError(
        f"select must be a policy (PassRateBand, Learnability, DifficultyPools, "
        f"FunctionPolicy), a dict config or a function, not {type(select).__name__}"
    )
