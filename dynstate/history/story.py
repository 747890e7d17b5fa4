"""A step's story: what the round of one version trained on and how it scored, as ``dynstate
show`` and serve's version page show it, and the same figures per round along a lineage
(serve's ``/outcomes``, "drawn rows by pass-rate band").

A round's outcomes are the outcome records committed in its version (the outcome files its
append added): in a training loop, the rows its step drew and the scores the policy got on
them. Each row's figures there are over those records only; a success, a pass rate and a band
are :mod:`dynstate.records.aggregate`'s. The generator state is the one the version's own
record commits, the consumption record (what the step drew, trained, filtered, dropped and
carried) the one :mod:`dynstate.log.consumption` reads back. The selection policy lives in
the sampler state; the store holds a sampler state only inside a consumption record, so the
policy is shown where the round has one.

Everything here reads the version's commit record and the outcome files it added: the same
work at step 10,000 as at 10. The series reads the commit records of the lineage (as the
growth chart does) and the outcome files of the rounds it keeps only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from ..errors import InvalidDataError
from ..loading.selection import FunctionPolicy, as_policy
from ..log.steps import own_step
from ..records.aggregate import band_counts, pass_rate, succeeded, tally
from ..records.manifest import Commit
from ..records.outcomes import DEFAULT_SUCCESS_ABOVE, as_numpy
from ..records.rounds import SELECT_META
from .outcomes import _picked

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["consumption_series", "drawn_band_series", "step_story", "weight_spread"]

# The lists of a consumption record a story shows (each bounded like the drawn rows).
# in_flight: format-2 records only (asynchronous trainers); empty for the others
_CONSUMED = ("carried_in", "drawn", "trained", "filtered", "dropped", "carry", "in_flight")


def _round_records(store: Store, record: Commit) -> pa.Table | None:
    """The outcome records ``record``'s version committed (``row``, ``step``, ``score``), in
    the order committed; None when it committed none."""
    outcomes = store.outcome_log
    files = outcomes.added(record)
    if not files:
        return None
    tables = [
        outcomes.read_file(ref, record.version).select(["row", "step", "score"]) for ref in files
    ]
    return pa.concat_tables(tables)


def _per_row(
    table: pa.Table, success_above: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rows ``table`` names in the order they first appear, each one's attempts and
    successes, each record's row among them, the scores and whether each succeeded."""
    rows = as_numpy(table.column("row")).astype(np.int64, copy=False)
    scores = as_numpy(table.column("score")).astype(np.float64, copy=False)
    won = succeeded(scores, success_above)
    distinct, first = np.unique(rows, return_index=True)
    attempts = np.zeros(len(distinct), np.int64)
    successes = np.zeros(len(distinct), np.int64)
    # tally over positions among the distinct rows (sorted), then put them in recorded order
    _, inv = tally(attempts, successes, np.searchsorted(distinct, rows), won)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return distinct[order], attempts[order], successes[order], rank[inv], scores, won


def _band_doc(counts: np.ndarray, bins: int) -> list[dict[str, Any]]:
    return [{"low": i / bins, "high": (i + 1) / bins, "rows": int(counts[i])} for i in range(bins)]


def _outcomes_doc(
    table: pa.Table, success_above: float, bins: int, rows: int, scores: int
) -> dict[str, Any]:
    distinct, attempts, successes, which, values, won = _per_row(table, success_above)
    steps = as_numpy(table.column("step")).astype(np.int64, copy=False)
    total, passed = len(values), int(won.sum())
    shown = min(rows, len(distinct))
    by_row = np.argsort(which, kind="stable")  # each row's records, in the order recorded
    starts = np.searchsorted(which[by_row], np.arange(shown + 1))
    drawn = []
    for k in range(shown):
        mine = values[by_row[starts[k] : starts[k + 1]]]
        drawn.append(
            {
                "row": int(distinct[k]),
                "attempts": int(attempts[k]),
                "successes": int(successes[k]),
                "pass_rate": float(pass_rate(successes[k], attempts[k])),
                "scores": mine[:scores].tolist(),
            }
        )
    return {
        "records": total,
        "rows": len(distinct),
        "successes": passed,
        "pass_rate": float(pass_rate(passed, total)),
        "mean_score": float(values.sum() / total),
        "success_above": success_above,
        "steps": sorted({int(s) for s in np.unique(steps)}),
        "bands": _band_doc(band_counts(successes, attempts, bins), bins),
        "drawn": drawn,
        "drawn_more": len(distinct) - shown,
        "scores_shown": scores,
    }


