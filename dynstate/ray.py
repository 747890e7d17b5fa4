"""Scale-out on Ray: rounds written by many Ray tasks, versions read as Ray Datasets.

The only module that imports ``ray`` (lazily: ``pip install 'dynstate[ray]'``).

A round written by N tasks is one version. Each task opens the store by URL, stages its own
shards (:meth:`Store.stage`) and returns the :class:`Staged` record; the driver gathers the
records in task-index order and commits them once (:meth:`Store.commit_staged`). This gives:

- *atomicity*: shards are invisible until the driver's single commit names them; if any task
  fails, the driver removes the successful tasks' shards and raises :class:`RoundFailedError`,
  and the store stays at its previous version;
- *determinism*: the rows of task ``i`` precede those of task ``i + 1``, whatever order the
  tasks finish in;
- *no duplicates under retries*: a task index yields exactly one object, so exactly one
  :class:`Staged` per index is committed — a retried attempt's predecessor may have written
  shards, but it never returned them, so no version references them and ``dynstate gc``
  removes them after its grace period.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import (
    ChecksumMismatchError,
    DynstateError,
    InvalidDataError,
    MissingDependencyError,
    MissingShardError,
    RoundFailedError,
    SchemaMismatchError,
    StateMismatchError,
    VersionCollectedError,
)
from .snapshot import Staged
from .store import DEFAULT_SHARD_BYTES, Store

if TYPE_CHECKING:
    import ray.data

__all__ = ["commit_round", "to_ray_dataset", "write_ray_dataset", "write_round"]

log = logging.getLogger("dynstate")


def _ray() -> Any:
    try:
        import ray
        import ray.data  # the Data library is a separate extra of ray
    except ImportError as exc:
        raise MissingDependencyError(
            f"dynstate.ray needs Ray with its Data library ({exc}); pip install 'dynstate[ray]'"
        ) from exc
    return ray


@dataclass(frozen=True)
class _Target:
    """How a Ray worker reaches the store: everything it needs, and picklable."""

    url: str
    storage_options: dict[str, Any]
    single_writer: bool
    lease_ttl_s: float  # the driver's: a worker's parts are held as long as it holds its own

    def open(self) -> Store:
        return Store.open(
            self.url,
            storage_options=self.storage_options,
            single_writer=self.single_writer,
            lease_ttl_s=self.lease_ttl_s,
        )


def _resolve(
    store_or_url: Store | str | os.PathLike[str], storage_options: dict[str, Any] | None
) -> Store:
    if isinstance(store_or_url, Store):
        store = store_or_url
    elif isinstance(store_or_url, (str, os.PathLike)):  # a path, as Store.open takes
        store = Store.open(store_or_url, storage_options=storage_options)
    else:
        raise InvalidDataError(
            f"expected a Store, a store URL or a path, not {type(store_or_url).__name__}"
        )
    if not store.storage.shared_across_processes:
        raise InvalidDataError(
            f"{store.display_url} is a memory:// store, which lives inside one process and "
            "cannot be reached by Ray workers; use a shared path or an s3:// URL"
        )
    return store


def _target(store: Store) -> _Target:
    # A local path as the driver resolves it: a worker keeps the directory it started in, and
    # on another node a relative path means another folder.
    url = (
        os.path.abspath(store.url) if store.reads_in_place and "://" not in store.url else store.url
    )
    return _Target(url, dict(store.storage_options), store.single_writer, store.lease_ttl_s)


# -- the Ray tasks (module level, so workers import them instead of unpickling code) ----------


def _stage_part(
    target: _Target,
    fn: Callable[[Any], Any] | None,
    item: Any,
    allow_new_columns: bool,
    shard_bytes: int,
) -> Staged:
    data = item if fn is None else fn(item)
    return target.open().stage(data, allow_new_columns=allow_new_columns, shard_bytes=shard_bytes)


def _remote(ray: Any, func: Callable[..., Any], **options: Any) -> Any:
    return ray.remote(func).options(**options)


# -- writing -------------------------------------------------------------------------------


def write_round(
    store_or_url: Store | str | os.PathLike[str],
    items: Iterable[Any],
    fn: Callable[[Any], Any] | None = None,
    *,
    meta: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    max_retries: int = 0,
    retry_exceptions: bool = False,
    num_cpus: float = 1,
    allow_new_columns: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    ray_remote_args: dict[str, Any] | None = None,
) -> int:
    """Write one round with one Ray task per item and commit it as one version.

    Task ``i`` stages ``fn(items[i])`` (or ``items[i]`` itself when ``fn`` is None: anything
    :meth:`Store.append` takes). The driver commits all parts in item order and returns the
    new version. ``max_retries``/``retry_exceptions`` are Ray's: a retried task contributes
    only its final attempt's rows. If a task still fails, nothing is committed and
    :class:`RoundFailedError` is raised.

    >>> write_round("s3://bucket/run1", range(8), generate, meta={"step": 3})  # doctest: +SKIP
    """
    ray = _ray()
    store = _resolve(store_or_url, storage_options)
    options: dict[str, Any] = {
        "max_retries": max_retries,
        "retry_exceptions": retry_exceptions,
        "num_cpus": num_cpus,
    }
    options.update(ray_remote_args or {})
    task = _remote(ray, _stage_part, **options)
    target = _target(store)
    refs: list[Any] = []
    try:
        for item in items:
            refs.append(task.remote(target, fn, item, allow_new_columns, shard_bytes))
    except BaseException as exc:
        _abandon(ray, store, refs)
        if isinstance(exc, (TypeError, pickle.PicklingError)):
            raise InvalidDataError(
                f"cannot send part {len(refs)} of a round for {store.display_url} to Ray "
                f"({_first_line(exc)}); nothing was committed — fn and every item must pickle"
            ) from exc
        raise
    log.info("round for %s: %d Ray tasks submitted", store.display_url, len(refs))
    return commit_round(store, refs, meta=meta)


def commit_round(
    store_or_url: Store | str | os.PathLike[str],
    parts: Sequence[Any],
    *,
    meta: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Commit one round from ``parts`` — Ray ``ObjectRef`` s of tasks or actor methods that
    return a :class:`Staged` (or ``Staged`` values) — in the given order, as one version.

    Waits for every part. If any failed, the shards of the others are removed, nothing is
    committed, and :class:`RoundFailedError` (with ``.failures``: index -> exception) is
    raised. Use this with your own tasks or actors that call :meth:`Store.stage`.
    """
    ray = _ray()
    store = _resolve(store_or_url, storage_options)
    staged: list[Staged] = []
    failures: dict[int, BaseException] = {}
    received: dict[int, Staged] = {}
    try:
        # Every part is awaited, also after a failure: a task still running would otherwise
        # stage shards after we have cleaned up. Each is taken as its task ends, not in
        # order: unpickled here its lease is renewed by this process, while one left in
        # Ray's object store behind a slow task has nobody to renew it once its worker
        # exits (a GPU task's, after one call), and a gc meanwhile would expire it.
        refs = [part for part in parts if isinstance(part, ray.ObjectRef)]
        if len(set(refs)) != len(refs):
            # one part given twice would be staged once and committed once, out of order
            failures[-1] = InvalidDataError(
                f"a round for {store.display_url} was given the same part twice; pass each "
                "task's result once"
            )
        pending = {part: i for i, part in enumerate(parts) if isinstance(part, ray.ObjectRef)}
        ready = [(i, part) for i, part in enumerate(parts) if not isinstance(part, ray.ObjectRef)]
        while ready or pending:
            if not ready:
                done, _ = ray.wait(list(pending), num_returns=1)
                ready = [(pending.pop(ref), ref) for ref in done]
            index, part = ready.pop()
            try:
                value = ray.get(part) if isinstance(part, ray.ObjectRef) else part
            except ray.exceptions.RayError as exc:
                failures[index] = exc
                continue
            if not isinstance(value, Staged):
                failures[index] = InvalidDataError(
                    f"part {index} of a round for {store.display_url} returned a "
                    f"{type(value).__name__}, not a dynstate.Staged; return Store.stage(...)"
                )
                continue
            received[index] = value
        staged.extend(received[i] for i in sorted(received))  # the round's order: the parts'
    except BaseException:
        # Interrupted while waiting (Ctrl-C): cancel what still runs and leave nothing behind
        # that we know of; whatever else was staged is unreferenced and collected by gc.
        for part in parts:
            if isinstance(part, ray.ObjectRef):
                _cancel_quietly(ray, part)
        _discard_ours(store, list(received.values()))
        raise
    paths = [s.path for part in staged for s in part.shards]
    if not failures and len(paths) != len(set(paths)):
        failures[-1] = InvalidDataError("the same staged shard was passed twice")
    if failures:
        _discard_ours(store, staged)
        raise _round_failed(store, len(parts), failures)
    try:
        version = store.commit_staged(staged, meta=meta)
    except (InvalidDataError, SchemaMismatchError, StateMismatchError):
        # Refused before the commit began (a part of another store, a bad meta): this round
        # is given up, as for a failed task, so that its parts are not held leased by this
        # process for days (gc would keep them as a live writer's). A failure inside the
        # commit has resolved its parts already (or holds them while its outcome is unknown).
        _discard_ours(store, staged)
        raise
    log.info(
        "committed a round of %d parts (%d rows) to %s as version %d",
        len(staged),
        sum(p.num_rows for p in staged),
        store.display_url,
        version,
    )
    return version


