"""A step's story (issue 44.6): ``dynstate show V``, serve's version page and ``/api``, and
serve's "rows drawn per pass-rate band" series on ``/outcomes`` — each checked against a
plain fold of the outcome records the test itself sent (unsorted, with repeated rows), the
consumption records read back, and the selection policy's weights worked out by hand.

The CLI runs as installed (the ``dynstate`` entry point in a subprocess); serve runs on a
real uvicorn server (tests/test_serve.py's ``served``)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_consumption import CFG, GROUP, read_log
from test_consumption import run as consumption_run
from test_serve import Client, served
from test_serve_browser import browser  # noqa: F401 - the fixture

import dynstate
from dynstate import Store
from dynstate.history.story import drawn_band_series, step_story
from dynstate.serve.api import StoreView

DYNSTATE = str(Path(sys.executable).with_name("dynstate"))
ROWS = 12
FLOOR, NEUTRAL = 0.05, 0.25
SELECT = {"policy": "learnability", "params": {"floor": FLOOR, "neutral": NEUTRAL}}
BINS = 10


def _records(rng: random.Random, step: int, num_rows: int) -> list[tuple[int, float]]:
    """A round's outcome records: unsorted rows, some repeated, scores on both sides of 0.5
    (and exactly 0.5, which is no success)."""
    rows = [rng.randrange(num_rows) for _ in range(rng.randint(3, 9))]
    rows += rows[: rng.randint(0, 3)]  # repeats, not adjacent
    rng.shuffle(rows)
    return [(r, rng.choice([0.0, 0.25, 0.5, 0.75, 1.0, rng.random()])) for r in rows]


def build(url: str, seed: int = 0) -> tuple[Store, dict[int, list[tuple[int, float]]], int]:
    """A store whose rounds commit outcomes, the policy in their meta (as the verl
    integration does) and a generator state; one round commits none and one no step."""
    rng = random.Random(seed)
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(ROWS)])
    sent: dict[int, list[tuple[int, float]]] = {}
    num_rows = ROWS
    for step in range(1, 7):
        new = [{"id": 100 * step + k} for k in range(step % 3)]
        if step == 4:  # a round of a step with no outcomes
            v = store.append(new, meta={"step": step, "select": SELECT})
            num_rows += len(new)
            continue
        recs = _records(rng, step, num_rows)
        v = store.append(
            new,
            meta={"step": step, "select": SELECT},
            outcomes={
                "row": [r for r, _ in recs],
                "step": [step] * len(recs),
                "score": [s for _, s in recs],
            },
            generator_state={"step": step, "hardest": sorted({r for r, _ in recs})[:3]},
        )
        num_rows += len(new)
        sent[v] = recs
    last = store.append([], meta={"note": "no step"})  # a version of no step
    return store, sent, last


def fold_round(recs: list[tuple[int, float]]) -> dict[str, Any]:
    """The round's figures, folded in plain Python: rows in the order first scored."""
    order: list[int] = []
    scores: dict[int, list[float]] = {}
    for row, score in recs:
        if row not in scores:
            order.append(row)
            scores[row] = []
        scores[row].append(score)
    wins = sum(s > 0.5 for _, s in recs)
    bands = [0] * BINS
    for row in order:
        bands[min(int(sum(s > 0.5 for s in scores[row]) / len(scores[row]) * BINS), BINS - 1)] += 1
    return {
        "records": len(recs),
        "rows": len(order),
        "successes": wins,
        "pass_rate": wins / len(recs),
        "mean_score": sum(s for _, s in recs) / len(recs),
        "order": order,
        "scores": scores,
        "bands": bands,
    }


def learnability_spread(store: Store, version: int, sent: dict) -> dict[str, Any]:
    """Learnability's weights by hand, from every record of the lineage up to ``version``."""
    num_rows = store.commit_record(version).num_rows
    attempts, wins = Counter(), Counter()
    for v, recs in sent.items():
        if v <= version:
            for row, score in recs:
                attempts[row] += 1
                wins[row] += score > 0.5
    weights = []
    for row in range(num_rows):
        if attempts[row]:
            p = wins[row] / attempts[row]
            weights.append(max(p * (1 - p), FLOOR))
        else:
            weights.append(NEUTRAL)
    total = sum(weights)
    shares = [w / total for w in weights]
    return {
        "rows": num_rows,
        "eligible": sum(s > 0 for s in shares),
        "effective_rows": 1 / sum(s * s for s in shares),
        "max_share": max(shares),
        "min_share": min(s for s in shares if s > 0),
    }


