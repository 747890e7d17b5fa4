"""Reading only the row groups a batch needs (issue 23.1): the checksums each new shard's
commit records per row group, ranged reads locally and on S3, a flipped byte in any row group
or footer still a ChecksumMismatchError naming the shard, and stores without row group
records read and verified whole as before."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import s3_url

import dynstate.writes as writes_module
from dynstate import ChecksumMismatchError, CorruptStoreError, Store, VersionedDataset
from dynstate.records import manifest as m
from dynstate.records.rowgroups import ROW_GROUP_ROWS, write_shard

ROWS = 4 * ROW_GROUP_ROWS + 100  # five row groups per shard

# Shards read back here must be decoded: the decode paths are what this module holds.
pytestmark = pytest.mark.usefixtures("decode_what_this_process_wrote", "no_decoded_files")


def _table(start: int, n: int) -> pa.Table:
    ids = np.arange(start, start + n)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "prompt": pa.array([f"task {i}: what is {i} + 3?" for i in ids.tolist()]),
            "reward": pa.array((ids % 7) / 7.0),
        }
    )


def _build(url: str, shards: int = 3, **options) -> tuple[Store, pa.Table]:
    store = Store.open(url, create=True, **options)
    for k in range(shards):
        store.append(_table(k * ROWS, ROWS))
    return store, pa.concat_tables([_table(k * ROWS, ROWS) for k in range(shards)])


class _Counted:
    """The storage's own ranged read, with what it was asked for remembered (the real read
    runs: nothing stands in for the backend)."""

    def __init__(self, storage):
        self.ranges: list[tuple[str, int, int]] = []
        self.whole: list[str] = []
        self._ranges, self._cat = storage._cat_ranges, storage._cat
        storage._cat_ranges = self.cat_ranges
        storage._cat = self.cat

    def cat_ranges(self, ranges):
        self.ranges += ranges
        return self._ranges(ranges)

    def cat(self, rel):
        if rel.startswith(m.DATA_DIR + "/"):
            self.whole.append(rel)  # shards only: records are read whole as ever
        return self._cat(rel)

    def bytes_read(self) -> int:
        return sum(end - start for _, start, end in self.ranges)


def _flip(store: Store, shard: m.ShardRef, offset: int) -> None:
    path = store.storage.path(shard.path)
    data = bytearray(store.storage.read(shard.path))
    data[offset] ^= 0xFF
    if store.storage.reads_in_place:
        os.chmod(path, 0o644)
        with open(path, "r+b") as fh:
            fh.write(data)
    else:
        store.storage.put(shard.path, bytes(data))


def test_new_shards_record_row_groups_that_partition_the_file(tmp_path):
    store, _ = _build(str(tmp_path / "s"), shards=1)
    shard = store.snapshot().shards[0]
    assert shard.groups is not None
    assert shard.groups.rows == (ROW_GROUP_ROWS,) * 4 + (100,)
    data = store.storage.read(shard.path)
    bounds = [0]
    for size in shard.groups.bytes:
        bounds.append(bounds[-1] + size)
    assert bounds[-1] == len(data) == shard.bytes
    for seg in range(len(shard.groups.bytes)):
        assert m.sha256(data[bounds[seg] : bounds[seg + 1]]) == shard.groups.digest(seg)
    meta = pq.read_metadata(pa.BufferReader(data))
    for g in range(meta.num_row_groups):  # row group g starts where its segment does
        col = meta.row_group(g).column(0)
        assert (col.dictionary_page_offset or col.data_page_offset) == max(bounds[g], 4)
    # the entry survives the record's round trip, and reopening the store
    assert m.ShardRef.from_json(json.loads(json.dumps(shard.to_json())), "t") == shard
    assert Store.open(str(tmp_path / "s")).snapshot().shards[0] == shard


def test_a_batch_reads_only_the_row_groups_holding_its_rows(tmp_path):
    store, table = _build(str(tmp_path / "s"))
    counted = _Counted(store.storage)
    ds = VersionedDataset(store)
    rows = [5, ROWS + 2 * ROW_GROUP_ROWS + 1, 2 * ROWS + ROWS - 1]  # one row group per shard
    assert ds.read_batch(rows) == [table.slice(r, 1).to_pylist()[0] for r in rows]
    assert counted.whole == []
    shards = store.snapshot().shards
    # per shard its row group and its footer; the last shard's are adjacent: one range
    assert len(counted.ranges) == 5
    assert counted.bytes_read() < 0.5 * sum(s.bytes for s in shards)
    # the same rows again cost nothing; a row in a read row group neither
    before = len(counted.ranges)
    more = [*rows, 6]
    assert ds.read_batch(more) == [table.slice(r, 1).to_pylist()[0] for r in more]
    assert (
        ds[ROWS + 2 * ROW_GROUP_ROWS + 7]
        == table.slice(ROWS + 2 * ROW_GROUP_ROWS + 7, 1).to_pylist()[0]
    )
    assert len(counted.ranges) == before


def test_random_batches_equal_the_table_while_row_groups_join_into_shards(tmp_path):
    store, table = _build(str(tmp_path / "s"))
    expected = table.to_pylist()
    ds = VersionedDataset(store)
    rng = np.random.default_rng(7)
    for _ in range(40):
        idx = rng.choice(table.num_rows, 16).tolist()
        assert ds.read_batch(idx) == [expected[i] for i in idx]
        assert ds.read_batch(idx, "arrow").to_pylist() == [expected[i] for i in idx]
        assert ds.read_batch(idx, "columns")["id"] == idx
        assert ds[idx[0]] == expected[idx[0]]
    # every row group of every shard read by now: they were joined into whole shards
    keys = list(ds.cache._shards)
    assert all(len(k) == 2 for k in keys if k[0] != "block"), keys
    assert ds.cache.nbytes == sum(e.nbytes for e in ds.cache._shards.values())


@pytest.mark.parametrize("segment", [0, 2, 4, "footer"])
def test_a_flipped_byte_in_any_row_group_names_the_shard(tmp_path, segment):
    store, _ = _build(str(tmp_path / "s"))
    shard = store.snapshot().shards[1]
    assert shard.groups is not None
    seg = len(shard.groups.rows) if segment == "footer" else segment
    start = sum(shard.groups.bytes[:seg])
    _flip(store, shard, start + shard.groups.bytes[seg] // 2)
    ds = VersionedDataset(str(tmp_path / "s"))
    row = ROWS + (min(seg, 4) * ROW_GROUP_ROWS)  # a row of the damaged group (or any, footer)
    with pytest.raises(ChecksumMismatchError, match=shard.path):
        ds.read_batch([row])
    with pytest.raises(ChecksumMismatchError, match=shard.path):
        VersionedDataset(str(tmp_path / "s"))[row]
    # rows of the other shards still read
    assert ds.read_batch([0, 2 * ROWS])[0]["id"] == 0


@pytest.mark.s3
def test_on_s3_a_batch_reads_ranges_and_a_flipped_byte_is_refused(s3_endpoint):
    url = s3_url()
    store, table = _build(url)
    counted = _Counted(store.storage)
    ds = VersionedDataset(store)
    rows = [3, ROWS + ROW_GROUP_ROWS + 3, 2 * ROWS + 2 * ROW_GROUP_ROWS]
    assert ds.read_batch(rows) == [table.slice(r, 1).to_pylist()[0] for r in rows]
    assert counted.whole == []
    assert counted.bytes_read() < 0.5 * sum(s.bytes for s in store.snapshot().shards)
    shard = store.snapshot().shards[2]
    assert shard.groups is not None
    _flip(store, shard, sum(shard.groups.bytes[:3]) + 10)  # row group 3
    fresh = VersionedDataset(url, cache_dir=None)
    with pytest.raises(ChecksumMismatchError, match=shard.path):
        fresh.read_batch([2 * ROWS + sum(shard.groups.rows[:3]) + 1])
    assert fresh.read_batch([2 * ROWS + 1])[0]["id"] == 2 * ROWS + 1  # row group 0 is intact


def _without_row_groups(table: pa.Table, sink, row_group_rows=None):
    """How shards were written before row groups were recorded."""
    pq.write_table(table, sink)
    return None


def test_a_store_without_row_group_records_reads_and_verifies_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(writes_module, "write_shard", _without_row_groups)
    store, table = _build(str(tmp_path / "s"))
    monkeypatch.undo()
    record = json.loads(store.storage.read(m.log_path(1)))
    assert "groups" not in record["add"][0]  # what an older dynstate wrote
    store.append(_table(3 * ROWS, ROWS))  # a newer shard beside the old ones
    shards = store.snapshot().shards
    assert [s.groups is None for s in shards] == [True, True, True, False]
    table = pa.concat_tables([table, _table(3 * ROWS, ROWS)])
    counted = _Counted(store.storage)
    ds = VersionedDataset(store)
    rows = [1, ROWS + 5, 3 * ROWS + 7]
    assert ds.read_batch(rows) == [table.slice(r, 1).to_pylist()[0] for r in rows]
    assert sorted(counted.whole) == sorted(s.path for s in shards[:2])  # old: whole
    assert {r[0] for r in counted.ranges} == {shards[3].path}  # new: its row group
    _flip(store, shards[0], shards[0].bytes // 2)
    with pytest.raises(ChecksumMismatchError, match=shards[0].path):
        VersionedDataset(str(tmp_path / "s")).read_batch([0])


def test_chunked_shard_lists_keep_row_groups_and_old_chunks_still_decode():
    groups = m.RowGroups((2, 1), (10, 8, 6), "a" * 64 + "b" * 64 + "c" * 64)
    shards = [m.ShardRef(f"data/{i}.parquet", 3, 24, "d" * 64, groups) for i in range(3)]
    shards += [m.ShardRef(f"data/x{i}.parquet", 3, 24, "e" * 64) for i in range(m.CHUNK_ENTRIES)]
    files, _ = m.split_chunks(shards)
    digest, data = files[0]
    assert m.decode_chunk(digest, data, "chunk") == shards[: m.CHUNK_ENTRIES]
    old = shards[3 : 3 + m.CHUNK_ENTRIES]
    files, _ = m.split_chunks(old)
    assert b"groups" not in files[0][1]  # no row groups: the chunk is as an older one
    assert m.decode_chunk(*files[0], "chunk") == old


@pytest.mark.parametrize(
    "bad",
    [
        {"rows": [2, 2], "bytes": [10, 8, 6], "sha256": "a" * 192},  # rows do not add up
        {"rows": [2, 1], "bytes": [10, 8, 5], "sha256": "a" * 192},  # bytes do not add up
        {"rows": [2, 1], "bytes": [10, 14], "sha256": "a" * 128},  # a segment missing
        {"rows": [2, 1], "bytes": [10, 8, 6], "sha256": "A" * 192},  # not a digest
        {"rows": [2, True], "bytes": [10, 8, 6], "sha256": "a" * 192},
        {"rows": [2.0, 1], "bytes": [10, 8, 6], "sha256": "a" * 192},  # adds up, not ints
        {"rows": [4, -1], "bytes": [10, 8, 6], "sha256": "a" * 192},  # adds up, negative
        {"rows": [2, 1], "bytes": [30, -12, 6], "sha256": "a" * 192},
        {"rows": [2, 1], "bytes": [10, 8, 6], "sha256": "a" * 191 + "g"},
        {"rows": [2, 1], "bytes": [10, 8, 6]},
        [1, 2],
    ],
)
def test_a_malformed_row_group_entry_is_refused(bad):
    entry = {"path": "data/a.parquet", "rows": 3, "bytes": 24, "sha256": "d" * 64, "groups": bad}
    with pytest.raises(CorruptStoreError, match="row group entry"):
        m.ShardRef.from_json(entry, "log/1.json")


def test_write_shard_of_an_empty_table_records_only_the_footer():
    class Sink:
        def __init__(self):
            self.data = bytearray()
            self.closed = False

        def write(self, data):
            self.data += data
            return len(data)

        def tell(self):
            return len(self.data)

        def flush(self):
            pass

    sink = Sink()
    groups = write_shard(_table(0, 0), sink)
    assert groups is not None and groups.rows == () and groups.bytes == (len(sink.data),)
    assert groups.digest(0) == m.sha256(bytes(sink.data))
    sink = Sink()
    groups = write_shard(_table(0, 10), sink, row_group_rows=4)
    assert groups is not None and groups.rows == (4, 4, 2)
    assert pq.read_table(pa.BufferReader(bytes(sink.data))).equals(_table(0, 10))


def test_a_large_shard_has_at_most_max_row_groups():
    from dynstate.records.rowgroups import MAX_ROW_GROUPS

    class Sink:
        def __init__(self):
            self.size = 0
            self.closed = False

        def write(self, data):
            self.size += len(memoryview(data))
            return len(memoryview(data))

        def tell(self):
            return self.size

        def flush(self):
            pass

    rows = ROW_GROUP_ROWS * MAX_ROW_GROUPS * 2 + 1
    groups = write_shard(pa.table({"x": pa.array(np.arange(rows))}), Sink())
    assert groups is not None and len(groups.rows) <= MAX_ROW_GROUPS and sum(groups.rows) == rows


def test_a_missing_shard_read_in_part_is_a_missing_shard_error(store_url):
    from dynstate import MissingShardError

    store, table = _build(store_url, shards=2)
    shard = store.snapshot().shards[1]
    ds = VersionedDataset(store)
    assert ds.read_batch([3])[0] == table.slice(3, 1).to_pylist()[0]  # memory, local, S3 alike
    store.storage.delete(shard.path)
    with pytest.raises(MissingShardError, match=shard.path):
        ds.read_batch([2, ROWS + 1])


def _rewrite_record(store: Store, version: int, change) -> None:
    """Change a commit record and give it a valid checksum again (what someone who can write
    the store can do)."""
    from dynstate.records import codec

    obj = json.loads(store.storage.read(m.log_path(version)))
    change(obj)
    path = store.storage.path(m.log_path(version))
    os.chmod(path, 0o644)
    with open(path, "wb") as fh:
        fh.write(codec.encode(obj))


def test_a_record_with_earlier_group_counts_moved_never_serves_another_row(tmp_path):
    """A read checks the counts of every group up to the ones it decodes (a group's first row
    is the sum of the counts before it), not only the decoded group's own: here group 1 keeps
    its true count, but the record moves its first row from 256 to 200."""
    url = str(tmp_path / "s")
    store, _ = _build(url, shards=1)

    def move(obj):
        rows = obj["add"][0]["groups"]["rows"]
        assert rows[:3] == [ROW_GROUP_ROWS] * 3
        rows[0], rows[2] = ROW_GROUP_ROWS - 56, ROW_GROUP_ROWS + 56

    _rewrite_record(store, 1, move)
    shard = Store.open(url).snapshot().shards[0]
    for row in (210, 5, 700):
        ds = VersionedDataset(url)
        try:
            got = ds.read_batch([row])
        except CorruptStoreError as exc:
            assert shard.path in str(exc)
        else:
            assert got == [_table(row, 1).to_pylist()[0]], f"row {row} answered another row"


@pytest.mark.parametrize("parallel", [True, False])
def test_a_batch_over_many_shards_decodes_them_on_threads_or_not_alike(
    tmp_path, monkeypatch, parallel
):
    import dynstate.loading.ranged as ranged

    monkeypatch.setattr(ranged, "_PARALLEL_SHARDS", 2 if parallel else 10**9)
    url, n = str(tmp_path / "s"), 20 * ROW_GROUP_ROWS  # 20 groups: a few rows read by range
    store = Store.open(url, create=True)
    for k in range(6):
        store.append(_table(k * n, n))
    table = _table(0, 6 * n)
    rows = np.random.default_rng(5).choice(table.num_rows, 18, replace=False).tolist()
    assert VersionedDataset(url).read_batch(rows) == table.take(rows).to_pylist()
    # a damaged record among them is still the typed error naming its shard, from a thread
    shard = store.snapshot().shards[3]

    def wrong_rows(obj):
        counts = obj["add"][0]["groups"]["rows"]
        counts[0], counts[1] = counts[0] - 1, counts[1] + 1

    _rewrite_record(store, 4, wrong_rows)
    some = [k * n + 7 for k in range(6)] + [3 * n + ROW_GROUP_ROWS + 1]
    with pytest.raises(CorruptStoreError, match=shard.path):
        VersionedDataset(url).read_batch(some)


def test_a_forked_child_decodes_after_its_parent_used_the_threads(tmp_path, monkeypatch):
    """The decoding threads of a parent do not exist in a forked DataLoader worker: the child
    starts its own (a pool inherited as is would never run its work)."""
    import multiprocessing

    import dynstate.loading.ranged as ranged

    monkeypatch.setattr(ranged, "_PARALLEL_SHARDS", 2)
    url, n = str(tmp_path / "s"), 20 * ROW_GROUP_ROWS  # 20 groups: a few rows read by range
    store = Store.open(url, create=True)
    for k in range(4):
        store.append(_table(k * n, n))
    table = _table(0, 4 * n)
    rows = [k * n + 3 for k in range(4)]
    started = ranged._DECODE.started
    assert VersionedDataset(url).read_batch(rows) == table.take(rows).to_pylist()
    assert started or ranged._DECODE.started, "the parent never used the threads"
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_read_and_check, args=(url, rows, table.take(rows).to_pylist()))
    child.start()
    child.join(60)
    if child.exitcode is None:
        child.kill()
        child.join()
    assert child.exitcode == 0, "the child hung or read wrong rows"


def _read_and_check(url: str, rows: list[int], expected: list[dict]) -> None:
    if VersionedDataset(url).read_batch(rows) != expected:
        os._exit(3)


def _dictionary_encoded(path, column: str) -> bool:
    meta = pq.read_metadata(path)
    index = meta.schema.names.index(column)
    return any(
        "DICTIONARY" in " ".join(meta.row_group(g).column(index).encodings)
        for g in range(meta.num_row_groups)
    )


def test_only_columns_that_repeat_get_a_dictionary(tmp_path) -> None:
    """Per-group dictionaries of mostly distinct values are paid at write and at every read
    and save nothing: such columns are written plain, repeated ones keep the dictionary."""
    n = 3 * ROW_GROUP_ROWS
    ids = np.arange(n)
    table = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "prompt": pa.array([f"task {i}" for i in ids.tolist()]),
            "source": pa.array(["gsm8k", "math"] * (n // 2)),
            "step": pa.array(ids // 500, pa.int64()),
            "solved": pa.array(ids % 3 == 0),
        }
    )
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append(table)
    [shard] = store.snapshot().shards
    path = tmp_path / "s" / shard.path
    assert not _dictionary_encoded(path, "id")
    assert not _dictionary_encoded(path, "prompt")
    assert _dictionary_encoded(path, "source")
    assert _dictionary_encoded(path, "step")
    assert store.snapshot().to_arrow().equals(table)


def test_every_column_type_round_trips_through_the_encoding_choice(tmp_path) -> None:
    import datetime
    import decimal

    n = ROW_GROUP_ROWS + 3
    ids = list(range(n))
    table = pa.table(
        {
            "i8": pa.array([i % 100 for i in ids], pa.int8()),
            "f32": pa.array([i / 3 for i in ids], pa.float32()),
            "large": pa.array([f"x{i}" for i in ids], pa.large_string()),
            "bin": pa.array([bytes([i % 256]) * 3 for i in ids], pa.binary()),
            "fixed": pa.array([i.to_bytes(4, "little") for i in ids], pa.binary(4)),
            "when": pa.array(
                [datetime.datetime(2026, 1, 1) + datetime.timedelta(seconds=i) for i in ids],
                pa.timestamp("us"),
            ),
            "dec": pa.array([decimal.Decimal(i) / 100 for i in ids], pa.decimal128(10, 2)),
            "nothing": pa.nulls(n),
            "labels": pa.array(["a", "b"] * (n // 2) + ["a"] * (n % 2)).dictionary_encode(),
            "mostly_null": pa.array([None] * (n - 1) + ["z"]),
        }
    )
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append(table)
    assert store.snapshot().to_arrow().equals(table)
    nested = pa.table({"ids": pa.array([[i, i + 1] for i in ids]), "k": pa.array(ids)})
    other = Store.open(str(tmp_path / "n"), create=True)
    other.append(nested)
    assert other.snapshot().to_arrow().equals(nested)


def test_row_groups_decoded_together_are_read_as_one_piece_in_any_order(tmp_path):
    """A batch's rows of several row groups of one shard, in shuffled order with repeats,
    some groups cached by an earlier read and some decoded now: every format gives the
    table's rows, and the groups decoded together are read through one decode."""
    from dynstate.loading import batch

    g = ROW_GROUP_ROWS
    store = Store.open(str(tmp_path / "s"), create=True)
    table = _table(0, 20 * g)  # 20 groups: four of them are read as row groups
    store.append(table)
    expected = table.to_pylist()
    ds = VersionedDataset(store)
    assert ds[2 * g + 5] == expected[2 * g + 5]  # group 2 cached alone
    rows = [3 * g + 1, 7, 2 * g + 9, 3 * g + 1, 0, 2 * g + 5, 9 * g + 99, 8]
    assert ds.read_batch(rows) == [expected[i] for i in rows]
    assert ds.read_batch(rows, "arrow").to_pylist() == [expected[i] for i in rows]
    assert ds.read_batch(rows, "columns")["prompt"] == [expected[i]["prompt"] for i in rows]

    fresh = VersionedDataset(store)
    view = fresh._view(fresh.version)
    found = batch.pieces(fresh.cache, fresh.store, view, np.asarray(rows))
    assert len(found) == 1  # groups 0, 2, 3 and 9 decoded together: one piece
    data, where, local = found[0]
    assert data.base is None
    got = [None] * len(rows)
    for position, row in zip(where.tolist(), local.tolist(), strict=True):
        got[position] = data.table.slice(row, 1).to_pylist()[0]
    assert got == [expected[i] for i in rows]
    # The parts cached per group slice their decode when first used on their own.
    assert fresh[3 * g + 2] == expected[3 * g + 2]


