"""The per-row aggregate of outcome records, from which every statistic is computed
(:mod:`dynstate.records.outcomes` says what each one means). Pure: no I/O; stored and read by
:mod:`dynstate.log.outcomes` in the form :meth:`Aggregate.to_table` writes.

The one home of the outcome rules: what a success is (:func:`succeeded`), a pass rate
(:func:`pass_rate`, :func:`pass_rates`), its band (:func:`band_of`, :func:`band_counts`,
:func:`summarize`), how records are counted per row (:func:`tally`) and the fold below. The
views, selection policies, ``dynstate stats`` and serve's charts ask these, so no two of them
can disagree (``tests/test_one_home.py`` keeps a second copy out).

Besides the sums for the aggregate's own ``success_above`` and ``half_life``, it keeps a
per-row histogram of the distinct scores (while there are at most :data:`MAX_SCORE_VALUES`),
so successes above any other threshold need no records.

The fold (the one order every statistic of a version is computed in): the records of the
version's lineage in lineage order (its outcome files oldest commit first, each file's
records as committed, which is :meth:`Store.outcome_records`' order), one record at a time.
Per row, starting from ``score_sum = ewma_num = ewma_den = 0.0`` and ``last_step = -1``, a
record ``(step, score)`` does, in IEEE double arithmetic, each operation rounded alone::

    score_sum = score_sum + score
    if step > last_step:       # a "lead": the row's new latest step
        scale = np.exp2((last_step - step) / half_life)
        ewma_num = ewma_num * scale + score
        ewma_den = ewma_den * scale + 1.0
        last_step = step
    else:
        weight = np.exp2((step - last_step) / half_life)
        ewma_num = ewma_num + score * weight
        ewma_den = ewma_den + weight

and ``mean_score = score_sum / attempts``, ``ewma_score = ewma_num / ewma_den``. A left fold
record by record continues from any prefix exactly, so a stored aggregate plus the files
after it, one handle's cached aggregate plus newer files, and ``pending=`` (the committed
version plus the step in progress) give bit-identical floats to a fold of every record
from scratch (tests/test_stats_oracle.py checks all of them against this recurrence in
plain Python). Summing a batch per row first and adding the sum would round differently
depending on where the batches begin, which is what a handle's cache decides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .outcomes import MAX_OUTCOMES, as_numpy, from_numpy

_AGG_META = b"dynstate.records.outcomes.aggregate"
# An aggregate keeps a per-row score histogram while the lineage's scores take at most this
# many distinct values (pass/fail, graded rubrics): successes above any threshold then come
# from it; past it, a threshold other than the aggregate's reads every record.
MAX_SCORE_VALUES = 16
_MAX_COUNT = 2**31 - MAX_OUTCOMES  # int32 counts: one more commit's records always fit


# -- the rules: a success, a pass rate, its band ---------------------------------------------


def succeeded(scores: Any, success_above: float) -> Any:
    """Whether each score is a success: strictly above ``success_above``."""
    return scores > success_above


def pass_rate(successes: Any, attempts: Any) -> Any:
    """``successes / attempts`` in float64 (arrays or numbers), NaN where a row was never
    tried. Counts stay below 2**53, so this is the correctly rounded quotient Python's own
    ``int / int`` gives."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.divide(successes, attempts, dtype=np.float64)


