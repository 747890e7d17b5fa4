"""The growth model (dynstate.history.growth) and the two pictures drawn from it: serve's SVG
chart and `dynstate plot` (issue 24: rounds readable next to a large import, a step axis for
verl-shaped stores; issue 19: memory bounded whatever the steps)."""

from __future__ import annotations

import sys
import tracemalloc
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from dynstate import Store
from dynstate.history import growth
from dynstate.maintenance.plot import growth_points, plot_growth
from dynstate.serve.chart import growth_svg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from serve_screenshot import IMPORT_ROWS, MAX_ROUND, build

SVG = "{http://www.w3.org/2000/svg}"
PANEL = 120  # the chart's panel height, px


def _url() -> str:
    return f"memory://growth-tests/{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def verl_store() -> Store:
    return build(_url())


def _rects(svg: str, cls: str) -> list[ET.Element]:
    root = ET.fromstring(svg)
    return [e for e in root.iter(f"{SVG}rect") if cls in (e.get("class") or "").split()]


def test_verl_shaped_store_is_drawn_over_steps_with_every_round_readable(verl_store) -> None:
    model = growth(verl_store)
    assert model["axis"] == "step"
    first = model["points"][0]
    # The import (no step, as dynstate's verl import writes it) sits before step 1.
    assert (first["kind"], first["x"], first["placed"], first["rows_added"]) == (
        "import",
        0,
        True,
        IMPORT_ROWS,
    )
    rounds = [p for p in model["points"] if p["kind"] == "round"]
    assert all(p["x"] == p["step"] for p in rounds)
    assert sorted({p["step"] for p in rounds}) == [s for s in range(1, 41) if s not in (9, 17, 22)]
    # The scale is the rounds': the import is cut, not the yardstick.
    assert model["scale"]["bars"] == max(p["rows_added"] for p in rounds) <= MAX_ROUND
    assert model["scale"]["clipped"] == [first["version"]]
    assert model["scale"]["total"][0] > 0  # total rows from just below the import

    svg = growth_svg(model)
    bars = {int(r.get("data-version")): r for r in _rects(svg, "bar")}
    for p in rounds:
        height = float(bars[p["version"]].get("height"))
        assert height == pytest.approx(max(1.0, p["rows_added"] / model["scale"]["bars"] * PANEL))
        assert height >= PANEL / MAX_ROUND * 0.99  # even a 1-row round is a visible bar
    assert "import" in bars[first["version"]].get("class")
    assert float(bars[first["version"]].get("height")) == PANEL
    assert f"{IMPORT_ROWS:,} rows (import, cut)" in svg
    ticks = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text") if "x-tick" in t.get("class")]
    assert ticks and all(t.lstrip("-").isdigit() for t in ticks)  # whole steps, 0 to 40
    assert 'data-axis="step"' in svg


def test_rollback_marks_abandoned_rounds_and_the_crash_on_the_step_axis(verl_store) -> None:
    model = growth(verl_store)
    reset = next(m for m in model["markers"] if m["kind"] == "reset")
    assert reset["rollback"] and reset["checkpoint_step"] == 21
    assert reset["x"] == 21  # a reset has no step: placed by the step before it
    assert [g["x"] for g in reset["abandoned_points"]] == [22, 23, 24, 25]
    crash = next(m for m in model["markers"] if m["kind"] == "crash")
    assert crash["x"] == 25.5 and "died after step 25" in crash["label"]
    compact = next(m for m in model["markers"] if m["kind"] == "compact")
    assert compact["x"] == 30
    svg = growth_svg(model)
    ghosts = _rects(svg, "mark-abandoned")
    assert sorted(int(g.get("data-version")) for g in ghosts) == [
        g["version"] for g in reset["abandoned_points"] if g["rows_added"]
    ]
    assert all(float(g.get("height")) > 0 for g in ghosts)
    assert 'class="mark-crash"' in svg and 'class="mark-reset"' in svg

    # dynstate plot draws the same model: same axis, same points, the rollback marked.
    axis, points = growth_points(verl_store)
    assert axis == "step"
    assert [(p["version"], p["x"]) for p in points] == [
        (p["version"], p["x"]) for p in model["points"]
    ]
    assert [p["label"] for p in points if p["event"] == "rollback"] == [
        "resumed from the checkpoint at step 21"
    ]


