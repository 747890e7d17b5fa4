"""The `dynstate` command line, through click's runner (most tests) and through the installed
console script in a subprocess, on a local store and on s3:// on the loopback S3 server."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import datasets
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import s3_url

from dynstate import Store
from dynstate import manifest as m
from dynstate.cli import cli
from dynstate.plot import growth_points

COMMANDS = ["ls", "show", "head", "verify", "gc", "diff", "tag", "reset", "compact", "export"]
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d{3}Z)?")


def run(*args: str, code: int = 0, env: dict[str, str] | None = None):
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
    """Layout-preserving normalization: timestamps and random ids keep their widths."""
    text = TIMESTAMP.sub(lambda mt: re.sub(r"\d", "0", mt.group()), text)
    text = re.sub(r"\b[0-9a-f]{32}\b", "x" * 32, text)
    text = re.sub(r"\b[0-9a-f]{12}\b", "h" * 12, text)
    text = text.replace(url, "URL")
    return "\n".join(line.rstrip() for line in text.splitlines())


# -- ls ----------------------------------------------------------------------------------------


def test_ls_json_exact(built) -> None:
    url, store = built
    out = json.loads(run("ls", url, "--all", "--json").stdout)
    nbytes = [store.commit_record(v).num_bytes for v in range(7)]
    for row in out:
        assert TIMESTAMP.fullmatch(row.pop("created"))
    common = {"tags": []}
    expected = [
        dict(version=0, op="create", rows_added=0, total_rows=0, shards=0, step=None,
             generator=None, status=None),
        dict(version=1, op="append", rows_added=3, total_rows=3, shards=1, step=0,
             generator="gen-a", status=None),
        dict(version=2, op="append", rows_added=3, total_rows=6, shards=2, step=1,
             generator="gen-a", status=None, tags=["ckpt"]),
        dict(version=3, op="append", rows_added=3, total_rows=9, shards=3, step=2,
             generator="gen-a", status="abandoned"),
        dict(version=4, op="append", rows_added=3, total_rows=12, shards=4, step=3,
             generator="gen-a", status="abandoned"),
        dict(version=5, op="reset", rows_added=0, total_rows=6, shards=2, step=None,
             generator=None, status=None),
        dict(version=6, op="append", rows_added=2, total_rows=8, shards=3, step=4,
             generator="gen-b", status="head"),
    ]  # fmt: skip
    expected = [{**common, **row, "bytes": nbytes[row["version"]]} for row in expected]
    assert out == expected
    # Without --all the abandoned versions are hidden; --limit keeps the newest.
    plain = json.loads(run("ls", url, "--json").stdout)
    assert [r["version"] for r in plain] == [0, 1, 2, 5, 6]
    limited = json.loads(run("ls", url, "--json", "--limit", "2").stdout)
    assert [r["version"] for r in limited] == [5, 6]
    limited_all = json.loads(run("ls", url, "--json", "--all", "--limit", "3").stdout)
    assert [(r["version"], r["status"]) for r in limited_all] == [
        (4, "abandoned"),
        (5, None),
        (6, "head"),
    ]


def test_ls_table_exact(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = build(url)
    b = [store.commit_record(v).num_bytes for v in range(7)]
    assert all(n < 100_000 for n in b)  # the layout below has room for five digits
    out = normalized(run("ls", url, "--all", env={"COLUMNS": "160"}).stdout, url)
    expected = f"""\
URL  head 6  (7 versions shown)

  version   op       rows added   total rows   shards   bytes   step   generator   created               tags   status
 ─────────────────────────────────────────────────────────────────────────────────────────────────────────────────────────
        0   create            0            0        0   {b[0]:>5}                      0000-00-00 00:00:00
        1   append            3            3        1   {b[1]:>5}   0      gen-a       0000-00-00 00:00:00
        2   append            3            6        2   {b[2]:>5}   1      gen-a       0000-00-00 00:00:00   ckpt
        3   append            3            9        3   {b[3]:>5}   2      gen-a       0000-00-00 00:00:00          abandoned
        4   append            3           12        4   {b[4]:>5}   3      gen-a       0000-00-00 00:00:00          abandoned
        5   reset             0            6        2   {b[5]:>5}                      0000-00-00 00:00:00
        6   append            2            8        3   {b[6]:>5}   4      gen-b       0000-00-00 00:00:00          head
"""  # noqa: E501
    assert out.strip("\n") == expected.strip("\n")


# -- show --------------------------------------------------------------------------------------


def test_show_exact(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = build(url)
    rec = store.commit_record(3)
    s = store.snapshot(3).shards
    out = normalized(run("show", url, "3", env={"COLUMNS": "120"}).stdout, url)
    expected = f"""\