def pass_rates(stats: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """``(pass_rate, tried)`` per row of a statistics table (:meth:`Store.outcome_stats`):
    the pass rate (NaN where a row was never tried) and whether it was."""
    attempts = as_numpy(stats.column("attempts"))
    return pass_rate(as_numpy(stats.column("successes")), attempts), attempts > 0


def band_of(successes: np.ndarray, attempts: np.ndarray, bins: int) -> np.ndarray:
    """The pass-rate band of trained rows (``attempts > 0``): ``bins`` equal bands of
    ``[0, 1]``, the last one closed. In integers: ``29/50 * 50`` is 28.999... in floats,
    which put a row on a band's lower edge into the band below."""
    successes = np.asarray(successes, dtype=np.int64)
    attempts = np.maximum(np.asarray(attempts, dtype=np.int64), 1)
    return np.minimum(successes * bins // attempts, bins - 1)


def band_counts(successes: np.ndarray, attempts: np.ndarray, bins: int) -> np.ndarray:
    """How many of the rows sit in each pass-rate band (rows never trained in none)."""
    trained = attempts > 0
    return np.bincount(band_of(successes[trained], attempts[trained], bins), minlength=bins)


def tally(
    attempts: np.ndarray, successes: np.ndarray, rows: np.ndarray, won: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Count records in, in place: ``rows`` (with repeats) tried once per record, ``won``
    whether each succeeded. Returns the distinct rows (sorted) and each record's index among
    them (exact: integer counts, in any order)."""
    hit, inv = _group(rows, len(attempts))
    attempts[hit] += np.bincount(inv, minlength=len(hit))
    successes[hit] += np.bincount(inv[won], minlength=len(hit))
    return hit, inv


def summarize(stats: pa.Table, *, bins: int = 10, top: int = 10) -> dict[str, Any]:
    """What ``dynstate stats`` and serve show, from a statistics table
    (:meth:`Store.outcome_stats`): how many rows were trained, a histogram of pass rates
    (:func:`band_counts`), and the ``top`` hardest rows (lowest pass rate, then most
    attempts) and easiest (highest, then most attempts) among the trained ones."""
    attempts = as_numpy(stats.column("attempts"))
    successes = as_numpy(stats.column("successes"))
    trained = np.flatnonzero(attempts > 0)
    rate = pass_rate(successes[trained], attempts[trained])
    counts = band_counts(successes, attempts, bins)
    histogram = [
        {"low": i / bins, "high": (i + 1) / bins, "rows": int(counts[i])} for i in range(bins)
    ]
    columns = {n: stats.column(n).to_pylist() for n in ("mean_score", "ewma_score", "last_step")}

    def entry(i: int) -> dict[str, Any]:
        row = int(trained[i])
        return {
            "row": row,
            "attempts": int(attempts[row]),
            "successes": int(successes[row]),
            "pass_rate": float(rate[i]),
            **{name: values[row] for name, values in columns.items()},
        }

    hardest = np.lexsort((trained, -attempts[trained], rate))[:top]
    easiest = np.lexsort((trained, -attempts[trained], -rate))[:top]
    overall = pass_rate(successes.sum(), attempts.sum())
    return {
        "rows": stats.num_rows,
        "trained": len(trained),
        "never_trained": stats.num_rows - len(trained),
        "records": int(attempts.sum()),
        "pass_rate": float(overall) if len(trained) else None,
        "histogram": histogram,
        "hardest": [entry(i) for i in hardest],
        "easiest": [entry(i) for i in easiest],
    }


@dataclass
class Aggregate:
    """Per-row sums over outcome records, dense over the rows of a version; merging more
    records in is exact (the EWMA state is kept relative to each row's latest step)."""

    success_above: float
    half_life: float
    attempts: np.ndarray
    score_sum: np.ndarray
    successes: np.ndarray
    first_step: np.ndarray  # -1: never trained
    last_step: np.ndarray
    ewma_num: np.ndarray
    ewma_den: np.ndarray
    # The score histogram: the distinct scores seen (sorted) and, per row, how many of its
    # outcomes had each — successes above any threshold without the records. None once the
    # scores took more than MAX_SCORE_VALUES values (or over an aggregate stored without it).
    values: np.ndarray | None = None
    counts: np.ndarray | None = None  # int32, rows x len(values)

    @classmethod
    def empty(cls, num_rows: int, success_above: float, half_life: float) -> Aggregate:
        return cls(
            success_above,
            half_life,
            np.zeros(num_rows, np.int64),
            np.zeros(num_rows, np.float64),
            np.zeros(num_rows, np.int64),
            np.full(num_rows, -1, np.int64),
            np.full(num_rows, -1, np.int64),
            np.zeros(num_rows, np.float64),
            np.zeros(num_rows, np.float64),
            np.empty(0, np.float64),
            np.zeros((num_rows, 0), np.int32),
        )

    @property
    def num_rows(self) -> int:
        return len(self.attempts)

    def copy(self) -> Aggregate:
        return Aggregate(
            self.success_above,
            self.half_life,
            self.attempts.copy(),
            self.score_sum.copy(),
            self.successes.copy(),
            self.first_step.copy(),
            self.last_step.copy(),
            self.ewma_num.copy(),
            self.ewma_den.copy(),
            None if self.values is None else self.values.copy(),
            None if self.counts is None else self.counts.copy(),
        )

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (
            self.attempts,
            self.score_sum,
            self.successes,
            self.first_step,
            self.last_step,
            self.ewma_num,
            self.ewma_den,
        )

    def grow(self, num_rows: int) -> Aggregate:
        """The same sums over ``num_rows`` rows (rows appended since are untrained)."""
        if num_rows <= self.num_rows:
            return self
        wider = Aggregate.empty(num_rows, self.success_above, self.half_life)
        for src, dst in zip(self._arrays(), wider._arrays(), strict=True):
            dst[: self.num_rows] = src
        if self.values is None or self.counts is None:
            wider.values = wider.counts = None
        else:
            wider.values = self.values
            wider.counts = np.zeros((num_rows, len(self.values)), np.int32)
            wider.counts[: self.num_rows] = self.counts
        return wider

    def fold(self, table: pa.Table) -> None:
        """Add the records of an outcome table (rows within range), in place, one record at
        a time in the table's order (the module docstring's fold): folding a lineage's files
        in one table, file by file, or from a stored aggregate on gives the same floats. The
        work is over the rows the records name, not over every row of the version."""
        if table.num_rows == 0:
            return
        rows = as_numpy(table.column("row")).astype(np.int64, copy=False)
        steps = as_numpy(table.column("step")).astype(np.int64, copy=False)
        scores = as_numpy(table.column("score")).astype(np.float64, copy=False)
        hit, inv = tally(self.attempts, self.successes, rows, succeeded(scores, self.success_above))
        k = len(hit)
        first = np.full(k, np.iinfo(np.int64).max, np.int64)
        np.minimum.at(first, inv, steps)
        last = np.full(k, -1, np.int64)
        np.maximum.at(last, inv, steps)
        old_last = self.last_step[hit]
        old = old_last >= 0
        self.first_step[hit] = np.where(old, np.minimum(self.first_step[hit], first), first)
        # One rounding per record, in record order: ufunc.at is unbuffered and goes through
        # the indices in order (a per-row sum added at once would round differently).
        np.add.at(self.score_sum, rows, scores)
        self._fold_ewma(hit, inv, steps, scores)
        self.last_step[hit] = np.maximum(old_last, last)
        self._fold_histogram(rows, scores, hit)

    def _fold_ewma(
        self, hit: np.ndarray, inv: np.ndarray, steps: np.ndarray, scores: np.ndarray
    ) -> None:
        """The EWMA recurrence of the module docstring over the records, row by row in record
        order, before ``last_step`` takes them in. Vectorised over rows in phases: phase j of
        a row is its j-th record of a new latest step (a "lead", which rescales the state)
        and the records after it up to the next lead (plain additions). So the loop runs as
        many times as a row of the batch has leads at most (one per step a commit holds)."""
        order = np.argsort(inv, kind="stable")  # row by row, each row's in record order
        g, s, x = inv[order], steps[order], scores[order]
        n = len(order)
        starts = np.ones(n, dtype=bool)
        starts[1:] = g[1:] != g[:-1]
        # Each record's prior latest step: the row's stored one or that of its earlier
        # records here. A running maximum per row: over step ranks offset by the row's group
        # (groups ascend, so the maximum never crosses into the next row). The ranks are the
        # steps less the least while that fits in int64 (a few steps: no sort), else dense.
        low = int(s.min())
        width = int(s.max()) - low + 1
        if width * len(hit) < 2**62:
            offset = g * width
            running = np.maximum.accumulate(offset + (s - low)) - offset + low
        else:
            distinct, rank = np.unique(s, return_inverse=True)
            offset = g * (len(distinct) + 1)
            running = distinct[np.maximum.accumulate(offset + rank) - offset]
        prior = np.empty(n, np.int64)
        prior[0] = -1
        prior[1:] = running[:-1]
        prior[starts] = -1
        prior = np.maximum(prior, self.last_step[hit][g])
        lead = s > prior
        # lead: the state's scale to the new latest step; else the record's weight (<= 1)
        factor = np.exp2(np.where(lead, prior - s, s - prior) / self.half_life)
        leads = np.cumsum(lead)
        phase = leads - (leads - lead)[starts][np.cumsum(starts) - 1]
        by_phase = np.argsort(phase, kind="stable")  # keeps each row's records in order
        bounds = np.searchsorted(phase[by_phase], np.arange(int(phase.max()) + 2))
        num, den = self.ewma_num, self.ewma_den
        for j in range(len(bounds) - 1):
            at = by_phase[bounds[j] : bounds[j + 1]]
            if j:  # first in the phase: its row's lead
                first = at[lead[at]]
                r = hit[g[first]]
                num[r] = num[r] * factor[first] + x[first]
                den[r] = den[r] * factor[first] + 1.0
                at = at[~lead[at]]
            r = hit[g[at]]
            np.add.at(num, r, x[at] * factor[at])
            np.add.at(den, r, factor[at])

    def _fold_histogram(self, rows: np.ndarray, scores: np.ndarray, hit: np.ndarray) -> None:
        if self.values is None or self.counts is None:
            return
        values = self.values
        at = np.searchsorted(values, scores)
        known = at < len(values)
        known[known] = values[at[known]] == scores[known]
        if not known.all():
            wider = np.union1d(values, scores[~known])
            if len(wider) > MAX_SCORE_VALUES:
                self.values = self.counts = None  # continuous scores: no histogram
                return
            counts = np.zeros((self.num_rows, len(wider)), np.int32)
            counts[:, np.searchsorted(wider, values)] = self.counts
            self.values, self.counts = wider, counts
            at = np.searchsorted(wider, scores)
        if self.attempts[hit].max() >= _MAX_COUNT:
            self.values = self.counts = None  # a row's count would overflow int32
            return
        counts = np.ascontiguousarray(self.counts)  # the flat view below must be a view
        flat = rows * counts.shape[1] + at
        if len(rows) * 4 >= self.num_rows:  # many records (a checkpoint): one dense pass
            counts += (
                np.bincount(flat, minlength=counts.size).reshape(counts.shape).astype(np.int32)
            )
        else:
            np.add.at(counts.reshape(-1), flat, 1)
        self.counts = counts

    def successes_above(self, threshold: float) -> np.ndarray | None:
        """Per row, how many outcomes scored above ``threshold`` (None: no histogram)."""
        if threshold == self.success_above:
            return self.successes
        if self.values is None or self.counts is None:
            return None
        return self.counts[:, succeeded(self.values, threshold)].sum(axis=1, dtype=np.int64)

    def stats(self, success_above: float | None = None) -> pa.Table:
        """One row per store row: the statistics of :mod:`dynstate.records.outcomes`; successes
        above ``success_above`` (from the histogram) if given, else above the aggregate's."""
        successes = self.successes
        if success_above is not None:
            found = self.successes_above(success_above)
            if found is None:
                raise ValueError("no score histogram: successes_above() is None")
            successes = found
        trained = self.attempts > 0
        untrained = ~trained
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = self.score_sum / self.attempts
            ewma = self.ewma_num / self.ewma_den
        return pa.table(
            {
                "row": from_numpy(np.arange(self.num_rows, dtype=np.int64)),
                "attempts": from_numpy(self.attempts),
                "successes": from_numpy(successes),
                "mean_score": from_numpy(mean, mask=untrained),
                "ewma_score": from_numpy(ewma, mask=untrained),
                "first_step": from_numpy(self.first_step, mask=untrained),
                "last_step": from_numpy(self.last_step, mask=untrained),
            }
        )

    # -- stored form: one row per trained row, parameters in the schema metadata -----------

    _SUMS = (
        "attempts",
        "score_sum",
        "successes",
        "first_step",
        "last_step",
        "ewma_num",
        "ewma_den",
    )

    def to_table(self) -> pa.Table:
        """The stored form: the trained rows only, or every row (``row`` then 0, 1, 2, ...)
        once at least half of them are trained. Dense is what a cold read wants (no scatter
        into the per-row arrays, 0.2 of a fresh process's statistics at 1M rows); the few
        untrained rows it adds cost less than a ``row`` column of the rest. Both are the same
        schema: any reader of either takes the other."""
        trained = self.attempts > 0
        count = int(np.count_nonzero(trained))
        dense = 2 * count >= self.num_rows
        idx = np.arange(self.num_rows, dtype=np.int64) if dense else np.flatnonzero(trained)
        columns = {"row": from_numpy(idx.astype(np.int64, copy=False))}
        for name in self._SUMS:
            values = getattr(self, name)
            columns[name] = from_numpy(values if dense else values[idx])
        table = pa.table(columns)
        values = None
        if self.values is not None and self.counts is not None:
            values = self.values.tolist()
            for i in range(len(values)):
                counts = np.ascontiguousarray(self.counts[:, i])
                table = table.append_column(
                    f"count_{i}", from_numpy(counts if dense else counts[idx])
                )
        params = {
            "success_above": self.success_above,
            "half_life": self.half_life,
            "num_rows": self.num_rows,
            "values": values,  # the score histogram's values, count_<i> its columns
        }
        return table.replace_schema_metadata({_AGG_META: json.dumps(params).encode()})

    @classmethod
    def from_table(cls, table: pa.Table, where: str) -> Aggregate:
        from ..errors import CorruptStoreError

        try:
            params = json.loads((table.schema.metadata or {})[_AGG_META])
            num_rows = int(params["num_rows"])
            idx = as_numpy(table.column("row"))
            if len(idx) and (idx.min() < 0 or idx.max() >= num_rows):
                raise ValueError("row out of range")
            # every row in order (the dense form): the columns are the arrays, copied once
            # (they are Arrow's read-only memory, and a fold writes into them)
            dense = len(idx) == num_rows and bool(
                np.array_equal(idx, np.arange(num_rows, dtype=idx.dtype))
            )
            agg = cls.empty(0 if dense else num_rows, params["success_above"], params["half_life"])
            for name in cls._SUMS:
                column = as_numpy(table.column(name))
                if dense:
                    setattr(agg, name, np.array(column, getattr(agg, name).dtype))
                else:
                    getattr(agg, name)[idx] = column
            values = params.get("values")  # absent: written before the histogram
            if values is None:
                agg.values = agg.counts = None
            else:
                agg.values = np.array(values, np.float64)
                if len(agg.values) > MAX_SCORE_VALUES or np.any(np.diff(agg.values) <= 0):
                    raise ValueError("malformed score values")
                agg.counts = np.zeros((num_rows, len(values)), np.int32)
                at = slice(None) if dense else idx
                for i in range(len(values)):
                    agg.counts[at, i] = as_numpy(table.column(f"count_{i}"))
        except (KeyError, TypeError, ValueError, pa.ArrowException) as exc:
            raise CorruptStoreError(
                f"{where} is not an outcome aggregate ({exc}); run `dynstate verify`"
            ) from exc
        return agg


def _group(rows: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows (sorted) and each record's index among them, as ``np.unique``
    gives them. Many records for the rows (a checkpoint folds 100 steps): by a pass over
    the rows instead of a sort, which costs seconds at millions of records — and already
    at a sixteenth of the rows (100 steps of 2,048 over 1M rows) the pass is the cheaper."""
    if len(rows) * 16 < num_rows:
        return np.unique(rows, return_inverse=True)
    hit = np.flatnonzero(np.bincount(rows, minlength=num_rows))
    where = np.empty(num_rows, np.int64)
    where[hit] = np.arange(len(hit))
    return hit, where[rows]
