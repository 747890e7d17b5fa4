"""VersionedSampler: a stateful sampler whose state pins a store version and a position, so
a growing dataset resumes exactly under torchdata's StatefulDataLoader.

The order depends only on the seed and the store's history, never on timing, worker count or
prefetch depth. Shuffling uses a keyed Feistel permutation, so position ``p`` of an epoch maps
to its row in O(1): resuming at row 10M costs what resuming at row 0 costs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from .dataset import VersionedDataset, encode_index
from .errors import InvalidDataError, StateMismatchError, UnsupportedFormatError
from .resume import walk_lineage

log = logging.getLogger("dynstate")

STATE_FORMAT = 1
STATE_KIND = "dynstate.VersionedSampler"
MODES = ("epoch", "mix")
_BLOCK = 1024
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a fast, well-distributed 64-bit hash (wrapping uint64 math)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """A pseudo-random bijection of [0, n) keyed by (seed, epoch); O(1) state, vectorized."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int):
        self.n = n
        bits = max(2, (max(n, 2) - 1).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = np.uint64((1 << self.half) - 1)
        base = np.array([seed & 0xFFFFFFFFFFFFFFFF, epoch & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
        k = _mix64(_mix64(base[:1]) ^ base[1:])[0]
        self.keys = [
            _mix64(np.array([k + np.uint64(r + 1)], dtype=np.uint64))[0] for r in range(self.ROUNDS)
        ]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.mask)
        return (left << half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._encrypt(positions.astype(np.uint64))
        # Cycle-walk values outside [0, n) back into range: still a bijection on [0, n).
        bad = out >= np.uint64(self.n)
        while bad.any():
            out[bad] = self._encrypt(out[bad])
            bad = out >= np.uint64(self.n)
        return out.astype(np.int64)


class VersionedSampler(Sampler[int]):
    """Stateful sampler over a :class:`VersionedDataset`.

    Modes:

    * ``"epoch"`` — each epoch pins the store's head when it starts and visits that version's
      rows once (shuffled with ``seed`` and the epoch number). Rows committed during an epoch
      join at the next one.
    * ``"mix"`` — as ``"epoch"``, and in addition each batch of ``batch_size`` indices draws up
      to ``fresh_share`` of its rows from rows committed after the epoch began, oldest first:
      rows of the round committed with ``meta={"step": s}`` become eligible at step ``s + lag``.
      Commit exactly one round per step (an empty one if nothing was generated). The sampler
      waits for the round of step ``t - lag`` before it hands out batch ``t``, so ``lag`` must
      be at least the loader's prefetch depth + 1 (``num_workers * prefetch_factor + 1``; 1
      without workers).

    With ``prefetch`` (default), the shards of the next block of the order are downloaded into
    the dataset's disk cache in the background (remote stores only), where DataLoader workers
    sharing the cache folder find them.

    ``state_dict()`` returns plain types (loadable with ``torch.load(weights_only=True)``);
    ``load_state_dict()`` continues exactly where the state was taken.
    """

    def __init__(
        self,
        dataset: VersionedDataset,
        *,
        shuffle: bool = True,
        seed: int = 0,
        mode: str = "epoch",
        batch_size: int | None = None,
        fresh_share: float = 0.25,
        lag: int = 1,
        wait_timeout: float = 600.0,
        prefetch: bool = True,
    ) -> None:
        if mode not in MODES:
            raise InvalidDataError(f"mode must be one of {MODES}, not {mode!r}")
        if mode == "mix":
            if not batch_size or batch_size < 1:
                raise InvalidDataError("mode='mix' needs the loader's batch_size")
            if not 0.0 < fresh_share <= 1.0:
                raise InvalidDataError(f"fresh_share must be in (0, 1], not {fresh_share}")
            if lag < 1:
                raise InvalidDataError(f"lag must be >= 1, not {lag}")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = int(seed)
        self.mode = mode
        self.batch_size = batch_size
        self.fresh_share = fresh_share
        self.lag = lag
        self.wait_timeout = wait_timeout
        self.prefetch = prefetch
        # The position: which epoch, over which version, how far in.
        self.epoch = 0
        self.version: int | None = None
        self.base_rows = 0
        self.position = 0  # indices of the base permutation handed out this epoch
        self.step = 0  # batches handed out over the whole run (mix mode)
        self.fresh_next = 0  # next fresh row to hand out (mix mode)
        self.fresh_version: int | None = None

    # -- iteration ---------------------------------------------------------------------------

    def __len__(self) -> int:
        if self.version is None:
            return self.dataset.store.snapshot().num_rows
        return self.base_rows

    def _start_epoch(self, epoch: int) -> None:
        snap = self.dataset.store.snapshot(self.dataset.store.refresh())
        self.epoch = epoch
        self.version = snap.version
        self.base_rows = snap.num_rows
        self.position = 0
        self.fresh_next = snap.num_rows
        self.fresh_version = snap.version
        log.debug("epoch %d pins version %d (%d rows)", epoch, self.version, self.base_rows)

    def __iter__(self) -> Iterator[int]:
        # A generator: nothing happens until the first index is requested, so the extra
        # iter() calls StatefulDataLoader makes while restoring have no effect.
        if self.version is None:
            self._start_epoch(self.epoch)
        elif self.position >= self.base_rows:
            self._start_epoch(self.epoch + 1)
        if self.mode == "epoch":
            yield from self._iter_epoch()
        else:
            yield from self._iter_mix()

    def _base_indices(self, start: int, stop: int) -> np.ndarray:
        positions = np.arange(start, stop, dtype=np.int64)
        if not self.shuffle:
            return positions
        return FeistelPermutation(self.base_rows, self.seed, self.epoch)(positions)

    def _prefetch(self, start: int) -> None:
        """Warm the shards of the block after ``start`` while this one is consumed."""
        if self.prefetch and start < self.base_rows:
            stop = min(start + _BLOCK, self.base_rows)
            self.dataset.prefetch(self.version, self._base_indices(start, stop).tolist())

    def _iter_epoch(self) -> Iterator[int]:
        tag = encode_index(self.version, 0)
        while self.position < self.base_rows:
            stop = min(self.position + _BLOCK, self.base_rows)
            self._prefetch(stop)
            for index in self._base_indices(self.position, stop).tolist():
                self.position += 1
                yield tag | index

    def _iter_mix(self) -> Iterator[int]:
        assert self.batch_size is not None
        want_fresh = max(1, round(self.fresh_share * self.batch_size))
        while self.position < self.base_rows:
            if self.position % _BLOCK < self.batch_size:
                self._prefetch(self.position - self.position % _BLOCK + _BLOCK)
            fresh_version, fresh_rows = self._visible(self.step - self.lag)
            n_fresh = min(want_fresh, max(0, fresh_rows - self.fresh_next))
            n_base = min(self.batch_size - n_fresh, self.base_rows - self.position)
            base_tag, fresh_tag = encode_index(self.version, 0), encode_index(fresh_version, 0)
            batch = [
                base_tag | i
                for i in self._base_indices(self.position, self.position + n_base).tolist()
            ]
            batch += [fresh_tag | i for i in range(self.fresh_next, self.fresh_next + n_fresh)]
            # State advances before the batch's indices leave, as the loader snapshots it
            # when it hands out the batch's first index.
            self.position += n_base
            self.fresh_next += n_fresh
            self.step += 1
            yield from batch

    def _visible(self, step: int) -> tuple[int, int]:
        """(version, rows) of the newest version whose round belongs to a step <= ``step``.
        Waits, up to ``wait_timeout``, until the round of ``step`` is committed, so the answer
        never depends on how far the loader prefetches."""
        store = self.dataset.store
        current = self.fresh_version if self.fresh_version is not None else self.version
        deadline = time.monotonic() + self.wait_timeout
        while True:
            version = current
            last = _latest_step(store, current)
            done = step < 0 or (last is not None and last >= step)
            # Only the head's lineage counts: rounds a rollback abandoned never become fresh.
            for v in _lineage_after(store, store.refresh(), current):
                record_step = store.commit_record(v).meta.get("step")
                if record_step is None:
                    continue
                if record_step > step:
                    done = True
                    break
                version = v
                if record_step == step:
                    done = True  # one round per step: step's round is in
                    break
            current = version
            if done:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the round of step {step} did not appear in {store.display_url} within "
                    f"{self.wait_timeout}s; commit one round (possibly empty) with "
                    "meta={'step': ...} per step, and make lag larger than the prefetch depth"
                )
            time.sleep(0.01)
        self.fresh_version = version
        return version, store.snapshot(version).num_rows

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "kind": STATE_KIND,
            "store_id": self.dataset.store_id,
            "store_url": self.dataset.store.display_url,
            "mode": self.mode,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "fresh_share": self.fresh_share,
            "lag": self.lag,
            "epoch": self.epoch,
            "version": self.version,
            "base_rows": self.base_rows,
            "position": self.position,
            "step": self.step,
            "fresh_next": self.fresh_next,
            "fresh_version": self.fresh_version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, self.dataset.store_id, self.dataset.store.display_url)
        # lag and share shape the stream only in mix mode; epoch mode may change them freely
        keys = ("mode", "shuffle", "seed") + (
            ("batch_size", "fresh_share", "lag") if self.mode == "mix" else ()
        )
        for key in keys:
            if state[key] != getattr(self, key):
                raise StateMismatchError(
                    f"sampler state for {self.dataset.store.display_url} was saved with "
                    f"{key}={state[key]!r} but this sampler has {key}={getattr(self, key)!r}; "
                    "construct the sampler with the same settings to resume exactly"
                )
        if state["version"] is not None:
            snap = self.dataset.store.snapshot(state["version"])  # raises if collected
            if snap.num_rows != state["base_rows"]:
                raise StateMismatchError(
                    f"version {snap.version} of {self.dataset.store.display_url} has "
                    f"{snap.num_rows} rows, but the state expects {state['base_rows']}"
                )
        self.epoch = state["epoch"]
        self.version = state["version"]
        self.base_rows = state["base_rows"]
        self.position = state["position"]
        self.step = state["step"]
        self.fresh_next = state["fresh_next"]
        self.fresh_version = state["fresh_version"]


def _latest_step(store: Any, version: int, horizon: int = 1000) -> int | None:
    """The step of the newest round in ``version``'s lineage that records one."""
    for v in itertools.islice(walk_lineage(store, version), horizon):
        step = store.commit_record(v).meta.get("step")
        if step is not None:
            return step
    return None


def _lineage_after(store: Any, head: int, floor: int) -> list[int]:
    """The versions of ``head``'s lineage newer than ``floor``, oldest first."""
    out = list(itertools.takewhile(lambda v: v > floor, walk_lineage(store, head)))
    return out[::-1]


def check_state(state: Any, store_id: str, url: str) -> None:
    """Validate a sampler state dict against the store it is loaded into."""
    if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
        raise StateMismatchError(
            f"not a dynstate sampler state (for {url}); pass the dict VersionedSampler."
            "state_dict() returned, or use dynstate.find_sampler_state(loader_state)"
        )
    if not isinstance(state.get("format"), int) or state["format"] > STATE_FORMAT:
        raise UnsupportedFormatError(
            f"sampler state format {state.get('format')!r} is newer than this dynstate "
            f"supports ({STATE_FORMAT}); upgrade dynstate"
        )
    if state.get("store_id") != store_id:
        raise StateMismatchError(
            f"this state belongs to store {state.get('store_id')} "
            f"({state.get('store_url')}), not to {url} (store {store_id}); resume with the "
            "store the checkpoint was written for"
        )


def find_sampler_state(loader_state: Any) -> dict[str, Any] | None:
    """The VersionedSampler state inside a StatefulDataLoader state dict (e.g. verl's
    ``data.pt``), wherever torchdata nested it; None if there is none."""
    if isinstance(loader_state, dict):
        if loader_state.get("kind") == STATE_KIND:
            return loader_state
        for value in loader_state.values():
            found = find_sampler_state(value)
            if found is not None:
                return found
    elif isinstance(loader_state, (list, tuple)):
        for value in loader_state:
            found = find_sampler_state(value)
            if found is not None:
                return found
    return None