def test_plot_of_a_verl_shaped_store(verl_store, tmp_path) -> None:
    out = tmp_path / "growth.png"
    assert plot_growth(verl_store, out) == len(growth(verl_store)["points"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_less_records_are_placed_by_the_step_before_them() -> None:
    store = Store.open(_url(), create=True)
    store.append([{"x": 0}] * 3, meta={"note": "import"})
    store.append([{"x": 1}], meta={"step": 1})
    store.append([{"x": 2}], meta={"step": 2})
    store.append([{"x": 3}, {"x": 3}], meta={"generator": "by hand"})  # no step
    store.append([{"x": 4}], meta={"step": 3})
    model = growth(store)
    got = [(p["version"], p["x"], p["placed"], p["kind"]) for p in model["points"]]
    assert got == [
        (1, 0, True, "import"),
        (2, 1, False, "round"),
        (3, 2, False, "round"),
        (4, 2, True, "round"),
        (5, 3, False, "round"),
    ]
    assert model["scale"] == {"bars": 3, "clipped": [], "total": [0, 8]}  # import not cut
    # Two rounds at step 2: side by side, each half the width.
    bars = {int(r.get("data-version")): r for r in _rects(growth_svg(model), "bar")}
    a, b = bars[3], bars[4]
    assert float(a.get("width")) == pytest.approx(float(b.get("width")))
    assert float(a.get("x")) + float(a.get("width")) == pytest.approx(float(b.get("x")), abs=0.2)


def test_store_without_steps_is_drawn_over_versions() -> None:
    store = Store.open(_url(), create=True)
    for k in range(3):
        store.append([{"x": k}])
    model = growth(store)
    assert model["axis"] == "version" and [p["x"] for p in model["points"]] == [1, 2, 3]


@pytest.mark.parametrize("jump", [2 * 10**7, 10**9, 2**63 + 5, 10**400])
def test_memory_is_bounded_whatever_the_steps(jump: int) -> None:
    store = Store.open(_url(), create=True)
    store.append([{"x": 1}], meta={"step": 1})
    store.append([{"x": 2}], meta={"step": jump})
    store.append([{"x": 3}], meta={"step": 2**62})
    tracemalloc.start()
    try:
        model = growth(store)
        svg = growth_svg(model)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak  # 852 MiB before, for 2*10**7
    missing = [m for m in model["markers"] if m["kind"] == "missing"]
    if jump < 2**63:
        assert model["points"][1]["x"] == jump
        assert missing[0]["count"] == jump - 2 and len(missing[0]["steps"]) == 100
    else:  # not a step a chart can place: drawn by the step before, and said so
        assert model["points"][1]["x"] == 1 and model["points"][1]["placed"]
    assert svg.startswith("<svg")


def test_many_rounds_are_summed_into_columns_with_the_import_cut() -> None:
    store = Store.open(_url(), create=True)
    store.append([{"x": 0}] * 500)
    for step in range(1, 501):
        store.append([{"x": step}] * (1 + step % 4), meta={"step": step})
    model = growth(store)
    assert model["scale"]["clipped"] == [1]
    svg = growth_svg(model)
    buckets = _rects(svg, "bucket")
    assert 100 < len(buckets) <= 300  # fewer columns than rounds, none empty
    assert all(float(b.get("height")) >= 1 for b in buckets)
    assert sum(int(b.get("data-rows")) for b in buckets) == sum(1 + s % 4 for s in range(1, 501))
    (cut,) = _rects(svg, "import")
    assert float(cut.get("height")) == PANEL and "500 rows (import, cut)" in svg
