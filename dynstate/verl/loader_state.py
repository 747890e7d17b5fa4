"""verl's ``data.pt`` (a torchdata ``StatefulDataLoader`` state) for another worker count.

torchdata's state has one shape without workers (``_num_yielded`` at the top) and another with
them (``_snapshot`` holding the main process's sampler state and one entry per worker), and
refuses to load one shape into the other (``AssertionError: State doesn't contain key
'_snapshot'``), or a snapshot of 2 workers into 4. The position itself is not tied to workers:
it is the dynstate sampler's state inside, taken when the last trained batch's indices were
drawn, and the dataset keeps no per-worker state. :func:`for_workers` therefore rewrites the
state into the shape of the new worker count, carrying the sampler state and torchdata's
counters over unchanged, so that the resumed loader continues with exactly the batches the old
one would have produced. What it cannot carry (a snapshot older than the last batch, worker
state of a stateful dataset, a layout of another torchdata version) is refused, naming both
worker counts, before anything is changed.
"""

from __future__ import annotations

from typing import Any

from ..errors import StateMismatchError

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


def for_workers(state: dict[str, Any], num_workers: int, path: str, url: str) -> dict[str, Any]:
    """``state`` (written by a loader with any worker count) in the shape a ``StatefulDataLoader``
    with ``num_workers`` workers loads. Raises :class:`StateMismatchError` naming both counts
    when it cannot be carried over exactly; changes nothing."""
    saved = saved_workers(state)

    def refuse(why: str) -> StateMismatchError:
        was = "an unknown number of" if saved is None else str(saved)
        return StateMismatchError(
            f"{path} was written by a train loader with {was} worker(s) "
            f"(data.dataloader_num_workers), this run has {num_workers}, and {why}; resume "
            f"{url} with data.dataloader_num_workers={saved if saved is not None else 'as before'}"
        )

    if saved == num_workers:
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
