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

``pass_rate`` is :func:`dynstate.records.aggregate.pass_rate`'s (a success is a score above
``success_above``, 0.5 by default: the statistics are read with the store's defaults, which
are incremental).
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import InvalidDataError
from ..records.aggregate import pass_rates
from ..records.inputs import check_plain
from .state import MAX_SELECT_DEPTH
from .weights import Plan, Selector, check_weights, step_rng

__all__ = [
    "DifficultyPools",
    "FunctionPolicy",
    "Learnability",
    "PassRateBand",
    "Plan",
    "Policy",
    "Selector",
    "as_policy",
    "check_weights",
    "pass_rates",
    "step_rng",
]


# -- policies ----------------------------------------------------------------------------


class Policy:
    """A selection policy: ``weigh(stats, step)`` returns ``[(share, weights), ...]``, one
    weight (or bool) per row of ``stats`` in each part (:meth:`parts`: the same, checked).

    ``name`` and ``params()`` (plain types) identify it in the sampler state: a resume with
    another policy, or other parameters, is refused. ``uses_step``: whether the weights depend
    on the step (then they are rebuilt every step, else once per statistics version).
    ``reads``: the statistics columns a row's weights depend on, that row's only — then a
    new statistics version re-weighs only the rows whose ``reads`` changed and the rows
    added (:class:`Selector`); None: the weights may depend on every row, rebuilt in full."""

    name = "policy"
    uses_step = False
    reads: tuple[str, ...] | None = None

    def params(self) -> dict[str, Any]:
        return {}

    def identity(self) -> dict[str, Any]:
        return {"policy": self.name, "params": self.params()}

    def weigh(self, stats: pa.Table, step: int) -> list[tuple[float, Any]]:
        """The policy itself: ``[(share, weights), ...]`` over the rows of ``stats``,
        unchecked (what subclasses implement)."""
        raise NotImplementedError

    def weigh_at(self, stats: pa.Table, step: int, where: str) -> list[tuple[float, Any]]:
        """:meth:`weigh`, where a policy that checks its own answer names ``where`` (the
        policy, step and version) in its refusals."""
        return self.weigh(stats, step)

    def parts(self, stats: pa.Table, step: int) -> list[tuple[float, np.ndarray]]:
        """:meth:`weigh` over a whole statistics table, checked: float64 weights, or
        :class:`InvalidDataError` naming the policy and the step."""
        return self.checked_parts(stats, step, f"{self.describe()} at step {step}")

    def describe(self) -> str:
        """The policy in words, for error messages."""
        return f"selection policy {self.name!r}"

    def expected_shares(self, stats: pa.Table, step: int, where: str) -> np.ndarray:
        """Each row's expected share of a step's draws by ``stats`` (float64, summing to 1):
        the parts that draw (a share above 0 and a weight above 0) split the step by their
        shares, and each part's rows split its share by their weights, as :class:`Plan`
        draws (its slots rounded down or up, which averages to the shares). What a sampler
        refuses (nothing drawable, weights whose total leaves float64's range) is refused
        here too, by the sampler's own plan (``where`` names the policy and version)."""
        parts = self.checked_parts(stats, step, where)
        Plan.of(stats.num_rows, parts, where)  # the sampler's checks
        shares = np.zeros(stats.num_rows, np.float64)
        live = [(s, w) for s, w in parts if s > 0 and w.sum() > 0]
        if not live:
            return shares
        top = max(s for s, _ in live)  # shares scaled to at most 1: their sum stays finite
        total = math.fsum(s / top for s, _ in live)
        for s, w in live:
            shares += (s / top / total) * (w / w.sum())
        return shares

    def checked_parts(
        self, stats: pa.Table, step: int, where: str, *, whole: bool = True
    ) -> list[tuple[float, np.ndarray]]:
        """:meth:`parts`, each weight vector checked (:func:`check_weights`). ``whole``:
        ``stats`` holds every row, so a lone part of all zeros is refused here already
        (several parts: pools, of which some may be empty)."""
        parts = self.weigh_at(stats, step, where)
        some = whole and len(parts) == 1
        n = stats.num_rows
        return [(share, check_weights(w, n, where, some=some)) for share, w in parts]

    def plan(self, stats: pa.Table, step: int, where: str) -> Plan:
        return Plan.of(stats.num_rows, self.checked_parts(stats, step, where), where)


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
    reads = ("attempts", "successes")

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

    def describe(self) -> str:
        return f"the pass-rate band [{self.lo}, {self.hi}] (untried={self.untried})"

    def weigh(self, stats: pa.Table, step: int) -> list[tuple[float, Any]]:
        return [(1.0, self.eligible(stats))]


