"""Export one version's rows, in order, to a Parquet file or a Hugging Face ``datasets``
directory at any fsspec URL (a local path, ``s3://bucket/key``...). The output appears
complete or not at all: it is written under a temporary name next to it and then moved into
place (on object stores a single PUT is already all-or-nothing).

An output never overlaps the store it is exported from: OUT that is the store root, lies
inside it or contains it is refused before anything is written or removed, and ``overwrite``
replaces only a file or a ``datasets`` export directory, never any other directory."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InvalidDataError, MissingDependencyError, StoreExistsError
from ..records import manifest as m
from ..snapshot import Snapshot
from ..storage import Location, open_location, redact

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
    if not isinstance(snap, Snapshot):
        raise InvalidDataError(
            f"export takes a Snapshot (store.snapshot(version)), not {type(snap).__name__}"
        )
    out = os.fspath(out)
    if fmt not in FORMATS:
        raise InvalidDataError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    where = _target(snap.store, out, storage_options)
    path = where.path
    if not overwrite and where.exists(path):
        raise StoreExistsError(
            f"{redact(out)} exists; choose another path or pass overwrite=True to replace it"
        )
    _existing(where, path, out)  # refuses a directory that is not a datasets export
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    tmp = f"{parent}/.{uuid.uuid4().hex}.tmp" if parent else f".{uuid.uuid4().hex}.tmp"
    if where.local and parent:
        where.makedirs(parent)
    try:
        # failures name OUT (the temporary name would mean nothing to the user)
        if fmt == "parquet":
            _write_parquet(snap, where, tmp, path, progress)
        else:
            _write_datasets(snap, out, where, tmp, path, progress, storage_options)
        where.remove(path)
        where.move(tmp, path, recursive=fmt == "datasets")
    finally:
        where.remove(tmp)
    return out


def replace_plan(
    snap: Snapshot,
    out: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
) -> str | None:
    """What exporting ``snap`` to ``out`` with ``overwrite=True`` would replace: a one-line
    description (``"a file of 1.2 KiB"``), or None when ``out`` does not exist. Raises as
    :func:`export` would for an ``out`` that overlaps the store or cannot be replaced; nothing
    is written."""
    return output_plan(snap.store, out, storage_options=storage_options)


def output_plan(
    store: Any,
    out: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    action: str = "export to",
) -> str | None:
    """The one check every command that writes an OUT beside a store makes (export, plot):
    refuses an ``out`` that is the store, lies inside it or contains it (InvalidDataError,
    naming ``action``), and returns what writing ``out`` would replace (``"a file of 1.2
    KiB"``), or None when nothing is there. Nothing is written."""
    out = os.fspath(out)
    where = _target(store, out, storage_options, action)
    return _existing(where, where.path, out)


def _target(
    store: Any, out: str, storage_options: dict[str, Any] | None, action: str = "export to"
) -> Location:
    """The location of ``out``, refused where it overlaps the store or any other store."""
    if not out.strip():  # '' is the current folder to a path join: the store's, often
        raise InvalidDataError(f"cannot {action} {out!r}: name a file or an object URL as OUT")
    where = open_location(out, storage_options)
    _refuse_overlap(store, out, where, action)
    _refuse_any_store(where, out, action)
    return where


def _refuse_any_store(where: Location, out: str, action: str) -> None:
    """An OUT inside *another* store (or one that is a store) would replace its shards or its
    ``store.json`` just as surely as one inside the exported store: OUT and every folder
    above it are looked at for a store's ``_dynstate/store.json``."""
    local = where.local
    place = os.path.realpath(where.path) if local else where.path.rstrip("/")
    sep = os.sep if local else "/"
    kind = "is"
    while place:
        if where.exists(f"{place.rstrip(sep)}{sep}{m.STORE_FILE.replace('/', sep)}"):
            raise InvalidDataError(
                f"cannot {action} {redact(out)}: it {kind} the dynstate store at "
                f"{where.show(place)}, whose files it would replace or alter; choose an OUT "
                "outside every store"
            )
        parent = os.path.dirname(place) if local else place.rpartition("/")[0]
        if parent == place:
            break
        place, kind = parent, "lies inside"


_LOCAL = "file"


def _location(
    protocols: tuple[str, ...], path: str, options: dict[str, Any]
) -> tuple[str, str, list[str]]:
    """(backend, endpoint, path components) that name the same place for the same bytes:
    symlinks resolved on a local disk; protocol, endpoint and bucket/key elsewhere."""
    if _LOCAL in protocols:
        return _LOCAL, "", [p for p in os.path.realpath(path).split(os.sep) if p]
    backend = "s3" if "s3" in protocols else str(protocols[0])
    client = options.get("client_kwargs")
    endpoint = options.get("endpoint_url") or (
        client.get("endpoint_url") if isinstance(client, dict) else None
    )
    return backend, str(endpoint or "").rstrip("/"), [p for p in path.split("/") if p]


def _refuse_overlap(store: Any, out: str, where: Location, action: str) -> None:
    """Writing onto, into or around the store would replace (or pollute) the store itself:
    one mistyped OUT would destroy its identity, a record or every version."""
    storage = getattr(store, "storage", None)
    if storage is None:
        return
    backend, endpoint, parts = _location(where.protocols, where.path, where.storage_options)
    s_protocols = storage.fs.protocol
    s_protocols = tuple(s_protocols) if isinstance(s_protocols, (tuple, list)) else (s_protocols,)
    s_backend, s_endpoint, s_parts = _location(
        s_protocols, storage.root, getattr(storage, "storage_options", {}) or {}
    )
    if backend != s_backend or (endpoint and s_endpoint and endpoint != s_endpoint):
        return
    common = min(len(parts), len(s_parts))
    if parts[:common] != s_parts[:common]:
        return
    relation = (
        "is the store"
        if len(parts) == len(s_parts)
        else "lies inside the store"
        if len(parts) > len(s_parts)
        else "contains the store"
    )
    raise InvalidDataError(
        f"cannot {action} {redact(out)}: it {relation} at {store.display_url}, which would "
        "be destroyed or altered; choose an OUT outside the store"
    )


def _existing(where: Location, path: str, out: str) -> str | None:
    """None if nothing is at ``path``; else what overwriting would replace. A directory is
    replaced only if it is a ``datasets`` export: any other folder (a project, a home
    directory, a bucket prefix of other files) is refused, never deleted."""
    if not where.exists(path):
        return None
    if not where.isdir(path):
        return f"a file of {_size(where.size(path))}"
    names = where.names(path)
    if not names >= _DATASETS_FILES:
        raise InvalidDataError(
            f"cannot replace {redact(out)}: it is a directory that is not a datasets export "
            f"(no {' or '.join(sorted(_DATASETS_FILES - names))}); choose another OUT, or "
            "remove it yourself"
        )
    files = where.find(path)
    stores = sorted(str(p)[: -len(m.STORE_FILE)] for p in files if str(p).endswith(m.STORE_FILE))
    if stores:
        # replacing the directory would remove a whole store inside it
        raise InvalidDataError(
            f"cannot replace {redact(out)}: it contains the dynstate store at "
            f"{redact(stores[0].rstrip('/'))}; choose another OUT, or move the store out first"
        )
    total = sum(int(info.get("size") or 0) for info in files.values())
    return f"a datasets directory of {len(files)} files, {_size(total)}"


_DATASETS_FILES = frozenset({"dataset_info.json", "state.json"})


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _tables(snap: Snapshot, progress: Progress | None) -> Iterator[pa.Table]:
    total = len(snap.shards)
    if progress is not None:
        progress(0, total)
    for i in range(total):
        yield snap.read_shard(i)
        if progress is not None:
            progress(i + 1, total)


def _write_parquet(
    snap: Snapshot, where: Location, tmp: str, path: str, progress: Progress | None
) -> None:
    schema = snap.schema if snap.schema is not None else pa.schema([])
    with where.open(tmp, "wb", name=path) as fh, pq.ParquetWriter(fh, schema) as writer:
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
    where: Location,
    tmp: str,
    path: str,
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
    for field in table.schema:
        # a type datasets has no feature for is the data's, not the location's: no retry fixes it
        try:
            datasets.Features.from_arrow_schema(pa.schema([field]))
        except (ValueError, TypeError, NotImplementedError) as exc:
            raise InvalidDataError(
                f"cannot export version {snap.version} of {snap.store.display_url} as a datasets "
                f"directory: its column {field.name!r} ({field.type}) has no datasets feature "
                f"({exc}); export it with --format parquet"
            ) from None
    target = tmp if "://" not in out else f"{out.split('://', 1)[0]}://{tmp}"
    with _quiet_datasets():
        # datasets writes through fsspec itself; its failures are translated all the same
        where.call(
            "write",
            path,
            lambda: datasets.Dataset(table).save_to_disk(target, storage_options=storage_options),
        )
