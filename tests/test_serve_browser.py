"""`dynstate serve` in a real browser: Debian's headless Chromium driven by Playwright (no
browser download; tools/setup-venv.sh installs the `chromium` package). A missing Chromium
fails these tests instead of skipping them."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator

import pytest
from test_serve import build_run, served

from dynstate.serve.api import StoreView

CHROMIUM = os.environ.get("DYNSTATE_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-background-networking", "--headless", "--disable-gpu"]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not os.path.exists(CHROMIUM):
        pytest.fail(
            f"no Chromium at {CHROMIUM}: install Debian's chromium package "
            "(tools/setup-venv.sh does) or set DYNSTATE_CHROMIUM"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[tuple[object, str]]:
    run = build_run(str(tmp_path_factory.mktemp("browser") / "store"), {})
    with served(StoreView(run.store, url=run.url)) as base:
        yield run, base


@pytest.fixture
def page(browser, site):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    # Everything comes from the server under test: any other request is a bug.
    foreign: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(site[1]) else foreign.append(r.url))
    yield page
    context.close()
    assert foreign == []


def test_store_page_renders_and_is_screenshotted(page, site, tmp_path):
    _run, base = site
    page.goto(base + "/")
    assert page.locator("h1").inner_text().startswith("Store")
    chart = page.locator("svg.growth")
    assert chart.is_visible() and chart.bounding_box()["width"] > 500
    assert page.locator("svg.growth .mark-reset").count() == 1
    assert page.locator("svg.growth .mark-compact").count() == 1
    assert page.locator("svg.growth .mark-lost").count() == 1
    assert page.locator("svg.growth .mark-empty").count() == 1
    assert page.locator("svg.growth rect.mark-abandoned").count() == 1  # v8; v9 was empty
    assert page.locator("table.versions tbody tr").count() == 13
    shot = tmp_path / "store.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("DYNSTATE_SERVE_SCREENSHOT"):  # refreshes docs/serve-store.png
        shutil.copy(shot, os.environ["DYNSTATE_SERVE_SCREENSHOT"])


def test_follow_a_round_to_its_rows_then_a_row_to_parent_and_child(page, site):
    run, base = site
    page.goto(base + "/")
    page.locator('svg.growth rect.bar[data-version="5"]').click()
    page.wait_for_url(re.compile(r"/versions/5$"))
    page.locator("a.round-rows").click()
    page.wait_for_url(re.compile(r"round=5"))
    rows = page.locator("table.rows a.row-link").all_inner_texts()
    assert [int(r) for r in rows] == list(run.rounds[5][2])
    sources = page.locator("table.rows a.source").all_inner_texts()
    assert sources == [str(s) for r in run.rounds[5][2] for s in run.sources[r]]

    row = run.rounds[5][2].start  # step 3, derived from row 12 (step 2)
    page.locator("table.rows a.row-link", has_text=str(row)).first.click()
    page.wait_for_url(re.compile(rf"/versions/5/rows/{row}$"))
    assert page.locator("h1").inner_text().startswith(f"Row {row}")
    assert "step 3" in page.locator("p.written-by").inner_text()
    assert page.locator("svg.lineage").is_visible()

    parent = run.sources[row][0]
    page.locator("ul.ancestors a.ancestor", has_text=f"row {parent}").click()
    page.wait_for_url(re.compile(rf"/rows/{parent}$"))
    assert page.locator("h1").inner_text().startswith(f"Row {parent}")
    children = page.locator("ul.descendants a.descendant").all_inner_texts()
    assert f"row {row}" in children

    # The child through the lineage graph: its node links to the row page.
    page.goto(f"{base}/versions/head/rows/{row}")
    child = min(r for r, src in run.sources.items() if row in src)
    page.locator(f'svg.lineage a[data-row="{child}"]').click()
    page.wait_for_url(re.compile(rf"/rows/{child}$"))
    assert page.locator("h1").inner_text().startswith(f"Row {child}")
    assert f"row {row}" in page.locator("ul.ancestors").inner_text()


def test_filter_rows_by_generator_and_search(page, site):
    run, base = site
    page.goto(base + "/versions/head")
    page.locator(".facet-generator a", has_text="proposer").click()
    page.wait_for_url(re.compile(r"generator=proposer"))
    generators = page.locator("table.rows tbody tr td:nth-child(4)").all_inner_texts()
    expected = sum(len(r[2]) for r in run.rounds.values() if r[1] == "proposer")
    assert generators == ["proposer"] * expected
    assert page.locator(".facet-generator li.selected").count() == 1

    page.fill("form.filters input[name=q]", "step 8")
    page.locator("form.filters button").click()
    page.wait_for_url(re.compile(r"q=step"))
    rows = page.locator("table.rows a.row-link").all_inner_texts()
    assert [int(r) for r in rows] == list(run.rounds[14][2])
    assert "generator=proposer" in page.url  # the search kept the facet filter


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> Iterator[str]:
    from test_stats_cli import build as build_scored

    store = build_scored(str(tmp_path_factory.mktemp("scored") / "store"))
    with served(StoreView(store)) as base:
        yield base


@pytest.fixture
def scored_page(browser, scored):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    foreign: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(scored) else foreign.append(r.url))
    yield page
    context.close()
    assert foreign == []


def test_outcomes_from_band_chart_to_sorted_rows_to_a_row_history(scored_page, scored, tmp_path):
    """A store with outcomes: the band chart, its band link to the rows table sorted by pass
    rate, the header that flips the order, the pass-rate form, and a row's history."""
    page, base = scored_page, scored
    page.goto(base + "/")
    page.locator("a.outcomes-link").click()
    page.wait_for_url(re.compile(r"/outcomes$"))
    chart = page.locator("svg.bands:not(.drawn)")
    assert chart.is_visible() and chart.bounding_box()["width"] > 500
    assert page.locator("svg.bands:not(.drawn) g.step").count() == 4
    page.locator("ul.bands-legend a", has_text="0\u201310%").click()
    page.wait_for_url(re.compile(r"max_pass_rate=0.1"))
    assert page.locator("table.rows a.row-link").all_inner_texts() == ["0", "1", "2"]

    page.goto(base + "/versions/head?min_attempts=1")
    page.locator("a.sort-pass_rate").click()  # ascending, then descending
    page.locator("a.sort-pass_rate").click()
    page.wait_for_url(re.compile(r"sort=-pass_rate"))
    assert page.locator("table.rows a.row-link").all_inner_texts() == ["4", "3", "0", "1", "2"]
    assert page.locator("table.rows td.pass-rate").first.inner_text() == "100%"
    page.fill("form.filters input[name=min_pass_rate]", "0.4")
    page.fill("form.filters input[name=max_pass_rate]", "0.6")
    page.locator("form.filters button").click()
    page.wait_for_url(re.compile(r"min_pass_rate=0.4"))
    assert "sort=-pass_rate" in page.url  # the form kept the order
    assert page.locator("table.rows a.row-link").all_inner_texts() == ["3"]

    page.locator("table.rows a.row-link", has_text="3").click()
    page.wait_for_url(re.compile(r"/rows/3$"))
    assert "pass rate 50%" in page.locator("p.outcome-summary").inner_text()
    assert page.locator("svg.pass-rate").is_visible()
    assert page.locator("svg.pass-rate circle.step-rate").count() == 4
    steps = page.locator("table.outcome-history tbody td:first-child").all_inner_texts()
    assert steps == ["3", "2", "1", "0"]
    shot = tmp_path / "row-outcomes.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("DYNSTATE_SERVE_OUTCOMES_SCREENSHOT"):  # docs/serve-row-outcomes.png
        shutil.copy(shot, os.environ["DYNSTATE_SERVE_OUTCOMES_SCREENSHOT"])


