"""A `dynstate` command that only reads a local store imports no fsspec, s3fs or botocore
(issue 23: `import fsspec` was ~0.1 s of a 0.3 s `ls`): the local backend works out its root
and does its reads with ``os``, and builds fsspec's filesystem only when something asks for
``Storage.fs``. The answers are the ones fsspec's local filesystem gave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pyarrow as pa
import pytest

from dynstate import Store
from dynstate.errors import InvalidDataError
from dynstate.storage import LocalStorage, Storage
from dynstate.storage.connect import LOCAL_OPTIONS, known_options
from dynstate.storage.local import fsspec_local_path

CLIENT_LIBRARIES = ("fsspec", "s3fs", "botocore", "aiobotocore", "aiohttp")
# What only a store in a bucket needs: obstore and the modules that read its configuration,
# and ftplib (whose errors connect translates for ftp://).
BUCKET_ONLY = (
    "dynstate.storage.objectstore",
    "dynstate.storage.s3config",
    "dynstate.storage.s3obstore",
    "obstore",
    "http.client",
    "ftplib",
)
# What a read has no use for and pyarrow imports on first use of some of its calls
# (``pa.array``, ``Array.to_numpy``, ``pq.read_table``): ~0.1-0.2 s of a fresh process's
# first batch or command where pandas is installed, as datasets and verl install it.
HEAVY = ("pandas", "pyarrow.dataset")
CONSOLE_SCRIPT = Path(sys.executable).with_name("dynstate")

# The console script's entry point (pyproject's [project.scripts]) run in a fresh interpreter,
# then a report of the client libraries it imported on the way.
PROBE = (
    """
import json, sys
from dynstate.cli import main

