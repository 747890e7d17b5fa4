"""VersionedSampler: a stateful sampler whose state pins a store version and a position, so
a growing dataset resumes exactly under torchdata's StatefulDataLoader, on one rank or many.

The order depends only on the seed, the batch layout and the store's history, never on timing,
worker count or prefetch depth. Shuffling uses a keyed Feistel permutation
(:mod:`dynstate.loading.permutation`), so position ``p`` of an epoch maps to its row in O(1):
resuming at row 10M costs what resuming at row 0 costs.

Positions are global: a step hands out ``num_replicas * batch_size`` positions of the epoch,
and rank ``r`` takes every ``num_replicas``-th of them from the ``r``-th on, as torch's
``DistributedSampler`` does. The state is the same on every rank, so one checkpoint restores
all of them, at any world size.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from ..errors import InvalidDataError, StateMismatchError
from ..resume import walk_lineage
from .dataset import VersionedDataset, encode_index
from .permutation import FeistelPermutation
from .state import MODES, STATE_FORMAT, STATE_KIND, _is_int, check_state

log = logging.getLogger("dynstate")

_BLOCK = 1024

__all__ = ["FeistelPermutation", "VersionedSampler"]


def _dist_world() -> tuple[int, int] | None:
    """(world size, rank) of an initialized torch.distributed process group, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return None


