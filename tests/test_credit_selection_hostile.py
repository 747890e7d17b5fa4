"""Credit and selection under hostile but plausible use (an outside audit): outcomes credited
to the right row, step and version; statistics equal to a plain fold of the raw records;
selection draws equal to an independent oracle of docs/selection.md, and equal after a resume
at every step. No defect was confirmed in this area; these tests
are guards for what held up, each built on an oracle written here from the docs alone, not on
the library's own helpers."""

from __future__ import annotations

import copy
import math
import random
import shutil
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from dynstate import (
    DifficultyPools,
    Learnability,
    PassRateBand,
    Store,
    VersionedDataset,
    VersionedSampler,
    compact,
)
from dynstate.history.outcomes import OutcomeViews
from dynstate.loading.dataset import decode_index
from dynstate.loading.weights import step_rng
from dynstate.records.aggregate import summarize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_stats_oracle import assert_identical, oracle

POLICIES = [
    Learnability(),
    PassRateBand(0.2, 0.8),
    DifficultyPools([0.3, 0.7], ["hard", "mid", "easy"], [0.5, 0.3, 0.2], unseen="mid"),
]


def _doc_parts(policy, stats) -> list[tuple[float, np.ndarray]]:
    """The policy's strata as docs/selection.md's table defines them (plain numpy)."""
    att = np.asarray(stats.column("attempts").to_pylist(), np.int64)
    suc = np.asarray(stats.column("successes").to_pylist(), np.int64)
    tried = att > 0
    p = np.where(tried, suc / np.maximum(att, 1), np.nan)
    if isinstance(policy, Learnability):
        w = np.where(tried, np.maximum(np.nan_to_num(p) * (1 - np.nan_to_num(p)), policy.floor),
                     policy.neutral)  # fmt: skip
        return [(1.0, w)]
    if isinstance(policy, PassRateBand):
        inside = tried & (np.nan_to_num(p) >= policy.lo) & (np.nan_to_num(p) <= policy.hi)
        return [(1.0, (inside | (~tried & policy.untried)).astype(float))]
    pool = np.searchsorted(policy.bounds, np.nan_to_num(p), side="right")
    pool[~tried] = policy.names.index(policy.unseen)
    return [(s, (pool == i).astype(float)) for i, s in enumerate(policy.shares)]


def _doc_draw(parts, rng: np.random.Generator, count: int) -> list[int]:
    """docs/selection.md, "How a draw is made": with several strata, each its exact share of
    the slots rounded down, the slots left to the strata whose cumulative interval of
    fractional parts holds ``v + k`` (``v`` the step's first uniform); ``u = U[0, 1) * total``
    per slot, the row whose cumulative interval holds ``u``, then one permutation by the same
    stream when there are several strata."""
    live = [(s, w) for s, w in parts if s > 0 and w.sum() > 0]
    out = [count]
    if len(live) > 1:
        total = sum(Fraction(s) for s, _ in live)
        exact = [count * Fraction(s) / total for s, _ in live]
        v = Fraction(float(rng.random()))
        edges = np.cumsum([Fraction(0)] + [x - math.floor(x) for x in exact])
        points = [v + k for k in range(count - sum(math.floor(x) for x in exact))]
        out = [
            math.floor(x) + sum(edges[i] <= p < edges[i + 1] for p in points)
            for i, x in enumerate(exact)
        ]
    drawn = []
    for (_, w), n in zip(live, out, strict=True):
        c = np.cumsum(w)
        drawn.append(np.searchsorted(c, rng.random(n) * c[-1], side="right"))
    rows = np.concatenate(drawn)
    if len(live) > 1:
        rows = rows[rng.permutation(len(rows))]
    return rows.tolist()


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_epoch_mode_draws_are_the_documented_draws_over_blocks(tmp_path, policy):
    """700 rows (three weight blocks, a partial one), repeated and unsorted outcome rows in one
    call: every slot of an epoch is the row the documented draw names."""
    store = Store.open(str(tmp_path / "s"), create=True)
    n = 700
    store.append([{"i": i} for i in range(n)])
    rng = np.random.default_rng(1)
    rows = rng.integers(0, n, 3000)
    store.append(
        [], outcomes={"row": rows, "step": [0] * 3000, "score": rng.choice([0.0, 1.0], 3000)}
    )
    b = 16
    sampler = VersionedSampler(VersionedDataset(store), seed=5, batch_size=b, select=policy)
    got = [decode_index(i)[1] for i in sampler]
    parts = _doc_parts(policy, store.outcome_stats())
    want: list[int] = []
    for step in range(math.ceil(n / b)):
        want += _doc_draw(parts, step_rng(5, 0, step), min(b, n - step * b))
    assert got == want


