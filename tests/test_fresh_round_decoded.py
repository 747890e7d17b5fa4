"""A fresh round's shards kept decoded after the commit that wrote them (issue 45.4,
:mod:`dynstate.fresh`), against a plain oracle (SPEC §3.16): the shards a separate handle lists
for the version, read whole with ``pyarrow.parquet`` and concatenated, then ``take``.

A generator loop — many small rounds, each followed by a batch over the new head — reads only
tables this process kept (no Parquet decode, no shard read), through a reset to an earlier
version and the rounds after it, and a schema that widens; the kept tables are what a decode
of their files gives, for every column type they are kept for; a round passed as an Arrow
table whose buffers the caller changes afterwards reads as committed; another handle in the
process takes them too, and another process decodes the files."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dynstate
from dynstate import Store, VersionedDataset, fresh
from dynstate.loading import cache, ranged

FORMATS = ("rows", "columns", "arrow")


@pytest.fixture(autouse=True)
def kept() -> Iterator[fresh.FreshShards]:
    """The process's fresh tables, on and empty for the test, as they were after it."""
    bound = fresh.FRESH.max_bytes
    fresh.FRESH.max_bytes = 64 * 2**20
    fresh.FRESH.clear()
    yield fresh.FRESH
    fresh.FRESH.clear()
    fresh.FRESH.max_bytes = bound


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    return f"memory://fresh-{tmp_path.name}"