def check_story(story: dict[str, Any], store: Store, version: int, sent: dict, rows: int) -> None:
    out = story["outcomes"]
    if version not in sent:
        assert out is None
        return
    want = fold_round(sent[version])
    for key in ("records", "rows", "successes"):
        assert out[key] == want[key], key
    assert out["pass_rate"] == pytest.approx(want["pass_rate"], rel=1e-12)
    assert out["mean_score"] == pytest.approx(want["mean_score"], rel=1e-12)
    assert [b["rows"] for b in out["bands"]] == want["bands"]
    assert [d["row"] for d in out["drawn"]] == want["order"][:rows]
    assert out["drawn_more"] == max(want["rows"] - rows, 0)
    for d in out["drawn"]:
        mine = want["scores"][d["row"]]
        assert d["attempts"] == len(mine)
        assert d["successes"] == sum(s > 0.5 for s in mine)
        assert d["scores"] == mine
    spread = story["weights"]
    expected = learnability_spread(store, version, sent)
    assert spread["rows"] == expected["rows"] and spread["eligible"] == expected["eligible"]
    for key in ("effective_rows", "max_share", "min_share"):
        assert spread[key] == pytest.approx(expected[key], rel=1e-9), key


def test_story_of_each_round_equals_the_records_folded_by_hand(tmp_path: Path) -> None:
    store, sent, last = build(str(tmp_path / "s"))
    for version in range(2, last + 1):
        story = step_story(store, version, rows=3)
        record = store.commit_record(version)
        assert story["step"] == record.meta.get("step")
        if story["step"] is None:
            assert story["policy"] is None and story["weights"] is None
            assert story["generator_state"] is None
            continue
        assert story["policy"] == SELECT
        assert story["generator_state"] == record.generator_state
        assert story["consumption"] is None  # no dynamic sampling in this run
        check_story(story, store, version, sent, rows=3)
    # the drawn-by-band series: one column per round with outcomes, oldest first
    series = drawn_band_series(store, last, bins=BINS)
    assert series["versions"] == sorted(sent)
    assert series["steps"] == [store.commit_record(v).meta["step"] for v in sorted(sent)]
    assert series["counts"] == [fold_round(sent[v])["bands"] for v in sorted(sent)]
    picked = drawn_band_series(store, last, bins=BINS, points=2)
    assert picked["rounds_recorded"] == len(sent) and len(picked["versions"]) == 2
    assert picked["versions"][-1] == max(sent)  # the last round is always kept


def test_a_policy_the_store_cannot_weigh_says_why(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"id": i} for i in range(4)])
    function = {"policy": "function", "params": {"name": "m:f", "params": {}, "uses_step": True}}
    v = store.append([], meta={"step": 1, "select": function})
    spread = step_story(store, v)["weights"]
    assert "never imported" in spread["error"] and "eligible" not in spread
    # a band no row is in: the policy's own refusal, named
    band = {"policy": "band", "params": {"lo": 0.9, "hi": 1.0, "untried": False}}
    v = store.append([], meta={"step": 2, "select": band})
    assert "band" in step_story(store, v)["weights"]["error"]
    # a meta "select" that is no policy identity is not shown as one
    v = store.append([], meta={"step": 3, "select": "learnability"})
    assert step_story(store, v)["policy"] is None
    with served(StoreView(store, url="s")) as base:
        status, html = Client(base).get("/versions/2")
    assert status == 200 and "never imported" in html


def test_a_dynamic_sampling_round_shows_what_the_step_consumed(tmp_path: Path) -> None:
    url = str(tmp_path / "dyn")
    cfg = {**CFG, "select": dynstate.Learnability(floor=FLOOR, neutral=NEUTRAL), "steps": 4}
    consumption_run(url, cfg, None, None)
    store = Store.open(url)
    records = dynstate.consumption_records(store)
    assert len(records) == 4
    for record in records:
        story = step_story(store, record["version"], rows=5)
        assert story["step"] == record["step"]
        used = story["consumption"]
        for name in ("carried_in", "drawn", "trained", "filtered", "dropped", "carry"):
            assert used[name]["count"] == len(record[name]), name
            assert used[name]["rows"] == record[name][:5], name
            assert used[name]["more"] == max(len(record[name]) - 5, 0), name
        # the policy the sampler state in the record names
        assert story["policy"] == SELECT
        # the outcomes: one record per response of each group scored at the step (every
        # drawn row's: trained, filtered, carried or dropped)
        out = story["outcomes"]
        assert out["records"] == GROUP * len(record["drawn"])
        assert out["rows"] == len(set(record["drawn"]))
        assert {d["row"] for d in out["drawn"]} <= set(record["drawn"])
    # serve's version page lists the same counts
    version = records[-1]["version"]
    with served(StoreView(store, url=url)) as base:
        status, html = Client(base).get(f"/versions/{version}")
    assert status == 200
    line = html[html.index('class="story-consumed"') :].split("</dd>")[0]
    assert f"drawn {len(records[-1]['drawn'])}" in line
    assert f"filtered {len(records[-1]['filtered'])}" in line


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [DYNSTATE, *args], capture_output=True, text=True, timeout=120, env={"COLUMNS": "120"}
    )


