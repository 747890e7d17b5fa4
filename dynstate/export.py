"""Export one version's rows, in order, to a Parquet file or a Hugging Face ``datasets``
directory at any fsspec URL (a local path, ``s3://bucket/key``...). The output appears
complete or not at all: it is written under a temporary name next to it and then moved into
place (on object stores a single PUT is already all-or-nothing)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import InvalidDataError, MissingDependencyError, StorageError, StoreExistsError
from .snapshot import Snapshot

FORMATS = ("parquet", "datasets")
Progress = Callable[[int, int], None]


def export(
    snap: Snapshot,
    out: str | os.PathLike[str],
    *,
    fmt: str = "parquet",
    overwrite: bool = False,
    progress: Progress | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write ``snap``'s rows to ``out`` (a path or fsspec URL); returns ``out``. Parquet is
    streamed shard by shard; a ``datasets`` directory loads with
    ``datasets.load_from_disk(out)``. ``progress(done, total)`` counts shards read."""
    import fsspec

    out = os.fspath(out)
    if fmt not in FORMATS:
        raise InvalidDataError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    try:
        fs, path = fsspec.core.url_to_fs(out, **(storage_options or {}))
    except ImportError as exc:
        raise MissingDependencyError(
            f"cannot write {out}: its filesystem is not installed ({exc}); for s3:// "
            "pip install 'dynstate[s3]'"
        ) from exc
    except (ValueError, TypeError) as exc:
        raise InvalidDataError(f"cannot write to {out}: {exc}") from exc
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    if local:
        path = os.path.abspath(path)
    try:
        if fs.exists(path) and not overwrite:
            raise StoreExistsError(
                f"{out} exists; choose another path or pass overwrite=True to replace it"
            )
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        tmp = f"{parent}/.{uuid.uuid4().hex}.tmp" if parent else f".{uuid.uuid4().hex}.tmp"
        if local and parent:
            fs.makedirs(parent, exist_ok=True)
        try:
            if fmt == "parquet":
                _write_parquet(snap, fs, tmp, progress)
            else:
                _write_datasets(snap, out, fs, tmp, progress, storage_options)
            _remove(fs, path)
            fs.mv(tmp, path, recursive=fmt == "datasets")
        finally:
            _remove(fs, tmp)
    except StoreExistsError:
        raise
    except Exception as exc:
        if isinstance(exc, (InvalidDataError, MissingDependencyError)):
            raise
        raise StorageError(f"cannot write version {snap.version} to {out}: {exc}") from exc
    return out


def _remove(fs: Any, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if fs.exists(path):
            fs.rm(path, recursive=fs.isdir(path))


def _tables(snap: Snapshot, progress: Progress | None) -> Iterator[pa.Table]:
    total = len(snap.shards)
    if progress is not None:
        progress(0, total)
    for i in range(total):
        yield snap.read_shard(i)
        if progress is not None:
            progress(i + 1, total)


def _write_parquet(snap: Snapshot, fs: Any, path: str, progress: Progress | None) -> None:
    schema = snap.schema if snap.schema is not None else pa.schema([])
    with fs.open(path, "wb") as fh, pq.ParquetWriter(fh, schema) as writer:
        for table in _tables(snap, progress):
            writer.write_table(table)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """datasets' own progress bars off while we write, and back as they were afterwards."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _write_datasets(
    snap: Snapshot,
    out: str,
    fs: Any,
    tmp: str,
    progress: Progress | None,
    storage_options: dict[str, Any] | None,
) -> None:
    try:
        import datasets
    except ImportError as exc:
        raise MissingDependencyError(
            "exporting a datasets directory needs the datasets package; pip install datasets"
        ) from exc
    tables = list(_tables(snap, progress))
    table = pa.concat_tables(tables) if tables else snap.to_arrow()
    target = tmp if "://" not in out else f"{out.split('://', 1)[0]}://{tmp}"
    with _quiet_datasets():
        datasets.Dataset(table).save_to_disk(target, storage_options=storage_options)