class Decodes:
    """Counts every Parquet decode and shard read of the dataset read path, and names the
    shards decoded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.whole = 0
        self.groups = 0
        self.shard_reads = 0
        self.paths: set[str] = set()
        whole, groups, read = cache.read_parquet, cache.read_groups, Store.read_shard_bytes

        def count_whole(data):
            self.whole += 1
            return whole(data)

        def count_groups(store, wanted, *args, **kwargs):
            self.groups += 1
            self.paths.update(s.path for s, _ in wanted)
            return groups(store, wanted, *args, **kwargs)

        def count_reads(store, shard, *args, **kwargs):
            self.shard_reads += 1
            self.paths.add(shard.path)
            return read(store, shard, *args, **kwargs)

        monkeypatch.setattr(cache, "read_parquet", count_whole)
        monkeypatch.setattr(cache, "read_groups", count_groups)
        monkeypatch.setattr(Store, "read_shard_bytes", count_reads)
        assert ranged.read_groups is groups  # the cache calls the name it imported

    @property
    def total(self) -> int:
        return self.whole + self.groups + self.shard_reads


def _shard_bytes(url: str, path: str) -> bytes:
    if url.startswith("memory://"):
        import fsspec

        with fsspec.open(f"{url}/{path}", "rb") as f:
            return f.read()
    with open(f"{url}/{path}", "rb") as f:
        return f.read()


def oracle(url: str, version: int) -> pa.Table:
    """Version ``version`` the plain way: its shards, as a separate handle lists them, read
    whole with pyarrow, concatenated (older shards lack later columns: null there)."""
    snap = Store.open(url).snapshot(version)
    assert snap.schema is not None
    parts = [pq.read_table(pa.BufferReader(_shard_bytes(url, s.path))) for s in snap.shards]
    table = pa.concat_tables(parts, promote_options="default").select(snap.schema.names)
    assert table.num_rows == snap.num_rows
    return table


def check_batch(ds: VersionedDataset, want: pa.Table, rng: np.random.Generator, n: int) -> None:
    """A batch of ``n`` random, unsorted, repeated rows in every format against ``want``."""
    idx = rng.integers(0, want.num_rows, n)
    idx[: n // 4] = idx[n // 4 : 2 * (n // 4)]  # repeats for sure
    expected = want.take(pa.array(idx))
    assert ds.read_batch(idx.tolist(), "rows") == expected.to_pylist()
    assert ds.read_batch(idx.tolist(), "columns") == expected.to_pydict()
    got = ds.read_batch(idx.tolist(), "arrow")
    assert pa.Table.from_batches([got]).equals(expected.cast(got.schema))
    row = int(idx[0])
    assert ds[row] == want.slice(row, 1).to_pylist()[0]


def _round(rng: np.random.Generator, start: int, n: int, hint: bool) -> list[dict]:
    rows = []
    for i in range(start, start + n):
        row = {
            "id": i,
            "prompt": f"task {i} " + "x" * int(rng.integers(0, 40)),
            "score": None if i % 13 == 0 else float(rng.random()),
            "tags": [f"t{i % 3}"] * (i % 4),
        }
        if hint:
            row["hint"] = None if i % 5 == 0 else f"hint {i}"
        rows.append(row)
    return rows


def test_generator_loop_reads_kept_tables_only(url, kept, monkeypatch):
    """Each step appends a round (1 to 90 rows; some cut into several shards, one of several row
    groups) and reads batches over the new head: every batch equals the oracle's, and after
    the seed (read as another process would) no shard is read or decoded — through a reset to
    an earlier version, the rounds after it, and a round that adds a column."""
    rng = np.random.default_rng(45)
    store = Store.open(url, create=True)
    store.append(_round(rng, 0, 300, False))
    ds = VersionedDataset(store)
    kept.clear()  # the seed is read as another process would: decoded
    seed = {s.path for s in store.snapshot().shards}
    check_batch(ds, oracle(url, ds.version), rng, 64)
    decodes = Decodes(monkeypatch)
    versions = [store.head]
    next_id = 300
    hint = False
    for step in range(36):
        n = 700 if step == 3 else int(rng.integers(1, 90))
        if step == 20:
            hint = True  # a later round widens the schema
        shard_bytes = 2000 if step % 7 == 5 else None  # some rounds in several shards
        v = store.append(
            _round(rng, next_id, n, hint), allow_new_columns=hint, shard_bytes=shard_bytes
        )
        next_id += n
        versions.append(v)
        if step == 28:
            # back to the head of step 10; later rounds go on from there
            back = versions[12]
            v = store.reset(back)
            versions.append(v)
            next_id = int(oracle(url, v).column("id").to_numpy().max()) + 1
        ds.pin(v)
        check_batch(ds, oracle(url, v), rng, 96)
    assert store.snapshot().schema.names[-1] == "hint"
    # A version from before the schema widened, read after it, takes the same kept tables
    # (the head's reads conformed them to the wider schema: null hints).
    older = VersionedDataset(store, versions[15])
    check_batch(older, oracle(url, versions[15]), rng, 64)
    # Only the seed is ever decoded again (the cache joins it into blocks of shards, and a
    # later version's blocks may need it alone): never a round written here.
    assert decodes.groups == 0 and decodes.paths <= seed, vars(decodes)
    assert kept.hits > 100
    # Another handle in this process takes them too (the record entries read back match).
    decodes.paths.clear()
    other = VersionedDataset(url)
    check_batch(other, oracle(url, other.version), rng, 128)
    assert decodes.groups == 0 and decodes.paths <= seed, vars(decodes)


def test_without_kept_tables_the_same_loop_decodes(url, kept, monkeypatch):
    """The counter's control: with nothing kept (bound 0) the same reads decode the shards,
    and return the same rows."""
    kept.max_bytes = 0
    rng = np.random.default_rng(7)
    store = Store.open(url, create=True)
    store.append(_round(rng, 0, 100, False))
    ds = VersionedDataset(store)
    decodes = Decodes(monkeypatch)
    for step in range(5):
        v = store.append(_round(rng, 100 + 50 * step, 50, False))
        ds.pin(v)
        check_batch(ds, oracle(url, v), rng, 64)
    assert decodes.whole >= 5
    assert len(kept) == 0


def test_another_process_decodes_the_files(tmp_path, kept):
    """Kept tables are this process's: another one reads the store and gets the oracle's rows
    from the files."""
    url = str(tmp_path / "store")
    rng = np.random.default_rng(3)
    store = Store.open(url, create=True)
    for k in range(4):
        store.append(_round(rng, 40 * k, 40, False))
    assert len(kept) == 4
    code = (
        "import json, sys, dynstate\n"
        "from dynstate import fresh\n"
        "ds = dynstate.VersionedDataset(sys.argv[1])\n"
        "rows = ds.read_batch([159, 3, 80, 80, 41], 'rows')\n"
        "print(json.dumps([rows, len(fresh.FRESH)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, url], capture_output=True, text=True, timeout=120, check=True
    )
    rows, held = json.loads(out.stdout)
    assert held == 0
    assert rows == oracle(url, store.head).take([159, 3, 80, 80, 41]).to_pylist()


def test_caller_changing_its_arrays_after_the_commit(tmp_path, kept, monkeypatch):
    """A round passed as an Arrow table over the caller's numpy memory: what is kept is a copy,
    so changing the arrays after the commit changes nothing read."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append(pa.table({"id": [0], "score": [0.5]}))
    kept.clear()  # the first round is read as another process would: decoded
    ids = np.arange(1, 65, dtype=np.int64)
    scores = np.linspace(0, 1, 64)
    v = store.append(pa.table({"id": pa.array(ids), "score": pa.array(scores)}))
    ids[:] = -1
    scores[:] = np.nan
    ds = VersionedDataset(store, v)
    decodes = Decodes(monkeypatch)
    rng = np.random.default_rng(1)
    check_batch(ds, oracle(url, v), rng, 64)
    assert ds.read_batch([1, 64, 0], "columns") == {"id": [1, 64, 0], "score": [0.0, 1.0, 0.5]}
    assert decodes.whole == 1  # the first round only: the second was taken as kept


