"""Decoded shards kept on local disk and mapped by later readers (dynstate/loading/cache.py,
``Decoded``), on by default for local stores: every read through them gives the rows the
shard files hold (the oracle: each shard read whole with pyarrow, then ``take``), and a shard
changed on disk after it was decoded is still found and refused, as without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynstate import CorruptStoreError, Store, VersionedDataset
from dynstate import decoded as decoded_module
from dynstate.loading import cache as cache_module

# The fresh round's kept tables would answer this process's reads of its own shards.
pytestmark = pytest.mark.usefixtures("decode_what_this_process_wrote")


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default folder of decoded files, under this test's own temporary directory."""
    monkeypatch.delenv("DYNSTATE_DECODED_CACHE", raising=False)
    monkeypatch.setattr(decoded_module.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(decoded_module, "_default", {})
    return tmp_path / "tmp" / f"dynstate-decoded-{os.geteuid()}"


def _store(tmp_path: Path, rounds: int = 4, rows: int = 3000) -> tuple[Store, Path]:
    root = tmp_path / "s"
    store = Store.open(str(root), create=True)
    for r in range(rounds):
        ids = np.arange(r * rows, (r + 1) * rows)
        store.append(
            pa.table(
                {
                    "id": pa.array(ids, pa.int64()),
                    "prompt": pa.array([f"round {r} task {i}" for i in ids.tolist()]),
                    "score": pa.array(ids / 7.0),
                }
            )
        )
    # A shard file changed within the last clock tick is not named for a decoded file yet.
    time.sleep(decoded_module._RACY_NS / 1e9)
    return store, root


def _oracle(store: Store, root: Path, idx: list[int]) -> list[dict]:
    """The shards read whole with pyarrow from their files, then ``take``."""
    snap = store.snapshot()
    whole = pa.concat_tables([pq.read_table(root / s.path) for s in snap.shards])
    return whole.take(pa.array(idx, pa.int64())).to_pylist()


def _decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count whole-shard Parquet decodes from here on."""
    calls: list[int] = []
    real = cache_module.read_parquet

    def counted(data):
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(cache_module, "read_parquet", counted)
    return calls


def _read_elsewhere(root: Path, tmp: Path, idx: list[int], pyarrow: str | None = None) -> dict:
    """``read_batch(idx)`` in a fresh interpreter (as a spawned DataLoader worker), counting
    its whole-shard Parquet decodes; ``pyarrow``: the version that interpreter's pyarrow
    says it is."""
    program = textwrap.dedent(
        """
        import json, sys, tempfile
        tempfile.tempdir = sys.argv[2]
        if len(sys.argv) > 4:
            import pyarrow
            pyarrow.__version__ = sys.argv[4]
        import dynstate.loading.cache as c
        calls = []
        real = c.read_parquet
        c.read_parquet = lambda data: calls.append(1) or real(data)
        from dynstate import VersionedDataset
        rows = VersionedDataset(sys.argv[1]).read_batch(json.loads(sys.argv[3]))
        print(json.dumps({"rows": rows, "decodes": len(calls)}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", program, str(root), str(tmp), json.dumps(idx)]
        + ([pyarrow] if pyarrow else []),
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "DYNSTATE_DECODED_CACHE"},
    )
    return json.loads(out.stdout)


def _indices(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, 700).tolist()
    return idx + idx[:50] + [n - 1, 0, n - 1]  # unsorted, with repeats


def test_a_later_reader_maps_what_an_earlier_one_decoded(tmp_path, folder, monkeypatch):
    """The first dataset decodes each shard once and leaves a file per shard (and per block)
    in the default folder; a second one, with a cache of its own, maps them: no decode, and
    the same rows as the shard files, in the order asked, repeats included."""
    store, root = _store(tmp_path)
    n = store.snapshot().num_rows
    every = list(range(n))
    first = VersionedDataset(str(root))
    assert first.read_batch(every) == _oracle(store, root, every)
    files = sorted(p.name for p in folder.iterdir())
    assert len([f for f in files if f.endswith(".arrow")]) >= 4, files
    assert folder.stat().st_mode & 0o777 == 0o700

    decodes = _decodes(monkeypatch)
    second = VersionedDataset(str(root))
    for seed in range(3):
        idx = _indices(n, seed)
        assert second.read_batch(idx) == _oracle(store, root, idx)
        assert second.read_batch(idx, "arrow").to_pylist() == _oracle(store, root, idx)
    assert [second[i] for i in (5, n - 1, 3001)] == _oracle(store, root, [5, n - 1, 3001])
    assert decodes == []


@pytest.mark.parametrize("damage", ["flip", "flip, times set back", "cut", "swapped"])
def test_a_shard_changed_after_it_was_decoded_is_refused(tmp_path, folder, monkeypatch, damage):
    """A shard damaged on disk after an earlier reader decoded it: a new reader does not take
    the decoded file for it (the file's name holds the shard file's identity and change
    times), so it reads the bytes, verifies them and raises, naming the shard, as it does
    with no decoded files — also when the damage set the file's times back."""
    store, root = _store(tmp_path)
    n = store.snapshot().num_rows
    every = list(range(n))
    VersionedDataset(str(root)).read_batch(every)  # decoded and kept
    ok = [i for i in _indices(n, 7) if not 6000 <= i < 9000]
    expected = _oracle(store, root, ok)  # read before the damage
    shard = store.snapshot().shards[2]
    path = root / shard.path
    before = path.stat()
    data = path.read_bytes()
    if damage.startswith("flip"):
        with open(path, "r+b") as fh:  # in place: same inode, same size
            fh.seek(len(data) // 3)
            fh.write(bytes([data[len(data) // 3] ^ 0xFF]))
        if damage.endswith("back"):
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
            assert path.stat().st_mtime_ns == before.st_mtime_ns
    elif damage == "cut":
        with open(path, "r+b") as fh:
            fh.truncate(len(data) - 10)
    else:  # another shard's bytes under this one's name
        other = root / store.snapshot().shards[1].path
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(other.read_bytes())
        os.replace(tmp, path)

    fresh = VersionedDataset(str(root))
    with pytest.raises(CorruptStoreError, match=shard.path):
        fresh.read_batch(every)
    # The other shards still read through their decoded files, as their files hold.
    assert VersionedDataset(str(root)).read_batch(ok) == expected


def test_off_with_the_switch_and_for_a_folder_others_may_write(tmp_path, folder, monkeypatch):
    """``DYNSTATE_DECODED_CACHE=0`` keeps nothing. A default folder that another user could
    write to is never used: a file put there could make reads return rows no commit wrote."""
    store, root = _store(tmp_path, rounds=2)
    every = list(range(store.snapshot().num_rows))
    monkeypatch.setenv("DYNSTATE_DECODED_CACHE", "0")
    assert VersionedDataset(str(root)).read_batch(every) == _oracle(store, root, every)
    assert not folder.exists()

    monkeypatch.delenv("DYNSTATE_DECODED_CACHE")
    folder.mkdir()
    folder.chmod(0o777)
    decodes = _decodes(monkeypatch)
    for _ in range(2):
        assert VersionedDataset(str(root)).read_batch(every) == _oracle(store, root, every)
    assert list(folder.iterdir()) == []
    assert len(decodes) == 4  # each dataset decoded both shards: nothing was kept

    if os.geteuid() == 0:  # a folder of another user, even one only it may write to
        folder.chmod(0o700)
        os.chown(folder, 65534, 65534)
        monkeypatch.setattr(decoded_module, "_default", {})
        assert VersionedDataset(str(root)).read_batch(every) == _oracle(store, root, every)
        assert list(folder.iterdir()) == []
        assert len(decodes) == 6


def test_the_folder_is_bounded_in_bytes_across_stores(tmp_path, folder, monkeypatch):
    """One folder for every store, kept under the reader's cache size (oldest files first
    out); what was trimmed is decoded again, the same rows."""
    store, root = _store(tmp_path, rounds=6)
    every = list(range(store.snapshot().num_rows))
    one = pq.read_table(root / store.snapshot().shards[0].path).get_total_buffer_size()
    bound = int(2.5 * one)
    ds = VersionedDataset(str(root), cache_bytes=bound)
    assert ds.read_batch(every) == _oracle(store, root, every)
    sizes = [p.stat().st_size for p in folder.iterdir() if p.name.endswith(".arrow")]
    assert len(sizes) >= 1 and sum(sizes) <= bound
    again = VersionedDataset(str(root), cache_bytes=bound)
    assert again.read_batch(every[::-1]) == _oracle(store, root, every[::-1])


def test_another_process_maps_what_this_one_decoded(tmp_path, folder):
    """Another process (a fresh interpreter, as a spawned DataLoader worker is) reads the
    shards through the files this one left, with no Parquet decode, and gets the rows the
    shard files hold."""
    store, root = _store(tmp_path)
    n = store.snapshot().num_rows
    VersionedDataset(str(root)).read_batch(list(range(n)))
    idx = _indices(n, 3)
    got = _read_elsewhere(root, folder.parent, idx)
    assert got["decodes"] == 0
    assert got["rows"] == _oracle(store, root, idx)


def test_an_interpreter_with_another_pyarrow_decodes_its_own(tmp_path, folder):
    """Files are named by the decoding code too: an interpreter whose pyarrow is another
    version maps none of this one's files (its decode could give other types), decodes, and
    writes its own, which this one then does not map either; both read the shard files' rows."""
    store, root = _store(tmp_path)
    n = store.snapshot().num_rows
    VersionedDataset(str(root)).read_batch(list(range(n)))
    idx = _indices(n, 5)
    other = _read_elsewhere(root, folder.parent, idx, pyarrow="99.0.0")
    assert other["decodes"] == len(store.snapshot().shards)
    assert other["rows"] == _oracle(store, root, idx)
    mine = _read_elsewhere(root, folder.parent, idx)
    assert mine["decodes"] == 0 and mine["rows"] == other["rows"]
    # the other interpreter's files are there, beside this one's, and not taken by it
    assert len(list(folder.glob("*.arrow"))) > len(store.snapshot().shards)
    again = _read_elsewhere(root, folder.parent, idx, pyarrow="99.0.0")
    assert again["decodes"] == 0 and again["rows"] == other["rows"]


def test_a_shard_mapped_under_a_wider_schema_is_conformed(tmp_path, folder):
    """A shard read under a wider schema (a column added later) is conformed after the map,
    as after a decode: the decoded file holds the shard as written."""
    store, root = _store(tmp_path, rounds=2)
    VersionedDataset(str(root)).read_batch(list(range(6000)))
    store.append(
        pa.table(
            {
                "id": pa.array([6000], pa.int64()),
                "prompt": pa.array(["late"]),
                "score": pa.array([1.0]),
                "extra": pa.array(["x"]),
            }
        ),
        allow_new_columns=True,
    )
    got = VersionedDataset(str(root)).read_batch([0, 5999, 6000, 3])
    assert [r.get("extra") for r in got] == [None, None, "x", None]
    assert [r["id"] for r in got] == [0, 5999, 6000, 3]


def test_a_shard_changed_within_the_clock_tick_is_decoded_not_named(tmp_path, folder):
    """A shard file whose change time is newer than the file system's clock tick gets no
    decoded file yet (a change in the same tick could leave the same times); once older it
    does."""
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append(pa.table({"id": pa.array(range(100), pa.int64())}))
    shard = store.snapshot().shards[0]
    decoded = decoded_module.Decoded(None, 2**30)
    assert decoded.name(store, shard) is None
    time.sleep(decoded_module._RACY_NS / 1e9)
    name = decoded.name(store, shard)
    assert name is not None and decoded.name(store, shard) == name


def test_the_committing_process_leaves_the_decoded_files_of_its_round(tmp_path, folder):
    """A round's shards are written as decoded files by the commit itself (from the table the
    committing process keeps, exactly what a decode gives), so the first read in another
    process maps them: no decode, the rows of the shard files. Rounds too small to be worth a
    file (a decode of ~0.1 ms) leave none."""
    from dynstate import fresh

    store, root = _store(tmp_path, rounds=1, rows=100)  # ~4 KiB: no file
    assert not folder.exists() or list(folder.iterdir()) == []
    fresh.FRESH.max_bytes = 64 * 2**20  # this module turns kept tables off; a writer has them
    ids = np.arange(100, 20100)
    store.append(
        pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "prompt": pa.array([f"later task {i} " + "x" * 64 for i in ids.tolist()]),
                "score": pa.array(ids / 3.0),
            }
        ),
        shard_bytes=512 * 1024,  # several shards of one round, each worth a file
    )
    shards = store.snapshot().shards[1:]
    assert len(shards) > 1
    assert len([p for p in folder.iterdir() if p.name.endswith(".arrow")]) == len(shards)
    time.sleep(decoded_module._RACY_NS / 1e9)
    idx = [int(i) for i in np.random.default_rng(5).permutation(np.arange(100, 20100))[:600]]
    idx += idx[:20]
    got = _read_elsewhere(root, folder.parent, idx)
    assert got["decodes"] == 0
    assert got["rows"] == _oracle(store, root, idx)


def test_a_round_passed_as_a_slice_of_a_larger_table_is_kept_and_written(tmp_path, folder):
    """A round given as a slice of a larger table (buffers shared with all of it) is kept by
    its size, not its parent's: the commit writes its decoded file, which another process
    maps."""
    from dynstate import fresh

    fresh.FRESH.max_bytes = 64 * 2**20
    ids = np.arange(400_000)
    big = pa.table(  # ~36 MB: over an eighth of the kept tables' bound
        {
            "id": pa.array(ids, pa.int64()),
            "prompt": pa.array(np.char.add("task ", ids.astype(str)).tolist()),
            "score": pa.array(ids / 9.0),
        }
    )
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append(big.slice(1000, 20_000))
    assert len([p for p in folder.iterdir() if p.name.endswith(".arrow")]) == 1
    time.sleep(decoded_module._RACY_NS / 1e9)
    idx = [19_999, 0, 7, 7, 12_345]
    got = _read_elsewhere(tmp_path / "s", folder.parent, idx)
    assert got["decodes"] == 0
    assert got["rows"] == _oracle(store, tmp_path / "s", idx)


def test_files_are_this_users_alone_and_another_users_file_is_not_read(
    tmp_path, folder, monkeypatch
):
    """Decoded files are written readable by their user only (the rows of a store are no
    one else's to read), and a file in the folder that is not the user's own — put there by
    someone who could write to it at some point — is never mapped: the shard is decoded."""
    store, root = _store(tmp_path, rounds=2)
    every = list(range(store.snapshot().num_rows))
    VersionedDataset(str(root)).read_batch(every)
    files = [p for p in folder.iterdir() if p.name.endswith(".arrow")]
    assert files and all(p.stat().st_mode & 0o077 == 0 for p in files)
    if os.geteuid() != 0:
        pytest.skip("handing a file to another user needs root")
    for p in files:
        os.chown(p, 65534, 65534)
    decodes = _decodes(monkeypatch)
    assert VersionedDataset(str(root)).read_batch(every) == _oracle(store, root, every)
    assert len(decodes) == 2


def test_a_folder_replaced_after_its_check_gets_no_file(tmp_path, folder, monkeypatch):
    """The default folder is checked once a process; if it is then deleted (a /tmp cleaner)
    and made again by someone whom it lets write, or who owns it, nothing is written there."""
    store, root = _store(tmp_path, rounds=2)
    every = list(range(store.snapshot().num_rows))
    VersionedDataset(str(root), cache_bytes=2**30).read_batch(every[:10])  # checked: ours
    for p in folder.iterdir():
        p.unlink()
    folder.chmod(0o777)  # as if made again by another user, open to all
    VersionedDataset(str(root)).read_batch(every)
    assert list(folder.iterdir()) == []


def _count_decodes_into(path: str) -> None:
    """A loader worker's init: count its whole-shard Parquet decodes in the file ``path``."""
    real = cache_module.read_parquet

    def counted(data):
        with open(path, "a") as fh:
            fh.write("decode\n")
        return real(data)

    cache_module.read_parquet = counted


def test_spawned_loader_workers_map_the_rounds_the_commits_wrote(tmp_path, folder, monkeypatch):
    """A ``StatefulDataLoader`` with two spawned workers over a store whose rounds this
    process committed: the workers map the decoded files the commits wrote (no decode in
    either), and the batches hold the shard files' rows in the sampler's order."""
    import functools

    from torchdata.stateful_dataloader import StatefulDataLoader

    from dynstate import fresh

    # The workers find the files in this test's temporary directory, as spawned children
    # of a process whose TMPDIR it is.
    monkeypatch.setenv("TMPDIR", str(folder.parent))
    fresh.FRESH.max_bytes = 64 * 2**20
    root = tmp_path / "s"
    store = Store.open(str(root), create=True)
    for r in range(3):
        ids = np.arange(r * 8000, (r + 1) * 8000)
        store.append(
            pa.table(
                {
                    "id": pa.array(ids, pa.int64()),
                    "prompt": pa.array([f"round {r} task {i} " + "y" * 40 for i in ids.tolist()]),
                }
            )
        )
    assert len([p for p in folder.iterdir() if p.name.endswith(".arrow")]) == 3
    time.sleep(decoded_module._RACY_NS / 1e9)
    counter = tmp_path / "decodes.txt"
    order = np.random.default_rng(2).permutation(24_000)[:3000].tolist()
    order += order[:100]
    loader = StatefulDataLoader(
        VersionedDataset(str(root)),
        batch_size=100,
        sampler=order,
        num_workers=2,
        collate_fn=list,
        multiprocessing_context="spawn",
        worker_init_fn=functools.partial(_call_with, str(counter)),
    )
    got = [row for batch in loader for row in batch]
    assert got == _oracle(store, root, order)
    assert not counter.exists(), counter.read_text()


def _call_with(path: str, worker_id: int) -> None:
    _count_decodes_into(path)


_CONCURRENT = """
import sys, tempfile
tempfile.tempdir = sys.argv[2]
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
from pathlib import Path
from dynstate import Store, VersionedDataset
root, seed, cache = Path(sys.argv[1]), int(sys.argv[3]), int(sys.argv[4])
store = Store.open(str(root))
whole = pa.concat_tables([pq.read_table(root / s.path) for s in store.snapshot().shards])
rng = np.random.default_rng(seed)
for k in range(25):
    ds = VersionedDataset(str(root), cache_bytes=cache)  # a new reader: maps or decodes
    idx = rng.integers(0, whole.num_rows, 300).tolist()
    if ds.read_batch(idx) != whole.take(pa.array(idx)).to_pylist():
        sys.exit(f"rows differ at {k}")
print("ok")
"""


def test_readers_writing_mapping_and_trimming_at_once_read_the_shards_rows(tmp_path, folder):
    """Three processes read the same store at once through new datasets with a bound under
    the store's decoded size: each writes decoded files, maps the others', and trims the
    folder while the others map from it. Every batch is the shard files' rows."""
    store, root = _store(tmp_path, rounds=6)
    one = pq.read_table(root / store.snapshot().shards[0].path).get_total_buffer_size()
    argv = [sys.executable, "-c", _CONCURRENT, str(root), str(folder.parent)]
    procs = [
        subprocess.Popen(
            [*argv, str(s), str(3 * one)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "DYNSTATE_DECODED_CACHE"},
        )
        for s in range(3)
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "ok", err[-2000:]
    sizes = [p.stat().st_size for p in folder.iterdir() if p.name.endswith(".arrow")]
    assert sizes, "no process kept a decoded file"


def _read_all_into(root: str, queue) -> None:
    ds = VersionedDataset(root)
    queue.put(len(ds.read_batch(list(range(len(ds))))))


def test_a_child_forked_while_a_thread_writes_a_decoded_file_writes_its_own(tmp_path, folder):
    """A DataLoader worker forked while another thread of its parent held the decoded files'
    bookkeeping lock reads (and writes decoded files) without waiting on that lock."""
    import multiprocessing

    store, root = _store(tmp_path, rounds=2)
    VersionedDataset(str(root)).read_batch([0])  # the folder checked in the parent
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with decoded_module._FOLDERS_LOCK:  # as a writing thread holds it at the fork
        child = ctx.Process(target=_read_all_into, args=(str(root), queue))
        child.start()
        try:
            assert queue.get(timeout=60) == store.snapshot().num_rows
        finally:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
