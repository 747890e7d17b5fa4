"""`dynstate serve`: every JSON endpoint and page, served by a real uvicorn server on loopback,
over a local and a loopback-S3 store that has been compacted, rolled back and garbage
collected, with lineage recorded in `_dynstate_source`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner
from conftest import s3_url
from serving import served

from dynstate import MissingDependencyError, Store
from dynstate.cli.commands_serve import serve as serve_command
from dynstate.maintenance.compact import compact
from dynstate.maintenance.gc import collect_garbage
from dynstate.serve.api import StoreView

SECRET = "wJalrXUtnFEMI-serve-test-SECRET"
SCHEMA = pa.schema(
    [
        ("prompt", pa.string()),
        ("answer", pa.string()),
        ("difficulty", pa.int64()),
        ("_dynstate_source", pa.list_(pa.int64())),
    ]
)


@dataclass
class Run:
    """A store as a short dynamic-datagen run leaves it, and what the test expects of it."""

    url: str
    options: dict[str, Any]
    store: Store = field(init=False)
    rounds: dict[int, tuple[int, str, range]] = field(default_factory=dict)  # head lineage
    abandoned: dict[int, tuple[int, str, range]] = field(default_factory=dict)
    sources: dict[int, list[int]] = field(default_factory=dict)


def _round(store: Store, run: Run, step: int, generator: str, n: int = 3) -> int:
    start = store.snapshot().num_rows
    prev = max((r for r in run.rounds.values() if r[2].stop <= start), key=lambda r: r[2].stop)
    base = prev[2].start
    rows = []
    for j in range(n):
        src = [base + j] if j < 2 else [base, base + 2]
        run.sources[start + j] = src
        rows.append(
            {
                "prompt": f"Task of step {step} row {j}: derive from {src}",
                "answer": str(step * 10 + j),
                "difficulty": j,
                "_dynstate_source": src,
            }
        )
    version = store.append(
        pa.Table.from_pylist(rows, SCHEMA), meta={"step": step, "generator": generator}
    )
    run.rounds[version] = (step, generator, range(start, start + n))
    return version


def build_run(url: str, options: dict[str, Any]) -> Run:
    """v1 initial rows, v2-v5 steps 0-3, v6 compaction, v7 step 4 (tagged), v8 step 5,
    v9 an empty round, v10 a rollback to v7, v11 a lost round, v12 step 6, v13 an empty round,
    v14 step 8; then gc keeps the newest 13 versions, so v0 and v1 are collected."""
    run = Run(url, options)
    store = Store.open(url, create=True, storage_options=options)
    initial = [
        {
            "prompt": f"Seed task {i}",
            "answer": str(i),
            "difficulty": i % 3,
            "_dynstate_source": None,
        }
        for i in range(6)
    ]
    v = store.append(
        pa.Table.from_pylist(initial, SCHEMA), meta={"step": -1, "generator": "initial"}
    )
    run.rounds[v] = (-1, "initial", range(0, 6))
    for step in range(4):
        _round(store, run, step, "mutator" if step % 2 == 0 else "proposer")
    assert compact(store, target_bytes=2**20) == 6
    assert _round(store, run, 4, "mutator") == 7
    store.tag("ckpt", 7)
    v8 = _round(store, run, 5, "proposer")
    run.abandoned[v8] = run.rounds.pop(v8)
    for row in run.abandoned[v8][2]:
        run.sources.pop(row)
    store.append([], meta={"step": 6, "generator": "proposer"})  # v9, abandoned too
    assert store.reset(7, meta={"rollback_from": 9}) == 10
    store.append([], meta={"step": 5, "generator": "lost:proposer", "lost": True})
    assert _round(store, run, 6, "mutator") == 12
    store.append([], meta={"step": 7, "generator": "proposer"})
    assert _round(store, run, 8, "proposer") == 14
    collect_garbage(store, keep=13, grace_s=0, dry_run=False)
    run.store = Store.open(url, storage_options=options)
    return run


class Client:
    def __init__(self, base: str):
        self.base = base
        self.bodies: list[str] = []

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=60) as resp:
                status, body = resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            status, body = err.code, err.read().decode()
        self.bodies.append(body)
        return status, body

    def json(self, path: str, status: int = 200) -> Any:
        code, body = self.get(path)
        assert code == status, f"{path}: {code} {body[:500]}"
        return json.loads(body)


@pytest.fixture(scope="module", params=["local", "s3"])
def site(request, tmp_path_factory) -> Iterator[tuple[Run, Client]]:
    if request.param == "local":
        url, options = str(tmp_path_factory.mktemp("serve") / "store"), {}
    else:
        request.getfixturevalue("s3_endpoint")
        url = s3_url()
        options = {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": SECRET}
    run = build_run(url, options)
    view = StoreView(run.store, url=url, storage_options=options)
    with served(view) as base:
        client = Client(base)
        yield run, client
    # No credential in any response of the whole module.
    for body in client.bodies:
        assert SECRET not in body


def _cli_json(run: Run, command: str, *args: str) -> Any:
    """What `dynstate COMMAND URL ARGS --json` prints for the same store."""
    from dynstate.cli import cli

    argv = [command, run.url, *args, "--json"]
    for key, value in run.options.items():
        argv += ["--storage-option", f"{key}={value}"]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _head_rows(run: Run) -> list[int]:
    return [r for _, _, rows in sorted(run.rounds.values(), key=lambda r: r[2].start) for r in rows]


def test_store_summary_and_growth_marks(site):
    run, client = site
    info = client.json("/api/store")
    assert info["url"] == run.store.display_url and info["store_id"] == run.store.store_id
    assert (info["head"], info["oldest"], info["versions"]) == (14, 2, 13)
    assert info["rows"] == len(_head_rows(run)) == 27
    assert info["tags"] == {"ckpt": 7}
    for key, value in _cli_json(run, "info").items():
        assert info[key] == value, key
    growth = info["growth"]
    assert growth["axis"] == "step"
    assert [p["version"] for p in growth["points"]] == [2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14]
    marks = {(m["kind"], m["version"]) for m in growth["markers"]}
    assert {("compact", 6), ("reset", 10), ("lost", 11), ("empty", 13)} <= marks
    reset = next(m for m in growth["markers"] if m["kind"] == "reset")
    assert reset["target"] == 7 and reset["abandoned"] == [8, 9] and reset["rows_dropped"] == 3
    branch = [(p["version"], p["x"], p["rows_added"]) for p in reset["abandoned_points"]]
    assert branch == [(8, 5, 3), (9, 6, 0)]
    # Step 5's round was lost and step 7's empty: marked as such, not as missing steps.
    assert [m for m in growth["markers"] if m["kind"] == "missing"] == []


def test_growth_marks_steps_without_a_round():
    store = Store.open(f"memory://serve-tests/{uuid.uuid4().hex}", create=True)
    for step in (0, 1, 4):
        store.append([{"x": step}], meta={"step": step, "generator": "g"})
    growth = StoreView(store).growth()
    assert [m["steps"] for m in growth["markers"] if m["kind"] == "missing"] == [[2, 3]]
    assert [p["x"] for p in growth["points"]] == [0, 1, 4]


def test_versions_paged_newest_first_with_the_cli_keys(site):
    run, client = site
    first = client.json("/api/versions?limit=5")
    assert [v["version"] for v in first["versions"]] == [14, 13, 12, 11, 10]
    assert first["next_before"] == 10 and first["versions"][0]["status"] == "head"
    second = client.json(f"/api/versions?limit=5&before={first['next_before']}")
    assert [v["version"] for v in second["versions"]] == [9, 8, 7, 6, 5]
    status = {v["version"]: v["status"] for v in second["versions"]}
    assert status == {9: "abandoned", 8: "abandoned", 7: None, 6: None, 5: None}
    assert second["versions"][2]["tags"] == ["ckpt"]
    last = client.json("/api/versions?limit=5&before=5")
    assert [v["version"] for v in last["versions"]] == [4, 3, 2] and last["next_before"] is None

    by_version = {row["version"]: row for row in _cli_json(run, "ls", "--all")}
    for row in [*first["versions"], *second["versions"], *last["versions"]]:
        assert row == by_version[row["version"]]


def test_version_record_schema_shards_and_rounds(site):
    run, client = site
    info = client.json("/api/versions/ckpt")
    assert info["version"] == 7 and info["op"] == "append" and info["tags"] == ["ckpt"]
    assert info["rows"] == 21 and info["meta"] == {"step": 4, "generator": "mutator"}
    assert [f["name"] for f in info["schema"]] == SCHEMA.names
    assert sum(s["rows"] for s in info["shard_list"]) == 21
    # Rows 0-5 were written by version 1, whose record gc removed.
    assert info["rounds"][0] == {
        "version": None,
        "step": None,
        "generator": None,
        "created": None,
        "rows": [0, 6],
    }
    assert [r["version"] for r in info["rounds"][1:]] == [2, 3, 4, 5, 7]
    for key, value in _cli_json(run, "show", "ckpt").items():
        assert info[key] == value, key
    head = client.json("/api/versions/head")
    assert head["version"] == 14 and head["status"] == "head"


def test_rows_paging_filters_search_and_facets(site):
    run, client = site
    page = client.json("/api/versions/head/rows?limit=4&offset=4")
    assert [r["row"] for r in page["rows"]] == [4, 5, 6, 7]
    assert page["total"] == 27 and page["next_offset"] == 8
    assert page["rows"][2]["values"]["_dynstate_source"] == run.sources[6]
    assert (page["rows"][2]["round"], page["rows"][2]["step"]) == (2, 0)

    proposer = client.json("/api/versions/head/rows?generator=proposer&limit=100")
    expected = sorted(r for _, gen, rows in run.rounds.values() if gen == "proposer" for r in rows)
    assert [r["row"] for r in proposer["rows"]] == expected and proposer["total"] == len(expected)
    assert {r["generator"] for r in proposer["rows"]} == {"proposer"}
    # Facets count rows given the other filters: all generators, the proposer's steps.
    facet = {f["value"]: f["count"] for f in proposer["facets"]["generator"]["values"]}
    assert facet == {"mutator": 12, "proposer": 9, None: 6}
    steps = {f["value"]: f["count"] for f in proposer["facets"]["step"]["values"]}
    assert steps == {1: 3, 3: 3, 8: 3}

    step3 = client.json("/api/versions/head/rows?step=3")
    assert [r["row"] for r in step3["rows"]] == list(run.rounds[5][2])

    found = client.json("/api/versions/head/rows?q=STEP%203%20ROW")
    assert [r["row"] for r in found["rows"]] == list(run.rounds[5][2]) and found["total"] == 3
    assert found["facets"]["step"]["exact"] is True
    assert {f["value"] for f in found["facets"]["step"]["values"]} == {3}

    # A search within a round filter: the filtered field's facet cannot count the search.
    both = client.json("/api/versions/head/rows?q=row%201&step=3")
    assert [r["row"] for r in both["rows"]] == [run.rounds[5][2].start + 1]
    assert both["facets"]["step"]["exact"] is False
    assert both["facets"]["generator"] == {
        "exact": True,
        "values": [{"value": "proposer", "count": 1, "selected": False}],
        "more": 0,
    }

    hard = client.json("/api/versions/head/rows?difficulty=2&generator=mutator&limit=2")
    assert all(r["values"]["difficulty"] == 2 and r["generator"] == "mutator" for r in hard["rows"])
    assert len(hard["rows"]) == 2 and hard["next_offset"] == 2

    # An older version shows its own rows: the abandoned round is there in version 8.
    old = client.json("/api/versions/8/rows?step=5")
    assert [r["row"] for r in old["rows"]] == list(run.abandoned[8][2])
    assert client.json("/api/versions/head/rows?step=5")["rows"] == []


def test_row_lineage_both_ways(site):
    run, client = site
    row = run.rounds[3][2].start  # step 1, derived from row 6 (step 0), derived from row 0
    detail = client.json(f"/api/versions/head/rows/{row}")
    assert detail["values"]["prompt"].startswith("Task of step 1 row 0")
    assert detail["round"]["version"] == 3 and detail["round"]["step"] == 1
    assert detail["round"]["generator"] == "proposer"
    assert detail["sources"] == run.sources[row] == [6]
    ancestors = {(a["row"], a["depth"]) for a in detail["ancestors"]}
    assert ancestors == {(6, 1), (0, 2)}
    children = sorted(r for r, src in run.sources.items() if row in src)
    assert children == [12, 14]
    direct = sorted(d["row"] for d in detail["descendants"] if d["depth"] == 1)
    assert direct == children
    grand = {r for r, src in run.sources.items() if set(src) & set(children)}
    assert {d["row"] for d in detail["descendants"] if d["depth"] == 2} == grand
    assert [6, row] in detail["edges"] and [row, 12] in detail["edges"]
    # The rows of the abandoned round never show up as descendants in the head.
    assert not {d["row"] for d in detail["descendants"]} & set(run.abandoned[8][2]) - set(
        _head_rows(run)
    )
    # From the parent's side: row 6's descendants include this row.
    parent = client.json("/api/versions/head/rows/6")
    assert row in [d["row"] for d in parent["descendants"] if d["depth"] == 1]
    # A row of the newest round was derived from rows of step 6 (version 12).
    newest = client.json(f"/api/versions/14/rows/{run.rounds[14][2].start}")
    assert [a["row"] for a in newest["ancestors"] if a["depth"] == 1] == run.sources[24]


def test_diff_by_rows_and_rounds(site):
    run, client = site
    d = client.json("/api/diff/8/head")
    assert (d["from"], d["to"], d["rows"]) == (8, 14, [24, 27])
    assert d["common_version"] == 7 and d["shared_rows"] == 21
    assert (d["added_rows"], d["removed_rows"]) == (6, 3)
    assert (d["added_range"], d["removed_range"]) == ([21, 27], [21, 24])
    assert [r["version"] for r in d["added_rounds"]] == [12, 14]
    assert [r["version"] for r in d["removed_rounds"]] == [8]
    assert d["removed_rounds"][0]["rows"] == [21, 24] and d["removed_rounds"][0]["step"] == 5
    assert [r["row"] for r in d["added_preview"]] == list(range(21, 27))
    assert [r["round"] for r in d["removed_preview"]] == [8, 8, 8]
    assert d["removed_preview"][0]["values"]["prompt"].startswith("Task of step 5 row 0")
    for key, value in _cli_json(run, "diff", "8", "head").items():
        assert d[key] == value, key
    same = client.json("/api/diff/ckpt/7")
    assert same["added_rows"] == 0 and same["added_rounds"] == [] and same["removed_rounds"] == []


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/api/versions/99", "version 99 not found"),
        ("/api/versions/1", "removed by garbage collection"),
        ("/api/versions/nosuchtag", "no tag 'nosuchtag'"),
        ("/api/versions/99/rows", "version 99 not found"),
        ("/api/versions/head/rows/27", "row 27 not found in version 14"),
        ("/api/versions/head/rows/-1", "row -1 not found"),
        ("/api/versions/head/rows/x", "row x not found"),
        ("/api/versions/1/rows/0", "removed by garbage collection"),
        ("/api/diff/1/head", "removed by garbage collection"),
        ("/api/checkpoints/0", "no checkpoint 0"),
        ("/api/nothing", "no page at /api/nothing"),
    ],
)
def test_unknown_versions_and_rows_are_404_with_a_message(site, path, message):
    _run, client = site
    body = client.json(path, status=404)
    assert message in body["error"] and body["status"] == 404


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/api/versions/head/rows?nosuch=1", "unknown column 'nosuch'"),
        ("/api/versions/head/rows?limit=0", "limit must be between 1 and 500"),
        ("/api/versions/head/rows?offset=abc", "offset must be an integer"),
        ("/api/versions/head/rows?difficulty=hard", "cannot compare column 'difficulty'"),
        ("/api/versions/head/rows?_dynstate_source=1", "only plain values"),
        ("/api/versions?limit=-3", "limit must be between"),
    ],
)
def test_bad_parameters_are_400_with_a_message(site, path, message):
    _, client = site
    body = client.json(path, status=400)
    assert message in body["error"]


def test_pages_render_and_link_their_json_twins(site):
    run, client = site
    pages = {
        "/": ['class="growth"', "Latest versions", "ckpt", "/api/store"],
        "/versions?limit=5&before=10": ["abandoned", "older →", "← newer"],
        "/versions/head?generator=proposer": ["generator = proposer", "/api/versions/14/rows"],
        f"/versions/head/rows/{run.rounds[3][2].start}": [
            'class="lineage"',
            "Descendants (",
            "row 6",
        ],
        "/diff/8/14": ["Rounds added (2)", "Rounds removed (1)"],
        "/diff?a=8&b=head": ["Rounds added (2)"],
        "/diff": ["Compare two versions"],
    }
    for path, needles in pages.items():
        status, body = client.get(path)
        assert status == 200, (path, body[:300])
        for needle in needles:
            assert needle in body, (path, needle)
        # Nothing is loaded from elsewhere: no CDN, no network.
        assert 'src="http' not in body and 'href="http' not in body
    status, body = client.get("/versions/99")
    assert status == 404 and "version 99 not found" in body and "<html" in body
    status, _ = client.get("/static/style.css")
    assert status == 200
    req = urllib.request.Request(client.base + "/api/store", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 405  # read-only


def test_checkpoint_page_shows_the_pinned_version_and_next_batches(tmp_path):
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from dynstate import VersionedDataset, VersionedSampler

    run = build_run(str(tmp_path / "store"), {})
    dataset = VersionedDataset(run.url)
    sampler = VersionedSampler(dataset, seed=3, batch_size=4)
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=list)
    batches = iter(loader)
    next(batches), next(batches)
    folder = tmp_path / "ckpt" / "global_step_2"
    folder.mkdir(parents=True)
    torch.save(loader.state_dict(), folder / "data.pt")
    upcoming = [next(batches), next(batches)]

    view = StoreView(run.store, checkpoints=[str(folder)], url=run.url)
    with served(view) as base:
        client = Client(base)
        info = client.json("/api/checkpoints/0")
        assert info["store_id"] == run.store.store_id and info["version"] == 14
        assert info["position"] == 8 and info["batch_size"] == 4
        got = [[row["prompt"] for row in b["values"]] for b in info["next_batches"]]
        assert got == [[row["prompt"] for row in batch] for batch in upcoming]
        assert client.json("/api/store")["checkpoints"] == [{"id": 0, "path": str(folder)}]
        status, body = client.get("/checkpoints/0")
        assert status == 200 and "Next batches" in body and "version 14" in body
        # The trainer's step is the folder's (as `dynstate inspect` says), not the sampler's
        # count of batches handed out.
        assert info["training_step"] == 2
        assert "<dt>training step</dt><dd>2</dd>" in body
        assert f"batches handed out {info['step']}" in body

    other = build_run(str(tmp_path / "other"), {})
    view = StoreView(other.store, checkpoints=[str(folder)], url=other.url)
    with served(view) as base:
        body = Client(base).json("/api/checkpoints/0", status=409)
        assert "store" in body["error"]


def test_descendant_index_extends_an_older_versions_index(tmp_path):
    run = build_run(str(tmp_path / "store"), {})
    view = StoreView(run.store)
    older = view.lineage.index(12)
    newer = view.lineage.index(14)
    assert newer.num_rows == 27 and older.num_rows == 24
    for row in range(27):
        expected = sorted(r for r, src in run.sources.items() if row in src)
        assert newer.children_of(row) == expected
    fresh = StoreView(Store.open(run.url)).lineage.index(14)
    assert (fresh.sources.tolist(), fresh.children.tolist()) == (
        newer.sources.tolist(),
        newer.children.tolist(),
    )


def test_serve_without_the_extra_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    result = CliRunner().invoke(serve_command, ["memory://nothing"])
    assert isinstance(result.exception, MissingDependencyError)
    assert "pip install 'dynstate[serve]'" in str(result.exception)


def test_serve_parses_storage_options_as_every_other_command():
    """serve takes --storage-option through the CLI's one parser: a malformed structured option
    is the same usage error (exit 2) as for ls, before any store or web server is touched."""
    from dynstate.cli import cli

    args = ["memory://nothing", "--storage-option", "client_kwargs=5"]
    served = CliRunner().invoke(serve_command, args)
    listed = CliRunner().invoke(cli, ["ls", *args])
    assert served.exit_code == listed.exit_code == 2
    assert "client_kwargs must be a JSON object" in served.output
    assert served.output.splitlines()[-1] == listed.output.splitlines()[-1]


def test_serve_through_the_cli_says_how_to_install_the_extra(monkeypatch):
    from dynstate.cli import cli

    monkeypatch.setitem(sys.modules, "jinja2", None)
    result = CliRunner().invoke(cli, ["serve", "memory://nothing"])
    assert result.exit_code == 1
    assert "dynstate serve needs jinja2" in result.output
    assert "pip install 'dynstate[serve]'" in result.output


def test_installed_dynstate_serve_binds_loopback_and_answers(tmp_path):
    run = build_run(str(tmp_path / "store"), {})
    dynstate = os.path.join(os.path.dirname(sys.executable), "dynstate")
    proc = subprocess.Popen(
        [dynstate, "serve", run.url, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "serving" in line and "http://127.0.0.1:" in line, (line, proc.stderr.read())
        base = line.split(" at ")[1].split()[0].rstrip("/")
        info = Client(base).json("/api/store")
        assert info["head"] == 14
        # A page elsewhere whose name resolves to 127.0.0.1 (DNS rebinding) gets nothing.
        req = urllib.request.Request(base + "/api/store", headers={"Host": "evil.example"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 400 and b"store_id" not in err.value.read()
    finally:
        proc.terminate()
        proc.wait(30)


def test_rows_of_every_arrow_type_render_as_json_and_html(tmp_path):
    import datetime as dt

    table = pa.table(
        {
            "text": ["a", None, "ünïcode </td><script>"],
            "blob": [b"\x00\x01", b"", None],
            "when": pa.array([dt.datetime(2026, 1, 1, 12), None, dt.datetime(2026, 1, 2)]),
            "score": [0.5, float("nan"), None],
            "ok": [True, False, None],
            "nested": [{"k": [1, 2]}, None, {"k": []}],
        }
    )
    store = Store.open(str(tmp_path / "store"), create=True)
    store.append(table, meta={"step": 0, "generator": "g"})
    view = StoreView(store)
    page = view.rows_page(None)
    values = [r["values"] for r in page["rows"]]
    assert values[0]["blob"] == "base64:AAE=" and values[0]["when"] == "2026-01-01T12:00:00"
    assert values[1]["score"] is None and values[0]["nested"] == {"k": [1, 2]}
    assert [r["row"] for r in view.rows_page(None, filters={"ok": ["true"]})["rows"]] == [0]
    assert [r["row"] for r in view.rows_page(None, q="ÜNÏ")["rows"]] == [2]
    with served(view) as base:
        status, body = Client(base).get("/versions/head")
        assert status == 200 and "&lt;script&gt;" in body and "<script>" not in body
        assert json.loads(Client(base).get("/api/versions/head/rows/2")[1])["values"]["ok"] is None


def test_an_empty_store_renders_every_page(tmp_path):
    store = Store.open(str(tmp_path / "store"), create=True)
    with served(StoreView(store)) as base:
        client = Client(base)
        info = client.json("/api/store")
        assert (info["head"], info["rows"], info["growth"]["points"]) == (0, 0, [])
        assert client.json("/api/versions/head/rows")["rows"] == []
        assert client.json("/api/versions/0/rows/0", status=404)["error"].endswith(
            "it has no rows)"
        )
        for path in ("/", "/versions", "/versions/head", "/diff/0/0", "/diff"):
            status, body = client.get(path)
            assert status == 200, (path, body[:300])
        assert "No rounds yet" in client.get("/")[1]


def test_rounds_committed_while_serving_appear_on_reload(tmp_path):
    run = build_run(str(tmp_path / "store"), {})
    with served(StoreView(run.store, url=run.url)) as base:
        client = Client(base)
        assert client.json("/api/store")["head"] == 14
        before = client.json("/api/versions/head/rows/24")["descendants"]
        assert before == []
        writer = Store.open(run.url)  # another writer, as the training run is
        writer.append(
            pa.Table.from_pylist(
                [{"prompt": "late", "answer": "x", "difficulty": 0, "_dynstate_source": [24]}],
                SCHEMA,
            ),
            meta={"step": 9, "generator": "proposer"},
        )
        info = client.json("/api/store")
        assert info["head"] == 15 and info["growth"]["points"][-1]["version"] == 15
        assert client.json("/api/versions?limit=1")["versions"][0]["status"] == "head"
        after = client.json("/api/versions/head/rows/24")
        assert after["version"] == 15 and [d["row"] for d in after["descendants"]] == [27]


# -- binding, hostile records, secrets ---------------------------------------------------------


def _bindable(host: str) -> bool:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except OSError:
        return False
    return True


def test_every_loopback_address_and_name_is_loopback():
    from dynstate.serve.net import allowed_hosts, is_loopback

    for host in ("127.0.0.1", "127.0.0.2", "127.255.0.9", "localhost", "LOCALHOST.", "::1",
                 "[::1]", "::ffff:127.0.0.1", "app.localhost"):  # fmt: skip
        assert is_loopback(host), host
        allowed = allowed_hosts(host)
        assert allowed is not None and {"127.0.0.1", "localhost", "[::1]"} <= set(allowed)
    assert "127.0.0.2" in allowed_hosts("127.0.0.2") and "[::1]" in allowed_hosts("::1")
    for host in ("0.0.0.0", "::", "[::]", "192.168.1.5", "10.0.0.1", "example.com", "fe80::1"):
        assert not is_loopback(host) and allowed_hosts(host) is None, host


def _serve_process(url: str, host: str) -> tuple[subprocess.Popen, str]:
    dynstate = os.path.join(os.path.dirname(sys.executable), "dynstate")
    proc = subprocess.Popen(
        [dynstate, "serve", url, "--host", host, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert "serving" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line.split(" at ")[1].split()[0].rstrip("/")


def _status_with_host(base: str, host_header: str) -> int:
    req = urllib.request.Request(base + "/api/store", headers={"Host": host_header})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.parametrize("host", ["::1", "[::1]", "127.0.0.2", "localhost"])
def test_installed_serve_checks_the_host_header_on_every_loopback_bind(tmp_path, host):
    """DNS rebinding: a page elsewhere whose name resolves to the loopback address must get
    nothing, whichever loopback address or name the server was bound to."""
    bare = host.strip("[]")
    if not _bindable("127.0.0.1" if bare == "localhost" else bare):
        pytest.skip(f"cannot bind {host} here")
    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"x": 1}], meta={"step": 0})
    proc, base = _serve_process(store.url, host)
    try:
        port = base.rsplit(":", 1)[1]
        own = base.split("//", 1)[1]
        assert _status_with_host(base, own) == 200
        assert _status_with_host(base, f"localhost:{port}") == 200
        for evil in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
            assert _status_with_host(base, evil) == 400, evil
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "note:" not in err  # loopback: nothing to warn about


def test_installed_serve_on_a_non_loopback_bind_prints_the_note(tmp_path):
    store = Store.open(str(tmp_path / "store"), create=True)
    proc, base = _serve_process(store.url, "0.0.0.0")
    try:
        port = base.rsplit(":", 1)[1]
        assert _status_with_host(f"http://127.0.0.1:{port}", "any.name.example") == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert err.startswith(
        "note: listening on 0.0.0.0: anyone who can reach it can read the store, and any Host "
        "name is answered; the default --host 127.0.0.1 serves this machine only"
    )


def test_serve_dash_h_prints_help():
    from dynstate.cli import cli

    for args in (["serve", "-h"], ["serve", "--help"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        assert result.output.startswith("Usage: ") and "--checkpoint" in result.output
        assert "-h, --help" in result.output


def test_steps_past_2_63_and_odd_meta_never_break_a_page(tmp_path):
    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"x": 1}], meta={"step": 1, "generator": "g"})
    store.append([{"x": 2}], meta={"step": 2**64, "generator": "g"})
    store.append([{"x": 3}], meta={"step": 2**70, "generator": "g"})
    store.append([], meta={"step": 2**70 + 1, "error": "boom"})
    store.append([{"x": 4}], meta={"step": -(2**80), "generator": 2**65})
    big = str(2**64)
    with served(StoreView(store)) as base:
        client = Client(base)
        paths = ["/", "/versions", "/versions/2", "/versions/2/rows/0", "/diff/1/5",
                 f"/versions/head?step={big}", "/api/store", "/api/versions", "/api/versions/2",
                 "/api/versions/head/rows", f"/api/versions/head/rows?step={big}",
                 f"/api/versions/head/rows?round={big}", "/api/versions/2/rows/0",
                 "/api/diff/1/5", f"/api/versions?before={big}"]  # fmt: skip
        for path in paths:
            status, body = client.get(path)
            assert status == 200, (path, body[:300])
            assert "Traceback" not in body
        info = client.json("/api/store")
        assert info["head"] == 5 and "growth" in info
        if info["growth"].get("error"):  # the chart may refuse such steps; the page says why
            assert info["growth"]["error"].startswith("the growth chart cannot be drawn")
            assert info["growth"]["error"] in client.get("/")[1]
        for path in (f"/api/versions/{big}", f"/api/versions/2/rows/{big}", f"/versions/{big}"):
            status, body = client.get(path)
            assert status == 404 and "Traceback" not in body, (path, body[:300])


def test_an_unexpected_error_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"x": 1}], meta={"step": 0})
    view = StoreView(store)

    def broken(*args, **kwargs):
        raise OverflowError("Python int too large to convert to C ssize_t")

    monkeypatch.setattr(view, "version_info", broken)
    with served(view) as base:
        client = Client(base)
        body = client.json("/api/versions/1", status=500)
        assert body["error"] == (
            "this page could not be built (OverflowError: Python int too large to convert to C "
            "ssize_t); other pages may still work"
        )
        status, html = client.get("/versions/1")
        assert status == 500 and "Traceback" not in html and "other pages may still work" in html
        assert client.json("/api/store")["head"] == 1


SLASH_SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY/SERVEKEY"


def test_no_secret_with_a_slash_on_any_page_json_or_error(tmp_path, monkeypatch):
    """The one scrubber on every response: a secret holding "/" (AWS secret keys do), whether
    in the environment, in a storage option or inside a URL's userinfo, appears nowhere."""
    from urllib.parse import quote

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SLASH_SECRET)
    option_secret = "Opt/Secret+Value/1234"
    store = Store.open(str(tmp_path / "store"), create=True)
    leak = f"http://AKID:{SLASH_SECRET}@host/x s3://u:{option_secret}@b/p pw=Sh/rt"
    store.append(
        [{"prompt": f"rows may quote it: {SLASH_SECRET}", "url": f"https://u:pa/ss@h/{1}"}],
        meta={"step": 0, "generator": "g", "note": leak, "opt": option_secret},
    )
    view = StoreView(store, url=store.url, storage_options={"secret": option_secret})
    with served(view) as base:
        client = Client(base)
        for path in ("/", "/versions", "/versions/1", "/versions/1/rows/0", "/diff/0/1",
                     "/api/store", "/api/versions", "/api/versions/1", "/api/versions/1/rows",
                     "/api/versions/1/rows/0", "/api/diff/0/1",
                     f"/api/versions/{quote(SLASH_SECRET, safe='')}",
                     f"/versions/{quote(option_secret, safe='')}",
                     f"/nothing/{SLASH_SECRET}"):  # fmt: skip
            client.get(path)
        joined = "\n".join(client.bodies)
        assert "***" in joined
        for part in (SLASH_SECRET, quote(SLASH_SECRET, safe=""), "K7MDENG", option_secret,
                     quote(option_secret, safe=""), "Opt/Secret", "pa/ss"):  # fmt: skip
            assert part not in joined, part


