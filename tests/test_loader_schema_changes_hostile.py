"""Hostile audit: what a StatefulDataLoader over VersionedDataset / VersionedSampler yields
while the store's schema changes under a training run. Rounds appended between epochs and
during one (mix mode) add nullable columns (``allow_new_columns=True``), promote columns that
were null so far (``None -> int``, ``[] -> list<int>``, a struct field ``None -> str``) and add
a dictionary (pandas ``Categorical``) column; datasets select ``columns=[...]``; every
``batch_format``; ``num_workers`` 0 and 2; resume from ``loader.state_dict()``; compaction and
gc between epochs.

Oracle (docs/format.md "Schema policy"; docs/api.md ``VersionedDataset``): the version an
index names (``dynstate.decode_index``) read whole with plain pyarrow, shard by shard
(``pq.read_table(root/shard.path)``), each shard shaped like the version's schema (columns it
lacks as nulls of the version's type, columns null so far cast to it), concatenated, then
``take`` the row. Each test that fails is a defect ("DEFECT." docstrings); "Guard." tests pin
behaviour that held."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import dynstate
from dynstate import (
    Store,
    VersionedDataset,
    VersionedSampler,
    decode_index,
    encode_index,
    rollback,
)
from dynstate.maintenance.compact import compact
from dynstate.maintenance.gc import collect_garbage

ROW = "_dynstate_row"
BATCH = 4
BASE_ROWS = 16  # four steps per epoch at BATCH


# -- the store: a first round with columns null so far, rounds that change the schema ----------


def _first_round() -> list[dict]:
    return [
        {"id": i, "p": f"q{i}", "maybe": None, "lst": [], "st": {"a": i, "b": None}}
        for i in range(BASE_ROWS)
    ]


def _round(step: int, start: int):
    """The round of ``step`` (deterministic, so a resumed run commits the same rounds):
    (data, allow_new_columns). Step 0 promotes the null columns, step 1 adds a string column,
    step 2 a pandas Categorical, step 3 has nulls in the new columns, step 4 adds a
    float column, later steps bring values in every column."""
    ids = list(range(start, start + 3))
    if step == 0:
        rows = [
            {"id": i, "p": f"q{i}", "maybe": i, "lst": [i, i + 1], "st": {"a": i, "b": f"b{i}"}}
            for i in ids
        ]
        return rows, False
    if step == 1:
        rows = [
            {
                "id": i,
                "p": f"q{i}",
                "maybe": None,
                "lst": [i],
                "st": {"b": "x", "a": i},
                "extra": f"e{i}",
            }
            for i in ids
        ]
        return rows, True
    if step == 2:
        frame = pd.DataFrame(
            {
                "id": ids,
                "p": [f"q{i}" for i in ids],
                "maybe": [7, 8, 9],
                "lst": [[1], [], [2, 3]],
                "st": [{"a": 1, "b": "y"}, {"a": 2, "b": None}, {"a": 3, "b": "z"}],
                "extra": ["x", None, "z"],
                "cat": pd.Categorical(["red", "blue", "red"]),
            }
        )
        return frame, True
    if step == 3:
        rows = [
            {
                "id": i,
                "p": f"q{i}",
                "maybe": None,
                "lst": [],
                "st": {"a": i, "b": None},
                "extra": None,
                "cat": None,
            }
            for i in ids
        ]
        return rows, False
    if step == 4:
        rows = [
            {
                "id": i,
                "p": f"q{i}",
                "maybe": 1,
                "lst": [9],
                "st": {"a": i, "b": "w"},
                "extra": "e",
                "cat": None,
                "score": 0.5 + i,
            }
            for i in ids
        ]
        return rows, True
    frame = pd.DataFrame(
        {
            "id": ids,
            "p": [f"q{i}" for i in ids],
            "maybe": [step, step + 1, step + 2],
            "lst": [[step], [step, 1], []],
            "st": [{"a": step, "b": "s"}] * 3,
            "extra": [f"s{step}"] * 3,
            "cat": pd.Categorical([f"c{step}", "green", f"c{step}"]),
            "score": [float(step), None, 1.5],
        }
    )
    return frame, False


def _commit_round(store: Store, step: int) -> int:
    head = store.snapshot(store.resolve(None))
    data, allow = _round(step, 1000 + head.num_rows)
    return store.append(data, meta={"step": step}, allow_new_columns=allow)


def _new_store(tmp_path, name: str = "store") -> tuple[Store, str]:
    root = str(tmp_path / name)
    store = Store.open(root, create=True)
    store.append(_first_round(), shard_bytes=400)  # several shards
    return store, root


# -- the oracle -------------------------------------------------------------------------------


class Oracle:
    """A version's rows read whole with plain pyarrow."""

    def __init__(self, root: str):
        self.root = root
        self.store = Store.open(root)
        self._tables: dict[int, pa.Table] = {}

    def schema(self, version: int) -> pa.Schema:
        return self.store.snapshot(version).schema

    def table(self, version: int) -> pa.Table:
        if version not in self._tables:
            snap = self.store.snapshot(version)
            schema = snap.schema
            parts = []
            for shard in snap.shards:
                t = pq.read_table(os.path.join(self.root, shard.path))
                cols = []
                for f in schema:
                    if f.name in t.column_names:
                        c = t.column(f.name)
                        cols.append(c if c.type == f.type else c.cast(f.type))
                    else:
                        cols.append(pa.nulls(t.num_rows, f.type))
                parts.append(pa.Table.from_arrays(cols, schema=schema))
            self._tables[version] = pa.concat_tables(parts)
        return self._tables[version]

    def row(self, index: int, columns=None, row_column=None) -> dict:
        version, row = decode_index(index)
        assert version is not None, "sampler indices carry their version"
        item = self.table(version).slice(row, 1).to_pylist()[0]
        if columns is not None:
            item = {c: item[c] for c in columns}
        if row_column is not None:
            item[row_column] = row
        return item

    def names(self, version: int, columns=None, row_column=None) -> list[str]:
        names = list(columns) if columns is not None else list(self.schema(version).names)
        return names + ([row_column] if row_column else [])


