"""`dynstate stats` and `dynstate head --sort/--min-*/--max-*` through the installed console
script, exact output (table, --json, --jsonl); a store without outcomes says so and exits 0;
and the library views they render (dynstate.history.outcomes) against a brute-force reference
over a store that grows, rolls back and is compacted."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_cli import console_script

from dynstate import Store
from dynstate.history.outcomes import OutcomeViews, RowSelection
from dynstate.maintenance.compact import compact
from dynstate.records.aggregate import summarize


def dynstate(*args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [console_script(), *args],
        capture_output=True,
        text=True,
        env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    return proc


def build(url: str) -> Store:
    """Six prompts, then four steps: each step scores rows 0-4 and adds one row. Rows 0-2
    always fail (row 2 scores 0.25), row 3 passes every other step, row 4 always passes,
    row 5 and the generated rows 6-9 are never trained."""
    store = Store.open(url, create=True)
    store.append(
        [{"prompt": f"what is {i} + {i}?", "answer": str(2 * i)} for i in range(6)],
        meta={"step": 0},
    )
    for step in range(4):
        outcomes = [
            {"row": r, "step": step, "score": score}
            for r, score in ((0, 0.0), (1, 0.0), (2, 0.25), (3, float(step % 2)), (4, 1.0))
        ]
        store.append(
            [{"prompt": f"harder than row 0, #{step}", "answer": "?"}],
            meta={"step": step + 1},
            outcomes=outcomes,
        )
    return store


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("stats") / "store")
    build(url)
    return url


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("bare") / "store")
    Store.open(url, create=True).append([{"prompt": "a"}, {"prompt": "b"}])
    return url


STATS = """\
{url} version 5
rows:      10
trained:   5 (5 never trained)
outcomes:  20 (a success is a score above 0.5)
pass rate: 30%

pass rate of trained rows:
     [0%, 25%)         3 ########################################
    [25%, 50%)         0
    [50%, 75%)         1 #############
   [75%, 100%]         1 #############

hardest rows:
row  attempts  successes  pass rate  mean score  ewma (10)  last step  prompt
  0         4          0         0%           0          0          3  what is 0 + 0?
  1         4          0         0%           0          0          3  what is 1 + 1?

easiest rows:
row  attempts  successes  pass rate  mean score  ewma (10)  last step  prompt
  4         4          4       100%           1          1          3  what is 4 + 4?
  3         4          2        50%         0.5      0.517          3  what is 3 + 3?
