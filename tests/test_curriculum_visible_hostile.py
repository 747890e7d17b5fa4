"""A curriculum run you can see (outside audit): what ``dynstate show/steps/stats`` and
``dynstate serve``'s JSON API report about a selection policy — each row's share of a step,
effective rows, the rows a step drew, the per-row statistics — against a plain oracle:
statistics folded by hand from the outcome records this test sent, weights computed by hand
from docs/selection.md's formulas, and draws counted over many loader steps. Hostile inputs
on the same surfaces must give a typed one-line error or a documented answer.

Runs are driven as a user would: ``VersionedSampler(select=...)`` under torchdata's
``StatefulDataLoader``, one round with outcomes committed per step (the policy's identity in
the round's meta, as the verl/TRL integrations write it). The CLI runs as installed (the
``dynstate`` entry point in a subprocess), serve on a real uvicorn server
(tests/serving.py).

Each ``test_defect_*`` test failed on the code before its fix; its docstring says what was
reported and what was true."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import served

from dynstate import (
    DifficultyPools,
    DynamicSampling,
    FunctionPolicy,
    InvalidDataError,
    Learnability,
    PassRateBand,
    Store,
    VersionCollectedError,
    VersionedDataset,
    VersionedSampler,
    collect_garbage,
)
from dynstate.serve.api import StoreView

DYNSTATE = str(Path(sys.executable).with_name("dynstate"))
ROWS, B = 12, 4
POOLS = DifficultyPools([0.3, 0.7], ["hard", "mid", "easy"], [0.5, 0.3, 0.2], unseen="mid")
POLICIES = {
    "band": PassRateBand(0.0, 0.9),
    "learnability": Learnability(floor=0.02, neutral=0.3),
    "pools": POOLS,
}


def by_parity(stats, step):  # a module-level user policy: even rows weigh 2, odd 1
    rows = np.arange(stats.num_rows)
    return np.where(rows % 2 == 0, 2.0, 1.0)


# -- the oracle -------------------------------------------------------------------------------


def score_of(row: int, step: int) -> float:
    """The seeded fake policy: row % 4 == 0 always solved, == 1 never, else a coin per
    (row, step) over scores on both sides of 0.5 (0.5 itself is no success)."""
    if row % 4 == 0:
        return 1.0
    if row % 4 == 1:
        return 0.0
    return random.Random(f"{row}/{step}").choice([0.0, 0.5, 0.75, 1.0])


def fold(records: list[tuple[int, float]], num_rows: int) -> tuple[list[int], list[int]]:
    attempts, wins = [0] * num_rows, [0] * num_rows
    for row, score in records:
        attempts[row] += 1
        wins[row] += score > 0.5
    return attempts, wins


def hand_shares(identity: dict[str, Any], attempts: list[int], wins: list[int]) -> list[float]:
    """Each row's expected share of a step's draws, from docs/selection.md's table."""
    kind, p = identity["policy"], identity["params"]
    rate = [w / a if a else None for a, w in zip(attempts, wins, strict=True)]
    if kind == "band":
        weights = [
            1.0 if (r is None and p["untried"]) or (r is not None and p["lo"] <= r <= p["hi"])
            else 0.0
            for r in rate
        ]  # fmt: skip
    elif kind == "learnability":
        weights = [p["neutral"] if r is None else max(r * (1 - r), p["floor"]) for r in rate]
    elif kind == "function":
        weights = [2.0 if i % 2 == 0 else 1.0 for i in range(len(rate))]
    else:
        pool = [
            p["names"].index(p["unseen"]) if r is None else sum(b <= r for b in p["bounds"])
            for r in rate
        ]
        sizes = Counter(pool)
        live = {i: s for i, s in enumerate(p["shares"]) if s > 0 and sizes[i]}
        total = sum(live.values())
        return [live[k] / total / sizes[k] if k in live else 0.0 for k in pool]
    total = sum(weights)
    return [w / total for w in weights]


def spread_of(shares: list[float]) -> dict[str, Any]:
    drawn = [s for s in shares if s > 0]
    return {
        "rows": len(shares),
        "eligible": len(drawn),
        "effective_rows": 1 / sum(s * s for s in drawn),
        "max_share": max(drawn),
        "min_share": min(drawn),
    }