def test_dynstate_show_tells_the_story_and_its_json_twin_is_the_library_s(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    store, sent, last = build(url, seed=3)
    version = max(sent)
    done = _cli("show", url, str(version), "--json", "--drawn", "2")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)["step_story"]
    assert doc == json.loads(json.dumps(step_story(store, version, rows=2)))
    check_story(doc, store, version, sent, rows=2)
    text = _cli("show", url, str(version), "--drawn", "2")
    assert text.returncode == 0, text.stderr
    want = fold_round(sent[version])
    lines = text.stdout.splitlines()
    assert f"step: {doc['step']}" in lines
    rate = next(line for line in lines if line.strip().startswith("pass rate:"))
    assert f"{want['pass_rate']:.0%} ({want['successes']:,} of {want['records']:,}" in rate
    assert any("learnability" in line and "policy:" in line for line in lines)
    weights = next(line for line in lines if line.strip().startswith("weights:"))
    assert f"{doc['weights']['eligible']:,} of" in weights
    table = lines[lines.index(next(x for x in lines if x.startswith("rows scored"))) + 2 :]
    assert [int(line.split()[0]) for line in table[:2]] == want["order"][:2]
    if want["rows"] > 2:
        assert f"{want['rows'] - 2:,} more row" in text.stdout
    # a version of no step
    plain = _cli("show", url, str(last))
    assert plain.returncode == 0 and "step: none" in plain.stdout


