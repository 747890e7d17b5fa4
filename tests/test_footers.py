"""Row groups decoded without their shard's footer on object stores (dynstate.records.footers,
docs/format.md "Footer templates"): a random batch fetches one footer per schema, decodes
every other shard's row groups from their own verified bytes to exactly what the footer
would give, falls back to the footers whenever a record's template is not the one its
footer implies, and still refuses a flipped byte in any row group it reads."""

from __future__ import annotations

import uuid
from itertools import accumulate

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import s3_url
from test_rowgroups import _Counted, _flip

import dynstate.records.rowgroups as rowgroups
from dynstate import ChecksumMismatchError, CorruptStoreError, Store, VersionedDataset
from dynstate.loading.ranged import Footers, read_groups, segment_bounds
from dynstate.records import manifest as m
from dynstate.records.footers import Template, mini_file, shard_template

G = rowgroups.OBJECT_STORE_GROUP_ROWS
ROWS = 20 * G + 17  # 21 row groups a shard: a batch of two rows reads it in part


def _varied(start: int, n: int) -> pa.Table:
    """Every kind of flat column a round holds: ints, floats, strings (plain and
    dictionary-encoded by the writer), nulls, bools, timestamps, structs, binary, and a
    column that is a dictionary type in Arrow."""
    ids = np.arange(start, start + n)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "reward": pa.array((ids % 7) / 7.0),
            "prompt": pa.array([f"task {i}: " + "x" * (i % 50) for i in ids.tolist()]),
            "label": pa.array([("easy", "hard", "mid")[i % 3] for i in ids.tolist()]),
            "maybe": pa.array([None if i % 4 == 0 else int(i) for i in ids.tolist()]),
            "solved": pa.array((ids % 2 == 0).tolist()),
            "at": pa.array(ids.astype("datetime64[ms]")),
            "meta": pa.array([{"k": int(i), "src": str(i % 5)} for i in ids.tolist()]),
            "blob": pa.array([bytes([i % 251]) * (i % 300) for i in ids.tolist()], pa.binary()),
            "split": pa.array([("train", "dev")[i % 2] for i in ids.tolist()]).dictionary_encode(),
        }
    )


def _build(url: str, shards: int = 4, make=_varied) -> tuple[Store, pa.Table]:
    store = Store.open(url, create=True)
    for k in range(shards):
        store.append(make(k * ROWS, ROWS))
    return store, pa.concat_tables([make(k * ROWS, ROWS) for k in range(shards)])


def _footer_reads(counted: _Counted, store: Store) -> list[str]:
    """The shards whose footer segment (the file's last bytes) a read fetched."""
    sizes = {s.path: s.bytes for s in store.snapshot().shards}
    return [path for path, _, end in counted.ranges if end == sizes.get(path)]


def _rows_in_every_shard(store: Store) -> list[int]:
    """Two rows in distinct row groups of every shard (never all of a shard's groups, so
    every shard is read in part)."""
    starts = list(accumulate((s.rows for s in store.snapshot().shards), initial=0))
    return [start + off for start in starts[:-1] for off in (G + 3, 4 * G + 1)]


def test_new_shards_on_an_object_store_name_their_template_and_its_row_group_size():
    store, _ = _build(f"memory://footers/{uuid.uuid4().hex}", shards=1)
    (shard,) = store.snapshot().shards
    assert shard.groups is not None
    assert shard.groups.rows == (G,) * 20 + (17,)
    schema = store.snapshot().schema
    assert schema is not None
    assert shard.groups.template == shard_template(schema, rowgroups.COMPRESSION)
    assert shard.groups.template is not None


def test_a_batch_on_an_object_store_fetches_one_footer_and_decodes_the_rest_without():
    store, table = _build(f"memory://footers/{uuid.uuid4().hex}")
    fresh = VersionedDataset(store.url, cache_dir=None)
    counted = _Counted(fresh.store.storage)
    rows = _rows_in_every_shard(store)
    assert fresh.read_batch(rows) == table.take(rows).to_pylist()
    assert counted.whole == []
    assert len(_footer_reads(counted, store)) == 1  # the first shard's: it taught the template
    # the next batch of the same dataset, other rows: no footer at all
    more = [r + 1 for r in rows]
    counted.ranges.clear()
    assert fresh.read_batch(more) == table.take(more).to_pylist()
    assert _footer_reads(counted, store) == []