def assert_spread(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert "error" not in got, got
    assert got["rows"] == want["rows"] and got["eligible"] == want["eligible"], (got, want)
    for key in ("effective_rows", "max_share", "min_share"):
        assert got[key] == pytest.approx(want[key], rel=1e-9), (key, got, want)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [DYNSTATE, *args], capture_output=True, text=True, timeout=120, env={"COLUMNS": "120"}
    )


def cli_json(*args: str) -> Any:
    done = cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def get(base: str, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(base + path, timeout=60) as resp:
            return resp.status, json.loads(resp.read().decode())
    except urllib.error.HTTPError as err:
        body = err.read().decode()
        return err.code, json.loads(body) if body.startswith("{") else body


# -- a run ------------------------------------------------------------------------------------


class Run:
    def __init__(self, url: str, policy: Any, mode: str, steps: int, *, workers: int = 0):
        self.url, self.steps = url, steps
        self.store = store = Store.open(url, create=True)
        store.append([{"id": i} for i in range(ROWS)])
        ds = VersionedDataset(store, row_column="_dynstate_row")
        lag = 1 if not workers else workers * 2 + 1  # above the loader's prefetch depth
        mix = {"mode": "mix", "lag": lag} if mode == "mix" else {}
        sampler = VersionedSampler(ds, seed=7, batch_size=B, select=policy, **mix)
        self.identity = sampler.select.identity()
        loader = StatefulDataLoader(
            ds, batch_size=B, sampler=sampler, collate_fn=list, num_workers=workers
        )
        self.drawn: dict[int, list[int]] = {}  # step -> rows the loader yielded
        self.version_of: dict[int, int] = {}  # step -> the version its round committed
        self.read: dict[int, int] = {}  # step -> the version whose statistics it drew by
        self.sent: dict[int, list[tuple[int, float]]] = {}  # version -> outcome records
        step = 0
        while step < steps:
            pinned = store.head
            for batch in loader:
                rows = [item["_dynstate_row"] for item in batch]
                self.drawn[step] = rows
                if mode == "epoch":
                    self.read[step] = pinned
                else:
                    self.read[step] = self.version_of.get(step - lag, 1)
                recs = [(r, score_of(r, step)) for r in rows]
                new = [{"id": 1000 * step + k} for k in range(step % 3)]  # fresh rounds
                meta = {"step": step, "select": self.identity}
                if step == 2:  # a round whose outcomes were not recorded
                    v = store.append(new, meta=meta)
                else:
                    v = store.append(
                        new,
                        meta=meta,
                        outcomes={
                            "row": [r for r, _ in recs],
                            "step": [step] * len(recs),
                            "score": [s for _, s in recs],
                        },
                    )
                    self.sent[v] = recs
                self.version_of[step] = v
                step += 1
                if step >= steps:
                    break

    def records_upto(self, version: int) -> list[tuple[int, float]]:
        return [r for v in sorted(self.sent) if v <= version for r in self.sent[v]]

    def folded(self, version: int) -> tuple[list[int], list[int]]:
        n = self.store.commit_record(version).num_rows
        return fold(self.records_upto(version), n)


CASES = [(name, mode, 0) for name in (*POLICIES, "function") for mode in ("epoch", "mix")]
CASES += [("pools", "mix", 2), ("learnability", "epoch", 2)]  # loader workers prefetching


@pytest.mark.parametrize(("name", "mode", "workers"), CASES)
def test_reported_weights_draws_and_statistics_equal_the_oracle(
    tmp_path, name, mode, workers
) -> None:
    """Per step: the loader's rows obey the policy by the statistics of the version the step
    read (band: every row eligible; pools: each pool's slots are its exact share rounded
    down or up); `show --json` and serve's /api/versions/V report the rows scored and the
    weights' spread as the oracle computes them; `stats --json` and /api/outcomes agree with
    the hand fold; a user function's spread is refused in words."""
    policy = POLICIES.get(name) or FunctionPolicy(by_parity, name="by_parity", uses_step=False)
    run = Run(str(tmp_path / "s"), policy, mode, steps=9, workers=workers)
    for step, rows in run.drawn.items():
        att, wins = run.folded(run.read[step])
        shares = hand_shares(run.identity, att, wins)
        fresh_ok = mode == "mix"  # a fresh slot is not weighted (docs: mix mode)
        if name == "band":
            assert all(shares[r] > 0 or fresh_ok for r in rows if r < len(shares)), (step, rows)
        if name == "pools" and mode == "epoch":
            p = run.identity["params"]
            rate = [w / a if a else None for a, w in zip(att, wins, strict=True)]
            pool = [
                p["names"].index(p["unseen"]) if r is None else sum(b <= r for b in p["bounds"])
                for r in rate
            ]
            got = Counter(pool[r] for r in rows)
            live = {i: s for i, s in enumerate(p["shares"]) if s > 0 and pool.count(i)}
            for i, s in live.items():
                exact = len(rows) * s / sum(live.values())
                assert math.floor(exact) <= got[i] <= math.ceil(exact), (step, got, live)
    with served(StoreView(run.store, url=run.url)) as base:
        for step, v in run.version_of.items():
            status, doc = get(base, f"/api/versions/{v}")
            assert status == 200
            story = doc["step_story"]
            assert story["step"] == step and story["policy"] == run.identity
            if v in run.sent:
                out = story["outcomes"]
                order = list(dict.fromkeys(run.drawn[step]))
                assert [d["row"] for d in out["drawn"]] == order
                assert out["records"] == len(run.drawn[step])
                for d in out["drawn"]:
                    mine = [s for r, s in run.sent[v] if r == d["row"]]
                    assert d["scores"] == mine and d["attempts"] == len(mine)
                    assert d["successes"] == sum(s > 0.5 for s in mine)
            else:
                assert story["outcomes"] is None
            if name == "function":
                assert "never imported" in story["weights"]["error"]
            else:
                att, wins = run.folded(v)
                assert_spread(story["weights"], spread_of(hand_shares(run.identity, att, wins)))
        head = run.store.head
        att, wins = run.folded(head)
        status, outcomes = get(base, "/api/outcomes")
        assert status == 200
        status, page = get(base, f"/api/versions/{head}/rows?limit=500")
        assert status == 200
        for row in page["rows"]:
            o = row["outcomes"]
            i = row["row"]
            assert (o["attempts"], o["successes"]) == (att[i], wins[i]), i
            assert o["pass_rate"] == (wins[i] / att[i] if att[i] else None)
        # rows in a pass-rate band (inclusive bounds, trained rows only)
        status, page = get(base, f"/api/versions/{head}/rows?min_pass_rate=0.5&max_pass_rate=1")
        want = [i for i in range(len(att)) if att[i] and 0.5 <= wins[i] / att[i] <= 1]
        assert status == 200 and sorted(r["row"] for r in page["rows"]) == want
        # rows drawn per band at each step: each round's own records, binned by hand
        drawn = outcomes["drawn_bands"]
        assert drawn["versions"] == sorted(run.sent)
        for v, counts in zip(drawn["versions"], drawn["counts"], strict=True):
            a, w = fold(run.sent[v], run.store.commit_record(v).num_rows)
            bins = [0] * drawn["bins"]
            for x, y in zip(a, w, strict=True):
                if x:
                    bins[min(int(y / x * drawn["bins"]), drawn["bins"] - 1)] += 1
            assert counts == bins, v
        # one row's outcome history: its steps, each with the pass rate through it
        row = max(range(len(att)), key=lambda i: att[i])
        status, doc = get(base, f"/api/versions/{head}/rows/{row}")
        mine = [(step, r, s) for step, v in run.version_of.items() if v in run.sent
                for r, s in run.sent[v] if r == row]  # fmt: skip
        steps = doc["outcomes"]["steps"]
        assert [e["step"] for e in steps] == sorted({s for s, _, _ in mine})
        for e in steps:
            upto = [s for st, _, s in mine if st <= e["step"]]
            assert e["pass_rate"] == pytest.approx(sum(s > 0.5 for s in upto) / len(upto))
    stats = cli_json("stats", run.url, "--bins", "4")
    assert stats["rows"] == len(att) and stats["records"] == sum(att)
    assert stats["trained"] == sum(a > 0 for a in att)
    assert stats["pass_rate"] == pytest.approx(sum(wins) / sum(att))
    bands = [0] * 4
    for a, w in zip(att, wins, strict=True):
        if a:
            bands[min(int(w / a * 4), 3)] += 1
    assert [h["rows"] for h in stats["histogram"]] == bands
    assert {k: outcomes["summary"][k] for k in ("rows", "trained", "records")} == {
        "rows": stats["rows"], "trained": stats["trained"], "records": stats["records"]
    }  # fmt: skip
    last = max(run.sent)
    shown = cli_json("show", run.url, str(last))["step_story"]
    status_doc = shown["weights"]
    if name != "function":
        assert_spread(status_doc, spread_of(hand_shares(run.identity, *run.folded(last))))


@pytest.mark.parametrize("name", ["pools", "learnability"])
def test_realized_shares_over_400_loader_steps_match_the_reported_ones(tmp_path, name) -> None:
    """At one fixed version (every epoch pins it), 400 loader steps: each pool's realized
    share of the draws and each row's realized frequency lie within a binomial bound of the
    shares `show --json` reports (which equal the hand-computed ones); each step's pool slots
    are its exact share rounded down or up."""
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"id": i} for i in range(24)])
    recs = [(r, 0.0) for r in range(6)] * 2  # hard: 6 rows
    recs += [(r, float(k)) for r in range(6, 14) for k in (0, 1)]  # mid: 8 rows at 0.5
    recs += [(r, 1.0) for r in (14, 17, 15, 16)]  # easy: 4 rows; 18..23 never tried (mid)
    random.Random(0).shuffle(recs)
    policy = POLICIES[name]
    identity = policy.identity()
    v = store.append(
        [],
        meta={"step": 0, "select": identity},
        outcomes={"row": [r for r, _ in recs], "step": [0] * len(recs),
                  "score": [s for _, s in recs]},
    )  # fmt: skip
    shares = hand_shares(identity, *fold(recs, 24))
    assert_spread(cli_json("show", str(tmp_path / "s"), str(v))["step_story"]["weights"],
                  spread_of(shares))  # fmt: skip
    ds = VersionedDataset(store, row_column="_dynstate_row")
    sampler = VersionedSampler(ds, seed=11, batch_size=8, select=policy, drop_last=True)
    loader = StatefulDataLoader(ds, batch_size=8, sampler=sampler, collate_fn=list)
    counts: Counter[int] = Counter()
    pool_of = [0] * 6 + [1] * 8 + [2] * 4 + [1] * 6
    steps = 0
    while steps < 400:
        for batch in loader:
            rows = [item["_dynstate_row"] for item in batch]
            counts.update(rows)
            if name == "pools":
                per = Counter(pool_of[r] for r in rows)
                assert per[0] == 4 and per[1] in (2, 3) and per[2] in (1, 2), per
            steps += 1
            if steps == 400:
                break
    n = 8 * 400
    for row in range(24):
        p = shares[row]
        assert abs(counts[row] - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1, (row, counts[row])
    if name == "pools":
        for pool, want in enumerate([0.5, 0.3, 0.2]):
            got = sum(c for r, c in counts.items() if pool_of[r] == pool)
            # systematic sampling: the pool's slots differ from n * share by less than a step
            assert abs(got - n * want) <= 5 * math.sqrt(n * want * (1 - want)), (pool, got)


def test_dynamic_sampling_steps_and_show_count_what_the_loader_gave(tmp_path) -> None:
    """DynamicSampling with pools: `dynstate steps --json` counts per step, and `show`'s
    consumption lists, equal what the score function was handed; the policy `show` names is
    the sampler state's and its spread equals the oracle's."""
    url = str(tmp_path / "d")
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(ROWS)])
    ds = VersionedDataset(url)
    sampler = VersionedSampler(ds, seed=1, select=POOLS)
    dyn = DynamicSampling(ds, sampler, gen_batch_size=4, train_groups=3, max_gen_batches=3)
    handed: dict[int, list[int]] = {}
    sent: list[tuple[int, float]] = []
    for step in range(dyn.resume(None), 5):

        def score(items, at, step=step):
            handed.setdefault(step, []).extend(i["id"] for i in items)
            return [[score_of(i["id"], at + k) for k in range(3)] for i in items]

        batch = dyn.next_batch(step, score)
        outs = batch.outcomes()
        sent += [(o["row"], o["score"]) for o in outs]
        store.append([], meta={"step": step}, outcomes=outs, rows_version=batch.rows_version,
                     consumption=batch.record)  # fmt: skip
    doc = cli_json("steps", url)
    assert [e["drawn"] for e in doc["steps"]] == [len(handed[s]) for s in range(5)]
    shown = cli_json("show", url, "--drawn", "1000")["step_story"]
    assert sorted(shown["consumption"]["drawn"]["rows"]) == sorted(handed[4])
    assert shown["policy"] == POOLS.identity()
    head = Store.open(url)
    att, wins = fold(sent, head.commit_record(head.head).num_rows)
    assert_spread(shown["weights"], spread_of(hand_shares(POOLS.identity(), att, wins)))