sys.argv = ["dynstate", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit as exc:
    if exc.code not in (0, None):
        raise
print("IMPORTED " + json.dumps(sorted(
    m for m in sys.modules if m.split(".")[0] in LIBRARIES or m in BUCKET_ONLY or m in HEAVY
)), file=sys.stderr)
""".replace("LIBRARIES", repr(CLIENT_LIBRARIES))
    .replace("BUCKET_ONLY", repr(BUCKET_ONLY))
    .replace("HEAVY", repr(HEAVY))
)

COMMANDS = [
    ["ls", "{url}", "--limit", "20"],
    ["ls", "{url}", "--limit", "20", "--json"],
    ["info", "{url}"],
    ["show", "{url}"],
    ["head", "{url}"],
    ["tags", "{url}"],
]


def _env() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "120"}


def _probe(args: list[str]) -> tuple[str, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    imported = done.stderr.rpartition("IMPORTED ")[2]
    return done.stdout, json.loads(imported)


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("lazy") / "store")
    store = Store.open(url, create=True)
    for step in range(25):
        table = pa.table({"prompt": [f"task {step}"], "step": [step]})
        store.append(table, meta={"step": step})
    store.tag("ckpt", 7)
    return url


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:1] + c[2:]))
def test_reading_a_local_store_imports_no_fsspec_nor_pandas(
    store_url: str, command: list[str]
) -> None:
    args = [a.format(url=store_url) for a in command]
    out, imported = _probe(args)
    assert imported == [], f"dynstate {' '.join(args)} imported {imported}"
    if CONSOLE_SCRIPT.exists():
        # the installed command prints the same (the probe is no different program)
        done = subprocess.run(
            [str(CONSOLE_SCRIPT), *args], capture_output=True, text=True, env=_env(), timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == out
    # and it did its work
    if args[-1] == "--json":
        assert [row["version"] for row in json.loads(out)] == list(range(25, 5, -1))
    elif args[0] == "ls":
        assert "version 25" in out and "ckpt" in out
    elif args[0] == "tags":
        assert "ckpt" in out and "7" in out
    elif args[0] == "head":
        assert "task 0" in out and "task 9" in out  # the first rows
    else:
        assert "version 25" in out or "25" in out.split()


READ = """
import json, sys
from dynstate import VersionedDataset

url, fmt = sys.argv[1], sys.argv[2]
ds = VersionedDataset(url, cache_dir=None, row_column="row" if fmt == "arrow" else None)
batch = ds.read_batch([24, 3, 3, 17] * 4, fmt)  # 8 rows of one shard: an Arrow take
rows = batch.to_pylist() if fmt == "arrow" else batch
print(json.dumps(rows))
print("IMPORTED " + json.dumps(sorted(m for m in sys.modules if m in HEAVY)), file=sys.stderr)
""".replace("HEAVY", repr(HEAVY))


@pytest.mark.parametrize("fmt", ["rows", "columns", "arrow"])
def test_a_fresh_process_reads_a_batch_without_importing_pandas(store_url: str, fmt: str) -> None:
    pytest.importorskip("pandas")  # else there is nothing it could import
    done = subprocess.run(
        [sys.executable, "-c", READ, store_url, fmt],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stderr.rpartition("IMPORTED ")[2]) == []
    got = json.loads(done.stdout)
    steps = [24, 3, 3, 17] * 4
    if fmt == "columns":
        assert got == {"prompt": [f"task {s}" for s in steps], "step": steps}
    elif fmt == "rows":
        assert got == [{"prompt": f"task {s}", "step": s} for s in steps]
    else:
        assert got == [{"prompt": f"task {s}", "step": s, "row": s} for s in steps]


def test_short_reading_processes_exit_cleanly_under_load(store_url: str) -> None:
    """A process that reads a batch and exits at once exits 0. Whole shards were decoded on
    pyarrow's threads from Python bytes: a pool thread dropping the last reference while the
    interpreter exited was killed inside a C++ destructor ("terminate called without an
    active exception", SIGABRT, arrow#34314) in ~6 % of such processes on a loaded machine.
    24 of them, 4 at a time (the old code failed this in 2 of 2 runs)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[int, str]:
        fmt = ("arrow", "rows", "columns")[i % 3]
        done = subprocess.run(
            [sys.executable, "-c", READ, store_url, fmt],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return done.returncode, done.stderr[-300:]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(24)))
    failed = [r for r in results if r[0] != 0]
    assert not failed, f"{len(failed)} of 24 exited abnormally: {failed[:3]}"


def test_file_url_and_options_import_no_fsspec(store_url: str) -> None:
    out, imported = _probe(
        ["ls", f"file://{store_url}", "--limit", "1", "--storage-option", "auto_mkdir=true"]
    )
    assert imported == [] and "version 25" in out


def test_unknown_local_option_is_refused_without_fsspec(store_url: str) -> None:
    code = (
        "import sys\n"
        "from dynstate.errors import InvalidDataError\n"
        "from dynstate.storage import open_storage\n"
        "try:\n"
        f"    open_storage({store_url!r}, {{'bogus': 1}})\n"
        "except InvalidDataError as exc:\n"
        "    print(exc)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {CLIENT_LIBRARIES!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    message, imported = done.stdout.strip().splitlines()
    assert imported == "[]"
    assert message == (
        f"unknown storage option 'bogus' for {store_url}; file:// takes "
        + ", ".join(sorted(LOCAL_OPTIONS))
    )


def test_local_options_are_what_fsspec_takes() -> None:
    """LOCAL_OPTIONS is written out so that checking a local store's options imports no
    fsspec; it must stay what fsspec's LocalFileSystem accepts."""
    assert known_options("file") == LOCAL_OPTIONS
    assert known_options("local") == LOCAL_OPTIONS
    with pytest.raises(InvalidDataError, match="unknown storage option 'anon'"):
        LocalStorage("runs/run1", {"anon": True})
    LocalStorage("runs/run1", {"auto_mkdir": True})  # accepted, as by fsspec


FSSPEC_ONLY = {"file:rel", "local:rel"}  # no '//' after the protocol: left to fsspec
ROOTS = [
    "store",
    "runs/run1",
    "runs/run1/",
    "runs//run1//",
    "./store",
    ".",
    "./",
    "../up/store",
    "a/../b",
    "/abs/store",
    "/abs/store/",
    "//abs//store",
    "/",
    "file:///abs/store",
    "file:///abs/store/",
    "file://rel/store",
    "local:///abs/store",
    "local://rel",
    "~",
    "~/store",
    "~/store/",
    "~nosuchuser/store",
    "with space/ünïcode",
    *sorted(FSSPEC_ONLY),
]


@pytest.mark.parametrize("url", ROOTS)
def test_local_root_is_fsspecs(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = fsspec.core.url_to_fs(url)[1]
    expected = root.rstrip("/") if root not in ("/", "") else root  # Storage's rule
    assert LocalStorage(url).root == expected
    assert (fsspec_local_path(url) is None) == (url in FSSPEC_ONLY)


def test_local_reads_answer_as_fsspec_did(tmp_path: Path) -> None:
    """size, modified and list through ``os`` give what the base class's fsspec versions
    give on the same storage, errors included."""
    root = tmp_path / "root"
    (root / "folder" / "sub").mkdir(parents=True)
    (root / "folder" / "b.json").write_bytes(b"12345")
    (root / "folder" / "a.json").write_bytes(b"")
    (root / "folder" / ".hidden").write_bytes(b"x")
    (root / "file").write_bytes(b"abc")
    (root / "link").symlink_to(root / "file")
    (root / "dirlink").symlink_to(root / "folder")
    (root / "broken").symlink_to(root / "nowhere")
    storage = LocalStorage(str(root))

    def same(method: str, rel: str) -> object:
        def outcome(fn: object) -> object:
            try:
                return fn(storage, rel)  # type: ignore[operator]
            except Exception as exc:
                return type(exc)

        new, old = outcome(getattr(LocalStorage, method)), outcome(getattr(Storage, method))
        assert new == old, f"{method}({rel!r}): {new!r}, fsspec's {old!r}"
        return new

    for rel in ("file", "link", "folder/b.json", "folder/a.json", "folder", "dirlink"):
        assert same("size", rel) == os.stat(root / rel).st_size
        assert same("modified", rel) == os.stat(root / rel).st_mtime
    for rel in ("missing", "broken", "folder/missing", "file/below"):
        same("size", rel)
        same("modified", rel)
    with pytest.raises(FileNotFoundError):
        storage.size("missing")
    with pytest.raises(FileNotFoundError):
        storage.modified("broken")

    assert same("list", "folder") == [".hidden", "a.json", "b.json", "sub"]  # folders too
    assert same("list", "dirlink") == [".hidden", "a.json", "b.json", "sub"]
    assert same("list", "") == ["broken", "dirlink", "file", "folder", "link"]
    assert same("list", "folder/") == [".hidden", "a.json", "b.json", "sub"]
    assert same("list", "folder/sub") == []
    assert same("list", "missing") == []
    assert same("list", "broken") == []
    assert same("list", "file") == ["file"]  # fsspec's ls of a file: the file itself
    same("list", "file/below")  # below a file: the same error


def test_filesystem_is_built_on_first_use(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    assert storage._fs is None
    (tmp_path / "x").write_bytes(b"1")
    assert storage.fs.exists(storage.path("x"))
    assert storage._fs is storage.fs


STATS = """
import json, sys
import dynstate

url = sys.argv[1]
store = dynstate.Store.open(url)
stats = store.outcome_stats()
print(json.dumps(stats.to_pydict()))
print("IMPORTED " + json.dumps(sorted(m for m in sys.modules if m in HEAVY)), file=sys.stderr)
""".replace("HEAVY", repr((*HEAVY, "pyarrow.compute")))


def test_a_fresh_process_reads_statistics_without_pandas_or_compute(tmp_path: Path) -> None:
    """Issue 45.3: pyarrow's to_numpy and pa.array(ndarray) import pandas at their first call
    and pyarrow.compute costs ~40 ms: a fresh process's statistics need neither. The values
    are checked against a fold of the raw records written here, the aggregate included."""
    pytest.importorskip("pandas")
    import dynstate

    url = str(tmp_path / "s")
    store = dynstate.Store.open(url, create=True)
    store.append([{"x": i} for i in range(7)])
    want: dict[int, list[float]] = {}
    for step in range(130):  # past the stored aggregate of every 100 versions
        rows = [(step * 5 + k) % 7 for k in range(3)] + [3]
        scores = [float((r + step) % 3 == 0) for r in rows]
        store.append(
            [], meta={"step": step}, outcomes={"row": rows, "step": [step] * 4, "score": scores}
        )
        for r, s in zip(rows, scores, strict=True):
            want.setdefault(r, []).append(s)
    done = subprocess.run(
        [sys.executable, "-c", STATS, url], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stderr.rpartition("IMPORTED ")[2]) == []
    got = json.loads(done.stdout)
    assert got["row"] == list(range(7))
    assert got["attempts"] == [len(want.get(r, [])) for r in range(7)]
    assert got["successes"] == [sum(s > 0.5 for s in want.get(r, [])) for r in range(7)]
    assert got["mean_score"] == [
        sum(want[r]) / len(want[r]) if r in want else None for r in range(7)
    ]