def _zoo(n: int) -> dict[str, pa.Array]:
    """Columns of many types, with nulls, at ``n`` rows."""
    i = np.arange(n)
    ts = pa.array(i * 1_000_000_007, pa.timestamp("ns", tz="UTC"))
    return {
        "i8": pa.array(i % 100, pa.int8()),
        "u64": pa.array(i, pa.uint64()),
        "f32": pa.array([None if k % 9 == 0 else k / 3 for k in range(n)], pa.float32()),
        "f64": pa.array(
            [float("nan") if k % 5 == 0 else -0.0 if k % 7 == 0 else k / 7 for k in range(n)]
        ),
        "b": pa.array([None if k % 4 == 0 else k % 2 == 0 for k in range(n)]),
        "s": pa.array([None if k % 6 == 0 else "é" * (k % 5) for k in range(n)]),
        "ls": pa.array([f"l{k}" for k in range(n)], pa.large_string()),
        "bin": pa.array([bytes([k % 256]) * (k % 3) for k in range(n)], pa.binary()),
        "fsb": pa.array([bytes([k % 256]) * 4 for k in range(n)], pa.binary(4)),
        "ts": ts,
        "ts_ms": pa.array(i * 1000, pa.timestamp("ms")),
        "d32": pa.array(i.astype(np.int32), pa.int32()).cast(pa.date32()),
        "t64": pa.array(i * 1000, pa.int64()).cast(pa.time64("us")),
        "dec": pa.array([Decimal(k) / 100 for k in range(n)], pa.decimal128(12, 2)),
        "lst": pa.array([None if k % 8 == 0 else list(range(k % 3)) for k in range(n)]),
        "st": pa.array(  # nulls in its children only: a null struct is not kept
            [{"a": None, "b": None} if k % 10 == 0 else {"a": k, "b": str(k)} for k in range(n)],
            pa.struct([("a", pa.int64()), ("b", pa.string())]),
        ),
        "mp": pa.array([[("k", k)] for k in range(n)], pa.map_(pa.string(), pa.int64())),
        "nul": pa.nulls(n),
    }


def _same_values(a: pa.ChunkedArray, b: pa.ChunkedArray) -> bool:
    """Equal, floats bit for bit (NaN equals NaN, -0.0 differs from 0.0)."""
    if not pa.types.is_floating(a.type):
        return a.equals(b)
    x, y = a.to_numpy(), b.to_numpy()  # nulls as NaN: their masks are compared apart
    bits = f"i{x.dtype.itemsize}"
    return a.is_null().equals(b.is_null()) and np.array_equal(x.view(bits), y.view(bits))