# -- hostile inputs that held -----------------------------------------------------------------


def nan_weights(stats, step):
    w = np.ones(stats.num_rows)
    w[1] = np.nan
    return w


def inf_weights(stats, step):
    w = np.ones(stats.num_rows)
    w[2] = np.inf
    return w


def negative_weights(stats, step):
    w = np.ones(stats.num_rows)
    w[0] = -1e-300
    return w


def zero_weights(stats, step):
    return np.zeros(stats.num_rows)


def long_weights(stats, step):  # rows beyond the statistics
    return np.ones(stats.num_rows + 3)


HOSTILE = [nan_weights, inf_weights, negative_weights, zero_weights, long_weights]


@pytest.mark.parametrize("fn", HOSTILE, ids=lambda f: f.__name__)
@pytest.mark.parametrize("mode", ["epoch", "mix"])
def test_hostile_function_policy_is_a_typed_one_line_refusal(tmp_path, fn, mode) -> None:
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"id": i} for i in range(8)])
    ds = VersionedDataset(store, row_column="_dynstate_row")
    kw = {"mode": "mix"} if mode == "mix" else {}
    sampler = VersionedSampler(ds, seed=0, batch_size=4, select=fn, **kw)
    loader = StatefulDataLoader(ds, batch_size=4, sampler=sampler, collate_fn=list)
    with pytest.raises(InvalidDataError) as err:
        next(iter(loader))
    assert "\n" not in str(err.value) and fn.__name__ in str(err.value)


