"""A step's outcomes out of verl's scored batch, and the ``dynstate/*`` figures verl's tracker
logs with the step.

Both trainers hand :meth:`DynstateRLDataset.commit_round` the step's scored batch;
:func:`batch_outcomes` turns it into the outcome records committed with the round, and
:func:`round_figures` / :func:`selection_figures` into the figures of the step (verl logs
every ``metrics`` key, so they appear next to ``critic/score/mean`` in wandb, tensorboard or the
console).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import CommitConflictError, InvalidDataError
from ..loading.selection import Policy, pass_rates
from ..store import Store
from .generator import ROW_KEY, VERSION_KEY

log = logging.getLogger("dynstate")

SCORE_KEY = "token_level_scores"  # verl's critic/score: its per-token sum is a sequence's score
METRIC_PREFIX = "dynstate/"
PASS_RATE_BANDS = 5  # figures: rows per pass-rate band of width 0.2


def batch_outcomes(batch: Any, step: int) -> dict[str, Any] | None:
    """The outcomes of a scored verl ``batch`` trained at ``step``: one record per response
    (GRPO's n responses of a prompt are n records of its row) — ``row`` (``dynstate_row``),
    ``step``, ``score`` (``token_level_scores`` summed over the response, as verl's
    ``critic/score/mean``) and ``response_length`` where the batch has ``response_mask``.
    None when the batch carries no row numbers or no scores."""
    non_tensors = getattr(batch, "non_tensor_batch", None) or {}
    tensors: Any = getattr(batch, "batch", None)
    rows = non_tensors.get(ROW_KEY)
    # TensorDict: membership through keys() (its __contains__ is not a key test everywhere)
    keys = set(tensors.keys()) if tensors is not None else set()
    if rows is None or SCORE_KEY not in keys:
        return None
    scores = tensors[SCORE_KEY].sum(-1).double().cpu().numpy()
    out: dict[str, Any] = {
        "row": np.asarray([int(r) for r in rows], dtype=np.int64),
        "step": np.full(len(scores), int(step), dtype=np.int64),
        "score": scores,
    }
    if "response_mask" in keys:
        out["response_length"] = tensors["response_mask"].sum(-1).double().cpu().numpy()
    return out


def join_outcomes(parts: list[dict[str, Any]], step: int) -> dict[str, Any]:
    """Outcome records of one step from several sources (a trained batch's, the groups an
    async trainer evicted), in order, every ``step`` set to ``step``; the columns every part
    has."""
    names = [n for n in parts[0] if all(n in p for p in parts[1:])] if parts else []
    out = {n: np.concatenate([np.asarray(p[n]) for p in parts]) for n in names}
    if parts:
        out["step"] = np.full(len(out["row"]), int(step), dtype=np.int64)
    return out


def batch_rows_version(batch: Any, store: Store) -> int | None:
    """The version the rows of a scored verl ``batch`` were read at, for the round commit's
    ``rows_version`` (outcomes bind to the rows they were scored on): the newest of its items'
    ``dynstate_version`` (the sampler pins each item's version). Items read at older
    versions (mix mode's fresh rows come from newer ones) must be on its lineage, so every
    row number means one row; else :class:`CommitConflictError` naming both versions. None
    when the batch carries no versions (the commit then binds to the store handle's view)."""
    non_tensors = getattr(batch, "non_tensor_batch", None) or {}
    versions = non_tensors.get(VERSION_KEY)
    if versions is None or not len(versions):
        return None
    distinct = sorted({int(v) for v in versions})
    newest, oldest = distinct[-1], distinct[0]
    if len(distinct) > 1:
        on_lineage: set[int] = set()
        for v in store.lineage(newest, ahead=newest - oldest + 1):
            if v < oldest:
                break
            on_lineage.add(v)
        off = [v for v in distinct if v not in on_lineage]
        if off:
            raise CommitConflictError(
                f"the batch of {store.display_url} holds rows read at version {off[0]}, which "
                f"is not on the lineage of version {newest} its other rows were read at (a "
                "reset came between): their row numbers name different rows, so the step's "
                "outcomes cannot be committed"
            )
    return newest


def filter_figures(record: dict[str, Any]) -> dict[str, float]:
    """The ``dynstate/filter/*`` figures of a step's consumption record (group filtering,
    ``algorithm.filter_groups``): groups carried in from the step before, rows drawn, groups
    trained, filtered, dropped and carried to the next step, and generation batches used; an
    asynchronous trainer's record (format 2) adds the rows still in flight."""
    prefix = f"{METRIC_PREFIX}filter/"
    figures = {
        f"{prefix}carried_in": float(len(record["carried_in"])),
        f"{prefix}drawn": float(len(record["drawn"])),
        f"{prefix}trained": float(len(record["trained"])),
        f"{prefix}filtered": float(len(record["filtered"])),
        f"{prefix}dropped": float(len(record["dropped"])),
        f"{prefix}carried": float(len(record["carry"])),
        f"{prefix}gen_batches": float(record["gen_batches"]),
    }
    if "in_flight" in record:
        figures[f"{prefix}in_flight"] = float(len(record["in_flight"]))
    return figures


def _band_names() -> list[str]:
    return [
        f"{i / PASS_RATE_BANDS:.1f}_{(i + 1) / PASS_RATE_BANDS:.1f}" for i in range(PASS_RATE_BANDS)
    ]


def _bands(rate: np.ndarray) -> np.ndarray:
    """Counts of pass rates (no NaN) per band of width 0.2, 1.0 in the last one."""
    band = np.minimum((rate * PASS_RATE_BANDS).astype(np.int64), PASS_RATE_BANDS - 1)
    return np.bincount(band, minlength=PASS_RATE_BANDS)


def round_figures(stats: pa.Table, version: int, added: int) -> dict[str, float]:
    """The figures of the step whose round is ``version`` (``stats``: its statistics): the
    version, rows added and in all, rows trained at least once, and those per pass-rate band."""
    rate, tried = pass_rates(stats)
    out = {
        f"{METRIC_PREFIX}version": float(version),
        f"{METRIC_PREFIX}rows_added": float(added),
        f"{METRIC_PREFIX}rows_total": float(stats.num_rows),
        f"{METRIC_PREFIX}rows_trained": float(tried.sum()),
    }
    for name, count in zip(_band_names(), _bands(rate[tried]), strict=True):
        out[f"{METRIC_PREFIX}pass_rate_{name}"] = float(count)
    return out


def selection_figures(
    policy: Policy, store: Store, stats: pa.Table, batch: Any, step: int
) -> dict[str, float]:
    """What the selection policy did and will do, under ``dynstate/select/``:

    * ``eligible``: rows the policy gives a positive weight by the statistics of the round
      just committed (``stats``) — what the draws that use this round choose from;
    * ``stats_version``: the newest version whose statistics drew the step's rows (every
      index the sampler yields carries it);
    * ``drawn_untried`` and ``drawn_pass_rate_<lo>_<hi>``: the step's trained responses by
      their row's pass rate in the statistics that drew it (GRPO's n responses of a row
      count n times) — a band policy shows nothing outside its band here."""
    prefix = f"{METRIC_PREFIX}select/"
    out: dict[str, float] = {}
    try:
        parts = policy.parts(stats, step + 1)
        eligible = np.zeros(stats.num_rows, dtype=bool)
        for share, weights in parts:
            if share > 0:
                eligible |= weights > 0
        out[f"{prefix}eligible"] = float(eligible.sum())
    except InvalidDataError as exc:
        # the next draw refuses these statistics with the same message; the figure says so
        log.warning("step %d: selection policy %s draws nothing: %s", step, policy.name, exc)
        out[f"{prefix}eligible"] = 0.0
    non_tensors = getattr(batch, "non_tensor_batch", None) or {}
    rows, versions = non_tensors.get(ROW_KEY), non_tensors.get(VERSION_KEY)
    if rows is None or versions is None or not len(rows):
        return out
    rows = np.asarray([int(r) for r in rows], dtype=np.int64)
    versions = np.asarray([int(v) for v in versions], dtype=np.int64)
    untried = 0
    counts = np.zeros(PASS_RATE_BANDS, dtype=np.int64)
    for version in np.unique(versions):
        rate, tried = pass_rates(store.outcome_stats(int(version)))
        mine = rows[versions == version]
        untried += int((~tried[mine]).sum())
        counts += _bands(rate[mine][tried[mine]])
    out[f"{prefix}stats_version"] = float(versions.max())
    out[f"{prefix}drawn_untried"] = float(untried)
    for name, count in zip(_band_names(), counts, strict=True):
        out[f"{prefix}drawn_pass_rate_{name}"] = float(count)
    return out
