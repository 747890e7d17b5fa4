"""Export one version's rows, in order, to a local Parquet file or a Hugging Face
``datasets`` directory. The output appears complete or not at all: it is written under a
temporary name next to it and renamed."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import InvalidDataError, StorageError, StoreExistsError
from .snapshot import Snapshot

FORMATS = ("parquet", "datasets")


def export(
    snap: Snapshot,
    out: str | os.PathLike[str],
    *,
    fmt: str = "parquet",
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> str:
    """Write ``snap``'s rows to ``out``; returns the path written. Parquet is streamed shard
    by shard; a ``datasets`` directory loads with ``datasets.load_from_disk(out)``."""
    out = os.fspath(out)
    if fmt not in FORMATS:
        raise InvalidDataError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    if os.path.lexists(out) and not overwrite:
        raise StoreExistsError(
            f"{out} exists; choose another path or pass overwrite=True (--overwrite)"
        )
    tmp = os.path.join(os.path.dirname(os.path.abspath(out)), f".{uuid.uuid4().hex}.tmp")
    try:
        if fmt == "parquet":
            _write_parquet(snap, tmp, progress)
        else:
            _write_datasets(snap, tmp, progress)
        _remove(out)
        os.replace(tmp, out)
    except OSError as exc:
        raise StorageError(f"cannot write version {snap.version} to {out}: {exc}") from exc
    finally:
        _remove(tmp)
    return out


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _tables(snap: Snapshot, progress: Callable[[int, int], None] | None):
    for i in range(len(snap.shards)):
        yield snap.read_shard(i)
        if progress is not None:
            progress(i + 1, len(snap.shards))


def _write_parquet(snap: Snapshot, path: str, progress) -> None:
    schema = snap.schema if snap.schema is not None else pa.schema([])
    with pq.ParquetWriter(path, schema) as writer:
        for table in _tables(snap, progress):
            writer.write_table(table)


def _write_datasets(snap: Snapshot, path: str, progress) -> None:
    import datasets

    tables = list(_tables(snap, progress))
    table = pa.concat_tables(tables) if tables else snap.to_arrow()
    datasets.disable_progress_bars()  # the caller shows its own
    datasets.Dataset(table).save_to_disk(path)