def test_collected_statistics_version_and_odd_inputs_are_typed(tmp_path) -> None:
    """A sampler state pinned at a version gc collected: VersionCollectedError on resume;
    `show`/`stats` of it: one line, exit 1; serve: a JSON error, not a 500. A version with no
    outcomes: documented answers. Band counts out of range: usage error / 400."""
    url = str(tmp_path / "g")
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(8)])
    ds = VersionedDataset(store, row_column="_dynstate_row")
    loader = StatefulDataLoader(
        ds, batch_size=4, collate_fn=list,
        sampler=VersionedSampler(ds, seed=0, batch_size=4, select=Learnability()),
    )  # fmt: skip
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    # version 1 has no outcomes: all rows untried, learnability weighs them alike
    no_out = cli_json("show", url, "1")["step_story"]
    assert no_out["outcomes"] is None
    done = cli("stats", url, "1")
    assert done.returncode == 0 and "no outcomes recorded" in done.stdout
    for k in range(1, 5):
        store.append([{"id": 100 + k}], meta={"step": k},
                     outcomes={"row": [k], "step": [k], "score": [1.0]})  # fmt: skip
    collect_garbage(store, keep=1, grace_s=0, dry_run=False)
    ds2 = VersionedDataset(Store.open(url), row_column="_dynstate_row")
    again = StatefulDataLoader(
        ds2, batch_size=4, collate_fn=list,
        sampler=VersionedSampler(ds2, seed=0, batch_size=4, select=Learnability()),
    )  # fmt: skip
    with pytest.raises(VersionCollectedError):
        again.load_state_dict(state)
        next(iter(again))
    for cmd in ("show", "stats"):
        done = cli(cmd, url, "1")
        assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "garbage collection" in done.stderr
    assert cli("stats", url, "--bins", "101").returncode == 2
    assert cli("stats", url, "--bins", "0").returncode == 2
    assert cli("show", url, "--drawn", "9" * 40, "--json").returncode == 0
    with served(StoreView(Store.open(url), url=url)) as base:
        assert get(base, "/api/versions/1")[0] in (404, 410)
        for bins in ("101", "0", "1e2", "9" * 400):
            status, body = get(base, f"/api/outcomes?bins={bins}")
            assert status == 400 and "bins" in body["error"], (bins, body)
        status, body = get(base, "/api/outcomes?bins=100")
        assert status == 200 and len(body["summary"]["histogram"]) == 100