def _discard_ours(store: Store, staged: list[Staged]) -> None:
    """Give up the parts of ``staged`` this store can discard; never raises over them (the
    round's own error is what the caller needs)."""
    ours = [p for p in staged if p.store in (None, store.store_id)]
    try:
        store.discard(ours)
    except DynstateError as exc:
        log.warning("could not remove the staged parts of a round for %s: %s (gc will)",
                    store.display_url, exc)  # fmt: skip


def _cancel_quietly(ray: Any, ref: Any) -> None:
    try:
        ray.cancel(ref)
    except Exception as exc:  # already finished, or its owner is gone: nothing to stop
        log.debug("could not cancel %s: %s", ref, exc)


def _abandon(ray: Any, store: Store, refs: list[Any]) -> None:
    """Remove what the submitted tasks of a round that will not be committed staged.
    They are awaited rather than cancelled: a task interrupted between writing its shards
    and returning them would leave files we cannot name."""
    for ref in refs:
        try:
            value = ray.get(ref)
        except ray.exceptions.RayError:
            continue  # it failed: whatever it wrote is unreferenced, left for gc
        if isinstance(value, Staged):
            store.discard([value])


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _round_failed(store: Store, total: int, failures: dict[int, BaseException]) -> Exception:
    first_index, first = next(iter(failures.items()))
    summary = str(first).strip().splitlines()
    reason = summary[-1] if summary else type(first).__name__
    where = f"part {first_index}" if first_index >= 0 else "the round"
    try:
        head = store.latest()
    except DynstateError:
        head = store.head  # the store being unreachable must not hide the round's failure
    error = RoundFailedError(
        f"round for {store.display_url} not committed: {len(failures)} of {total} parts "
        f"failed ({where}: {type(first).__name__}: {reason}); the store is still at version "
        f"{head} and the other parts' shards were removed; fix the cause and write the "
        "round again (or pass max_retries)"
    )
    error.failures = failures
    error.__cause__ = first
    return error


