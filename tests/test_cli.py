"""The `dynstate` command line: exact output of every command (table and --json) through the
real click group, on a local store and on s3:// on the loopback S3 server; exit codes and
one-line errors; and, through the installed console script, start-up imports and exit."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import datasets
import fsspec
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import S3_BUCKET, s3_url

from dynstate import Store
from dynstate.cli import cli
from dynstate.cli.render import human_size
from dynstate.maintenance.compact import compact
from dynstate.maintenance.plot import abandoned_points, growth_points
from dynstate.records import manifest as m

COMMANDS = ["ls", "info", "show", "head", "diff", "tags", "verify", "gc", "tag", "reset",
            "compact", "export", "plot", "inspect"]  # fmt: skip
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d{3}Z)?")
HEAVY = ("torch", "datasets", "verl", "ray", "matplotlib", "pandas")


def run(*args: str, code: int = 0, env: dict[str, str] | None = None):
    env = {"COLUMNS": "100", **(env or {})}
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    assert result.exit_code == code, (result.stdout, result.stderr)
    return result


def rows(start: int, n: int) -> list[dict]:
    return [{"id": i, "text": f"row {i}"} for i in range(start, start + n)]


def build(url: str) -> Store:
    """Versions 1-4 appends (step 0-3), 2 tagged `ckpt`, 5 a reset to 2, 6 an append: 3 and 4
    are abandoned."""
    store = Store.open(url, create=True)
    for step in range(4):
        store.append(rows(10 * step, 3), meta={"step": step, "generator": "gen-a"})
    store.tag("ckpt", 2)
    store.reset(2)
    store.append(rows(100, 2), meta={"step": 4, "generator": "gen-b"})
    return store


@pytest.fixture
def built(durable_url: str) -> tuple[str, Store]:
    return durable_url, build(durable_url)


def normalized(text: str, url: str) -> str:
    """Timestamps and random ids keep their widths, so the layout is compared too."""
    text = text.replace(url, "URL")
    text = TIMESTAMP.sub(lambda mt: re.sub(r"\d", "0", mt.group()), text)
    text = re.sub(r"\b[0-9a-f]{32}\b", "x" * 32, text)
    text = re.sub(r"\b[0-9a-f]{12}\b", "h" * 12, text)
    return "\n".join(line.rstrip() for line in text.splitlines())


def sizes(store: Store) -> list[str]:
    return [human_size(store.commit_record(v).num_bytes) for v in range(store.refresh() + 1)]


def files_of(url: str) -> dict[str, int]:
    fs, root = fsspec.core.url_to_fs(url)
    return {p: fs.size(p) for p in fs.find(root)}


# -- ls and info -------------------------------------------------------------------------------


def test_ls_table_exact(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = build(url)
    s = sizes(store)
    header = f"""\
store:    URL
head:     version 6: 8 rows, 3 shards, {s[6]}
versions: 7 kept (0-6), tags: ckpt
commits:  first 0000-00-00 00:00:00 UTC, last 0000-00-00 00:00:00 UTC
"""
    out = normalized(run("ls", url, "--all").stdout, url)
    w = max(len(x) for x in s)
    expected = (
        header
        + f"""
version  op       added  rows  shards  {"size":>{w}}  step  generator  created (UTC)        status
      6  append       2     8       3  {s[6]:>{w}}     4  gen-b      0000-00-00 00:00:00  head
      5  reset→2      0     6       2  {s[5]:>{w}}                   0000-00-00 00:00:00
      4  append       3    12       4  {s[4]:>{w}}     3  gen-a      0000-00-00 00:00:00  abandoned
      3  append       3     9       3  {s[3]:>{w}}     2  gen-a      0000-00-00 00:00:00  abandoned
      2  append       3     6       2  {s[2]:>{w}}     1  gen-a      0000-00-00 00:00:00  tag ckpt
      1  append       3     3       1  {s[1]:>{w}}     0  gen-a      0000-00-00 00:00:00
      0  create       0     0       0  {s[0]:>{w}}                   0000-00-00 00:00:00"""
    )
    assert out == expected
    assert all(len(line) <= 100 for line in out.splitlines())
    # Without --all the abandoned versions are hidden, and the footer says so; --limit keeps
    # the newest and says how many are older; --reverse lists oldest first.
    plain = normalized(run("ls", url, "--limit", "3").stdout, url).splitlines()[6:]
    assert [line.split()[0] for line in plain[:3]] == ["6", "5", "2"]
    assert plain[3:] == [
        "(2 older versions not shown: --limit N shows more, --limit 0 all)",
        "(2 abandoned versions hidden: --all shows them)",
    ]
    rev = normalized(run("ls", url, "--reverse").stdout, url).splitlines()[6:]
    assert [line.split()[0] for line in rev] == ["0", "1", "2", "5", "6", "(2"]


def test_ls_json_exact(built) -> None:
    url, store = built
    out = json.loads(run("ls", url, "--all", "--json").stdout)
    nbytes = [store.commit_record(v).num_bytes for v in range(7)]
    for row in out:
        assert TIMESTAMP.fullmatch(row.pop("created"))
    expected = [
        dict(version=6, op="append", target=None, rows_added=2, total_rows=8, shards=3, step=4,
             generator="gen-b", tags=[], status="head"),
        dict(version=5, op="reset", target=2, rows_added=0, total_rows=6, shards=2, step=None,
             generator=None, tags=[], status=None),
        dict(version=4, op="append", target=None, rows_added=3, total_rows=12, shards=4, step=3,
             generator="gen-a", tags=[], status="abandoned"),
        dict(version=3, op="append", target=None, rows_added=3, total_rows=9, shards=3, step=2,
             generator="gen-a", tags=[], status="abandoned"),
        dict(version=2, op="append", target=None, rows_added=3, total_rows=6, shards=2, step=1,
             generator="gen-a", tags=["ckpt"], status=None),
        dict(version=1, op="append", target=None, rows_added=3, total_rows=3, shards=1, step=0,
             generator="gen-a", tags=[], status=None),
        dict(version=0, op="create", target=None, rows_added=0, total_rows=0, shards=0,
             step=None, generator=None, tags=[], status=None),
    ]  # fmt: skip
    extra = {"rollback_step": None, "error": None}
    assert out == [{**row, "bytes": nbytes[row["version"]], **extra} for row in expected]
    assert list(out[0]) == ["version", "op", "target", "rows_added", "total_rows", "shards",
                            "bytes", "step", "generator", "tags", "status", "rollback_step",
                            "error"]  # fmt: skip

    def versions(*args: str) -> list[int]:
        return [r["version"] for r in json.loads(run("ls", url, "--json", *args).stdout)]

    assert versions() == [6, 5, 2, 1, 0]
    assert versions("--reverse") == [0, 1, 2, 5, 6]
    assert versions("--limit", "2") == [6, 5]
    assert versions("--all", "--limit", "3") == [6, 5, 4]
    assert versions("--all", "--limit", "3", "--reverse") == [4, 5, 6]
    assert versions("--limit", "0") == [6, 5, 2, 1, 0]


def test_info_exact(built) -> None:
    url, store = built
    info = json.loads(run("info", url, "--json").stdout)
    assert TIMESTAMP.fullmatch(info.pop("first_commit"))
    assert TIMESTAMP.fullmatch(info.pop("last_commit"))
    head = store.commit_record(6)
    assert info == {
        "url": url, "store_id": store.store_id, "head": 6, "oldest": 0, "versions": 7, "rows": 8,
        "bytes": head.num_bytes, "shards": 3, "tags": {"ckpt": 2},
    }  # fmt: skip
    text = normalized(run("info", url).stdout, url)
    assert text.splitlines() == [
        "store:    URL",
        f"head:     version 6: 8 rows, 3 shards, {human_size(head.num_bytes)}",
        "versions: 7 kept (0-6), tags: ckpt",
        "commits:  first 0000-00-00 00:00:00 UTC, last 0000-00-00 00:00:00 UTC",
    ]


@pytest.mark.s3
def test_ls_limit_reads_a_bounded_number_of_objects_on_s3(s3_server, tmp_path) -> None:
    """`ls --limit 20` of a 1,000-version store on S3 sends about as many requests as of a
    30-version one: only the records shown (and a handful of others) are read."""
    local = str(tmp_path / "big")
    store = Store.open(local, create=True)
    for step in range(1000):  # empty rounds: one record each, built fast on local disk
        store.append([], meta={"step": step})
    store.reset(990)
    small = str(tmp_path / "small")
    store = Store.open(small, create=True)
    for step in range(30):
        store.append([], meta={"step": step})
    fs = fsspec.filesystem("s3")
    counts = {}
    for name, path in (("big", local), ("small", small)):
        url = s3_url()
        fs.put(path + "/", url[len("s3://") :] + "/", recursive=True)
        mark = s3_server.count()
        listed = json.loads(run("ls", url, "--limit", "20", "--json").stdout)
        counts[name] = s3_server.since(mark)
        assert len(listed) == 20
    assert [r["version"] for r in listed] == list(range(30, 10, -1))
    gets = [p for method, p, _ in counts["big"] if method == "GET"]
    records = [p for p in gets if "/_dynstate/log/" in p]
    # The 20 shown, the probe past the head, the oldest kept version's (for the summary) and
    # at most one more: nothing that depends on the length of the history.
    assert len(records) <= 24, records
    assert len(counts["big"]) <= len(counts["small"]) + 2
    assert len(counts["big"]) < 40, counts["big"]


# -- show, head --------------------------------------------------------------------------------


def test_show_exact(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = build(url)
    rec = store.commit_record(3)
    shard_sizes = [human_size(s.bytes) for s in store.snapshot(3).shards]
    out = normalized(run("show", url, "3").stdout, url)
    w = max(len("size"), *(len(x) for x in shard_sizes))
    expected = f"""\