# -- defects ----------------------------------------------------------------------------------


def _spread_and_refusal(tmp_path, select: dict[str, Any], policy: Any, outcomes=None):
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(12)])
    v = store.append([{"id": 100}, {"id": 101}], meta={"step": 0, "select": select},
                     outcomes=outcomes)  # fmt: skip
    done = cli("show", url, str(v), "--json")
    assert done.returncode == 0, done.stderr
    weights = json.loads(done.stdout)["step_story"]["weights"]
    ds = VersionedDataset(store, row_column="_dynstate_row")
    loader = StatefulDataLoader(
        ds, batch_size=4, collate_fn=list,
        sampler=VersionedSampler(ds, seed=0, batch_size=4, select=policy),
    )  # fmt: skip
    with pytest.raises(InvalidDataError):
        next(iter(loader))  # the sampler refuses this policy at this version
    return weights, done.stderr


def test_defect_show_spread_of_pools_with_no_drawable_pool(tmp_path) -> None:
    """Reported: `show --json` (and serve's version page) give the pools policy at a version
    with no outcomes `eligible: 0, effective_rows: 0.0, max_share: 0.0` — as if it drew
    from nothing — and the text form says "0 of 14 rows drawable". True: every row is
    untried, so all sit in the `unseen` pool, whose share is 0; the sampler refuses this
    version with InvalidDataError ("leaves no row that can be drawn"). docs/cli.md promises
    `error` instead of the figures for a policy that refuses the statistics (as a band
    holding no row gets). Why it matters: a user reading the curriculum's story sees a
    figure where the run actually died; history/story.py:weight_spread uses
    Policy.expected_shares, which skips Plan._check's refusal for multi-part policies."""
    pools = DifficultyPools([0.5], ["hard", "easy"], [0.0, 1.0], unseen="hard")
    weights, _ = _spread_and_refusal(tmp_path, pools.identity(), pools)
    assert "error" in weights, weights


