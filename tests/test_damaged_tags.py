"""One damaged tag file does not hide a store's history, and it can be repaired.

Through the installed ``dynstate`` console script, as a user meets it: ``ls``, ``info``,
``show`` and ``tags`` list what can be read and warn (naming the file and the fix);
``tag NAME --delete`` removes the damaged tag (the fix the warning names) and ``tag --force``
replaces it; gc, which must keep every tagged version, refuses to run until then and says how."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dynstate import Store
from dynstate.errors import CorruptStoreError

DAMAGE = {
    "not json": lambda text: "{not json",
    # Another version, the checksum left as it was (in whatever layout the file has).
    "checksum": lambda text: json.dumps({**json.loads(text), "version": 2}),
    "empty": lambda text: "",
}


def dynstate(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("dynstate") or os.path.join(os.path.dirname(sys.executable), "dynstate")
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=120)


def damaged_store(tmp_path: Path, damage: str) -> tuple[str, Path]:
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    store.append([{"id": 1}])
    store.tag("good", 1)
    store.append([{"id": 2}])
    store.tag("bad", 1)
    tag = tmp_path / "s" / "_dynstate" / "tags" / "bad.json"
    tag.write_text(DAMAGE[damage](tag.read_text()))
    return url, tag


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_listings_warn_and_show_the_rest(tmp_path: Path, damage: str) -> None:
    url, _ = damaged_store(tmp_path, damage)
    fix = f"dynstate tag {url} bad --delete"
    for command in ("ls", "info", "show", "tags"):
        proc = dynstate(command, url)
        assert proc.returncode == 0, (command, proc.stderr)
        assert "bad.json" in proc.stderr and fix in proc.stderr, (command, proc.stderr)
        assert "reset to an earlier version" not in proc.stderr  # a reset cannot fix a tag
    listed = json.loads(dynstate("tags", url, "--json").stdout)
    assert [(t["name"], t["version"]) for t in listed] == [("good", 1)]
    summary = json.loads(dynstate("info", url, "--json").stdout)
    assert summary["tags"] == {"good": 1} and summary["head"] == 2


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_gc_refuses_until_the_damaged_tag_is_deleted(tmp_path: Path, damage: str) -> None:
    url, tag = damaged_store(tmp_path, damage)
    proc = dynstate("gc", url, "--yes")
    assert proc.returncode == 1
    assert "bad.json" in proc.stderr and f"dynstate tag {url} bad --delete" in proc.stderr
    with pytest.raises(CorruptStoreError, match="--delete"):
        Store.open(url).tags()

    proc = dynstate("tag", url, "bad", "--delete", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "url": url, "tag": "bad", "version": None, "deleted": True
    }  # fmt: skip
    assert not tag.exists()
    assert Store.open(url).tags() == {"good": 1}
    assert dynstate("gc", url, "--yes").returncode == 0
    assert dynstate("tag", url, "bad", "--delete").returncode == 1  # gone: a missing tag


def test_force_replaces_a_damaged_tag_and_plain_tag_refuses(tmp_path: Path) -> None:
    url, _ = damaged_store(tmp_path, "not json")
    proc = dynstate("tag", url, "bad", "2")
    assert proc.returncode == 1 and "--delete" in proc.stderr
    assert dynstate("tag", url, "other", "2").returncode == 0  # other tags are unaffected
    assert dynstate("tag", url, "bad", "2", "--force").returncode == 0
    assert Store.open(url).tags() == {"bad": 2, "good": 1, "other": 2}
