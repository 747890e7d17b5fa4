"""Dynamic sampling (DAPO's group filtering) for any PyTorch loop, with consumption as data
state (SPEC §3.15; docs/dynamic-sampling.md).

A step trains ``train_groups`` groups. It first takes the groups the previous step carried,
then draws generation batches of rows from a :class:`VersionedSampler` through a
StatefulDataLoader, has the caller score each row's group of responses, keeps the groups a
filter rule accepts, and draws again until the batch is full or ``max_gen_batches`` batches
were drawn. Accepted groups beyond the batch are carried to the next step (``surplus="carry"``,
the default) or dropped with the reason ``"surplus"`` (``surplus="drop"``).

What the step consumed — the rows drawn, the groups trained, filtered (with their spread)
and dropped, the carry with its scores, the sampler's position after the draws and the
settings — is the record :attr:`StepBatch.record`, which the caller commits with the step's
round (``store.append(..., meta={"step": N}, consumption=batch.record)``), so the round and
its consumption land in one version. A resume at step N reads step N's record from the store,
rolls the store back to it, and continues from its carry and position: the checkpoint needs
only N.

Why the rule is called twice per group: a rule that answers differently for the same scores
would make the steps after a resume differ from the uninterrupted run's; it is refused the
first time it happens, before anything is committed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import DynstateError, InvalidDataError, StateMismatchError
from ..records.consumption import CONSUMPTION_FORMAT, check_scores
from ..records.inputs import check_plain
from .dataset import VersionedDataset, decode_index, encode_index
from .sampler import VersionedSampler, _dist_world
from .state import find_sampler_state

if TYPE_CHECKING:
    from ..store import Store

__all__ = [
    "DynamicSampling",
    "FilterRule",
    "Group",
    "StdThreshold",
    "StepBatch",
    "ZeroVariance",
    "consumption_records",
]

SURPLUS_MODES = ("carry", "drop")
# The key of a record's sampler state (an extra key: VersionedSampler.load_state_dict takes
# only its own) that lists, per rank, how many groups of ``carry`` are that rank's, in rank
# order; absent with one rank. A resume at the same number of ranks gives each its own back.
CARRY_BY_RANK = "carry_by_rank"


def group_std(scores: Sequence[float]) -> float:
    """The population standard deviation of a group's scores (DAPO's spread), in a fixed
    summation order so that every process computes the same bits."""
    if min(scores) == max(scores):
        return 0.0  # exactly: the rounded mean of equal scores may differ from them
    mean = math.fsum(scores) / len(scores)
    # a product, not ** 2: past 1e154 it is inf (a spread), where ** raises OverflowError
    return math.sqrt(math.fsum((s - mean) * (s - mean) for s in scores) / len(scores))


class FilterRule:
    """A group filter: ``keep(scores) -> bool`` over one group's scores, with the ``name``
    and ``params`` (plain types) a resume compares. Wrap a user's pure function as
    ``FilterRule(fn, name="my_rule", params={...})``; it must answer the same for the same
    scores (checked: a rule that does not is refused)."""

    def __init__(
        self,
        fn: Callable[[list[float]], bool],
        *,
        name: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        if not callable(fn):
            raise InvalidDataError(f"rule must be callable, not {type(fn).__name__}")
        self.fn = fn
        if name is None:
            name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        if not isinstance(name, str) or not name:
            raise InvalidDataError(f"a FilterRule's name must be a non-empty str, not {name!r}")
        if params is not None and not isinstance(params, dict):
            raise InvalidDataError(f"a FilterRule's params must be a dict, not {params!r}")
        # plain types (tuples as lists): they go into every consumption record's settings
        self.name = check_plain(name, "a FilterRule's name", "name", depth=0)
        self.params = check_plain(
            params or {}, f"params of FilterRule {name!r}", "params", depth=16, tuples=True
        )

    def identity(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.params}

    def keep(self, scores: list[float]) -> bool:
        return bool(self.fn(list(scores)))

    def __repr__(self) -> str:
        return f"FilterRule({self.name!r}, params={self.params!r})"


class StdThreshold(FilterRule):
    """Keep a group whose scores' standard deviation is above ``min_std``."""

    def __init__(self, min_std: float) -> None:
        if isinstance(min_std, bool) or not isinstance(min_std, (int, float)):
            raise InvalidDataError(f"min_std must be a number >= 0, not {min_std!r}")
        if not (math.isfinite(min_std) and min_std >= 0):
            raise InvalidDataError(f"min_std must be a finite number >= 0, not {min_std!r}")
        self.min_std = float(min_std)
        super().__init__(self._keep, name="std_threshold", params={"min_std": self.min_std})

    def _keep(self, scores: list[float]) -> bool:
        return group_std(scores) > self.min_std