version:    3
op:         append
parent:     2
created:    0000-00-00T00:00:00.000Z
status:     abandoned
rows:       9
rows_added: 3
shards:     3
bytes:      {rec.num_bytes}
lineage:    0-3 (4 versions)
meta:       {{"generator": "gen-a", "step": 2}}
            schema

  column   type     nullable
 ────────────────────────────
  id       int64    yes
  text     string   yes

                                      shards

  #   path                                            rows   bytes   sha256
 ─────────────────────────────────────────────────────────────────────────────────
  0   data/{"x" * 32}.parquet   3      {s[0].bytes:<5}   {"h" * 12}
  1   data/{"x" * 32}.parquet   3      {s[1].bytes:<5}   {"h" * 12}
  2   data/{"x" * 32}.parquet   3      {s[2].bytes:<5}   {"h" * 12}
"""
    got = [line for line in out.splitlines() if line.strip()]
    assert got == [line.rstrip() for line in expected.splitlines() if line.strip()]


def test_show_json_tag_and_lineage(built) -> None:
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


# -- head, diff, tag, reset --------------------------------------------------------------------


def test_head_rows_columns_jsonl(built) -> None:
    url, _ = built
    lines = run("head", url, "-n", "4", "--jsonl").stdout.splitlines()
    assert [json.loads(line) for line in lines] == rows(0, 3) + rows(10, 1)
    lines = run("head", url, "4", "--columns", "text", "--jsonl", "-n", "20").stdout.splitlines()
    expected = [0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32]
    assert [json.loads(line) for line in lines] == [{"text": f"row {i}"} for i in expected]
    table = run("head", url, "-n", "2", env={"COLUMNS": "80"}).stdout
    assert "row 0" in table and "row 1" in table and "row 2" not in table
    bad = run("head", url, "--columns", "nope", code=2)
    assert "nope" in bad.stderr and "id, text" in bad.stderr


def test_diff(built) -> None:
    url, store = built
    info = json.loads(run("diff", url, "4", "6", "--json").stdout)
    assert info["rows"] == [12, 8] and info["shared_prefix_rows"] == 6
    assert not info["extends"] and info["schema_change"] is None
    assert [s["path"] for s in info["added"]] == [store.snapshot(6).shards[-1].path]
    assert [s["path"] for s in info["removed"]] == [s.path for s in store.snapshot(4).shards[2:]]
    text = run("diff", url, "ckpt", "head").stdout
    assert "rows:   6 -> 8 (+2)" in text and "version 6 extends version 2" in text


def test_tag_and_reset(built) -> None:
    url, _ = built
    assert "tagged version 4" in run("tag", url, "late", "4").stdout
    moved = run("tag", url, "ckpt", "3", code=1)
    assert moved.stderr.startswith("error: tag 'ckpt'") and "version 2" in moved.stderr
    run("tag", url, "ckpt", "3", "--force")
    assert Store.open(url).resolve("ckpt") == 3
    assert "new head is version 7" in run("reset", url, "late").stdout
    out = json.loads(run("ls", url, "--all", "--json").stdout)
    status = {r["version"]: r["status"] for r in out}
    assert status == {0: None, 1: None, 2: None, 3: None, 4: None, 5: "abandoned",
                      6: "abandoned", 7: "head"}  # fmt: skip


def test_errors_are_one_line_and_redacted(s3_endpoint: str, tmp_path) -> None:
    missing = run("ls", str(tmp_path / "nothing"), code=1)
    assert missing.stderr.startswith("error: no dynstate store at ") and missing.stdout == ""
    secret_url = s3_url().replace("s3://", "s3://AKIDKEY:s3cr3tvalue@")
    for args in (["ls", secret_url], ["verify", secret_url], ["show", secret_url, "1"]):
        result = run(*args, code=1)
        assert "s3cr3tvalue" not in result.stdout + result.stderr
        assert "***@" in result.stderr
    url = str(tmp_path / "store")
    build(url)
    assert "version 99 not found" in run("show", url, "99", code=1).stderr
    assert "no tag 'nope'" in run("head", url, "nope", code=1).stderr
    assert run("gc", url, "--keep", "1", "--older-than", "1d", code=2).exit_code == 2


def test_every_command_has_help_with_example() -> None:
    for name in [*COMMANDS, "plot"]:
        text = run(name, "--help").stdout
        assert "Example:" in text and f"dynstate {name} " in text, name
        assert "--storage-option" in text, name


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
    url, _ = built
    assert run("verify", url).stdout.startswith(f"ok: {url}")
    report = json.loads(run("verify", url, "--all", "--json").stdout)
    assert (
        report["ok"] and report["problems"] == [] and report["versions_checked"] == list(range(7))
    )
    assert report["shards_checked"] == 5  # every distinct shard of every version, once


@pytest.mark.parametrize(
    "kind", ["truncated shard", "flipped byte", "missing file", "tampered record"]
)
def test_verify_catches_corruption(built, kind: str) -> None:
    url, store = built
    rel = corrupt(url, store, kind)
    result = run("verify", url, code=1)
    assert rel in result.stdout, result.stdout
    assert result.stderr.startswith("error: 1 problem(s) in ")
    expected = {
        "truncated shard": "truncated",
        "flipped byte": "does not match its checksum",
        "missing file": "is missing",
        "tampered record": "does not match its checksum",
    }[kind]
    assert expected in result.stdout


def test_verify_names_every_problem_and_checks_old_versions_with_all(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = build(url)
    abandoned_only = store.snapshot(4).shards[3].path  # not part of the head
    fs, root = fsspec.core.url_to_fs(url)
    fs.rm_file(f"{root}/{abandoned_only}")
    run("verify", url)  # the head does not need it
    corrupt(url, store, "tampered record")
    shard = corrupt(url, store, "flipped byte")
    report = json.loads(run("verify", url, "--all", "--json", code=1).stdout)
    assert len(report["problems"]) == 3
    text = "\n".join(report["problems"])
    assert abandoned_only in text and shard in text and m.log_path(3) in text


# -- export, plot, compact ---------------------------------------------------------------------


def test_export_parquet_and_datasets(built, tmp_path) -> None:
    url, store = built
    out = tmp_path / "rows.parquet"
    run("export", url, "4", str(out))
    assert pq.read_table(out).equals(store.snapshot(4).to_arrow())
    assert run("export", url, str(out), code=1).stderr.startswith(f"error: {out} exists")
    run("export", url, str(out), "--overwrite")
    assert pq.read_table(out).to_pylist() == store.snapshot().to_arrow().to_pylist()
    ds_dir = tmp_path / "ds"
    run("export", url, "ckpt", str(ds_dir), "--format", "datasets")
    assert datasets.load_from_disk(str(ds_dir)).to_list() == rows(0, 3) + rows(10, 3)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left


def test_plot_writes_png(tmp_path) -> None:
    url = str(tmp_path / "store")
    build(url)
    out = tmp_path / "growth.png"
    assert "4 versions" in run("plot", url, str(out)).stdout  # 1, 2, 5, 6: the head's lineage
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    label, points = growth_points(Store.open(url))
    assert label == "step"  # the reset (no step of its own) sits at the step before it
    got = [(p["version"], p["x"], p["rows_added"], p["total_rows"]) for p in points]
    assert got == [(1, 0, 3, 3), (2, 1, 3, 6), (5, 1, 0, 6), (6, 4, 2, 8)]


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
    assert "pip install 'dynstate[plot]'" in proc.stderr and proc.stderr.startswith("error: ")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("dynstate.compact") is None,
    reason="dynstate/compact.py (compaction, another issue) is not in this checkout",
)
def test_compact_keeps_rows_in_order_and_reduces_files(durable_url: str) -> None:
    store = Store.open(durable_url, create=True)
    for step in range(6):
        store.append(rows(7 * step, 7), meta={"step": step})
    before = store.snapshot()
    out = run("compact", durable_url, "--target-size", "1MiB").stdout
    after = Store.open(durable_url).snapshot()
    assert f"version {after.version} has {len(after.shards)} shards" in out
    assert len(after.shards) < len(before.shards)
    old, new = before.to_arrow().to_pylist(), after.to_arrow().to_pylist()
    assert len(old) == len(new)
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        assert a == b, f"row {i} differs"
    assert "nothing to compact" in run("compact", durable_url, "--target-size", "1MiB").stdout


# -- the installed console script --------------------------------------------------------------


def console_script() -> str:
    path = shutil.which("dynstate") or os.path.join(os.path.dirname(sys.executable), "dynstate")
    assert os.path.exists(path), "the dynstate console script is not installed"
    return path


def test_console_script_ls_and_verify_on_s3(s3_endpoint: str) -> None:
    url = s3_url()
    store = build(url)
    proc = subprocess.run(
        [console_script(), "ls", url, "--json"], capture_output=True, text=True, check=True
    )
    assert [r["version"] for r in json.loads(proc.stdout)] == [0, 1, 2, 5, 6]
    rel = corrupt(url, store, "missing file")
    proc = subprocess.run([console_script(), "verify", url], capture_output=True, text=True)
    assert proc.returncode == 1 and rel in proc.stdout and proc.stderr.startswith("error: ")


def test_console_script_storage_option_sets_endpoint(s3_endpoint: str) -> None:
    url = s3_url()
    build(url)
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    env["COLUMNS"] = "200"
    args = [console_script(), "ls", url, "--storage-option", f"endpoint_url={s3_endpoint}"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "gen-b" in proc.stdout and "head" in proc.stdout
    bad = subprocess.run([console_script(), "ls", url, "--storage-option", "nokey"],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr


def test_console_script_help_lists_commands() -> None:
    proc = subprocess.run([console_script(), "--help"], capture_output=True, text=True, check=True)
    for name in COMMANDS:
        assert name in proc.stdout
    assert "Exit codes" in proc.stdout


def test_cli_reads_what_the_library_wrote_arrow_types(tmp_path) -> None:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append(pa.table({"x": pa.array([[1, 2], None]), "b": pa.array([b"\x00", b"z"])}))
    lines = run("head", url, "--jsonl").stdout.splitlines()
    assert [json.loads(line)["x"] for line in lines] == [[1, 2], None]