version: 3
op:      append
parent:  2
created: 0000-00-00 00:00:00 UTC
status:  abandoned
rows:    9 (+3 in this version)
shards:  3
size:    {human_size(rec.num_bytes)} ({rec.num_bytes:,} bytes)
tags:    none
lineage: 0-3 (4 versions)
meta:    {{"generator": "gen-a", "step": 2}}

schema:
  column  type    nullable
  id      int64   yes
  text    string  yes

shards:
  #  path                                                                            rows  {"size":>{w}}  sha256
"""  # noqa: E501
    expected += "\n".join(
        f"  {i}  data/{'x' * 32}-{'x' * 32}.parquet     3  {shard_sizes[i]:>{w}}  {'h' * 12}"
        for i in range(3)
    )
    # the story of step 2: a round with no outcomes, no generator state and no policy
    expected += """

step: 2
  outcomes:  none committed in this version
  generator: no state committed"""
    assert out == expected


def test_show_json(built) -> None:
    url, store = built
    info = json.loads(run("show", url, "ckpt", "--json").stdout)
    assert info["version"] == 2 and info["tags"] == ["ckpt"] and info["status"] is None
    assert info["store_id"] == store.store_id
    assert [s["path"] for s in info["shard_list"]] == [s.path for s in store.snapshot(2).shards]
    assert [c["name"] for c in info["schema"]] == ["id", "text"]
    head = json.loads(run("show", url, "--json").stdout)
    assert (head["version"], head["status"], head["op"]) == (6, "head", "append")
    assert head["lineage"] == "0-2, 5-6 (5 versions)"
    reset = json.loads(run("show", url, "5", "--json").stdout)
    assert (reset["op"], reset["target"]) == ("reset", 2)


def test_show_walks_a_bounded_number_of_records(tmp_path) -> None:
    from dynstate.history import describe

    store = build(str(tmp_path / "store"))
    assert describe(store, lineage_limit=3)["lineage"] == "2, 5-6, … (the newest 3 versions read)"
    assert describe(store)["lineage"] == "0-2, 5-6 (5 versions)"
    assert describe(store, 3, lineage_limit=3)["status"] == "abandoned"  # found within 3
    assert describe(store, 1, lineage_limit=3)["status"] == "unknown"  # would need a 4th
    assert describe(store, 1)["status"] is None


def test_head_table_json_jsonl(built) -> None:
    url, _ = built
    assert run("head", url, "-n", "4").stdout.splitlines() == [
        "#  id  text", "0  0   row 0", "1  1   row 1", "2  2   row 2", "3  10  row 10"
    ]  # fmt: skip
    assert json.loads(run("head", url, "-n", "4", "--json").stdout) == rows(0, 3) + rows(10, 1)
    lines = run("head", url, "4", "--columns", "text", "--jsonl", "-n", "20").stdout.splitlines()
    expected = [0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32]
    assert [json.loads(line) for line in lines] == [{"text": f"row {i}"} for i in expected]
    bad = run("head", url, "--columns", "nope", code=2)
    assert "nope" in bad.stderr and "id, text" in bad.stderr


def _chat_store(url: str) -> Store:
    """A verl-shaped store: a 6-row import of chat prompts (step -1), rounds of 3 rows
    (steps 0-2), an empty round whose generator failed (step 3)."""
    store = Store.open(url, create=True)

    def chat(text: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]

    store.append([{"prompt": chat(f"seed {i}"), "n": i} for i in range(6)], meta={"step": -1})
    for step in range(3):
        store.append([{"prompt": chat(f"task {step}-{k}\nmore"), "n": 100 * step + k}
                      for k in range(3)], meta={"step": step, "generator": "g"})  # fmt: skip
    store.append([], meta={"step": 3, "generator": "g", "error": "generator crashed: OOM"})
    return store


def test_head_of_what_a_round_added_with_offset_and_tail(tmp_path) -> None:
    url = str(tmp_path / "store")
    _chat_store(url)
    added = run("head", url, "3", "--added").stdout.splitlines()
    assert added == [
        " #  prompt                                    n",
        " 9  system: Be brief. | user: task 1-0\\nmore  100",
        "10  system: Be brief. | user: task 1-1\\nmore  101",
        "11  system: Be brief. | user: task 1-2\\nmore  102",
    ]
    assert run("head", url, "3", "--added", "--tail", "-n", "1").stdout.splitlines()[1:] == [
        "11  system: Be brief. | user: task 1-2\\nmore  102"
    ]
    assert run("head", url, "3", "--added", "--offset", "1", "-n", "1").stdout.splitlines()[1:] == [
        "10  system: Be brief. | user: task 1-1\\nmore  101"
    ]
    # --tail and --offset over a whole version: the last rows, or from row N on.
    tail = json.loads(run("head", url, "--tail", "-n", "2", "--json", "--columns", "n").stdout)
    assert tail == [{"n": 201}, {"n": 202}]
    skip = run("head", url, "--offset", "5", "-n", "2", "--columns", "n").stdout.splitlines()
    assert skip == ["#  n", "5  5", "6  0"]
    past = json.loads(run("head", url, "--offset", HUGE, "--json").stdout)
    assert past == []
    # The import's rows are the version's first, as before; the chat messages by content.
    assert run("head", url, "1", "-n", "1").stdout.splitlines()[1] == (
        "0  system: Be brief. | user: seed 0  0"
    )
    raw = json.loads(run("head", url, "1", "-n", "1", "--json").stdout)
    assert raw[0]["prompt"][1] == {"role": "user", "content": "seed 0"}  # --json keeps them
    empty = run("head", url, "5", "--added")
    assert empty.stdout == f"version 5 of {url} (append) added no rows\n"


def test_diff_rows_shows_the_rows_v2_adds(tmp_path) -> None:
    url = str(tmp_path / "store")
    _chat_store(url)
    out = run("diff", url, "2", "4", "--rows", "-n", "4", "--columns", "n").stdout
    assert out.splitlines()[-7:] == [
        "",
        "rows version 4 adds (the first 4 of 6 rows):",
        " #  n",
        " 9  100",
        "10  101",
        "11  102",
        "12  200",
    ]
    info = json.loads(run("diff", url, "2", "4", "--rows", "-n", "2", "--json").stdout)
    assert [p["row"] for p in info["added_preview"]] == [9, 10]
    assert info["added_preview"][0]["values"]["n"] == 100
    none = run("diff", url, "4", "2", "--rows").stdout.splitlines()
    assert none[-1] == "version 2 adds no rows to version 4"


def test_rollbacks_and_failed_rounds_say_so(tmp_path) -> None:
    from dynstate import rollback

    url = str(tmp_path / "store")
    store = _chat_store(url)
    rollback(store, step=1)  # version 6: back to version 3, the round of step 1
    out = run("ls", url, "--all").stdout.splitlines()
    rows = {line.split()[0]: line for line in out[6:]}
    assert rows["6"].split()[1:4] == ["reset→3", "(step", "1)"]
    assert rows["5"].split()[2] == "failed"
    row5 = json.loads(run("ls", url, "--all", "--json").stdout)[1]
    assert (row5["version"], row5["error"], row5["rows_added"]) == (5, "generator crashed: OOM", 0)
    show = dict(line.split(":", 1) for line in run("show", url, "5").stdout.splitlines()[:9])
    assert show["rows"].strip() == "15 (none added: the round failed: generator crashed: OOM)"
    assert run("show", url, "6").stdout.splitlines()[1] == "op:      reset→3 (step 1)"


def test_ls_fits_80_columns_without_cutting_status_or_tags(tmp_path, monkeypatch) -> None:
    # a relative URL: the header names it, and a pytest-xdist worker's tmp_path is 10
    # characters longer (popen-gwN/), enough to push that line past 80 columns
    monkeypatch.chdir(tmp_path)
    url = "store"
    store = build(url)
    store.tag("best-run", 6)
    out = run("ls", url, "--all", env={"COLUMNS": "80"}).stdout.splitlines()
    assert all(len(line) <= 80 for line in out), [len(line) for line in out]
    table = out[5:-1]
    # The tag on the head widens the status column: the generator goes too, status stays whole.
    assert table[0].split() == ["version", "op", "added", "rows", "step", "created", "(UTC)",
                                "status"]  # fmt: skip
    assert table[1].endswith("  head, tag best-run")
    assert table[3].endswith("  abandoned") and table[5].endswith("  tag ckpt")
    assert out[-1] == "(shards, size, generator left out to fit 80 columns: --json has all)"
    store.untag("best-run")
    out = run("ls", url, "--all", env={"COLUMNS": "80"}).stdout.splitlines()
    assert all(len(line) <= 80 for line in out) and "generator" in out[5]
    assert out[-1] == "(shards, size left out to fit 80 columns: --json has all)"
    wide = run("ls", url, "--all", env={"COLUMNS": "120"}).stdout
    assert "shards" in wide and "left out" not in wide


@pytest.mark.slow
def test_head_never_crashes_at_exit(tmp_path) -> None:
    """Arrow objects freed during interpreter teardown, with torch loaded, aborted the process
    (exit 134, 'terminate called without an active exception') in about half the runs."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(46):
        store.append(rows(5 * step, 5), meta={"step": step})
    code = "import torch, sys\nfrom dynstate.cli import main\nsys.argv[0] = 'dynstate'\nmain()"
    for _ in range(8):
        proc = subprocess.run([sys.executable, "-c", code, "head", url, "45", "-n", "3",
                               "--jsonl"], capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert [json.loads(line)["id"] for line in proc.stdout.splitlines()] == [0, 1, 2]


def test_python_dash_m_dynstate_is_the_command(tmp_path) -> None:
    """``python -m dynstate`` runs the same commands as the ``dynstate`` script, with the same
    name in its usage and the same exit codes."""
    url = str(tmp_path / "store")
    Store.open(url, create=True).append(rows(0, 3), meta={"step": 0})
    run = subprocess.run([sys.executable, "-m", "dynstate", "head", url, "-n", "2", "--jsonl"],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert [json.loads(line)["id"] for line in run.stdout.splitlines()] == [0, 1]
    usage = subprocess.run([sys.executable, "-m", "dynstate", "--help"], capture_output=True,
                           text=True)  # fmt: skip
    assert usage.returncode == 0 and usage.stdout.startswith("Usage: dynstate "), usage.stdout
    missing = subprocess.run([sys.executable, "-m", "dynstate", "ls", str(tmp_path / "none")],
                             capture_output=True, text=True)  # fmt: skip
    assert missing.returncode == 1 and "no dynstate store at" in missing.stderr


# -- diff --------------------------------------------------------------------------------------


def test_diff_exact(built) -> None:
    url, store = built
    info = json.loads(run("diff", url, "4", "6", "--json").stdout)
    assert info == {
        "url": url, "from": 4, "to": 6, "rows": [12, 8], "added_rows": 2, "removed_rows": 6,
        "shared_rows": 6, "common_version": 2, "added_versions": [6], "removed_versions": [3, 4],
        "extends": False, "same_rows": False, "schema_change": None, "shards": [4, 3],
    }  # fmt: skip
    assert run("diff", url, "ckpt", "head").stdout.splitlines() == [
        f"{url}: version 2 -> 6",
        "rows:    6 -> 8: version 6 extends version 2",
        "added:   2 rows (version 6)",
        "removed: 0 rows",
        "shared:  the first 6 rows (both lineages meet at version 2)",
        "schema:  unchanged",
        "shards:  2 -> 3",
    ]
    with_shards = json.loads(run("diff", url, "4", "6", "--shards", "--json").stdout)
    assert [s["path"] for s in with_shards["shards_added"]] == [store.snapshot(6).shards[-1].path]
    assert [s["path"] for s in with_shards["shards_removed"]] == [
        s.path for s in store.snapshot(4).shards[2:]
    ]
    text = run("diff", url, "4", "6", "--shards").stdout.splitlines()
    assert text[1] == "rows:    12 -> 8: version 6 does not contain all rows of version 4"
    assert [line[:2] for line in text[7:]] == ["+ ", "- ", "- "]


def test_diff_after_compaction_and_noop_reset_reports_no_row_change(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(6):
        store.append(rows(7 * step, 7), meta={"step": step})
    before = store.refresh()
    after = compact(store, target_bytes=2**20)
    assert after == before + 1
    info = json.loads(run("diff", url, str(before), str(after), "--json").stdout)
    assert (info["added_rows"], info["removed_rows"], info["same_rows"]) == (0, 0, True)
    assert info["shared_rows"] == 42 and "shards_added" not in info
    assert "rows:    42 -> 42: same rows" in run("diff", url, str(before), str(after)).stdout
    reset = Store.open(url).reset(after)
    info = json.loads(run("diff", url, str(after), str(reset), "--json").stdout)
    assert (info["added_rows"], info["removed_rows"], info["same_rows"]) == (0, 0, True)


# -- tags, tag, reset --------------------------------------------------------------------------


def test_tags_and_tag(built) -> None:
    url, store = built
    assert run("tag", url, "late", "4").stdout == f"tagged version 4 of {url} as late\n"
    assert run("tag", url, "late", "4").stdout == f"tag late already names version 4 of {url}\n"
    out = normalized(run("tags", url).stdout, url)
    assert out.splitlines() == [
        "tag   version  op      rows  step  created (UTC)",
        "ckpt        2  append     6     1  0000-00-00 00:00:00",
        "late        4  append    12     3  0000-00-00 00:00:00",
    ]
    listed = json.loads(run("tags", url, "--json").stdout)
    for tag in listed:
        assert TIMESTAMP.fullmatch(tag.pop("created"))
    assert listed == [
        {"name": "ckpt", "version": 2, "op": "append", "rows": 6, "step": 1},
        {"name": "late", "version": 4, "op": "append", "rows": 12, "step": 3},
    ]
    moved = run("tag", url, "ckpt", "3", code=1)
    assert moved.stderr.startswith("error: tag 'ckpt'") and "version 2" in moved.stderr
    assert "--force" in moved.stderr and "force=True" not in moved.stderr
    assert json.loads(run("tag", url, "ckpt", "3", "--force", "--json").stdout) == {
        "url": url, "tag": "ckpt", "version": 3, "deleted": False, "previous": 2
    }  # fmt: skip
    assert run("tag", url, "late", "--delete").stdout == (
        f"removed tag late (version 4) from {url}\n"
    )
    assert json.loads(run("tag", url, "ckpt", "--delete", "--json").stdout) == {
        "url": url, "tag": "ckpt", "version": 3, "deleted": True
    }  # fmt: skip
    assert store.tags() == {}
    assert run("tags", url).stdout == f"{url}: no tags (dynstate tag URL NAME VERSION adds one)\n"
    assert json.loads(run("tags", url, "--json").stdout) == []
    assert "no tag 'gone'" in run("tag", url, "gone", "--delete", code=1).stderr
    assert run("tag", url, "x", "3", "--delete", code=2).exit_code == 2


def test_reset_exact_and_noop(built) -> None:
    url, store = built
    assert run("reset", url, "4").stdout == (
        f"reset {url} to version 4: new head is version 7 (12 rows); versions 5-6 are "
        "abandoned until gc\n"
    )
    assert store.refresh() == 7
    # Resetting to what the head already holds commits nothing, and says so.
    for version in ("4", "7", "head"):
        assert run("reset", url, version).stdout == (
            f"{url}: nothing to do, the head (version 7) already has the rows of version "
            f"{version.replace('head', '7')}; nothing committed\n"
        )
    assert json.loads(run("reset", url, "4", "--json").stdout) == {
        "url": url, "target": 4, "head": 7, "committed": None
    }  # fmt: skip
    assert store.refresh() == 7
    assert json.loads(run("reset", url, "ckpt", "--json").stdout) == {
        "url": url, "target": 2, "head": 8, "committed": 8
    }  # fmt: skip
    status = {
        r["version"]: r["status"] for r in json.loads(run("ls", url, "--all", "--json").stdout)
    }
    assert status == {0: None, 1: None, 2: None, 3: "abandoned", 4: "abandoned", 5: "abandoned",
                      6: "abandoned", 7: "abandoned", 8: "head"}  # fmt: skip


# -- gc: plan first, delete only with --yes ----------------------------------------------------


def test_gc_shows_a_plan_and_deletes_only_with_yes(built) -> None:
    url, _ = built
    before = files_of(url)
    plan = run("gc", url, "--keep", "2", "--grace", "0")
    assert files_of(url) == before  # nothing deleted without --yes
    assert plan.stderr == "nothing removed: pass --yes to remove these files\n"
    lines = plan.stdout.splitlines()
    # --keep 2 stops at the tagged version 2: versions 0 and 1 go, with version 1's records;
    # the plan says which tag holds the floor and why each kept range is kept.
    explained = [
        "floor: version 2, held by tag ckpt (--keep 2 alone would keep from version 5)",
        "kept: versions 2-4: tag ckpt names version 2: the floor never passes a tagged version; "
        "2 of them abandoned by a reset",
        "kept: versions 5-6: --keep 2: the newest 2 versions",
    ]
    assert lines[-3:] == explained
    lines = lines[:-3]
    assert all(line.startswith("would remove ") for line in lines[:-1])
    assert lines[-1].startswith(f"{url}: would remove {len(lines) - 1} files (")
    assert lines[-1].endswith(
        "versions 0-1 collected; 0 orphans younger than the grace period kept"
    )
    as_json = json.loads(run("gc", url, "--keep", "2", "--grace", "0", "--json").stdout)
    assert (as_json["deleted"], as_json["dry_run"], as_json["floor_after"]) == (False, True, 2)
    assert as_json["pinned_by"] == [{"kind": "tag", "name": "ckpt", "version": 2}]
    assert as_json["retention"] == {"rule": "keep 2", "keep": 2, "older_than_s": None,
                                    "asked_floor": 5, "floor": 2, "tags": {"ckpt": 2},
                                    "note": None}  # fmt: skip
    assert as_json["kept"] == [
        {"from": 2, "to": 4,
         "reason": "tag ckpt names version 2: the floor never passes a tagged version"},
        {"from": 5, "to": 6, "reason": "keep 2: the newest 2 versions"},
    ]  # fmt: skip
    assert files_of(url) == before
    dry = run("gc", url, "--keep", "2", "--grace", "0", "--dry-run", "--yes")
    assert dry.stderr == "" and files_of(url) == before
    done = json.loads(run("gc", url, "--keep", "2", "--grace", "0", "--yes", "--json").stdout)
    assert done["deleted"] and not done["dry_run"] and done["floor_after"] == 2
    assert {r["path"] for r in done["removed"]} == {r["path"] for r in as_json["removed"]}
    assert run("verify", url, "--all").exit_code == 0
    again = run("gc", url, "--keep", "2", "--grace", "0")
    assert again.stdout == f"{url}: nothing to remove\n" + "\n".join(explained) + "\n"
    assert again.stderr == ""


def test_gc_names_what_pins_the_floor_and_reports_foreign_files(tmp_path) -> None:
    """The issue's case: --keep 5 on 27 versions with an old tag keeps 22 and says why; a
    file dynstate never writes is named in the human output, not only in --json."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(26):
        store.append(rows(step, 1), meta={"step": step})
    store.tag("old", 4)
    store.tag("mid", 10)
    with open(os.path.join(url, "data", "NOTES.txt"), "w") as f:
        f.write("mine")
    out = run("gc", url, "--keep", "5", "--grace", "0").stdout.splitlines()
    assert out[-4:] == [
        "floor: version 4, held by tag old (--keep 5 alone would keep from version 22)",
        "kept: versions 4-21: tag old names version 4: the floor never passes a tagged "
        "version (tags in this range: old (4), mid (10))",
        "kept: versions 22-26: --keep 5: the newest 5 versions",
        "left alone: 1 file dynstate never writes: data/NOTES.txt",
    ]
    store.untag("old")
    store.untag("mid")
    out = run("gc", url, "--keep", "5", "--grace", "0").stdout.splitlines()
    assert out[-3:] == [
        "floor: version 22, set by --keep 5",
        "kept: versions 22-26: --keep 5: the newest 5 versions",
        "left alone: 1 file dynstate never writes: data/NOTES.txt",
    ]
    plain = run("gc", url).stdout.splitlines()
    assert plain == [
        f"{url}: nothing to remove",
        "floor: version 0 (unchanged: no retention rule)",
        "kept: versions 0-26: no retention rule (--keep or --older-than): every version is kept",
        "left alone: 1 file dynstate never writes: data/NOTES.txt",
    ]
    as_json = json.loads(run("gc", url, "--older-than", "1d", "--json").stdout)
    assert as_json["foreign"] == ["data/NOTES.txt"]
    assert as_json["pinned_by"] == [{"kind": "earlier floor", "version": 0}]
    assert as_json["kept"] == [{"from": 0, "to": 26, "reason": "older than 1d: committed "
                                "within the last 1d (every kept version already falls within "
                                "it)"}]  # fmt: skip


def test_gc_usage_errors_exit_2_and_change_nothing(tmp_path) -> None:
    url = str(tmp_path / "store")
    build(url)
    before = files_of(url)
    for args in (["--older-than", "2x"], ["--keep", "5", "--older-than", "1d"],
                 ["--grace", "soon"], ["--keep", "0"]):  # fmt: skip
        result = run("gc", url, *args, "--yes", code=2)
        assert "Traceback" not in result.stderr and result.stdout == ""
    assert "cannot read duration '2x'" in run("gc", url, "--older-than", "2x", code=2).stderr
    assert files_of(url) == before


HUGE = "9" * 23  # beyond sys.maxsize


def test_huge_counts_mean_all_and_never_leak_overflow_errors(tmp_path) -> None:
    """Every integer option of every command: a count larger than a machine word is "all"
    (clamped), never a ValueError/OverflowError from below; negative ones stay usage errors."""
    url = str(tmp_path / "store")
    store = build(url)
    every = json.loads(run("ls", url, "--all", "--json").stdout)
    assert json.loads(run("ls", url, "--all", "--limit", HUGE, "--json").stdout) == every
    head = json.loads(run("head", url, "-n", HUGE, "--json").stdout)
    assert (
        head == rows(0, 3) + rows(10, 3) + rows(100, 2) == store.snapshot().to_arrow().to_pylist()
    )
    shown = json.loads(run("show", url, "--max-shards", HUGE, "--json").stdout)
    assert len(shown["shard_list"]) == 3
    assert "shards:" in run("show", url, "--max-shards", HUGE).stdout
    before = files_of(url)
    gc = json.loads(run("gc", url, "--keep", HUGE, "--yes", "--json").stdout)
    assert gc["versions_collected"] == [] and gc["files_removed"] == 0
    huge_size = "9" * 400  # float infinity once parsed: no limit
    assert files_of(url) == before
    compacted = run("compact", url, "--target-size", huge_size).stdout
    assert compacted.endswith("version 7 has 1 shard (version 6 had 3), same 8 rows\n")
    for args in (["ls", url, "--limit", "-1"], ["head", url, "-n", "-" + HUGE],
                 ["show", url, "--max-shards", "x"], ["gc", url, "--keep", "0"]):  # fmt: skip
        result = run(*args, code=2)
        assert "Invalid value for" in result.stderr and "Traceback" not in result.stderr


# -- verify ------------------------------------------------------------------------------------


def corrupt(url: str, store: Store, kind: str) -> str:
    """Damage one file of ``store`` the way ``kind`` says; returns the damaged relative path."""
    fs, root = fsspec.core.url_to_fs(url)
    if kind == "tampered record":
        rel = m.log_path(3)
        obj = json.loads(fs.cat_file(f"{root}/{rel}"))
        obj["num_rows"] += 1
        fs.pipe_file(f"{root}/{rel}", json.dumps(obj).encode())
        return rel
    rel = store.snapshot().shards[1].path
    data = fs.cat_file(f"{root}/{rel}")
    if kind == "truncated shard":
        fs.pipe_file(f"{root}/{rel}", data[: len(data) // 2])
    elif kind == "flipped byte":
        i = len(data) // 2
        fs.pipe_file(f"{root}/{rel}", data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :])
    else:
        fs.rm_file(f"{root}/{rel}")
    return rel


def test_verify_passes_on_healthy_store(built) -> None:
    url, store = built
    nbytes = sum(s.bytes for s in store.snapshot().shards)
    assert run("verify", url).stdout == (
        f"ok: {url}: 1 version, 3 shards, {human_size(nbytes)} verified\n"
    )
    report = json.loads(run("verify", url, "--all", "--json").stdout)
    assert report["ok"] and report["problems"] == []
    assert report["versions_checked"] == list(range(7))
    assert report["shards_checked"] == 5  # every distinct shard of every version, once


@pytest.mark.parametrize(
    "kind", ["truncated shard", "flipped byte", "missing file", "tampered record"]
)
def test_verify_catches_corruption(built, kind: str) -> None:
    url, store = built
    rel = corrupt(url, store, kind)
    result = run("verify", url, code=1)
    assert rel in result.stdout, result.stdout
    assert result.stderr == f"error: 1 problem(s) in {url}\n"
    expected = {
        "truncated shard": "truncated",
        "flipped byte": "does not match its checksum",
        "missing file": "is missing",
        "tampered record": "does not match its checksum",
    }[kind]
    assert expected in result.stdout


# -- compact, export, plot ---------------------------------------------------------------------


def test_compact_exact_and_progress(durable_url: str) -> None:
    store = Store.open(durable_url, create=True)
    for step in range(6):
        store.append(rows(7 * step, 7), meta={"step": step})
    before = store.snapshot()
    out = run("compact", durable_url, "--target-size", "1MiB").stdout
    after = Store.open(durable_url).snapshot()
    assert out == (
        f"compacted {durable_url}: version 7 has 1 shard (version 6 had 6), same 42 rows\n"
    )
    assert after.to_arrow().to_pylist() == before.to_arrow().to_pylist()
    assert json.loads(run("compact", durable_url, "--json").stdout) == {
        "url": durable_url, "from": 7, "version": 7, "committed": False, "shards": [1, 1],
        "rows": 42,
    }  # fmt: skip
    assert run("compact", durable_url).stdout == (
        f"{durable_url}: nothing to compact at version 7; nothing committed\n"
    )
    assert "--target-size" in run("compact", durable_url, "--target-size", "big", code=2).stderr
    # The progress callback counts source shards read, up to the total.
    store.append(rows(100, 1))
    store.append(rows(101, 1))
    seen: list[tuple[int, int]] = []
    compact(Store.open(durable_url), target_bytes=2**20, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(0, 3), (1, 3), (2, 3), (3, 3)]


def test_export_parquet_datasets_and_s3(built, tmp_path, s3_endpoint) -> None:
    url, store = built
    out = tmp_path / "rows.parquet"
    assert run("export", url, "4", str(out)).stdout == (
        f"exported version 4 of {url} (12 rows) to {out}\n"
    )
    assert pq.read_table(out).equals(store.snapshot(4).to_arrow())
    exists = run("export", url, str(out), code=1)
    assert exists.stderr == (
        f"error: {out} exists; choose another path or pass --overwrite to replace it\n"
    )
    replaced = run("export", url, str(out), "--overwrite", "--yes", "--json")
    assert replaced.stderr.startswith(f"would replace {out} (a file of ")  # stdout: JSON only
    info = json.loads(replaced.stdout)
    assert info == {"url": url, "version": 6, "rows": 8, "shards": 3, "out": str(out),
                    "format": "parquet", "replaced": info["replaced"]}  # fmt: skip
    assert info["replaced"].startswith("a file of ")
    assert pq.read_table(out).to_pylist() == store.snapshot().to_arrow().to_pylist()
    ds_dir = tmp_path / "ds"
    run("export", url, "ckpt", str(ds_dir), "--format", "datasets")
    assert datasets.load_from_disk(str(ds_dir)).to_list() == rows(0, 3) + rows(10, 3)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left
    # Any fsspec URL: s3:// goes to the bucket, not to a local directory named "s3:".
    target = f"{s3_url()}/exports/rows.parquet"
    run("export", url, target)
    with fsspec.open(target, "rb") as fh:
        assert pq.read_table(fh).to_pylist() == store.snapshot().to_arrow().to_pylist()
    assert not os.path.exists("s3:")
    fs = fsspec.filesystem("s3")
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(target.rsplit("/", 1)[0][5:])] == ["rows.parquet"]


def test_plot_writes_png_and_marks_events(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = build(url)
    compact(store, target_bytes=2**20)
    out = tmp_path / "growth.png"
    assert run("plot", url, str(out)).stdout == (
        f"wrote {out} (5 versions of {url}; marked: reset to version 2, compaction)\n"
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    label, points = growth_points(Store.open(url))
    assert label == "step"  # the reset (no step of its own) sits at the step before it
    got = [(p["version"], p["x"], p["rows_added"], p["total_rows"], p["event"]) for p in points]
    assert got == [(1, 0, 3, 3, None), (2, 1, 3, 6, None), (5, 1, 0, 6, "reset"),
                   (6, 4, 2, 8, None), (7, 4, 0, 8, "compact")]  # fmt: skip
    info = json.loads(run("plot", url, str(tmp_path / "g2.png"), "--json").stdout)
    assert info["x"] == "step" and [p["version"] for p in info["points"]] == [1, 2, 5, 6, 7]


def _tree(root) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
        for d, _, files in os.walk(root)
        for f in files
    }


RECORD = "_dynstate/log/00000000000000000001.json"


@pytest.mark.parametrize("inside", ["_dynstate/store.json", RECORD, "_dynstate/new.png", ""])
def test_plot_refuses_an_out_inside_the_store(tmp_path, inside) -> None:
    url = str(tmp_path / "store")
    build(url)
    before = _tree(url)
    out = os.path.join(url, inside) if inside else url
    for extra in ((), ("--overwrite", "--yes")):
        err = run("plot", url, out, *extra, code=2 if not inside else 1).stderr
        if inside:  # the store root itself is a directory: click refuses it as OUT
            assert err.startswith(f"error: cannot plot to {out}: it lies inside the store at {url}")
            assert "choose an OUT outside the store" in err
    assert _tree(url) == before
    assert Store.open(url).refresh() == 6


def test_plot_replaces_an_existing_out_only_with_overwrite_and_yes(tmp_path) -> None:
    url = str(tmp_path / "store")
    build(url)
    out = tmp_path / "notes.png"
    out.write_text("my notes")
    err = run("plot", url, str(out), code=1).stderr
    assert err == f"error: {out} exists; choose another path or pass --overwrite to replace it\n"
    result = run("plot", url, str(out), "--overwrite", code=1)
    assert result.stdout == f"would replace {out} (a file of 8 B)\n"
    assert "not replaced: pass --yes (with --overwrite)" in result.stderr
    assert out.read_text() == "my notes"
    result = run("plot", url, str(out), "--overwrite", "--yes")
    assert result.stdout.startswith(f"would replace {out} (a file of 8 B)\nwrote {out} (")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["notes.png", "store"]  # no temporary file left
    # The Python API refuses the same way.
    from dynstate.errors import InvalidDataError, StoreExistsError
    from dynstate.maintenance.plot import plot_growth

    with pytest.raises(StoreExistsError, match="pass overwrite=True"):
        plot_growth(Store.open(url), out)
    with pytest.raises(InvalidDataError, match="lies inside the store"):
        plot_growth(Store.open(url), os.path.join(url, "_dynstate", "store.json"), overwrite=True)


def test_plot_marks_the_checkpoint_a_rollback_resumed_from(tmp_path) -> None:
    from dynstate import rollback

    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(5):
        store.append(rows(step, 1), meta={"step": step})
    rollback(store, step=2)
    store.append(rows(50, 1), meta={"step": 3})
    _, points = growth_points(store)
    marked = [(p["x"], p["event"], p["label"]) for p in points if p["event"]]
    assert marked == [(2, "rollback", "resumed from the checkpoint at step 2")]
    # The rounds the rollback dropped (what the crash cost) are drawn too, hatched.
    lost = abandoned_points(store, points)
    assert [(p["version"], p["x"], p["event"]) for p in lost] == [
        (4, 3, "abandoned"),
        (5, 4, "abandoned"),
    ]
    run("plot", url, str(tmp_path / "g.png"))


def test_plot_without_matplotlib_names_the_extra(tmp_path) -> None:
    url = str(tmp_path / "store")
    build(url)
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from dynstate.cli import main\n"
        f"sys.argv = ['dynstate', 'plot', {url!r}, {str(tmp_path / 'x.png')!r}]\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr == (
        "error: plotting needs matplotlib, which is not installed; pip install 'dynstate[plot]'\n"
    )
    assert not (tmp_path / "x.png").exists()


# -- errors and exit codes ---------------------------------------------------------------------


def test_errors_are_one_line_in_cli_terms(tmp_path) -> None:
    missing = run("ls", str(tmp_path / "nothing"), code=1)
    assert missing.stdout == ""
    assert missing.stderr == (
        f"error: no dynstate store at {tmp_path / 'nothing'}; check the URL (a store is created "
        "by the run that first writes to it; no dynstate command creates one)\n"
    )
    url = str(tmp_path / "store")
    build(url)
    assert run("show", url, "99", code=1).stderr == (
        f"error: version 99 not found in {url} (latest is 6); `dynstate ls URL` lists them\n"
    )
    assert "no tag 'nope'" in run("head", url, "nope", code=1).stderr
    for args in (["ls", url, "--storage-option", "nokey"], ["ls", url, "--limit", "-1"],
                 ["head", url, "-n", "x"], ["ls"], ["nosuchcommand"]):  # fmt: skip
        result = run(*args, code=2)
        assert "Traceback" not in result.stderr


@pytest.mark.s3
def test_s3_errors_say_what_to_do(s3_endpoint: str) -> None:
    url = s3_url()
    build(url)

    def fails(args: list[str], env: dict[str, str | None], expected: str) -> None:
        full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        # The timeout only guards against a hang; how fast the answer comes is not asserted.
        proc = subprocess.run([console_script(), *args], capture_output=True, text=True,
                              env=full, timeout=300)  # fmt: skip
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.startswith(f"error: {expected}"), proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stdout == ""

    no_creds = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_PROFILE": None,
                "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
                "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
    fails(["ls", url], no_creds, f"no S3 credentials found for {url}; set AWS_ACCESS_KEY_ID")
    fails(["ls", "s3://no-such-bucket/run"], {}, "bucket 'no-such-bucket' does not exist at")
    fails(["ls", f"s3://{S3_BUCKET}/empty-prefix"], {}, f"no dynstate store at s3://{S3_BUCKET}/")
    with closed_port() as port:
        fails(["ls", url], {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"},
              f"cannot reach the S3 endpoint http://127.0.0.1:{port}")  # fmt: skip
    fails(["ls", url], {"AWS_ENDPOINT_URL": "http://127.0.0.1:99999"},
          "the S3 endpoint 'http://127.0.0.1:99999' is not a valid URL")  # fmt: skip
    # No endpoint: AWS itself, in a region whose host does not exist anywhere.
    unset = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "HTTPS_PROXY", "https_proxy", "ALL_PROXY")
    no_endpoint: dict[str, str | None] = dict.fromkeys(unset)
    no_endpoint["AWS_REGION"] = "dynstate-nowhere-1"
    fails(["ls", "s3://some-bucket/run"], no_endpoint,
          "cannot reach AWS S3 at https://s3.dynstate-nowhere-1.amazonaws.com")  # fmt: skip


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A loopback port that refuses connections for as long as it is held: bound but never
    listening, so no other process on the machine can take it (a fixed port such as 1 may be
    served by anything)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.mark.s3
def test_a_404_from_a_non_s3_server_is_not_a_missing_bucket(s3_endpoint: str) -> None:
    """Only S3's own NoSuchBucket answer means a missing bucket: a mistyped endpoint where some
    other HTTP server answers 404 to everything is not reported as one."""
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
        proc = subprocess.run([console_script(), "ls", s3_url()], capture_output=True,
                              text=True, env=env, timeout=300)  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and "does not exist" not in proc.stderr, proc.stderr


class _NotFound(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_PUT = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.s3
def test_s3_endpoint_with_credentials_in_it_is_refused_at_once(s3_endpoint: str) -> None:
    """botocore refuses to sign a request to http://user:secret@host on every attempt: a
    configuration error told at once (no retries, no "retry later"), the secret never shown."""
    url = s3_url()
    build(url)
    secret = "SuperSecretValue123"
    with_creds = s3_endpoint.replace("://", f"://user:{secret}@")
    shown = s3_endpoint.replace("://", "://***@")
    expected = (
        f"error: the S3 endpoint '{shown}' has credentials in it; pass them as AWS_ACCESS_KEY_ID "
        "and AWS_SECRET_ACCESS_KEY (or --storage-option key=... --storage-option secret=...) "
        "and the endpoint as http(s)://host:port\n"
    )
    client_kwargs = f'client_kwargs={{"endpoint_url": "{with_creds}"}}'
    for args, env in (
        (["ls", url], {**os.environ, "AWS_ENDPOINT_URL": with_creds}),
        (["ls", url, "--storage-option", f"endpoint_url={with_creds}"], dict(os.environ)),
        (["-v", "info", url, "--storage-option", client_kwargs], dict(os.environ)),
    ):  # fmt: skip
        proc = subprocess.run([console_script(), *args], capture_output=True, text=True, env=env,
                              timeout=120)  # fmt: skip
        assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
        assert proc.stderr.endswith(expected) and secret not in proc.stderr
        assert "retry" not in proc.stderr


@pytest.mark.s3
def test_malformed_structured_storage_options_are_usage_errors(s3_endpoint: str) -> None:
    url = s3_url()
    build(url)
    secret = "--storage-option", "secret=TopSecretValue9"
    for value, message in [
        (
            "client_kwargs=5",
            'client_kwargs must be a JSON object, e.g. client_kwargs={"region_name"',
        ),
        ("client_kwargs=[1]", "client_kwargs must be a JSON object"),
        ("config_kwargs=7", 'config_kwargs must be a JSON object, e.g. config_kwargs={"retries"'),
        ('config_kwargs={"retries": "x"}', 'the "retries" of config_kwargs must be a JSON object'),
        ('config_kwargs={"retries": {"mode": "weird"}}', "config_kwargs is not a valid botocore"),
        ('config_kwargs={"nope": 1}', "config_kwargs is not a valid botocore Config"),
        ("s3_additional_kwargs=x", "s3_additional_kwargs must be a JSON object"),
    ]:
        result = run("ls", url, "--storage-option", value, *secret, code=2)
        assert "Invalid value for --storage-option: " + message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and "TopSecretValue9" not in result.stderr
        assert "AttributeError" not in result.stderr and "TypeError" not in result.stderr
    ok = run("ls", url, "--storage-option", 'config_kwargs={"retries": {"max_attempts": 3}}')
    assert ok.stdout.startswith(f"store:    {url}\n")


def test_every_command_has_help_with_example() -> None:
    for name in COMMANDS:
        text = run(name, "--help").stdout
        assert "Example:" in text and f"dynstate {name} " in text, name
        assert "--storage-option" in text and "--json" in text, name


def test_every_option_has_help_text() -> None:
    import click

    from dynstate.cli.commands_serve import serve

    commands = {**cli.commands, "serve": serve}
    missing = [
        f"{name} {'/'.join(p.opts)}"
        for name, command in commands.items()
        for p in command.params
        if isinstance(p, click.Option) and not p.help
    ]
    assert missing == []


# -- the installed console script --------------------------------------------------------------


def console_script() -> str:
    path = shutil.which("dynstate") or os.path.join(os.path.dirname(sys.executable), "dynstate")
    assert os.path.exists(path), "the dynstate console script is not installed"
    return path


def test_console_script_help_and_ls_import_nothing_heavy(tmp_path) -> None:
    url = str(tmp_path / "store")
    build(url)
    probe = (
        "import sys\nfrom dynstate.cli import main\nsys.argv[0] = 'dynstate'\n"
        "try:\n    main()\nfinally:\n"
        f"    print(sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
    )
    for args in (["--help"], ["ls", url], ["show", url], ["diff", url, "1", "6"]):
        proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True,
                              text=True)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.strip() == "[]", (args, proc.stderr)
    bare = (
        "import sys\nimport dynstate.cli\n"
        "print(sorted(set(sys.modules) & {'pyarrow', 'fsspec', 'rich'}))"
    )
    assert subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"  # fmt: skip
    proc = subprocess.run([console_script(), "--help"], capture_output=True, text=True, check=True)
    for name in COMMANDS:
        assert f"  {name} " in proc.stdout
    assert "Exit codes" in proc.stdout


@pytest.mark.s3
def test_console_script_ls_verify_and_storage_option_on_s3(s3_endpoint: str) -> None:
    url = s3_url()
    store = build(url)
    proc = subprocess.run(
        [console_script(), "ls", url, "--json"], capture_output=True, text=True, check=True
    )
    assert [r["version"] for r in json.loads(proc.stdout)] == [6, 5, 2, 1, 0]
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    args = [console_script(), "ls", url, "--storage-option", f"endpoint_url={s3_endpoint}"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "gen-b" in proc.stdout and "head" in proc.stdout
    rel = corrupt(url, store, "missing file")
    proc = subprocess.run([console_script(), "verify", url], capture_output=True, text=True)
    assert proc.returncode == 1 and rel in proc.stdout and proc.stderr.startswith("error: ")


# -- inspect -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["epoch", "mix"])
def test_inspect_names_the_training_step_apart_from_the_sampler_counters(tmp_path, mode) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    import resume_harness as h
    import torch

    from dynstate import find_sampler_state

    cfg = h.Config(url=str(tmp_path / "store"), steps=7, batch_size=3, mode=mode, ckpt_every=3)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    h.train(cfg, ckpt_dir=str(ckpt), stop_after=3)
    folder = tmp_path / "checkpoints" / "global_step_14"  # verl's layout; any step number
    folder.mkdir(parents=True)
    shutil.copy(ckpt / "latest.pt", folder / "data.pt")
    state = find_sampler_state(torch.load(folder / "data.pt", weights_only=True))
    info = json.loads(run("inspect", str(folder), "--json").stdout)
    assert info["training_step"] == 14 and info["step"] == state["step"]
    lines = run("inspect", str(folder)).stdout.splitlines()
    fields = dict(line.split(":", 1) for line in lines[:7])
    assert fields["training step"].strip() == "14 (folder global_step_14)"
    assert fields["sampler counters"].strip() == (
        f"epoch {state['epoch']}, position {state['position']:,}, "
        f"batches handed out {state['step']:,}"
    )
    assert f"pinned version {state['version']}," in fields["sampler"]
    huge = json.loads(run("inspect", str(folder), "-n", HUGE, "--json").stdout)
    assert huge["next_indices"][: len(info["next_indices"])] == info["next_indices"]
    plain = tmp_path / "elsewhere.pt"
    shutil.copy(ckpt / "latest.pt", plain)
    assert json.loads(run("inspect", str(plain), "--json").stdout)["training_step"] is None


def _on_a_terminal(args: list[str], answer: bytes) -> tuple[int, str]:
    """Run the console script with a pseudo-terminal as stdin/stdout/stderr; answer its prompt."""
    import pty
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen([console_script(), *args], stdin=slave, stdout=slave, stderr=slave,
                            env={**os.environ, "COLUMNS": "100"})  # fmt: skip
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 60
    answered = False
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
        if not answered and b"[y/N]" in out:
            os.write(master, answer)
            answered = True
    os.close(master)
    return proc.wait(timeout=30), out.decode(errors="replace")


def test_gc_asks_on_a_terminal_and_deletes_only_on_yes(tmp_path) -> None:
    url = str(tmp_path / "store")
    build(url)
    before = files_of(url)
    code, out = _on_a_terminal(["gc", url, "--keep", "2", "--grace", "0"], b"n\n")
    assert code == 0 and "would remove " in out and "remove 3 files" in out
    assert "nothing removed: pass --yes" in out and files_of(url) == before
    code, out = _on_a_terminal(["gc", url, "--keep", "2", "--grace", "0"], b"y\n")
    assert code == 0 and f"{url}: removed 3 files" in out
    gone = re.findall(r"removed ((?:_dynstate|data)/\S+) \(", out)  # after the bar's escapes
    assert len(gone) == 3
    assert all(os.path.join(url, rel) in before for rel in gone)
    assert not any(os.path.exists(os.path.join(url, rel)) for rel in gone)


def test_export_overwrite_asks_on_a_terminal_and_replaces_only_on_yes(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = build(url)
    out = tmp_path / "rows.parquet"
    run("export", url, "1", str(out))
    before = out.read_bytes()
    code, text = _on_a_terminal(["export", url, str(out), "--overwrite"], b"n\n")
    assert code == 1 and f"would replace {out} (a file of " in text
    assert f"replace {out}? [y/N]" in text and "not replaced: pass --yes" in text
    assert out.read_bytes() == before
    code, text = _on_a_terminal(["export", url, str(out), "--overwrite"], b"y\n")
    assert code == 0 and f"(8 rows) to {out}, replacing a file of " in text
    assert pq.read_table(out).to_pylist() == store.snapshot().to_arrow().to_pylist()


def test_ls_shows_the_newest_20_on_a_terminal_and_all_when_piped(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    for step in range(25):
        store.append([], meta={"step": step})
    code, out = _on_a_terminal(["ls", url], b"")
    assert code == 0 and "(6 older versions not shown: --limit N shows more, --limit 0 all)" in out
    listed = [line.split()[0] for line in out.splitlines()[6:] if line[:8].strip().isdigit()]
    assert listed == [str(v) for v in range(25, 5, -1)]
    piped = json.loads(run("ls", url, "--json").stdout)
    assert [r["version"] for r in piped] == list(range(25, -1, -1))


# -- secrets -----------------------------------------------------------------------------------

SLASH_SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY/CLIKEY01"


def test_a_secret_with_a_slash_never_appears_in_output_or_errors(tmp_path) -> None:
    """Through the installed command: a secret holding "/" and "+" (AWS secret keys do), from
    the environment, a storage option or a URL's userinfo, is in no output and no error."""
    from urllib.parse import quote

    option_secret = "Opt/Secret+Value/42"
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append(
        [{"text": f"a row quoting {SLASH_SECRET}", "link": "https://u:pa/ss@h/x"}],
        meta={"step": 0, "note": f"http://AKID:{SLASH_SECRET}@h/x", "opt": option_secret,
              "signed": "https://b/k?X-Amz-Signature=0ddba11/x&X-Amz-Credential=AK/1"},
    )  # fmt: skip
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": SLASH_SECRET, "COLUMNS": "100"}
    opt = ["--storage-option", f"secret={option_secret}"]
    outputs = []
    for args in (["show", url, *opt], ["show", url, "--json", *opt], ["head", url, *opt],
                 ["head", url, "--jsonl", *opt], ["ls", url, *opt],
                 ["ls", f"{tmp_path}/{SLASH_SECRET}", *opt],
                 ["-vv", "ls", f"{tmp_path}/{SLASH_SECRET}", *opt],
                 ["ls", f"{tmp_path}/{option_secret}", *opt],
                 ["ls", f"sftp://user:{SLASH_SECRET}@127.0.0.1:1/x"],
                 ["ls", f"http://user:{quote(option_secret, safe='')}@127.0.0.1:1/x"]):  # fmt: skip
        proc = subprocess.run([console_script(), *args], capture_output=True, text=True,
                              env=env, timeout=120)  # fmt: skip
        outputs.append(proc.stdout + proc.stderr)
        assert proc.returncode in (0, 1), (args, proc.stderr)
    joined = "\n".join(outputs)
    assert "***" in joined and "error: " in joined
    assert "Traceback" in joined  # -vv logged the failure's traceback, scrubbed too
    for part in (SLASH_SECRET, quote(SLASH_SECRET, safe=""), "K7MDENG", option_secret,
                 quote(option_secret, safe=""), "Opt/Secret", "pa/ss", "0ddba11"):  # fmt: skip
        assert part not in joined, part
