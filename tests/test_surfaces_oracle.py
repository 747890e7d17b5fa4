"""The offline surfaces (`dynstate head/diff/show/ls/info/stats/export`, `dynstate serve`'s
JSON API) against an oracle computed without dynstate's readers: a version's rows are its
shards read whole with plain ``pyarrow.parquet.read_table`` (paths from
``store.snapshot(v).shards``, in manifest order); per-row statistics are a plain Python fold
of the outcome records this test itself committed (modelled along each lineage, resets
included); a diff is checked against the rows themselves.

The ``test_*_was_*`` tests each held a defect, fixed since (each failed on the code before;
its docstring tells it as found); the others guard what held up under seeded random
histories."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import random
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import dynstate
from dynstate.cli import cli
from dynstate.maintenance.compact import compact
from dynstate.maintenance.gc import collect_garbage

sys.path.insert(0, str(Path(__file__).parent))
from serving import served

pytest.importorskip("starlette")
from dynstate.serve.api import StoreView

# -- the oracle ------------------------------------------------------------------------------


def oracle_rows(root: Path, store: dynstate.Store, v: int) -> list[dict[str, Any]]:
    """Version ``v``'s rows: its shards read whole with plain pyarrow, in manifest order, as
    dicts over the version's columns (a column a shard predates is null)."""
    snap = store.snapshot(v)
    names = [f.name for f in snap.schema] if snap.schema is not None else []
    rows: list[dict[str, Any]] = []
    for shard in snap.shards:
        for row in pq.read_table(os.path.join(root, shard.path)).to_pylist():
            rows.append({n: row.get(n) for n in names})
    return rows