def test_pages_say_compaction_rollback_step_failed_round_and_give_no_python_advice(tmp_path):
    from dynstate import rollback

    store = Store.open(str(tmp_path / "store"), create=True)
    for step in range(3):
        store.append([{"x": step}], meta={"step": step, "generator": "g"})
    assert compact(store, target_bytes=2**20) == 4
    store.append([], meta={"step": 3, "generator": "g", "error": "generator crashed: OOM"})
    assert rollback(store, step=1) == 6  # back to version 2, the round of step 1
    with served(StoreView(store)) as base:
        client = Client(base)
        _, compacted = client.get("/versions/4")
        assert "compacts version" in compacted and "reset to" not in compacted
        _, reset = client.get("/versions/6")
        assert "reset to" in reset and "(rolled back to step 1)" in reset
        _, failed = client.get("/versions/5")
        assert "(none added: the round failed)" in failed and "generator crashed: OOM" in failed
        assert "(+0)" not in failed
        _, listing = client.get("/versions")
        assert 'title="generator crashed: OOM">failed</span>' in listing
        assert '<span class="muted">(step 1)</span>' in listing
        row = {v["version"]: v for v in client.json("/api/versions")["versions"]}
        assert (row[6]["rollback_step"], row[5]["error"]) == (1, "generator crashed: OOM")
        for path in ("/api/versions/99", "/versions/99", "/versions/nosuchtag"):
            status, body = client.get(path)
            assert status == 404 and "version=None" not in body and "dynstate ls" not in body
            assert "/versions" in body
        assert client.json("/api/versions/99", status=404)["error"] == (
            f"version 99 not found in {store.display_url} (latest is 6); the versions page "
            "(/versions) lists them"
        )