def test_serve_shows_the_story_and_the_drawn_bands(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    store, sent, last = build(url, seed=5)
    version = max(sent)
    with served(StoreView(Store.open(url), url=url)) as base:
        client = Client(base)
        doc = client.json(f"/api/versions/{version}")["step_story"]
        check_story(doc, store, version, sent, rows=20)
        assert doc == json.loads(json.dumps(step_story(store, version)))
        status, html = client.get(f"/versions/{version}")
        assert status == 200
        want = fold_round(sent[version])
        assert f"{100 * want['pass_rate']:.0f}%" in html and 'class="story-drawn"' in html
        assert html.count('class="row-link"') >= min(want["rows"], 20)
        outcomes = client.json(f"/api/outcomes?version={last}")
        drawn = outcomes["drawn_bands"]
        assert drawn["counts"] == [fold_round(sent[v])["bands"] for v in sorted(sent)]
        status, page = client.get(f"/outcomes?version={last}")
        assert status == 200 and "bands drawn" in page
        # a store without outcomes has no series
        empty = Store.open(str(tmp_path / "empty"), create=True)
        empty.append([{"id": 1}])
    with served(StoreView(Store.open(str(tmp_path / "empty")), url="e")) as base:
        assert Client(base).json("/api/outcomes")["drawn_bands"] is None


def test_dynstate_steps_and_the_filtering_chart_count_what_the_loop_logged(tmp_path: Path) -> None:
    """The loop's own log (what each step's score function saw, what it trained and carried)
    is the oracle: `dynstate steps`, its --json, /api/outcomes' ``filtering`` and the chart
    count the same groups, and `show` names the filtered rows with their spread."""
    url, log = str(tmp_path / "dyn"), tmp_path / "log.jsonl"
    cfg = {**CFG, "steps": 7, "max_gen_batches": 4}
    consumption_run(url, cfg, None, log)
    logged = read_log(log)
    want = []
    carried = 0
    for step in sorted(logged):
        e = logged[step]
        drawn, trained, carry = len(e["drawn"]), len(e["trained"]), len(e["carry"])
        filtered = carried + drawn - trained - carry  # surplus="carry": nothing dropped
        want.append((step, carried, drawn, trained, filtered, carry))
        carried = carry
    assert sum(w[4] for w in want) > 0, "nothing filtered: the chart was not tested"
    done = _cli("steps", url, "--json", "--limit", "100")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    got = [
        (e["step"], e["carried_in"], e["drawn"], e["trained"], e["filtered"], e["carry"])
        for e in doc["steps"]
    ]
    assert got == want and doc["complete"]
    drawn_total = sum(w[2] for w in want)
    assert doc["totals"]["filtered_share"] == pytest.approx(sum(w[4] for w in want) / drawn_total)
    tail = json.loads(_cli("steps", url, "--json", "--limit", "2").stdout)
    assert [e["step"] for e in tail["steps"]] == [w[0] for w in want[-2:]]
    assert not tail["complete"]
    text = _cli("steps", url, "--limit", "100").stdout.splitlines()
    total = next(line for line in text if line.startswith("total")).split()
    assert total[:2] == ["total", str(len(want))] and int(total[5]) == drawn_total
    # show: the filtered groups of the last step, with their spread, from the record
    record = dynstate.consumption_records(Store.open(url))[-1]
    shown = _cli("show", url).stdout
    if record["filtered"]:
        row, spread = record["filtered"][0]
        assert f"row {row} (spread {spread:g})" in shown
    with served(StoreView(Store.open(url), url=url)) as base:
        client = Client(base)
        assert client.json("/api/outcomes")["filtering"] == {
            key: value for key, value in doc.items() if key != "url"
        } | {"complete": True}
        status, page = client.get("/outcomes")
    assert status == 200
    chart = page[page.index('<svg class="filtered"') :].split("</svg>")[0]
    cells = re.findall(r'data-step="(\d+)" data-filtered="(\d+)" data-drawn="(\d+)"', chart)
    assert [(int(a), int(b), int(c)) for a, b, c in cells] == [(w[0], w[4], w[2]) for w in want]


def test_the_step_view_and_the_drawn_chart_in_a_browser(browser, tmp_path: Path) -> None:  # noqa: F811
    url = str(tmp_path / "s")
    _, sent, last = build(url, seed=7)
    version = max(sent)
    want = fold_round(sent[version])
    with served(StoreView(Store.open(url), url=url)) as base:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        try:
            page.goto(f"{base}/versions/{version}")
            rows = page.locator("table.story-drawn tbody tr")
            assert rows.count() == want["rows"]
            shown = [int(rows.nth(i).locator("td").first.inner_text()) for i in range(rows.count())]
            assert shown == want["order"]
            assert (
                page.locator(".story-pass-rate")
                .inner_text()
                .startswith(f"{100 * want['pass_rate']:.0f}%")
            )
            assert page.locator(".story-weights").is_visible()
            rows.first.locator("a.row-link").click()
            page.wait_for_url(re.compile(rf"/versions/{version}/rows/{want['order'][0]}$"))
            page.goto(f"{base}/outcomes?version={last}")
            chart = page.locator("svg.drawn")
            assert chart.is_visible() and chart.bounding_box()["width"] > 500
            steps = chart.locator("g.step")
            assert steps.count() == len(sent)
            for i, v in enumerate(sorted(sent)):
                bars = steps.nth(i).locator("rect")
                drawn = sum(
                    int(bars.nth(k).get_attribute("data-rows")) for k in range(bars.count())
                )
                assert drawn == fold_round(sent[v])["rows"], v
        finally:
            context.close()


def test_an_async_steps_rows_in_flight_are_shown(tmp_path: Path) -> None:
    """A format-2 record (an async trainer's: rows still in flight, a group dropped as failed)
    committed by hand: `dynstate steps` (text and --json), `show` and serve's version page and
    chart count the rows in flight and name the failed drop, as the record lists them."""
    url = str(tmp_path / "async")
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(ROWS)])
    head = store.head
    in_flight = [[3, 7, 7], [5, 1]]  # row 7 twice: drawn in two epochs
    carried: list[int] = []
    drawn_by_step = [[2, 9, 3, 7, 7, 4], [5, 1, 8]]
    for step, (drawn, flying) in enumerate(zip(drawn_by_step, in_flight, strict=True), start=1):
        pool = Counter(carried) + Counter(drawn) - Counter(flying)
        rest = sorted(pool.elements())
        record = {
            "format": 2,
            "step": step,
            "rows_version": head,
            "settings": {"trainer_mode": "colocate_async"},
            "carried_in": carried,
            "drawn": drawn,
            "gen_batches": len(drawn),
            "trained": rest[2:],
            "filtered": [[rest[0], 0.0]],
            "dropped": [[rest[1], "failed"]],
            "carry": [],
            "in_flight": flying,
            "sampler": {},
        }
        trained = record["trained"]
        outcomes = {"row": trained, "step": [step] * len(trained), "score": [1.0] * len(trained)}
        store.append(
            [], meta={"step": step}, rows_version=head, consumption=record, outcomes=outcomes
        )
        carried = flying
    done = _cli("steps", url, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert [(e["step"], e["in_flight"], e["carried_in"]) for e in doc["steps"]] == [
        (1, 3, 0),
        (2, 2, 3),
    ]
    assert doc["totals"]["in_flight"] == 5
    text = _cli("steps", url).stdout.splitlines()
    assert "in flight" in text[1]
    shown = _cli("show", url).stdout
    assert "in flight 2" in shown and "(failed)" in shown
    with served(StoreView(Store.open(url), url=url)) as base:
        client = Client(base)
        status, html = client.get(f"/versions/{Store.open(url).head}")
        assert status == 200 and "in flight" in html and "[5, 1]" in html
        status, page = client.get("/outcomes")
        assert status == 200 and "2 in flight" in page and "5 rows" in page
