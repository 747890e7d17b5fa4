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

from ..errors import InvalidDataError, StateMismatchError
from ..records.consumption import CONSUMPTION_FORMAT, check_scores
from .dataset import VersionedDataset, decode_index, encode_index
from .sampler import VersionedSampler

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


def group_std(scores: Sequence[float]) -> float:
    """The population standard deviation of a group's scores (DAPO's spread), in a fixed
    summation order so that every process computes the same bits."""
    mean = math.fsum(scores) / len(scores)
    return math.sqrt(math.fsum((s - mean) ** 2 for s in scores) / len(scores))


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
        self.name = name
        self.params = dict(params or {})

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
    """What one step trains (``groups``: the carried groups first, then the accepted ones in
    draw order) and the consumption ``record`` to commit with the step's round."""

    step: int
    groups: tuple[Group, ...]
    record: dict[str, Any]

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
        """The trained groups' scores as outcome records (``row``, ``step``, ``score``, one per
        response), for ``store.append(outcomes=..., rows_version=batch.rows_version)``."""
        return [
            {"row": g.row, "step": self.step, "score": s} for g in self.groups for s in g.scores
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
    object builds over ``dataset`` and ``sampler``); a step trains ``train_groups`` groups;
    ``rule`` decides which groups are kept (default :class:`ZeroVariance`); at most
    ``max_gen_batches`` batches are drawn per step (None: no bound) — a step that runs out
    trains the groups it has; ``surplus`` is ``"carry"`` or ``"drop"``; ``max_carry`` bounds
    the groups carried (default: ``gen_batch_size + train_groups``, the most a step can
    carry when it starts with fewer than ``train_groups`` carried).

    Refused (``InvalidDataError`` naming the setting): a mix-mode sampler, several ranks,
    DataLoader workers — their draws are not yet a function of the step alone here.
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
        least = gen_batch_size + train_groups
        if max_carry is None:
            max_carry = least if surplus == "carry" else 0
        if isinstance(max_carry, bool) or not isinstance(max_carry, int) or max_carry < 0:
            raise InvalidDataError(f"max_carry must be an int >= 0, not {max_carry!r}")
        if surplus == "carry" and max_carry < gen_batch_size - 1:
            raise InvalidDataError(
                f"max_carry={max_carry} for {url} is below what one step can carry "
                f"(gen_batch_size - 1 = {gen_batch_size - 1} accepted groups beyond a full "
                "batch); raise max_carry or pass surplus='drop'"
            )
        if sampler.mode != "epoch":
            raise InvalidDataError(
                f"DynamicSampling over {url} supports mode='epoch' samplers, not "
                f"mode={sampler.mode!r}: mix mode counts one round per loader batch, and a "
                "filtering step draws a varying number of them"
            )
        if sampler.num_replicas != 1:
            raise InvalidDataError(
                f"DynamicSampling over {url} supports num_replicas=1, not "
                f"num_replicas={sampler.num_replicas}: ranks would filter apart and their "
                "shared sampler position would no longer be one state"
            )
        if num_workers != 0:
            raise InvalidDataError(
                f"DynamicSampling over {url} supports num_workers=0, not "
                f"num_workers={num_workers!r}: with prefetching workers the sampler would pin "
                "an epoch's version by timing, not by the step"
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
        self._loader = self._make_loader()
        self._it: Any = None
        self._carry: list[Group] = []
        self._rows_version: int | None = None
        self._next_step: int | None = None
        self._broken: str | None = None

    def _make_loader(self) -> Any:
        import torch
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(
            _Drawn(self.dataset),
            sampler=self.sampler,
            batch_size=self.gen_batch_size,
            drop_last=self.sampler.drop_last,
            collate_fn=_keep_list,
            num_workers=0,
            # Its own generator: without one, each epoch's iterator draws a base seed from
            # torch's global generator, which a trainer restores on resume and samples
            # completions from; a draw at another moment than in the uninterrupted run (a
            # resume starts a new iterator) would shift every later generation.
            generator=torch.Generator(),
        )
        return self.sampler.check_loader(loader)

    # -- settings and resume -----------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        """What a resume must match (plain types; stored in every record)."""
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
        """The groups the next step trains first."""
        return tuple(self._carry)

    def resume(self, step: int | None, *, first_step: int = 0) -> int:
        """Continue after the checkpoint of ``step`` (None: no checkpoint yet); returns the
        step to run next. Reads step ``step``'s record from the store, checks it against this
        object's settings (:class:`StateMismatchError` naming each that differs) and its
        carry against ``max_carry``, then rolls the store back to that step
        (:func:`dynstate.rollback`; rounds of a crashed run after it are abandoned) and
        restores the carry and the sampler's position. Nothing changes when it refuses."""
        from ..rewind import rollback

        if self._it is not None or self._next_step is not None:
            raise InvalidDataError("resume() is called once, on a fresh DynamicSampling")
        url = self.store.display_url
        if step is None:
            # No checkpoint: the rounds a crashed run committed before its first are dropped.
            rollback(self.store, step=first_step - 1)
            self._next_step = first_step
            return first_step
        if isinstance(step, bool) or not isinstance(step, int) or step < first_step:
            raise InvalidDataError(f"step must be an int >= {first_step} or None, not {step!r}")
        found = self.store.consumption.of_step(self.store.refresh(), step)
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
        if len(record["carry"]) > self.max_carry:
            raise InvalidDataError(
                f"step {step} of {url} carries {len(record['carry'])} groups, over "
                f"max_carry={self.max_carry}; nothing was changed"
            )
        rows_version = record["rows_version"]
        carry = [
            Group(encode_index(rows_version, row), None, tuple(scores))
            for row, scores in record["carry"]
        ]
        rollback(self.store, step=step)
        self.sampler.load_state_dict(record["sampler"])
        # Rows are immutable: read again, they are the items the crashed run drew.
        self._carry = [Group(g.index, self.dataset[g.index], g.scores) for g in carry]
        self._rows_version = rows_version
        self._next_step = step + 1
        return step + 1

    # -- the loop ------------------------------------------------------------------------------

    def _draw_batch(self) -> list[tuple[int, Any]]:
        """The next generation batch; an epoch's end starts the next epoch."""
        for _ in range(2):
            if self._it is None:
                self._it = iter(self._loader)
            try:
                batch: list[tuple[int, Any]] = next(self._it)
                return batch
            except StopIteration:
                self._it = None
        raise InvalidDataError(
            f"the sampler over {self.store.display_url} hands out no rows (an empty version?)"
        )

    def next_batch(self, step: int, score: Score) -> StepBatch:
        """Run step ``step``'s draws: ``score(items, step)`` gets the items of one generation
        batch and returns, per item, its group's scores (a list of numbers). Returns what the
        step trains and the record to commit with its round. After an error (a bad score,
        a rule that is not deterministic) this object refuses further steps: resume from the
        store in a new one."""
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
        batches = 0
        while len(accepted) < self.train_groups and (
            self.max_gen_batches is None or batches < self.max_gen_batches
        ):
            pairs = self._draw_batch()
            batches += 1
            items = [item for _, item in pairs]
            scored = score(items, step)
            if not hasattr(scored, "__len__") or len(scored) != len(pairs):
                got = len(scored) if hasattr(scored, "__len__") else type(scored).__name__
                raise InvalidDataError(
                    f"score returned {got} groups of scores for a generation batch of "
                    f"{len(pairs)} rows at step {step} ({url}); return one list per item"
                )
            for (index, item), raw in zip(pairs, scored, strict=True):
                scores = check_scores(raw, url, f"the scores of row {decode_index(index)[1]}")
                drawn.append(index)
                keep = self.rule.keep(scores)
                if keep != self.rule.keep(scores):
                    raise InvalidDataError(
                        f"rule {self.rule.name!r} answered differently for the same scores "
                        f"{scores} at step {step} ({url}); a filter rule must be a pure "
                        "function of a group's scores — nothing was committed"
                    )
                if keep:
                    accepted.append(Group(index, item, tuple(scores)))
                else:
                    filtered.append((index, group_std(scores)))
        trained, surplus = accepted[: self.train_groups], accepted[self.train_groups :]
        carry = surplus if self.surplus == "carry" else []
        dropped = [] if self.surplus == "carry" else surplus
        if len(carry) > self.max_carry:
            raise InvalidDataError(
                f"step {step} of {url} would carry {len(carry)} groups, over "
                f"max_carry={self.max_carry}; raise max_carry or pass surplus='drop'"
            )
        rows_version = self._newest([g.index for g in carried_in] + drawn)
        record = {
            "format": CONSUMPTION_FORMAT,
            "step": step,
            "rows_version": rows_version,
            "settings": self.settings(),
            "carried_in": [row(g.index) for g in carried_in],
            "drawn": [row(i) for i in drawn],
            "gen_batches": batches,
            "trained": [row(g.index) for g in trained],
            "filtered": [[row(i), spread] for i, spread in filtered],
            "dropped": [[row(g.index), "surplus"] for g in dropped],
            "carry": [[row(g.index), list(g.scores)] for g in carry],
            "sampler": self.sampler.state_dict(),
        }
        self._carry = carry
        self._rows_version = rows_version
        return StepBatch(step, tuple(trained), record)

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