def check_batch(oracle: Oracle, indices, batch, fmt: str, columns=None, row_column=None):
    """``batch`` (as ``__getitems__(indices)`` returned it in ``fmt``) against the oracle."""
    indices = [int(i) for i in indices]
    expected = [oracle.row(i, columns, row_column) for i in indices]
    versions = [decode_index(i)[0] for i in indices]
    if fmt == "rows":
        assert isinstance(batch, list) and len(batch) == len(indices)
        for i, (got, want, v) in enumerate(zip(batch, expected, versions, strict=True)):
            assert list(got) == oracle.names(v, columns, row_column), (i, v, list(got))
            assert got == want, (i, v, got, want)
        return
    # the columnar formats: rows of versions with fewer columns have None there
    names: list[str] = []
    for v in sorted(set(versions)):
        for n in oracle.names(v, columns, row_column):
            if n not in names:
                names.append(n)
    full = [{n: want.get(n) for n in names} for want in expected]
    if fmt == "columns":
        assert sorted(batch) == sorted(names), (list(batch), names)
        got_rows = [{n: batch[n][k] for n in names} for k in range(len(indices))]
        assert got_rows == full
        return
    assert fmt == "arrow"
    assert isinstance(batch, pa.RecordBatch), type(batch)
    newest = max(versions)
    schema = oracle.schema(newest)
    want_fields = [schema.field(n) for n in (schema.names if columns is None else columns)]
    if row_column:
        want_fields.append(pa.field(row_column, pa.int64()))
    assert batch.schema.names == [f.name for f in want_fields], (batch.schema, want_fields)
    for got_f, want_f in zip(batch.schema, want_fields, strict=True):
        assert got_f.type == want_f.type, (got_f, want_f)
    assert batch.to_pylist() == [{n: r[n] for n in batch.schema.names} for r in full]


class Recording(VersionedDataset):
    """A VersionedDataset whose batches carry the indices they were read from."""

    def __getitems__(self, indices):
        return [int(i) for i in indices], super().__getitems__(indices)