def test_defect_show_spread_of_learnability_whose_total_overflows(tmp_path) -> None:
    """Reported: `show --json` for `Learnability(neutral=1e308)` over rows never tried gives
    `eligible: 0, effective_rows: 0.0` (and numpy's "overflow encountered in reduce"
    RuntimeWarning on stderr). True: the weights' total is infinite; the sampler refuses it
    with InvalidDataError (docs/selection.md, "Bad input": refused, not normalised), and every
    row has weight 1e308 > 0, so "0 drawable" is false either way. Why it matters: the story
    of a step must not invent figures for a policy the run could not use
    (history/story.py:weight_spread -> selection.py:Policy.expected_shares divides by an
    infinite sum)."""
    select = {"policy": "learnability", "params": {"floor": 0.01, "neutral": 1e308}}
    weights, stderr = _spread_and_refusal(tmp_path, select, Learnability(neutral=1e308))
    assert "error" in weights and "overflow" in weights["error"], weights
    assert "RuntimeWarning" not in stderr, stderr


def test_defect_function_policy_refusal_names_no_version(tmp_path) -> None:
    """Reported: a FunctionPolicy returning NaN (or inf, negative, the wrong length) on its
    first use is refused as "selection policy 'm.f' at step 0 returned NaN weights ..." —
    no version, no store. True/documented: docs/selection.md "Bad input" says such weights
    raise InvalidDataError "naming the policy, step, version and what to fix" (an all-zero
    answer does name them: "at step 0, version 1 of URL"). Why it matters: with several
    stores or a mix-mode lag the user cannot tell which statistics the function choked on
    (selection.py FunctionPolicy.weigh builds its own `where` without the version)."""
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(8)])
    ds = VersionedDataset(store, row_column="_dynstate_row")
    loader = StatefulDataLoader(
        ds, batch_size=4, collate_fn=list,
        sampler=VersionedSampler(ds, seed=0, batch_size=4, select=nan_weights),
    )  # fmt: skip
    with pytest.raises(InvalidDataError) as err:
        next(iter(loader))
    assert "version 1" in str(err.value), str(err.value)