def _stage_block(target: _Target, block: Any, shard_bytes: int) -> Staged:
    return target.open().stage(block, shard_bytes=shard_bytes)


def write_ray_dataset(
    store_or_url: Store | str | os.PathLike[str],
    ds: ray.data.Dataset,
    *,
    meta: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    max_retries: int = 0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> int:
    """Write a Ray Dataset as one round: each block is staged by a Ray task, the driver
    commits once. Rows keep the order of ``ds.to_arrow_refs()``; set
    ``ds.context.execution_options.preserve_order = True`` for a deterministic order."""
    ray = _ray()
    store = _resolve(store_or_url, storage_options)
    task = _remote(ray, _stage_block, max_retries=max_retries, num_cpus=1)
    target = _target(store)
    refs = [task.remote(target, block, shard_bytes) for block in ds.to_arrow_refs()]
    return commit_round(store, refs, meta=meta)


# -- reading -------------------------------------------------------------------------------


def to_ray_dataset(
    store_or_url: Store | str | os.PathLike[str],
    version: int | str | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    check_sizes: bool = True,
    **read_args: Any,
) -> ray.data.Dataset:
    """``version`` (number, tag or None for the head) as a Ray Dataset, read with
    ``ray.data.read_parquet`` from exactly that version's shard files, in row order.

    Ray reads the files itself, so shard checksums are *not* verified on this path;
    ``check_sizes`` (default) compares each file's size with the committed one first, which
    catches missing and truncated shards. ``dynstate verify`` checks the content."""
    ray = _ray()
    store = _resolve(store_or_url, storage_options)
    snap = store.snapshot(version)
    schema = snap.schema
    columns = read_args.pop("columns", None)
    if columns is not None and schema is not None:
        # Checked and applied here: Ray's reader prunes a projection to the columns of the
        # first file (a column older shards lack vanished from every row) and answers unknown
        # names with placeholder rows.
        if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
            raise InvalidDataError(
                f"columns must be a list of column names, not {columns!r}; e.g. columns=['a']"
            )
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise InvalidDataError(
                f"columns {missing} are not in version {snap.version} of {store.display_url} "
                f"(it has {schema.names}); pass names it has"
            )
        import pyarrow as pa

        schema = pa.schema([schema.field(c) for c in columns])
    if check_sizes:
        _check_sizes(store, snap.version, snap.shards)
    if not snap.shards:
        empty = schema.empty_table() if schema is not None else None
        return ray.data.from_arrow(empty) if empty is not None else ray.data.from_items([])
    paths = [store.storage.path(s.path) for s in snap.shards]
    args: dict[str, Any] = {
        "filesystem": _arrow_fs(store),
        "schema": schema,  # older shards lack later nullable columns: read them as nulls
        "partitioning": None,
        "shuffle": None,
        # The list is exact: no filter by name (Ray cuts a path at "?" before it looks for
        # ".parquet", and a store under such a folder read as empty).
        "file_extensions": None,
    }
    args.update(read_args)
    ctx = ray.data.DataContext.get_current()
    v2 = getattr(ctx, "use_datasource_v2", None)
    if v2:
        # Ray's v2 reader lists and stats the paths in an extra stage that costs seconds per
        # read even for a few files; the file list here is already exact, so use the v1
        # reader. The dataset keeps its own copy of the context; the global flag is restored.
        ctx.use_datasource_v2 = False
    try:
        ds = ray.data.read_parquet(paths, **args)
    finally:
        if v2:
            ctx.use_datasource_v2 = v2
    # The dataset carries its own copy of the context; the caller's global one is untouched.
    ds.context.execution_options.preserve_order = True
    return ds


def _check_sizes(store: Store, version: int, shards: Sequence[Any]) -> None:
    for shard in shards:
        try:
            size = store.storage.size(shard.path)
        except FileNotFoundError:
            store.latest()  # the floor now: a gc since this handle read it collected it
            if version < store.floor:
                raise VersionCollectedError(
                    f"version {version} of {store.display_url} was removed by garbage "
                    f"collection (oldest kept is {store.floor}); use a later version"
                ) from None
            raise MissingShardError(
                f"shard {shard.path} of {store.display_url} (version {version}) is missing; "
                "restore it, or reset the store to a version that does not use it"
            ) from None
        if size != shard.bytes:
            raise ChecksumMismatchError(
                f"shard {shard.path} of {store.display_url} (version {version}) has {size} "
                f"bytes, {shard.bytes} committed; restore it or reset to a version without it"
            )


def _arrow_fs(store: Store) -> Any:
    import pyarrow.fs as pafs

    if store.reads_in_place:
        return pafs.LocalFileSystem()
    # The store's own fsspec filesystem (same credentials, endpoint and options); it pickles
    # to the read tasks.
    return pafs.PyFileSystem(pafs.FSSpecHandler(store.storage.fs))
