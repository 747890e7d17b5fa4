"""`dynstate serve` costs what a page shows, not what the history holds (issue 40.6): a row
trained at 10**6 steps and a store of 10**6 outcome steps, served by the installed
`dynstate serve`, answer the row page with the latest steps and a chart of at most 240 points
in well under a megabyte, the process's peak RSS stays under 300 MiB, and the JSON twin
pages through the rest (`before`/`limit`), its pages concatenating to the history that
`Store.outcome_records()` holds.

The stores are built cheaply but as a run leaves them: 100 commits of 10**4 steps each (a
commit may carry several steps), so that, like a run's, the head's statistics are a stored
outcome checkpoint's aggregate plus the files after it. Each commit lists its records newest
step first: the statistics fold (``dynstate.records.aggregate``) then takes one lead per commit,
where ascending records of one row in one commit would cost it one Python iteration per step
(a cost of the writer's checkpoint and of a store without one, not of serve)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from dynstate import Store
from dynstate.history import outcomes as views_module
from dynstate.history.outcomes import OutcomeViews
from dynstate.log.outcomes import outcomes_of

STEPS = 10**6
COMMITS = 100
MIB = 2**20
RSS_LIMIT = 300 * MIB

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads the server's RSS from /proc"
)


def build(url: str, rows: int, row_of: Any, *, seed: int) -> Store:
    """``rows`` rows, then ``COMMITS`` commits of ``STEPS / COMMITS`` steps each (one record a
    step, the row ``row_of(step)``, scores 0, 0.5 or 1), the newest step of a commit first; the
    100th commit's outcome checkpoint waited for."""
    store = Store.open(url, create=True)
    store.append([{"prompt": f"task {i}"} for i in range(rows)])
    per = STEPS // COMMITS
    rng = np.random.default_rng(seed)
    for c in range(COMMITS):
        steps = np.arange((c + 1) * per - 1, c * per - 1, -1, dtype=np.int64)
        scores = rng.integers(0, 3, per) / 2
        store.append([], outcomes=pa.table({"row": row_of(steps), "step": steps, "score": scores}))
    outcomes_of(store.log).flush()
    fresh = Store.open(url)
    assert outcomes_of(fresh.log).lineage(fresh.head).aggregate is not None
    return fresh


def oracle(
    store: Store, row: int, keep: Any = None, success_above: float = 0.5
) -> dict[int, dict[str, Any]]:
    """The row's history from the raw records, by plain Python: its records in lineage order,
    grouped by step (ascending, a step's scores as recorded), with the running pass rate and
    mean (scores added one by one); the entries of the ``keep`` step indices (all if None),
    by index."""
    records = store.outcome_records()
    rows = records.column("row").combine_chunks().to_numpy()
    mine = np.flatnonzero(rows == row)
    steps = records.column("step").combine_chunks().to_numpy()[mine].tolist()
    scores = records.column("score").combine_chunks().to_numpy()[mine].tolist()
    by_step: dict[int, list[float]] = {}
    for step, score in zip(steps, scores, strict=True):
        by_step.setdefault(step, []).append(score)
    out = {}
    attempts = successes = 0
    total = 0.0
    for i, step in enumerate(sorted(by_step)):
        mine_scores = by_step[step]
        won = sum(1 for x in mine_scores if x > success_above)
        attempts += len(mine_scores)
        successes += won
        for x in mine_scores:
            total += x
        if keep is None or i in keep:
            out[i] = {
                "step": step,
                "scores": mine_scores,
                "attempts": len(mine_scores),
                "successes": won,
                "pass_rate": successes / attempts,
                "mean_score": total / attempts,
            }
    return out


def history(entries: dict[int, dict[str, Any]], start: int = 0, stop: int | None = None) -> list:
    return [entries[i] for i in range(start, len(entries) if stop is None else stop)]


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