def test_defect_subnormal_weights_are_not_drawn_in_proportion(tmp_path) -> None:
    """Reported: `show --json` gives `Learnability(floor=5e-324, neutral=5e-324)` (both in
    their accepted ranges) over 16 rows all solved or untried a uniform spread —
    min_share == max_share == 1/16, effective_rows 16. True (400 loader steps): row 0 is
    drawn about half as often as the others and row 15 about 1.5 times as often, because
    `U[0,1) * total` rounds to the subnormal grid of a total of 16 * 5e-324, so the first
    interval is hit half the time and the rounding past the end lands on the last row.
    docs/selection.md: "exactly proportional to the float64 weights up to rounding", and a
    total that overflows is refused for this very reason (every draw landing on the last
    row), but a total that underflows is neither refused nor rescaled
    (weights.py Plan.draw / CumulativeWeights.find). Why it matters: the reported curriculum
    and the drawn one differ by up to 50 % per row."""
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(16)])
    select = Learnability(floor=5e-324, neutral=5e-324)
    v = store.append([], meta={"step": 0, "select": select.identity()},
                     outcomes={"row": [0, 1, 2, 3], "step": [0] * 4,
                               "score": [1.0] * 4})  # fmt: skip
    # Fixed so: such a total is refused as an overflowing one is (it cannot be drawn in
    # proportion), by the sampler and by what `show` reports alike.
    spread = cli_json("show", url, str(v))["step_story"]["weights"]
    assert "too small to draw in proportion" in spread.get("error", ""), spread
    ds = VersionedDataset(store, row_column="_dynstate_row")
    sampler = VersionedSampler(ds, seed=0, batch_size=16, select=select)
    loader = StatefulDataLoader(ds, batch_size=16, sampler=sampler, collate_fn=list)
    with pytest.raises(InvalidDataError, match="too small to draw in proportion"):
        next(iter(loader))
    # weights of the same proportions, scaled into the normal range, are drawn in proportion
    fine = Learnability(floor=1e-290, neutral=1e-290)
    sampler = VersionedSampler(ds, seed=0, batch_size=16, select=fine)
    loader = StatefulDataLoader(ds, batch_size=16, sampler=sampler, collate_fn=list)
    counts: Counter[int] = Counter()
    for _ in range(400):
        for batch in loader:
            counts.update(item["_dynstate_row"] for item in batch)
    n, p = 400 * 16, 1 / 16
    bound = 5 * math.sqrt(n * p * (1 - p))
    off = {row: counts[row] for row in range(16) if abs(counts[row] - n * p) > bound}
    assert not off, f"rows drawn off their share {n * p:.0f} +- {bound:.0f}: {off}"


def test_defect_show_spread_of_pools_whose_shares_sum_past_float64(tmp_path) -> None:
    """Reported: `show --json` gives `DifficultyPools([0.5], ..., shares=[1e308, 1e308])`
    (each share finite and >= 0, as documented) `eligible: 0, effective_rows: 0.0,
    max_share: 0.0`. True: the sampler splits every step between the two pools exactly (its
    slot counts use exact rationals) and draws every row: by hand, the 2 easy rows get 1/4
    of the draws each, the 6 hard/untried rows 1/12 each (effective rows 6). Why it matters:
    the curriculum's story says the run can draw nothing while it draws every row
    (selection.py Policy.expected_shares sums the float shares to inf and divides by it)."""
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(8)])
    pools = DifficultyPools([0.5], ["hard", "easy"], [1e308, 1e308], unseen="hard")
    recs = [(0, 1.0), (2, 0.0), (1, 1.0), (3, 0.0)]
    v = store.append([], meta={"step": 0, "select": pools.identity()},
                     outcomes={"row": [r for r, _ in recs], "step": [0] * 4,
                               "score": [s for _, s in recs]})  # fmt: skip
    ds = VersionedDataset(store, row_column="_dynstate_row")
    loader = StatefulDataLoader(
        ds, batch_size=8, collate_fn=list,
        sampler=VersionedSampler(ds, seed=0, batch_size=8, select=pools),
    )  # fmt: skip
    drawn = Counter(item["_dynstate_row"] for batch in loader for item in batch)
    assert set(drawn) <= set(range(8)) and sum(drawn.values()) == 8  # the sampler draws
    want = spread_of(hand_shares({"policy": "pools", "params": {**pools.params(),
                                                                "shares": [1, 1]}},
                                 *fold(recs, 8)))  # fmt: skip
    assert want["eligible"] == 8 and want["effective_rows"] == pytest.approx(6)
    assert_spread(cli_json("show", url, str(v))["step_story"]["weights"], want)
