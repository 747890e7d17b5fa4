"""`dynstate export` / `dynstate.export` never touch the store they read: an OUT that is the
store root, lies inside it or contains it is refused before anything is removed, locally (also
through symlinks) and on S3; replacing an existing OUT is a deleting command (plan, then
--yes) and never removes a folder that is not a datasets export."""

from __future__ import annotations

import hashlib
import os

import datasets
import fsspec
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import s3_url

import dynstate
from dynstate import InvalidDataError, Store, StoreExistsError
from dynstate.cli import cli


def run(*args: str, code: int = 0):
    result = CliRunner().invoke(cli, list(args), env={"COLUMNS": "100"}, catch_exceptions=False)
    assert result.exit_code == code, (result.stdout, result.stderr)
    return result


def contents(url: str) -> dict[str, str]:
    """Every file under ``url`` with the sha256 of its bytes."""
    fs, root = fsspec.core.url_to_fs(url)
    return {p: hashlib.sha256(fs.cat_file(p)).hexdigest() for p in fs.find(root)}


def build(url: str) -> Store:
    store = Store.open(url, create=True)
    for i in range(3):
        store.append([{"id": i, "text": f"row {i}"}])
    store.tag("ckpt", 2)
    return store


@pytest.fixture
def runs(tmp_path):
    """runs/run1 (a store) next to someone else's runs/notes.txt, and a datasets export of
    the store inside runs/ (so that an OUT with --overwrite would be replaceable)."""
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "notes.txt").write_text("someone else's file")
    build(str(runs / "run1"))
    return runs


OVERLAPS = [
    ("run1", "parquet", "is the store"),
    ("run1", "datasets", "is the store"),
    (".", "datasets", "contains the store"),
    ("run1/data", "datasets", "lies inside the store"),
    ("run1/_dynstate", "parquet", "lies inside the store"),
    ("run1/data/new.parquet", "parquet", "lies inside the store"),
]


@pytest.mark.parametrize("rel,fmt,where", OVERLAPS)
def test_cli_export_onto_into_or_around_the_store_is_refused(runs, rel, fmt, where) -> None:
    store_url = str(runs / "run1")
    before = contents(str(runs))
    out = os.path.normpath(str(runs / rel))
    result = run("export", store_url, "3", out, "--format", fmt, "--overwrite", "--yes", code=1)
    assert result.stdout == ""
    assert result.stderr == (
        f"error: cannot export to {out}: it {where} at {store_url}, which would be destroyed "
        "or altered; choose an OUT outside the store\n"
    )
    assert contents(str(runs)) == before  # byte-identical, notes.txt included
    assert run("verify", store_url, "--all").stdout.startswith("ok: ")


@pytest.mark.parametrize("rel,fmt,where", OVERLAPS)
def test_api_export_with_overwrite_onto_the_store_is_refused(runs, rel, fmt, where) -> None:
    store = Store.open(str(runs / "run1"))
    before = contents(str(runs))
    with pytest.raises(InvalidDataError, match=f"it {where} at "):
        dynstate.export(store.snapshot(), runs / rel, fmt=fmt, overwrite=True)
    assert contents(str(runs)) == before


def test_symlinks_are_resolved(runs, tmp_path) -> None:
    """A link to the store, or a path through a linked folder, is the store."""
    store_url = str(runs / "run1")
    (tmp_path / "alias").symlink_to(runs / "run1")
    (tmp_path / "parent").symlink_to(runs)
    before = contents(str(runs))
    snap = Store.open(store_url).snapshot()
    for out in (tmp_path / "alias", tmp_path / "parent" / "run1" / "data", tmp_path / "parent"):
        with pytest.raises(InvalidDataError, match="choose an OUT outside the store"):
            dynstate.export(snap, out, fmt="datasets", overwrite=True)
    # ... and the store opened through a link is the same store.
    with pytest.raises(InvalidDataError, match="it is the store"):
        dynstate.export(Store.open(str(tmp_path / "alias")).snapshot(), runs / "run1")
    assert contents(str(runs)) == before


def test_a_sibling_with_a_common_name_prefix_is_not_the_store(runs) -> None:
    store_url = str(runs / "run1")
    out = str(runs / "run1.parquet")
    run("export", store_url, out)
    assert pq.read_table(out).column("id").to_pylist() == [0, 1, 2]