@contextmanager
def serving(url: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """The installed `dynstate serve URL --port 0`, as a user starts it."""
    dynstate = os.path.join(os.path.dirname(sys.executable), "dynstate")
    proc = subprocess.Popen(
        [dynstate, "serve", url, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "serving" in line, (line, proc.stderr.read() if proc.stderr else "")
        yield proc, line.split(" at ")[1].split()[0].rstrip("/")
    finally:
        proc.terminate()
        proc.wait(30)


def get(base: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(base + path, timeout=300) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def get_json(base: str, path: str) -> Any:
    status, body = get(base, path)
    assert status == 200, (path, status, body[:300])
    return json.loads(body)


@pytest.fixture(scope="module")
def one_row(tmp_path_factory) -> Store:
    """Row 0 of 8 trained at each of 10**6 steps."""
    url = str(tmp_path_factory.mktemp("bounded") / "one-row")
    return build(url, 8, lambda steps: np.zeros(len(steps), np.int64), seed=0)


@pytest.fixture(scope="module")
def many_steps(tmp_path_factory) -> Store:
    """10**6 steps spread over 1,000 rows (each trained at 1,000 of them)."""
    url = str(tmp_path_factory.mktemp("bounded") / "many-steps")
    return build(url, 1000, lambda steps: (steps * 7919) % 1000, seed=1)


def test_a_row_of_a_million_steps_is_a_page_in_bounded_memory(one_row):
    store = one_row
    # (step i is the row's i-th step here)
    pages = [*range(STEPS - 200, STEPS), *range(495_000, 500_000), *range(3000)]
    chart_at = [round(i * (STEPS - 1) / 239) for i in range(240)]
    want = oracle(store, 0, keep={*pages, *chart_at})
    with serving(store.url) as (proc, base):
        status, html = get(base, "/versions/head/rows/0")
        assert status == 200, html[:300]
        page = html.decode()
        # The page: the row's figures over all its steps, the latest 200 listed newest first,
        # a chart of 240 evenly spaced steps (the old page listed them all: 165 MB).
        assert len(html) < MIB
        assert "Trained 1,000,000 times at 1,000,000 steps (0\u2013999999)" in page
        table = page.split('<table class="outcome-history">')[1].split("</table>")[0]
        listed = [int(cell.split("<")[0]) for cell in table.split('<tr><td class="num">')[1:]]
        assert listed == list(range(STEPS - 1, STEPS - 201, -1))
        assert page.count('<circle class="step-rate"') == 240
        assert "(240 of its 1,000,000 steps, evenly spaced)" in page
        assert f'href="?before={STEPS - 200}">older' in page

        # The JSON twin: the same page, and where the next one starts.
        status, body = get(base, "/api/versions/head/rows/0")
        assert status == 200 and len(body) < MIB
        doc = json.loads(body)
        assert doc["outcomes"]["steps"] == history(want, STEPS - 200, STEPS)
        place = doc["outcome_steps"]
        assert (place["total"], place["limit"], place["before"]) == (STEPS, 200, None)
        assert place["next_before"] == STEPS - 200
        chart = place["chart"]
        assert [point["step"] for point in chart] == chart_at
        for point in chart:
            full = want[point["step"]]
            assert point == {k: full[k] for k in ("step", "attempts", "successes", "pass_rate")}
        stats = store.outcome_stats().slice(0, 1).to_pylist()[0]
        assert doc["outcomes"]["attempts"] == stats["attempts"] == STEPS
        assert doc["outcomes"]["ewma_score"] == stats["ewma_score"]

        # Older pages, from the middle and the oldest end.
        middle = get_json(base, "/api/versions/head/rows/0?before=500000&limit=5000")
        assert middle["outcomes"]["steps"] == history(want, 495_000, 500_000)
        assert middle["outcome_steps"]["next_before"] == 495_000
        oldest = get_json(base, "/api/versions/head/rows/0?before=3000&limit=5000")
        assert oldest["outcomes"]["steps"] == history(want, 0, 3000)
        assert oldest["outcome_steps"]["next_before"] is None
        _, older_html = get(base, "/versions/head/rows/0?before=999800")
        assert "steps 999600\u2013999799: 200 of the row's 1,000,000 steps" in (older_html.decode())

        # The band chart of the same store (10**6 steps: 240 of them folded).
        outcomes = get_json(base, "/api/outcomes")
        assert outcomes["bands"]["steps_recorded"] == STEPS
        assert len(outcomes["bands"]["steps"]) == 240
        assert get(base, "/outcomes")[0] == 200
        peak = peak_rss(proc.pid)
        assert peak < RSS_LIMIT, f"serve's peak RSS {peak / MIB:.0f} MiB"


def test_a_store_of_a_million_steps_pages_every_row_in_bounded_memory(many_steps):
    store = many_steps
    row = 617
    want = history(oracle(store, row))
    assert len(want) == 1000
    with serving(store.url) as (proc, base):
        status, html = get(base, f"/versions/head/rows/{row}")
        assert status == 200 and len(html) < MIB
        assert html.decode().count('<circle class="step-rate"') == 240
        # Walk the JSON twin from the latest page to the oldest: the pages, oldest first,
        # are the row's whole history.
        pages: list[list[dict[str, Any]]] = []
        before: int | None = None
        while True:
            query = f"?limit=64&points=16{'' if before is None else f'&before={before}'}"
            doc = get_json(base, f"/api/versions/head/rows/{row}{query}")
            pages.append(doc["outcomes"]["steps"])
            assert len(doc["outcome_steps"]["chart"]) == 16
            before = doc["outcome_steps"]["next_before"]
            if before is None:
                break
        assert len(pages) == 16  # 15 pages of 64 and one of 40
        assert [entry for page in reversed(pages) for entry in page] == want
        bands = get_json(base, "/api/outcomes?bins=4")["bands"]
        assert bands["steps_recorded"] == STEPS and len(bands["steps"]) == 240
        assert bands["steps"][-1] == STEPS - 1
        summary = get_json(base, "/api/outcomes?bins=4")["summary"]
        assert bands["counts"][-1] == [b["rows"] for b in summary["histogram"]]
        assert get(base, "/outcomes")[0] == 200
        peak = peak_rss(proc.pid)
        assert peak < RSS_LIMIT, f"serve's peak RSS {peak / MIB:.0f} MiB"


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("limit=0", "limit must be between 1 and 5000"),
        ("limit=5001", "limit must be between 1 and 5000"),
        ("before=-1", "before must be at least 0"),
        ("before=soon", "before must be an integer"),
        ("points=1", "points must be between 2 and 5000"),
    ],
)
def test_bad_paging_parameters_are_400(query, message, tmp_path):
    from test_serve import served

    from dynstate.serve.api import StoreView

    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"i": 0}])
    store.append([], outcomes=[{"row": 0, "step": 1, "score": 1.0}])
    with served(StoreView(store)) as base:
        status, body = get(base, f"/api/versions/head/rows/0?{query}")
        assert status == 400 and message in json.loads(body)["error"]
        status, body = get(base, f"/versions/head/rows/0?{query}")
        assert status == 400 and message in body.decode()