def _consumption_doc(record: dict[str, Any], rows: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "rows_version": record["rows_version"],
        "gen_batches": record["gen_batches"],
        "settings": record["settings"],
    }
    for name in _CONSUMED:
        items = record.get(name, [])
        out[name] = {"count": len(items), "rows": items[:rows], "more": max(len(items) - rows, 0)}
    return out


def _policy_of(record: Commit, consumed: dict[str, Any] | None) -> dict[str, Any] | None:
    """The selection policy in force at the round (``{"policy", "params"}``): the one the
    consumption record's sampler state names, else the one the integration's round commit
    names in its meta (:data:`SELECT_META`); None where neither does."""
    if consumed is not None and _is_identity(consumed["sampler"].get("select")):
        return dict(consumed["sampler"]["select"])
    meta = record.meta if isinstance(record.meta, dict) else {}
    if _is_identity(meta.get(SELECT_META)):
        return dict(meta[SELECT_META])
    return None


def _is_identity(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("policy"), str)
        and isinstance(value.get("params"), dict)
    )


def weight_spread(
    store: Store, version: int, policy: dict[str, Any], step: int | None
) -> dict[str, Any]:
    """How the selection policy ``policy`` (``{"policy", "params"}``, as a sampler state
    names it) spreads the draws over ``version``'s rows by ``version``'s statistics, at the
    step after ``step``: what the draws that read this version choose from. ``rows``,
    ``eligible`` (rows of weight above 0 in a part with a share above 0), ``effective_rows``
    (1 / sum of p squared, p each row's expected share of a step's draws: ``rows`` for a
    uniform draw, 1 when one row takes every draw), ``max_share`` and ``min_share`` (the
    largest and smallest p above 0). A user function's code is not imported from what a store
    names, so its spread is not computed: ``error`` says so, as it does for a policy that
    refuses these statistics."""
    num_rows = store.commit_record(version).num_rows
    out: dict[str, Any] = {"stats_version": version, "rows": num_rows}
    if policy["policy"] == FunctionPolicy.name:
        return {**out, "error": "a user function's weights are not computed from a store "
                "(its code is never imported from what the store names)"}  # fmt: skip
    try:
        built = as_policy({**policy["params"], "policy": policy["policy"]})
        assert built is not None
        at = (step or 0) + 1
        where = f"{built.describe()} at step {at}, version {version} of {store.display_url}"
        share = built.expected_shares(store.outcome_stats(version), at, where)
    except InvalidDataError as exc:
        return {**out, "error": str(exc)}
    drawn = share[share > 0]
    return {
        **out,
        "eligible": len(drawn),
        "effective_rows": float(1.0 / np.square(drawn).sum()) if len(drawn) else 0.0,
        "max_share": float(drawn.max()) if len(drawn) else 0.0,
        "min_share": float(drawn.min()) if len(drawn) else 0.0,
    }


def step_story(
    store: Store,
    version: int,
    *,
    rows: int = 20,
    scores: int = 32,
    bins: int = 10,
    success_above: float = DEFAULT_SUCCESS_ABOVE,
) -> dict[str, Any]:
    """The story of the step whose round is ``version``: ``step`` (the round's own step,
    :func:`dynstate.log.steps.own_step`; None for a version of no step), ``outcomes`` (None
    when the version committed none: how many records over how many rows, the successes,
    the pass rate and the mean score, the steps the records name, the rows per pass-rate
    band, and the first ``rows`` rows in the order recorded with each one's attempts,
    successes, pass rate and first ``scores`` scores; ``drawn_more`` counts the rows not
    listed), ``generator_state`` (the state this version committed, None if none),
    ``consumption`` (its consumption record, each list with its count and first ``rows``
    entries; None without one) and ``policy`` (the selection policy of the sampler state in
    that record or in the round's meta, ``{"policy", "params"}``; None where the store does
    not know it) with ``weights`` (:func:`weight_spread`; None without a policy)."""
    record = store.commit_record(version)
    step = own_step(record)
    table = _round_records(store, record)
    consumed = None
    if step is not None and record.consumption is not None:
        found = store.consumption.of_step(version, step)
        if found is not None and found[0] == version:
            consumed = found[1]
    policy = _policy_of(record, consumed)
    return {
        "version": version,
        "step": step,
        "outcomes": None
        if table is None or not table.num_rows
        else _outcomes_doc(table, success_above, bins, rows, scores),
        "generator_state": record.generator_state,
        "consumption": None if consumed is None else _consumption_doc(consumed, rows),
        "policy": policy,
        "weights": None if policy is None else weight_spread(store, version, policy, step),
    }


