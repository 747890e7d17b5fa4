"""Every read path of :class:`~dynstate.VersionedDataset` against a plain oracle (SPEC §3.16,
issue 40): the version's shards, named by its manifest, read whole with ``pyarrow.parquet``
(bytes fetched through fsspec, not through dynstate's storage layer), concatenated, then
``take(indices)``.

The paths: local disk, ``memory://`` and S3 (loopback moto; dynstate reads it through
obstore, :mod:`dynstate.storage.s3obstore`, and through s3fs); a cold dataset (footer templates
learned within the batch), one whose templates an earlier read taught, one warm across many
batches and one whose cache is smaller than a version (evictions, large shards read a row
group at a time, the disk cache); a fresh one that maps the decoded files (shards, blocks)
an earlier reader left, whole or damaged (cut short, zeroed, another file's rows); a
prefetch or not; row groups decoded on one thread or several; an uncompacted version, its
compacted successor and an older version with fewer columns, alone or mixed in one batch
through the sampler's version-tagged indices; every column or a projection; ``format``
``"rows"``, ``"columns"`` and ``"arrow"``; ``row_column``; ``__getitem__`` and
``__getitems__``; a ``StatefulDataLoader`` with 0 and 2 workers; and an epoch in order (row
groups joined into their shard, shards into blocks). Indices come from hypothesis: unsorted,
repeated, spread over shards and row groups, a few rows of one row group, or of a few groups
of one shard or of several.

``DYNSTATE_ORACLE_EXAMPLES`` sets the examples of each read test per backend and cache
state (default 40, a few hundred per backend in all; the other tests take a share of it).
``python tools/oracle_long.py`` runs the module with many more.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import s3_url
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynstate import Store, VersionedDataset, compact
from dynstate.loading import cache, ranged
from dynstate.loading.dataset import encode_index

EXAMPLES = int(os.environ.get("DYNSTATE_ORACLE_EXAMPLES", "40"))
ROW = "_dynstate_row"
FORMATS = ("rows", "columns", "arrow")

# (rows, a column added from this round on, shard_bytes). Three large shards (11 to 19 row
# groups of 128 rows on object stores, 6 to 10 of 256 on a local disk), so that a batch reads
# a few groups of several shards together, with templates that other shards taught; a round
# cut into many small shards (blocks of them); shards of one row group and of a few.
ROUNDS: list[tuple[int, bool, int | None]] = [
    (2400, False, None),
    (1600, False, None),
    (1000, False, 6000),
    (130, False, None),
    (40, False, None),
    (1300, True, None),
    (260, True, None),
    (3, True, None),
]


def _round(start: int, n: int, hint: bool) -> pa.Table:
    """Rows ``start`` .. ``start + n`` in the kinds of flat column a round holds: null-free
    numbers (read through numpy views), floats with nulls, strings (plain and
    dictionary-encoded), bools, timestamps, binary, structs; and, from the schema's second
    version on, a nullable ``hint`` column that older rows lack."""
    ids = np.arange(start, start + n)
    columns = {
        "id": pa.array(ids, pa.int64()),
        "score": pa.array([None if i % 11 == 0 else (i % 7) / 7 for i in ids.tolist()]),
        "text": pa.array([f"task {i} " + "x" * (i % 23) for i in ids.tolist()]),
        "level": pa.array((ids % 5).astype(np.int32)),
        "solved": pa.array((ids % 3 == 0).tolist()),
        "at": pa.array(ids.astype("datetime64[ms]")),
        "blob": pa.array([bytes([i % 251]) * (i % 40) for i in ids.tolist()], pa.binary()),
        "split": pa.array([("train", "dev")[i % 2] for i in ids.tolist()]).dictionary_encode(),
        "meta": pa.array([{"k": int(i), "src": str(i % 5)} for i in ids.tolist()]),
    }
    if hint:
        columns["hint"] = pa.array([None if i % 4 == 0 else f"h{i}" for i in ids.tolist()])
    return pa.table(columns)


# -- the oracle ------------------------------------------------------------------------------


def _file_bytes(url: str, path: str) -> bytes:
    """A shard's bytes through fsspec (s3fs on S3): none of dynstate's readers."""
    with fsspec.open(f"{url.rstrip('/')}/{path}", "rb") as f:
        return f.read()


@dataclass
class Asked:
    """What a batch asks for: (version, row) per index, and the dataset's settings that
    shape the answer."""

    entries: list[tuple[int, int]]
    pinned: int  # the dataset's version: an empty batch has its columns
    columns: list[str] | None = None
    row_column: str | None = None


class Oracle:
    """The rows of a store's versions the plain way: each version's shards (its manifest's
    list) read whole with pyarrow and concatenated in order, then ``take``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.store = Store.open(url)
        self.tables: dict[int, pa.Table] = {}

    def table(self, version: int) -> pa.Table:
        table = self.tables.get(version)
        if table is None:
            snap = self.store.snapshot(version)
            assert snap.schema is not None
            parts = [
                pq.read_table(pa.BufferReader(_file_bytes(self.url, s.path))) for s in snap.shards
            ]
            # Shards written before a column was added lack it: null there.
            table = pa.concat_tables(parts, promote_options="default").select(snap.schema.names)
            assert table.num_rows == snap.num_rows
            table = self.tables[version] = table
        return table

    def _names(self, version: int, asked: Asked) -> list[str]:
        names = self.table(version).schema.names
        return names if asked.columns is None else asked.columns

    def rows(self, asked: Asked) -> list[dict]:
        """One dict per (version, row): its version's columns (or those asked for), and the
        row's number under ``row_column``."""
        entries = asked.entries
        out: list[dict | None] = [None] * len(entries)
        for version in {v for v, _ in entries}:
            at = [i for i, (v, _) in enumerate(entries) if v == version]
            table = self.table(version).select(self._names(version, asked))
            taken = table.take(pa.array([entries[i][1] for i in at], pa.int64()))
            for i, row in zip(at, taken.to_pylist(), strict=True):
                if asked.row_column is not None:
                    row[asked.row_column] = entries[i][1]
                out[i] = row
        return out  # type: ignore[return-value]

    def columns(self, asked: Asked) -> dict:
        """Column lists over the columns of every version the batch reads (None where a
        row's version lacks one), the row numbers last."""
        names: list[str] = []
        for version in sorted({v for v, _ in asked.entries} or {asked.pinned}):
            names += [n for n in self._names(version, asked) if n not in names]
        rows = self.rows(Asked(asked.entries, asked.pinned, asked.columns))
        out = {n: [row.get(n) for row in rows] for n in names}
        if asked.row_column is not None:
            out[asked.row_column] = [r for _, r in asked.entries]
        return out