def test_new_shards_are_lz4_and_snappy_shards_of_older_stores_still_read(tmp_path, monkeypatch):
    """Shards are LZ4 (LZ4_RAW) for random access; a store whose earlier shards are Snappy,
    as dynstate wrote them before, reads both, by row group and whole, into the same rows."""
    import dynstate.records.rowgroups as rowgroups

    url = str(tmp_path / "s")
    monkeypatch.setattr(rowgroups, "COMPRESSION", "snappy")  # as written before the change
    store, _ = _build(url, shards=1)
    monkeypatch.undo()
    store.append(_table(ROWS, ROWS))
    table = pa.concat_tables([_table(0, ROWS), _table(ROWS, ROWS)])
    old, new = store.snapshot().shards
    codecs = []
    for shard in (old, new):
        meta = pq.read_metadata(tmp_path / "s" / shard.path)
        codecs.append(
            {
                meta.row_group(g).column(c).compression
                for g in range(meta.num_row_groups)
                for c in range(meta.num_columns)
            }
        )
    assert codecs == [{"SNAPPY"}, {"LZ4"}]
    rows = [3, ROW_GROUP_ROWS + 1, ROWS + 2, 2 * ROWS - 1]
    fresh = VersionedDataset(url, cache_dir=None)
    assert fresh.read_batch(rows, "arrow").to_pylist() == table.take(rows).to_pylist()
    assert Store.open(url).snapshot().to_arrow().equals(table)