class ZeroVariance(StdThreshold):
    """DAPO's default: drop a group whose responses all scored the same (no GRPO signal)."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.name, self.params = "zero_variance", {}


def as_rule(rule: Any) -> FilterRule:
    """``rule`` as a :class:`FilterRule`: one already, ``"zero_variance"``, or a function."""
    if isinstance(rule, FilterRule):
        return rule
    if rule is None or rule == "zero_variance":
        return ZeroVariance()
    if callable(rule):
        return FilterRule(rule)
    raise InvalidDataError(
        f"rule must be 'zero_variance', a FilterRule (StdThreshold(x), FilterRule(fn, "
        f"name=...)) or a function of a group's scores, not {rule!r}"
    )


@dataclass(frozen=True)
class Group:
    """One drawn row and its group of responses' scores. ``index`` is the version-tagged
    index the sampler drew (:func:`dynstate.decode_index`); ``row`` its row number."""

    index: int
    item: Any
    scores: tuple[float, ...]

    @property
    def row(self) -> int:
        return decode_index(self.index)[1]


@dataclass(frozen=True)
class StepBatch:
    """What one step trains on this rank (``groups``: the carried groups first, then the
    accepted ones in draw order) and the consumption ``record`` to commit with the step's
    round — with several ranks, the record of every rank's consumption, the same on each:
    one process (rank 0) commits it. ``everyone``: every rank's trained groups (items of
    other ranks None); None with one rank. ``scored``: every group scored at this step —
    trained, filtered, carried to the next step or dropped — every rank's, rank by rank in
    scoring order (items of other ranks None), for :meth:`outcomes`."""

    step: int
    groups: tuple[Group, ...]
    record: dict[str, Any]
    everyone: tuple[Group, ...] | None = None
    scored: tuple[Group, ...] = ()

    @property
    def full(self) -> bool:
        """Whether the step got its ``train_groups`` (False: ``max_gen_batches`` ran out)."""
        return len(self.groups) == self.record["settings"]["train_groups"]

    @property
    def rows_version(self) -> int | None:
        """The version the record's and the outcomes' row numbers are rows of."""
        value: int | None = self.record["rows_version"]
        return value

    def outcomes(self) -> list[dict[str, Any]]:
        """The scores of every group scored at this step as outcome records (``row``,
        ``step``, ``score``, one per response), for ``store.append(outcomes=...,
        rows_version=batch.rows_version)``: the groups trained, filtered, carried and dropped,
        each once, at the step that scored it (a carried group's scores are in the round of
        the step that scored it, not again in the next step's). So a row filtered every time
        (always solved, or never) counts as tried for selection. With several ranks, every
        rank's groups: the step's one round holds them all."""
        return [
            {"row": g.row, "step": self.step, "score": s} for g in self.scored for s in g.scores
        ]


class _Drawn:
    """The loader's dataset: each item with the index it was drawn at, so the loop knows
    which rows a generation batch holds whatever the collation."""

    def __init__(self, dataset: VersionedDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return int(index), self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[int, Any]]:
        items = self.dataset.__getitems__(indices)
        return [(int(i), item) for i, item in zip(indices, items, strict=True)]


def _keep_list(batch: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    return batch


Score = Callable[[list[Any], int], Sequence[Sequence[float]]]


class DynamicSampling:
    """DAPO's draw / score / filter / refill / carry loop over a :class:`VersionedSampler`.

    ``gen_batch_size`` rows are drawn per generation batch (through a StatefulDataLoader this
    object builds over ``dataset`` and ``sampler``, with ``num_workers`` workers); a step
    trains ``train_groups`` groups; ``rule`` decides which groups are kept (default
    :class:`ZeroVariance`); at most ``max_gen_batches`` sampler steps are drawn per step
    (None: no bound) — a step that runs out trains the groups it has; ``surplus`` is
    ``"carry"`` or ``"drop"``; ``max_carry`` bounds the groups a rank carries (default:
    ``gen_batch_size + train_groups``; with ``num_replicas`` ranks a step can carry up to
    ``num_replicas * gen_batch_size - 1``, so ``max_carry`` must be at least that).

    Ranks (a sampler with ``num_replicas > 1``, in an initialized ``torch.distributed``
    process group of that size): every rank trains ``train_groups`` groups of its own. The
    ranks draw in lockstep — one sampler step, ``gen_batch_size`` rows per rank, while any
    rank still needs groups — so the sampler's position stays one state, and each sampler
    step's rows are dealt to the ranks that need groups (rank ``j``'s share to the ``j mod
    k``-th of the ``k`` needing ranks; all needing: each its own share), so no drawn row goes
    unscored and no rank's carry grows without bound. Each rank scores only the rows dealt to
    it; the step's record holds every rank's consumption (the same on every rank, committed
    once, by rank 0) with each rank's share of the carry. A resume at the same number of
    ranks gives each rank its own carry back; at another number it deals the carry out
    again, so that every carried group is trained once (elastic resume).

    Workers: the record's sampler position is the loader's snapshot of the batches handed
    out (not the sampler's, which prefetching runs ahead), and an epoch starts only when the
    loop asks for its first batch (the sampler's epoch ends its iterator, so prefetch never
    crosses an epoch): the version an epoch pins depends on the step, not timing.

    Steps: the sampler counts generation batches (sampler steps), the rounds count training
    steps, and a training step draws a varying number of batches. Where the sampler asks for
    the round of sampler step ``x`` (the version a new epoch pins: ``x`` = the step before
    it; mix mode's fresh rows: ``x = s - lag``), it gets the round of the last training step
    whose draws ended at or before ``x``, read from the records: a rule on the history, never
    on timing. In mix mode ``lag`` therefore counts generation batches, and must exceed the
    loader's prefetch depth as without filtering.

    Refused (``InvalidDataError`` naming the setting): several ranks without a
    ``torch.distributed`` process group of ``num_replicas`` processes.
    """

    def __init__(
        self,
        dataset: VersionedDataset,
        sampler: VersionedSampler,
        *,
        gen_batch_size: int,
        train_groups: int,
        rule: Any = "zero_variance",
        max_gen_batches: int | None = 10,
        surplus: str = "carry",
        max_carry: int | None = None,
        num_workers: int = 0,
    ) -> None:
        if not isinstance(dataset, VersionedDataset) or sampler.dataset is not dataset:
            raise InvalidDataError(
                "DynamicSampling takes a VersionedDataset and the VersionedSampler built on it"
            )
        url = dataset.store.display_url
        for name, value in (("gen_batch_size", gen_batch_size), ("train_groups", train_groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidDataError(f"{name} must be a positive int, not {value!r} ({url})")
        if max_gen_batches is not None and (
            isinstance(max_gen_batches, bool)
            or not isinstance(max_gen_batches, int)
            or max_gen_batches < 1
        ):
            raise InvalidDataError(
                f"max_gen_batches must be a positive int or None, not {max_gen_batches!r}"
            )
        if surplus not in SURPLUS_MODES:
            raise InvalidDataError(f"surplus must be one of {SURPLUS_MODES}, not {surplus!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise InvalidDataError(f"num_workers must be an int >= 0, not {num_workers!r} ({url})")
        replicas = sampler.num_replicas
        least = gen_batch_size + train_groups
        if max_carry is None:
            max_carry = least if surplus == "carry" else 0
        if isinstance(max_carry, bool) or not isinstance(max_carry, int) or max_carry < 0:
            raise InvalidDataError(f"max_carry must be an int >= 0, not {max_carry!r}")
        most = replicas * gen_batch_size - 1
        if surplus == "carry" and max_carry < most:
            ranks = "" if replicas == 1 else f" with num_replicas={replicas}"
            raise InvalidDataError(
                f"max_carry={max_carry} for {url} is below what one step can carry{ranks} "
                f"(num_replicas * gen_batch_size - 1 = {most} accepted groups beyond a full "
                "batch); raise max_carry or pass surplus='drop'"
            )
        if replicas != 1:
            world = _dist_world()
            if world is None or world != (replicas, sampler.rank):
                raise InvalidDataError(
                    f"DynamicSampling over {url} with num_replicas={replicas} (rank "
                    f"{sampler.rank}) deals each sampler step's rows to the ranks that need "
                    "groups, through torch.distributed; initialize the process group "
                    f"(world_size={replicas}, this process's rank {sampler.rank}) first — found "
                    f"{'none' if world is None else f'world_size={world[0]}, rank={world[1]}'}"
                )
        if sampler.batch_size is not None and sampler.batch_size != gen_batch_size:
            raise InvalidDataError(
                f"the sampler for {url} counts steps of batch_size={sampler.batch_size}, but "
                f"gen_batch_size={gen_batch_size}; pass the same to both"
            )
        self.dataset = dataset
        self.sampler = sampler
        self.store = dataset.store
        self.gen_batch_size = gen_batch_size
        self.train_groups = train_groups
        self.rule = as_rule(rule)
        self.max_gen_batches = max_gen_batches
        self.surplus = surplus
        self.max_carry = max_carry
        self.num_workers = num_workers
        self.num_replicas = replicas
        self.rank = sampler.rank
        self._loader = self._make_loader()
        self._it: Any = None
        self._carry: list[Group] = []
        self._rows_version: int | None = None
        self._next_step: int | None = None
        self._broken: str | None = None
        self._position: dict[str, Any] | None = None  # with workers: after the last batch
        # The sampler steps are generation batches, the rounds' steps training steps: the
        # sampler asks which training step rules a sampler step (its epoch pin, mix mode's
        # fresh rows) through this clock. _ends: training step -> the sampler step its draws
        # ended at (the record's position); _handed: the sampler step of the next batch the
        # loader hands out.
        self._ends: dict[int, int] = {}
        self._handed = sampler.step
        sampler.round_clock = self._round_before

    def _make_loader(self) -> Any:
        import torch
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(
            _Drawn(self.dataset),
            sampler=self.sampler,
            batch_size=self.gen_batch_size,
            drop_last=self.sampler.drop_last,
            collate_fn=_keep_list,
            num_workers=self.num_workers,
            # Its own generator: without one, each epoch's iterator draws a base seed from
            # torch's global generator, which a trainer restores on resume and samples
            # completions from; a draw at another moment than in the uninterrupted run (a
            # resume starts a new iterator) would shift every later generation.
            generator=torch.Generator(),
        )
        return self.sampler.check_loader(loader)

    # -- ranks ---------------------------------------------------------------------------------

    def _gather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order (one rank: just ``value``)."""
        if self.num_replicas == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.num_replicas
        dist.all_gather_object(out, value)
        return out

    # -- settings and resume -----------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        """What a resume must match (plain types; stored in every record). The number of
        ranks and of workers is not among them: a resume may change both."""
        return {
            "gen_batch_size": self.gen_batch_size,
            "train_groups": self.train_groups,
            "rule": self.rule.identity(),
            "max_gen_batches": self.max_gen_batches,
            "surplus": self.surplus,
            "max_carry": self.max_carry,
        }

    @property
    def carry(self) -> tuple[Group, ...]:
        """The groups the next step trains first (this rank's)."""
        return tuple(self._carry)

    def rank_carry(self, record: dict[str, Any]) -> list[list[Any]]:
        """This rank's share of a record's carry: its own at the same number of ranks (by the
        record's per-rank counts), else every ``num_replicas``-th group from its rank on."""
        carry: list[list[Any]] = record["carry"]
        counts = record["sampler"].get(CARRY_BY_RANK)
        if not isinstance(counts, list) or sum(counts) != len(carry):
            counts = [len(carry)]  # one rank's record (or an older one)
        if len(counts) == self.num_replicas:
            start = sum(counts[: self.rank])
            return carry[start : start + counts[self.rank]]
        return carry[self.rank :: self.num_replicas]

    def resume(self, step: int | None, *, first_step: int = 0) -> int:
        """Continue after the checkpoint of ``step`` (None: no checkpoint yet); returns the
        step to run next. Reads step ``step``'s record from the store, checks it against this
        object's settings (:class:`StateMismatchError` naming each that differs) and this
        rank's share of its carry against ``max_carry``, then rolls the store back to that
        step (:func:`dynstate.rollback`, on rank 0 only; rounds of a crashed run after it are
        abandoned) and restores the carry and the sampler's position. Nothing changes when it
        refuses; with several ranks every rank refuses when one does. The number of ranks may
        differ from the checkpoint's (its carry is dealt out again)."""
        if self._it is not None or self._next_step is not None:
            raise InvalidDataError("resume() is called once, on a fresh DynamicSampling")
        url = self.store.display_url
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise InvalidDataError(f"step must be an int >= {first_step} or None, not {step!r}")
        if step is not None and step < first_step:
            raise InvalidDataError(f"step must be an int >= {first_step} or None, not {step!r}")
        problem: DynstateError | None = None
        record: dict[str, Any] | None = None
        if step is not None:
            try:
                record = self._checked_record(step, url)
            except DynstateError as exc:
                problem = exc
        # Every rank checks before any rolls back: one that refuses stops them all unchanged.
        problems = self._gather(None if problem is None else (type(problem).__name__, str(problem)))
        if problem is not None:
            raise problem
        for rank, said in enumerate(problems):
            if said is not None:
                raise StateMismatchError(f"rank {rank} refused to resume {url}: {said[1]}")
        if step is None:
            # No checkpoint: the rounds a crashed run committed before its first are dropped,
            # and the sampler starts afresh (one reused in this process after a failed step
            # has handed out rows that no record holds: drawn again, not skipped).
            self._rollback(first_step - 1)
            self.sampler._restart()
            self._next_step = first_step
            self._handed = self.sampler.step
            return first_step
        assert record is not None
        rows_version = record["rows_version"]
        carry = [
            Group(encode_index(rows_version, row), None, tuple(scores))
            for row, scores in self.rank_carry(record)
        ]
        self._rollback(step)
        position = _position(record)
        self.sampler.load_state_dict(position)
        self._position = position
        # Rows are immutable: read again, they are the items the crashed run drew.
        self._carry = [Group(g.index, self.dataset[g.index], g.scores) for g in carry]
        self._rows_version = rows_version
        self._next_step = step + 1
        self._handed = self._ends[step] = int(position["step"])
        return step + 1

    def _checked_record(self, step: int, url: str) -> dict[str, Any]:
        found = self.store.consumption.of_step(self.store.latest(), step)
        if found is None:
            raise StateMismatchError(
                f"{url} holds no consumption record for step {step} on its head's lineage; "
                "resume from the step of a checkpoint whose round committed "
                "consumption=batch.record"
            )
        _, record = found
        theirs, ours = record["settings"], self.settings()
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        if differ:
            said = ", ".join(f"{k}: {theirs.get(k)!r} -> {ours.get(k)!r}" for k in differ)
            raise StateMismatchError(
                f"the filter settings differ from those step {step} of {url} was run with "
                f"({said}); resume with the checkpoint's settings — nothing was changed"
            )
        if len(record["carry"]) > self.max_carry and self.num_replicas == 1:
            raise InvalidDataError(
                f"step {step} of {url} carries {len(record['carry'])} groups, over "
                f"max_carry={self.max_carry}; nothing was changed"
            )
        mine = self.rank_carry(record)
        if len(mine) > self.max_carry:
            raise InvalidDataError(
                f"step {step} of {url} carries {len(record['carry'])} groups, and rank "
                f"{self.rank} of num_replicas={self.num_replicas} would take {len(mine)}, over "
                f"max_carry={self.max_carry}; resume with more ranks or a larger max_carry — "
                "nothing was changed"
            )
        # The sampler's checks too (its seed, shuffle, a collected version...): refused after
        # the rollback, they would leave the store rolled back to a checkpoint not resumed.
        self.sampler._checked_state(_position(record))
        return record

    def _rollback(self, step: int) -> None:
        """Rank 0 rolls the store back to ``step``; the others wait for it."""
        from ..rewind import rollback

        if self.rank == 0:
            rollback(self.store, step=step)
        self._gather(None)

    # -- the loop ------------------------------------------------------------------------------

    def _draw_batch(self) -> list[tuple[int, Any]]:
        """The next generation batch (this rank's share of a sampler step); an epoch's end
        starts the next epoch."""
        for _ in range(2):
            if self._it is None:
                self._it = iter(self._loader)
            try:
                batch: list[tuple[int, Any]] = next(self._it)
            except StopIteration:
                self._it = None
                continue
            self._handed += 1
            if self.num_workers:
                # The loader's snapshot pairs the sampler's state with the batch just handed
                # out; the sampler itself is as far as the workers' prefetch.
                self._position = find_sampler_state(self._loader.state_dict())
            return batch
        raise InvalidDataError(
            f"the sampler over {self.store.display_url} hands out no rows (an empty version?)"
        )

    def _round_before(self, step: int) -> int:
        """The sampler's round clock: the last training step whose draws ended at or before
        sampler step ``step`` (``sampler.first_step - 1``: none yet). Only ended steps can
        answer, so ``step`` must lie before the batch the loader hands out now — which mix
        mode's ``lag`` above the prefetch depth guarantees (``check_loader`` checks it)."""
        url = self.store.display_url
        if self._next_step is None:
            raise InvalidDataError(f"call resume(step or None) before drawing from {url}")
        if step >= self._handed:
            raise InvalidDataError(
                f"the sampler over {url} asked for the round of generation batch {step} while "
                f"batch {self._handed} is being handed out; in mix mode lag counts generation "
                "batches and must exceed the loader's prefetch depth (num_workers * "
                "prefetch_factor + 1)"
            )
        none = self.sampler.first_step - 1
        t = self._next_step - 1  # the step under way has not ended
        while t > none:
            end = self._end_of(t)
            if end is None:
                return none  # no record: a step before this run's first
            if end <= step + 1:
                return t
            t -= 1
        return none

    def _end_of(self, step: int) -> int | None:
        """The sampler step after ``step``'s draws: this object's record, else the store's
        (None: the head's lineage holds no record of ``step``)."""
        if step not in self._ends:
            found = self.store.consumption.of_step(self.store.latest(), step)
            if found is None:
                return None
            self._ends[step] = int(found[1]["sampler"]["step"])
        return self._ends[step]

    def _deal(self, pairs: list[tuple[int, Any]], needing: list[int]) -> list[list[Any]]:
        """The generation batches this rank scores of one sampler step: the share of rank
        ``j`` goes to ``needing[j % len(needing)]``; every rank learns every share's indices
        and reads the items of the shares dealt to it that are not its own."""
        if self.num_replicas == 1:
            return [pairs]
        shares = self._gather([index for index, _ in pairs])
        out: list[list[Any]] = []
        for j, indices in enumerate(shares):
            if needing[j % len(needing)] != self.rank or not indices:
                continue
            if j == self.rank:
                out.append(pairs)
            else:
                items = self.dataset.__getitems__(indices)
                out.append(list(zip(indices, items, strict=True)))
        return out

    def next_batch(self, step: int, score: Score) -> StepBatch:
        """Run step ``step``'s draws: ``score(items, step)`` gets the items of one generation
        batch and returns, per item, its group's scores (a list of numbers). Returns what the
        step trains and the record to commit with its round. After an error (a bad score,
        a rule that is not deterministic) this object refuses further steps: resume from the
        store in a new one. With several ranks every rank calls it for every step."""
        url = self.store.display_url
        if self._broken is not None:
            raise InvalidDataError(
                f"this DynamicSampling over {url} stopped at {self._broken}; build a new one "
                "and resume() from the last committed step"
            )
        if self._next_step is None:
            raise InvalidDataError("call resume(step or None) before the first next_batch")
        if step != self._next_step:
            raise InvalidDataError(f"next step is {self._next_step}, not {step!r} ({url})")
        try:
            out = self._step(step, score)
        except BaseException:
            self._broken = f"step {step}"
            raise
        self._next_step = step + 1
        return out

    def _step(self, step: int, score: Score) -> StepBatch:
        url = self.store.display_url
        carried_in = list(self._carry)
        accepted = list(carried_in)
        drawn: list[int] = []
        filtered: list[tuple[int, float]] = []
        scored: list[Group] = []
        batches = 0
        while self.max_gen_batches is None or batches < self.max_gen_batches:
            # The same answer on every rank, so they draw in lockstep.
            needs = self._gather(len(accepted) < self.train_groups)
            needing = [rank for rank, need in enumerate(needs) if need]
            if not needing:
                break
            dealt = self._deal(self._draw_batch(), needing)
            batches += 1
            for pairs in dealt:
                self._score(pairs, score, step, url, drawn, accepted, filtered, scored)
        trained, surplus = accepted[: self.train_groups], accepted[self.train_groups :]
        carry = surplus if self.surplus == "carry" else []
        dropped = [] if self.surplus == "carry" else surplus
        parts = self._gather(
            (
                [g.index for g in carried_in],
                drawn,
                [(g.index, g.scores) for g in trained],
                filtered,
                [g.index for g in dropped],
                [(g.index, g.scores) for g in carry],
                [(g.index, g.scores) for g in scored],
            )
        )
        for rank, part in enumerate(parts):
            if len(part[5]) > self.max_carry:
                who = "" if self.num_replicas == 1 else f" (rank {rank})"
                raise InvalidDataError(
                    f"step {step} of {url}{who} would carry {len(part[5])} groups, over "
                    f"max_carry={self.max_carry}; raise max_carry or pass surplus='drop'"
                )
        everyone = [index for part in parts for index in self._indices_of(part)]
        rows_version = self._newest(everyone)
        position = self.sampler.state_dict() if self.num_workers == 0 else self._position
        if position is None:  # a worker loader that has handed out nothing yet
            position = self.sampler.state_dict()
        if self.num_replicas > 1:
            position = {**position, CARRY_BY_RANK: [len(part[5]) for part in parts]}
        record = {
            "format": CONSUMPTION_FORMAT,
            "step": step,
            "rows_version": rows_version,
            "settings": self.settings(),
            "carried_in": [row(i) for part in parts for i in part[0]],
            "drawn": [row(i) for part in parts for i in part[1]],
            "gen_batches": batches,
            "trained": [row(i) for part in parts for i, _ in part[2]],
            "filtered": [[row(i), spread] for part in parts for i, spread in part[3]],
            "dropped": [[row(i), "surplus"] for part in parts for i in part[4]],
            "carry": [[row(i), list(s)] for part in parts for i, s in part[5]],
            "sampler": position,
        }
        self._carry = carry
        self._rows_version = rows_version
        self._ends[step] = int(position["step"])
        all_trained = None
        all_scored = scored
        if self.num_replicas > 1:
            groups: list[Group] = []
            all_scored = []
            for rank, part in enumerate(parts):
                if rank == self.rank:
                    groups.extend(trained)
                    all_scored.extend(scored)
                else:
                    groups.extend(Group(i, None, tuple(s)) for i, s in part[2])
                    all_scored.extend(Group(i, None, tuple(s)) for i, s in part[6])
            all_trained = tuple(groups)
        return StepBatch(step, tuple(trained), record, all_trained, tuple(all_scored))

    @staticmethod
    def _indices_of(part: tuple[Any, ...]) -> list[int]:
        carried_in, drawn, trained, filtered, dropped, carry, _ = part  # scored: drawn ones
        return [*carried_in, *drawn, *(i for i, _ in trained), *(i for i, _ in filtered),
                *dropped, *(i for i, _ in carry)]  # fmt: skip

    def _score(
        self,
        pairs: list[tuple[int, Any]],
        score: Score,
        step: int,
        url: str,
        drawn: list[int],
        accepted: list[Group],
        filtered: list[tuple[int, float]],
        scored: list[Group],
    ) -> None:
        """Score one generation batch and sort its groups into accepted and filtered (each
        goes into ``scored`` too)."""
        items = [item for _, item in pairs]
        answer = score(items, step)
        if not hasattr(answer, "__len__") or len(answer) != len(pairs):
            got = len(answer) if hasattr(answer, "__len__") else type(answer).__name__
            raise InvalidDataError(
                f"score returned {got} groups of scores for a generation batch of "
                f"{len(pairs)} rows at step {step} ({url}); return one list per item"
            )
        for (index, item), raw in zip(pairs, answer, strict=True):
            scores = check_scores(raw, url, f"the scores of row {decode_index(index)[1]}")
            drawn.append(index)
            keep = self.rule.keep(scores)
            if keep != self.rule.keep(scores):
                raise InvalidDataError(
                    f"rule {self.rule.name!r} answered differently for the same scores "
                    f"{scores} at step {step} ({url}); a filter rule must be a pure "
                    "function of a group's scores — nothing was committed"
                )
            group = Group(index, item, tuple(scores))
            scored.append(group)
            if keep:
                accepted.append(group)
            else:
                filtered.append((index, group_std(scores)))

    def _newest(self, indices: list[int]) -> int | None:
        """The version a step's row numbers are stored at: the newest its rows came from.
        Every epoch pins a version of the lineage newer than the last, so row ``r`` of an
        older one is row ``r`` of it (SPEC §3.4)."""
        versions = {decode_index(i)[0] for i in indices}
        if None in versions:
            raise InvalidDataError(
                f"the sampler over {self.store.display_url} handed out an index without a "
                "version; DynamicSampling needs a VersionedSampler's tagged indices"
            )
        known = [v for v in versions if v is not None]
        if self._rows_version is not None:
            known.append(self._rows_version)
        return max(known) if known else None


def row(index: int) -> int:
    """The row number of a version-tagged index."""
    return decode_index(index)[1]


def consumption_records(store: Store, version: int | str | None = None) -> list[dict[str, Any]]:
    """Every consumption record of ``version``'s lineage (a number, a tag or None: the head),
    oldest step first, each with ``"version"``: the version of its round. O(lineage): for
    audits and views; a resume reads only the record of its step."""
    head = store.resolve(version)
    return [{**record, "version": v} for v, record in store.consumption.lineage(head)]


def _position(record: dict[str, Any]) -> dict[str, Any]:
    """The sampler state a consumption record holds (its carry by rank left out)."""
    return {k: v for k, v in record["sampler"].items() if k != CARRY_BY_RANK}