class Learnability(Policy):
    """Weights ``max(p * (1 - p), floor)`` by pass rate ``p`` (tasks solved half the time
    weigh most), ``neutral`` for rows never tried (0.25 by default: as much as ``p = 0.5``)."""

    name = "learnability"
    reads = ("attempts", "successes")

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
        learn = np.subtract(1.0, rate)  # in place from here: this runs over every row
        learn *= rate
        np.maximum(learn, self.floor, out=learn)  # NaN (never tried) stays NaN
        np.copyto(learn, self.neutral, where=~tried)
        return learn

    def describe(self) -> str:
        return f"learnability (floor={self.floor}, neutral={self.neutral})"

    def weigh(self, stats: pa.Table, step: int) -> list[tuple[float, Any]]:
        return [(1.0, self.weights(stats))]


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
    reads = ("attempts", "successes")

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
        if isinstance(names, str):  # list("abc") would make three pools of one letter
            raise InvalidDataError(f"pool names must be a list of names, not the str {names!r}")
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

    def describe(self) -> str:
        return f"difficulty pools {self.names} (bounds {self.bounds}, shares {self.shares})"

    def weigh(self, stats: pa.Table, step: int) -> list[tuple[float, Any]]:
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
        check_plain(name, "a policy name", "name", depth=0)  # UTF-8 text, as records hold
        _check_signature(fn, name)
        self.fn, self.user_name = fn, name
        # plain types: they go into the sampler state, two levels inside the policy's
        # identity ({"policy", "params": {..., "params": these}}), which nests at most
        # MAX_SELECT_DEPTH deep
        self.user_params = check_plain(
            params or {},
            f"params of policy {name!r}",
            "params",
            depth=MAX_SELECT_DEPTH - 2,
            tuples=True,
        )
        self.uses_step = bool(uses_step)
        self._checked = False

    def params(self) -> dict[str, Any]:
        return {"name": self.user_name, "params": self.user_params, "uses_step": self.uses_step}

    def describe(self) -> str:
        return f"selection policy {self.user_name!r}"

    def weigh(self, stats: pa.Table, step: int) -> list[tuple[float, Any]]:
        return self.weigh_at(stats, step, f"selection policy {self.user_name!r} at step {step}")

    def weigh_at(self, stats: pa.Table, step: int, where: str) -> list[tuple[float, Any]]:
        weights = self.fn(stats, step)
        if not self._checked:
            weights = check_weights(weights, stats.num_rows, where, some=False)
            again = check_weights(self.fn(stats, step), stats.num_rows, where, some=False)
            if not np.array_equal(weights, again):
                raise InvalidDataError(
                    f"{where} returned different weights for the same statistics and step; "
                    "a policy must be a pure function of (stats, step) for runs to resume "
                    "exactly — draw no random numbers and keep no state in it"
                )
            self._checked = True
        return [(1.0, weights)]


def _check_signature(fn: Callable[..., Any], name: str) -> None:
    """Refuse a function that cannot be called as ``fn(stats, step)`` now, with the policy's
    name, rather than with a raw TypeError at the first step (functions whose signature
    Python cannot tell, some builtins, are let through)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, 0)
    except TypeError as exc:
        raise InvalidDataError(
            f"selection policy {name!r} has the signature {name.rpartition(':')[2]}"
            f"{signature}, which cannot be called as fn(stats, step) ({exc}); a policy "
            "takes the statistics table and the step: def policy(stats, step) -> weights"
        ) from None


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
        except (ImportError, AttributeError, ValueError) as exc:  # ValueError: ":fn"
            raise InvalidDataError(f"cannot import selection policy {path!r}: {exc}") from exc
        unknown = sorted(set(args) - {"params", "uses_step"})
        if unknown:
            raise InvalidDataError(
                f"function policy {path!r}: unknown key(s) {', '.join(map(repr, unknown))}; "
                "a function policy config takes policy, function, params and uses_step"
            )
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