@pytest.mark.s3
def test_on_s3_footerless_reads_fetch_less_and_a_flipped_byte_is_still_refused(s3_endpoint):
    store, table = _build(s3_url())
    rows = _rows_in_every_shard(store)
    fresh = VersionedDataset(store.url, cache_dir=None)
    counted = _Counted(fresh.store.storage)
    assert fresh.read_batch(rows) == table.take(rows).to_pylist()
    assert len(_footer_reads(counted, store)) == 1
    shard = store.snapshot().shards[2]
    assert shard.groups is not None
    _flip(store, shard, sum(shard.groups.bytes[:4]) + 10)  # row group 4 of the third shard
    again = VersionedDataset(store.url, cache_dir=None)
    start = sum(s.rows for s in store.snapshot().shards[:2])
    row = start + sum(shard.groups.rows[:4]) + 1
    again.read_batch([1])  # the first shard teaches the template: the next read is footerless
    with pytest.raises(ChecksumMismatchError, match=shard.path):
        again.read_batch([row])
    assert again.read_batch([start + 1])[0]["id"] == start + 1  # row group 0 is intact


def test_a_schema_with_a_list_column_has_no_template_and_reads_with_footers():
    def with_list(start: int, n: int) -> pa.Table:
        return _varied(start, n).append_column(
            "tokens", pa.array([[i, i + 1][: i % 3] for i in range(start, start + n)])
        )

    store, table = _build(f"memory://footers/{uuid.uuid4().hex}", shards=3, make=with_list)
    assert all(s.groups is not None and s.groups.template is None for s in store.snapshot().shards)
    fresh = VersionedDataset(store.url, cache_dir=None)
    counted = _Counted(fresh.store.storage)
    rows = _rows_in_every_shard(store)
    assert fresh.read_batch(rows) == table.take(rows).to_pylist()
    assert len(_footer_reads(counted, store)) == 3


def test_a_record_whose_template_its_footer_does_not_imply_is_read_with_the_footers():
    """Shards naming one template that no footer implies: the first footer fetched teaches
    nothing, and the shards waiting for it fetch theirs (not their row groups again)."""
    store, table = _build(f"memory://footers/{uuid.uuid4().hex}", shards=3)
    shards = store.snapshot().shards
    bogus = "ab" * 32
    doctored = [
        s._replace(groups=s.groups._replace(template=bogus)) for s in shards if s.groups is not None
    ]
    wanted = [(s, [1, 3]) for s in doctored]
    counted = _Counted(store.storage)
    got = read_groups(store, wanted, store.head, Footers())
    for k, part in enumerate(got):
        g = ROWS * k
        expected = pa.concat_tables([table.slice(g + G, G), table.slice(g + 3 * G, G)])
        assert part.equals(expected)
    assert sorted(_footer_reads(counted, store)) == sorted(s.path for s in shards)
    fetched = [(path, start) for path, start, _ in counted.ranges]
    assert len(fetched) == len(set(fetched))  # the shards that waited fetch only their footers


def test_a_template_no_footer_implies_is_not_waited_for_again():
    """A store whose records name a template this reader cannot rebuild (written by another
    pyarrow, say): once one footer taught nothing, later batches read its shards with their
    footers in one pass, each row group fetched once, not after waiting on another footer."""
    store, table = _build(f"memory://footers/{uuid.uuid4().hex}", shards=3)
    bogus = "cd" * 32
    doctored = [
        s._replace(groups=s.groups._replace(template=bogus))
        for s in store.snapshot().shards
        if s.groups is not None
    ]
    footers = Footers()
    read_groups(store, [(doctored[0], [1])], store.head, footers)
    counted = _Counted(store.storage)
    got = read_groups(store, [(s, [2]) for s in doctored[1:]], store.head, footers)
    for k, part in enumerate(got, start=1):
        assert part.equals(table.slice(ROWS * k + 2 * G, G))
    fetched = [(path, start) for path, start, _ in counted.ranges]
    assert len(fetched) == len(set(fetched)) == 4  # each shard's group and its footer, once