"""


def test_stats_table(url: str) -> None:
    assert dynstate("stats", url, "--top", "2", "--bins", "4").stdout == STATS.format(url=url)


def test_stats_threshold_and_column(url: str) -> None:
    # --threshold is --success-above: at 0.2, row 2 (0.25 every step) passes every time
    out = dynstate("stats", url, "3", "--threshold", "0.2", "--top", "1", "--bins", "2",
                   "--column", "answer").stdout  # fmt: skip
    assert out == (
        f"{url} version 3\n"
        "rows:      8\n"
        "trained:   5 (3 never trained)\n"
        "outcomes:  10 (a success is a score above 0.2)\n"
        "pass rate: 50%\n"
        "\n"
        "pass rate of trained rows:\n"
        "     [0%, 50%)         2 " + "#" * 27 + "\n"
        "   [50%, 100%]         3 " + "#" * 40 + "\n"
        "\n"
        "hardest rows:\n"
        "row  attempts  successes  pass rate  mean score  ewma (10)  last step  answer\n"
        "  0         2          0         0%           0          0          1  0\n"
        "\n"
        "easiest rows:\n"
        "row  attempts  successes  pass rate  mean score  ewma (10)  last step  answer\n"
        "  2         2          2       100%        0.25       0.25          1  4\n"
    )
    same = dynstate("stats", url, "3", "--success-above", "0.2", "--top", "1", "--bins", "2",
                    "--column", "answer").stdout  # fmt: skip
    assert same == out
    bad = dynstate("stats", url, "--column", "nope", code=2)
    assert "no column nope in version 5" in bad.stderr and "columns: prompt, answer" in bad.stderr


def test_stats_json(url: str) -> None:
    out = json.loads(dynstate("stats", url, "--top", "1", "--bins", "2", "--json").stdout)
    assert out == {
        "url": url,
        "version": 5,
        "success_above": 0.5,
        "half_life": 10.0,
        "preview_column": "prompt",
        "rows": 10,
        "trained": 5,
        "never_trained": 5,
        "records": 20,
        "pass_rate": 0.3,
        "histogram": [
            {"low": 0.0, "high": 0.5, "rows": 3},
            {"low": 0.5, "high": 1.0, "rows": 2},
        ],
        "hardest": [
            {
                "row": 0,
                "attempts": 4,
                "successes": 0,
                "pass_rate": 0.0,
                "mean_score": 0.0,
                "ewma_score": 0.0,
                "last_step": 3,
                "preview": "what is 0 + 0?",
            }
        ],
        "easiest": [
            {
                "row": 4,
                "attempts": 4,
                "successes": 4,
                "pass_rate": 1.0,
                "mean_score": 1.0,
                "ewma_score": 1.0,
                "last_step": 3,
                "preview": "what is 4 + 4?",
            }
        ],
    }


def test_stats_without_outcomes(bare: str, url: str) -> None:
    assert dynstate("stats", bare).stdout == (
        f"{bare} version 1\n"
        "rows:      2\n"
        "trained:   0 (2 never trained)\n"
        "outcomes:  0 (a success is a score above 0.5)\n"
        "pass rate: -\n"
        "no outcomes recorded in this version's lineage\n"
    )
    out = json.loads(dynstate("stats", bare, "--json", "--bins", "1").stdout)
    assert (out["trained"], out["records"], out["pass_rate"]) == (0, 0, None)
    assert (out["hardest"], out["easiest"]) == ([], [])
    assert out["histogram"] == [{"low": 0.0, "high": 1.0, "rows": 0}]
    # version 1 of the store with outcomes: before the first outcome was recorded
    assert dynstate("stats", url, "1").stdout.endswith(
        "no outcomes recorded in this version's lineage\n"
    )


def test_head_sorted_and_filtered(url: str) -> None:
    assert dynstate("head", url, "--sort", "pass_rate", "-n", "3").stdout == (
        "#  attempts  pass rate  prompt          answer\n"
        "0         4         0%  what is 0 + 0?  0\n"
        "1         4         0%  what is 1 + 1?  2\n"
        "2         4         0%  what is 2 + 2?  4\n"
    )
    # descending; rows never trained come last, in row order; --offset counts in that order
    assert dynstate("head", url, "--sort", "-pass_rate", "--offset", "1", "-n", "5").stdout == (
        "#  attempts  pass rate  prompt          answer\n"
        "3         4        50%  what is 3 + 3?  6\n"
        "0         4         0%  what is 0 + 0?  0\n"
        "1         4         0%  what is 1 + 1?  2\n"
        "2         4         0%  what is 2 + 2?  4\n"
        "5         0          -  what is 5 + 5?  10\n"
    )
    assert dynstate("head", url, "--max-attempts", "0", "--tail", "-n", "2").stdout == (
        "#  attempts  pass rate  prompt                 answer\n"
        "8         0          -  harder than row 0, #2  ?\n"
        "9         0          -  harder than row 0, #3  ?\n"
    )
    bounds = ("--min-pass-rate", "0.25", "--max-pass-rate", "1", "--columns", "prompt")
    assert dynstate("head", url, *bounds).stdout == (
        "#  attempts  pass rate  prompt\n"
        "3         4        50%  what is 3 + 3?\n"
        "4         4       100%  what is 4 + 4?\n"
    )
    # at version 3 (two steps recorded) row 3 has passed once in two
    lines = dynstate("head", url, "3", "--sort", "-ewma_score", "--jsonl", "-n", "2").stdout
    assert [json.loads(x) for x in lines.splitlines()] == [
        {"_dynstate_row": 4, "_dynstate_attempts": 2, "_dynstate_successes": 2,
         "_dynstate_pass_rate": 1.0, "prompt": "what is 4 + 4?", "answer": "8"},
        {"_dynstate_row": 3, "_dynstate_attempts": 2, "_dynstate_successes": 1,
         "_dynstate_pass_rate": 0.5, "prompt": "what is 3 + 3?", "answer": "6"},
    ]  # fmt: skip
    # --added: only the rows the version's round wrote (none trained yet)
    assert json.loads(dynstate("head", url, "--added", "--sort", "attempts", "--json").stdout) == [
        {"_dynstate_row": 9, "_dynstate_attempts": 0, "_dynstate_successes": 0,
         "_dynstate_pass_rate": None, "prompt": "harder than row 0, #3", "answer": "?"},
    ]  # fmt: skip
    assert dynstate("head", url, "--min-attempts", "5").stdout == (
        f"no rows of version 5 of {url} pass these bounds\n"
    )


def test_head_stats_options_refused_or_without_outcomes(url: str, bare: str) -> None:
    bad = dynstate("head", url, "--sort", "difficulty", code=2)
    assert "'difficulty' is no statistic; one of pass_rate, attempts" in bad.stderr
    assert (
        "Invalid value for '--max-pass-rate'"
        in dynstate("head", url, "--max-pass-rate", "1.5", code=2).stderr
    )
    note = (
        f"no outcomes recorded in the lineage of version 1 of {bare}; nothing to sort or "
        "filter by\n"
    )
    assert dynstate("head", bare, "--sort", "pass_rate").stdout == note
    done = dynstate("head", bare, "--sort", "pass_rate", "--json")
    assert (done.stdout, done.stderr) == ("[]\n", note)
    # without a statistic option head is as it was
    assert dynstate("head", bare).stdout == "#  prompt\n0  a\n1  b\n"


# -- the views, against a brute-force reference ------------------------------------------------


def _reference(records: list[tuple[int, int, float]], num_rows: int, bins: int, above: float):
    """Per step (ascending), the band counts of every row trained so far."""
    attempts = np.zeros(num_rows, np.int64)
    successes = np.zeros(num_rows, np.int64)
    out = []
    for step in sorted({s for _, s, _ in records}):
        for row, s, score in records:
            if s == step:
                attempts[row] += 1
                successes[row] += score > above
        trained = attempts > 0
        rate = successes[trained] / attempts[trained]
        band = np.minimum((rate * bins).astype(np.int64), bins - 1)
        out.append((step, np.bincount(band, minlength=bins).tolist()))
    return out


def test_band_series_and_histories_match_a_reference(tmp_path: Path) -> None:
    rng = random.Random(7)
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"prompt": f"p{i}"} for i in range(40)])
    kept: dict[int, list[tuple[int, int, float]]] = {store.head: []}
    views = OutcomeViews(store)  # one handle through growth, rollback and compaction
    records: list[tuple[int, int, float]] = []
    step = 0
    for round_ in range(30):
        if round_ == 18:  # roll back to the version after round 9: its outcomes only
            target = sorted(kept)[10]
            store.reset(target)
            records = list(kept[target])
            step = max(s for _, s, _ in records) + 1
            kept[store.head] = list(records)
            continue
        if round_ == 24:
            compact(store)
            kept[store.head] = list(records)
            continue
        n = store.snapshot().num_rows
        new = [(rng.randrange(n), step, rng.choice([0.0, 0.25, 0.75, 1.0])) for _ in range(12)]
        new += [(new[0][0], step, 1.0)]  # a GRPO group: one row twice in a step
        store.append(
            [{"prompt": f"gen{round_}"}],
            outcomes=[{"row": r, "step": s, "score": x} for r, s, x in new],
        )
        records += new
        kept[store.head] = list(records)
        step += 1
        series = views.band_series(store.head, bins=5)
        num_rows = store.snapshot().num_rows
        want = _reference(records, num_rows, 5, 0.5)
        assert list(zip(series["steps"], series["counts"], strict=True)) == want
        final = summarize(store.outcome_stats(), bins=5)["histogram"]
        assert series["counts"][-1] == [b["rows"] for b in final]
        for row in (new[0][0], new[5][0]):  # each head extends the last one's sorted records
            history = views.row_history(store.head, row)
            mine = [(s, x) for r, s, x in records if r == row]
            assert [(p["step"], x) for p in history["steps"] for x in p["scores"]] == mine
    # every kept version, asked afresh and through the shared handle, in a shuffled order
    versions = sorted(kept)
    rng.shuffle(versions)
    for v in versions:
        num_rows = store.commit_record(v).num_rows
        want = _reference(kept[v], num_rows, 5, 0.5)
        for handle in (views, OutcomeViews(store)):
            got = handle.band_series(v, bins=5)
            assert list(zip(got["steps"], got["counts"], strict=True)) == want, v
        row = kept[v][0][0] if kept[v] else 0
        history = views.row_history(v, row)
        if not kept[v]:
            assert history is None
            continue
        mine = [(s, x) for r, s, x in kept[v] if r == row]
        assert [(p["step"], x) for p in history["steps"] for x in p["scores"]] == mine
        assert history["attempts"] == len(mine)
        assert history["steps"][-1]["pass_rate"] == pytest.approx(
            sum(x > 0.5 for _, x in mine) / len(mine)
        )
    thinned = views.band_series(store.head, bins=5, points=4)
    full = views.band_series(store.head, bins=5)
    assert len(thinned["steps"]) == 4 and thinned["steps"][-1] == full["steps"][-1]
    assert thinned["counts"][-1] == full["counts"][-1]


def test_row_selection() -> None:
    import pyarrow as pa

    stats = pa.table(
        {
            "row": [0, 1, 2, 3, 4],
            "attempts": [2, 0, 4, 1, 4],
            "successes": [1, 0, 1, 1, 4],
            "mean_score": [0.5, None, 0.25, 1.0, 1.0],
            "ewma_score": [0.5, None, 0.3, 1.0, 1.0],
            "first_step": [0, None, 0, 3, 0],
            "last_step": [1, None, 3, 3, 3],
        }
    )
    assert RowSelection(sort="pass_rate").select(stats).tolist() == [2, 0, 3, 4, 1]
    assert RowSelection(sort="-pass_rate").select(stats).tolist() == [3, 4, 0, 2, 1]
    assert RowSelection(sort="-attempts").select(stats).tolist() == [2, 4, 0, 3, 1]
    assert RowSelection(sort="last_step").select(stats).tolist() == [0, 2, 3, 4, 1]
    assert RowSelection(min_pass_rate=0.5, max_pass_rate=0.5).select(stats).tolist() == [0]
    assert RowSelection(max_pass_rate=0.2).select(stats).tolist() == []  # 0 attempts: no rate
    assert RowSelection(min_attempts=2, max_attempts=3).select(stats).tolist() == [0]
    from dynstate.errors import InvalidDataError

    for bad in ({"sort": "score"}, {"min_pass_rate": "2"}, {"max_attempts": "-1"},
                {"min_pass_rate": "nan"}, {"min_attempts": "x"}):  # fmt: skip
        with pytest.raises(InvalidDataError, match="rows of v1"):
            RowSelection.parse(bad, "v1")
