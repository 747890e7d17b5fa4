"""The JSON documents of ``dynstate serve``, built from the library: every HTML page renders
one of these, and ``/api/...`` returns it as is. Keys follow the CLI's ``--json`` output where
the two overlap (``info``, ``ls``, ``show``, ``diff``, ``inspect``).

Every builder reads only what it returns: a page of versions reads the records on that page,
a page of rows the shards those rows are in. Filters on data columns and text search scan the
one version asked about, shard by shard, and stop once the page is full.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from ..errors import DynstateError, VersionCollectedError, VersionNotFoundError
from ..history import describe, diff, growth, summary, version_rows
from ..history.outcomes import NO_OUTCOMES, OutcomeViews, RowSelection, outcome_records_count
from ..history.story import consumption_series, drawn_band_series, step_story
from ..records.aggregate import summarize
from ..snapshot import Snapshot
from ..storage.credentials import scrub, secrets_of
from ..store import Store
from .graph import ancestors, descendants, preview, sources
from .lineage import LineageCache
from .rows import MAX_LIMIT, RowQuery, int_param, jsonable

log = logging.getLogger("dynstate")

_DIFF_PREVIEW = 10
# A row's outcome history per page: steps listed (default, most) and chart points.
STEPS_PAGE = 200
MAX_STEPS_PAGE = 5_000
CHART_POINTS = 240
MAX_CHART_POINTS = 5_000


class RowNotFoundError(DynstateError, LookupError):
    """A row number outside a version's rows."""


def chart_failed(floor: int, exc: BaseException) -> dict[str, Any]:
    """The growth document when the chart cannot be built from what the records hold: no
    points, and one line on why (the rest of the page is unaffected)."""
    return {
        "axis": "version",
        "floor": floor,
        "points": [],
        "markers": [],
        "error": f"the growth chart cannot be drawn from this store's records "
        f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})",
    }