def _unwrap(batch):
    return batch


def _loader(dataset, sampler, workers: int) -> StatefulDataLoader:
    kwargs = {"prefetch_factor": 1} if workers else {}
    loader = StatefulDataLoader(
        dataset,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=workers,
        collate_fn=_unwrap,
        **kwargs,
    )
    sampler.check_loader(loader)
    return loader


def _lag(workers: int) -> int:
    return workers * 1 + 1


# -- epoch mode -------------------------------------------------------------------------------


def _train(
    store,
    loader,
    oracle,
    *,
    epochs,
    step,
    fmt,
    columns=None,
    row_column=None,
    between=None,
    save_at=None,
    pins=None,
    rounds=None,
):
    """The README's loop: take a batch, check it against the oracle, commit the step's round,
    and at step ``save_at`` checkpoint ``loader.state_dict()`` (after the round, as
    docs/resume.md orders it). Returns the batches seen [(step, indices, batch)] and the
    checkpoint (None without ``save_at``)."""
    seen = []
    saved = None
    rounds = {} if rounds is None else rounds
    for epoch in range(epochs):
        first = True
        for indices, batch in loader:
            check_batch(oracle, indices, batch, fmt, columns, row_column)
            if pins is not None and first:
                pins.append((step, decode_index(indices[0])[0]))
            first = False
            seen.append((step, indices, batch))
            rounds[step] = _commit_round(store, step)
            if save_at is not None and step == save_at:
                saved = loader.state_dict()
            step += 1
        if between is not None:
            between(epoch)
    return seen, saved


def _plain(batch, fmt):
    """A batch as plain Python rows (for comparing two runs)."""
    if fmt == "arrow":
        return batch.to_pylist()
    if fmt == "columns":
        n = len(next(iter(batch.values()))) if batch else 0
        return [{k: v[i] for k, v in sorted(batch.items())} for i in range(n)]
    return batch


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fmt", ["rows", "columns", "arrow"])
def test_guard_epoch_mode_batches_equal_the_pinned_version_as_schema_changes(
    tmp_path, fmt, workers
):
    """Guard. epoch mode over rounds that promote null columns, add a string, a Categorical and
    a float column: every batch is the rows of the version its epoch pinned (epoch 0: the
    first round; epoch e + 1: the round of the step before it, docs/resume.md), with that
    version's columns and types, in every batch_format, with and without workers."""
    store, root = _new_store(tmp_path)
    oracle = Oracle(root)
    ds = Recording(store, batch_format=fmt, row_column=ROW)
    sampler = VersionedSampler(ds, seed=3, batch_size=BATCH)
    loader = _loader(ds, sampler, workers)
    pins: list = []
    rounds: dict = {}
    _train(
        store,
        loader,
        oracle,
        epochs=2 if workers else 3,
        step=0,
        fmt=fmt,
        row_column=ROW,
        pins=pins,
        rounds=rounds,
    )
    assert pins[0] == (0, 1)
    for start, version in pins[1:]:
        assert version == rounds[start - 1], (start, version, rounds)


# -- mix mode: fresh rows of newer schemas in the pinned version's batches ---------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fmt", ["rows", "columns", "arrow"])
def test_mix_mode_batches_equal_pinned_and_fresh_versions_as_schema_changes(tmp_path, fmt, workers):
    """Guard. mix mode (docs/resume.md "Mix mode") joins the pinned version's rows with
    fresh rows of rounds committed during the epoch, which promote null columns and add
    columns. Each item equals its own version's row (the pinned one, or the newer version
    its fresh row comes from); the columnar formats give None where an older version lacks a
    column; an arrow batch has one schema that holds every row (the newest version's)."""
    store, root = _new_store(tmp_path)
    oracle = Oracle(root)
    ds = Recording(store, batch_format=fmt, row_column=ROW)
    sampler = VersionedSampler(
        ds,
        seed=5,
        mode="mix",
        batch_size=BATCH,
        fresh_share=0.5,
        lag=_lag(workers),
        wait_timeout=30,
    )
    loader = _loader(ds, sampler, workers)
    seen, _ = _train(store, loader, oracle, epochs=2, step=0, fmt=fmt, row_column=ROW)
    mixed = [s for s, idx, _ in seen if len({decode_index(i)[0] for i in idx}) > 1]
    assert mixed, "some batches join rows of two versions"