def test_kept_tables_equal_the_decode(tmp_path, kept):
    """For every column type kept, the kept table equals ``pq.read_table`` of its shard file,
    schema and metadata included; types a round trip changes (dictionaries, ``date64``) are
    not kept, nor are tables with a null struct (its children hold the writer's values, a
    decode's are null), and their shards are decoded."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append(pa.table(_zoo(5)))
    kept.clear()
    v = store.append(pa.table(_zoo(300)), shard_bytes=6000)  # several shards
    shards = store.snapshot(v).shards[1:]
    assert len(shards) > 1
    for s in shards:
        table = kept.get(s)
        assert table is not None
        decoded = pq.read_table(pa.BufferReader(_shard_bytes(url, s.path)))
        assert table.schema.equals(decoded.schema, check_metadata=True)
        for name in table.column_names:
            assert _same_values(table.column(name), decoded.column(name)), name
    idx = np.random.default_rng(0).integers(0, 305, 64).tolist()
    got = pa.Table.from_batches([VersionedDataset(store, v).read_batch(idx, "arrow")])
    want = oracle(url, v).take(idx)
    for name in want.column_names:  # NaN-aware: the float column holds NaNs
        assert _same_values(got.column(name), want.column(name).cast(got.schema.field(name).type))

    for column in (
        pa.array(["a", "b", "a"] * 20).dictionary_encode(),
        pa.array(np.arange(60) * 86_400_000, pa.int64()).cast(pa.date64()),
        # a null struct over the caller's child values, which a decode has as nulls
        pa.StructArray.from_arrays(
            [pa.array(np.arange(60))], names=["a"], mask=pa.array(np.arange(60) % 3 == 0)
        ),
    ):
        other = Store.open(str(tmp_path / f"other-{column.type}"), create=True)
        w = other.append(pa.table({"c": column}))
        assert kept.get(other.snapshot(w).shards[0]) is None
        got = VersionedDataset(other, w).read_batch([5, 0, 5], "columns")["c"]
        assert got == column.take([5, 0, 5]).to_pylist()


def test_bounded(tmp_path, kept):
    """At most the bound is held (newest kept); a round over an eighth of it is not kept."""
    kept.max_bytes = 200_000
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    rng = np.random.default_rng(5)
    for k in range(60):
        store.append(_round(rng, 64 * k, 64, False))
        assert kept.nbytes <= kept.max_bytes
    head = store.snapshot()
    assert kept.get(head.shards[-1]) is not None
    assert kept.get(head.shards[0]) is None  # the oldest went first
    big = store.append(_round(rng, 10_000, 2_000, False))
    assert all(kept.get(s) is None for s in store.snapshot(big).shards[len(head.shards) :])
    check_batch(VersionedDataset(store), oracle(url, big), rng, 128)


def test_gc_after_a_reset(tmp_path, kept):
    """gc of the versions a reset abandoned leaves every kept version's reads as the
    oracle's; the abandoned versions are gone, not served from kept tables."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    rng = np.random.default_rng(9)
    for k in range(6):
        store.append(_round(rng, 30 * k, 30, False))
    abandoned = store.head
    store.reset(3)
    v = store.append(_round(rng, 500, 30, False))
    dynstate.collect_garbage(
        store, keep=1, grace_s=0, dry_run=False, clock=lambda: store.storage.now() + 3600
    )
    ds = VersionedDataset(store)
    assert ds.version == v
    check_batch(ds, oracle(url, v), rng, 64)
    with pytest.raises(dynstate.DynstateError):
        VersionedDataset(store, abandoned)[0]


def test_loader_workers_forked_after_the_commit(tmp_path, kept):
    """DataLoader workers forked after the rounds were committed (each inherits the kept
    tables, reopens the store and reads record entries equal to the parent's) return the
    oracle's rows."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    rng = np.random.default_rng(11)
    for k in range(6):
        store.append(_round(rng, 50 * k, 50, False))
    ds = VersionedDataset(store)
    order = rng.permutation(300).tolist()
    loader = StatefulDataLoader(
        ds,
        batch_size=32,
        sampler=order,
        num_workers=2,
        collate_fn=list,
        multiprocessing_context="fork",
    )
    got = [row for batch in loader for row in batch]
    assert got == oracle(url, store.head).take(order).to_pylist()


def test_a_table_that_cannot_be_kept_never_fails_the_committed_append(tmp_path, kept, monkeypatch):
    """Keeping runs after the commit: whatever goes wrong there (here, the copy raising), the
    append returns its version, and the round reads back by a decode. A fixed-shape tensor
    round (one of pyarrow's own extension types) is not kept at all."""
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)

    def broken(table: pa.Table) -> pa.Table:
        raise RuntimeError("no copy today")

    monkeypatch.setattr(fresh, "_owned", broken)
    v = store.append(pa.table({"id": list(range(10))}))
    assert store.head == v and len(kept) == 0
    ds = VersionedDataset(store, v)
    assert ds.read_batch([9, 0, 9], "columns") == {"id": [9, 0, 9]}
    monkeypatch.undo()
    tensor = pa.fixed_shape_tensor(pa.float32(), (2, 2), permutation=[1, 0])
    storage = pa.array([[float(k)] * 4 for k in range(3)], pa.list_(pa.float32(), 4))
    rounds = Store.open(str(tmp_path / "tensors"), create=True)
    w = rounds.append(pa.table({"t": pa.ExtensionArray.from_storage(tensor, storage)}))
    assert rounds.head == w and len(kept) == 0
