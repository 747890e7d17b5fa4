"""`dynstate ls` on S3 reads its header (the oldest kept version's record, the tag listing)
while it reads the rows' records, where that reads nothing twice (issue 23.3): the rows and
the header are what the library says, each object is read once, the tags are listed once."""

from __future__ import annotations

import json

import fsspec
import pytest
from click.testing import CliRunner
from conftest import s3_url

from dynstate import Store
from dynstate.cli import cli
from dynstate.history import summary, version_rows


def _store_on_s3(tmp_path) -> str:
    """30 appends, tags on a version `--limit 10` shows and on one it does not, then a reset
    (so the newest rows are not one straight run of parents) and two more appends."""
    local = str(tmp_path / "store")
    store = Store.open(local, create=True)
    for step in range(30):
        store.append([{"step": step}], meta={"step": step, "generator": "g"})
    store.tag("best", 27)
    store.tag("early", 3)
    store.reset(27)
    for step in range(30, 32):
        store.append([{"step": step}], meta={"step": step})
    url = s3_url()
    fsspec.filesystem("s3").put(local + "/", url[len("s3://") :] + "/", recursive=True)
    return url


@pytest.mark.s3
@pytest.mark.parametrize("limit", [10, 40], ids=["floor below the rows", "floor among them"])
def test_ls_on_s3_header_beside_rows_reads_once(s3_server, tmp_path, limit: int) -> None:
    url = _store_on_s3(tmp_path)
    fresh = Store.open(url)
    want_rows = version_rows(fresh, limit=limit, refresh=False, tags=fresh.tags())
    want_info = summary(Store.open(url), refresh=False)

    mark = s3_server.count()
    listed = CliRunner().invoke(cli, ["ls", url, "--limit", str(limit), "--json"])
    sent = s3_server.since(mark)
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout) == json.loads(json.dumps(want_rows))
    assert [r["tags"] for r in want_rows if r["version"] == 27] == [["best"]]
    gets = [path for method, path, query in sent if method == "GET" and not query]
    # gc.json again after each batch of records below the head (the stray-record check)
    floors = [p for p in gets if p.endswith("/_dynstate/gc.json")]
    assert 1 <= len(floors) <= 4, sorted(gets)
    gets = [p for p in gets if p not in floors]
    assert len(gets) == len(set(gets)), sorted(gets)
    tag_listings = [q for method, _, q in sent if "tags" in q and "list-type" in q]
    assert len(tag_listings) == 1, sent

    table = CliRunner().invoke(cli, ["ls", url, "--limit", str(limit)], env={"COLUMNS": "120"})
    assert table.exit_code == 0, table.output
    assert f"{want_info['versions']} kept" in table.stdout
    assert "tags: best, early" in table.stdout
    best = next(line for line in table.stdout.splitlines() if line.lstrip().startswith("27 "))
    assert "tag best" in best