def strict(value: Any) -> Any:
    """A value as strict JSON carries it (NaN and infinities null), for comparing rows."""
    if isinstance(value, dict):
        return {k: strict(x) for k, x in value.items()}
    if isinstance(value, list):
        return [strict(x) for x in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def fold(n: int, records: list[dict[str, Any]], above: float = 0.5, half_life: float = 10.0):
    """Per-row statistics of ``n`` rows from raw outcome records (docs/outcomes.md)."""
    per: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    for r in records:
        per[r["row"]].append(r)
    out = []
    for i, recs in enumerate(per):
        a = len(recs)
        s = sum(1 for r in recs if r["score"] > above)
        entry: dict[str, Any] = {"row": i, "attempts": a, "successes": s, "pass_rate": None,
                                 "mean_score": None, "ewma_score": None, "first_step": None,
                                 "last_step": None}  # fmt: skip
        if a:
            last = max(r["step"] for r in recs)
            w = [2 ** ((r["step"] - last) / half_life) for r in recs]
            entry.update(
                pass_rate=s / a,
                mean_score=sum(r["score"] for r in recs) / a,
                ewma_score=sum(x * r["score"] for x, r in zip(w, recs, strict=True)) / sum(w),
                first_step=min(r["step"] for r in recs),
                last_step=last,
            )
        out.append(entry)
    return out


def close(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def cli_json(*args: Any) -> Any:
    res = CliRunner().invoke(cli, [str(a) for a in args])
    assert res.exit_code == 0, (args, res.output)
    return json.loads(res.stdout)


def get(base: str, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(base + path, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- seeded random histories ---------------------------------------------------------------

TEXTS = ["", "a", "ü\nnewline", "x" * 3000, 'tab\tq"uote', None, "日本語", "emoji😀"]
SCORES = [0.0, 0.5, 0.5000001, 1.0, 0.25, 0.75, 1, 0]


def history(root: Path, seed: int, steps: tuple[int, int] = (5, 14)):
    """A store with appends (duplicate rows, nulls, unicode, long text, nested lists, a
    column added later), empty rounds, outcome-only rounds, resets to old versions and
    compactions; and the model: per version, its row count and outcome records."""
    rng = random.Random(seed)
    store = dynstate.Store.open(str(root), create=True)
    model: dict[int, dict[str, Any]] = {0: {"n": 0, "out": [], "steps": set()}}
    cols: list[str] = []
    nid = stepc = 0
    for _ in range(rng.randint(*steps)):
        op, head = rng.random(), store.head
        cur = model[head]
        if op < 0.12 and head > 1:
            target = rng.randint(1, head - 1)
            model[store.reset(target)] = model[target]
            continue
        if op < 0.18 and head > 0:
            compact(store, target_bytes=10**9)
            if store.refresh() != head:
                model[store.head] = cur
            continue
        rows: list[dict[str, Any]] = []
        if op >= 0.25:
            if rng.random() < 0.2:
                cols = [*cols, f"c{len(cols)}"]
            for _ in range(rng.randint(1, 6)):
                if rows and rng.random() < 0.25:
                    rows.append(dict(rows[-1]))  # the same content twice
                    continue
                rows.append(
                    {
                        "id": nid % 5,
                        "t": rng.choice(TEXTS),
                        "f": rng.choice([0.5, -1.0, None, float("nan")]),
                        "l": rng.choice([[1, 2], [], None]),
                    }
                    | {c: rng.choice([None, nid]) for c in cols}
                )
                nid += 1
        out = step = None
        if cur["n"] and rng.random() < 0.8:
            stepc += 1
            step = stepc if rng.random() < 0.8 else rng.randint(0, stepc)
            if step in cur["steps"]:
                step = stepc = stepc + 1
            k = rng.randint(1, 8)
            out = {"row": [rng.randrange(cur["n"]) for _ in range(k)], "step": [step] * k,
                   "score": [rng.choice(SCORES) for _ in range(k)]}  # fmt: skip
        schema = pa.schema(
            [
                ("id", pa.int64()),
                ("t", pa.string()),
                ("f", pa.float64()),
                ("l", pa.list_(pa.int64())),
            ]
            + [(c, pa.int64()) for c in cols]
        )
        data = pa.Table.from_pylist(rows, schema=schema) if rows else []
        v = store.append(data, meta={"step": stepc if step is None else step}, outcomes=out,
                         allow_new_columns=True)  # fmt: skip
        recs = (
            []
            if out is None
            else [
                {"row": r, "step": s, "score": float(x)}
                for r, s, x in zip(out["row"], out["step"], out["score"], strict=True)
            ]
        )
        model[v] = {"n": cur["n"] + len(rows), "out": cur["out"] + recs,
                    "steps": cur["steps"] | ({step} if step is not None else set())}  # fmt: skip
    store.refresh()
    return store, model


def sort_key(name: str, desc: bool):
    def key(w: dict[str, Any]) -> tuple:
        val = w[name]
        missing = val is None
        return (missing, 0 if missing else (-val if desc else val), w["row"])

    return key


SORTS = ["pass_rate", "-pass_rate", "attempts", "-attempts", "successes", "mean_score",
         "-ewma_score", "first_step", "-last_step"]  # fmt: skip


# -- guards: what held up ------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_head_windows_match_pyarrow_oracle(tmp_path, seed) -> None:
    """`head` -n/--offset/--tail/--added near and past the ends, -n 0, at every version."""
    store, _ = history(tmp_path, seed)
    for v in range(store.head + 1):
        want = [strict(r) for r in oracle_rows(tmp_path, store, v)]
        rec, n = store.commit_record(v), len(want)
        added = want[n - rec.rows_added :] if rec.op == "append" else []
        cases = [
            ([], want[:10]),
            (["-n", 0], []),
            (["-n", n + 5], want),
            (["--offset", max(n - 2, 0), "-n", 5], want[max(n - 2, 0) :]),
            (["--offset", n + 3], []),
            (["--tail", "-n", 3], want[max(0, n - 3) :]),
            (["--tail", "--offset", 2, "-n", 3], want[max(0, n - 5) : max(0, n - 2)]),
            (["--tail", "--offset", n + 2], []),
            (["--added", "-n", 1000], added),
            (["--added", "--tail", "-n", 1], added[-1:]),
        ]
        for args, expected in cases:
            assert cli_json("head", tmp_path, v, *args, "--json") == expected, (v, args)


def test_installed_entry_point_head_jsonl(tmp_path) -> None:
    store, _ = history(tmp_path, 3)
    want = [strict(r) for r in oracle_rows(tmp_path, store, store.head)]
    exe = Path(sys.executable).parent / "dynstate"
    done = subprocess.run([str(exe), "head", str(tmp_path), "-n", "1000", "--jsonl"],
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert [json.loads(line) for line in done.stdout.splitlines()] == want


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_stats_and_head_sort_match_fold(tmp_path, seed) -> None:
    """outcome_stats, `stats --json` and `head --sort/--min-/--max-pass-rate` at every
    version, against a fold of the records each lineage holds."""
    store, model = history(tmp_path, seed)
    for v in range(1, store.head + 1):
        m = model[v]
        want = fold(m["n"], m["out"])
        for w, g in zip(want, store.outcome_stats(v).to_pylist(), strict=True):
            for k in ("attempts", "successes", "first_step", "last_step"):
                assert w[k] == g[k], (v, k, w, g)
            assert close(w["mean_score"], g["mean_score"]) and close(
                w["ewma_score"], g["ewma_score"]
            )
        trained = [w for w in want if w["attempts"]]
        if not trained:
            continue
        s = cli_json("stats", tmp_path, v, "--json", "--top", 1000)
        assert (s["rows"], s["trained"], s["records"]) == (m["n"], len(trained), len(m["out"]))
        assert close(s["pass_rate"], sum(w["successes"] for w in want) / len(m["out"]))
        hard = sorted(trained, key=lambda w: (w["pass_rate"], -w["attempts"], w["row"]))
        assert [h["row"] for h in s["hardest"]] == [h["row"] for h in hard]
        hist = [0] * 10
        for w in trained:
            hist[min(w["successes"] * 10 // w["attempts"], 9)] += 1
        assert [b["rows"] for b in s["histogram"]] == hist
        rows = [strict(r) for r in oracle_rows(tmp_path, store, v)]
        for key in SORTS:
            got = cli_json("head", tmp_path, v, "--sort", key, "-n", 10_000, "--json")
            expected = sorted(want, key=sort_key(key.lstrip("-"), key.startswith("-")))
            assert [g["_dynstate_row"] for g in got] == [e["row"] for e in expected], (v, key)
            for g in got:
                w = want[g["_dynstate_row"]]
                assert (g["_dynstate_attempts"], g["_dynstate_successes"]) == (
                    w["attempts"], w["successes"])  # fmt: skip
                assert close(g["_dynstate_pass_rate"], w["pass_rate"])
                values = {k: x for k, x in g.items() if not k.startswith("_dynstate")}
                assert values == rows[g["_dynstate_row"]]
        for w in trained[:3]:  # bounds at exact k/n
            x = w["pass_rate"]
            got = cli_json("head", tmp_path, v, "--min-pass-rate", repr(x), "-n", 10_000, "--json")
            assert [g["_dynstate_row"] for g in got] == [
                e["row"] for e in want if e["attempts"] and e["pass_rate"] >= x
            ]
            got = cli_json("head", tmp_path, v, "--max-pass-rate", repr(x), "-n", 10_000, "--json")
            assert [g["_dynstate_row"] for g in got] == [
                e["row"] for e in want if e["attempts"] and e["pass_rate"] <= x
            ]


@pytest.mark.parametrize("seed", [7, 8])
def test_diff_rows_and_serve_diff_match_oracle(tmp_path, seed) -> None:
    """`diff --rows --json` and /api/diff between versions of different lineages: the rows
    called shared are the same rows, the added/removed counts are what is left of each."""
    store, _ = history(tmp_path, seed)
    head = store.head
    rows = {v: oracle_rows(tmp_path, store, v) for v in range(head + 1)}
    view = StoreView(store)
    rng = random.Random(seed)
    for a, b in [(rng.randint(0, head), rng.randint(0, head)) for _ in range(8)]:
        d = cli_json("diff", tmp_path, a, b, "--rows", "-n", 1000, "--json")
        ra, rb = rows[a], rows[b]
        common = set(ra[0]) & set(rb[0]) if ra and rb else set()
        sh = d["shared_rows"]
        assert d["rows"] == [len(ra), len(rb)]
        assert [{k: strict(r[k]) for k in common} for r in ra[:sh]] == [
            {k: strict(r[k]) for k in common} for r in rb[:sh]
        ]
        assert (d["added_rows"], d["removed_rows"]) == (len(rb) - sh, len(ra) - sh)
        assert [p["row"] for p in d["added_preview"]] == list(range(sh, len(rb)))
        # NaN compared as null on both sides: diff --rows prints NaN (test_defect_diff_rows_...)
        assert [strict(p["values"]) for p in d["added_preview"]] == [strict(r) for r in rb[sh:]]
        sv = view.diff(a, b)
        assert (sv["added_range"], sv["removed_range"]) == ([sh, len(rb)], [sh, len(ra)])
        for side, src in (("added", rb), ("removed", ra)):
            shown = sv[f"{side}_preview"]
            assert [p["values"] for p in shown] == [strict(r) for r in src[sh : sh + len(shown)]]


@pytest.mark.parametrize("seed", [9, 10])
def test_serve_rows_pages_match_oracle(tmp_path, seed) -> None:
    """/api/versions/{v}/rows walked page by page with sort, outcome bounds and a column
    filter, against the fold and the pyarrow rows; one version over HTTP as well."""
    store, model = history(tmp_path, seed)
    view = StoreView(store)

    def walk(v, **kw):
        got, off = [], 0
        for _ in range(500):
            page = view.rows_page(v, offset=str(off), limit="3", **kw)
            got += page["rows"]
            if page["next_offset"] is None:
                return got, page["total"]
            off = page["next_offset"]
        raise AssertionError("paging did not end")

    for v in range(1, store.head + 1):
        m, rows = model[v], [strict(r) for r in oracle_rows(tmp_path, store, v)]
        got, total = walk(v)
        assert [g["values"] for g in got] == rows and total == len(rows)
        if not m["out"] or not rows:
            continue
        want = fold(m["n"], m["out"])
        for key in ("pass_rate", "-attempts", "mean_score", "-last_step"):
            order = [w["row"] for w in sorted(want, key=sort_key(key.lstrip("-"), key[0] == "-"))]
            bounds = (
                ({}, lambda r: True),
                ({"min_pass_rate": "0.5"}, lambda r, w=want: bool(w[r]["attempts"])
                 and w[r]["pass_rate"] >= 0.5),
                ({"max_attempts": "0"}, lambda r, w=want: w[r]["attempts"] == 0),
            )  # fmt: skip
            for extra, keep in bounds:
                for filters in ({}, {"id": ["0", "1"]}):
                    exp = [r for r in order if keep(r) and (not filters or rows[r]["id"] in (0, 1))]
                    got, total = walk(v, filters=filters, outcome={"sort": key, **extra})
                    assert [g["row"] for g in got] == exp and total == len(exp), (v, key, extra)
                    for g in got:
                        assert g["values"] == rows[g["row"]]
                        assert g["outcomes"]["attempts"] == want[g["row"]]["attempts"]
    v = store.head
    with served(view, warm=False) as base:
        status, page = get(base, f"/api/versions/{v}/rows?limit=500")
    assert status == 200
    assert [r["values"] for r in page["rows"]] == [
        strict(r) for r in oracle_rows(tmp_path, store, v)
    ]


def test_gc_tags_ls_show_export_match_oracle(tmp_path) -> None:
    """After gc with a tag: ls --all / show statuses and counts, info, export read back, and
    head/stats at every kept version."""
    store, model = history(tmp_path, 11, steps=(8, 14))
    store.tag("t1", store.head - 3)
    collect_garbage(store, keep=4, dry_run=False, grace_s=0)
    store = dynstate.Store.open(str(tmp_path))
    floor, head = store.floor, store.head
    kept = range(floor, head + 1)

    def line(v):
        out = []
        while v is not None and v >= floor:
            out.append(v)
            rec = store.commit_record(v)
            v = rec.target if rec.op == "reset" else rec.parent
        return out

    on_line = set(line(head))
    listed = cli_json("ls", tmp_path, "--all", "--json")
    assert [x["version"] for x in listed] == list(kept)[::-1]
    for x in listed:
        v = x["version"]
        rows = oracle_rows(tmp_path, store, v)
        shards = store.snapshot(v).shards
        assert x["total_rows"] == len(rows) and x["shards"] == len(shards)
        assert x["bytes"] == sum(os.path.getsize(os.path.join(tmp_path, s.path)) for s in shards)
        status = "head" if v == head else (None if v in on_line else "abandoned")
        assert x["status"] == status and (("t1" in x["tags"]) == (v == head - 3))
        shown = cli_json("show", tmp_path, v, "--json")
        assert (shown["rows"], shown["status"]) == (len(rows), status)
        out = tmp_path.parent / f"export-{v}.parquet"
        cli_json("export", tmp_path, v, out, "--json")
        assert [strict(r) for r in pq.read_table(out).to_pylist()] == [strict(r) for r in rows]
        assert cli_json("head", tmp_path, v, "-n", 1000, "--json") == [strict(r) for r in rows]
        if model[v]["out"]:
            assert cli_json("stats", tmp_path, v, "--json")["records"] == len(model[v]["out"])
    info = cli_json("info", tmp_path, "--json")
    assert (info["head"], info["oldest"], info["tags"]) == (head, floor, {"t1": head - 3})


# -- defects -------------------------------------------------------------------------------

FAR_MS = 2_534_023_008_000_000  # milliseconds since 1970: past year 9999


def _far_store(root: Path) -> dynstate.Store:
    store = dynstate.Store.open(str(root), create=True)
    store.append(pa.table({"ts": pa.array([0, FAR_MS], pa.timestamp("ms")), "p": ["a", "b"]}))
    return store


def test_head_json_value_was_window_dependent_with_an_out_of_range_timestamp(tmp_path) -> None:
    """Row 0's timestamp (1970-01-01, in range) is shown as ISO 8601 by `head -n 1`, but as
    Arrow's text ("1970-01-01 00:00:00.000") once the window also holds row 1, whose value is
    past year 9999: one unrepresentable value changes how every value of its column in the
    window is shown. docs/cli.md: only "a value Python's datetime cannot hold" is shown as
    Arrow prints it; the others are values as serve's API gives them (ISO 8601)."""
    store = _far_store(tmp_path)
    (shard,) = store.snapshot(1).shards
    column = pq.read_table(os.path.join(tmp_path, shard.path)).column("ts")
    assert column[0].as_py() == dt.datetime(1970, 1, 1) and column[1].value == FAR_MS
    alone = cli_json("head", tmp_path, "-n", 1, "--json")
    both = cli_json("head", tmp_path, "-n", 2, "--json")
    assert alone[0]["ts"] == column[0].as_py().isoformat()
    assert both[1]["ts"] == f"<value out of range: {FAR_MS}>"
    assert both[0] == alone[0]  # fails: {'ts': '1970-01-01 00:00:00.000', ...}


@pytest.mark.parametrize("path", ["/api/versions/1/rows", "/api/versions/1/rows/1"])
def test_serve_row_pages_were_500_on_an_out_of_range_timestamp(tmp_path, path) -> None:
    """`dynstate head` shows a store holding a timestamp past year 9999; serve's rows page
    and that row's page answer 500 (OverflowError) instead of the values `head --jsonl`
    prints (docs/serve.md: "values, as dynstate head --jsonl prints a row")."""
    store = _far_store(tmp_path)
    head_rows = cli_json("head", tmp_path, "-n", 2, "--json")
    assert head_rows[1]["ts"] == f"<value out of range: {FAR_MS}>"
    with served(StoreView(store), warm=False) as base:
        status, doc = get(base, path)
    assert status == 200, doc  # fails: 500 "this page could not be built (OverflowError ...)"
    values = [r["values"] for r in doc["rows"]] if "rows" in doc else [doc["values"]]
    assert values[-1]["ts"] == head_rows[1]["ts"] and values[-1]["p"] == "b"


def test_diff_rows_json_was_not_strict_json_nor_head_values(tmp_path) -> None:
    """`diff --rows --json` shows "the rows V2 adds, as head shows them" (docs/cli.md), but
    its ``added_preview`` values skip head's strict-JSON rendering: NaN and infinities come
    out as the bare tokens NaN / Infinity (not JSON, RFC 8259), bytes as Python's repr
    ("b'\\x01'") and timestamps as str() instead of ISO 8601."""
    store = dynstate.Store.open(str(tmp_path), create=True)
    store.append([{"p": "a", "f": 1.0, "b": b"\x00", "ts": dt.datetime(2020, 1, 2, 3, 4, 5)}])
    later = dt.datetime(2021, 1, 2, 3, 4, 5)
    store.append(
        [
            {"p": "b", "f": float("nan"), "b": b"\x01", "ts": later},
            {"p": "c", "f": float("inf"), "b": None, "ts": None},
        ]
    )
    oracle = oracle_rows(tmp_path, store, 2)[1:]
    assert math.isnan(oracle[0]["f"]) and oracle[0]["b"] == b"\x01"
    head = cli_json("head", tmp_path, 2, "--added", "--json")
    assert head[0] == {"p": "b", "f": None, "b": "base64:AQ==", "ts": "2021-01-02T03:04:05"}
    res = CliRunner().invoke(cli, ["diff", str(tmp_path), "1", "2", "--rows", "--json"])
    assert res.exit_code == 0, res.output

    def refuse(token: str) -> Any:
        raise ValueError(f"not JSON: {token}")

    doc = json.loads(res.stdout, parse_constant=refuse)  # fails: not JSON: NaN
    assert [p["values"] for p in doc["added_preview"]] == head


def _boundary_store(root: Path) -> dynstate.Store:
    """Row 0 trained 50 times with 29 successes (pass rate exactly 0.58), row 1 never."""
    store = dynstate.Store.open(str(root), create=True)
    store.append([{"p": "x"}, {"p": "y"}], meta={"step": 0})
    scores = [1.0] * 29 + [0.0] * 21
    store.append([], meta={"step": 1},
                 outcomes={"row": [0] * 50, "step": [1] * 50, "score": scores})  # fmt: skip
    return store


def test_stats_histogram_was_putting_an_edge_rate_in_the_band_below(tmp_path) -> None:
    """`stats --bins 50`: a row at 29/50 = 58% belongs in the band [0.58, 0.60) (bands are
    half-open, docs/cli.md), but is counted in [0.56, 0.58): the band is
    int(29/50 * 50) = int(28.999999999999996) = 28."""
    _boundary_store(tmp_path)
    out = cli_json("stats", tmp_path, "--bins", 50, "--json")
    (rate,) = [e["pass_rate"] for e in out["hardest"]]
    assert rate == 29 / 50
    expected = 29 * 50 // 50  # the oracle's band, in integers
    counts = [b["rows"] for b in out["histogram"]]
    assert out["histogram"][expected]["low"] <= rate < out["histogram"][expected]["high"]
    assert counts[expected] == 1, counts  # fails: the row is in band 28


def test_serve_outcome_bands_were_putting_an_edge_rate_in_the_band_below(tmp_path) -> None:
    """/api/outcomes?bins=50: the summary's histogram and the band series both place the
    29/50 row in band 28 ([0.56, 0.58)) instead of 29 ([0.58, 0.60))."""
    store = _boundary_store(tmp_path)
    with served(StoreView(store), warm=False) as base:
        status, doc = get(base, "/api/outcomes?bins=50")
    assert status == 200
    hist = [b["rows"] for b in doc["summary"]["histogram"]]
    last = doc["bands"]["counts"][-1]
    assert hist[29] == 1 and last[29] == 1, (hist.index(1), last.index(1))