def test_a_compacted_store_reads_only_the_row_groups_a_batch_needs(tmp_path):
    """Compaction writes and records row groups like a round's shards: a batch of a compacted
    store reads ranges, not the whole merged shard, and a flipped byte is still refused."""
    from dynstate import compact, verify_store

    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    sizes, start = [3000, 50, 4000, 10, 2940], 0  # 40 row groups, straddling the rounds
    for n in sizes:
        store.append(_table(start, n))
        start += n
    table = _table(0, start)
    compact(store, target_bytes=2**30)
    (shard,) = store.snapshot().shards
    assert shard.groups is not None
    full = start // ROW_GROUP_ROWS
    assert shard.groups.rows == (ROW_GROUP_ROWS,) * full + (start - full * ROW_GROUP_ROWS,)
    assert verify_store(store).ok
    fresh = Store.open(url)
    counted = _Counted(fresh.storage)
    rows = [3, 3500, start - 1]
    ds = VersionedDataset(fresh)
    assert ds.read_batch(rows) == [table.slice(r, 1).to_pylist()[0] for r in rows]
    assert counted.whole == []
    assert counted.bytes_read() < 0.2 * shard.bytes
    g = 3500 // ROW_GROUP_ROWS
    _flip(store, shard, sum(shard.groups.bytes[:g]) + shard.groups.bytes[g] // 2)
    with pytest.raises(ChecksumMismatchError, match=shard.path):
        VersionedDataset(url).read_batch([3500])
    assert VersionedDataset(url).read_batch([3])[0]["id"] == 3