# -- stores, built once per backend ----------------------------------------------------------


@dataclass
class Layout:
    """Where a version's rows lie, from its manifest: to aim indices at groups and shards."""

    num_rows: int
    shards: list[tuple[int, int]]  # [start, end) of each shard
    groups: list[tuple[int, int]]  # [start, end) of each row group
    # The row groups of each shard of several, as often as it has groups: a shard drawn
    # from it is more likely one that a batch reads a few groups of, not all
    several: list[list[tuple[int, int]]]
    edges: list[int]  # the first and last rows of every shard and row group


def _layout(store: Store, version: int) -> Layout:
    snap = store.snapshot(version)
    shards, groups, several = [], [], []
    for start, shard in zip(snap.offsets, snap.shards, strict=False):
        shards.append((start, start + shard.rows))
        counts = shard.groups.rows if shard.groups is not None else (shard.rows,)
        cuts = [start + c for c in accumulate(counts, initial=0)]
        own = list(pairwise(cuts))
        groups += own
        if len(own) > 1:
            several += [own] * len(own)
    edges = sorted({r for lo, hi in groups for r in (lo, hi - 1)})
    return Layout(snap.num_rows, shards, groups, several, edges)


@dataclass
class Built:
    backend: str
    url: str
    versions: dict[str, int]  # "old" (fewer columns), "wide", "compacted"
    layouts: dict[int, Layout]
    oracle: Oracle
    tmp: str  # disk cache folders go here
    warm: dict[tuple[Any, ...], VersionedDataset] = field(default_factory=dict)
    decoded: dict[bool, str] = field(default_factory=dict)  # folders of decoded files


def _build(url: str, backend: str, tmp: str) -> Built:
    store = Store.open(url, create=True)
    start = 0
    old = 0
    for rows, hint, shard_bytes in ROUNDS:
        version = store.append(
            _round(start, rows, hint), allow_new_columns=hint, shard_bytes=shard_bytes
        )
        start += rows
        if not hint:
            old = version
    wide = store.head
    compacted = compact(store, target_bytes=20_000)
    assert compacted != wide
    versions = {"old": old, "wide": wide, "compacted": compacted}
    layouts = {v: _layout(store, v) for v in versions.values()}
    # Several shards, and shards of several row groups, in every version.
    assert all(
        len(lay.shards) > 1 and len(lay.groups) > len(lay.shards) for lay in layouts.values()
    )
    return Built(backend, url, versions, layouts, Oracle(url), tmp)


