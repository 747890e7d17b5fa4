"""What a fresh `dynstate` process pays before its first line of output (issue 23.3): the
commands that only read commit records import no pyarrow or numpy, and on S3 one `ls` reads
no object twice and fetches the records it shows together."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fsspec
import pytest
from conftest import s3_url

from dynstate import Store

HEAVY = ("pyarrow", "numpy", "torch", "pandas", "datasets")

# Runs the commands in one fresh interpreter, as the console script does, then reports which
# heavy modules got imported on the way.
PROBE = """
import json, sys
from dynstate.cli import cli

for args in json.loads(sys.argv[1]):
    try:
        cli(args, prog_name="dynstate")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise SystemExit(f"dynstate {args} exited {exc.code}")
print("IMPORTED " + json.dumps(sorted(m for m in HEAVY if m in sys.modules)))
"""


def _build(url: str, versions: int = 12) -> Store:
    store = Store.open(url, create=True)
    for step in range(versions):
        store.append([{"prompt": f"task {step}", "step": step}], meta={"step": step})
    store.tag("ckpt", 3)
    store.reset(5)
    return store


def _probe(commands: list[list[str]], env: dict[str, str] | None = None) -> tuple[str, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{PROBE}", json.dumps(commands)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "120", **(env or {})},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out, _, imported = done.stdout.rpartition("IMPORTED ")
    return out, json.loads(imported)


def test_reading_commands_import_no_pyarrow(tmp_path) -> None:
    url = str(tmp_path / "store")
    _build(url)
    out, imported = _probe(
        [
            ["ls", url, "--limit", "5"],
            ["ls", url, "--all", "--json"],
            ["info", url],
            ["tags", url],
        ]
    )
    assert imported == [], f"a listing imported {imported}"
    # The commands did their work: the head (a reset to 5), the abandoned versions, the tag.
    assert "reset→5" in out and "abandoned" in out and "ckpt" in out


def test_store_module_imports_no_pyarrow() -> None:
    """Opening a store is the first step of every command; its module pulls in none of
    the row, outcome or write machinery until one is used."""
    code = (
        "import sys, dynstate.store, dynstate.history, dynstate.log; "
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.s3
def test_ls_on_s3_reads_each_object_once(s3_server, tmp_path) -> None:
    """`ls --limit 20` right after opening: store.json and the head hint once each, every
    record once (no second head probe for the summary), whatever the listing shows; gc.json
    once at the open and once after each batch of records below the head (the listing's,
    the summary's), which a stray record below a newer floor would otherwise pass
    (docs/format.md)."""
    local = str(tmp_path / "store")
    store = Store.open(local, create=True)
    for step in range(40):
        store.append([], meta={"step": step})
    url = s3_url()
    fsspec.filesystem("s3").put(local + "/", url[len("s3://") :] + "/", recursive=True)
    mark = s3_server.count()
    out, _ = _probe([["ls", url, "--limit", "20", "--json"]])
    sent = s3_server.since(mark)
    rows = json.loads(out)
    assert [r["version"] for r in rows] == list(range(40, 20, -1))
    gets = [path for method, path, query in sent if method == "GET" and not query]
    floors = [p for p in gets if p.endswith("/_dynstate/gc.json")]
    assert len(floors) == 3, sorted(gets)
    gets = [p for p in gets if p not in floors]
    assert len(gets) == len(set(gets)), sorted(gets)
    records = [p for p in gets if "/_dynstate/log/" in p]
    # The 20 shown, the probe past the head, the oldest kept version's (the summary's).
    assert len(records) == 22, sorted(records)


@pytest.mark.s3
def test_open_and_count_on_s3_reads_no_shard_list(s3_server, tmp_path) -> None:
    """`Store.open(url).snapshot().num_rows` on S3 (issue 23.2): `store.json`, `gc.json`,
    the hint, the head's record and the probe past it, then the snapshot's refresh — at most
    8 GETs and none of a record below the head, a checkpoint, chunk or schema, although the
    head (149) lies 49 records above its checkpoint. Its shard list comes when asked."""
    local = str(tmp_path / "store")
    store = Store.open(local, create=True)
    for step in range(149):
        store.append([{"step": step}], meta={"step": step})
    url = s3_url()
    fsspec.filesystem("s3").put(local + "/", url[len("s3://") :] + "/", recursive=True)
    mark = s3_server.count()
    snap = Store.open(url).snapshot()
    assert snap.num_rows == 149
    gets = [p for method, p, query in s3_server.since(mark) if method == "GET" and not query]
    assert len(gets) <= 8, gets
    named = {"store.json", "gc.json", "_head_hint.json", f"{149:020d}.json", f"{150:020d}.json"}
    assert {p.rsplit("/", 1)[-1] for p in gets} <= named, gets
    assert not [p for p in gets if "/checkpoints/" in p or "/chunks/" in p or "/schemas/" in p]
    assert [s.rows for s in snap.shards] == [1] * 149