def _small_store() -> Store:
    """Steps committed out of order, several scores at some steps (one at 150), a row never
    trained."""
    store = Store.open(f"memory://bounded-{uuid.uuid4().hex}", create=True)
    store.append([{"i": i} for i in range(5)])
    rng = np.random.default_rng(7)
    for chunk in np.array_split(rng.permutation(300), 6):
        records = [
            {"row": int(rng.integers(0, 4)), "step": int(s), "score": float(rng.random())}
            for s in chunk
            for _ in range(int(rng.integers(1, 4)))
        ]
        store.append([], outcomes=records)
    store.append([], outcomes=[{"row": 1, "step": 1000, "score": i / 150} for i in range(150)])
    return store


def test_row_pages_concatenate_to_the_raw_records_and_to_row_history():
    store = _small_store()
    views = OutcomeViews(store)
    for row in range(5):
        want = history(oracle(store, row))
        full = views.row_history(store.head, row)
        assert full is not None and full["steps"] == want
        for limit in (1, 7, 200):
            pages, before = [], None
            while True:
                doc = views.row_steps(store.head, row, limit=limit, before=before, points=5)
                assert doc is not None and doc["steps_total"] == len(want)
                assert len(doc["chart"]) == min(5, len(want))
                pages.append(doc["steps"])
                before = doc["next_before"]
                if before is None:
                    break
            got = [entry for page in reversed(pages) for entry in page]
            # a step's scores are listed up to 100 (its attempts count all of them)
            assert [{**e, "scores": e["scores"][:100]} for e in want] == got, (row, limit)
    # below every step: an empty page and no next one
    doc = views.row_steps(store.head, 0, before=0)
    assert doc is not None and (doc["steps"], doc["next_before"]) == ([], None)
    crowded = views.row_steps(store.head, 1, limit=1)
    assert crowded is not None
    assert len(crowded["steps"][0]["scores"]) == 100 and crowded["steps"][0]["attempts"] == 150


def test_band_series_at_the_kept_steps_equals_the_per_step_fold(monkeypatch):
    """The fold at the kept steps only (lineages past 10,000 steps) against the per-step fold,
    on a small store whose steps were committed out of order."""
    store = _small_store()
    for bins in (3, 10):
        for points in (None, 2, 17, 400):
            want = OutcomeViews(store).band_series(store.head, bins=bins, points=points)
            with monkeypatch.context() as patch:
                patch.setattr(views_module, "_FOLD_STEPS", 0)
                got = OutcomeViews(store).band_series(store.head, bins=bins, points=points)
            assert got == want, (bins, points)