class VersionedSampler(Sampler[int]):
    """Stateful sampler over a :class:`VersionedDataset`, for one rank or many.

    Modes:

    * ``"epoch"`` — each epoch pins one version of the store and visits its rows once
      (shuffled with ``seed`` and the epoch number). Rows committed during an epoch join at
      the next one.
    * ``"mix"`` — as ``"epoch"``, but each batch gives up to ``fresh_share`` of its slots to
      rows committed after the epoch began, oldest first: rows of the round committed with
      ``meta={"step": s}`` become eligible at step ``s + lag``. Commit exactly one round per
      step (an empty one if nothing was generated). ``lag`` must exceed the loader's prefetch
      depth: ``lag >= num_workers * prefetch_factor + 1`` (1 without workers).

    Steps: with ``batch_size`` (the per-rank batch size of the loader), the sampler counts the
    loader's steps, from ``first_step`` (0; 1 for a trainer whose first step is step 1, as
    verl's ``global_steps``), in the numbering of the rounds' ``meta["step"]``. Epoch
    ``e + 1``, which starts at step ``S``, pins the version of the round of step ``S - 1``
    (the newest version of the head's lineage whose ``meta["step"]`` is at most ``S - 1``), a
    rule on the store's history, so every rank and every resumed run pins
    the same version. Mix mode waits for that round; epoch mode pins the head when the run
    commits no rounds. The first epoch pins the head (rank 0's, broadcast to every rank when
    ``torch.distributed`` is initialized).

    Ranks follow torch's ``DistributedSampler``: ``num_replicas``/``rank`` default to the
    initialized process group's (else 1 and 0); ``drop_last=True`` drops the end of an epoch
    that does not fill a whole step on every rank, ``drop_last=False`` repeats rows from the
    start of the epoch so that every rank gets as many. Pass the loader's ``drop_last`` here
    too, and call :meth:`check_loader` on the loader you build.

    ``state_dict()`` returns plain types (loadable with ``torch.load(weights_only=True)``);
    ``load_state_dict()`` continues exactly where the state was taken, with any number of
    ranks and workers.
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
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        first_step: int = 0,
        wait_timeout: float = 600.0,
        prefetch: bool = True,
    ) -> None:
        if mode not in MODES:
            raise InvalidDataError(f"mode must be one of {MODES}, not {mode!r}")
        if not _is_int(seed):
            raise InvalidDataError(f"seed must be an int, not {seed!r}")
        if batch_size is not None and (not _is_int(batch_size) or batch_size < 1):
            raise InvalidDataError(f"batch_size must be a positive int or None, not {batch_size!r}")
        if not isinstance(drop_last, bool) or not isinstance(shuffle, bool):
            raise InvalidDataError("shuffle and drop_last must be True or False")
        if not _is_int(first_step) or first_step < 0:
            raise InvalidDataError(f"first_step must be an int >= 0, not {first_step!r}")
        if mode == "mix":
            if batch_size is None:
                raise InvalidDataError("mode='mix' needs the loader's batch_size")
            if not isinstance(fresh_share, (int, float)) or not 0.0 < fresh_share <= 1.0:
                raise InvalidDataError(f"fresh_share must be in (0, 1], not {fresh_share!r}")
            if not _is_int(lag) or lag < 1:
                raise InvalidDataError(f"lag must be an int >= 1, not {lag!r}")
        world = _dist_world() if num_replicas is None or rank is None else None
        if num_replicas is None:
            num_replicas = world[0] if world else 1
        if rank is None:
            rank = world[1] if world else 0
        if not _is_int(num_replicas) or num_replicas < 1:
            raise InvalidDataError(f"num_replicas must be a positive int, not {num_replicas!r}")
        if not _is_int(rank) or not 0 <= rank < num_replicas:
            raise InvalidDataError(f"rank must be in [0, {num_replicas}), not {rank!r}")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = int(seed)
        self.mode = mode
        self.batch_size = None if batch_size is None else int(batch_size)
        self.fresh_share = fresh_share
        self.lag = lag
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.drop_last = drop_last
        self.wait_timeout = wait_timeout
        self.prefetch = prefetch
        # The position, the same on every rank: which epoch, over which version, how far in.
        self.epoch = 0
        self.version: int | None = None
        self.base_rows = 0
        self.position = 0  # slots of the epoch handed out, all ranks together
        self.base_next = 0  # next position of the epoch's permutation (mix: <= position)
        self.first_step = int(first_step)
        self.step = self.first_step  # the next step's number (counted with batch_size)
        self.fresh_next = 0  # next fresh row to hand out (mix mode)
        self.fresh_version: int | None = None
        self._perm_key: tuple[int, int] | None = None
        self._perm_start = 0
        self._perm_rows: list[int] = []
        self._prefetched = -1
        self._open = False  # an epoch is under way: it started and not all its indices left

    # -- layout ------------------------------------------------------------------------------

    def _step_shape(self) -> tuple[int, int] | None:
        """(slots, indices per rank) of the step at ``position``; None when the epoch is over."""
        left = self.base_rows - self.position
        if left <= 0:
            return None
        per_rank = self.batch_size or 1
        full = per_rank * self.num_replicas
        if left >= full:
            return full, per_rank
        if self.drop_last:
            return None
        return left, -(-left // self.num_replicas)

    def _share(self, rows: int) -> int:
        """Indices one rank gets from an epoch of ``rows`` rows."""
        per_rank = self.batch_size or 1
        steps, left = divmod(rows, per_rank * self.num_replicas)
        if self.drop_last or left == 0:
            return steps * per_rank
        return steps * per_rank + -(-left // self.num_replicas)

    def __len__(self) -> int:
        """Indices this rank gets in the current epoch (the next one's, from the head, if none
        is under way): what ``len(loader)`` needs, in both modes."""
        if self.version is not None and self._open:
            return self._share(self.base_rows)
        return self._share(self.dataset.store.snapshot().num_rows)

    def set_epoch(self, epoch: int) -> None:
        """Accepted for ``DistributedSampler`` compatibility. The sampler numbers epochs itself
        (its state carries the number), so a resumed loop need not pass the right one."""
        if (
            _is_int(epoch)
            and self.version is not None
            and epoch not in (self.epoch, self.epoch + 1)
        ):
            log.debug("set_epoch(%d) ignored: the sampler is in epoch %d", epoch, self.epoch)

    def check_loader(self, loader: Any) -> Any:
        """Check that ``loader`` batches as this sampler counts, and that mix mode's ``lag`` is
        deeper than its prefetch; returns the loader. Call it when the loader is built."""
        batch_sampler = getattr(loader, "batch_sampler", None)
        if getattr(loader, "sampler", None) is not self and (
            getattr(batch_sampler, "sampler", None) is not self
        ):
            raise InvalidDataError("this loader does not draw from this VersionedSampler")
        url = self.dataset.store.display_url
        size, drop = getattr(loader, "batch_size", None), bool(getattr(loader, "drop_last", False))
        if self.batch_size is not None and size != self.batch_size:
            raise InvalidDataError(
                f"the loader's batch_size is {size} but the VersionedSampler for {url} counts "
                f"steps of {self.batch_size}; pass the loader's batch_size to both"
            )
        if size is not None and self.batch_size is None and self.num_replicas > 1:
            raise InvalidDataError(
                f"pass batch_size={size} to the VersionedSampler for {url}: with several ranks "
                "it counts the loader's steps"
            )
        if drop and not self.drop_last and self.batch_size is not None:
            raise InvalidDataError(
                f"the loader drops the partial last batch (drop_last=True) but the "
                f"VersionedSampler for {url} counts it as a step; pass drop_last=True to both"
            )
        workers = int(getattr(loader, "num_workers", 0) or 0)
        factor = int(getattr(loader, "prefetch_factor", None) or 0) if workers else 0
        if self.mode == "mix":
            if workers and not getattr(loader, "in_order", True):
                raise InvalidDataError(
                    f"mix mode over {url} needs batches in order; build the loader with "
                    "in_order=True"
                )
            if self.lag < workers * factor + 1:
                raise InvalidDataError(
                    f"lag={self.lag} is too small for num_workers={workers} and "
                    f"prefetch_factor={factor}: the loader asks for batch t while step "
                    f"t - {workers * factor} trains, so the round it waits for cannot exist "
                    f"yet; use lag >= {workers * factor + 1} (num_workers * prefetch_factor + 1)"
                )
        return loader

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        # A generator: nothing happens until the first index is requested, so the extra
        # iter() calls StatefulDataLoader makes while restoring have no effect.
        if self.version is None or self._step_shape() is None:
            self._start_epoch()
        if self.mode == "epoch":
            yield from self._iter_epoch()
        else:
            yield from self._iter_mix()
        self._open = False

    def _start_epoch(self) -> None:
        first = self.version is None
        version = self._agree(lambda: self._epoch_version(first))
        snap = self.dataset.store.snapshot(version)
        self.epoch = self.epoch if first else self.epoch + 1
        self.version = snap.version
        self.base_rows = snap.num_rows
        self.position = self.base_next = 0
        self.fresh_next = snap.num_rows
        self.fresh_version = snap.version
        self._open = True
        log.debug(
            "epoch %d pins version %d (%d rows) at step %d",
            self.epoch,
            self.version,
            self.base_rows,
            self.step,
        )

    def _agree(self, decide: Callable[[], int]) -> int:
        """``decide()`` on rank 0, broadcast to every rank of an initialized process group that
        this sampler spans, so all ranks pin one version even while others commit."""
        world = _dist_world()
        if self.num_replicas == 1 or world is None or world[0] != self.num_replicas:
            return decide()
        import torch.distributed as dist

        box = [decide() if world[1] == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return int(box[0])  # type: ignore[arg-type]

    def _epoch_version(self, first: bool) -> int:
        """The version the epoch starting now pins (see the class docstring)."""
        store = self.dataset.store
        deadline = time.monotonic() + self.wait_timeout
        while True:
            head = store.refresh()
            if first or self.batch_size is None or self.step <= self.first_step:
                return head  # no step has run: no round to pin by
            found = _round_version(store, head, self.version, self.step - 1)  # type: ignore[arg-type]
            if found is not None:
                return found
            if self.mode == "epoch":
                return head  # a run that commits no rounds: the head, as it always was
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the round of step {self.step - 1} did not appear in {store.display_url} "
                    f"within {self.wait_timeout}s, so epoch {self.epoch + 1} cannot pin its "
                    "version; commit one round (possibly empty) with meta={'step': ...} per step"
                )
            time.sleep(0.01)

    def _rows(self, start: int, count: int) -> list[int]:
        """Rows at positions ``start .. start + count`` of the epoch's permutation."""
        if count <= 0:
            return []
        key = (self.epoch, self.base_rows)
        offset = start - self._perm_start
        if key != self._perm_key or offset < 0 or offset + count > len(self._perm_rows):
            stop = min(self.base_rows, start + max(count, _BLOCK))
            positions = np.arange(start, stop, dtype=np.int64)
            if self.shuffle:
                positions = FeistelPermutation(self.base_rows, self.seed, self.epoch)(positions)
            self._perm_key, self._perm_start, self._perm_rows = key, start, positions.tolist()
            offset = 0
        return self._perm_rows[offset : offset + count]

    def _prefetch(self) -> None:
        """Warm the shards of the block after the one being consumed (remote stores)."""
        block = self.base_next // _BLOCK
        if not self.prefetch or block == self._prefetched or self.dataset.store.storage.local:
            return  # local shards are read where they lie: nothing to warm
        self._prefetched = block
        start = (block + 1) * _BLOCK
        if start < self.base_rows:
            stop = min(start + _BLOCK, self.base_rows)
            positions = np.arange(start, stop, dtype=np.int64)
            if self.shuffle:
                positions = FeistelPermutation(self.base_rows, self.seed, self.epoch)(positions)
            self.dataset.prefetch(self.version, positions.tolist())  # type: ignore[arg-type]

    def _padding(self, count: int) -> list[int]:
        # Rows repeated from the start of the epoch so that every rank gets as many; they may
        # repeat more than once only in an epoch with fewer rows than ranks.
        if count <= 0 or self.base_rows == 0:
            return []
        reps = self._rows(0, min(count, self.base_rows))
        return (reps * math.ceil(count / len(reps)))[:count]

    def _iter_epoch(self) -> Iterator[int]:
        tag = encode_index(self.version, 0)  # type: ignore[arg-type]
        replicas, rank = self.num_replicas, self.rank
        if replicas == 1 and self.batch_size is None:
            # One index per step: the position moves index by index, in blocks.
            while self.position < self.base_rows:
                self._prefetch()
                stop = min(self.position + _BLOCK, self.base_rows)
                for row in self._rows(self.position, stop - self.position):
                    self.position += 1
                    yield tag | row
                self.base_next = self.position
            return
        while (shape := self._step_shape()) is not None:
            slots, per_rank = shape
            self._prefetch()
            rows = self._rows(self.position, slots)
            rows += self._padding(per_rank * replicas - slots)
            # State moves a whole step before its indices leave: the loader snapshots it once
            # the batch is complete, and every rank must hold the same state.
            self.position += slots
            self.base_next = self.position
            if self.batch_size is not None:
                self.step += 1
            yield from [tag | row for row in (rows[rank::replicas] if replicas > 1 else rows)]

    def _iter_mix(self) -> Iterator[int]:
        assert self.batch_size is not None
        replicas, rank = self.num_replicas, self.rank
        want = max(1, round(self.fresh_share * self.batch_size))
        while (shape := self._step_shape()) is not None:
            slots, per_rank = shape
            self._prefetch()
            fresh_version, fresh_rows = self._visible(self.step - self.lag)
            n_fresh = min(min(want, per_rank) * replicas, slots, fresh_rows - self.fresh_next)
            n_fresh = max(0, n_fresh)
            n_base = slots - n_fresh
            base_tag, fresh_tag = encode_index(self.version, 0), encode_index(fresh_version, 0)  # type: ignore[arg-type]
            batch = [base_tag | row for row in self._rows(self.base_next, n_base)]
            batch += [fresh_tag | row for row in range(self.fresh_next, self.fresh_next + n_fresh)]
            batch += [base_tag | row for row in self._padding(per_rank * replicas - slots)]
            self.position += slots
            self.base_next += n_base
            self.fresh_next += n_fresh
            self.step += 1
            yield from batch[rank::replicas] if replicas > 1 else batch

    def _visible(self, step: int) -> tuple[int, int]:
        """(version, rows) of the newest version whose round belongs to a step <= ``step``.
        Waits, up to ``wait_timeout``, until the round of ``step`` is committed, so the answer
        never depends on how far the loader prefetches."""
        store = self.dataset.store
        current = self.fresh_version if self.fresh_version is not None else self.version
        assert current is not None
        deadline = time.monotonic() + self.wait_timeout
        while True:
            version = current
            last = _latest_step(store, current)
            done = step < self.first_step or (last is not None and last >= step)
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
                    "meta={'step': ...} per step, and check the loader with "
                    "VersionedSampler.check_loader (lag must exceed its prefetch depth)"
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
            "drop_last": self.drop_last,
            "num_replicas": self.num_replicas,
            "epoch": self.epoch,
            "version": self.version,
            "base_rows": self.base_rows,
            "position": self.position,
            "base_next": self.position if self.mode == "epoch" else self.base_next,
            "step": self.step,
            "fresh_next": self.fresh_next,
            "fresh_version": self.fresh_version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (any rank's, any world size's); checked in full first: a
        bad state raises :class:`StateMismatchError` and leaves the sampler as it was."""
        url = self.dataset.store.display_url
        state = check_state(state, self.dataset.store_id, url)
        # lag and share shape the stream only in mix mode; epoch mode may change them freely
        keys = ["mode", "shuffle", "seed", "drop_last", "batch_size"]
        if self.mode == "mix":
            keys += ["fresh_share", "lag"]
        for key in keys:
            if state[key] != getattr(self, key):
                raise StateMismatchError(
                    f"sampler state for {url} was saved with {key}={state[key]!r} but this "
                    f"sampler has {key}={getattr(self, key)!r}; construct the sampler with "
                    "the same settings to resume exactly"
                )
        if state["version"] is not None:
            store = self.dataset.store
            snap = store.snapshot(state["version"])  # raises if collected
            if snap.num_rows != state["base_rows"]:
                raise StateMismatchError(
                    f"version {snap.version} of {url} has {snap.num_rows} rows, but the "
                    f"sampler state expects {state['base_rows']}; it belongs to another history"
                )
            fresh = store.snapshot(state["fresh_version"])
            if state["fresh_next"] > fresh.num_rows:
                raise StateMismatchError(
                    f"sampler state for {url} expects row {state['fresh_next']} of version "
                    f"{fresh.version}, which has {fresh.num_rows} rows"
                )
        if state["format"] == 1 and state["mode"] == "epoch" and state["version"] is not None:
            # Format 1 counted no steps in epoch mode: take them up after the newest round.
            last = _latest_step(self.dataset.store, self.dataset.store.refresh())
            state["step"] = 0 if last is None else last + 1
        for key in ("epoch", "version", "base_rows", "position", "base_next", "step"):
            setattr(self, key, state[key])
        self.fresh_next = state["fresh_next"]
        self.fresh_version = state["fresh_version"]
        self._open = self.version is not None and self._step_shape() is not None


def _round_version(store: Any, head: int, floor: int, step: int) -> int | None:
    """The newest version of ``head``'s lineage after ``floor`` whose round belongs to a step
    <= ``step`` (``floor`` if none); None while no round of ``step`` or later is there."""
    best = floor
    for v in _lineage_after(store, head, floor):
        record_step = store.commit_record(v).meta.get("step")
        if record_step is None:
            continue
        if record_step > step:
            return best
        best = v
        if record_step == step:
            return best
    return None


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
