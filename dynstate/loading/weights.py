"""Drawing rows by weight: the structure a selection policy's weights live in, refreshed in
place when a round's statistics arrive, and the one keyed random stream a step draws from.

:class:`CumulativeWeights` keeps a weight per row and a blocked cumulative sum: rows in
blocks of :data:`BLOCK`, each block's running sum, and a running sum over the block totals.
Setting the weights of ``k`` rows recomputes only the blocks that hold them (and the short
sum over block totals), so a round that trained a few hundred rows of a million costs a few
hundred blocks' work, not a pass over every row. Its content is a pure function of the
weight vector — every block's sums are computed by the same sequential ``cumsum``, whichever
rows changed and in whatever order — so weights refreshed round by round draw bit for bit
what weights built in one go draw: a resumed run, which builds them at the version it resumes
at, continues the same stream. Drawing ``k`` rows is two searches per row.

:class:`Plan` is a policy's strata (a share of the step's slots and a weight structure
each); :class:`Selector` keeps one sampler's plan and refreshes it from one statistics
version to the next; :func:`step_rng` is the stream a step draws from, keyed by ``(seed,
epoch, step)``. The policies themselves are in :mod:`dynstate.loading.selection`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from ..errors import InvalidDataError

__all__ = ["BLOCK", "CumulativeWeights", "Plan", "Selector", "check_weights", "step_rng"]

BLOCK = 256  # rows per block; fixed, as the draws' rounding (never their law) depends on it
_SALT = 0x5E1EC7  # keeps a selection's stream apart from any other use of the same seed


class Weighing(Protocol):
    """What :class:`Selector` asks of a selection policy (``selection.Policy`` is one). A
    protocol here, not an import, so that ``selection`` builds on this module and not both
    ways: ``reads`` names the statistics columns a row's weights depend on (None: every
    row's), ``uses_step`` whether they depend on the step."""

    reads: tuple[str, ...] | None
    uses_step: bool

    def plan(self, stats: pa.Table, step: int, where: str) -> Plan: ...

    def checked_parts(
        self, stats: pa.Table, step: int, where: str, *, whole: bool = True
    ) -> list[tuple[float, np.ndarray]]: ...


def step_rng(seed: int, epoch: int, step: int) -> np.random.Generator:
    """The random stream of one step's draw: a function of ``(seed, epoch, step)`` only."""
    mask = (1 << 64) - 1
    return np.random.Generator(np.random.PCG64([seed & mask, epoch & mask, step & mask, _SALT]))


def check_weights(values: Any, num_rows: int, where: str, *, some: bool = True) -> np.ndarray:
    """``values`` as float64 weights of ``num_rows`` rows (bools: 1 eligible, 0 not); a
    wrong length, a negative, NaN or infinite weight raise :class:`InvalidDataError` naming
    ``where`` (the policy, step and version), and so do all zero when ``some`` (False: the
    weights of some rows only, whose zeros the whole may make up for)."""
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
    if len(weights) and weights.max() == np.inf:
        raise InvalidDataError(f"{where} returned infinite weights; return finite numbers")
    if some and num_rows and not weights.any():
        raise InvalidDataError(all_zero(where, num_rows))
    return weights


#: The smallest total weight a stratum may have: below it a draw's ``U[0, 1) * total`` is
#: rounded to subnormal floats, coarser than U's 53 bits (2**-1022 is the smallest normal).
MIN_TOTAL = 2.0**-969


def all_zero(where: str, num_rows: int) -> str:
    return (
        f"{where} gives every one of the {num_rows} rows weight 0: nothing can be drawn; "
        "widen the band / raise the floor, or include rows never tried"
    )