@pytest.fixture(
    scope="module", params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)]
)
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    tmp = str(tmp_path_factory.mktemp(f"oracle-{request.param}"))
    if request.param == "local":
        url = os.path.join(tmp, "store")
    elif request.param == "memory":
        url = f"memory://dynstate-oracle/{uuid.uuid4().hex}"
    else:
        request.getfixturevalue("s3_endpoint")
        url = s3_url()
    return _build(url, request.param, tmp)


# -- indices ---------------------------------------------------------------------------------


def _rows_in(draw: st.DrawFn, span: tuple[int, int], most: int) -> list[int]:
    return draw(st.lists(st.integers(span[0], span[1] - 1), min_size=1, max_size=most))


@st.composite
def batches(draw: st.DrawFn, built: Built) -> tuple[bool, list[tuple[int, int]]]:
    """(tagged, [(version, row)]): rows of one version (plain row numbers), or of several
    (the version-tagged indices VersionedSampler yields; tagged is then True). The rows are
    a few of one row group (the group read in part), several of one shard (a few of its
    row groups read together), so of several shards (read in part together: templates
    taught by one shard's footer decode the others), or parts of those kinds, first and
    last rows of shards and groups, and rows anywhere; some repeated, and all shuffled."""
    names = sorted(built.versions)
    tagged = draw(st.integers(0, 3)) == 0
    if tagged:
        chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    else:
        chosen = [draw(st.sampled_from(names))]
    shape = draw(st.sampled_from(["group", "shard", "shards", "parts", "parts"]))
    entries: list[tuple[int, int]] = []
    parts = {"group": 1, "shard": 1, "shards": draw(st.integers(2, 4))}.get(shape)
    for _ in range(parts or draw(st.integers(1, 4))):
        version = built.versions[draw(st.sampled_from(chosen))]
        lay = built.layouts[version]
        kind = shape if parts else draw(st.sampled_from(["group", "shard", "edges", "anywhere"]))
        kind = "shard" if kind == "shards" else kind
        if kind == "group":
            rows = _rows_in(draw, draw(st.sampled_from(lay.groups)), 6)
        elif kind == "shard":  # rows of two or three of its groups
            own = draw(st.sampled_from(lay.several))
            picked = draw(st.lists(st.sampled_from(own), min_size=2, max_size=3, unique=True))
            rows = [r for span in picked for r in _rows_in(draw, span, 4)]
        elif kind == "edges":
            rows = draw(st.lists(st.sampled_from(lay.edges), min_size=1, max_size=8))
        else:
            rows = draw(st.lists(st.integers(0, lay.num_rows - 1), max_size=16))
        entries += [(version, r) for r in rows]
    if entries:
        entries += draw(st.lists(st.sampled_from(entries), max_size=4))  # repeats
    return tagged, draw(st.permutations(entries))


def _indices(tagged: bool, entries: list[tuple[int, int]]) -> list[int]:
    return [encode_index(v, r) if tagged else r for v, r in entries]


# -- datasets in each cache state ------------------------------------------------------------

MODES = ("cold", "taught", "warm", "small", "decoded", "damaged")
SMALL_CACHE = 384 * 1024  # under a version decoded: evictions; large shards read in part


def _fresh(
    built: Built, version: int, decoded: str | None = None, **kwargs: Any
) -> VersionedDataset:
    # A disk cache of its own: a cold read must not find shards an earlier one left there,
    # nor decoded files (on a local store, in a folder of the store's id by default).
    ds = VersionedDataset(built.url, version, cache_dir=tempfile.mkdtemp(dir=built.tmp), **kwargs)
    ds.cache.decoded.folder = decoded or tempfile.mkdtemp(dir=built.tmp)
    return ds