@pytest.fixture(scope="module")
def long_site(tmp_path_factory) -> Iterator[str]:
    from test_serve_chart import long_run

    store = long_run(str(tmp_path_factory.mktemp("long") / "store"))
    with served(StoreView(store)) as base:
        yield base


def test_growth_chart_of_a_2000_round_store_renders_its_buckets(browser, long_site, tmp_path):
    """The chart of a long run (more rounds than pixels) as a browser lays it out: bucket
    bars inside the bars panel, standing on its axis, with a caption saying what they are,
    and a bar's link to its last round's version page."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    foreign: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(long_site) else foreign.append(r.url))
    try:
        page.goto(long_site + "/")
        chart = page.locator("svg.growth")
        assert chart.is_visible() and chart.bounding_box()["width"] > 500
        box = chart.bounding_box()
        bars = page.locator("svg.growth rect.bar.bucket")
        assert 100 < bars.count() <= 1000
        heights = []
        for k in (0, bars.count() // 2, bars.count() - 1):
            b = bars.nth(k).bounding_box()
            assert b is not None and b["height"] > 0 and b["width"] > 0
            assert box["x"] <= b["x"] and b["x"] + b["width"] <= box["x"] + box["width"]
            assert box["y"] <= b["y"] and b["y"] + b["height"] <= box["y"] + box["height"]
            heights.append(b["height"])
        caption = page.locator("svg.growth text.bars-caption")
        c = caption.bounding_box()
        assert (
            c is not None and box["y"] <= c["y"] and c["x"] + c["width"] <= box["x"] + box["width"]
        )
        assert re.search(r"mean of the rounds in \d+ steps", caption.text_content() or "")
        assert page.locator("svg.growth g.bars-axis text").all_text_contents() == [
            "0",
            "1",
            "2",
            "3",
            "4",
        ]
        shot = tmp_path / "long.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        last = bars.nth(bars.count() - 1).get_attribute("data-last")
        page.locator("svg.growth a:has(rect.bar.bucket)").last.click()
        page.wait_for_url(re.compile(rf"/versions/{last}$"))
    finally:
        context.close()
    assert foreign == []
