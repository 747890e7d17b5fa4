"""The growth chart of `dynstate serve` against the data: a 2,000-round store, more rounds than
the chart has pixels, so its bars are buckets. Every bar must read, on the chart's own
rows-added axis, as the mean rows added per round of the rounds it covers, computed here in
plain Python from the store's commit records (issue 44.3: the bars were bucket sums against a
per-round axis, so a run adding 2 rows per round showed bars of 1.33 and 2)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import pyarrow as pa
import pytest
from test_serve import Client, served

from dynstate import Store
from dynstate.serve.api import StoreView

NS = "{http://www.w3.org/2000/svg}"
ROUNDS = 2000
# Rows added by round i: varied, so that bucket means differ and a wrong grouping shows.
PATTERN = (2, 2, 2, 1, 3, 2, 4)


def long_run(url: str) -> Store:
    """An import of 100 rows, then 2,000 rounds at steps 0-1999 adding PATTERN rows each."""
    store = Store.open(url, create=True)
    store.append(pa.table({"x": list(range(100))}))
    for step in range(ROUNDS):
        n = PATTERN[step % len(PATTERN)]
        store.append(pa.table({"x": [step] * n}), meta={"step": step, "generator": "g"})
    return store


def growth_svg_of(body: str) -> ET.Element:
    """The growth chart of a served page, parsed as the XML it is."""
    match = re.search(r'<svg class="growth".*?</svg>', body, re.S)
    assert match, body[:2000]
    return ET.fromstring(match.group(0))


def _classes(el: ET.Element) -> set[str]:
    return set(el.get("class", "").split())


def bars_axis(svg: ET.Element) -> tuple[float, float, list[str]]:
    """The rows-added axis as drawn: (y of 0, pixels per row, tick labels)."""
    axis = next(g for g in svg.iter(f"{NS}g") if "bars-axis" in _classes(g))
    lines = [float(line.get("y1")) for line in axis.iter(f"{NS}line")]
    labels = [t.text or "" for t in axis.iter(f"{NS}text")]
    values = [float(t) for t in labels]
    (y0, v0), (y1, v1) = (lines[0], values[0]), (lines[-1], values[-1])
    assert v0 == 0 and v1 > 0
    return y0, (y0 - y1) / v1, labels


@pytest.fixture(scope="module")
def long_site(tmp_path_factory) -> Iterator[tuple[Store, Client]]:
    store = long_run(str(tmp_path_factory.mktemp("chart") / "store"))
    with served(StoreView(store)) as base:
        yield store, Client(base)


def test_bucket_bars_are_the_mean_rows_per_round_on_the_axis(long_site):
    store, client = long_site
    status, body = client.get("/")
    assert status == 200
    svg = growth_svg_of(body)
    zero, per_row, labels = bars_axis(svg)
    assert all(re.fullmatch(r"\d+", t) for t in labels), labels  # a count axis: whole ticks
    caption = next(t for t in svg.iter(f"{NS}text") if "bars-caption" in _classes(t)).text
    size = int(re.search(r"mean of the rounds in (\d+) steps", caption or "").group(1))
    bars = [r for r in svg.iter(f"{NS}rect") if {"bar", "bucket"} <= _classes(r)]
    assert 100 < len(bars) <= 1000  # buckets, not one bar per round

    records = {v: store.commit_record(v) for v in range(store.head + 1)}
    rounds = sorted(v for v, r in records.items() if r.op == "append" and v >= 2)
    assert len(rounds) == ROUNDS
    covered: list[int] = []
    for bar in bars:
        first, last = int(bar.get("data-first")), int(bar.get("data-last"))
        mine = [v for v in rounds if first <= v <= last]
        assert 0 < len(mine) <= size and int(bar.get("data-rounds")) == len(mine)
        covered += mine
        mean = sum(records[v].rows_added for v in mine) / len(mine)
        height, y = float(bar.get("height")), float(bar.get("y"))
        assert abs(y + height - zero) < 0.01  # standing on the axis's 0
        assert abs(height / per_row - mean) < 0.01, (first, last, height / per_row, mean)
    assert covered == rounds  # every round in exactly one bar, in order
    # The import (100 rows, 25 times the largest round) is its own bar, cut, with its number.
    (imp,) = [r for r in svg.iter(f"{NS}rect") if "import" in _classes(r)]
    assert imp.get("data-rows") == "100"


def test_short_run_bars_axis_has_whole_ticks(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    for step in range(5):
        store.append(pa.table({"x": [step, step]}), meta={"step": step})
    with served(StoreView(store)) as base:
        svg = growth_svg_of(Client(base).get("/")[1])
    _zero, per_row, labels = bars_axis(svg)
    assert labels == ["0", "1", "2"]  # was 0, 0.5, 1, 1.5, 2 on a count of rows
    for bar in (r for r in svg.iter(f"{NS}rect") if "bar" in _classes(r)):
        assert abs(float(bar.get("height")) / per_row - int(bar.get("data-rows"))) < 0.05