def drawn_band_series(
    store: Store,
    version: int,
    *,
    bins: int = 10,
    points: int | None = None,
    success_above: float = DEFAULT_SUCCESS_ABOVE,
) -> dict[str, Any]:
    """Per round of ``version``'s lineage that committed outcomes (oldest first, down to the
    gc floor), the rows it drew by their pass-rate band at that step (over the round's own
    records, as :func:`step_story` bins them): ``steps`` (each round's own step, else the
    newest step its records name), ``versions``, ``counts`` (rows per band) and ``rows``
    (rows drawn). ``points``: at most this many rounds, evenly spaced, the last kept; only
    their outcome files are read."""
    outcomes = store.outcome_log
    rounds = []
    for v in store.lineage(version):
        record = store.commit_record(v)
        if outcomes.added(record):
            rounds.append(record)
    rounds.reverse()
    kept_steps: list[int] = []
    kept_versions: list[int] = []
    counts: list[list[int]] = []
    for i in _picked(len(rounds), points):
        record = rounds[i]
        table = _round_records(store, record)
        if table is None or not table.num_rows:
            continue
        _, attempts, successes, _, _, _ = _per_row(table, success_above)
        step = own_step(record)
        if step is None:
            step = int(as_numpy(table.column("step")).max())
        kept_steps.append(step)
        kept_versions.append(record.version)
        counts.append(band_counts(successes, attempts, bins).tolist())
    return {
        "version": version,
        "bins": bins,
        "success_above": success_above,
        "bands": [{"low": i / bins, "high": (i + 1) / bins} for i in range(bins)],
        "rounds_recorded": len(rounds),
        "steps": kept_steps,
        "versions": kept_versions,
        "counts": counts,
        "rows": [sum(c) for c in counts],
    }


def consumption_series(store: Store, version: int, *, limit: int | None = None) -> dict[str, Any]:
    """What each step of ``version``'s lineage consumed, by its consumption record (the
    rounds of dynamic sampling, :mod:`dynstate.loading.consumption`), oldest first: ``steps``,
    one ``{version, step, gen_batches, carried_in, drawn, trained, filtered, dropped, carry,
    in_flight, filtered_share}`` each (counts of groups; ``filtered_share``: filtered over
    drawn, None for a step that drew nothing), and ``totals`` over them (``filtered_share``
    over every group drawn). ``limit``: the newest that many steps only, and the lineage is
    walked back no further than the record before the oldest of them (``complete`` says
    whether every record is counted: whether there is no such record)."""
    records = store.consumption.lineage(version, None if limit is None else limit + 1)
    complete = limit is None or len(records) <= limit
    if not complete:
        records = records[1:]  # oldest first: the one past the limit
    names = _CONSUMED
    steps = []
    for v, record in records:
        entry: dict[str, Any] = {
            "version": v,
            "step": record["step"],
            "gen_batches": record["gen_batches"],
        }
        entry.update({name: len(record.get(name, [])) for name in names})
        entry["filtered_share"] = _share(entry["filtered"], entry["drawn"])
        steps.append(entry)
    totals: dict[str, Any] = {name: sum(e[name] for e in steps) for name in (*names, "gen_batches")}
    totals["filtered_share"] = _share(totals["filtered"], totals["drawn"])
    return {
        "version": version,
        "steps": steps,
        "totals": totals,
        "complete": complete,
    }


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None