def _run_mix(url: str, policy, steps: int, resume_at: int | None = None) -> list:
    store = Store.open(url)
    b = 6

    def make() -> VersionedSampler:
        return VersionedSampler(VersionedDataset(store), seed=3, batch_size=b, select=policy,
                                mode="mix", lag=1, fresh_share=0.34, drop_last=True,
                                wait_timeout=5)  # fmt: skip

    def endless(s):
        while True:
            yield from s

    sampler = make()
    it = endless(sampler)
    out, rounds = [], {}
    for step in range(steps):
        if step == resume_at:
            state = copy.deepcopy(sampler.state_dict())
            sampler = make()
            sampler.load_state_dict(state)
            it = endless(sampler)
        batch = [decode_index(next(it)) for _ in range(b)]
        # the oracle: picked rows first (at most round(0.34 * 6) = 2 fresh ones follow them),
        # drawn over the statistics of the round of step - 1
        stats = store.outcome_stats(rounds.get(step - 1, sampler.version))
        parts = _doc_parts(policy, stats)
        assert any(
            _doc_draw(parts, step_rng(3, sampler.epoch, step), b - k)
            == [r for _, r in batch[: b - k]]
            for k in range(3)  # k fresh slots
        ), step
        out.append(batch)
        rows = [r for _, r in batch]
        rounds[step] = store.append(
            [{"i": 1000 + step * 10 + k} for k in range(step % 3)],
            meta={"step": step},
            outcomes={"row": rows, "step": [step] * b,
                      "score": [float((r * 7 + step * 3) % 4 >= 2) for r in rows]},
            rows_version=max(v for v, _ in batch),
        )  # fmt: skip
    return out


@pytest.mark.parametrize("policy", POLICIES[::2], ids=lambda p: p.name)
def test_mix_mode_selection_matches_the_oracle_and_resumes_at_every_step(tmp_path, policy):
    template = tmp_path / "template"
    Store.open(str(template), create=True).append([{"i": i} for i in range(20)])
    steps = 10

    def fresh(name: str) -> str:
        shutil.copytree(template, tmp_path / name)
        return str(tmp_path / name)

    reference = _run_mix(fresh("ref"), policy, steps)
    for k in range(1, steps):
        assert _run_mix(fresh(f"r{k}"), policy, steps, resume_at=k) == reference, k


def test_stats_at_every_kept_version_equal_the_raw_fold_across_resets_and_compactions(tmp_path):
    """Random histories: unsorted and repeated rows, several steps per commit, steps out of
    order, more than 16 distinct scores (no histogram), resets and compactions; a long-lived
    handle and a fresh one at other thresholds and half-lives agree with the fold of
    ``outcome_records()``, and the band series ends at ``summarize``'s histogram."""
    for seed in range(8):
        rnd = random.Random(seed)
        url = str(tmp_path / f"s{seed}")
        store = Store.open(url, create=True)
        store.append([{"i": i} for i in range(5)])
        views = OutcomeViews(store, success_above=0.2)
        values = [round(x * 0.05, 2) for x in range(22)] if seed % 2 else [0.0, 0.25, 1.0]
        used: set[int] = set()
        versions: list[int] = []
        for k in range(18):
            op = rnd.random()
            if op < 0.12 and len(versions) > 2:
                store.reset(rnd.choice(versions))
                used = set(store.outcome_records().column("step").to_pylist())
                continue
            if op < 0.18:
                compact(store)
                continue
            n = store.snapshot().num_rows
            steps = [x for x in rnd.sample(range(40), 3) if x not in used][:2]
            if not steps:
                continue
            used |= set(steps)
            m = rnd.randint(1, 7)
            versions.append(store.append(
                [{"i": 100 + k}] * rnd.randint(0, 2),
                outcomes={"row": [rnd.randrange(n) for _ in range(m)],
                          "step": [rnd.choice(steps) for _ in range(m)],
                          "score": [rnd.choice(values) for _ in range(m)]},
            ))  # fmt: skip
        for handle in (store, Store.open(url)):
            for v in [*versions[-3:], store.head]:
                n, records = handle.snapshot(v).num_rows, handle.outcome_records(v)
                for above, half in [(0.5, 10.0), (0.2, 10.0), (0.5, 3.0)]:
                    got = handle.outcome_stats(v, success_above=above, half_life=half)
                    assert_identical(got, oracle(records, n, above, half), (seed, v, above, half))
                series = views.band_series(v)
                hist = summarize(handle.outcome_stats(v, success_above=0.2))["histogram"]
                assert series["counts"][-1] == [b["rows"] for b in hist]