def test_serve_opens_its_store_as_every_other_command():
    """The CLI's preflight: an S3 endpoint that does not answer is one line within seconds,
    the same as `dynstate ls` says, before any web server starts."""
    from dynstate.cli import cli

    args = ["s3://no-bucket/run", "--storage-option", "endpoint_url=http://127.0.0.1:1"]
    started = time.monotonic()
    served = CliRunner().invoke(cli, ["serve", *args])
    listed = CliRunner().invoke(cli, ["ls", *args])
    assert time.monotonic() - started < 20
    assert served.exit_code == listed.exit_code == 1
    assert served.output == listed.output
    assert served.output.startswith("error: cannot reach the S3 endpoint http://127.0.0.1:1")


def test_chat_prompts_are_shown_by_their_content(tmp_path):
    store = Store.open(str(tmp_path / "store"), create=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    store.append([{"prompt": chat, "answer": "4"}], meta={"step": 0})
    with served(StoreView(store)) as base:
        client = Client(base)
        _, page = client.get("/versions/head")
        assert "system: Be brief. | user: 2+2?" in page and "&#34;role&#34;" not in page
        assert client.json("/api/versions/head/rows")["rows"][0]["values"]["prompt"] == chat


# -- outcomes (issue 21.5) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> Iterator[tuple[Store, Client]]:
    """tests/test_stats_cli.py's store: rows 0-2 always fail, 3 passes every other step, 4
    always passes, 5-9 never trained; four steps, versions 2-5."""
    from test_stats_cli import build as build_scored

    store = build_scored(str(tmp_path_factory.mktemp("scored") / "store"))
    with served(StoreView(store)) as base:
        yield store, Client(base)


def test_outcomes_page_bands_per_step_and_hardest_rows(scored):
    from dynstate.records.aggregate import summarize

    store, client = scored
    data = client.json("/api/outcomes?bins=4")
    assert (data["version"], data["recorded"], data["message"]) == (5, True, None)
    assert data["summary"] == summarize(store.outcome_stats(), bins=4, top=10)
    bands = data["bands"]
    assert (bands["steps"], bands["steps_recorded"], bands["rows"]) == ([0, 1, 2, 3], 4, 10)
    # step 0: row 3 failed (band 0); then 1/2, 1/3, 2/4
    assert bands["counts"] == [[4, 0, 0, 1], [3, 0, 1, 1], [3, 1, 0, 1], [3, 0, 1, 1]]
    assert bands["trained"] == [5, 5, 5, 5]
    assert bands["counts"][-1] == [b["rows"] for b in data["summary"]["histogram"]]
    assert client.json("/api/outcomes?bins=4&points=2")["bands"]["steps"] == [0, 3]
    # an older version: its lineage only
    older = client.json("/api/outcomes?version=3&bins=4")["bands"]
    assert (older["steps"], older["counts"]) == ([0, 1], [[4, 0, 0, 1], [3, 0, 1, 1]])
    status, page = client.get("/outcomes?bins=4")
    assert status == 200
    # the first chart: rows by band after each step; the second: the rows each round drew
    trained, drawn = page.split('<section class="drawn-bands">')
    assert drawn.count('<g class="step" data-step=') == data["drawn_bands"]["rounds_recorded"]
    assert trained.count('<g class="step" data-step=') == 4
    assert trained.count('class="band band-0"') == 4
    assert trained.count('class="band band-2"') == 2
    assert "<title>step 2: 1 row with pass rate [25%, 50%)</title>" in page
    assert 'href="/versions/5?min_pass_rate=0.75&amp;max_pass_rate=1.0&amp;sort=pass_rate"' in page
    assert '<a class="row-link" href="/versions/5/rows/0">0</a>' in page
    assert 'href="/api/outcomes?bins=4">JSON</a>' in page
    _, store_page = client.get("/")
    assert 'href="/outcomes">20 outcome records in the head\'s lineage' in store_page
    assert client.json("/api/store")["outcome_records"] == 20


def test_row_page_shows_its_outcome_history(scored):
    _store, client = scored
    detail = client.json("/api/versions/5/rows/3")["outcomes"]
    assert detail == {
        "success_above": 0.5,
        "row": 3,
        "attempts": 4,
        "successes": 2,
        "mean_score": 0.5,
        "ewma_score": pytest.approx(0.5173217448321853),
        "first_step": 0,
        "last_step": 3,
        "pass_rate": 0.5,
        "steps": [
            {"step": 0, "scores": [0.0], "attempts": 1, "successes": 0, "pass_rate": 0.0,
             "mean_score": 0.0},
            {"step": 1, "scores": [1.0], "attempts": 1, "successes": 1, "pass_rate": 0.5,
             "mean_score": 0.5},
            {"step": 2, "scores": [0.0], "attempts": 1, "successes": 0,
             "pass_rate": pytest.approx(1 / 3), "mean_score": pytest.approx(1 / 3)},
            {"step": 3, "scores": [1.0], "attempts": 1, "successes": 1, "pass_rate": 0.5,
             "mean_score": 0.5},
        ],
    }  # fmt: skip
    # at version 3 only steps 0 and 1 were recorded
    assert [p["step"] for p in client.json("/api/versions/3/rows/3")["outcomes"]["steps"]] == [0, 1]
    _, page = client.get("/versions/5/rows/3")
    assert (
        "Trained 4 times at 4 steps (0\u20133): 2 passed (a score above 0.5), pass rate "
        "<strong>50%</strong>, mean score 0.5, EWMA score 0.517." in page
    )
    assert page.count('<circle class="step-rate"') == 4 and '<svg class="pass-rate"' in page
    history = page.split('<table class="outcome-history">')[1].split("</table>")[0]
    assert history.count("<tr>") == 5  # header and four steps, newest first
    assert history.index('<td class="num">3</td>') < history.index('<td class="num">0</td>')
    _, never = client.get("/versions/5/rows/5")
    assert "Never trained in the lineage of version 5." in never
    assert client.json("/api/versions/5/rows/5")["outcomes"]["steps"] == []


def test_rows_sorted_and_filtered_by_pass_rate_and_attempts(scored):
    _store, client = scored

    def rows(query: str) -> tuple[list[int], Any]:
        data = client.json(f"/api/versions/5/rows?{query}")
        return [r["row"] for r in data["rows"]], data

    got, data = rows("sort=-pass_rate&limit=3")
    assert got == [4, 3, 0] and data["total"] == 10 and data["next_offset"] == 3
    assert data["rows"][1]["outcomes"] == {
        "attempts": 4, "successes": 2, "pass_rate": 0.5, "mean_score": 0.5, "last_step": 3
    }  # fmt: skip
    assert data["outcomes"]["sort"] == "-pass_rate" and data["outcomes"]["recorded"]
    assert rows("sort=-pass_rate&offset=3&limit=3")[0] == [1, 2, 5]
    assert rows("sort=attempts")[0] == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    assert rows("min_pass_rate=0.25&max_pass_rate=0.75")[0] == [3]
    assert rows("max_attempts=0")[0] == [5, 6, 7, 8, 9]
    got, data = rows("min_attempts=1&q=what+is+3")  # with a text search: the total is exact
    assert (got, data["total"]) == ([3], 1)
    got, data = rows("round=2&sort=pass_rate")  # round 2 wrote row 6
    assert (got, data["total"]) == ([6], 1)
    assert rows("answer=%3F&min_attempts=1")[0] == []
    # the facets count the selected rows
    facet = rows("min_attempts=1")[1]["facets"]["step"]
    assert facet["exact"] and facet["values"] == [{"value": 0, "count": 5, "selected": False}]
    _, page = client.get("/versions/5?sort=pass_rate&min_attempts=1")
    assert '<a class="sort-pass_rate" href="?min_attempts=1&amp;sort=-pass_rate"' in page
    assert "pass rate ▲" in page
    assert page.count('<td class="num pass-rate">0%</td>') == 3
    assert '<td class="num pass-rate">100%</td>' in page
    assert 'name="min_attempts" min="0" step="1" value="1"' in page
    assert '<input type="hidden" name="sort" value="pass_rate">' in page
    for bad, message in (
        ("sort=score", "cannot sort the rows of version 5"),
        ("sort=--pass_rate", "cannot sort the rows of version 5"),  # one '-' at most
        ("min_pass_rate=2", "min_pass_rate for the rows of version 5"),
        ("max_attempts=-1", "max_attempts for the rows of version 5"),
    ):
        assert message in client.json(f"/api/versions/5/rows?{bad}", status=400)["error"]


def test_a_store_without_outcomes_says_so_on_every_page(tmp_path):
    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"prompt": "a"}, {"prompt": "b"}], meta={"step": 0})
    with served(StoreView(store)) as base:
        client = Client(base)
        assert client.json("/api/outcomes") == {
            "url": store.display_url,
            "version": 1,
            "recorded": False,
            "message": "no outcomes recorded",
            "summary": None,
            "bands": None,
            "drawn_bands": None,
            "filtering": None,
        }
        _, page = client.get("/outcomes")
        assert "no outcomes recorded in the lineage of version 1." in page
        _, page = client.get("/")
        assert "no outcomes recorded in the head's lineage." in page
        assert client.json("/api/versions/1/rows/0")["outcomes"] is None
        _, page = client.get("/versions/1/rows/0")
        assert "no outcomes recorded in the lineage of version 1." in page
        data = client.json("/api/versions/1/rows?sort=pass_rate")  # nothing to sort by
        assert [r["row"] for r in data["rows"]] == [0, 1] and "outcomes" not in data["rows"][0]
        assert data["outcomes"]["message"] == "no outcomes recorded"
        _, page = client.get("/versions/1?sort=pass_rate")
        assert "no outcomes recorded in the lineage of version 1: no pass rates" in page
        assert "sort-pass_rate" not in page


