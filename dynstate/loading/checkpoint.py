"""What a training checkpoint refers to: store, version, position and the next batch's rows;
and how dynstate writes its own files into one, durably (both integrations).

Reads a verl ``global_step_N`` directory, a ``data.pt`` file or any ``torch.save``d dict that
holds a StatefulDataLoader state with a :class:`~dynstate.VersionedSampler` inside.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any, BinaryIO

from ..errors import CheckpointNotFoundError, InvalidDataError, StateMismatchError
from .dataset import VersionedDataset, decode_index
from .sampler import VersionedSampler
from .selection import FunctionPolicy, Policy, as_policy
from .state import check_state, find_sampler_state

_GLOBAL_STEP = re.compile(r"global_step_(\d+)")


def load_checkpoint_state(path: str) -> tuple[str, dict[str, Any]]:
    """(file read, sampler state) of the checkpoint at ``path`` (a ``global_step_N`` folder
    or a file; :func:`read_checkpoint_file`); the state is not yet checked against any store."""
    file = path
    if os.path.isdir(path):
        candidates = [os.path.join(path, name) for name in ("data.pt", "latest.pt")]
        found = [c for c in candidates if os.path.isfile(c)]
        if not found:
            raise CheckpointNotFoundError(
                f"{path} holds no data.pt; pass a verl global_step_N directory or a data.pt file"
            )
        file = found[0]
    if not os.path.isfile(file):
        raise CheckpointNotFoundError(
            f"no checkpoint at {path}; pass a global_step_N directory or a .pt file"
        )
    _, state = read_checkpoint_file(file)
    return file, state


def read_checkpoint_file(file: str) -> tuple[Any, dict[str, Any]]:
    """(the object ``torch.save`` wrote, the dynstate sampler state inside it) of a
    checkpoint file (a verl ``data.pt``, any saved loader state): the one reader of such a
    file, loaded with ``weights_only=True`` (a checkpoint never runs code) on the CPU. A file
    that is not a plain state, or holds no sampler state, is a :class:`StateMismatchError`
    naming it; the state is not yet checked against any store."""
    import torch

    try:
        obj = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises a zoo of types for bad files
        raise StateMismatchError(
            f"{file} could not be loaded with torch.load(weights_only=True) "
            f"({_why(exc, _head(file))}); "
            "pass the data.pt the run's checkpoint wrote, and restore it if it is damaged"
        ) from exc
    state = find_sampler_state(obj)
    if state is None:
        raise StateMismatchError(
            f"{file} holds no dynstate sampler state; was the run's train sampler a "
            "dynstate.VersionedSampler (with verl: the dataset of data.dynstate, docs/verl.md)?"
        )
    return obj, state


def training_step(file: str) -> int | None:
    """The trainer's step of a checkpoint, from its verl folder name (``global_step_N``); None
    when the file is not in such a folder. Not the sampler's own counters, which count what
    the sampler handed out and can differ (a mix-mode sampler restarts them per version)."""
    for part in reversed(os.path.abspath(file).split(os.sep)[:-1]):
        match = _GLOBAL_STEP.fullmatch(part)
        if match is not None:
            return int(match.group(1))
    return None


def _recorded(file: str, checked: dict[str, Any], shown_url: str) -> dict[str, Any]:
    return {
        "checkpoint": file,
        "training_step": training_step(file),
        "store_url": shown_url,
        "store_id": checked["store_id"],
        **{k: checked[k] for k in ("mode", "epoch", "version", "position", "base_rows", "step")},
        "seed": checked["seed"],
        "batch_size": checked["batch_size"],
        "select": checked["select"],
    }


def _unloaded_function(name: str) -> Any:
    def fn(stats: Any, step: int) -> Any:
        raise InvalidDataError(
            f"the checkpoint's selection policy is the user function {name!r}, which inspect "
            "does not import (a checkpoint from elsewhere may name any code); the next batch "
            "is drawn by that function in the run itself"
        )

    return fn


def policy_of_state(select: dict[str, Any] | None, file: str) -> Policy | None:
    """The selection policy a (checked) sampler state records, rebuilt so that the state
    loads into a sampler: a built-in from its name and parameters; a user function as a
    stand-in with the recorded identity that refuses to draw (its code is never imported
    from what a checkpoint names)."""
    if select is None:
        return None
    params = select["params"]
    if select["policy"] == FunctionPolicy.name:
        name, user_params = params.get("name"), params.get("params")
        if not isinstance(name, str) or not isinstance(user_params, dict):
            raise StateMismatchError(
                f"{file}: the sampler state records a function policy without a name and "
                f"params ({params!r}); it is damaged — pass the data.pt the run wrote"
            )
        policy: Policy = FunctionPolicy(
            _unloaded_function(name),
            name=name,
            params=user_params,
            uses_step=bool(params.get("uses_step", True)),
        )
    else:
        try:
            policy = as_policy({**params, "policy": select["policy"]})  # type: ignore[assignment]
        except InvalidDataError as exc:
            raise StateMismatchError(
                f"{file}: the sampler state's selection policy cannot be rebuilt ({exc}); "
                "it was written by another dynstate version, or is damaged"
            ) from None
    if policy.identity() != select:
        raise StateMismatchError(
            f"{file}: the sampler state's selection policy {select!r} rebuilds as "
            f"{policy.identity()!r}; it was written by another dynstate version, or is damaged"
        )
    return policy


def _unopened(file: str, state: dict[str, Any], shown_url: str) -> dict[str, Any]:
    """What the checkpoint says, without its store: the state is checked in full against
    itself (its own store id), so nothing shown is unchecked."""
    store_id = state.get("store_id")
    try:
        checked = check_state(state, store_id if isinstance(store_id, str) else "", shown_url)
    except StateMismatchError as exc:
        raise StateMismatchError(f"{file}: {exc}") from exc
    return {
        **_recorded(file, checked, shown_url),
        "opened": False,
        "not_opened": f"{shown_url} is not on this machine, so it was not opened: a "
        "checkpoint from elsewhere may name any server or bucket, which opening would read "
        "with your credentials",
    }


# How a torch.save file starts: a zip archive (torch >= 1.6) or a pickle (protocol 2+, the
# legacy format).
_TORCH_MAGIC = (b"PK\x03\x04", b"\x80")


def _head(file: str) -> bytes:
    try:
        with open(file, "rb") as fh:
            return fh.read(4)
    except OSError:
        return b""


def _why(exc: BaseException, head: bytes = b"PK\x03\x04") -> str:
    """One line on why torch.load failed (its messages run to many lines, or are empty);
    ``head``: the file's first bytes. torch's weights-only loader reports any file it cannot
    unpickle as unsafe content, a text file beside the checkpoint (trainer_state.json,
    latest_checkpointed_iteration.txt) included: such a file is no torch.save file at all."""
    text = str(exc)
    if head and not head.startswith(_TORCH_MAGIC):
        return f"not a torch.save file: it starts with {head!r}"
    if "Weights only load failed" in text:
        return "it holds Python objects other than plain types and tensors"
    if isinstance(exc, EOFError) or not text.strip():
        return f"{type(exc).__name__}: the file is empty or cut short"
    first = text.strip().splitlines()[0][:200]
    return f"not a torch.save file, or a damaged one: {type(exc).__name__}: {first}"


# Schemes whose URLs name this machine's own files or memory: opening them sends nothing
# anywhere. Every other fsspec URL (http(s), s3, gs, chained "a::b" URLs...) goes out.
_LOCAL_SCHEMES = ("file", "local", "memory")


def is_local_url(url: str) -> bool:
    """Whether opening ``url`` stays on this machine (a path, ``file://``, ``memory://``)."""
    if "::" in url:
        return False  # a chained URL (simplecache::s3://...) reaches its last part's target
    scheme, sep, _ = url.partition("://")
    return not sep or scheme.lower() in _LOCAL_SCHEMES


def describe_checkpoint(
    path: str,
    *,
    store_url: str | None = None,
    storage_options: dict[str, Any] | None = None,
    rows: int | None = None,
    open_remote: bool = False,
) -> dict[str, Any]:
    """Where the checkpoint at ``path`` is in its store, and the rows of its next batch.
    ``store_url`` overrides the (redacted) URL recorded in the state.

    A checkpoint may come from anywhere, and the URL it records could name any server or
    bucket, which opening would read with this machine's credentials. So a recorded URL that
    is not local is opened only with ``open_remote=True``; otherwise the result holds what the
    checkpoint itself says (checked in full), ``"opened": False`` and ``"not_opened"``, why.
    A ``store_url`` the caller passes is always opened."""
    from ..storage.credentials import redact

    file, state = load_checkpoint_state(path)
    recorded = state.get("store_url")
    url = store_url or recorded
    if not isinstance(url, str) or not url:
        raise StateMismatchError(
            f"the sampler state in {file} records no store URL (store_url={recorded!r}); pass "
            "the store's URL: describe_checkpoint(..., store_url=URL) or `dynstate inspect "
            "--store URL`"
        )
    if recorded is None:
        state = {**state, "store_url": url}  # the caller named the store; the id still checks
    if store_url is None and not open_remote and not is_local_url(url):
        return _unopened(file, state, redact(url))
    dataset = VersionedDataset(url, storage_options=storage_options)
    # Checked in full (keys, types, ranges, store id) before anything reads a value from it.
    try:
        checked = check_state(state, dataset.store_id, dataset.store.display_url)
    except StateMismatchError as exc:
        raise StateMismatchError(f"{file}: {exc}") from exc
    info = {**_recorded(file, checked, redact(checked["store_url"])), "opened": True}
    sampler = VersionedSampler(
        dataset,
        shuffle=checked["shuffle"],
        seed=checked["seed"],
        mode=checked["mode"],
        batch_size=checked["batch_size"],
        fresh_share=checked["fresh_share"],
        lag=checked["lag"],
        num_replicas=checked["num_replicas"],
        rank=0,
        drop_last=checked["drop_last"],
        wait_timeout=5.0,
        prefetch=False,
        select=policy_of_state(checked["select"], file),
    )
    sampler.load_state_dict(state)  # checks that the version still exists, with its rows
    info["head"] = dataset.store.head
    n = rows or checked["batch_size"] or 8
    indices = []
    try:
        for index in sampler:
            indices.append(index)
            if len(indices) == n:
                break
    except (TimeoutError, InvalidDataError) as exc:  # a round not committed; steps unknown
        info["next_error"] = str(exc)
    info["next_version"] = sampler.version
    info["next_epoch"] = sampler.epoch
    info["next_indices"] = [decode_index(i)[1] for i in indices]
    info["next_rows"] = dataset.__getitems__(indices) if indices else []
    return info


# -- a StatefulDataLoader's state under another worker count ----------------------------------
#
# torchdata's state has one shape without workers (``_num_yielded`` at the top) and another
# with them (``_snapshot`` holding the main process's sampler state and one entry per worker),
# and refuses to load one shape into the other with a bare ``AssertionError`` (``State doesn't
# contain key '_snapshot'``), or a snapshot of 2 workers into 4. The position itself is not
# tied to workers: it is the dynstate sampler's state inside, and a VersionedDataset keeps no
# per-worker state. So the state is rewritten into the new shape, the sampler state and
# torchdata's counters carried over unchanged, and the resumed loader continues with exactly
# the batches the old one would have produced. What cannot be carried (a snapshot older than
# the last batch, per-worker dataset state, another torchdata layout) is refused.

# torchdata 0.11's key names (torchdata/stateful_dataloader/stateful_dataloader.py)
_INDEX_SAMPLER_STATE = "_index_sampler_state"
_SAMPLER_ITER_STATE = "_sampler_iter_state"
_SAMPLER_ITER_YIELDED = "_sampler_iter_yielded"
_LEN_CALLED = "_IterableDataset_len_called"
_SHARED_SEED = "_shared_seed"
_FETCHER_STATE = "fetcher_state"
_DATASET_STATE = "dataset_state"
_FINISHED = "_iterator_finished"
_NUM_YIELDED = "_num_yielded"  # single process only
_SNAPSHOT = "_snapshot"  # multiprocess only, and everything below
_STEPS_SINCE = "_steps_since_snapshot"
_SNAPSHOT_STEP = "_snapshot_step"
_LAST_WORKER = "_last_yielded_worker_id"
_MAIN = "_main_snapshot"
_WORKERS = "_worker_snapshots"
_NUM_WORKERS = "_num_workers"
_BASE_SEED = "_base_seed"

_MAIN_KEYS = (_INDEX_SAMPLER_STATE, _SAMPLER_ITER_STATE, _SAMPLER_ITER_YIELDED, _LEN_CALLED)


def saved_workers(state: Any) -> int | None:
    """The ``num_workers`` of the loader that wrote ``state``; None for an unknown layout."""
    if not isinstance(state, dict):
        return None
    if _NUM_YIELDED in state and _SNAPSHOT not in state:
        return 0
    main = state.get(_SNAPSHOT, {}).get(_MAIN) if isinstance(state.get(_SNAPSHOT), dict) else None
    workers = main.get(_NUM_WORKERS) if isinstance(main, dict) else None
    if isinstance(workers, int) and not isinstance(workers, bool) and workers > 0:
        return workers
    return None


# The entries torchdata 0.11 writes, and reads back at the next iter(), by layout.
_SINGLE_KEYS = (*_MAIN_KEYS, _SHARED_SEED, _NUM_YIELDED, _FETCHER_STATE, _DATASET_STATE, _FINISHED)
_MULTI_KEYS = (_SNAPSHOT, _STEPS_SINCE, _FINISHED)
_SNAPSHOT_KEYS = (_SNAPSHOT_STEP, _LAST_WORKER, _MAIN, _WORKERS)
_MULTI_MAIN_KEYS = (*_MAIN_KEYS, _SHARED_SEED, _NUM_WORKERS, _BASE_SEED)


def _missing_entry(state: dict[str, Any], num_workers: int) -> str | None:
    """The first entry of ``num_workers``'s layout that ``state`` lacks, or None."""
    if num_workers == 0:
        return next((k for k in _SINGLE_KEYS if k not in state), None)
    for keys, part in (
        (_MULTI_KEYS, state),
        (_SNAPSHOT_KEYS, state.get(_SNAPSHOT)),
        (_MULTI_MAIN_KEYS, (state.get(_SNAPSHOT) or {}).get(_MAIN)),
    ):
        if not isinstance(part, dict):
            return keys[0]
        missing = next((k for k in keys if k not in part), None)
        if missing is not None:
            return missing
    workers = state[_SNAPSHOT][_WORKERS]
    return None if isinstance(workers, dict) else _WORKERS


def carry_loader_state(
    state: dict[str, Any], num_workers: int, refuse: Callable[[str], Exception]
) -> dict[str, Any]:
    """``state`` (written by a loader with any worker count) in the shape a ``StatefulDataLoader``
    with ``num_workers`` workers loads; ``refuse(why)`` makes the error raised when it cannot
    be carried over exactly (the caller names the setting its users change). Changes
    nothing."""
    saved = saved_workers(state)
    if saved == num_workers:
        # loaded as it is, but checked as whole first: torchdata reads it only at the next
        # iter(), and a missing entry then fails with a bare KeyError
        missing = _missing_entry(state, num_workers)
        if missing is not None:
            raise refuse(f"it lacks torchdata's {missing!r} entry (a damaged state)")
        return state
    if saved is None:
        raise refuse("its layout is not one torchdata 0.11 writes")
    try:
        if saved == 0:
            main = {k: state[k] for k in _MAIN_KEYS}
            main[_SHARED_SEED] = state[_SHARED_SEED]
            yielded = state[_NUM_YIELDED]
            dataset_states = [state[_DATASET_STATE]]
            base_seed = None
        else:
            snapshot = state[_SNAPSHOT]
            if state[_STEPS_SINCE] != 0:
                raise refuse(
                    f"its sampler state is {state[_STEPS_SINCE]} batch(es) older than the last "
                    "one trained (snapshot_every_n_steps > 1), which only the same workers replay"
                )
            main = {k: snapshot[_MAIN][k] for k in _MAIN_KEYS}
            main[_SHARED_SEED] = snapshot[_MAIN][_SHARED_SEED]
            base_seed = snapshot[_MAIN][_BASE_SEED]
            yielded = snapshot[_SNAPSHOT_STEP]
            dataset_states = [
                w.get(_DATASET_STATE) for w in (snapshot[_WORKERS] or {}).values() if w is not None
            ]
        finished = state[_FINISHED]
    except (KeyError, TypeError, AttributeError) as exc:
        raise refuse(f"it lacks torchdata's {exc} entry") from exc
    if any(s is not None for s in dataset_states):
        raise refuse("its dataset keeps a per-worker state that cannot be split differently")
    if num_workers == 0:
        return {
            **main,
            _NUM_YIELDED: yielded,
            _FETCHER_STATE: None,
            _DATASET_STATE: None,
            _FINISHED: finished,
        }
    if base_seed is not None:
        main[_BASE_SEED] = base_seed
    else:
        # A loader without workers has no worker seed; draw one as torch does for a new loader.
        import torch

        main[_BASE_SEED] = int(torch.empty((), dtype=torch.int64).random_().item())
    main[_NUM_WORKERS] = num_workers
    return {
        _SNAPSHOT: {
            _SNAPSHOT_STEP: yielded,
            # the worker before the first: the next batch goes to worker 0, as on a new loader
            _LAST_WORKER: num_workers - 1,
            _MAIN: main,
            _WORKERS: {},  # no per-worker state: each worker starts as on a new loader
        },
        _STEPS_SINCE: 0,
        _FINISHED: finished,
    }


def load_loader_state(loader: Any, state: dict[str, Any]) -> None:
    """Load ``state`` (a ``StatefulDataLoader.state_dict()``, e.g. from a checkpoint) into
    ``loader``, whatever ``num_workers`` the loader that saved it had: the state is carried
    into the shape ``loader``'s worker count loads (the same batches follow, see above), where
    ``loader.load_state_dict(state)`` would fail with torchdata's bare ``AssertionError``.
    What cannot be carried exactly raises :class:`StateMismatchError` naming both worker
    counts, and ``loader`` is left unchanged."""
    if not isinstance(state, dict):
        raise StateMismatchError(
            f"a loader state is the dict StatefulDataLoader.state_dict() returns, not "
            f"{type(state).__name__}; pass what the checkpoint saved from it"
        )
    num_workers = int(getattr(loader, "num_workers", 0) or 0)
    saved = saved_workers(state)

    def refuse(why: str) -> StateMismatchError:
        if saved == num_workers:  # the state itself is damaged
            return StateMismatchError(
                f"this loader state cannot be loaded: {why}; pass the state "
                "StatefulDataLoader.state_dict() returned, or resume from an earlier checkpoint"
            )
        was = "an unknown number of" if saved is None else str(saved)
        return StateMismatchError(
            f"this loader state was saved by a StatefulDataLoader with {was} worker(s), "
            f"this loader has num_workers={num_workers}, and {why}; build the loader with "
            f"num_workers={saved if saved is not None else 'as when it was saved'}"
        )

    loader.load_state_dict(carry_loader_state(state, num_workers, refuse))


# -- dynstate's files in a trainer's checkpoint ------------------------------------------


def save_durably(state: Any, path: str) -> None:
    """``torch.save(state)`` as ``path``, by :func:`write_durably`."""
    import torch

    _replace_durably(path, lambda fh: torch.save(state, fh))


def write_durably(path: str, data: bytes) -> None:
    """``data`` as ``path``: to a temporary file, fsynced, then renamed over ``path``, and its
    folder and that folder's own entry fsynced (the folder may be new: verl's ``global_step_N``
    is made by dynstate's carry file, before verl writes into it), so that after a crash or a
    power cut ``path`` is either the old file or the whole new one."""
    _replace_durably(path, lambda fh: fh.write(data))


def _replace_durably(path: str, write: Callable[[BinaryIO], object]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        write(fh)  # streamed: a carry's tensors are not held twice
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    folder = os.path.dirname(os.path.abspath(path))
    _fsync_folder(folder)
    _fsync_folder(os.path.dirname(folder))


def sync_checkpoint(folder: str) -> None:
    """fsync every file and folder of a checkpoint that the trainer wrote (transformers fsyncs
    none), before dynstate's file marks it whole (TRL: ``dynstate_state.pt``): after a power
    cut, a checkpoint marked whole is whole, and the older ones deleted after it
    (``save_total_limit``) are not needed."""
    for here, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            fd = os.open(os.path.join(here, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_folder(here)
    _fsync_folder(os.path.dirname(os.path.abspath(folder)))  # the checkpoint's own entry


def sync_folder(path: str) -> None:
    """fsync the folder ``path``: the names created or removed in it are durable."""
    _fsync_folder(path)


def _fsync_folder(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
