"""Small things found trying dynstate as a verl user (issue 44.8), each checked through the
surface the user saw: the `dynstate` CLI (click's CliRunner or the installed script) and
`dynstate serve` on a real loopback server."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator

import pyarrow as pa
import pytest
from click.testing import CliRunner
from test_serve import Client, served

from dynstate import Store
from dynstate.cli import cli
from dynstate.serve.api import StoreView

ROWS = 120


def _verl_row(i: int, source: list[int] | None = None) -> dict:
    """A row as dynstate's verl import writes it: ``data_source`` first, the same on every
    row, then the prompt as chat messages."""
    return {
        "data_source": "arith",
        "prompt": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": f"What is {i} + {i}?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "_dynstate_source": source,
    }


@pytest.fixture(scope="module")
def verl_store(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("verl") / "store")
    store = Store.open(url, create=True)
    store.append([_verl_row(i) for i in range(ROWS - 1)])
    outcomes = [{"row": r, "step": 0, "score": float(r % 2)} for r in range(8)]
    store.append([_verl_row(ROWS - 1, [3])], meta={"step": 1}, outcomes=outcomes)
    return url


@pytest.fixture(scope="module")
def verl_site(verl_store) -> Iterator[Client]:
    with served(StoreView(Store.open(verl_store))) as base:
        yield Client(base)


def test_stats_previews_a_verl_row_by_its_prompt(verl_store):
    result = CliRunner().invoke(cli, ["stats", verl_store, "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["preview_column"] == "prompt"  # was "data_source": "arith" on every row
    # The table is as wide as the terminal says (CI has none: 80 columns).
    result = CliRunner().invoke(cli, ["stats", verl_store], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "user: What is 0 + 0?" in result.output
    # A narrow cell leads with the task, not the system prompt every row shares.
    narrow = CliRunner().invoke(cli, ["stats", verl_store], env={"COLUMNS": "80"})
    assert narrow.exit_code == 0, narrow.output
    assert "user: Wh" in narrow.output and "system:" not in narrow.output


def test_serve_shows_a_chat_prompt_as_messages_not_json(verl_site):
    status, body = verl_site.get("/versions/head/rows/3")
    assert status == 200
    assert '<span class="role">user</span><pre>What is 3 + 3?</pre>' in body
    assert "&#34;role&#34;" not in body and '"role":' not in body
    # The lineage preview of the child (row 119, derived from row 3) is its prompt too.
    assert "arith</li>" not in body and "What is 119 + 119?" in body


def test_serve_pager_counts_rows_as_the_row_column_does(verl_site):
    status, body = verl_site.get("/versions/head?offset=50&limit=50")
    assert status == 200
    span = re.search(r'class="muted page-span">([^<]*)<', body).group(1)
    assert span == "rows 50\u201399 of 120"  # was "rows 51-100", against row numbers 50-99
    # Rows sorted by pass rate are no range of rows: the pager counts the matches from 1.
    status, body = verl_site.get("/versions/head?sort=pass_rate&min_attempts=1")
    span = re.search(r'class="muted page-span">([^<]*)<', body).group(1)
    assert span == "matches 1\u20138 of 8"


def test_serve_row_numbers_do_not_wrap(verl_site):
    status, css = verl_site.get("/static/style.css")
    assert status == 200
    rule = re.search(r"td\.num, th\.num \{([^}]*)\}", css).group(1)
    assert "white-space: nowrap" in rule  # "2010" showed as "201 / 0" beside a wide prompt


def _two_rollbacks(url: str) -> Store:
    """An import, then a run that crashed and resumed twice (rollbacks at steps 3 and 6)."""
    from dynstate import rollback

    store = Store.open(url, create=True)
    store.append(pa.table({"x": list(range(20))}))
    for first, last, back_to in ((0, 5, 3), (4, 8, 6), (7, 11, None)):
        for step in range(first, last + 1):
            store.append(pa.table({"x": [step, step]}), meta={"step": step})
        if back_to is not None:
            rollback(store, step=back_to)
    return store


def test_plot_legend_with_two_rollbacks_is_whole_and_ticks_are_whole(tmp_path):
    from dynstate.maintenance.plot import growth_figure

    store = _two_rollbacks(str(tmp_path / "store"))
    fig, model = growth_figure(store)
    assert sum(m.get("rollback", False) for m in model["markers"]) == 2
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box, page = legend.get_window_extent(renderer), fig.bbox
    # Every entry (two rollbacks, two crashes: long texts) inside the image, left and right.
    assert page.x0 <= box.x0 and box.x1 <= page.x1, (box, page)
    assert page.y0 <= box.y0
    for ax in fig.axes:  # rows are counts: no 0.5 ticks
        assert all(float(t).is_integer() for t in ax.get_yticks())
    # The CLI writes the whole picture.
    result = CliRunner().invoke(cli, ["plot", store.url, str(tmp_path / "g.png")])
    assert result.exit_code == 0, result.output


def test_gc_says_the_young_files_are_the_collected_versions_outcome_files(tmp_path):
    """A rollback abandons four rounds with outcomes; gc collecting them keeps their outcome
    files for the grace period, and says that is what they are (not "4 orphans")."""
    from dynstate import rollback

    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"p": str(i)} for i in range(10)], meta={"step": 0})

    def step(s: int) -> None:
        scores = [{"row": r, "step": s - 1, "score": 1.0} for r in range(10)]
        store.append([{"p": "new"}], meta={"step": s}, outcomes=scores)

    for s in range(1, 8):
        step(s)
    rollback(store, step=3)
    for s in range(4, 8):
        step(s)
    plan = CliRunner().invoke(cli, ["gc", url, "--keep", "2", "--dry-run", "--json"])
    assert plan.exit_code == 0, plan.output
    assert json.loads(plan.output)["kept_young_outcomes"] == 4
    result = CliRunner().invoke(cli, ["gc", url, "--keep", "2", "--yes"])
    assert result.exit_code == 0, result.output
    assert "orphan" not in result.output
    assert (
        "kept until older than the grace period: 4 outcome files of the collected versions "
        "(rounds a reset or rollback abandoned; a later gc removes them)"
    ) in " ".join(result.output.split())


def test_a_missing_store_is_explained_in_command_line_terms(tmp_path):
    missing = str(tmp_path / "nothing")
    for args in (["ls", missing], ["stats", missing], ["gc", missing, "--keep", "1"]):
        proc = subprocess.run(["dynstate", *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1
        assert proc.stderr == (
            f"error: no dynstate store at {missing}; check the URL (a store is created by the "
            "run that first writes to it; no dynstate command creates one)\n"
        )  # was "... or create one with dynstate.Store.open(url, create=True)"


def _plain_loader(store: Store, workers: int, **options):
    from torchdata.stateful_dataloader import StatefulDataLoader

    import dynstate

    ds = dynstate.VersionedDataset(store)
    sampler = dynstate.VersionedSampler(ds, seed=3, batch_size=4, drop_last=True)
    return StatefulDataLoader(ds, batch_size=4, drop_last=True, sampler=sampler,
                              num_workers=workers, collate_fn=_xs, **options)  # fmt: skip


def _xs(rows: list[dict]) -> list[int]:
    return [r["x"] for r in rows]


def _batches(loader, n: int) -> list[list[int]]:
    out: list[list[int]] = []
    while len(out) < n:
        for batch in loader:
            out.append(batch)
            if len(out) == n:
                break
    return out


def test_plain_resume_with_another_num_workers(tmp_path):
    """A plain StatefulDataLoader user resuming with another num_workers: torchdata's own
    load_state_dict fails with a bare AssertionError; dynstate.load_loader_state carries the
    state over (the same batches follow) or refuses with a typed error naming both counts."""
    import dynstate

    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"x": i} for i in range(40)])
    first = _plain_loader(store, 0)
    seen = _batches(first, 3)
    state = first.state_dict()
    expected = _batches(first, 4)
    assert len(seen) == 3

    raw = _plain_loader(store, 2)
    raw.load_state_dict(state)
    with pytest.raises(AssertionError):  # what a plain user got: no type, no advice
        _batches(raw, 1)

    loader = _plain_loader(store, 2)
    dynstate.load_loader_state(loader, state)
    assert _batches(loader, 4) == expected

    # A two-worker snapshot taken two batches before the last one: only two workers replay it.
    old = _plain_loader(store, 2, snapshot_every_n_steps=3)
    _batches(old, 5)
    stale = old.state_dict()
    with pytest.raises(dynstate.StateMismatchError) as err:
        dynstate.load_loader_state(_plain_loader(store, 0), stale)
    message = str(err.value)
    assert "with 2 worker(s)" in message and "this loader has num_workers=0" in message
    assert "build the loader with num_workers=2" in message


def test_ls_shows_rounds_without_rows_as_what_they_were(tmp_path):
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"p": str(i)} for i in range(5)], meta={"step": 0})
    store.append([], meta={"step": 1}, outcomes=[{"row": 0, "step": 0, "score": 1.0}])
    store.append([], meta={"step": 2})
    store.append([{"p": "x"}], meta={"step": 3})
    result = CliRunner().invoke(cli, ["ls", url, "--all"])
    assert result.exit_code == 0, result.output
    ops = {int(line.split()[0]): line.split()[1] for line in result.output.splitlines()[6:]}
    # was "append" with 0 added for both
    assert ops == {4: "append", 3: "empty", 2: "outcomes", 1: "append", 0: "create"}


def test_one_version_and_one_shard_are_said_in_the_singular(tmp_path):
    from dynstate.history import growth

    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(3):
        store.append([{"p": str(step)}], meta={"step": step})  # versions 1-3
    diff = CliRunner().invoke(cli, ["diff", url, "2", "3"])
    assert diff.exit_code == 0, diff.output
    assert "(version 3)" in diff.output and "(versions 3)" not in diff.output
    reset = CliRunner().invoke(cli, ["reset", url, "2"])
    assert reset.exit_code == 0, reset.output
    assert "version 3 is abandoned until gc" in reset.output  # was "versions 3-3 are"
    compacted = CliRunner().invoke(cli, ["compact", url])
    assert compacted.exit_code == 0, compacted.output
    labels = [m["label"] for m in growth(Store.open(url))["markers"]]
    assert "compaction: 1 shard" in labels  # was "1 shards"
    assert any(
        label.startswith("reset to version 2; version 3 abandoned (1 row dropped)")
        for label in labels
    ), labels


def test_staged_parts_whose_schemas_differ_only_in_representation_make_one_round(
    tmp_path,
) -> None:
    """Parts of one round staged apart (Ray tasks, blocks) with columns in another order, a
    column all None in one part and typed in another, strings as a pandas frame gives them
    (``large_string``) beside an Arrow table's and a Categorical's, and a nullable column one
    part lacks, were refused ("different schemas"); they commit as one version now, each
    shard read by name as the version's schema says. Held to the shards read whole with
    pyarrow, conformed by name, then ``take`` with unsorted repeated indices, in every batch
    format; a real type conflict (int in one part, str in another) is still refused."""
    import pyarrow.parquet as pq

    from dynstate import SchemaMismatchError, VersionedDataset

    pd = pytest.importorskip("pandas")
    root = tmp_path / "store"
    store = Store.open(str(root), create=True)
    parts = [
        store.stage([{"a": 1, "b": None, "c": "x"}]),
        store.stage([{"c": "y", "a": 2, "b": "t"}]),
        store.stage(pd.DataFrame({"a": [3], "b": ["u"], "c": pd.Categorical(["z"])})),
        store.stage(pa.table({"a": [4], "b": pa.array(["v"], pa.large_string())})),
    ]
    version = store.commit_staged(parts)
    snap = Store.open(str(root)).snapshot(version)
    schema = snap.schema
    assert schema.names == ["a", "b", "c"] and schema.field("b").type == pa.string()
    tables = []
    for shard in snap.shards:
        t = pq.read_table(root / shard.path)
        tables.append(
            pa.table(
                [
                    t.column(f.name).cast(f.type)
                    if f.name in t.column_names
                    else pa.nulls(t.num_rows, f.type)
                    for f in schema
                ],
                schema=schema,
            )
        )
    oracle = pa.concat_tables(tables)
    assert oracle.to_pylist() == [
        {"a": 1, "b": None, "c": "x"},
        {"a": 2, "b": "t", "c": "y"},
        {"a": 3, "b": "u", "c": "z"},
        {"a": 4, "b": "v", "c": None},
    ]
    idx = [3, 0, 2, 2, 1, 3]
    want = oracle.take(pa.array(idx)).to_pylist()
    assert snap.to_arrow().to_pylist() == oracle.to_pylist()
    for fmt in ("rows", "columns", "arrow"):
        got = VersionedDataset(str(root), batch_format=fmt).__getitems__(idx)
        rows = (
            got.to_pylist()
            if fmt == "arrow"
            else got
            if fmt == "rows"
            else [dict(zip(got, vals, strict=True)) for vals in zip(*got.values(), strict=True)]
        )
        assert rows == want, fmt
    other = Store.open(str(tmp_path / "other"), create=True)
    with pytest.raises(SchemaMismatchError, match=r"no one version can hold .*changed types: n"):
        other.commit_staged([other.stage([{"a": 5, "n": 1}]), other.stage([{"a": 6, "n": "1"}])])
    assert Store.open(str(tmp_path / "other")).head == 0


def test_the_cli_shows_a_long_int_in_meta_whatever_the_process_int_limit(tmp_path) -> None:
    """A meta holding an integer within the store's bound (1,001 digits) printed by `dynstate
    show` (and `--json`) in a process whose int string limit is Python's least (640,
    PYTHONINTMAXSTRDIGITS) failed with a ValueError out of json.dumps; every JSON the CLI and
    the web view write goes through the codec's dumps now, as records do."""
    import os
    import sys

    url = str(tmp_path / "store")
    big = 10**1000 + 7
    Store.open(url, create=True).append([{"a": 1}], meta={"big": big})
    env = {**os.environ, "PYTHONINTMAXSTRDIGITS": "640"}
    for args in (["show", url, "1"], ["show", url, "1", "--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "dynstate", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, (args, done.stderr)
        assert str(big)[:600] in done.stdout.replace("\n", "").replace(" ", ""), args