# -- resume after schema changes ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "fmt", "workers"),
    [("epoch", "arrow", 0), ("epoch", "rows", 2), ("mix", "columns", 0), ("mix", "arrow", 2)],
)
def test_guard_resume_mid_epoch_after_schema_changes_in_a_new_loader(tmp_path, mode, fmt, workers):
    """Guard. a checkpoint taken mid-epoch after rounds promoted and added columns, resumed
    in a new dataset/sampler/loader after ``rollback(step=...)`` (docs/resume.md "The save /
    resume sequence"): the batches from the next step on hold the rows the uninterrupted run
    got, each equal to the oracle's row of its version."""
    store, root = _new_store(tmp_path)
    oracle = Oracle(root)
    kw = {"mode": mode, "batch_size": BATCH, "seed": 11}
    if mode == "mix":
        kw |= {"fresh_share": 0.5, "lag": _lag(workers), "wait_timeout": 30}
    ds = Recording(store, batch_format=fmt, row_column=ROW)
    loader = _loader(ds, VersionedSampler(ds, **kw), workers)
    save_at = 5  # epoch 1 (steps 4..), after the columns were added and promoted
    seen, ckpt = _train(
        store, loader, oracle, epochs=2, step=0, fmt=fmt, row_column=ROW, save_at=save_at
    )
    assert ckpt is not None
    reference = [_plain(b, fmt) for s, _, b in seen if s > save_at]
    ckpt = torch.load(_save(tmp_path, ckpt), weights_only=True)

    store2 = Store.open(root)
    rollback(store2, step=save_at)
    ds2 = Recording(store2, batch_format=fmt, row_column=ROW)
    loader2 = _loader(ds2, VersionedSampler(ds2, **kw), workers)
    loader2.load_state_dict(ckpt)
    resumed, _ = _train(
        store2, loader2, Oracle(root), epochs=2 - 1, step=save_at + 1, fmt=fmt, row_column=ROW
    )
    assert [_plain(b, fmt) for _, _, b in resumed] == reference


def _save(tmp_path, state) -> str:
    path = str(tmp_path / "ckpt.pt")
    torch.save(state, path)
    return path


# -- compaction and gc between epochs ----------------------------------------------------------


@pytest.mark.parametrize(("fmt", "workers"), [("rows", 0), ("arrow", 2), ("columns", 2)])
def test_guard_compaction_and_gc_between_epochs_keep_batches_exact(tmp_path, fmt, workers):
    """Guard. between epochs the store is compacted (rows of the first round, null columns
    and all, rewritten with the promoted and added columns) and gc'd down to the two newest
    versions; the next epochs pin by the step rule and read the compacted shards, shaped
    like their version's schema (a column added after the compaction reads as nulls)."""
    store, root = _new_store(tmp_path)
    oracle = Oracle(root)
    compacted = []

    def between(epoch):
        if epoch == 2:
            return  # after the last epoch
        compacted.append(compact(store, target_bytes=1 << 20))
        collect_garbage(store, keep=2, grace_s=0, dry_run=False)

    ds = Recording(store, batch_format=fmt, row_column=ROW)
    loader = _loader(ds, VersionedSampler(ds, seed=2, batch_size=BATCH), workers)
    pins: list = []
    rounds: dict = {}
    _train(
        store,
        loader,
        oracle,
        epochs=3,
        step=0,
        fmt=fmt,
        row_column=ROW,
        between=between,
        pins=pins,
        rounds=rounds,
    )
    assert [p[1] for p in pins[1:]] == [rounds[s - 1] for s, _ in pins[1:]]
    # epoch 2 reads a version made on top of the first compaction: its first shard is
    # the compacted one, which holds the first round's rows under the promoted schema
    first = store.snapshot(pins[2][1]).shards[0]
    assert first.rows > BASE_ROWS