def _decoded_folder(built: Built, damaged: bool) -> str:
    """A folder of decoded files (shards and blocks) that an earlier reader left, by reading
    every version from start to end; ``damaged``: a copy with most files cut short, filled
    with other bytes, or holding another file's content under its name."""
    if damaged in built.decoded:
        return built.decoded[damaged]
    if not damaged:
        folder = tempfile.mkdtemp(dir=built.tmp)
        for version in built.versions.values():
            ds = _fresh(built, version, decoded=folder)
            rows = built.layouts[version].num_rows
            for start in range(0, rows, 500):
                ds.read_batch(list(range(start, min(start + 500, rows))))
            ds.read_batch(list(range(rows)))  # again: every block formed, and written
        files = sorted(f for f in os.listdir(folder) if f.endswith(".arrow"))
        assert len(files) > len(built.versions), "the reads left no decoded files"
    else:
        source = _decoded_folder(built, False)
        folder = tempfile.mkdtemp(dir=built.tmp)
        files = sorted(f for f in os.listdir(source) if f.endswith(".arrow"))
        for i, name in enumerate(files):
            data = Path(source, name).read_bytes()
            kind = i % 4
            if kind == 0:
                data = data[: len(data) // 2]
            elif kind == 1:
                data = bytes(len(data))
            elif kind == 2:  # another shard's (or block's) decoded rows under this name
                data = Path(source, files[(i + 1) % len(files)]).read_bytes()
            Path(folder, name).write_bytes(data)
    built.decoded[damaged] = folder
    return folder


def _teach(built: Built, ds: VersionedDataset, version: int) -> None:
    """Read one row of the shard with the most row groups, in part: on an object store its
    footer teaches the template every shard of the schema names."""
    lo, _ = max(built.layouts[version].several, key=len)[0]
    ds.read_batch([encode_index(version, lo + 1)])


def dataset(built: Built, mode: str, version: int, **kwargs: Any) -> VersionedDataset:
    """A dataset pinned at ``version`` in cache state ``mode``: ``cold`` (fresh), ``taught``
    (fresh but for one earlier read), ``warm`` and ``small`` (one per backend and settings,
    kept across examples; ``small`` with a cache smaller than the store)."""
    if mode in ("decoded", "damaged"):
        ds = _fresh(built, version, decoded=_decoded_folder(built, mode == "damaged"), **kwargs)
    elif mode in ("cold", "taught"):
        ds = _fresh(built, version, **kwargs)
        if mode == "taught":
            _teach(built, ds, version)
            if not ds.store.storage.reads_in_place:
                assert ds.cache.footers._templates, "the teaching read taught no template"
    else:
        key = (mode, repr(sorted(kwargs.items())))
        ds = built.warm.get(key)
        if ds is None:
            size = {"cache_bytes": SMALL_CACHE} if mode == "small" else {}
            ds = built.warm[key] = _fresh(built, version, **size, **kwargs)
        ds.pin(version)
    if built.backend == "s3":  # obstore, unless a test turned it off
        own = os.environ.get("DYNSTATE_S3_CLIENT", "") != "s3fs"
        assert ds.store.storage.served == own  # type: ignore[attr-defined]
    return ds


# -- checks ----------------------------------------------------------------------------------


def check_batch(built: Built, got: Any, fmt: str, asked: Asked) -> None:
    """``got`` (a batch in format ``fmt``) holds exactly the oracle's rows, in order."""
    oracle = built.oracle
    if fmt == "rows":
        assert got == oracle.rows(asked)
        return
    want = oracle.columns(asked)
    if fmt == "columns":
        assert got == want
        return
    assert isinstance(got, pa.RecordBatch)
    assert got.to_pydict() == want
    row_column = asked.row_column
    versions = {v for v, _ in asked.entries} or {asked.pinned}
    if len(versions) == 1:  # one version: its schema, its column order
        table = oracle.table(versions.pop())
        if asked.columns is not None:
            table = table.select(asked.columns)
        names = list(table.schema.names) + ([row_column] if row_column else [])
        assert got.schema.names == names
        for name in table.schema.names:
            assert got.schema.field(name).type == table.schema.field(name).type
    if row_column is not None:
        assert got.schema.field(row_column).type == pa.int64()


def asked_of(ds: VersionedDataset, entries: list[tuple[int, int]]) -> Asked:
    return Asked(entries, ds.version, ds.columns, ds.row_column)


def _settings(examples: int) -> Any:
    return settings(
        max_examples=max(1, examples),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- the differential tests ------------------------------------------------------------------


def test_the_rows_of_one_shard_come_back_in_the_order_asked(store_url: str, tmp_path) -> None:
    """Issue 40's batch: rows of a few row groups of one 5,120-row shard, unsorted. On object
    stores they were read together as one piece, group by group, and came back sorted while
    ``row_column`` labelled them in the order asked."""
    store = Store.open(store_url, create=True)
    store.append(
        pa.table({"id": pa.array(range(5120), pa.int64()), "text": [str(i) for i in range(5120)]})
    )
    asked = [3167, 4342, 1064, 3642, 664]
    ds = VersionedDataset(store_url, row_column=ROW, cache_dir=str(tmp_path / "cache"))
    assert [row["id"] for row in ds.read_batch(asked)] == asked
    assert [row[ROW] for row in ds.__getitems__(asked)] == asked
    columns = ds.read_batch(asked, "columns")
    assert columns["id"] == columns[ROW] == asked
    assert columns["text"] == [str(i) for i in asked]
    assert ds.read_batch(asked, "arrow").column("id").to_pylist() == asked
    assert Oracle(store_url).rows(Asked([(store.head, r) for r in asked], store.head)) == [
        {"id": i, "text": str(i)} for i in asked
    ]


# What a dataset is asked to return besides a version's columns.
SHAPES = st.fixed_dictionaries(
    {
        "row_column": st.sampled_from([None, ROW]),
        "columns": st.sampled_from([None, None, ["text", "id"], ["meta", "score", "at", "split"]]),
    }
)


def _pinned(built: Built, tagged: bool, entries: list[tuple[int, int]]) -> int:
    """The version a dataset is pinned at: that of its plain row numbers."""
    return entries[0][0] if entries and not tagged else built.versions["wide"]


def check_reads(built: Built, mode: str, data: st.DataObject) -> None:
    """read_batch in every format, and __getitems__ in the dataset's own, in an order drawn
    (the first read of a cold dataset is in any format), after a prefetch or not."""
    tagged, entries = data.draw(batches(built), "batch")
    shape = data.draw(SHAPES, "shape")
    batch_format = data.draw(st.sampled_from(FORMATS), "batch_format")
    ds = dataset(built, mode, _pinned(built, tagged, entries), batch_format=batch_format, **shape)
    if data.draw(st.booleans(), "prefetch"):  # remote shards downloaded to disk meanwhile
        for version in {v for v, _ in entries}:
            ds.prefetch(version, [r for v, r in entries if v == version])
    indices = _indices(tagged, entries)
    asked = asked_of(ds, entries)
    for what in data.draw(st.permutations([*FORMATS, "getitems"]), "order"):
        if what == "getitems":
            got, fmt = ds.__getitems__(indices), batch_format
        else:
            got, fmt = ds.read_batch(indices, what), what
        check_batch(built, got, fmt, asked)


@pytest.mark.parametrize("mode", MODES)
@_settings(EXAMPLES)
@given(data=st.data())
def test_read_batch_matches_the_oracle(built: Built, mode: str, data: st.DataObject) -> None:
    check_reads(built, mode, data)


@pytest.mark.parametrize("mode", MODES)
@_settings(EXAMPLES // 2)
@given(data=st.data())
def test_getitem_matches_the_oracle(built: Built, mode: str, data: st.DataObject) -> None:
    """ds[i] one at a time (the single-row path: a block, a shard or a row group)."""
    tagged, entries = data.draw(batches(built), "batch")
    shape = data.draw(SHAPES, "shape")
    ds = dataset(built, mode, _pinned(built, tagged, entries), **shape)
    got = [ds[i] for i in _indices(tagged, entries)]
    assert got == built.oracle.rows(asked_of(ds, entries))


def _patched_settings(examples: int) -> Any:
    # The patch (a function-scoped fixture) holds for every example alike.
    return settings(
        max_examples=max(1, examples),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


@pytest.mark.s3
@pytest.mark.parametrize("built", ["s3"], indirect=True)
@_patched_settings(EXAMPLES // 2)
@given(data=st.data())
def test_s3_through_s3fs_matches_the_oracle(
    monkeypatch: pytest.MonkeyPatch, built: Built, data: st.DataObject
) -> None:
    """The same reads on S3 through s3fs (what dynstate reads with where obstore does not
    serve the configuration, or in a process forked after obstore ran) rather than obstore."""
    monkeypatch.setenv("DYNSTATE_S3_CLIENT", "s3fs")
    check_reads(built, data.draw(st.sampled_from(["cold", "taught"]), "mode"), data)


def test_decoded_files_are_mapped_not_decoded(
    monkeypatch: pytest.MonkeyPatch, built: Built
) -> None:
    """A fresh reader over the decoded files an earlier one left reads no Parquet at all (so
    the "decoded" mode above holds the mapped path to the oracle), and every row of every
    version is the oracle's."""
    folder = _decoded_folder(built, False)

    def no_parquet(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("read Parquet although its decoded file is there")

    monkeypatch.setattr(cache.ShardCache, "_load", no_parquet)
    monkeypatch.setattr(cache, "read_groups", no_parquet)
    for version in built.versions.values():
        ds = _fresh(built, version, decoded=folder)
        rows = list(range(built.layouts[version].num_rows))[::-1]
        assert ds.read_batch(rows) == built.oracle.rows(asked_of(ds, [(version, r) for r in rows]))


@pytest.mark.parametrize(
    "built", ["memory", pytest.param("s3", marks=pytest.mark.s3)], indirect=True
)
@_patched_settings(EXAMPLES // 2)
@given(data=st.data())
def test_decoding_on_threads_matches_the_oracle(
    monkeypatch: pytest.MonkeyPatch, built: Built, data: st.DataObject
) -> None:
    """The row groups of a cold batch decoded on several threads, shard by shard, as on a
    machine of more than two cores (ranged._PARALLEL_SHARDS)."""
    monkeypatch.setattr(ranged, "_DECODERS", 2)
    monkeypatch.setattr(ranged, "_PARALLEL_SHARDS", 2)
    check_reads(built, data.draw(st.sampled_from(["cold", "taught"]), "mode"), data)


@pytest.mark.parametrize("cache_bytes", [SMALL_CACHE, 64 * 2**20])
@_settings(EXAMPLES // 8)
@given(data=st.data())
def test_an_epoch_in_order_matches_the_oracle(
    built: Built, cache_bytes: int, data: st.DataObject
) -> None:
    """A version read from start to end in batches (an epoch of a loader without shuffle),
    each batch shuffled: row groups read one after another are joined into their shard,
    shards into blocks, and a small cache evicts as it goes."""
    version = built.versions[data.draw(st.sampled_from(sorted(built.versions)), "version")]
    size = data.draw(st.integers(40, 700), "batch size")
    shape = data.draw(SHAPES, "shape")
    fmt = data.draw(st.sampled_from(FORMATS), "format")
    ds = _fresh(built, version, cache_bytes=cache_bytes, **shape)
    shuffle = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), "seed")).permutation
    num_rows = built.layouts[version].num_rows
    for start in range(0, num_rows, size):
        chunk = shuffle(np.arange(start, min(start + size, num_rows))).tolist()
        got = ds.read_batch(chunk, fmt)
        check_batch(built, got, fmt, asked_of(ds, [(version, r) for r in chunk]))


def _as_is(batch: Any) -> Any:
    return batch


def check_loader(built: Built, workers: int, data: st.DataObject) -> None:
    """A StatefulDataLoader over explicit batches (its batch_sampler, so the oracle knows
    every index): each batch it hands out, from the main process or from workers that
    reopen the store, holds the oracle's rows in the order asked."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    # With workers, a process start per example: fewer examples, more batches each.
    drawn = data.draw(
        st.lists(batches(built), min_size=1 + 3 * workers, max_size=4 + 4 * workers), "batches"
    )
    fmt = data.draw(st.sampled_from(FORMATS), "batch_format")
    shape = data.draw(SHAPES, "shape")
    ds = _fresh(built, built.versions["wide"], batch_format=fmt, **shape)
    # Tagged indices throughout: the worker's copy reads the version each index names.
    plan = [[encode_index(v, r) for v, r in entries] for _, entries in drawn]
    loader = StatefulDataLoader(ds, batch_sampler=plan, num_workers=workers, collate_fn=_as_is)
    got = list(loader)
    assert len(got) == len(plan)
    for batch, (_, entries) in zip(got, drawn, strict=True):
        check_batch(built, batch, fmt, asked_of(ds, entries))


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates with a UserWarning.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@_settings(EXAMPLES // 4)
@given(data=st.data())
def test_loader_in_process_matches_the_oracle(built: Built, data: st.DataObject) -> None:
    check_loader(built, 0, data)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@_settings(EXAMPLES // 10)
@given(data=st.data())
def test_loader_with_two_workers_matches_the_oracle(built: Built, data: st.DataObject) -> None:
    check_loader(built, 2, data)