def test_shards_of_two_codecs_each_decode_with_their_own_template(monkeypatch):
    """Shards written with Snappy (as dynstate did before LZ4) beside LZ4 ones: their records
    name different templates, each learned from a footer of its own codec."""
    url = f"memory://footers/{uuid.uuid4().hex}"
    store = Store.open(url, create=True)
    monkeypatch.setattr(rowgroups, "COMPRESSION", "snappy")
    store.append(_varied(0, ROWS))
    store.append(_varied(ROWS, ROWS))
    monkeypatch.setattr(rowgroups, "COMPRESSION", "lz4")
    store.append(_varied(2 * ROWS, ROWS))
    store.append(_varied(3 * ROWS, ROWS))
    table = pa.concat_tables([_varied(k * ROWS, ROWS) for k in range(4)])
    digests = [s.groups.template for s in store.snapshot().shards if s.groups is not None]
    assert digests[0] == digests[1] != digests[2] == digests[3]
    fresh = VersionedDataset(url, cache_dir=None)
    counted = _Counted(fresh.store.storage)
    rows = _rows_in_every_shard(store)
    assert fresh.read_batch(rows) == table.take(rows).to_pylist()
    assert len(_footer_reads(counted, store)) == 2


def _group_bytes(store: Store, shard: m.ShardRef, g: int) -> bytes:
    assert shard.groups is not None
    bounds = segment_bounds(shard.groups)
    data = store.read_shard_bytes(shard)
    return data[bounds[g] + (4 if g == 0 else 0) : bounds[g + 1]]


def test_a_synthesized_footer_decodes_each_group_as_the_real_one_and_refuses_a_wrong_one():
    store, _ = _build(f"memory://footers/{uuid.uuid4().hex}", shards=1)
    (shard,) = store.snapshot().shards
    assert shard.groups is not None
    real = pq.ParquetFile(pa.BufferReader(store.read_shard_bytes(shard)))
    template = Template(real.schema_arrow, rowgroups.COMPRESSION)
    assert template.digest == shard.groups.template
    for g, rows in enumerate(shard.groups.rows):
        data = mini_file(template, _group_bytes(store, shard, g), rows)
        assert data is not None
        decoded = pq.ParquetFile(pa.BufferReader(data)).read_row_group(0)
        assert decoded.equals(real.read_row_group(g))
    group = _group_bytes(store, shard, 2)
    assert mini_file(template, group, G - 1) is None  # the pages hold other row counts
    assert mini_file(template, group, G + 1) is None
    assert mini_file(template, group[:-1], G) is None  # the pages do not fill it
    assert mini_file(template, group + b"\x00", G) is None
    assert mini_file(template, b"\xff" * 64, G) is None  # not page headers at all
    assert mini_file(template, b"", G) is None


def test_a_malformed_template_in_a_record_is_a_corrupt_store():
    groups = {"rows": [2], "bytes": [10, 20], "sha256": "a" * 128}
    assert m.RowGroups.checked(groups, 2, 30, "x").template is None
    ok = m.RowGroups.checked({**groups, "template": "b" * 64}, 2, 30, "x")
    assert ok.template == "b" * 64 and ok.to_json()["template"] == "b" * 64
    for bad in ("B" * 64, "b" * 63, "", 7, ["b" * 64]):
        with pytest.raises(CorruptStoreError, match="malformed row group entry"):
            m.RowGroups.checked({**groups, "template": bad}, 2, 30, "x")


@pytest.mark.parametrize(
    "table",
    [
        _varied(0, 3 * G),
        _varied(0, 3 * G).replace_schema_metadata({"source": "gen-7", "round": "3"}),
        pa.table(
            {
                "a": pa.array(range(3 * G), pa.int32()),
                "b": pa.array([str(i % 3) for i in range(3 * G)]),  # dictionary-encoded
            },
            schema=pa.schema(
                [
                    pa.field("a", pa.int32(), nullable=False, metadata={"unit": "step"}),
                    pa.field("b", pa.string()),
                ]
            ),
        ),
    ],
    ids=["varied", "schema-metadata", "field-metadata"],
)
def test_a_template_is_byte_for_byte_the_shard_footer_around_its_row_groups(table):
    """What the digest promises: the fields the template takes from an empty file's footer
    are exactly those of the footer the writer wrote for a shard of that schema."""
    from dynstate.records.footers import _halves, read_struct

    store = Store.open(f"memory://footers/{uuid.uuid4().hex}", create=True)
    store.append(table)
    (shard,) = store.snapshot().shards
    assert shard.groups is not None and shard.groups.template is not None
    data = store.read_shard_bytes(shard)
    size = int.from_bytes(data[-8:-4], "little")
    meta, _ = read_struct(data[-8 - size : -8], 0)
    real = pq.ParquetFile(pa.BufferReader(data))
    template = Template(real.schema_arrow, rowgroups.COMPRESSION)
    assert (template.prefix, template.suffix) == _halves(meta)
    assert template.digest == shard.groups.template