_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    import test_loader_schema_changes_hostile as t
    from dynstate import Store, VersionedSampler, rollback

    root, ckpt_path, out, fmt, workers = sys.argv[2:7]
    workers = int(workers)
    columns = json.loads(sys.argv[7])
    kw = json.loads(sys.argv[8])
    save_at = int(sys.argv[9])
    ckpt = torch.load(ckpt_path, weights_only=True)
    store = Store.open(root)
    rollback(store, step=save_at)
    ds = t.Recording(store, batch_format=fmt, row_column=t.ROW, columns=columns)
    loader = t._loader(ds, VersionedSampler(ds, **kw), workers)
    loader.load_state_dict(ckpt)
    seen, _ = t._train(store, loader, t.Oracle(root), epochs=1, step=save_at + 1, fmt=fmt,
                       columns=columns, row_column=t.ROW)
    with open(out, "w") as fh:
        json.dump([t._plain(b, fmt) for _, _, b in seen], fh)
    """
)


@pytest.mark.parametrize("fmt", ["arrow", "rows"])
def test_guard_resume_in_a_new_process_with_columns_added_later(tmp_path, fmt):
    """Guard. a mix-mode run whose dataset selects ``columns=[...]`` that were added by
    rounds (a Categorical and a string column, in another order than the schema's), with two
    loader workers, checkpointed mid-epoch with ``torch.save(loader.state_dict())`` and
    resumed in a fresh process after ``rollback(step=...)``: the rest of the epoch is the
    uninterrupted run's batches, each equal to the oracle's row of its version."""
    store, root = _new_store(tmp_path)
    # the columns exist before the run starts (rounds of steps 0..2 of an earlier run)
    for s in range(3):
        _commit_round(store, s)
    store.append(*([_round(3, 5000)[0]]), meta={"step": 3})
    columns = ["cat", "id", "maybe", "st", "extra"]
    workers = 2
    kw = {
        "mode": "mix",
        "batch_size": BATCH,
        "seed": 4,
        "fresh_share": 0.5,
        "lag": _lag(workers),
        "wait_timeout": 30,
        "first_step": 4,
    }
    oracle = Oracle(root)
    ds = Recording(store, batch_format=fmt, row_column=ROW, columns=columns)
    loader = _loader(ds, VersionedSampler(ds, **kw), workers)
    save_at = 6
    seen, ckpt = _train(
        store,
        loader,
        oracle,
        epochs=1,
        step=4,
        fmt=fmt,
        columns=columns,
        row_column=ROW,
        save_at=save_at,
    )
    reference = [_plain(b, fmt) for s, _, b in seen if s > save_at]
    assert reference and ckpt is not None
    ckpt_path = _save(tmp_path, ckpt)
    out = str(tmp_path / "resumed.json")
    here = os.path.dirname(os.path.abspath(__file__))
    import json

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            here,
            root,
            ckpt_path,
            out,
            fmt,
            str(workers),
            json.dumps(columns),
            json.dumps(kw),
            str(save_at),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as fh:
        resumed = json.load(fh)
    assert resumed == json.loads(json.dumps(reference))


# -- __getitems__ directly: unsorted, repeated, several versions, row groups, columns ---------


def test_guard_getitems_unsorted_repeated_indices_across_schema_versions(tmp_path):
    """Guard. ``__getitems__`` of unsorted, repeated sampler indices naming rows of several
    versions (null columns and their promotions, added string / Categorical / float columns,
    shards of many row groups read in part), under ``columns=[...]`` in another order than the
    schema's, ``columns=[]`` and ``row_column``: every format equals the oracle (docs/api.md
    ``VersionedDataset``: rows of versions with fewer columns have None there in the columnar
    formats)."""
    import random

    store, root = _new_store(tmp_path)
    n = 3000  # 12 row groups of 256 rows: a few rows read group by group
    big = pd.DataFrame(
        {
            "id": range(n),
            "p": [f"q{i}" for i in range(n)],
            "maybe": range(n),
            "lst": [[i] for i in range(n)],
            "st": [{"a": i, "b": f"b{i % 7}"} for i in range(n)],
            "extra": [None if i % 3 else f"e{i}" for i in range(n)],
            "cat": pd.Categorical([f"c{i % 300}" for i in range(n)]),
            "score": [i / 4 for i in range(n)],
        }
    )
    versions = [1] + [_commit_round(store, s) for s in range(6)]
    versions.append(store.append(big, meta={"step": 6}))
    oracle = Oracle(root)
    rng = random.Random(7)
    selections = [None, ["st", "id", "maybe"], [], ["lst"], ["cat", "id"], ["score", "extra"]]
    for columns in selections:
        usable = [
            v
            for v in versions
            if columns is None or all(c in store.snapshot(v).schema.names for c in columns)
        ]
        for fmt in ("rows", "columns", "arrow"):
            for row_column in (None, ROW):
                ds = VersionedDataset(
                    root, batch_format=fmt, columns=columns, row_column=row_column
                )
                for _ in range(3):
                    idx = []
                    for _ in range(7):
                        v = rng.choice(usable)
                        idx.append(encode_index(v, rng.randrange(store.snapshot(v).num_rows)))
                    idx += idx[:3]
                    rng.shuffle(idx)
                    check_batch(oracle, idx, ds.__getitems__(idx), fmt, columns, row_column)
                    one = idx[0]
                    assert ds[one] == oracle.row(one, columns, row_column)


def test_guard_columns_naming_a_column_the_pinned_version_lacks_is_refused(tmp_path):
    """Guard. a dataset whose ``columns=[...]`` names a column added after the version a
    checkpoint pinned is refused with InvalidDataError naming it (View: "columns [...] are
    not in version N"), never read as some other column or silently dropped."""
    store, _ = _new_store(tmp_path)
    with pytest.raises(dynstate.InvalidDataError, match="extra"):
        Recording(store, columns=["id", "extra"], row_column=ROW)  # checked here
    ds = Recording(store, columns=["id", "extra"])
    loader = _loader(ds, VersionedSampler(ds, seed=0, batch_size=BATCH), 0)
    with pytest.raises(dynstate.InvalidDataError, match="extra"):
        next(iter(loader))


@pytest.mark.parametrize(
    ("first", "later"),
    [
        ([{"a": 1, "c": [{"x": None}]}], [{"a": 2, "c": [{"x": "s"}]}]),
        ([{"a": 1, "c": {"x": []}}], [{"a": 2, "c": {"x": [1]}}]),
        ([{"a": 1, "c": [[]]}], [{"a": 2, "c": [[1]]}]),
        ([{"a": 1, "c": {"x": {"y": None}}}], [{"a": 2, "c": {"x": {"y": 3}}}]),
        ([{"a": 1, "c": []}], [{"a": 2, "c": [{"x": 1}]}]),
        ([{"a": 1, "c": None}], [{"a": 2, "c": {"x": "s"}}]),
    ],
    ids=["list-struct", "struct-list", "list-list", "struct-struct", "list-to-structs", "null"],
)
def test_guard_nested_null_promotions_in_batches_joining_two_versions(tmp_path, first, later):
    """Guard. a null type nested in a list or struct (docs/format.md "Schema policy"),
    promoted by a later round; a batch joining rows of both versions (mix mode's pinned and
    fresh rows) equals the oracle in every format, the arrow batch under the newer type."""
    root = str(tmp_path / "store")
    store = Store.open(root, create=True)
    v1, v2 = store.append(first), store.append(later)
    oracle = Oracle(root)
    idx = [encode_index(v2, 1), encode_index(v1, 0), encode_index(v2, 0), encode_index(v1, 0)]
    for fmt in ("rows", "columns", "arrow"):
        ds = VersionedDataset(root, batch_format=fmt, row_column=ROW)
        check_batch(oracle, idx, ds.__getitems__(idx), fmt, None, ROW)
