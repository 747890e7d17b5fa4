"""VersionedSampler: a stateful sampler whose state pins a store version and a position, so
a growing dataset resumes exactly under torchdata's StatefulDataLoader, on one rank or many.

The order depends only on the seed, the batch layout and the store's history, never on timing,
worker count or prefetch depth. Shuffling uses a keyed Feistel permutation
(:mod:`dynstate.loading.permutation`), so position ``p`` of an epoch maps to its row in O(1):
resuming at row 10M costs what resuming at row 0 costs.

The sampler composes three things kept elsewhere: its position, one immutable value
(:class:`dynstate.loading.state.Position`); the rank and step math
(:mod:`dynstate.loading.layout`); and the "round of step N" query (:mod:`dynstate.log.steps`),
by which each epoch pins its version and mix mode draws fresh rows; the loader's batching
(:mod:`dynstate.loading.batching`), the epoch's order (:class:`EpochOrder`), the selection
policies (:mod:`dynstate.loading.selection`) and their weights (:mod:`dynstate.loading.weights`)
live apart too. It stays one file of ~540 lines because epoch mode, mix mode and selection are
three ways of filling the same step under one epoch, step and state protocol (the position
moves a whole step before the step's indices leave, alike on every rank), which reads best in
one class; what stands alone has left it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from torch.utils.data import Sampler

from ..errors import InvalidDataError, StateMismatchError
from . import layout
from .batching import Batching, check_lag
from .dataset import VersionedDataset, encode_index
from .permutation import EpochOrder, FeistelPermutation
from .selection import Policy, as_policy
from .state import (
    MODES,
    SELECT_FORMAT,
    STATE_KIND,
    WITHIN_FORMAT,
    Position,
    _is_int,
    check_settings,
    check_state,
)
from .weights import Selector, step_rng

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

    Steps: the sampler counts the loader's steps, from ``first_step`` (0; 1 for a trainer
    whose first step is step 1, as verl's ``global_steps``), in the numbering of the rounds'
    ``meta["step"]``. Pass ``batch_size`` (the per-rank batch size of the loader, the same
    number the loader gets) wherever rounds are committed by step; mix mode and ``select=``
    need it. Without it the sampler draws as a plain sampler and counts no steps, and a rule
    that needs them raises :class:`InvalidDataError` naming ``batch_size``: it is never guessed.
    :meth:`check_loader` compares the loader with it (or takes the loader's when none was
    given), as the verl and TRL integrations do at start-up. Epoch ``e + 1``, which starts at
    step ``S``, pins the version of the round of step ``S - 1`` (:mod:`dynstate.log.steps`), a
    rule on the store's history, so every rank and every resumed run pins the same version.
    Mix mode waits for that round; epoch mode pins the head when the run commits no rounds.
    The first epoch pins the head (rank 0's, broadcast to every rank when
    ``torch.distributed`` is initialized).

    Ranks follow torch's ``DistributedSampler``: ``num_replicas``/``rank`` default to the
    initialized process group's (else 1 and 0); ``drop_last=True`` drops the end of an epoch
    that does not fill a whole step on every rank, ``drop_last=False`` repeats rows from the
    start of the epoch so that every rank gets as many.

    Selection (``select=``, :mod:`dynstate.loading.selection`): a policy over the per-row
    outcome statistics — :class:`PassRateBand`, :class:`Learnability`,
    :class:`DifficultyPools`, a module-level function ``fn(stats, step)`` or a
    :class:`FunctionPolicy` — picks each step's rows instead of the epoch's permutation:
    drawn with replacement by the policy's weights, from a stream keyed by ``(seed, epoch,
    step)``, over the statistics of a version fixed by a rule on the history (epoch mode: the
    version the epoch pinned; mix mode: the round of step ``s - lag``, the version fresh rows
    come from). An epoch still has as many steps as without selection. The policy's identity
    goes into the state: a resume with another policy is refused.

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
        select: Any = None,
    ) -> None:
        if mode not in MODES:
            raise InvalidDataError(f"mode must be one of {MODES}, not {mode!r}")
        if not _is_int(seed) or not -(2**63) <= seed < 2**64:
            # the permutation keys on 64 bits: seeds 2**64 apart would be one stream (torch's
            # manual_seed refuses them too)
            big = _is_int(seed) and abs(seed) >= 2**128  # its digits could pass the str limit
            said = f"<an int of {int(seed).bit_length():,} bits>" if big else repr(seed)
            raise InvalidDataError(f"seed must be an int from -2**63 to 2**64 - 1, not {said}")
        if batch_size is not None and (not _is_int(batch_size) or batch_size < 1):
            raise InvalidDataError(f"batch_size must be a positive int or None, not {batch_size!r}")
        if not isinstance(drop_last, bool) or not isinstance(shuffle, bool):
            raise InvalidDataError("shuffle and drop_last must be True or False")
        if not _is_int(first_step) or first_step < 0:
            raise InvalidDataError(f"first_step must be an int >= 0, not {first_step!r}")
        if mode == "mix" and batch_size is None:
            raise InvalidDataError(
                "mode='mix' keys each step's rows by the loader's step; pass batch_size "
                "(the loader's per-rank batch size) to VersionedSampler"
            )
        # in every mode: the state records both, and check_state checks them in every mode
        if (
            isinstance(fresh_share, bool)
            or not isinstance(fresh_share, (int, float))
            or not 0.0 < fresh_share <= 1.0
        ):
            raise InvalidDataError(f"fresh_share must be in (0, 1], not {fresh_share!r}")
        if not _is_int(lag) or lag < 1:
            raise InvalidDataError(f"lag must be an int >= 1, not {lag!r}")
        if (
            isinstance(wait_timeout, bool)
            or not isinstance(wait_timeout, (int, float))
            or not wait_timeout >= 0  # NaN too: it would wait forever for a missing round
        ):
            raise InvalidDataError(
                f"wait_timeout must be a number of seconds >= 0 (math.inf: no bound), not "
                f"{wait_timeout!r}"
            )
        world = _dist_world() if num_replicas is None or rank is None else None
        if num_replicas is None:
            num_replicas = world[0] if world else 1
        if rank is None:
            rank = world[1] if world else 0
        if not _is_int(num_replicas) or num_replicas < 1:
            raise InvalidDataError(f"num_replicas must be a positive int, not {num_replicas!r}")
        if not _is_int(rank) or not 0 <= rank < num_replicas:
            raise InvalidDataError(f"rank must be in [0, {num_replicas}), not {rank!r}")
        policy = as_policy(select)
        settings = {
            "seed": seed,
            "batch_size": batch_size,
            "num_replicas": num_replicas,
            "lag": lag if _is_int(lag) else None,  # epoch mode leaves it unchecked above
            "step": first_step,
        }
        check_settings(
            {k: None if v is None else int(v) for k, v in settings.items()},
            None if policy is None else policy.identity(),
        )
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = int(seed)
        self.mode = mode
        self._batching = Batching.of(None if batch_size is None else int(batch_size), drop_last)
        # plain types for the state (a numpy scalar accepted here would be refused on load)
        self.fresh_share = float(fresh_share) if isinstance(fresh_share, float) else fresh_share
        self.lag = int(lag) if _is_int(lag) else lag
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.wait_timeout = float(wait_timeout)
        self.prefetch = prefetch
        self.first_step = int(first_step)
        self.select: Policy | None = policy
        self._selector = None if self.select is None else Selector(self.select)
        self._order = EpochOrder(shuffle, self.seed, _BLOCK)
        self._prefetched = -1
        self._restart()
        # Maps a step of this sampler's count to the step of the round (``meta["step"]``)
        # that rules it: the same number when each training step draws one sampler step;
        # DynamicSampling, whose training steps draw a varying number, sets its own
        # (the last training step that ended by then). Not state: the loop sets it again.
        self.round_clock: Callable[[int], int] | None = None

    def _restart(self) -> None:
        """Where a new sampler of these settings starts (no epoch pinned, step
        ``first_step``); also a run started afresh on a sampler that handed out rows."""
        self.pos: Position = Position(step=self.first_step)
        self._open = False  # an epoch is under way: it started and not all its indices left
        self._pinned_now = False  # __iter__ just pinned the first epoch
        # The position counts whole steps, and moves before a step's indices leave. A state
        # asked for between two of them is the step's start (``_step_start``) and how many of
        # them this rank handed out (``within_step``); ``_owed``: how many it has not yet.
        self._owed: int = 0
        self._taken: int = 0
        self._step_start: Position = self.pos
        self._skip: int = 0  # a loaded state's within_step: the next step's indices to leave out

    # The batches steps are counted in: given, taken from the loader by check_loader, or taken
    # from a loaded state. None: not known.
    batch_size = property(lambda self: self._batching.size)
    drop_last = property(lambda self: self._batching.drop_last)
    # The position, read-only: it changes only as one value (self.pos).
    epoch = property(lambda self: self.pos.epoch)
    version = property(lambda self: self.pos.version)
    base_rows = property(lambda self: self.pos.base_rows)
    position = property(lambda self: self.pos.slot)
    base_next = property(lambda self: self.pos.base_next)
    step = property(lambda self: self.pos.step)
    fresh_next = property(lambda self: self.pos.fresh_next)
    fresh_version = property(lambda self: self.pos.fresh_version)

    # -- layout ------------------------------------------------------------------------------

    def _step_shape(self) -> tuple[int, int] | None:
        """(slots, indices per rank) of the step at the position; None when the epoch is over."""
        left = self.pos.base_rows - self.pos.slot
        return layout.step_shape(left, self.batch_size or 1, self.num_replicas, self.drop_last)

    def __len__(self) -> int:
        """Indices this rank gets in the current epoch (the next one's, from the head, if none
        is under way): what ``len(loader)`` needs, in both modes."""
        rows = self.pos.base_rows
        if self.pos.version is None or not self._open:
            store = self.dataset.store
            rows = store.snapshot(store.resolve(None)).num_rows
        return self._share(rows)

    def _share(self, rows: int) -> int:
        """Indices one rank gets from an epoch of ``rows`` rows."""
        return layout.share(rows, self.batch_size or 1, self.num_replicas, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Accepted for ``DistributedSampler`` compatibility. The sampler numbers epochs itself
        (its state carries the number), so a resumed loop need not pass the right one."""
        if _is_int(epoch) and self.pos.version is not None and epoch - self.pos.epoch not in (0, 1):
            log.debug("set_epoch(%d) ignored: the sampler is in epoch %d", epoch, self.pos.epoch)

    # -- the loader --------------------------------------------------------------------------

    def check_loader(self, loader: Any) -> Any:
        """Check that ``loader`` batches as this sampler counts, and that mix mode's ``lag`` is
        deeper than its prefetch; returns the loader. Without this call nothing compares them:
        a loader that batches by another size still resumes exactly (:meth:`state_dict` saves
        how far into a step it was), but the sampler's steps are not the loader's, and the
        ``lag`` is not checked."""
        batch_sampler = getattr(loader, "batch_sampler", None)
        if getattr(loader, "sampler", None) is not self and (
            getattr(batch_sampler, "sampler", None) is not self
        ):
            raise InvalidDataError("this loader does not draw from this VersionedSampler")
        url = self.dataset.store.display_url
        size, drop = getattr(loader, "batch_size", None), getattr(loader, "drop_last", False)
        if size is None:  # built with batch_sampler=: that one batches
            size = getattr(batch_sampler, "batch_size", None)
            drop = getattr(batch_sampler, "drop_last", False)
        if isinstance(size, int) and not isinstance(size, bool):
            self._meet_loader(int(size), bool(drop))
        elif self._batching.given:
            raise InvalidDataError(
                f"the loader's batch_size is {size} but the VersionedSampler for {url} counts "
                f"steps of {self.batch_size}; pass the loader's batch_size to both"
            )
        if self.mode == "mix":
            check_lag(self.lag, loader, url)
        return loader

    def _meet_loader(self, size: int, drop: bool) -> None:
        known = self.batch_size is not None
        self._batching = self._batching.meet(size, drop, self.dataset.store.display_url)
        if not known and self.pos.version is not None:
            # Drawn before its steps were known: count on from the newest round.
            self.pos = replace(self.pos, step=self._steps_taken_up())

    def _steps_taken_up(self) -> int:
        store = self.dataset.store
        last = store.steps.latest(store.latest())
        return self.first_step if last is None else max(self.first_step, last + 1)

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        if self.pos.version is None:
            # The first epoch pins the head when its iterator is made, not at its first index:
            # torchdata snapshots the sampler right after making the iterator (with
            # snapshot_every_n_steps > 1 that snapshot may be a checkpoint's), and a run resumed
            # from it must find the epoch pinned, not pin the head it finds then — which holds
            # the rounds the first run committed meanwhile.
            self._start_epoch()
            self._pinned_now = True  # an epoch of no rows is still this epoch, not over
        return self._draw()

    def _draw(self) -> Iterator[int]:
        # A generator: later epochs start at their first index, by the step rule, so the
        # extra iter() calls StatefulDataLoader makes while restoring have no effect.
        pinned_now, self._pinned_now = self._pinned_now, False
        self._owed = 0  # a new iterator: an abandoned one's step is not this one's
        if self.pos.version is None or (self._step_shape() is None and not pinned_now):
            self._start_epoch()
        if self.mode == "epoch":
            yield from self._iter_epoch()
        else:
            yield from self._iter_mix()
        self._open = False

    def _start_epoch(self) -> None:
        first = self.pos.version is None
        version = self._agree(lambda: self._epoch_version(first))
        snap = self.dataset.store.snapshot(version)
        self.pos = self.pos.started(snap.version, snap.num_rows, next_epoch=not first)
        self._open = True
        log.debug(
            "epoch %d pins version %d (%d rows) at step %d",
            self.pos.epoch,
            snap.version,
            snap.num_rows,
            self.pos.step,
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
        store, pinned = self.dataset.store, self.pos.version
        head = store.latest()
        if first or pinned is None:
            return head
        if self.batch_size is None:
            if any(own is not None for _, own in store.steps.after(head, pinned)):
                raise InvalidDataError(
                    f"epoch {self.pos.epoch + 1} over {store.display_url} pins the version of "
                    "the round of the step before it, but this VersionedSampler does not know "
                    "the loader's steps; pass batch_size (the loader's) to VersionedSampler, "
                    "or call sampler.check_loader(loader) before the first epoch"
                )
            return head  # no rounds: the head, as it always was
        if self.pos.step <= self.first_step:
            return head  # no step has run: no round to pin by
        target = self._round_step(self.pos.step - 1)
        if target < self.first_step:
            return head  # no training step has ended: no round to pin by
        if self.mode == "epoch":
            store.steps.require_held(pinned, head)
            found = store.steps.round_version(head, target, pinned)
            return head if found is None else found  # a run that commits no rounds: the head
        return store.steps.wait_round(
            target,
            pinned,
            timeout=self.wait_timeout,
            advice=f"epoch {self.pos.epoch + 1} cannot pin its version; commit one round "
            "(possibly empty) with meta={'step': ...} per step",
        )

    def _rows(self, start: int, count: int) -> list[int]:
        """Rows at positions ``start .. start + count`` of the epoch's permutation."""
        return self._order.rows(self.pos.epoch, self.pos.base_rows, start, count)

    def _prefetch(self) -> None:
        """Warm the shards of the block after the one being consumed (remote stores)."""
        block = self.pos.base_next // _BLOCK
        if not self.prefetch or block == self._prefetched or self.dataset.store.reads_in_place:
            return  # local shards are read where they lie: nothing to warm
        self._prefetched = block
        rows, start = self.pos.base_rows, (block + 1) * _BLOCK
        if start < rows:
            wanted = self._order.positions(self.pos.epoch, rows, start, min(start + _BLOCK, rows))
            self.dataset.prefetch(self.pos.version, wanted)  # type: ignore[arg-type]

    def _padding(self, count: int) -> list[int]:
        # Rows repeated from the start of the epoch so that every rank gets as many; they may
        # repeat more than once only in an epoch with fewer rows than ranks.
        if count <= 0 or self.pos.base_rows == 0:
            return []
        reps = self._rows(0, min(count, self.pos.base_rows))
        return (reps * math.ceil(count / len(reps)))[:count]

    def _iter_epoch(self) -> Iterator[int]:
        tag = encode_index(self.pos.version, 0)  # type: ignore[arg-type]
        replicas, rank = self.num_replicas, self.rank
        if self.select is not None:
            yield from self._iter_selected()
            return
        if replicas == 1 and self.batch_size is None:
            # One index per step: the position moves index by index, in blocks.
            while (start := self.pos.slot) < self.pos.base_rows:
                self._prefetch()
                stop = min(start + _BLOCK, self.pos.base_rows)
                for slot, row in enumerate(self._rows(start, stop - start), start + 1):
                    self.pos = replace(self.pos, slot=slot, base_next=slot)
                    yield tag | row
            return
        while (shape := self._step_shape()) is not None:
            slots, per_rank = shape
            self._prefetch()
            rows = self._rows(self.pos.slot, slots)
            rows += self._padding(per_rank * replicas - slots)
            # State moves a whole step before its indices leave: the loader snapshots it once
            # the batch is complete, and every rank must hold the same state.
            slot = self.pos.slot + slots
            counted = self.batch_size is not None
            begun = self.pos
            self.pos = replace(self.pos, slot=slot, base_next=slot, step=self.pos.step + counted)
            yield from self._hand_out(
                begun, [tag | row for row in (rows[rank::replicas] if replicas > 1 else rows)]
            )

    def _hand_out(self, start: Position, indices: list[int]) -> Iterator[int]:
        """This rank's indices of the step that starts at ``start``, counted (see
        :meth:`state_dict`); a loaded state's ``within_step`` first ones left out."""
        skip, self._skip = self._skip, 0
        self._step_start = start
        for taken in range(skip + 1, len(indices) + 1):
            self._taken, self._owed = taken, len(indices) - taken
            yield indices[taken - 1]

    # -- selection -----------------------------------------------------------------------

    def _selected(self, version: int, count: int) -> list[int]:
        """``count`` rows of the step at the position, drawn by the policy over the
        statistics of ``version`` (fixed by the mode's rule, never by timing)."""
        assert self.select is not None and self._selector is not None
        step, store = self.pos.step, self.dataset.store
        key = (version, step if self.select.uses_step else None)
        where = f"{self.select.describe()} at step {step}, version {version} of {store.display_url}"
        plan = self._selector.plan(key, lambda: store.outcome_stats(version), step, where)
        return plan.draw(step_rng(self.seed, self.pos.epoch, step), count).tolist()

    def _iter_selected(self) -> Iterator[int]:
        """Epoch mode with a policy: each step draws its slots by the policy's weights over
        the statistics of the version the epoch pinned."""
        if self.batch_size is None:
            raise InvalidDataError(
                f"a VersionedSampler with select= over {self.dataset.store.display_url} keys "
                "each step's draw by the loader's step; pass batch_size (the loader's) to "
                "VersionedSampler, or call sampler.check_loader(loader) before drawing"
            )
        tag = encode_index(self.pos.version, 0)  # type: ignore[arg-type]
        replicas, rank = self.num_replicas, self.rank
        while (shape := self._step_shape()) is not None:
            slots, per_rank = shape
            rows = self._selected(self.pos.version, per_rank * replicas)  # type: ignore[arg-type]
            slot = self.pos.slot + slots
            start = self.pos
            self.pos = replace(self.pos, slot=slot, base_next=slot, step=self.pos.step + 1)
            yield from self._hand_out(
                start, [tag | row for row in (rows[rank::replicas] if replicas > 1 else rows)]
            )

    def _iter_mix(self) -> Iterator[int]:
        assert self.batch_size is not None
        replicas, rank = self.num_replicas, self.rank
        want = max(1, round(self.fresh_share * self.batch_size))
        while (shape := self._step_shape()) is not None:
            slots, per_rank = shape
            if self.select is None:
                self._prefetch()
            fresh_version, fresh_rows = self._visible(self._round_step(self.pos.step - self.lag))
            p = self.pos
            n_fresh = max(0, min(min(want, per_rank) * replicas, slots, fresh_rows - p.fresh_next))
            n_base = slots - n_fresh
            base_tag, fresh_tag = encode_index(p.version, 0), encode_index(fresh_version, 0)  # type: ignore[arg-type]
            if self.select is not None:
                # The rest of the step by the policy, over the statistics of the same round
                # the fresh rows come from (step - lag): the loader never waits on itself.
                picked = self._selected(fresh_version, per_rank * replicas - n_fresh)
                batch = [fresh_tag | row for row in picked]
            else:
                batch = [base_tag | row for row in self._rows(p.base_next, n_base)]
            batch += [fresh_tag | row for row in range(p.fresh_next, p.fresh_next + n_fresh)]
            if self.select is None:
                batch += [base_tag | row for row in self._padding(per_rank * replicas - slots)]
            self.pos = replace(
                p,
                slot=p.slot + slots,
                base_next=p.base_next + n_base,
                fresh_next=p.fresh_next + n_fresh,
                fresh_version=fresh_version,
                step=p.step + 1,
            )
            yield from self._hand_out(p, batch[rank::replicas] if replicas > 1 else batch)

    def _round_step(self, step: int) -> int:
        """The round step (``meta["step"]``) that sampler step ``step`` is ruled by."""
        if self.round_clock is None or step < self.first_step:
            return step
        return self.round_clock(step)

    def _visible(self, step: int) -> tuple[int, int]:
        """(version, rows) of the round of ``step`` (the newest version whose round belongs to
        a step <= ``step``; only the head's lineage counts, so rounds a rollback abandoned
        never become fresh). Waits, up to ``wait_timeout``, until that round is committed, so
        the answer never depends on how far the loader prefetches."""
        store = self.dataset.store
        current = self.pos.fresh_version if self.pos.fresh_version is not None else self.pos.version
        assert current is not None
        if step < self.first_step:
            version = current  # no step has run yet: nothing fresh to wait for
        else:
            version = store.steps.wait_round(
                step,
                current,
                timeout=self.wait_timeout,
                advice="commit one round (possibly empty) with meta={'step': ...} per step, "
                "and check the loader with VersionedSampler.check_loader (lag must exceed its "
                "prefetch depth)",
            )
        return version, store.snapshot(version).num_rows

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position as plain types. Asked for between two indices of one step (a loader
        that batches by another size than the sampler counts, or a loop that iterates the
        sampler itself), it is the step's start and ``within_step``, how many of this rank's
        indices of the step were handed out: a resume hands out the rest of the step."""
        # Format 3 only with a policy: a dynstate without selection refuses such a state
        # (newer format) instead of resuming without the policy; format 4 only mid-step, so
        # that a dynstate that cannot continue one refuses it; other states stay format 2.
        within = self._taken if self._owed else 0
        identity = None if self.select is None else self.select.identity()
        selection: dict[str, Any] = {} if identity is None else {"select": identity}
        fmt = SELECT_FORMAT if identity is not None else 2
        if within:
            fmt = WITHIN_FORMAT
            selection = {"select": identity, "within_step": within}
        pos = self._step_start if within else self.pos
        return {
            "format": fmt,
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
            **pos.state(self.mode),
            **selection,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (any rank's, any world size's); checked in full first: a
        bad state raises :class:`StateMismatchError` and leaves the sampler as it was."""
        batching, position, within = self._checked_state(state)
        self._batching = batching
        self.pos = position
        self._pinned_now = False
        self._owed = self._taken = 0
        self._step_start = position
        self._skip = within
        self._open = self.pos.version is not None and self._step_shape() is not None

    def _checked_state(self, state: dict[str, Any]) -> tuple[Batching, Position, int]:
        """What :meth:`load_state_dict` would adopt from ``state``, every check made and
        nothing changed: a caller that must refuse before it changes the store (a resume's
        rollback) checks here first."""
        url = self.dataset.store.display_url
        state = check_state(state, self.dataset.store_id, url)
        # lag and share shape the stream only in mix mode; epoch mode may change them freely
        keys = ["mode", "shuffle", "seed"]
        if self._batching.given:
            keys += ["drop_last", "batch_size"]
        elif state["batch_size"] is None and max(self.num_replicas, state["num_replicas"]) > 1:
            # uncounted steps keep this sampler's drop_last (adopt below), which decides over
            # several ranks whether an epoch's end is dropped or padded
            keys.append("drop_last")
        if self.mode == "mix":
            keys += ["fresh_share", "lag"]
        for key in keys:
            if state[key] != getattr(self, key):
                raise StateMismatchError(
                    f"sampler state for {url} was saved with {key}={state[key]!r} but this "
                    f"sampler has {key}={getattr(self, key)!r}; construct the sampler with "
                    "the same settings to resume exactly"
                )
        mine = None if self.select is None else self.select.identity()
        if state["select"] != mine:
            raise StateMismatchError(
                f"sampler state for {url} (version {state['version']}, step "
                f"{state['step']}) was saved with select={state['select']!r} but this "
                f"sampler has select={mine!r}; construct the sampler with the same selection "
                "policy and parameters to resume exactly"
            )
        batching = self._batching.adopt(state["batch_size"], state["drop_last"], url)
        store = self.dataset.store
        if state["version"] is not None:
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
        position = Position.from_state(state)
        uncounted = state["format"] == 1 or state["batch_size"] is None
        if uncounted and state["mode"] == "epoch" and state["version"] is not None:
            # Written while the sampler counted no steps: take them up after the newest round.
            last = store.steps.latest(store.latest())
            position = replace(position, step=0 if last is None else last + 1)
        within = state["within_step"]
        if within and state["num_replicas"] != self.num_replicas:
            raise StateMismatchError(
                f"sampler state for {url} was saved within a step by "
                f"num_replicas={state['num_replicas']}, after {within} of each rank's indices; "
                f"this sampler has num_replicas={self.num_replicas}, whose ranks share the step "
                "otherwise; resume with the same number of ranks"
            )
        return batching, position, within