def _counting_reads(store: Store) -> list[str]:
    """Every path ``store``'s storage reads from now on (instrumenting the real backend)."""
    paths: list[str] = []
    read = store.storage.read

    def counted(path: str, *args: Any, **kwargs: Any) -> Any:
        paths.append(path)
        return read(path, *args, **kwargs)

    store.storage.read = counted  # type: ignore[method-assign]
    return paths


def test_the_first_band_chart_reads_aggregates_not_every_outcome_file(tmp_path):
    """Issue 21: the first /outcomes of a long run costs, per point drawn, one stored
    aggregate and the outcome files committed since it (fewer than CHECKPOINT_INTERVAL),
    not every outcome file of the lineage — and draws the counts the full fold draws."""
    from dynstate.history.outcomes import band_of
    from dynstate.records.manifest import CHECKPOINT_INTERVAL

    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"prompt": f"p{i}"} for i in range(8)])
    steps = 2 * CHECKPOINT_INTERVAL + 30
    records: list[tuple[int, int, float]] = []
    for step in range(steps):
        mine = [(step % 8, step, float(step % 3 == 0)), ((5 * step + 3) % 8, step, 1.0)]
        scored = [{"row": r, "step": s, "score": x} for r, s, x in mine]
        store.append([], meta={"step": step}, outcomes=scored)
        records += mine

    def reference(step: int) -> list[int]:
        attempts, wins = np.zeros(8, np.int64), np.zeros(8, np.int64)
        for r, s, x in records:
            if s <= step:
                attempts[r] += 1
                wins[r] += x > 0.5
        trained = attempts > 0
        return np.bincount(band_of(wins[trained], attempts[trained], 4), minlength=4).tolist()

    fresh = Store.open(url)
    reads = _counting_reads(fresh)
    bands = StoreView(fresh).outcomes_info(None, bins="4", points="3")["bands"]
    assert (bands["steps_recorded"], bands["steps"]) == (steps, [0, 114, 229])
    assert bands["counts"] == [reference(s) for s in bands["steps"]]
    outcome_files = [p for p in reads if p.startswith("data/")]
    # versions 2, 116 and 231 hold steps 0, 114 and 229: 1 file, then the aggregate of
    # version 100 and 16 files, then that of version 200 and 31 files
    assert len(outcome_files) <= 1 + 16 + 31 < steps
    assert sum("/aggregates/" in p for p in reads) <= 3
    # what the fold of every record (the path for lineages it cannot serve) would read
    folded = Store.open(url)
    all_reads = _counting_reads(folded)
    folded.outcome_records()
    assert sum(p.startswith("data/") for p in all_reads) == steps
    # a rollback to step 200 (version 202), rounds again from step 201, a compaction: the
    # counts are those of the kept lineage's records
    store.reset(202)
    records = [r for r in records if r[1] <= 200]
    for step in range(201, 216):
        mine = [(step % 8, step, 0.0)]
        store.append(
            [], meta={"step": step}, outcomes=[{"row": step % 8, "step": step, "score": 0.0}]
        )
        records += mine
    compact(store)
    after = Store.open(url)
    later_reads = _counting_reads(after)
    again = StoreView(after).outcomes_info(None, bins="4", points="3")["bands"]
    assert again["steps_recorded"] == 216 and again["steps"][-1] == 215
    assert sum(p.startswith("data/") for p in later_reads) < 100  # statistics, not the fold
    assert again["counts"] == [reference(s) for s in again["steps"]]