def test_overwrite_shows_the_plan_and_replaces_only_with_yes(runs) -> None:
    store_url = str(runs / "run1")
    out = str(runs / "rows.parquet")
    run("export", store_url, "1", out)
    size = os.path.getsize(out)
    before = contents(str(runs))
    refused = run("export", store_url, out, code=1)
    assert refused.stderr == (
        f"error: {out} exists; choose another path or pass --overwrite to replace it\n"
    )
    # Not on a terminal and no --yes: the plan, nothing replaced, exit 1.
    plan = run("export", store_url, out, "--overwrite", code=1)
    assert plan.stdout == f"would replace {out} (a file of {size} B)\n"
    assert (
        plan.stderr == f"error: {out} not replaced: pass --yes (with --overwrite) to replace it\n"
    )
    assert contents(str(runs)) == before
    done = run("export", store_url, out, "--overwrite", "--yes")
    assert done.stdout == (
        f"would replace {out} (a file of {size} B)\n"
        f"exported version 3 of {store_url} (3 rows) to {out}, replacing a file of {size} B\n"
    )
    assert pq.read_table(out).column("id").to_pylist() == [0, 1, 2]


def test_overwrite_replaces_a_datasets_export_but_never_another_folder(runs, tmp_path) -> None:
    store_url = str(runs / "run1")
    ds = tmp_path / "ds"
    run("export", store_url, "1", str(ds), "--format", "datasets")
    done = run("export", store_url, str(ds), "--format", "datasets", "--overwrite", "--yes")
    assert "replacing a datasets directory of " in done.stdout
    assert datasets.load_from_disk(str(ds))["id"] == [0, 1, 2]
    # A folder that is not a datasets export (a project, a home directory) is never removed.
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('hi')")
    for fmt in ("datasets", "parquet"):
        result = run("export", store_url, str(project), "--format", fmt, "--overwrite", "--yes",
                     code=1)  # fmt: skip
        assert result.stderr == (
            f"error: cannot replace {project}: it is a directory that is not a datasets export "
            "(no dataset_info.json or state.json); choose another OUT, or remove it yourself\n"
        )
    assert (project / "train.py").read_text() == "print('hi')"
    snap = Store.open(store_url).snapshot()
    with pytest.raises(StoreExistsError, match="exists; choose another path"):
        dynstate.export(snap, project)
    with pytest.raises(InvalidDataError, match="not a datasets export"):
        dynstate.export(snap, project, overwrite=True)
    assert os.listdir(project) == ["train.py"]


def test_s3_export_onto_into_or_around_the_store_is_refused(s3_endpoint) -> None:
    prefix = s3_url()
    store_url = f"{prefix}/run1"
    build(store_url)
    fs = fsspec.filesystem("s3")
    fs.pipe_file(f"{prefix[5:]}/other.txt", b"someone else's")
    before = contents(prefix)
    for out, fmt, where in [
        (store_url, "parquet", "is the store"),
        (f"{store_url}/", "datasets", "is the store"),
        (prefix, "datasets", "contains the store"),
        (f"{prefix}/", "datasets", "contains the store"),
        (f"s3a://{prefix[5:]}", "datasets", "contains the store"),
        (f"{store_url}/data", "datasets", "lies inside the store"),
        (f"{store_url}/_dynstate/x.parquet", "parquet", "lies inside the store"),
    ]:
        result = run("export", store_url, "3", out, "--format", fmt, "--overwrite", "--yes",
                     code=1)  # fmt: skip
        assert result.stderr == (
            f"error: cannot export to {out}: it {where} at {store_url}, which would be "
            "destroyed or altered; choose an OUT outside the store\n"
        ), out
        with pytest.raises(InvalidDataError, match=f"it {where} at "):
            dynstate.export(Store.open(store_url).snapshot(), out, fmt=fmt, overwrite=True)
    assert contents(prefix) == before
    # The same bucket, a prefix beside the store: fine.
    run("export", store_url, f"{prefix}/run1-rows.parquet")
    assert run("verify", store_url, "--all").stdout.startswith("ok: ")
