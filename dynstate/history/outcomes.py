"""Views of a version's outcomes that the surfaces (``dynstate stats`` and ``head``,
``dynstate serve``) render: rows selected and ordered by a statistic, one row's outcome
history step by step, and how many rows sit in each pass-rate band after each step.

All of them are built from :meth:`Store.outcome_stats` (the incremental per-row statistics)
or from the lineage's outcome files through :mod:`dynstate.log.outcomes`; the surfaces never
compute a statistic themselves. A success, a pass rate and its band are
:mod:`dynstate.records.aggregate`'s, the rules :func:`~dynstate.records.aggregate.summarize`
applies, so a chart's last step and ``dynstate stats`` agree.

One file past 400 lines for now: :class:`OutcomeViews` holds one lock and the caches its
three views extend from each other's lineage prefixes; the band series (its largest part)
is the seam to split along once its read-estimate work settles.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import InvalidDataError
from ..records.aggregate import band_counts, band_of, pass_rate, pass_rates, succeeded, tally
from ..records.manifest import CHECKPOINT_INTERVAL
from ..records.outcomes import DEFAULT_SUCCESS_ABOVE, as_numpy

if TYPE_CHECKING:
    from ..store import Store

# The statistics a row can be ordered by (the columns of Store.outcome_stats, and pass_rate).
SORT_KEYS = (
    "pass_rate",
    "attempts",
    "successes",
    "mean_score",
    "ewma_score",
    "first_step",
    "last_step",
)
NO_OUTCOMES = "no outcomes recorded"
# Band counts of single versions kept (a few charts' worth of points).
_BANDS_CACHED = 4096
# Above this many steps a band series is folded at the steps it keeps only (_fold_at): the
# per-step fold keeps every step's counts, which a lineage of 10**6 steps cannot afford.
_FOLD_STEPS = 10_000


def outcome_records_count(store: Store, version: int) -> int:
    """How many outcome records ``version``'s lineage holds (0: none recorded), from the
    commit records alone."""
    return store.outcome_log.lineage(version).records


@dataclass(frozen=True)
class RowSelection:
    """Which rows to list and in what order, by their statistics. ``sort``: one of
    :data:`SORT_KEYS`, ascending, or with a leading ``-`` descending; rows never trained
    (no pass rate, no scores) come last either way, but by ``attempts`` and ``successes``,
    where their count, 0, sorts with the others; ties in row order. The pass-rate bounds
    are inclusive and keep trained rows only; the attempt bounds are inclusive."""

    sort: str | None = None
    min_pass_rate: float | None = None
    max_pass_rate: float | None = None
    min_attempts: int | None = None
    max_attempts: int | None = None

    @property
    def active(self) -> bool:
        return any(
            x is not None
            for x in (
                self.sort,
                self.min_pass_rate,
                self.max_pass_rate,
                self.min_attempts,
                self.max_attempts,
            )
        )

    @classmethod
    def parse(cls, params: dict[str, Any], where: str) -> RowSelection:
        """From text or numbers (query parameters, CLI options); InvalidDataError naming
        ``where`` for anything else."""
        sort = params.get("sort") or None
        if sort is not None and sort.removeprefix("-") not in SORT_KEYS:  # one '-' at most
            raise InvalidDataError(
                f"cannot sort the rows of {where} by {sort!r}; sort by one of "
                f"{', '.join(SORT_KEYS)} (a leading '-' for descending)"
            )
        rates = [
            _number(params.get(k), k, where, 0.0, 1.0) for k in ("min_pass_rate", "max_pass_rate")
        ]
        counts = [_whole(params.get(k), k, where) for k in ("min_attempts", "max_attempts")]
        return cls(sort, rates[0], rates[1], counts[0], counts[1])

    def to_json(self) -> dict[str, Any]:
        return {
            "sort": self.sort,
            "min_pass_rate": self.min_pass_rate,
            "max_pass_rate": self.max_pass_rate,
            "min_attempts": self.min_attempts,
            "max_attempts": self.max_attempts,
        }

    def select(self, stats: pa.Table) -> np.ndarray:
        """Row numbers of ``stats`` (one row per store row) that pass, in order."""
        attempts = as_numpy(stats.column("attempts"))
        keep = np.ones(len(attempts), dtype=bool)
        rate, _ = pass_rates(stats)
        if self.min_pass_rate is not None or self.max_pass_rate is not None:
            keep &= attempts > 0
            with np.errstate(invalid="ignore"):
                if self.min_pass_rate is not None:
                    keep &= rate >= self.min_pass_rate
                if self.max_pass_rate is not None:
                    keep &= rate <= self.max_pass_rate
        if self.min_attempts is not None:
            keep &= attempts >= self.min_attempts
        if self.max_attempts is not None:
            keep &= attempts <= self.max_attempts
        rows = np.flatnonzero(keep)
        if self.sort is None:
            return rows
        name = self.sort.removeprefix("-")
        if name == "pass_rate":
            key = rate[rows]
        else:
            key = as_numpy(stats.column(name)).astype(np.float64)[rows]
            if name not in ("attempts", "successes"):
                key = np.where(attempts[rows] > 0, key, np.nan)
        missing = np.isnan(key)
        key = np.where(missing, 0.0, -key if self.sort.startswith("-") else key)
        return rows[np.lexsort((rows, key, missing))]


def _number(value: Any, name: str, where: str, lo: float, hi: float) -> float | None:
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not lo <= number <= hi:
        raise InvalidDataError(
            f"{name} for the rows of {where} must be a number from {lo:g} to {hi:g}, not {value!r}"
        )
    return number


def _whole(value: Any, name: str, where: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if number < 0:
        raise InvalidDataError(
            f"{name} for the rows of {where} must be a whole number of at least 0, not {value!r}"
        )
    return number


def row_stats(stats: pa.Table, rows: Any) -> list[dict[str, Any]]:
    """The statistics of ``rows`` as plain dicts (``pass_rate`` None when never trained)."""
    idx = pa.array(np.asarray(rows, dtype=np.int64))
    taken = stats.take(idx).to_pylist()
    for entry in taken:
        rate = pass_rate(entry["successes"], entry["attempts"])
        entry["pass_rate"] = float(rate) if entry["attempts"] else None
    return taken


def _points_cheaper(records: int, steps: int, rows: int, points: int) -> bool:
    """Whether the statistics at ``points`` versions cost less than folding every one of
    ``records``: a point reads an aggregate of ``rows`` and, on average, the files of half a
    checkpoint interval (fewer when the points are closer than that)."""
    if not steps or not points:
        return False
    per_step = records / steps
    files = min(steps / points, CHECKPOINT_INTERVAL / 2)
    return points * (rows + files * per_step) < records


def _picked(n: int, points: int | None) -> list[int] | range:
    """At most ``points`` of ``range(n)``, evenly spaced, the last always kept."""
    if points is None or n <= points:
        return range(n)
    return sorted({round(i * (n - 1) / max(points - 1, 1)) for i in range(points)})


def _end(starts: np.ndarray, i: int, n: int) -> int:
    """Where group ``i`` of ``n`` records that begin at ``starts`` ends (exclusive)."""
    return int(starts[i + 1]) if i + 1 < len(starts) else n


@dataclass
class _Series:
    """The band series folded so far over the first ``files`` files of a lineage."""

    files: int
    last_file: str | None
    last_step: int
    attempts: np.ndarray
    successes: np.ndarray
    steps: list[int]
    counts: list[list[int]]


@dataclass(frozen=True)
class _ByRow:
    """The outcome records of the first ``files`` files of a lineage, sorted by row, then
    step, then as recorded."""

    files: int
    last_file: str | None
    max_step: int
    rows: np.ndarray
    steps: np.ndarray
    scores: np.ndarray


def _columns(tables: list[pa.Table]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not tables:
        empty = np.empty(0, np.int64)
        return empty, empty, np.empty(0, np.float64)
    t = pa.concat_tables([x.select(["row", "step", "score"]) for x in tables])
    return (
        as_numpy(t.column("row")).astype(np.int64),
        as_numpy(t.column("step")).astype(np.int64),
        as_numpy(t.column("score")).astype(np.float64),
    )


class OutcomeViews:
    """The views of one store, with what they cache (versions are immutable, so nothing
    goes stale): the statistics and row orders of the versions asked about last, their
    records sorted by row (row histories), and the band series, each extended with only the
    outcome files a newer version of the same lineage committed since (like the growth
    chart)."""

    def __init__(self, store: Store, *, success_above: float = DEFAULT_SUCCESS_ABOVE):
        self.store = store
        self.success_above = success_above
        self._by_row: OrderedDict[int, _ByRow] = OrderedDict()
        self._stats: OrderedDict[int, pa.Table] = OrderedDict()
        self._orders: OrderedDict[tuple[int, RowSelection], np.ndarray] = OrderedDict()
        self._series: dict[int, _Series] = {}
        self._bands: OrderedDict[tuple[int, int], list[int]] = OrderedDict()
        self._lock = threading.Lock()

    # -- statistics and selections of a version ----------------------------------------------

    def stats(self, version: int) -> pa.Table:
        """:meth:`Store.outcome_stats` of ``version`` with this view's ``success_above``."""
        with self._lock:
            cached = self._stats.get(version)
            if cached is not None:
                self._stats.move_to_end(version)
                return cached
        table = self.store.outcome_stats(version, success_above=self.success_above)
        with self._lock:
            self._stats[version] = table
            while len(self._stats) > 2:
                self._stats.popitem(last=False)
        return table

    def select(self, version: int, choice: RowSelection) -> np.ndarray:
        """``choice.select`` over the statistics of ``version`` (cached: paging through a
        sorted table sorts once)."""
        key = (version, choice)
        with self._lock:
            cached = self._orders.get(key)
            if cached is not None:
                self._orders.move_to_end(key)
                return cached
        order = choice.select(self.stats(version))
        with self._lock:
            self._orders[key] = order
            while len(self._orders) > 8:
                self._orders.popitem(last=False)
        return order

    # -- one row's history -----------------------------------------------------------------

    def _records_by_row(self, version: int) -> _ByRow:
        with self._lock:
            cached = self._by_row.get(version)
            if cached is not None:
                self._by_row.move_to_end(version)
                return cached
            known = list(self._by_row.values())
        outcomes = self.store.outcome_log
        lineage = outcomes.lineage(version)
        count = lineage.count
        base = None
        for entry in known:  # the longest cached prefix of this lineage's files
            if (
                0 < entry.files <= count
                and (base is None or entry.files > base.files)
                and outcomes.file_at(lineage, entry.files - 1).path == entry.last_file
            ):
                base = entry
        start = base.files if base is not None else 0
        rows, steps, scores = _columns(
            [outcomes.read_file(ref, version) for ref in outcomes.files_from(lineage, start)]
        )
        order = np.lexsort((steps, rows))  # stable: a step's scores in the order recorded
        rows, steps, scores = rows[order], steps[order], scores[order]
        if base is not None and len(steps) and int(steps.min()) <= base.max_step:
            # steps older than the cached ones: sort everything again
            rows = np.concatenate([base.rows, rows])
            steps = np.concatenate([base.steps, steps])
            scores = np.concatenate([base.scores, scores])
            order = np.lexsort((steps, rows))
            rows, steps, scores = rows[order], steps[order], scores[order]
        elif base is not None:
            # every new record is of a later step: it goes after its row's older ones
            at = np.searchsorted(base.rows, rows, side="right")
            rows = np.insert(base.rows, at, rows)
            steps = np.insert(base.steps, at, steps)
            scores = np.insert(base.scores, at, scores)
        last = outcomes.file_at(lineage, count - 1).path if count else None
        top = int(steps.max()) if len(steps) else -1
        found = _ByRow(count, last, top, rows, steps, scores)
        with self._lock:
            self._by_row[version] = found
            while len(self._by_row) > 2:
                self._by_row.popitem(last=False)
        return found

    def row_history(self, version: int, row: int) -> dict[str, Any] | None:
        """Row ``row``'s outcomes in ``version``'s lineage, step by step: each step's scores
        and successes, and the row's pass rate and mean score through that step. None when
        the lineage holds no outcomes at all. The first request for a version reads its
        outcome records once (a row's history is not in the aggregates), or only the files
        committed since a version of its lineage asked about before; later rows of that
        version are a binary search."""
        if not outcome_records_count(self.store, version):
            return None
        by_row = self._records_by_row(version)
        rows, steps, scores = by_row.rows, by_row.steps, by_row.scores
        lo, hi = np.searchsorted(rows, [row, row + 1])
        mine_steps, mine_scores = steps[lo:hi], scores[lo:hi]
        history: list[dict[str, Any]] = []
        attempts = successes = 0
        total = 0.0
        if hi > lo:
            cuts = np.flatnonzero(np.diff(mine_steps)) + 1
            for part_steps, part in zip(
                np.split(mine_steps, cuts), np.split(mine_scores, cuts), strict=True
            ):
                won = int(succeeded(part, self.success_above).sum())
                attempts += len(part)
                successes += won
                for score in part.tolist():  # one by one, as the aggregate's fold adds them
                    total += score
                history.append(
                    {
                        "step": int(part_steps[0]),
                        "scores": part.tolist(),
                        "attempts": len(part),
                        "successes": won,
                        "pass_rate": float(pass_rate(successes, attempts)),
                        "mean_score": total / attempts,
                    }
                )
        summary = row_stats(self.stats(version), [row])[0]
        return {"success_above": self.success_above, **summary, "steps": history}

    def row_steps(
        self,
        version: int,
        row: int,
        *,
        limit: int = 200,
        before: int | None = None,
        points: int = 240,
        scores: int = 100,
    ) -> dict[str, Any] | None:
        """:meth:`row_history` bounded by what a page shows, whatever the row's history: the
        row's statistics; ``steps``, the latest ``limit`` steps it was trained at below step
        ``before`` (None: all), ascending, each with at most ``scores`` of its scores (the
        first, as recorded; ``attempts`` counts them all) and the same figures as
        :meth:`row_history`; ``steps_total``, how many steps the row has; ``next_before``,
        the ``before`` of the next older page (None on the oldest); and ``chart``, at most
        ``points`` of the steps, evenly spaced with the last kept (``step``, ``attempts``,
        ``successes``, ``pass_rate`` through it). Pages walked with ``next_before`` concatenate
        to :meth:`row_history`'s steps. Per-step figures are running sums over the row's
        records in the order row_history folds them (``np.cumsum`` adds one by one, so the
        means are bit-identical); nothing per step is built outside the page and the chart.
        Each call scans the lineage's outcome records for the row (the handle's cache of
        outcome files keeps the newest 512 decoded; older ones are read again) and keeps no
        sorted copy of them, unlike row_history. None when the lineage holds no outcomes."""
        if not outcome_records_count(self.store, version):
            return None
        # Only this row's records, in lineage order, then by step (ties as recorded: the
        # order row_history folds): the lineage's records are scanned, never copied or
        # kept, so memory follows the row and the page, not the history.
        records = self.store.outcome_log.records(version)
        mask = pc.equal(records.column("row"), row)
        steps = as_numpy(pc.filter(records.column("step"), mask)).astype(np.int64, copy=False)
        order = np.argsort(steps, kind="stable")
        steps = steps[order]
        values = as_numpy(pc.filter(records.column("score"), mask))[order].astype(
            np.float64, copy=False
        )
        del records, mask, order
        n = len(steps)
        change = np.ones(n, dtype=bool)
        np.not_equal(steps[1:], steps[:-1], out=change[1:])
        starts = np.flatnonzero(change)  # each step's first record
        del change
        count = len(starts)
        stop = count if before is None else int(np.searchsorted(steps[starts], before))
        first = max(stop - limit, 0)
        shown = {
            i: values[starts[i] : min(int(starts[i]) + scores, _end(starts, i, n))].tolist()
            for i in range(first, stop)
        }
        # Running sums through each record, in place of the records (the page's scores are
        # taken above): the figures of any step are read off them.
        won = np.cumsum(succeeded(values, self.success_above), dtype=np.int64)
        total = np.cumsum(values, out=values)

        def figures(i: int) -> dict[str, Any]:
            a, b = int(starts[i]), _end(starts, i, n)
            through = int(won[b - 1])
            return {
                "step": int(steps[a]),
                "attempts": b - a,
                "successes": through - (int(won[a - 1]) if a else 0),
                "pass_rate": float(pass_rate(through, b)),
                "mean_score": float(total[b - 1]) / b,
            }

        page = []
        for i in range(first, stop):
            entry = figures(i)
            page.append({"step": entry.pop("step"), "scores": shown[i], **entry})
        chart = []
        for i in _picked(count, points):
            entry = figures(i)
            del entry["mean_score"]
            chart.append(entry)
        summary = row_stats(self.stats(version), [row])[0]
        return {
            "success_above": self.success_above,
            **summary,
            "steps": page,
            "steps_total": count,
            "next_before": int(steps[starts[first]]) if first else None,
            "chart": chart,
        }

    # -- rows per pass-rate band, per step -------------------------------------------------

    def band_series(self, version: int, *, bins: int = 10, points: int | None = None) -> dict:
        """After each step of ``version``'s lineage, how many rows sit in each pass-rate band
        (their pass rate over every outcome up to and including that step), as
        :func:`dynstate.records.aggregate.summarize` bins them; the last point equals its histogram.
        ``points``: at most this many steps, evenly spaced, the last always kept (the counts
        are exact at the steps kept).

        Two ways to the same counts, the cheaper one chosen from the commit records alone:

        * the fold of every outcome record of the lineage, cached per version: a later head
          folds only the files committed since (all of them again after a rollback);
        * where every commit of the lineage that holds outcomes adds one step, later than the
          steps before it (what a training loop writes), the bands of
          :meth:`Store.outcome_stats` at the version that committed each step kept: one
          stored aggregate plus fewer than :data:`~dynstate.records.manifest.CHECKPOINT_INTERVAL`
          outcome files per point, whatever the length of the history. Chosen when that is
          estimated to read less than the fold (points x (rows + the records of the files
          since a checkpoint) < every record: a history long next to the points drawn), and
          no fold of the lineage is cached.

        So the first chart reads the lesser of every record and about ``points`` aggregates
        with the files after them."""
        lineage = self.store.outcome_log.lineage(version)
        num_rows = self.store.commit_record(version).num_rows
        records = lineage.records
        steps_held = sum(b - a + 1 for a, b in lineage.steps)
        plan = None
        if _points_cheaper(records, steps_held, num_rows, len(_picked(steps_held, points))) and (
            self._fold_base(version, bins) is None  # a cached fold reads only the files since
        ):
            plan = self._step_versions(version)
        if plan is None and steps_held > _FOLD_STEPS:
            kept_steps, kept_counts, recorded = self._fold_at(version, bins, points)
        elif plan is None:
            series = self._fold(version, bins)
            steps, counts = series.steps, series.counts
            picked = _picked(len(steps), points)
            kept_steps = [steps[i] for i in picked]
            kept_counts = [counts[i] for i in picked]
            recorded = len(steps)
        else:
            picked = _picked(len(plan), points)
            kept_steps = [plan[i][0] for i in picked]
            kept_counts = [self._bands_at(plan[i][1], bins) for i in picked]
            recorded = len(plan)
        return {
            "version": version,
            "bins": bins,
            "success_above": self.success_above,
            "bands": [{"low": i / bins, "high": (i + 1) / bins} for i in range(bins)],
            "rows": num_rows,
            "records": records,
            "steps_recorded": recorded,
            "steps": kept_steps,
            "counts": kept_counts,
            "trained": [sum(c) for c in kept_counts],
        }

    def _step_versions(self, version: int) -> list[tuple[int, int]] | None:
        """``(step, version that committed it)`` along ``version``'s lineage, oldest first,
        when each commit with outcomes adds exactly one step, newer than every step before
        it, and all of them are above the gc floor; None otherwise. From the commit records
        and outcome lineages alone (no outcome file is read)."""
        outcomes = self.store.outcome_log
        versions = list(self.store.lineage(version))[::-1]
        plan: list[tuple[int, int]] = []
        count, top, records = 0, -1, 0
        for v in versions:
            lineage = outcomes.lineage(v)
            if lineage.records == records:
                continue
            n = sum(b - a + 1 for a, b in lineage.steps)
            last = lineage.steps[-1][1] if lineage.steps else -1
            if n != count + 1 or last <= top:
                return None  # several steps in one commit, or one out of order
            plan.append((last, v))
            count, top, records = n, last, lineage.records
        return plan

    def _bands_at(self, version: int, bins: int) -> list[int]:
        """Trained rows per pass-rate band in the statistics of ``version`` (cached)."""
        key = (version, bins)
        with self._lock:
            cached = self._bands.get(key)
            if cached is not None:
                return cached
        stats = self.store.outcome_stats(version, success_above=self.success_above)
        attempts = as_numpy(stats.column("attempts")).astype(np.int64)
        successes = as_numpy(stats.column("successes")).astype(np.int64)
        found = band_counts(successes, attempts, bins).tolist()
        with self._lock:
            self._bands[key] = found
            while len(self._bands) > _BANDS_CACHED:
                self._bands.popitem(last=False)
        return found

    def _fold_at(
        self, version: int, bins: int, points: int | None
    ) -> tuple[list[int], list[list[int]], int]:
        """The steps :func:`_picked` keeps of ``version``'s lineage, their band counts (as
        :meth:`_fold` gives them) and how many steps it holds, folding every record once but
        counting bands at the kept steps only: the records between two kept steps are added
        together (a row's band depends only on its totals through a step). Nothing is
        cached, and its memory is the records' columns, not the steps'."""
        outcomes = self.store.outcome_log
        num_rows = self.store.commit_record(version).num_rows
        records = outcomes.records(version)
        steps = as_numpy(records.column("step")).astype(np.int64, copy=False)
        order = np.argsort(steps, kind="stable")
        steps = steps[order]
        rows = as_numpy(records.column("row")).astype(np.int64, copy=False)[order]
        won = succeeded(as_numpy(records.column("score")), self.success_above)[order]
        del records, order
        starts = np.flatnonzero(np.diff(steps, prepend=-1))
        kept = [int(steps[starts[i]]) for i in _picked(len(starts), points)]
        cuts = np.searchsorted(steps, kept, side="right")
        attempts = np.zeros(num_rows, np.int64)
        successes = np.zeros(num_rows, np.int64)
        current = np.zeros(bins, np.int64)
        counts: list[list[int]] = []
        a = 0
        for b in cuts.tolist():
            current += _step_bands(attempts, successes, rows[a:b], won[a:b], bins)
            counts.append(current.tolist())
            a = b
        return kept, counts, len(starts)

    def _fold(self, version: int, bins: int) -> _Series:
        outcomes = self.store.outcome_log
        lineage = outcomes.lineage(version)
        num_rows = self.store.commit_record(version).num_rows
        count = lineage.count
        base = self._fold_base(version, bins)
        new = outcomes.files_from(lineage, base.files if base is not None else 0)
        tables = [outcomes.read_file(ref, version) for ref in new]
        records = (
            pa.concat_tables([t.select(["row", "step", "score"]) for t in tables])
            if tables
            else None
        )
        if (
            base is not None
            and records is not None
            and records.num_rows
            and int(as_numpy(records.column("step")).min()) <= base.last_step
        ):
            # A step older than those folded (steps need not be committed in order): the
            # series is rebuilt from every file.
            base, tables = None, [outcomes.read_file(r, version) for r in outcomes.files(lineage)]
            records = pa.concat_tables([t.select(["row", "step", "score"]) for t in tables])
        if base is not None and not new and len(base.attempts) == num_rows:
            return base
        if base is None:
            series = _Series(
                0, None, -1, np.zeros(num_rows, np.int64), np.zeros(num_rows, np.int64), [], []
            )
        else:
            grown_a = np.zeros(num_rows, np.int64)
            grown_s = np.zeros(num_rows, np.int64)
            grown_a[: len(base.attempts)] = base.attempts
            grown_s[: len(base.successes)] = base.successes
            series = _Series(
                base.files,
                base.last_file,
                base.last_step,
                grown_a,
                grown_s,
                list(base.steps),
                [list(c) for c in base.counts],
            )
        if records is not None and records.num_rows:
            self._add(series, records, bins)
        series.files = count
        series.last_file = outcomes.file_at(lineage, count - 1).path if count else None
        with self._lock:
            self._series[bins] = series
        return series

    def _fold_base(self, version: int, bins: int) -> _Series | None:
        """The cached fold that ``version``'s lineage extends (its files are a prefix of the
        lineage's), or None."""
        outcomes = self.store.outcome_log
        lineage = outcomes.lineage(version)
        num_rows = self.store.commit_record(version).num_rows
        with self._lock:
            cached = self._series.get(bins)
        if (
            cached is not None
            and cached.files <= lineage.count
            and len(cached.attempts) <= num_rows
            and (
                cached.files == 0
                or outcomes.file_at(lineage, cached.files - 1).path == cached.last_file
            )
        ):
            return cached
        return None

    def _add(self, series: _Series, records: pa.Table, bins: int) -> None:
        rows = as_numpy(records.column("row")).astype(np.int64)
        steps = as_numpy(records.column("step")).astype(np.int64)
        won = succeeded(as_numpy(records.column("score")), self.success_above)
        order = np.argsort(steps, kind="stable")
        rows, steps, won = rows[order], steps[order], won[order]
        current = band_counts(series.successes, series.attempts, bins)
        cuts = np.flatnonzero(np.diff(steps)) + 1
        for step_rows, step_won, at in zip(
            np.split(rows, cuts), np.split(won, cuts), np.split(steps, cuts), strict=True
        ):
            current += _step_bands(series.attempts, series.successes, step_rows, step_won, bins)
            series.steps.append(int(at[0]))
            series.counts.append(current.tolist())
        series.last_step = series.steps[-1]


def _step_bands(
    attempts: np.ndarray, successes: np.ndarray, rows: np.ndarray, won: np.ndarray, bins: int
) -> np.ndarray:
    """Count one step's records in (:func:`~dynstate.records.aggregate.tally`) and return how
    the band counts change: the rows it names leave their old band and join their new one."""
    hit, inv = tally(attempts, successes, rows, won)
    tried, passed = attempts[hit], successes[hit]
    new = np.bincount(band_of(passed, tried, bins), minlength=bins)
    # the rows' counts before the step: less what it added (exact integers)
    tried = tried - np.bincount(inv, minlength=len(hit))
    passed = passed - np.bincount(inv[won], minlength=len(hit))
    before = tried > 0
    return new - np.bincount(band_of(passed[before], tried[before], bins), minlength=bins)