def test_band_chart_of_steps_the_aggregates_cannot_split_folds_the_records(tmp_path):
    """Two steps in one commit: no version holds the statistics after the first of them, so
    the series folds the records (and still counts exactly)."""
    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"prompt": f"p{i}"} for i in range(4)])
    both = [{"row": 0, "step": 0, "score": 1.0}, {"row": 0, "step": 1, "score": 0.0}]
    store.append([], outcomes=both)
    store.append([], outcomes=[{"row": 1, "step": 2, "score": 1.0}])
    bands = StoreView(store).outcomes_info(None, bins="4")["bands"]
    # after step 0 row 0 has passed 1 of 1 (the statistics of its version say 1 of 2)
    want = [[0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert (bands["steps"], bands["counts"]) == ([0, 1, 2], want)


def test_a_diff_of_neighbours_reads_records_back_to_where_they_meet_only(tmp_path):
    """Issue 20.7: the diff page is history.diff plus the rounds of the versions it found,
    not a walk of both whole lineages."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(150):
        store.append([{"prompt": f"p{step}"}], meta={"step": step})
    fresh = Store.open(url)
    _ = fresh.snapshot(fresh.head - 1).shards  # what reading the two versions reads first
    reads = _counting_reads(fresh)
    data = StoreView(fresh).diff(str(fresh.head - 1), "head")
    assert (data["added_versions"], data["added_range"]) == ([150], [149, 150])
    assert [r["version"] for r in data["added_rounds"]] == [150]
    assert data["added_preview"][0]["values"]["prompt"] == "p149"
    # the floor, the head hint, the head's record, the shard of the preview row; the
    # lineages hold 150 versions each
    assert len(reads) <= 6, reads