class StoreView:
    """Everything ``dynstate serve`` shows about one store, as JSON-able dicts."""

    def __init__(
        self,
        store: Store,
        *,
        checkpoints: Sequence[str] = (),
        url: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ):
        self.store = store
        self.url = url or store.url  # opens checkpoint datasets; never shown
        self.storage_options = dict(storage_options or {})
        self.checkpoints = list(checkpoints)
        self.lineage = LineageCache(store)
        self.rows = RowQuery(store)
        self.outcomes = OutcomeViews(store)
        self._growth: tuple[int, dict[str, Any]] | None = None
        self._growth_lock = threading.Lock()
        self._checkpoint_info: dict[int, dict[str, Any]] = {}
        # One scan of a lineage's outcome records at a time (a row's history, the band
        # series): each is bounded by its page, but requests and the start-up thread at once
        # would add their peaks up.
        self._scan_lock = threading.Lock()

    # -- helpers -----------------------------------------------------------------------------

    @property
    def secrets(self) -> list[str]:
        """Values never to show besides those the scrubber always hides: credentials in the
        URL and in the storage options."""
        return secrets_of(self.url, self.storage_options)

    def resolve(self, version: int | str | None) -> int:
        if version in (None, "", "head"):
            return self.store.refresh()
        return self.store.resolve(version)

    @contextlib.contextmanager
    def _scanning(self) -> Iterator[None]:
        """Hold the scan lock; after the scan, hand the memory Arrow's allocator kept back
        to the system (it keeps freed pages for reuse: a server idles at its peak else)."""
        with self._scan_lock:
            try:
                yield
            finally:
                pa.default_memory_pool().release_unused()

    # -- store -------------------------------------------------------------------------------

    def growth(self, head: int | None = None) -> dict[str, Any]:
        """The growth (:func:`dynstate.history.growth`) of the lineage of ``head`` (default:
        the head read now), cached per head (a later head re-reads only records it has not
        read before, which the store caches)."""
        if head is None:
            head = self.store.refresh()
        with self._growth_lock:
            if self._growth is not None and self._growth[0] == head:
                return self._growth[1]
            try:
                data = growth(self.store, self.lineage.chain(head))
            except DynstateError:
                raise
            except (ArithmeticError, ValueError, TypeError, MemoryError) as exc:
                # Record meta is whatever the writers put there (a step of 2**64, a float
                # step of 1e308): a chart it breaks must not take the store page with it.
                debug = log.isEnabledFor(logging.DEBUG)
                what = f"{type(exc).__name__}: {exc}"
                log.warning("growth chart of %s: %s", self.store.display_url, what, exc_info=debug)
                data = chart_failed(self.store.floor, exc)
            self._growth = (head, data)
            return data

    def store_info(self, *, with_growth: bool = True) -> dict[str, Any]:
        """:func:`dynstate.history.summary` (``dynstate ls``'s header), the checkpoints this
        server was given, the head lineage's outcome record count and its growth."""
        info = summary(self.store)
        info["checkpoints"] = [{"id": k, "path": path} for k, path in enumerate(self.checkpoints)]
        info["outcome_records"] = outcome_records_count(self.store, info["head"])
        if with_growth:
            info["growth"] = self.growth(info["head"])
        return info

    # -- versions ----------------------------------------------------------------------------

    def versions_page(
        self, *, limit: str | None = None, before: str | None = None, head: int | None = None
    ) -> dict:
        """Versions newest first: ``limit`` of them below ``before`` (default: from the head).
        Reads the records shown and the head's lineage down to the oldest one shown. ``head``:
        the head a caller has just read (:meth:`store_info`'s), for a page that names one head
        however the store moves meanwhile; by default it is read now."""
        if head is None:
            head = self.store.refresh()
        floor = self.store.floor
        n = int_param(limit, "limit", 50, 1, MAX_LIMIT)
        top = int_param(before, "before", head + 1, 0, None)
        top = min(top, head + 1)
        rows = version_rows(self.store, include_abandoned=True, limit=n, before=top, refresh=False)
        numbers = [r["version"] for r in rows]
        more = bool(numbers) and numbers[-1] > floor
        return {
            "url": self.store.display_url,
            "head": head,
            "oldest": floor,
            "limit": n,
            "before": top,
            "next_before": numbers[-1] if more else None,
            "versions": rows,
        }

    def version_info(self, version: int | str | None) -> dict[str, Any]:
        """``dynstate show --json`` of one version, plus its rounds (which rows each wrote)."""
        v = self.resolve(version)
        info = describe(self.store, v)
        rounds = self.lineage.rounds(v)
        info["rounds"] = [s.to_json() for s in rounds.segments]
        info["columns"] = [f["name"] for f in info["schema"]]
        info["step_story"] = step_story(self.store, v)
        return info

    # -- rows --------------------------------------------------------------------------------

    def rows_page(
        self,
        version: int | str | None,
        *,
        offset: str | None = None,
        limit: str | None = None,
        q: str | None = None,
        filters: Mapping[str, Sequence[str]] | None = None,
        outcome: Mapping[str, str | None] | None = None,
    ) -> dict[str, Any]:
        """A page of a version's rows, filtered and searched, with facets (see
        :meth:`RowQuery.page`), and — where the version's lineage holds outcomes — each row's
        attempts and pass rate, sortable and filterable by them (``outcome``: ``sort``,
        ``min_pass_rate``, ``max_pass_rate``, ``min_attempts``, ``max_attempts``, as
        :class:`dynstate.history.outcomes.RowSelection` takes them)."""
        v = self.resolve(version)
        where = f"version {v} of {self.store.display_url}"
        choice = RowSelection.parse(dict(outcome or {}), where)
        recorded = outcome_records_count(self.store, v) > 0
        stats = self.outcomes.stats(v) if recorded else None
        order = self.outcomes.select(v, choice) if recorded and choice.active else None
        page = self.rows.page(
            self.store.snapshot(v),
            self.lineage.rounds(v),
            offset,
            limit,
            q,
            filters or {},
            order=order,
        )
        if stats is not None:
            figures = _row_figures(stats, [r["row"] for r in page["rows"]])
            for entry, fig in zip(page["rows"], figures, strict=True):
                entry["outcomes"] = fig
        return {
            "url": self.store.display_url,
            "version": v,
            **page,
            "outcomes": {
                "recorded": recorded,
                "message": None if recorded else NO_OUTCOMES,
                **choice.to_json(),
            },
        }

    # -- outcomes ----------------------------------------------------------------------------

    def outcomes_info(
        self, version: int | str | None, *, bins: str | None = None, points: str | None = None
    ) -> dict[str, Any]:
        """The outcomes of a version's lineage: ``dynstate stats --json`` (its summary) and
        the rows per pass-rate band after each step (at most ``points`` steps shown)."""
        v = self.resolve(version)
        n_bins = int_param(bins, "bins", 10, 1, 100)
        n_points = int_param(points, "points", 240, 2, 100_000)
        records = outcome_records_count(self.store, v)
        info: dict[str, Any] = {
            "url": self.store.display_url,
            "version": v,
            "recorded": records > 0,
            "message": None if records else NO_OUTCOMES,
        }
        if not records:
            return {**info, "summary": None, "bands": None, "drawn_bands": None, "filtering": None}
        with self._scanning():
            stats = self.outcomes.stats(v)
            summary = summarize(stats, bins=n_bins, top=10)
            series = self.outcomes.band_series(v, bins=n_bins, points=n_points)
            drawn = drawn_band_series(self.store, v, bins=n_bins, points=n_points)
            filtering = consumption_series(self.store, v, limit=n_points)
        return {
            **info,
            "summary": summary,
            "bands": series,
            "drawn_bands": drawn,
            "filtering": filtering if filtering["steps"] else None,
        }

    # -- one row and its lineage -------------------------------------------------------------

    def row_detail(
        self,
        version: int | str | None,
        row: int | str,
        *,
        limit: str | None = None,
        before: str | None = None,
        points: str | None = None,
    ) -> dict[str, Any]:
        """One row: its values, round, lineage and outcome history. The history is one page
        (:meth:`dynstate.history.outcomes.OutcomeViews.row_steps`): the latest ``limit`` steps
        below step ``before`` and a chart of at most ``points`` steps, so a row trained at
        10**6 steps costs a page, not its history; ``outcome_steps.next_before`` pages on."""
        v = self.resolve(version)
        snap = self.store.snapshot(v)
        i = self._row_number(snap, row)
        n = int_param(limit, "limit", STEPS_PAGE, 1, MAX_STEPS_PAGE)
        below = None if before in (None, "") else int_param(before, "before", 0, 0, None)
        n_points = int_param(points, "points", CHART_POINTS, 2, MAX_CHART_POINTS)
        rounds = self.lineage.rounds(v)
        values = self.rows.read(snap, [i])[0]
        seg = rounds.of_row(i)
        round_info = None
        if seg is not None and seg.version is not None:
            try:
                record = self.store.commit_record(seg.version)
            except VersionCollectedError:
                record = None  # collected since the rounds were read: no round, as docs say
            if record is not None:
                round_info = {**seg.to_json(), "op": record.op, "meta": record.meta}
        up, up_edges = ancestors(snap, i, values, self.rows.read)
        index = self.lineage.index(v)
        down, down_edges = descendants(index, i)
        with self._scanning():
            history = self.outcomes.row_steps(v, i, limit=n, before=below, points=n_points)
        nodes = {n["row"]: n for n in [*up, *down]}
        previews = self.rows.read(snap, list(nodes)) if nodes else []
        for (r, node), vals in zip(nodes.items(), previews, strict=True):
            node.update(self.rows.row_json(rounds, r, {}))
            node["preview"] = preview(vals)
            node.pop("values", None)
        return {
            "url": self.store.display_url,
            "version": v,
            "row": i,
            "round": round_info,
            "values": values,
            "sources": sources(values),
            "ancestors": up,
            "descendants": down,
            "edges": [*up_edges, *down_edges],
            "index": {"version": index.version, "rows": index.num_rows, "edges": index.edges},
            **_outcome_page(history, n, below),
        }

    def _row_number(self, snap: Snapshot, row: int | str) -> int:
        try:
            i = int(row)
        except (TypeError, ValueError):
            i = -1
        if not 0 <= i < snap.num_rows:
            last = f"rows are 0-{snap.num_rows - 1}" if snap.num_rows else "it has no rows"
            raise RowNotFoundError(
                f"row {row} not found in version {snap.version} of {self.store.display_url} "
                f"({last})"
            )
        return i

    # -- diff --------------------------------------------------------------------------------

    def diff(self, a: int | str | None, b: int | str | None) -> dict[str, Any]:
        """``dynstate diff --json`` of two versions (:func:`dynstate.history.diff`: it reads
        the records back to where the lineages meet, no further), plus the row ranges and
        rounds added and removed and the first rows of each: rows up to the newest version
        both lineages hold are shared (row identity), so the rows a side adds are those of
        its versions that the other lacks."""
        va, vb = self.resolve(a), self.resolve(b)
        info = diff(self.store, va, vb)
        shared = info["shared_rows"]
        sides = (("added", vb, info["added_versions"]), ("removed", va, info["removed_versions"]))
        rounds = {side: self.lineage.rounds_of(v, versions) for side, v, versions in sides}
        ends = {"added": info["rows"][1], "removed": info["rows"][0]}
        for side, _, _ in sides:
            info[f"{side}_range"] = [shared, ends[side]]
        for side, _, _ in sides:
            segments = rounds[side].segments
            info[f"{side}_rounds"] = [s.to_json() for s in segments if s.version is not None]
        for side, v, _ in sides:
            # The first rows of the side, read from the shards they are in only.
            first = list(range(shared, min(ends[side], shared + _DIFF_PREVIEW)))
            values = self.rows.read(self.store.snapshot(v), first)
            info[f"{side}_preview"] = [
                self.rows.row_json(rounds[side], i, x) for i, x in zip(first, values, strict=True)
            ]
        return info

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint(self, k: int | str) -> dict[str, Any]:
        """What checkpoint ``k`` (of ``--checkpoint``) pins: ``dynstate inspect --json``, plus
        the next rows grouped into batches."""
        try:
            number = int(k)
        except (TypeError, ValueError):
            number = -1
        if not 0 <= number < len(self.checkpoints):
            raise RowNotFoundError(
                f"no checkpoint {k}; this server was given {len(self.checkpoints)} "
                "(dynstate serve URL --checkpoint PATH)"
            )
        cached = self._checkpoint_info.get(number)
        if cached is not None:
            return cached
        from ..loading.checkpoint import describe_checkpoint, load_checkpoint_state

        path = self.checkpoints[number]
        _, state = load_checkpoint_state(path)
        batch = int(state.get("batch_size") or 8)
        info = describe_checkpoint(
            path,
            store_url=self.url,
            storage_options=self.storage_options or None,
            rows=min(2 * batch, 64),
        )
        info = {k: jsonable(v) for k, v in info.items()}
        info["store_url"] = scrub(str(info["store_url"]), self.secrets)
        info["id"] = number
        info["path"] = path
        info["batch_size"] = batch
        indices = info["next_indices"]
        info["next_batches"] = [
            {"rows": indices[i : i + batch], "values": info["next_rows"][i : i + batch]}
            for i in range(0, len(indices), batch)
        ]
        version = info.get("version")
        if isinstance(version, int):
            try:
                info["version_rows"] = self.store.commit_record(version).num_rows
            except VersionNotFoundError:
                info["version_rows"] = None
        self._checkpoint_info[number] = info
        return info


def _outcome_page(history: dict[str, Any] | None, limit: int, before: int | None) -> dict[str, Any]:
    """``outcomes`` (the row's statistics and its page of steps, the keys ``row_history``
    has) and ``outcome_steps`` (where the page sits: ``total`` steps, ``limit``, ``before``,
    ``next_before``, and the ``chart`` points), both None without outcomes."""
    if history is None:
        return {"outcomes": None, "outcome_steps": None}
    place = {
        "total": history.pop("steps_total"),
        "limit": limit,
        "before": before,
        "next_before": history.pop("next_before"),
        "chart": history.pop("chart"),
    }
    return {"outcomes": history, "outcome_steps": place}


def _row_figures(stats: Any, rows: list[int]) -> list[dict[str, Any]]:
    from ..history.outcomes import row_stats

    return (
        [
            {k: f[k] for k in ("attempts", "successes", "pass_rate", "mean_score", "last_step")}
            for f in row_stats(stats, rows)
        ]
        if rows
        else []
    )