class CumulativeWeights:
    """A weight per row and its blocked cumulative sum (see the module docstring)."""

    def __init__(self) -> None:
        self.num_rows = 0
        self._weights = np.zeros(0, np.float64)  # capacity: whole blocks, zero past num_rows
        self._local = np.zeros((0, BLOCK), np.float64)  # running sum within each block
        self._top = np.zeros(0, np.float64)  # running sum over the blocks' totals
        self.total = 0.0
        self._last_block = 0

    @classmethod
    def of(cls, weights: np.ndarray) -> CumulativeWeights:
        """Built over every row in one go (no search for the blocks a change touched)."""
        built = cls()
        blocks = -(-len(weights) // BLOCK)
        built._grow(blocks + blocks // 8 + 1)  # room for rounds to come: growing copies all
        built.num_rows = len(weights)
        built._weights[: len(weights)] = weights
        built._sum_blocks(slice(None))
        return built

    @property
    def weights(self) -> np.ndarray:
        """The weight of every row (a read-only view)."""
        view = self._weights[: self.num_rows]
        view.flags.writeable = False
        return view

    def set(self, rows: np.ndarray, values: np.ndarray, num_rows: int) -> None:
        """Give ``rows`` the weights ``values`` (checked by the caller) and grow to
        ``num_rows`` rows (never shrink); rows added and not named weigh 0. Work: the blocks
        that hold ``rows``, plus the sum over block totals."""
        if num_rows < self.num_rows:
            raise ValueError("CumulativeWeights never shrinks; build a new one")
        blocks = -(-num_rows // BLOCK)
        if blocks > len(self._local):
            self._grow(max(blocks, 2 * len(self._local)))
        self.num_rows = num_rows
        self._weights[rows] = values
        self._sum_blocks(np.unique(np.asarray(rows, np.int64) // BLOCK))

    def _sum_blocks(self, dirty: slice | np.ndarray) -> None:
        """Recompute the sums of the ``dirty`` blocks and the sum over all blocks."""
        blocks = -(-self.num_rows // BLOCK)
        rows = self._weights.reshape(-1, BLOCK)
        with np.errstate(over="ignore"):  # an infinite total is refused by Plan._check
            if isinstance(dirty, slice):  # every block in use: summed where they lie, no copy
                np.cumsum(rows[:blocks], axis=1, out=self._local[:blocks])
            else:
                self._local[dirty] = np.cumsum(rows[dirty], axis=1)
            self._top = np.cumsum(self._local[:blocks, -1])
        self.total = float(self._top[-1]) if blocks else 0.0
        self._last_block = int(np.searchsorted(self._top, self.total, side="left"))

    def _grow(self, blocks: int) -> None:
        old = len(self._local)
        weights = np.zeros(blocks * BLOCK, np.float64)
        weights[: old * BLOCK] = self._weights
        local = np.zeros((blocks, BLOCK), np.float64)
        local[:old] = self._local
        self._weights, self._local = weights, local

    def find(self, u: np.ndarray) -> np.ndarray:
        """The row of each point ``u`` in ``[0, total]`` of the cumulative sum: row ``i`` for
        ``u`` in its interval, so rows are hit in proportion to their weights and a row of
        weight 0 never (a point rounding past the end lands on the last row that weighs)."""
        block = np.searchsorted(self._top, u, side="right")
        past = block >= len(self._top)
        block[past] = self._last_block
        start = np.where(block > 0, self._top[block - 1], 0.0)
        rest = u - start
        # within each point's block: how many of its running sums are <= the rest (a search
        # of every point at once over the blocks it fell in: k x BLOCK comparisons); the
        # first sum reaching the block's total is its last row of positive weight, where a
        # rest rounding up to the total (or a point past the end) lands
        sums = self._local[block]
        last = (sums < sums[:, -1:]).sum(axis=1)
        within = np.minimum((sums <= rest[:, None]).sum(axis=1), last)
        within[past] = last[past]
        return block * BLOCK + within


class _Stratum:
    def __init__(self, share: float, weights: CumulativeWeights) -> None:
        self.share, self.weights = share, weights

    @property
    def active(self) -> bool:
        return self.share > 0 and self.weights.total > 0


class Plan:
    """A policy's strata for one statistics version: each a share of the step's slots and a
    :class:`CumulativeWeights`. Strata keep their place while empty (a pool with no row
    gives its share to the others, and takes it back once it has rows), so refreshing a
    plan in place and building one from the same weights agree. Drawing k slots over n rows
    costs a search over the n / BLOCK block totals and one over a block, per slot."""

    def __init__(self, num_rows: int, strata: list[_Stratum]) -> None:
        self.num_rows = num_rows
        self.all_strata = strata

    @classmethod
    def of(cls, num_rows: int, parts: Sequence[tuple[float, np.ndarray]], where: str) -> Plan:
        """A plan built from ``(share, weights)`` pairs over all ``num_rows`` rows."""
        strata = [_Stratum(float(s), CumulativeWeights.of(w)) for s, w in parts]
        plan = cls(num_rows, strata)
        plan._check(where)
        return plan

    def set(
        self, rows: np.ndarray, weights: Sequence[np.ndarray], num_rows: int, where: str
    ) -> None:
        """Give ``rows`` new weights, one array per stratum, and grow to ``num_rows``."""
        for stratum, values in zip(self.all_strata, weights, strict=True):
            stratum.weights.set(rows, values, num_rows)
        self.num_rows = num_rows
        self._check(where)

    def _check(self, where: str) -> None:
        num_rows = self.num_rows
        for stratum in self.all_strata:
            # Finite weights can still sum past the float range: u = U[0, 1) * inf is inf or
            # NaN, and every draw would land on the last row. Refused rather than rescaled,
            # so that a row's share is always its weight over the plain float64 total.
            total = stratum.weights.total
            if not math.isfinite(total):
                raise InvalidDataError(
                    f"{where} returned weights whose total overflows float64 (largest "
                    f"{stratum.weights.weights.max():.6g} over {num_rows} rows); weights are "
                    "relative: scale them down (e.g. divide by their maximum) so that they "
                    "sum to a finite number"
                )
            # Below MIN_TOTAL, u = U[0, 1) * total falls on a grid coarser than U's 53 bits
            # (subnormal floats): rows would be drawn out of proportion to their weights.
            if 0 < total < MIN_TOTAL:
                raise InvalidDataError(
                    f"{where} returned weights whose total {total:.6g} is too small to draw "
                    f"in proportion (below {MIN_TOTAL:.3g}); weights are relative: scale them "
                    "up (e.g. divide by their maximum)"
                )
        if num_rows and not self.strata:
            if len(self.all_strata) == 1:
                raise InvalidDataError(all_zero(where, num_rows))
            raise InvalidDataError(
                f"{where} leaves no row that can be drawn (every pool empty or weighted 0); "
                "change the pools' bounds or shares"
            )

    @property
    def strata(self) -> list[_Stratum]:
        """The strata a step draws from: a share above 0 and some row of weight above 0."""
        return [s for s in self.all_strata if s.active]

    def counts(self, count: int, u: float = 0.0) -> list[int]:
        """Slots of each drawing stratum among ``count``: each stratum's exact share of the
        slots rounded down or up, the slots left after rounding down going to the strata by
        systematic sampling of their fractional parts at offset ``u`` in [0, 1) (the step's
        first uniform). Every step holds each share as closely as whole slots allow, and a
        stratum gets its extra slot with probability equal to its fraction, so over the steps
        each share is met on average (a fixed rule, e.g. largest remainder, would give
        0.5/0.3/0.2 at 8 slots 4/2/2 every step: 0.25 for the 0.3 pool forever). Exact
        rational arithmetic: which stratum gets a slot never depends on float rounding."""
        strata = self.strata
        shares = [Fraction(s.share) for s in strata]
        total = sum(shares)
        exact = [count * s / total for s in shares]
        out = [math.floor(x) for x in exact]
        offset = Fraction(u)
        low = Fraction(0)
        for i, x in enumerate(exact):
            high = low + (x - out[i])
            # the points offset + k (k = 0, 1, ...) that fall in [low, high): 0 or 1 of them
            out[i] += math.ceil(high - offset) - math.ceil(low - offset)
            low = high
        return out

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` rows, with replacement, each stratum's in proportion to its weights; with
        several strata the step's first uniform sets their slots (:meth:`counts`)."""
        strata = self.strata
        if count <= 0 or not strata:
            return np.zeros(0, np.int64)
        counts = self.counts(count, float(rng.random())) if len(strata) > 1 else [count]
        parts = []
        for stratum, n in zip(strata, counts, strict=True):
            u = rng.random(n) * stratum.weights.total
            parts.append(stratum.weights.find(u))
        rows = np.concatenate(parts)
        if len(parts) > 1:
            rows = rows[rng.permutation(len(rows))]  # every rank's share mixes the pools
        return rows.astype(np.int64)


class Selector:
    """The weights one sampler draws from: the plan of the statistics version it drew from
    last, refreshed in place when the next version's statistics arrive.

    For a policy whose rows weigh by their own statistics (``reads``) and not by the step,
    the refresh re-weighs only the rows whose ``reads`` columns changed and the rows the
    round added — found by one comparison of those columns with the last version's — and
    the plan's :class:`~dynstate.loading.weights.CumulativeWeights` recompute only the
    blocks that hold them. Its content is a pure function of the version's statistics, so
    a refresh and a build at that version (a resumed run's) draw the same rows. Other
    policies are built in full per version (and per step with ``uses_step``)."""

    def __init__(self, policy: Weighing) -> None:
        self.policy = policy
        self._key: Any = None
        self._plan: Plan | None = None
        self._seen: list[np.ndarray] = []  # the ``reads`` columns the plan was weighed by
        self.rebuilds = 0  # plans built over every row (work counters, for tests and benches)
        self.reweighed = 0  # rows re-weighed by refreshes

    def plan(self, key: Any, stats: Callable[[], pa.Table], step: int, where: str) -> Plan:
        """The plan for ``key`` (a statistics version, and the step for a policy that uses
        it); ``stats()`` gives that version's statistics table when it is not the last one."""
        if self._plan is not None and self._key == key:
            return self._plan
        table = stats()
        policy, last = self.policy, self._plan
        self._plan = None  # a refused refresh leaves no half-updated plan behind
        if (
            last is not None
            and policy.reads is not None
            and not policy.uses_step
            and table.num_rows >= last.num_rows
        ):
            self._remember(table, self._refresh(last, table, step, where))
            plan = last
        else:
            plan = policy.plan(table, step, where)
            self.rebuilds += 1
            if policy.reads is not None:
                self._remember(table, None)
        self._plan, self._key = plan, key
        return plan

    def _remember(self, table: pa.Table, rows: np.ndarray | None) -> None:
        """Keep the ``reads`` columns of ``table`` — in arrays of our own (the table's
        buffers may be the store's, which we must not count on staying as they are), with
        room to grow; ``rows``: only those changed since the last version."""
        assert self.policy.reads is not None
        n = table.num_rows
        if rows is None:
            self._seen = []
            for name in self.policy.reads:
                column = _column(table, name)
                own = np.empty(n + n // 8 + 1, column.dtype)
                own[:n] = column
                self._seen.append(own)
            return
        for i, name in enumerate(self.policy.reads):
            if len(self._seen[i]) < n:
                wider = np.empty(max(n, 2 * len(self._seen[i])), self._seen[i].dtype)
                wider[: len(self._seen[i])] = self._seen[i]
                self._seen[i] = wider
            self._seen[i][rows] = _column(table, name)[rows]

    def _refresh(self, plan: Plan, table: pa.Table, step: int, where: str) -> np.ndarray:
        """Re-weigh the rows whose ``reads`` changed and the rows added; returns them."""
        assert self.policy.reads is not None
        old = plan.num_rows
        changed, differs = np.zeros(old, np.bool_), np.empty(old, np.bool_)
        for seen, name in zip(self._seen, self.policy.reads, strict=True):
            # into buffers: this is the one pass over every row a refresh makes
            np.not_equal(seen[:old], _column(table, name)[:old], out=differs)
            np.logical_or(changed, differs, out=changed)
        rows = np.concatenate([np.flatnonzero(changed), np.arange(old, table.num_rows)])
        if not len(rows):
            return rows
        # the rows' own statistics: all a row-local policy reads
        part = pa.table({name: _column(table, name)[rows] for name in self.policy.reads})
        parts = self.policy.checked_parts(part, step, where, whole=False)
        plan.set(rows, [w for _, w in parts], table.num_rows, where)
        self.reweighed += len(rows)
        return rows


def _column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False)
